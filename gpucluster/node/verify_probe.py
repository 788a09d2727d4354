#!/usr/bin/python3
"""`gpucluster verify`'s measurements on one compute node, run as a step of the verify job (one task per node):
`python3 verify_probe.py [--deep] [--fsx-mib N] [--fsx-dir DIR] [--dcgm-only | --without-dcgm]` prints one
JSON object, {check name: measured}, for what the node's pool has (DCGM's host engine answers root only: the verify
run measures the rest in the user's job and the diagnostic in root's, verify_run.py). It measures and judges nothing:
the checks' contract (gpucluster/contract/verify.py) compares each figure with the plan's expectation.

What each check measures (a probe that cannot measure gives {"error": why}, never a figure it did not see):
- `gpus` {"count": N} (nvidia-smi), `ecc_uncorrected` N (uncorrected ECC errors since the driver loaded, all GPUs),
  `dcgm_diag` {"level": L, "passed": bool, "failures": [...]} (`dcgmi diag -r L -j`; L is 1, 3 with --deep);
- `neuron_devices` {"count": N} (/dev/neuron*);
- `efa_devices` {"count": N, "devices": [...]} (the RDMA devices the efa driver registered), `nccl_efa_plugin`
  {"found": bool, "path": ...} (aws-ofi-nccl where the image puts it);
- `fsx_mounted` {"mounted": bool, "type": ..., "lustre_version": ...}; `fsx_write_mbps` and `fsx_read_mbps` (MB/s,
  10^6 bytes a second as AWS states FSx throughput) of one sequential file on /fsx;
- `metadata_refused` {"refused": bool, "answer": ...}: whether a job can get an IMDSv2 token;
- `names_resolve` {"nodes": N, "unresolved": [...]}: the job's nodes (SLURM_JOB_NODELIST) whose names resolve here.

The across-nodes figures (`nccl_all_reduce_busbw_gbps`, `nccl_transport`) come from nccl_tests.py, which reads
all_reduce_perf's output. Standard library only (the system python3).
"""

from __future__ import annotations

import argparse
import getpass
import json
import mmap
import os
import socket
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the library this program is part of (the bundle's lib/)
from gpucluster.contract.hostlist import expand_hostlist
from gpucluster.contract.settings import (
    AWS_OFI_NCCL_LIB_DIRS,
    IMDS_URL,
    NCCL_NET_PLUGIN_FILE,
    SHARED_DIR,
    SHARED_HOME,
    ClusterSettings,
    PoolSettings,
    read_env_file,
)
from gpucluster.contract.verify import (
    DCGM_DEEP_LEVEL,
    DCGM_DIAG,
    DCGM_LEVEL,
    DCGM_LEVEL_SECONDS,
    ECC_UNCORRECTED,
    EFA_DEVICES,
    FSX_MOUNTED,
    FSX_READ_MBPS,
    FSX_WRITE_MBPS,
    GPUS,
    METADATA_REFUSED,
    NAMES_RESOLVE,
    NCCL_EFA_PLUGIN,
    NEURON_DEVICES,
)
from gpucluster.node.devices import (
    TOOL_DIRS,
    count_neuron_devices,
    dcgm_problems,
    filesystem_type,
    first_file,
    gpu_rows,
    tool,
)

EFA_DRIVER = "efa"  # the PCI driver's name (linux drivers/infiniband/hw/efa/efa_main.c: DRV_MODULE_NAME)
LUSTRE_FS_TYPE = "lustre"
# Lustre's client writes its version, "2.15.6\n", to /sys/fs/lustre/version (lustre/obdclass/obd_sysfs.c version_show,
# the "lustre" kset under /sys/fs); `lctl get_param -n version` reads the same parameter.
LUSTRE_VERSION_FILE = "/sys/fs/lustre/version"
METADATA_SECONDS = 2.0  # a job's token request fails at once (blocked) or times out (hop limit): neither takes long
FSX_MIB = 4096  # per node: long enough that opening the file and the first RPCs do not dominate the figure
FSX_BLOCK = 16 << 20  # one write or read; the same random bytes each time, so nothing can compress them
MB = 1_000_000


def error(why: str) -> dict[str, Any]:
    return {"error": why}


def nvidia(nvidia_smi: str = "nvidia-smi") -> dict[str, Any]:
    """`gpus` and `ecc_uncorrected` from one nvidia-smi call (devices.gpu_rows). A GPU without ECC reports "[N/A]":
    it counts no errors."""
    rows, why = gpu_rows(nvidia_smi)
    if rows is None:
        return {GPUS: error(why), ECC_UNCORRECTED: error(why)}
    return {GPUS: {"count": len(rows)},
            ECC_UNCORRECTED: sum(int(row[1]) for row in rows if len(row) > 1 and row[1].isdigit())}


def dcgm_diag(level: int, dcgmi: str = "dcgmi") -> dict[str, Any]:
    """`dcgmi diag -r <level> -j`, judged by the Kubernetes burn-in's reading of DCGM's report (devices.dcgm_problems):
    a failed test, a diagnostic that could not run or ran no test is a failure, each named. The report is read
    whatever dcgmi's exit status (a failing diagnostic need not exit 0); no output at all is an error."""
    out, why = tool(dcgmi, "diag", "-r", str(level), "-j", seconds=DCGM_LEVEL_SECONDS[level], check=False)
    if out is None:
        return error(why)
    problems, _ = dcgm_problems(out)
    return {"level": level, "passed": not problems, "failures": problems}


def efa_devices(infiniband_dir: str = "/sys/class/infiniband") -> dict[str, Any]:
    """The RDMA devices whose driver is efa (<device>/device/driver links to the PCI driver's directory). Their names
    are not the proof: rdma-core's udev rules rename them (rdmap<bus>s<slot>)."""
    root = Path(infiniband_dir)
    names = sorted(entry.name for entry in root.iterdir()
                   if Path(os.path.realpath(entry / "device" / "driver")).name == EFA_DRIVER) if root.is_dir() else []
    return {"count": len(names), "devices": names}


def nccl_efa_plugin(directories: tuple[str, ...] = AWS_OFI_NCCL_LIB_DIRS) -> dict[str, Any]:
    path = first_file(directories, NCCL_NET_PLUGIN_FILE)
    return {"found": path is not None, "path": path}


def lustre_version(version_file: str = LUSTRE_VERSION_FILE, lctl: str = "lctl") -> str | None:
    """The Lustre client's version (its module's), from sysfs or else from lctl; None when neither answers."""
    try:
        return Path(version_file).read_text().strip() or None
    except OSError:
        out, _ = tool(lctl, "get_param", "-n", "version")
        return (out or "").strip() or None


def fsx_mounted(shared: str = SHARED_DIR, mountinfo: str = "/proc/self/mountinfo",
                version_file: str = LUSTRE_VERSION_FILE, lctl: str = "lctl",
                expected_type: str = LUSTRE_FS_TYPE) -> dict[str, Any]:
    fs_type = filesystem_type(shared, mountinfo)
    version = lustre_version(version_file, lctl) if fs_type == LUSTRE_FS_TYPE else None
    return {"mounted": fs_type == expected_type, "type": fs_type, "lustre_version": version}


def metadata_refused(url: str = IMDS_URL, seconds: float = METADATA_SECONDS) -> dict[str, Any]:
    """Whether a job is refused the instance metadata: an IMDSv2 token (a PUT to latest/api/token) is what every
    metadata read, the role's credentials among them, needs first. Refused when the request fails, times out or
    is answered with an error; an answer with a token means the job can read the instance's credentials."""
    request = urllib.request.Request(f"{url.rstrip('/')}/latest/api/token", method="PUT",
                                     headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"})
    try:
        with urllib.request.urlopen(request, timeout=seconds) as response:
            token = response.read()
    except urllib.error.HTTPError as exc:
        return {"refused": True, "answer": f"HTTP {exc.code}"}
    except (OSError, TimeoutError) as exc:
        return {"refused": True, "answer": str(getattr(exc, "reason", exc)) or type(exc).__name__}
    return {"refused": not token, "answer": "a token" if token else "an empty answer"}


def names_resolve(nodelist: str) -> dict[str, Any]:
    """How many of the job's nodes (Slurm's host list) resolve here, and which do not."""
    names = expand_hostlist(nodelist)
    unresolved = []
    for name in names:
        try:
            socket.getaddrinfo(name, None)
        except (socket.gaierror, UnicodeError):
            unresolved.append(name)
    return {"nodes": len(names) - len(unresolved), "unresolved": unresolved}


@dataclass(frozen=True)
class Throughput:
    write_mbps: float
    read_mbps: float


def sequential_throughput(directory: str, mib: int, block: int = FSX_BLOCK) -> Throughput:
    """Write `mib` MiB to a new file in `directory` a block at a time and fsync it (the write's figure includes
    the fsync: the data is on the file servers), drop the file's pages from this node's cache (posix_fadvise
    DONTNEED after the fsync: an unprivileged process cannot drop the whole cache), read it back; then delete it.
    The block is page-aligned (an anonymous mapping) and random: a compressing file system gains nothing."""
    if mib <= 0 or block <= 0:
        raise ValueError(f"nothing to measure in {mib} MiB written {block} bytes at a time")
    total = mib << 20
    buffer = mmap.mmap(-1, block)
    buffer.write(os.urandom(block))
    fd, path = tempfile.mkstemp(prefix=".gpucluster-verify-", dir=directory)
    try:
        start = time.perf_counter()
        written = 0
        while written < total:
            written += os.write(fd, memoryview(buffer)[: min(block, total - written)])
        os.fsync(fd)
        write_seconds = time.perf_counter() - start
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.lseek(fd, 0, os.SEEK_SET)
        start = time.perf_counter()
        read = 0
        while read < total:
            got = os.readv(fd, [buffer])
            if not got:
                raise OSError(f"{path} ended after {read} of {total} bytes")
            read += got
        read_seconds = time.perf_counter() - start
    finally:
        os.close(fd)
        os.unlink(path)
        buffer.close()
    return Throughput(round(total / MB / write_seconds, 1), round(total / MB / read_seconds, 1))


def fsx_throughput(directory: str, mib: int, mounted: dict[str, Any], shared: str = SHARED_DIR) -> dict[str, Any]:
    """Both figures, measured only on the Lustre file system: a directory on a local disk would give a disk's."""
    if not mounted.get("mounted"):
        why = f"{shared} is not a mounted Lustre file system"
        return {FSX_WRITE_MBPS: error(why), FSX_READ_MBPS: error(why)}
    try:
        figures = sequential_throughput(directory, mib)
    except OSError as exc:
        return {FSX_WRITE_MBPS: error(str(exc)), FSX_READ_MBPS: error(str(exc))}
    return {FSX_WRITE_MBPS: figures.write_mbps, FSX_READ_MBPS: figures.read_mbps}


@dataclass(frozen=True)
class Sources:
    """Where each probe looks: production's paths, tools and address by default. Tests point them at a temp root,
    stand-in tools and a 127.0.0.1 server, since this machine has no GPU, EFA device, Lustre client or instance
    metadata."""

    nvidia_smi: str = "nvidia-smi"
    dcgmi: str = "dcgmi"
    dev_dir: str = "/dev"
    infiniband_dir: str = "/sys/class/infiniband"
    nccl_plugin_dirs: tuple[str, ...] = AWS_OFI_NCCL_LIB_DIRS
    shared_dir: str = SHARED_DIR
    mountinfo: str = "/proc/self/mountinfo"
    lustre_version_file: str = LUSTRE_VERSION_FILE
    lctl: str = "lctl"
    metadata_url: str = IMDS_URL
    # The type /fsx must be: Lustre. The boot rehearsal's /fsx is a directory of the test machine's own file system
    # (no Lustre client runs there), whose type its verify run names (--fsx-type) to measure /fsx for real.
    fsx_type: str = LUSTRE_FS_TYPE


def probe(pool: PoolSettings, nodelist: str, fsx_dir: str, *, deep: bool = False, fsx_mib: int = FSX_MIB,
          dcgm: bool = True, sources: Sources = Sources()) -> dict[str, Any]:
    """{check: measured} for what the pool's nodes have: the accelerator checks of its kind, EFA's on EFA pools.
    `dcgm` False leaves DCGM's diagnostic out: DCGM's host engine answers root only (contract/lockdown.py), and the
    verify run's user job measures the rest (verify_run.py runs the diagnostic in a root job, `--dcgm-only`)."""
    measured: dict[str, Any] = {}
    if pool.accelerator == "nvidia":
        measured |= nvidia(sources.nvidia_smi)
        if dcgm:
            measured[DCGM_DIAG] = dcgm_diag(DCGM_DEEP_LEVEL if deep else DCGM_LEVEL, sources.dcgmi)
    elif pool.accelerator == "neuron":
        measured[NEURON_DEVICES] = {"count": count_neuron_devices(Path(sources.dev_dir))}
    if pool.efa_interfaces:
        measured[EFA_DEVICES] = efa_devices(sources.infiniband_dir)
        if pool.accelerator == "nvidia":  # NCCL's plugin; Neuron's collectives bring their own
            measured[NCCL_EFA_PLUGIN] = nccl_efa_plugin(sources.nccl_plugin_dirs)
    measured[FSX_MOUNTED] = fsx_mounted(sources.shared_dir, sources.mountinfo, sources.lustre_version_file,
                                        sources.lctl, sources.fsx_type)
    measured |= fsx_throughput(fsx_dir, fsx_mib, measured[FSX_MOUNTED], sources.shared_dir)
    measured[METADATA_REFUSED] = metadata_refused(sources.metadata_url)
    measured[NAMES_RESOLVE] = names_resolve(nodelist)
    return measured


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="Measure this node for `gpucluster verify` (prints JSON).")
    parser.add_argument("--deep", action="store_true", help=f"DCGM diagnostic level {DCGM_DEEP_LEVEL}, not "
                                                            f"{DCGM_LEVEL}")
    parser.add_argument("--fsx-mib", type=int, default=FSX_MIB, metavar="MIB", help="MiB written and read back on /fsx")
    parser.add_argument("--fsx-dir", default=f"{SHARED_HOME}/{getpass.getuser()}",
                        help="where on /fsx (default: the user's home there)")
    dcgm = parser.add_mutually_exclusive_group()
    dcgm.add_argument("--dcgm-only", action="store_true",
                      help="only DCGM's diagnostic (as root: its host engine answers no one else)")
    dcgm.add_argument("--without-dcgm", action="store_true", help="everything but DCGM's diagnostic (a user's job)")
    parser.add_argument("--fsx-type", default=LUSTRE_FS_TYPE, help=argparse.SUPPRESS)  # Sources.fsx_type says why
    args = parser.parse_args(argv[1:])
    if args.fsx_mib < 1:
        parser.error("--fsx-mib must be at least 1")
    os.environ["PATH"] = ":".join([*os.environ.get("PATH", "").split(":"), *TOOL_DIRS])
    pool = ClusterSettings.load().pools[read_env_file()["GPUCLUSTER_POOL"]]
    if args.dcgm_only:
        level = DCGM_DEEP_LEVEL if args.deep else DCGM_LEVEL
        print(json.dumps({DCGM_DIAG: dcgm_diag(level)} if pool.accelerator == "nvidia" else {}, sort_keys=True))
        return 0
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.uname().nodename
    print(json.dumps(probe(pool, nodelist, args.fsx_dir, deep=args.deep, fsx_mib=args.fsx_mib,
                           dcgm=not args.without_dcgm, sources=Sources(fsx_type=args.fsx_type)), sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
