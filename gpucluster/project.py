"""Where the project's own files are: in a checkout, the repository around the library; on the head node, the bundle's
lib/, which mirrors it for what the command line reads (the stack's file). Only the top (cli, plan, the Pulumi program)
imports this; the layers below are handed paths."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES_DIR = ROOT / "examples"
STACKS_DIR = ROOT / "stacks"
PROGRAM = ROOT / "__main__.py"  # the Pulumi program: only in a checkout, with components/
