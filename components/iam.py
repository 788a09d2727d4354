"""IAM as the components write it: policy documents, trust policies, the statements several roles share, and the
account the stack deploys into (looked up once per stack, handed to each component that names it)."""

from __future__ import annotations

import json
from collections.abc import Sequence

import pulumi
import pulumi_aws as aws

MANAGED_POLICY = "arn:aws:iam::aws:policy/"  # AWS-managed policies, by name
EC2_ASSUME = json.dumps({"Version": "2012-10-17", "Statement": [
    {"Effect": "Allow", "Principal": {"Service": "ec2.amazonaws.com"}, "Action": "sts:AssumeRole"}]})
# EKS and its Pod Identity agent tag the sessions they open: the roles they assume trust both actions.
ASSUME_AND_TAG = ("sts:AssumeRole", "sts:TagSession")
# The image build instances only (Image Builder's documented pair with EC2InstanceProfileForImageBuilder).
SSM_CORE = MANAGED_POLICY + "AmazonSSMManagedInstanceCore"
# A node reads its settings and the munge key in one GetParameters call; GetParameter stays for single reads.
PARAMETER_READ = ["ssm:GetParameter", "ssm:GetParameters"]
# What the nodes' SSM agent needs for Session Manager (the ssmmessages channels) and Run Command (ec2messages, which
# `pulumi destroy` uses to close the partitions), and no more. Not AmazonSSMManagedInstanceCore: it also allows
# ssm:GetParameter(s) on every parameter of the account, another stack's munge key among them. These actions take no
# resource but "*".
SSM_AGENT: dict[str, object] = {"Sid": "SessionManagerAndRunCommand", "Effect": "Allow", "Resource": "*", "Action": [
    "ssm:UpdateInstanceInformation", "ssmmessages:CreateControlChannel", "ssmmessages:CreateDataChannel",
    "ssmmessages:OpenControlChannel", "ssmmessages:OpenDataChannel", "ec2messages:AcknowledgeMessage",
    "ec2messages:DeleteMessage", "ec2messages:FailMessage", "ec2messages:GetEndpoint", "ec2messages:GetMessages",
    "ec2messages:SendReply"]}


def policy(statements: list[dict[str, object]]) -> str:
    return json.dumps({"Version": "2012-10-17", "Statement": statements})


def trust(service: str, actions: Sequence[str] = ("sts:AssumeRole",)) -> str:
    """A role's trust policy: one AWS service may assume it."""
    return policy([{"Effect": "Allow", "Principal": {"Service": service}, "Action": list(actions)}])


def allow_service(service: str | list[str], action: str, resource: str, condition: dict[str, dict[str, str]]) -> str:
    """A resource policy letting one AWS service act on one resource, on behalf of one source only."""
    return policy([{"Effect": "Allow", "Principal": {"Service": service}, "Action": action, "Resource": resource,
                    "Condition": condition}])


def account_id(opts: pulumi.ResourceOptions) -> pulumi.Output[str]:
    """The account of the stack's provider (`opts` carries it): what ARNs and SourceAccount conditions name."""
    return aws.get_caller_identity_output(opts=pulumi.InvokeOutputOptions(provider=opts.provider)).account_id
