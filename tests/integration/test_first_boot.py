"""What only the instance can tell, checked at its first boot (health.py --configuration) on the boot rehearsal's
nodes (tests/local_cluster.py): a GPU node whose DCGM host engine is stopped gets it started and serves; a node whose
kernel has no Lustre module, and an always-on node whose instance lacks its pool tag, are DOWN with the configuration
reason and their fix, lose their instances and are never launched again, however often the reconciler runs (the
rehearsal's timers do not fire: the test runs it, as its timer would)."""

from __future__ import annotations

import pytest

from gpucluster.contract.settings import BOOT_LOG, POOL_TAG
from local_cluster import NO_LUSTRE_MODULE, UNTAGGED, LocalCluster

pytestmark = pytest.mark.rehearsal


def reason(cluster: LocalCluster, node: str) -> str:
    return cluster.run("sinfo", "--noheader", "-R", "-n", node, "--format=%200E").strip()


def state(cluster: LocalCluster, node: str) -> str:
    return cluster.run("sinfo", "--noheader", "-n", node, "--format=%t").strip()


def test_first_boot_starts_dcgm_and_downs_misconfigured_nodes_without_a_relaunch(cluster: LocalCluster) -> None:
    cluster.first_boot_faults.update(standby=NO_LUSTRE_MODULE, always=UNTAGGED)
    healthy = cluster.run("sbatch", "--parsable", "-p", "spot", "-o", "/dev/null", "--wrap", "true").strip()
    broken = cluster.run("sbatch", "--parsable", "-p", "standby", "-o", "/dev/null", "--wrap", "true").strip()
    assert "always-on node(s) always-1 are off: powering them up" in cluster.reconcile()

    # (a) The spot node's image has DCGM with its host engine stopped: started at boot, the node runs the job.
    cluster.wait(f"job {healthy} to complete", lambda: cluster.job_state(healthy) == "COMPLETED", 240)
    node = cluster.nodes[cluster.instances()["spot-1"]]
    assert node.enter("systemctl", "is-active", "nvidia-dcgm.service").stdout.strip() == "active"
    assert "nvidia-dcgm.service was stopped: started it" in node.path(BOOT_LOG).read_text()
    assert state(cluster, "spot-1") in ("idle", "mix", "alloc")

    # (b) A kernel without a Lustre module, (c) an instance without its pool tag: DOWN, the fix in the reason.
    cluster.wait("standby-1 and always-1 to find their faults", lambda: "configuration" in reason(
        cluster, "standby-1") and "configuration" in reason(cluster, "always-1"), 240)
    assert reason(cluster, "standby-1").startswith(
        "gpucluster: configuration: no Lustre client module for kernel "), reason(cluster, "standby-1")
    assert "rebake the image, or hold the kernel it was baked with" in reason(cluster, "standby-1")
    assert reason(cluster, "always-1").startswith(
        f"gpucluster: configuration: instance not tagged, not {POOL_TAG}=always: EC2 did not give it the launch "
        "template's tags"), reason(cluster, "always-1")
    faulty = {node: cluster.instances()[node] for node in ("standby-1", "always-1")}
    assert cluster.job_state(broken) in ("PENDING", "CONFIGURING")  # requeued off the DOWN node (to standby-2)
    # Neither registered (slurmd stays stopped: it would be returned to service).
    for name in faulty:
        assert state(cluster, name).startswith("down"), state(cluster, name)

    # The reconciler ends their instances at once (no job can use them) and leaves the nodes DOWN: never
    # returned to service, never powered up again, however late its passes.
    passes = [cluster.reconcile()]
    assert "DOWN for a configuration fault" in passes[0] and all(i in passes[0] for i in faulty.values()), passes
    cluster.wait("their instances to go", lambda: not set(faulty.values()) & set(cluster.instances().values()), 60)
    # The job tries standby-2 next, which meets the same fault: once, not in a loop. Meanwhile the backoff of a
    # passing cause (5 s here) is long past.
    cluster.wait("standby-2 to find it too", lambda: "configuration" in reason(cluster, "standby-2"), 240)
    passes += [cluster.reconcile() for _ in range(3)]
    assert not any("powering them up" in p or "returning to service" in p for p in passes), passes
    for name in faulty:
        assert state(cluster, name).startswith("down") and "configuration" in reason(cluster, name)
        assert [booted for booted, _ in cluster.boots].count(name) == 1, cluster.boots
    cluster.wait(f"job {broken} to wait, with no node left to try", lambda: cluster.job_state(broken) == "PENDING", 60)
