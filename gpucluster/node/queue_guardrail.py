"""The Kubernetes flavour's budget guardrail, run in the cluster (gpucluster/render/kube.py ships it in a ConfigMap,
with the modules of this package it imports, and components/kubernetes.py (QueueGuardrail) deploys it).

Every message on the budget's queue (AWS Budgets notifications, through SNS) wakes it, and so does a timer: it reads
the budget's actual spend and, at the act threshold, holds the team's Kueue ClusterQueue (`stopPolicy: Hold`: running
jobs finish, new ones wait); below it, reopens the queue (`stopPolicy: None`) and reverses the Budgets action that
denied the autoscaler's scale-up, if it ran. The queue's long-poll loop and the budget decision are the Slurm head
guardrail's (sqs_poll, budget). Standard library and boto3 only.
"""

from __future__ import annotations

import json
import logging
import os
import ssl
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the library this program is part of (the ConfigMap's)
from gpucluster.node import sqs_poll
from gpucluster.node.budget import read_spend

SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
KUEUE_PATH = "/apis/kueue.x-k8s.io/v1beta2/clusterqueues/"
RECHECK_SECONDS = 600  # also without a message: spend falls back at the month's turn with no notification


def patch_body(policy: str) -> bytes:
    return json.dumps({"spec": {"stopPolicy": policy}}).encode()


def set_stop_policy(cluster_queue: str, policy: str) -> None:
    with open(f"{SERVICE_ACCOUNT}/token") as f:
        token = f.read()
    host = os.environ["KUBERNETES_SERVICE_HOST"]
    request = urllib.request.Request(
        f"https://{host}{KUEUE_PATH}{cluster_queue}", data=patch_body(policy), method="PATCH",
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/merge-patch+json"})
    context = ssl.create_default_context(cafile=f"{SERVICE_ACCOUNT}/ca.crt")
    with urllib.request.urlopen(request, context=context, timeout=30):
        pass


def decide(budgets: Any, account: str, budget_name: str, act_threshold_percent: int) -> dict[str, Any]:
    """Read the budget and say what the ClusterQueue's stopPolicy should be: Hold at or past the act threshold of the
    month's budget, None (open) below it."""
    spend = read_spend(budgets, account, budget_name, act_threshold_percent)
    return {"actual_usd": spend.actual, "limit_usd": spend.limit, "stop_policy": "Hold" if spend.over else "None"}


def lift_launch_deny(budgets: Any, account: str, budget_name: str, action_id: str) -> bool:
    """Reverse the launch-deny action if AWS Budgets executed it; True if it did. Only this one action: the role may
    describe and execute nothing else."""
    action = budgets.describe_budget_action(AccountId=account, BudgetName=budget_name, ActionId=action_id)["Action"]
    if action["Status"] != "EXECUTION_SUCCESS":
        return False
    budgets.execute_budget_action(AccountId=account, BudgetName=budget_name, ActionId=action_id,
                                  ExecutionType="REVERSE_BUDGET_ACTION")
    return True


def step(budgets: Any, account: str, budget_name: str, act_threshold_percent: int, action_id: str) -> dict[str, Any]:
    """One check: the queue's stopPolicy to set, and below the threshold the deny lifted."""
    decision = decide(budgets, account, budget_name, act_threshold_percent)
    if decision["stop_policy"] == "None":
        decision["launch_deny_reversed"] = lift_launch_deny(budgets, account, budget_name, action_id)
    return decision


def main() -> None:
    import boto3

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(levelname)s %(message)s")
    queue_url, budget_name = os.environ["QUEUE_URL"], os.environ["BUDGET_NAME"]
    cluster_queue, act = os.environ["CLUSTER_QUEUE"], int(os.environ["ACT_THRESHOLD_PERCENT"])
    action_id = os.environ["LAUNCH_DENY_ACTION_ID"]
    sqs, budgets = boto3.client("sqs"), boto3.client("budgets")
    account = boto3.client("sts").get_caller_identity()["Account"]
    next_check = 0.0

    def check(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        nonlocal next_check
        if messages or time.time() >= next_check:
            decision = step(budgets, account, budget_name, act, action_id)
            set_stop_policy(cluster_queue, decision["stop_policy"])
            print(json.dumps(decision), flush=True)
            next_check = time.time() + RECHECK_SECONDS
        return messages

    sqs_poll.serve(sqs, queue_url, check)


if __name__ == "__main__":
    main()
