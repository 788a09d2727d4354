#!/usr/bin/env python3
"""gpucluster's budget guardrail, run on the head node as the service gpucluster-budget.

AWS Budgets publishes its notifications to the stack's SNS topic; an SQS queue subscribed to it wakes this program.
The budget itself (DescribeBudget) is the truth, read on every message and every `check_seconds`:

- spend at or over the act threshold: the cluster's partitions go DOWN (queued and new jobs pend, running jobs finish),
  each pending job gets an AdminComment naming the budget (Slurm's own reason reads PartitionDown, and Slurm lets no
  program set it), idle nodes are powered down now instead of after SuspendTime, the reconciler stops launching
  always-on nodes;
- spend back under it (a new month, a raised limit): the partitions it closed reopen and the Budgets action's launch
  deny on the head node's role is reversed.

By hand: `gpucluster-budget status | check | close | reopen`. `reopen` holds for the rest of the month (a person
decided to spend more); `close` holds until someone reopens. Every action is logged (journal and log file) and published to the topic, so the budget's
subscribers hear of it.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

from gpucluster_metrics import family, sample, write
from gpucluster_node import REASON_PREFIX, Slurm, always_on_nodes, setup_logging
from gpucluster.contract.scontrol import job_records, parse_oneliner  # noqa: E402  (the bundle's lib/, on the path since gpucluster_node)
from gpucluster.contract.settings import TEXTFILE_DIR, BudgetSettings, ClusterSettings  # the bundle's lib/, on the path since gpucluster_node

BUDGET_PREFIX = f"{REASON_PREFIX} budget"
# How the resume program marks nodes it could not launch while the Budgets action's deny was on the head node's role.
DENIED_PREFIX = f"{REASON_PREFIX} launch failed: UnauthorizedOperation"
RECEIVE_WAIT_SECONDS = 20  # SQS long polling: also the pace of the sweep over new pending jobs while closed

log = logging.getLogger("gpucluster-budget")


@dataclass
class State:
    """What the guardrail did, kept across restarts; the reconciler reads `closed`."""

    closed: bool = False
    reason: str = ""
    since: float = 0.0
    partitions: list[str] = field(default_factory=list)  # the ones it closed: only those reopen
    reopened_by_hand: str = ""  # the month (YYYY-MM, UTC) a person reopened: no closing again in it
    closed_by_hand: bool = False  # a person closed: only a person reopens

    @classmethod
    def load(cls, path: Path) -> State:
        try:
            return cls(**json.loads(path.read_text()))
        except FileNotFoundError:
            return cls()

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1))
        tmp.chmod(0o644)  # the reconciler (slurm user) reads it
        tmp.replace(path)


@dataclass(frozen=True)
class Spend:
    actual: float
    limit: float
    act_at: float
    forecast: float | None = None  # AWS forecasts a month's spend once it has some history

    @property
    def over(self) -> bool:
        return self.actual >= self.act_at

    def describe(self, team: str) -> str:
        return (f"team {team} spent ${self.actual:,.2f} of its ${self.limit:,.2f} monthly budget "
                f"(the guardrail acts at ${self.act_at:,.2f})")


def publish_spend(spend: Spend, directory: Path) -> None:
    """The budget for the cost board, through node_exporter's textfile collector."""
    figures = [("limit", spend.limit, "The team's monthly budget"), ("actual", spend.actual, "Spend this month"),
               ("forecast", spend.forecast, "AWS's forecast of this month's spend")]
    write("".join(family(f"gpucluster_budget_{name}_usd", "gauge", f"{text} (AWS Budgets).",
                         [sample(f"gpucluster_budget_{name}_usd", value)])
                  for name, value, text in figures if value is not None), directory, "gpucluster-budget.prom")


def month(now: float) -> str:
    return time.strftime("%Y-%m", time.gmtime(now))


class SlurmQueue(Slurm):
    """The scontrol calls of the guardrail: partitions, pending jobs, idle nodes."""

    def partitions(self) -> dict[str, str]:
        """Partition name -> State (UP, DOWN, DRAIN, INACTIVE)."""
        rows = [parse_oneliner(line) for line in self._run("show", "partitions", "--oneliner").splitlines()
                if line.startswith("PartitionName=")]
        return {row["PartitionName"]: row["State"] for row in rows}

    def set_partition_state(self, names: list[str], state: str) -> None:
        for name in names:
            self._run("update", f"partitionname={name}", f"state={state}")

    def pending_jobs(self) -> dict[str, str]:
        """Pending job id -> its AdminComment ("" when none)."""
        jobs = job_records(self._run("show", "jobs", "--oneliner"))
        return {job["JobId"]: job.get("AdminComment", "") for job in jobs if job.get("JobState") == "PENDING"}

    def set_admin_comment(self, job: str, text: str) -> None:
        self._run("update", f"jobid={job}", f"admincomment={text}")

    def power_down_idle(self, keep: set[str]) -> list[str]:
        """Nodes that are up and idle: powered down now (Slurm calls the suspend program), not after SuspendTime.
        `keep`: the always-on nodes, which the team chose to keep running (a power-down request would override
        SuspendExcNodes)."""
        idle = [n["NodeName"] for n in self.nodes() if _idle_and_up(n.get("State", "")) and n["NodeName"] not in keep]
        if idle:
            self._run("update", f"nodename={','.join(idle)}", "state=power_down")
        return idle


def _idle_and_up(state: str) -> bool:
    """An idle cloud node that is up."""
    flags = set(state.split("+"))
    return {"IDLE", "CLOUD"} <= flags and not flags & {"POWERED_DOWN", "POWERING_DOWN", "POWERING_UP", "DOWN", "COMPLETING"}


class Guardrail:
    def __init__(self, config: ClusterSettings, guard: BudgetSettings, slurm: SlurmQueue, budgets, sns, team: str,  # type: ignore[no-untyped-def]
                 metrics_dir: Path | None = None):
        self.config, self.guard, self.slurm, self.budgets, self.sns, self.team = config, guard, slurm, budgets, sns, team
        self.state_path = Path(config.budget_state_file)
        self.metrics_dir = metrics_dir  # where the spend goes for Prometheus (None: nowhere)

    @contextmanager
    def _state(self) -> Iterator[State]:
        """The state, locked against the service and a person's command running at once, saved on the way out."""
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.state_path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            state = State.load(self.state_path)
            yield state
            state.save(self.state_path)

    def spend(self) -> Spend:
        budget = self.budgets.describe_budget(AccountId=self.guard.account_id, BudgetName=self.guard.budget_name)["Budget"]
        limit = float(budget["BudgetLimit"]["Amount"])
        calculated = budget.get("CalculatedSpend", {})
        actual = float(calculated.get("ActualSpend", {}).get("Amount", 0))
        forecast = calculated.get("ForecastedSpend", {}).get("Amount")
        spend = Spend(actual=actual, limit=limit, act_at=limit * self.guard.act_threshold_percent / 100,
                      forecast=float(forecast) if forecast is not None else None)
        if self.metrics_dir:
            publish_spend(spend, self.metrics_dir)
        return spend

    def check(self, now: float | None = None) -> str:
        """Read the budget and act on it. Returns what it did: closed, reopened, held-open, closed-still or open."""
        now = time.time() if now is None else now
        spend = self.spend()
        with self._state() as state:
            if state.reopened_by_hand and state.reopened_by_hand != month(now):
                log.info("the reopening by hand of %s has lapsed with the month", state.reopened_by_hand)
                state.reopened_by_hand = ""
            if spend.over and not state.closed:
                if state.reopened_by_hand:
                    log.warning("%s; reopened by hand for %s: staying open", spend.describe(self.team),
                                state.reopened_by_hand)
                    return "held-open"
                self._close(state, spend.describe(self.team), now)
                return "closed"
            if not spend.over and state.closed and not state.closed_by_hand:
                self._reopen(state, f"spend is back under the act threshold: {spend.describe(self.team)}")
                return "reopened"
            if state.closed:
                self._enforce(state)
                return "closed-still"
            return "open"

    def close_by_hand(self, who: str, now: float | None = None) -> None:
        now = time.time() if now is None else now
        with self._state() as state:
            state.reopened_by_hand = ""
            if not state.closed:
                self._close(state, f"closed by hand by {who}", now)
            state.closed_by_hand = True

    def reopen_by_hand(self, who: str, now: float | None = None) -> None:
        now = time.time() if now is None else now
        with self._state() as state:
            state.reopened_by_hand = month(now)
            self._reopen(state, f"reopened by hand by {who} for the rest of {month(now)}", always_tell=True)

    def sweep(self) -> None:
        """While closed: keep partitions down (a reconfigure reopens them), mark new pending jobs, stop idle nodes."""
        with self._state() as state:
            if state.closed:
                self._enforce(state)

    # --- the actions -----------------------------------------------------------------------------------------------
    def _close(self, state: State, why: str, now: float) -> None:
        up = sorted(name for name, st in self.slurm.partitions().items() if st == "UP")
        state.closed, state.reason, state.since = True, why, now
        state.partitions = sorted(set(state.partitions) | set(up))
        self._enforce(state)
        self._tell("closed the partitions", f"{why}. Partitions {', '.join(state.partitions)} are DOWN: queued and "
                   "new jobs wait, running jobs finish, idle nodes are released. They reopen when spend falls under "
                   "the threshold (new month, raised budget) or with `sudo gpucluster-budget reopen` on the head node.")

    def _enforce(self, state: State) -> None:
        partitions = self.slurm.partitions()
        still_up = [p for p in state.partitions if partitions.get(p) == "UP"]
        self.slurm.set_partition_state(still_up, "DOWN")
        comment = f"{BUDGET_PREFIX}: partitions closed: {state.reason}"
        for job, current in self.slurm.pending_jobs().items():
            if current != comment:
                self.slurm.set_admin_comment(job, comment)
        released = self.slurm.power_down_idle(keep=always_on_nodes(self.config))
        if released:
            log.info("budget closed: powering down idle node(s) %s", ",".join(released))

    def _reopen(self, state: State, why: str, always_tell: bool = False) -> None:
        closed_here = state.partitions
        existing = self.slurm.partitions()
        self.slurm.set_partition_state([p for p in closed_here if p in existing], "UP")
        for job, current in self.slurm.pending_jobs().items():
            if current.startswith(BUDGET_PREFIX):
                self.slurm.set_admin_comment(job, "")
        denied = [n["NodeName"] for n in self.slurm.nodes()
                  if n.get("Reason", "").startswith(DENIED_PREFIX) and "DOWN" in n.get("State", "")]
        if denied:  # the launch deny is being lifted: those nodes may launch again
            log.info("nodes %s were refused a launch while denied: schedulable again", ",".join(denied))
            self.slurm.power_down(denied)
        was_closed = state.closed
        state.closed, state.closed_by_hand, state.reason, state.since, state.partitions = False, False, "", 0.0, []
        lifted = self._lift_launch_deny()
        if was_closed or lifted or always_tell:
            self._tell("reopened the partitions", f"{why}. Partitions {', '.join(closed_here) or '(none)'} are UP"
                       + ("; the launch deny on the head node's role is lifted." if lifted else "."))

    def _lift_launch_deny(self) -> bool:
        """Reverse the Budgets action that denied the head node's launches, if it ran."""
        if not self.guard.launch_deny_action:
            return False
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            actions = self.budgets.describe_budget_actions_for_budget(
                AccountId=self.guard.account_id, BudgetName=self.guard.budget_name)["Actions"]
            done = [a for a in actions if a["Status"] == "EXECUTION_SUCCESS"]
            for action in done:
                self.budgets.execute_budget_action(AccountId=self.guard.account_id, BudgetName=self.guard.budget_name,
                                                   ActionId=action["ActionId"], ExecutionType="REVERSE_BUDGET_ACTION")
            return bool(done)
        except (BotoCoreError, ClientError) as exc:
            log.error("could not reverse the budget action (reverse it in the AWS Budgets console): %s", exc)
            return False

    def _tell(self, what: str, message: str) -> None:
        subject = f"gpucluster {self.config.cluster}: budget guardrail {what}"
        log.warning("%s: %s", subject, message)
        try:
            self.sns.publish(TopicArn=self.guard.topic_arn, Subject=subject[:100], Message=message)
        except Exception:  # the log has it; a lost e-mail must not undo the action
            log.exception("could not publish to %s", self.guard.topic_arn)


def serve(guardrail: Guardrail, sqs, stop=lambda: False) -> None:  # type: ignore[no-untyped-def]
    """The service: wake on a budget message or every check_seconds; sweep while closed."""
    guard = guardrail.guard
    next_check = 0.0
    while not stop():
        try:
            messages = sqs.receive_message(QueueUrl=guard.queue_url, WaitTimeSeconds=RECEIVE_WAIT_SECONDS,
                                           MaxNumberOfMessages=10).get("Messages", [])
            for message in messages:
                log.info("notification: %s", _subject(message["Body"]))
            if messages or time.time() >= next_check:
                log.info("budget check: %s", guardrail.check())
                next_check = time.time() + guard.check_seconds
            else:
                guardrail.sweep()
            # Deleted only once acted on: a failed check leaves them to come back after the visibility timeout.
            for message in messages:
                sqs.delete_message(QueueUrl=guard.queue_url, ReceiptHandle=message["ReceiptHandle"])
        except Exception:
            log.exception("budget guardrail step failed; retrying")
            time.sleep(RECEIVE_WAIT_SECONDS)


def _subject(body: str) -> str:
    """SNS wraps the budget's text in an envelope with a Subject."""
    try:
        envelope: dict[str, Any] = json.loads(body)
        return str(envelope.get("Subject") or envelope.get("Message", "")[:120])
    except ValueError:
        return body[:120]


def clients(config: ClusterSettings):  # type: ignore[no-untyped-def]
    import boto3

    # Budgets is a global service answered in us-east-1; SQS and SNS live in the cluster's region.
    return (boto3.client("budgets", region_name="us-east-1"), boto3.client("sns", region_name=config.region),
            boto3.client("sqs", region_name=config.region))


USAGE = "usage: gpucluster-budget {run|status|check|close|reopen}"


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[1] not in ("run", "status", "check", "close", "reopen"):
        print(USAGE, file=sys.stderr)
        return 2
    command = argv[1]
    config = ClusterSettings.load()
    setup_logging(config)
    if config.budget is None:
        print("this cluster has no budget guardrail (budget.act_threshold_percent is null)", file=sys.stderr)
        return 2
    budgets, sns, sqs = clients(config)
    guardrail = Guardrail(config, config.budget, SlurmQueue(config.scontrol), budgets, sns, config.team,
                          Path(TEXTFILE_DIR))
    who = os.environ.get("SUDO_USER") or os.environ.get("USER") or "root"
    try:
        if command == "run":
            serve(guardrail, sqs)
        elif command == "check":
            print(guardrail.check())
        elif command == "close":
            guardrail.close_by_hand(who)
        elif command == "reopen":
            guardrail.reopen_by_hand(who)
        else:
            state = State.load(guardrail.state_path)
            print(f"{'CLOSED' if state.closed else 'open'}: {state.reason or guardrail.spend().describe(guardrail.team)}"
                  + (f" (reopened by hand for {state.reopened_by_hand})" if state.reopened_by_hand else ""))
    except Exception:
        log.exception("gpucluster-budget %s failed", command)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
