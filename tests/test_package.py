"""`pip install .` gives the `gpucluster` command, which plans a stack from outside the checkout.

Cost: about 8 s to build and install, 10-15 s for the plan's cold process (on this 2-core machine, shared).

The fresh virtual environment borrows the development venv's packages through a .pth file and installs this package
alone (`--no-deps --no-build-isolation --no-index`): a real install of the runtime's dependencies downloads a minute of
wheels, and this machine may be offline. What is proven is the package's own part: its metadata, its console script,
the modules and data it ships (pyproject.toml's package list), and that nothing reaches back into the checkout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

from conftest import ROOT
from gpucluster import __version__

# What a build reads from the checkout; a copy keeps the build's by-products (build/, *.egg-info) out of it.
SOURCES = ("pyproject.toml", "README.md", "requirements.txt", "gpucluster", "components", "examples")


def test_the_package_list_is_the_tree() -> None:
    """Every Python package of the library and the program is installed (a new one must be added to the list)."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {init.parent.relative_to(ROOT).as_posix().replace("/", ".")
             for top in ("gpucluster", "components") for init in (ROOT / top).rglob("__init__.py")}
    assert listed == found | {"gpucluster.examples"}


def test_pip_install_gives_the_command_that_plans_from_anywhere(tmp_path: Path) -> None:
    source, venv, elsewhere = tmp_path / "source", tmp_path / "venv", tmp_path / "elsewhere"
    source.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    python = venv / "bin" / "python"
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "development-venv.pth").write_text(sysconfig.get_path("purelib") + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "GPUCLUSTER_"))}
    installed = subprocess.run([python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
                                "--no-build-isolation", "--no-index", str(source)], env=env, capture_output=True,
                               text=True, timeout=180)
    assert installed.returncode == 0, installed.stderr
    shutil.rmtree(source)  # nothing may come from the copy it was built from
    command = venv / "bin" / "gpucluster"
    elsewhere.mkdir()

    version = subprocess.run([command, "--version"], cwd=elsewhere, env=env, capture_output=True, text=True)
    assert (version.returncode, version.stdout) == (0, f"gpucluster {__version__}\n"), version.stderr

    planned = subprocess.run([command, "plan", "dev"], cwd=elsewhere, env=env | {"GPUCLUSTER_STACKS": str(
        ROOT / "stacks")}, capture_output=True, text=True, timeout=120)
    assert planned.returncode == 0, planned.stderr
    assert "gpucluster:pool:GpuPool  gpucluster-dev-g6-spot" in planned.stdout
    # The library, the program and the examples came from the new venv, not from the checkout.
    where = subprocess.run([python, "-c", "from importlib.util import find_spec; from gpucluster import project; "
                            "print(find_spec('gpucluster').origin, find_spec('components').origin, "
                            "project.EXAMPLES_DIR / 'launch.sh')"], cwd=elsewhere, env=env, capture_output=True,
                           text=True)
    assert all(path.startswith(purelib) for path in where.stdout.split()), where.stdout
