#!/usr/bin/env python3
"""Bring a gpucluster node up in its role: `bootstrap.py head` or `bootstrap.py compute`.

Run by fetch_bundle.py at every boot from the unpacked bundle in /opt/gpucluster; idempotent, so a reboot converges.
Reads /etc/gpucluster/cluster.json (the cluster's settings from SSM). Logs to /var/log/gpucluster/bootstrap.log and
the journal. Standard library and boto3 only (Ubuntu's python3-boto3).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import pwd
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

BUNDLE = Path("/opt/gpucluster")
SETTINGS = Path("/etc/gpucluster/cluster.json")
STATE = Path("/var/lib/gpucluster")  # the head node's state volume: slurmctld state and MariaDB
SLURM_ETC = Path("/etc/slurm")
MUNGE_KEY = Path("/etc/munge/munge.key")
ENROOT_VERSION = "3.5.0"

log = logging.getLogger("gpucluster-bootstrap")


def run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    log.info("$ %s", " ".join(args))
    return subprocess.run(list(args), check=check, capture_output=True, text=True)


# --- shared ----------------------------------------------------------------------------------------------------------

def munge_key(ssm, parameter: str, create: bool, attempts: int = 60) -> bytes:  # type: ignore[no-untyped-def]
    """The cluster's munge key from SSM (SecureString). The head node creates it once; a second head that races it
    loses the create and reads the winner's key. Compute nodes only read, waiting for the head if needed."""
    if create:
        try:
            ssm.put_parameter(Name=parameter, Type="SecureString", Overwrite=False,
                              Value=base64.b64encode(os.urandom(1024)).decode(),
                              Description="gpucluster munge key (created by the head node)")
            log.info("created the munge key in %s", parameter)
        except ssm.exceptions.ParameterAlreadyExists:
            log.info("munge key already in %s", parameter)
    for _ in range(attempts):
        try:
            value = ssm.get_parameter(Name=parameter, WithDecryption=True)["Parameter"]["Value"]
            return base64.b64decode(value)
        except ssm.exceptions.ParameterNotFound:
            time.sleep(10)
    raise RuntimeError(f"no munge key in {parameter}")


def install_munge_key(key: bytes, path: Path = MUNGE_KEY) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(key)
    path.chmod(0o400)
    munge = pwd.getpwnam("munge")
    os.chown(path, munge.pw_uid, munge.pw_gid)


def hosts_entry(head_address: str, hosts: Path = Path("/etc/hosts")) -> None:
    """Compute nodes reach the controller as `head` (SlurmctldHost); node names themselves are never resolved."""
    lines = [line for line in hosts.read_text().splitlines() if not line.rstrip().endswith(" head")]
    hosts.write_text("\n".join(lines + [f"{head_address} head"]) + "\n")


def fstab_entry(entry: str, fstab: Path = Path("/etc/fstab")) -> None:
    """Add a mount to /etc/fstab once: every boot runs the bootstrap again."""
    if entry not in fstab.read_text():
        fstab.write_text(fstab.read_text() + entry + "\n")


def mount_lustre(dns_name: str, mount_name: str, where: str = "/fsx") -> None:
    if run("mountpoint", "-q", where, check=False).returncode == 0:
        return
    kernel = os.uname().release
    run("apt-get", "install", "-y", "-q", f"lustre-client-modules-{kernel}", "lustre-client-utils", check=False)
    Path(where).mkdir(exist_ok=True)
    fstab_entry(f"{dns_name}@tcp:/{mount_name} {where} lustre defaults,relatime,flock,_netdev,x-systemd.automount 0 0")
    run("mount", where)


# --- head ------------------------------------------------------------------------------------------------------------

def state_volume(volume_id: str, where: Path = STATE) -> None:
    """Format the state volume on first use only, and mount it: the queue and accounting survive a new head node."""
    device = Path(f"/dev/disk/by-id/nvme-Amazon_Elastic_Block_Store_{volume_id.replace('-', '')}")
    for _ in range(60):
        if device.exists():
            break
        time.sleep(5)
    if run("blkid", str(device), check=False).returncode != 0:
        run("mkfs.ext4", "-L", "gpucluster-state", str(device))
    where.mkdir(parents=True, exist_ok=True)
    fstab_entry(f"LABEL=gpucluster-state {where} ext4 defaults,nofail 0 2")
    run("mount", "-a")


def database_on_state_volume() -> None:
    data = STATE / "mysql"
    run("systemctl", "stop", "mariadb")
    if not data.exists():
        shutil.copytree("/var/lib/mysql", data, symlinks=True)
        shutil.chown(data, "mysql", "mysql")
    fstab_entry(f"{data} /var/lib/mysql none bind 0 0")
    run("mount", "/var/lib/mysql", check=False)
    run("systemctl", "enable", "--now", "mariadb")
    run("mariadb", "-u", "root", "-e", (BUNDLE / "accounting.sql").read_text())


SYSTEMD = Path("/etc/systemd/system")


def unit(description: str, section: str, body: list[str], after: str = "",
         wanted_by: str | None = "multi-user.target") -> str:
    """A systemd unit file: [Unit], the [Service] or [Timer] section, and [Install] when it is enabled on its own."""
    lines = ["[Unit]", f"Description={description}"] + ([f"After={after}", f"Wants={after}"] if after else [])
    lines += ["", f"[{section}]", *body]
    if wanted_by:
        lines += ["", "[Install]", f"WantedBy={wanted_by}"]
    return "\n".join(lines) + "\n"


def start(*units: str) -> None:
    run("systemctl", "daemon-reload")
    for name in units:
        run("systemctl", "enable", "--now", name)


def slurm_files(settings: dict) -> None:  # type: ignore[type-arg]
    SLURM_ETC.mkdir(exist_ok=True)
    for conf in (BUNDLE / "slurm").iterdir():
        shutil.copy(conf, SLURM_ETC / conf.name)
    (SLURM_ETC / "slurmdbd.conf").chmod(0o600)
    shutil.chown(SLURM_ETC / "slurmdbd.conf", "slurm", "slurm")
    for d in (STATE / "slurmctld", Path("/var/log/slurm"), Path("/var/log/gpucluster")):
        d.mkdir(parents=True, exist_ok=True)
        shutil.chown(d, "slurm", "slurm")
    bin_dir = BUNDLE / "bin"
    bin_dir.mkdir(exist_ok=True)
    from gpucluster_node import COMMANDS  # beside this file in the bundle

    for program in (*COMMANDS, "reconcile"):
        link = bin_dir / program
        if not link.is_symlink():
            link.symlink_to(BUNDLE / "gpucluster_node.py")
    (SYSTEMD / "gpucluster-reconcile.service").write_text(unit(
        "gpucluster: match EC2 instances and Slurm nodes", "Service",
        ["Type=oneshot", "User=slurm", f"ExecStart={bin_dir}/reconcile"], wanted_by=None))
    (SYSTEMD / "gpucluster-reconcile.timer").write_text(unit(
        "gpucluster reconciler every minute", "Timer", ["OnBootSec=2min", "OnUnitActiveSec=60s"],
        wanted_by="timers.target"))


def budget_guardrail(systemd: Path = SYSTEMD, sbin: Path = Path("/usr/local/sbin")) -> None:
    """The guardrail service, and `gpucluster-budget` on the admin's PATH for status, check, close and reopen."""
    command = sbin / "gpucluster-budget"
    if not command.is_symlink():
        command.symlink_to(BUNDLE / "gpucluster_budget.py")
    # As root: it writes the state that `sudo gpucluster-budget reopen` also writes.
    (systemd / "gpucluster-budget.service").write_text(unit(
        "gpucluster budget guardrail: close the partitions when the budget is spent", "Service",
        [f"ExecStart={command} run", "Restart=always", "RestartSec=30"], after="slurmctld.service"))


PYDANTIC = "pydantic>=2.9,<3"  # as requirements.txt; boto3 and PyYAML come from Ubuntu's packages


def command_line(bin_dir: Path = Path("/usr/local/bin")) -> None:
    """`gpucluster cost|plan|render|preflight` on the head node, from the library and stack file in the bundle."""
    venv = BUNDLE / "venv"
    if not (venv / "bin" / "python").exists():
        run("python3", "-m", "venv", "--system-site-packages", str(venv))
        run(str(venv / "bin" / "pip"), "install", "--quiet", PYDANTIC)
    command = bin_dir / "gpucluster"
    command.write_text(f"#!/bin/sh\nPYTHONPATH={BUNDLE}/lib exec {venv}/bin/python -m gpucluster \"$@\"\n")
    command.chmod(0o755)


def head(settings: dict, ssm) -> None:  # type: ignore[no-untyped-def,type-arg]
    state_volume(settings["state_volume_id"])
    install_munge_key(munge_key(ssm, settings["munge_key_parameter"], create=True))
    run("systemctl", "enable", "--now", "munge")
    run("systemctl", "restart", "munge")
    database_on_state_volume()
    slurm_files(settings)
    start("slurmdbd", "slurmctld", "gpucluster-reconcile.timer")
    if "budget" in settings:
        budget_guardrail()
        start("gpucluster-budget.service")
    run("sh", str(BUNDLE / "accounting.sh"))  # the team's account, its users and its monthly GPU-hours
    command_line()
    mount_lustre(settings["fsx_dns_name"], settings["fsx_mount_name"])
    os.chmod("/fsx", 0o1777)  # like /tmp: every user may submit from and write into /fsx, only owners delete
    shutil.copytree(BUNDLE / "examples", "/fsx/examples", dirs_exist_ok=True)


# --- compute ---------------------------------------------------------------------------------------------------------

def imds(path: str) -> str:
    token = urllib.request.urlopen(urllib.request.Request(
        "http://169.254.169.254/latest/api/token", method="PUT",
        headers={"X-aws-ec2-metadata-token-ttl-seconds": "300"}), timeout=5).read().decode()
    return urllib.request.urlopen(urllib.request.Request(
        f"http://169.254.169.254/latest/{path}", headers={"X-aws-ec2-metadata-token": token}), timeout=5).read().decode()


def node_name() -> str:
    """The Slurm node name the resume program tagged this instance with, read from instance metadata tags."""
    for _ in range(60):
        try:
            return imds("meta-data/tags/instance/gpucluster:node")
        except OSError:
            time.sleep(5)
    raise RuntimeError("no gpucluster:node tag on this instance")


def nccl_environment(efa: bool) -> str:
    """Environment for NCCL jobs (aws-ofi-nccl >= 1.7, libfabric >= 1.18 as on the DLAMIs)."""
    lines = ["export NCCL_SOCKET_IFNAME=^docker,lo,veth", "export NCCL_DEBUG=${NCCL_DEBUG:-WARN}"]
    if efa:
        lines += ["export FI_PROVIDER=efa", "export FI_EFA_USE_HUGE_PAGE=0"]
    return "\n".join(lines) + "\n"


def containers() -> None:
    """enroot and pyxis, so that `srun --container-image=...` works; the image cache lives on local NVMe."""
    arch = "amd64"
    for package in (f"enroot_{ENROOT_VERSION}-1_{arch}.deb", f"enroot+caps_{ENROOT_VERSION}-1_{arch}.deb"):
        url = f"https://github.com/NVIDIA/enroot/releases/download/v{ENROOT_VERSION}/{package}"
        run("curl", "-fsSL", "-o", f"/tmp/{package}", url)
    run("apt-get", "install", "-y", "-q", f"/tmp/enroot_{ENROOT_VERSION}-1_{arch}.deb",
        f"/tmp/enroot+caps_{ENROOT_VERSION}-1_{arch}.deb")
    nvme = Path("/opt/dlami/nvme") if Path("/opt/dlami/nvme").is_dir() else Path("/tmp")
    Path("/etc/enroot/enroot.conf.d").mkdir(parents=True, exist_ok=True)
    Path("/etc/enroot/enroot.conf.d/gpucluster.conf").write_text(
        f"ENROOT_CACHE_PATH {nvme}/enroot/cache\nENROOT_DATA_PATH {nvme}/enroot/data\n"
        f"ENROOT_RUNTIME_PATH {nvme}/enroot/runtime/$(id -u)\n")
    run("apt-get", "install", "-y", "-q", "libslurm-dev", "build-essential", "git", check=False)
    run("git", "clone", "--depth=1", "https://github.com/NVIDIA/pyxis.git", "/tmp/pyxis", check=False)
    run("make", "-C", "/tmp/pyxis", "install", check=False)


def gpu_metrics(pool: str, region: str, systemd: Path = SYSTEMD) -> str | None:
    """Utilisation for the pool's idle alarm: the CloudWatch agent (on the Deep Learning AMIs) on NVIDIA nodes, the
    neuron-monitor publisher on Trainium nodes. Returns the systemd unit to start, if any."""
    agent = BUNDLE / "cloudwatch-agent" / f"{pool}.json"
    ctl = "/opt/aws/amazon-cloudwatch-agent/bin/amazon-cloudwatch-agent-ctl"
    if agent.exists() and Path(ctl).exists():
        run(ctl, "-a", "fetch-config", "-m", "ec2", "-c", f"file:{agent}", "-s")
    neuron = BUNDLE / "neuron-metrics" / f"{pool}.json"
    if not neuron.exists():
        return None
    (systemd / "gpucluster-neuron-metrics.service").write_text(unit(
        "gpucluster: NeuronCore utilisation to CloudWatch", "Service",
        [f"Environment=AWS_DEFAULT_REGION={region}",
         f"ExecStart=/usr/bin/python3 {BUNDLE}/gpucluster_neuron_metrics.py {neuron} -- /opt/aws/neuron/bin/neuron-monitor",
         "Restart=always", "RestartSec=30"]))
    return "gpucluster-neuron-metrics.service"


def compute(settings: dict, ssm) -> None:  # type: ignore[no-untyped-def,type-arg]
    name = node_name()
    run("hostnamectl", "set-hostname", name)
    hosts_entry(settings["head_address"])
    install_munge_key(munge_key(ssm, settings["munge_key_parameter"], create=False))
    run("systemctl", "restart", "munge")
    pool_name = os.environ.get("GPUCLUSTER_POOL") or name.rsplit("-", 1)[0]
    pool = settings["pools"][pool_name]
    Path("/etc/profile.d/gpucluster-nccl.sh").write_text(nccl_environment(pool.get("efa_interfaces", 0) > 0))
    # NCCL keeps its buffers in /dev/shm: allow most of the node's memory.
    run("mount", "-o", "remount,size=90%", "/dev/shm", check=False)
    mount_lustre(settings["fsx_dns_name"], settings["fsx_mount_name"])
    containers()
    metrics = gpu_metrics(pool_name, settings["region"])
    if metrics:
        start(metrics)
    # Configless: slurm.conf, gres.conf and plugstack.conf come from the controller.
    Path("/etc/default/slurmd").write_text(f'SLURMD_OPTIONS="--conf-server head:6817 -N {name}"\n')
    run("systemctl", "enable", "--now", "slurmd")
    run("systemctl", "restart", "slurmd")


def main(argv: list[str]) -> int:
    Path("/var/log/gpucluster").mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        handlers=[logging.StreamHandler(sys.stderr),
                                  logging.FileHandler("/var/log/gpucluster/bootstrap.log")])
    role = argv[1] if len(argv) > 1 else ""
    if role not in ("head", "compute"):
        print("usage: bootstrap.py head|compute", file=sys.stderr)
        return 2
    import boto3

    settings = json.loads(SETTINGS.read_text())
    ssm = boto3.client("ssm", region_name=settings["region"])
    try:
        (head if role == "head" else compute)(settings, ssm)
    except Exception:
        log.exception("bootstrap %s failed", role)
        return 1
    log.info("bootstrap %s done", role)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
