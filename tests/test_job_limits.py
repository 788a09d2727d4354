"""What one user can queue and keep on the head (issue 23): the stack file's caps on jobs and on batch scripts, the
Slurm settings and sacctmgr limits they render to, the state volume sized for the worst case they allow, and what
users see of each other's jobs. The local cluster proves them on a real Slurm (tests/integration/
test_user_isolation.py)."""

from __future__ import annotations

import pytest

from conftest import ROOT, STACK_FILES
from gpucluster.contract.settings import SLURM_ROOT_ACCOUNT
from gpucluster.render import slurm
from gpucluster.spec import model
from gpucluster.spec.model import SlurmSpec, SpecError, Stack, load_stack, validate

TEAM_A = ROOT / "stacks" / "Pulumi.team-a.yaml"


def conf_settings(text: str) -> dict[str, str]:
    return {line.split("=", 1)[0]: line.split("=", 1)[1] for line in text.splitlines()
            if line and not line.startswith("#") and len(line.split()) == 1}


def with_slurm(stack: Stack, **keys: int) -> Stack:
    return Stack(stack.name, stack.region, stack.spec.model_copy(update={"slurm": SlurmSpec(
        **{**stack.spec.slurm.model_dump(), **keys})}))


def config(**slurm_keys: object) -> dict:
    return {"aws:region": "us-east-1", "gpucluster:cluster": {
        "team": "t1", "availability_zone": "us-east-1a", "network": {"vpc_cidr": "10.0.0.0/16"},
        "pools": [{"name": "gpu", "instance_type": "p5.48xlarge", "max_nodes": 2}],
        "storage": {"lustre": {"deployment_type": "SCRATCH_2", "storage_capacity_gib": 1200}},
        "budget": {"monthly_usd": 20000, "notify_emails": ["x@example.com"]}, "slurm": slurm_keys}}


def problems(**slurm_keys: object) -> list[tuple[str, str]]:
    with pytest.raises(SpecError) as caught:
        validate("s1", config(**slurm_keys))
    return caught.value.problems


def test_defaults_cap_every_user_and_the_team_and_fit_the_state_volume() -> None:
    limits = validate("s1", config()).spec.slurm
    assert limits.max_submitted_jobs_per_user <= limits.max_submitted_jobs <= model.MAX_JOB_COUNT // 2
    assert limits.max_running_jobs_per_user <= limits.max_running_jobs <= limits.max_submitted_jobs
    assert limits.max_running_jobs_per_user <= limits.max_submitted_jobs_per_user
    # Below Slurm's own 4 MiB: scripts are small.
    assert limits.max_batch_script_kib < 4096
    assert model.job_files_worst_case_gib(limits) <= model.job_files_room_gib()


def test_a_user_cap_above_the_teams_is_refused_with_its_path() -> None:
    assert problems(max_running_jobs_per_user=30, max_running_jobs=20) == [
        ("gpucluster:cluster.slurm.max_running_jobs_per_user",
         "must be <= max_running_jobs (20): one user cannot have more than the whole team")]


def test_more_running_than_submitted_is_refused() -> None:
    assert problems(max_running_jobs_per_user=50, max_submitted_jobs_per_user=40) == [
        ("gpucluster:cluster.slurm.max_running_jobs_per_user",
         "must be <= max_submitted_jobs_per_user (40): a running job is a submitted one")]


def test_the_team_cap_leaves_room_under_slurms_job_count() -> None:
    [(where, message)] = problems(max_submitted_jobs=model.MAX_JOB_COUNT)
    assert where == "gpucluster:cluster.slurm.max_submitted_jobs"
    assert message == f"Input should be less than or equal to {model.MAX_JOB_COUNT // 2}"


def test_the_largest_script_that_fits_is_taken_and_one_kib_more_refused() -> None:
    """The sizing rule's edge: the largest script whose worst case fits in the state volume's share is taken; a KiB
    more is refused, at its path, naming the largest that fits."""
    per_job_kib = int(model.job_files_room_gib() * (1 << 20) / model.MAX_JOB_COUNT)
    largest = per_job_kib - model.JOB_ENVIRONMENT_KIB
    assert validate("s1", config(max_batch_script_kib=largest)).spec.slurm.max_batch_script_kib == largest
    [(where, message)] = problems(max_batch_script_kib=largest + 1)
    assert where == "gpucluster:cluster.slurm.max_batch_script_kib"
    assert message.endswith(f"more than the {model.job_files_room_gib():.0f} GiB kept for them: at most {largest} KiB")


def test_the_worst_case_counts_every_job_slurm_holds_with_its_script_and_environment() -> None:
    limits = SlurmSpec(max_batch_script_kib=1024)
    assert model.job_files_worst_case_gib(limits) * (1 << 20) == \
        model.MAX_JOB_COUNT * (1024 + model.JOB_ENVIRONMENT_KIB)


@pytest.mark.parametrize("path", STACK_FILES, ids=lambda p: p.name)
def test_slurm_conf_bounds_scripts_and_the_job_count_and_keeps_jobs_private(path) -> None:
    stack = load_stack(path)
    settings = conf_settings(slurm.slurm_conf(stack))
    assert settings["SchedulerParameters"].split(",") == [
        "nohold_on_prolog_fail", f"max_script_size={stack.spec.slurm.max_batch_script_kib * 1024}"]
    # Room beside the team's queue for the admins' jobs and finished ones.
    assert int(settings["MaxJobCount"]) == model.MAX_JOB_COUNT >= 2 * stack.spec.slurm.max_submitted_jobs
    assert set(settings["PrivateData"].split(",")) == {"cloud", "jobs", "usage", "users", "accounts", "reservations",
                                                       "events"}
    # sacct and sreport ask slurmdbd, which keeps the same privacy.
    dbd = conf_settings(slurm.slurmdbd_conf(stack))
    assert set(dbd["PrivateData"].split(",")) == set(settings["PrivateData"].split(",")) - {"cloud"}


def test_a_stack_key_changes_the_rendered_script_bound() -> None:
    stack = with_slurm(load_stack(TEAM_A), max_batch_script_kib=100)
    assert "max_script_size=102400" in conf_settings(slurm.slurm_conf(stack))["SchedulerParameters"]


def test_the_accounting_script_sets_the_team_and_per_user_caps_on_the_account() -> None:
    stack = with_slurm(load_stack(TEAM_A), max_submitted_jobs_per_user=11, max_running_jobs_per_user=7,
                       max_submitted_jobs=31, max_running_jobs=17)
    script = slurm.accounting_script(stack).splitlines()
    team = stack.spec.team
    [modify] = [line for line in script if line.startswith(f"sacctmgr -i modify account where name={team} set")]
    assert modify.split()[8:] == ["GrpSubmitJobs=31", "GrpJobs=17", "MaxSubmitJobs=11", "MaxJobs=7"]
    # The account is set before its users are added (who take its Max* limits), and root is never made a member:
    # root's jobs (verify's DCGM diagnostic) run under Slurm's root account, outside the team's caps.
    assert script.index(modify) < next(i for i, line in enumerate(script) if "add user alice" in line)
    assert [line.split(" >")[0] for line in script if "root" in line] == [
        f"sacctmgr -i add user root Account={SLURM_ROOT_ACCOUNT}"]
    assert SLURM_ROOT_ACCOUNT != team
