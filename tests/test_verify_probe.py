"""`gpucluster verify`'s measurements: the per-node probe (gpucluster/node/verify_probe.py) and the reading of
nccl-tests' all_reduce_perf output (gpucluster/node/nccl_tests.py).

This machine has no GPU, DCGM, EFA device, Lustre client or instance metadata, so the probe meets stand-ins: a
nvidia-smi and a dcgmi printing what the real tools print (nvidia-smi's documented CSV; DCGM 4.5.2's `dcgmi diag -j`
reports, recorded in tests/dcgm-diag/ for the Kubernetes burn-in), a temp root shaped as sysfs and mountinfo are, and
a metadata service on 127.0.0.1. The /fsx throughput runs for real on a temp directory (its shape, not its speed).

The all_reduce_perf outputs in tests/nccl-tests/ are AWS's published p5 and p4de tables (awsome-distributed-training
0162aac, micro-benchmarks/nccl-tests/README.md), and runs rebuilt from nccl-tests' output format at NVIDIA/nccl-tests
a0b82b2 (src/util.cu) with NCCL's log lines (NVIDIA/nccl 5067397 src/debug.cc, init.cc) and aws-ofi-nccl's (v1.21.1
and v1.7.4-aws src/nccl_ofi_net.*), for the log, the footer and the faults the published tables do not show:
tests/nccl-tests/README.md says which line comes from where.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import subprocess
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from conftest import ROOT
from gpucluster.contract import verify
from gpucluster.contract.settings import AWS_OFI_NCCL_LIB_DIRS, NCCL_NET_PLUGIN_FILE, ClusterSettings, PoolSettings
from gpucluster.node import nccl_tests, verify_probe
from gpucluster.node.verify_probe import Sources
from gpucluster.render import verify as verify_plan
from gpucluster.spec import catalog
from gpucluster.spec.model import load_stack

NCCL_OUTPUTS = ROOT / "tests" / "nccl-tests"
DCGM_REPORTS = ROOT / "tests" / "dcgm-diag"
P5 = PoolSettings("p5", "lt-1", "subnet-1", "p5.48xlarge", "spot", efa_interfaces=32, accelerator="nvidia",
                  accelerators=8)
G6 = PoolSettings("g6", "lt-2", "subnet-1", "g6.xlarge", "spot", accelerator="nvidia", accelerators=1)
TRN = PoolSettings("trn", "lt-3", "subnet-1", "trn1.32xlarge", "on-demand", efa_interfaces=8, accelerator="neuron",
                   accelerators=16)
# The checks of issue 25 this part measures, as the checks' contract names them.
CHECKS = {"gpus", "neuron_devices", "efa_devices", "ecc_uncorrected", "dcgm_diag", "fsx_mounted", "nccl_efa_plugin",
          "metadata_refused", "names_resolve", "nccl_all_reduce_busbw_gbps", "nccl_transport", "fsx_write_mbps",
          "fsx_read_mbps"}
LUSTRE_MOUNT = "36 25 0:52 / {path} rw,relatime shared:20 - lustre 10.0.0.5@tcp:/abcdefgh rw,flock,lazystatfs\n"
ROOT_MOUNT = "25 1 259:1 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p1 rw,discard\n"


def stand_in(path: Path, body: str) -> str:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return str(path)


# --- GPUs, ECC, DCGM ----------------------------------------------------------------------------------------------


def test_gpus_and_uncorrected_ecc_come_from_one_nvidia_smi_call(tmp_path: Path) -> None:
    """nvidia-smi --query-gpu=index,ecc.errors.uncorrected.volatile.total --format=csv,noheader,nounits: one row per
    GPU; a GPU without ECC says [N/A]."""
    rows = ["0, 0", "1, 2", "2, [N/A]", "3, 5"]
    smi = stand_in(tmp_path / "nvidia-smi", "; ".join(f'echo "{r}"' for r in rows))
    measured = verify_probe.nvidia(smi)
    assert measured["gpus"] == {"count": len(rows)}
    assert measured["ecc_uncorrected"] == 2 + 5


def test_a_failing_nvidia_smi_is_an_error_not_zero_gpus(tmp_path: Path) -> None:
    smi = stand_in(tmp_path / "nvidia-smi", 'echo "NVIDIA-SMI has failed" >&2; exit 9')
    measured = verify_probe.nvidia(smi)
    assert "exited 9" in measured["gpus"]["error"] and "count" not in measured["gpus"]
    assert "error" in measured["ecc_uncorrected"]
    assert "not found" in verify_probe.nvidia(str(tmp_path / "absent"))["gpus"]["error"]


@pytest.fixture
def dcgmi(tmp_path: Path) -> Callable[[str, int], str]:
    """A dcgmi that prints a recorded report and exits with the given status; it notes its arguments."""
    def make(report: str, status: int = 0) -> str:
        return stand_in(tmp_path / "dcgmi", f'echo "$@" > {tmp_path}/dcgmi.args; cat {DCGM_REPORTS / report}; '
                                            f"exit {status}")
    return make


def test_dcgm_diagnostic_passes_on_a_clean_report(dcgmi: Callable[[str, int], str], tmp_path: Path) -> None:
    measured = verify_probe.dcgm_diag(1, dcgmi("p5-pass.json", 0))
    assert measured == {"level": 1, "passed": True, "failures": []}
    assert (tmp_path / "dcgmi.args").read_text().split() == ["diag", "-r", "1", "-j"]


def test_dcgm_diagnostic_names_the_failing_test_whatever_dcgmi_exits(dcgmi: Callable[[str, int], str]) -> None:
    for status in (0, 226):
        measured = verify_probe.dcgm_diag(3, dcgmi("p5-row-remap-pending.json", status))
        assert measured["level"] == 3 and measured["passed"] is False
        assert any("failed on GPU 3" in f for f in measured["failures"]), measured


def test_dcgm_diagnostic_that_could_not_run_fails_and_no_output_is_an_error(
        dcgmi: Callable[[str, int], str], tmp_path: Path) -> None:
    measured = verify_probe.dcgm_diag(1, dcgmi("runtime-error.json", 1))
    assert measured["passed"] is False and "could not run" in measured["failures"][0]
    silent = stand_in(tmp_path / "dcgmi-silent", "echo 'host engine not running' >&2; exit 1")
    assert "host engine not running" in verify_probe.dcgm_diag(1, silent)["error"]


# --- EFA, NCCL's plugin, Neuron -------------------------------------------------------------------------------------


def sysfs_rdma(root: Path, devices: dict[str, str | None]) -> Path:
    """/sys/class/infiniband as the kernel lays it out: each entry's `device` links to its PCI device, whose `driver`
    links to the driver's directory under /sys/bus/pci/drivers (None: a device without a driver bound)."""
    infiniband = root / "class" / "infiniband"
    infiniband.mkdir(parents=True)
    for i, (name, driver) in enumerate(devices.items()):
        pci = root / "devices" / "pci0000:00" / f"0000:00:{16 + i:02x}.0"
        pci.mkdir(parents=True)
        if driver:
            (root / "bus" / "pci" / "drivers" / driver).mkdir(parents=True, exist_ok=True)
            (pci / "driver").symlink_to(root / "bus" / "pci" / "drivers" / driver)
        (pci / "infiniband" / name).mkdir(parents=True)
        (infiniband / name).symlink_to(pci / "infiniband" / name)
        (pci / "infiniband" / name / "device").symlink_to(pci)
    return infiniband


def test_efa_devices_are_those_the_efa_driver_registered(tmp_path: Path) -> None:
    infiniband = sysfs_rdma(tmp_path, {"rdmap16s27": "efa", "rdmap17s27": "efa", "mlx5_0": "mlx5_core",
                                       "rdmap18s27": None})
    assert verify_probe.efa_devices(str(infiniband)) == {"count": 2, "devices": ["rdmap16s27", "rdmap17s27"]}
    assert verify_probe.efa_devices(str(tmp_path / "absent")) == {"count": 0, "devices": []}


def test_nccl_plugin_is_found_in_any_directory_the_image_uses(tmp_path: Path) -> None:
    dirs = (str(tmp_path / "lib" / "x86_64-linux-gnu"), str(tmp_path / "lib"))
    assert verify_probe.nccl_efa_plugin(dirs) == {"found": False, "path": None}
    Path(dirs[1]).mkdir(parents=True)
    (Path(dirs[1]) / NCCL_NET_PLUGIN_FILE).write_bytes(b"\x7fELF")
    assert verify_probe.nccl_efa_plugin(dirs) == {"found": True, "path": f"{dirs[1]}/{NCCL_NET_PLUGIN_FILE}"}


def test_the_probe_looks_where_the_image_puts_the_plugin() -> None:
    """build_image.sh's OFI_NCCL_DIRS, in its order, are the contract's AWS_OFI_NCCL_LIB_DIRS."""
    script = (ROOT / "gpucluster" / "node" / "build_image.sh").read_text()
    match = re.search(r"^OFI_NCCL_DIRS=\(([^)]*)\)", script, re.MULTILINE)
    assert match, "build_image.sh no longer names OFI_NCCL_DIRS"
    assert tuple(match.group(1).split()) == AWS_OFI_NCCL_LIB_DIRS


# --- /fsx -----------------------------------------------------------------------------------------------------------


def test_fsx_mounted_as_lustre_with_the_client_version(tmp_path: Path) -> None:
    mountinfo, version = tmp_path / "mountinfo", tmp_path / "version"
    mountinfo.write_text(ROOT_MOUNT + LUSTRE_MOUNT.format(path="/fsx"))
    version.write_text("2.15.6\n")  # as obd_sysfs.c version_show writes LUSTRE_VERSION_STRING
    assert verify_probe.fsx_mounted("/fsx", str(mountinfo), str(version)) == {
        "mounted": True, "type": "lustre", "lustre_version": "2.15.6"}


def test_fsx_version_from_lctl_when_sysfs_lacks_it(tmp_path: Path) -> None:
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(LUSTRE_MOUNT.format(path="/fsx"))
    lctl = stand_in(tmp_path / "lctl", f'echo "$@" > {tmp_path}/lctl.args; echo 2.16.1')
    measured = verify_probe.fsx_mounted("/fsx", str(mountinfo), str(tmp_path / "absent"), lctl)
    assert measured["lustre_version"] == "2.16.1"
    assert (tmp_path / "lctl.args").read_text().split() == ["get_param", "-n", "version"]


def test_fsx_that_is_not_lustre_is_not_mounted(tmp_path: Path) -> None:
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(ROOT_MOUNT)
    assert verify_probe.fsx_mounted("/fsx", str(mountinfo))["mounted"] is False
    mountinfo.write_text(ROOT_MOUNT + "40 25 0:60 / /fsx rw - nfs4 10.0.0.9:/ rw\n")
    assert verify_probe.fsx_mounted("/fsx", str(mountinfo)) == {"mounted": False, "type": "nfs4",
                                                                "lustre_version": None}


def test_sequential_throughput_writes_reads_back_and_cleans_up(tmp_path: Path) -> None:
    figures = verify_probe.sequential_throughput(str(tmp_path), mib=8, block=1 << 20)
    assert figures.write_mbps > 0 and figures.read_mbps > 0
    assert list(tmp_path.iterdir()) == []  # its file is gone


def test_throughput_of_a_size_that_is_not_whole_blocks_reads_it_all(tmp_path: Path) -> None:
    assert verify_probe.sequential_throughput(str(tmp_path), mib=5, block=3 << 20).read_mbps > 0  # else: "ended after"
    with pytest.raises(ValueError):
        verify_probe.sequential_throughput(str(tmp_path), mib=0)


def test_throughput_is_measured_only_on_lustre(tmp_path: Path) -> None:
    measured = verify_probe.fsx_throughput(str(tmp_path), 8, {"mounted": False}, "/fsx")
    assert "not a mounted Lustre" in measured["fsx_write_mbps"]["error"]
    assert "error" in measured["fsx_read_mbps"] and list(tmp_path.iterdir()) == []
    unwritable = verify_probe.fsx_throughput(str(tmp_path / "absent"), 8, {"mounted": True})
    assert "No such file" in unwritable["fsx_write_mbps"]["error"]


# --- instance metadata ----------------------------------------------------------------------------------------------


@pytest.fixture
def metadata() -> Iterator[Callable[[int, bytes], str]]:
    """An IMDSv2 stand-in on 127.0.0.1 whose token request (PUT latest/api/token) answers the status and body set."""
    answer: dict[str, tuple[int, bytes]] = {"token": (200, b"AQAEAE-token")}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_PUT(self) -> None:
            status, body = answer["token"] if self.path == "/latest/api/token" else (404, b"")
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    def serve(status: int, body: bytes) -> str:
        answer["token"] = (status, body)
        return f"http://127.0.0.1:{server.server_address[1]}"
    yield serve
    server.shutdown()
    server.server_close()


def test_metadata_that_hands_a_job_a_token_is_not_refused(metadata: Callable[[int, bytes], str]) -> None:
    assert verify_probe.metadata_refused(metadata(200, b"AQAEAE-token")) == {"refused": False, "answer": "a token"}


def test_metadata_answering_an_error_is_refused(metadata: Callable[[int, bytes], str]) -> None:
    assert verify_probe.metadata_refused(metadata(403, b"")) == {"refused": True, "answer": "HTTP 403"}


def test_metadata_unreachable_or_silent_is_refused() -> None:
    with socket.socket() as closed:  # a port nothing listens on: the connection is refused
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    assert verify_probe.metadata_refused(f"http://127.0.0.1:{port}")["refused"] is True
    with socket.socket() as silent:  # accepts the connection (the backlog) and never answers: a timeout
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        measured = verify_probe.metadata_refused(f"http://127.0.0.1:{silent.getsockname()[1]}", seconds=0.2)
    assert measured["refused"] is True and "timed out" in measured["answer"]


# --- names ----------------------------------------------------------------------------------------------------------


def test_names_resolve_counts_the_jobs_nodes_that_resolve() -> None:
    """The job's node list in Slurm's form, expanded; names under .invalid never resolve (RFC 6761)."""
    measured = verify_probe.names_resolve("localhost,gpucluster-absent-[1-2].invalid")
    assert measured == {"nodes": 1, "unresolved": ["gpucluster-absent-1.invalid", "gpucluster-absent-2.invalid"]}


# --- the node's JSON ------------------------------------------------------------------------------------------------


@pytest.fixture
def sources(tmp_path: Path, dcgmi: Callable[[str, int], str]) -> Sources:
    """A p5 node's view, healthy: eight GPUs, 32 EFA devices, the plugin, /fsx on Lustre, metadata unreachable."""
    (tmp_path / "mountinfo").write_text(ROOT_MOUNT + LUSTRE_MOUNT.format(path=str(tmp_path / "fsx")))
    (tmp_path / "version").write_text("2.15.6\n")
    (tmp_path / "dev").mkdir()
    for i in range(16):
        (tmp_path / "dev" / f"neuron{i}").touch()
    plugin = tmp_path / "ofi"
    plugin.mkdir()
    (plugin / NCCL_NET_PLUGIN_FILE).touch()
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    return Sources(nvidia_smi=stand_in(tmp_path / "nvidia-smi", "; ".join(f'echo "{i}, 0"' for i in range(8))),
                   dcgmi=dcgmi("p5-pass.json", 0), dev_dir=str(tmp_path / "dev"),
                   infiniband_dir=str(sysfs_rdma(tmp_path / "sys", {f"rdmap{i}s27": "efa" for i in range(32)})),
                   nccl_plugin_dirs=(str(plugin),), shared_dir=str(tmp_path / "fsx"),
                   mountinfo=str(tmp_path / "mountinfo"), lustre_version_file=str(tmp_path / "version"),
                   metadata_url=f"http://127.0.0.1:{port}")


def test_a_p5_node_measures_every_check_of_its_kind(sources: Sources, tmp_path: Path) -> None:
    (tmp_path / "fsx").mkdir()
    measured = verify_probe.probe(P5, "localhost", str(tmp_path / "fsx"), fsx_mib=4, sources=sources)
    assert set(measured) == {"gpus", "ecc_uncorrected", "dcgm_diag", "efa_devices", "nccl_efa_plugin", "fsx_mounted",
                             "fsx_write_mbps", "fsx_read_mbps", "metadata_refused", "names_resolve"}
    assert measured["gpus"] == {"count": P5.accelerators} and measured["ecc_uncorrected"] == 0
    assert measured["dcgm_diag"]["level"] == 1 and measured["dcgm_diag"]["passed"] is True
    assert measured["efa_devices"]["count"] == P5.efa_interfaces and measured["nccl_efa_plugin"]["found"] is True
    assert measured["fsx_mounted"]["mounted"] is True and measured["fsx_write_mbps"] > 0
    assert measured["metadata_refused"]["refused"] is True and measured["names_resolve"]["nodes"] == 1
    assert json.loads(json.dumps(measured)) == measured


def test_deep_runs_dcgm_level_3(sources: Sources, tmp_path: Path) -> None:
    measured = verify_probe.probe(G6, "localhost", str(tmp_path), deep=True, fsx_mib=4, sources=sources)
    assert measured["dcgm_diag"]["level"] == 3
    assert (tmp_path / "dcgmi.args").read_text().split() == ["diag", "-r", "3", "-j"]
    assert "efa_devices" not in measured and "nccl_efa_plugin" not in measured  # g6.xlarge has no EFA


def test_a_trainium_node_counts_neuron_devices_not_gpus(sources: Sources, tmp_path: Path) -> None:
    measured = verify_probe.probe(TRN, "localhost", str(tmp_path), fsx_mib=4, sources=sources)
    assert measured["neuron_devices"] == {"count": 16} and measured["efa_devices"]["count"] == 32
    assert not {"gpus", "ecc_uncorrected", "dcgm_diag", "nccl_efa_plugin"} & set(measured)


def test_main_prints_the_pools_readings_as_one_json_object(
        sources: Sources, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The program as the verify jobs run it: the node's pool from node.env and the settings, the user's job
    --without-dcgm, root's --dcgm-only (dcgmi found on PATH). Seams: the settings and node.env a node has, and the
    sources fixture's stand-ins for the tools and files this machine lacks (main's own Sources() is production's)."""
    monkeypatch.setattr(verify_probe, "read_env_file", lambda: {"GPUCLUSTER_POOL": P5.name})
    monkeypatch.setattr(ClusterSettings, "load",
                        classmethod(lambda cls: ClusterSettings("c", "us-east-1", {P5.name: P5})))
    monkeypatch.setattr(verify_probe, "Sources", lambda fsx_type: dataclasses.replace(sources, fsx_type=fsx_type))
    monkeypatch.setenv("SLURM_JOB_NODELIST", "localhost")
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")  # the dcgmi stand-in
    (tmp_path / "fsx").mkdir()

    assert verify_probe.main(["verify_probe.py", "--without-dcgm", "--fsx-mib=1", f"--fsx-dir={tmp_path / 'fsx'}"]) == 0
    measured = json.loads(capsys.readouterr().out)
    assert set(measured) == {"gpus", "ecc_uncorrected", "efa_devices", "nccl_efa_plugin", "fsx_mounted",
                             "fsx_write_mbps", "fsx_read_mbps", "metadata_refused", "names_resolve"}
    assert measured["gpus"] == {"count": P5.accelerators} and measured["names_resolve"]["nodes"] == 1
    assert measured["fsx_write_mbps"] > 0 and not list((tmp_path / "fsx").iterdir())  # its file removed

    assert verify_probe.main(["verify_probe.py", "--dcgm-only", "--deep"]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "dcgm_diag": {"level": verify.DCGM_DEEP_LEVEL, "passed": True, "failures": []}}
    assert (tmp_path / "dcgmi.args").read_text().split() == ["diag", "-r", str(verify.DCGM_DEEP_LEVEL), "-j"]


def test_every_check_name_is_the_issues() -> None:
    names = {value for module in (verify_probe, nccl_tests) for key, value in vars(module).items()
             if key.isupper() and isinstance(value, str) and value in CHECKS}
    assert names == CHECKS


def test_the_probe_runs_as_a_program_with_the_system_python() -> None:
    """The entry the verify job runs on each node (standard library only: its imports resolve without the venv)."""
    done = subprocess.run(["/usr/bin/python3", str(ROOT / "gpucluster" / "node" / "verify_probe.py"), "--help"],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and "--deep" in done.stdout, done.stderr


# --- all_reduce_perf's output ---------------------------------------------------------------------------------------


def output(name: str) -> str:
    return (NCCL_OUTPUTS / name).read_text()


def found(pattern: str, text: str) -> str:
    match = re.search(pattern, text, re.MULTILINE)
    assert match, pattern
    return match.group(match.lastindex or 0)


def ranks(text: str) -> int:
    return len(re.findall(r"^#  Rank ", text, re.MULTILINE))


@pytest.mark.parametrize("name", ["all_reduce_efa.txt", "all_reduce_socket.txt", "all_reduce_old.txt"])
def test_the_table_is_read_column_by_column(name: str) -> None:
    """Each half's busbw is its algbw x 2(n-1)/n (AllReduce, nccl-tests doc/PERFORMANCE.md), the largest row is the
    run's maxBytes, and the average line is the mean of every busbw: the columns were read as nccl-tests wrote them."""
    text = output(name)
    result = nccl_tests.parse(text)
    n = ranks(text)
    for row in result.rows:
        for half in (row.out_of_place, row.in_place):
            assert half.busbw_gbps == pytest.approx(half.algbw_gbps * 2 * (n - 1) / n, abs=0.02)  # both printed to 0.01
            assert half.algbw_gbps == pytest.approx(row.size_bytes / 1e9 / (half.time_us / 1e6), rel=1e-3)
    assert result.largest.size_bytes == int(found(r"maxBytes (\d+)", text))
    busbws = [h.busbw_gbps for row in result.rows for h in (row.out_of_place, row.in_place)]
    assert result.average_busbw_gbps == pytest.approx(sum(busbws) / len(busbws), abs=0.01)
    assert result.busbw_gbps == result.largest.out_of_place.busbw_gbps
    assert result.wrong == 0 and result.out_of_bounds == 0
    assert nccl_tests.measurements(text)["nccl_all_reduce_busbw_gbps"] == {"min": result.busbw_gbps,
                                                                           "bytes": result.largest.size_bytes}


def test_a_sweep_that_stopped_short_of_the_plans_size_fails_whatever_its_bandwidth() -> None:
    """The reading's "bytes" is the table's largest size: judged against a plan that asks a larger one it fails (a
    busbw read at a small size is no answer to a floor published at a large one); against its own size it passes."""
    text = output("all_reduce_efa.txt")
    reading = nccl_tests.measurements(text)[verify.NCCL_ALL_REDUCE_BUSBW_GBPS]
    swept, busbw = reading["bytes"], reading["min"]

    def against(plan_bytes: int) -> verify.Result:
        check = verify.Check("p", verify.NCCL_ALL_REDUCE_BUSBW_GBPS, {"min": busbw, "bytes": plan_bytes})
        return verify.judge_reading(check, reading)

    assert against(swept).result == verify.PASS
    short = against(2 * swept)
    assert short.result == verify.FAIL and f"bytes {swept} where the plan asks {2 * swept}" in short.fix


def test_efa_is_the_transport_though_the_socket_transport_logs_too() -> None:
    text = output("all_reduce_efa.txt")
    assert "NET/Socket : Using" in text
    assert nccl_tests.measurements(text)["nccl_transport"] == {"provider": "efa", "network": "Libfabric"}


def test_sockets_are_named_as_the_transport() -> None:
    assert nccl_tests.measurements(output("all_reduce_socket.txt"))["nccl_transport"] == {
        "provider": "socket", "network": "Socket"}


def test_older_aws_ofi_nccl_lines_are_read() -> None:
    assert nccl_tests.transport(output("all_reduce_old.txt")).as_dict() == {"provider": "efa",
                                                                             "network": "AWS Libfabric"}


def test_ranks_that_disagree_name_every_transport() -> None:
    text = output("all_reduce_efa.txt")
    line = found(r"^p5-od-2:\S+ \[7\] NCCL INFO Using network Libfabric$", text)
    mixed = text.replace(line, line.replace("Libfabric", "Socket"))
    assert nccl_tests.transport(mixed).provider == "efa,socket"


def test_wrong_values_make_the_bandwidth_an_error() -> None:
    text = output("all_reduce_wrong.txt")
    result = nccl_tests.parse(text)
    assert result.wrong == result.out_of_bounds > 0
    assert "wrong values" in nccl_tests.measurements(text)["nccl_all_reduce_busbw_gbps"]["error"]


def test_a_run_without_validation_still_gives_its_bandwidth() -> None:
    """-c 0: nccl-tests writes N/A in place of #wrong (writeBenchmarkLineBody)."""
    def unvalidated(line: str) -> str:
        cells = line.split()
        if not cells or not cells[0].isdigit():
            return line
        cells[8] = cells[12] = "N/A"
        return "  ".join(cells)
    text = "\n".join(unvalidated(line) for line in output("all_reduce_efa.txt").splitlines())
    result = nccl_tests.parse(text)
    assert result.wrong is None and result.busbw_gbps == nccl_tests.parse(output("all_reduce_efa.txt")).busbw_gbps


def test_a_timestamp_column_moves_nothing() -> None:
    """-S 1: the header ends in `timestamp` and each row in a "%Y-%m-%d %H:%M:%S" time (src/util.cu)."""
    lines = []
    for line in output("all_reduce_efa.txt").splitlines():
        if line.startswith("#") and "busbw" in line.split():
            line += "          timestamp"
        elif line.split() and line.split()[0].isdigit():
            line += "  2026-09-15 10:42:07"
        lines.append(line)
    assert nccl_tests.parse("\n".join(lines)) == nccl_tests.parse(output("all_reduce_efa.txt"))


def last_row(text: str, change: Callable[[list[str]], list[str]]) -> str:
    """The output with its last table row's cells changed."""
    lines = text.splitlines()
    at = max(i for i, line in enumerate(lines) if line.split() and line.split()[0].isdigit())
    lines[at] = "  ".join(change(lines[at].split()))
    return "\n".join(lines)


def test_the_bandwidth_is_the_out_of_place_half_as_the_catalogs_figures_were_published() -> None:
    """spec/catalog.py's figures are out-of-place busbw: a slower in-place half changes the reading not at all."""
    text = output("all_reduce_efa.txt")
    published = nccl_tests.parse(text).largest.out_of_place.busbw_gbps
    slow_in_place = last_row(text, lambda cells: [*cells[:11], f"{published / 2:.2f}", *cells[12:]])
    assert nccl_tests.parse(slow_in_place).largest.in_place.busbw_gbps == pytest.approx(published / 2, abs=0.01)
    assert nccl_tests.measurements(slow_in_place)[verify.NCCL_ALL_REDUCE_BUSBW_GBPS]["min"] == published


# awsome-distributed-training's published two-node tables (tests/nccl-tests/README.md): the source of the catalog's
# all_reduce figures (spec/catalog.py ALL_REDUCE_BUSBW), read here by the parser that judges a run against them.
PUBLISHED = {"all_reduce_p5_published.txt": "p5.48xlarge", "all_reduce_p4de_published.txt": "p4de.24xlarge"}
PUBLISHED_RANKS = 16  # two nodes of eight GPUs, one rank each (the README's sbatch: --ntasks-per-node 8)


@pytest.mark.parametrize(("name", "itype"), PUBLISHED.items())
def test_the_published_tables_read_as_the_catalogs_figures(name: str, itype: str) -> None:
    """The recorded output, srun's "0: " labels and all: every row's busbw is its algbw x 2(n-1)/n, and the largest
    size's out-of-place busbw is the figure the catalog publishes for the type."""
    read = nccl_tests.table(output(name))
    n = PUBLISHED_RANKS
    for row in read.rows:
        for half in (row.out_of_place, row.in_place):
            assert half.busbw_gbps == pytest.approx(half.algbw_gbps * 2 * (n - 1) / n, abs=0.02)
    figure = catalog.ALL_REDUCE_BUSBW[itype]
    biggest = nccl_tests.largest(read.rows)
    assert (biggest.size_bytes, biggest.out_of_place.busbw_gbps) == (figure.message_bytes, figure.published_gbps)
    # The README shows the table without its footer ("with a lot more information"): as a run's whole output, it
    # would be one that did not finish.
    assert (read.out_of_bounds, read.average_busbw_gbps) == (None, None)
    with pytest.raises(nccl_tests.NcclTestsError, match="did not finish"):
        nccl_tests.parse(output(name))


def test_srun_labels_are_read_off_every_line() -> None:
    """`srun --label` prefixes each task's lines with its id, right-aligned ("0: ", " 9: " among 16 tasks): the
    table and NCCL's log read as they do without it."""
    text = output("all_reduce_efa.txt")
    labelled = "\n".join(f"{i % 16:2d}: {line}" for i, line in enumerate(text.splitlines()))
    assert nccl_tests.measurements(labelled) == nccl_tests.measurements(text)
    assert nccl_tests.parse(labelled) == nccl_tests.parse(text)


@pytest.mark.parametrize(("mangle", "said"), [
    (lambda text: "", "no nccl-tests result table"),
    (lambda text: text.split("# Out of bounds")[0], "did not finish"),
    (lambda text: re.sub(r"^ +\d+ .*\n", "", text, flags=re.MULTILINE), "no row"),
    (lambda text: last_row(text, lambda cells: [*cells[:7], "4x4.52", *cells[8:]]), "not a number"),
    (lambda text: last_row(text, lambda cells: cells[:7]), "cells under a header"),
])
def test_malformed_output_is_a_clear_error_never_a_zero(mangle: Callable[[str], str], said: str) -> None:
    text = mangle(output("all_reduce_efa.txt"))
    with pytest.raises(nccl_tests.NcclTestsError, match=said):
        nccl_tests.parse(text)
    assert said in nccl_tests.measurements(text)["nccl_all_reduce_busbw_gbps"]["error"]


def test_a_log_without_nccls_choice_is_an_error() -> None:
    lines = output("all_reduce_efa.txt").splitlines()
    table_only = "\n".join(line for line in lines if "NCCL INFO" not in line)
    assert "NCCL_DEBUG=INFO" in nccl_tests.measurements(table_only)["nccl_transport"]["error"]
    no_provider = "\n".join(line for line in lines if "Selected provider" not in line)
    with pytest.raises(nccl_tests.NcclTestsError, match="no `NET/OFI Selected provider`"):
        nccl_tests.transport(no_provider)


# --- the probe's readings judged against the plan ------------------------------------------------------------------

THROUGHPUT = {"fsx_write_mbps", "fsx_read_mbps"}  # this machine's disk, not FSx: its figures say nothing here


def judged(measured: dict[str, object], **changes: object) -> dict[str, verify.Result]:
    """team-a's p5-spot pool planned for one node, each of the node's checks judged on the probe's reading."""
    checks = verify_plan.plan(load_stack(ROOT / "stacks" / "Pulumi.team-a.yaml"),
                              verify_plan.Options(pools=("p5-spot",), nodes=1))
    return {c.check: verify.judge_reading(c, {**measured, **changes}.get(c.check))
            for c in checks if c.check in measured and c.check not in THROUGHPUT}


def test_a_healthy_nodes_readings_pass_the_plan(sources: Sources, tmp_path: Path) -> None:
    (tmp_path / "fsx").mkdir()
    measured = verify_probe.probe(P5, "localhost", str(tmp_path / "fsx"), fsx_mib=4, sources=sources)
    results = judged(measured)
    assert set(results) == set(measured) - THROUGHPUT
    assert {name: r.result for name, r in results.items() if r.result != "pass"} == {}
    assert results["gpus"].measured == 8 and results["dcgm_diag"].measured is True


def test_a_nodes_faults_fail_their_checks_saying_what_was_read(sources: Sources, tmp_path: Path,
                                                                dcgmi: Callable[[str, int], str]) -> None:
    (tmp_path / "fsx").mkdir()
    measured = verify_probe.probe(P5, "localhost", str(tmp_path / "fsx"), fsx_mib=4, sources=sources)
    results = judged(measured, gpus={"count": 7},
                     dcgm_diag=verify_probe.dcgm_diag(1, dcgmi("p5-row-remap-pending.json", 226)),
                     names_resolve={"nodes": 0, "unresolved": ["p5-spot-1"]},
                     efa_devices={"error": "no /sys/class/infiniband"})
    assert {n for n, r in results.items() if r.result == "fail"} == {"gpus", "dcgm_diag", "names_resolve",
                                                                     "efa_devices"}
    assert results["gpus"].measured == 7
    assert "failed on GPU 3" in results["dcgm_diag"].fix
    assert results["names_resolve"].fix.startswith("unresolved ['p5-spot-1']")
    assert results["efa_devices"].measured is None and results["efa_devices"].fix.startswith("no /sys/class")


def test_a_diagnostic_at_another_level_than_the_plans_fails(sources: Sources, tmp_path: Path) -> None:
    """A level-1 diagnostic that passed is no answer to a plan that asks level 3 (--deep)."""
    check = verify.Check("p5-spot", verify.DCGM_DIAG, {"level": verify.DCGM_DEEP_LEVEL})
    shallow = verify_probe.dcgm_diag(verify.DCGM_LEVEL, sources.dcgmi)
    result = verify.judge_reading(check, shallow)
    assert result.result == "fail" and result.fix.startswith("level 1 where the plan asks 3"), result
    assert verify.judge_reading(check, verify_probe.dcgm_diag(verify.DCGM_DEEP_LEVEL, sources.dcgmi)).result == "pass"


def test_the_probe_refuses_a_size_below_one_mib_in_one_line() -> None:
    probe = ROOT / "gpucluster" / "node" / "verify_probe.py"
    done = subprocess.run(["/usr/bin/python3", str(probe), "--fsx-mib", "0"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "--fsx-mib must be at least 1" in done.stderr and len(done.stderr) < 1000
