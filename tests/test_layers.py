"""The library's layers, read from its import graph: every import of every module of gpucluster/ and components/ and
of the Pulumi program (__main__.py), at module level or inside a function, against the rule of the layout:

- contract imports only contract and the standard library (it runs on the nodes);
- node (the node programs) imports contract and node, the standard library, boto3 and botocore;
- spec imports contract and spec; render imports contract, spec, render and gpucluster.node (the programs as bytes,
  never a program itself); aws imports contract, spec, aws and cli_errors (the command line's exit-code convention,
  which imports nothing of the library);
- components import anything in gpucluster but cli, plan, plan_diff and project;
- only cli, plan and the entry points (python -m gpucluster, the Pulumi program) import project, which runs the
  program (components) for plan; plan_diff is handed the planning function."""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import ROOT

# Layer -> the layers it may import. "node source" is gpucluster/node/__init__.py: it reads the programs as data.
BELOW_THE_TOP: dict[str, set[str]] = {
    "contract": {"contract"},
    "node": {"contract", "node", "node source"},
    "node source": set(),
    "spec": {"contract", "spec"},
    "render": {"contract", "spec", "render", "node source"},
    "aws": {"contract", "spec", "aws", "cli_errors"},
    "cli_errors": set(),
    "completion": set(),  # the shell completion script, from the parser it is handed
    "project": {"components"},  # plan's Pulumi program, imported when run
    "package": set(),  # gpucluster/__init__.py
    "components": {"contract", "node", "node source", "spec", "render", "aws", "components", "package"},
}
TOP = ("cli", "plan", "plan_diff", "entry point")  # they may import anything of the library
MAY_IMPORT = BELOW_THE_TOP | {top: {*BELOW_THE_TOP, *TOP} for top in TOP}
# What a layer may import from outside the library (the other layers: whatever is installed).
STANDARD_LIBRARY = frozenset(sys.stdlib_module_names)
OUTSIDE = {
    "contract": (STANDARD_LIBRARY, "the standard library"),
    "node": (STANDARD_LIBRARY | {"boto3", "botocore"}, "the standard library, boto3 and botocore"),
}


@dataclass(frozen=True)
class Import:
    line: int
    module: str  # resolved: `from gpucluster.spec import catalog` imports gpucluster.spec.catalog


def module_name(path: str) -> str:
    """gpucluster/spec/model.py -> gpucluster.spec.model; a package's __init__.py is the package."""
    parts = path.removesuffix(".py").split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> str | None:
    """The layer of a module of the library; None for a module outside it."""
    parts = module.split(".")
    if parts == ["__main__"] or parts == ["gpucluster", "__main__"]:
        return "entry point"
    if parts[0] == "components":
        return "components"
    if parts[0] != "gpucluster":
        return None
    if len(parts) == 1:
        return "package"
    if parts[1] == "node":
        return "node source" if len(parts) == 2 else "node"
    if parts[1] in ("contract", "spec", "render", "aws", "cli", "cli_errors", "completion", "plan", "plan_diff",
                    "project"):
        return parts[1]
    raise AssertionError(f"{module} is in no layer: place it in the rule of tests/{Path(__file__).name}")


def imports(path: str, source: str, tree: set[str]) -> list[Import]:
    """Every import in a module's source, resolved against the modules of `tree` (paths)."""
    known = {module_name(p) for p in tree}
    package = module_name(path).split(".")
    if not path.endswith("__init__.py"):
        package = package[:-1]
    found = []
    for node in ast.walk(ast.parse(source, path)):
        if isinstance(node, ast.Import):
            found += [Import(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join([*package[:len(package) + 1 - node.level], *([node.module] if node.module else [])]) \
                if node.level else node.module or ""
            found += [Import(node.lineno, f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
                      for alias in node.names]
    return found


def violations(files: dict[str, str], rest_of_tree: Iterable[str] = ()) -> list[str]:
    """What breaks the rule in `files` (path in the checkout -> source), one message per import."""
    tree = set(files) | set(rest_of_tree)
    found = []
    for path, source in sorted(files.items()):
        layer = layer_of(module_name(path))
        assert layer is not None, f"{path} is not in the library"
        for imported in imports(path, source, tree):
            target = layer_of(imported.module)
            if target is None and layer in OUTSIDE:
                allowed, said = OUTSIDE[layer]
                if imported.module.split(".")[0] not in allowed:
                    found.append(f"{path}:{imported.line}: {layer} imports {imported.module}, from outside the "
                                 f"library: {layer} may import only {said}")
            elif target is not None and target not in MAY_IMPORT[layer]:
                may = ", ".join(sorted(MAY_IMPORT[layer])) or "nothing of the library"
                found.append(f"{path}:{imported.line}: {layer} imports {imported.module} ({target}); "
                             f"{layer} may import {may}")
    return found


def library_files() -> dict[str, str]:
    paths = [p for top in ("gpucluster", "components") for p in (ROOT / top).rglob("*.py")
             if "__pycache__" not in p.parts]
    return {p.relative_to(ROOT).as_posix(): p.read_text() for p in [*paths, ROOT / "__main__.py"]}


LIBRARY = library_files()


def test_every_import_of_the_library_keeps_to_its_layer() -> None:
    found = violations(LIBRARY)
    assert not found, "imports across the layers:\n" + "\n".join(found)


def test_the_library_is_all_in_layers() -> None:
    """Every module has a layer and every layer of the rule has modules: the check above reads the right tree."""
    assert {layer_of(module_name(path)) for path in LIBRARY} == set(MAY_IMPORT)


@pytest.mark.parametrize(("path", "source", "expected"), [
    ("gpucluster/spec/bad.py", "def f():\n    from gpucluster.render import slurm\n",
     "gpucluster/spec/bad.py:2: spec imports gpucluster.render.slurm (render); spec may import contract, spec"),
    ("gpucluster/render/bad.py", "from gpucluster.node import resume\n",
     "gpucluster/render/bad.py:1: render imports gpucluster.node.resume (node)"),
    ("gpucluster/aws/bad.py", "from ..render import kube\n",
     "gpucluster/aws/bad.py:1: aws imports gpucluster.render.kube (render)"),
    ("components/bad.py", "import gpucluster.project\n",
     "components/bad.py:1: components imports gpucluster.project (project)"),
    ("gpucluster/spec/bad.py", "from gpucluster import cli\n",
     "gpucluster/spec/bad.py:1: spec imports gpucluster.cli (cli)"),
    ("gpucluster/contract/bad.py", "import yaml\n",
     "gpucluster/contract/bad.py:1: contract imports yaml, from outside the library: contract may import only the "
     "standard library"),
    ("gpucluster/node/bad.py", "import pulumi\n",
     "gpucluster/node/bad.py:1: node imports pulumi, from outside the library: node may import only the standard "
     "library, boto3 and botocore"),
    ("gpucluster/node/bad.py", "from gpucluster.spec import catalog\n",
     "gpucluster/node/bad.py:1: node imports gpucluster.spec.catalog (spec)"),
])
def test_an_import_across_the_layers_is_named(path: str, source: str, expected: str) -> None:
    (found,) = violations({path: source}, LIBRARY)
    assert found.startswith(expected), found


@pytest.mark.parametrize(("path", "source"), [
    ("gpucluster/render/fine.py", "from gpucluster.node import source\nfrom gpucluster import node\n"),
    ("gpucluster/node/fine.py", "import json\nimport boto3\nfrom gpucluster.node.slurm_control import SlurmControl\n"
                                "from gpucluster.contract.settings import ClusterSettings\n"),
    ("gpucluster/cli.py", "from gpucluster import project\n"),
])
def test_what_the_layers_allow_passes(path: str, source: str) -> None:
    assert violations({path: source}, LIBRARY) == []


def test_a_module_in_no_layer_is_refused() -> None:
    with pytest.raises(AssertionError, match="gpucluster.helpers is in no layer"):
        violations({"gpucluster/helpers.py": ""}, LIBRARY)
