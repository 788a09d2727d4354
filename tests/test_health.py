"""A compute node's health check (gpucluster/node/health.py) against stand-ins for nvidia-smi, neuron-ls,
fi_info and dmesg on PATH: this machine has no GPU, no Neuron device and no EFA. Each stand-in prints what the real
tool prints in the cases that matter (its documented CSV or JSON)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from gpucluster.contract.settings import PoolSettings
from gpucluster.node import health

P5 = PoolSettings("p5", "lt-1", "subnet-1", "p5.48xlarge", "spot", efa_interfaces=32, accelerator="nvidia",
                  accelerators=8)
TRN = PoolSettings("trn", "lt-2", "subnet-1", "trn1.32xlarge", "on-demand", accelerator="neuron", accelerators=16)


@pytest.fixture
def tools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Write a stand-in: tools("nvidia-smi", "echo ...")."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")

    def write(name: str, body: str) -> None:
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return write


def gpus(n: int, ecc: dict[int, int] | None = None) -> str:
    return "; ".join(f'echo "{i}, {(ecc or {}).get(i, 0)}"' for i in range(n))


def test_a_healthy_node_passes(tools) -> None:
    tools("nvidia-smi", gpus(8))
    tools("fi_info", "; ".join(f'echo "provider: efa"; echo "    domain: rdmap{i}s0-rdm"' for i in range(32)))
    tools("dmesg", 'echo "[  1.0] usual boot noise"')
    assert health.accelerators(P5) == [] and health.efa(P5) == [] and health.fatal_xids() == []


@pytest.mark.parametrize(("stand_in", "problem"), [
    (gpus(7), "7 of 8 GPUs"),
    (gpus(8, {3: 2}), "GPU 3: 2 uncorrected ECC errors"),
    ("echo 'NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver' >&2; exit 9",
     "nvidia-smi exited 9: NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver"),
])
def test_gpu_faults_are_found(tools, stand_in: str, problem: str) -> None:
    tools("nvidia-smi", stand_in)
    assert problem in health.accelerators(P5)


def test_a_missing_tool_is_a_finding_not_a_crash(tools) -> None:
    assert health.accelerators(P5) == ["nvidia-smi not found"]


def test_a_hung_tool_costs_its_time_limit_and_no_more(tools, monkeypatch: pytest.MonkeyPatch) -> None:
    tools("nvidia-smi", "sleep 600")
    monkeypatch.setattr(health, "TOOL_SECONDS", 1)
    start = time.monotonic()
    problems = health.check(P5, "prolog")
    assert "nvidia-smi did not answer in 1 s" in problems and time.monotonic() - start < 3


def test_fatal_xids_and_missing_efa_devices(tools) -> None:
    tools("dmesg", 'echo "[ 99.1] NVRM: Xid (PCI:0000:53:00): 79, pid=1234, GPU has fallen off the bus."; '
                   'echo "[ 99.2] NVRM: Xid (PCI:0000:64:00): 13, Graphics Exception"')
    assert health.fatal_xids() == ["fatal GPU XID(s) 79 in the kernel log"]  # 13 is an application's fault
    tools("fi_info", "; ".join(f'echo "    domain: rdmap{i}s0-rdm"' for i in range(31)))
    assert health.efa(P5) == ["31 of 32 EFA devices"]


def test_neuron_devices_are_counted(tools) -> None:
    tools("neuron-ls", "echo '[" + ",".join('{"neuron_device": %d}' % i for i in range(15)) + "]'")
    assert health.accelerators(TRN) == ["15 of 16 Neuron devices"]


def test_the_prolog_runs_only_the_fast_checks(tools, monkeypatch: pytest.MonkeyPatch) -> None:
    tools("nvidia-smi", gpus(8))
    tools("fi_info", "exit 1")  # would be a finding in the periodic check
    tools("dmesg", "exit 1")
    monkeypatch.setattr(health, "storage", lambda: [])
    assert health.check(P5, "prolog") == []
    assert "fi_info exited 1: " in health.check(P5, "periodic")


def test_storage_needs_fsx_mounted(tmp_path: Path) -> None:
    assert health.storage(str(tmp_path / "fsx"), disks=("/",)) == [f"{tmp_path / 'fsx'} is not mounted"]
    assert health.storage("/", disks=("/",)) == []  # / is a mount point with space


def test_the_prolog_labels_a_jobs_gpus_for_dcgm_exporter_and_the_epilog_unlabels_them(tmp_path: Path) -> None:
    """dcgm-exporter's HPC job mapping: a file per GPU index naming the job on it."""
    health.label_gpus("41", "0,1", epilog=False, mapping=tmp_path)
    health.label_gpus("42", "1,3", epilog=False, mapping=tmp_path)  # GPU 1's earlier job left no Epilog behind
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == {"0": "41\n", "1": "42\n", "3": "42\n"}
    health.label_gpus("41", "0,1", epilog=True, mapping=tmp_path)  # takes only its own job off
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == {"1": "42\n", "3": "42\n"}
    health.label_gpus("43", "", epilog=False, mapping=tmp_path)  # a job without GPUs labels nothing
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "3"]
