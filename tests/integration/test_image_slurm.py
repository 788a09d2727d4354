"""The node image's Slurm release in the boot rehearsal (tests/rehearsal_image.py): the daemons report it, MPI jobs
launch through its PMIx plugin, and its slurmctld hands the resume program the jobs it resumes nodes for."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

import pytest

from conftest import FIXTURES
from gpucluster.contract.settings import NODE_LOG
from gpucluster.spec.bom import SLURM_VERSION
from gpucluster.spec.model import Stack, load_stack
from local_cluster import LocalCluster

pytestmark = pytest.mark.rehearsal

# Every rank adds its rank number over MPI: with the image's python3-mpi4py on the image's Open MPI, wired by PMIx.
ALLREDUCE = ("from mpi4py import MPI; import socket; c = MPI.COMM_WORLD; "
             "print(f'rank {c.rank} of {c.size} on {socket.gethostname()} sum {c.allreduce(c.rank)}', flush=True)")


def test_mpi_job_runs_through_pmix_on_nodes_scaled_from_zero_of_the_image_release(cluster: LocalCluster) -> None:
    assert not cluster.instances()
    job = cluster.run("sbatch", "--parsable", "-p", "standby", "-N", "2", "-o", str(cluster.root / "mpi-%j.out"),
                      "--wrap", f"srun --mpi=pmix -N 2 --ntasks-per-node=1 /usr/bin/python3 -c \"{ALLREDUCE}\"").strip()
    cluster.wait(f"job {job} to end", lambda: cluster.job_state(job) in {"COMPLETED", "FAILED", "CANCELLED"}, 240)
    output = (cluster.root / f"mpi-{job}.out").read_text()
    assert cluster.job_state(job) == "COMPLETED", output
    ranks = re.findall(r"^rank (\d) of 2 on (\S+) sum 1$", output, flags=re.M)
    assert sorted(ranks) == [("0", "standby-1"), ("1", "standby-2")], output
    assert {node for node, _ in cluster.boots} == {"standby-1", "standby-2"}  # launched for the job
    # The controller, both nodes' slurmd and the head's commands: the node image's release.
    config = dict(re.findall(r"^(\S+)\s+= (.*)$", cluster.run("scontrol", "show", "config"), flags=re.M))
    assert config["SLURM_VERSION"] == SLURM_VERSION
    # (A line per node and partition: the spot partition falls back to the standby nodes.)
    versions = set(cluster.run("sinfo", "--noheader", "-N", "-n", "standby-[1-2]", "--format=%N %v").splitlines())
    assert versions == {f"standby-1 {SLURM_VERSION}", f"standby-2 {SLURM_VERSION}"}
    assert cluster.run("scontrol", "version").split()[-1] == SLURM_VERSION


def three_node_pool(tmp_path: Path) -> Stack:
    """The local stack with a third standby node: room for a 2-node and a 1-node job in one pool."""
    text = (FIXTURES / "Pulumi.local.yaml").read_text()
    pool = "- name: standby\n        instance_type: g6.xlarge\n        capacity: on-demand\n        max_nodes: 2\n"
    assert pool in text
    (tmp_path / "Pulumi.local.yaml").write_text(text.replace(pool, pool.replace("max_nodes: 2", "max_nodes: 3")))
    return load_stack(tmp_path / "Pulumi.local.yaml")


def test_job_ec2_cannot_launch_whole_gets_no_node_while_a_smaller_one_runs(
        start_cluster: Callable[..., LocalCluster], tmp_path: Path) -> None:
    """EC2 has room for one on-demand instance: the 2-node job's fleet asks for both of its nodes at once and gets
    neither, so no instance idles for a job that cannot start; the 1-node job in the same pool runs. The resume
    program tells the jobs apart only through the SLURM_RESUME_FILE slurmctld hands it."""
    cluster = start_cluster(three_node_pool(tmp_path))
    cluster.capacity["on-demand"] = 1
    hold, release = cluster.held("whole")
    pair = cluster.run("sbatch", "--parsable", "-p", "standby", "-N", "2", "--wrap", "srun true").strip()
    single = cluster.run("sbatch", "--parsable", "-p", "standby", "-N", "1", "-o", str(cluster.root / "one-%j.out"),
                         "--wrap", f"echo ran on $SLURMD_NODENAME; {hold}").strip()
    cluster.wait(f"job {single} to run", lambda: cluster.job_state(single) == "RUNNING", 180)
    fleets = [action for _, action in cluster.calls if action.startswith("CreateFleet")]
    assert "CreateFleet on-demand x2 refused" in fleets, fleets
    # The pair's nodes resumed as that job's, as a whole: the job id comes only from SLURM_RESUME_FILE.
    log = cluster.head.path(NODE_LOG).read_text()
    assert re.search(rf"2 node\(s\) of pool standby \(on-demand\), job {pair}, all or nothing", log), log[-3000:]
    # The pair got no instance: the one launched is the single job's node.
    assert len(cluster.boots) == 1, cluster.boots
    node = cluster.boots[0][0]
    assert cluster.run("squeue", "-h", "-j", single, "-o", "%N").strip() == node
    assert cluster.job_state(pair) == "PENDING"
    reasons = dict(line.split("|", 1) for line in cluster.run(
        "sinfo", "--noheader", "-R", "--format=%n|%E").splitlines())
    refused = sorted(n for n, why in reasons.items() if "capacity: InsufficientInstanceCapacity" in why)
    assert len(refused) == 2 and node not in refused, reasons
    release.touch()
    cluster.wait(f"job {single} to complete", lambda: cluster.job_state(single) == "COMPLETED", 120)
    assert (cluster.root / f"one-{single}.out").read_text() == f"ran on {node}\n"
