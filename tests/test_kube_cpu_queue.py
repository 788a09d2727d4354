"""CPU-only work never holds an accelerator family's quota: it has a queue of its own (LocalQueue `cpu`, its own
ClusterQueue with the CPU flavour only), and ValidatingAdmissionPolicies refuse, in the team's namespace, a workload
on the accelerator queue whose containers ask for no accelerator, naming the CPU queue.

The policies' CEL is evaluated for real with cel-python (celpy), the way the API server composes a policy: its resource
rules and its binding's namespace selector pick the request, every match condition must hold, then every validation
must (kubernetes.io/docs/reference/access-authn-authz/validating-admission-policy). A CEL evaluation error fails the
test: under failurePolicy Fail it would refuse every such request. Every object here passes strict validation against
the cluster version's schema first. Kubernetes' CEL libraries beyond the standard (quantity(), optionals) are not in
celpy; the expressions use none of them."""

from __future__ import annotations

import copy
import dataclasses
from functools import cache
from typing import Any

import celpy
import pytest

from conftest import K8S_STACK_FILES, of_type, planned
from gpucluster.contract import node_health
from gpucluster.plan import Declared
from gpucluster.render import kube
from gpucluster.spec import eks
from gpucluster.spec.model import Stack
from test_kube_queues import assign, cluster_queues
from test_kubernetes import check

Plan = tuple[Stack, tuple[Declared, ...]]
# The kinds the policies cover (Kueue's integrations enabled in kube.kueue_values), as an admission request names them.
KINDS = {"Pod": ("", "v1", "pods"), "Job": ("batch", "v1", "jobs"), "Deployment": ("apps", "v1", "deployments"),
         "StatefulSet": ("apps", "v1", "statefulsets")}
CPU_ONLY = {"cpu": "2", "memory": "4Gi"}


@pytest.fixture(params=K8S_STACK_FILES, ids=lambda p: p.name)
def k8s(request: pytest.FixtureRequest) -> Plan:
    return planned(request.param)


# --- The API server's admission, for these policies ---------------------------------------------------------------

@cache
def _program(expression: str) -> Any:
    env = celpy.Environment()
    return env.program(env.compile(expression))


def evaluate(expression: str, activation: dict[str, Any]) -> bool:
    result = _program(expression).evaluate({k: celpy.json_to_cel(v) for k, v in activation.items()})
    assert isinstance(result, celpy.celtypes.BoolType), f"{expression!r} gave {result!r}, not a bool"
    return bool(result)


def kueue_defaulted(declared: tuple[Declared, ...], obj: dict[str, Any]) -> dict[str, Any]:
    """The object as Kueue v0.19.2's mutating webhook hands it on (mutating admission runs before validating): one
    without a queue name, in a namespace Kueue manages (managedJobsNamespaceSelector: the team namespace's label)
    that has a LocalQueue named `default`, is given that queue (pkg/controller/jobframework/defaults.go,
    setDefaultLocalQueue)."""
    namespace = obj["metadata"]["namespace"]
    managed = any(n.inputs["metadata"]["name"] == namespace
                  and n.inputs["metadata"].get("labels", {}).get(kube.TEAM_NAMESPACE_LABEL) == "true"
                  for n in of_type(declared, "core/v1:Namespace"))
    default_queue = any(q.inputs["metadata"] == {"name": "default", "namespace": namespace}
                        for q in of_type(declared, f"{kube.KUEUE_API}:LocalQueue"))
    if not managed or not default_queue or kube.QUEUE_NAME_LABEL in obj["metadata"].get("labels", {}):
        return obj
    defaulted = copy.deepcopy(obj)
    defaulted["metadata"].setdefault("labels", {})[kube.QUEUE_NAME_LABEL] = "default"
    return defaulted


def refusal(declared: tuple[Declared, ...], obj: dict[str, Any], operation: str = "CREATE",
            old: dict[str, Any] | None = None) -> str | None:
    """The message the declared policies refuse this request with, after Kueue's defaulting; None if they admit
    it."""
    obj = kueue_defaulted(declared, obj)
    group, version, resource = KINDS[obj["kind"]]
    namespace = obj["metadata"]["namespace"]
    namespace_labels = {"kubernetes.io/metadata.name": namespace}  # the API server sets it on every namespace
    policies = [d.inputs for d in of_type(declared, "admissionregistration.k8s.io/v1:ValidatingAdmissionPolicy")]
    bindings = {b.inputs["spec"]["policyName"]: b.inputs["spec"]
                for b in of_type(declared, "admissionregistration.k8s.io/v1:ValidatingAdmissionPolicyBinding")}
    activation = {"object": obj, "oldObject": old, "request": {"operation": operation, "namespace": namespace}}
    for policy in policies:
        spec, binding = policy["spec"], bindings[policy["metadata"]["name"]]
        if not any(group in r["apiGroups"] and version in r["apiVersions"] and resource in r["resources"]
                   and operation in r["operations"] for r in spec["matchConstraints"]["resourceRules"]):
            continue
        selector = binding["matchResources"]["namespaceSelector"]["matchLabels"]
        if not selector.items() <= namespace_labels.items():
            continue
        assert binding["validationActions"] == ["Deny"] and spec["failurePolicy"] == "Fail"
        if not all(evaluate(c["expression"], activation) for c in spec["matchConditions"]):
            continue
        for validation in spec["validations"]:
            if not evaluate(validation["expression"], activation):
                return str(validation["message"])
    return None


def pod_spec(requests: dict[str, str], limits: dict[str, str] | None = None, kind: str = "Job") -> dict[str, Any]:
    main = {"name": "main", "image": "busybox", "command": ["true"],
            "resources": {"requests": requests} | ({"limits": limits} if limits else {})}
    return {"containers": [main], "restartPolicy": "Never" if kind in ("Job", "Pod") else "Always"}


def workload(stack: Stack, kind: str, queue: str | None, spec: dict[str, Any],
             namespace: str | None = None) -> dict[str, Any]:
    """A `kind` whose pods have `spec`, on the LocalQueue `queue` (no label if None), valid for the stack's version."""
    labels = {kube.QUEUE_NAME_LABEL: queue} if queue else {}
    metadata = {"name": "w", "namespace": namespace or kube.namespace_name(stack), "labels": labels}
    group, version, _ = KINDS[kind]
    obj: dict[str, Any] = {"apiVersion": f"{group}/{version}".lstrip("/"), "kind": kind, "metadata": metadata}
    if kind == "Pod":
        obj["spec"] = spec
    else:
        obj["spec"] = {"template": {"metadata": {"labels": {"app": "w"}}, "spec": spec}}
        if kind != "Job":
            obj["spec"]["selector"] = {"matchLabels": {"app": "w"}}
        if kind == "StatefulSet":
            obj["spec"]["serviceName"] = "w"
    check(obj, stack.spec.eks.version)
    return obj


def accelerators(stack: Stack) -> list[str]:
    """The accelerator resources the stack's pools advertise (from the pools, not from the policies)."""
    return sorted({kube.accelerator_resource(p) for p in stack.spec.pools})


# --- The policies ------------------------------------------------------------------------------------------------

def test_the_policies_are_valid_and_bound_to_the_teams_namespace(k8s: Plan) -> None:
    stack, declared = k8s
    objects = [d.inputs for d in declared if d.type.startswith("kubernetes:admissionregistration.k8s.io/v1:")]
    assert {o["kind"] for o in objects} == {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}
    for obj in objects:
        check(obj, stack.spec.eks.version)
    covered = {(g, r) for p in objects if p["kind"] == "ValidatingAdmissionPolicy"
               for rule in p["spec"]["matchConstraints"]["resourceRules"] for g in rule["apiGroups"]
               for r in rule["resources"]}
    assert covered == {(g, r) for g, _, r in KINDS.values()}
    # ValidatingAdmissionPolicy is GA (admissionregistration.k8s.io/v1) from Kubernetes 1.30: every version offered.
    assert all(tuple(map(int, v.split("."))) >= (1, 30) for v in eks.VERSIONS)


@pytest.mark.parametrize("kind", KINDS)
def test_a_cpu_only_workload_on_the_accelerator_queue_is_refused_naming_the_cpu_queue(k8s: Plan, kind: str) -> None:
    stack, declared = k8s
    message = refusal(declared, workload(stack, kind, kube.LOCAL_QUEUE, pod_spec(CPU_ONLY, kind=kind)))
    assert message is not None and f"{kube.QUEUE_NAME_LABEL}: {kube.CPU_LOCAL_QUEUE}" in message
    for resource in accelerators(stack):
        assert resource in message
    # The same workload on the CPU queue is the policies' no concern; on none, Kueue's webhook gives it the
    # namespace's LocalQueue `default`, the accelerator queue, and it is refused alike.
    assert refusal(declared, workload(stack, kind, kube.CPU_LOCAL_QUEUE, pod_spec(CPU_ONLY, kind=kind))) is None
    assert kube.LOCAL_QUEUE == "default"
    assert refusal(declared, workload(stack, kind, None, pod_spec(CPU_ONLY, kind=kind))) == message
    # Nor in another namespace: the bindings hold the team's only.
    assert refusal(declared, workload(stack, kind, kube.LOCAL_QUEUE, pod_spec(CPU_ONLY, kind=kind),
                                      namespace="kube-system")) is None


@pytest.mark.parametrize("kind", KINDS)
def test_a_workload_that_asks_for_an_accelerator_of_the_stack_is_admitted(k8s: Plan, kind: str) -> None:
    stack, declared = k8s
    for resource in accelerators(stack):
        asks = CPU_ONLY | {resource: "1"}
        assert refusal(declared, workload(stack, kind, kube.LOCAL_QUEUE, pod_spec(asks, kind=kind))) is None
        # Only as a limit (the API server makes it the request too).
        only_limit = pod_spec(CPU_ONLY, {resource: "1"}, kind=kind)
        assert refusal(declared, workload(stack, kind, kube.LOCAL_QUEUE, only_limit)) is None
        # A CPU sidecar beside the accelerator container.
        two = pod_spec(asks, kind=kind)
        two["containers"].append({"name": "sidecar", "image": "busybox", "command": ["true"]})
        assert refusal(declared, workload(stack, kind, kube.LOCAL_QUEUE, two)) is None


def test_what_is_not_an_accelerator_of_the_stack_is_refused(k8s: Plan) -> None:
    """EFA interfaces or huge pages alone, or an accelerator no pool of the stack has, are no accelerator here."""
    stack, declared = k8s
    others = [{r: "1"} for r in (eks.GPU_RESOURCE, eks.NEURON_RESOURCE) if r not in accelerators(stack)]
    for extra in [{eks.EFA_RESOURCE: "1"}, {kube.HUGEPAGES_RESOURCE: kube.EFA_POD_HUGEPAGES}, *others]:
        spec = pod_spec(CPU_ONLY | extra, CPU_ONLY | extra)  # huge pages need requests = limits
        assert refusal(declared, workload(stack, "Job", kube.LOCAL_QUEUE, spec)) is not None, extra


@pytest.mark.parametrize("kind", KINDS)
def test_neuroncores_are_refused_with_the_resource_to_ask_for(k8s: Plan, kind: str) -> None:
    """The Neuron device plugin advertises aws.amazon.com/neuroncore too, which the queues do not count: on a stack
    with Neuron pools a pod asking for cores is told to ask for whole devices, not to use the CPU queue; with the
    devices it asks for, it passes. Without Neuron pools, cores are no accelerator of the stack."""
    stack, declared = k8s
    cores = CPU_ONLY | {eks.NEURONCORE_RESOURCE: "2"}
    message = refusal(declared, workload(stack, kind, kube.LOCAL_QUEUE, pod_spec(cores, kind=kind)))
    assert message is not None
    if eks.NEURON_RESOURCE in accelerators(stack):
        assert eks.NEURONCORE_RESOURCE in message and f"request {eks.NEURON_RESOURCE}" in message
        assert kube.CPU_LOCAL_QUEUE not in message
        # As a limit only, or beside a device request: still the cores' message.
        for spec in (pod_spec(CPU_ONLY, cores, kind=kind), pod_spec(cores | {eks.NEURON_RESOURCE: "1"}, kind=kind)):
            assert refusal(declared, workload(stack, kind, kube.LOCAL_QUEUE, spec)) == message
        devices = CPU_ONLY | {eks.NEURON_RESOURCE: "1"}
        assert refusal(declared, workload(stack, kind, kube.LOCAL_QUEUE, pod_spec(devices, kind=kind))) is None
    else:
        assert f"{kube.QUEUE_NAME_LABEL}: {kube.CPU_LOCAL_QUEUE}" in message


def test_updates_are_judged_only_when_they_move_work_onto_the_queue_or_change_its_pods(k8s: Plan) -> None:
    stack, declared = k8s
    on_cpu = workload(stack, "Pod", kube.CPU_LOCAL_QUEUE, pod_spec(CPU_ONLY))
    moved = copy.deepcopy(on_cpu)
    moved["metadata"]["labels"][kube.QUEUE_NAME_LABEL] = kube.LOCAL_QUEUE
    assert refusal(declared, moved, "UPDATE", on_cpu) is not None
    # A CPU pod already on the queue (from before the policy) keeps its finalizer updates: nothing it asks changed.
    finalized = copy.deepcopy(moved)
    finalized["metadata"]["finalizers"] = ["kueue.x-k8s.io/managed"]
    assert refusal(declared, moved, "UPDATE", finalized) is None
    # A job on the queue whose pods stop asking for the accelerator is judged again.
    resource = accelerators(stack)[0]
    gpu_job = workload(stack, "Job", kube.LOCAL_QUEUE, pod_spec(CPU_ONLY | {resource: "1"}))
    cpu_job = workload(stack, "Job", kube.LOCAL_QUEUE, pod_spec(CPU_ONLY))
    assert refusal(declared, cpu_job, "UPDATE", gpu_job) is not None
    assert refusal(declared, gpu_job, "UPDATE", cpu_job) is None


def test_the_refusal_is_what_the_policy_catches_not_the_label_check(k8s: Plan) -> None:
    """Without its validation a policy refuses nothing: the refusals above come from the accelerator expression."""
    stack, declared = k8s
    loosened = tuple(
        dataclasses.replace(d, inputs={**d.inputs, "spec": {**d.inputs["spec"], "validations": [
            {**d.inputs["spec"]["validations"][0], "expression": "true"}]}})
        if d.type.endswith(":ValidatingAdmissionPolicy") else d for d in declared)
    job = workload(stack, "Job", kube.LOCAL_QUEUE, pod_spec(CPU_ONLY))
    assert refusal(declared, job) is not None and refusal(loosened, job) is None


# --- Where Kueue puts a CPU-only pod, and whether a node takes it ---------------------------------------------------

def tolerates(tolerations: list[dict[str, str]], taint: dict[str, str]) -> bool:
    return any(t.get("key") in (None, taint["key"]) and t.get("effect") in (None, taint["effect"])
               and (t.get("operator") == "Exists" or t.get("value") == taint["value"]) for t in tolerations)


def node_groups(declared: tuple[Declared, ...]) -> list[dict[str, Any]]:
    """Each node group's labels and taints as its nodes carry them once burnt in (the startup taint gone)."""
    effects = {"NO_SCHEDULE": "NoSchedule", "NO_EXECUTE": "NoExecute", "PREFER_NO_SCHEDULE": "PreferNoSchedule"}
    return [{"name": g.inputs["nodeGroupName"], "labels": g.inputs.get("labels") or {},
             "taints": [{"key": t["key"], "value": t.get("value", ""), "effect": effects[t["effect"]]}
                        for t in g.inputs.get("taints") or [] if t["key"] != node_health.STARTUP_TAINT]}
            for g in of_type(declared, "eks/nodeGroup:NodeGroup")]


def nodes_for(declared: tuple[Declared, ...], flavour_name: str, requests: dict[str, str]) -> list[str]:
    """The node groups where a pod Kueue admitted to the flavour can be scheduled: the flavour's node labels and
    tolerations, and the tolerations the API server's ExtendedResourceToleration plugin adds for each extended
    resource the pod requests."""
    (flavour,) = [f.inputs["spec"] for f in of_type(declared, "kueue.x-k8s.io/v1beta2:ResourceFlavor")
                  if f.inputs["metadata"]["name"] == flavour_name]
    tolerations = list(flavour["tolerations"]) + [{"key": r, "operator": "Exists", "effect": "NoSchedule"}
                                                  for r in requests if "/" in r]
    return [g["name"] for g in node_groups(declared)
            if flavour["nodeLabels"].items() <= g["labels"].items()
            and all(t["effect"] == "PreferNoSchedule" or tolerates(tolerations, t) for t in g["taints"])]


def test_a_cpu_only_pod_fits_no_flavour_of_the_accelerator_queue(k8s: Plan) -> None:
    """Every flavour of the accelerator queue selects nodes where a CPU-only pod cannot run (it does not tolerate the
    accelerator taint), so if it were admitted there it would only hold quota: the policies keep it off. A pod asking
    for the family's accelerator does fit there, and the CPU queue places the CPU-only pod on the CPU nodes."""
    stack, declared = k8s
    queues = cluster_queues(declared)
    (group,) = queues[kube.LOCAL_QUEUE]["spec"]["resourceGroups"]
    assert [f["name"] for f in group["flavors"]] == list(kube.families(stack))
    for flavour in group["flavors"]:
        pools = kube.families(stack)[flavour["name"]]
        assert nodes_for(declared, flavour["name"], CPU_ONLY) == [], flavour["name"]
        accelerator = {kube.accelerator_resource(pools[0]): "1"}
        assert nodes_for(declared, flavour["name"], CPU_ONLY | accelerator), flavour["name"]
    flavour = assign(queues[kube.CPU_LOCAL_QUEUE], CPU_ONLY)
    assert flavour == kube.CPU_FLAVOR
    assert nodes_for(declared, flavour, CPU_ONLY) == [f"{stack.cluster_name}-{kube.CPU_FLAVOR}"]
