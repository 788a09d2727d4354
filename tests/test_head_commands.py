"""The `gpucluster` command on the head node runs from the unpacked bundle (lib/ on PYTHONPATH, as the wrapper that
bootstrap.command_line writes, without Pulumi, which the head's venv lacks): `render` works there and gives what the
repository gives, `plan` says it needs a checkout; and a compute node's part of the library imports with the system
python3 alone."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

import standard_library
from conftest import STACK_FILES
from gpucluster.contract import settings
from gpucluster.project import EXAMPLES_DIR
from gpucluster.render import bundle, dashboards, prometheus, slurm, userdata
from gpucluster.spec import bom
from gpucluster.spec.model import load_stack

SYSTEM_PYTHON = "/usr/bin/python3"  # what runs the node programs: no pydantic, no venv


def unpack(stack_path: Path, target: Path) -> Path:
    """The bundle as fetch_bundle.py leaves it in /opt/gpucluster."""
    import gzip

    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(bundle.build(load_stack(stack_path), EXAMPLES_DIR)))) as tar:
        tar.extractall(target, filter="data")
    return target


# The head image's venv holds pydantic over the system's PyYAML and boto3 (build_image.sh): not Pulumi, not moto.
NOT_ON_THE_HEAD = ("pulumi", "pulumi_aws", "moto", "components")
BLOCK = f"""
import runpy, sys
class NotOnTheHead:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {NOT_ON_THE_HEAD!r}:
            raise ImportError(f"{{name}} is not on the head node")
sys.meta_path.insert(0, NotOnTheHead())
"""


def head_command(root: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`python ARGS` as /usr/local/bin/gpucluster runs it: the library from the bundle, nothing from here, and none
    of the packages the head's venv lacks. `-m MODULE ...` and `-c CODE` as python takes them."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")} | {
        "PYTHONPATH": str(root / "lib"), "GPUCLUSTER_STACKS": str(root / "lib" / "stacks")}
    if args[0] == "-m":
        code = BLOCK + f"sys.argv = [{args[1]!r}, *sys.argv[1:]]\nrunpy.run_module({args[1]!r}, run_name='__main__')\n"
        args = ("-c", code, *args[2:])
    else:
        args = ("-c", BLOCK + args[1], *args[2:])
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("path", STACK_FILES, ids=lambda p: p.name)
def test_render_from_the_bundle_gives_the_repositorys_files(path: Path, tmp_path: Path) -> None:
    root, elsewhere = unpack(path, tmp_path / "opt"), tmp_path / "home"
    elsewhere.mkdir()
    stack = load_stack(path)
    which = head_command(root, "-c", "import gpucluster; print(gpucluster.__file__)", cwd=elsewhere)
    assert which.stdout.strip() == str(root / "lib" / "gpucluster" / "__init__.py"), which.stderr
    assert "pulumi is not on the head node" in head_command(root, "-c", "import pulumi", cwd=elsewhere).stderr

    done = head_command(root, "-m", "gpucluster", "render", stack.name, "--out", str(tmp_path / "out"), cwd=elsewhere)
    assert done.returncode == 0, done.stderr
    out = tmp_path / "out"
    written = {str(p.relative_to(out)): p.read_text() for p in out.rglob("*") if p.is_file()}
    expected = userdata.all_user_data(stack) | {f"slurm/{name}": text for name, text in slurm.all_files(stack).items()}
    expected |= prometheus.files(stack) | dashboards.files(stack) | {"image/bom.json": bom.render(stack)}
    assert written.keys() == expected.keys()
    for name, text in expected.items():
        assert written[name] == text, f"{name} rendered on the head node differs from the repository's"
    for name in prometheus.files(stack) | dashboards.files(stack):  # what the head reads is what `render` writes
        assert (root / name).read_text() == written[name], name


def test_plan_from_the_bundle_says_where_to_run_it(tmp_path: Path) -> None:
    path = STACK_FILES[0]
    root, elsewhere = unpack(path, tmp_path / "opt"), tmp_path / "home"
    elsewhere.mkdir()
    done = head_command(root, "-m", "gpucluster", "plan", load_stack(path).name, cwd=elsewhere)
    assert done.returncode == 2
    assert "plan runs the Pulumi program" in done.stderr and "from a checkout" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout


# Run by the system python3 -I, after standard_library.ONLY: every program, then every module (boto3 must wait for the
# call that needs it).
IMPORT_ALL = """
import importlib, json, runpy, sys
lib, programs, modules = sys.argv[1], sys.argv[2].split(), sys.argv[3].split()
loaded = {}
def library():
    return [m.__file__ for name, m in list(sys.modules.items()) if name.split(".")[0] == "gpucluster"]
for program in programs:  # each as the system python3 runs it: it finds the library itself
    sys.path[:] = [p for p in sys.path if p != lib]
    for name in [m for m in sys.modules if m.split(".")[0] == "gpucluster"]:
        del sys.modules[name]
    runpy.run_path(program)
    loaded[program] = library()
for module in modules:
    importlib.import_module(module)
    loaded[module] = library()
print(json.dumps(loaded))
"""


def test_a_compute_node_imports_every_node_module_with_the_system_python_alone(tmp_path: Path) -> None:
    """What a compute node unpacks of the library (contract and node) is all the node programs import: every module
    of both imports with /usr/bin/python3 -I (no PYTHONPATH, no venv, no site packages), every program finding the
    library from its own place in the bundle; none is named like a standard module that its directory, first on a
    script's path, would hide."""
    from gpucluster.node import fetch_bundle as fetcher

    assert Path(SYSTEM_PYTHON).exists()
    stack = load_stack(STACK_FILES[0])
    data, root = bundle.build(stack, EXAMPLES_DIR), tmp_path / "opt"

    class S3:
        def get_object(self, Bucket: str, Key: str) -> dict[str, io.BytesIO]:
            return {"Body": io.BytesIO(data)}

    # Unpacked as the fetcher does it on a compute node, with what its user data says.
    compute = userdata.node_env(stack, "compute", stack.spec.pools[0])
    fetcher.fetch_bundle(S3(), "bucket", bundle.key(data), str(root), tuple(compute["GPUCLUSTER_LIBRARY"].split(":")))
    lib = root / "lib"
    package = lib / "gpucluster"
    sources = sorted(p for p in package.rglob("*.py"))
    assert {p.relative_to(package).parts[0] for p in sources} == {"__init__.py", "contract", "node"}
    assert not {p.stem for p in (package / "node").glob("*.py")} & sys.stdlib_module_names
    programs = [str(p) for p in sources if 'if __name__ == "__main__":' in p.read_text()]
    modules = [".".join(p.relative_to(lib).with_suffix("").parts).removesuffix(".__init__") for p in sources]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    done = subprocess.run([SYSTEM_PYTHON, "-I", "-c", standard_library.ONLY + IMPORT_ALL, str(lib), " ".join(programs),
                           " ".join(modules)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    loaded = json.loads(done.stdout)
    assert set(loaded) == set(programs) | set(modules)
    assert {str(root / Path(p).relative_to(settings.BUNDLE_DIR)) for p in (settings.RESUME_PROGRAM,
                                                                         settings.BOOTSTRAP_PROGRAM)} <= set(programs)
    assert str(package / "contract" / "settings.py") in loaded[str(root / "lib/gpucluster/node/resume.py")]
    # The bundle's library, nothing from here.
    assert all(file.startswith(f"{lib}/") for files in loaded.values() for file in files)


def test_no_node_module_imports_a_program() -> None:
    """The node programs share modules, never each other: a program's entry file is its own."""
    import ast

    from gpucluster.node import NODE_DIR

    sources = {f"gpucluster.node.{p.stem}": p.read_text() for p in NODE_DIR.glob("*.py") if p.stem != "__init__"}
    programs = {name for name, text in sources.items() if 'if __name__ == "__main__":' in text}
    assert {f"gpucluster.node.{Path(p).stem}" for p in settings.NODE_PROGRAMS if p.endswith(".py")} <= programs
    for name, text in sources.items():
        imported = set()
        for statement in ast.walk(ast.parse(text)):
            if isinstance(statement, ast.Import):
                imported |= {alias.name for alias in statement.names}
            elif isinstance(statement, ast.ImportFrom) and statement.module:
                imported |= {statement.module} | {f"{statement.module}.{alias.name}" for alias in statement.names}
        assert not imported & programs - {name}, f"{name} imports a program: {sorted(imported & programs)}"
