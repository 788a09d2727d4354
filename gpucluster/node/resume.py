#!/usr/bin/env python3
"""Slurm's ResumeProgram on the head node (settings.RESUME_PROGRAM): `resume.py HOSTLIST` (such as p5-spot-[1-4]).

Launches one EC2 instance per node with CreateFleet (type instant) from the pool's launch template, grouped by job
(SLURM_RESUME_FILE, Slurm 23.02 and later): a multi-node job gets all its nodes in one request or none, and one job's
shortage does not fail another's nodes. The registry records which instance is which node the moment EC2 answers;
Slurm gets each node's instance id, and the instance learns its node name from Slurm by that id (no per-instance API
call, no DescribeInstances). Nodes that EC2 cannot launch are set DOWN with the AWS reason, so Slurm requeues the job
and schedules it where it can run (a fallback pool); the reconciler returns them to service later.

Standard library and boto3. Every action is logged to the node log and to stderr (the journal).
"""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the library this program is part of (the bundle's lib/)
from gpucluster.contract import reasons
from gpucluster.contract.hostlist import compress_hostlist, expand_hostlist
from gpucluster.contract.settings import SETTINGS_FILE, ClusterSettings
from gpucluster.node import log, program
from gpucluster.node.fleet import LaunchResult, ec2_client, launch_group, launch_groups, live_instances, terminate
from gpucluster.node.registry import forget, read_registry, record
from gpucluster.node.slurm_control import SlurmControl


def job_nodes(config: ClusterSettings, nodes: list[str], resume_file: str | None) -> dict[str, list[str]]:
    """Job id -> its nodes being resumed, from SLURM_RESUME_FILE (Slurm 23.02 and later). Without the file (a call by
    hand) the call's nodes count as one job when all-or-nothing holds, since no one can tell them apart."""
    if resume_file and Path(resume_file).exists():
        doc = json.loads(Path(resume_file).read_text())
        # Slurm writes null for a field without a value; a manual power_up has no job at all.
        return {str(job["job_id"]): expand_hostlist(job.get("nodes_resume") or "") for job in doc.get("jobs") or []}
    return {"(this call)": nodes} if config.all_or_nothing else {}


def resume(config: ClusterSettings, ec2: Any, slurm: SlurmControl, hostlist: str,
           resume_file: str | None = None) -> LaunchResult:
    nodes = expand_hostlist(hostlist)
    total = LaunchResult()
    # A node whose instance still lives (a resume Slurm repeats, an always-on node powered up again) keeps it.
    entries = read_registry(config).instances
    live = live_instances(ec2, [entries[n]["instance"] for n in nodes if n in entries])
    kept = {n: entries[n]["instance"] for n in nodes if n in entries and entries[n]["instance"] in live}
    if kept:
        log.info("resume %s: their instances still run, not launching others", compress_hostlist(kept))
        total.launched.update(kept)
    jobs = job_nodes(config, nodes, resume_file)
    for group in launch_groups(config, [n for n in nodes if n not in kept], jobs):
        pool = config.pools.get(group.pool)
        if pool is None:
            reason = f"{reasons.CONFIGURATION}: no pool {group.pool} in {SETTINGS_FILE}"
            log.error(reason)
            total.failed.update({n: reason for n in group.nodes})
            continue
        log.info("resume %s: %d node(s) of pool %s (%s)%s", compress_hostlist(group.nodes), len(group.nodes),
                 pool.name, pool.market, f", job {group.job}, all or nothing" if group.whole else "")
        result = launch_group(config, ec2, pool, group)
        record(config, result.launched)  # before anything else can go wrong: a launched instance is never unowned
        total.launched.update(result.launched)
        total.failed.update(result.failed)
    # A job gets all its nodes or none, across pools too (a partition with a fallback pool).
    for job, members in jobs.items():
        failed = [n for n in members if n in total.failed]
        doomed = ([n for n in members if n in total.launched and n not in kept]
                  if failed and config.all_or_nothing else [])
        if doomed:
            log.warning("job %s: %s failed, terminating its other node(s) %s", job, compress_hostlist(failed),
                        compress_hostlist(doomed))
            terminate(ec2, [total.launched.pop(n) for n in doomed])
            forget(config, doomed)
            total.failed.update({n: total.failed[failed[0]] for n in doomed})
    if total.launched:
        slurm.set_instances(total.launched)
        for name, instance in sorted(total.launched.items()):
            log.info("node %s is %s", name, instance)
    by_reason: dict[str, list[str]] = defaultdict(list)
    for node, reason in total.failed.items():
        by_reason[reason].append(node)
    for reason, down in by_reason.items():
        slurm.set_down(down, reason)
    return total


def resume_or_set_down(config: ClusterSettings, slurm: SlurmControl, hostlist: str) -> None:
    """The program's work: on any failure the nodes go DOWN, so that Slurm requeues their jobs at once."""
    try:
        resume(config, ec2_client(config), slurm, hostlist, os.environ.get("SLURM_RESUME_FILE"))
    except Exception:
        try:
            # Passing: the reconciler returns them to service with backoff (and terminates what was launched).
            slurm.set_down(expand_hostlist(hostlist), f"{reasons.LAUNCH_FAILED}: resume program error, see log")
        except Exception:  # scontrol itself may be what failed; the exit status still tells Slurm
            log.exception("could not set %s DOWN after the failure", hostlist)
        raise


def main(argv: list[str]) -> int:
    return program.run(argv, resume_or_set_down, ("HOSTLIST",))


if __name__ == "__main__":
    sys.exit(main(sys.argv))
