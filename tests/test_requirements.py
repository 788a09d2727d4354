"""The runtime requirements cover what the runtime imports: every third-party module that gpucluster/, components/
and the Pulumi program's entry (__main__.py) import, anywhere in a module (a function's own import runs too), comes
from a distribution named in requirements.txt, which is all `make plan`'s runtime-only venv and `pip install .`
install (pyproject.toml reads its dependencies from it). A distribution that arrives only as another one's dependency
is not counted: its maintainers may drop it. The node programs' own rule (gpucluster/contract: the standard library
only; gpucluster/node: that and boto3, which the image carries) is tests/test_layers.py's."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from collections.abc import Mapping

from conftest import ROOT
from test_layers import LIBRARY

FIRST_PARTY = {"gpucluster", "components"}


def normalized(distribution: str) -> str:
    """A distribution's name as the packaging specs compare names (PEP 503)."""
    return re.sub(r"[-_.]+", "-", distribution).lower()


def required(text: str) -> set[str]:
    """The distributions a requirements file names (its lines' names, before any version, extra or marker)."""
    names = set()
    for line in filter(None, (line.split("#", 1)[0].strip() for line in text.splitlines())):
        name = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", line)
        assert name, f"{line!r}: no distribution's name (an option such as -r is not read here)"
        names.add(normalized(name[0]))
    return names


def third_party_imports(files: dict[str, str]) -> dict[str, set[str]]:
    """Top-level name of each import from outside the library and the standard library -> the files importing it."""
    found: dict[str, set[str]] = {}
    for path, source in files.items():
        for node in ast.walk(ast.parse(source, path)):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for top in {name.split(".")[0] for name in names} - FIRST_PARTY - sys.stdlib_module_names:
                found.setdefault(top, set()).add(path)
    return found


def missing(files: dict[str, str], requirements: set[str],
            providers: Mapping[str, list[str]]) -> list[str]:
    """One line per imported module whose distribution is not a requirement (or that nothing installed provides)."""
    problems = []
    for name, paths in sorted(third_party_imports(files).items()):
        where = ", ".join(sorted(paths))
        distributions = {normalized(d) for d in providers.get(name, [])}
        if not distributions:
            problems.append(f"{name} (imported by {where}) is provided by no installed distribution")
        elif not distributions & requirements:
            problems.append(f"{name} (imported by {where}) comes from {', '.join(sorted(distributions))}, which "
                            "requirements.txt does not name")
    return problems


def test_every_runtime_import_comes_from_a_requirement() -> None:
    requirements = required((ROOT / "requirements.txt").read_text())
    providers = importlib.metadata.packages_distributions()
    assert third_party_imports(LIBRARY), "no third-party import found: the walk reads the wrong files"
    problems = missing(LIBRARY, requirements, providers)
    assert not problems, "\n".join(problems)


def test_an_import_outside_the_requirements_is_found() -> None:
    """The check itself: a test tool imported by the library, in a function or at the top, and a module no
    distribution provides, each named with the file; relative and standard-library imports are not counted."""
    files = {"gpucluster/aws/bad.py": "import json\nfrom . import spend\ndef f():\n    from moto import mock_aws\n",
             "components/bad.py": "import pulumi\nimport no_such_module.sub\n"}
    providers = {"moto": ["moto"], "pulumi": ["pulumi"]}
    assert missing(files, {"pulumi"}, providers) == [
        "moto (imported by gpucluster/aws/bad.py) comes from moto, which requirements.txt does not name",
        "no_such_module (imported by components/bad.py) is provided by no installed distribution"]
    assert required("# a comment\nPyYAML>=6.0\ngrafana-foundation-sdk==1!11.6.0  # why\npulumi_aws[x]>=7\n") == \
        {"pyyaml", "grafana-foundation-sdk", "pulumi-aws"}
