"""`python -m gpucluster render`: the exact user data EC2 gets, checked by the real cloud-init, and the Slurm files."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, STACK_FILES
from gpucluster import slurm, userdata
from gpucluster.spec import load_stack

GOLDEN = ROOT / "tests" / "golden"


def render(stack: str, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpucluster", "render", stack, "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def cloud_init_schema(path: Path) -> subprocess.CompletedProcess[str]:
    assert shutil.which("cloud-init"), "install cloud-init first (make test does)"
    return subprocess.run(["cloud-init", "schema", "--config-file", str(path)], capture_output=True, text=True)


@pytest.mark.parametrize("path", STACK_FILES, ids=lambda p: p.name)
def test_render_writes_valid_small_user_data_and_slurm_files(path: Path, tmp_path: Path) -> None:
    stack = load_stack(path)
    done = render(str(path), tmp_path)
    assert done.returncode == 0, done.stderr
    expected = {"head-node.user-data", *(f"{p.name}.user-data" for p in stack.spec.pools),
                "slurm/slurm.conf", "slurm/gres.conf", "slurm/slurmdbd.conf", "slurm/plugstack.conf"}
    written = {str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()}
    assert written == expected
    for name in expected - {n for n in expected if n.startswith("slurm/")}:
        data = (tmp_path / name).read_bytes()
        assert data.startswith(b"#cloud-config\n")
        assert len(data) < userdata.EC2_USER_DATA_LIMIT // 2, f"{name}: {len(data)} bytes leaves too little headroom"
        checked = cloud_init_schema(tmp_path / name)
        assert checked.returncode == 0, checked.stdout + checked.stderr
        assert f"GPUCLUSTER_CONFIG_PARAMETER={userdata.config_parameter(stack)}" in data.decode()
    assert (tmp_path / "slurm" / "slurm.conf").read_text() == slurm.slurm_conf(stack)


def test_schema_checker_rejects_a_broken_file(tmp_path: Path) -> None:
    """The check above can fail: cloud-init refuses a malformed document."""
    broken = tmp_path / "broken.user-data"
    broken.write_text("#cloud-config\npackages: 5\nwrite_files:\n  - content: x\n")
    checked = cloud_init_schema(broken)
    assert checked.returncode != 0 and "packages" in (checked.stdout + checked.stderr)


def test_user_data_carries_no_secret() -> None:
    for path in STACK_FILES:
        for text in userdata.all_user_data(load_stack(path)).values():
            lowered = text.lower()
            assert "munge.key" not in lowered and "password" not in lowered and "secret" not in lowered


def test_golden_team_a(tmp_path: Path) -> None:
    """The rendered team-a artifacts, reviewed like code. Regenerate with GPUCLUSTER_UPDATE_GOLDEN=1 and read the diff."""
    assert render("team-a", tmp_path).returncode == 0
    golden = GOLDEN / "team-a"
    if os.environ.get("GPUCLUSTER_UPDATE_GOLDEN"):
        shutil.rmtree(golden, ignore_errors=True)
        shutil.copytree(tmp_path, golden)
    rendered = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert rendered == sorted(p.relative_to(golden) for p in golden.rglob("*") if p.is_file())
    for rel in rendered:
        assert (tmp_path / rel).read_text() == (golden / rel).read_text(), f"{rel} differs from tests/golden/team-a"


def test_render_bad_input_exits_2(tmp_path: Path) -> None:
    done = render("tests/bad_stacks/Pulumi.min-above-max.yaml", tmp_path)
    assert done.returncode == 2 and "must be <= max_nodes" in done.stderr and "Traceback" not in done.stderr
    assert not any(tmp_path.iterdir())
