"""The Kubernetes objects of a `scheduler: kubernetes` stack, as plain manifests.

components/kubernetes.py declares exactly these through pulumi_kubernetes, `gpucluster render` writes them for
`kubectl apply`, and the tests validate them against Kubernetes' and Kueue's schemas. Values only AWS knows at `up`
(the file system's id and DNS name, the queue's URL) come in as arguments: Pulumi outputs in the program, placeholders
in `render`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpucluster import node
from gpucluster.contract import settings
from gpucluster.render import monitoring, prometheus
from gpucluster.spec import catalog, eks, wheels
from gpucluster.spec.model import CPU_NODES_NAME, PoolSpec, Stack

Manifest = dict[str, Any]

POOL_LABEL = "gpucluster/pool"
CAPACITY_LABEL = "gpucluster/capacity"
ACCELERATOR_LABEL = "gpucluster/accelerator"
EFA_LABEL = "gpucluster/efa"  # on EFA pools only: where the EFA device plugin runs
# A spot pool and its fallback share one value (the spot pool's name), every other pool its own: a Kueue flavour
# selects on it, so a job admitted to it may run on either and the autoscaler's priority expander does the fallback.
FAMILY_LABEL = "gpucluster/family"
SPOT_TAINT = "gpucluster/spot"
# The label the Cluster Autoscaler's AWS provider names as its GPULabel (cluster-autoscaler-1.35.0,
# cloudprovider/aws/aws_cloud_provider.go): a node that carries it but advertises no GPU yet counts as unready, not as
# room, so the autoscaler does not launch more nodes while the device plugin starts (processors/customresources/
# gpu_processor.go; its AWS README's "special note on GPU instances"). NVIDIA pools only: that processor knows only the
# GPU vendors' resources (utils/gpu/gpu.go GPUVendorResourceNames, not aws.amazon.com/neuron), so a Neuron node with
# the label would stay unready to it for good.
GPU_LABEL = "k8s.amazonaws.com/accelerator"
# Its value names the GPU model (the README: `k8s.amazonaws.com/accelerator=<gpu-type>`), in the provider's spelling
# where it lists the model (availableGPUTypes in the same file; only its metrics read that list), else the same form.
GPU_TYPES = {"A10G": "nvidia-a10g", "L4": "nvidia-l4", "L40S": "nvidia-l40s", "A100": "nvidia-tesla-a100",
             "H100": "nvidia-h100", "H200": "nvidia-h200", "B200": "nvidia-b200"}
# The CPU node group (kubernetes.cpu_nodes) is its own family, and the one Kueue flavour of the CPU queue; its taint
# keeps off every pod Kueue did not admit to that flavour (the flavour adds the toleration), so the small group serves
# the CPU queue's work only.
CPU_FLAVOR = CPU_NODES_NAME
CPU_TAINT = {"key": "gpucluster/cpu", "value": "true", "effect": "NoSchedule"}
# What an EFA pod requests besides its devices (eks.py says where the figures come from); the quota counts a node's
# huge pages as it counts its devices.
HUGEPAGES_RESOURCE = eks.HUGEPAGES_RESOURCE
EFA_POD_HUGEPAGES = f"{eks.EFA_POD_HUGEPAGES_MIB}Mi"
# The system nodes' taint: only the cluster's own software (which tolerates it) runs there, never a team's pods.
SYSTEM_TAINT = {"key": "CriticalAddonsOnly", "value": "true", "effect": "NoSchedule"}
SYSTEM_TOLERATIONS = [{"key": "CriticalAddonsOnly", "operator": "Exists"}]
# Namespaces whose jobs Kueue manages even without a queue name (its webhook gives them the LocalQueue `default`).
TEAM_NAMESPACE_LABEL = "gpucluster/team-namespace"
QUEUE_NAME_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_API = "kueue.x-k8s.io/v1beta2"  # the storage version of the pinned Kueue (v1beta1 is deprecated there)
FSX_CLAIM = "fsx"
# The team's two LocalQueues: `default` for accelerator work, `cpu` for the rest (each to a ClusterQueue of its own).
LOCAL_QUEUE = "default"
CPU_LOCAL_QUEUE = "cpu"
GUARDRAIL = "gpucluster-guardrail"
# What each container requests when it asks for nothing, so that the quota's CPU and memory count every pod. No
# default limit: it would cap a GPU pod that sets only accelerator limits at this much memory and OOM-kill it.
DEFAULT_CPU, DEFAULT_MEMORY = "500m", "1Gi"
# The share of a node's vCPUs and memory one pod per node may take: the rest is the kubelet's reservation, the
# eviction threshold and the daemon sets (CNI, device plugins, exporters, the FSx CSI node).
NODE_SHARE_CPU, NODE_SHARE_MEMORY = 0.9, 0.85
# Pods of the team at once: every node's worth of one pod per accelerator, plus room for small helper pods.
PODS_PER_NODE = 16


@dataclass(frozen=True)
class Fsx:
    """The file system as the static PersistentVolume names it."""

    file_system_id: Any
    dns_name: Any
    mount_name: Any
    capacity_gib: int


def namespace_name(stack: Stack) -> str:
    return stack.spec.team


def cluster_queue_name(stack: Stack) -> str:
    """The accelerator ClusterQueue (the pools' families), behind the LocalQueue `default`."""
    return stack.spec.team


def cpu_cluster_queue_name(stack: Stack) -> str:
    """The CPU ClusterQueue (the CPU nodes' flavour only), behind the LocalQueue `cpu`."""
    return f"{stack.spec.team}-{CPU_LOCAL_QUEUE}"


def cluster_queue_names(stack: Stack) -> list[str]:
    """Both of the team's ClusterQueues: what the budget's guardrail holds and reopens."""
    return [cluster_queue_name(stack), cpu_cluster_queue_name(stack)]


def accelerator_resources(stack: Stack) -> list[str]:
    """The accelerator resources the stack's pools advertise: a pod on the accelerator queue asks for one of them."""
    return sorted({accelerator_resource(p) for p in stack.spec.pools})


def accelerator_resource(pool: PoolSpec) -> str:
    return eks.GPU_RESOURCE if pool.accelerator.kind == "nvidia" else eks.NEURON_RESOURCE


def family_name(stack: Stack, pool: PoolSpec) -> str:
    """The pool's family: the spot pool's name for a spot pool and its fallback, else the pool's own."""
    spot = next((p for p in stack.spec.pools if p.fallback == pool.name), None)
    return spot.name if spot is not None else pool.name


def families(stack: Stack) -> dict[str, list[PoolSpec]]:
    """The pools by family, in the order Kueue tries the flavours; within a family, spot first."""
    out: dict[str, list[PoolSpec]] = {}
    for pool in flavor_order(stack):
        out.setdefault(family_name(stack, pool), []).append(pool)
    return out


def pool_labels(stack: Stack, pool: PoolSpec) -> dict[str, str]:
    """Labels every node of the pool carries (node group labels; the ResourceFlavor selects on the family's)."""
    labels = {POOL_LABEL: pool.name, CAPACITY_LABEL: pool.capacity, ACCELERATOR_LABEL: pool.accelerator.kind,
              FAMILY_LABEL: family_name(stack, pool)}
    if pool.accelerator.kind == "nvidia":
        labels[GPU_LABEL] = GPU_TYPES[pool.accelerator.model]
    return labels | ({EFA_LABEL: "true"} if pool.uses_efa else {})


def pool_taints(pool: PoolSpec) -> list[dict[str, str]]:
    """Only pods that ask for accelerators (and, on spot pools, accept interruption) land on the pool's nodes."""
    taints = [{"key": accelerator_resource(pool), "value": "true", "effect": "NoSchedule"}]
    if pool.capacity == "spot":
        taints.append({"key": SPOT_TAINT, "value": "true", "effect": "NoSchedule"})
    return taints


def pool_resources(pool: PoolSpec) -> dict[str, int]:
    """Extended resources one node of the pool advertises (its device plugins' counts)."""
    out = {accelerator_resource(pool): pool.accelerator.count}
    if pool.uses_efa:
        out[eks.EFA_RESOURCE] = pool.itype.efa_interfaces
    return out


# What of a node's instance store its pods may fill: nodeadm's kubelet defaults keep nodefs.available 10% free
# (evictionHard) and reserve 1Gi of ephemeral-storage (kubeReserved) (awslabs/amazon-eks-ami v20260724,
# nodeadm/internal/kubelet/config.go); a further 1% for the file system's own structures on the array.
NODEFS_EVICTION_SHARE, FILESYSTEM_SHARE, KUBE_RESERVED_EPHEMERAL_BYTES = 0.10, 0.01, 2**30


def node_ephemeral_storage(pool: PoolSpec) -> int | None:
    """Bytes of ephemeral storage (emptyDir, image layers, logs) one node of the pool offers pods: its NVMe instance
    store as one array, less what the kubelet keeps. None for a type without instance store."""
    store = pool.itype.instance_store
    if store is None:
        return None
    usable = 1 - NODEFS_EVICTION_SHARE - FILESYSTEM_SHARE
    return int(store.total_gb * 10**9 * usable) - KUBE_RESERVED_EPHEMERAL_BYTES


NODEADM_API = "node.eks.aws/v1alpha1"
# nodeadm's user data part type and the multipart framing EKS merges with its own NodeConfig for a managed node group
# (awslabs/amazon-eks-ami v20260724 nodeadm/doc/examples.md).
NODEADM_CONTENT_TYPE = "application/node.eks.aws"
USER_DATA_BOUNDARY = "BOUNDARY"


def node_config(pool: PoolSpec) -> Manifest | None:
    """nodeadm's NodeConfig for a pool whose type has instance store: every NVMe disk in one RAID0 array, where nodeadm
    bind-mounts /var/lib/kubelet, /var/lib/containerd and /var/log/pods (templates/al2023/runtime/bin/
    setup-local-disks), so emptyDir volumes and image layers live on NVMe, not the root volume. None otherwise."""
    if pool.itype.instance_store is None:
        return None
    return {"apiVersion": NODEADM_API, "kind": "NodeConfig",
            "spec": {"instance": {"localStorage": {"strategy": "RAID0"}}}}


def node_user_data(pool: PoolSpec) -> str | None:
    """The pool's launch template user data (before base64): its NodeConfig as a MIME multipart part. None without."""
    config = node_config(pool)
    if config is None:
        return None
    return "\n".join([
        "MIME-Version: 1.0", f'Content-Type: multipart/mixed; boundary="{USER_DATA_BOUNDARY}"', "",
        f"--{USER_DATA_BOUNDARY}", f"Content-Type: {NODEADM_CONTENT_TYPE}", "",
        json.dumps(config, indent=2),  # JSON is YAML, which nodeadm reads
        "", f"--{USER_DATA_BOUNDARY}--", ""])


def node_resources(pool: PoolSpec) -> dict[str, int]:
    """What one node of the pool has beyond CPU and memory: its devices and, on EFA pools, the 2 MiB huge pages the
    EFA installer reserves. Huge pages count in MiB: `quantity` writes each amount as Kubernetes reads it."""
    out = pool_resources(pool)
    if pool.uses_efa:
        out[HUGEPAGES_RESOURCE] = eks.EFA_NODE_HUGEPAGES * 2
    return out


def quantity(resource: str, amount: int) -> int | str:
    """An amount of `node_resources` as a Kubernetes quantity: huge pages in MiB ("10256Mi"), devices as counts."""
    return f"{amount}Mi" if resource == HUGEPAGES_RESOURCE else amount


def cpu_node_labels() -> dict[str, str]:
    """The CPU node group's labels: its own family, which the CPU flavour selects on."""
    return {POOL_LABEL: CPU_FLAVOR, CAPACITY_LABEL: "on-demand", FAMILY_LABEL: CPU_FLAVOR}


def flavor_order(stack: Stack) -> list[PoolSpec]:
    """The team's flavours in the order Kueue tries them: each spot pool right before the pool it falls back to."""
    pools = list(stack.spec.pools)
    ordered: list[PoolSpec] = []
    for pool in pools:
        if pool in ordered:
            continue
        if pool.capacity != "spot" and any(p.fallback == pool.name for p in pools):
            continue  # placed after its spot pool
        ordered.append(pool)
        ordered += [p for p in pools if pool.capacity == "spot" and p.name == pool.fallback and p not in ordered]
    ordered += [p for p in pools if p not in ordered]
    return ordered


def _memory_gi(mib: int) -> str:
    return f"{mib // 1024}Gi"


CPU_COVERED = ["cpu", "memory"]


def _covered(stack: Stack) -> list[str]:
    extended = sorted({r for p in stack.spec.pools for r in node_resources(p)})
    return [*CPU_COVERED, *extended]


# A node group at its largest: its instance type, what one node has beyond CPU and memory (node_resources), max nodes.
NodeGroupSize = tuple[catalog.InstanceType, dict[str, int], int]


def pool_size(pool: PoolSpec) -> NodeGroupSize:
    return pool.itype, node_resources(pool), pool.max_nodes


def cpu_nodes_size(stack: Stack) -> NodeGroupSize:
    cpu_nodes = stack.spec.eks.cpu_nodes
    return cpu_nodes.itype, {}, cpu_nodes.max_nodes


def capacity(groups: list[NodeGroupSize]) -> dict[str, Any]:
    """What the node groups hold together at their largest: vCPUs, memory in Gi (of the sum, rounded down) and each
    other resource as a Kubernetes quantity."""
    have: dict[str, int] = {}
    memory_mib = 0
    for itype, resources, nodes in groups:
        for resource, count in ({"cpu": itype.vcpus} | resources).items():
            have[resource] = have.get(resource, 0) + count * nodes
        memory_mib += itype.memory_mib * nodes
    return {r: quantity(r, count) for r, count in have.items()} | {"memory": _memory_gi(memory_mib)}


def _family_quota(name: str, pools: list[PoolSpec], covered: list[str]) -> dict[str, Any]:
    """What the family's pools hold at their largest, per resource Kueue covers (0 for resources it has none of)."""
    quota = capacity([pool_size(pool) for pool in pools])
    return {"name": name, "resources": [{"name": r, "nominalQuota": quota.get(r, 0)} for r in covered]}


def _cpu_quota(stack: Stack) -> dict[str, Any]:
    """The CPU nodes at their largest: CPU and memory only (the CPU queue covers nothing else, so a pod asking for an
    accelerator, EFA or huge pages there is inadmissible rather than placed where none is)."""
    quota = capacity([cpu_nodes_size(stack)])
    return {"name": CPU_FLAVOR, "resources": [{"name": r, "nominalQuota": quota[r]} for r in CPU_COVERED]}


def namespace(stack: Stack) -> Manifest:
    # Pod Security's baseline: no privileged or host-network pods, no hostPath, so that no team pod reaches the node's
    # devices or role around the device plugins, the quota and Pod Identity.
    return {"apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": namespace_name(stack), "labels": {TEAM_NAMESPACE_LABEL: "true",
                                                                   "pod-security.kubernetes.io/enforce": "baseline"}}}


def quota_totals(stack: Stack) -> dict[str, Any]:
    """The team's ceiling at once: every pool and the CPU nodes at max size (what the node groups could ever
    hold)."""
    groups = [cpu_nodes_size(stack), *(pool_size(pool) for pool in stack.spec.pools)]
    return capacity(groups) | {"pods": PODS_PER_NODE * sum(nodes for _, _, nodes in groups)}


def resource_quota(stack: Stack) -> Manifest:
    totals = quota_totals(stack)
    hard = {"requests.cpu": str(totals.pop("cpu")), "requests.memory": totals.pop("memory"),
            "pods": str(totals.pop("pods"))}
    # Extended resources take the requests. prefix only (they cannot be overcommitted); huge pages are counted under it
    # too (kubernetes pkg/quota/v1/evaluator/core/pods.go: podComputeUsageHelper).
    hard |= {f"requests.{resource}": str(amount) for resource, amount in sorted(totals.items())}
    return {"apiVersion": "v1", "kind": "ResourceQuota",
            "metadata": {"name": "team-quota", "namespace": namespace_name(stack)}, "spec": {"hard": hard}}


def limit_range(stack: Stack) -> Manifest:
    return {"apiVersion": "v1", "kind": "LimitRange",
            "metadata": {"name": "defaults", "namespace": namespace_name(stack)},
            "spec": {"limits": [{"type": "Container",
                                 "defaultRequest": {"cpu": DEFAULT_CPU, "memory": DEFAULT_MEMORY}}]}}


def fsx_volume(stack: Stack, fsx: Fsx) -> list[Manifest]:
    """The stack's file system as a static PersistentVolume bound to one claim in the team's namespace."""
    name = f"{stack.cluster_name}-fsx"
    size = f"{fsx.capacity_gib}Gi"
    pv = {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": name},
          "spec": {"capacity": {"storage": size}, "volumeMode": "Filesystem", "accessModes": ["ReadWriteMany"],
                   "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "",
                   "claimRef": {"namespace": namespace_name(stack), "name": FSX_CLAIM},
                   "mountOptions": ["flock"],
                   "csi": {"driver": "fsx.csi.aws.com", "volumeHandle": fsx.file_system_id,
                           "volumeAttributes": {"dnsname": fsx.dns_name, "mountname": fsx.mount_name}}}}
    pvc = {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
           "metadata": {"name": FSX_CLAIM, "namespace": namespace_name(stack)},
           "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "", "volumeName": name,
                    "resources": {"requests": {"storage": size}}}}
    return [pv, pvc]


def taint_tolerations(pools: list[PoolSpec]) -> list[dict[str, str]]:
    """Tolerations for every taint of these pools' nodes (the cluster's own daemons on them)."""
    taints = {(t["key"], t["value"], t["effect"]) for pool in pools for t in pool_taints(pool)}
    return [{"key": k, "operator": "Equal", "value": v, "effect": e} for k, v, e in sorted(taints)]


def family_tolerations(pools: list[PoolSpec]) -> list[dict[str, str]]:
    """What a job admitted to the family tolerates: the spot opt-in where a spot pool is in it (a job admitted to a
    spot family accepts interruption: that is the family's point), never the accelerator's taint. A pod that requests
    the accelerator gets that toleration from the API server's ExtendedResourceToleration admission plugin (on in EKS
    since 1.19: aws/containers-roadmap#739), one that requests none does not: a CPU pod on a GPU family's flavour (the
    admission policies refuse one on the accelerator queue) never fits a GPU node, so the autoscaler starts none."""
    accelerators = {accelerator_resource(pool) for pool in pools}
    return [t for t in taint_tolerations(pools) if t["key"] not in accelerators]


def resource_flavors(stack: Stack) -> list[Manifest]:
    """One flavour per family, the CPU nodes' first; Kueue adds its tolerations to the pods it admits, so jobs need not
    know the taints."""
    tolerations = {CPU_FLAVOR: [{"operator": "Equal", **CPU_TAINT}]}
    tolerations |= {name: family_tolerations(pools) for name, pools in families(stack).items()}
    return [{"apiVersion": KUEUE_API, "kind": "ResourceFlavor", "metadata": {"name": name},
             "spec": {"nodeLabels": {FAMILY_LABEL: name}, "tolerations": tolerated}}
            for name, tolerated in tolerations.items()]


def _cluster_queue(stack: Stack, name: str, covered: list[str], flavors: list[dict[str, Any]]) -> Manifest:
    """A ClusterQueue of the team's namespace. A pending workload preempts the queue's workloads of lower priority
    (WorkloadPriorityClass) when the quota is taken.

    No stopPolicy: the guardrail owns that field (Kueue defaults it to None), and with server-side apply an `up`
    that does not name it never takes it back, so it cannot reopen a held queue."""
    return {"apiVersion": KUEUE_API, "kind": "ClusterQueue", "metadata": {"name": name},
            "spec": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace_name(stack)}},
                     "queueingStrategy": "BestEffortFIFO",
                     "preemption": {"withinClusterQueue": "LowerPriority"},
                     "resourceGroups": [{"coveredResources": covered, "flavors": flavors}]}}


def cluster_queue(stack: Stack) -> Manifest:
    """The accelerator queue: the pools' families only. Kueue tries them in order and takes the first with room for
    every resource a pod set requests. The CPU flavour is not among them: in one queue, a CPU-only pod that finds the
    CPU flavour's quota taken is admitted to a family's (which covers cpu and memory too), where no node takes it
    (it does not tolerate the accelerator taint) and it holds that quota until waitForPodsReady evicts it. The
    admission policies (gpu_queue_policies) send CPU-only work to the CPU queue instead."""
    covered = _covered(stack)
    return _cluster_queue(stack, cluster_queue_name(stack), covered,
                          [_family_quota(name, pools, covered) for name, pools in families(stack).items()])


def cpu_cluster_queue(stack: Stack) -> Manifest:
    """The CPU queue: the CPU nodes' flavour only, covering CPU and memory only."""
    return _cluster_queue(stack, cpu_cluster_queue_name(stack), CPU_COVERED, [_cpu_quota(stack)])


# The team's priorities, by the label a job carries (kueue.x-k8s.io/priority-class: high). A job without it gets
# Kueue's default priority, 0 (no pod PriorityClass is a global default here): `normal` is that default by value.
PRIORITY_CLASS_LABEL = "kueue.x-k8s.io/priority-class"
PRIORITIES = {"low": (-100, "Preemptible work: any normal or high job may take its quota."),
              "normal": (0, "The default (a job without the label has this priority)."),
              "high": (100, "Urgent work: preempts low and normal jobs when the quota is taken.")}


def workload_priority_classes() -> list[Manifest]:
    return [{"apiVersion": KUEUE_API, "kind": "WorkloadPriorityClass", "metadata": {"name": name},
             "value": value, "description": description}
            for name, (value, description) in PRIORITIES.items()]


def local_queues(stack: Stack) -> list[Manifest]:
    return [{"apiVersion": KUEUE_API, "kind": "LocalQueue",
             "metadata": {"name": local, "namespace": namespace_name(stack)}, "spec": {"clusterQueue": cluster}}
            for local, cluster in ((LOCAL_QUEUE, cluster_queue_name(stack)),
                                   (CPU_LOCAL_QUEUE, cpu_cluster_queue_name(stack)))]


# --- What the accelerator queue admits ----------------------------------------------------------------------------

ADMISSION_API = "admissionregistration.k8s.io/v1"  # ValidatingAdmissionPolicy: GA since Kubernetes 1.30
# The kinds a team queues (Kueue's integrations enabled in kueue_values), by where their pods' spec sits.
QUEUED_KINDS = {"object.spec": [("", "v1", "pods")],
                "object.spec.template.spec": [("batch", "v1", "jobs"), ("apps", "v1", "deployments"),
                                              ("apps", "v1", "statefulsets")]}


def _on_gpu_queue(obj: str) -> str:
    labels = f"{obj}.metadata.labels"
    return (f"has({labels}) && '{QUEUE_NAME_LABEL}' in {labels} && "
            f"{labels}['{QUEUE_NAME_LABEL}'] == '{LOCAL_QUEUE}'")


def requests_an_accelerator(pod_spec: str, resources: list[str]) -> str:
    """CEL: a container of the pod spec at `pod_spec` asks for one of `resources` (as a request or, which the API
    server makes a request too, as a limit)."""
    wanted = ", ".join(f"'{r}'" for r in resources)
    asks = " || ".join(f"(has(c.resources.{field}) && c.resources.{field}.exists(r, r in [{wanted}]))"
                       for field in ("requests", "limits"))
    return f"{pod_spec}.containers.exists(c, has(c.resources) && ({asks}))"


def gpu_queue_policies(stack: Stack) -> list[Manifest]:
    """ValidatingAdmissionPolicies (and their bindings to the team's namespace) that refuse a workload queued to the
    accelerator queue whose containers ask for no accelerator, naming the CPU queue. One policy per place of the pod
    spec, so that each expression type-checks against its kinds' schema. On an update they judge only what changed
    the answer (a workload newly on the queue, or its pods' spec changed): finalizer and status updates of what was
    admitted before pass."""
    resources = accelerator_resources(stack)
    message = (f"asks for no accelerator ({', '.join(resources)}) on the accelerator queue {LOCAL_QUEUE!r}: label it "
               f"{QUEUE_NAME_LABEL}: {CPU_LOCAL_QUEUE} (the CPU queue), whose nodes it runs on")
    # Checked first: a pod asking for NeuronCores asks for no accelerator the queue counts, and "use the CPU queue"
    # would mislead it.
    no_cores = (f"asks for {eks.NEURONCORE_RESOURCE}, which the queues do not count (their quota is whole Neuron "
                f"devices): request {eks.NEURON_RESOURCE} instead")
    out: list[Manifest] = []
    for pod_spec, kinds in QUEUED_KINDS.items():
        name = f"gpucluster-{stack.spec.team}-gpu-queue-" + ("pods" if pod_spec == "object.spec" else "workloads")
        old_spec = pod_spec.replace("object.", "oldObject.", 1)
        out.append({"apiVersion": ADMISSION_API, "kind": "ValidatingAdmissionPolicy", "metadata": {"name": name},
                    "spec": {"failurePolicy": "Fail",
                             "matchConstraints": {"resourceRules": [
                                 {"apiGroups": [group], "apiVersions": [version], "resources": [resource],
                                  "operations": ["CREATE", "UPDATE"]} for group, version, resource in kinds]},
                             "matchConditions": [
                                 {"name": "on-the-accelerator-queue", "expression": _on_gpu_queue("object")},
                                 {"name": "new-or-changed", "expression": (
                                     f"request.operation == 'CREATE' || !({_on_gpu_queue('oldObject')}) || "
                                     f"{old_spec} != {pod_spec}")}],
                             "validations": [
                                 *([{"expression": f"!({requests_an_accelerator(pod_spec, [eks.NEURONCORE_RESOURCE])})",
                                     "message": no_cores, "reason": "Forbidden"}]
                                   if eks.NEURON_RESOURCE in resources else []),
                                 {"expression": requests_an_accelerator(pod_spec, resources),
                                  "message": message, "reason": "Forbidden"}]}})
        out.append({"apiVersion": ADMISSION_API, "kind": "ValidatingAdmissionPolicyBinding",
                    "metadata": {"name": name},
                    "spec": {"policyName": name, "validationActions": ["Deny"],
                             "matchResources": {"namespaceSelector": {"matchLabels": {
                                 "kubernetes.io/metadata.name": namespace_name(stack)}}}}})
    return out


def idle_gpu_rule(stack: Stack) -> Manifest:
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
            "metadata": {"name": "gpucluster-idle-gpu", "namespace": eks.KUBE_PROMETHEUS_STACK.namespace,
                         "labels": {"release": "monitoring"}},
            "spec": {"groups": [{"name": "gpucluster", "rules": [{
                # The Slurm flavour's expression and hold: on labels dcgm-exporter sets wherever it runs.
                "alert": "GpuIdle", "expr": prometheus.gpu_idle_expr(), "for": prometheus.IDLE_FOR,
                "labels": {"severity": "warning", "cluster": stack.cluster_name},
                "annotations": {"summary": (f"GPU {{{{ $labels.gpu }}}} on {{{{ $labels.Hostname }}}} under "
                                            f"{monitoring.IDLE_PERCENT}% for {monitoring.IDLE_MINUTES} minutes: "
                                            "money burning")}}]}]}}


def team_manifests(stack: Stack, fsx: Fsx) -> list[Manifest]:
    """The team's namespace, its quota and defaults, its claim on the file system. Core Kubernetes only."""
    return [namespace(stack), resource_quota(stack), limit_range(stack), *fsx_volume(stack, fsx)]


def team_group(stack: Stack) -> str:
    """The Kubernetes group the team role's access entry puts its sessions in (RBAC subjects name it)."""
    return f"gpucluster:{stack.spec.team}"


# Kueue's aggregated ClusterRole for people who submit jobs (the pinned chart's `<fullname>-batch-user-role`, its
# fullname being the release's, "kueue"): read LocalQueues and Workloads. EKS's edit policy knows no Kueue objects.
KUEUE_BATCH_USER_ROLE = "kueue-batch-user-role"


def team_kueue_access(stack: Stack) -> Manifest:
    """The team may see its queue and its jobs' Workloads (`kubectl get workloads`), in its namespace only."""
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": {"name": "kueue-batch-user", "namespace": namespace_name(stack)},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": KUEUE_BATCH_USER_ROLE},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": team_group(stack)}]}


def queue_manifests(stack: Stack) -> list[Manifest]:
    """Kueue's objects (need Kueue's CRDs), the accelerator queue's admission policies and the team's access to the
    queues (needs Kueue's ClusterRole)."""
    return [*workload_priority_classes(), *resource_flavors(stack), cluster_queue(stack), cpu_cluster_queue(stack),
            *local_queues(stack), *gpu_queue_policies(stack), team_kueue_access(stack)]


# --- Helm values -----------------------------------------------------------------------------------------------

# From a node's registration to Ready: its device plugins, then the burn-in (its startup taint keeps the node not
# ready to the autoscaler), which pulls NVIDIA's DCGM image (a few GB) and runs the level-1 diagnostic on every GPU.
# The autoscaler's default (15 minutes; the flag is `max-node-startup-time` from cluster-autoscaler 1.35,
# kubernetes/autoscaler#8543 and #9074) would count a slow burn-in's node as failed to start: an allowance for those
# steps, not a measurement.
NODE_STARTUP_MINUTES = 25


def node_startup_minutes(stack: Stack) -> int:
    """The allowance above, and on a stack with EFA pools the burn-in's pull of a Deep Learning Container for fi_info
    (kube_health.efa_info_image: as large as a job's image, pulled after DCGM, under the startup taint): the job
    image's pull allowance again. One flag for every group, so the slowest pool's start."""
    efa = any(p.uses_efa for p in stack.spec.pools)
    return NODE_STARTUP_MINUTES + (IMAGE_PULL_MINUTES if efa else 0)


def max_node_provision_time(stack: Stack) -> str:
    """The autoscaler's wait for a new node: the slowest of the stack's instance types (catalog.provision_minutes).
    One flag for every group: the AWS provider takes no per-group override of it (cluster-autoscaler-1.35.0's AWS
    README lists the autoscaling-options tags it reads; max-node-provision-time is not among them)."""
    return f"{provision_minutes(stack)}m"


def provision_minutes(stack: Stack) -> int:
    return max(p.itype.provision_minutes for p in stack.spec.pools)


def asg_name_regex(node_group_name: str) -> str:
    """EKS names a managed node group's Auto Scaling group eks-<node group name>-<uuid>."""
    # The uuid's shape, not any suffix: a pool named like another's prefix (p5, p5-spot) must not match its group.
    return f"^eks-{node_group_name}-[0-9a-f]{{8}}(-[0-9a-f]{{4}}){{3}}-[0-9a-f]{{12}}$"


def autoscaler_values(stack: Stack, node_group_names: dict[str, str], service_account: str) -> dict[str, Any]:
    """The Cluster Autoscaler: discovers the node groups by EKS's own ASG tags, and with the priority expander tries
    each spot pool before its on-demand fallback (higher number first). `node_group_names` names each pool's node
    group and the CPU nodes' (under CPU_FLAVOR). The CPU group is listed too, last: the priority expander drops a
    group that no entry matches ("The group won't be used.", cluster-autoscaler 1.35 expander/priority/priority.go)
    and no other group fits a CPU-only pod, so its rank among them does not matter."""
    order = [p.name for p in flavor_order(stack)] + [CPU_FLAVOR]
    priorities = {str(10 * (len(order) - i)): [asg_name_regex(node_group_names[name])]
                  for i, name in enumerate(order)}
    return {
        "cloudProvider": "aws",
        "awsRegion": stack.region,
        "autoDiscovery": {"clusterName": stack.cluster_name},
        "rbac": {"serviceAccount": {"create": True, "name": service_account}},
        "expanderPriorities": priorities,
        "tolerations": SYSTEM_TOLERATIONS,
        # A spot group that cannot get capacity is given up on after this long and the next priority is tried
        # (the default, 15 minutes, leaves a queued job waiting that much per attempt).
        "extraArgs": {"expander": "priority", "max-node-provision-time": max_node_provision_time(stack),
                      "max-node-startup-time": f"{node_startup_minutes(stack)}m",
                      "balance-similar-node-groups": False,
                      "skip-nodes-with-local-storage": False, "scale-down-unneeded-time": "10m"},
    }


def nvidia_device_plugin_values() -> dict[str, Any]:
    # Our nodes carry our accelerator label; no Node Feature Discovery needed to find them.
    return {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": ACCELERATOR_LABEL, "operator": "In", "values": ["nvidia"]}]}]}}},
        "tolerations": [{"operator": "Exists"}]}


def neuron_device_plugin_values() -> dict[str, Any]:
    """AWS's Neuron chart with its device plugin only, on Neuron nodes only (our label), tolerating their taints. The
    problem detector, the scheduler extension and the DRA driver, on by default or not, are turned off explicitly."""
    return {"devicePlugin": {"enabled": True, "nodeSelector": {ACCELERATOR_LABEL: "neuron"},
                             "tolerations": [{"operator": "Exists"}]},
            "npd": {"enabled": False}, "scheduler": {"enabled": False}, "draDriver": {"enabled": False},
            "ultraserverOperator": {"enabled": False}}


def efa_device_plugin_values() -> dict[str, Any]:
    return {"nodeSelector": {EFA_LABEL: "true"}, "tolerations": [{"operator": "Exists"}]}


# After its nodes are up, an admitted job's pods pull the training image: a CUDA/PyTorch image of 10-20 GB. An allowance
# chosen for that size, not a measurement; a slower first pull counts against the job's wait below.
IMAGE_PULL_MINUTES = 10
# Requeuing a job whose pods were not ready in time: after about 1, 2, 4, 8, 16 minutes, then deactivated (`kubectl get
# workloads` shows it) rather than retried for ever.
REQUEUE_BACKOFF_BASE_SECONDS, REQUEUE_BACKOFF_LIMIT = 60, 5


def pods_ready_timeout_minutes(stack: Stack) -> int:
    """How long an admitted job may wait for all its pods to run: the autoscaler's attempts at its family (the spot
    group, then the on-demand fallback, each given up on after max-node-provision-time), the node's start (device
    plugins, burn-in) and the image pull. Kueue's recoveryTimeout (a lost pod's replacement) defaults to it."""
    attempts = max(len(pools) for pools in families(stack).values())
    return (attempts - 1) * provision_minutes(stack) + node_wait_minutes(stack)


def node_wait_minutes(stack: Stack) -> int:
    """From asking for a node to a pod running there: the autoscaler's provision time, the node's start (device
    plugins, burn-in) and the image pull."""
    return provision_minutes(stack) + node_startup_minutes(stack) + IMAGE_PULL_MINUTES


def kueue_values(stack: Stack) -> dict[str, Any]:
    """Jobs in the team's namespace without a queue name are managed too. Kueue v0.19.2's webhooks label such a job
    with the LocalQueue named `default` when the namespace has one (pkg/controller/jobframework/defaults.go,
    setDefaultLocalQueue): here that is the accelerator queue, so an unlabelled job asking for GPUs is queued there
    and one asking for none is refused by the accelerator queue's admission policy, which names the `cpu` queue
    (validating admission runs after the mutating webhooks).

    waitForPodsReady (fields as Kueue v0.19.2's apis/config/v1beta2/configuration_types.go names them): a job whose
    pods do not all run within the timeout is evicted, gives its quota back and is requeued with backoff. Without it,
    a spot family's quota (spot and fallback at max) admits jobs the fallback alone cannot hold while spot has no
    capacity, and they keep that quota for ever. No blockAdmission: it would hold every other admission of the queue
    (CPU work too) while one job waits for its nodes. The recovery timeout (a pod lost later, e.g. to a spot
    interruption) defaults to the timeout.

    Integrations: only what the flavour installs an operator for (Kubernetes' own Job, Pod, Deployment and
    StatefulSet); JobSet and Kubeflow Trainer are not installed."""
    config = "\n".join([
        "apiVersion: config.kueue.x-k8s.io/v1beta2",
        "kind: Configuration",
        "health:",
        "  healthProbeBindAddress: :8081",
        "metrics:",
        "  bindAddress: :8443",
        "webhook:",
        "  port: 9443",
        "leaderElection:",
        "  leaderElect: true",
        "  resourceName: c1f6bfd2.kueue.x-k8s.io",
        "manageJobsWithoutQueueName: true",
        "managedJobsNamespaceSelector:",
        "  matchLabels:",
        f"    {TEAM_NAMESPACE_LABEL}: \"true\"",
        "waitForPodsReady:",
        f"  timeout: {pods_ready_timeout_minutes(stack)}m",
        "  blockAdmission: false",
        "  requeuingStrategy:",
        "    timestamp: Eviction",  # an evicted job queues again behind those waiting, from its eviction
        f"    backoffBaseSeconds: {REQUEUE_BACKOFF_BASE_SECONDS}",
        f"    backoffLimitCount: {REQUEUE_BACKOFF_LIMIT}",
        "integrations:",
        "  frameworks:",
        "  - batch/job",
        # Bare pods, Deployments and StatefulSets too, so that no GPU pod in the team's namespace bypasses the
        # queue (and with it the quota and the budget's hold). Only there: the namespace selector above.
        "  - pod",
        "  - deployment",
        "  - statefulset",
        "",
    ])
    return {"managerConfig": {"controllerManagerConfigYaml": config},
            "controllerManager": {"tolerations": SYSTEM_TOLERATIONS}}


def dcgm_exporter_values() -> dict[str, Any]:
    return {"serviceMonitor": {"enabled": True, "interval": "15s", "additionalLabels": {"release": "monitoring"}},
            "nodeSelector": {ACCELERATOR_LABEL: "nvidia"}, "tolerations": [{"operator": "Exists"}]}


ALERTMANAGER_SERVICE_ACCOUNT = "alertmanager"  # named, for its Pod Identity association


def alertmanager_config(stack: Stack, topic_arn: Any) -> dict[str, Any]:
    """The Slurm flavour's routing (settings.alertmanager_routing: GpuIdle and the rest to the stack's topic), plus the
    chart's always-firing Watchdog kept off the topic."""
    config = settings.alertmanager_routing(topic_arn, stack.region, stack.cluster_name)
    config["route"]["routes"] = [{"receiver": "null", "matchers": ['alertname = "Watchdog"']}]
    config["receivers"].append({"name": "null"})
    return config


def prometheus_values(stack: Stack, topic_arn: Any) -> dict[str, Any]:
    # Rules and monitors of every release are picked up, not only this chart's own.
    # Everything but the node exporter (a DaemonSet that tolerates every NoSchedule taint) on the system nodes.
    return {"prometheus": {"prometheusSpec": {"ruleSelectorNilUsesHelmValues": False,
                                              "serviceMonitorSelectorNilUsesHelmValues": False,
                                              "retention": "15d", "tolerations": SYSTEM_TOLERATIONS}},
            "alertmanager": {"config": alertmanager_config(stack, topic_arn),
                             "serviceAccount": {"create": True, "name": ALERTMANAGER_SERVICE_ACCOUNT},
                             "alertmanagerSpec": {"tolerations": SYSTEM_TOLERATIONS}},
            "prometheusOperator": {"tolerations": SYSTEM_TOLERATIONS,
                                   "admissionWebhooks": {"patch": {"tolerations": SYSTEM_TOLERATIONS}}},
            "kube-state-metrics": {"tolerations": SYSTEM_TOLERATIONS},
            "grafana": {"enabled": False}}


# --- The first job ---------------------------------------------------------------------------------------------

# AWS's Deep Learning Container for PyTorch training on EC2: torch with CUDA, and EFA's libfabric with NCCL's EFA
# plugin (aws-ofi-nccl). Without those, NCCL falls back to TCP sockets. The tag and what it carries are read from
# aws/deep-learning-containers: docs/pytorch/changelog/index.md ("PyTorch 2.13", EC2 tag 2.13-cu133-amzn2023: PyTorch
# 2.13.0, CUDA 13.3, NCCL 2.30.7, EFA 1.49.0) and .github/config/image/pytorch/2.13-ec2-cuda.yml (prod_image,
# private_registry: true). The registry is AWS's account in each region; the node role's
# AmazonEC2ContainerRegistryPullOnly lets the kubelet pull from it.
DLC_ACCOUNT = "763104351884"
DLC_IMAGE = "pytorch:2.13-cu133-amzn2023"
# The DLC's EFA installer puts the plugin at /opt/amazon/ofi-nccl/lib64/libnccl-net-ofi.so, on the image's
# LD_LIBRARY_PATH (scripts/docker/common/install_efa_amzn2023.sh, docker/pytorch/Dockerfile.cuda): NCCL opens
# libnccl-net-<NCCL_NET_PLUGIN>.so, so naming it makes NCCL load it (and ddp_train.py report it found).
NCCL_EFA_PLUGIN = "ofi"
EXAMPLE_NAME = "ddp-example"
RENDEZVOUS_PORT = 29500
TRAINER = "trainer"
# torchrun restarts this node's workers this often (a worker's crash, or a peer lost to an interruption) before the
# pod fails; then the Job's backoffLimit counts the pod. Interruptions themselves are never counted (DisruptionTarget).
MAX_RESTARTS = 3
BACKOFF_LIMIT = 3
# Exit codes of the pod's command that no retry mends: bash's "command not found" / "not executable" (an image
# without torchrun) and a usage error (2: bash's or torchrun's own arguments): the Job fails at once.
BUG_EXIT_CODES = [2, 126, 127]


def dlc_image(region: str) -> str:
    return f"{DLC_ACCOUNT}.dkr.ecr.{region}.amazonaws.com/{DLC_IMAGE}"


def replacement_wait_s(stack: Stack) -> int:
    """How long a pod waits for a lost peer's replacement: a node for it, started and burnt in, and the image."""
    return node_wait_minutes(stack) * 60


def node_share(itype: catalog.InstanceType) -> tuple[int, int]:
    """The whole vCPUs and GiB of memory one pod per node may take (NODE_SHARE_CPU, NODE_SHARE_MEMORY)."""
    return int(itype.vcpus * NODE_SHARE_CPU), int(itype.memory_mib * NODE_SHARE_MEMORY) // 1024


def node_sized_resources(pool: PoolSpec) -> dict[str, str]:
    """What one pod that takes a whole node of the pool asks for: all its accelerators and EFA interfaces (with EFA's
    huge pages), and most of its CPU and memory (requests = limits: Guaranteed, so the kubelet evicts it last)."""
    cpu, memory_gi = node_share(pool.itype)
    out = {"cpu": str(cpu), "memory": f"{memory_gi}Gi"}
    out |= {r: str(c) for r, c in pool_resources(pool).items()}
    return out | ({HUGEPAGES_RESOURCE: EFA_POD_HUGEPAGES} if pool.uses_efa else {})


def shm_size(pool: PoolSpec) -> str:
    """/dev/shm for NCCL and the data loaders: a quarter of the pod's memory (a memory-backed emptyDir counts against
    the container's memory limit, so it is bounded by it in any case)."""
    return f"{node_share(pool.itype)[1] // 4}Gi"


def trainer_env(pool: PoolSpec) -> dict[str, str]:
    """NCCL over EFA where the pool has it. NCCL_DEBUG=INFO on EFA pools: the log then shows aws-ofi-nccl's
    "NET/OFI Selected Provider is efa" (a TCP fallback shows "NET/Socket" instead). FI_EFA_USE_DEVICE_RDMA stays
    unset: libfabric then uses the device's RDMA where the type has it, while 1 aborts on a type without
    (fi_efa(7))."""
    if not pool.uses_efa:
        return {"NCCL_DEBUG": "WARN"}
    return {"NCCL_DEBUG": "INFO", "FI_PROVIDER": "efa", "NCCL_NET_PLUGIN": NCCL_EFA_PLUGIN}


def trainer_script(nodes: int, procs: int, checkpoints: str, wait: int) -> str:
    """torchrun with elastic restarts and a c10d rendezvous hosted by index 0, named by its headless-Service DNS name,
    which follows index 0's replacement pod. When index 0 is lost its store goes with it and every other pod's
    torchrun exits ("RendezvousConnectionError", seen with torch 2.13): those pods start torchrun again, for as long
    as a replacement takes, and join the replacement's store. A run that lasted that long had joined: the wait
    starts anew at its loss. Every start resumes from the newest checkpoint (ddp_train.py)."""
    torchrun = " ".join([
        "torchrun", f"--nnodes={nodes}", f"--nproc-per-node={procs}", f"--max-restarts={MAX_RESTARTS}",
        "--rdzv-backend=c10d", '--rdzv-id="$JOB_UID"',
        f"--rdzv-endpoint={EXAMPLE_NAME}-0.{EXAMPLE_NAME}:{RENDEZVOUS_PORT}",
        f'--rdzv-conf="is_host=$is_host,join_timeout={wait}"',
        "/opt/example/ddp_train.py", "--checkpoint-dir", f'"{checkpoints}"'])
    return "\n".join([
        'is_host=false; [ "$JOB_COMPLETION_INDEX" = 0 ] && is_host=true',
        "lost=$SECONDS",
        "while :; do",
        "  started=$SECONDS",
        f"  {torchrun} 2>&1 | tee /tmp/torchrun.log",
        "  rc=${PIPESTATUS[0]}",
        f"  [ $((SECONDS - started)) -lt {wait} ] || lost=$SECONDS",
        f"  if [ $rc -ne 0 ] && [ $((SECONDS - lost)) -lt {wait} ] && grep -q RendezvousConnectionError "
        "/tmp/torchrun.log; then sleep 5; continue; fi",  # the new host's name may not resolve yet
        "  exit $rc",
        "done"])


def example_job(stack: Stack, pool: PoolSpec, script: str, nodes: int = 2) -> list[Manifest]:
    """`script` (examples/ddp_train.py) across `nodes` nodes of `pool` with torchrun: an indexed Job (one pod per node)
    behind a headless Service for the rendezvous, queued through the team's LocalQueue, checkpointing to the FSx
    claim (one directory per Job: its pods resume it, a new Job starts afresh). It survives interruptions: a pod
    evicted for one (DisruptionTarget) is replaced without counting against backoffLimit, and the training restarts
    from its checkpoint."""
    ns, name = namespace_name(stack), EXAMPLE_NAME
    config_map = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "namespace": ns},
                  "data": {"ddp_train.py": script}}
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": ns},
               "spec": {"clusterIP": "None", "selector": {"job-name": name}, "ports": [{"name": "c10d",
                                                                                         "port": RENDEZVOUS_PORT}]}}
    requests = node_sized_resources(pool)
    env: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in trainer_env(pool).items()]
    # The Job's uid, on every pod of it: the rendezvous' id and the checkpoint directory's name.
    env.append({"name": "JOB_UID", "valueFrom": {"fieldRef": {
        "fieldPath": "metadata.labels['batch.kubernetes.io/controller-uid']"}}})
    script_text = trainer_script(nodes, pool.accelerator.count, f"/fsx/checkpoints/{name}-$JOB_UID",
                                 replacement_wait_s(stack))
    job = {"apiVersion": "batch/v1", "kind": "Job",
           "metadata": {"name": name, "namespace": ns, "labels": {QUEUE_NAME_LABEL: LOCAL_QUEUE}},
           "spec": {"completionMode": "Indexed", "completions": nodes, "parallelism": nodes,
                    "backoffLimit": BACKOFF_LIMIT,
                    # A replacement starts once its predecessor is gone: never two pods of one index (one hostname).
                    "podReplacementPolicy": "Failed",
                    "podFailurePolicy": {"rules": [
                        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
                        {"action": "FailJob", "onExitCodes": {"containerName": TRAINER, "operator": "In",
                                                              "values": BUG_EXIT_CODES}}]},
                    "suspend": True,  # Kueue unsuspends it once admitted
                    "template": {"spec": {
                        "subdomain": name, "restartPolicy": "Never",
                        # The pool's family: a spot pool's job falls back to its on-demand pool's nodes.
                        "nodeSelector": {FAMILY_LABEL: family_name(stack, pool)},
                        "tolerations": family_tolerations(families(stack)[family_name(stack, pool)]),
                        "containers": [{"name": TRAINER, "image": dlc_image(stack.region),
                                        "command": ["bash", "-c", script_text], "env": env,
                                        "resources": {"requests": requests, "limits": requests},
                                        "volumeMounts": [{"name": "fsx", "mountPath": "/fsx"},
                                                         {"name": "example", "mountPath": "/opt/example"},
                                                         {"name": "shm", "mountPath": "/dev/shm"}]}],
                        "volumes": [{"name": "fsx", "persistentVolumeClaim": {"claimName": FSX_CLAIM}},
                                    {"name": "example", "configMap": {"name": name}},
                                    {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": shm_size(pool)}}]}}}}
    return [config_map, service, job]


# --- The budget guardrail ---------------------------------------------------------------------------------------

# Docker's official image through ECR Public's mirror: no anonymous Docker Hub pulls (rate-limited per address) from
# behind the stack's one NAT address, on every new GPU node (the burn-in's verdict) or guardrail start.
GUARDRAIL_IMAGE = "public.ecr.aws/docker/library/python:3.12-slim"
# Where a controller's boto3 goes (an emptyDir at /tmp), and how: gpucluster/spec/wheels.py's exact files, their hashes
# checked, none of their dependencies resolved by pip (the table is the whole closure), wheels only (nothing built).
BOTO3_TARGET = "/tmp/lib"


def boto3_region(region: str) -> dict[str, str]:
    """The environment that gives a controller's boto3 its region: botocore reads AWS_DEFAULT_REGION, not AWS_REGION
    (botocore/configprovider.py, 'region'), and Pod Identity sets only the credentials' variables."""
    return {"AWS_DEFAULT_REGION": region}


def boto3_install(target: str = BOTO3_TARGET) -> str:
    """The shell command that installs boto3 into `target` from a requirements file it writes beside it."""
    requirements = f"{target}.txt"
    lines = " ".join(f"'{wheel.requirement()}'" for wheel in wheels.BOTO3)
    return (f"printf '%s\\n' {lines} > {requirements} && "
            f"pip install --quiet --no-cache-dir --disable-pip-version-check --no-deps --require-hashes "
            f"--only-binary=:all: --target {target} -r {requirements}")


def library_files(*paths: str) -> dict[str, str]:
    """A program's files table: ConfigMap key -> the file's path in the library (a ConfigMap's keys are flat names;
    the volume's items put each file back at its path under the mount, so that its imports resolve there)."""
    return {path.replace("/", "."): path for path in paths}


@dataclass(frozen=True)
class ShippedProgram:
    config_map: Manifest
    volume: dict[str, Any]
    volume_mount: dict[str, Any]


def ship_program(name: str, namespace: str, mount: str, files: dict[str, str]) -> ShippedProgram:
    """An in-cluster program with the library files it imports (`library_files`) in the ConfigMap `name`, and the pod's
    volume and read-only mount that put them at their paths under `mount`."""
    return ShippedProgram(
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "namespace": namespace},
         "data": {key: (node.LIBRARY_DIR / path).read_text() for key, path in files.items()}},
        {"name": "program", "configMap": {"name": name, "items": [{"key": k, "path": p} for k, p in files.items()]}},
        {"name": "program", "mountPath": mount, "readOnly": True})


# The guardrail shares its queue loop and budget decision with the Slurm head's, and its API client with the burn-in.
GUARDRAIL_MOUNT = "/opt/guardrail"
GUARDRAIL_PROGRAM = "gpucluster/node/queue_guardrail.py"
GUARDRAIL_FILES = library_files(
    "gpucluster/__init__.py", "gpucluster/node/__init__.py", "gpucluster/node/budget.py", "gpucluster/node/sqs_poll.py",
    "gpucluster/node/kube_api.py", GUARDRAIL_PROGRAM)


def guardrail_manifests(stack: Stack, queue_url: Any, act_threshold_percent: int,
                        launch_deny_action_id: Any) -> list[Manifest]:
    """The in-cluster controller that holds and reopens the team's two ClusterQueues: may patch those only."""
    ns = eks.KUEUE.namespace
    labels = {"app": GUARDRAIL}
    program = ship_program(GUARDRAIL, ns, GUARDRAIL_MOUNT, GUARDRAIL_FILES)
    env = {"QUEUE_URL": queue_url, "BUDGET_NAME": stack.budget_name, "TEAM": stack.spec.team,
           "CLUSTER_QUEUES": ",".join(cluster_queue_names(stack)),
           "ACT_THRESHOLD_PERCENT": str(act_threshold_percent), **boto3_region(stack.region),
           "LAUNCH_DENY_ACTION_ID": launch_deny_action_id}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": GUARDRAIL, "namespace": ns}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": GUARDRAIL},
         "rules": [{"apiGroups": ["kueue.x-k8s.io"], "resources": ["clusterqueues"],
                    "resourceNames": cluster_queue_names(stack), "verbs": ["get", "patch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": GUARDRAIL},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": GUARDRAIL},
         "subjects": [{"kind": "ServiceAccount", "name": GUARDRAIL, "namespace": ns}]},
        program.config_map,
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": GUARDRAIL, "namespace": ns,
                                                                     "labels": labels},
         "spec": {"replicas": 1, "selector": {"matchLabels": labels}, "strategy": {"type": "Recreate"},
                  "template": {"metadata": {"labels": labels}, "spec": {
                      "serviceAccountName": GUARDRAIL,
                      "tolerations": SYSTEM_TOLERATIONS,
                      "securityContext": {"runAsNonRoot": True, "runAsUser": 65534,
                                          "seccompProfile": {"type": "RuntimeDefault"}},
                      "containers": [{
                          "name": "guardrail", "image": GUARDRAIL_IMAGE,
                          "command": ["sh", "-c",
                                      f"{boto3_install()} && "
                                      f"PYTHONPATH={BOTO3_TARGET} exec python {GUARDRAIL_MOUNT}/{GUARDRAIL_PROGRAM}"],
                          "env": [{"name": k, "value": v} for k, v in env.items()],
                          "resources": {"requests": {"cpu": "50m", "memory": "128Mi"},
                                        "limits": {"memory": "256Mi"}},
                          "securityContext": {"allowPrivilegeEscalation": False,
                                              "capabilities": {"drop": ["ALL"]}},
                          "volumeMounts": [program.volume_mount, {"name": "tmp", "mountPath": "/tmp"}]}],
                      "volumes": [program.volume, {"name": "tmp", "emptyDir": {}}]}}}},
    ]


# --- For `kubectl apply` ----------------------------------------------------------------------------------------

def example_pool(stack: Stack) -> PoolSpec:
    """The pool the first job runs on: the first NVIDIA pool with EFA, else the first NVIDIA pool, else the first."""
    nvidia = [p for p in stack.spec.pools if p.itype.accelerator and p.itype.accelerator.kind == "nvidia"]
    return next((p for p in nvidia if p.uses_efa), nvidia[0] if nvidia else stack.spec.pools[0])


EXAMPLE_JOB_FILE = "example-ddp-job.yaml"


def render_header(name: str) -> str:
    """Each rendered file's first lines: only the first job is for `kubectl apply`; the rest is what `pulumi up`
    declares, for review, with placeholders where AWS computes a value."""
    if name == EXAMPLE_JOB_FILE:
        return "# The first job: kubectl apply -f this file once `pulumi up` has built the cluster.\n"
    return ("# Reference, not for kubectl apply: `pulumi up` declares these objects (and owns them); values only AWS\n"
            "# knows are placeholders (<... at up>).\n")


def render_files(stack: Stack, examples_dir: Path) -> dict[str, list[Manifest]]:
    """Every object the program declares in the cluster (values AWS computes as placeholders), and the first job."""
    from gpucluster.render import kube_health  # it builds on this module

    fsx = Fsx("<file system id at up>", "<file system DNS name at up>", "<mount name at up>",
              stack.spec.storage.lustre.storage_capacity_gib or 1200)
    if stack.spec.storage.lustre.file_system_id:
        lustre = stack.spec.storage.lustre
        fsx = Fsx(lustre.file_system_id, lustre.dns_name, lustre.mount_name, 1200)
    files = {"team.yaml": team_manifests(stack, fsx), "queues.yaml": queue_manifests(stack),
             "idle-gpu-rule.yaml": [idle_gpu_rule(stack)], "burn-in.yaml": kube_health.burn_in_manifests(stack),
             EXAMPLE_JOB_FILE: example_job(stack, example_pool(stack), (examples_dir / "ddp_train.py").read_text())}
    act = stack.spec.budget.act_threshold_percent
    if act is not None:
        files["guardrail.yaml"] = guardrail_manifests(stack, "<budget queue URL at up>", act,
                                                      "<budget action id at up>")
    return files
