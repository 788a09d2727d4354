"""examples/submit.sh's arguments: which one is the batch script (any file whose first line starts with #!, as sbatch
requires; or the one after `--`), which go to sbatch and which to the script. sinfo and sbatch are stand-ins on
PATH here: the unit lane has no Slurm, and what is checked is the command line submit.sh hands sbatch. Its real runs,
against a local cluster's sbatch and sinfo: tests/integration/test_scale_from_zero.py's examples."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT

SUBMIT = ROOT / "examples" / "submit.sh"
# sinfo's answers as Slurm 24.11 prints them: %P marks the default partition with *, %G a node's gres with sockets.
PARTITIONS = "g6*\np5\n"
GRES = {"g6": "gpu:l4:4(S:0)", "p5": "gpu:h100:8(S:0-1)"}


@pytest.fixture
def slurm_on_path(tmp_path: Path) -> dict[str, str]:
    """sinfo answering the partitions and their gres, sbatch writing its arguments one a line to sbatch.args."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    sinfo = bin_dir / "sinfo"
    gres_cases = "".join(f'  *"-p {name} "*) echo "{gres}" ;;\n' for name, gres in GRES.items())
    sinfo.write_text(f'#!/bin/bash\ncase "$* " in\n  *%P*) printf "{PARTITIONS}" ;;\n{gres_cases}esac\n')
    sbatch = bin_dir / "sbatch"
    sbatch.write_text(f"#!/bin/bash\nprintf '%s\\n' \"$@\" > {tmp_path / 'sbatch.args'}\n")
    for tool in (sinfo, sbatch):
        tool.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}


def submit(tmp_path: Path, env: dict[str, str], *args: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """submit.sh run in tmp_path; what sbatch got (none: not called)."""
    done = subprocess.run([str(SUBMIT), *args], cwd=tmp_path, env=env, capture_output=True, text=True)
    called = tmp_path / "sbatch.args"
    return done, called.read_text().splitlines() if called.exists() else []


def test_any_batch_script_with_options_before_and_arguments_after(tmp_path: Path,
                                                                  slurm_on_path: dict[str, str]) -> None:
    """A user's train.sh (not *.sbatch); an option's value that is an existing file (an earlier job's log) stays an
    option; what follows the script, even a batch script, is the script's."""
    (tmp_path / "train.sh").write_text("#!/bin/bash\npython train.py \"$@\"\n")
    (tmp_path / "old.log").write_text("step 1\n")
    done, sbatch = submit(tmp_path, slurm_on_path, "-p", "p5", "-N", "4", "-o", "old.log", "train.sh", "--steps",
                          "5", "train.sh")
    assert done.returncode == 0, done.stderr
    assert sbatch == ["-p", "p5", "--gpus-per-node=8", "-p", "p5", "-N", "4", "-o", "old.log", "train.sh", "--steps",
                      "5", "train.sh"]
    done, sbatch = submit(tmp_path, slurm_on_path, "train.sh")  # the default partition, its GPUs
    assert done.returncode == 0, done.stderr
    assert sbatch == ["-p", "g6", "--gpus-per-node=4", "train.sh"]


def test_double_dash_names_the_script_outright(tmp_path: Path, slurm_on_path: dict[str, str]) -> None:
    """After `--` the next argument is the script, even one that is also an option's look-alike or has no #! yet
    (sbatch says what it thinks of it)."""
    (tmp_path / "job.sh").write_text("#!/bin/bash\ntrue\n")
    done, sbatch = submit(tmp_path, slurm_on_path, "-J", "x", "--", "job.sh", "-v")
    assert done.returncode == 0, done.stderr
    assert sbatch == ["-p", "g6", "--gpus-per-node=4", "-J", "x", "job.sh", "-v"]


@pytest.mark.parametrize("args", [(), ("-N", "2"), ("-N", "2", "missing.sh"), ("-N", "2", "notes.txt"), ("--",)])
def test_no_batch_script_is_a_usage_error(args: tuple[str, ...], tmp_path: Path,
                                          slurm_on_path: dict[str, str]) -> None:
    (tmp_path / "notes.txt").write_text("not a script\n")
    done, sbatch = submit(tmp_path, slurm_on_path, *args)
    assert (done.returncode, sbatch) == (2, [])
    assert done.stderr.startswith("usage: examples/submit.sh [SBATCH OPTIONS] [--] SCRIPT [ARGS...]")
    assert "first line starts with #!" in done.stderr
