"""The `gpucluster` command on the head node runs from the unpacked bundle (lib/ on PYTHONPATH, as the wrapper that
bootstrap.command_line writes, without Pulumi, which the head's venv lacks): `render` works there and gives what the
repository gives, `plan` says it needs a checkout, and the node programs find the settings contract beside them with the system python3 alone."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from conftest import STACK_FILES
from gpucluster.render import bundle, dashboards, prometheus, slurm, userdata
from gpucluster.spec.model import load_stack
from gpucluster.project import EXAMPLES_DIR

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
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")} | {"PYTHONPATH": str(root / "lib")}
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
    expected |= prometheus.files(stack) | dashboards.files(stack)
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
    assert "plan runs the Pulumi program" in done.stderr and "checkout of the repository" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout


@pytest.mark.parametrize("program", ["gpucluster_node", "bootstrap"])
def test_node_programs_find_the_contract_beside_them_with_the_system_python(program: str, tmp_path: Path) -> None:
    """The node programs run with /usr/bin/python3, no PYTHONPATH, no venv: they put the bundle's lib/ on their path
    themselves, and the contract they import there needs the standard library only."""
    assert Path(SYSTEM_PYTHON).exists()
    root, elsewhere = unpack(STACK_FILES[0], tmp_path / "opt"), tmp_path / "home"
    elsewhere.mkdir()
    code = (f"import sys; sys.path.insert(0, {str(root)!r}); import {program}; "
            "from gpucluster.contract import settings; print(settings.__file__); "
            "print(sorted(m for m in ('pydantic', 'yaml', 'boto3') if m in sys.modules))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    done = subprocess.run([SYSTEM_PYTHON, "-I", "-c", code], cwd=elsewhere, env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    settings_file, imported = done.stdout.splitlines()
    assert settings_file == str(root / "lib" / "gpucluster" / "contract" / "settings.py")
    assert imported == "[]"
