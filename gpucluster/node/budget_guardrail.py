#!/usr/bin/env python3
"""gpucluster's budget guardrail on the head node (settings.BUDGET_PROGRAM), run as the service BUDGET_UNIT.

AWS Budgets publishes its notifications to the stack's SNS topic; an SQS queue subscribed to it wakes this program.
The budget itself (DescribeBudget) is the truth, read on every message and every `check_seconds`:

- spend at or over the act threshold: the cluster's partitions go DOWN (queued and new jobs pend, running jobs finish),
  each pending job gets an AdminComment naming the budget (Slurm's own reason reads PartitionDown, and Slurm lets no
  program set it), idle nodes are powered down now instead of after SuspendTime, the reconciler stops launching
  always-on nodes;
- spend back under it (a new month, a raised limit): the partitions it closed reopen and the Budgets action's launch
  deny on the head node's role is reversed.

By hand: `gpucluster-budget status | check | close | reopen`. `reopen` holds for the rest of the month (a person
decided to spend more); `close` holds until someone reopens. Every action is logged (journal and log file) and
published to the topic, so the budget's subscribers hear of it. Standard library and boto3.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the library this program is part of (the bundle's lib/)
from gpucluster.contract import reasons
from gpucluster.contract.settings import BUDGET_TEXTFILE, TEXTFILE_DIR, BudgetSettings, ClusterSettings
from gpucluster.node import sqs_poll
from gpucluster.node.budget import BudgetSpend, GuardrailState, read_spend
from gpucluster.node.program import setup_logging
from gpucluster.node.slurm_control import SlurmControl
from gpucluster.node.textfile import family, sample, write

log = logging.getLogger("gpucluster-budget")


def publish_spend(spend: BudgetSpend, directory: Path) -> None:
    """The budget for the cost board, through node_exporter's textfile collector."""
    figures = [("limit", spend.limit, "The team's monthly budget"), ("actual", spend.actual, "Spend this month"),
               ("forecast", spend.forecast, "AWS's forecast of this month's spend")]
    write("".join(family(f"gpucluster_budget_{name}_usd", "gauge", f"{text} (AWS Budgets).",
                         [sample(f"gpucluster_budget_{name}_usd", value)])
                  for name, value, text in figures if value is not None), directory, BUDGET_TEXTFILE)


def month(now: float) -> str:
    return time.strftime("%Y-%m", time.gmtime(now))


class Guardrail:
    def __init__(self, config: ClusterSettings, guard: BudgetSettings, slurm: SlurmControl, budgets: Any,
                 sns: Any, team: str, metrics_dir: Path | None = None) -> None:
        self.config, self.guard, self.slurm, self.team = config, guard, slurm, team
        self.budgets, self.sns = budgets, sns
        self.state_path = Path(config.budget_state_file)
        self.metrics_dir = metrics_dir  # where the spend goes for Prometheus (None: nowhere)

    @contextmanager
    def _state(self) -> Iterator[GuardrailState]:
        """The state, locked against the service and a person's command running at once, saved on the way out."""
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.state_path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            state = GuardrailState.load(self.state_path)
            yield state
            state.save(self.state_path)

    def spend(self) -> BudgetSpend:
        spend = read_spend(self.budgets, self.guard.account_id, self.guard.budget_name,
                           self.guard.act_threshold_percent)
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
    def _close(self, state: GuardrailState, why: str, now: float) -> None:
        up = sorted(name for name, st in self.slurm.partitions().items() if st == "UP")
        state.closed, state.reason, state.since = True, why, now
        state.partitions = sorted(set(state.partitions) | set(up))
        self._enforce(state)
        self._tell("closed the partitions", f"{why}. Partitions {', '.join(state.partitions)} are DOWN: queued and "
                   "new jobs wait, running jobs finish, idle nodes are released. They reopen when spend falls under "
                   "the threshold (new month, raised budget) or with `sudo gpucluster-budget reopen` on the head node.")

    def _enforce(self, state: GuardrailState) -> None:
        partitions = self.slurm.partitions()
        still_up = [p for p in state.partitions if partitions.get(p) == "UP"]
        self.slurm.set_partition_state(still_up, "DOWN")
        comment = f"{reasons.BUDGET}: partitions closed: {state.reason}"
        for job, current in self.slurm.pending_jobs().items():
            if current != comment:
                self.slurm.set_admin_comment(job, comment)
        released = self.slurm.power_down_idle(keep=self.config.always_on_nodes())
        if released:
            log.info("budget closed: powering down idle node(s) %s", ",".join(released))

    def _reopen(self, state: GuardrailState, why: str, always_tell: bool = False) -> None:
        closed_here = state.partitions
        existing = self.slurm.partitions()
        self.slurm.set_partition_state([p for p in closed_here if p in existing], "UP")
        for job, current in self.slurm.pending_jobs().items():
            if current.startswith(reasons.BUDGET):
                self.slurm.set_admin_comment(job, "")
        denied = [n.name for n in self.slurm.nodes()
                  if n.reason.startswith(reasons.LAUNCH_DENIED) and "DOWN" in n.state]
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


def serve(guardrail: Guardrail, sqs: Any, stop: Callable[[], bool] = lambda: False,
          wait_seconds: int = sqs_poll.RECEIVE_WAIT_SECONDS, sleep: Callable[[float], None] = time.sleep) -> None:
    """The service: wake on a budget message or every check_seconds, and sweep while closed at every wait's end (so
    the wait is the pace of the sweep over new pending jobs). Messages are deleted only once acted on: a failed check
    leaves them to come back after the visibility timeout, and pauses the service for a wait."""
    next_check = 0.0

    def act(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        nonlocal next_check
        for message in messages:
            log.info("notification: %s", _subject(message["Body"]))
        if messages or time.time() >= next_check:
            log.info("budget check: %s", guardrail.check())
            next_check = time.time() + guardrail.guard.check_seconds
        else:
            guardrail.sweep()
        return messages

    sqs_poll.serve(sqs, guardrail.guard.queue_url, act, stop, lambda: wait_seconds, retry_seconds=wait_seconds,
                   sleep=sleep)


def _subject(body: str) -> str:
    """SNS wraps the budget's text in an envelope with a Subject."""
    try:
        envelope: dict[str, Any] = json.loads(body)
        return str(envelope.get("Subject") or envelope.get("Message", "")[:120])
    except ValueError:
        return body[:120]


def clients(config: ClusterSettings) -> tuple[Any, Any, Any]:
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
    setup_logging(config.log_file)
    if config.budget is None:
        print("this cluster has no budget guardrail (budget.act_threshold_percent is null)", file=sys.stderr)
        return 2
    budgets, sns, sqs = clients(config)
    guardrail = Guardrail(config, config.budget, SlurmControl(config.scontrol), budgets, sns, config.team,
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
            state = GuardrailState.load(guardrail.state_path)
            reason = state.reason or guardrail.spend().describe(guardrail.team)
            print(f"{'CLOSED' if state.closed else 'open'}: {reason}"
                  + (f" (reopened by hand for {state.reopened_by_hand})" if state.reopened_by_hand else ""))
    except Exception:
        log.exception("gpucluster-budget %s failed", command)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
