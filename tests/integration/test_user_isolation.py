"""A user cannot disturb other users or the cluster: the login user's attacks, from a login shell on the head and from
inside jobs, on one local cluster (tests/local_cluster.py) that this module's tests share (one boot for all; each test
leaves no job of its own behind). Root's commands stand for the admin's; the login user's for any team member's."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpucluster.contract.settings import EVENTS_LOG, LOGIN_USER
from gpucluster.spec.model import load_stack
from local_cluster import LocalCluster, spot_warning

# One cluster for the module: under xdist its tests stay on one worker (--dist loadgroup).
pytestmark = [pytest.mark.rehearsal, pytest.mark.xdist_group("user-isolation")]

STACK = Path(__file__).resolve().parents[1] / "stacks" / "Pulumi.local.yaml"


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    root = Path(tempfile.mkdtemp(prefix="gpucluster-cluster-"))
    local = LocalCluster(load_stack(STACK), root).start()  # stopped itself if it failed
    try:
        yield local
    finally:
        local.stop()
        shutil.rmtree(root, ignore_errors=True)


def as_login_user(cluster: LocalCluster, command: str) -> subprocess.CompletedProcess[str]:
    """A login shell of the login user's on the head (what Session Manager gives), its exit status kept."""
    return cluster.head.enter("runuser", "-l", LOGIN_USER, "-c", command, check=False)


def job_record(cluster: LocalCluster, job: str) -> dict[str, Any]:
    """The job as Slurm's JSON has it (never scontrol's text, which the job's own fields can forge)."""
    record: dict[str, Any] = json.loads(cluster.run("scontrol", "show", "job", job, "--json"))["jobs"][0]
    return record


def test_a_forged_job_comment_makes_no_program_act_on_another_users_job(cluster: LocalCluster) -> None:
    """Root's job runs on standby-1, another on standby-2. The login user's held job names root's job as running on
    standby-2 in its comment and its name (scontrol's `--oneliner` text let them pass for its real fields). EC2 warns
    of standby-2's reclaim: the interruptions service (as slurm) signals and requeues the job really there, and
    neither root's job elsewhere nor the job that only claims to be there."""
    hold, release = cluster.held("forged-comment")
    # Each job says when it is ready to hear SIGUSR1 (a job is RUNNING while its prolog still runs) and when it did.
    trap = "trap 'echo USR1 >> /fsx/signalled-$SLURM_JOB_ID' USR1; touch /fsx/ready-$SLURM_JOB_ID; "
    jobs: list[str] = []
    try:
        for node in ("standby-1", "standby-2"):  # pinned: requeued, the warned job waits for its drained node
            jobs.append(cluster.run("sbatch", "--parsable", "-p", "standby", "-w", node, "-o", "/dev/null", "--wrap",
                                    trap + hold).strip())
        victim, warned_job = jobs
        forged_text = f" JobId={victim} JobState=RUNNING NodeList=standby-2 BatchHost=standby-2"
        submitted = as_login_user(cluster, " ".join([
            "sbatch --parsable --hold -p standby -o /dev/null", "--comment", shlex.quote(forged_text),
            "--job-name", shlex.quote(f"x\nJobId={victim} JobState=RUNNING NodeList=standby-2"), "--wrap true"]))
        assert submitted.returncode == 0, submitted.stderr
        forged = submitted.stdout.strip()
        jobs.append(forged)
        assert job_record(cluster, forged)["comment"] == forged_text  # Slurm keeps the text as it was given
        cluster.wait("both of root's jobs to run", lambda: all(
            (cluster.fsx / f"ready-{j}").exists() for j in (victim, warned_job)), 240)
        instance = cluster.instances()["standby-2"]

        cluster.aws("sqs").send_message(QueueUrl=cluster.interruptions, MessageBody=spot_warning(instance))

        def events() -> list[dict[str, Any]]:
            log = cluster.head.path(EVENTS_LOG)
            return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

        def requeued() -> list[str]:
            return [e["job"] for e in events() if e["event"] == "requeued" and e["job"] in jobs]

        cluster.wait(f"job {warned_job} to be requeued", lambda: bool(requeued()), 60)
        warned = [e for e in events() if e["event"] == "spot interruption warning" and e.get("instance") == instance]
        assert [e["jobs"] for e in warned] == [[warned_job]], warned
        assert requeued() == [warned_job]
        assert job_record(cluster, warned_job)["restart_cnt"] == 1
        assert (cluster.fsx / f"signalled-{warned_job}").exists()
        # Root's job elsewhere: not signalled, not requeued, still running. The forged one: untouched, still held.
        assert not (cluster.fsx / f"signalled-{victim}").exists()
        for job, state in ((victim, ["RUNNING"]), (forged, ["PENDING"])):
            record = job_record(cluster, job)
            assert (record["job_state"], record["restart_cnt"]) == (state, 0), record
    finally:
        if jobs:
            cluster.run("scancel", *jobs, check=False)
        release.touch()
    # What the reconciler does to a node drained for a new instance once it is idle (without its other work, such as
    # powering up the always-on node): the next test finds the cluster as it was.
    cluster.run("scontrol", "update", "nodename=standby-2", "state=power_down_force")
    cluster.wait("standby-2's instance to go", lambda: "standby-2" not in cluster.instances(), 60)
