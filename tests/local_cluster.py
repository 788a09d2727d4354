"""A real Slurm cluster on this machine, booted the way EC2 boots gpucluster's nodes, with AWS served by moto.

The boot rehearsal: every node, the head and each launched instance, is a set of Linux namespaces on this machine
whose root is an overlay over the rehearsal image (tests/rehearsal_image.py: Debian 13 with the node image's Slurm
release, PMIx, Open MPI, munge, MariaDB and Prometheus, from Debian's packages), with its own /run and /tmp, its own
host name and its own changes to the image. Each boots as EC2 would boot it: its user data, rendered by gpucluster,
goes through cloud-init's steps, which enable gpucluster-boot.service; that unit runs fetch_bundle.py (settings and
munge key from SSM, the bundle from S3, all in moto) and bootstrap.py in the node's role, which starts munge, MariaDB,
slurmdbd, slurmctld or slurmd from the packaged unit files and our drop-ins. Nothing here starts a Slurm daemon; the
tests' Slurm commands run on the head, inside its root (HEAD_COMMANDS).

What this machine forces, and stands in for it:
- no systemd as PID 1 and no cloud-init datasource: tests/rehearsal/systemctl and tests/rehearsal/cloud_init
  (their docstrings say what they do);
- no EC2: instances are moto's; a small instance-metadata server per node answers IMDSv2 (instance id and
  instance-profile credentials); the node image's Python finds boto3 and the AWS endpoints through one .pth file;
- no node image of Ubuntu's: the rehearsal image plays it, with the test venv as the image's venv (it and the Python
  it runs on are bound into every node at their paths here, as are the repository and the cluster's directory);
- no block device or Lustre: the head's state volume is a loop device behind its EBS by-id name, /fsx a directory
  shared by all nodes (mounted before the boot, so the bootstrap finds it mounted);
- no VPC: each cluster has a network namespace of its own (Network), which all its nodes share, so clusters run
  side by side and each one's lockdown rules are its own;
- one address for all of a cluster's nodes: the Slurm ports differ per node (SlurmLayout.node_port_base), slurmd
  reports the configured CPUs and GPUs (`config_overrides`, /dev/null as each GPU device), no cgroup plugin (this
  machine's cgroups are not Slurm's to use: cgroup.conf says CgroupPlugin=disabled), and compute nodes boot in a time
  namespace of their own (slurmctld ignores a node whose boot time predates its resume request); each node's
  exporters listen on ports of their own (settings exporter_port_base);
- no GPU, DCGM, NCCL or container runtime: nvidia-smi, nccl-tests' all_reduce_perf (over MPI) and `docker` (running
  dcgm-exporter) are stand-ins on GPU nodes;
  so are DCGM's host engine unit (installed, stopped), nv-hostengine and dcgmi (first_boot_stand_ins), which keeps
  health watches and injected fields (inject_gpu_fault: a GPU fault as the driver reports it);
- no Lustre module for this machine's kernel: `modinfo` is a stand-in on compute nodes; the metadata server serves
  the instance's tags from moto (the pools' launch templates put tags in the metadata).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Iterator

from gpucluster.contract.settings import (
    ALL_REDUCE_PERF,
    CLUSTER_TAG,
    HEALTH_PROGRAM,
    LOGIN_USER,
    NODE_LOG,
    NODE_REGISTRY,
    POOL_TAG,
    SCRAPE_JOBS,
)
from gpucluster.project import EXAMPLES_DIR
from gpucluster.render import slurm
from gpucluster.spec.model import Stack
from rehearsal_image import REHEARSAL_ROOTFS, python_version, stale

ROOT = Path(__file__).resolve().parent.parent
REHEARSAL = Path(__file__).resolve().parent / "rehearsal"
# What the harness runs on this machine; the nodes run the rehearsal image's programs.
REQUIRED = ("unshare", "nsenter", "chroot", "pivot_root", "losetup", "ip", "pgrep")
# The local clusters' own directories (/fsx, job output, the image's SDK), shared into their nodes at the same paths:
# not under /tmp, which every job on a node sees as an empty one of its own (job_container/tmpfs, as on an instance).
CLUSTERS_DIR = Path("/var/tmp/gpucluster-clusters")
# What a user or a test runs on the head node: these commands enter its namespaces (a login on the head).
HEAD_COMMANDS = ("sbatch", "squeue", "scontrol", "sinfo", "sacctmgr", "sshare", "sacct", "scancel", "srun", "sreport")
BOOT_SECONDS = 2.0
SITE_PACKAGES = Path(__import__("boto3").__path__[0]).resolve().parent
# The test venv, the node image's venv here, and the Python installation it runs on (outside the venv: this machine's).
TEST_VENV = SITE_PACKAGES.parents[2]
TEST_PYTHON = Path(sys.base_prefix).resolve()
# What the node image's python3-boto3 gives the system Python (Debian's is too old for AWS_ENDPOINT_URL): copied out
# of the test venv, whose directory the slurm user running the resume program may not be allowed to enter.
AWS_SDK = ("boto3", "botocore", "s3transfer", "jmespath", "dateutil", "urllib3", "six.py")


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:  # another file system
        shutil.copy2(source, target)


def image_sdk(target: Path) -> Path:
    """The AWS SDK for the rehearsal image, readable by every user."""
    target.mkdir(mode=0o755)
    for name in AWS_SDK:
        source = SITE_PACKAGES / name
        if source.is_dir():
            shutil.copytree(source, target / name, copy_function=_link_or_copy)
        else:
            _link_or_copy(str(source), str(target / name))
    return target
MOTO_ACCOUNT = "123456789012"
# LocalCluster.first_boot_faults: what a pool's next instances get wrong.
NO_LUSTRE_MODULE = "a kernel without a Lustre module"
UNTAGGED = "no pool tag on the instance"
LOGIN_UID = 1100  # the rehearsal image's login user, when this machine has none of that name
SPARE_NODE_PORTS = 4  # for nodes of pools that a test's changed stack adds (LocalCluster.apply)
IMAGE_AMI = "ami-12c6146b"  # one of moto's images
MOTO_SERVER = ("import threading\nfrom moto.server import ThreadedMotoServer\n"
               "server = ThreadedMotoServer(ip_address='127.0.0.1', port=0, verbose=False)\nserver.start()\n"
               "print(server.get_host_and_port()[1], flush=True)\nthreading.Event().wait()\n")


def missing_tools() -> list[str]:
    """What keeps the rehearsal from running here: tools of this machine's, the rehearsal image, or a checkout (or
    test venv) under /tmp, which the nodes share at its path and every job's private /tmp would hide (.ci/run tests a
    copy elsewhere)."""
    hidden = [f"{path} is under /tmp, hidden from the local clusters' jobs: use a checkout elsewhere"
              for path in (ROOT, TEST_VENV) if path.resolve().is_relative_to("/tmp")]
    return [tool for tool in REQUIRED if not shutil.which(tool)] + ([why] if (why := stale()) else []) + hidden


def new_cluster_root() -> Path:
    """A fresh directory for one local cluster, under CLUSTERS_DIR."""
    CLUSTERS_DIR.mkdir(mode=0o755, parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="gpucluster-cluster-", dir=CLUSTERS_DIR))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_block(count: int) -> int:
    """The first of `count` consecutive free ports, below the kernel's ephemeral range: a slurmd binds its port only
    when its node boots, and by then any outgoing connection could have taken an ephemeral port as its source.
    In the calling thread's network (Network.entered)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for base in range(max(1024, low - 12000), low - count):
        if all(_bindable(base + i) for i in range(count)):
            return base
    raise RuntimeError(f"no {count} consecutive free ports below {low}")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def wait_for(what: str, ready: Callable[[], bool], watched: list[subprocess.Popen[bytes]], logs: list[Path],
             seconds: float = 30) -> None:
    """Poll `ready` until it holds; fail with the logs' tails if a watched process dies or time runs out."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if ready():
            return
        if any(p.poll() is not None for p in watched):
            break
        time.sleep(0.2)
    tails = "\n".join(f"--- {log}\n{log.read_text()[-2500:]}" for log in logs if log.exists())
    raise RuntimeError(f"{what} did not come up in time:\n{tails}")


CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "setns")


class Network:
    """The cluster's own network namespace, as a VPC is its own: its nodes' addresses, their ports and the firewall
    rules of their lockdown are nobody else's, so local clusters run side by side and one's end takes nothing of
    another's. It lives while a holder process sleeps in it (and while sockets made in it are open); the kernel drops
    it, with its rules, after them. Its nodes enter it (`prefix`); the harness makes its servers' sockets in it
    (`entered`), so the nodes reach them on 127.0.0.1 while the servers' threads talk to moto outside."""

    # An interface besides loopback, as an instance has: where loopback holds the only IPv4 address, getaddrinfo for
    # IPv4 with AI_ADDRCONFIG (Slurm's, for the address a daemon listens on) finds none. Nothing is sent through it (a
    # veth pair with both ends here: this machine's kernel has no dummy interfaces).
    INTERFACE = ("ip link add eth0 type veth peer name eth1 && ip addr add 10.255.0.1/24 dev eth0 && "
                 "ip link set eth0 up && ip link set eth1 up")

    def __init__(self) -> None:
        up = f"ip link set lo up && {self.INTERFACE} && echo up && exec sleep infinity"
        self.holder = subprocess.Popen(["unshare", "--net", "--", "sh", "-c", up], stdout=subprocess.PIPE,
                                       start_new_session=True)
        assert self.holder.stdout is not None
        self.output = self.holder.stdout
        if self.output.readline() != b"up\n":
            stop(self.holder)
            raise RuntimeError("no network namespace for the cluster (unshare --net needs root)")
        self.path = f"/proc/{self.holder.pid}/ns/net"
        self.fd = os.open(self.path, os.O_RDONLY)

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        """The calling thread in this network: the sockets it makes meanwhile belong to it (namespaces are per
        thread; a socket keeps the one it was made in)."""
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        try:
            _setns(self.fd)
            try:
                yield
            finally:
                _setns(own)
        finally:
            os.close(own)

    def prefix(self) -> list[str]:
        """A command line's start that runs the command in this network."""
        return ["nsenter", f"--net={self.path}", "--"]

    def processes(self, name: str) -> list[str]:
        """`pgrep -a -x name` among this network's processes (another cluster's are not ours)."""
        return subprocess.run(["pgrep", "-a", "-x", name, "--ns", str(self.holder.pid), "--nslist", "net"],
                              capture_output=True, text=True).stdout.splitlines()

    def close(self) -> None:
        stop(self.holder)
        self.output.close()
        os.close(self.fd)


class AwsFront:
    """An HTTP front for moto, one per caller (a node, or the tests), so that each AWS call is counted against who made
    it. It can answer CreateFleet with an EC2 error for the markets in `failing_markets`, or for a fleet of more
    instances than `capacity[market]` has left (EC2 out of room for a fleet that must be launched whole), and the next
    `throttle[action]` calls of an action with ThrottlingException, as AWS does when an account's request rate is
    spent."""

    def __init__(self, network: Network, upstream: str, who: str, calls: list[tuple[str, str]],
                 failing_markets: dict[str, str], throttle: dict[str, int], capacity: dict[str, int]):
        self.upstream, self.who = upstream, who
        self.calls = calls  # (who, action), shared by every front of a cluster
        self.failing_markets, self.throttle, self.capacity = failing_markets, throttle, capacity
        front = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _any(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0) or 0))
                action = front.action(self.command, self.path, self.headers, body)
                front.calls.append((front.who, action))
                if front.throttle.get(action, 0) > 0:
                    front.throttle[action] -= 1
                    return self._reply(400, b'{"__type":"ThrottlingException","message":"Rate exceeded"}',
                                       "application/x-amz-json-1.1")
                if action == "CreateFleet":
                    text = body.decode()
                    market = next((m for m in front.failing_markets if f"DefaultTargetCapacityType={m}" in text), None)
                    if market:
                        front.calls[-1] = (front.who, f"CreateFleet {market} refused")
                        return self._reply(200, _fleet_error(front.failing_markets[market]))
                    if refused := front.out_of_capacity(text):
                        front.calls[-1] = (front.who, refused)
                        return self._reply(200, _fleet_error("InsufficientInstanceCapacity"))
                request = urllib.request.Request(front.upstream + self.path, data=body if body else None,
                                                 method=self.command,
                                                 headers={k: v for k, v in self.headers.items() if k.lower() != "host"})
                try:
                    with urllib.request.urlopen(request, timeout=60) as reply:
                        self._reply(reply.status, reply.read(), reply.headers.get("Content-Type"))
                except urllib.error.HTTPError as err:
                    self._reply(err.code, err.read(), err.headers.get("Content-Type"))

            do_GET = do_POST = do_PUT = do_HEAD = do_DELETE = _any

            def _reply(self, status: int, data: bytes, content_type: str | None = "text/xml") -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type or "text/xml")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

        with network.entered():  # where the nodes are; its threads, made outside, reach moto
            self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def out_of_capacity(self, request: str) -> str:
        """What was refused, if a CreateFleet asks for more instances than its market has left; else the instances are
        taken from what is left."""
        market = re.search(r"DefaultTargetCapacityType=([\w-]+)", request)
        count = re.search(r"TotalTargetCapacity=(\d+)", request)
        if not market or not count or market.group(1) not in self.capacity:
            return ""
        if int(count.group(1)) > self.capacity[market.group(1)]:
            return f"CreateFleet {market.group(1)} x{count.group(1)} refused"
        self.capacity[market.group(1)] -= int(count.group(1))
        return ""

    @staticmethod
    def action(method: str, path: str, headers, body: bytes) -> str:
        """The API call: the JSON protocols name it in X-Amz-Target, the query protocols in Action=, S3 by method."""
        if target := headers.get("X-Amz-Target"):
            return target.rsplit(".", 1)[-1]
        if match := re.search(r"Action=(\w+)", body.decode(errors="replace") + path):
            return match.group(1)
        return {"GET": "s3:GetObject", "PUT": "s3:PutObject", "HEAD": "s3:HeadObject"}.get(method, f"s3:{method}")

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _fleet_error(code: str) -> bytes:
    """What EC2 answers an instant fleet it could not fill: HTTP 200, no instances, the reason in errorSet."""
    return f"""<?xml version="1.0" encoding="UTF-8"?>
<CreateFleetResponse xmlns="http://ec2.amazonaws.com/doc/2016-11-15/">
  <requestId>fault-injected</requestId>
  <fleetId>fleet-00000000-0000-0000-0000-000000000000</fleetId>
  <errorSet><item><errorCode>{code}</errorCode>
    <errorMessage>We currently do not have sufficient capacity in the Availability Zone you requested.</errorMessage>
    <lifecycle>spot</lifecycle></item></errorSet>
  <fleetInstanceSet/>
</CreateFleetResponse>""".encode()




class InstanceMetadata:
    """IMDSv2 for one rehearsal node: a token, the instance id and instance-profile credentials; with `tags` (a
    compute node's: its instance's tags in moto, read at each request), the tags as EC2 serves them where the launch
    template puts them in the metadata. Without: 404, as for the head, whose template does not."""

    def __init__(self, network: Network, instance_id: str, tags: Callable[[], dict[str, str]] | None = None):
        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_PUT(self) -> None:
                self._reply(200, "rehearsal-token" if self.path == "/latest/api/token" else "")

            def do_GET(self) -> None:
                if self.headers.get("X-aws-ec2-metadata-token") != "rehearsal-token":
                    return self._reply(401, "")
                path = self.path.removeprefix("/latest/")
                now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 6 * 3600))
                answers = {
                    "meta-data/instance-id": instance_id,
                    # A cluster's nodes share its network: each node's slurmd registers from 127.0.0.1,
                    # the address Slurm (and so Prometheus) knows it by, so that is its exporters' address too.
                    "meta-data/local-ipv4": "127.0.0.1",
                    "meta-data/iam/security-credentials/": "gpucluster-node",
                    "meta-data/iam/security-credentials/gpucluster-node": json.dumps({
                        "Code": "Success", "Type": "AWS-HMAC", "AccessKeyId": "testing", "SecretAccessKey": "testing",
                        "Token": "testing", "Expiration": now, "LastUpdated": now}),
                }
                if tags is not None and path.startswith("meta-data/tags/instance"):
                    answers.update(instance_tags(tags()))
                self._reply(200, answers[path]) if path in answers else self._reply(404, "")

            def _reply(self, status: int, text: str) -> None:
                data = text.encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        with network.entered():
            self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def instance_tags(tags: dict[str, str]) -> dict[str, str]:
    """The metadata's tags category: the keys, one a line, at meta-data/tags/instance; each value under its key."""
    return {"meta-data/tags/instance": "\n".join(tags), **{f"meta-data/tags/instance/{k}": v for k, v in tags.items()}}


def spot_warning(instance: str) -> str:
    """EC2's two-minute warning as the stack's EventBridge rule puts it into the head's queue (the event is the
    body)."""
    return json.dumps({"version": "0", "id": "7e5e1b2a-0000-0000-0000-000000000001",
                       "detail-type": "EC2 Spot Instance Interruption Warning", "source": "aws.ec2",
                       "account": MOTO_ACCOUNT, "time": "2026-11-30T16:00:00Z", "region": "us-east-1",
                       "resources": [f"arn:aws:ec2:us-east-1:{MOTO_ACCOUNT}:instance/{instance}"],
                       "detail": {"instance-id": instance, "instance-action": "terminate"}})


def pinned_cpu(index: int) -> int:
    """The CPU of a cluster's index-th compute node (round robin). Slurm's job_container/tmpfs keeps each job's mount
    namespace by bind-mounting its /proc/PID/ns/mnt, and the kernel refuses that (EINVAL) unless the job's namespace
    is newer than the mount namespace of the process mounting it. This machine's kernel (6.18) numbers namespaces
    from per-CPU batches: one made later on another CPU can get a lower number, and about one job in three failed to
    start (`ns base mount failed: Invalid argument`). On an instance slurmd runs in the first mount namespace, older
    than any; here every node has its own, so each node's processes stay on the CPU its namespace was made on."""
    cpus = sorted(os.sched_getaffinity(0))
    return cpus[index % len(cpus)]


@dataclass
class RehearsalNode:
    """One EC2 instance of the cluster as a set of namespaces over the rehearsal image (tests/rehearsal_image.py);
    `boot` runs its user data as EC2 and cloud-init would."""

    name: str  # for the harness's logs; the node learns its Slurm name itself
    root: Path
    user_data: str
    aws: AwsFront
    imds: InstanceMetadata
    fsx: Path
    sdk: Path  # the image's AWS SDK (image_sdk)
    network: Network  # the cluster's, shared by its nodes
    # Paths of this machine the node sees at the same paths: the repository (the stand-ins, the examples), the
    # cluster's directory (job output, the SDK) and the test venv with the Python it runs on.
    shared: tuple[Path, ...] = ()
    volume: Path | None = None  # the head's state volume (a loop device behind its EBS by-id name)
    volume_id: str = ""
    own_clock: bool = False  # compute nodes: a boot time of their own
    gpus: int = 0  # compute nodes: the GPUs its stand-in nvidia-smi reports
    gpu_fault: str = ""  # shell for the stand-in instead of healthy GPUs (LocalCluster.gpu_faults)
    first_boot_fault: str = ""  # LocalCluster.first_boot_faults
    # Compute nodes: the one CPU all the node's processes run on (pinned_cpu says why).
    cpu: int | None = None
    init: subprocess.Popen[bytes] | None = None

    def boot(self) -> None:
        """Power on: fresh /run and /tmp, the image with the node's own changes over it as its root, then cloud-init's
        first-boot steps (a reboot skips them: cloud-init runs write_files and runcmd once per instance) and the units
        enabled for multi-user.target."""
        upper, merged = self.root / "up", self.root / "root"
        first = not upper.exists()
        for d in (upper, self.root / "work", merged):
            d.mkdir(parents=True, exist_ok=True)
        run_dir, tmp_dir = self.root / "run", self.root / "tmp"
        for d in (run_dir, tmp_dir):  # tmpfs on an instance: empty at every boot
            shutil.rmtree(d, ignore_errors=True)
        (run_dir / "rehearsal-systemd").mkdir(parents=True)
        tmp_dir.mkdir(mode=0o1777)
        tmp_dir.chmod(0o1777)  # past the umask
        self._image()
        (run_dir / "rehearsal-systemd" / "environment.json").write_text(json.dumps(
            {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}))
        disk = self.root / "disk-by-id"
        disk.mkdir(exist_ok=True)
        if self.volume:
            link = disk / f"nvme-Amazon_Elastic_Block_Store_{self.volume_id.replace('-', '')}"
            link.unlink(missing_ok=True)
            link.symlink_to(self.volume)
        Path("/dev/disk/by-id").mkdir(parents=True, exist_ok=True)  # the mount point, in this machine's /dev; empty
        binds = [(run_dir, "/run"), (tmp_dir, "/tmp"), (disk, "/dev/disk/by-id"), (self.fsx, "/fsx"),
                 *((path, str(path)) for path in sorted(self.shared, key=lambda p: len(p.parts))),
                 (REHEARSAL / "systemctl", "/usr/bin/systemctl")]
        mounts = [f"mount -t overlay overlay -o lowerdir={REHEARSAL_ROOTFS},upperdir={upper},"
                  f"workdir={self.root / 'work'} {merged}",
                  f"mount -t proc proc {merged}/proc", f"mount --rbind /sys {merged}/sys",
                  f"mount --rbind /dev {merged}/dev", f"mount -t tmpfs tmpfs {merged}/dev/shm"]
        for source, target in binds:
            mounts += [f"mkdir -p {merged}{target}" if source.is_dir() else f"touch {merged}{target}",
                       f"mount --bind {source} {merged}{target}"]
        # A new instance has EC2's name; a rebooted one the name in its /etc/hostname, as systemd sets it.
        inside = [f"hostname ip-{self.name}" if first else "hostname -F /etc/hostname",
                  "systemd-tmpfiles --create --prefix=/run --prefix=/var/lib >/dev/null 2>&1 || true",
                  "cd / && exec sleep infinity"]
        # The image as the namespace's own root (pivot_root), not a chroot inside this machine's: what enters the
        # node's mount namespace (setns, as Slurm's job_container/tmpfs does for every job step) lands in the node,
        # as on an instance, not at this machine's root.
        mounts.append(f"cd {merged} && pivot_root . mnt && "
                      f"exec chroot . sh -ec {shlex.quote('; '.join(['umount -l /mnt', *inside]))}")
        clock = ["--time", f"--boottime=-{Path('/proc/uptime').read_text().split('.')[0]}"] if self.own_clock else []
        log = open(self.root / "init.log", "ab")
        self.init = subprocess.Popen([*self._pinned(), *self.network.prefix(), "unshare", "--mount", "--uts",
                                      "--propagation", "private", *clock, "--", "sh", "-ec", "; ".join(mounts)],
                                     stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        wait_for(f"node {self.name}'s namespaces", lambda: self._ready(), [self.init], [self.root / "init.log"], 10)
        if first:
            (self.root / "user-data").write_text(self.user_data)
            self.enter("/usr/bin/python3", str(REHEARSAL / "cloud_init"), str(self.root / "user-data"))
        else:
            self.enter("/usr/bin/python3", str(REHEARSAL / "cloud_init"), str(self.root / "user-data"), "--every-boot")
            wants = self.upper("/etc/systemd/system/multi-user.target.wants")
            for unit in sorted(p.name for p in wants.iterdir()) if wants.is_dir() else []:
                self.enter("systemctl", "start", "--no-block", unit)

    def upper(self, inside: str) -> Path:
        """Where the node's own change to a path of the image is kept (its overlay's upper layer)."""
        return self.root / "up" / inside.lstrip("/")

    def _image(self) -> None:
        """What the node image adds to the rehearsal image's packages: its manifest, its venv, boto3 for the system
        Python, its login user.
        The .pth file also points the AWS SDK at this node's moto front and metadata server (the seam for EC2)."""
        image = self.upper("/opt/gpucluster-image")
        image.mkdir(parents=True, exist_ok=True)
        (image / "manifest.json").write_text(json.dumps({"role": "rehearsal", "from": "Debian packages (make test)"}))
        venv = image / "venv"
        if not venv.is_symlink():
            venv.symlink_to(TEST_VENV)  # pydantic for `gpucluster`, torch
        # The images' login user, which the rehearsal image lacks (a uid of its own here; Ubuntu's is 1000).
        for name, entry in (("passwd", f"{LOGIN_USER}:x:{LOGIN_UID}:{LOGIN_UID}::/home/{LOGIN_USER}:/bin/bash"),
                            ("group", f"{LOGIN_USER}:x:{LOGIN_UID}:")):
            target, image_file = self.upper(f"/etc/{name}"), REHEARSAL_ROOTFS / "etc" / name
            if not target.exists() and not any(line.split(":")[0] == LOGIN_USER
                                               for line in image_file.read_text().splitlines()):
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(image_file.read_text() + entry + "\n")
        if self.gpus:
            # No GPU on this machine: nvidia-smi as the health check asks it (index, uncorrected ECC errors), one
            # healthy GPU per configured GPU, or the fault a test gave this node (fewer GPUs, ECC errors, a hang).
            tool = self.upper("/usr/local/bin/nvidia-smi")
            tool.parent.mkdir(parents=True, exist_ok=True)
            tool.write_text("#!/bin/sh\n" + (self.gpu_fault or
                            f"for i in $(seq 0 {self.gpus - 1}); do echo \"$i, 0\"; done") + "\n")
            tool.chmod(0o755)
            # No container runtime or DCGM either: `docker run` of dcgm-exporter serves its metrics from a stand-in.
            shutil.copy(REHEARSAL / "docker", tool.parent / "docker")
            (tool.parent / "rehearsal-gpus").write_text(str(self.gpus))
            self.first_boot_stand_ins(tool.parent)
            # nccl-tests as the image builds it: a stand-in that all-reduces over MPI (its docstring says how).
            nccl_tests = self.upper(ALL_REDUCE_PERF)
            nccl_tests.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(REHEARSAL / "all_reduce_perf", nccl_tests)
        if self.own_clock:  # a compute node
            self.kernel_modules(self.upper("/usr/local/bin"))
        dist = self.upper(f"/usr/local/lib/{python_version()}/dist-packages")
        dist.mkdir(parents=True, exist_ok=True)
        (dist / "rehearsal.pth").write_text(
            f"{self.sdk}\nimport os; os.environ.setdefault('AWS_ENDPOINT_URL', '{self.aws.url}'); "
            f"os.environ.setdefault('AWS_EC2_METADATA_SERVICE_ENDPOINT', '{self.imds.url}')\n")

    def first_boot_stand_ins(self, bin_dir: Path) -> None:
        """A GPU node's DCGM as the image may have it: installed, its host engine's unit not enabled (stopped at
        boot); the first boot starts it (tests/rehearsal's nvidia-dcgm.service, nv-hostengine, dcgmi)."""
        for name in ("nv-hostengine", "dcgmi"):
            shutil.copy(REHEARSAL / name, bin_dir / name)
        units = self.upper("/etc/systemd/system")
        units.mkdir(parents=True, exist_ok=True)
        shutil.copy(REHEARSAL / "nvidia-dcgm.service", units / "nvidia-dcgm.service")

    def kernel_modules(self, bin_dir: Path) -> None:
        """The running kernel's modules as `modinfo` (a stand-in) reports them: Lustre's client, unless this node's
        fault is a kernel without it."""
        bin_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy(REHEARSAL / "modinfo", bin_dir / "modinfo")
        (bin_dir / "rehearsal-modules").write_text("" if self.first_boot_fault == NO_LUSTRE_MODULE else "lustre\n")

    def _ready(self) -> bool:
        return self.init is not None and self.init.poll() is None and \
            os.readlink(f"/proc/{self.init.pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt") and \
            subprocess.run(self.prefix() + ["mountpoint", "-q", "/fsx"], capture_output=True).returncode == 0

    def _pinned(self) -> list[str]:
        return ["taskset", "-c", str(self.cpu)] if self.cpu is not None else []

    def prefix(self) -> list[str]:
        """A command line's start that runs the command on the node: its namespaces, its root, at its root."""
        assert self.init is not None
        return [*self._pinned(), "nsenter", "-t", str(self.init.pid), "-m", "-u", "-n", "-r", "-w"] + (
            ["-T"] if self.own_clock else []) + ["--"]

    def enter(self, *args: str, env: dict[str, str] | None = None, check: bool = True,
              timeout: float = 120) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(self.prefix() + list(args), env=env, capture_output=True, text=True, timeout=timeout)
        if check and done.returncode:
            raise RuntimeError(f"on {self.name}: {' '.join(args)} exited {done.returncode}: {done.stderr[-2000:]}")
        return done

    def path(self, inside: str) -> Path:
        """A path as the node sees it, read from outside."""
        assert self.init is not None
        return Path(f"/proc/{self.init.pid}/root{inside}")

    def boot_state(self) -> str:
        state = self.root / "run" / "rehearsal-systemd" / "gpucluster-boot.service.json"
        return json.loads(state.read_text())["state"] if state.exists() else "starting"

    def errors(self) -> str:
        """The node programs' errors and their tracebacks (settings.NODE_LOG), to lead a failure's message: the
        tail of a long message is cut in CI's summary."""
        f = self.upper(NODE_LOG)
        if not f.exists():
            return ""
        picked, in_traceback = [], False
        for line in f.read_text(errors="replace").splitlines():
            # A traceback runs from its first line through the indented frames to the exception's line.
            if in_traceback or line.startswith("Traceback") or " ERROR " in line or " WARNING " in line:
                picked.append(line)
            in_traceback = line.startswith(("Traceback", " "))
        return f"--- {self.name}: {NODE_LOG} (errors and warnings)\n" + "\n".join(picked[-60:]) if picked else ""

    def logs(self) -> str:
        parts = []
        for name in ("/var/log/gpucluster/boot.log", "/var/log/rehearsal/gpucluster-boot.service.log", NODE_LOG):
            f = self.upper(name)
            if f.exists():
                parts.append(f"--- {self.name}: {name}\n{f.read_text(errors='replace')[-3000:]}")
        for f in sorted(self.upper("/var/log").glob("slurm/*.log")) + sorted(
                self.upper("/var/log/rehearsal").glob("*.log")):
            parts.append(f"--- {self.name}: {f.name}\n{f.read_text(errors='replace')[-1500:]}")
        return "\n".join(parts)

    def power_off(self) -> None:
        """Every process of the node ends at once, as when EC2 stops or terminates the instance. The boot loop's
        thread and the cluster's stop may both power a node off: each works on the init it found (seen: the other
        one's `init = None` midway failed the stop and left the cluster's daemons running)."""
        init = self.init
        if init is None:
            return
        try:
            ns = os.readlink(f"/proc/{init.pid}/ns/mnt")
        except OSError:  # its init is gone: nothing of the node runs any more
            ns = os.readlink("/proc/self/ns/mnt")
        for proc in (Path("/proc").iterdir() if ns != os.readlink("/proc/self/ns/mnt") else ()):
            if proc.name.isdigit() and int(proc.name) != init.pid:
                try:
                    if os.readlink(proc / "ns" / "mnt") == ns:
                        os.kill(int(proc.name), signal.SIGKILL)
                except OSError:
                    continue
        stop(init)
        self.init = None


@dataclass
class LocalCluster:
    stack: Stack
    root: Path
    nodes: dict[str, RehearsalNode] = field(default_factory=dict)  # instance id -> booted compute node
    boots: list[tuple[str, float]] = field(default_factory=list)  # (node name, when its instance booted)
    calls: list[tuple[str, str]] = field(default_factory=list)  # (who, AWS action) through the fronts
    failing_markets: dict[str, str] = field(default_factory=dict)
    capacity: dict[str, int] = field(default_factory=dict)  # market -> instances EC2 can still launch (AwsFront)
    throttle: dict[str, int] = field(default_factory=dict)
    gpu_faults: dict[str, str] = field(default_factory=dict)  # pool -> its next nodes' nvidia-smi (a broken GPU)
    # pool -> what its next instances get wrong that only their first boot can find: NO_LUSTRE_MODULE, UNTAGGED
    first_boot_faults: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _closers: list[Callable[[], None]] = field(default_factory=list)
    _clients: dict[str, Any] = field(default_factory=dict)  # service -> boto3 client (aws)

    # --- lifecycle -----------------------------------------------------------------------------------------------
    def start(self, boot_head: bool = True) -> LocalCluster:
        try:
            self._start(boot_head)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        self._stop.set()
        for node in list(self.nodes.values()) + ([self.head] if hasattr(self, "head") else []):
            node.power_off()
        self.nodes.clear()
        if hasattr(self, "volume_device"):
            subprocess.run(["losetup", "-d", self.volume_device], capture_output=True)
            del self.volume_device  # detached once: by then the device number may be another cluster's
        # The network last: with it go its lockdown's rules, nobody else's. (Each closed once: stop may run twice.)
        while self._closers:
            self._closers.pop()()

    def _start(self, boot_head: bool) -> None:
        from gpucluster.render import bundle, userdata

        self.root.chmod(0o755)
        self.network = Network()
        self._closers.append(self.network.close)
        self.moto_url = self._moto()
        nodes = sum(p.max_nodes for p in self.stack.spec.pools) + SPARE_NODE_PORTS
        # One block: ports picked one by one could land inside the nodes' range. The nodes' exporters (every node
        # its own ports: they share one address here) after slurmd's.
        exporter_ports = (1 + nodes) * len(SCRAPE_JOBS)
        with self.network.entered():
            ports = free_port_block(nodes + 3 + exporter_ports)
        self.exporter_port_base = ports + 3 + nodes
        self.dev_dir = self.root / "dev"
        self.layout = slurm.SlurmLayout(controller_port=ports, node_port=ports + 1, dbd_port=ports + 2,
                                        node_port_base=ports + 3, dev_dir=str(self.dev_dir), simulated_hardware=True,
                                        cgroups=False, power_save_min_interval=0,
                                        suspend_timeout=5, cred_expire=10)
        self._devices()
        self.fsx = self.root / "fsx"
        self.fsx.mkdir()
        self.sdk = image_sdk(self.root / "image-python")
        # What of this machine the nodes see (RehearsalNode.shared): this directory holds the SDK and job output.
        self.shared = (ROOT, self.root, TEST_VENV, TEST_PYTHON)
        self.bundle = bundle.build(self.stack, EXAMPLES_DIR, self.layout)
        self._aws_world(bundle.key(self.bundle), userdata)
        self.env = {**os.environ, "PATH": f"{self._login_commands()}:{os.environ['PATH']}"}
        self.env.pop("SLURM_CONF", None)
        if boot_head:
            self.boot_head()
            threading.Thread(target=self._boot_loop, daemon=True).start()

    def _moto(self) -> str:
        """The cluster's AWS account: a moto server of its own, in a process of its own (moto's backends are shared
        by every server in a process, and another cluster may run in this one)."""
        server = subprocess.Popen([sys.executable, "-c", MOTO_SERVER], stdout=subprocess.PIPE, start_new_session=True)
        assert server.stdout is not None
        output = server.stdout

        def close() -> None:
            stop(server)
            output.close()

        self._closers.append(close)
        port = server.stdout.readline().strip()
        if not port.isdigit():
            raise RuntimeError(f"the moto server did not start (exit {server.poll()})")
        return f"http://127.0.0.1:{int(port)}"

    def front(self, who: str) -> AwsFront:
        front = AwsFront(self.network, self.moto_url, who, self.calls, self.failing_markets, self.throttle,
                         self.capacity)
        self._closers.append(front.close)
        return front

    def aws(self, service: str):
        """The cluster's moto as a boto3 client, one per service: making one costs more CPU than a call, and the
        waits ask moto every 0.2 s."""
        if service not in self._clients:
            import boto3

            self._clients[service] = boto3.client(service, endpoint_url=self.moto_url, region_name=self.stack.region,
                                                  aws_access_key_id="testing", aws_secret_access_key="testing")
        return self._clients[service]

    def ec2(self):
        return self.aws("ec2")

    def _devices(self) -> None:
        self.dev_dir.mkdir(exist_ok=True)
        for pool in self.stack.spec.pools:
            if not (acc := pool.itype.accelerator):
                continue
            for i in range(acc.count):
                device = self.dev_dir / f"{acc.kind}{i}"  # as slurm.device_files names them
                if not device.is_symlink():
                    device.symlink_to("/dev/null")  # slurmd wants a character device behind each gres.conf File=

    # --- AWS in moto: what `pulumi up` would have created -------------------------------------------------------
    def _aws_world(self, bundle_key: str, userdata) -> None:
        from gpucluster.contract.settings import BudgetSettings, ClusterSettings

        ec2, s3, ssm = self.ec2(), self.aws("s3"), self.aws("ssm")
        vpc = ec2.create_vpc(CidrBlock="127.0.0.0/16")["Vpc"]["VpcId"]
        # moto gives instances addresses from this subnet: loopback addresses that reach this machine's daemons.
        self.subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="127.0.0.0/24",
                                        AvailabilityZone=self.stack.spec.availability_zone)["Subnet"]["SubnetId"]
        pools = self._pool_settings(ec2, {})
        head = ec2.run_instances(ImageId=IMAGE_AMI, InstanceType=self.stack.spec.head_node.instance_type, MinCount=1,
                                 MaxCount=1, SubnetId=self.subnet, TagSpecifications=[{
                                     "ResourceType": "instance",
                                     "Tags": [{"Key": "Name", "Value": f"{self.stack.cluster_name}-head"}]}],
                                 )["Instances"][0]
        self.head_instance, self.head_address = head["InstanceId"], head["PrivateIpAddress"]
        self.volume_id = ec2.create_volume(AvailabilityZone=self.stack.spec.availability_zone, Size=1)["VolumeId"]
        image = self.root / "state-volume.img"
        subprocess.run(["truncate", "-s", "256M", str(image)], check=True)
        self.volume_device = subprocess.run(["losetup", "-f", "--show", str(image)], check=True, capture_output=True,
                                            text=True).stdout.strip()
        bucket = f"{self.stack.cluster_name}-bundle"
        # S3 wants the region named for any bucket outside us-east-1 (team-b runs in us-west-2).
        s3.create_bucket(Bucket=bucket, **({} if self.stack.region == "us-east-1" else {
            "CreateBucketConfiguration": {"LocationConstraint": self.stack.region}}))
        s3.put_object(Bucket=bucket, Key=bundle_key, Body=self.bundle)
        sns, sqs = self.aws("sns"), self.aws("sqs")
        self.topic = sns.create_topic(Name=f"{self.stack.cluster_name}-alerts")["TopicArn"]
        queue = sqs.create_queue(QueueName=f"{self.stack.cluster_name}-guardrail")["QueueUrl"]
        arn = sqs.get_queue_attributes(QueueUrl=queue, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
        sns.subscribe(TopicArn=self.topic, Protocol="sqs", Endpoint=arn)
        self.set_spend(0.0)
        # EC2's spot warnings, as the stack's EventBridge rule would deliver them (tests send them themselves).
        self.interruptions = sqs.create_queue(QueueName=f"{self.stack.cluster_name}-interruptions")["QueueUrl"]
        budget = self.stack.spec.budget
        self.settings = ClusterSettings(
            cluster=self.stack.cluster_name, team=self.stack.spec.team, region=self.stack.region, pools=pools,
            bundle_bucket=bucket, bundle_key=bundle_key, head_address=self.head_address, state_volume_id=self.volume_id,
            fsx_dns_name="fs-0123456789abcdef0.fsx.us-east-1.amazonaws.com", fsx_mount_name="abcdefgh",
            munge_key_parameter=userdata.munge_key_parameter(self.stack), slurmctld_port=self.layout.controller_port,
            all_or_nothing=self.stack.spec.slurm.all_or_nothing, people=self.stack.spec.people,
            # A node DOWN for a passing cause is retried after 5 s here instead of 10 min (the stack file's minimum
            # is a minute): tests shorten timers, not sleep.
            capacity_retry_seconds=5,
            interruption_queue_url=self.interruptions, alerts_topic_arn=self.topic,
            exporter_port_base=self.exporter_port_base,
            # A spot warning's jobs are requeued 5 s after their checkpoint signal here instead of a minute.
            checkpoint_grace_seconds=5,
            # The guardrail checks the budget every 5 s here instead of hourly: tests shorten timers, not sleep.
            budget=BudgetSettings(budget_name=self.stack.budget_name, account_id=MOTO_ACCOUNT,
                                  act_threshold_percent=budget.act_threshold_percent or 100, queue_url=queue,
                                  topic_arn=self.topic, check_seconds=5, launch_deny_action=False))
        ssm.put_parameter(Name=userdata.config_parameter(self.stack), Type="String", Value=self.settings.to_json())
        self.userdata = userdata

    def _pool_settings(self, ec2, known: dict) -> dict:
        """What the GpuPool components export for the stack's pools: a launch template for each new one."""
        from gpucluster.contract.settings import PoolSettings

        pools = {}
        for pool in self.stack.spec.pools:
            template = known[pool.name].launch_template_id if pool.name in known else ec2.create_launch_template(
                LaunchTemplateName=f"{self.stack.cluster_name}-{pool.name}",
                LaunchTemplateData={"ImageId": IMAGE_AMI, "InstanceType": pool.instance_type,
                                    "TagSpecifications": [{"ResourceType": "instance", "Tags": [
                                        {"Key": k, "Value": v}
                                        for k, v in {**self.stack.tags, POOL_TAG: pool.name}.items()]}]},
            )["LaunchTemplate"]["LaunchTemplateId"]
            acc = pool.itype.accelerator
            pools[pool.name] = PoolSettings(name=pool.name, launch_template_id=template, subnet_id=self.subnet,
                                            instance_type=pool.instance_type, market=pool.capacity,
                                            min_nodes=pool.min_nodes, max_nodes=pool.max_nodes,
                                            accelerator=acc.kind if acc else "", accelerators=acc.count if acc else 0,
                                            node_hour_usd=pool.itype.on_demand_usd_per_hour or 0.0)
        return pools

    def apply(self, stack: Stack) -> None:
        """`pulumi up` with a changed stack file: launch templates for new pools, the new bundle in S3, the new
        settings in SSM. The running head's update timer picks them up (`update` runs it here)."""
        from dataclasses import replace

        from gpucluster.render import bundle

        self.stack = stack
        self._devices()
        data = bundle.build(stack, EXAMPLES_DIR, self.layout)
        key = bundle.key(data)
        self.aws("s3").put_object(Bucket=self.settings.bundle_bucket, Key=key, Body=data)
        self.settings = replace(self.settings, pools=self._pool_settings(self.ec2(), self.settings.pools),
                                bundle_key=key, people=stack.spec.people)
        self.aws("ssm").put_parameter(Name=self.userdata.config_parameter(stack), Type="String",
                                      Value=self.settings.to_json(), Overwrite=True)

    def update(self) -> str:
        """One run of the head's update unit, as its timer starts it every minute; returns what the boot log gained."""
        from gpucluster.contract.settings import BOOT_LOG

        log = self.head.path(BOOT_LOG)
        before = log.stat().st_size
        self.head.enter("systemctl", "start", "gpucluster-update.service")
        return log.read_text()[before:]

    def _login_commands(self) -> Path:
        """Slurm's commands as a user on the head node runs them."""
        bin_dir = self.root / "head-login"
        bin_dir.mkdir(exist_ok=True)
        for name in HEAD_COMMANDS:
            # Off the PATH a job inherits (sbatch exports it): inside a job, srun is the node's own.
            # Entering the head's root moves there: go back to the submit directory (shared with the nodes).
            (bin_dir / name).write_text(
                f"#!/bin/sh\nPATH=$(echo \"$PATH\" | sed 's#{bin_dir}:##')\n"
                f"exec nsenter -t \"$(cat {self.root}/head.pid)\" -m -u -n -r -w -- "
                f"sh -c 'cd \"$1\" && shift && exec \"$@\"' sh \"$PWD\" /usr/bin/{name} \"$@\"\n")
            (bin_dir / name).chmod(0o755)
        return bin_dir

    # --- booting ----------------------------------------------------------------------------------------------------
    def boot_head(self, seconds: float = 180, name: str = "head") -> None:
        """A head node instance: the first, or (with another name) its replacement, which comes up on the same state
        volume and the same fixed network interface as `pulumi up` gives it."""
        imds = InstanceMetadata(self.network, self.head_instance)
        self._closers.append(imds.close)
        self.head = RehearsalNode(name, self.root / name, self.userdata.head_node(self.stack), self.front("head"),
                                  imds, self.fsx, self.sdk, self.network, self.shared, volume=Path(self.volume_device),
                                  volume_id=self.volume_id)
        self.head.boot()
        (self.root / "head.pid").write_text(str(self.head.init.pid))  # type: ignore[union-attr]  # boot() started it
        self.wait_booted(self.head, seconds)
        # As the README tells admins: users other than the image's login user are added by hand; the tests submit
        # as root.
        team = self.stack.spec.team
        # (A replaced head finds the user in the kept database: sacctmgr then adds nothing and exits 1.)
        self.run("sacctmgr", "-i", "add", "user", "root", f"Account={team}", f"DefaultAccount={team}", check=False)
        if not self.run("sacctmgr", "-n", "-P", "show", "assoc", "where", "user=root", f"account={team}").strip():
            raise RuntimeError(f"root is not in the Slurm account {team}")

    def replace_head(self) -> None:
        """`pulumi up` replacing the head node: the old instance goes first (delete_before_replace), a new one boots."""
        self.head.power_off()
        self.boot_head(name=f"head-{len(list(self.root.glob('head*/')))}")

    def reboot(self, node: RehearsalNode, seconds: float = 180) -> None:
        node.power_off()
        node.boot()
        if node is self.head:
            (self.root / "head.pid").write_text(str(self.head.init.pid))  # type: ignore[union-attr]  # boot() started it
        self.wait_booted(node, seconds)

    def wait_booted(self, node: RehearsalNode, seconds: float) -> None:
        try:
            wait_for(f"{node.name} to boot", lambda: node.boot_state() in ("active", "failed"), [], [], seconds)
        except RuntimeError:
            raise RuntimeError(f"{node.name} did not finish booting in {seconds:.0f} s\n{node.logs()}") from None
        if node.boot_state() != "active":
            raise RuntimeError(f"{node.name}'s boot failed\n{node.logs()}")

    def _boot_loop(self) -> None:
        """EC2's part: an instance launched by the resume program boots a little later; a terminated one stops."""
        ec2 = self.ec2()
        seen: dict[str, float] = {}
        while not self._stop.is_set():
            try:
                live = self.instances_by_id(ec2)
            except Exception:  # moto shutting down with the test
                return
            now = time.monotonic()
            for instance in live.keys() - self.nodes.keys() - {self.head_instance}:
                # Slurm compares boot times in whole seconds and ignores a node that "booted" before it was resumed;
                # a real instance takes minutes, here two seconds are enough.
                if now - seen.setdefault(instance, now) >= BOOT_SECONDS:
                    seen.pop(instance)
                    try:
                        self._boot(instance, live[instance])
                    except Exception as exc:  # the node stays down; the test's wait reports the logs
                        (self.root / f"boot-{instance}.error").write_text(str(exc))
            for instance in self.nodes.keys() - live.keys():
                self.nodes.pop(instance).power_off()
            time.sleep(0.3)

    def _boot(self, instance: str, pool_name: str) -> None:
        pool = next(p for p in self.stack.spec.pools if p.name == pool_name)
        fault = self.first_boot_faults.get(pool_name, "")
        if fault == UNTAGGED:  # as EC2 launches it if it does not add the launch template's tags to the request's
            self.ec2().delete_tags(Resources=[instance], Tags=[{"Key": POOL_TAG}])
        imds = InstanceMetadata(self.network, instance, tags=lambda: self._live().get(instance, {}))
        self._closers.append(imds.close)
        acc = pool.itype.accelerator
        node = RehearsalNode(instance, self.root / instance, self.userdata.pool_nodes(self.stack, pool),
                             self.front(instance), imds, self.fsx, self.sdk, self.network, self.shared, own_clock=True,
                             gpus=acc.count if acc and acc.kind == "nvidia" else 0,
                             gpu_fault=self.gpu_faults.get(pool_name, ""), first_boot_fault=fault,
                             cpu=pinned_cpu(len(self.boots)))
        self.nodes[instance] = node
        node.boot()
        self.boots.append((self.registry().get(instance, instance), time.time()))

    def registry(self) -> dict[str, str]:
        """The head's record of which instance is which node (the resume program's registry): instance id -> node."""
        path = self.head.path(NODE_REGISTRY)
        entries = json.loads(path.read_text())["instances"] if path.exists() else {}
        return {entry["instance"]: node for node, entry in entries.items()}

    def _live(self, ec2=None) -> dict[str, dict[str, str]]:
        """Pending or running instances of this cluster's pools in moto: instance id -> its tags."""
        ec2 = ec2 or self.ec2()
        reservations = ec2.describe_instances(Filters=[
            {"Name": "instance-state-name", "Values": ["pending", "running"]},
            {"Name": f"tag:{CLUSTER_TAG}", "Values": [self.stack.cluster_name]}])["Reservations"]
        return {i["InstanceId"]: {t["Key"]: t["Value"] for t in i.get("Tags", [])}
                for r in reservations for i in r["Instances"]}

    def instances_by_id(self, ec2=None) -> dict[str, str]:
        """Instance id -> pool."""
        return {instance: tags.get(POOL_TAG, "") for instance, tags in self._live(ec2).items()}

    def instances(self, ec2=None) -> dict[str, str]:
        """Live instances the cluster knows as nodes: node name -> instance id."""
        live = self._live(ec2)
        return {node: instance for instance, node in self.registry().items() if instance in live}

    def reconcile(self) -> str:
        """One pass of the reconciler, as its timer starts it on the head (the rehearsal's timers do not fire);
        returns what it logged."""
        log = self.head.path("/var/log/rehearsal/gpucluster-reconcile.service.log")
        before = log.stat().st_size if log.exists() else 0
        self.head.enter("systemctl", "start", "gpucluster-reconcile.service")
        return log.read_text()[before:]

    # --- the budget guardrail: AWS Budgets and the service the head node runs ---------------------------------------
    def set_spend(self, actual: float) -> None:
        """The stack's budget as AWS Budgets would report it (moto keeps the spend it is given)."""
        budgets, name = self.aws("budgets"), self.stack.budget_name
        if any(b["BudgetName"] == name for b in budgets.describe_budgets(AccountId=MOTO_ACCOUNT).get("Budgets", [])):
            budgets.delete_budget(AccountId=MOTO_ACCOUNT, BudgetName=name)
        budgets.create_budget(AccountId=MOTO_ACCOUNT, Budget={
            "BudgetName": name, "BudgetType": "COST", "TimeUnit": "MONTHLY",
            "BudgetLimit": {"Amount": f"{self.stack.spec.budget.monthly_usd:.2f}", "Unit": "USD"},
            "CalculatedSpend": {"ActualSpend": {"Amount": f"{actual:.2f}", "Unit": "USD"}}})

    def budget_command(self, command: str) -> str:
        """`sudo gpucluster-budget <command>` as an admin runs it on the head node."""
        login = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root",
                 "SUDO_USER": "alice"}
        return self.head.enter("/usr/local/sbin/gpucluster-budget", command, env=login).stdout

    # --- helpers for tests ----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def link_local_metadata(self) -> Iterator[None]:
        """Instance metadata where EC2 serves it, 169.254.169.254:80, in the cluster's network, where the nodes'
        lockdown (their user data's bootcmd) put its rules. It hands out a token to whoever gets through. The nodes'
        own stand-ins listen elsewhere, so the boot path is unaffected."""
        class Metadata(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_PUT(self) -> None:
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"token")

        def address(verb: str) -> None:
            subprocess.run([*self.network.prefix(), "ip", "addr", verb, "169.254.169.254/32", "dev", "lo"], check=True)

        address("add")
        with self.network.entered():
            server = ThreadingHTTPServer(("169.254.169.254", 80), Metadata)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            yield
        finally:
            server.shutdown()
            server.server_close()
            address("del")

    def node(self, name: str) -> RehearsalNode:
        """The booted instance a Slurm node runs on."""
        return self.nodes[self.instances()[name]]

    def health_check(self, name: str) -> subprocess.CompletedProcess[str]:
        """The node's periodic health check, as slurmd runs its HealthCheckProgram (root, no job), at once: the
        rehearsal's HealthCheckInterval is Slurm's 5 minutes."""
        return self.node(name).enter("/usr/bin/python3", HEALTH_PROGRAM, env={"PATH": "/usr/bin:/bin"}, check=False)

    def inject_gpu_fault(self, name: str, field: int, value: int, gpu: int = 0) -> None:
        """A GPU fault as the driver reports it, through DCGM's own field injection (`dcgmi test --inject`, root on
        the node, as DCGM's tests inject faults; the stand-in dcgmi keeps it in its host engine's state): e.g. field
        230 (DCGM_FI_DEV_XID_ERROR) value 79, a GPU fallen off the bus."""
        self.node(name).enter("dcgmi", "test", "--inject", "--gpuid", str(gpu), "-f", str(field), "-v", str(value))

    def held(self, name: str) -> tuple[str, Path]:
        """A shell command that runs until the test touches the file returned with it: a job that must be running at
        some point of a test runs through it, however slow this machine is today, and not a second longer."""
        release = self.fsx / f"release-{name}"
        return f"until [ -e /fsx/{release.name} ]; do sleep 0.5; done", release

    def run(self, *args: str, check: bool = True) -> str:
        return subprocess.run(list(args), env=self.env, check=check, capture_output=True, text=True, timeout=60).stdout

    def job_state(self, job: str) -> str:
        return self.run("scontrol", "show", "job", job).split("JobState=")[1].split()[0]

    def wait(self, what: str, ready: Callable[[], bool], seconds: float) -> None:
        try:
            wait_for(what, ready, [], [], seconds)
        except RuntimeError as exc:
            nodes = [self.head, *self.nodes.values()]
            logs = "\n".join(node.logs() for node in nodes)
            errors = "\n".join([f.read_text() for f in self.root.glob("boot-*.error")] + [n.errors() for n in nodes])
            raise RuntimeError(f"{exc}\n{errors}\n{logs}") from None
