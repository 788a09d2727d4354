"""The reconciler on the boot rehearsal's cluster (tests/local_cluster.py): always-on nodes powered up through Slurm and
kept up, and a node whose instance vanished returned to service (a pass in the middle of a resume is in
test_scale_from_zero.py). The rehearsal's timers do not fire: the tests start the reconciler's unit themselves, as its
timer would."""

from __future__ import annotations

from local_cluster import LocalCluster


def node_state(cluster: LocalCluster, node: str) -> str:
    return cluster.run("sinfo", "--noheader", "-n", node, "--format=%t").strip()


def test_always_on_node_is_powered_up_and_comes_back_after_its_instance_vanishes(cluster: LocalCluster) -> None:
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
