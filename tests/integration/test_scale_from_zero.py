"""Jobs on nodes that do not exist yet: Slurm calls the resume program, which launches instances (moto), the harness
boots a slurmd for each, the job runs; idle nodes are suspended and their instances terminated."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from conftest import FIXTURES
from gpucluster.spec import load_stack
from local_cluster import LocalCluster, missing_tools


@pytest.fixture
def cluster():  # type: ignore[no-untyped-def]
    assert not missing_tools(), f"install Slurm, munge and MariaDB first (make test does): missing {missing_tools()}"
    root = Path(tempfile.mkdtemp(prefix="gpucluster-cluster-"))
    local = LocalCluster(load_stack(FIXTURES / "Pulumi.local.yaml"), root).start()
    yield local
    local.stop()
    shutil.rmtree(root, ignore_errors=True)


def submit(cluster: LocalCluster, *args: str) -> str:
    return cluster.run("sbatch", "--parsable", "-o", str(cluster.root / "job-%j.out"), *args).strip()


def test_two_node_job_scales_from_zero_and_back(cluster: LocalCluster) -> None:
    assert not cluster.instances()
    job = submit(cluster, "-p", "standby", "-N", "2", "--wrap", "srun bash -c 'echo ran on $SLURMD_NODENAME'")
    cluster.wait(f"job {job} to complete", lambda: cluster.job_state(job) == "COMPLETED", 180)
    output = (cluster.root / f"job-{job}.out").read_text()
    assert "ran on standby-1" in output and "ran on standby-2" in output, output
    # Each node was an instance launched for the job, tagged with its node name, reached at its moto address.
    launched = {node for node, _ in cluster.boots}
    assert launched == {"standby-1", "standby-2"}
    addresses = cluster.run("sinfo", "--noheader", "-N", "-p", "standby", "--format=%N %o")
    assert all(line.split()[1].startswith("127.0.0.") for line in addresses.splitlines()), addresses
    # After SuspendTime idle seconds the suspend program terminates both instances.
    cluster.wait("idle nodes to be suspended", lambda: not cluster.instances(), 120)
    ec2 = cluster.ec2()
    states = {i["State"]["Name"] for r in ec2.describe_instances()["Reservations"] for i in r["Instances"]}
    assert states == {"terminated"}
    # Powering down (idle%) for SuspendTimeout, then powered down (idle~): either way no instance, ready to resume.
    cluster.wait("nodes to power down", lambda: set(cluster.run(
        "sinfo", "--noheader", "-p", "standby", "--format=%t").split()) <= {"idle%", "idle~"}, 60)


def test_spot_capacity_shortage_falls_back_to_on_demand(cluster: LocalCluster) -> None:
    cluster.faulty.failing_markets["spot"] = "InsufficientInstanceCapacity"
    # The spot partition lists the spot nodes first (lower weight) and the on-demand pool behind them.
    job = submit(cluster, "-p", "spot", "-N", "2", "--wrap", "srun bash -c 'echo ran on $SLURMD_NODENAME'")
    # Slurm holds a requeued job for the credential lifetime (120 s) before it runs elsewhere.
    cluster.wait(f"job {job} to complete", lambda: cluster.job_state(job) == "COMPLETED", 300)
    output = (cluster.root / f"job-{job}.out").read_text()
    assert "ran on standby-1" in output and "ran on standby-2" in output, output
    assert "CreateFleet spot" in cluster.faulty.calls and "CreateFleet ok" in cluster.faulty.calls
    # The spot nodes carry EC2's reason, so `sinfo -R` tells the user why the job moved.
    reasons = cluster.run("sinfo", "--noheader", "-R", "--format=%n|%E")
    down = dict(line.split("|", 1) for line in reasons.splitlines())
    for node in ("spot-1", "spot-2"):
        assert "capacity: InsufficientInstanceCapacity" in down[node], reasons
    assert {node for node, _ in cluster.boots} == {"standby-1", "standby-2"}
    assert "Restarts=1" in cluster.run("scontrol", "show", "job", job)  # requeued once, not lost
