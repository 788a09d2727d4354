"""The rehearsal's node image: a Debian 13 (trixie) root file system built from Debian's packages by mmdebstrap
(`make rehearsal-rootfs`), with the Slurm release the node image runs (gpucluster.spec.bom.SLURM_VERSION). Every
rehearsal node's root is an overlay over it (tests/local_cluster.py); it is also an apt-capable Debian root.

REHEARSAL_ROOTFS is where it is (GPUCLUSTER_REHEARSAL_ROOTFS overrides it; the Makefile reads the default from here:
`python3 tests/rehearsal_image.py`). PACKAGES lists what it is built from; the build leaves a copy of that list in
the tree, so a changed list is a stale image (`stale`). Standard library only: the Makefile runs it with python3.
"""

from __future__ import annotations

import os
from pathlib import Path

REHEARSAL_ROOTFS = Path(os.environ.get("GPUCLUSTER_REHEARSAL_ROOTFS", "/var/cache/gpucluster/rehearsal-rootfs"))
PACKAGES = Path(__file__).resolve().parent / "rehearsal" / "image-packages"
STAMP = ".gpucluster-image-packages"  # in the tree: the package list it was built from


def stale(root: Path = REHEARSAL_ROOTFS) -> str:
    """Why the image cannot be used as it is ("" when it can)."""
    stamp = root / STAMP
    if not stamp.exists():
        return f"no rehearsal image at {root} (make rehearsal-rootfs builds it)"
    if stamp.read_bytes() != PACKAGES.read_bytes():
        return f"the rehearsal image at {root} was built from another package list (make rehearsal-rootfs)"
    return ""


def python_version(root: Path = REHEARSAL_ROOTFS) -> str:
    """The image's python3, as its dist-packages directory names it ("python3.13")."""
    return os.readlink(root / "usr" / "bin" / "python3")


if __name__ == "__main__":
    print(REHEARSAL_ROOTFS)
