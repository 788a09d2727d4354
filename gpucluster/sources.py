"""Where the files the library ships to nodes are: in a checkout of the repository, beside the library; on the head
node, in the bundle's lib/, which mirrors that layout for what the library reads (see bundle.contents)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NODE_DIR = ROOT / "cloud-init"  # what runs on the nodes
EXAMPLES_DIR = ROOT / "examples"
STACKS_DIR = ROOT / "stacks"
PROGRAM = ROOT / "__main__.py"  # the Pulumi program: only in a checkout, with components/


def node_file(name: str) -> bytes:
    return (NODE_DIR / name).read_bytes()
