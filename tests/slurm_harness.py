"""A real Slurm controller on this machine, started from gpucluster's rendered slurm.conf.

Only paths and ports differ from what the head node gets (SlurmLayout); munge runs with a fresh key of its own.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from gpucluster import slurm
from gpucluster.spec import Stack

REQUIRED = ("munged", "slurmctld", "slurmdbd", "sinfo", "scontrol", "sacctmgr", "mariadbd", "mariadb-install-db")


def missing_tools() -> list[str]:
    return [tool for tool in REQUIRED if not shutil.which(tool)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _own(path: Path, user: str) -> None:
    entry = pwd.getpwnam(user)
    os.chown(path, entry.pw_uid, entry.pw_gid)


@dataclass
class Controller:
    conf: Path
    env: dict[str, str]
    procs: list[subprocess.Popen[bytes]]
    log: Path

    def run(self, *args: str) -> str:
        return subprocess.run(list(args), env=self.env, check=True, capture_output=True, text=True, timeout=30).stdout

    def stop(self) -> None:
        stop_all(self.procs)


def spawn(procs: list[subprocess.Popen[bytes]], args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start a daemon in its own process group (so that a wrapper such as runuser dies with what it runs)."""
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    procs.append(proc)
    return proc


def stop_all(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in reversed(procs):
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in reversed(procs):
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def wait_for(what: str, ready, watched: list[subprocess.Popen[bytes]], logs: list[Path], seconds: float = 30) -> None:  # type: ignore[no-untyped-def]
    """Poll `ready` until it holds; fail with the logs' tails if a watched process dies or time runs out."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if ready():
            return
        if any(p.poll() is not None for p in watched):
            break
        time.sleep(0.2)
    tails = "\n".join(f"--- {log}\n{log.read_text()[-2000:]}" for log in logs if log.exists())
    raise RuntimeError(f"{what} did not come up:\n{tails}")


def port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def start_database(root: Path, procs: list[subprocess.Popen[bytes]]) -> Path:
    """A private MariaDB with the accounting user slurmdbd connects as (Unix-socket authentication)."""
    db = root / "mysql"
    data = db / "data"
    data.mkdir(parents=True)
    for path in (db, data):
        _own(path, "mysql")
    subprocess.run(["mariadb-install-db", "--user=mysql", f"--datadir={data}", "--auth-root-authentication-method=socket",
                    "--skip-test-db"], check=True, capture_output=True)
    sock = db / "mysqld.sock"
    log = db / "error.log"
    proc = spawn(procs, ["mariadbd", "--user=mysql", f"--datadir={data}", f"--socket={sock}", "--skip-networking",
                         f"--pid-file={db}/mysqld.pid", f"--log-error={log}"])
    wait_for("MariaDB", sock.exists, [proc], [log])
    subprocess.run(["mariadb", f"--socket={sock}", "-u", "root", "-e", slurm.ACCOUNTING_DB_SQL], check=True)
    return sock


def start_controller(stack: Stack, root: Path) -> Controller:
    """MariaDB, munged, slurmdbd and slurmctld for `stack` under `root`; returns when `sinfo` answers."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        return _start_controller(stack, root, procs)
    except BaseException:
        stop_all(procs)
        raise


def _start_controller(stack: Stack, root: Path, procs: list[subprocess.Popen[bytes]]) -> Controller:
    munge_dir = root / "munge"
    munge_dir.mkdir()
    munge_dir.chmod(0o755)  # munged insists that every client can reach its socket
    key = munge_dir / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    for path in (munge_dir, key):
        _own(path, "munge")
    socket_path = munge_dir / "munge.socket"
    spawn(procs, ["runuser", "-u", "munge", "--", "munged", "--foreground", f"--key-file={key}", f"--socket={socket_path}",
                  f"--pid-file={munge_dir}/munged.pid", f"--log-file={munge_dir}/munged.log", f"--seed-file={munge_dir}/seed"])
    layout = slurm.SlurmLayout(
        controller_host=socket.gethostname(),
        controller_port=free_port(),
        node_port=free_port(),
        dbd_port=free_port(),
        state_dir=str(root / "state"),
        spool_dir=str(root / "spool"),
        log_dir=str(root / "log"),
        run_dir=str(root / "run"),
        programs_dir=str(root / "bin"),
        munge_socket=str(socket_path),
    )
    for d in (layout.state_dir, layout.spool_dir, layout.log_dir, layout.run_dir, layout.programs_dir):
        Path(d).mkdir()
        _own(Path(d), layout.slurm_user)
    conf = root / "slurm.conf"
    conf.write_text(slurm.slurm_conf(stack, layout))
    (root / "gres.conf").write_text(slurm.gres_conf(stack))
    dbd_conf = root / "slurmdbd.conf"
    dbd_conf.write_text(slurm.slurmdbd_conf(stack, layout))
    dbd_conf.chmod(0o600)
    _own(dbd_conf, layout.slurm_user)

    db_socket = start_database(root, procs)
    logs = Path(layout.log_dir)
    # slurmdbd reads slurmdbd.conf beside SLURM_CONF; the client library finds the private MariaDB by MYSQL_UNIX_PORT.
    env = {**os.environ, "SLURM_CONF": str(conf), "MYSQL_UNIX_PORT": str(db_socket)}
    dbd = spawn(procs, ["slurmdbd", "-D"], env)
    wait_for("slurmdbd", lambda: port_open(layout.dbd_port), [dbd], [logs / "slurmdbd.log"])
    ctld = spawn(procs, ["slurmctld", "-D", "-i", "-f", str(conf)], env)
    controller = Controller(conf, env, procs, logs / "slurmctld.log")
    wait_for("slurmctld", lambda: subprocess.run(["sinfo"], env=env, capture_output=True).returncode == 0,
             [ctld, dbd], [logs / "slurmctld.log", logs / "slurmdbd.log"])
    return controller
