"""The Pulumi program's entry, as Pulumi's Python host runs it (Pulumi.yaml): components.program."""

from components.program import main
from gpucluster.project import EXAMPLES_DIR

main(EXAMPLES_DIR)
