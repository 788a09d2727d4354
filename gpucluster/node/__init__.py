"""The node programs: what runs on the head and compute nodes (and the EKS guardrail's pod), in the system Python with
the standard library and boto3, importing only the contract and the modules of this package they share. The Pulumi
side reads these files as data (`source`) to ship them; it never imports a program."""

from __future__ import annotations

import logging
from pathlib import Path

NODE_DIR = Path(__file__).resolve().parent
LIBRARY_DIR = NODE_DIR.parent.parent  # what holds the gpucluster package: the checkout, or the bundle's lib/ on a node

# The one logger of the programs that manage nodes and of the modules they share: one story in the node log.
log = logging.getLogger("gpucluster-node")


def source(name: str) -> bytes:
    """The bytes of a node program or script, as they are shipped."""
    return (NODE_DIR / name).read_bytes()
