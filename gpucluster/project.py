"""Where the project's own files are: in a checkout, the repository around the library; on the head node, the bundle's
lib/, which mirrors it for what the command line reads (the stack's file). Only the top (cli, plan, the Pulumi program)
imports this; the layers below are handed paths."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES_DIR = ROOT / "examples"
STACKS_DIR = ROOT / "stacks"
PROGRAM = ROOT / "__main__.py"  # the Pulumi program: only in a checkout, with components/


def pulumi_program() -> Callable[[], None]:
    """The checkout's Pulumi program as Pulumi's Python host runs it (`__main__.py` as __main__, the checkout on the
    path for components/): what `plan` hands to the mock runtime."""

    def run() -> None:
        if str(ROOT) not in sys.path:
            sys.path.insert(0, str(ROOT))
        runpy.run_path(str(PROGRAM), run_name="__main__")

    return run
