"""The Pulumi program: read the stack's spec, build the cluster, export its outputs."""

import pulumi

from components.cluster import create_cluster
from gpucluster.project import EXAMPLES_DIR
from gpucluster.spec.model import stack_from_pulumi_config

for key, value in create_cluster(stack_from_pulumi_config(), EXAMPLES_DIR).items():
    pulumi.export(key, value)
