"""The Kubernetes flavour of a cluster: the EKS control plane, a managed node group per pool, the cluster's software,
the team's namespace and the budget's hold on its queue (components/kubernetes.py), on the shared network, file system
and budget (components/shared.py). No head node, node images or Slurm wiring."""

from __future__ import annotations

import pulumi
import pulumi_kubernetes as k8s

from components.budget import LaunchDeny, LaunchDenyArgs
from components.kubernetes import (
    ClusterSoftware,
    ClusterSoftwareArgs,
    CpuNodes,
    CpuNodesArgs,
    EksCluster,
    EksClusterArgs,
    NodeGroupPlace,
    NodePool,
    NodePoolArgs,
    QueueGuardrail,
    QueueGuardrailArgs,
    TeamSpace,
    TeamSpaceArgs,
)
from components.network import control_plane_cidr
from components.shared import create_shared_parts, shared_outputs
from gpucluster.render import kube
from gpucluster.spec.model import Stack

# What the autoscaler's role may no longer do once the budget is spent: grow a node group.
SCALE_UP_ACTIONS = ("autoscaling:SetDesiredCapacity", "autoscaling:UpdateAutoScalingGroup")


def create_kubernetes_cluster(stack: Stack) -> dict[str, object]:
    """Declare every resource of a Kubernetes stack and return the stack outputs."""
    spec = stack.spec
    shared = create_shared_parts(stack)
    opts, network, storage, budget = shared.opts, shared.network, shared.storage, shared.budget
    cluster = EksCluster(stack.cluster_name, EksClusterArgs(
        stack=stack, vpc_id=network.vpc_id, subnet_id=network.subnet_id,
        control_plane_subnet_id=spec.eks.control_plane_subnet_id,
        control_plane_cidr=control_plane_cidr(spec.network.vpc_cidr) if spec.network.vpc_cidr else None,
        security_group_id=network.security_group_id, account_id=shared.account_id), opts)
    node_ready = [cluster.node_access, *cluster.node_policies, *cluster.node_addons]
    place = NodeGroupPlace(cluster_name=cluster.name, node_role_arn=cluster.node_role_arn, subnet_id=network.subnet_id,
                           security_group_ids=cluster.node_security_group_ids, version=cluster.version,
                           depends_on=node_ready)
    pools = {pool.name: NodePool(f"{stack.cluster_name}-{pool.name}", NodePoolArgs(stack=stack, pool=pool, place=place),
                                 opts)
             for pool in spec.pools}
    cpu_nodes = CpuNodes(f"{stack.cluster_name}-{kube.CPU_FLAVOR}", CpuNodesArgs(stack=stack, place=place), opts)
    # Everything in the cluster goes through the API with the identity running Pulumi, once a node runs the add-ons.
    provider = k8s.Provider("eks", kubeconfig=cluster.kubeconfig, enable_server_side_apply=True,
                            opts=pulumi.ResourceOptions(depends_on=[cluster.system_nodes, *cluster.addons]))
    if opts.provider is None:
        raise ValueError("the stack's resource options name no AWS provider (create_shared_parts sets one)")
    in_cluster = pulumi.ResourceOptions(providers={"aws": opts.provider, "kubernetes": provider})
    software = ClusterSoftware(stack.cluster_name, ClusterSoftwareArgs(
        stack=stack, cluster_name=cluster.name, cluster_arn=cluster.arn,
        node_group_names={name: pool.node_group_name for name, pool in pools.items()}
        | {kube.CPU_FLAVOR: cpu_nodes.node_group_name},
        alerts_topic_arn=budget.topic_arn), in_cluster)
    fsx = kube.Fsx(storage.file_system_id, storage.dns_name, storage.mount_name, fsx_capacity_gib(stack))
    TeamSpace(stack.cluster_name, TeamSpaceArgs(stack=stack, fsx=fsx, kueue=software.kueue,
                                                prometheus=software.prometheus), in_cluster)
    act = spec.budget.act_threshold_percent
    if act is not None:
        deny = LaunchDeny(stack.cluster_name, LaunchDenyArgs(
            budget_name=budget.budget_name, act_threshold_percent=act, role_name=software.autoscaler_role_name,
            role_arn=software.autoscaler_role_arn, topic_arn=budget.topic_arn, account_id=shared.account_id,
            denied_actions=SCALE_UP_ACTIONS), opts)
        QueueGuardrail(stack.cluster_name, QueueGuardrailArgs(
            stack=stack, cluster_name=cluster.name, budget_arn=budget.budget_arn,
            queue_url=budget.queue_url,  # type: ignore[arg-type]  # the budget has it: act is set
            queue_arn=budget.queue_arn,  # type: ignore[arg-type]  # the budget has it: act is set
            act_threshold_percent=act, launch_deny_action_id=deny.action_id, launch_deny_action_arn=deny.action_arn,
            kueue=software.kueue), in_cluster)
    return {
        **shared_outputs(stack, shared),
        "cluster_name": cluster.name,
        "kubeconfig_command": pulumi.Output.concat("aws eks update-kubeconfig --region ", stack.region, " --name ",
                                                  cluster.name),
        "team_role_arn": cluster.team_role_arn,
        "namespace": kube.namespace_name(stack),
        "local_queue": kube.LOCAL_QUEUE,
        "cpu_local_queue": kube.CPU_LOCAL_QUEUE,
        "node_groups": {name: pool.node_group_name for name, pool in pools.items()}
        | {kube.CPU_FLAVOR: cpu_nodes.node_group_name},
    }


def fsx_capacity_gib(stack: Stack) -> int:
    """The PersistentVolume's size: the file system's, or (an existing one, size unknown here) the smallest Lustre."""
    return stack.spec.storage.lustre.storage_capacity_gib or 1200
