"""GPU node groups on EKS that scale once and repair themselves, under Pulumi's mock runtime: the Cluster Autoscaler's
GPU label, its provision time sized for the stack's slowest type, node-template tags named by their key (a change of
labels and taints deletes only the tags whose key went away), the dependency graph of node groups and Pod Identity
releases, node auto repair, the node monitoring agent's tolerations, and instance-store NVMe as node scratch.

Third-party schemas are vendored in tests/schemas/ from the pinned sources: nodeadm's NodeConfig CRD
(awslabs/amazon-eks-ami v20260724) and the node monitoring agent add-on's configuration schema
(aws/eks-node-monitoring-agent v1.7.0).
"""

from __future__ import annotations

import base64
import email
import gzip
import json
from pathlib import Path
from typing import Any

import jsonschema
import moto
import pytest
import yaml

from components.kubernetes import NODE_TEMPLATE, REPLACE_REASONS, autoscaler_node_template_tags
from conftest import K8S_STACK_FILES, of_type, planned
from gpucluster.contract import node_health
from gpucluster.plan import Declared, planned_asg_name
from gpucluster.render import kube, kube_health
from gpucluster.spec import catalog, eks
from gpucluster.spec.model import Stack
from test_kubernetes import SCHEMAS, TEAM_K8S, _strict, variant

EC2_FACTS = json.load(gzip.open(Path(moto.__file__).parent / "ec2" / "resources" / "instance_types.json.gz"))
TRAINIUM = [{"name": "trn1", "instance_type": "trn1.32xlarge", "max_nodes": 2}]
Plan = tuple[Stack, tuple[Declared, ...]]


@pytest.fixture(params=K8S_STACK_FILES, ids=lambda p: p.name)
def k8s(request: pytest.FixtureRequest) -> Plan:
    return planned(request.param)


def node_groups(plan: Plan) -> dict[str, Declared]:
    """The pools' node groups by pool name (the system group aside)."""
    stack, declared = plan
    names = {f"{stack.cluster_name}-{p.name}": p.name for p in stack.spec.pools}
    return {names[g.inputs["nodeGroupName"]]: g for g in of_type(declared, "eks/nodeGroup:NodeGroup")
            if g.inputs["nodeGroupName"] in names}


def template_tags(plan: Plan, pool: str) -> dict[str, Declared]:
    """The pool's node-template tag resources by tag key."""
    stack, declared = plan
    group = planned_asg_name(f"{stack.cluster_name}-{pool}")
    return {t.inputs["tag"]["key"]: t for t in of_type(declared, "autoscaling/tag:Tag")
            if t.inputs["autoscalingGroupName"] == group}


def launch_template(plan: Plan, pool: str) -> dict[str, Any]:
    _, declared = plan
    (template,) = [t.inputs for t in of_type(declared, "ec2/launchTemplate:LaunchTemplate")
                   if "tagSpecifications" in t.inputs
                   and t.inputs["tagSpecifications"][0]["tags"]["gpucluster:pool"] == pool]
    return template


def tolerates(tolerations: list[dict[str, str]], taint: dict[str, str]) -> bool:
    """Kubernetes' matching of a toleration to a taint (key, Equal/Exists, effect; an empty key with Exists: all)."""
    for t in tolerations:
        if t.get("effect") not in (None, "", taint["effect"]):
            continue
        if t.get("operator") == "Exists" and t.get("key") in (None, "", taint["key"]):
            return True
        if t.get("key") == taint["key"] and t.get("operator", "Equal") == "Equal" and t.get("value") == taint["value"]:
            return True
    return False


# --- The autoscaler's GPU label ---------------------------------------------------------------------------------

def test_nvidia_pools_carry_the_autoscalers_gpu_label_on_group_and_template(k8s: Plan) -> None:
    stack, _ = k8s
    groups = node_groups(k8s)
    for pool in stack.spec.pools:
        if pool.accelerator.kind != "nvidia":  # test_neuron_pools_do_not_carry_the_gpu_label
            assert "k8s.amazonaws.com/accelerator" not in groups[pool.name].inputs["labels"]
            continue
        model = kube.GPU_TYPES[pool.accelerator.model]
        assert groups[pool.name].inputs["labels"]["k8s.amazonaws.com/accelerator"] == model
        # Scale-from-zero: the template node carries it too, so a node still without GPUs counts as not ready.
        tags = template_tags(k8s, pool.name)
        assert tags[f"{NODE_TEMPLATE}/label/k8s.amazonaws.com/accelerator"].inputs["tag"]["value"] == model


def test_neuron_pools_do_not_carry_the_gpu_label() -> None:
    """The autoscaler's GPU processor knows no aws.amazon.com/neuron: with the label a Neuron node stays unready."""
    plan = variant(TEAM_K8S, pools=TRAINIUM)
    group = node_groups(plan)["trn1"]
    assert group.inputs["labels"]["gpucluster/accelerator"] == "neuron"
    assert "k8s.amazonaws.com/accelerator" not in group.inputs["labels"]
    assert not [k for k in template_tags(plan, "trn1") if "k8s.amazonaws.com/accelerator" in k]


def test_every_nvidia_model_of_the_catalog_has_a_gpu_type() -> None:
    models = {t.accelerator.model for t in catalog.ACCELERATED.values()
              if t.accelerator and t.accelerator.kind == "nvidia"}
    assert models == set(kube.GPU_TYPES)
    for model, value in kube.GPU_TYPES.items():
        assert value.startswith("nvidia-") and value.endswith(model.lower())


# --- Provision time ---------------------------------------------------------------------------------------------

def _provision_time(plan: Plan) -> str:
    _, declared = plan
    (release,) = [r.inputs for r in of_type(declared, "helm.sh/v3:Release") if r.inputs["name"] == "cluster-autoscaler"]
    return str(release["values"]["extraArgs"]["max-node-provision-time"])


def test_provision_time_is_the_slowest_pool_types() -> None:
    stack, _ = plan = planned(TEAM_K8S)
    slowest = max(catalog.NODE_PROVISION_MINUTES[p.itype.family] for p in stack.spec.pools)
    assert _provision_time(plan) == f"{slowest}m"
    only_g6e = variant(TEAM_K8S, pools=[{"name": "g6e", "instance_type": "g6e.12xlarge", "max_nodes": 2}])
    assert _provision_time(only_g6e) == f"{catalog.NODE_PROVISION_MINUTES['g6e']}m"
    # A p5 boots slower than a g6e: the stack with both waits for the p5.
    assert catalog.NODE_PROVISION_MINUTES["p5"] > catalog.NODE_PROVISION_MINUTES["g6e"]
    # kubernetes/autoscaler#6810: 5 minutes orphaned a GPU instance for hours.
    assert min(catalog.NODE_PROVISION_MINUTES.values()) > 5


def test_every_catalog_type_has_a_provision_time() -> None:
    for itype in catalog.ACCELERATED.values():
        assert itype.provision_minutes > 0, itype.name


# --- Node-template tags named by key ----------------------------------------------------------------------------

def _pools_with(stack: Stack, name: str, **changes: Any) -> list[dict[str, Any]]:
    return [p.model_dump(exclude_defaults=True) | (changes if p.name == name else {}) for p in stack.spec.pools]


@pytest.mark.parametrize("before_capacity, after_capacity", [("on-demand", "spot"), ("spot", "on-demand")])
def test_a_label_and_taint_change_deletes_only_the_tags_whose_key_went_away(before_capacity: str,
                                                                             after_capacity: str) -> None:
    """A pool goes spot (its capacity label changes, the spot taint comes) and back: each tag whose key both plans
    want keeps its resource (its URN), so Pulumi updates it in place and never deletes it."""
    base = planned(TEAM_K8S)[0]
    before = variant(TEAM_K8S, pools=_pools_with(base, "g6e", capacity=before_capacity))
    after = variant(TEAM_K8S, pools=_pools_with(base, "g6e", capacity=after_capacity))
    for pool in ("g6e", "p5-spot", "p5-od"):
        old, new = template_tags(before, pool), template_tags(after, pool)
        kept = set(old) & set(new)
        assert kept, pool
        for key in kept:
            assert old[key].urn == new[key].urn, key
        old_urns, new_urns = {t.urn for t in old.values()}, {t.urn for t in new.values()}
        # Only the tags of keys that went away are deleted, only those of new keys created.
        assert old_urns - new_urns == {old[k].urn for k in set(old) - set(new)}
        assert new_urns - old_urns == {new[k].urn for k in set(new) - set(old)}
    spot_taint = f"{NODE_TEMPLATE}/taint/{kube.SPOT_TAINT}"
    capacity = f"{NODE_TEMPLATE}/label/{kube.CAPACITY_LABEL}"
    old, new = template_tags(before, "g6e"), template_tags(after, "g6e")
    assert (spot_taint in new) == (after_capacity == "spot") and (spot_taint in old) == (before_capacity == "spot")
    assert new[capacity].inputs["tag"]["value"] == after_capacity and old[capacity].urn == new[capacity].urn


def test_tag_resources_are_named_by_their_key(k8s: Plan) -> None:
    stack, _ = k8s
    for pool in stack.spec.pools:
        tags = template_tags(k8s, pool.name)
        assert set(tags) == set(autoscaler_node_template_tags(stack, pool))
        for key, tag in tags.items():
            assert tag.name == f"{stack.cluster_name}-{pool.name}-ca-{key.removeprefix(NODE_TEMPLATE + '/')}"


# --- Dependencies -----------------------------------------------------------------------------------------------

def test_releases_wait_for_their_pod_identity_associations(k8s: Plan) -> None:
    stack, declared = k8s
    associations = {a.name: a.urn for a in of_type(declared, "eks/podIdentityAssociation:PodIdentityAssociation")}
    releases = {r.inputs["name"]: r for r in of_type(declared, "helm.sh/v3:Release")}
    assert associations[f"{stack.cluster_name}-autoscaler"] in releases["cluster-autoscaler"].dependencies
    assert associations[f"{stack.cluster_name}-alertmanager"] in releases["monitoring"].dependencies
    assert associations[f"{stack.cluster_name}-autoscaler"] not in releases["monitoring"].dependencies


def test_accelerator_node_groups_wait_for_the_node_addons(k8s: Plan) -> None:
    _, declared = k8s
    addons = {a.inputs["addonName"]: a.urn for a in of_type(declared, "eks/addon:Addon")}
    for pool, group in node_groups(k8s).items():
        for addon in eks.NODE_ADDONS:
            assert addons[addon] in group.dependencies, (pool, addon)
        # The pod add-ons run on the system nodes and wait for them, not for the accelerator pools.
        assert addons["coredns"] not in group.dependencies, pool


# --- Node auto repair -------------------------------------------------------------------------------------------

def _repair(group: Declared) -> dict[str, Any]:
    return dict(group.inputs["nodeRepairConfig"])


@pytest.mark.parametrize("pools", [None, TRAINIUM], ids=["nvidia", "neuron"])
def test_fatal_accelerator_faults_replace_the_node_one_at_a_time(pools: list[dict[str, Any]] | None) -> None:
    plan = planned(TEAM_K8S) if pools is None else variant(TEAM_K8S, pools=pools)
    stack, _ = plan
    for name, group in node_groups(plan).items():
        pool = next(p for p in stack.spec.pools if p.name == name)
        repair = _repair(group)
        assert repair["enabled"] is True
        # One repair at a time, and none when half the pool is unhealthy (a bad AMI or driver, not a bad node).
        assert repair["maxParallelNodesRepairedCount"] == 1
        assert 0 < repair["maxUnhealthyNodeThresholdPercentage"] <= 50
        overrides = repair["nodeRepairConfigOverrides"]
        assert {o["nodeUnhealthyReason"] for o in overrides} == set(REPLACE_REASONS[pool.accelerator.kind])
        for override in overrides:
            assert override["nodeMonitoringCondition"] == "AcceleratedHardwareReady"
            assert override["repairAction"] == "Replace"  # the EKS API's values: Replace | Reboot | NoAction
            assert override["minRepairWaitTimeMins"] >= 1  # its valid range
    (system,) = [g for g in of_type(plan[1], "eks/nodeGroup:NodeGroup")
                 if g.inputs["nodeGroupName"].endswith("-system")]
    assert "nodeRepairConfig" not in system.inputs


def test_a_fallen_off_the_bus_gpu_is_replaced() -> None:
    """XID 79 (GPU fallen off the bus) and double-bit ECC errors are among what replaces an NVIDIA node."""
    assert {"NvidiaXID79Error", "NvidiaDoubleBitError"} <= set(REPLACE_REASONS["nvidia"])
    assert not [r for r in REPLACE_REASONS["neuron"] if r.startswith("Nvidia")]


def _monitoring_agent_configuration(declared: tuple[Declared, ...]) -> dict[str, Any]:
    (agent,) = [a.inputs for a in of_type(declared, "eks/addon:Addon")
                if a.inputs["addonName"] == "eks-node-monitoring-agent"]
    return dict(json.loads(agent["configurationValues"]))


def test_node_monitoring_agents_dcgm_server_tolerates_every_pool_taint(k8s: Plan) -> None:
    stack, declared = k8s
    configuration = _monitoring_agent_configuration(declared)
    schema = json.loads((SCHEMAS / "eks-node-monitoring-agent-v1.7.0-configuration.json").read_text())
    jsonschema.Draft7Validator(schema).validate(configuration)
    tolerations = configuration["dcgmAgent"]["tolerations"]
    for pool in stack.spec.pools:
        # The burn-in's startup taint too: without its host engine, the agent reports DCGMError on a node under burn-in
        # and node repair acts on it; and a failed node's, which stays until the node goes.
        for taint in [*kube_health.node_group_taints(pool),
                      {"key": node_health.FAILED_TAINT, "value": "dcgm", "effect": "NoSchedule"}]:
            assert tolerates(tolerations, taint), (pool.name, taint)
    # Not everything: the system nodes' taint keeps it off the system nodes.
    assert not tolerates(tolerations, kube.SYSTEM_TAINT)


def test_the_schema_refuses_a_misspelt_monitoring_agent_key() -> None:
    schema = json.loads((SCHEMAS / "eks-node-monitoring-agent-v1.7.0-configuration.json").read_text())
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(schema).validate({"dcgmAgents": {"tolerations": []}})


# --- Instance-store NVMe as scratch -----------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted({**catalog.ACCELERATED, **catalog.HEAD_NODE}))
def test_instance_store_facts_match_ec2(name: str) -> None:
    itype = catalog.lookup(name)
    disks = (EC2_FACTS[name].get("InstanceStorageInfo") or {}).get("Disks") or []
    store = itype.instance_store
    if not disks:
        assert store is None
        return
    (disk,) = disks
    assert store is not None and (store.count, store.size_gb) == (disk["Count"], disk["SizeInGB"])
    assert store.total_gb == EC2_FACTS[name]["InstanceStorageInfo"]["TotalSizeInGB"]


NODECONFIG = _strict(json.loads((SCHEMAS / "nodeconfig-amazon-eks-ami-v20260724.json").read_text())
                     ["schemas"]["NodeConfig"])


def _node_config_parts(user_data_b64: str) -> list[email.message.Message]:
    message = email.message_from_string(base64.b64decode(user_data_b64).decode())
    assert message.get_content_type() == "multipart/mixed"
    return [p for p in message.walk() if not p.is_multipart()]


def test_instance_store_pools_put_kubelet_and_containerd_on_a_raid0_array(k8s: Plan) -> None:
    stack, _ = k8s
    for pool in stack.spec.pools:
        assert pool.itype.instance_store is not None  # every type the shipped stacks use has NVMe
        (part,) = _node_config_parts(launch_template(k8s, pool.name)["userData"])
        assert part.get_content_type() == "application/node.eks.aws"
        config = yaml.safe_load(str(part.get_payload()))
        jsonschema.validate(config, NODECONFIG)
        assert (config["apiVersion"], config["kind"]) == ("node.eks.aws/v1alpha1", "NodeConfig")
        assert config["spec"]["instance"]["localStorage"]["strategy"] == "RAID0"


def test_the_nodeconfig_schema_refuses_an_unknown_strategy_or_field() -> None:
    good = {"apiVersion": "node.eks.aws/v1alpha1", "kind": "NodeConfig",
            "spec": {"instance": {"localStorage": {"strategy": "RAID0"}}}}
    jsonschema.validate(good, NODECONFIG)
    for bad in ({"strategy": "RAID5"}, {"strategy": "RAID0", "raidLevel": 0}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({**good, "spec": {"instance": {"localStorage": bad}}}, NODECONFIG)


def test_template_tags_advertise_the_arrays_ephemeral_storage(k8s: Plan) -> None:
    """Without the tag the autoscaler's template node has no ephemeral-storage, and a pod that requests any never
    starts a node from zero. It offers the array less what the kubelet keeps, never more than the disks hold."""
    stack, _ = k8s
    for pool in stack.spec.pools:
        store = pool.itype.instance_store
        assert store is not None
        tags = template_tags(k8s, pool.name)
        offered = int(tags[f"{NODE_TEMPLATE}/resources/ephemeral-storage"].inputs["tag"]["value"])
        assert offered == kube.node_ephemeral_storage(pool)
        assert 0.8 * store.total_gb * 10**9 < offered < 0.9 * store.total_gb * 10**9
        # The quota and Kueue do not cover it: only the autoscaler's template does.
        assert "ephemeral-storage" not in kube.pool_resources(pool)
