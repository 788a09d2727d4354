"""The resume-fail program (Slurm's ResumeFailProgram), against in-process moto and a recording stand-in for
scontrol."""

from __future__ import annotations

from gpucluster.node import fleet
from gpucluster.node.resume import resume
from gpucluster.node.resume_fail import resume_fail
from head_fakes import FakeSlurm, ec2_fixture, make_config  # noqa: F401  (the ec2 fixture)


def test_resume_fail_keeps_the_reason_of_nodes_it_never_launched(ec2) -> None:
    """At ResumeTimeout Slurm also calls resume-fail for nodes the resume program set DOWN with EC2's reason (a
    configuration error's fix must stay on them)."""
    config, slurm = make_config(ec2), FakeSlurm()
    launched = resume(config, ec2, FakeSlurm(), "p5-od-1").launched
    assert resume_fail(config, ec2, slurm, "p5-od-[1-2]") == [launched["p5-od-1"]]
    (down,) = slurm.updates()
    assert down[1] == "nodename=p5-od-1" and not fleet.cluster_instances(config, ec2)
