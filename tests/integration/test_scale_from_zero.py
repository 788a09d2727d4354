"""Jobs on nodes that do not exist yet: Slurm calls the resume program, which launches instances (moto), the harness
boots a slurmd for each, the job runs; idle nodes are suspended and their instances terminated."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from conftest import ROOT
from gpucluster.contract.settings import (
    AWS_OFI_NCCL_LIB_DIR,
    EVENTS_LOG,
    NCCL_NET_PLUGIN_FILE,
    POOL_TAG,
    PROMETHEUS_PORT,
)
from gpucluster.node import usage
from gpucluster.node.slurm_control import SlurmControl
from gpucluster.spec import cost
from local_cluster import LocalCluster, spot_warning

pytestmark = pytest.mark.rehearsal


def submit(cluster: LocalCluster, *args: str) -> str:
    return cluster.run("sbatch", "--parsable", "-o", str(cluster.root / "job-%j.out"), *args).strip()


def prometheus(cluster: LocalCluster, path: str) -> dict[str, Any]:
    """The head's Prometheus (it listens on 127.0.0.1 in the cluster's network, which its nodes share)."""
    with cluster.network.entered():
        answer = urllib.request.urlopen(f"http://127.0.0.1:{PROMETHEUS_PORT}/api/v1/{path}", timeout=10)
    with answer:
        return json.load(answer)["data"]


def scraped(cluster: LocalCluster, job: str) -> dict[str, str]:
    """node label -> health of the scrape job's active targets."""
    return {t["labels"]["node"]: t["health"] for t in prometheus(cluster, "targets?state=active")["activeTargets"]
            if t["labels"]["job"] == job}


def test_two_node_job_scales_from_zero_and_back(cluster: LocalCluster) -> None:
    assert not cluster.instances()
    # Each task's host name is its node's, and it resolves both nodes' names (the job's prolog), the first one as job
    # scripts name it. It holds its GPU until the test has seen it in Prometheus.
    hold, release = cluster.held("monitoring")
    job = submit(cluster, "-p", "standby", "-N", "2", "--gres=gpu:1", "--wrap",
                 'first=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1); '
                 "srun bash -c \"echo ran on \\$SLURMD_NODENAME as \\$(hostname) resolving "
                 f"\\$(getent hosts $first standby-1 standby-2 | wc -l); {hold}\"")

    def standby() -> set[str]:
        return {i for i, pool in cluster.instances_by_id().items() if pool == "standby"}

    cluster.wait("the job's instances to be launched", lambda: len(standby()) == 2, 60)
    before = standby()
    # Reconciler passes while the nodes boot and register (and always-1 is powered up) terminate nothing.
    passes = [cluster.reconcile() for _ in range(3)]
    assert not any("terminating" in p or "DOWN" in p for p in passes), passes
    assert ("head", "TerminateInstances") not in cluster.calls and standby() == before
    # Prometheus on the head, started from the rendered prometheus.yml, finds the nodes as they register and scrapes
    # their real node_exporters and dcgm-exporter's stand-in; each GPU's series carry its node, pool, team and job.
    cluster.wait(f"job {job} to run", lambda: cluster.job_state(job) == "RUNNING", 180)
    cluster.wait("Prometheus to scrape both nodes", lambda: all(
        scraped(cluster, kind).get(node) == "up"
        for kind in ("node", "dcgm") for node in ("standby-1", "standby-2")), 120)
    assert scraped(cluster, "node")["head"] == "up"

    def job_labelled() -> dict[str, dict[str, str]]:
        """node -> the labels of its GPU's series that name a job (the scrape after the Prolog wrote its file)."""
        query = urllib.parse.quote('DCGM_FI_DEV_GPU_UTIL{pool="standby",hpc_job!=""}')
        series = prometheus(cluster, f"query?query={query}")
        return {s["metric"]["node"]: s["metric"] for s in series["result"]}

    cluster.wait("both nodes' GPUs to carry the job", lambda: set(job_labelled()) == {"standby-1", "standby-2"}, 90)
    labels = job_labelled()
    assert all(m["hpc_job"] == job and m["team"] == cluster.stack.spec.team and m["UUID"] for m in labels.values())
    load = prometheus(cluster, "query?query=" + urllib.parse.quote('node_load1{pool="standby"}'))["result"]
    assert {s["metric"]["node"] for s in load} == {"standby-1", "standby-2"}, load  # node_exporter's own figures
    release.touch()
    cluster.wait(f"job {job} to complete", lambda: cluster.job_state(job) == "COMPLETED", 180)
    output = (cluster.root / f"job-{job}.out").read_text()
    assert "ran on standby-1 as standby-1 resolving 3" in output, output
    assert "ran on standby-2 as standby-2 resolving 3" in output, output
    cluster.wait("the head to resolve the nodes", lambda: cluster.head.enter(
        "getent", "hosts", "standby-1", check=False).returncode == 0, 30)
    # Each node was an instance launched for the job (and the always-on one), recorded as its node, reached at its
    # moto address.
    assert {node for node, _ in cluster.boots} <= {"standby-1", "standby-2", "always-1"}
    assert {"standby-1", "standby-2"} <= {node for node, _ in cluster.boots}
    addresses = cluster.run("sinfo", "--noheader", "-N", "-p", "standby", "--format=%N %o")
    assert all(line.split()[1].startswith("127.0.0.") for line in addresses.splitlines()), addresses
    # After SuspendTime idle seconds the suspend program terminates both instances.
    cluster.wait("idle nodes to be suspended", lambda: not {"standby-1", "standby-2"} & set(cluster.instances()), 120)
    # A node powered down is no longer a name anyone resolves, nor a target Prometheus scrapes.
    cluster.wait("standby-1's name to go", lambda: cluster.head.enter(
        "getent", "hosts", "standby-1", check=False).returncode == 2, 60)
    cluster.wait("the suspended nodes to leave Prometheus' targets", lambda: not {"standby-1", "standby-2"} & (
        set(scraped(cluster, "node")) | set(scraped(cluster, "dcgm"))), 90)
    ec2 = cluster.ec2()
    launched_by_slurm = ec2.describe_instances(Filters=[{"Name": f"tag:{POOL_TAG}", "Values": ["standby"]}])
    states = {i["State"]["Name"] for r in launched_by_slurm["Reservations"] for i in r["Instances"]}
    assert states == {"terminated"}
    # Powering down (idle%) for SuspendTimeout, then powered down (idle~): either way no instance, ready to resume.
    cluster.wait("nodes to power down", lambda: set(cluster.run(
        "sinfo", "--noheader", "-p", "standby", "--format=%t").split()) <= {"idle%", "idle~"}, 60)


def test_spot_capacity_shortage_falls_back_to_on_demand(cluster: LocalCluster) -> None:
    cluster.failing_markets["spot"] = "InsufficientInstanceCapacity"
    # The spot partition lists the spot nodes first (lower weight) and the on-demand pool behind them.
    job = submit(cluster, "-p", "spot", "-N", "2", "--wrap", "srun bash -c 'echo ran on $SLURMD_NODENAME'")
    # Slurm holds a requeued job for the credential lifetime (120 s) before it runs elsewhere.
    cluster.wait(f"job {job} to complete", lambda: cluster.job_state(job) == "COMPLETED", 300)
    output = (cluster.root / f"job-{job}.out").read_text()
    assert "ran on standby-1" in output and "ran on standby-2" in output, output
    fleets = [action for who, action in cluster.calls if action.startswith("CreateFleet")]
    assert "CreateFleet spot refused" in fleets and "CreateFleet" in fleets, fleets
    # The spot nodes carry EC2's reason, so `sinfo -R` tells the user why the job moved.
    reasons = cluster.run("sinfo", "--noheader", "-R", "--format=%n|%E")
    down = dict(line.split("|", 1) for line in reasons.splitlines())
    for node in ("spot-1", "spot-2"):
        assert "capacity: InsufficientInstanceCapacity" in down[node], reasons
    assert {node for node, _ in cluster.boots} == {"standby-1", "standby-2"}
    assert "Restarts=1" in cluster.run("scontrol", "show", "job", job)  # requeued once, not lost


def submit_example(cluster: LocalCluster, sbatch_file: str, *args: str, partition: str = "standby") -> str:
    """An example job as a user submits it from the directory holding examples/, on the CPU: through
    examples/submit.sh, which asks Slurm for the partition's GPUs per node (1: the local pools are g6.xlarge). Returns
    its id."""
    torchrun = Path(sys.executable).with_name("torchrun")
    assert torchrun.exists(), "pip install torch==2.13.0 (make test does)"
    env_path = f"{torchrun.parent}:{os.environ['PATH']}"
    return subprocess.run(
        ["examples/submit.sh", "--parsable", "-p", partition, "--output", str(cluster.root / "ex-%j.out"),
         "--export", f"ALL,PATH={env_path},CHECKPOINT_DIR={cluster.root / 'checkpoints'}",  # not into the repository
         f"examples/{sbatch_file}", *args],
        cwd=ROOT, env=cluster.env, check=True, capture_output=True, text=True).stdout.strip()


def run_example(cluster: LocalCluster, sbatch_file: str, *args: str) -> str:
    """An example job (submit_example) run to its end. Returns its output once it completed."""
    job = submit_example(cluster, sbatch_file, *args)
    cluster.wait(f"{sbatch_file} job {job}",
                 lambda: cluster.job_state(job) in {"COMPLETED", "FAILED", "CANCELLED"}, 240)
    output = (cluster.root / f"ex-{job}.out").read_text()
    # The whole output when it failed: each rank's first error is near the top, the launcher's summary at the end.
    assert cluster.job_state(job) == "COMPLETED", output[-20000:]
    return output


def test_example_all_reduce_job_measures_bus_bandwidth(cluster: LocalCluster) -> None:
    output = run_example(cluster, "all_reduce.sbatch", "--max-bytes", str(16 << 20), "--iters", "5")
    assert "all_reduce correct: True (world 2, backend gloo)" in output, output[-2000:]
    rows = re.findall(r"^\s+(\d+)\s+[\d.]+\s+([\d.]+)\s+([\d.]+)$", output, flags=re.M)
    assert [int(r[0]) for r in rows] == [1 << 20, 4 << 20, 16 << 20]
    assert all(float(bus) > 0 and float(bus) == pytest.approx(float(alg), rel=0.02) for _, alg, bus in rows)  # n=2


def test_example_ddp_job_survives_a_spot_warning_and_trains_across_two_nodes(cluster: LocalCluster) -> None:
    """The DDP example on two spot nodes. EC2's warning for one of them reaches the head's queue: the interruptions
    service drains the node, the job gets SIGUSR1 and checkpoints, is requeued (5 s later here), EC2 takes the
    instance, the reconciler gives the node back, and the job runs again on a fresh node from the checkpoint's step,
    not step 0. Both ranks train and end with the same weights.

    The resumed run's time is measured on the first run, on this machine today (a loaded machine reaches its nodes,
    starts torch and trains many times slower than a quiet one), not guessed."""
    # Still training when the signal comes (the warning goes out as step 0 shows: a quiet machine trains a few
    # hundred steps a second), and seconds of training left after the resume.
    steps = 1500
    checkpoints = cluster.root / "checkpoints"
    submitted = time.monotonic()
    job = submit_example(cluster, "ddp.sbatch", "--steps", str(steps), "--checkpoint-every", str(10 * steps),
                         partition="spot")  # only the signal makes a checkpoint
    output = cluster.root / f"ex-{job}.out"
    cluster.wait(f"job {job} to run", lambda: cluster.job_state(job) == "RUNNING", 240)
    # The node to warn and its instance, found while torch starts: nothing stands between step 0 and the warning.
    node = cluster.run("scontrol", "show", "hostnames", cluster.run("squeue", "-h", "-j", job, "-o", "%N").strip())
    node = node.split()[0]
    instance = cluster.instances()[node]
    cluster.wait(f"job {job} to train", lambda: output.exists() and "step 0 " in output.read_text(), 240)
    training = time.monotonic()

    warned_at = time.time()
    cluster.aws("sqs").send_message(QueueUrl=cluster.interruptions, MessageBody=spot_warning(instance))
    cluster.wait("the checkpoint the signal asks for", lambda: "(signalled)" in output.read_text(), 60)
    first_signalled = int(re.findall(r"checkpoint at step (\d+) \(signalled\)", output.read_text())[0])
    # At most a step's seconds: the signal's own way to the job counts as steps too.
    step_seconds = (time.monotonic() - training) / max(first_signalled, 1)
    measured = (f"the first run trained from {training - submitted:.0f} s after its submission, "
                f"{step_seconds * 1000:.1f} ms a step")
    reason = cluster.run("sinfo", "-h", "-R", "-n", node, "-o", "%E")
    assert f"gpucluster: replace: spot interruption warning for {instance}" in reason, reason
    cluster.wait(f"job {job} to be requeued", lambda: "Restarts=1" in cluster.run("scontrol", "show", "job", job), 60)
    # Its first run has ended (the job pending again) long before EC2 reclaims the instance, two minutes after its
    # warning: Slurm gives a step's processes KillWait (30 s). Taken while the job still completes, the batch step's
    # node would leave the other node's step waiting out MessageTimeout (60 s) for its vanished srun (seen: 111 s).
    cluster.wait(f"job {job}'s first run to end", lambda: cluster.job_state(job) == "PENDING", 120)
    cluster.ec2().terminate_instances(InstanceIds=[instance])
    # The reconciler then gives the node a fresh start.
    cluster.wait(f"{node} to be replaced", lambda: "replace" in cluster.reconcile(), 60)
    # The resumed run gets three times what the first one took to start training and to train the steps left, and
    # the requeued job's hold (the credential's lifetime) and the replaced node's power-down on top.
    left = steps - first_signalled
    deadline = time.monotonic() + 3 * (training - submitted + left * step_seconds) + (
        (cluster.layout.cred_expire or 0) + cluster.layout.suspend_timeout)
    cluster.wait(f"job {job} to resume ({measured})",
                 lambda: "resumed from " in output.read_text() or cluster.job_state(job) in {"FAILED", "COMPLETED"},
                 deadline - time.monotonic())
    cluster.wait(f"job {job} to train its last {left} steps ({measured})",
                 lambda: cluster.job_state(job) in {"COMPLETED", "FAILED"}, deadline - time.monotonic())
    text = output.read_text()
    assert cluster.job_state(job) == "COMPLETED", text[-20000:]
    first_run, resumed = text.split("resumed from ", 1)
    # scancel --full reaches the training processes through srun and directly: one checkpoint or two; the newest.
    signalled = [int(n) for n in re.findall(r"checkpoint at step (\d+) \(signalled\)", first_run)]
    newest = max(signalled, default=None)
    assert signalled and resumed.startswith(f"{checkpoints}/step-{newest} at step {newest}"), text[-3000:]
    assert instance not in cluster.instances().values()
    events = [json.loads(line)["event"] for line in cluster.head.path(EVENTS_LOG).read_text().splitlines()]
    assert events[0] == "spot interruption warning" and "requeued" in events and "replaced" in events, events

    ranks = re.findall(r"rank (\d)/2 on (\S+) backend gloo loss ([\d.]+) -> ([\d.]+) weights (\w{16}) "
                       r"nccl-net (\S+) (?:in \S+|not found) LD_LIBRARY_PATH=(\S*)", resumed)
    assert sorted(r[0] for r in ranks) == ["0", "1"], text[-3000:]
    # The warned instance took no part in the rest: its node ran it only as a fresh instance, if at all (which one
    # depends on whether the job or the node's replacement comes first).
    fresh = {name for name, booted in cluster.boots if booted > warned_at}
    assert all(r[1] != node or node in fresh for r in ranks), (ranks, cluster.boots)
    assert len({r[4] for r in ranks}) == 1  # replicas agree
    # Every task's NCCL would load EFA's plugin (review item 5), as each training process itself sees its environment
    # (the TaskProlog's, through srun and torchrun): named, and its directory on the loader's path.
    assert {r[5] for r in ranks} == {NCCL_NET_PLUGIN_FILE}, text[-3000:]
    assert all(AWS_OFI_NCCL_LIB_DIR in r[6].split(":") for r in ranks), text[-3000:]


def test_money_quota_holds_jobs_that_would_exceed_it(cluster: LocalCluster) -> None:
    """The team account's monthly quota in money (the $500 budget less the stack's fixed costs, as cent-minutes of
    Slurm's billing TRES) admits a job whose time limit fits, and holds one that would bill past it, with Slurm's quota
    reason; the job that ran billed its GPU's price for its minute."""
    quota = cost.quota(cluster.stack)
    shown = cluster.run("sacctmgr", "-n", "-P", "show", "assoc", "where", "account=local", "user=",
                        "format=GrpTRESMins").split()
    assert shown == [f"billing={quota.billing_minutes}"]
    (standby,) = [p for p in quota.pools if p.pool == "standby"]
    month = 30 * 24
    assert standby.usd_per_accelerator_hour * month > quota.usd  # a GPU for 30 days costs more than the quota
    fits = submit(cluster, "-p", "standby", "--gpus=1", "--time=60", "--wrap", "sleep 62")
    beyond = submit(cluster, "-p", "standby", "--gpus=1", f"--time={month * 60}", "--wrap", "true")
    cluster.wait(f"job {fits} to complete", lambda: cluster.job_state(fits) == "COMPLETED", 180)
    assert cluster.job_state(beyond) == "PENDING"
    reason = cluster.run("squeue", "-h", "-j", beyond, "-o", "%r").strip()
    assert reason == "AssocGrpBillingMinutes", reason
    account = cluster.run("squeue", "-h", "-j", beyond, "-o", "%a").strip()
    assert account == "local"
    # `gpucluster cost` on the head node reads the same figures Slurm enforces: one GPU for a minute and a bit
    # (Slurm counts whole minutes; root sums the accounts under it), billed at the GPU's price for the job's run time
    # (Slurm truncates the job's billing to whole cents per hour, and the usage to whole cent-minutes).
    used = usage.slurm_gpu_hours(SlurmControl(str(shutil.which("scontrol", path=cluster.env["PATH"]))))
    assert used.accounts == pytest.approx({"root": 1 / 60, "local": 1 / 60})
    seconds = int(cluster.run("sacct", "-n", "-X", "-j", fits, "-o", "ElapsedRaw").strip())
    assert used.billed_usd["local"] == pytest.approx(standby.usd_per_accelerator_hour * seconds / 3600, rel=0.05)
    # and by person: the job's user (the harness submits as root, a user of the team's account here) used all of it.
    assert used.users[("local", "root")] == pytest.approx(1 / 60), used
