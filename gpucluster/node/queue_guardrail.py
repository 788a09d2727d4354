"""The Kubernetes flavour's budget guardrail, run in the cluster (gpucluster/render/kube.py ships it in a ConfigMap,
with the modules of this package it imports, and components/kubernetes.py (QueueGuardrail) deploys it).

Every message on the budget's queue (AWS Budgets notifications, through SNS) wakes it, and so does a timer: it reads
the budget's actual spend and each of the team's Kueue ClusterQueues (the accelerator queue and the CPU queue: both
spend), and decides for each on its own (`decide`):

- at or past the act threshold, an open queue is held (`stopPolicy: Hold`: running jobs finish, new ones wait), and
  the hold is marked as the guardrail's by the annotation `gpucluster/held-by`, set in the same patch;
- below it, the guardrail reopens only a hold it made (stopPolicy None, the annotation removed in the same patch), and
  reverses the Budgets action that denied the autoscaler's scale-up, if it ran.

A person's hold (Hold or HoldAndDrain without the annotation) is left alone at any spend, and logged: only a person
reopens it. An admin who takes over the guardrail's hold removes the annotation
(`kubectl annotate clusterqueue TEAM gpucluster/held-by-`); one who escalates it to HoldAndDrain keeps it theirs too.
An admin's reopening is respected below the threshold (the stale annotation is dropped, so a later manual hold stays
manual); past the threshold the queue is held again at the next check: the budget's hold is what the team was
promised, and a `kubectl patch` carries no record of who decided to spend more or until when (the Slurm flavour's
`gpucluster-budget reopen` does). To spend past it, raise the budget's limit or act threshold in the stack file.

A new budget has no spend yet (AWS Budgets computes CalculatedSpend some hours after creation): that reads as $0, the
queues stay open. A failing AWS or Kubernetes call is logged with its cause (a ClusterQueue that fails does not keep
the other from being decided) and the check is made again on the next turn of the queue's loop; the budget's messages
are deleted only after a check that succeeded. The process never exits on a fault: a crash loop would hold or reopen
nothing. The queue's long-poll loop and the spend reading are the Slurm head guardrail's (sqs_poll, budget). Standard
library and boto3 only.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import sys
import time
import urllib.error
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the library this program is part of (the ConfigMap's)
from gpucluster.node import sqs_poll
from gpucluster.node.budget import BudgetSpend, read_spend
from gpucluster.node.kube_api import KubeApi

KUEUE_PATH = "/apis/kueue.x-k8s.io/v1beta2/clusterqueues/"
RECHECK_SECONDS = 600  # also without a message: spend falls back at the month's turn with no notification
HELD_BY = "gpucluster/held-by"  # the annotation that makes a hold the guardrail's
# Kueue v0.19.2's stopPolicy values (tests/schemas/kueue-v0.19.2-v1beta2.json); unset means "None".
OPEN, HOLD, HOLD_AND_DRAIN = "None", "Hold", "HoldAndDrain"

log = logging.getLogger("gpucluster-queue-guardrail")


class Action(enum.Enum):
    HOLD = "hold"
    REOPEN = "reopen"
    LEAVE = "leave"


@dataclass(frozen=True)
class Decision:
    action: Action
    why: str


def decide(spend: BudgetSpend, stop_policy: str, held_by_guardrail: bool) -> Decision:
    """What to do with one ClusterQueue, given the spend, its stopPolicy and whether it carries the guardrail's
    annotation (the module's docstring says why each case goes the way it does)."""
    if spend.over:
        if stop_policy != OPEN:
            return Decision(Action.LEAVE, "held by the guardrail" if held_by_guardrail else
                            f"held by hand ({stop_policy}): left to whoever held it")
        return Decision(Action.HOLD, "reopened by hand past the threshold: held again" if held_by_guardrail else
                        "at or past the act threshold: held")
    if not held_by_guardrail:
        return Decision(Action.LEAVE, "open" if stop_policy == OPEN else
                        f"held by hand ({stop_policy}): only a person reopens it")
    if stop_policy == HOLD_AND_DRAIN:
        return Decision(Action.LEAVE, "the guardrail's hold made HoldAndDrain by hand: left to whoever did it")
    return Decision(Action.REOPEN, "back under the act threshold: reopened" if stop_policy == HOLD else
                    "reopened by hand: the guardrail's claim on it is dropped")


def patch_body(action: Action, resource_version: str, reason: str = "") -> dict[str, Any]:
    """The merge patch for a hold or a reopening: the stopPolicy and the annotation change together, and only if the
    queue is still at the version the decision was made on (a merge patch carrying metadata.resourceVersion is
    conditional: a person's change in between fails it with 409 Conflict, as controller-runtime's
    MergeFromWithOptimisticLock relies on)."""
    held = action is Action.HOLD
    return {"metadata": {"resourceVersion": resource_version, "annotations": {HELD_BY: reason if held else None}},
            "spec": {"stopPolicy": HOLD if held else OPEN}}


@dataclass(frozen=True)
class ClusterQueue:
    """What the guardrail reads of one of the team's ClusterQueues."""

    stop_policy: str
    held_by_guardrail: bool
    resource_version: str

    @classmethod
    def from_object(cls, obj: dict[str, Any]) -> ClusterQueue:
        metadata = obj["metadata"]
        return cls(stop_policy=obj.get("spec", {}).get("stopPolicy", OPEN),
                   held_by_guardrail=HELD_BY in (metadata.get("annotations") or {}),
                   resource_version=metadata["resourceVersion"])


class ClusterQueueApi:
    """One ClusterQueue through the Kubernetes API: GET and merge PATCH, all the guardrail's RBAC allows."""

    def __init__(self, api: KubeApi, name: str) -> None:
        self.api, self.path = api, f"{KUEUE_PATH}{name}"

    def get(self) -> ClusterQueue:
        return ClusterQueue.from_object(self.api.call("GET", self.path))

    def patch(self, body: dict[str, Any]) -> None:
        self.api.call("PATCH", self.path, body)


def lift_launch_deny(budgets: Any, account: str, budget_name: str, action_id: str) -> bool:
    """Reverse the launch-deny action if AWS Budgets executed it; True if it did. Only this one action: the role may
    describe and execute nothing else."""
    action = budgets.describe_budget_action(AccountId=account, BudgetName=budget_name, ActionId=action_id)["Action"]
    if action["Status"] != "EXECUTION_SUCCESS":
        return False
    budgets.execute_budget_action(AccountId=account, BudgetName=budget_name, ActionId=action_id,
                                  ExecutionType="REVERSE_BUDGET_ACTION")
    return True


def cause(exc: Exception) -> str:
    """A failed call in one line: the Kubernetes API's own message for an HTTP error, else the exception."""
    if isinstance(exc, urllib.error.HTTPError):
        try:
            message = json.loads(exc.read()).get("message", "")
        except (ValueError, OSError, AttributeError):
            message = ""
        return f"HTTP {exc.code} {exc.reason}: {message}".rstrip(": ")
    return f"{type(exc).__name__}: {exc}"


@dataclass(frozen=True)
class Settings:
    """The Deployment's environment (gpucluster/render/kube.py guardrail_manifests)."""

    queue_url: str
    budget_name: str
    team: str
    cluster_queues: tuple[str, ...]  # CLUSTER_QUEUES: names separated by commas
    act_threshold_percent: int
    launch_deny_action_id: str

    @classmethod
    def from_environment(cls) -> Settings:
        return cls(os.environ["QUEUE_URL"], os.environ["BUDGET_NAME"], os.environ["TEAM"],
                   tuple(name for name in os.environ["CLUSTER_QUEUES"].split(",") if name),
                   int(os.environ["ACT_THRESHOLD_PERCENT"]), os.environ["LAUNCH_DENY_ACTION_ID"])


class CheckFailed(Exception):
    """Some of a check's calls failed (each named with its cause); the rest were made."""


class Guardrail:
    def __init__(self, settings: Settings, budgets: Any, sts: Any, queues: dict[str, ClusterQueueApi]) -> None:
        self.settings, self.budgets, self.sts, self.queues = settings, budgets, sts, queues
        self.account = ""  # asked of STS at the first check, not at start: a start cannot fail on AWS
        self.next_check = 0.0

    def check(self) -> dict[str, Any]:
        """One check: read the spend, then each queue and act on its decision; below the threshold, lift the deny.
        Raises on a failed call (the caller logs it and checks again), after deciding every queue it could read."""
        s = self.settings
        if not self.account:
            self.account = self.sts.get_caller_identity()["Account"]
        spend = read_spend(self.budgets, self.account, s.budget_name, s.act_threshold_percent)
        outcome: dict[str, Any] = {"actual_usd": spend.actual, "limit_usd": spend.limit,
                                   "spend_computed": spend.computed, "queues": {}}
        failed: list[str] = []
        for name, api in self.queues.items():
            try:
                outcome["queues"][name] = self.check_queue(spend, api)
            except Exception as exc:  # the other queues are still decided
                failed.append(f"{name}: {cause(exc)}")
        if failed:
            raise CheckFailed("; ".join(failed))
        if not spend.over:
            outcome["launch_deny_reversed"] = lift_launch_deny(self.budgets, self.account, s.budget_name,
                                                               s.launch_deny_action_id)
        return outcome

    def check_queue(self, spend: BudgetSpend, api: ClusterQueueApi) -> dict[str, str]:
        queue = api.get()
        decision = decide(spend, queue.stop_policy, queue.held_by_guardrail)
        if decision.action is not Action.LEAVE:
            api.patch(patch_body(decision.action, queue.resource_version, spend.describe(self.settings.team)))
        return {"stop_policy": queue.stop_policy, "action": decision.action.value, "why": decision.why}

    def on_messages(self, messages: list[sqs_poll.Message], now: float) -> list[sqs_poll.Message]:
        """sqs_poll's act: check on a message or when the timer is due. The messages go back to be deleted only after
        a check that succeeded; after a failed one they stay, and the timer stays due, so the next turn checks
        again."""
        if not messages and now < self.next_check:
            return []
        try:
            outcome = self.check()
        except Exception as exc:  # any failed call: logged, and checked again; the process stays up
            log.error("check failed, trying again at the next check: %s", cause(exc))
            return []
        log.info("%s", json.dumps(outcome))
        self.next_check = now + RECHECK_SECONDS
        return messages


def serve(settings: Settings, client: Callable[[str], Any], api: KubeApi,
          stop: Callable[[], bool] = lambda: False) -> None:
    """The service until `stop`: the guardrail over the settings' queues, woken by the budget's queue or its timer;
    `client` makes a boto3 client by its service's name."""
    guardrail = Guardrail(settings, client("budgets"), client("sts"),
                          {name: ClusterQueueApi(api, name) for name in settings.cluster_queues})
    sqs_poll.serve(client("sqs"), settings.queue_url, lambda messages: guardrail.on_messages(messages, time.time()),
                   stop=stop)


def main() -> None:
    import boto3

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(levelname)s %(message)s")
    serve(Settings.from_environment(), boto3.client, KubeApi.in_cluster())


if __name__ == "__main__":
    main()
