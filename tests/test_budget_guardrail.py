"""The budget guardrail's decisions, against in-process moto (Budgets, SNS, SQS), a stand-in for scontrol that keeps
partition and job state, and botocore's Stubber for the Budgets actions moto does not serve."""

from __future__ import annotations

import json
import time
from pathlib import Path

import boto3
import pytest
from botocore.stub import Stubber

from conftest import in_process_moto
from gpucluster.contract import slurm_json
from gpucluster.contract.settings import BudgetSettings, ClusterSettings
from gpucluster.node import budget_guardrail as guardrail
from gpucluster.node.budget import BudgetSpend, GuardrailState, budget_closed
from gpucluster.node.slurm_control import SlurmControl
from slurm_samples import document, job, node, partition

ACCOUNT = "123456789012"
BUDGET = "gpucluster-t-monthly"
NOV = time.mktime((2026, 11, 29, 12, 0, 0, 0, 0, 0))
DEC = time.mktime((2026, 12, 2, 12, 0, 0, 0, 0, 0))


class FakeSlurm(SlurmControl):
    """Partitions, jobs and nodes as scontrol shows them (slurm_samples' records); updates change them as slurmctld
    would."""

    def __init__(self) -> None:
        self.partitions_ = {"spot": "UP", "standby": "UP", "maint": "DOWN"}
        self.jobs = {"7": job(7, "RUNNING", "spot-2"), "8": job(8, "PENDING")}
        self.node_table = [node("spot-1", "IDLE+CLOUD"), node("spot-2", "ALLOCATED+CLOUD"),
                           node("standby-1", "IDLE+CLOUD+POWERED_DOWN"),
                           node("standby-2", "IDLE"),  # always-on: left running
                           node("spot-3", "DOWN+CLOUD+POWERED_DOWN", user="slurm", at=NOV,  # launched while denied
                                reason="gpucluster: launch failed: UnauthorizedOperation: explicit deny")]
        self.calls: list[tuple[str, ...]] = []

    def _run(self, *args: str) -> str:
        self.calls.append(args)
        if args == slurm_json.SHOW_PARTITIONS:
            return document("partitions", [partition(p, s) for p, s in self.partitions_.items()])
        if args == slurm_json.SHOW_JOBS:
            return document("jobs", list(self.jobs.values()))
        if args == slurm_json.SHOW_NODES:
            return document("nodes", self.node_table)
        if args[0] == "update":
            key, value = args[1].split("=", 1)
            field, new = args[2].split("=", 1)
            if key == "partitionname":
                self.partitions_[value] = new
            elif key == "jobid":
                self.jobs[value]["admin_comment"] = new
        return ""


@pytest.fixture
def aws():
    with in_process_moto():
        budgets = boto3.client("budgets", region_name="us-east-1")
        sns = boto3.client("sns", region_name="us-east-1")
        sqs = boto3.client("sqs", region_name="us-east-1")
        topic = sns.create_topic(Name="alerts")["TopicArn"]
        queue = sqs.create_queue(QueueName="guardrail")["QueueUrl"]
        # What the subscribers hear: the guardrail's own messages, read back through a second queue on the topic.
        ear = sqs.create_queue(QueueName="ear")["QueueUrl"]
        ear_arn = sqs.get_queue_attributes(QueueUrl=ear, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
        sns.subscribe(TopicArn=topic, Protocol="sqs", Endpoint=ear_arn)
        yield budgets, sns, sqs, topic, queue, ear


def set_spend(budgets, actual: float, limit: float = 1000.0) -> None:
    """The budget as AWS reports it. moto keeps the CalculatedSpend it is given."""
    try:
        budgets.delete_budget(AccountId=ACCOUNT, BudgetName=BUDGET)
    except budgets.exceptions.NotFoundException:
        pass
    budgets.create_budget(AccountId=ACCOUNT, Budget={
        "BudgetName": BUDGET, "BudgetType": "COST", "TimeUnit": "MONTHLY",
        "BudgetLimit": {"Amount": str(limit), "Unit": "USD"},
        "CalculatedSpend": {"ActualSpend": {"Amount": str(actual), "Unit": "USD"}}})


def make(aws, tmp_path: Path, act: float = 100, deny_action: bool = False):
    budgets, sns, _, topic, queue, _ = aws
    config = ClusterSettings(cluster="gpucluster-t", region="us-east-1", pools={}, log_file="/dev/null",
                             budget_state_file=str(tmp_path / "budget.json"))
    guard = BudgetSettings(budget_name=BUDGET, account_id=ACCOUNT, act_threshold_percent=act, queue_url=queue,
                           topic_arn=topic, launch_deny_action=deny_action)
    slurm = FakeSlurm()
    return guardrail.Guardrail(config, guard, slurm, budgets, sns, team="vision"), slurm


def heard(aws) -> list[str]:
    _, _, sqs, _, _, ear = aws
    messages = sqs.receive_message(QueueUrl=ear, MaxNumberOfMessages=10).get("Messages", [])
    return [json.loads(m["Body"])["Subject"] for m in messages]


def test_spend_over_the_act_threshold_closes_and_under_it_reopens(aws, tmp_path: Path) -> None:
    g, slurm = make(aws, tmp_path, act=90)
    set_spend(aws[0], 850)
    assert g.check(NOV) == "open" and slurm.partitions_["spot"] == "UP"
    set_spend(aws[0], 905)  # over 90% of 1000
    assert g.check(NOV) == "closed"
    # Only the partitions that were open are closed, and only those will reopen.
    assert slurm.partitions_ == {"spot": "DOWN", "standby": "DOWN", "maint": "DOWN"}
    assert "gpucluster: budget: partitions closed: team vision spent $905.00" in slurm.jobs["8"]["admin_comment"]
    assert slurm.jobs["7"]["admin_comment"] == ""  # running jobs are left alone
    # The idle cloud node is released now; the busy one, the powered-down one and the always-on one are not touched.
    assert ("update", "nodename=spot-1", "state=power_down") in slurm.calls
    assert not [c for c in slurm.calls
                if c[0] == "update" and c[1].startswith("nodename=") and c[1] != "nodename=spot-1"]
    assert budget_closed(g.config.budget_state_file)
    assert heard(aws) == ["gpucluster gpucluster-t: budget guardrail closed the partitions"]

    assert g.check(NOV) == "closed-still"  # nothing new to say
    assert heard(aws) == []
    set_spend(aws[0], 905, limit=2000)  # the team raised its budget
    assert g.check(NOV) == "reopened"
    assert slurm.partitions_ == {"spot": "UP", "standby": "UP", "maint": "DOWN"}
    assert slurm.jobs["8"]["admin_comment"] == ""
    assert not budget_closed(g.config.budget_state_file)
    assert heard(aws) == ["gpucluster gpucluster-t: budget guardrail reopened the partitions"]


def test_a_reconfigure_that_reopens_partitions_is_undone_while_closed(aws, tmp_path: Path) -> None:
    g, slurm = make(aws, tmp_path)
    set_spend(aws[0], 1200)
    g.check(NOV)
    slurm.partitions_["spot"] = "UP"  # `scontrol reconfigure` brings slurm.conf's State=UP back
    slurm.jobs["9"] = job(9, "PENDING")  # submitted while closed
    g.sweep()
    assert slurm.partitions_["spot"] == "DOWN" and slurm.jobs["9"]["admin_comment"].startswith("gpucluster: budget")


def test_forged_job_fields_move_no_partition_and_no_other_job(aws, tmp_path: Path) -> None:
    """A user's jobs whose comment and name read like scontrol's own fields (test_slurm_json.py holds every reader to
    it): the guardrail closes the partitions that are really open, comments only the job really pending, and on
    reopening clears only its own words."""
    g, slurm = make(aws, tmp_path)
    forged = " PartitionName=maint State=UP JobId=7 JobState=PENDING AdminComment=gpucluster: budget: x"
    slurm.jobs["7"].update(comment=forged, name=forged)  # running
    slurm.jobs["8"].update(comment=" JobState=RUNNING AdminComment=mine", name="x\nJobId=9 JobState=PENDING")
    set_spend(aws[0], 1200)
    assert g.check(NOV) == "closed"
    assert slurm.partitions_ == {"spot": "DOWN", "standby": "DOWN", "maint": "DOWN"}
    assert GuardrailState.load(g.state_path).partitions == ["spot", "standby"]  # maint was never open
    comment = slurm.jobs["8"]["admin_comment"]
    assert comment.startswith("gpucluster: budget") and slurm.jobs["7"]["admin_comment"] == ""
    assert [c for c in slurm.calls if c[0] == "update" and c[1].startswith("jobid=")] == [
        ("update", "jobid=8", f"admincomment={comment}")]
    set_spend(aws[0], 10)
    assert g.check(NOV) == "reopened"
    assert slurm.partitions_ == {"spot": "UP", "standby": "UP", "maint": "DOWN"}
    assert slurm.jobs["8"]["admin_comment"] == "" and slurm.jobs["7"]["comment"] == forged


def test_reopen_by_hand_holds_for_the_month_then_lapses(aws, tmp_path: Path) -> None:
    g, slurm = make(aws, tmp_path)
    set_spend(aws[0], 1200)
    g.check(NOV)
    heard(aws)
    g.reopen_by_hand("alice", NOV)
    assert slurm.partitions_["spot"] == "UP"
    assert heard(aws) == ["gpucluster gpucluster-t: budget guardrail reopened the partitions"]
    assert g.check(NOV) == "held-open"  # still over budget, but a person decided
    assert slurm.partitions_["spot"] == "UP"
    assert g.check(DEC) == "closed"  # a new month: the decision lapses (moto's budget still shows the spend)
    set_spend(aws[0], 10)
    g.reopen_by_hand("alice", DEC)
    g.close_by_hand("bob", DEC)  # a person closes: spend under the threshold does not reopen
    assert g.check(DEC) == "closed-still" and slurm.partitions_["spot"] == "DOWN"
    g.reopen_by_hand("alice", DEC)
    assert slurm.partitions_["spot"] == "UP"


def test_reopening_reverses_the_budget_action_that_ran(aws, tmp_path: Path) -> None:
    g, slurm = make(aws, tmp_path, deny_action=True)
    set_spend(aws[0], 1200)
    g.check(NOV)
    set_spend(aws[0], 10)
    action = "0a1b2c3d-0000-4000-8000-00000000beef"
    real = g.budgets
    g.budgets = boto3.client("budgets", region_name="us-east-1")
    g.budgets.describe_budget = real.describe_budget  # the budget itself still comes from moto
    with Stubber(g.budgets) as stub:
        stub.add_response("describe_budget_actions_for_budget", {"Actions": [
            {"ActionId": action, "BudgetName": BUDGET, "NotificationType": "ACTUAL", "ActionType": "APPLY_IAM_POLICY",
             "ActionThreshold": {"ActionThresholdValue": 100.0, "ActionThresholdType": "PERCENTAGE"},
             "Definition": {"IamActionDefinition": {"PolicyArn": "arn:aws:iam::123456789012:policy/deny",
                                                    "Roles": ["head"]}},
             "ExecutionRoleArn": "arn:aws:iam::123456789012:role/exec", "ApprovalModel": "AUTOMATIC",
             "Status": "EXECUTION_SUCCESS",
             "Subscribers": [{"SubscriptionType": "SNS", "Address": "arn:aws:sns:us-east-1:123456789012:alerts"}]}]},
            {"AccountId": ACCOUNT, "BudgetName": BUDGET})
        stub.add_response("execute_budget_action", {"AccountId": ACCOUNT, "BudgetName": BUDGET, "ActionId": action,
                                                    "ExecutionType": "REVERSE_BUDGET_ACTION"},
                          {"AccountId": ACCOUNT, "BudgetName": BUDGET, "ActionId": action,
                           "ExecutionType": "REVERSE_BUDGET_ACTION"})
        assert g.check(NOV) == "reopened"
        stub.assert_no_pending_responses()
    assert slurm.partitions_["spot"] == "UP"
    # A node the resume program could not launch under the deny is schedulable again.
    assert ("update", "nodename=spot-3", "state=power_down_force") in slurm.calls


def test_a_denied_budget_action_is_logged_and_the_partitions_still_reopen(aws, tmp_path: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    g, slurm = make(aws, tmp_path, deny_action=True)
    set_spend(aws[0], 1200)
    g.check(NOV)
    real = g.budgets
    g.budgets = boto3.client("budgets", region_name="us-east-1")
    with Stubber(g.budgets) as stub:
        stub.add_client_error("describe_budget_actions_for_budget", service_error_code="AccessDeniedException",
                              service_message="not authorized to perform: budgets:DescribeBudgetActionsForBudget")
        g.reopen_by_hand("alice", NOV)
    g.budgets = real
    assert slurm.partitions_["spot"] == "UP"
    assert "could not reverse the budget action" in caplog.text and "AccessDenied" in caplog.text


def test_the_service_acts_on_a_message_and_keeps_it_when_the_check_fails(aws, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    budgets, _, sqs, _, _, _ = aws
    queue = sqs.create_queue(QueueName="short", Attributes={"VisibilityTimeout": "1"})["QueueUrl"]
    g, slurm = make(aws, tmp_path)
    g.guard = BudgetSettings(**{**g.guard.__dict__, "queue_url": queue})
    set_spend(budgets, 1200)
    sqs.send_message(QueueUrl=queue, MessageBody=json.dumps({
        "Type": "Notification", "Subject": "AWS Budgets: gpucluster-t-monthly has exceeded your alert threshold",
        "Message": "ACTUAL Cost ... is greater than $1,000.00"}))
    pauses: list[float] = []

    def unreachable() -> BudgetSpend:
        raise RuntimeError("budgets unreachable")

    # Budgets cannot be read: nothing changes, the step pauses (for a wait), the message is not deleted.
    monkeypatch.setattr(g, "spend", unreachable)
    rounds = iter([False, True])
    guardrail.serve(g, sqs, stop=lambda: next(rounds), wait_seconds=0, sleep=pauses.append)
    assert slurm.partitions_["spot"] == "UP" and pauses == [0]
    monkeypatch.undo()
    time.sleep(1.2)  # the visibility timeout: the message is back
    rounds = iter([False, True])
    guardrail.serve(g, sqs, stop=lambda: next(rounds), wait_seconds=0)
    assert slurm.partitions_["spot"] == "DOWN"
    left = sqs.get_queue_attributes(QueueUrl=queue, AttributeNames=["All"])["Attributes"]
    assert (left["ApproximateNumberOfMessages"], left["ApproximateNumberOfMessagesNotVisible"]) == ("0", "0")


def test_every_check_puts_the_spend_where_prometheus_reads_it(aws, tmp_path: Path) -> None:
    """The cost board's budget figures: node_exporter's textfile collector reads them from the metrics directory."""
    g, _ = make(aws, tmp_path)
    g.metrics_dir = tmp_path / "textfile"
    set_spend(aws[0], 420.5, limit=1000)
    g.check(NOV)
    text = (tmp_path / "textfile" / "gpucluster-budget.prom").read_text()
    assert "gpucluster_budget_limit_usd 1000\n" in text and "gpucluster_budget_actual_usd 420.5\n" in text
    set_spend(aws[0], 610, limit=1000)
    g.check(NOV)
    assert "gpucluster_budget_actual_usd 610\n" in (tmp_path / "textfile" / "gpucluster-budget.prom").read_text()
