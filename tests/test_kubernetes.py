"""The Kubernetes flavour under Pulumi's mock runtime: the EKS cluster, node groups, autoscaler tags, cluster software,
the team's namespace and queues, the budget guardrail, the first job, and every Kubernetes object against its schema.

Core Kubernetes objects go through kubernetes-validate in strict mode (unknown fields are errors) for the stack's
version. Custom resources (Kueue's, the Prometheus operator's) go through the openAPIV3Schema of the CRDs that the
pinned charts install, vendored in tests/schemas/ (CI has no network at test time), made strict the same way.
"""

from __future__ import annotations

import base64
import copy
import json
import re
import uuid
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

import standard_library
from components.kubernetes import autoscaler_node_template_tags, autoscaler_policy, burn_in_policy
from conftest import K8S_STACK_FILES, ROOT, of_type, planned
from gpucluster.contract import node_health
from gpucluster.node import queue_guardrail
from gpucluster.plan import PLAN_OPERATOR_IP, Declared, planned_asg_name, planned_outputs, run_program
from gpucluster.project import EXAMPLES_DIR, pulumi_program
from gpucluster.render import kube, prometheus
from gpucluster.spec import catalog, cost, eks
from gpucluster.spec.model import OPERATOR, SpecError, Stack, load_stack, validate

SCHEMAS = ROOT / "tests" / "schemas"
TEAM_K8S = ROOT / "stacks" / "Pulumi.team-k8s.yaml"


@pytest.fixture(params=K8S_STACK_FILES, ids=lambda p: p.name)
def k8s(request: pytest.FixtureRequest) -> tuple[Stack, tuple[Declared, ...]]:
    return planned(request.param)


def variant(path: Path, **changes: Any) -> tuple[Stack, tuple[Declared, ...]]:
    """A shipped stack with cluster keys changed, validated and planned."""
    doc = yaml.safe_load(path.read_text())["config"]
    doc["gpucluster:cluster"].update(copy.deepcopy(changes))
    stack = validate("k8s-variant", doc)
    return stack, tuple(run_program(stack, pulumi_program()))


def by_name(declared: tuple[Declared, ...], suffix: str) -> dict[str, dict]:
    return {d.name: d.inputs for d in of_type(declared, suffix)}


def k8s_objects(declared: tuple[Declared, ...]) -> list[dict]:
    """Every Kubernetes object the program declares, as the API server would get it (Helm releases aside)."""
    return [d.inputs for d in declared if d.type.startswith("kubernetes:") and not d.type.endswith(":Release")]


def test_k8s_stacks_exist() -> None:
    assert TEAM_K8S in K8S_STACK_FILES


# --- Scheduler switch ------------------------------------------------------------------------------------------

def test_no_slurm_parts_on_a_kubernetes_stack(k8s: tuple[Stack, tuple[Declared, ...]]) -> None:
    _, declared = k8s
    types = {d.type for d in declared}
    for kind in ("aws:ec2/instance:Instance", "gpucluster:head:HeadNode", "aws:imagebuilder/image:Image",
                 "gpucluster:image:NodeImage", "gpucluster:access:NodeAccess"):
        assert kind not in types, kind
    assert not any(t.startswith("aws:imagebuilder") for t in types)


def test_the_slurm_stacks_build_no_kubernetes() -> None:
    _, declared = planned(ROOT / "stacks" / "Pulumi.team-a.yaml")
    assert not [d for d in declared if d.type.startswith(("kubernetes:", "aws:eks/", "gpucluster:kubernetes:"))]


def test_every_aws_resource_is_tagged_and_in_a_component(k8s: tuple[Stack, tuple[Declared, ...]]) -> None:
    stack, declared = k8s
    (provider,) = [d for d in declared if d.type == "pulumi:providers:aws"]
    assert json.loads(provider.inputs["defaultTags"]) == {"tags": stack.tags}
    for d in declared:
        if d.type.startswith("aws:"):
            assert d.provider.startswith(provider.urn + "::"), d.name
            assert d.parent_type and d.parent_type.startswith("gpucluster:"), d.name
        if d.type.startswith("kubernetes:"):
            assert d.provider.startswith("urn:") and "pulumi:providers:kubernetes" in d.provider, d.name


# --- 1. The cluster -------------------------------------------------------------------------------------------

def test_cluster_private_encrypted_pinned(k8s: tuple[Stack, tuple[Declared, ...]]) -> None:
    stack, declared = k8s
    (cluster,) = of_type(declared, "eks/cluster:Cluster")
    spec = cluster.inputs
    assert spec["version"] == stack.spec.eks.version and spec["upgradePolicy"] == {"supportType": "STANDARD"}
    vpc = spec["vpcConfig"]
    # Public only for the stack's way in (tests/test_kube_access.py): `operator` is the plan's documentation address.
    public = [f"{PLAN_OPERATOR_IP}/32" if c == OPERATOR else c for c in stack.spec.eks.public_access_cidrs]
    assert vpc["endpointPrivateAccess"] is True and vpc["endpointPublicAccess"] is bool(public)
    assert vpc.get("publicAccessCidrs") == (public or None)
    assert spec["accessConfig"]["authenticationMode"] == "API"
    (key,) = of_type(declared, "kms/key:Key")
    assert key.inputs["enableKeyRotation"] is True
    assert spec["encryptionConfig"] == {"resources": ["secrets"],
                                        "provider": {"keyArn": f"arn:aws:kms:{stack.region}:123456789012:key/"
                                                               + _planned_id(key, stack)}}


def acts(stack: Stack) -> bool:
    """The stack's budget acts (an act threshold): the guardrail and the launch deny exist only then."""
    return stack.spec.budget.act_threshold_percent is not None


def guardrail_deployments(declared: tuple[Declared, ...]) -> list[Declared]:
    return [d for d in of_type(declared, "apps/v1:Deployment") if d.inputs["metadata"]["name"] == kube.GUARDRAIL]


def family_of(stack: Stack, pool: Any) -> str:
    """The pool's family as the stack file says it: the spot pool that falls back to it, else its own name."""
    return next((p.name for p in stack.spec.pools if p.fallback == pool.name), pool.name)


def _planned_id(d: Declared, stack: Stack) -> str:
    from gpucluster.plan import planned_id
    return planned_id(d, stack.region)


def test_control_plane_has_two_zones_nodes_one(k8s: tuple[Stack, tuple[Declared, ...]]) -> None:
    stack, declared = k8s
    (cluster,) = of_type(declared, "eks/cluster:Cluster")
    network = stack.spec.network
    if network.subnet_id:  # an existing network: its subnet and the control plane's, nothing made
        assert not of_type(declared, "ec2/subnet:Subnet")
        assert cluster.inputs["vpcConfig"]["subnetIds"] == [network.subnet_id, stack.spec.eks.control_plane_subnet_id]
        for group in of_type(declared, "eks/nodeGroup:NodeGroup"):
            assert group.inputs["subnetIds"] == [network.subnet_id]
        return
    subnets = {_planned_id(s, stack): s.inputs for s in of_type(declared, "ec2/subnet:Subnet")}
    zones = {subnets[s]["availabilityZone"] for s in cluster.inputs["vpcConfig"]["subnetIds"]}
    assert len(zones) == 2 and stack.spec.availability_zone in zones
    (control_plane,) = [s for s in subnets.values() if s["tags"]["Name"].endswith("-control-plane")]
    assert control_plane["mapPublicIpOnLaunch"] is False
    private = [i for i, s in subnets.items() if s["tags"]["Name"].endswith("-private")]
    for group in of_type(declared, "eks/nodeGroup:NodeGroup"):
        assert group.inputs["subnetIds"] == private  # the stack's one AZ


def test_existing_network_names_the_control_planes_subnet() -> None:
    network = {"vpc_id": "vpc-0a1b2c3d4e5f60718", "subnet_id": "subnet-0a1b2c3d4e5f60718"}
    stack, declared = variant(TEAM_K8S, network=network,
                              kubernetes={"control_plane_subnet_id": "subnet-0f0e0d0c0b0a09080",
                                          "private_access_cidrs": ["10.8.0.0/16"]})
    (cluster,) = of_type(declared, "eks/cluster:Cluster")
    assert cluster.inputs["vpcConfig"]["subnetIds"] == ["subnet-0a1b2c3d4e5f60718", "subnet-0f0e0d0c0b0a09080"]
    assert not of_type(declared, "ec2/subnet:Subnet")


def test_public_endpoint_only_for_the_cidrs_given() -> None:
    stack, declared = variant(TEAM_K8S, kubernetes={"version": "1.35", "public_access_cidrs": ["8.8.8.0/24"]})
    (cluster,) = of_type(declared, "eks/cluster:Cluster")
    vpc = cluster.inputs["vpcConfig"]
    assert vpc["endpointPublicAccess"] is True and vpc["publicAccessCidrs"] == ["8.8.8.0/24"]


def test_addons(k8s: tuple[Stack, tuple[Declared, ...]]) -> None:
    _, declared = k8s
    names = sorted(a.inputs["addonName"] for a in of_type(declared, "eks/addon:Addon"))
    assert names == sorted(["vpc-cni", "coredns", "kube-proxy", "eks-pod-identity-agent", "aws-fsx-csi-driver",
                            "eks-node-monitoring-agent"])


def test_nodes_cannot_manage_ips_the_vpc_cni_can(k8s: tuple[Stack, tuple[Declared, ...]]) -> None:
    stack, declared = k8s
    attached = {(a.inputs["role"], a.inputs["policyArn"].rsplit("/", 1)[1])
                for a in of_type(declared, "iam/rolePolicyAttachment:RolePolicyAttachment")}
    node, cni = f"{stack.cluster_name}-node", f"{stack.cluster_name}-vpc-cni"
    assert {p for r, p in attached if r == node} == {"AmazonEKSWorkerNodePolicy", "AmazonEC2ContainerRegistryPullOnly"}
    assert {p for r, p in attached if r == cni} == {"AmazonEKS_CNI_Policy"}
    addons = {a.inputs["addonName"]: a for a in of_type(declared, "eks/addon:Addon")}
    assert addons["vpc-cni"].inputs["podIdentityAssociations"] == [
        {"roleArn": f"arn:aws:iam::123456789012:role/{cni}", "serviceAccount": "aws-node"}]
    assert addons["eks-pod-identity-agent"].urn in addons["vpc-cni"].dependencies


def test_system_nodes_after_the_node_daemons_coredns_after_the_nodes(k8s: tuple[Stack, tuple[Declared, ...]]) -> None:
    """Nodes are Ready only with the CNI, and Pod Identity needs its agent: both before the system nodes. CoreDNS and
    the other add-ons that run pods wait for nodes to run them on (else EKS reports them degraded and `up` fails)."""
    stack, declared = k8s
    addons = {a.inputs["addonName"]: a for a in of_type(declared, "eks/addon:Addon")}
    (system,) = [g for g in of_type(declared, "eks/nodeGroup:NodeGroup")
                 if g.inputs["nodeGroupName"] == f"{stack.cluster_name}-system"]
    for name in ("vpc-cni", "kube-proxy", "eks-pod-identity-agent"):
        assert addons[name].urn in system.dependencies, name
        assert system.urn not in addons[name].dependencies, name
    for name in ("coredns", "aws-fsx-csi-driver", "eks-node-monitoring-agent"):
        assert system.urn in addons[name].dependencies, name


def _tolerates_system(tolerations: list[dict]) -> bool:
    return any(t.get("key") == "CriticalAddonsOnly" and t.get("operator") == "Exists" for t in tolerations)


def test_system_nodes_run_only_the_clusters_own_software(k8s: tuple[Stack, tuple[Declared, ...]]) -> None:
    """System nodes: IMDSv2 with one hop, and a CriticalAddonsOnly taint that the cluster's software tolerates (the
    charts at the values keys their pinned versions read, the guardrail, CoreDNS) and the team's pods do not."""
    stack, declared = k8s
    (system,) = [g.inputs for g in of_type(declared, "eks/nodeGroup:NodeGroup")
                 if g.inputs["nodeGroupName"] == f"{stack.cluster_name}-system"]
    assert system["taints"] == [{"key": "CriticalAddonsOnly", "value": "true", "effect": "NO_SCHEDULE"}]
    templates = {_planned_id(t, stack): t.inputs for t in of_type(declared, "ec2/launchTemplate:LaunchTemplate")}
    metadata = templates[system["launchTemplate"]["id"]]["metadataOptions"]
    assert metadata["httpTokens"] == "required" and metadata["httpPutResponseHopLimit"] == 1
    releases = _releases(declared)
    monitoring = releases["monitoring"]["values"]
    for tolerations in (releases["cluster-autoscaler"]["values"]["tolerations"],
                        releases["kueue"]["values"]["controllerManager"]["tolerations"],
                        monitoring["prometheus"]["prometheusSpec"]["tolerations"],
                        monitoring["alertmanager"]["alertmanagerSpec"]["tolerations"],
                        monitoring["prometheusOperator"]["tolerations"],
                        monitoring["prometheusOperator"]["admissionWebhooks"]["patch"]["tolerations"],
                        monitoring["kube-state-metrics"]["tolerations"]):
        assert _tolerates_system(tolerations)
    guardrails = guardrail_deployments(declared)
    assert len(guardrails) == acts(stack)
    for guardrail in guardrails:
        assert _tolerates_system(guardrail.inputs["spec"]["template"]["spec"]["tolerations"])
    addons = {a.inputs["addonName"]: a.inputs for a in of_type(declared, "eks/addon:Addon")}
    assert _tolerates_system(json.loads(addons["coredns"]["configurationValues"])["tolerations"])
    *_, job = kube.example_job(stack, kube.example_pool(stack), (EXAMPLES_DIR / "ddp_train.py").read_text())
    assert not _tolerates_system(job["spec"]["template"]["spec"]["tolerations"])


def test_access_entries() -> None:
    admin = "arn:aws:iam::123456789012:role/platform-admins"
    stack, declared = variant(TEAM_K8S, kubernetes={"version": "1.35", "admin_role_arns": [admin],
                                                    "public_access_cidrs": ["operator"]})
    entries = {e.inputs["principalArn"]: e.inputs for e in of_type(declared, "eks/accessEntry:AccessEntry")}
    name = stack.cluster_name
    assert entries[f"arn:aws:iam::123456789012:role/{name}-node"]["type"] == "EC2_LINUX"
    assert entries[admin]["type"] == "STANDARD"
    assocs = {a.inputs["principalArn"]: a.inputs for a in of_type(declared,
                                                                   "eks/accessPolicyAssociation:AccessPolicyAssociation")}
    assert assocs[admin]["policyArn"].endswith("/AmazonEKSClusterAdminPolicy")
    assert assocs[admin]["accessScope"] == {"type": "cluster"}
    team = assocs[f"arn:aws:iam::123456789012:role/{name}-team"]
    assert team["policyArn"].endswith("/AmazonEKSEditPolicy")
    assert team["accessScope"] == {"type": "namespace", "namespaces": [stack.spec.team]}
    # EKS's edit policy covers no Kueue objects: the team's group is bound to Kueue's user role in its namespace.
    team_entry = entries[f"arn:aws:iam::123456789012:role/{name}-team"]
    assert team_entry["kubernetesGroups"] == [f"gpucluster:{stack.spec.team}"]
    (binding,) = [b for b in of_type(declared, "rbac.authorization.k8s.io/v1:RoleBinding")
                  if b.inputs["metadata"]["namespace"] == stack.spec.team]
    assert binding.inputs["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                         "name": "kueue-batch-user-role"}
    assert binding.inputs["subjects"] == [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group",
                                           "name": f"gpucluster:{stack.spec.team}"}]
    kueue = next(r.urn for r in of_type(declared, "helm.sh/v3:Release") if r.inputs["name"] == "kueue")
    assert kueue in binding.dependencies  # the release makes the ClusterRole
    (team_policy,) = [p for p in of_type(declared, "iam/rolePolicy:RolePolicy") if p.name == f"{name}-team"]
    (statement,) = json.loads(team_policy.inputs["policy"])["Statement"]
    assert statement["Action"] == "eks:DescribeCluster"
    assert statement["Resource"] == f"arn:aws:eks:{stack.region}:123456789012:cluster/{name}"



def test_each_persons_principals_join_the_team_group() -> None:
    """`users:` on kubernetes: every principal of every person gets the team role's access (an entry in the team's
    group, EKS's edit policy in the team's namespace only), so kubectl runs as their own identity; nothing more."""
    alice = "arn:aws:iam::123456789012:role/researchers/alice"
    bob = ["arn:aws:iam::123456789012:role/bob", "arn:aws:iam::123456789012:user/bob"]
    stack, declared = variant(TEAM_K8S, users=[{"name": "alice", "principals": [alice]},
                                               {"name": "bob", "principals": bob, "admin": True}])
    entries = {e.inputs["principalArn"]: e for e in of_type(declared, "eks/accessEntry:AccessEntry")}
    assocs = {a.inputs["principalArn"]: a for a in of_type(declared,
                                                            "eks/accessPolicyAssociation:AccessPolicyAssociation")}
    team = f"arn:aws:iam::123456789012:role/{stack.cluster_name}-team"
    for principal in (alice, *bob):
        entry, assoc = entries[principal], assocs[principal]
        assert entry.inputs["type"] == "STANDARD"
        # The team's: the same group (Kueue's user role in the namespace) and the same association, an admin too.
        assert entry.inputs["kubernetesGroups"] == entries[team].inputs["kubernetesGroups"] == [
            f"gpucluster:{stack.spec.team}"]
        assert {k: v for k, v in assoc.inputs.items() if k != "principalArn"} == \
            {k: v for k, v in assocs[team].inputs.items() if k != "principalArn"}
        assert assoc.inputs["accessScope"] == {"type": "namespace", "namespaces": [stack.spec.team]}
        assert entry.urn in assoc.dependencies
    # Removing a person removes their entries; nobody else's change.
    _, declared = variant(TEAM_K8S, users=[{"name": "alice", "principals": [alice]}])
    assert {e.inputs["principalArn"] for e in of_type(declared, "eks/accessEntry:AccessEntry")} == \
        set(entries) - set(bob)


def test_a_principal_keeps_its_access_entry_when_the_people_are_reordered_or_a_principal_moves() -> None:
    """EKS takes one access entry per principal: between two plans, each principal's entry keeps its resource name
    whatever the order of the people or of their principals, and wherever it moves, so that `up` updates it in place
    instead of creating the principal's second entry before deleting the first (which EKS refuses)."""
    roles = [f"arn:aws:iam::123456789012:role/r{i}" for i in range(3)]

    def names(users: list[dict[str, Any]]) -> dict[str, tuple[str, str]]:
        _, declared = variant(TEAM_K8S, users=users)
        entries = {e.inputs["principalArn"]: e for e in of_type(declared, "eks/accessEntry:AccessEntry")}
        assocs = {a.inputs["principalArn"]: a.name
                  for a in of_type(declared, "eks/accessPolicyAssociation:AccessPolicyAssociation")}
        assert all(entries[arn].delete_before_replace for arn in roles if arn in entries)  # a new ARN: deleted first
        return {arn: (entries[arn].name, assocs[arn]) for arn in roles if arn in entries}

    before = names([{"name": "alice", "principals": roles[:2]}, {"name": "bob", "principals": roles[2:]}])
    reordered = names([{"name": "bob", "principals": roles[2:]}, {"name": "alice", "principals": roles[1::-1]}])
    moved = names([{"name": "alice", "principals": roles[1:2]}, {"name": "bob", "principals": [roles[2], roles[0]]}])
    assert len({entry for entry, _ in before.values()}) == len(roles)
    assert before == reordered == moved

    def admin_names(admins: list[str]) -> dict[str, str]:
        _, declared = variant(TEAM_K8S, kubernetes={"version": "1.35", "admin_role_arns": admins,
                                                    "public_access_cidrs": ["operator"]})
        return {e.inputs["principalArn"]: e.name for e in of_type(declared, "eks/accessEntry:AccessEntry")
                if e.inputs["principalArn"] in roles}

    assert admin_names(roles) == admin_names(roles[::-1]) != {}


def test_a_cluster_admins_role_cannot_also_be_a_person() -> None:
    """EKS takes one access entry per principal: a role in kubernetes.admin_role_arns listed for a person is refused
    with its path, not at `up`."""
    admin = "arn:aws:iam::123456789012:role/platform-admins"
    doc = yaml.safe_load(TEAM_K8S.read_text())["config"]
    doc["gpucluster:cluster"]["kubernetes"] = {"version": "1.35", "admin_role_arns": [admin],
                                               "public_access_cidrs": ["operator"]}
    doc["gpucluster:cluster"]["users"] = [{"name": "bob", "principals": ["arn:aws:iam::123456789012:user/bob", admin]}]
    with pytest.raises(SpecError) as bad:
        validate("k8s-variant", doc)
    assert bad.value.problems == [("gpucluster:cluster.users[0].principals[1]", f"{admin!r} is also in kubernetes."
                                   "admin_role_arns: EKS gives a principal one access entry, and the admins' is the "
                                   "cluster's admin")]

# --- 2. GPU pools -----------------------------------------------------------------------------------------------

def _templates(declared: tuple[Declared, ...]) -> dict[str, dict]:
    return {lt.inputs["tagSpecifications"][0]["tags"]["gpucluster:pool"]: lt.inputs
            for lt in of_type(declared, "ec2/launchTemplate:LaunchTemplate") if "tagSpecifications" in lt.inputs}


def _groups(stack: Stack, declared: tuple[Declared, ...]) -> dict[str, dict]:
    return {g.inputs["nodeGroupName"].removeprefix(f"{stack.cluster_name}-"): g.inputs
            for g in of_type(declared, "eks/nodeGroup:NodeGroup")}


def test_node_group_per_pool(k8s: tuple[Stack, tuple[Declared, ...]]) -> None:
    stack, declared = k8s
    groups, templates = _groups(stack, declared), _templates(declared)
    assert set(groups) == {p.name for p in stack.spec.pools} | {"system", "cpu"}
    placement = {g.name: g.inputs for g in of_type(declared, "ec2/placementGroup:PlacementGroup")}
    for pool in stack.spec.pools:
        group, lt = groups[pool.name], templates[pool.name]
        accelerator = pool.itype.accelerator
        assert accelerator is not None
        assert group["amiType"] == ("AL2023_x86_64_NVIDIA" if accelerator.kind == "nvidia"
                                    else "AL2023_x86_64_NEURON")
        assert group["capacityType"] == {"on-demand": "ON_DEMAND", "spot": "SPOT",
                                         "capacity-block": "CAPACITY_BLOCK"}[pool.capacity]
        assert group["scalingConfig"] == {"minSize": pool.min_nodes, "maxSize": pool.max_nodes,
                                          "desiredSize": pool.min_nodes}
        # The autoscaler's GPU label on NVIDIA pools only (tests/test_kube_node_groups.py says why).
        gpu_label = ({"k8s.amazonaws.com/accelerator": kube.GPU_TYPES[accelerator.model]}
                     if accelerator.kind == "nvidia" else {})
        assert group["labels"] == {"gpucluster/pool": pool.name, "gpucluster/capacity": pool.capacity,
                                   "gpucluster/accelerator": accelerator.kind,
                                   "gpucluster/family": family_of(stack, pool), **gpu_label,
                                   **({"gpucluster/efa": "true"} if pool.uses_efa else {})}
        taints = {(t["key"], t["effect"]) for t in group["taints"]}
        assert (kube.accelerator_resource(pool), "NO_SCHEDULE") in taints
        assert (("gpucluster/spot", "NO_SCHEDULE") in taints) == (pool.capacity == "spot")
        assert group["launchTemplate"]["id"] == _planned_id(
            next(t for t in of_type(declared, "ec2/launchTemplate:LaunchTemplate")
                 if "tagSpecifications" in t.inputs
                 and t.inputs["tagSpecifications"][0]["tags"]["gpucluster:pool"] == pool.name), stack)
        assert group["version"] == stack.spec.eks.version
        assert "instanceTypes" not in group and lt["instanceType"] == pool.instance_type
        nics = lt["networkInterfaces"]
        assert len(nics) == (pool.itype.efa_interfaces if pool.uses_efa else 1)
        # EKS refuses a template whose interfaces name a subnet; the node group's subnet applies.
        assert not any("subnetId" in n for n in nics)
        assert not any("associatePublicIpAddress" in n for n in nics)
        # EKS writes the node's bootstrap for its own AMI: the template names no image or profile, and its user data
        # only the pool's NodeConfig part, which EKS merges with its own (tests/test_kube_node_groups.py).
        assert not {"imageId", "iamInstanceProfile"} & set(lt)
        assert base64.b64decode(lt["userData"]).decode() == kube.node_user_data(pool)
        assert lt["metadataOptions"]["httpTokens"] == "required"
        assert lt["metadataOptions"]["httpPutResponseHopLimit"] == 1
        assert lt["blockDeviceMappings"][0]["deviceName"] == "/dev/xvda"
        assert lt["blockDeviceMappings"][0]["ebs"]["encrypted"] == "true"
        if pool.uses_efa:
            assert lt["placement"]["groupName"] in placement


def node_security_groups(stack: Stack, declared: tuple[Declared, ...]) -> dict[str, set[str]]:
    """The security groups each node group's nodes get, as EKS assigns them: its launch template's (every interface's),
    or the cluster security group when the group has no template or the template names none."""
    (cluster,) = of_type(declared, "eks/cluster:Cluster")
    cluster_sg = planned_outputs(cluster, stack.region)["vpcConfig"]["clusterSecurityGroupId"]
    templates = {_planned_id(t, stack): t.inputs for t in of_type(declared, "ec2/launchTemplate:LaunchTemplate")}
    out = {}
    for group in of_type(declared, "eks/nodeGroup:NodeGroup"):
        lt = templates.get(group.inputs.get("launchTemplate", {}).get("id"), {})
        per_interface = [set(n.get("securityGroups", [])) for n in lt.get("networkInterfaces", [])]
        named = set(lt.get("vpcSecurityGroupIds", [])) | (set.intersection(*per_interface) if per_interface else set())
        out[group.inputs["nodeGroupName"]] = named or {cluster_sg}
    return out


def test_every_node_group_shares_a_security_group_with_the_control_plane(
        k8s: tuple[Stack, tuple[Declared, ...]]) -> None:
    stack, declared = k8s
    (cluster,) = of_type(declared, "eks/cluster:Cluster")
    cluster_sg = planned_outputs(cluster, stack.region)["vpcConfig"]["clusterSecurityGroupId"]
    groups = node_security_groups(stack, declared)
    assert len(groups) == len(stack.spec.pools) + 2  # and the system and CPU nodes
    # Pods on system nodes (CoreDNS, Kueue's webhook) and accelerator nodes reach each other, and the add-ons too.
    shared = set.intersection(*groups.values())
    assert cluster_sg in shared
    # The stack's group is the one the control plane and every node group share (with private_access_cidrs the
    # control plane has the API's own group besides, which no node has).
    control_plane_groups: set[str] = set(cluster.inputs["vpcConfig"]["securityGroupIds"])
    (stack_sg,) = control_plane_groups & shared
    assert len(cluster.inputs["vpcConfig"]["securityGroupIds"]) == 1 + bool(stack.spec.eks.private_access_cidrs)
    for lt in _templates(declared).values():  # EFA interfaces too: NCCL's traffic crosses every card
        assert all(set(n["securityGroups"]) == {stack_sg, cluster_sg} for n in lt["networkInterfaces"])


def test_capacity_block_pool() -> None:
    pools = [{"name": "p5-cb", "instance_type": "p5.48xlarge", "capacity": "capacity-block", "min_nodes": 2,
              "max_nodes": 2, "capacity_reservation_id": "cr-0a1b2c3d4e5f60718"}]
    stack, declared = variant(TEAM_K8S, pools=pools)
    assert _groups(stack, declared)["p5-cb"]["capacityType"] == "CAPACITY_BLOCK"
    lt = _templates(declared)["p5-cb"]
    assert lt["instanceMarketOptions"] == {"marketType": "capacity-block"}
    assert lt["capacityReservationSpecification"]["capacityReservationTarget"]["capacityReservationId"] == \
        "cr-0a1b2c3d4e5f60718"


def test_trainium_pool_boots_neuron_ami_and_is_tainted_for_neuron() -> None:
    pools = [{"name": "trn1", "instance_type": "trn1.32xlarge", "max_nodes": 2}]
    stack, declared = variant(TEAM_K8S, pools=pools)
    group = _groups(stack, declared)["trn1"]
    assert group["amiType"] == "AL2023_x86_64_NEURON"
    assert {t["key"] for t in group["taints"]} == {"aws.amazon.com/neuron", node_health.STARTUP_TAINT}
    # No NVIDIA pool: no NVIDIA device plugin, dcgm-exporter or idle-GPU rule.
    releases = _releases(declared)
    assert not {"nvidia-device-plugin", "dcgm-exporter"} & set(releases) and "efa-device-plugin" in releases
    # Neuron's device plugin, pinned, on the Neuron nodes (their label), through their taint; nothing else of its chart.
    neuron = releases["neuron-device-plugin"]
    assert (neuron["chart"], neuron["version"], neuron["namespace"]) == (
        "oci://public.ecr.aws/neuron/neuron-helm-chart", "1.10.0", "kube-system")
    plugin = neuron["values"]["devicePlugin"]
    assert plugin["enabled"] is True and plugin["nodeSelector"] == {"gpucluster/accelerator": "neuron"}
    assert group["labels"]["gpucluster/accelerator"] == "neuron"
    assert {"operator": "Exists"} in plugin["tolerations"]
    assert all(neuron["values"][part] == {"enabled": False}
               for part in ("npd", "scheduler", "draDriver", "ultraserverOperator"))
    assert not of_type(declared, "monitoring.coreos.com/v1:PrometheusRule")


# --- 3. Scaling from zero ---------------------------------------------------------------------------------------

def test_autoscaler_node_template_tags_on_each_group(k8s: tuple[Stack, tuple[Declared, ...]]) -> None:
    stack, declared = k8s
    tags: dict[str, dict[str, str]] = {}
    for tag in of_type(declared, "autoscaling/tag:Tag"):
        tags.setdefault(tag.inputs["autoscalingGroupName"], {})[tag.inputs["tag"]["key"]] = tag.inputs["tag"]["value"]
        assert tag.inputs["tag"]["propagateAtLaunch"] is False
    prefix = "k8s.io/cluster-autoscaler/node-template"
    for pool in stack.spec.pools:
        got = tags[planned_asg_name(f"{stack.cluster_name}-{pool.name}")]  # the group EKS made for the node group
        assert got[f"{prefix}/label/gpucluster/pool"] == pool.name
        resource = kube.accelerator_resource(pool)
        assert got[f"{prefix}/taint/{resource}"] == "true:NoSchedule"
        assert pool.itype.accelerator is not None
        assert got[f"{prefix}/resources/{resource}"] == str(pool.itype.accelerator.count)
        if pool.uses_efa:
            assert got[f"{prefix}/resources/vpc.amazonaws.com/efa"] == str(pool.itype.efa_interfaces)
        assert (f"{prefix}/taint/gpucluster/spot" in got) == (pool.capacity == "spot")
        assert got[f"{prefix}/label/gpucluster/family"] == kube.family_name(stack, pool)
        assert got == autoscaler_node_template_tags(stack, pool)


def test_p5_template_tags_say_8_gpus_and_32_efa() -> None:
    stack = load_stack(TEAM_K8S)
    pool = next(p for p in stack.spec.pools if p.name == "p5-spot")
    tags = autoscaler_node_template_tags(stack, pool)
    assert tags["k8s.io/cluster-autoscaler/node-template/resources/nvidia.com/gpu"] == "8"
    assert tags["k8s.io/cluster-autoscaler/node-template/resources/vpc.amazonaws.com/efa"] == "32"
    assert tags["k8s.io/cluster-autoscaler/node-template/taint/gpucluster/spot"] == "true:NoSchedule"


def _releases(declared: tuple[Declared, ...]) -> dict[str, dict]:
    return {r.inputs["name"]: r.inputs for r in of_type(declared, "helm.sh/v3:Release")}


def test_autoscaler_priority_expander_spot_first(k8s: tuple[Stack, tuple[Declared, ...]]) -> None:
    stack, declared = k8s
    ca = _releases(declared)["cluster-autoscaler"]
    assert ca["values"]["extraArgs"]["expander"] == "priority"
    assert ca["values"]["autoDiscovery"]["clusterName"] == stack.cluster_name
    rank = {regex: int(p) for p, regexes in ca["values"]["expanderPriorities"].items() for regex in regexes}

    def rank_of(group: str) -> int:
        """The rank of the one entry that matches the group's Auto Scaling group as EKS names it."""
        asg = f"eks-{group}-{uuid.uuid4()}"
        (matched,) = [r for regex, r in rank.items() if re.search(regex, asg)]
        return matched

    for pool in stack.spec.pools:
        if pool.fallback:
            assert rank_of(f"{stack.cluster_name}-{pool.name}") > rank_of(f"{stack.cluster_name}-{pool.fallback}")
    # A pool whose name another's begins with gets its own entry only (p5 and p5-spot).
    groups = ("gpucluster-x-p5", "gpucluster-x-p5-spot")
    for group in groups:
        asg = f"eks-{group}-{uuid.uuid4()}"
        assert [g for g in groups if re.search(kube.asg_name_regex(g), asg)] == [group], asg
    # Its Pod Identity role resizes only this cluster's groups.
    (assoc,) = [a for a in of_type(declared, "eks/podIdentityAssociation:PodIdentityAssociation")
                if a.inputs["serviceAccount"] == "cluster-autoscaler"]
    assert assoc.inputs["namespace"] == "kube-system"
    roles = {p.name: json.loads(p.inputs["policy"]) for p in of_type(declared, "iam/rolePolicy:RolePolicy")}
    grants = {s["Sid"]: s for s in roles[f"{stack.cluster_name}-autoscaler"]["Statement"]}
    resize = grants["ResizeOwnGroups"]
    assert resize["Condition"] == {"StringEquals": {
        f"aws:ResourceTag/k8s.io/cluster-autoscaler/{stack.cluster_name}": "owned"}}
    assert resize["Resource"] == (f"arn:aws:autoscaling:{stack.region}:123456789012:autoScalingGroup:*:"
                                  f"autoScalingGroupName/eks-{stack.cluster_name}-*")
    # Every pool's group, as the node group names it (EKS: eks-<node group>-<uuid>), matches the resource pattern;
    # another cluster's does not.
    from fnmatch import fnmatchcase
    tagged = {t.inputs["autoscalingGroupName"] for t in of_type(declared, "autoscaling/tag:Tag")}
    assert len(tagged) == len(stack.spec.pools) + 1  # and the CPU nodes'
    arn = f"arn:aws:autoscaling:{stack.region}:123456789012:autoScalingGroup:0a1b2c3d-uuid:autoScalingGroupName/"
    assert all(fnmatchcase(arn + group, resize["Resource"]) for group in tagged)
    assert not fnmatchcase(arn + "eks-gpucluster-other-p5-od-uuid", resize["Resource"])
    assert (grants["NodeGroups"]["Resource"]
            == f"arn:aws:eks:{stack.region}:123456789012:nodegroup/{stack.cluster_name}/*")


@pytest.mark.parametrize(("partition", "region"), [("aws", "us-east-1"), ("aws-cn", "cn-north-1"),
                                                   ("aws-us-gov", "us-gov-west-1")])
def test_the_controllers_policies_name_arns_in_the_clusters_partition(partition: str, region: str) -> None:
    """The autoscaler's and the burn-in's grants are in the cluster's own partition: an `arn:aws:` resource in aws-cn
    or aws-us-gov matches nothing there, and the controller is refused."""
    cluster_arn = f"arn:{partition}:eks:{region}:123456789012:cluster/gpucluster-x"
    documents = [json.loads(autoscaler_policy(cluster_arn)),
                 json.loads(burn_in_policy(cluster_arn, ["gpucluster-x-p5"]))]
    resources = [r for d in documents for s in d["Statement"]
                 for r in ([s["Resource"]] if isinstance(s["Resource"], str) else s["Resource"]) if r != "*"]
    assert resources and all(r.startswith(f"arn:{partition}:") and f":{region}:123456789012:" in r for r in resources)


# --- 4. Devices and storage; Helm pins ---------------------------------------------------------------------------

def test_releases_are_pinned(k8s: tuple[Stack, tuple[Declared, ...]]) -> None:
    stack, declared = k8s
    releases = _releases(declared)
    kinds = {p.accelerator.kind for p in stack.spec.pools}
    # The cluster's own releases, and each device plugin (and NVIDIA's exporter) where a pool has its devices.
    pins = {"cluster-autoscaler": eks.CLUSTER_AUTOSCALER, "kueue": eks.KUEUE, "monitoring": eks.KUBE_PROMETHEUS_STACK}
    if "nvidia" in kinds:
        pins |= {"nvidia-device-plugin": eks.NVIDIA_DEVICE_PLUGIN, "dcgm-exporter": eks.DCGM_EXPORTER}
    if "neuron" in kinds:
        pins["neuron-device-plugin"] = eks.NEURON_DEVICE_PLUGIN
    if any(p.uses_efa for p in stack.spec.pools):
        pins["efa-device-plugin"] = eks.EFA_DEVICE_PLUGIN
    assert set(releases) == set(pins)
    for name, chart in pins.items():
        release = releases[name]
        assert (release["chart"], release["version"], release["namespace"]) == (chart.name, chart.version,
                                                                                chart.namespace)
        assert release.get("repositoryOpts", {}).get("repo", "") == chart.repository
        assert release["version"][0].isdigit() or release["version"].startswith("v")


def test_efa_plugin_only_on_efa_nodes(k8s: tuple[Stack, tuple[Declared, ...]]) -> None:
    _, declared = k8s
    values = _releases(declared)["efa-device-plugin"]["values"]
    assert values["nodeSelector"] == {"gpucluster/efa": "true"}
    nvidia = _releases(declared)["nvidia-device-plugin"]["values"]
    terms = nvidia["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms == [{"matchExpressions": [{"key": "gpucluster/accelerator", "operator": "In", "values": ["nvidia"]}]}]


def test_no_efa_no_efa_plugin() -> None:
    pools = [{"name": "g6e", "instance_type": "g6e.xlarge", "max_nodes": 2}]  # no EFA on the type
    _, declared = variant(TEAM_K8S, pools=pools)
    assert "efa-device-plugin" not in _releases(declared)
    (quota,) = of_type(declared, "core/v1:ResourceQuota")
    assert "requests.vpc.amazonaws.com/efa" not in quota.inputs["spec"]["hard"]


def test_fsx_as_static_volume_and_claim(k8s: tuple[Stack, tuple[Declared, ...]]) -> None:
    stack, declared = k8s
    (pv,) = of_type(declared, "core/v1:PersistentVolume")
    (pvc,) = of_type(declared, "core/v1:PersistentVolumeClaim")
    csi = pv.inputs["spec"]["csi"]
    lustre = stack.spec.storage.lustre
    if lustre.file_system_id:  # an existing file system: named as the stack file gives it, none made
        assert not of_type(declared, "fsx/lustreFileSystem:LustreFileSystem")
        file_system, dns_name = lustre.file_system_id, lustre.dns_name
        assert csi["volumeAttributes"]["mountname"] == lustre.mount_name
    else:
        (fs,) = of_type(declared, "fsx/lustreFileSystem:LustreFileSystem")
        file_system = _planned_id(fs, stack)
        dns_name = f"{file_system}.fsx.{stack.region}.amazonaws.com"
    assert csi["driver"] == "fsx.csi.aws.com" and csi["volumeHandle"] == file_system
    assert csi["volumeAttributes"]["dnsname"] == dns_name
    assert pv.inputs["spec"]["claimRef"] == {"namespace": stack.spec.team, "name": "fsx"}
    assert pvc.inputs["metadata"]["namespace"] == stack.spec.team
    assert pvc.inputs["spec"]["volumeName"] == pv.inputs["metadata"]["name"]
    assert pv.inputs["spec"]["persistentVolumeReclaimPolicy"] == "Retain"  # deleting the claim keeps the data


# --- 5. Per-team isolation --------------------------------------------------------------------------------------

def test_quota_counts_every_pool_at_max() -> None:
    stack, declared = planned(TEAM_K8S)
    (quota,) = of_type(declared, "core/v1:ResourceQuota")
    hard = quota.inputs["spec"]["hard"]
    # p5-od 2 + p5-spot 4 nodes of 8 GPUs and 32 EFA; g6e.12xlarge 2 nodes of 4 GPUs and 1 EFA; 4 CPU nodes
    # (m7i.2xlarge) of 8 vCPUs.
    assert hard["requests.nvidia.com/gpu"] == str(6 * 8 + 2 * 4)
    assert hard["requests.vpc.amazonaws.com/efa"] == str(6 * 32 + 2 * 1)
    assert hard["requests.cpu"] == str(6 * 192 + 2 * 48 + 4 * 8)
    assert hard["pods"] == str((8 + 4) * kube.PODS_PER_NODE)
    assert quota.inputs["metadata"]["namespace"] == stack.spec.team
    (limits,) = of_type(declared, "core/v1:LimitRange")
    assert limits.inputs["spec"]["limits"][0]["defaultRequest"] == {"cpu": "500m", "memory": "1Gi"}


def test_kueue_flavours_are_pool_families_so_spot_falls_back() -> None:
    """One flavour for a spot pool and its fallback, selecting on a label both node groups carry: Kueue admits a job to
    it and the pods may land on either; the autoscaler tries the spot group first and gives up on it within minutes."""
    stack, declared = planned(TEAM_K8S)
    flavours = {f.inputs["metadata"]["name"]: f.inputs["spec"] for f in
                of_type(declared, "kueue.x-k8s.io/v1beta2:ResourceFlavor")}
    assert set(flavours) == {"cpu", "p5-spot", "g6e"}  # the CPU nodes' flavour: tests/test_kube_queues.py
    assert flavours["p5-spot"]["nodeLabels"] == {"gpucluster/family": "p5-spot"}
    groups = _groups(stack, declared)
    assert (groups["p5-spot"]["labels"]["gpucluster/family"] == groups["p5-od"]["labels"]["gpucluster/family"]
            == "p5-spot")
    assert groups["g6e"]["labels"]["gpucluster/family"] == "g6e"
    # Kueue puts the flavour's tolerations on the pods it admits: spot's opt-in, never the accelerator's taint (the
    # API server's ExtendedResourceToleration gives that to pods that request the accelerator, and to no other).
    assert flavours["p5-spot"]["tolerations"] == [
        {"key": "gpucluster/spot", "operator": "Equal", "value": "true", "effect": "NoSchedule"}]
    assert flavours["g6e"]["tolerations"] == []
    assert not any("nodeTaints" in f for f in flavours.values())
    # Every taint of every node group is tolerated by a pod its family's flavour admits that requests the group's
    # accelerator, but the burn-in's startup taint, which keeps jobs off a node until its burn-in passes
    # (tests/test_kube_burn_in.py); a pod that requests no accelerator tolerates the accelerator's taint on none.
    for name, group in groups.items():
        if name == "system":
            continue
        flavour = flavours[group["labels"]["gpucluster/family"]]
        tolerated = {(t["key"], t["value"], t["effect"]) for t in flavour["tolerations"]}
        tainted = {(t["key"], t["value"], t["effect"].replace("NO_SCHEDULE", "NoSchedule")) for t in group["taints"]
                   if t["key"] != node_health.STARTUP_TAINT}
        accelerator = {t for t in tainted if t[0] in (eks.GPU_RESOURCE, eks.NEURON_RESOURCE)}
        assert tainted - accelerator <= tolerated
        assert not accelerator & tolerated
    queues = {q.inputs["metadata"]["name"]: q.inputs for q in of_type(declared, "kueue.x-k8s.io/v1beta2:ClusterQueue")}
    assert set(queues) == {"language", "language-cpu"}  # the accelerator queue and the CPU queue
    cq = queues["language"]
    (group,) = cq["spec"]["resourceGroups"]
    assert [f["name"] for f in group["flavors"]] == ["p5-spot", "g6e"]
    assert group["coveredResources"] == ["cpu", "memory", "hugepages-2Mi", "nvidia.com/gpu", "vpc.amazonaws.com/efa"]
    p5 = {r["name"]: r["nominalQuota"] for r in group["flavors"][0]["resources"]}
    # Spot at max (4) and its fallback at max (2) can both be up.
    assert p5 == {"cpu": 6 * 192, "memory": f"{6 * 2048}Gi", "nvidia.com/gpu": 48, "vpc.amazonaws.com/efa": 192,
                  "hugepages-2Mi": f"{6 * 5128 * 2}Mi"}
    g6e = {r["name"]: r["nominalQuota"] for r in group["flavors"][1]["resources"]}
    assert g6e["vpc.amazonaws.com/efa"] == 2 and g6e["nvidia.com/gpu"] == 8
    extra = _releases(declared)["cluster-autoscaler"]["values"]["extraArgs"]
    assert extra["expander"] == "priority"
    assert extra["max-node-provision-time"] == f"{catalog.NODE_PROVISION_MINUTES['p5']}m"  # its slowest type
    (cpu_group,) = queues["language-cpu"]["spec"]["resourceGroups"]
    assert [f["name"] for f in cpu_group["flavors"]] == ["cpu"] and cpu_group["coveredResources"] == ["cpu", "memory"]
    for queue in queues.values():
        assert queue["spec"]["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "language"}}
    local = {q.inputs["metadata"]["name"]: q.inputs for q in of_type(declared, "kueue.x-k8s.io/v1beta2:LocalQueue")}
    assert {name: q["spec"] for name, q in local.items()} == {"default": {"clusterQueue": "language"},
                                                               "cpu": {"clusterQueue": "language-cpu"}}
    assert {q["metadata"]["namespace"] for q in local.values()} == {"language"}


def test_jobs_without_a_queue_name_are_not_admitted() -> None:
    stack, declared = planned(TEAM_K8S)
    config = yaml.safe_load(_releases(declared)["kueue"]["values"]["managerConfig"]["controllerManagerConfigYaml"])
    assert config["manageJobsWithoutQueueName"] is True
    (ns,) = [n for n in of_type(declared, "core/v1:Namespace") if n.inputs["metadata"]["name"] == stack.spec.team]
    assert config["managedJobsNamespaceSelector"] == {"matchLabels": {"gpucluster/team-namespace": "true"}}
    assert ns.inputs["metadata"]["labels"]["gpucluster/team-namespace"] == "true"
    # Bare pods, Deployments and StatefulSets are queued too: none takes a GPU around the quota or the hold.
    assert {"batch/job", "pod", "deployment", "statefulset"} <= set(config["integrations"]["frameworks"])
    assert ns.inputs["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "baseline"


def test_the_guardrail_owns_the_stop_policy() -> None:
    """The program never names the ClusterQueue's stopPolicy, and applies server-side: an `up` leaves a held queue held
    (no ignore_changes needed, none relied on)."""
    _, declared = planned(TEAM_K8S)
    queues = of_type(declared, "kueue.x-k8s.io/v1beta2:ClusterQueue")
    assert len(queues) == 2
    for cq in queues:
        assert "stopPolicy" not in cq.inputs["spec"] and not cq.ignore_changes
    (provider,) = [d for d in declared if d.type == "pulumi:providers:kubernetes"]
    assert provider.inputs["enableServerSideApply"] in (True, "true")
    # What the guardrail patches is the field the program leaves alone.
    assert queue_guardrail.patch_body(queue_guardrail.Action.HOLD, "1")["spec"] == {"stopPolicy": "Hold"}


def test_queues_wait_for_kueue() -> None:
    _, declared = planned(TEAM_K8S)
    kueue = next(r.urn for r in of_type(declared, "helm.sh/v3:Release") if r.inputs["name"] == "kueue")
    for d in declared:
        if d.type.startswith("kubernetes:kueue.x-k8s.io/"):
            assert kueue in d.dependencies, d.name


# --- 6. Budget that acts ----------------------------------------------------------------------------------------

def test_budget_denies_the_autoscalers_scale_up(k8s: tuple[Stack, tuple[Declared, ...]]) -> None:
    stack, declared = k8s
    if not acts(stack):  # alerts only: nothing denied
        assert not of_type(declared, "budgets/budgetAction:BudgetAction")
        return
    (action,) = of_type(declared, "budgets/budgetAction:BudgetAction")
    name = stack.cluster_name
    assert action.inputs["definition"]["iamActionDefinition"]["roles"] == [f"{name}-autoscaler"]
    (deny,) = [p for p in of_type(declared, "iam/policy:Policy") if p.name == f"{name}-launch-deny"]
    (statement,) = json.loads(deny.inputs["policy"])["Statement"]
    assert statement["Effect"] == "Deny" and "autoscaling:SetDesiredCapacity" in statement["Action"]


def test_guardrail_reads_the_budget_queue_and_may_patch_the_teams_queues(
        k8s: tuple[Stack, tuple[Declared, ...]]) -> None:
    stack, declared = k8s
    name = stack.cluster_name
    if stack.spec.budget.act_threshold_percent is None:  # alerts only: no guardrail, nothing it may do
        assert not [r for r in of_type(declared, "rbac.authorization.k8s.io/v1:ClusterRole")
                    if r.inputs["metadata"]["name"] == kube.GUARDRAIL]
        assert f"{name}-guardrail-pod" not in {p.name for p in of_type(declared, "iam/rolePolicy:RolePolicy")}
        return
    grants = {s["Sid"]: s for s in json.loads({p.name: p for p in of_type(declared, "iam/rolePolicy:RolePolicy")}[
        f"{name}-guardrail-pod"].inputs["policy"])["Statement"]}
    assert grants["BudgetQueue"]["Resource"] == f"arn:aws:sqs:{stack.region}:123456789012:{name}-guardrail"
    assert grants["ReadBudget"]["Resource"] == f"arn:aws:budgets::123456789012:budget/{stack.budget_name}"
    (action,) = of_type(declared, "budgets/budgetAction:BudgetAction")
    action_arn = planned_outputs(action, stack.region)["arn"]
    assert action_arn.startswith(f"arn:aws:budgets::123456789012:budget/{stack.budget_name}/action/")
    assert grants["ReverseLaunchDeny"] == {"Sid": "ReverseLaunchDeny", "Effect": "Allow", "Resource": action_arn,
                                           "Action": ["budgets:DescribeBudgetAction", "budgets:ExecuteBudgetAction"]}
    (role,) = [r for r in of_type(declared, "rbac.authorization.k8s.io/v1:ClusterRole")
               if r.inputs["metadata"]["name"] == kube.GUARDRAIL]
    queues = sorted(q.inputs["metadata"]["name"] for q in of_type(declared, "kueue.x-k8s.io/v1beta2:ClusterQueue"))
    (rule,) = role.inputs["rules"]
    assert {**rule, "resourceNames": sorted(rule["resourceNames"])} == {
        "apiGroups": ["kueue.x-k8s.io"], "resources": ["clusterqueues"], "resourceNames": queues,
        "verbs": ["get", "patch"]}
    (deployment,) = [d for d in of_type(declared, "apps/v1:Deployment")
                     if d.inputs["metadata"]["name"] == kube.GUARDRAIL]
    env = {e["name"]: e["value"] for e in deployment.inputs["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["QUEUE_URL"] == f"https://sqs.{stack.region}.amazonaws.com/123456789012/{name}-guardrail"
    assert sorted(env["CLUSTER_QUEUES"].split(",")) == queues and env["BUDGET_NAME"] == stack.budget_name
    assert env["LAUNCH_DENY_ACTION_ID"] == planned_outputs(action, stack.region)["actionId"]
    (script,) = [c for c in of_type(declared, "core/v1:ConfigMap") if c.inputs["metadata"]["name"] == kube.GUARDRAIL]
    assert script.inputs["data"]["gpucluster.node.queue_guardrail.py"] == Path(queue_guardrail.__file__).read_text()


def test_the_guardrail_pod_has_every_file_its_program_imports(k8s: tuple[Stack, tuple[Declared, ...]],
                                                            tmp_path: Path) -> None:
    """The ConfigMap carries the guardrail and the library modules it shares with the Slurm head's guardrail (the queue
    loop, the budget decision); the volume puts each at its path. The program, as the container starts it from that
    mount, imports with the standard library alone (boto3 is the pod's own, imported where the service starts)."""
    import subprocess
    import sys

    stack, declared = k8s
    configs = [c for c in of_type(declared, "core/v1:ConfigMap") if c.inputs["metadata"]["name"] == kube.GUARDRAIL]
    if not acts(stack):  # alerts only: no guardrail
        assert not configs and not guardrail_deployments(declared)
        return
    (script,) = configs
    (deployment,) = guardrail_deployments(declared)
    pod = deployment.inputs["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v.get("configMap", {}).get("name") == kube.GUARDRAIL]
    (mount,) = [m["mountPath"] for m in pod["containers"][0]["volumeMounts"] if m["name"] == volume["name"]]
    for item in volume["configMap"]["items"]:  # the volume as the kubelet projects it, under tmp_path
        (tmp_path / item["path"]).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / item["path"]).write_text(script.inputs["data"][item["key"]])
    assert {item["key"] for item in volume["configMap"]["items"]} == set(script.inputs["data"])
    program = pod["containers"][0]["command"][-1].split("exec python ")[1]
    assert program.startswith(f"{mount}/")
    code = standard_library.ONLY + "import runpy\nrunpy.run_path(sys.argv[1])\n"
    done = subprocess.run([sys.executable, "-I", "-c", code, str(tmp_path / program.removeprefix(f"{mount}/"))],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_a_budget_that_only_alerts_has_no_hold_and_no_deny() -> None:
    doc = yaml.safe_load(TEAM_K8S.read_text())["config"]["gpucluster:cluster"]["budget"]
    _, declared = variant(TEAM_K8S, budget={**doc, "act_threshold_percent": None})
    for kind in ("budgets/budgetAction:BudgetAction", "apps/v1:Deployment", "sqs/queue:Queue"):
        assert not of_type(declared, kind), kind
    assert not [r for r in of_type(declared, "rbac.authorization.k8s.io/v1:ClusterRole")
                if r.inputs["metadata"]["name"] == kube.GUARDRAIL]


# --- 7. Monitoring ----------------------------------------------------------------------------------------------

def test_idle_gpu_rule_matches_the_slurm_alarm(k8s: tuple[Stack, tuple[Declared, ...]]) -> None:
    _, declared = k8s
    (rule,) = of_type(declared, "monitoring.coreos.com/v1:PrometheusRule")
    (alert,) = rule.inputs["spec"]["groups"][0]["rules"]
    assert alert["alert"] == "GpuIdle"
    slurm = next(r for r in prometheus.alert_rules() if r["alert"] == "GpuIdle")  # the Slurm flavour's rules.yml
    assert (alert["expr"], alert["for"]) == (slurm["expr"], slurm["for"])
    dcgm = _releases(declared)["dcgm-exporter"]["values"]
    assert dcgm["serviceMonitor"]["enabled"] is True


def test_gpu_idle_alert_reaches_the_stack_topic(k8s: tuple[Stack, tuple[Declared, ...]], tmp_path: Path) -> None:
    """Alertmanager routes to the budget's topic with SigV4 (not the chart's `null`), as the Slurm flavour's does, and
    its service account's Pod Identity role may publish to that topic only."""
    import shutil
    import subprocess

    stack, declared = k8s
    (topic,) = of_type(declared, "sns/topic:Topic")
    topic_arn = planned_outputs(topic, stack.region)["arn"]
    values = _releases(declared)["monitoring"]["values"]["alertmanager"]
    config = values["config"]
    assert config["route"]["receiver"] == "stack-topic"
    receivers = {r["name"]: r for r in config["receivers"]}
    (sns,) = receivers["stack-topic"]["sns_configs"]
    assert sns["topic_arn"] == topic_arn and sns["sigv4"] == {"region": stack.region}
    assert config["route"]["routes"] == [{"receiver": "null", "matchers": ['alertname = "Watchdog"']}]
    # The same routing as the Slurm head's Alertmanager (gpucluster/node/bootstrap.py writes it from the same function).
    from gpucluster.contract.settings import alertmanager_routing
    assert receivers["stack-topic"] == alertmanager_routing(topic_arn, stack.region, stack.cluster_name)["receivers"][0]
    amtool = shutil.which("amtool")
    assert amtool, "amtool is missing: install Debian's prometheus-alertmanager (make test does)"
    (tmp_path / "alertmanager.yml").write_text(json.dumps(config))
    checked = subprocess.run([amtool, "check-config", str(tmp_path / "alertmanager.yml")], capture_output=True,
                             text=True, timeout=30)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert values["serviceAccount"] == {"create": True, "name": "alertmanager"}
    (assoc,) = [a for a in of_type(declared, "eks/podIdentityAssociation:PodIdentityAssociation")
                if a.inputs["serviceAccount"] == "alertmanager"]
    assert assoc.inputs["namespace"] == "monitoring"
    assert assoc.inputs["roleArn"] == f"arn:aws:iam::123456789012:role/{stack.cluster_name}-alertmanager"
    (grant,) = [json.loads(p.inputs["policy"]) for p in of_type(declared, "iam/rolePolicy:RolePolicy")
                if p.name == f"{stack.cluster_name}-alertmanager"]
    assert grant["Statement"] == [{"Sid": "PublishAlerts", "Effect": "Allow", "Action": "sns:Publish",
                                   "Resource": topic_arn}]


# --- 8. The first job -------------------------------------------------------------------------------------------

def test_example_job() -> None:
    stack = load_stack(TEAM_K8S)
    pool = kube.example_pool(stack)
    assert pool.uses_efa and pool.itype.accelerator is not None and pool.itype.accelerator.kind == "nvidia"
    config_map, service, job = kube.example_job(stack, pool, (EXAMPLES_DIR / "ddp_train.py").read_text())
    assert config_map["data"]["ddp_train.py"] == (ROOT / "examples" / "ddp_train.py").read_text()
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "default"
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == 2
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == service["metadata"]["name"] and service["spec"]["clusterIP"] == "None"
    # The pool's family: spot first, its on-demand fallback when spot has no capacity.
    assert pod["nodeSelector"] == {"gpucluster/family": "p5-spot"}
    (flavour,) = [f for f in kube.resource_flavors(stack) if f["metadata"]["name"] == "p5-spot"]
    assert pod["tolerations"] == flavour["spec"]["tolerations"]
    (container,) = pod["containers"]
    # A p5.48xlarge: 192 vCPUs, 2 TiB; all its GPUs and EFA interfaces, most of its CPU and memory.
    assert container["resources"]["requests"] == {"nvidia.com/gpu": "8", "vpc.amazonaws.com/efa": "32",
                                                  "cpu": "172", "memory": "1740Gi", "hugepages-2Mi": "5120Mi"}
    assert container["resources"]["limits"] == container["resources"]["requests"]
    (shm,) = [v for v in pod["volumes"] if v["name"] == "shm"]
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "435Gi"}
    assert {"name": "fsx", "persistentVolumeClaim": {"claimName": "fsx"}} in pod["volumes"]
    command = container["command"][-1]
    assert "torchrun --nnodes=2 --nproc-per-node=8" in command and '--checkpoint-dir "/fsx/checkpoints/' in command


def admitted(container: dict, limit_range: dict) -> dict[str, dict[str, str]]:
    """The container's resources once admitted: API defaulting copies its own limits to missing requests, then the
    LimitRanger fills what is still missing from `defaultRequest` and `default`."""
    (rule,) = limit_range["spec"]["limits"]
    own = container["resources"]
    limits = {**rule.get("default", {}), **own.get("limits", {})}
    requests = {**rule.get("defaultRequest", {}), **own.get("limits", {}), **own.get("requests", {})}
    return {"requests": requests, "limits": limits}


def _gi(quantity: str) -> int:
    assert quantity.endswith("Gi"), quantity
    return int(quantity[:-2])


@pytest.mark.parametrize("pool_name", ["p5-spot", "p5-od", "g6e"])
def test_the_example_job_keeps_its_memory_under_the_limit_range(pool_name: str) -> None:
    stack = load_stack(TEAM_K8S)
    pool = next(p for p in stack.spec.pools if p.name == pool_name)
    *_, job = kube.example_job(stack, pool, (EXAMPLES_DIR / "ddp_train.py").read_text())
    (container,) = job["spec"]["template"]["spec"]["containers"]
    effective = admitted(container, kube.limit_range(stack))
    node_gi = pool.itype.memory_mib // 1024
    # Most of the node, not the LimitRange's 1Gi default: torch, NCCL and the data loaders fit; /dev/shm within it.
    assert node_gi * 0.8 <= _gi(effective["limits"]["memory"]) < node_gi
    (shm,) = [v for v in job["spec"]["template"]["spec"]["volumes"] if v["name"] == "shm"]
    assert 0 < _gi(shm["emptyDir"]["sizeLimit"]) <= _gi(effective["limits"]["memory"]) // 2
    assert int(effective["requests"]["cpu"]) < pool.itype.vcpus


def test_the_limit_range_does_not_cap_a_pod_that_sets_only_gpu_limits() -> None:
    """A team's own GPU job that sets only `nvidia.com/gpu` gets default requests (counted by the quota), no 1Gi cap."""
    stack = load_stack(TEAM_K8S)
    effective = admitted({"resources": {"limits": {"nvidia.com/gpu": "8"}}}, kube.limit_range(stack))
    assert "memory" not in effective["limits"] and "cpu" not in effective["limits"]
    assert effective["requests"] == {"cpu": "500m", "memory": "1Gi", "nvidia.com/gpu": "8"}


# --- Schemas ----------------------------------------------------------------------------------------------------

def _strict(schema: dict) -> dict:
    """An openAPIV3Schema as the API server's strict field validation reads it: unknown fields are errors."""
    schema = copy.deepcopy(schema)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            # Go's regexp takes a flag group anywhere; Python's only at the start (same meaning here: whole pattern).
            if isinstance(node.get("pattern"), str) and node["pattern"].startswith("^(?i)"):
                node["pattern"] = "(?i)^" + node["pattern"][len("^(?i)"):]
            if "properties" in node and "additionalProperties" not in node \
                    and not node.get("x-kubernetes-preserve-unknown-fields"):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)
    walk(schema)
    return schema


def _crd_schemas() -> dict[tuple[str, str], dict]:
    out = {}
    for path, api in (("kueue-v0.19.2-v1beta2.json", kube.KUEUE_API),
                      ("prometheusrule-kube-prometheus-stack-88.5.3.json", "monitoring.coreos.com/v1")):
        for kind, schema in json.loads((SCHEMAS / path).read_text())["schemas"].items():
            out[(api, kind)] = _strict(schema)
    return out


CRDS = _crd_schemas()


def check(obj: dict, version: str) -> None:
    """Raise if the object is not valid for the Kubernetes version (or its custom resource's schema)."""
    schema = CRDS.get((obj["apiVersion"], obj["kind"]))
    if schema is not None:
        jsonschema.validate(obj, schema)
    else:
        kubernetes_validate.validate(obj, version, strict=True)


def test_every_declared_object_is_valid(k8s: tuple[Stack, tuple[Declared, ...]]) -> None:
    stack, declared = k8s
    objects = k8s_objects(declared)
    kinds = {o["kind"] for o in objects}
    expected = {"Namespace", "ResourceQuota", "LimitRange", "PersistentVolume", "PersistentVolumeClaim",
                "ResourceFlavor", "ClusterQueue", "LocalQueue", "ValidatingAdmissionPolicy",
                "ValidatingAdmissionPolicyBinding", "ClusterRole"}
    expected |= {"Deployment"} if acts(stack) else set()
    expected |= {"PrometheusRule"} if any(p.accelerator.kind == "nvidia" for p in stack.spec.pools) else set()
    assert expected <= kinds
    for obj in objects:
        check(obj, stack.spec.eks.version)


def test_rendered_files_are_what_the_program_declares_and_valid(tmp_path: Path) -> None:
    from gpucluster.cli import main

    assert main(["render", str(TEAM_K8S), "--out", str(tmp_path)]) == 0
    stack, declared = planned(TEAM_K8S)
    rendered = [d for f in sorted((tmp_path / "kubernetes").glob("*.yaml")) for d in yaml.safe_load_all(f.read_text())]
    for obj in rendered:
        check(obj, stack.spec.eks.version)
    # Only the first job is for kubectl; the rest, with placeholders, says it is reference only.
    for f in (tmp_path / "kubernetes").glob("*.yaml"):
        first = f.read_text().splitlines()[0]
        assert first.startswith("# Reference, not for kubectl apply") == (f.name != "example-ddp-job.yaml"), f.name
    assert "<file system id at up>" in (tmp_path / "kubernetes" / "team.yaml").read_text()
    key = lambda o: (o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"])  # noqa: E731
    declared_keys = {key(o) for o in k8s_objects(declared)}
    job_objects = kube.example_job(stack, kube.example_pool(stack), (EXAMPLES_DIR / "ddp_train.py").read_text())
    example = {key(o) for o in job_objects}
    assert {key(o) for o in rendered} == declared_keys | example


def test_kubernetes_validate_covers_the_pinned_versions() -> None:
    """kubernetes-validate 1.37 bundles schemas up to 1.37: every version the spec allows is checked as itself."""
    from kubernetes_validate import utils

    assert all(utils.major_minor(v) <= utils.latest_version() for v in eks.VERSIONS)


@pytest.mark.parametrize("break_it", [
    lambda o: o["spec"].update(stopPolicy="Pause"),
    lambda o: o["spec"].update(cohort_name="x"),
    lambda o: o["spec"]["resourceGroups"][0].update(coveredResources=[]),
])
def test_schema_check_catches_a_bad_cluster_queue(break_it: Any) -> None:
    obj = kube.cluster_queue(load_stack(TEAM_K8S))
    check(obj, "1.35")
    break_it(obj)
    with pytest.raises(jsonschema.ValidationError):
        check(obj, "1.35")


def test_schema_check_catches_a_bad_core_object() -> None:
    quota = kube.resource_quota(load_stack(TEAM_K8S))
    check(quota, "1.35")
    quota["spec"]["hardd"] = quota["spec"].pop("hard")
    with pytest.raises(kubernetes_validate.ValidationError):
        check(quota, "1.35")


# --- Plan and cost ----------------------------------------------------------------------------------------------

def test_cost_counts_the_control_plane_not_a_head_node() -> None:
    stack = load_stack(TEAM_K8S)
    estimate = cost.estimate(stack)
    assert estimate.head_node_monthly == 0
    system = catalog.lookup(eks.SYSTEM_INSTANCE_TYPE).on_demand_usd_per_hour
    assert system is not None
    assert estimate.kubernetes_monthly == pytest.approx((0.10 + 2 * system) * cost.HOURS_PER_MONTH)
    assert not estimate.images  # EKS's own AMIs: nothing baked
    assert estimate.fixed_hourly == pytest.approx(
        (estimate.kubernetes_monthly + estimate.network_monthly + estimate.lustre_monthly) / cost.HOURS_PER_MONTH)
    assert estimate.hourly_min == pytest.approx(estimate.fixed_hourly)  # every pool from zero


def test_plan_json_for_a_kubernetes_stack(capsys: pytest.CaptureFixture[str]) -> None:
    from gpucluster.cli import main

    assert main(["plan", str(TEAM_K8S), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["cost"]["fixed_monthly_usd"]["kubernetes"] > 73  # the control plane alone is $0.10 x 730 h
    assert any(r["type"] == "aws:eks/cluster:Cluster" for r in doc["resources"])
    assert main(["plan", str(TEAM_K8S)]) == 0
    assert "EKS and system nodes per month" in capsys.readouterr().out



def test_no_team_can_take_a_namespace_the_charts_use() -> None:
    from gpucluster.spec.model import RESERVED_NAMESPACES

    charts = (eks.CLUSTER_AUTOSCALER, eks.NVIDIA_DEVICE_PLUGIN, eks.NEURON_DEVICE_PLUGIN, eks.EFA_DEVICE_PLUGIN,
              eks.KUEUE, eks.KUBE_PROMETHEUS_STACK, eks.DCGM_EXPORTER)
    assert {c.namespace for c in charts} <= set(RESERVED_NAMESPACES)
