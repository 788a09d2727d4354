"""A real Slurm cluster on this machine, started from gpucluster's rendered configuration, with EC2 served by moto.

What differs from the head node, and why:
- paths and ports (SlurmLayout): everything lives in a temporary directory, each slurmd gets its own port;
- `SlurmdParameters=config_overrides`: the nodes here have 2 cores and no GPU, so slurmd reports the configured ones,
  and /dev/null stands in for each GPU device file;
- no cgroups (proctrack/linuxproc, jobacct_gather/linux): this sandbox's cgroup mounts are not usable by Slurm;
- the node programs run through small wrappers that point boto3 at moto (AWS_ENDPOINT_URL) instead of being linked;
- "booting" an instance is starting `slurmd -N <node>` here. moto's subnet is 127.0.0.0/24, so the address the resume
  program gives Slurm is a loopback address that reaches that slurmd.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable

from gpucluster import slurm
from gpucluster.spec import Stack

ROOT = Path(__file__).resolve().parent.parent
NODE_PROGRAM = ROOT / "cloud-init" / "gpucluster_node.py"
BUDGET_PROGRAM = ROOT / "cloud-init" / "gpucluster_budget.py"
REQUIRED = ("/usr/bin/python3", "munged", "slurmctld", "slurmd", "slurmdbd", "sinfo", "scontrol", "sbatch", "mariadbd", "mariadb-install-db",
            "unshare", "runuser")
BOOT_SECONDS = 2.0
SITE_PACKAGES = Path(__import__("boto3").__file__).resolve().parent.parent
MOTO_ACCOUNT = "123456789012"
AWS_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def missing_tools() -> list[str]:
    return [tool for tool in REQUIRED if not shutil.which(tool)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_block(count: int) -> int:
    """The first of `count` consecutive free ports, below the kernel's ephemeral range: a slurmd binds its port only
    when its node boots, and by then any outgoing connection could have taken an ephemeral port as its source."""
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


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _own(path: Path, user: str) -> None:
    entry = pwd.getpwnam(user)
    os.chown(path, entry.pw_uid, entry.pw_gid)


def spawn(procs: list[subprocess.Popen[bytes]], args: list[str], env: dict[str, str] | None = None,
          log: Path | None = None) -> subprocess.Popen[bytes]:
    """Start a daemon in its own process group, so that a wrapper (runuser, unshare) dies with what it runs."""
    out = open(log, "ab") if log else subprocess.DEVNULL
    proc = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    procs.append(proc)
    return proc


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


class FaultyEC2:
    """An HTTP front for moto that answers CreateFleet with an EC2 error for the markets in `failing_markets`."""

    def __init__(self, upstream: str):
        self.upstream = upstream
        self.failing_markets: dict[str, str] = {}  # market -> error code
        self.calls: list[str] = []
        front = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                text = body.decode()
                if "Action=CreateFleet" in text:
                    market = next((m for m in front.failing_markets if f"DefaultTargetCapacityType={m}" in text), None)
                    front.calls.append(f"CreateFleet {market or 'ok'}")
                    if market:
                        return self._reply(200, _fleet_error(front.failing_markets[market]))
                request = urllib.request.Request(front.upstream + self.path, data=body, method="POST",
                                                 headers={k: v for k, v in self.headers.items() if k.lower() != "host"})
                try:
                    with urllib.request.urlopen(request, timeout=60) as reply:
                        self._reply(reply.status, reply.read(), reply.headers.get("Content-Type"))
                except urllib.error.HTTPError as err:
                    self._reply(err.code, err.read(), err.headers.get("Content-Type"))

            def _reply(self, status: int, data: bytes, content_type: str | None = "text/xml") -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type or "text/xml")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


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


@dataclass
class LocalCluster:
    stack: Stack
    root: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    nodes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)  # booted node -> its slurmd
    boots: list[tuple[str, float]] = field(default_factory=list)  # (node, when its slurmd started)
    env: dict[str, str] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)

    # --- lifecycle -----------------------------------------------------------------------------------------------
    def start(self) -> LocalCluster:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        self._stop.set()
        for proc in list(self.nodes.values()) + list(reversed(self.procs)):
            stop(proc)
        self.nodes.clear()
        self._stop_orphan_steps()
        for closer in ("faulty", "moto"):
            if hasattr(self, closer):
                getattr(self, closer).stop() if closer == "moto" else getattr(self, closer).close()

    def _start(self) -> None:
        from moto.server import ThreadedMotoServer

        self.root.chmod(0o755)
        port = free_port()
        self.moto = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        self.moto.start()
        # moto's backends are shared by every server in this process: each cluster starts from an empty account.
        urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/moto-api/reset", method="POST"))
        self.faulty = FaultyEC2(f"http://127.0.0.1:{port}")
        self.moto_url = f"http://127.0.0.1:{port}"
        nodes = sum(p.max_nodes for p in self.stack.spec.pools)
        # One block for every port of the cluster: ports picked one by one could land inside the nodes' range.
        ports = free_port_block(nodes + 3)
        self.layout = slurm.SlurmLayout(
            controller_host=socket.gethostname(),
            controller_port=ports,
            node_port=ports + 1,
            dbd_port=ports + 2,
            node_port_base=ports + 3,
            state_dir=str(self.root / "state"),
            spool_dir=str(self.root / "spool"),
            log_dir=str(self.root / "log"),
            run_dir=str(self.root / "run"),
            programs_dir=str(self.root / "bin"),
            munge_socket=str(self.root / "munge" / "munge.socket"),
            dev_dir=str(self.root / "dev"),
            simulated_hardware=True,
            cgroups=False,
        )
        self.config_path = self.root / "cluster.json"
        self._ec2_world()
        self._files()
        self._daemons()
        threading.Thread(target=self._boot_loop, daemon=True).start()

    def _stop_orphan_steps(self) -> None:
        """slurmstepd detaches from slurmd: a job step still running when its "node" stops would outlive the test."""
        if not hasattr(self, "conf"):
            return
        mark = f"SLURM_CONF={self.conf}".encode()
        for proc in Path("/proc").iterdir():
            try:
                if proc.name.isdigit() and (proc / "cmdline").read_bytes().startswith(b"slurmstepd") \
                        and mark in (proc / "environ").read_bytes().split(b"\0"):
                    os.kill(int(proc.name), signal.SIGKILL)
            except OSError:  # gone meanwhile, or not ours to read
                continue

    # --- EC2 in moto: what `pulumi up` would have created -------------------------------------------------------
    def ec2(self):  # type: ignore[no-untyped-def]
        import boto3

        return boto3.client("ec2", endpoint_url=self.moto_url, region_name=self.stack.region, **{
            "aws_access_key_id": "testing", "aws_secret_access_key": "testing"})

    def _ec2_world(self) -> None:
        ec2 = self.ec2()
        vpc = ec2.create_vpc(CidrBlock="127.0.0.0/16")["Vpc"]["VpcId"]
        subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="127.0.0.0/24",
                                   AvailabilityZone=self.stack.spec.availability_zone)["Subnet"]["SubnetId"]
        pools = {}
        for pool in self.stack.spec.pools:
            template = ec2.create_launch_template(
                LaunchTemplateName=f"{self.stack.cluster_name}-{pool.name}",
                LaunchTemplateData={"ImageId": "ami-12c6146b", "InstanceType": pool.instance_type,
                                    "TagSpecifications": [{"ResourceType": "instance", "Tags": [
                                        {"Key": k, "Value": v} for k, v in {**self.stack.tags, "gpucluster:pool": pool.name}.items()]}]},
            )["LaunchTemplate"]["LaunchTemplateId"]
            pools[pool.name] = {"launch_template_id": template, "subnet_id": subnet,
                                "instance_type": pool.instance_type, "market": pool.capacity}
        self.config_path.write_text(json.dumps({
            "cluster": self.stack.cluster_name, "region": self.stack.region, "pools": pools,
            "log_file": str(self.root / "log" / "nodes.log"), "scontrol": shutil.which("scontrol"),
            "team": self.stack.spec.team, "budget_state_file": str(self.root / "budget.json"),
        }, indent=1))

    # --- files and daemons ----------------------------------------------------------------------------------------
    def _files(self) -> None:
        lay = self.layout
        for d in (lay.state_dir, lay.spool_dir, lay.log_dir, lay.run_dir, lay.programs_dir, lay.dev_dir):
            Path(d).mkdir()
            _own(Path(d), lay.slurm_user)
        for pool in self.stack.spec.pools:
            acc = pool.itype.accelerator
            for i in range(acc.count if acc else 0):
                # slurmd wants a character device behind each gres.conf File=: /dev/null stands in for the GPU.
                device = Path(lay.dev_dir) / f"{acc.kind}{i}"  # as slurm.device_files names them
                if not device.is_symlink():
                    device.symlink_to("/dev/null")
        self.conf = self.root / "slurm.conf"
        self.conf.write_text(slurm.slurm_conf(self.stack, lay))
        (self.root / "gres.conf").write_text(slurm.gres_conf(self.stack, lay))
        dbd = self.root / "slurmdbd.conf"
        dbd.write_text(slurm.slurmdbd_conf(self.stack, lay))
        dbd.chmod(0o600)
        _own(dbd, lay.slurm_user)
        self.env = {**os.environ, **AWS_ENV, "SLURM_CONF": str(self.conf), "GPUCLUSTER_CONFIG": str(self.config_path),
                    "AWS_ENDPOINT_URL": self.faulty.url}
        for command in ("resume", "suspend", "resume-fail"):
            wrapper = Path(lay.programs_dir) / command
            exports = " ".join(f"{k}={v}" for k, v in self.env.items()
                               if k.startswith("AWS_") or k in ("SLURM_CONF", "GPUCLUSTER_CONFIG"))
            # Slurm runs these as the slurm user with the system python3, as on the head node; boto3 comes from the
            # test environment's site-packages (the interpreter behind it may sit where slurm cannot read).
            wrapper.write_text(f"#!/bin/sh\nexport {exports} PYTHONPATH={SITE_PACKAGES}\n"
                               f"exec /usr/bin/python3 {NODE_PROGRAM} {command} \"$@\"\n")
            wrapper.chmod(0o755)

    def _daemons(self) -> None:
        lay = self.layout
        logs = Path(lay.log_dir)
        munge_dir = Path(lay.munge_socket).parent
        munge_dir.mkdir()
        munge_dir.chmod(0o755)  # munged insists that every client can reach its socket
        key = munge_dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        for path in (munge_dir, key):
            _own(path, "munge")
        spawn(self.procs, ["runuser", "-u", "munge", "--", "munged", "--foreground", f"--key-file={key}",
                           f"--socket={lay.munge_socket}", f"--pid-file={munge_dir}/munged.pid",
                           f"--log-file={munge_dir}/munged.log", f"--seed-file={munge_dir}/seed"])
        db_socket = self._database()
        env = {**self.env, "MYSQL_UNIX_PORT": str(db_socket)}
        dbd = spawn(self.procs, ["slurmdbd", "-D"], env)
        wait_for("slurmdbd", lambda: listening(lay.dbd_port), [dbd], [logs / "slurmdbd.log"])
        ctld = spawn(self.procs, ["slurmctld", "-D", "-i", "-f", str(self.conf)], env)
        wait_for("slurmctld", lambda: subprocess.run(["sinfo"], env=self.env, capture_output=True).returncode == 0,
                 [ctld, dbd], [logs / "slurmctld.log", logs / "slurmdbd.log"])
        # The head node's accounting script, for the user the tests submit as.
        subprocess.run(["sh", "-c", slurm.accounting_script(self.stack, ("root",))], env=self.env, check=True,
                       capture_output=True)

    def _database(self) -> Path:
        """A private MariaDB with the accounting user slurmdbd connects as (Unix-socket authentication)."""
        db = self.root / "mysql"
        data = db / "data"
        data.mkdir(parents=True)
        for path in (db, data):
            _own(path, "mysql")
        subprocess.run(["mariadb-install-db", "--user=mysql", f"--datadir={data}",
                        "--auth-root-authentication-method=socket", "--skip-test-db"], check=True, capture_output=True)
        sock = db / "mysqld.sock"
        log = db / "error.log"
        proc = spawn(self.procs, ["mariadbd", "--user=mysql", f"--datadir={data}", f"--socket={sock}",
                                  "--skip-networking", f"--pid-file={db}/mysqld.pid", f"--log-error={log}"])
        wait_for("MariaDB", sock.exists, [proc], [log])
        subprocess.run(["mariadb", f"--socket={sock}", "-u", "root", "-e", slurm.ACCOUNTING_DB_SQL], check=True)
        return sock

    # --- the node booter: plays the part of EC2 starting and stopping machines ----------------------------------
    def _boot_loop(self) -> None:
        ec2 = self.ec2()
        seen: dict[str, float] = {}
        while not self._stop.is_set():
            try:
                live = self.instances(ec2)
            except Exception:  # moto shutting down with the test
                return
            now = time.monotonic()
            for node in live.keys() - self.nodes.keys():
                # Slurm compares boot times in whole seconds and ignores a node that "booted" before it was resumed;
                # a real instance takes minutes, here two seconds are enough.
                if now - seen.setdefault(node, now) >= BOOT_SECONDS:
                    self._boot(node)
                    seen.pop(node)
            for node in self.nodes.keys() - live.keys():
                stop(self.nodes.pop(node))
            time.sleep(0.3)

    def _boot(self, node: str) -> None:
        (Path(self.layout.spool_dir) / node).mkdir(exist_ok=True)  # the package makes /var/spool/slurmd on a real node
        uptime = Path("/proc/uptime").read_text().split(".")[0]
        # slurmctld ignores a node whose boot time predates the resume request: boot it in a time namespace of its own.
        self.nodes[node] = spawn([], ["unshare", "--time", f"--boottime=-{uptime}", "slurmd", "-D", "-f", str(self.conf),
                                      "-N", node], self.env, Path(self.layout.log_dir) / f"boot-{node}.log")
        self.boots.append((node, time.time()))

    def instances(self, ec2=None) -> dict[str, str]:  # type: ignore[no-untyped-def]
        """Running instances of this cluster in moto: node name -> instance id."""
        ec2 = ec2 or self.ec2()
        found = {}
        for r in ec2.describe_instances(Filters=[{"Name": "instance-state-name", "Values": ["pending", "running"]},
                                                 {"Name": "tag:gpucluster:cluster", "Values": [self.stack.cluster_name]}])["Reservations"]:
            for inst in r["Instances"]:
                tags = {t["Key"]: t["Value"] for t in inst.get("Tags", [])}
                if "gpucluster:node" in tags:
                    found[tags["gpucluster:node"]] = inst["InstanceId"]
        return found

    # --- the budget guardrail: AWS Budgets, its topic and queue in moto, the service as on the head node ----------
    def aws(self, service: str):  # type: ignore[no-untyped-def]
        import boto3

        return boto3.client(service, endpoint_url=self.moto_url, region_name=self.stack.region, **{
            "aws_access_key_id": "testing", "aws_secret_access_key": "testing"})

    def set_spend(self, actual: float) -> None:
        """The stack's budget as AWS Budgets would report it (moto keeps the spend it is given)."""
        budgets, name = self.aws("budgets"), self.stack.budget_name
        if any(b["BudgetName"] == name for b in budgets.describe_budgets(AccountId=MOTO_ACCOUNT).get("Budgets", [])):
            budgets.delete_budget(AccountId=MOTO_ACCOUNT, BudgetName=name)
        budgets.create_budget(AccountId=MOTO_ACCOUNT, Budget={
            "BudgetName": name, "BudgetType": "COST", "TimeUnit": "MONTHLY",
            "BudgetLimit": {"Amount": f"{self.stack.spec.budget.monthly_usd:.2f}", "Unit": "USD"},
            "CalculatedSpend": {"ActualSpend": {"Amount": f"{actual:.2f}", "Unit": "USD"}}})

    def start_guardrail(self, check_seconds: int) -> str:
        """What the Budget component and the head node set up: the topic, the queue subscribed to it, the settings, the
        service. Returns the topic's ARN."""
        sns, sqs = self.aws("sns"), self.aws("sqs")
        topic = sns.create_topic(Name=f"{self.stack.cluster_name}-alerts")["TopicArn"]
        queue = sqs.create_queue(QueueName=f"{self.stack.cluster_name}-guardrail")["QueueUrl"]
        arn = sqs.get_queue_attributes(QueueUrl=queue, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
        sns.subscribe(TopicArn=topic, Protocol="sqs", Endpoint=arn)
        settings = json.loads(self.config_path.read_text())
        settings["budget"] = {"budget_name": self.stack.budget_name, "account_id": MOTO_ACCOUNT,
                              "act_threshold_percent": self.stack.spec.budget.act_threshold_percent,
                              "queue_url": queue, "topic_arn": topic, "check_seconds": check_seconds,
                              "launch_deny_action": False}  # moto serves no Budgets actions
        self.config_path.write_text(json.dumps(settings, indent=1))
        env = {**self.env, "PYTHONPATH": str(SITE_PACKAGES)}
        spawn(self.procs, ["/usr/bin/python3", str(BUDGET_PROGRAM), "run"], env, Path(self.layout.log_dir) / "budget.log")
        return topic

    def budget_command(self, command: str) -> str:
        """`gpucluster-budget <command>` as an admin runs it on the head node."""
        env = {**self.env, "PYTHONPATH": str(SITE_PACKAGES), "SUDO_USER": "alice"}
        return subprocess.run(["/usr/bin/python3", str(BUDGET_PROGRAM), command], env=env, check=True,
                              capture_output=True, text=True, timeout=60).stdout

    # --- helpers for tests ----------------------------------------------------------------------------------------
    def run(self, *args: str, check: bool = True) -> str:
        return subprocess.run(list(args), env=self.env, check=check, capture_output=True, text=True, timeout=60).stdout

    def job_state(self, job: str) -> str:
        return self.run("scontrol", "show", "job", job).split("JobState=")[1].split()[0]

    def wait(self, what: str, ready: Callable[[], bool], seconds: float) -> None:
        log_dir = Path(self.layout.log_dir)
        try:
            wait_for(what, ready, [], [log_dir / "slurmctld.log", log_dir / "nodes.log"], seconds)
        except RuntimeError as exc:  # the nodes' own logs exist only now
            nodes = "\n".join(f"--- {log}\n{log.read_text()[-1500:]}" for log in sorted(log_dir.glob("*slurmd-*.log"))
                              + sorted(log_dir.glob("boot-*.log")))
            raise RuntimeError(f"{exc}\n{nodes}") from None
