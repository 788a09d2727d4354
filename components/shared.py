"""What both flavours of a cluster build alike: the stack's one provider and its account, the network, the file
system and the budget, and the stack outputs that describe them."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from components.budget import Budget, BudgetArgs
from components.iam import account_id
from components.network import Network, NetworkArgs
from components.storage import Storage, StorageArgs
from gpucluster.spec import cost
from gpucluster.spec.model import Stack


@dataclass(frozen=True)
class SharedParts:
    opts: pulumi.ResourceOptions  # puts a component on the stack's provider
    account_id: pulumi.Output[str]
    network: Network
    storage: Storage
    budget: Budget


def provider_options(stack: Stack) -> pulumi.ResourceOptions:
    """The one provider of the stack: every taggable resource gets the cluster, team and stack tags from it."""
    provider = aws.Provider("aws", region=stack.region, default_tags={"tags": stack.tags})
    return pulumi.ResourceOptions(provider=provider)


def create_shared_parts(stack: Stack) -> SharedParts:
    spec = stack.spec
    opts = provider_options(stack)
    account = account_id(opts)
    network = Network(stack.cluster_name, NetworkArgs(
        region=stack.region, availability_zone=spec.availability_zone, vpc_cidr=spec.network.vpc_cidr,
        vpc_id=spec.network.vpc_id, subnet_id=spec.network.subnet_id), opts)
    storage = Storage(stack.cluster_name, StorageArgs(
        lustre=spec.storage.lustre, region=stack.region, subnet_id=network.subnet_id,
        security_group_id=network.security_group_id, security_group_rules=network.security_group_rules), opts)
    budget = Budget(stack.cluster_name, BudgetArgs(
        budget_name=stack.budget_name, spec=spec.budget, stack=stack.name, account_id=account,
        activate_cost_tag=spec.budget.activate_cost_allocation_tag), opts)
    return SharedParts(opts=opts, account_id=account, network=network, storage=storage, budget=budget)


def shared_outputs(stack: Stack, parts: SharedParts) -> dict[str, object]:
    """The stack outputs both flavours export: where the cluster lives, its file system, its budget, its hourly cost."""
    network, storage, budget = parts.network, parts.storage, parts.budget
    estimate = cost.estimate(stack)
    return {
        "vpc_id": network.vpc_id,
        "subnet_id": network.subnet_id,
        "security_group_id": network.security_group_id,
        "fsx_file_system_id": storage.file_system_id,
        "fsx_dns_name": storage.dns_name,
        "fsx_mount_name": storage.mount_name,
        "data_repository": storage.data_repository,
        "budget_name": budget.budget_name,
        "alerts_topic_arn": budget.topic_arn,
        "hourly_cost_usd_min": round(estimate.hourly_min, 2),
        "hourly_cost_usd_max": round(estimate.hourly_max, 2),
    }
