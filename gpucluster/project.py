"""Where the command line finds what is not the library: stack files, the Pulumi program, the first-job examples.
The library never reaches up into a checkout for them: a stack is a path, or a bare name looked up under ./stacks and
then $GPUCLUSTER_STACKS (the head node's wrapper points it at the bundle's stacks); the program's components are a
package installed beside gpucluster (pyproject.toml); the examples are the package's data when installed, the
checkout's examples/ otherwise. Only the top (cli, plan, the Pulumi program) imports this; the layers below are handed
paths."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

PACKAGE_DIR = Path(__file__).resolve().parent
# pyproject.toml installs the checkout's examples/ as the package's examples/; in a checkout (or `pip install -e .`,
# or the head's bundle) they are beside the package, where the wheel's copy is not.
_INSTALLED_EXAMPLES = PACKAGE_DIR / "examples"
EXAMPLES_DIR = _INSTALLED_EXAMPLES if _INSTALLED_EXAMPLES.is_dir() else PACKAGE_DIR.parent / "examples"
STACKS_DIR = Path("stacks")  # relative: the current directory's
STACKS_ENV = "GPUCLUSTER_STACKS"
STACK_HELP = f"a path to a stack file, or a stack name: ./stacks/Pulumi.NAME.yaml, else ${STACKS_ENV}/Pulumi.NAME.yaml"


def stack_dirs() -> list[Path]:
    """Where a bare stack name is looked up, in order."""
    extra = os.environ.get(STACKS_ENV)
    return [STACKS_DIR, *([Path(extra)] if extra else [])]


def is_stack_path(stack: str) -> bool:
    return Path(stack).suffix in (".yaml", ".yml") or "/" in stack


class StackNotFound(LookupError):
    """A bare stack name that is in none of stack_dirs()."""


def looked_in() -> str:
    """Where bare stack names are looked up, as a message says it (and that $GPUCLUSTER_STACKS is unset, if it is)."""
    places = " or ".join(str(directory) for directory in stack_dirs())
    return places if os.environ.get(STACKS_ENV) else f"{places} (${STACKS_ENV} is not set)"


def find_stack(stack: str) -> Path:
    """STACK as the command line takes it (STACK_HELP): a path as given (the stack's loader says if it is missing),
    or the first file of a bare name in stack_dirs(); StackNotFound when there is none."""
    if is_stack_path(stack):
        return Path(stack)
    found = next((path for directory in stack_dirs() if (path := directory / f"Pulumi.{stack}.yaml").exists()), None)
    if found is None:
        raise StackNotFound(f"no such stack file: Pulumi.{stack}.yaml is not in {looked_in()}")
    return found


def has_program() -> bool:
    """The Pulumi program and what it needs (components, Pulumi's SDK) are installed: a checkout's venv or `pip
    install`, not the head node's bundle and venv."""
    try:
        import components.program  # noqa: F401
    except ImportError:
        return False
    return True


def pulumi_program() -> Callable[[], None]:
    """The Pulumi program (components.program) as Pulumi's Python host runs it through __main__.py: what `plan`
    hands to the mock runtime."""

    def run() -> None:
        from components.program import main

        main(EXAMPLES_DIR)

    return run
