"""The burn-in of every new accelerator node on the Kubernetes flavour, as plain manifests (declared by
components/kubernetes.py's ClusterSoftware, written by `gpucluster render`).

Each pool's node group starts its nodes with a startup taint (node_group_taints) that no job tolerates. A DaemonSet per
pool runs on its nodes until they carry a burn-in label: on NVIDIA pools an init container of NVIDIA's DCGM image runs
the level-1 diagnostic; on EFA pools one of the first job's image lists what libfabric's EFA provider opens; the last
init container runs gpucluster/node/burn_in.py, which counts the devices, decides and
marks the Node (pass: the taint lifted; fail: its instance first terminated through its Auto Scaling group for a
replacement, within a bound per pool, then a failed taint in the startup taint's place). The label then takes the
node out of the DaemonSet's reach and its pod leaves. No container requests a device-plugin resource: an init
container's requests are held for the pod's whole life and would keep a GPU or EFA device from the jobs.
"""

from __future__ import annotations

from typing import Any

from gpucluster.contract import node_health
from gpucluster.contract.settings import ClusterSettings
from gpucluster.render import kube
from gpucluster.render.kube import Manifest
from gpucluster.spec.model import PoolSpec, Stack

# The cluster's own node software, apart from the team's namespace (which enforces Pod Security's baseline: no
# privileged container, no hostPath). Pod Security's privileged level, said explicitly: the diagnostic needs it.
NAMESPACE = "gpucluster-system"
BURN_IN = "gpucluster-burn-in"
# NVIDIA's DCGM image (NVIDIA/DCGM docker/Dockerfile.ubuntu22.04: dcgmi and nv-hostengine on a CUDA base image with
# NVIDIA_VISIBLE_DEVICES=all), at the tag the GPU Operator v26.3.3 pins (deployments/gpu-operator/values.yaml, dcgm).
DCGM_IMAGE = "nvcr.io/nvidia/cloud-native/dcgm:4.5.2-1-ubuntu22.04"
# Level 1: the quick deployment checks (driver, libraries, persistence, retired pages), seconds not minutes. With no
# host engine to reach, dcgmi starts one embedded in itself (NVIDIA/DCGM v4.5.2 dcgmi/Diag.cpp,
# StartDiag::DoExecuteConnectionFailure), so the init container needs no daemon. Its standard output (the report, or
# its error message) goes to the report file whatever its exit code, its standard error to the container's log: the
# verdict reads the report, and a missing or broken one fails the node.
DCGM_COMMAND = "dcgmi diag -r 1 -j > {report}; exit 0"
PAUSE_IMAGE = "registry.k8s.io/pause:3.10"
RESULTS = "/burn-in"  # an emptyDir shared by the init containers
REPORT = f"{RESULTS}/dcgm.json"
# On EFA pools: what libfabric's EFA provider can open, listed by the EFA installer's fi_info in AWS's Deep Learning
# Container for the pool's kind (efa_info_image), whose build runs AWS's EFA installer, which puts libfabric and its
# tools under /opt/amazon/efa (the path AWS's EFA guides call it by). Pulling that image here also has it on the node
# for a first job of that image. Its listing and error message both go to the file: the verdict counts the RDM
# domains and fails the node on none (gpucluster/node/devices.py efa_rdm_domains).
# NVIDIA pools: kube.DLC_IMAGE (the DLC's install_efa_amzn2023.sh). Neuron pools: AWS's Neuron PyTorch training DLC,
# from aws-neuron/deep-learning-containers README.md (pytorch-training-neuronx, PyTorch 2.9.0, Neuron 2.27.1, trn1,
# trn2, trn3, inf2); its pytorch/training/2.9.0/Dockerfile.neuronx runs efa_installer.sh --skip-kmod. No CUDA image
# pulled onto a Neuron node only for fi_info.
NEURON_DLC_IMAGE = "public.ecr.aws/neuron/pytorch-training-neuronx:2.9.0-neuronx-py312-sdk2.27.1-ubuntu24.04"
FI_INFO_REPORT = f"{RESULTS}/fi_info.txt"
FI_INFO_COMMAND = "/opt/amazon/efa/bin/fi_info -p efa -t FI_EP_RDM > {report} 2>&1; exit 0"
HOST_DEV, HOST_INFINIBAND = "/host/dev", "/host/infiniband"
MOUNT = "/opt/burn-in"
PROGRAM = "gpucluster/node/burn_in.py"
FILES = kube.library_files(
    "gpucluster/__init__.py", "gpucluster/contract/__init__.py", "gpucluster/contract/node_health.py",
    "gpucluster/node/__init__.py", "gpucluster/node/devices.py", "gpucluster/node/kube_api.py", PROGRAM)
STARTUP_TAINT = {"key": node_health.STARTUP_TAINT, "value": "true", "effect": "NoSchedule"}


def unprivileged() -> dict[str, Any]:
    return {"runAsNonRoot": True, "runAsUser": 65534, "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}


def node_group_taints(pool: PoolSpec) -> list[dict[str, str]]:
    """The node group's taints: the pool's, and the burn-in's startup taint. Only the pool's go into the autoscaler's
    node template (a startup taint is gone by the time a pod could run there) and the Kueue flavours' tolerations."""
    return [*kube.pool_taints(pool), dict(STARTUP_TAINT)]


# What a node daemon that must run during and after a burn-in tolerates of it (the node monitoring agent's DCGM server).
BURN_IN_TOLERATIONS = [{"key": key, "operator": "Exists"} for key in (node_health.STARTUP_TAINT,
                                                                      node_health.FAILED_TAINT)]


def daemon_set_name(pool: PoolSpec) -> str:
    return f"{BURN_IN}-{pool.name}"


def expected(pool: PoolSpec) -> dict[str, int]:
    """What burn_in.py compares with (its environment): the catalog's counts for the pool's instance type."""
    kind, count = pool.accelerator.kind, pool.accelerator.count
    return {"EXPECTED_GPUS": count if kind == "nvidia" else 0,
            "EXPECTED_NEURON_DEVICES": count if kind == "neuron" else 0,
            "EXPECTED_EFA_DEVICES": pool.itype.efa_interfaces if pool.uses_efa else 0}


def efa_info_image(pool: PoolSpec, region: str) -> str:
    return kube.dlc_image(region) if pool.accelerator.kind == "nvidia" else NEURON_DLC_IMAGE


def _read_only_host(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "hostPath": {"path": path, "type": "Directory"}}


def replacement_env(pool: PoolSpec, region: str) -> dict[str, str]:
    """What the verdict needs to replace a failed node: the pool's name (its record), the bound (the Slurm flavour's
    health-replacement bound, the same figures), and boto3's hash-checked install into the writable /tmp."""
    return {"POOL": pool.name, "REPLACEMENTS": str(ClusterSettings.health_replacements),
            "REPLACEMENT_WINDOW_SECONDS": str(ClusterSettings.health_replacement_window_seconds),
            **kube.boto3_region(region), "BOTO3_INSTALL": kube.boto3_install(), "BOTO3_TARGET": kube.BOTO3_TARGET}


def daemon_set(pool: PoolSpec, region: str) -> Manifest:
    labels = {"app": BURN_IN, kube.POOL_LABEL: pool.name}
    nvidia = pool.accelerator.kind == "nvidia"
    env: list[dict[str, Any]] = [{"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
           {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
           *({"name": k, "value": str(v)} for k, v in expected(pool).items()),
           {"name": "DCGM_REPORT", "value": REPORT}, {"name": "FI_INFO_REPORT", "value": FI_INFO_REPORT},
           {"name": "DEV_DIR", "value": HOST_DEV},
           {"name": "INFINIBAND_DIR", "value": HOST_INFINIBAND},
           *({"name": k, "value": v} for k, v in replacement_env(pool, region).items())]
    program = kube.ship_program(BURN_IN, NAMESPACE, MOUNT, FILES)
    mounts: list[dict[str, Any]] = [program.volume_mount, {"name": "results", "mountPath": RESULTS},
                                    {"name": "tmp", "mountPath": "/tmp"}]
    volumes: list[dict[str, Any]] = [program.volume, {"name": "results", "emptyDir": {}},
                                     {"name": "tmp", "emptyDir": {}}]
    if not nvidia:  # the Neuron devices are counted by their nodes under /dev
        mounts.append({"name": "dev", "mountPath": HOST_DEV, "readOnly": True})
        volumes.append(_read_only_host("dev", "/dev"))
    if pool.uses_efa:
        mounts.append({"name": "infiniband", "mountPath": HOST_INFINIBAND, "readOnly": True})
        volumes.append(_read_only_host("infiniband", "/sys/class/infiniband"))
    init: list[dict[str, Any]] = []
    if nvidia:
        # All GPUs without the device plugin, as dcgm-exporter reaches them: the AL2023 NVIDIA AMI makes the NVIDIA
        # runtime containerd's default (awslabs/amazon-eks-ami nodeadm/internal/containerd/runtime_config_nvidia.go,
        # config2.template.toml default_runtime_name), which hands a container every GPU its NVIDIA_VISIBLE_DEVICES
        # names. Privileged, as the GPU Operator runs this image (assets/state-dcgm/0400_dcgm.yml).
        init.append({"name": "dcgm-diag", "image": DCGM_IMAGE,
                     "command": ["sh", "-c", DCGM_COMMAND.format(report=REPORT)],
                     "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}],
                     "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
                     "securityContext": {"privileged": True},
                     "volumeMounts": [{"name": "results", "mountPath": RESULTS}]})
    if pool.uses_efa:
        # Privileged for the EFA devices (/dev/infiniband) without asking the EFA device plugin for them (held for the
        # pod's life); the DLC's entrypoint is replaced by the command.
        init.append({"name": "efa-info", "image": efa_info_image(pool, region),
                     "command": ["sh", "-c", FI_INFO_COMMAND.format(report=FI_INFO_REPORT)],
                     "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}},
                     "securityContext": {"privileged": True},
                     "volumeMounts": [{"name": "results", "mountPath": RESULTS}]})
    init.append({"name": "verdict", "image": kube.GUARDRAIL_IMAGE, "command": ["python", f"{MOUNT}/{PROGRAM}"],
                 "env": env,
                 "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "128Mi"}},
                 "securityContext": unprivileged() | {"readOnlyRootFilesystem": True},
                 "volumeMounts": mounts})
    return {"apiVersion": "apps/v1", "kind": "DaemonSet",
            "metadata": {"name": daemon_set_name(pool), "namespace": NAMESPACE, "labels": labels},
            "spec": {"selector": {"matchLabels": labels}, "template": {"metadata": {"labels": labels}, "spec": {
                "serviceAccountName": BURN_IN,
                # The pool's nodes that have no verdict yet: the verdict's label ends the pod there.
                "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                    {"matchExpressions": [
                        {"key": kube.POOL_LABEL, "operator": "In", "values": [pool.name]},
                        {"key": node_health.RESULT_LABEL, "operator": "DoesNotExist"}]}]}}},
                "tolerations": [{"key": t["key"], "operator": "Exists", "effect": t["effect"]}
                                for t in node_group_taints(pool)],
                "initContainers": init,
                # Requests nothing: it only holds the pod until the DaemonSet controller removes it.
                "containers": [{"name": "pause", "image": PAUSE_IMAGE,
                                "securityContext": unprivileged()}],
                "volumes": volumes}}}}


def burn_in_manifests(stack: Stack) -> list[Manifest]:
    """The namespace, the verdict's identity (may read and patch Nodes, and its replacements' record, nothing else;
    its AWS rights come through a Pod Identity association: components/kubernetes.py), the program, the record (its
    data is the verdict's: declared without any, so that `up` leaves it alone) and a DaemonSet per pool. The
    namespace comes first: components/kubernetes.py declares the rest after it."""
    return [
        {"apiVersion": "v1", "kind": "Namespace",
         "metadata": {"name": NAMESPACE, "labels": {"pod-security.kubernetes.io/enforce": "privileged"}}},
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": BURN_IN, "namespace": NAMESPACE}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": BURN_IN},
         "rules": [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": BURN_IN},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": BURN_IN},
         "subjects": [{"kind": "ServiceAccount", "name": BURN_IN, "namespace": NAMESPACE}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": {"name": BURN_IN, "namespace": NAMESPACE},
         "rules": [{"apiGroups": [""], "resources": ["configmaps"],
                    "resourceNames": [node_health.REPLACEMENTS_CONFIG_MAP], "verbs": ["get", "patch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": BURN_IN, "namespace": NAMESPACE},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": BURN_IN},
         "subjects": [{"kind": "ServiceAccount", "name": BURN_IN, "namespace": NAMESPACE}]},
        kube.ship_program(BURN_IN, NAMESPACE, MOUNT, FILES).config_map,
        {"apiVersion": "v1", "kind": "ConfigMap",
         "metadata": {"name": node_health.REPLACEMENTS_CONFIG_MAP, "namespace": NAMESPACE}},
        *(daemon_set(pool, stack.region) for pool in stack.spec.pools),
    ]
