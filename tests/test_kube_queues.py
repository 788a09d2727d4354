"""Kueue in the Kubernetes flavour: every resource an EFA pod requests is covered (huge pages too), CPU-only pods have
their own queue, flavour and node group so they never start an accelerator node nor hold a family's quota (the admission
policies that keep them off the accelerator queue: tests/test_kube_cpu_queue.py), admitted jobs wait a bounded time for
their pods, the team has priorities with preemption, and only integrations whose operators are installed are enabled.

Kueue's flavour assignment is simulated as Kueue v0.19.2 does it for one resource group: the flavours in the
ClusterQueue's order, the first with enough nominal quota for every resource the pod set requests
(pkg/scheduler/flavorassigner); a requested resource no group covers makes the workload inadmissible."""

from __future__ import annotations

import copy
import re
from fractions import Fraction
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from components.kubernetes import autoscaler_node_template_tags
from conftest import K8S_STACK_FILES, ROOT, of_type, planned
from gpucluster.plan import Declared, planned_asg_name
from gpucluster.render import kube
from gpucluster.spec import catalog, cost, eks
from gpucluster.spec.model import SpecError, Stack, load_stack, validate
from test_kubernetes import TEAM_K8S, check

# Integrations whose operators the flavour runs: Kubernetes' own controllers. Kueue's names, as its
# pkg/controller/jobs/*/ register them.
INSTALLED_INTEGRATIONS = {"batch/job", "pod", "deployment", "statefulset"}
# Kueue v0.19.2's WaitForPodsReady and RequeuingStrategy fields (apis/config/v1beta2/configuration_types.go).
WAIT_FOR_PODS_READY_FIELDS = {"timeout", "blockAdmission", "requeuingStrategy", "recoveryTimeout"}
REQUEUING_FIELDS = {"timestamp", "backoffLimitCount", "backoffBaseSeconds", "backoffMaxSeconds"}
SUFFIXES: dict[str, int | Fraction] = {"": 1, "m": Fraction(1, 1000), "k": 1000, "M": 1000**2, "G": 1000**3,
                                       "Ki": 1024, "Mi": 1024**2, "Gi": 1024**3, "Ti": 1024**4}


@pytest.fixture(params=K8S_STACK_FILES, ids=lambda p: p.name)
def k8s(request: pytest.FixtureRequest) -> tuple[Stack, tuple[Declared, ...]]:
    return planned(request.param)


def amount(value: float | int | str) -> Fraction:
    """A Kubernetes quantity as a number (the forms the objects here use). The mock runtime hands numbers back as
    floats."""
    if isinstance(value, float):
        assert value.is_integer(), value
        value = int(value)
    match = re.fullmatch(r"(\d+)([A-Za-z]*)", str(value))
    assert match and match[2] in SUFFIXES, value
    return int(match[1]) * Fraction(SUFFIXES[match[2]])


def assign(cluster_queue: dict, requests: dict[str, str]) -> str | None:
    """The flavour Kueue admits a pod set with these requests to when the queue is empty; None: inadmissible."""
    (group,) = cluster_queue["spec"]["resourceGroups"]
    if not set(requests) <= set(group["coveredResources"]):
        return None
    return next((str(f["name"]) for f in group["flavors"] if fits(f, requests)), None)


def fits(flavor: dict, requests: dict[str, str]) -> bool:
    """The flavour's nominal quota holds every request (a resource it does not list: none of it)."""
    quota = {r["name"]: amount(r["nominalQuota"]) for r in flavor["resources"]}
    return all(amount(v) <= quota.get(r, 0) for r, v in requests.items())


def efa_pod_requests(pool: Any) -> dict[str, str]:
    """A node-sized pod of an EFA pool as the example job asks for it (its devices and, as EKS's EFA guide writes
    one, huge pages), which must carry the huge pages itself."""
    requests = kube.node_sized_resources(pool)
    assert requests[kube.HUGEPAGES_RESOURCE] == kube.EFA_POD_HUGEPAGES
    return requests


def cluster_queues(declared: tuple[Declared, ...]) -> dict[str, dict]:
    """The declared ClusterQueues by the LocalQueue that leads to each (`default`, `cpu`)."""
    by_name = {q.inputs["metadata"]["name"]: q.inputs for q in of_type(declared, "kueue.x-k8s.io/v1beta2:ClusterQueue")}
    return {lq.inputs["metadata"]["name"]: by_name[lq.inputs["spec"]["clusterQueue"]]
            for lq in of_type(declared, "kueue.x-k8s.io/v1beta2:LocalQueue")}


def kueue_config(declared: tuple[Declared, ...]) -> dict:
    (release,) = [r for r in of_type(declared, "helm.sh/v3:Release") if r.inputs["name"] == "kueue"]
    return yaml.safe_load(release.inputs["values"]["managerConfig"]["controllerManagerConfigYaml"])


# --- Schemas ----------------------------------------------------------------------------------------------------

def test_every_queue_object_validates_against_the_vendored_schemas(k8s: tuple[Stack, tuple[Declared, ...]]) -> None:
    stack, declared = k8s
    declared_kinds = {d.inputs["kind"] for d in declared if d.type.startswith("kubernetes:kueue.x-k8s.io/")}
    assert {"WorkloadPriorityClass", "ResourceFlavor", "ClusterQueue", "LocalQueue"} <= declared_kinds
    for obj in kube.queue_manifests(stack):
        check(obj, stack.spec.eks.version)


@pytest.mark.parametrize("break_it", [
    lambda o: o.pop("value"),
    lambda o: o.update(spec={"value": 1}),  # the field sits beside metadata, not under a spec
    lambda o: o.update(value="high"),
])
def test_schema_check_catches_a_bad_priority_class(break_it: Any) -> None:
    obj = kube.workload_priority_classes()[0]
    check(obj, "1.35")
    break_it(obj)
    with pytest.raises(jsonschema.ValidationError):
        check(obj, "1.35")


def test_priority_classes_reach_the_api_as_whole_objects(k8s: tuple[Stack, tuple[Declared, ...]]) -> None:
    """pulumi_kubernetes' Python CustomResource sends a spec only: a WorkloadPriorityClass's value must arrive."""
    _, declared = k8s
    sent = {d.inputs["metadata"]["name"]: d.inputs for d in of_type(declared, "kueue.x-k8s.io/v1beta2:"
                                                                     "WorkloadPriorityClass")}
    assert sent == {m["metadata"]["name"]: m for m in kube.workload_priority_classes()}


# --- Every resource an EFA pod requests ---------------------------------------------------------------------------

def test_the_queue_covers_every_resource_a_node_sized_efa_pod_requests(k8s: tuple[Stack, tuple[Declared, ...]]) -> None:
    stack, declared = k8s
    cq = cluster_queues(declared)[kube.LOCAL_QUEUE]
    (group,) = cq["spec"]["resourceGroups"]
    flavors = {f["name"]: f for f in group["flavors"]}
    for pool in stack.spec.pools:
        requests = efa_pod_requests(pool) if pool.uses_efa else kube.node_sized_resources(pool)
        assert set(requests) <= set(group["coveredResources"]), pool.name
        # Its own family can hold it (Kueue may pick an earlier family with room: the flavours' order).
        assert fits(flavors[kube.family_name(stack, pool)], requests), pool.name
        assert assign(cq, requests) in set(kube.families(stack)), pool.name


@pytest.mark.parametrize("path", K8S_STACK_FILES, ids=lambda p: p.name)
def test_without_huge_pages_in_the_queue_such_a_pod_is_never_admitted(path: Path) -> None:
    """What the coverage fixes: the queue as it was, without huge pages, cannot admit the guide's EFA pod."""
    stack = load_stack(path)
    if not kube.example_pool(stack).uses_efa:
        assert kube.HUGEPAGES_RESOURCE not in kube.cluster_queue(stack)["spec"]["resourceGroups"][0]["coveredResources"]
        return
    cq = kube.cluster_queue(stack)
    assert assign(cq, efa_pod_requests(kube.example_pool(stack))) is not None
    (group,) = cq["spec"]["resourceGroups"]
    index = group["coveredResources"].index(kube.HUGEPAGES_RESOURCE)
    group["coveredResources"].pop(index)
    for flavor in group["flavors"]:
        flavor["resources"].pop(index)
    assert assign(cq, efa_pod_requests(kube.example_pool(stack))) is None


def test_an_efa_node_has_the_huge_pages_the_efa_installer_reserves() -> None:
    stack = load_stack(TEAM_K8S)
    for pool in stack.spec.pools:
        have = kube.node_resources(pool)
        if not pool.uses_efa:
            assert kube.HUGEPAGES_RESOURCE not in have
            continue
        pages = amount(kube.quantity(kube.HUGEPAGES_RESOURCE, have[kube.HUGEPAGES_RESOURCE]))
        assert pages == eks.EFA_NODE_HUGEPAGES * 2 * 1024**2
        # One pod per node, as the guide's job runs, fits the node's pages.
        assert amount(kube.EFA_POD_HUGEPAGES) <= pages


def test_huge_pages_in_the_quota_and_the_node_template_tags() -> None:
    stack, declared = planned(TEAM_K8S)
    (quota,) = of_type(declared, "core/v1:ResourceQuota")
    efa_nodes = sum(p.max_nodes for p in stack.spec.pools if p.uses_efa)
    assert amount(quota.inputs["spec"]["hard"][f"requests.{kube.HUGEPAGES_RESOURCE}"]) == (
        efa_nodes * eks.EFA_NODE_HUGEPAGES * 2 * 1024**2)
    tag = f"k8s.io/cluster-autoscaler/node-template/resources/{kube.HUGEPAGES_RESOURCE}"
    for pool in stack.spec.pools:
        tags = autoscaler_node_template_tags(stack, pool)
        if pool.uses_efa:
            # A quantity as resource.ParseQuantity reads it, so the autoscaler's template node has the pages.
            assert amount(tags[tag]) == eks.EFA_NODE_HUGEPAGES * 2 * 1024**2
            assert re.fullmatch(r"\d+Mi", tags[tag])
        else:
            assert tag not in tags


def test_a_pool_without_efa_has_no_huge_pages_anywhere() -> None:
    doc = yaml.safe_load(TEAM_K8S.read_text())["config"]
    doc["gpucluster:cluster"]["pools"] = [{"name": "g6e", "instance_type": "g6e.xlarge", "max_nodes": 2}]
    stack = validate("k8s-variant", doc)
    (group,) = kube.cluster_queue(stack)["spec"]["resourceGroups"]
    assert kube.HUGEPAGES_RESOURCE not in group["coveredResources"]
    assert f"requests.{kube.HUGEPAGES_RESOURCE}" not in kube.resource_quota(stack)["spec"]["hard"]


# --- CPU-only pods ------------------------------------------------------------------------------------------------

def test_a_cpu_only_pod_is_admitted_to_the_cpu_flavour_of_the_cpu_queue(
        k8s: tuple[Stack, tuple[Declared, ...]]) -> None:
    stack, declared = k8s
    cq = cluster_queues(declared)[kube.CPU_LOCAL_QUEUE]
    cpu, memory_gi = kube.node_share(stack.spec.eks.cpu_nodes.itype)
    # A small pod (the LimitRange's default request) and one that takes most of a CPU node.
    for requests in ({"cpu": kube.DEFAULT_CPU, "memory": kube.DEFAULT_MEMORY},
                     {"cpu": str(cpu), "memory": f"{memory_gi}Gi"}):
        assert assign(cq, requests) == kube.CPU_FLAVOR
    (group,) = cq["spec"]["resourceGroups"]
    assert [f["name"] for f in group["flavors"]] == [kube.CPU_FLAVOR] and group["coveredResources"] == ["cpu", "memory"]


def test_an_accelerator_pod_is_inadmissible_on_the_cpu_queue_and_never_takes_the_cpu_flavour(
        k8s: tuple[Stack, tuple[Declared, ...]]) -> None:
    stack, declared = k8s
    queues = cluster_queues(declared)
    gpu_flavours = [f["name"] for f in queues[kube.LOCAL_QUEUE]["spec"]["resourceGroups"][0]["flavors"]]
    assert kube.CPU_FLAVOR not in gpu_flavours
    for pool in stack.spec.pools:
        resource = kube.accelerator_resource(pool)
        # A one-accelerator pod with a small CPU request would fit the CPU flavour's CPU: the CPU queue does not
        # cover the accelerator, so Kueue never admits it there.
        small = {"cpu": "1", "memory": "1Gi", resource: "1"}
        assert assign(queues[kube.CPU_LOCAL_QUEUE], small) is None, pool.name
        assert assign(queues[kube.LOCAL_QUEUE], small) in gpu_flavours, pool.name
        node_sized = efa_pod_requests(pool) if pool.uses_efa else kube.node_sized_resources(pool)
        assert assign(queues[kube.LOCAL_QUEUE], node_sized) in gpu_flavours, pool.name


def test_the_cpu_node_group_is_tainted_for_its_flavour_and_scales_from_zero(
        k8s: tuple[Stack, tuple[Declared, ...]]) -> None:
    stack, declared = k8s
    cpu_nodes = stack.spec.eks.cpu_nodes
    (group,) = [g.inputs for g in of_type(declared, "eks/nodeGroup:NodeGroup")
                if g.inputs["nodeGroupName"] == f"{stack.cluster_name}-{kube.CPU_FLAVOR}"]
    assert group["amiType"] == "AL2023_x86_64_STANDARD" and group["capacityType"] == "ON_DEMAND"
    assert group["instanceTypes"] == [cpu_nodes.instance_type]
    assert catalog.lookup(cpu_nodes.instance_type).accelerator is None
    assert group["scalingConfig"] == {"minSize": 0, "maxSize": cpu_nodes.max_nodes, "desiredSize": 0}
    assert group["labels"]["gpucluster/family"] == kube.CPU_FLAVOR
    taints = {(t["key"], t["value"], t["effect"]) for t in group["taints"]}
    assert taints == {("gpucluster/cpu", "true", "NO_SCHEDULE")}
    # The CPU flavour selects those nodes and tolerates exactly their taint; no accelerator flavour tolerates it.
    flavours = {f.inputs["metadata"]["name"]: f.inputs["spec"] for f in
                of_type(declared, "kueue.x-k8s.io/v1beta2:ResourceFlavor")}
    assert flavours[kube.CPU_FLAVOR]["nodeLabels"] == {"gpucluster/family": kube.CPU_FLAVOR}
    assert {(t["key"], t["value"], {"NoSchedule": "NO_SCHEDULE"}[t["effect"]])
            for t in flavours[kube.CPU_FLAVOR]["tolerations"]} == taints
    assert not any(t["key"] == "gpucluster/cpu" for name, f in flavours.items() if name != kube.CPU_FLAVOR
                   for t in f["tolerations"])
    # Its launch template: IMDSv2 with one hop, the nodes' security groups.
    (template,) = [t.inputs for t in of_type(declared, "ec2/launchTemplate:LaunchTemplate")
                   if t.inputs.get("description") == f"{stack.cluster_name} CPU node group"]
    assert template["metadataOptions"]["httpTokens"] == "required"
    assert template["metadataOptions"]["httpPutResponseHopLimit"] == 1
    assert len(template["vpcSecurityGroupIds"]) == 2


def test_the_autoscaler_can_scale_the_cpu_group_from_zero(k8s: tuple[Stack, tuple[Declared, ...]]) -> None:
    """Its Auto Scaling group carries the node-template labels and taint, and the priority expander lists it: a group
    no entry matches is never used (cluster-autoscaler 1.35 expander/priority/priority.go)."""
    stack, declared = k8s
    asg = planned_asg_name(f"{stack.cluster_name}-{kube.CPU_FLAVOR}")
    tags = {t.inputs["tag"]["key"]: t.inputs["tag"]["value"] for t in of_type(declared, "autoscaling/tag:Tag")
            if t.inputs["autoscalingGroupName"] == asg}
    prefix = "k8s.io/cluster-autoscaler/node-template"
    assert tags[f"{prefix}/label/gpucluster/family"] == kube.CPU_FLAVOR
    assert tags[f"{prefix}/taint/gpucluster/cpu"] == "true:NoSchedule"
    assert not any(k.startswith(f"{prefix}/resources/") for k in tags)
    (release,) = [r for r in of_type(declared, "helm.sh/v3:Release") if r.inputs["name"] == "cluster-autoscaler"]
    regexes = [re.compile(x) for xs in release.inputs["values"]["expanderPriorities"].values() for x in xs]
    groups = {t.inputs["autoscalingGroupName"] for t in of_type(declared, "autoscaling/tag:Tag")}
    assert asg in groups
    for name in groups:  # every group the program tags, the CPU one included, has a priority
        assert any(r.match(name) for r in regexes), name


def test_cpu_nodes_are_priced_like_a_pool() -> None:
    stack = load_stack(TEAM_K8S)
    estimate = cost.estimate(stack)
    (cpu,) = [p for p in estimate.pools if p.name == kube.CPU_FLAVOR]
    price = stack.spec.eks.cpu_nodes.itype.on_demand_usd_per_hour
    assert price and cpu.usd_per_node_hour == price and cpu.capacity == "on-demand"
    assert (cpu.min_nodes, cpu.max_nodes) == (0, stack.spec.eks.cpu_nodes.max_nodes)
    assert estimate.hourly_max == pytest.approx(estimate.fixed_hourly + sum(
        (p.itype.on_demand_usd_per_hour or 0) * p.max_nodes for p in stack.spec.pools) + price * cpu.max_nodes)


def _variant(**kubernetes: Any) -> dict:
    doc = copy.deepcopy(yaml.safe_load(TEAM_K8S.read_text())["config"])
    doc["gpucluster:cluster"].setdefault("kubernetes", {}).update(kubernetes)
    return doc


def test_cpu_nodes_keys_have_defaults_and_are_checked() -> None:
    stack = validate("k8s-variant", _variant())
    assert (stack.spec.eks.cpu_nodes.instance_type, stack.spec.eks.cpu_nodes.max_nodes) == (
        eks.CPU_INSTANCE_TYPE, eks.CPU_MAX_NODES)
    stack = validate("k8s-variant", _variant(cpu_nodes={"instance_type": "c7i.2xlarge", "max_nodes": 2}))
    assert kube.cpu_cluster_queue(stack)["spec"]["resourceGroups"][0]["flavors"][0]["resources"][0] == {
        "name": "cpu", "nominalQuota": 2 * catalog.lookup("c7i.2xlarge").vcpus}
    with pytest.raises(SpecError) as caught:
        validate("k8s-variant", _variant(cpu_nodes={"instance_type": "p5.48xlarge", "max_nodes": 0}))
    paths = {p for p, _ in caught.value.problems}
    assert paths == {"gpucluster:cluster.kubernetes.cpu_nodes.instance_type",
                     "gpucluster:cluster.kubernetes.cpu_nodes.max_nodes"}


def test_no_pool_may_take_the_cpu_flavours_name() -> None:
    doc = _variant()
    doc["gpucluster:cluster"]["pools"].append({"name": kube.CPU_FLAVOR, "instance_type": "g6e.xlarge",
                                               "max_nodes": 1})
    with pytest.raises(SpecError) as caught:
        validate("k8s-variant", doc)
    index = len(doc["gpucluster:cluster"]["pools"]) - 1
    assert [p for p, _ in caught.value.problems] == [f"gpucluster:cluster.pools[{index}].name"]


# --- Kueue's configuration ----------------------------------------------------------------------------------------

def test_only_installed_integrations_are_enabled(k8s: tuple[Stack, tuple[Declared, ...]]) -> None:
    _, declared = k8s
    config = kueue_config(declared)
    assert config["apiVersion"] == "config.kueue.x-k8s.io/v1beta2" and config["kind"] == "Configuration"
    frameworks = set(config["integrations"]["frameworks"])
    assert frameworks <= INSTALLED_INTEGRATIONS
    assert "batch/job" in frameworks
    releases = {r.inputs["name"] for r in of_type(declared, "helm.sh/v3:Release")}
    assert not any("jobset" in r or "trainer" in r for r in releases)  # the operators those would need


def test_admitted_jobs_wait_for_their_pods_a_bounded_time(k8s: tuple[Stack, tuple[Declared, ...]]) -> None:
    stack, declared = k8s
    wait = kueue_config(declared)["waitForPodsReady"]
    assert set(wait) <= WAIT_FOR_PODS_READY_FIELDS and set(wait["requeuingStrategy"]) <= REQUEUING_FIELDS
    assert wait["blockAdmission"] is False
    assert wait["requeuingStrategy"]["timestamp"] == "Eviction"
    assert wait["requeuingStrategy"]["backoffLimitCount"] >= 1
    assert wait["requeuingStrategy"]["backoffBaseSeconds"] >= 1
    assert wait["timeout"].endswith("m")
    timeout = int(wait["timeout"][:-1])
    provision = kube.provision_minutes(stack)
    # A spot family's job may wait for the spot group to be given up on, then for its fallback, its node's start
    # (burn-in: not ready to the autoscaler until it passes; on EFA pools it pulls a DLC for fi_info too, as large as
    # a job's image), then pull its image.
    attempts = 2 if any(p.fallback for p in stack.spec.pools) else 1
    burn_in_pull = kube.IMAGE_PULL_MINUTES if any(p.uses_efa for p in stack.spec.pools) else 0
    node_start = kube.NODE_STARTUP_MINUTES + burn_in_pull
    assert timeout == attempts * provision + node_start + kube.IMAGE_PULL_MINUTES
    groups = {p.name: p.name for p in stack.spec.pools} | {kube.CPU_FLAVOR: "cpu"}
    startup = kube.autoscaler_values(stack, groups, "sa")["extraArgs"]["max-node-startup-time"]
    assert startup == f"{node_start}m"


def test_team_k8s_waits_what_the_docs_quote() -> None:
    """The figures the how-to and the explanation give for team-k8s (a p5 pool on spot with an on-demand fallback,
    EFA): the jobs' wait and the autoscaler's start-up allowance, as rendered."""
    stack, declared = planned(TEAM_K8S)
    assert kueue_config(declared)["waitForPodsReady"]["timeout"] == "85m"
    groups = {p.name: p.name for p in stack.spec.pools} | {kube.CPU_FLAVOR: "cpu"}
    assert kube.autoscaler_values(stack, groups, "sa")["extraArgs"]["max-node-startup-time"] == "35m"
    docs = ROOT / "docs"
    how_to = " ".join((docs / "how-to" / "kubernetes.md").read_text().split())
    explanation = " ".join((docs / "explanation" / "kubernetes.md").read_text().split())
    assert "do not all run within 85 minutes (team-k8s:" in how_to and "35 for the node's start" in how_to
    assert "`max-node-startup-time`: 25 minutes" in explanation and "10 more for the burn-in's pull" in explanation
    assert "85 minutes for team-k8s" in explanation


def test_the_node_start_allows_for_the_burn_in_image_pull_on_efa_pools() -> None:
    """The same stack with and without EFA: the autoscaler's start-up allowance and the jobs' wait grow by the
    burn-in's DLC pull (fi_info) only where a pool uses EFA."""
    doc = yaml.safe_load(TEAM_K8S.read_text())["config"]
    doc["gpucluster:cluster"]["pools"] = [{"name": "p5", "instance_type": "p5.48xlarge", "max_nodes": 2}]
    with_efa = validate("k8s-efa", doc)
    doc["gpucluster:cluster"]["pools"][0]["efa"] = False
    without = validate("k8s-no-efa", doc)
    assert [p.uses_efa for s in (with_efa, without) for p in s.spec.pools] == [True, False]
    groups = {"p5": "p5", kube.CPU_FLAVOR: "cpu"}
    startup = {s.name: int(kube.autoscaler_values(s, groups, "sa")["extraArgs"]["max-node-startup-time"][:-1])
               for s in (with_efa, without)}
    assert startup == {"k8s-efa": kube.NODE_STARTUP_MINUTES + kube.IMAGE_PULL_MINUTES,
                       "k8s-no-efa": kube.NODE_STARTUP_MINUTES}
    assert kube.node_wait_minutes(with_efa) - kube.node_wait_minutes(without) == kube.IMAGE_PULL_MINUTES


# --- Priorities ---------------------------------------------------------------------------------------------------

def test_priorities_with_preemption_within_the_queue(k8s: tuple[Stack, tuple[Declared, ...]]) -> None:
    _, declared = k8s
    classes = {d.inputs["metadata"]["name"]: d.inputs["value"]
               for d in of_type(declared, "kueue.x-k8s.io/v1beta2:WorkloadPriorityClass")}
    assert classes["low"] < classes["normal"] < classes["high"]
    # A job without the label gets Kueue's default priority, 0 (pkg/constants DefaultPriority): normal's.
    assert classes["normal"] == 0
    queues = of_type(declared, "kueue.x-k8s.io/v1beta2:ClusterQueue")
    assert len(queues) == 2
    for cq in queues:
        assert cq.inputs["spec"]["preemption"] == {"withinClusterQueue": "LowerPriority"}
    assert kube.PRIORITY_CLASS_LABEL == "kueue.x-k8s.io/priority-class"


def test_rendered_queues_file_has_the_priority_classes(tmp_path: Path) -> None:
    from gpucluster.cli import main

    assert main(["render", str(TEAM_K8S), "--out", str(tmp_path)]) == 0
    objects = list(yaml.safe_load_all((tmp_path / "kubernetes" / "queues.yaml").read_text()))
    assert {o["metadata"]["name"] for o in objects if o["kind"] == "WorkloadPriorityClass"} == set(kube.PRIORITIES)
