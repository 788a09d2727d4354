"""The Kubernetes flavour's budget guardrail, run in the cluster (components/eks_stack.py mounts this file).

Every message on the budget's queue (AWS Budgets notifications, through SNS) wakes it, and so does a timer: it reads
the budget's actual spend and, at the act threshold, holds the team's Kueue ClusterQueue (`stopPolicy: Hold`: running
jobs finish, new ones wait); below it, reopens the queue (`stopPolicy: None`) and reverses the Budgets action that
denied the autoscaler's scale-up, if it ran (as the Slurm head's guardrail does, gpucluster/node/gpucluster_budget.py:
that file is not in this container, so the few lines live here). Standard library and boto3 only.
"""

from __future__ import annotations

import json
import os
import ssl
import urllib.request
from typing import Any

SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
KUEUE_PATH = "/apis/kueue.x-k8s.io/v1beta2/clusterqueues/"
RECHECK_SECONDS = 600  # also without a message: spend falls back at the month's turn with no notification


def stop_policy(actual_usd: float, limit_usd: float, act_threshold_percent: int) -> str:
    """Hold at or past the act threshold of the month's budget; None (open) below it."""
    return "Hold" if actual_usd >= limit_usd * act_threshold_percent / 100 else "None"


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
    """Read the budget and say what the ClusterQueue's stopPolicy should be."""
    budget = budgets.describe_budget(AccountId=account, BudgetName=budget_name)["Budget"]
    actual = float(budget["CalculatedSpend"]["ActualSpend"]["Amount"])
    limit = float(budget["BudgetLimit"]["Amount"])
    return {"actual_usd": actual, "limit_usd": limit,
            "stop_policy": stop_policy(actual, limit, act_threshold_percent)}


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

    queue_url, budget_name = os.environ["QUEUE_URL"], os.environ["BUDGET_NAME"]
    cluster_queue, act = os.environ["CLUSTER_QUEUE"], int(os.environ["ACT_THRESHOLD_PERCENT"])
    action_id = os.environ["LAUNCH_DENY_ACTION_ID"]
    sqs, budgets = boto3.client("sqs"), boto3.client("budgets")
    account = boto3.client("sts").get_caller_identity()["Account"]
    waited = RECHECK_SECONDS
    while True:
        messages = sqs.receive_message(QueueUrl=queue_url, WaitTimeSeconds=20, MaxNumberOfMessages=10).get("Messages", [])
        waited += 20
        if messages or waited >= RECHECK_SECONDS:
            decision = step(budgets, account, budget_name, act, action_id)
            set_stop_policy(cluster_queue, decision["stop_policy"])
            print(json.dumps(decision), flush=True)
            waited = 0
        for message in messages:
            sqs.delete_message(QueueUrl=queue_url, ReceiptHandle=message["ReceiptHandle"])


if __name__ == "__main__":
    main()
