"""The whole cluster for one stack, as `__main__.py` and `gpucluster plan` run it: the stack's scheduler picks the
flavour (components/slurm_cluster.py or components/kubernetes_cluster.py), which declares every resource."""

from __future__ import annotations

from pathlib import Path

from components.kubernetes_cluster import create_kubernetes_cluster
from components.slurm_cluster import create_slurm_cluster
from gpucluster.spec.model import Stack


def create_cluster(stack: Stack, examples_dir: Path) -> dict[str, object]:
    """Declare every resource of the stack and return the stack outputs. `examples_dir`: the first-job files the Slurm
    head copies to the shared file system."""
    if stack.spec.scheduler == "kubernetes":
        return create_kubernetes_cluster(stack)
    return create_slurm_cluster(stack, examples_dir)
