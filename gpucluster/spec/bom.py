"""The node image's bill of materials: every version a node runs, named once. The image bake installs exactly this
(gpucluster/node/build_image.sh reads the rendered bom.json) and the tests run the same Slurm (tests/local_cluster.py).
"""

from __future__ import annotations

# Slurm, built into the image from SchedMD's release tag, and Debian 13's package of the same release in the tests.
SLURM_VERSION = "24.11.5"
