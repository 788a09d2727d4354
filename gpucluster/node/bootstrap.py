#!/usr/bin/env python3
"""Configure a gpucluster node in its role (settings.BOOTSTRAP_PROGRAM): `bootstrap.py head` or `bootstrap.py compute`.

Run by fetch_bundle.py from gpucluster-boot.service at every boot, after the settings, the munge key and the bundle
are on disk; idempotent, so a reboot converges. It makes no AWS call and, on the node image, installs and downloads
nothing: on an image without the manifest build_image.sh writes last (a stock AMI), it runs that script first.
Every service it starts must be running afterwards, or the boot fails loudly (the unit is retried) instead of leaving
a node that never joins. Logs to the journal and /var/log/gpucluster/boot.log. Standard library only.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import pwd
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the library this program is part of (the bundle's lib/)
from gpucluster.contract import (
    lockdown,
    reasons,
    settings as contract,
    slurm_json,
)
from gpucluster.contract.hostlist import compress_hostlist, expand_hostlist
from gpucluster.contract.settings import ClusterSettings, PoolSettings, read_env_file
from gpucluster.node import accounts
from gpucluster.node.metadata import imds
from gpucluster.node.safe_paths import foreign, own_directory, replace_tree, set_aside

BUNDLE = Path(contract.BUNDLE_DIR)
STATE = Path(contract.STATE_DIR)
SLURM_ETC = Path("/etc/slurm")
MUNGE_KEY = Path("/etc/munge/munge.key")
SYSTEMD = Path("/etc/systemd/system")
IMAGE_VENV = Path(contract.IMAGE_MANIFEST).parent / "venv"  # build_image.sh: torch (compute), pydantic (head)

MAX_RETRY_WAIT = 10.0  # seconds: a node's boot counts against Slurm's ResumeTimeout

log = logging.getLogger("gpucluster-bootstrap")


def run(*args: str, check: bool = True, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    log.info("$ %s", " ".join(args))
    done = subprocess.run(list(args), capture_output=True, text=True, env=env)
    if check and done.returncode:
        raise RuntimeError(f"{' '.join(args)} exited {done.returncode}: {(done.stderr or done.stdout).strip()[-800:]}")
    return done


_Result = TypeVar("_Result")  # what the retried action returns


def retry(what: str, action: Callable[[], _Result], attempts: int = 5, delay: float = 2.0) -> _Result:
    """Transient faults at boot (a file system still coming up, a device still attaching) get a few tries."""
    for attempt in range(attempts):
        try:
            return action()
        except (OSError, RuntimeError) as exc:
            if attempt == attempts - 1:
                raise RuntimeError(f"{what}: {exc}") from exc
            wait = min(delay * 2 ** attempt, MAX_RETRY_WAIT)
            log.warning("%s: %s; again in %.0f s", what, exc, wait)
            time.sleep(wait)
    raise RuntimeError(f"{what}: not tried ({attempts} attempts)")


# --- the node image --------------------------------------------------------------------------------------------------

def ensure_image(role: str, manifest: Path = Path(contract.IMAGE_MANIFEST)) -> None:
    """On the baked image, nothing to do. On a stock AMI, build what the image would hold, once (slow path)."""
    if manifest.exists():
        log.info("node image: %s", json.loads(manifest.read_text()).get("role", "?"))
        return
    log.warning("no %s: this is not a gpucluster node image; installing the software now (minutes)", manifest)
    run("bash", contract.BUILD_IMAGE_SCRIPT, role, contract.BUNDLE_BOM)  # the bundle's bill of materials
    if not manifest.exists():
        raise RuntimeError(f"build_image.sh {role} finished without writing {manifest}")


# --- systemd ---------------------------------------------------------------------------------------------------------

def unit(description: str, section: str, body: list[str], after: str = "",
         wanted_by: str | None = "multi-user.target", ordered_after: str = "") -> str:
    """A systemd unit file: [Unit], the [Service] or [Timer] section, and [Install] when it is enabled on its own.
    `after`: a unit it needs and starts after; `ordered_after`: one it only waits for when both are starting."""
    lines = ["[Unit]", f"Description={description}"] + ([f"After={after}", f"Wants={after}"] if after else [])
    lines += [f"After={ordered_after}"] if ordered_after else []
    lines += ["", f"[{section}]", *body]
    if wanted_by:
        lines += ["", "[Install]", f"WantedBy={wanted_by}"]
    return "\n".join(lines) + "\n"


def drop_in(service: str, text: str, systemd: Path = SYSTEMD) -> Path:
    """Our settings on top of a packaged unit, which stays as the package ships it."""
    path = systemd / f"{service}.d" / "gpucluster.conf"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# /run/slurm holds the pid files slurm.conf names; several Slurm daemons share it, so a stop keeps it.
SLURM_RUNTIME = "[Service]\nRuntimeDirectory=slurm\nRuntimeDirectoryPreserve=yes\n"
# Enabled services start at a reboot on their own, before this bootstrap runs: those whose data live on the state
# volume wait for its mount (fstab's nofail puts it outside local-fs.target's ordering).
ON_STATE_VOLUME = f"[Unit]\nRequiresMountsFor={STATE}\n\n"
# Debian's and Ubuntu's slurmd.service carry ConditionPathExists=/etc/slurm/slurm.conf. A configless node has no such
# file: systemd would skip slurmd without an error and the node would never register. An empty assignment resets it.
SLURMD_DROP_IN = "[Unit]\nConditionPathExists=\n\n" + SLURM_RUNTIME


def start(*units: str) -> None:
    """Enable and (re)start each unit, then insist that it runs: `systemctl enable --now` exits 0 even when a unit's
    condition fails and it is skipped."""
    run("systemctl", "daemon-reload")
    for name in units:
        run("systemctl", "enable", name)
        run("systemctl", "restart", name)
        state = run("systemctl", "is-active", name, check=False).stdout.strip()
        if state != "active":
            status = run("systemctl", "status", "--no-pager", name, check=False).stdout.strip()
            raise RuntimeError(f"{name} is {state or 'not running'} after its start:\n{status}")


# --- shared ----------------------------------------------------------------------------------------------------------

def install_munge_key(staged: Path = Path(contract.MUNGE_KEY_STAGED), path: Path = MUNGE_KEY) -> None:
    """Readable by munge alone from its first byte: written to a file created 0400 and owned by munge, then renamed
    over the key (writing in place would leave a new key world-readable until a chmod)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    munge = pwd.getpwnam("munge")
    tmp = path.with_name(f".{path.name}.new")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
    try:
        os.fchown(fd, munge.pw_uid, munge.pw_gid)
        os.write(fd, staged.read_bytes())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def people_accounts(s: ClusterSettings, role: str) -> None:
    """The stack's people as accounts on this node (gpucluster/node/accounts.py), before slurmd or a session can
    start; a name or uid another account has here fails the boot, naming both. The head is where people connect: a
    removed person's processes are killed there and their account deleted; the log names what is left to do at AWS.
    A compute node takes its accounts from the settings it booted with, as new as any people file the head published
    before this moment: it applies no file of an older generation (one brought back to /fsx)."""
    changes = accounts.settle(s.people, sessions_here=role == "head")
    for change in changes:
        log.info("accounts: %s", change)
    if role == "head" and any(change.startswith("deleted ") for change in changes):
        log.warning("accounts: a removed person's open Session Manager sessions stay open at AWS until they end: list "
                    "them with `aws ssm describe-sessions --state Active` and end them with `aws ssm "
                    "terminate-session --session-id ...` (docs/how-to/people.md)")
    if role == "compute":
        accounts.record_generation(accounts.clock_generation())


def people_homes(s: ClusterSettings) -> None:
    """The head's part, once /fsx is mounted: the people's homes (0700), then the people signed for the compute
    nodes' Prolog. The login user's home as always without `users:`."""
    shared_home(users=s.accounts, mode=0o700 if s.people else 0o750)
    own_directory(Path(contract.SHARED_PEOPLE_FILE).parent)
    accounts.publish(s.people)


def lock_down(role: str) -> None:
    """The lockdown cloud-init's bootcmd ran before the network came up, once more now that the image's packages are
    all there (on a stock AMI the slurm user exists only after build_image.sh), with the guard of DCGM's host engine
    (before any job can start) and, on the head, sshd's key lookup let through (lockdown.BOOTSTRAP_IMDS_USERS). A
    failure fails the boot: a node whose users could reach the instance's credentials must not serve."""
    run("sh", "-c", lockdown.script(role))


def hosts_entry(head_address: str, hosts: Path = Path("/etc/hosts")) -> None:
    """Compute nodes reach the controller as `head` (SlurmctldHost). The address is the head node's fixed network
    interface, so it holds across a head replacement; rewritten at every boot all the same."""
    lines = [line for line in hosts.read_text().splitlines()
             if not line.rstrip().endswith(f" {contract.HEAD_HOSTNAME}")]
    hosts.write_text("\n".join(lines + [f"{head_address} {contract.HEAD_HOSTNAME}"]) + "\n")


def fstab_entry(entry: str, fstab: Path = Path("/etc/fstab")) -> None:
    """Add a mount to /etc/fstab once: every boot runs the bootstrap again."""
    if entry not in fstab.read_text():
        fstab.write_text(fstab.read_text() + entry + "\n")


def mounted(where: str) -> bool:
    return run("mountpoint", "-q", where, check=False).returncode == 0


def mount_lustre(dns_name: str, mount_name: str, where: str = contract.SHARED_DIR) -> None:
    """The client comes with the node image (AWS's FSx Lustre repository); a missing client is a failed boot."""
    Path(where).mkdir(exist_ok=True)
    # nosuid, nodev: files come into /fsx from S3 with the owner and mode bits of the objects' metadata; whoever may
    # write to the bucket must not be able to plant a setuid-root program or a device there.
    fstab_entry(f"{dns_name}@tcp:/{mount_name} {where} lustre "
                "defaults,relatime,flock,nosuid,nodev,_netdev,x-systemd.automount 0 0")
    if not mounted(where):
        retry(f"mount {where}", lambda: run("mount", where))


def shared_home(shared: Path = Path(contract.SHARED_HOME), home: Path = Path("/home"),
                users: tuple[str, ...] = (contract.LOGIN_USER,), mode: int = 0o750) -> None:
    """Home directories on the Lustre file system, the same on the head and on every compute node, so that code,
    venvs and job output in ~ are where the job runs (HyperPod does the same; ParallelCluster exports /home from its
    head over NFS). /home is a bind mount of it (in fstab, after /fsx, for reboots). Each of `users` (the login user,
    or the stack's people: then `mode` 0700, theirs alone) gets a home from /etc/skel the first time; the cluster never
    deletes one, gives it back to root or changes its mode afterwards (a removed person's stays).
    /fsx is world-writable and outlives the head: /fsx/home is root's own directory (anything a user made there first
    is set aside), and a home is made complete, owned by its user, in a directory only root can enter, then renamed
    into place; a home that is there is left as it is (root writes nothing into it), one that is not a directory
    (a link) is set aside and made anew."""
    own_directory(shared)
    for user in users:
        try:
            account = pwd.getpwnam(user)
        except KeyError:
            continue
        mine = shared / user
        if why := foreign(mine, None):  # a home is kept whoever owns it; a link or a file is not one
            set_aside(mine, why)
        if not os.path.lexists(mine):
            replace_tree(functools.partial(skeleton, uid=account.pw_uid, gid=account.pw_gid), mine, mode)
    # _netdev and nofail, like /fsx: a Lustre that is slow to come back must not hold a reboot in emergency mode.
    fstab_entry(f"{shared} {home} none bind,nosuid,nodev,_netdev,nofail,"
                f"x-systemd.requires-mounts-for={contract.SHARED_DIR} 0 0")
    if not mounted(str(home)):
        run("mount", "-o", "bind,nosuid,nodev", str(shared), str(home))


def skeleton(home: Path, uid: int, gid: int, skel: Path = Path("/etc/skel")) -> None:
    """A new home from /etc/skel, every entry its user's (links themselves, not what they point to)."""
    shutil.copytree(skel, home, symlinks=True)
    for entry in [home, *home.rglob("*")]:
        os.chown(entry, uid, gid, follow_symlinks=False)


def shared_examples(source: Path = BUNDLE / "examples", target: Path = Path(contract.SHARED_EXAMPLES)) -> None:
    """The bundle's examples on /fsx, read-only for users, copied once: in a directory only root can enter, then
    renamed into place (never a copy into what a user may have made or linked first). Never overwritten after that,
    at a boot or an update: an admin's edits stay, and a later bundle adds only the files the directory lacks (a new
    example)."""
    if foreign(target, 0) or not os.path.lexists(target):
        replace_tree(lambda new: shutil.copytree(source, new), target)
        return
    for path in sorted(source.rglob("*")):  # parents before their contents
        copy = target / path.relative_to(source)
        if os.path.lexists(copy):
            continue
        if path.is_dir():
            copy.mkdir(mode=0o755)
        else:
            shutil.copy2(path, copy)


# --- head ------------------------------------------------------------------------------------------------------------

def state_volume(volume_id: str, where: Path = STATE, dev: Path = Path("/dev/disk/by-id")) -> None:
    """Format the state volume on first use only, and mount it: the queue and accounting survive a new head node."""
    device = dev / f"nvme-Amazon_Elastic_Block_Store_{volume_id.replace('-', '')}"  # as grow_state_volume names it
    retry(f"state volume {volume_id} to attach", lambda: device.resolve(strict=True), attempts=12)
    if run("blkid", str(device), check=False).returncode != 0:
        run("mkfs.ext4", "-q", "-L", "gpucluster-state", str(device))
    where.mkdir(parents=True, exist_ok=True)
    # By the volume's own id, not by label: a second volume with the same label must never be mounted instead.
    fstab_entry(f"{device} {where} ext4 defaults,nofail 0 2")
    if not mounted(str(where)):
        run("mount", str(where))
    grow_state_volume(volume_id, dev)


def grow_state_volume(volume_id: str, dev: Path = Path("/dev/disk/by-id")) -> None:
    """A volume that `pulumi up` enlarged (EBS grows it in place) gets a file system as large: Prometheus' retention
    is sized for the volume. Online, and nothing to do when the sizes match."""
    run("resize2fs", str(dev / f"nvme-Amazon_Elastic_Block_Store_{volume_id.replace('-', '')}"))


def database_dir(data: Path = STATE / "mysql",
                 conf: Path = Path("/etc/mysql/mariadb.conf.d/60-gpucluster.cnf")) -> None:
    """MariaDB keeps the accounting database on the state volume. Created on first use; owned by `mysql` at every
    boot, because a new head image may give the mysql user another uid, and a root-owned copy does not start."""
    conf.parent.mkdir(parents=True, exist_ok=True)
    # slurmdbd reaches it over its Unix socket ("localhost"): no TCP listener at all.
    conf.write_text(f"# gpucluster: the accounting database lives on the head node's state volume.\n[mysqld]\n"
                    f"datadir = {data}\nskip-networking\n")
    if not (data / "mysql").is_dir():
        data.mkdir(parents=True, exist_ok=True)
        run("mariadb-install-db", "--user=mysql", f"--datadir={data}", "--auth-root-authentication-method=socket",
            "--skip-test-db")
    run("chown", "-R", "mysql:mysql", str(data))


def installed_spank_plugins(plugstack: str) -> str:
    """plugstack.conf without the SPANK plugins this image lacks (pyxis where it was not built): Slurm logs two error
    lines for a missing plugin at every sbatch and srun, `optional` or not (src/common/spank.c), and the configless
    compute nodes take the head's file. (Not an `include` of a drop-in directory: slurmctld reads configless includes
    itself, and refuses globs or waits a minute for a missing file.)"""
    return "".join(line for line in plugstack.splitlines(keepends=True)
                   if len(words := line.split()) < 2 or words[0] not in ("required", "optional")
                   or Path(words[1]).exists())


def slurm_files() -> int:
    """slurm.conf and friends into /etc/slurm; returns slurmdbd's port."""
    SLURM_ETC.mkdir(exist_ok=True)
    for conf in (BUNDLE / "slurm").iterdir():
        shutil.copy(conf, SLURM_ETC / conf.name)
    plugstack = SLURM_ETC / "plugstack.conf"
    plugstack.write_text(installed_spank_plugins(plugstack.read_text()))
    dbd = SLURM_ETC / "slurmdbd.conf"
    dbd.chmod(0o600)
    shutil.chown(dbd, "slurm", "slurm")
    for d in (STATE / "slurmctld", Path(contract.NODE_REGISTRY_DIR), Path("/var/log/slurm"), Path(contract.LOG_DIR)):
        d.mkdir(parents=True, exist_ok=True)
        shutil.chown(d, "slurm", "slurm")
    # Like the database: a new head image may give the slurm user another uid; the queue's state files follow it.
    run("chown", "-R", "slurm:slurm", str(STATE / "slurmctld"), contract.NODE_REGISTRY_DIR)
    # The node programs run as slurm and the budget guardrail as root, both into this log: whoever wrote first must
    # not lock the other out.
    for log_file in (Path(contract.NODE_LOG), Path(contract.EVENTS_LOG)):
        log_file.touch()
        shutil.chown(log_file, "slurm", "slurm")
    drop_in("slurmdbd.service", ON_STATE_VOLUME + SLURM_RUNTIME)
    # A restart (a changed stack) must not kill resume and suspend programs under way: Slurm lets them outlive
    # slurmctld, systemd's default kills the whole control group.
    drop_in("slurmctld.service", ON_STATE_VOLUME + SLURM_RUNTIME + "KillMode=process\n")
    return next(int(line.split("=", 1)[1]) for line in dbd.read_text().splitlines() if line.startswith("DbdPort="))


def node_control_units() -> None:
    """The reconciler's service and timer, and the interruptions service (Slurm runs its resume, suspend and
    resume-fail programs itself, by the paths slurm.conf names)."""
    (SYSTEMD / f"{contract.RECONCILE_UNIT}.service").write_text(unit(
        "gpucluster: match EC2 instances and Slurm nodes", "Service",
        ["Type=oneshot", "User=slurm", f"ExecStart={contract.RECONCILE_PROGRAM}"], wanted_by=None))
    (SYSTEMD / f"{contract.RECONCILE_UNIT}.timer").write_text(unit(
        # From the moment the bootstrap starts it (always-on nodes powered up at once), then every minute.
        "gpucluster reconciler every minute", "Timer", ["OnActiveSec=10s", "OnUnitActiveSec=60s"],
        wanted_by="timers.target"))
    # As slurm, like the programs Slurm runs: it drains, signals and requeues, and reads the registry.
    (SYSTEMD / f"{contract.INTERRUPTIONS_UNIT}.service").write_text(unit(
        "gpucluster: act on EC2's spot interruption warnings", "Service",
        ["User=slurm", f"ExecStart={contract.INTERRUPTIONS_PROGRAM}", "Restart=always", "RestartSec=10"],
        after="slurmctld.service"))


def budget_guardrail(systemd: Path = SYSTEMD, sbin: Path = Path("/usr/local/sbin")) -> None:
    """The guardrail service, and `gpucluster-budget` on the admin's PATH for status, check, close and reopen."""
    command = sbin / contract.BUDGET_COMMAND
    sbin.mkdir(parents=True, exist_ok=True)
    command.unlink(missing_ok=True)  # made anew: a former bundle's may name another program
    command.symlink_to(contract.BUDGET_PROGRAM)
    # As root: it writes the state that `sudo gpucluster-budget reopen` also writes.
    (systemd / f"{contract.BUDGET_UNIT}.service").write_text(unit(
        "gpucluster budget guardrail: close the partitions when the budget is spent", "Service",
        [f"ExecStart={command} run", "Restart=always", "RestartSec=30"], after="slurmctld.service"))


def node_names(systemd: Path = SYSTEMD) -> None:
    """The service that publishes registered nodes' names and addresses (HOSTS_PROGRAM): as root, for the head's
    /etc/hosts; it waits for slurmctld, and retries while /fsx is not there yet (a reboot)."""
    (systemd / "gpucluster-hosts.service").write_text(unit(
        "gpucluster: node names that resolve (/etc/hosts and the shared hosts file)", "Service",
        [f"ExecStart=/usr/bin/python3 {contract.HOSTS_PROGRAM} publish", "Restart=always", "RestartSec=5"],
        after="slurmctld.service"))


def command_line(bin_dir: Path = Path("/usr/local/bin")) -> None:
    """`gpucluster cost|render|preflight` for the admins, from the library and stack file in the bundle and the
    image's venv (pydantic)."""
    command = bin_dir / "gpucluster"
    bin_dir.mkdir(parents=True, exist_ok=True)
    # Bare stack names: the bundle's stack file (gpucluster.project.stack_dirs, render/bundle.py STACKS_IN_LIB).
    command.write_text(f"#!/bin/sh\nGPUCLUSTER_STACKS={contract.LIB_DIR}/stacks "
                       f"PYTHONPATH={contract.LIB_DIR} exec {IMAGE_VENV}/bin/python -m gpucluster \"$@\"\n")
    command.chmod(0o755)


# --- the head: sshd for `gpucluster ssh-proxy` ------------------------------------------------------------------------
# The key a person pushes with EC2 Instance Connect is looked up by the ec2-instance-connect package's command, as its
# own user (contract/lockdown.py EIC_USER says what it does and why that user reaches instance metadata).
EIC_KEYS_COMMAND = "/usr/share/ec2-instance-connect/eic_run_authorized_keys"
SSHD = Path("/usr/sbin/sshd")
# sshd takes the first value it reads of a keyword, and Ubuntu's sshd_config starts with `Include
# /etc/ssh/sshd_config.d/*.conf`, read in name order: 10- comes before cloud-init's 50- and the cloud image's 60-.
SSHD_DROP_IN = Path("/etc/ssh/sshd_config.d/10-gpucluster.conf")
# Ubuntu 24.04 starts sshd from ssh.socket (socket activation, Ubuntu 22.10 and later): the socket, not sshd, binds
# the port, so the address is set there too (an empty ListenStream= drops the packaged and generated ones).
SSH_SOCKET_DROP_IN = "[Socket]\nListenStream=\nListenStream=127.0.0.1:22\n"


def sshd_config() -> str:
    """The head's sshd: reached only through Session Manager's stream to the head's loopback, keys only from EC2
    Instance Connect. No authorized_keys file: a pushed key is good for 60 s and for the name IAM let its pusher push
    for, so each login is IAM's decision of that moment, in CloudTrail; a key file in a home on /fsx (which S3
    imports write into) would outlive a person's access and could be planted."""
    return "\n".join([
        "# gpucluster: SSH through Session Manager only (`gpucluster ssh-config`), keys from EC2 Instance Connect.",
        "ListenAddress 127.0.0.1",
        "PermitRootLogin no",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "AuthenticationMethods publickey",
        "AuthorizedKeysFile none",
        f"AuthorizedKeysCommand {EIC_KEYS_COMMAND} %u %f",
        f"AuthorizedKeysCommandUser {lockdown.EIC_USER}",
        "",
    ])


def ssh_server(config: Path = SSHD_DROP_IN, systemd: Path = SYSTEMD) -> None:
    """sshd as sshd_config() says, (re)started. Canonical's Ubuntu images carry sshd and ec2-instance-connect; an
    image without them boots without SSH, with a warning: `gpucluster connect` still works."""
    missing = [str(path) for path in (SSHD, Path(EIC_KEYS_COMMAND)) if not path.exists()]
    if missing or not _exists_user(lockdown.EIC_USER):
        log.warning("no SSH on this head (`gpucluster ssh-config`): the image lacks %s (packages openssh-server and "
                    "ec2-instance-connect)", ", ".join(missing) or f"the user {lockdown.EIC_USER}")
        return
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(sshd_config())
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # privilege separation's, which sshd -t insists on
    run(str(SSHD), "-t")  # the whole configuration as sshd will read it (a fault fails the boot, as for any unit)
    if run("systemctl", "is-enabled", "ssh.socket", check=False).stdout.strip() == "enabled":
        drop_in("ssh.socket", SSH_SOCKET_DROP_IN, systemd)
        run("systemctl", "stop", "ssh.service")  # it holds the socket's old address
        start("ssh.socket")
    else:
        start("ssh.service")


def _exists_user(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def wait_for_port(port: int, host: str = "127.0.0.1", seconds: float = 60) -> None:
    """A daemon this one needs at its start: slurmctld's first start fails when slurmdbd does not answer yet ("no
    TRES"); a configless slurmd cannot start before its controller answers (a head being replaced)."""
    import socket

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"nothing answers on {host}:{port} after {seconds:.0f} s")


def controller_up() -> None:
    answer = run("scontrol", "ping", check=False).stdout
    if "UP" not in answer:
        raise RuntimeError(f"slurmctld does not answer yet: {answer.strip()}")


def head(s: ClusterSettings) -> None:
    state_volume(s.state_volume_id)  # first: it keeps the list of the accounts the cluster made (accounts.py)
    people_accounts(s, "head")
    install_munge_key()
    start("munge")
    database_dir()
    drop_in("mariadb.service", ON_STATE_VOLUME)
    start("mariadb")
    run("mariadb", "-u", "root", "-e", (BUNDLE / "accounting.sql").read_text())
    dbd_port = slurm_files()
    node_control_units()
    start("slurmdbd")
    wait_for_port(dbd_port)
    start("slurmctld", f"{contract.RECONCILE_UNIT}.timer")
    if s.interruption_queue_url:
        start(f"{contract.INTERRUPTIONS_UNIT}.service")
    # slurmdbd pushes new accounts and users to slurmctld; one it cannot reach yet never learns them until it restarts.
    retry("slurmctld to answer", controller_up, attempts=8, delay=0.5)
    if s.budget is not None:
        budget_guardrail()
        start(f"{contract.BUDGET_UNIT}.service")
    run("sh", str(BUNDLE / "accounting.sh"))  # the team's account, its users and its monthly GPU-hours
    command_line()
    update_timer()
    start(f"{contract.UPDATE_UNIT}.timer")
    mount_lustre(s.fsx_dns_name, s.fsx_mount_name)
    # Root's own entries on /fsx first, then /fsx open to all: on a new file system no user can make a path root is
    # about to write (a later boot finds it world-writable: safe_paths then sets aside what root did not make).
    people_homes(s)
    shared_examples()
    own_directory(Path(contract.NODE_HOSTS_FILE).parent)
    os.chmod(contract.SHARED_DIR, 0o1777)  # like /tmp: all may submit from and write into /fsx, only owners delete
    node_names()
    start("gpucluster-hosts.service")
    head_monitoring(s)
    ssh_server()


# --- the head: a changed stack applied in place -----------------------------------------------------------------------

RESTART_PENDING = Path(contract.ETC_DIR) / "slurmctld-restart-pending"  # node definitions changed, not yet restarted
BUSY = {"ALLOCATED", "MIXED", "COMPLETING", "POWER_UP", "POWERING_UP"}  # a job has it, or it is being launched


def update_timer(systemd: Path = SYSTEMD) -> None:
    """Every minute the fetcher reads the settings (one GetParameters call) and, when a `pulumi up` changed them, the
    bundle they name; then `bootstrap.py head --update`. The fetcher is the bundle's copy, so it is the new one.
    First, whatever the update does: the associations of people the stack removed go once their last job has ended
    (sacctmgr refused while it ran); a failure there ("-") is logged and keeps no update from running."""
    (systemd / f"{contract.UPDATE_UNIT}.service").write_text(unit(
        "gpucluster: apply a changed stack (pulumi up) on the running head", "Service",
        ["Type=oneshot", f"ExecStart=-/bin/sh {contract.PEOPLE_LEAVERS_SCRIPT}",
         f"ExecStart=/usr/bin/python3 {contract.BUNDLE_FETCHER} "
         f"{contract.NODE_ENV_FILE} --update {contract.APPLIED_FILE}"], wanted_by=None,
        ordered_after=contract.BOOT_UNIT))  # never beside a boot's own bootstrap
    (systemd / f"{contract.UPDATE_UNIT}.timer").write_text(unit(
        "gpucluster: look for a changed stack every minute", "Timer", ["OnActiveSec=60s", "OnUnitActiveSec=60s"],
        wanted_by="timers.target"))


def mark_applied(settings_file: Path = Path(contract.SETTINGS_FILE),
                 marker: Path = Path(contract.APPLIED_FILE)) -> None:
    marker.write_text(hashlib.sha256(settings_file.read_bytes()).hexdigest() + "\n")


def node_lines(slurm_conf: str) -> set[str]:
    return {line for line in slurm_conf.splitlines() if line.startswith("NodeName=")}


def conf_nodes(slurm_conf: str) -> set[str]:
    return {n for line in node_lines(slurm_conf) for n in expand_hostlist(line.split()[0].split("=", 1)[1])}


def slurm_states() -> dict[str, frozenset[str]]:
    return {n.name: n.state for n in slurm_json.nodes(run("scontrol", *slurm_json.SHOW_NODES).stdout)}


def retire(nodes: list[str], states: dict[str, frozenset[str]]) -> list[str]:
    """Nodes the new configuration drops go first: drained, so no job lands on them, and powered down once their jobs
    end (the suspend program terminates their instances); once off, set DOWN so that nothing wakes them before the
    new configuration is in. Returns those not done yet."""
    busy = [n for n in nodes if n in states and ("POWERED_DOWN" not in states[n] or states[n] & BUSY)]
    off = [n for n in nodes if n in states and n not in busy and "DOWN" not in states[n]]
    down = [n for n in busy if "DOWN" in states[n] and not states[n] & {"POWER_DOWN", "POWERING_DOWN"}]
    drain = [n for n in busy if n not in down and not states[n] & {"POWER_DOWN", "POWERING_DOWN"}]
    if off:
        run("scontrol", "update", f"nodename={','.join(off)}", "state=down", f"reason={reasons.REMOVED}")
    if down:  # DOWN nodes run no job
        run("scontrol", "update", f"nodename={','.join(down)}", "state=power_down_force")
    if drain:
        run("scontrol", "update", f"nodename={','.join(drain)}", "state=power_down_asap", f"reason={reasons.REMOVED}")
    return busy


def update(s: ClusterSettings) -> bool:
    """Apply a changed stack on the running head, without stopping running jobs or the fleet: nodes the stack drops
    are retired first (the update waits, timer tick after timer tick, until they are powered down); then the new
    Slurm files; slurmctld restarts when node definitions changed (it keeps its queue and running jobs in its state
    files; slurmd and jobs run on), else it rereads them; `scontrol reconfigure` sends them to the configless nodes;
    accounts and quota are set anew. New nodes launch from the pools' new launch template versions (their default).
    The people go first, whatever else waits: their accounts and homes, the compute nodes' copy (their Prolog
    applies it before each job), then their associations. Returns whether everything was applied."""
    people_accounts(s, "head")
    people_homes(s)
    run("sh", str(BUNDLE / "accounting.sh"))  # again below, once slurmctld has the new files (new gres types)
    old = (SLURM_ETC / "slurm.conf").read_text()
    new = (BUNDLE / "slurm" / "slurm.conf").read_text()
    gone = sorted(conf_nodes(old) - conf_nodes(new))
    waiting = retire(gone, slurm_states()) if gone else []
    if waiting:
        log.info("waiting for %s, which the stack drops, to finish their jobs and power down",
                 compress_hostlist(waiting))
        return False
    if node_lines(old) != node_lines(new):
        RESTART_PENDING.touch()  # kept until the restart worked: the next tick compares the new files with themselves
    slurm_files()
    node_control_units()
    if s.budget is not None:
        budget_guardrail()
    node_names()
    run("systemctl", "daemon-reload")  # the units as just written (a new bundle may run its programs from elsewhere)
    if RESTART_PENDING.exists():
        run("systemctl", "restart", "slurmctld")
        retry("slurmctld to answer", controller_up, attempts=8, delay=0.5)
        RESTART_PENDING.unlink()
    run("scontrol", "reconfigure")
    run("sh", str(BUNDLE / "accounting.sh"))
    if s.budget is not None:
        run("systemctl", "restart", f"{contract.BUDGET_UNIT}.service")
    if s.interruption_queue_url:
        run("systemctl", "restart", f"{contract.INTERRUPTIONS_UNIT}.service")  # the new bundle's program
    run("systemctl", "restart", "gpucluster-hosts.service")  # the new bundle's publisher
    grow_state_volume(s.state_volume_id)  # `up` may have enlarged it; Prometheus' retention counts on its size
    head_monitoring(s)  # the new bundle's Prometheus files and metrics program, the topic as it is now
    command_line()
    shared_examples()
    return True


# --- compute ---------------------------------------------------------------------------------------------------------

def slurm_client_conf(s: ClusterSettings, path: Path = Path(contract.SLURM_CLIENT_CONF)) -> Path:
    """What scontrol needs to ask the controller before slurmd has fetched the cluster's configuration."""
    path.write_text(f"ClusterName={s.cluster}\nSlurmctldHost={contract.HEAD_HOSTNAME}\nSlurmctldPort={s.slurmctld_port}\n"
                    "AuthType=auth/munge\n")
    return path


def own_node(instance_id: str, scontrol_json: str) -> str:
    """The node whose NodeHostName is this instance's id: the resume program set it the moment EC2 answered."""
    found = [n.name for n in slurm_json.nodes(scontrol_json) if n.hostname == instance_id]
    if len(found) != 1:
        raise RuntimeError(f"{len(found)} Slurm node(s) for {instance_id}: {', '.join(found) or 'none yet'}")
    return found[0]


def node_name(s: ClusterSettings, saved: Path = Path(contract.NODE_NAME_FILE), attempts: int = 60) -> str:
    """This instance's Slurm node name, learned from the controller at the first boot and kept for the instance's
    life (a reboot keeps its node). No per-instance AWS call: Slurm knows which node this instance is."""
    if saved.exists():
        return saved.read_text().strip()
    instance_id = imds("meta-data/instance-id")
    env = {**os.environ, "SLURM_CONF": str(slurm_client_conf(s))}
    name = retry(f"the Slurm node of {instance_id}",
                 lambda: own_node(instance_id, run("scontrol", *slurm_json.SHOW_NODES, env=env).stdout),
                 attempts=attempts, delay=2)
    saved.write_text(name + "\n")
    return name


def nccl_environment(pool: PoolSettings) -> str:
    """NCCL/EFA settings for jobs (aws-ofi-nccl >= 1.7, libfabric >= 1.18 as on the DLAMIs), as NAME=value lines for
    the TaskProlog (task_prolog.sh), which gives them to every task that does not set them itself (LD_LIBRARY_PATH:
    added to the task's own). NVIDIA nodes: aws-ofi-nccl on the loader's path and named, so that the job's own NCCL
    (a torch wheel's) loads it instead of falling back to TCP sockets unseen. EFA pools: NCCL_NET names the plugin's
    network, so that a plugin that does not load fails the job (NCCL then initialises no other network; every
    aws-ofi-nccl release answers to "AWS Libfabric", the newer ones also to "Libfabric")."""
    lines = ["NCCL_SOCKET_IFNAME=^docker,lo,veth", "NCCL_DEBUG=WARN"]
    nvidia = pool.accelerator == "nvidia"
    if nvidia:
        lines += [f"LD_LIBRARY_PATH={contract.AWS_OFI_NCCL_LIB_DIR}", f"NCCL_NET_PLUGIN={contract.NCCL_NET_PLUGIN}"]
    if pool.efa_interfaces:
        lines += ["FI_PROVIDER=efa", "FI_EFA_USE_HUGE_PAGE=0"] + (["NCCL_NET=AWS Libfabric"] if nvidia else [])
    return "\n".join(lines) + "\n"


def local_scratch(nvme: Path = Path("/opt/dlami/nvme"), scratch: Path = Path(contract.LOCAL_SCRATCH)) -> Path:
    """The node's scratch space (settings.LOCAL_SCRATCH): a link to a directory on local NVMe (dlami-nvme.service
    mounts it before this unit runs), or a directory on the root volume where the instance has none; never /tmp. In it
    each job's private /tmp (JOB_TMP_DIR, Slurm's job_container/tmpfs) and enroot's directories (ENROOT_DIR), all
    root's and 0755: only root makes entries there (a user's own enroot directories: the Prolog, container_directories
    in health.py)."""
    if mounted(str(nvme)):
        target = own_directory(nvme / "gpucluster")
        if not (scratch.is_symlink() and os.readlink(scratch) == str(target)):
            if os.path.lexists(scratch):
                set_aside(scratch, "is not the link to the instance store")
            scratch.symlink_to(target)
    else:
        own_directory(scratch)
    for directory in (contract.JOB_TMP_DIR, contract.ENROOT_DIR, contract.PMIX_TMP_DIR):
        own_directory(Path(directory))
    for kind in contract.ENROOT_KINDS:
        own_directory(Path(contract.ENROOT_DIR) / kind)  # 0755: an image's 1777 directory of an older layout too
    return scratch


def container_storage(conf: Path = Path("/etc/enroot/enroot.conf.d/gpucluster.conf")) -> None:
    """enroot's image cache, container data and runtime files per user in the node's scratch space. enroot runs as
    the user and only `mkdir -p`s these paths: the Prolog has made them, the user's own, before the job starts."""
    conf.parent.mkdir(parents=True, exist_ok=True)
    conf.write_text("".join(f"ENROOT_{kind.upper()}_PATH {contract.ENROOT_DIR}/{kind}/$(id -u)\n"
                            for kind in contract.ENROOT_KINDS))


def gpu_metrics(pool: str, region: str, systemd: Path = SYSTEMD) -> str | None:
    """Utilisation for the pool's idle alarm: the CloudWatch agent (in the node image) on NVIDIA nodes, the
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
         f"ExecStart=/usr/bin/python3 {contract.NEURON_METRICS_PROGRAM} {neuron} -- /opt/aws/neuron/bin/neuron-monitor",
         "Restart=always", "RestartSec=30"]))
    return "gpucluster-neuron-metrics.service"


# --- monitoring -------------------------------------------------------------------------------------------------------

METRICS_UNIT = "gpucluster-metrics.service"


def in_image(tool: str) -> bool:
    """Monitoring never keeps a node from work: an image baked before it (a pool's pinned ami_id, a head kept on
    its AMI) boots without it, with a warning. `pulumi up --replace` of the image's resource bakes a new one."""
    if shutil.which(tool):
        return True
    log.warning("%s is not in this node image (baked before gpucluster's monitoring): no metrics from it", tool)
    return False


def node_exporter(s: ClusterSettings, node: str, address: str) -> None:
    """node_exporter on this node's private address only, with the textfile collector our figures go through."""
    if not in_image("prometheus-node-exporter"):
        return
    Path(contract.TEXTFILE_DIR).mkdir(parents=True, exist_ok=True)
    port = s.exporter_port(contract.NODE_JOB, node)
    Path("/etc/default/prometheus-node-exporter").write_text(
        f'ARGS="--web.listen-address={address}:{port} --collector.textfile.directory={contract.TEXTFILE_DIR} '
        f'{" ".join(contract.NODE_EXPORTER_FLAGS)}"\n')
    start("prometheus-node-exporter")


def metrics_writer(role: str, systemd: Path = SYSTEMD) -> None:
    """METRICS_PROGRAM: Slurm, quota and prices on the head; EFA and Lustre bytes on compute nodes."""
    (systemd / METRICS_UNIT).write_text(unit(
        "gpucluster: Slurm, EFA and Lustre figures for node_exporter", "Service",
        [f"ExecStart=/usr/bin/python3 {contract.METRICS_PROGRAM} {role}", "Restart=always", "RestartSec=10"],
        ordered_after="slurmctld.service"))
    start(METRICS_UNIT)


def alertmanager_config(s: ClusterSettings) -> str:
    """Every alert to the stack's topic (contract.alertmanager_routing, the EKS flavour's too), with the instance
    role's credentials. JSON being YAML."""
    return json.dumps(contract.alertmanager_routing(s.alerts_topic_arn, s.region, s.cluster), indent=1) + "\n"


def grafana(systemd: Path = SYSTEMD, provisioning: Path = Path("/etc/grafana/provisioning"),
            home: Path = Path("/usr/share/grafana"), password: Path = Path(contract.ETC_DIR) / "grafana-admin-password",
            ) -> str | None:
    """Grafana on 127.0.0.1 (a Session Manager port forward reaches it), viewers without a login, our dashboards and
    Prometheus provisioned. Returns its unit, None where the image has no Grafana (the rehearsal's: Debian has none).
    The admins' password (sudo cat) is made here, never in user data."""
    if not home.is_dir():
        log.warning("no Grafana in this image: dashboards only through Prometheus")
        return None
    (provisioning / "datasources").mkdir(parents=True, exist_ok=True)
    (provisioning / "dashboards").mkdir(parents=True, exist_ok=True)
    (provisioning / "datasources" / "gpucluster.yaml").write_text(json.dumps({"apiVersion": 1, "datasources": [{
        "name": "Prometheus", "type": "prometheus", "uid": contract.GRAFANA_DATASOURCE_UID, "access": "proxy",
        "url": f"http://127.0.0.1:{contract.PROMETHEUS_PORT}", "isDefault": True, "editable": False}]}, indent=1))
    (provisioning / "dashboards" / "gpucluster.yaml").write_text(json.dumps({"apiVersion": 1, "providers": [{
        "name": "gpucluster", "type": "file", "disableDeletion": True, "allowUiUpdates": False,
        "options": {"path": str(BUNDLE / contract.DASHBOARDS_DIR)}}]}, indent=1))
    if not password.exists():  # made 0640 from the start: never a moment readable by all
        with os.fdopen(os.open(password, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640), "w") as out:
            out.write(hashlib.sha256(os.urandom(32)).hexdigest()[:32])
    shutil.chown(password, "root", "grafana")
    drop_in("grafana-server.service", "[Service]\n" + "".join(f"Environment={k}={v}\n" for k, v in {
        "GF_SERVER_HTTP_ADDR": "127.0.0.1", "GF_SERVER_HTTP_PORT": contract.GRAFANA_PORT,
        "GF_AUTH_ANONYMOUS_ENABLED": "true", "GF_AUTH_ANONYMOUS_ORG_ROLE": "Viewer", "GF_USERS_ALLOW_SIGN_UP": "false",
        "GF_ANALYTICS_REPORTING_ENABLED": "false", "GF_ANALYTICS_CHECK_FOR_UPDATES": "false",
        "GF_SECURITY_ADMIN_PASSWORD__FILE": password}.items()), systemd)
    return "grafana-server"


def head_monitoring(s: ClusterSettings) -> None:
    """Prometheus (history on the state volume), Alertmanager to the stack's topic, Grafana; node_exporter and the
    Slurm figures of the head itself. Prometheus finds the nodes in the lists gpucluster-hosts keeps."""
    node_exporter(s, contract.HEAD_HOSTNAME, s.head_address)
    metrics_writer("head")
    if not in_image("prometheus"):
        return
    for directory in (contract.SCRAPE_TARGETS_DIR, contract.PROMETHEUS_DATA_DIR):
        Path(directory).mkdir(parents=True, exist_ok=True)
    # The whole history: a new head image may give the prometheus user another uid.
    run("chown", "-R", "prometheus:prometheus", contract.PROMETHEUS_DATA_DIR)
    shutil.copyfile(BUNDLE / "prometheus" / "prometheus.env", "/etc/default/prometheus")
    drop_in("prometheus.service", ON_STATE_VOLUME)
    Path("/etc/prometheus").mkdir(exist_ok=True)
    Path("/etc/prometheus/alertmanager.yml").write_text(alertmanager_config(s))
    # No cluster gossip (it listens on every address by default): one Alertmanager.
    Path("/etc/default/prometheus-alertmanager").write_text(
        f'ARGS="--config.file=/etc/prometheus/alertmanager.yml --cluster.listen-address= '
        f'--web.listen-address=127.0.0.1:{contract.ALERTMANAGER_PORT}"\n')
    start("prometheus", "prometheus-alertmanager", *filter(None, [grafana()]))


def gpu_exporter(s: ClusterSettings, pool: PoolSettings, node: str, address: str,
                 systemd: Path = SYSTEMD) -> str | None:
    """dcgm-exporter (the image's container) on NVIDIA nodes, with the Prolog's GPU-to-job files; neuron-monitor's
    Prometheus output on Trainium nodes. Returns the unit to start."""
    job = next((j for j in contract.SCRAPE_JOBS if j.accelerator and j.accelerator == pool.accelerator), None)
    if job is None:
        return None
    port = s.exporter_port(job, node)
    if not in_image("docker" if pool.accelerator == "nvidia" else "/opt/aws/neuron/bin/neuron-monitor-prometheus.py"):
        return None
    if pool.accelerator == "nvidia":
        Path(contract.GPU_JOB_MAP_DIR).mkdir(parents=True, exist_ok=True)
        counters = BUNDLE / "dcgm-exporter" / "counters.csv"
        command = (f"docker run --rm --name gpucluster-dcgm-exporter --gpus all --cap-add SYS_ADMIN --network host "
                   f"-v {contract.GPU_JOB_MAP_DIR}:{contract.GPU_JOB_MAP_DIR}:ro -v {counters}:{counters}:ro "
                   f"-e DCGM_EXPORTER_LISTEN={address}:{port} -e DCGM_EXPORTER_COLLECTORS={counters} "
                   f"-e DCGM_HPC_JOB_MAPPING_DIR={contract.GPU_JOB_MAP_DIR} "
                   # The AMI's DCGM host engine (nvidia-dcgm.service), which the health check's dcgmi uses too:
                   # a second engine in the container could be refused the profiling fields.
                   f"-e DCGM_REMOTE_HOSTENGINE_INFO=localhost:5555 {contract.DCGM_EXPORTER_IMAGE}")
        body = ["ExecStartPre=-docker rm -f gpucluster-dcgm-exporter",  # one a crash left behind holds the name
                f"ExecStart={command}", "ExecStop=docker stop gpucluster-dcgm-exporter"]
    else:
        neuron = "/opt/aws/neuron/bin"
        body = [f'ExecStart=/bin/sh -c "{neuron}/neuron-monitor | {neuron}/neuron-monitor-prometheus.py --port {port}"']
    # dcgm-exporter reads the host engine: started with it (Wants=), not only after it when something else starts it.
    nvidia = pool.accelerator == "nvidia"
    (systemd / "gpucluster-gpu-exporter.service").write_text(unit(
        f"gpucluster: {pool.accelerator} metrics for Prometheus", "Service", body + ["Restart=always", "RestartSec=10"],
        after="nvidia-dcgm.service" if nvidia else "", ordered_after="docker.service" if nvidia else ""))
    return "gpucluster-gpu-exporter.service"


def set_hostname(name: str) -> None:
    """The Slurm node name, kept across reboots (user data sets preserve_hostname)."""
    Path("/etc/hostname").write_text(name + "\n")
    run("hostname", name)


def configuration_holds() -> bool:
    """The first boot's checks of what only this instance can tell (HEALTH_PROGRAM --configuration: DCGM's host
    engine, the kernel's Lustre module, the pool tag, NCCL's EFA plugin), before anything needs them. A fault leaves
    the node DOWN with its fix as the reason and the boot ends here: slurmd stays stopped, for a node that registers
    is returned to service (ReturnToService=2), and a fresh instance would meet the same fault."""
    checked = run("/usr/bin/python3", contract.HEALTH_PROGRAM, "--configuration", check=False)
    for line in checked.stderr.splitlines():
        log.warning("%s", line)
    if checked.returncode:
        log.error("configuration fault: the node is DOWN (sinfo -R says what to fix); slurmd not started")
    return checked.returncode == 0


def compute(s: ClusterSettings, env: dict[str, str]) -> None:
    people_accounts(s, "compute")
    hosts_entry(s.head_address)
    install_munge_key()
    start("munge")
    wait_for_port(s.slurmctld_port, contract.HEAD_HOSTNAME, seconds=600)  # a head being replaced comes back
    name = node_name(s)
    set_hostname(name)
    pool = s.pools[env["GPUCLUSTER_POOL"]]
    Path(contract.NCCL_ENV_FILE).write_text(nccl_environment(pool))
    if not configuration_holds():
        return
    # NCCL keeps its buffers in /dev/shm: allow most of the node's memory.
    run("mount", "-o", "remount,size=90%", "/dev/shm", check=False)
    mount_lustre(s.fsx_dns_name, s.fsx_mount_name)
    # The head makes the people's homes (before their associations exist, so before any job of theirs): only the
    # bind mount here. The login user's home as always without `users:`.
    shared_home(users=() if s.people else (contract.LOGIN_USER,))
    local_scratch()
    container_storage()
    metrics = gpu_metrics(pool.name, s.region)
    if metrics:
        start(metrics)
    address = imds("meta-data/local-ipv4")
    node_exporter(s, name, address)
    metrics_writer("compute")
    exporter = gpu_exporter(s, pool, name, address)
    if exporter:
        start(exporter)
    # Configless: slurm.conf and gres, cgroup, job_container, mpi, plugstack.conf come from the controller.
    Path("/etc/default/slurmd").write_text(
        f'SLURMD_OPTIONS="--conf-server {contract.HEAD_HOSTNAME}:{s.slurmctld_port} -N {name}"\n')
    drop_in("slurmd.service", SLURMD_DROP_IN)
    Path(contract.SLURMD_SPOOL_DIR).mkdir(parents=True, exist_ok=True)
    # Before the node takes work: its health, with a short DCGM diagnostic. A failing node drains itself (its first
    # job is requeued by the Prolog's check) and the reconciler gives it a fresh instance.
    run("/usr/bin/python3", contract.HEALTH_PROGRAM, "--boot", check=False)
    start("slurmd")


def main(argv: list[str]) -> int:
    Path(contract.LOG_DIR).mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        handlers=[logging.StreamHandler(sys.stderr), logging.FileHandler(contract.BOOT_LOG)])
    role = argv[1] if len(argv) > 1 else ""
    updating = argv[2:] == ["--update"]
    if role not in contract.ROLES or argv[2:] not in ([], ["--update"]) or (updating and role != "head"):
        print(f"usage: bootstrap.py {'|'.join(contract.ROLES)} | bootstrap.py head --update", file=sys.stderr)
        return 2
    try:
        s = ClusterSettings.load()
        if updating:
            if update(s):
                mark_applied()
                log.info("bootstrap head --update: the changed stack is applied")
            return 0
        ensure_image(role)
        lock_down(role)
        if role == "head":
            head(s)
            mark_applied()
        else:
            compute(s, read_env_file())
    except Exception:
        log.exception("bootstrap %s%s failed", role, " --update" if updating else "")
        return 1
    log.info("bootstrap %s done", role)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
