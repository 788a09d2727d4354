"""A compute node's health check (gpucluster/node/health.py) against stand-ins for nvidia-smi, dcgmi, neuron-ls,
fi_info and dmesg on PATH: this machine has no GPU, no DCGM, no Neuron device and no EFA. Each stand-in prints what the
real tool prints in the cases that matter (its documented CSV, or the JSON DCGM's source writes). The first boot's
configuration checks also meet a stand-in systemctl (no systemd as PID 1 here) and instance metadata served from this
process (no EC2)."""

from __future__ import annotations

import dataclasses
import json
import shlex
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from gpucluster.contract import reasons
from gpucluster.contract.settings import NCCL_NET_PLUGIN_FILE, POOL_TAG, ClusterSettings, PoolSettings
from gpucluster.node import devices, health

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


def dcgm_report(failures: dict[int, dict[str, tuple[str, list[str]]]] | None = None) -> str:
    """`dcgmi health -c -j` as DCGM writes it (dcgmi/Health.cpp through DcgmiOutputJson: jsoncpp's styled writer):
    GPU id -> health system -> (its verdict, its message in the parts dcgmi splits it into)."""
    gpus: dict[str, object] = {}
    worst = "Healthy"
    for gpu, systems in (failures or {}).items():
        verdicts = {verdict for verdict, _ in systems.values()}
        entity = "Failure" if "Failure" in verdicts else "Warning"
        worst = "Failure" if "Failure" in (worst, entity) else entity
        gpus[str(gpu)] = {"children": {"Errors": {"children": {
            system: {"overflow": parts, "value": verdict} for system, (verdict, parts) in systems.items()}}},
            "value": entity}
    body: dict[str, object] = {"Overall Health": {"value": worst}, **({"GPU": {"children": gpus}} if gpus else {})}
    return json.dumps({"body": body, "header": ["Health Monitor Report"]}, indent=3, sort_keys=True)


def dcgmi(report: str) -> str:
    """A stand-in dcgmi whose `health -c -j` answers `report`."""
    return f"[ \"$*\" = \"health -c -j\" ] || exit 9; cat <<'EOF'\n{report}\nEOF"


def test_a_healthy_node_passes(tools) -> None:
    tools("nvidia-smi", gpus(8))
    tools("fi_info", "; ".join(f'echo "provider: efa"; echo "    domain: rdmap{i}s0-rdm"' for i in range(32)))
    tools("dcgmi", dcgmi(dcgm_report()))
    assert health.accelerators(P5) == [] and health.efa(P5) == [] and health.gpu_faults(P5) == []


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
    monkeypatch.setattr(devices, "TOOL_SECONDS", 1)
    start = time.monotonic()
    problems = health.check(P5, "prolog")
    assert "nvidia-smi did not answer in 1 s" in problems and time.monotonic() - start < 3


# What a process can write into the kernel log: the NULL-argv warning of a program whose file name is an XID line
# (Linux 5.18 and later, once a boot), and a line written to /dev/kmsg where that is allowed.
FORGED_KERNEL_LOG = (
    "[ 99.1] process 'python3' launched '/tmp/x/NVRM: Xid (PCI:0000:53:00): 79, pid=1, GPU has fallen off the bus.' "
    "with NULL argv: empty string added",
    "[ 99.2] NVRM: Xid (PCI:0000:64:00): 48, pid=1234, An uncorrectable double bit error (DBE) has been detected")


@pytest.mark.parametrize(("report", "problem"), [
    # The kernel log says XID 79 and 48 (forged); the driver's counters, through DCGM, say nothing: nothing drains.
    (dcgm_report(), None),
    # DCGM's verdicts from the driver's own events and counters: a devastating XID, a double-bit ECC count.
    (dcgm_report({3: {"Internal error": ("Failure", ["Detected XID 79 for GPU 3 (triggered by XID 79: GPU has",
                                                     "fallen off the bus)"])}}),
     "DCGM health: GPU 3: Detected XID 79 for GPU 3 (triggered by XID 79: GPU has fallen off the bus)"),
    (dcgm_report({0: {"Memory system": ("Failure", ["Detected 2 volatile double-bit ECC error(s) in GPU 0."])},
                  5: {"Driver": ("Failure", ["GPU 5 requires a reset"])}}),
     "DCGM health: GPU 0: Detected 2 volatile double-bit ECC error(s) in GPU 0.; GPU 5: GPU 5 requires a reset"),
    # Warnings (a pending page retirement, XID 63 or 94, thermal events) drain nothing; a failure beside one does.
    (dcgm_report({1: {"Memory system": ("Warning", ["Detected XID 63 for GPU 1"])}}), None),
    (dcgm_report({1: {"Thermal system": ("Warning", ["Thermal violations"]),
                      "PCIe system": ("Failure", ["GPU 1 has fallen off the bus"])}}),
     "DCGM health: GPU 1: GPU 1 has fallen off the bus"),
])
def test_gpu_faults_come_from_dcgm_never_from_the_kernel_log(tools, report: str, problem: str | None) -> None:
    tools("dmesg", "; ".join(f"echo {shlex.quote(line)}" for line in FORGED_KERNEL_LOG))
    tools("dcgmi", dcgmi(report))
    tools("nvidia-smi", gpus(8))
    tools("fi_info", "; ".join(f'echo "    domain: rdmap{i}s0-rdm"' for i in range(32)))
    assert health.gpu_faults(P5) == ([problem] if problem else [])
    assert [p for p in health.check(P5, "periodic") if "DCGM" in p or "XID" in p or "Xid" in p] == \
        ([problem] if problem else [])


def test_a_host_engine_without_watches_gets_them_and_the_driver_counters_decide(tools, tmp_path: Path,
                                                                               capsys) -> None:
    """A host engine restarted since the boot has no watches: they are set again, and meanwhile nvidia-smi's row
    remapper counts decide. Without dcgmi at all, the same counters."""
    calls = tmp_path / "dcgmi.calls"
    tools("dcgmi", f'echo "$*" >> {calls}; [ "$1 $2" = "health -s" ] && '
                   'echo "Health monitor systems set successfully." && exit 0; '
                   'echo "Error: Health watches not enabled. Please enable watches. "; exit 253')
    tools("nvidia-smi", '[ "$*" = "--query-remapped-rows=gpu_bus_id,remapped_rows.failure --format=csv,noheader" ] '
                        '|| exit 9; echo "00000000:53:00.0, No"; echo "00000000:64:00.0, Yes"')
    assert health.gpu_faults(P5) == ["GPU 00000000:64:00.0: row remapping failed"]
    assert calls.read_text().splitlines() == ["health -c -j", f"health -s {health.DCGM_WATCHES}"]
    assert "DCGM had no health watches: set them" in capsys.readouterr().err
    (tmp_path / "bin" / "dcgmi").unlink()
    assert health.gpu_faults(P5) == ["GPU 00000000:64:00.0: row remapping failed"]
    tools("nvidia-smi", 'echo "Field remapped_rows.failure is not a valid field to query." >&2; exit 2')  # no remapper
    assert health.gpu_faults(P5) == [] and "row remapper not read" in capsys.readouterr().err
    assert health.gpu_faults(TRN) == [] and health.gpu_faults(dataclasses.replace(P5, accelerators=0)) == []


def test_a_host_engine_that_does_not_answer_is_a_finding(tools) -> None:
    tools("dcgmi", 'echo "Error: Unable to connect to host engine. Host engine connection invalid/disconnected."; '
                   "exit 255")
    assert health.gpu_faults(P5) == ["DCGM health check: dcgmi exited 255: Error: Unable to connect to host engine. "
                                     "Host engine connection invalid/disconnected."]
    tools("dcgmi", "echo 'not json'")
    assert health.gpu_faults(P5) == ["DCGM health check: not the JSON dcgmi writes: not json"]


def test_missing_efa_devices(tools) -> None:
    tools("fi_info", "; ".join(f'echo "    domain: rdmap{i}s0-rdm"' for i in range(31)))
    assert health.efa(P5) == ["31 of 32 EFA devices"]


def test_neuron_devices_are_counted(tools) -> None:
    tools("neuron-ls", "echo '[" + ",".join('{"neuron_device": %d}' % i for i in range(15)) + "]'")
    assert health.accelerators(TRN) == ["15 of 16 Neuron devices"]


def test_the_prolog_runs_only_the_fast_checks(tools, monkeypatch: pytest.MonkeyPatch) -> None:
    tools("nvidia-smi", gpus(8))
    tools("fi_info", "exit 1")  # would be a finding in the periodic check
    tools("dcgmi", "exit 1")
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


# --- the first boot's configuration checks ---------------------------------------------------------------------------
G6 = PoolSettings("g6", "lt-3", "subnet-1", "g6.xlarge", "on-demand", accelerator="nvidia", accelerators=1)


def systemctl(state: Path, starts: bool = True) -> str:
    """A stand-in systemctl: `is-active` answers from a state file, `start` writes it (or fails, as a unit whose
    service exits at once does)."""
    start = f'touch {state}' if starts else 'echo "Job for nvidia-dcgm.service failed." >&2; exit 1'
    return (f'case "$1" in is-active) [ -e {state} ] && echo active && exit 0; echo inactive; exit 3;; '
            f'start) {start};; esac')


def test_a_stopped_dcgm_host_engine_is_started_and_passes(tools, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    units = tmp_path / "units"
    units.mkdir()
    (units / health.DCGM_UNIT).write_text("[Service]\nExecStart=/usr/bin/nv-hostengine -n\n")
    tools("systemctl", systemctl(tmp_path / "dcgm-active"))
    watches = tmp_path / "watches"
    tools("dcgmi", f'[ "$*" = "health -s a" ] && echo "$*" >> {watches} && '
                   'echo "Health monitor systems set successfully."')
    assert health.dcgm_host_engine(P5, (str(units),)) == []
    assert (tmp_path / "dcgm-active").exists()  # started
    assert watches.read_text() == "health -s a\n"  # and its health watches set, for gpu_faults
    assert "nvidia-dcgm.service was stopped: started it" in capsys.readouterr().err
    assert health.dcgm_host_engine(P5, (str(units),)) == []  # running: nothing to do, nothing said
    assert capsys.readouterr().err == ""
    assert health.dcgm_host_engine(TRN, ()) == []  # no DCGM on Trainium


def test_dcgm_missing_or_not_starting_is_a_configuration_fault(tools, tmp_path: Path) -> None:
    assert health.dcgm_host_engine(P5, (str(tmp_path),)) == [
        "DCGM is not installed (no nvidia-dcgm.service): rebake the image (build_image.sh installs it)"]
    (tmp_path / health.DCGM_UNIT).write_text("[Service]\n")
    tools("systemctl", systemctl(tmp_path / "dcgm-active", starts=False))
    (problem,) = health.dcgm_host_engine(P5, (str(tmp_path),))
    assert problem.startswith("nvidia-dcgm.service does not start (systemctl exited 1: Job for") and "rebake" in problem


def test_a_kernel_without_a_lustre_module_is_a_configuration_fault(tools) -> None:
    tools("modinfo", '[ "$*" = "-k 6.8.0-1029-aws -F filename lustre" ] || exit 1; '
                     'echo /lib/modules/6.8.0-1029-aws/updates/lustre.ko')
    assert health.lustre_module("6.8.0-1029-aws") == []
    assert health.lustre_module("7.0.0-1012-aws") == [
        "no Lustre client module for kernel 7.0.0-1012-aws (the kernel changed without one): rebake the image, "
        "or hold the kernel it was baked with"]


def test_lustre_module_undecided_without_modinfo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no modinfo: no answer, so no fault
    assert health.lustre_module("7.0.0-1012-aws") == []
    said = capsys.readouterr().err
    assert "cannot tell whether kernel 7.0.0-1012-aws has a Lustre module (modinfo not found)" in said


@pytest.fixture
def metadata(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[dict[str, str] | None], None]]:
    """Instance metadata (IMDSv2) serving the instance's tags as EC2 does with tags in metadata allowed: the keys at
    meta-data/tags/instance, each value under its key. None: tags not allowed (every tags path answers 404)."""
    served: dict[str, dict[str, str] | None] = {"tags": {}}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_PUT(self) -> None:
            self.reply(200, "token")

        def do_GET(self) -> None:
            tags = served["tags"]
            path = self.path.removeprefix("/latest/meta-data/tags/instance")
            if self.headers.get("X-aws-ec2-metadata-token") != "token":
                return self.reply(401, "")
            if tags is None or (path and path.lstrip("/") not in tags):
                return self.reply(404, "")
            self.reply(200, tags[path.lstrip("/")] if path else "\n".join(tags))

        def reply(self, status: int, text: str) -> None:
            self.send_response(status)
            self.send_header("Content-Length", str(len(text.encode())))
            self.end_headers()
            self.wfile.write(text.encode())

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    yield lambda tags: served.update(tags=tags)
    server.shutdown()
    server.server_close()


def test_the_instance_must_carry_the_pool_its_node_name_claims(metadata) -> None:
    metadata({POOL_TAG: "p5-od", "gpucluster:cluster": "c1", "aws:ec2:fleet-id": "fleet-1"})
    assert health.pool_tag("p5-od-3") == []
    assert health.pool_tag("p5-spot-1") == [
        f"instance tagged {POOL_TAG}=p5-od, not {POOL_TAG}=p5-spot: EC2 did not give it the launch template's tags"]
    metadata({"gpucluster:cluster": "c1"})  # CreateFleet's tags instead of the launch template's, not with them
    assert health.pool_tag("p5-od-3") == [
        f"instance not tagged, not {POOL_TAG}=p5-od: EC2 did not give it the launch template's tags"]


def test_a_pool_tag_that_cannot_be_read_downs_no_node(metadata, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    metadata(None)  # a launch template (an older version) without tags in the metadata
    assert health.pool_tag("p5-od-3") == []
    assert "cannot read the instance's tags from its metadata (HTTP 404): pool tag not checked" in \
        capsys.readouterr().err
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", "http://127.0.0.1:9")  # nothing answers
    assert health.pool_tag("p5-od-3") == []
    assert "the instance metadata does not answer" in capsys.readouterr().err


def test_an_efa_pool_needs_ncclS_efa_plugin(tmp_path: Path) -> None:
    arch = tmp_path / "x86_64-linux-gnu"  # the two places the image may hold it (build_image.sh OFI_NCCL_DIRS)
    arch.mkdir()
    directories = (str(arch), str(tmp_path))
    assert health.nccl_plugin(P5, directories) == [
        f"no {NCCL_NET_PLUGIN_FILE} in {arch} or {tmp_path} (aws-ofi-nccl, NCCL's EFA plugin): rebake the image"]
    (arch / NCCL_NET_PLUGIN_FILE).write_bytes(b"")
    assert health.nccl_plugin(P5, directories) == []
    (arch / NCCL_NET_PLUGIN_FILE).unlink()
    (tmp_path / NCCL_NET_PLUGIN_FILE).write_bytes(b"")
    assert health.nccl_plugin(P5, directories) == []
    assert health.nccl_plugin(G6, (str(tmp_path / "none"),)) == []  # no EFA: sockets are all NCCL has anyway


def test_configuration_faults_set_the_node_down_with_their_fix(tools, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                metadata) -> None:
    """`health.py --configuration` as the bootstrap runs it: DOWN (not drained) with reasons.CONFIGURATION, the
    class the reconciler never relaunches, and exit status 1 (the boot then leaves slurmd stopped)."""
    calls = tmp_path / "scontrol.calls"
    tools("scontrol", f'echo "$@" >> {calls}')
    settings = tmp_path / "cluster.json"
    settings.write_text(ClusterSettings(cluster="c1", region="us-east-1", pools={"g6": G6}).to_json())
    monkeypatch.setattr(ClusterSettings, "load", classmethod(lambda cls: cls.from_json(settings.read_text())))
    monkeypatch.setattr(health, "read_env_file", lambda: {"GPUCLUSTER_POOL": "g6"})
    monkeypatch.setattr(health, "NODE_NAME_FILE", str(tmp_path / "node-name"))
    (tmp_path / "node-name").write_text("g6-2\n")
    monkeypatch.setattr(health, "dcgm_host_engine", lambda pool: [])
    tools("modinfo", "exit 1")  # this kernel has no Lustre module
    metadata({POOL_TAG: "g6"})
    assert health.main(["health.py", "--configuration"]) == 1
    (update,) = calls.read_text().splitlines()
    assert update.startswith("update nodename=g6-2 state=down reason=gpucluster: configuration: no Lustre client "
                             "module for kernel "), update
    assert update.split("reason=")[1].startswith(reasons.CONFIGURATION)
    calls.unlink()
    tools("modinfo", "echo /lib/modules/x/lustre.ko")
    assert health.main(["health.py", "--configuration"]) == 0 and not calls.exists()


def test_the_prolog_makes_the_job_users_container_directories_and_sets_aside_a_planted_link(tmp_path: Path) -> None:
    """enroot (as the user) only `mkdir -p`s its directories and uses what it finds: root makes them first, the
    user's own, 0700, in root's 0755 directories; a link left there (an older image's 1777 layout) is set aside."""
    import os
    import stat

    if os.geteuid() != 0:
        pytest.skip("the Prolog runs as root: chown needs it")
    base = tmp_path / "enroot"
    for kind in ("cache", "data", "runtime"):
        (base / kind).mkdir(parents=True)
    victim = tmp_path / "etc"
    victim.mkdir(mode=0o700)
    (base / "data" / "4321").symlink_to(victim)
    assert health.container_directories(4321, 4321, base) == []
    for kind in ("cache", "data", "runtime"):
        info = os.lstat(base / kind / "4321")
        assert stat.S_ISDIR(info.st_mode) and (info.st_uid, stat.S_IMODE(info.st_mode)) == (4321, 0o700)
    assert victim.stat().st_uid == 0 and len(list((base / "data").glob("4321.set-aside-*"))) == 1
    (base / "data" / "4321" / "image").mkdir()
    assert health.container_directories(4321, 4321, base) == []  # the next job: the user's own kept as it is
    assert (base / "data" / "4321" / "image").is_dir()
    assert health.container_directories(4321, 4321, tmp_path / "none") == []  # a node without the scratch space
