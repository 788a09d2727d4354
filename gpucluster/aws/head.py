"""The stack's running head node, found by its tags with the caller's credentials: `gpucluster dashboard` forwards a
port to it, `gpucluster verify STACK` sends it a Run Command."""

from __future__ import annotations

from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from gpucluster.cli_errors import credentials_problem
from gpucluster.contract.settings import CLUSTER_TAG, head_instance_name
from gpucluster.spec.model import Stack


class HeadNotFound(Exception):
    """No single running head node, or AWS would not say: one line for the operator. Credentials that are missing or
    no longer valid are not this: botocore's error goes up for the command line to say (exit 2)."""


def running_head(ec2: Any, stack: Stack) -> str:
    """The instance id of the stack's one running head node."""
    heads = [i["InstanceId"] for i in _heads(ec2, stack, ["running"])]
    if len(heads) != 1:  # the head is replaced delete-before-replace: two running ones are for a human to look at
        raise HeadNotFound(f"{len(heads) or 'no'} running head node(s) of {stack.cluster_name} in {stack.region}"
                           f"{': ' + ', '.join(heads) if heads else _not_running(ec2, stack)}")
    return heads[0]


def _heads(ec2: Any, stack: Stack, states: list[str]) -> list[dict[str, Any]]:
    """The stack's head instances in these states, by id; AWS's refusal as HeadNotFound, but credentials that are
    missing or no longer valid go up for the command line to say."""
    try:
        reservations = ec2.describe_instances(Filters=[
            {"Name": f"tag:{CLUSTER_TAG}", "Values": [stack.cluster_name]},
            {"Name": "tag:Name", "Values": [head_instance_name(stack.cluster_name)]},
            {"Name": "instance-state-name", "Values": states}])["Reservations"]
    except (BotoCoreError, ClientError) as exc:
        if credentials_problem(exc):
            raise
        raise HeadNotFound(f"AWS answered: {exc}") from None
    return sorted((i for r in reservations for i in r["Instances"]), key=lambda i: str(i["InstanceId"]))


def _not_running(ec2: Any, stack: Stack) -> str:
    """Why there is no running head: the head's instances in another state (stopped, starting), or none."""
    found = _heads(ec2, stack, ["pending", "stopping", "stopped", "shutting-down"])
    others = [f"{i['InstanceId']} is {i['State']['Name']}" for i in found]
    if others:
        return f" ({', '.join(others)}: `aws ec2 start-instances` or `pulumi up` brings it back)"
    return " (is the stack up? `pulumi up` starts it)"
