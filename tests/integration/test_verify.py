"""`gpucluster verify` on the head node of a local cluster: real Slurm scales the pool from zero for the login user's
job, real srun with PMIx starts the all_reduce_perf stand-in (tests/rehearsal/all_reduce_perf, MPI over the
rehearsal image's Open MPI, nccl-tests' output), the probe measures real /fsx throughput and the real lockdown, root's
second job runs DCGM's diagnostic, and the head's Prometheus answers for its targets. One cluster for every case, in
sequence: the pass, then the failures each named by its check, then `verify --last`."""

from __future__ import annotations

import stat
import subprocess
from pathlib import Path
from typing import Callable

import pytest

from conftest import FIXTURES
from gpucluster.contract import verify as v
from gpucluster.contract.lockdown import IMDS_CHAIN
from gpucluster.contract.settings import LOGIN_USER, VERIFY_DIR, VERIFY_PLAN, VERIFY_TEXTFILE
from gpucluster.spec.model import Stack, load_stack
from local_cluster import LocalCluster

pytestmark = pytest.mark.rehearsal

POOL = "standby"
FSX_MIB = 16  # per node: enough to time a write and a read through this machine's disk in well under a second
SWEEP_BYTES = 1 << 20  # MPI over loopback: a MiB shows the format and the transport; a p5's 16 GiB would take minutes


def existing_file_system(tmp_path: Path) -> Stack:
    """The local stack on an existing file system: the rehearsal's /fsx is this machine's disk, which no FSx
    throughput floor describes, so the plan expects no figure and the run records the measured one with a warning
    (render/verify.fsx_floors_mbps: an existing file system's size and tier are not in the stack). Its idle nodes stay
    up a minute, not 15 s: the second run finds the first run's nodes with the faults the test gives them."""
    text = (FIXTURES / "Pulumi.local.yaml").read_text().replace("suspend_time_seconds: 15", "suspend_time_seconds: 60")
    created = "      lustre:\n        deployment_type: SCRATCH_2\n        storage_capacity_gib: 1200\n"
    assert created in text
    existing = ("      lustre:\n        file_system_id: fs-0123456789abcdef0\n"
                "        dns_name: fs-0123456789abcdef0.fsx.us-east-1.amazonaws.com\n        mount_name: abcdefgh\n")
    (tmp_path / "Pulumi.local.yaml").write_text(text.replace(created, existing))
    return load_stack(tmp_path / "Pulumi.local.yaml")


def with_efa_pools_nccl_checks(cluster: LocalCluster) -> None:
    """The bundle's plan for the head, with the standby pool asked what the plan asks of EFA pools' all_reduce: the
    provider NCCL chose, and a sweep size of the plan's choosing. The local pools are g6.xlarge (no EFA: this machine
    has no EFA device for efa_devices to count), and the catalog publishes no all_reduce floor for them."""
    path = cluster.head.path(VERIFY_PLAN)
    checks = v.plan_from_json(path.read_text())
    busbw = next(c for c in checks if (c.pool, c.check) == (POOL, v.NCCL_ALL_REDUCE_BUSBW_GBPS))
    assert "min" not in busbw.expect  # no published figure: judged warn
    changed = [v.Check(c.pool, c.check, {**c.expect, "bytes": SWEEP_BYTES}) if c == busbw else c for c in checks]
    changed.insert(checks.index(busbw) + 1, v.Check(POOL, v.NCCL_TRANSPORT, {"provider": "efa"}))
    path.write_text(v.plan_json(changed))


def verify(cluster: LocalCluster, fsx_type: str, *args: str) -> tuple[int, list[v.Result], str]:
    """`gpucluster verify --json ...` as root on the head; its AWS calls go where the node image's .pth sends the
    system Python's (the command runs the image's venv)."""
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root",
           "AWS_ENDPOINT_URL": cluster.head.aws.url, "AWS_EC2_METADATA_SERVICE_ENDPOINT": cluster.head.imds.url}
    done = cluster.head.enter("/usr/local/bin/gpucluster", "verify", "--json", *args, env=env, check=False,
                              timeout=300)
    assert done.returncode in (0, 1), done.stderr[-3000:]
    return done.returncode, v.run_from_json(done.stdout), done.stderr


def by_check(results: list[v.Result]) -> dict[str, v.Result]:
    return {r.check: r for r in results if r.pool == POOL}


def test_verify_passes_on_nodes_scaled_from_zero_then_names_each_fault(
        start_cluster: Callable[..., LocalCluster], tmp_path: Path) -> None:
    cluster = start_cluster(existing_file_system(tmp_path))
    with_efa_pools_nccl_checks(cluster)
    fsx_type = cluster.head.enter("findmnt", "-n", "-o", "FSTYPE", "/fsx").stdout.strip()
    run = ["--pool", POOL, f"--fsx-mib={FSX_MIB}", f"--fsx-type={fsx_type}"]
    assert not cluster.instances()

    code, results, err = verify(cluster, fsx_type, *run)
    checks = by_check(results)
    failed = {c: r.fix for c, r in checks.items() if r.result == v.FAIL}
    assert code == 0 and not failed, (failed, err[-3000:])
    # Warned only where the plan knows no figure; every other check passed.
    assert {c for c, r in checks.items() if r.result == v.WARN} == {
        v.NCCL_ALL_REDUCE_BUSBW_GBPS, v.FSX_WRITE_MBPS, v.FSX_READ_MBPS}
    assert {node for node, _ in cluster.boots} == {f"{POOL}-1", f"{POOL}-2"}  # launched for the run
    scale = checks[v.SCALE_FROM_ZERO_SECONDS]
    assert isinstance(scale.measured, float) and 0 < scale.measured <= float(str(scale.expect["max"]))
    assert checks[v.GPUS].measured == checks[v.GPUS].expect["count"]
    assert checks[v.NAMES_RESOLVE].measured == 2 and checks[v.METADATA_REFUSED].measured is True
    assert checks[v.DCGM_DIAG].measured is True and checks[v.FSX_MOUNTED].measured is True
    assert checks[v.NCCL_TRANSPORT].measured == "efa"
    for figure in (v.NCCL_ALL_REDUCE_BUSBW_GBPS, v.FSX_WRITE_MBPS, v.FSX_READ_MBPS):
        measured = checks[figure].measured
        assert isinstance(measured, float) and measured > 0, checks[figure]
    assert checks[v.PROMETHEUS_SCRAPES].measured == 2
    assert {(r.check, r.result) for r in results if r.pool == v.CLUSTER} == {
        (v.BUDGET_TOPIC, v.PASS), (v.GPU_IDLE_RULE, v.PASS)}, results

    # The run is kept on /fsx, root's and readable by all; the board has the pool's last result per check.
    kept = sorted((cluster.fsx / Path(VERIFY_DIR).relative_to("/fsx")).glob("*.json"))
    assert [p.name.endswith(f"-{POOL}.json") for p in kept] == [True]
    assert v.run_from_json(kept[0].read_text()) == results
    assert stat.S_IMODE(kept[0].stat().st_mode) == 0o644 and kept[0].stat().st_uid == 0
    board = cluster.head.path(VERIFY_TEXTFILE).read_text()
    assert f'{v.RESULT_METRIC}{{check="gpus",pool="{POOL}"}} {v.RESULT_CODES[v.PASS]}' in board, board
    assert f'{v.RUN_TIME_METRIC}{{pool="{POOL}"}} ' in board

    # Faults, each where the check looks, while the nodes are still up. standby-2's job sees one GPU fewer than the
    # node has (a device that is not the job's to open): a GPU the driver lost is the Prolog's health check's to find
    # (as root, before any job: the node is drained and replaced, tests/test_health.py), so this is the loss only a
    # job sees. NCCL takes its socket transport, and the lockdown lets the login user's jobs reach instance metadata.
    gpus = int(checks[v.GPUS].expect["count"])
    rows = "".join(f'echo "{i}, 0"\n' for i in range(gpus - 1))
    job_view = f'#!/bin/sh\n{rows}if [ "$(id -u)" = 0 ]; then echo "{gpus - 1}, 0"; fi\n'
    (cluster.root / "nvidia-smi").write_text(job_view)
    cluster.node(f"{POOL}-2").enter("cp", str(cluster.root / "nvidia-smi"), "/usr/local/bin/nvidia-smi")
    (cluster.fsx / "rehearsal-nccl-transport").write_text("socket\n")
    uid = cluster.head.enter("id", "-u", LOGIN_USER).stdout.strip()
    let_through = ["iptables", "-w", "-I", IMDS_CHAIN, "1", "-m", "owner", "--uid-owner", uid, "-j", "ACCEPT"]
    subprocess.run([*cluster.network.prefix(), *let_through], check=True)
    with cluster.link_local_metadata():
        code, results, err = verify(cluster, fsx_type, *run)
    checks = by_check(results)
    failures = {c: r for c, r in checks.items() if r.result == v.FAIL}
    assert code == 1 and set(failures) == {v.GPUS, v.NCCL_TRANSPORT, v.METADATA_REFUSED}, (
        [(r.check, r.measured, r.fix) for r in results], cluster.boots, err[-3000:])
    assert failures[v.GPUS].measured == 0 and failures[v.GPUS].fix.startswith(f"{POOL}-2: ")
    assert failures[v.NCCL_TRANSPORT].measured == "socket"
    assert failures[v.METADATA_REFUSED].measured is False and "a token" in failures[v.METADATA_REFUSED].fix
    assert {node for node, _ in cluster.boots} == {f"{POOL}-1", f"{POOL}-2"}  # the same nodes: no fresh instance
    # Those nodes were up when the job was submitted: nothing scaled, and the run says so instead of passing.
    scale = checks[v.SCALE_FROM_ZERO_SECONDS]
    assert scale.result == v.WARN and scale.measured is None and "already up" in scale.fix, scale

    # `verify --last` prints the newest run as it was kept, and its verdict.
    last = cluster.head.enter("/usr/local/bin/gpucluster", "verify", "--last", "--json", check=False)
    assert last.returncode == 1 and v.run_from_json(last.stdout) == results, last.stderr
    table = cluster.head.enter("/usr/local/bin/gpucluster", "verify", "--last", check=False).stdout
    assert any(line.split()[:3] == [POOL, v.GPUS, v.FAIL] for line in table.splitlines()), table
