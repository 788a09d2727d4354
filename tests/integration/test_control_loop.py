"""The reconciler on the boot rehearsal's cluster (tests/local_cluster.py): always-on nodes powered up through Slurm and
kept up, a node whose instance vanished returned to service, a node that fails its health check replaced, and a job
that outlives a restart of the controller (a pass in the middle of a resume is in test_scale_from_zero.py). The
rehearsal's timers do not fire: the tests start the reconciler's unit themselves, as its timer would."""

from __future__ import annotations

import subprocess
import time
import uuid

import pytest

from local_cluster import LocalCluster

pytestmark = pytest.mark.rehearsal


def node_state(cluster: LocalCluster, node: str) -> str:
    return cluster.run("sinfo", "--noheader", "-n", node, "--format=%t").strip()


def test_always_on_node_comes_back_after_its_instance_vanishes_and_an_unhealthy_node_is_replaced(
        cluster: LocalCluster) -> None:
    assert node_state(cluster, "always-1") == "idle~"  # a CLOUD node, powered down until the reconciler runs
    assert "always-on node(s) always-1 are off: powering them up" in cluster.reconcile()
    cluster.wait("always-1 to come up", lambda: node_state(cluster, "always-1") == "idle", 120)
    first = cluster.instances()["always-1"]
    # Never suspended (SuspendExcNodes): idle far beyond SuspendTime (15 s here), its instance stays.
    job = cluster.run("sbatch", "--parsable", "-p", "always", "-o", "/dev/null", "--wrap", "hostname").strip()
    cluster.wait(f"job {job} on always-1", lambda: cluster.job_state(job) == "COMPLETED", 60)

    cluster.ec2().terminate_instances(InstanceIds=[first])  # a spot reclaim, or someone in the console
    assert "lost their instance: setting them DOWN" in cluster.reconcile()
    assert node_state(cluster, "always-1") == "down"
    reason = cluster.run("sinfo", "--noheader", "-R", "-n", "always-1", "--format=%E")
    assert "instance vanished" in reason, reason
    # After its backoff (5 s here) the next pass returns it to service, and the one after powers it up again.
    cluster.wait("always-1 to be returned to service", lambda: "returning to service" in cluster.reconcile(), 30)
    cluster.wait("always-1 to be powered down", lambda: node_state(cluster, "always-1") in ("idle~", "idle%"), 60)
    cluster.wait("always-1 to be powered up", lambda: "powering them up" in cluster.reconcile(), 60)
    cluster.wait("always-1 to come back", lambda: node_state(cluster, "always-1") == "idle", 120)
    assert cluster.instances()["always-1"] != first

    # A node whose GPU is gone (its nvidia-smi stand-in lists none): its boot's health check drains it, the Prolog's
    # check requeues the job that was waiting for it (it never runs there), and the reconciler gives the node a fresh
    # instance; the job runs on a healthy one.
    cluster.gpu_faults["standby"] = "true"  # prints no GPU
    job = cluster.run("sbatch", "--parsable", "-p", "standby", "--open-mode=append", "-o",
                      str(cluster.root / "health-%j.out"), "--wrap", "echo ran with $(nvidia-smi | wc -l) GPU").strip()
    cluster.wait("a node to fail its health check", lambda: "health: 0 of 1 GPUs" in cluster.run(
        "sinfo", "--noheader", "-R", "--format=%E"), 120)
    sick = cluster.run("sinfo", "--noheader", "-R", "--format=%N %E").split()[0]
    sick_instance = cluster.instances()[sick]
    cluster.gpu_faults.clear()
    # Idle and drained, the node loses its instance: to Slurm's own suspend (SuspendTime, 15 s here) or to the
    # reconciler's replacement (a node Slurm never suspends, or a long SuspendTime), whichever comes first.
    cluster.wait(f"{sick}'s instance to go",
                 lambda: cluster.reconcile() is not None and sick_instance not in cluster.instances().values(), 120)
    cluster.wait(f"job {job} to complete", lambda: cluster.job_state(job) == "COMPLETED", 240)
    assert (cluster.root / f"health-{job}.out").read_text().splitlines() == ["ran with 1 GPU"]

    # The controller restarted under a running job (a recovered or replaced head, a changed stack): the job finishes.
    hold, release = cluster.held("restart")
    job = cluster.run("sbatch", "--parsable", "-p", "standby", "-o", str(cluster.root / "restart-%j.out"), "--wrap",
                      f"{hold}; echo finished").strip()
    cluster.wait(f"job {job} to run", lambda: cluster.job_state(job) == "RUNNING", 180)
    cluster.head.enter("systemctl", "restart", "slurmctld")
    release.touch()
    cluster.wait(f"job {job} to finish after the restart", lambda: state_if_answering(cluster, job) == "COMPLETED", 120)
    assert (cluster.root / f"restart-{job}.out").read_text() == "finished\n"

    # A GPU tool that hangs after boot (a wedged driver): the Prolog kills it after its limit, drains the node and
    # fails, so the job is requeued instead of waiting forever on the node (ParallelCluster #6777).
    node = cluster.run("sacct", "-n", "-X", "-j", job, "--format=NodeList%40").strip()
    rehearsal = cluster.nodes[cluster.instances()[node]]
    # A duration of this run's own: the rehearsal's nodes share the machine's process table with other clusters.
    hung = f"sleep 600.{uuid.uuid4().int % 10**6:06d}"
    rehearsal.path("/usr/local/bin/nvidia-smi").write_text(f"#!/bin/sh\nexec {hung}\n")
    submitted = time.monotonic()
    job = cluster.run("sbatch", "--parsable", "-p", "standby", "-w", node, "-o", "/dev/null", "--wrap", "true").strip()
    cluster.wait(f"{node} to be drained by its Prolog", lambda: "nvidia-smi did not answer in 10 s" in cluster.run(
        "sinfo", "--noheader", "-R", "-n", node, "--format=%E"), 60)
    assert time.monotonic() - submitted < 10 + 15  # the tool's limit, then Slurm's own round trips
    # Requeued by the Prolog: its start winds down (COMPLETING) and it waits again, with a restart counted.
    cluster.wait(f"job {job} to be requeued", lambda: all(
        fact in cluster.run("scontrol", "show", "job", job) for fact in ("JobState=PENDING", "Restarts=1")), 30)
    assert hung not in rehearsal.enter("ps", "-eo", "args").stdout  # the hung tool was killed with its session
    cluster.run("scancel", job)


def state_if_answering(cluster: LocalCluster, job: str) -> str:
    """The job's state, or "" while slurmctld does not answer yet."""
    try:
        return cluster.job_state(job)
    except (subprocess.CalledProcessError, IndexError):
        return ""
