"""The resume-fail program (Slurm's ResumeFailProgram), against in-process moto and a recording stand-in for
scontrol."""

from __future__ import annotations

from gpucluster.node import fleet
from gpucluster.node.resume import resume
from gpucluster.node.resume_fail import resume_fail
from head_fakes import NOW, FakeSlurm, ec2_fixture, make_config  # noqa: F401  (the ec2 fixture)
from slurm_samples import node


def test_resume_fail_keeps_the_reason_of_nodes_it_never_launched(ec2) -> None:
    """At ResumeTimeout Slurm also calls resume-fail for nodes the resume program set DOWN with EC2's reason (a
    configuration error's fix must stay on them)."""
    config, slurm = make_config(ec2), FakeSlurm()
    launched = resume(config, ec2, FakeSlurm(), "p5-od-1").launched
    assert resume_fail(config, ec2, slurm, "p5-od-[1-2]") == [launched["p5-od-1"]]
    (down,) = slurm.updates()
    assert down[1] == "nodename=p5-od-1" and not fleet.cluster_instances(config, ec2)


def test_resume_fail_keeps_the_configuration_fault_a_node_found_at_its_first_boot(ec2) -> None:
    """A launched node whose first-boot check set it DOWN for a configuration fault never registers: at ResumeTimeout
    its instance goes, and its reason (slurmctld appends its own) stays, so the reconciler does not retry it."""
    config, slurm = make_config(ec2), FakeSlurm()
    launched = resume(config, ec2, FakeSlurm(), "p5-od-[1-2]").launched
    slurm.table = [node("p5-od-1", "DOWN+CLOUD+POWERED_DOWN", "gpucluster: configuration: no Lustre client module "
                        "for kernel 7.0.0-1012-aws (...) : ResumeTimeout reached", "slurm", NOW),
                   node("p5-od-2", "DOWN+CLOUD+POWERED_DOWN", "ResumeTimeout reached", "slurm", NOW)]
    assert sorted(resume_fail(config, ec2, slurm, "p5-od-[1-2]")) == sorted(launched.values())
    assert not fleet.cluster_instances(config, ec2)
    (down,) = slurm.updates()
    assert down[1] == "nodename=p5-od-2"  # only the one that merely failed to register is retried later
