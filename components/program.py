"""The Pulumi program: read the stack's spec, build the cluster, export its outputs. Pulumi's Python host runs it
through the checkout's __main__.py; `gpucluster plan` runs it under the mock runtime, installed or not."""

from pathlib import Path

import pulumi

from components.cluster import create_cluster
from gpucluster.spec.model import stack_from_pulumi_config


def main(examples_dir: Path) -> None:
    for key, value in create_cluster(stack_from_pulumi_config(), examples_dir).items():
        pulumi.export(key, value)
