"""The budget guardrail on a real Slurm cluster: a budget notification published to the stack's topic (moto SNS ->
SQS) closes the partitions while a running job finishes; a new job pends, no node is launched for it; the partitions
reopen when the spend falls back under the threshold, and by hand."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest

from gpucluster.contract import slurm_json
from gpucluster.contract.settings import BUDGET_STATE_FILE
from gpucluster.spec import cost
from local_cluster import LocalCluster

pytestmark = pytest.mark.rehearsal


def partition_states(cluster: LocalCluster) -> dict[str, str]:
    rows = cluster.run("sinfo", "--noheader", "--format=%R %a").split("\n")
    return dict(row.split() for row in rows if row)


def head_status(cluster: LocalCluster) -> dict[str, Any]:
    """`gpucluster status --json` as root on the head, as its Run Command document runs it."""
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root"}
    done = cluster.head.enter("/usr/local/bin/gpucluster", "status", "--json", env=env, check=False, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    status: dict[str, Any] = json.loads(done.stdout)
    return status


def status_says_what_slurm_says(cluster: LocalCluster, spent: float) -> None:
    """The head's status against sinfo and squeue, and against the plan's own budget and quota."""
    status = head_status(cluster)
    closed = partition_states(cluster)
    assert {p["name"]: p["open"] for p in status["partitions"]} == {name: state == "up" for name, state in
                                                                   closed.items()}
    assert all(p["why"].startswith("budget: ") and f"spent ${spent:,.2f}" in p["why"]
               for p in status["partitions"]), status["partitions"]
    nodes = cluster.run("sinfo", "--noheader", "--Node", "--format=%N").split()
    assert {pool: sum(states.values()) for pool, states in status["pools"].items()} == {
        pool.name: sum(1 for n in set(nodes) if n.rpartition("-")[0] == pool.name) for pool in cluster.stack.spec.pools}
    pending = Counter(cluster.run("squeue", "--noheader", "--states=PD", "--format=%r").split())
    running = cluster.run("squeue", "--noheader", "--states=R", "--format=%i").split()
    assert status["jobs"] == {"running": len(running), "pending": sum(pending.values()),
                              "pending_reasons": dict(pending)}
    assert status["pools"] and sum(s.get("busy", 0) for s in status["pools"].values()) >= 1  # the running job's
    plan = cluster.stack.spec.budget
    assert plan.act_threshold_percent is not None  # the local stack has the guardrail
    assert status["budget"]["limit_usd"] == plan.monthly_usd and status["budget"]["spent_usd"] == spent
    assert status["budget"]["act_at_usd"] == plan.monthly_usd * plan.act_threshold_percent / 100
    assert status["quota"]["usd"] == pytest.approx(cost.quota(cluster.stack).usd, abs=0.01)


def team_minutes(cluster: LocalCluster) -> tuple[int, int]:
    """The team account's billing (cent-minutes) and GPU minutes this month, from sshare's GrpTRESRaw as an admin reads
    it, apart from the reader status uses (contract.slurm_json.account_row)."""
    team = cluster.stack.spec.team
    rows = [line.split("|") for line in cluster.run("sshare", "-n", "-P", "-A", team, "-o",
                                                    "Account,User,GrpTRESRaw").splitlines()]
    (raw,) = [used for account, user, used in rows if account.strip() == team and not user]
    tres = dict(item.split("=", 1) for item in raw.split(","))
    return int(tres["billing"]), int(tres.get("gres/gpu", 0))


def usage_says_what_sshare_says(cluster: LocalCluster) -> None:
    """The head's status against sshare once the team's jobs ended (nothing adds to their use meanwhile), when they
    billed at least a cent and used a GPU-minute: a status that misread sshare, or never read it, would not show the
    same figures."""
    billed, gpu = team_minutes(cluster)
    used_usd = billed / 60 / slurm_json.BILLING_CENTS_PER_USD
    assert used_usd >= 0.01 and gpu >= 1, (billed, gpu)  # a cent and a GPU-minute: the document's precision
    status = head_status(cluster)
    assert status["quota"]["used_usd"] == round(used_usd, 2), (status["quota"], billed)
    assert status["gpu_hours"]["used"] == round(gpu / 60, 2), (status["gpu_hours"], gpu)


def submit(cluster: LocalCluster, partition: str, command: str, *options: str) -> str:
    return cluster.run("sbatch", "--parsable", "-p", partition, "-o", str(cluster.root / "job-%j.out"), *options,
                       "--wrap", command).strip()


def test_spent_budget_closes_partitions_lets_running_jobs_finish_and_reopens(cluster: LocalCluster) -> None:
    cluster.set_spend(120.0)  # of 500: fine
    topic = cluster.topic  # the head node runs the guardrail from its boot, checking the budget every 5 s here
    sns, sqs = cluster.aws("sns"), cluster.aws("sqs")
    # What the budget's subscribers receive, heard through a queue of our own on the same topic.
    ear = sqs.create_queue(QueueName="subscriber")["QueueUrl"]
    sns.subscribe(TopicArn=topic, Protocol="sqs", Endpoint=sqs.get_queue_attributes(
        QueueUrl=ear, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"])

    hold, release = cluster.held("running")
    # A GPU for a minute at least (beside the hold): a GPU-minute, and at the GPU's price more than a cent, which status
    # must show.
    running = submit(cluster, "standby", f"sleep 60 & {hold}; wait; echo finished", "--gpus=1")
    cluster.wait(f"job {running} to run", lambda: cluster.job_state(running) == "RUNNING", 120)

    # AWS Budgets reports the spend over the act threshold and notifies the topic.
    cluster.set_spend(510.0)
    sns.publish(TopicArn=topic, Subject="AWS Budgets: gpucluster-local-monthly has exceeded your alert threshold",
                Message="You requested that we alert you when the ACTUAL Cost associated with your "
                        "gpucluster-local-monthly budget is greater than $500.00 for the current month.")
    cluster.wait("partitions to close", lambda: set(partition_states(cluster).values()) == {"down"}, 60)
    launches = cluster.calls.count(("head", "CreateFleet"))

    waiting = submit(cluster, "spot", "echo ran after reopening")
    cluster.wait(f"job {waiting} to carry the budget comment",
                 lambda: "gpucluster: budget" in cluster.run("scontrol", "show", "job", waiting), 60)
    shown = cluster.run("scontrol", "show", "job", waiting)
    assert "JobState=PENDING" in shown and "Reason=PartitionDown" in shown, shown
    assert "spent $510.00 of its $500.00 monthly budget" in shown, shown
    # The job that was running when the budget ran out finishes normally.
    assert cluster.job_state(running) == "RUNNING"
    status_says_what_slurm_says(cluster, spent=510.0)
    release.touch()
    cluster.wait(f"job {running} to complete", lambda: cluster.job_state(running) == "COMPLETED", 120)
    assert "finished" in (cluster.root / f"job-{running}.out").read_text()
    # Slurm adds an ended job's use to its association (priority/multifactor, at the job's end).
    cluster.wait(f"job {running}'s billing in sshare", lambda: team_minutes(cluster)[0] > 0, 30)
    usage_says_what_sshare_says(cluster)
    # Its node goes back to zero; nothing is launched for the waiting job.
    cluster.wait("the idle node's instance to be terminated", lambda: not cluster.instances(), 90)
    assert cluster.calls.count(("head", "CreateFleet")) == launches and cluster.job_state(waiting) == "PENDING"
    assert "CLOSED" in cluster.budget_command("status")

    # A new month (or a raised limit): the periodic check finds the spend under the threshold and reopens.
    cluster.set_spend(3.0)
    cluster.wait("partitions to reopen", lambda: set(partition_states(cluster).values()) == {"up"}, 60)
    cluster.wait(f"job {waiting} to complete", lambda: cluster.job_state(waiting) == "COMPLETED", 180)
    assert "gpucluster: budget" not in cluster.run("scontrol", "show", "job", waiting)

    # By hand: an admin closes and reopens with the documented command.
    cluster.budget_command("close")
    assert set(partition_states(cluster).values()) == {"down"}
    cluster.budget_command("reopen")
    assert set(partition_states(cluster).values()) == {"up"}
    assert json.loads(cluster.head.path(BUDGET_STATE_FILE).read_text())["reopened_by_hand"]

    subjects = [json.loads(m["Body"])["Subject"] for m in _drain(sqs, ear)]
    assert [s.rsplit("guardrail ", 1)[-1] for s in subjects if "guardrail" in s] == [
        "closed the partitions", "reopened the partitions", "closed the partitions", "reopened the partitions"]


def _drain(sqs, queue: str) -> list[dict]:
    messages: list[dict] = []
    while batch := sqs.receive_message(QueueUrl=queue, MaxNumberOfMessages=10).get("Messages", []):
        messages += batch
    return messages
