"""A changed stack reaching the running cluster (`pulumi up` on day 2), on the boot rehearsal's cluster
(tests/local_cluster.py): `LocalCluster.apply` does what `pulumi up` does (templates for new pools, the new bundle in
S3, the new settings in SSM) and `update` starts the head's update unit, as its timer does every minute."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import FIXTURES
from gpucluster.spec.model import load_stack
from local_cluster import LocalCluster

pytestmark = pytest.mark.rehearsal

EXTRA_POOL = """      - name: extra
        instance_type: g6.xlarge
        capacity: on-demand
        max_nodes: 1
"""
ALWAYS_POOL = """      - name: always  # one always-on node (min_nodes), which the reconciler keeps up
        instance_type: g6.xlarge
        capacity: on-demand
        min_nodes: 1
        max_nodes: 1
"""


def changed(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "Pulumi.local.yaml"  # the same stack, a new version of its file
    path.write_text(text)
    return path


def submit(cluster: LocalCluster, *args: str) -> str:
    return cluster.run("sbatch", "--parsable", "-o", "/dev/null", *args).strip()


def partitions(cluster: LocalCluster) -> set[str]:
    return set(cluster.run("sinfo", "--noheader", "--format=%R").split())


def test_a_new_pool_reaches_the_running_head_while_a_job_runs(cluster: LocalCluster, tmp_path: Path) -> None:
    hold, release = cluster.held("running")
    running = submit(cluster, "-p", "standby", "--wrap", hold)
    cluster.wait(f"job {running} to run", lambda: cluster.job_state(running) == "RUNNING", 120)
    text = (FIXTURES / "Pulumi.local.yaml").read_text()
    assert ALWAYS_POOL in text
    cluster.apply(load_stack(changed(tmp_path, text.replace(ALWAYS_POOL, ALWAYS_POOL + EXTRA_POOL))))

    log = cluster.update()
    assert "the stack changed: applying it in place" in log and "the changed stack is applied" in log, log
    assert "extra" in partitions(cluster)
    assert cluster.job_state(running) == "RUNNING"  # slurmctld restarted under it; the job ran on
    new = submit(cluster, "-p", "extra", "--wrap", "srun hostname")
    cluster.wait(f"job {new} in the new partition", lambda: cluster.job_state(new) == "COMPLETED", 180)
    assert cluster.job_state(running) == "RUNNING"
    release.touch()
    cluster.wait(f"job {running} to finish", lambda: cluster.job_state(running) == "COMPLETED", 60)
    assert "Restarts=0" in cluster.run("scontrol", "show", "job", running)  # never requeued
    assert "applying" not in cluster.update()  # applied once; the next tick finds nothing to do


def test_a_removed_pool_is_drained_before_its_nodes_go(cluster: LocalCluster, tmp_path: Path) -> None:
    cluster.reconcile()  # powers up always-1
    cluster.wait("always-1 to come up", lambda: "always-1" in cluster.instances() and cluster.run(
        "sinfo", "--noheader", "-n", "always-1", "--format=%t").strip() == "idle", 120)
    hold, release = cluster.held("busy")
    busy = submit(cluster, "-p", "always", "--wrap", hold)
    cluster.wait(f"job {busy} to run", lambda: cluster.job_state(busy) == "RUNNING", 60)
    text = (FIXTURES / "Pulumi.local.yaml").read_text()
    cluster.apply(load_stack(changed(tmp_path, text.replace(ALWAYS_POOL, ""))))

    log = cluster.update()
    assert "waiting for always-1, which the stack drops" in log, log
    assert "always" in partitions(cluster) and cluster.job_state(busy) == "RUNNING"
    reason = cluster.run("sinfo", "--noheader", "-R", "-n", "always-1", "--format=%E")
    assert "removed from the stack" in reason, reason
    assert "always-1" in cluster.instances()  # kept for the job
    release.touch()
    cluster.wait(f"job {busy} to finish", lambda: cluster.job_state(busy) == "COMPLETED", 60)
    cluster.wait("always-1's instance to go", lambda: "always-1" not in cluster.instances(), 60)
    cluster.wait("the change to be applied", lambda: "the changed stack is applied" in cluster.update(), 60)
    assert "always" not in partitions(cluster)
