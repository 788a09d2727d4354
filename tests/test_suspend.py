"""The suspend program (Slurm's SuspendProgram), against in-process moto."""

from __future__ import annotations

from gpucluster.node import fleet
from gpucluster.node.resume import resume
from gpucluster.node.suspend import suspend
from head_fakes import FakeSlurm, ec2_fixture, live, make_config  # noqa: F401  (the ec2 fixture)


def test_suspend_terminates_only_the_listed_nodes(ec2) -> None:
    config = make_config(ec2)
    resume(config, ec2, FakeSlurm(), "p5-od-1,p5-od-2")
    suspend(config, ec2, "p5-od-1")
    assert set(live(config, ec2)) == {"p5-od-2"} and len(fleet.cluster_instances(config, ec2)) == 1
