#!/usr/bin/env python3
"""Slurm's ResumeFailProgram on the head node (settings.RESUME_FAIL_PROGRAM): `resume_fail.py HOSTLIST`, the nodes
Slurm gave up on at ResumeTimeout. A launched node that never registered: its instance is terminated and the node set
DOWN with the reason; the reconciler returns it to service with backoff. Standard library and boto3."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the library this program is part of (the bundle's lib/)
from gpucluster.contract import reasons
from gpucluster.contract.hostlist import compress_hostlist, expand_hostlist
from gpucluster.contract.settings import ClusterSettings
from gpucluster.node import log, program
from gpucluster.node.fleet import ec2_client, terminate
from gpucluster.node.registry import registry
from gpucluster.node.slurm_control import SlurmControl


def resume_fail(config: ClusterSettings, ec2: Any, slurm: SlurmControl, hostlist: str) -> list[str]:
    """Only the nodes the resume program launched are set DOWN with this reason: the others were set DOWN by it
    already, with EC2's reason (a configuration error's fix must stay visible). So are launched nodes whose first boot
    found a configuration fault (they set themselves DOWN, and never registered): retried, they would meet it again."""
    nodes = expand_hostlist(hostlist)
    with registry(config) as state:
        launched = {n: state.instances.pop(n)["instance"] for n in nodes if n in state.instances}
    log.error("resume failed for %s (never registered): terminating %s", compress_hostlist(nodes),
              ",".join(launched.values()) or "nothing")
    terminate(ec2, list(launched.values()))
    records = slurm.nodes() if launched else []
    faulty = {n.name for n in records if reasons.CONFIGURATION in n.reason}
    slurm.set_down(sorted(set(launched) - faulty),
                   f"{reasons.LAUNCH_FAILED}: node did not register before ResumeTimeout")
    return list(launched.values())


def main(argv: list[str]) -> int:
    return program.run(argv, lambda config, slurm, hostlist: resume_fail(config, ec2_client(config), slurm, hostlist),
                       ("HOSTLIST",))


if __name__ == "__main__":
    sys.exit(main(sys.argv))
