"""The Kubernetes flavour's components: an EKS cluster (EksCluster), one managed node group per pool (NodePool), and
what runs in the cluster (ClusterSoftware: autoscaler, device plugins, Kueue, monitoring; TeamSpace: the team's
namespace, quota, queues and file system; QueueGuardrail: the budget's hold on the team's queue). Every object is a
plain pulumi-aws or pulumi_kubernetes resource, so that the offline plan and the tests see each one; third-party
software is a pinned helm.v3.Release.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi_aws as aws
import pulumi_kubernetes as k8s

from components import child
from components.gpu_pool import launch_template, placement_group
from components.iam import ASSUME_AND_TAG, MANAGED_POLICY, policy, trust
from gpucluster.aws import checkip
from gpucluster.contract import settings
from gpucluster.render import kube, kube_health
from gpucluster.spec import eks
from gpucluster.spec.model import CONFIG_KEY, OPERATOR, PoolSpec, Stack, principal_key

ACCESS_POLICY = "arn:aws:eks::aws:cluster-access-policy/"
# The node role joins the cluster and pulls images; the VPC CNI's IP management is its own Pod Identity role, so that
# no pod on the node can use it.
NODE_POLICIES = ("AmazonEKSWorkerNodePolicy", "AmazonEC2ContainerRegistryPullOnly")
CNI_POLICY = "AmazonEKS_CNI_Policy"
AUTOSCALER_SERVICE_ACCOUNT = "cluster-autoscaler"
CAPACITY_TYPES = {"on-demand": "ON_DEMAND", "spot": "SPOT", "capacity-block": "CAPACITY_BLOCK"}
TAINT_EFFECTS = {"NoSchedule": "NO_SCHEDULE"}
NODE_TEMPLATE = "k8s.io/cluster-autoscaler/node-template"

# Node auto repair on the accelerator pools (EKS API reference: NodeRepairConfig, NodeRepairConfigOverrides; pulumi_aws
# 7.51.1 NodeGroupNodeRepairConfigArgs). The node monitoring agent sets the condition AcceleratedHardwareReady with a
# reason per fault (aws/eks-node-monitoring-agent v1.7.0 pkg/reasons/reasons.yaml, docs/node-health-issues.adoc). For
# the faults a reboot does not cure the action is Replace: NVIDIA's catalog gives them more than a GPU reset (XID 48
# double-bit ECC, 74 NVLink, 79 fallen off the bus, 95 uncontained memory error, 140 unrecoverable ECC), EC2 replaces
# on row remapping (63, 64), and the agent's docs say a fabric error persists across reboots (monitors/nvidia/dcgm/
# dcgm_policies.go lists the XIDs it raises a condition for). Other reasons keep EKS's own action.
REPAIR_CONDITION = "AcceleratedHardwareReady"
REPLACE_REASONS = {
    "nvidia": ("NvidiaXID48Error", "NvidiaXID63Error", "NvidiaXID64Error", "NvidiaXID74Error", "NvidiaXID79Error",
               "NvidiaXID95Error", "NvidiaXID140Error", "NvidiaDoubleBitError", "NvidiaNVLinkError",
               "NvidiaFabricError", "NvidiaDeviceCountMismatch"),
    "neuron": ("NeuronDMAError", "NeuronHBMUncorrectableError", "NeuronNCUncorrectableError",
               "NeuronSRAMUncorrectableError"),
}
# EKS's own wait before it repairs an AcceleratedHardwareReady fault (EKS user guide, node-repair: 10m): the pods see
# the fault first and a job checkpoints or fails over.
REPAIR_WAIT_MINUTES = 10
# One node repaired at a time, so a repair never takes more of a pool than the bad node; and no repair once over half
# of a pool is unhealthy: that is a bad AMI, driver or add-on, which replacing nodes would only repeat.
MAX_PARALLEL_REPAIRS = 1
MAX_UNHEALTHY_PERCENT = 50


def node_repair_config(pool: PoolSpec) -> aws.eks.NodeGroupNodeRepairConfigArgsDict:
    return {"enabled": True, "max_parallel_nodes_repaired_count": MAX_PARALLEL_REPAIRS,
            "max_unhealthy_node_threshold_percentage": MAX_UNHEALTHY_PERCENT,
            "node_repair_config_overrides": [
                {"node_monitoring_condition": REPAIR_CONDITION, "node_unhealthy_reason": reason,
                 "repair_action": "Replace", "min_repair_wait_time_mins": REPAIR_WAIT_MINUTES}
                for reason in REPLACE_REASONS[pool.accelerator.kind]]}


@dataclass(frozen=True)
class EksClusterArgs:
    stack: Stack
    vpc_id: pulumi.Input[str]
    subnet_id: pulumi.Input[str]  # the stack's one AZ: nodes, FSx
    control_plane_subnet_id: pulumi.Input[str] | None  # an existing subnet in another AZ; None: create a small one
    control_plane_cidr: str | None  # the small subnet's range in a new VPC
    security_group_id: pulumi.Input[str]
    account_id: pulumi.Input[str]  # components.iam.account_id: the team role's trust names it


class EksCluster(pulumi.ComponentResource):
    """The control plane: private endpoint (public only for kubernetes.public_access_cidrs, the private one also for
    private_access_cidrs), secrets under a KMS key, API-mode access entries, managed add-ons."""

    name: pulumi.Output[str]
    arn: pulumi.Output[str]
    node_role_arn: pulumi.Output[str]
    kubeconfig: pulumi.Output[str]
    version: pulumi.Output[str]
    node_security_group_ids: list[pulumi.Input[str]]

    def __init__(self, name: str, args: EksClusterArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpucluster:kubernetes:EksCluster", name, None, opts)
        stack, settings_ = args.stack, args.stack.spec.eks
        second_subnet = args.control_plane_subnet_id
        if second_subnet is None:
            if not args.control_plane_cidr:
                raise ValueError("the EKS control plane needs a second subnet: control_plane_subnet_id (an existing "
                                 "subnet in another AZ) or control_plane_cidr (the range of a new VPC to create one "
                                 "in)")
            zone = settings_.control_plane_availability_zone or other_zone(stack.spec.availability_zone)
            # Holds only the control plane's interfaces, which talk to the nodes inside the VPC: no route out needed.
            second_subnet = aws.ec2.Subnet(
                f"{name}-control-plane", vpc_id=args.vpc_id, cidr_block=args.control_plane_cidr,
                availability_zone=zone, map_public_ip_on_launch=False, tags={"Name": f"{name}-control-plane"},
                opts=child(self)).id
        key = aws.kms.Key(f"{name}-secrets", description=f"{name}: Kubernetes secrets envelope encryption",
                          enable_key_rotation=True, deletion_window_in_days=7, opts=child(self))
        role = aws.iam.Role(f"{name}-eks", assume_role_policy=trust("eks.amazonaws.com", ASSUME_AND_TAG),
                            opts=child(self))
        attached = [aws.iam.RolePolicyAttachment(f"{name}-eks-cluster", role=role.name,
                                                 policy_arn=MANAGED_POLICY + "AmazonEKSClusterPolicy",
                                                 opts=child(self))]
        try:
            public_cidrs = checkip.public_access_cidrs(settings_.public_access_cidrs)
        except checkip.LookupFailed as exc:
            raise pulumi.RunError(f"{CONFIG_KEY}.kubernetes.public_access_cidrs: {OPERATOR!r} is this machine's "
                                  f"public address, which could not be looked up: {exc} (list the network's CIDRs "
                                  "instead)") from None
        # The nodes' group, which lets members talk freely to each other: control plane <-> kubelets.
        groups: list[pulumi.Input[str]] = [args.security_group_id]
        if not stack.spec.network.creates_vpc:
            # In an existing network, the private endpoint's own group: HTTPS from the networks that reach the VPC
            # (kubernetes.private_access_cidrs) and from nothing else; the nodes' group never opens 443. There even
            # while the list is empty, so that listing networks later adds rules, not a group to the cluster.
            api_group = aws.ec2.SecurityGroup(
                f"{name}-api", vpc_id=args.vpc_id,
                description="EKS API private endpoint: HTTPS from kubernetes.private_access_cidrs", opts=child(self))
            # Named by network (each once): removing one from the list takes only its own rule.
            for cidr in dict.fromkeys(settings_.private_access_cidrs):
                aws.vpc.SecurityGroupIngressRule(
                    f"{name}-api-{cidr.replace('/', '-')}", security_group_id=api_group.id, cidr_ipv4=cidr,
                    ip_protocol="tcp", from_port=443, to_port=443,
                    description=f"Kubernetes API from {cidr} (kubernetes.private_access_cidrs)", opts=child(self))
            groups.append(api_group.id)
        cluster = aws.eks.Cluster(
            f"{name}-eks",
            name=stack.cluster_name,
            version=settings_.version,
            role_arn=role.arn,
            vpc_config={"subnet_ids": [args.subnet_id, second_subnet],
                        "security_group_ids": groups,
                        "endpoint_private_access": True,
                        "endpoint_public_access": bool(public_cidrs),
                        "public_access_cidrs": public_cidrs or None},
            access_config={"authentication_mode": "API",
                           # The identity running `pulumi up` declares the Kubernetes objects below through the API.
                           "bootstrap_cluster_creator_admin_permissions": True},
            encryption_config={"resources": ["secrets"], "provider": {"key_arn": key.arn}},
            upgrade_policy={"support_type": "STANDARD"},
            enabled_cluster_log_types=["api", "audit", "authenticator"],
            # Add-ons below are EKS-managed; nothing self-managed underneath them.
            bootstrap_self_managed_addons=False,
            opts=child(self, depends_on=attached),
        )
        node_role = aws.iam.Role(f"{name}-node", assume_role_policy=trust("ec2.amazonaws.com"), opts=child(self))
        node_policies = [aws.iam.RolePolicyAttachment(f"{name}-node-{p}", role=node_role.name,
                                                      policy_arn=MANAGED_POLICY + p, opts=child(self))
                         for p in NODE_POLICIES]
        self.node_access = aws.eks.AccessEntry(f"{name}-nodes", cluster_name=cluster.name,
                                               principal_arn=node_role.arn, type="EC2_LINUX", opts=child(self))
        self.node_policies = node_policies
        node_addons = self._addons(name, stack, cluster, eks.NODE_ADDONS, {})
        # Every node group waits for them: without the CNI no node of it becomes Ready.
        self.node_addons = list(node_addons.values())
        # EKS adds its cluster security group to a node group's nodes only when their launch template names none:
        # every node group's template names both it (the control plane's and managed add-ons' group) and the stack's
        # (members talk freely), so that pods on system and accelerator nodes reach each other.
        self.node_security_group_ids = [args.security_group_id, cluster.vpc_config.cluster_security_group_id]
        system_template = plain_launch_template(f"{name}-system-lt", f"{stack.cluster_name} system node group",
                                               self.node_security_group_ids, child(self))
        self.system_nodes = aws.eks.NodeGroup(
            f"{name}-system", cluster_name=cluster.name, node_group_name=f"{stack.cluster_name}-system",
            version=cluster.version,
            node_role_arn=node_role.arn, subnet_ids=[args.subnet_id], ami_type="AL2023_x86_64_STANDARD",
            instance_types=[eks.SYSTEM_INSTANCE_TYPE], capacity_type="ON_DEMAND",
            launch_template={"id": system_template.id, "version": system_template.latest_version.apply(str)},
            scaling_config={"min_size": eks.SYSTEM_NODES, "max_size": eks.SYSTEM_NODES,
                            "desired_size": eks.SYSTEM_NODES},
            labels={"gpucluster/role": "system"},
            taints=[{"key": kube.SYSTEM_TAINT["key"], "value": kube.SYSTEM_TAINT["value"],
                     "effect": TAINT_EFFECTS[kube.SYSTEM_TAINT["effect"]]}],
            opts=child(self, depends_on=[self.node_access, *node_policies, *node_addons.values()]))
        self._admins(name, cluster, settings_.admin_role_arns)
        self.team_role_arn = self._team(name, stack, cluster, args.account_id)
        self._people(name, stack, cluster)
        pod_addons = self._addons(name, stack, cluster, [a for a in eks.ADDONS if a not in eks.NODE_ADDONS],
                                  node_addons, after=[self.system_nodes])
        self.addons = [{**node_addons, **pod_addons}[a] for a in eks.ADDONS]
        self.name, self.arn, self.node_role_arn = cluster.name, cluster.arn, node_role.arn
        self.version = cluster.version
        self.kubeconfig = pulumi.Output.all(cluster.name, cluster.endpoint, cluster.certificate_authority).apply(
            lambda a: kubeconfig(a[0], a[1], a[2]["data"], stack.region))
        self.register_outputs({"name": self.name, "arn": self.arn, "node_role_arn": self.node_role_arn,
                               "team_role_arn": self.team_role_arn})

    def _addons(self, name: str, stack: Stack, cluster: aws.eks.Cluster, names: Sequence[str],
                made: dict[str, aws.eks.Addon], after: Sequence[pulumi.Resource] = ()) -> dict[str, aws.eks.Addon]:
        """Managed add-ons; the VPC CNI with its own Pod Identity role, once the Pod Identity agent is there."""
        addons = dict(made)
        for addon in sorted(names, key=lambda a: a != "eks-pod-identity-agent"):
            vpc_cni = addon == "vpc-cni"
            association: list[aws.eks.AddonPodIdentityAssociationArgsDict] | None = None
            if vpc_cni:
                cni = aws.iam.Role(f"{name}-vpc-cni",
                                   assume_role_policy=trust("pods.eks.amazonaws.com", ASSUME_AND_TAG), opts=child(self))
                aws.iam.RolePolicyAttachment(f"{name}-vpc-cni", role=cni.name,
                                             policy_arn=MANAGED_POLICY + CNI_POLICY, opts=child(self))
                association = [{"role_arn": cni.arn, "service_account": "aws-node"}]
            addons[addon] = aws.eks.Addon(
                f"{name}-{addon}", cluster_name=cluster.name, addon_name=addon,
                resolve_conflicts_on_create="OVERWRITE", resolve_conflicts_on_update="PRESERVE",
                pod_identity_associations=association,
                configuration_values=addon_configuration(stack, addon),
                opts=child(self, depends_on=[*after, *([addons["eks-pod-identity-agent"]] if vpc_cni else [])]))
        return {a: addons[a] for a in names}

    def _admins(self, name: str, cluster: aws.eks.Cluster, role_arns: Sequence[str]) -> None:
        for i, arn in enumerate(role_arns):  # by the principal, as the people's (member_resource says why)
            resource = member_resource(name, arn, "admin")
            aliases = [pulumi.Alias(name=f"{name}-admin-{i}")]
            entry = aws.eks.AccessEntry(resource, cluster_name=cluster.name, principal_arn=arn, type="STANDARD",
                                        opts=child(self, delete_before_replace=True, aliases=aliases))
            aws.eks.AccessPolicyAssociation(resource, cluster_name=cluster.name, principal_arn=arn,
                                            policy_arn=ACCESS_POLICY + "AmazonEKSClusterAdminPolicy",
                                            access_scope={"type": "cluster"},
                                            opts=child(self, depends_on=[entry], delete_before_replace=True,
                                                       aliases=aliases))

    def _team(self, name: str, stack: Stack, cluster: aws.eks.Cluster,
              account_id: pulumi.Input[str]) -> pulumi.Output[str]:
        """The team's role: edit rights in its namespace only, and DescribeCluster for `aws eks update-kubeconfig`.
        Who may assume it is the account's IAM to say (as for the Slurm flavour's access policies)."""
        role = aws.iam.Role(f"{name}-team", assume_role_policy=pulumi.Output.from_input(account_id).apply(
            lambda acct: policy([{"Effect": "Allow", "Principal": {"AWS": f"arn:aws:iam::{acct}:root"},
                                  "Action": "sts:AssumeRole"}])), opts=child(self))
        aws.iam.RolePolicy(f"{name}-team", role=role.id, policy=cluster.arn.apply(lambda arn: policy([{
            "Sid": "Kubeconfig", "Effect": "Allow", "Action": "eks:DescribeCluster", "Resource": arn}])),
            opts=child(self))
        # Its sessions are in the team's group too: RBAC in the namespace binds Kueue's user role to it (kube.py).
        self._team_member(f"{name}-team", stack, cluster, role.arn)
        return role.arn

    def _people(self, name: str, stack: Stack, cluster: aws.eks.Cluster) -> None:
        """Each person's principals (`users:`) are team members as the team's role is, so that kubectl runs with
        their own identity (the API server's audit log names it). Per-person limits are Slurm's: none here."""
        for person in stack.spec.users or ():
            for i, arn in enumerate(person.principals):
                # Named by the principal, not by its place (member_resource). Older releases named it by place: the
                # alias takes over an entry of that name at the first `up`.
                self._team_member(member_resource(name, arn), stack, cluster, arn,
                                  aliases=[pulumi.Alias(name=f"{name}-user-{person.name}-{i}")])

    def _team_member(self, resource: str, stack: Stack, cluster: aws.eks.Cluster,
                     principal_arn: pulumi.Input[str], aliases: Sequence[pulumi.Alias] = ()) -> None:
        """An access entry in the team's group, with EKS's edit policy in the team's namespace only. Replaced
        delete-first: a new principal ARN (its path changed) would otherwise make the principal's second entry."""
        entry = aws.eks.AccessEntry(resource, cluster_name=cluster.name, principal_arn=principal_arn,
                                    type="STANDARD", kubernetes_groups=[kube.team_group(stack)],
                                    opts=child(self, delete_before_replace=True, aliases=list(aliases)))
        aws.eks.AccessPolicyAssociation(resource, cluster_name=cluster.name, principal_arn=principal_arn,
                                        policy_arn=ACCESS_POLICY + "AmazonEKSEditPolicy",
                                        access_scope={"type": "namespace", "namespaces": [kube.namespace_name(stack)]},
                                        opts=child(self, depends_on=[entry], delete_before_replace=True,
                                                   aliases=list(aliases)))


def member_resource(name: str, principal_arn: str, kind: str = "member") -> str:
    """A principal's access entry: named by a short hash of who the ARN names (spec.model.principal_key: IAM names
    are unique in an account regardless of case and path), so the name holds whatever list, and place, it is in:
    EKS takes one access entry per principal, and a name that moved with the principal would have Pulumi create its
    second entry before deleting the first (the `up` fails)."""
    key = principal_key(principal_arn)
    digest = hashlib.sha256("/".join(key or (principal_arn,)).encode()).hexdigest()[:12]
    return f"{name}-{kind}-{digest}"


def addon_configuration(stack: Stack, addon: str) -> str | None:
    """An add-on's configuration_values where its defaults do not fit the cluster's nodes."""
    if addon == "coredns":
        # CoreDNS runs on the tainted system nodes (EKS's default tolerations say so too; explicit here).
        return json.dumps({"tolerations": kube.SYSTEM_TOLERATIONS})
    if addon == "eks-node-monitoring-agent":
        # Its node agent tolerates every taint by default, its DCGM host engine (which the agent's GPU checks ask)
        # none (aws/eks-node-monitoring-agent v1.7.0 charts/eks-node-monitoring-agent/values.yaml: nodeAgent and
        # dcgmAgent tolerations; keys as charts/configuration.schema.json names them): it tolerates the pools' taints,
        # and the burn-in's: without its host engine the node agent reports DCGMError (fatal) a minute after start,
        # and node repair would act on a node still under burn-in.
        tolerations = kube.taint_tolerations(list(stack.spec.pools)) + kube_health.BURN_IN_TOLERATIONS
        return json.dumps({"dcgmAgent": {"tolerations": tolerations}})
    return None


def plain_launch_template(name: str, description: str, security_group_ids: Sequence[pulumi.Input[str]],
                          opts: pulumi.ResourceOptions) -> aws.ec2.LaunchTemplate:
    """A template for a node group without accelerators: EKS's AMI and bootstrap, the nodes' security groups."""
    return aws.ec2.LaunchTemplate(
        name, description=description, vpc_security_group_ids=security_group_ids,
        # IMDSv2 with one hop: pods get AWS credentials from Pod Identity only, never the node's role.
        metadata_options={"http_endpoint": "enabled", "http_tokens": "required",
                          "http_put_response_hop_limit": 1, "http_protocol_ipv6": "disabled"},
        update_default_version=True, opts=opts)


def other_zone(zone: str) -> str:
    """Another AZ of the same region for the control plane's second subnet: letter b, or a when the stack is in b."""
    return zone[:-1] + ("a" if zone[-1] != "a" else "b")


def kubeconfig(cluster_name: str, endpoint: str, ca_data: str, region: str) -> str:
    """A kubeconfig that authenticates with `aws eks get-token` as the identity running Pulumi."""
    return json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": cluster_name,
        "clusters": [{"name": cluster_name, "cluster": {"server": endpoint, "certificate-authority-data": ca_data}}],
        "contexts": [{"name": cluster_name, "context": {"cluster": cluster_name, "user": cluster_name}}],
        "users": [{"name": cluster_name, "user": {"exec": {
            "apiVersion": "client.authentication.k8s.io/v1beta1", "command": "aws",
            "args": ["eks", "get-token", "--cluster-name", cluster_name, "--region", region]}}}],
    })


def autoscaler_node_template_tags(stack: Stack, pool: PoolSpec) -> dict[str, str]:
    """What the Cluster Autoscaler reads off an Auto Scaling group at zero nodes to know what a new node would look
    like (kubernetes/autoscaler#4998): without the taints and the GPU/EFA counts it never scales a pool up from zero."""
    resources = {r: str(kube.quantity(r, n)) for r, n in kube.node_resources(pool).items()}
    # Its AWS template node has no ephemeral-storage otherwise (cluster-autoscaler-1.35.0 cloudprovider/aws/
    # aws_manager.go buildNodeFromTemplate: pods, cpu, nvidia.com/gpu, memory, then these tags), so a pod that requests
    # any would never start a node from zero.
    ephemeral = kube.node_ephemeral_storage(pool)
    if ephemeral is not None:
        resources["ephemeral-storage"] = str(ephemeral)
    return node_template_tags(kube.pool_labels(stack, pool), kube.pool_taints(pool), resources)


def node_template_tags(labels: dict[str, str], taints: Sequence[dict[str, str]],
                       resources: dict[str, str]) -> dict[str, str]:
    """The node-template tags of a group's labels, taints and resources. Resource values are quantities:
    cluster-autoscaler 1.35 reads them with resource.ParseQuantity (cloudprovider/aws/aws_manager.go
    extractAllocatableResourcesFromAsg), so "10256Mi" of huge pages reads as it does in a pod's requests."""
    tags = {f"{NODE_TEMPLATE}/label/{k}": v for k, v in labels.items()}
    tags |= {f"{NODE_TEMPLATE}/taint/{t['key']}": f"{t['value']}:{t['effect']}" for t in taints}
    tags |= {f"{NODE_TEMPLATE}/resources/{r}": n for r, n in resources.items()}
    return tags


def tag_group(name: str, asg_name: pulumi.Input[str], tags: dict[str, str], opts: pulumi.ResourceOptions) -> None:
    """The autoscaler's node-template tags on a node group's Auto Scaling group (not on its instances)."""
    # Named by their key: a label or taint that goes away deletes its own tag and no other (never applied yet, so the
    # old index names need no aliases).
    for key, value in sorted(tags.items()):
        aws.autoscaling.Tag(f"{name}-ca-{key.removeprefix(NODE_TEMPLATE + '/')}", autoscaling_group_name=asg_name,
                            tag={"key": key, "value": value, "propagate_at_launch": False}, opts=opts)


@dataclass(frozen=True)
class NodeGroupPlace:
    """Where a node group of the cluster goes, the same for every pool's and the CPU nodes'."""

    cluster_name: pulumi.Input[str]
    node_role_arn: pulumi.Input[str]
    subnet_id: pulumi.Input[str]
    # the stack's and the cluster's (EksCluster.node_security_group_ids)
    security_group_ids: Sequence[pulumi.Input[str]]
    version: pulumi.Input[str]  # the cluster's: the node group's AMI follows it
    depends_on: Sequence[pulumi.Resource] = ()  # the node role's policies and access entry, the node add-ons


@dataclass(frozen=True)
class NodePoolArgs:
    stack: Stack
    pool: PoolSpec
    place: NodeGroupPlace


def autoscaling_group_name(resources: Sequence[aws.eks.outputs.NodeGroupResource]) -> str:
    """The Auto Scaling group EKS made for a managed node group, from the node group's resources."""
    groups = resources[0].autoscaling_groups
    if not groups or not groups[0].name:
        raise ValueError("the node group reports no Auto Scaling group among its resources")
    return groups[0].name


@dataclass(frozen=True)
class NodeGroupShape:
    """What sets one of the cluster's node groups apart: the pools' and the CPU nodes' differ only in these."""

    ami_type: str
    capacity_type: str
    min_nodes: int
    max_nodes: int
    labels: dict[str, str]
    taints: Sequence[dict[str, str]]
    template_tags: dict[str, str]  # the autoscaler's node template (node_template_tags)
    instance_types: Sequence[str] | None = None  # None: the launch template's
    node_repair_config: aws.eks.NodeGroupNodeRepairConfigArgsDict | None = None


def node_group(name: str, place: NodeGroupPlace, template: aws.ec2.LaunchTemplate, shape: NodeGroupShape,
               parent: pulumi.Resource) -> None:
    """The managed node group `name` from `template`, from `shape.min_nodes`, with the autoscaler's node-template tags
    on its Auto Scaling group."""
    group = aws.eks.NodeGroup(
        f"{name}-ng",
        cluster_name=place.cluster_name,
        node_group_name=name,
        version=place.version,
        node_role_arn=place.node_role_arn,
        subnet_ids=[place.subnet_id],
        ami_type=shape.ami_type,
        instance_types=shape.instance_types,
        capacity_type=shape.capacity_type,
        launch_template={"id": template.id, "version": template.latest_version.apply(str)},
        scaling_config={"min_size": shape.min_nodes, "max_size": shape.max_nodes, "desired_size": shape.min_nodes},
        labels=shape.labels,
        taints=[{"key": t["key"], "value": t["value"], "effect": TAINT_EFFECTS[t["effect"]]} for t in shape.taints],
        update_config={"max_unavailable": 1},
        node_repair_config=shape.node_repair_config,
        # The autoscaler owns the desired size once the group exists.
        opts=child(parent, depends_on=list(place.depends_on), ignore_changes=["scalingConfig.desiredSize"]),
    )
    tag_group(name, group.resources.apply(autoscaling_group_name), shape.template_tags, child(parent))


class NodePool(pulumi.ComponentResource):
    """One pool as a managed node group from min_nodes (0 by default) on EKS's accelerated AL2023 AMI, launched from
    the pool's template (EFA layout, placement group), with the autoscaler's node-template tags on its group."""

    node_group_name: str

    def __init__(self, name: str, args: NodePoolArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpucluster:kubernetes:NodePool", name, None, opts)
        stack, pool = args.stack, args.pool
        accelerator = pool.accelerator
        group = placement_group(name, pool, child(self))
        user_data = kube.node_user_data(pool)
        template = launch_template(
            name, pool, description=f"{stack.cluster_name} node group {pool.name}: {pool.instance_type}",
            subnet_id=None, security_group_ids=args.place.security_group_ids, group_name=group,
            node_tags={**stack.tags, settings.POOL_TAG: pool.name}, root_device=eks.ROOT_DEVICE, opts=child(self),
            user_data=base64.b64encode(user_data.encode()).decode() if user_data else None)
        self.node_group_name = name
        node_group(name, args.place, template, NodeGroupShape(
            ami_type=eks.AMI_TYPES[accelerator.kind], capacity_type=CAPACITY_TYPES[pool.capacity],
            min_nodes=pool.min_nodes, max_nodes=pool.max_nodes, labels=kube.pool_labels(stack, pool),
            taints=kube_health.node_group_taints(pool), template_tags=autoscaler_node_template_tags(stack, pool),
            node_repair_config=node_repair_config(pool)), self)
        self.register_outputs({"node_group_name": self.node_group_name})


@dataclass(frozen=True)
class CpuNodesArgs:
    stack: Stack
    place: NodeGroupPlace


class CpuNodes(pulumi.ComponentResource):
    """The team's CPU node group (kubernetes.cpu_nodes): on demand, from zero, EKS's standard AL2023 AMI, tainted so
    that only pods Kueue admits to the CPU flavour land there, with the autoscaler's node-template tags."""

    node_group_name: str

    def __init__(self, name: str, args: CpuNodesArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpucluster:kubernetes:CpuNodes", name, None, opts)
        spec = args.stack.spec.eks.cpu_nodes
        template = plain_launch_template(f"{name}-lt", f"{args.stack.cluster_name} CPU node group",
                                         args.place.security_group_ids, child(self))
        self.node_group_name = name
        node_group(name, args.place, template, NodeGroupShape(
            ami_type="AL2023_x86_64_STANDARD", capacity_type="ON_DEMAND", min_nodes=0, max_nodes=spec.max_nodes,
            labels=kube.cpu_node_labels(), taints=[kube.CPU_TAINT],
            template_tags=node_template_tags(kube.cpu_node_labels(), [kube.CPU_TAINT], {}),
            instance_types=[spec.instance_type]), self)
        self.register_outputs({"node_group_name": self.node_group_name})


def declare(manifest: kube.Manifest, opts: pulumi.ResourceOptions) -> pulumi.CustomResource:
    """A manifest as its pulumi_kubernetes resource: the typed class for the core kinds, CustomResource otherwise."""
    name = "-".join(filter(None, [manifest["metadata"].get("namespace"), manifest["kind"].lower(),
                                  manifest["metadata"]["name"]]))
    body = {k: v for k, v in manifest.items() if k not in ("apiVersion", "kind", "metadata")}
    typed = TYPED.get((manifest["apiVersion"], manifest["kind"]))
    if typed is not None:
        return typed(name, metadata=manifest["metadata"], opts=opts, **{SNAKE.get(k, k): v for k, v in body.items()})
    if set(body) <= {"spec"}:
        return k8s.apiextensions.CustomResource(name, api_version=manifest["apiVersion"], kind=manifest["kind"],
                                                metadata=manifest["metadata"], opts=opts, **body)
    # pulumi_kubernetes' Python CustomResource takes a spec only; a kind whose fields sit beside metadata (Kueue's
    # WorkloadPriorityClass: value, description) goes to the provider as the whole object, under the same type.
    return pulumi.CustomResource(f"kubernetes:{manifest['apiVersion']}:{manifest['kind']}", name, dict(manifest), opts)


SNAKE = {"roleRef": "role_ref"}  # the one camelCase top-level field among the typed kinds
TYPED: dict[tuple[str, str], Any] = {
    ("v1", "Namespace"): k8s.core.v1.Namespace,
    ("v1", "ResourceQuota"): k8s.core.v1.ResourceQuota,
    ("v1", "LimitRange"): k8s.core.v1.LimitRange,
    ("v1", "PersistentVolume"): k8s.core.v1.PersistentVolume,
    ("v1", "PersistentVolumeClaim"): k8s.core.v1.PersistentVolumeClaim,
    ("v1", "ConfigMap"): k8s.core.v1.ConfigMap,
    ("v1", "ServiceAccount"): k8s.core.v1.ServiceAccount,
    ("rbac.authorization.k8s.io/v1", "ClusterRole"): k8s.rbac.v1.ClusterRole,
    ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding"): k8s.rbac.v1.ClusterRoleBinding,
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): k8s.rbac.v1.RoleBinding,
    ("apps/v1", "Deployment"): k8s.apps.v1.Deployment,
    ("apps/v1", "DaemonSet"): k8s.apps.v1.DaemonSet,
    ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicy"):
        k8s.admissionregistration.v1.ValidatingAdmissionPolicy,
    ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicyBinding"):
        k8s.admissionregistration.v1.ValidatingAdmissionPolicyBinding,
}


def release(name: str, chart: eks.Chart, values: dict[str, Any], opts: pulumi.ResourceOptions) -> k8s.helm.v3.Release:
    return k8s.helm.v3.Release(name, name=name, chart=chart.name, version=chart.version,
                               repository_opts={"repo": chart.repository} if chart.repository else None,
                               namespace=chart.namespace, create_namespace=True, atomic=True, values=values,
                               opts=opts)


@dataclass(frozen=True)
class ClusterSoftwareArgs:
    stack: Stack
    cluster_name: pulumi.Input[str]
    cluster_arn: pulumi.Input[str]
    node_group_names: dict[str, str]  # pool -> node group name
    alerts_topic_arn: pulumi.Input[str]  # the budget's topic: Alertmanager publishes the alerts there


class ClusterSoftware(pulumi.ComponentResource):
    """Pinned Helm releases: the Cluster Autoscaler (with its Pod Identity role), the NVIDIA, Neuron and EFA device
    plugins, Kueue, and the Prometheus stack with dcgm-exporter; and the accelerator nodes' burn-in."""

    autoscaler_role_arn: pulumi.Output[str]
    autoscaler_role_name: pulumi.Output[str]
    kueue: k8s.helm.v3.Release
    prometheus: k8s.helm.v3.Release

    def __init__(self, name: str, args: ClusterSoftwareArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpucluster:kubernetes:ClusterSoftware", name, None, opts)
        stack = args.stack
        role = aws.iam.Role(f"{name}-autoscaler", assume_role_policy=trust("pods.eks.amazonaws.com", ASSUME_AND_TAG),
                            opts=child(self))
        aws.iam.RolePolicy(f"{name}-autoscaler", role=role.id,
                           policy=pulumi.Output.from_input(args.cluster_arn).apply(autoscaler_policy), opts=child(self))
        autoscaler = aws.eks.PodIdentityAssociation(f"{name}-autoscaler", cluster_name=args.cluster_name,
                                                    namespace=eks.CLUSTER_AUTOSCALER.namespace,
                                                    service_account=AUTOSCALER_SERVICE_ACCOUNT, role_arn=role.arn,
                                                    opts=child(self))
        # Its pods get credentials only once the association exists; before, they crash-loop and the atomic release
        # rolls back.
        release("cluster-autoscaler", eks.CLUSTER_AUTOSCALER,
                kube.autoscaler_values(stack, args.node_group_names, AUTOSCALER_SERVICE_ACCOUNT),
                child(self, depends_on=[autoscaler]))
        nvidia = [p for p in stack.spec.pools if p.itype.accelerator and p.itype.accelerator.kind == "nvidia"]
        if nvidia:
            release("nvidia-device-plugin", eks.NVIDIA_DEVICE_PLUGIN, kube.nvidia_device_plugin_values(),
                    child(self))
        if any(p.itype.accelerator and p.itype.accelerator.kind == "neuron" for p in stack.spec.pools):
            release("neuron-device-plugin", eks.NEURON_DEVICE_PLUGIN, kube.neuron_device_plugin_values(),
                    child(self))
        if any(p.uses_efa for p in stack.spec.pools):
            release("efa-device-plugin", eks.EFA_DEVICE_PLUGIN, kube.efa_device_plugin_values(), child(self))
        self.kueue = release("kueue", eks.KUEUE, kube.kueue_values(stack), child(self))
        alertmanager = aws.iam.Role(f"{name}-alertmanager",
                                    assume_role_policy=trust("pods.eks.amazonaws.com", ASSUME_AND_TAG),
                                    opts=child(self))
        # Alertmanager's SNS receiver (SigV4) publishes the alerts to the stack's topic: that topic only.
        aws.iam.RolePolicy(f"{name}-alertmanager", role=alertmanager.id,
                           policy=pulumi.Output.from_input(args.alerts_topic_arn).apply(lambda arn: policy([{
                               "Sid": "PublishAlerts", "Effect": "Allow", "Action": "sns:Publish", "Resource": arn}])),
                           opts=child(self))
        publishing = aws.eks.PodIdentityAssociation(f"{name}-alertmanager", cluster_name=args.cluster_name,
                                                    namespace=eks.KUBE_PROMETHEUS_STACK.namespace,
                                                    service_account=kube.ALERTMANAGER_SERVICE_ACCOUNT,
                                                    role_arn=alertmanager.arn, opts=child(self))
        self.prometheus = release("monitoring", eks.KUBE_PROMETHEUS_STACK,
                                  kube.prometheus_values(stack, args.alerts_topic_arn),
                                  child(self, depends_on=[publishing]))
        if nvidia:
            release("dcgm-exporter", eks.DCGM_EXPORTER, kube.dcgm_exporter_values(),
                    child(self, depends_on=[self.prometheus]))
        # The burn-in of every new accelerator node (the node groups' startup taint waits for it), with its Pod
        # Identity role: a failed node's instance is terminated for a replacement. The Pod Identity agent runs on the
        # tainted accelerator nodes too (aws/eks-charts stable/eks-pod-identity-agent/values.yaml: tolerations
        # operator Exists).
        burn_in_role = aws.iam.Role(f"{name}-burn-in", assume_role_policy=trust("pods.eks.amazonaws.com",
                                                                                ASSUME_AND_TAG), opts=child(self))
        aws.iam.RolePolicy(f"{name}-burn-in", role=burn_in_role.id, policy=pulumi.Output.from_input(
            args.cluster_arn).apply(lambda arn: burn_in_policy(arn, [args.node_group_names[p.name]
                                                                     for p in stack.spec.pools])), opts=child(self))
        replacing = aws.eks.PodIdentityAssociation(f"{name}-burn-in", cluster_name=args.cluster_name,
                                                   namespace=kube_health.NAMESPACE, service_account=kube_health.BURN_IN,
                                                   role_arn=burn_in_role.arn, opts=child(self))
        burn_in_namespace, *burn_in = kube_health.burn_in_manifests(stack)
        namespace = declare(burn_in_namespace, child(self))
        for manifest in burn_in:
            # Its pods get AWS credentials only once the association exists.
            pod = [replacing] if manifest["kind"] == "DaemonSet" else []
            declare(manifest, child(self, depends_on=[namespace, *pod]))
        self.autoscaler_role_arn, self.autoscaler_role_name = role.arn, role.name
        self.register_outputs({"autoscaler_role_arn": self.autoscaler_role_arn})


@dataclass(frozen=True)
class ClusterArn:
    """An EKS cluster's ARN (arn:<partition>:eks:<region>:<account>:cluster/<name>), to build its neighbours' ARNs in
    the same partition: aws, aws-cn, aws-us-gov."""

    partition: str
    region: str
    account: str
    name: str

    @classmethod
    def parse(cls, arn: str) -> ClusterArn:
        fields = arn.split(":")
        return cls(fields[1], fields[3], fields[4], fields[5].split("/", 1)[1])

    def of(self, service: str, resource: str) -> str:
        return f"arn:{self.partition}:{service}:{self.region}:{self.account}:{resource}"

    def own_groups(self, prefix: str) -> str:
        """The Auto Scaling groups whose names begin with `prefix`."""
        return self.of("autoscaling", f"autoScalingGroup:*:autoScalingGroupName/{prefix}")


def autoscaler_policy(cluster_arn: str) -> str:
    """Read every group (the Describe calls take no resource); read this cluster's node groups; resize and terminate
    only the Auto Scaling groups of this cluster's node groups (eks-<cluster>-<pool>-<uuid>) that EKS tagged as its."""
    cluster = ClusterArn.parse(cluster_arn)
    return policy([
        {"Sid": "Discover", "Effect": "Allow", "Resource": "*", "Action": [
            "autoscaling:DescribeAutoScalingGroups", "autoscaling:DescribeAutoScalingInstances",
            "autoscaling:DescribeLaunchConfigurations", "autoscaling:DescribeScalingActivities",
            "autoscaling:DescribeTags", "ec2:DescribeImages", "ec2:DescribeInstanceTypes",
            "ec2:DescribeLaunchTemplateVersions", "ec2:GetInstanceTypesFromInstanceRequirements"]},
        {"Sid": "NodeGroups", "Effect": "Allow", "Action": "eks:DescribeNodegroup",
         "Resource": cluster.of("eks", f"nodegroup/{cluster.name}/*")},
        {"Sid": "ResizeOwnGroups", "Effect": "Allow", "Resource": cluster.own_groups(f"eks-{cluster.name}-*"),
         "Action": ["autoscaling:SetDesiredCapacity", "autoscaling:TerminateInstanceInAutoScalingGroup"],
         "Condition": {"StringEquals": {f"aws:ResourceTag/k8s.io/cluster-autoscaler/{cluster.name}": "owned"}}},
    ])


def burn_in_policy(cluster_arn: str, node_groups: Sequence[str]) -> str:
    """Terminate instances of the accelerator pools' Auto Scaling groups (eks-<node group>-<uuid>) that EKS tagged as
    this cluster's, and nothing else: no Describe (the instance id is the Node's, the call needs no group name), no
    resize (the group's desired capacity is kept, hence the replacement)."""
    cluster = ClusterArn.parse(cluster_arn)
    return policy([
        {"Sid": "ReplaceFailedNodes", "Effect": "Allow", "Action": "autoscaling:TerminateInstanceInAutoScalingGroup",
         "Resource": [cluster.own_groups(f"eks-{group}-*") for group in node_groups],
         "Condition": {"StringEquals": {f"aws:ResourceTag/k8s.io/cluster-autoscaler/{cluster.name}": "owned"}}},
    ])


@dataclass(frozen=True)
class TeamSpaceArgs:
    stack: Stack
    fsx: kube.Fsx
    kueue: pulumi.Resource  # the release that installs Kueue's CRDs
    prometheus: pulumi.Resource  # the release that installs the PrometheusRule CRD


class TeamSpace(pulumi.ComponentResource):
    """The team's namespace with its quota and defaults, its claim on the file system, its Kueue queues, and the
    idle-GPU alert."""

    def __init__(self, name: str, args: TeamSpaceArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpucluster:kubernetes:TeamSpace", name, None, opts)
        stack = args.stack
        core = [declare(m, child(self)) for m in kube.team_manifests(stack, args.fsx)]
        for manifest in kube.queue_manifests(stack):
            declare(manifest, child(self, depends_on=[args.kueue, core[0]]))
        if any(p.itype.accelerator and p.itype.accelerator.kind == "nvidia" for p in stack.spec.pools):
            declare(kube.idle_gpu_rule(stack), child(self, depends_on=[args.prometheus]))
        self.register_outputs({})


@dataclass(frozen=True)
class QueueGuardrailArgs:
    stack: Stack
    cluster_name: pulumi.Input[str]
    # The Budget component's queue and budget, and the LaunchDeny that denies the autoscaler's scale-up.
    queue_url: pulumi.Input[str]
    queue_arn: pulumi.Input[str]
    budget_arn: pulumi.Input[str]
    act_threshold_percent: int
    launch_deny_action_id: pulumi.Input[str]
    launch_deny_action_arn: pulumi.Input[str]
    kueue: pulumi.Resource  # the release that installs Kueue's CRDs


class QueueGuardrail(pulumi.ComponentResource):
    """The budget's queue, read in the cluster by a small controller that holds the team's ClusterQueue at the act
    threshold and reopens it below (gpucluster/node/queue_guardrail.py), with its Pod Identity role."""

    def __init__(self, name: str, args: QueueGuardrailArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpucluster:kubernetes:QueueGuardrail", name, None, opts)
        role = aws.iam.Role(f"{name}-guardrail-pod",
                            assume_role_policy=trust("pods.eks.amazonaws.com", ASSUME_AND_TAG), opts=child(self))
        aws.iam.RolePolicy(f"{name}-guardrail-pod", role=role.id, policy=pulumi.Output.all(
            args.queue_arn, args.budget_arn, args.launch_deny_action_arn).apply(lambda a: policy([
                {"Sid": "BudgetQueue", "Effect": "Allow", "Action": ["sqs:ReceiveMessage", "sqs:DeleteMessage"],
                 "Resource": a[0]},
                {"Sid": "ReadBudget", "Effect": "Allow", "Action": "budgets:ViewBudget", "Resource": a[1]},
                # On reopening, lift the autoscaler's scale-up deny: whether it ran, and reversing it; that action only
                # (DescribeBudgetAction takes the action's ARN, where DescribeBudgetActionsForBudget needs the
                # budget's).
                {"Sid": "ReverseLaunchDeny", "Effect": "Allow",
                 "Action": ["budgets:DescribeBudgetAction", "budgets:ExecuteBudgetAction"], "Resource": a[2]}])),
            opts=child(self))
        association = aws.eks.PodIdentityAssociation(f"{name}-guardrail", cluster_name=args.cluster_name,
                                                     namespace=eks.KUEUE.namespace, service_account=kube.GUARDRAIL,
                                                     role_arn=role.arn, opts=child(self))
        for manifest in kube.guardrail_manifests(args.stack, args.queue_url, args.act_threshold_percent,
                                                 args.launch_deny_action_id):
            # The pod gets AWS credentials only once its association exists: started before, it has none.
            pod = [association] if manifest["kind"] == "Deployment" else []
            declare(manifest, child(self, depends_on=[args.kueue, *pod]))
        self.register_outputs({})
