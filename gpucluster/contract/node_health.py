"""The Kubernetes flavour's burn-in marks on a Node: what the node groups start with (components/kubernetes.py), what
the burn-in DaemonSet tolerates (gpucluster/render/kube_health.py) and what its program sets (gpucluster/node/
burn_in.py). Standard library only: the program imports this file in its pod.
"""

from __future__ import annotations

# Every accelerator node starts with this taint, so that no job lands on it before its burn-in passes. The Cluster
# Autoscaler knows the prefix: it counts such a node as starting (not ready) rather than as room for pending pods, and
# leaves the taint out of the template of a new node (kubernetes/autoscaler cluster-autoscaler/utils/taints/taints.go:
# StartupTaintPrefix, IsStartupTaint, FilterOutNodesWithStartupTaints, SanitizeTaints). EKS takes taint keys of at most
# 63 characters (its Taint shape), the prefix included.
STARTUP_TAINT = "startup-taint.cluster-autoscaler.kubernetes.io/burn-in"
# A failed node's taint, in place of the startup taint: its value names the check that failed. Its prefix is the
# autoscaler's status-taint one (taints.go StatusTaintPrefix): kept out of the template it builds from a ready node of
# the group and caches for good (a failed first node would otherwise leave its taint on every node the group is
# thought to make, and the group would never scale up from zero again), yet not counted as unready: the autoscaler
# sees a ready node nothing can use and removes it as unneeded (its scale-down eligibility checks no taints).
FAILED_TAINT = "status-taint.cluster-autoscaler.kubernetes.io/burn-in-failed"
RESULT_LABEL = "gpucluster/burn-in"  # passed | failed: the node's burn-in is decided and is not run again
PASSED, FAILED = "passed", "failed"
REASON_ANNOTATION = "gpucluster/burn-in-reason"  # what failed, in words (a label value cannot hold them)

# A failed node is terminated through its Auto Scaling group so that the group launches a replacement (the autoscaler
# keeps a group at its minimum without looking at taints, and node auto repair does not read ours). At most
# REPLACEMENTS per pool within the window, as the Slurm flavour's reconciler bounds its health replacements
# (settings.ClusterSettings.health_replacements): a fault that follows fresh instances is not theirs. The record of
# each pool's replacements lives in this ConfigMap of the burn-in's namespace (the node itself goes with its instance).
REPLACEMENTS_CONFIG_MAP = "gpucluster-burn-in-replacements"
REPLACEMENT_ANNOTATION = "gpucluster/burn-in-replacement"  # what became of the failed node's instance, in words
