"""The node programs: what runs on the head and compute nodes (and the EKS guardrail's pod), in the system Python with
the standard library and boto3, importing only the contract. The library reads these files as data (`source`) to ship
them; it never imports a program."""

from __future__ import annotations

from pathlib import Path

NODE_DIR = Path(__file__).resolve().parent


def source(name: str) -> bytes:
    """The bytes of a node program or script, as they are shipped."""
    return (NODE_DIR / name).read_bytes()
