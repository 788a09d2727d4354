"""Facts about Amazon EKS that the Kubernetes flavour relies on: versions, add-ons, node AMIs, chart pins, prices.

Versions and their end of standard support are EKS's published calendar (docs.aws.amazon.com/eks/latest/userguide/
kubernetes-versions.html, as mirrored by endoflife.date/amazon-eks), recorded 2026-11-30; `preflight` asks EKS
(DescribeClusterVersions, DescribeAddonVersions, the AMI's SSM parameter) whether they still hold in the region.
"""

from __future__ import annotations

from dataclasses import dataclass

# Kubernetes versions EKS offers, and the end of their standard support (EKS then bills extended support, 6x).
STANDARD_SUPPORT_ENDS = {"1.34": "2026-12-02", "1.35": "2027-03-27"}
VERSIONS = tuple(STANDARD_SUPPORT_ENDS)
DEFAULT_VERSION = "1.35"

# The cluster's hourly fee under standard support (EKS pricing page, us-east-1); extended support is $0.60.
CONTROL_PLANE_USD_PER_HOUR = 0.10

# Kubernetes' own pods (CoreDNS, the autoscaler, Kueue, Prometheus, the guardrail) need nodes that are not tainted
# accelerator nodes and that stay while the pools are at zero: a small on-demand system node group.
SYSTEM_INSTANCE_TYPE = "m7i.xlarge"
SYSTEM_NODES = 2
# The team's CPU-only work (data preparation, evaluation, notebooks) gets its own small on-demand node group from zero
# (kubernetes.cpu_nodes), so that it never starts an accelerator node.
CPU_INSTANCE_TYPE = "m7i.2xlarge"
CPU_MAX_NODES = 4

# Managed node groups' AMI types for EKS's accelerated Amazon Linux 2023 images, by accelerator kind. EKS picks the
# image of the cluster's version and writes the node's bootstrap (nodeadm) itself.
AMI_TYPES = {"nvidia": "AL2023_x86_64_NVIDIA", "neuron": "AL2023_x86_64_NEURON"}
# AL2023's root device (the DLAMIs of the Slurm flavour use /dev/sda1).
ROOT_DEVICE = "/dev/xvda"


def ami_parameter(version: str, kind: str) -> str:
    """The public SSM parameter naming the recommended accelerated AL2023 AMI of a version (what preflight reads)."""
    return f"/aws/service/eks/optimized-ami/{version}/amazon-linux-2023/x86_64/{kind}/recommended/image_id"


# EKS managed add-ons every cluster gets. Versions are left to EKS's default for the cluster's version (resolved at
# create and kept until changed); `preflight` lists what the region offers for the version.
ADDONS = (
    "vpc-cni",
    "coredns",
    "kube-proxy",
    "eks-pod-identity-agent",
    "aws-fsx-csi-driver",
    "eks-node-monitoring-agent",
)
# Node daemons: a node is Ready only with the CNI (and kube-proxy), and Pod Identity works only with its agent, so
# these come before the first node group. The others run pods (CoreDNS, the CSI controller) and so after it.
NODE_ADDONS = ("vpc-cni", "kube-proxy", "eks-pod-identity-agent")


@dataclass(frozen=True)
class Chart:
    """A Helm chart pinned by repository, name and version."""

    name: str
    repository: str  # an HTTPS chart repository, or "" for an OCI reference in `name`
    version: str
    namespace: str


# Third-party software, pinned. A new pin is a reviewed change like any other. Versions as each project's chart
# source declares them (Chart.yaml), read 2026-11-30: kubernetes/autoscaler cluster-autoscaler/charts (9.59.0, app
# 1.35.0), NVIDIA/k8s-device-plugin deployments/helm (0.20.0), aws/eks-charts stable/aws-efa-k8s-device-plugin
# (v0.5.30), kubernetes-sigs/kueue tag v0.19.2, prometheus-community/helm-charts (88.5.3, operator 0.93.1),
# NVIDIA/dcgm-exporter deployment (4.8.2); AWS's Neuron chart (aws-neuron/neuron-helm-charts, 1.10.0 as
# `helm pull oci://public.ecr.aws/neuron/neuron-helm-chart` lists it; values keys devicePlugin/npd/scheduler/draDriver/
# ultraserverOperator as its values.yaml names them).
CLUSTER_AUTOSCALER = Chart("cluster-autoscaler", "https://kubernetes.github.io/autoscaler", "9.59.0", "kube-system")
NVIDIA_DEVICE_PLUGIN = Chart("nvidia-device-plugin", "https://nvidia.github.io/k8s-device-plugin", "0.20.0",
                             "kube-system")
EFA_DEVICE_PLUGIN = Chart("aws-efa-k8s-device-plugin", "https://aws.github.io/eks-charts", "v0.5.30", "kube-system")
# The Neuron device plugin (advertises aws.amazon.com/neuron); the chart's other parts are switched off in its values.
NEURON_DEVICE_PLUGIN = Chart("oci://public.ecr.aws/neuron/neuron-helm-chart", "", "1.10.0", "kube-system")
# Kueue publishes its chart as an OCI artifact only.
KUEUE = Chart("oci://registry.k8s.io/kueue/charts/kueue", "", "0.19.2", "kueue-system")
KUBE_PROMETHEUS_STACK = Chart("kube-prometheus-stack", "https://prometheus-community.github.io/helm-charts", "88.5.3",
                              "monitoring")
DCGM_EXPORTER = Chart("dcgm-exporter", "https://nvidia.github.io/dcgm-exporter/helm-charts", "4.8.2", "monitoring")

# The Kubernetes resource names of the extended resources the device plugins advertise.
GPU_RESOURCE = "nvidia.com/gpu"
NEURON_RESOURCE = "aws.amazon.com/neuron"
# The Neuron device plugin advertises a node's NeuronCores too; the queues count whole devices only (NEURON_RESOURCE),
# so a pod asking for cores is refused on the accelerator queue with a message that says so (kube.gpu_queue_policies).
NEURONCORE_RESOURCE = "aws.amazon.com/neuroncore"
EFA_RESOURCE = "vpc.amazonaws.com/efa"

# 2 MiB huge pages on EFA nodes. The accelerated AL2023 AMIs run the EFA installer (amazon-eks-ami
# templates/al2023/provisioners/install-efa.sh: `efa_installer.sh --minimal`, enable_efa defaults to true), and "Amazon
# EC2 instances with the EFA driver installed pre-allocate 5128 2MiB Huge Pages" (EKS User Guide, ml/node-efa.adoc,
# awsdocs/amazon-eks-user-guide 4d52b4d); the kubelet advertises them as hugepages-2Mi. libfabric's EFA provider
# takes its buffers from them, so an EFA pod requests them: the guide's NCCL job asks for 5120Mi per pod.
HUGEPAGES_RESOURCE = "hugepages-2Mi"
EFA_NODE_HUGEPAGES = 5128  # pages of 2 MiB per node
EFA_POD_HUGEPAGES_MIB = 5120  # what one EFA pod requests (the guide's figure), in MiB
