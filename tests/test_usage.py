"""The head's readers of a stack's use (gpucluster/node/usage.py): which machine is the stack's head, Slurm's GPU-hours
there (this machine has Debian's Slurm client, whose sshare finds no controller), and idle GPU-hours from a real
Prometheus. Slurm's real figures on a running cluster: tests/integration/test_scale_from_zero.py, test_people.py."""

from __future__ import annotations

import datetime as dt
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT
from gpucluster.contract.settings import ClusterSettings
from gpucluster.node import usage
from gpucluster.render import prometheus
from gpucluster.spec.model import load_stack

TEAM_A = load_stack(ROOT / "stacks" / "Pulumi.team-a.yaml")


def head_settings(folder: Path, cluster: str) -> Path:
    path = folder / "cluster.json"
    path.write_text(ClusterSettings(cluster=cluster, region="us-east-1", pools={}).to_json())
    return path


@pytest.fixture
def debian_sshare(monkeypatch: pytest.MonkeyPatch) -> None:
    """Slurm's client on PATH, with no controller to answer it."""
    sshare = shutil.which("sshare")
    assert sshare, "the test machine has Slurm's client (slurm-client): these tests are about such a machine"
    monkeypatch.setenv("PATH", str(Path(sshare).parent))


def test_the_head_is_known_by_its_settings_file_naming_the_stacks_cluster(tmp_path: Path,
                                                                          debian_sshare: None) -> None:
    """On the stack's head, sshare is asked (here it finds no controller: what it says is the report's line, not a
    traceback); on another cluster's head, or with no or a broken settings file, it is not."""
    ours = head_settings(tmp_path, TEAM_A.cluster_name)
    assert usage.on_the_head(TEAM_A.cluster_name, ours)
    unanswered = usage.head_gpu_hours(TEAM_A.cluster_name, ours)
    assert isinstance(unanswered, str) and unanswered.startswith("Slurm did not answer (sshare exited 1: ")

    (tmp_path / "other").mkdir()
    other = head_settings(tmp_path / "other", "gpucluster-team-b")
    for settings_file in (other, tmp_path / "missing.json"):
        assert not usage.on_the_head(TEAM_A.cluster_name, settings_file)
        assert usage.head_gpu_hours(TEAM_A.cluster_name, settings_file) == usage.OFF_THE_HEAD


@pytest.mark.parametrize("content", [b"{", b"\xff\xfe", b"null", b"[]", b'{"cluster": "c", "region": "r", "pools": []}',
                                     b'{"cluster": "c", "region": "r", "surprise": 1}'])
def test_a_settings_file_that_is_not_settings_makes_no_head_and_says_why(tmp_path: Path, content: bytes) -> None:
    """Truncated, not UTF-8, JSON of another shape: the one rule answers "not a head" with the reason, for `cost`,
    `status` and `verify` alike (tests/test_cli.py: status's one error line), never a traceback."""
    broken = tmp_path / "cluster.json"
    broken.write_bytes(content)
    why = usage.here(None, broken)
    assert isinstance(why, str) and why.startswith(f"{broken} cannot be read as the cluster's settings: "), why
    assert not usage.on_the_head("c", broken)
    assert usage.head_gpu_hours("c", broken) == usage.OFF_THE_HEAD


def test_an_unreadable_settings_file_makes_no_head(tmp_path: Path) -> None:
    """A directory where the file should be: reading it fails as a file the caller may not read does (OSError)."""
    (tmp_path / "cluster.json").mkdir()
    why = usage.here(None, tmp_path / "cluster.json")
    assert isinstance(why, str) and "cannot be read" in why
    assert usage.here(None, tmp_path / "missing.json") == f"no {tmp_path / 'missing.json'} here"
    (tmp_path / "theirs").mkdir()
    theirs = head_settings(tmp_path / "theirs", "gpucluster-team-b")
    assert usage.here(TEAM_A.cluster_name, theirs) == (
        f"this is the head node of gpucluster-team-b, not of {TEAM_A.cluster_name}")
    assert isinstance(usage.here(None, theirs), ClusterSettings)


def test_on_a_head_whose_slurm_does_not_answer_both_figures_say_why(tmp_path: Path, debian_sshare: None) -> None:
    """The stack's head (its settings file), Slurm's client present but no controller: Slurm's error for GPU-hours
    and idle GPU-hours alike; elsewhere nothing (the board says where they are)."""
    ours = head_settings(tmp_path, TEAM_A.cluster_name)
    now = dt.datetime.now(dt.UTC)
    found = usage.head_usage(TEAM_A.cluster_name, TEAM_A.spec.team, prometheus.idle_gpu_hours_query, now, ours)
    assert found is not None
    gpu_hours, idle = found
    assert gpu_hours == idle
    assert isinstance(gpu_hours, str) and gpu_hours.startswith("Slurm did not answer (sshare exited 1")
    assert usage.head_usage(TEAM_A.cluster_name, TEAM_A.spec.team, prometheus.idle_gpu_hours_query, now,
                            tmp_path / "missing.json") is None


def test_idle_gpu_hours_are_what_the_heads_prometheus_recorded(tmp_path: Path) -> None:
    """Debian's Prometheus over a month backfilled with gpucluster:gpu_idle as the recording rule writes it (a sample
    every SCRAPE_SECONDS, 1 idle, 0 busy): the board's query counts the idle samples of this month only."""
    from local_cluster import free_port, wait_for
    from test_prometheus import tool

    month = dt.datetime(2026, 10, 1, tzinfo=dt.UTC)
    now = month + dt.timedelta(days=19)
    step = prometheus.SCRAPE_SECONDS
    series = {  # gpu -> (first sample, samples, value)
        "0": (month + dt.timedelta(hours=1), 240, 1), "1": (month + dt.timedelta(hours=1), 240, 0),
        "2": (month + dt.timedelta(days=3), 61, 1),
        "3": (month - dt.timedelta(hours=2), 120, 1),  # last month's: outside the range
    }
    lines = ["# TYPE gpucluster:gpu_idle gauge"]
    for gpu, (first, count, value) in series.items():
        lines += [f'gpucluster:gpu_idle{{gpu="{gpu}",node="p-1",pool="p"}} {value} {int(first.timestamp()) + step * i}'
                  for i in range(count)]
    (tmp_path / "samples").write_text("\n".join(lines) + "\n# EOF\n")
    made = subprocess.run([tool("promtool"), "tsdb", "create-blocks-from", "openmetrics", str(tmp_path / "samples"),
                           str(tmp_path / "tsdb")], capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    (tmp_path / "prometheus.yml").write_text("global: {}\n")
    port = free_port()
    log = tmp_path / "prometheus.log"
    with open(log, "wb") as out:
        server = subprocess.Popen([tool("prometheus"), f"--config.file={tmp_path / 'prometheus.yml'}",
                                   f"--storage.tsdb.path={tmp_path / 'tsdb'}", "--storage.tsdb.retention.time=100y",
                                   f"--web.listen-address=127.0.0.1:{port}"], stdout=out, stderr=out)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for("prometheus", lambda: isinstance(usage.prometheus_value(base, "vector(1)", now), float),
                 [server], [log])
        seconds = int((now - month).total_seconds())
        idle = usage.prometheus_value(base, prometheus.idle_gpu_hours_query(seconds), now)
        expected = sum(count * value for first, count, value in series.values() if first >= month) * step / 3600
        assert idle == pytest.approx(expected) and expected > 0
    finally:
        server.terminate()
        server.wait(timeout=30)
    gone = usage.prometheus_value(base, "vector(1)", now)
    assert isinstance(gone, str) and gone.startswith("Prometheus did not answer")
