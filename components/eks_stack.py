"""The Kubernetes flavour of the whole stack: what `create_cluster` declares for `scheduler: kubernetes`.

Network, storage and budget are the Slurm flavour's own components; the head node, node images and Slurm's wiring
are not built. The EKS control plane, node groups and cluster software come from components/kubernetes.py.
"""

from __future__ import annotations

import pulumi
import pulumi_aws as aws
import pulumi_kubernetes as k8s

from components import child
from components.budget import LaunchDeny, LaunchDenyArgs
from components.cluster import (create_budget, create_network, create_storage, network_and_storage_outputs,
                                provider_options)
from components.iam import ASSUME_AND_TAG, account_id, policy, trust
from components.kubernetes import (ClusterSoftware, ClusterSoftwareArgs, EksCluster, EksClusterArgs, NodePool,
                                   NodePoolArgs, TeamSpace, TeamSpaceArgs, declare)
from components.network import control_plane_cidr
from gpucluster.spec import cost, eks
from gpucluster.render import kube
from gpucluster.spec.model import Stack

# What the autoscaler's role may no longer do once the budget is spent: grow a node group.
SCALE_UP_ACTIONS = ("autoscaling:SetDesiredCapacity", "autoscaling:UpdateAutoScalingGroup")


class QueueGuardrail(pulumi.ComponentResource):
    """The budget's queue, read in the cluster by a small controller that holds the team's ClusterQueue at the act
    threshold and reopens it below (gpucluster/node/queue_guardrail.py), with its Pod Identity role."""

    def __init__(self, name: str, stack: Stack, cluster_name: pulumi.Input[str], queue_url: pulumi.Input[str],
                 queue_arn: pulumi.Input[str], budget_arn: pulumi.Input[str], act_threshold_percent: int,
                 launch_deny: LaunchDeny, after: list[pulumi.Resource], opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpucluster:kubernetes:QueueGuardrail", name, None, opts)
        role = aws.iam.Role(f"{name}-guardrail-pod", assume_role_policy=trust("pods.eks.amazonaws.com", ASSUME_AND_TAG),
                            opts=child(self))
        aws.iam.RolePolicy(f"{name}-guardrail-pod", role=role.id, policy=pulumi.Output.all(
            queue_arn, budget_arn, launch_deny.action_arn).apply(lambda a: policy([
                {"Sid": "BudgetQueue", "Effect": "Allow", "Action": ["sqs:ReceiveMessage", "sqs:DeleteMessage"],
                 "Resource": a[0]},
                {"Sid": "ReadBudget", "Effect": "Allow", "Action": "budgets:ViewBudget", "Resource": a[1]},
                # On reopening, lift the autoscaler's scale-up deny: whether it ran, and reversing it; that action only
                # (DescribeBudgetAction takes the action's ARN, where DescribeBudgetActionsForBudget needs the budget's).
                {"Sid": "ReverseLaunchDeny", "Effect": "Allow",
                 "Action": ["budgets:DescribeBudgetAction", "budgets:ExecuteBudgetAction"], "Resource": a[2]}])),
            opts=child(self))
        aws.eks.PodIdentityAssociation(f"{name}-guardrail", cluster_name=cluster_name, namespace=eks.KUEUE.namespace,
                                       service_account=kube.GUARDRAIL, role_arn=role.arn, opts=child(self))
        for manifest in kube.guardrail_manifests(stack, queue_url, act_threshold_percent, launch_deny.action_id):
            declare(manifest, child(self, depends_on=after))
        self.register_outputs({})


def create_kubernetes_cluster(stack: Stack) -> dict[str, object]:
    """Declare every resource of a Kubernetes stack and return the stack outputs."""
    spec = stack.spec
    opts = provider_options(stack)
    account = account_id(opts)
    network = create_network(stack, opts)
    storage = create_storage(stack, network, opts)
    budget = create_budget(stack, account, opts)
    cluster = EksCluster(stack.cluster_name, EksClusterArgs(
        stack=stack, vpc_id=network.vpc_id, subnet_id=network.subnet_id,
        control_plane_subnet_id=spec.eks.control_plane_subnet_id,
        control_plane_cidr=control_plane_cidr(spec.network.vpc_cidr) if spec.network.vpc_cidr else None,
        security_group_id=network.security_group_id, account_id=account), opts)
    node_ready = [cluster.node_access, *cluster.node_policies]
    pools = {pool.name: NodePool(f"{stack.cluster_name}-{pool.name}", NodePoolArgs(
        stack=stack, pool=pool, cluster_name=cluster.name, node_role_arn=cluster.node_role_arn,
        subnet_id=network.subnet_id, security_group_ids=cluster.node_security_group_ids,
        version=cluster.version, depends_on=node_ready), opts)
        for pool in spec.pools}
    # Everything in the cluster goes through the API with the identity running Pulumi, once a node runs the add-ons.
    provider = k8s.Provider("eks", kubeconfig=cluster.kubeconfig, enable_server_side_apply=True,
                            opts=pulumi.ResourceOptions(depends_on=[cluster.system_nodes, *cluster.addons]))
    in_cluster = pulumi.ResourceOptions(providers={"aws": opts.provider, "kubernetes": provider})
    software = ClusterSoftware(stack.cluster_name, ClusterSoftwareArgs(
        stack=stack, cluster_name=cluster.name, cluster_arn=cluster.arn,
        node_group_names={name: pool.node_group_name for name, pool in pools.items()},
        alerts_topic_arn=budget.topic_arn), in_cluster)
    fsx = kube.Fsx(storage.file_system_id, storage.dns_name, storage.mount_name, fsx_capacity_gib(stack))
    TeamSpace(stack.cluster_name, TeamSpaceArgs(stack=stack, fsx=fsx, kueue=software.kueue,
                                                prometheus=software.prometheus), in_cluster)
    act = spec.budget.act_threshold_percent
    if act is not None:
        deny = LaunchDeny(stack.cluster_name, LaunchDenyArgs(
            budget_name=budget.budget_name, act_threshold_percent=act, role_name=software.autoscaler_role_name,
            role_arn=software.autoscaler_role_arn, topic_arn=budget.topic_arn, account_id=account,
            denied_actions=SCALE_UP_ACTIONS), opts)
        QueueGuardrail(stack.cluster_name, stack, cluster.name, budget.queue_url, budget.queue_arn,  # type: ignore[arg-type]
                       budget.budget_arn, act, deny, [software.kueue], in_cluster)
    estimate = cost.estimate(stack)
    return {
        **network_and_storage_outputs(network, storage),
        "cluster_name": cluster.name,
        "kubeconfig_command": pulumi.Output.concat("aws eks update-kubeconfig --region ", stack.region, " --name ",
                                                  cluster.name),
        "team_role_arn": cluster.team_role_arn,
        "namespace": kube.namespace_name(stack),
        "local_queue": kube.LOCAL_QUEUE,
        "node_groups": {name: pool.node_group_name for name, pool in pools.items()},
        "budget_name": budget.budget_name,
        "alerts_topic_arn": budget.topic_arn,
        "hourly_cost_usd_min": round(estimate.hourly_min, 2),
        "hourly_cost_usd_max": round(estimate.hourly_max, 2),
    }


def fsx_capacity_gib(stack: Stack) -> int:
    """The PersistentVolume's size: the file system's, or (an existing one, size unknown here) the smallest Lustre."""
    return stack.spec.storage.lustre.storage_capacity_gib or 1200

