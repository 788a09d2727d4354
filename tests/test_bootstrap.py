"""The on-node bootstrap's decisions that can be checked off AWS: the munge key in SSM, files it writes."""

from __future__ import annotations

import pwd
import stat
import sys
from pathlib import Path

import boto3
import pytest
from moto import mock_aws

from conftest import ROOT

sys.path.insert(0, str(ROOT / "cloud-init"))
import bootstrap  # noqa: E402

PARAMETER = "/gpucluster/gpucluster-t/munge-key"


@pytest.fixture
def ssm():  # type: ignore[no-untyped-def]
    with mock_aws():
        yield boto3.client("ssm", region_name="us-east-1")


def test_first_head_creates_the_key_and_a_racing_head_reads_it(ssm) -> None:  # type: ignore[no-untyped-def]
    first = bootstrap.munge_key(ssm, PARAMETER, create=True)
    second = bootstrap.munge_key(ssm, PARAMETER, create=True)  # loses the create, reads the winner's key
    assert len(first) == 1024 and first == second
    stored = ssm.get_parameter(Name=PARAMETER)["Parameter"]
    assert stored["Type"] == "SecureString"


def test_compute_node_only_reads_and_gives_up_without_a_head(ssm, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(bootstrap.time, "sleep", lambda seconds: None)
    with pytest.raises(RuntimeError, match="no munge key"):
        bootstrap.munge_key(ssm, PARAMETER, create=False, attempts=2)
    with pytest.raises(ssm.exceptions.ParameterNotFound):
        ssm.get_parameter(Name=PARAMETER)  # it did not create one


def test_munge_key_file_is_munge_only(tmp_path: Path) -> None:
    key = tmp_path / "munge.key"
    bootstrap.install_munge_key(b"k" * 1024, key)
    info = key.stat()
    assert stat.S_IMODE(info.st_mode) == 0o400 and info.st_uid == pwd.getpwnam("munge").pw_uid


def test_hosts_entry_replaces_an_old_head_address(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n10.0.0.9 head\n")
    bootstrap.hosts_entry("10.0.0.17", hosts)
    assert hosts.read_text() == "127.0.0.1 localhost\n10.0.0.17 head\n"


def test_nccl_environment_turns_on_efa_only_where_the_pool_has_it() -> None:
    assert "FI_PROVIDER=efa" in bootstrap.nccl_environment(efa=True)
    assert "FI_EFA_USE_HUGE_PAGE=0" in bootstrap.nccl_environment(efa=True)
    assert "FI_PROVIDER" not in bootstrap.nccl_environment(efa=False)


def test_usage_error_exits_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bootstrap.logging, "FileHandler", lambda path: bootstrap.logging.StreamHandler())
    monkeypatch.setattr(bootstrap.Path, "mkdir", lambda *a, **k: None)
    assert bootstrap.main(["bootstrap.py", "nonsense"]) == 2


def test_head_installs_the_budget_guardrail_service_and_command(tmp_path: Path) -> None:
    systemd, sbin = tmp_path / "systemd", tmp_path / "sbin"
    systemd.mkdir()
    sbin.mkdir()
    bootstrap.budget_guardrail(systemd, sbin)
    bootstrap.budget_guardrail(systemd, sbin)  # a reboot runs it again
    assert (sbin / "gpucluster-budget").readlink() == bootstrap.BUNDLE / "gpucluster_budget.py"
    unit = (systemd / "gpucluster-budget.service").read_text()
    assert f"ExecStart={sbin}/gpucluster-budget run" in unit and "Restart=always" in unit
    assert "After=slurmctld.service" in unit and "WantedBy=multi-user.target" in unit


def test_head_gets_the_command_line_with_the_pinned_pydantic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from conftest import ROOT as repo

    assert bootstrap.PYDANTIC in (repo / "requirements.txt").read_text().splitlines()
    ran: list[tuple[str, ...]] = []
    monkeypatch.setattr(bootstrap, "BUNDLE", tmp_path)
    monkeypatch.setattr(bootstrap, "run", lambda *args, **kw: ran.append(args))
    bootstrap.command_line(tmp_path)
    assert ran == [("python3", "-m", "venv", "--system-site-packages", f"{tmp_path}/venv"),
                   (f"{tmp_path}/venv/bin/pip", "install", "--quiet", bootstrap.PYDANTIC)]
    wrapper = (tmp_path / "gpucluster").read_text()
    assert f"PYTHONPATH={tmp_path}/lib exec {tmp_path}/venv/bin/python -m gpucluster" in wrapper


def test_fstab_entries_are_added_once(tmp_path: Path) -> None:
    fstab = tmp_path / "fstab"
    fstab.write_text("LABEL=root / ext4 defaults 0 1\n")
    for _ in range(2):  # every boot runs the bootstrap again
        bootstrap.fstab_entry("LABEL=gpucluster-state /var/lib/gpucluster ext4 defaults,nofail 0 2", fstab)
    assert fstab.read_text().splitlines() == ["LABEL=root / ext4 defaults 0 1",
                                              "LABEL=gpucluster-state /var/lib/gpucluster ext4 defaults,nofail 0 2"]
