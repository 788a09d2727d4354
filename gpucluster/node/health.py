#!/usr/bin/python3
"""A compute node's health (settings.HEALTH_PROGRAM): the accelerators its pool has, no fatal GPU fault (from the
driver's and DCGM's own counters, never from the kernel log, which any process can write into: gpu_faults), its EFA
devices, /fsx, local disk.

Run as root by slurmd: as Slurm's HealthCheckProgram (every HealthCheckInterval), as its Epilog (which only takes the
job's labels off its GPUs for dcgm-exporter) and as its Prolog before every job (Slurm gives a prolog SLURM_JOB_ID),
where only the fast checks run, each tool has TOOL_SECONDS (a hung nvidia-smi can never hang a job's start:
ParallelCluster #6777), and a healthy node goes on to the node names (HOSTS_PROGRAM). The bootstrap runs it with
`--boot` before slurmd starts, adding a short DCGM diagnostic where DCGM is installed. A node that fails is drained
with the reason `gpucluster: replace: health: ...` (`sinfo -R`); the reconciler gives it a fresh instance once it is
idle. In the Prolog the exit status is 1, so Slurm requeues the job (SchedulerParameters=nohold_on_prolog_fail) and it
never starts here.

`--configuration`, run by the bootstrap at every boot before it mounts anything or starts slurmd: what only the
instance itself can tell of the image and of EC2 as they really are (the DCGM host engine running, which it starts
where the image left it stopped; a Lustre module for the running kernel; the pool tag on the instance; on EFA pools
NCCL's EFA plugin). A fault is no passing state: a fresh instance would meet it again, so the node is set DOWN with
`gpucluster: configuration: <what, and the fix>` (the reconciler's needs-a-fix class: no relaunch) and the exit status
is 1, and the bootstrap then leaves slurmd stopped (a node that registered would be returned to service). A check
that cannot decide (the metadata service not answering, a tool missing) says so in the boot log and passes.

Standard library only. What a node should have comes from the cluster settings and the node's pool.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import subprocess
import sys
import urllib.error
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the library this program is part of (the bundle's lib/)
from gpucluster.contract import reasons
from gpucluster.contract.settings import (
    AWS_OFI_NCCL_LIB_DIRS,
    ENROOT_DIR,
    ENROOT_KINDS,
    GPU_JOB_MAP_DIR,
    HOSTS_PROGRAM,
    NCCL_NET_PLUGIN_FILE,
    NODE_NAME_FILE,
    POOL_TAG,
    SHARED_DIR,
    SLURM_CLIENT_CONF,
    ClusterSettings,
    PoolSettings,
    named_pool,
    read_env_file,
)
from gpucluster.node import accounts
from gpucluster.node.devices import (
    DCGM_SECONDS,
    TOOL_DIRS,
    TOOL_SECONDS,
    efa_rdm_domains,
    filesystem_type,
    first_file,
    gpu_rows,
    tool,
)
from gpucluster.node.metadata import imds
from gpucluster.node.safe_paths import own_directory
from gpucluster.node.slurm_control import SlurmControl

MIN_FREE_BYTES = 5 << 30  # below this on / (or the instance store) a job's container images and logs fail


def accelerators(pool: PoolSettings) -> list[str]:
    """The accelerators the driver sees, as its tools report them (no text a user can write reaches them): NVIDIA's
    count and uncorrected ECC errors since the driver loaded (nvidia-smi); Neuron's device count (neuron-ls). Neuron
    devices' own error counters (neuron-monitor's) are not checked."""
    if pool.accelerator == "nvidia" and pool.accelerators:
        rows, why = gpu_rows()
        if rows is None:
            return [why]
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


# DCGM's health watches, set by `--configuration` at every boot (the host engine forgets them when it restarts): every
# system (PCIe, memory, InfoROM, thermal and power, NVLink, NVSwitch, the driver's recovery action, ConnectX).
DCGM_WATCHES = "a"
WATCHES_OFF = "Health watches not enabled"  # dcgmi health -c of a host engine without watches (dcgmi/Health.cpp)


def gpu_faults(pool: PoolSettings) -> list[str]:
    """GPU faults as the driver counts them, never as text: the kernel log is no source, since any process can put
    an `NVRM: Xid` line there (a program whose file name is one, run with an empty argv, is logged by the kernel).

    DCGM's health watches (`dcgmi health -c -j`) fail a GPU on the driver's own events and counters: the XIDs DCGM
    always treats as fatal (48 double-bit ECC, 74 NVLink, 79 fallen off the bus, 95 uncontained ECC, 119 and 120 GSP,
    140 unrecovered ECC; DCGM 4.4 and later), XID 64 (row remapping failed), volatile double-bit ECC errors, a failed
    row remap, unrepairable memory, pending page retirements past their limit, the driver asking for a reset or a
    reboot (its GPU recovery action), NVLink and fabric manager failures, InfoROM corruption. A warning (XID 63 or 94,
    a pending page retirement, thermal or power events, PCIe replays) drains nothing. Without dcgmi, or while DCGM
    has no watches, the driver's counters through nvidia-smi: a failed row remap (uncorrected ECC errors are
    accelerators()'s). Application XIDs (13, 31, 43: a job's own fault) never count.

    Only root may ask the host engine (the lockdown rejects anyone else's connection to its port): a user cannot
    inject a field value into DCGM's cache, clear its watches or pause it."""
    if pool.accelerator != "nvidia" or not pool.accelerators:
        return []
    if shutil.which("dcgmi"):
        out, why = tool("dcgmi", "health", "-c", "-j")
        if out is not None:
            return dcgm_failures(out)
        if WATCHES_OFF not in why:
            return [f"DCGM health check: {why}"]  # the host engine does not answer: DCGM cannot vouch for the GPUs
        # The host engine was restarted since the boot: set them again; DCGM answers from the next check on.
        note(f"DCGM had no health watches: {dcgm_watches() or 'set them'}")
    return remapped_rows()


def dcgm_failures(report: str) -> list[str]:
    """The GPUs `dcgmi health -c -j` fails, with DCGM's words. Its JSON (dcgmi/Health.cpp, DcgmiOutputJson):
    {"body": {"Overall Health": {"value": ...}, "GPU": {"children": {"<id>": {"value": "Failure", "children":
    {"Errors": {"children": {"<system>": {"value": "Failure", "overflow": [message parts]}}}}}}}}}."""
    try:
        body = json.loads(report)["body"]
    except (ValueError, KeyError, TypeError):
        return [f"DCGM health check: not the JSON dcgmi writes: {report.strip()[:100]}"]
    found = []
    for group, entities in body.items():
        for entity, entry in (entities.get("children") or {}).items() if isinstance(entities, dict) else ():
            if entry.get("value") != "Failure":
                continue
            systems = ((entry.get("children") or {}).get("Errors") or {}).get("children") or {}
            said = [" ".join(s.get("overflow") or []) or name for name, s in systems.items()
                    if s.get("value") == "Failure"]
            found.append(f"{group} {entity}: {'; '.join(said) or 'failure'}")
    if not found and (body.get("Overall Health") or {}).get("value") == "Failure":
        found.append("failure")
    return [f"DCGM health: {'; '.join(found)}"[:300]] if found else []


def dcgm_watches() -> str:
    """Set DCGM's health watches on every GPU; "" or why not."""
    return tool("dcgmi", "health", "-s", DCGM_WATCHES)[1]


def remapped_rows() -> list[str]:
    """The driver's row remapper (HBM GPUs): a failed remap means memory that can no longer be spared. A GPU without
    one (GDDR) or a query this driver lacks answers nothing here: its ECC count is accelerators()'s."""
    out, why = tool("nvidia-smi", "--query-remapped-rows=gpu_bus_id,remapped_rows.failure", "--format=csv,noheader")
    if out is None:
        note(f"row remapper not read: {why}")
        return []
    rows = [[cell.strip() for cell in line.split(",")] for line in out.splitlines() if line.strip()]
    failed = [row[0] for row in rows if len(row) > 1 and row[1] == "Yes"]
    return [f"GPU {', '.join(failed)}: row remapping failed"] if failed else []


def efa(pool: PoolSettings) -> list[str]:
    if not pool.efa_interfaces:
        return []
    out, why = tool("fi_info", "-p", "efa", "-t", "FI_EP_RDM")
    if out is None:
        return [why]
    found = len(efa_rdm_domains(out))
    return [] if found == pool.efa_interfaces else [f"{found} of {pool.efa_interfaces} EFA devices"]


def mounted(path: str, mountinfo: str = "/proc/self/mountinfo") -> bool:
    """A mount point (a bind mount too, which os.path.ismount misses on the same file system)."""
    return filesystem_type(path, mountinfo) is not None


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
        problems += gpu_faults(pool) + efa(pool)
    if mode == "boot" and pool.accelerator == "nvidia" and shutil.which("dcgmi"):
        out, why = tool("dcgmi", "diag", "-r", "1", seconds=DCGM_SECONDS)
        if out is None:
            problems.append(f"DCGM diagnostic: {why}")
        elif re.search(r"\bFail\b", out):
            problems.append("DCGM diagnostic level 1 failed: " + "; ".join(
                line.strip(" |") for line in out.splitlines() if "Fail" in line)[:150])
    return problems


# --- the first boot's configuration checks ----------------------------------------------------------------------------
DCGM_UNIT = "nvidia-dcgm.service"  # NVIDIA's host engine (nv-hostengine), as DCGM's packages install it
UNIT_DIRS = ("/etc/systemd/system", "/run/systemd/system", "/usr/lib/systemd/system", "/lib/systemd/system")


def note(text: str) -> None:
    """A line for the boot log (the bootstrap logs what this program says)."""
    print(f"gpucluster health: {text}", file=sys.stderr)


def dcgm_host_engine(pool: PoolSettings, unit_dirs: tuple[str, ...] = UNIT_DIRS) -> list[str]:
    """NVIDIA nodes: the boot's `dcgmi diag`, the health watches and dcgm-exporter need the host engine. Started here
    where the image has it stopped (nothing else would: every node would fail its diagnostic and be replaced, in a
    loop); then its health watches are set (gpu_faults: a host engine that refuses them leaves the checks to the
    driver's counters, said in the boot log)."""
    if pool.accelerator != "nvidia":
        return []
    if not any(Path(d, DCGM_UNIT).exists() for d in unit_dirs):
        return [f"DCGM is not installed (no {DCGM_UNIT}): rebake the image (build_image.sh installs it)"]
    if tool("systemctl", "is-active", "--quiet", DCGM_UNIT)[0] is None:
        _, why = tool("systemctl", "start", DCGM_UNIT, seconds=60)
        if tool("systemctl", "is-active", "--quiet", DCGM_UNIT)[0] is None:
            return [f"{DCGM_UNIT} does not start ({why or 'inactive after its start'}): see its journal; "
                    "rebake the image"]
        note(f"{DCGM_UNIT} was stopped: started it")
    if why := dcgm_watches():
        note(f"DCGM's health watches not set ({why}): the GPUs' driver counters only")
    return []


def lustre_module(release: str = "") -> list[str]:
    """/fsx and /home need a Lustre client module built for the running kernel: one a kernel update brought in
    without its module (a reboot onto it) cannot mount them."""
    release = release or os.uname().release
    out, why = tool("modinfo", "-k", release, "-F", "filename", "lustre")
    if out is not None and out.strip():
        return []
    if out is None and not why.startswith("modinfo exited"):  # no modinfo, or it hung: no answer either way
        note(f"cannot tell whether kernel {release} has a Lustre module ({why})")
        return []
    return [f"no Lustre client module for kernel {release} (the kernel changed without one): "
            "rebake the image, or hold the kernel it was baked with"]


def pool_tag(node: str) -> list[str]:
    """The instance carries its pool's tag (POOL_TAG) with the pool its Slurm name claims: the reconciler finds its
    pool's instances by that tag (without it, each would be taken for a vanished node's). Read from the instance's
    metadata tags, which the pools' launch templates turn on (no AWS call, no permission)."""
    claimed = named_pool(node)
    try:
        keys = imds("meta-data/tags/instance").split()
        value = imds(f"meta-data/tags/instance/{POOL_TAG}").strip() if POOL_TAG in keys else None
    except urllib.error.HTTPError as exc:  # 404: the launch template does not put tags in the metadata
        note(f"cannot read the instance's tags from its metadata (HTTP {exc.code}): pool tag not checked")
        return []
    except OSError as exc:
        note(f"the instance metadata does not answer ({exc}): pool tag not checked")
        return []
    if value == claimed:
        return []
    found = "not tagged" if value is None else f"tagged {POOL_TAG}={value}"
    return [f"instance {found}, not {POOL_TAG}={claimed}: EC2 did not give it the launch template's tags"]


def nccl_plugin(pool: PoolSettings, directories: tuple[str, ...] = AWS_OFI_NCCL_LIB_DIRS) -> list[str]:
    """EFA pools' jobs require NCCL's EFA plugin (nccl.env: NCCL_NET): without it every multi-node job would fail.
    Either directory the image may hold it in (build_image.sh puts the one it found on the loader's path)."""
    if pool.accelerator != "nvidia" or not pool.efa_interfaces:
        return []
    if first_file(directories, NCCL_NET_PLUGIN_FILE):
        return []
    return [f"no {NCCL_NET_PLUGIN_FILE} in {' or '.join(directories)} (aws-ofi-nccl, NCCL's EFA plugin): rebake the "
            "image"]


def configuration(pool: PoolSettings, node: str) -> list[str]:
    return dcgm_host_engine(pool) + lustre_module() + pool_tag(node) + nccl_plugin(pool)


def set_down(node: str, problems: list[str], scontrol: str = "scontrol") -> None:
    """reasons.CONFIGURATION: the reconciler leaves the node DOWN, its reason saying what to fix."""
    SlurmControl(scontrol, timeout=TOOL_SECONDS).set_down([node], f"{reasons.CONFIGURATION}: {'; '.join(problems)}")


def drain(node: str, problems: list[str], scontrol: str = "scontrol") -> None:
    """For a fresh instance (reasons.REPLACE). A controller that does not answer leaves the node as it is: the next
    check tries again."""
    try:
        SlurmControl(scontrol, timeout=TOOL_SECONDS).drain([node], f"{reasons.HEALTH}: {'; '.join(problems)}")
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


def container_directories(uid: int, gid: int, base: Path = Path(ENROOT_DIR)) -> list[str]:
    """The job user's enroot directories (enroot.conf: ENROOT_DIR/<kind>/$(id -u)), made by root in root's 0755
    directories, the user's own, 0700: no user can make another's first (enroot, as the user, only `mkdir -p`s them
    and would use whatever it found), and one that is not the user's own directory (a link, or another's left by an
    older image's world-writable layout) is set aside and logged. Returns what could not be made: that user's
    container jobs fail on this node, others run."""
    if not base.is_dir():  # a node without the bootstrap's scratch space (an older bundle)
        return []
    problems = []
    for kind in ENROOT_KINDS:
        try:
            own_directory(base / kind / str(uid), uid, gid, 0o700)
        except (OSError, RuntimeError) as exc:
            problems.append(f"{base / kind / str(uid)}: {exc}")
    return problems


def people_accounts() -> str:
    """The people as the head last published them (a changed stack reaches running compute nodes so): accounts made,
    locked or unlocked before the job starts (gpucluster/node/accounts.py). Returns the problem that keeps this node
    from serving them ("" when none): a name or uid another account has here. A file the head did not sign, or an
    older one than this node applied (a copy brought back), changes nothing here: logged, the node keeps its
    accounts and serves on."""
    try:
        for change in accounts.apply_published():
            print(f"gpucluster prolog: accounts: {change}", file=sys.stderr)
    except (accounts.UnsignedFile, accounts.OlderFile) as exc:
        print(f"gpucluster prolog: {exc}", file=sys.stderr)
    except (accounts.AccountError, RuntimeError, OSError, ValueError) as exc:  # a clash, a failed tool, a bad file
        return f"accounts: {exc}"
    return ""


def main(argv: list[str]) -> int:
    path = os.environ.get("PATH", "").split(":")
    os.environ["PATH"] = ":".join(path + [d for d in TOOL_DIRS if d not in path])
    if os.environ.get("SLURM_SCRIPT_CONTEXT") == "epilog_slurmd":  # as Slurm's Epilog: no check after a job
        label_gpus(os.environ.get("SLURM_JOB_ID", ""), os.environ.get("SLURM_JOB_GPUS", ""), epilog=True)
        return 0
    modes = {"--boot": "boot", "--configuration": "configuration"}
    mode = modes.get(argv[1] if argv[1:] else "") or ("prolog" if os.environ.get("SLURM_JOB_ID") else "periodic")
    settings = ClusterSettings.load()
    pool = settings.pools[read_env_file()["GPUCLUSTER_POOL"]]
    node = Path(NODE_NAME_FILE).read_text().strip() if Path(NODE_NAME_FILE).exists() else os.uname().nodename
    problems = configuration(pool, node) if mode == "configuration" else check(pool, mode)
    if problems:
        print(f"gpucluster health ({mode}) on {node}: {'; '.join(problems)}", file=sys.stderr)
        if "SLURM_CONF" not in os.environ and Path(SLURM_CLIENT_CONF).exists():  # at boot, before slurmd
            os.environ["SLURM_CONF"] = SLURM_CLIENT_CONF
        if mode == "configuration":
            set_down(node, problems)  # a controller that does not answer fails the boot (retried at ResumeTimeout)
            return 1
        drain(node, problems)
        return 1 if mode == "prolog" else 0
    if mode == "prolog":
        if problem := people_accounts():
            print(f"gpucluster prolog on {node}: {problem}", file=sys.stderr)
            set_down(node, [problem])
            return 1
        uid = int(os.environ["SLURM_JOB_UID"])
        gid = int(os.environ.get("SLURM_JOB_GID") or pwd.getpwuid(uid).pw_gid)
        for problem in container_directories(uid, gid):
            print(f"gpucluster prolog on {node}: {problem}", file=sys.stderr)
        label_gpus(os.environ["SLURM_JOB_ID"], os.environ.get("SLURM_JOB_GPUS", ""), epilog=False)
        os.execv(HOSTS_PROGRAM, [HOSTS_PROGRAM])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
