#!/usr/bin/env python3
"""Slurm's SuspendProgram on the head node (settings.SUSPEND_PROGRAM): `suspend.py HOSTLIST`. Terminates the
instances of the listed nodes and forgets them. Standard library and boto3."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the library this program is part of (the bundle's lib/)
from gpucluster.contract.hostlist import compress_hostlist, expand_hostlist
from gpucluster.contract.settings import ClusterSettings
from gpucluster.node import log, program
from gpucluster.node.fleet import ec2_client, terminate
from gpucluster.node.registry import forget


def suspend(config: ClusterSettings, ec2: Any, hostlist: str) -> list[str]:
    nodes = expand_hostlist(hostlist)
    ids = forget(config, nodes)
    log.info("suspend %s: terminating %s", compress_hostlist(nodes), ",".join(ids) or "nothing")
    terminate(ec2, ids)
    return ids


def main(argv: list[str]) -> int:
    return program.run(argv, lambda config, slurm, hostlist: suspend(config, ec2_client(config), hostlist),
                       ("HOSTLIST",))


if __name__ == "__main__":
    sys.exit(main(sys.argv))
