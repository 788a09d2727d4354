#!/usr/bin/python3
"""A compute node's health (settings.HEALTH_PROGRAM): the accelerators its pool has, no fatal GPU error, its EFA
devices, /fsx, local disk.

Run as root by slurmd: as Slurm's HealthCheckProgram (every HealthCheckInterval), as its Epilog (which only takes the
job's labels off its GPUs for dcgm-exporter) and as its Prolog before every job (Slurm gives a prolog SLURM_JOB_ID),
where only the fast checks run, each tool has TOOL_SECONDS (a hung nvidia-smi can never hang a job's start:
ParallelCluster #6777), and a healthy node goes on to the node names (HOSTS_PROGRAM). The bootstrap runs it with
`--boot` before slurmd starts, adding a short DCGM diagnostic where DCGM is installed. A node that fails is drained
with the reason `gpucluster: replace: health: ...` (`sinfo -R`); the reconciler gives it a fresh instance once it is
idle. In the Prolog the exit status is 1, so Slurm requeues the job (SchedulerParameters=nohold_on_prolog_fail) and it
never starts here.

Standard library only. What a node should have comes from the cluster settings and the node's pool.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the library this program is part of (the bundle's lib/)
from gpucluster.contract import reasons
from gpucluster.contract.settings import (
    FATAL_XIDS,
    GPU_JOB_MAP_DIR,
    HOSTS_PROGRAM,
    NODE_NAME_FILE,
    SHARED_DIR,
    SLURM_CLIENT_CONF,
    ClusterSettings,
    PoolSettings,
    read_env_file,
)
from gpucluster.node.slurm_control import SlurmControl

TOOL_SECONDS = 10  # one tool call; the Prolog makes at most three
DCGM_SECONDS = 300  # `dcgmi diag -r 1` takes about a minute
MIN_FREE_BYTES = 5 << 30  # below this on / (or the instance store) a job's container images and logs fail
# Where the images put the tools: slurmd runs its HealthCheckProgram and Prolog with a bare PATH (/bin, /usr/bin...).
TOOL_DIRS = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin", "/opt/amazon/efa/bin",
             "/opt/aws/neuron/bin")


def tool(*args: str, seconds: float | None = None) -> tuple[str | None, str]:
    """(stdout, "") or (None, why): a missing, failing or hung tool is a finding, never a hang. A hung one is killed
    with everything it started (its own session), which might otherwise hold its output open."""
    limit = seconds or TOOL_SECONDS
    if not shutil.which(args[0]):
        return None, f"{args[0]} not found"
    proc = subprocess.Popen(list(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return None, f"{args[0]} did not answer in {limit:g} s"
    if proc.returncode:
        return None, f"{args[0]} exited {proc.returncode}: {(err or out).strip()[-200:]}"
    return out, ""


def accelerators(pool: PoolSettings) -> list[str]:
    if pool.accelerator == "nvidia" and pool.accelerators:
        out, why = tool("nvidia-smi", "--query-gpu=index,ecc.errors.uncorrected.volatile.total",
                        "--format=csv,noheader,nounits")
        if out is None:
            return [why]
        rows = [[cell.strip() for cell in line.split(",")] for line in out.splitlines() if line.strip()]
        problems = [f"{len(rows)} of {pool.accelerators} GPUs"] if len(rows) != pool.accelerators else []
        problems += [f"GPU {r[0]}: {r[1]} uncorrected ECC errors" for r in rows
                     if len(r) > 1 and r[1].isdigit() and int(r[1]) > 0]
        return problems
    if pool.accelerator == "neuron" and pool.accelerators:
        out, why = tool("neuron-ls", "--json-output")
        if out is None:
            return [why]
        found = len(json.loads(out or "[]"))
        return [] if found == pool.accelerators else [f"{found} of {pool.accelerators} Neuron devices"]
    return []


def fatal_xids() -> list[str]:
    out, _ = tool("dmesg", "--level=err,warn")
    xids = sorted({int(x) for x in re.findall(r"NVRM: Xid \([^)]*\): (\d+),", out or "")} & set(FATAL_XIDS))
    return [f"fatal GPU XID(s) {', '.join(map(str, xids))} in the kernel log"] if xids else []


def efa(pool: PoolSettings) -> list[str]:
    if not pool.efa_interfaces:
        return []
    out, why = tool("fi_info", "-p", "efa", "-t", "FI_EP_RDM")
    if out is None:
        return [why]
    found = len(set(re.findall(r"domain:\s*(\S+)", out)))
    return [] if found == pool.efa_interfaces else [f"{found} of {pool.efa_interfaces} EFA devices"]


def mounted(path: str, mountinfo: str = "/proc/self/mountinfo") -> bool:
    """A mount point (a bind mount too, which os.path.ismount misses on the same file system)."""
    return any(line.split()[4] == path for line in Path(mountinfo).read_text().splitlines())


def storage(shared: str = SHARED_DIR, disks: tuple[str, ...] = ("/", "/opt/dlami/nvme")) -> list[str]:
    problems = [] if mounted(shared) else [f"{shared} is not mounted"]
    for disk in disks:
        if os.path.isdir(disk) and shutil.disk_usage(disk).free < MIN_FREE_BYTES:
            problems.append(f"{disk} has {shutil.disk_usage(disk).free >> 30} GiB free")
    return problems


def check(pool: PoolSettings, mode: str) -> list[str]:
    """Problems found; `prolog` runs only what takes a moment."""
    problems = accelerators(pool) + storage()
    if mode != "prolog":
        problems += fatal_xids() + efa(pool)
    if mode == "boot" and pool.accelerator == "nvidia" and shutil.which("dcgmi"):
        out, why = tool("dcgmi", "diag", "-r", "1", seconds=DCGM_SECONDS)
        if out is None:
            problems.append(f"DCGM diagnostic: {why}")
        elif re.search(r"\bFail\b", out):
            problems.append("DCGM diagnostic level 1 failed: " + "; ".join(
                line.strip(" |") for line in out.splitlines() if "Fail" in line)[:150])
    return problems


def drain(node: str, problems: list[str], scontrol: str = "scontrol") -> None:
    """For a fresh instance (reasons.REPLACE). A controller that does not answer leaves the node as it is: the next
    check tries again."""
    try:
        SlurmControl(scontrol, timeout=TOOL_SECONDS).drain([node], f"{reasons.REPLACE}: health: {'; '.join(problems)}")
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired):  # SlurmControl logged it
        pass


def label_gpus(job: str, gpus: str, epilog: bool, mapping: Path = Path(GPU_JOB_MAP_DIR)) -> None:
    """dcgm-exporter's HPC job mapping: a file per GPU index (SLURM_JOB_GPUS, as Slurm gives the Prolog and Epilog)
    naming the job on it, so that the GPU's series carry `hpc_job`. A GPU is one job's (gres): the Prolog replaces
    what an Epilog that never ran left behind, the Epilog takes its own job off."""
    for index in filter(None, gpus.split(",")):
        entry = mapping / index
        if epilog:
            if entry.exists() and entry.read_text().split() == [job]:
                entry.unlink()
            continue
        mapping.mkdir(parents=True, exist_ok=True)
        temporary = mapping / f".{index}.tmp"
        temporary.write_text(f"{job}\n")
        temporary.chmod(0o644)
        os.replace(temporary, entry)


def main(argv: list[str]) -> int:
    path = os.environ.get("PATH", "").split(":")
    os.environ["PATH"] = ":".join(path + [d for d in TOOL_DIRS if d not in path])
    if os.environ.get("SLURM_SCRIPT_CONTEXT") == "epilog_slurmd":  # as Slurm's Epilog: no check after a job
        label_gpus(os.environ.get("SLURM_JOB_ID", ""), os.environ.get("SLURM_JOB_GPUS", ""), epilog=True)
        return 0
    mode = "boot" if argv[1:] == ["--boot"] else "prolog" if os.environ.get("SLURM_JOB_ID") else "periodic"
    settings = ClusterSettings.load()
    pool = settings.pools[read_env_file()["GPUCLUSTER_POOL"]]
    problems = check(pool, mode)
    if problems:
        node = Path(NODE_NAME_FILE).read_text().strip() if Path(NODE_NAME_FILE).exists() else os.uname().nodename
        print(f"gpucluster health ({mode}) on {node}: {'; '.join(problems)}", file=sys.stderr)
        if "SLURM_CONF" not in os.environ and Path(SLURM_CLIENT_CONF).exists():  # at boot, before slurmd
            os.environ["SLURM_CONF"] = SLURM_CLIENT_CONF
        drain(node, problems)
        return 1 if mode == "prolog" else 0
    if mode == "prolog":
        label_gpus(os.environ["SLURM_JOB_ID"], os.environ.get("SLURM_JOB_GPUS", ""), epilog=False)
        os.execv(HOSTS_PROGRAM, [HOSTS_PROGRAM])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
