#!/usr/bin/python3
"""`gpucluster verify` on the head node: the plan's checks measured through Slurm, as users' jobs run, and judged.

For every chosen pool at once, a batch job of the login user (settings.LOGIN_USER; root submits it through runuser)
asks for the plan's node count of that pool alone (its partition, --constraint on the pool's node feature,
--exclusive), so Slurm scales the pool from zero. The job writes its start time first (scale_from_zero_seconds: from
Slurm giving the job its nodes, when the run last saw it waiting, to that start; the wait before, from submission,
kept beside it as queue_seconds), runs verify_probe.py once per node (each node's JSON to a file of its own in the
run's directory on /fsx, owned by the user; the pools take turns, FSX_LOCK, so that one pool at a time measures /fsx
throughput) and, on NVIDIA pools of two nodes or more, nccl-tests' all_reduce_perf across them. DCGM's host engine
answers root only (contract/lockdown.py DCGM_CHAIN): as soon as the user's job starts, root submits a short job on
exactly its nodes that Slurm starts once the user's job has ended (--dependency=afterany), before SuspendTime could
power an idle node off, and that runs the probe's DCGM diagnostic alone. While the pool's nodes are up (a job of the
run holds them, or Slurm says they are), the head's Prometheus is asked whether it scrapes them.

A pool whose nodes were all up when the run submitted its job (a warm pool) scales nothing: scale_from_zero_seconds
warns that it was not measured. A job that Slurm does not give nodes within QUEUE_SECONDS is cancelled: when Slurm's
reason is other work or the team's limits (Resources, Priority, a QOS or association limit) the pool's checks warn
with that reason, any other reason fails them; nodes still booting past the plan's scale-from-zero limit fail them.
Root's DCGM job kept from the nodes so (another job took them after the user's) makes dcgm_diag warn alike.

Every check is judged with contract.verify.judge_reading: a per-node check by the pool's worst node (named in the
fix), /fsx throughput by the sum of the nodes' concurrent figures. The run document lands in settings.VERIFY_DIR
(root's, 0644), the last result of each pool on the team's board (settings.VERIFY_TEXTFILE); the nodes return to zero
by Slurm's own SuspendTime. Exit status: 0 nothing failed, 1 something did.

Standard library, and boto3 for the budget topic (the head's role), like the resume program.
"""

from __future__ import annotations

import calendar
import json
import os
import pwd
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the library this program is part of (the bundle's lib/)
from gpucluster.contract import slurm_json, verify as v
from gpucluster.contract.settings import (
    ALL_REDUCE_PERF,
    LOGIN_USER,
    NODE_JOB,
    PROMETHEUS_PORT,
    SLURM_ROOT_ACCOUNT,
    VERIFY_DIR,
    VERIFY_PROBE_PROGRAM,
    VERIFY_TEXTFILE,
    ClusterSettings,
)
from gpucluster.contract.verify import DCGM_START_SECONDS, JOB_SECONDS, QUEUE_SECONDS
from gpucluster.node import nccl_tests, textfile
from gpucluster.node.prometheus_api import prometheus_get
from gpucluster.node.slurm_control import SlurmControl

PYTHON = "/usr/bin/python3"  # the node programs' interpreter on every node
STARTED_FILE = "started"  # in a pool's run directory: the job's first act, its start time (Unix seconds)
# In the run's directory (on /fsx, which nodes mount with `flock`: bootstrap.py's fstab line): the pools' probe steps
# take it in turn, so that one pool at a time measures /fsx throughput. Each pool's floor is a share of the whole file
# system's baseline (render/verify.fsx_floors_mbps): pools measuring at once would divide it and fail falsely.
FSX_LOCK = ".fsx-throughput.lock"
ALL_REDUCE_OUT = "all_reduce.out"
# Prometheus finds a new node at its next file_sd refresh and scrapes it at its next interval (render/prometheus.py:
# a minute and 30 s); a node it has not scraped this long after the job started is not being scraped. Shorter than
# JOB_SECONDS: this wait adds nothing to contract.verify.run_seconds.
PROMETHEUS_SECONDS = 120
POLL_SECONDS = 2.0  # between looks at Slurm's jobs and Prometheus' targets
SEVERITY = {v.PASS: 0, v.WARN: 1, v.FAIL: 2}
BOOTING = "CONFIGURING"  # a job's state flag while its nodes boot
POWERED_OFF = frozenset({"POWERED_DOWN", "POWERING_DOWN"})  # a node that a job must boot (again)
NOT_UP = POWERED_OFF | {"POWER_DOWN", "POWERING_UP", "DOWN"}  # a node whose exporter Prometheus cannot reach
PER_NODE = (v.GPUS, v.NEURON_DEVICES, v.EFA_DEVICES, v.ECC_UNCORRECTED, v.DCGM_DIAG, v.FSX_MOUNTED, v.NCCL_EFA_PLUGIN,
            v.METADATA_REFUSED, v.NAMES_RESOLVE)
SUMMED = (v.FSX_WRITE_MBPS, v.FSX_READ_MBPS)  # the nodes write and read at once: /fsx carried the sum
ACROSS = (v.NCCL_ALL_REDUCE_BUSBW_GBPS, v.NCCL_TRANSPORT)  # one all_reduce_perf run over the job's nodes


class RunError(Exception):
    """The run cannot go on (a plan that says no node count, sbatch refusing a job): one line for the operator."""


# --- what each pool's jobs do ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PoolPlan:
    """One pool's checks and what its jobs must do for them."""

    pool: str
    checks: tuple[v.Check, ...]
    nodes: int  # names_resolve's {"nodes": N}: the job's node count
    dcgm_level: int | None  # dcgm_diag's level; None: no DCGM diagnostic (not an NVIDIA pool)
    all_reduce_bytes: int | None  # the sweep's largest size; None: no all_reduce check
    gpus_per_node: int  # all_reduce_perf's tasks per node (one per GPU)
    start_seconds: float | None  # scale_from_zero_seconds' max; None: the nodes are always on


def pool_plans(checks: list[v.Check]) -> list[PoolPlan]:
    """The plan's pools (not the cluster's checks) in its order, each with what its jobs need to know."""
    plans = []
    for pool in dict.fromkeys(c.pool for c in checks if c.pool != v.CLUSTER):
        mine = {c.check: c for c in checks if c.pool == pool}
        names = mine.get(v.NAMES_RESOLVE)
        if names is None or not isinstance(names.expect.get("nodes"), int):
            raise RunError(f"the plan gives pool {pool} no node count ({v.NAMES_RESOLVE}'s expect.nodes)")
        dcgm = mine.get(v.DCGM_DIAG)
        busbw = mine.get(v.NCCL_ALL_REDUCE_BUSBW_GBPS)
        gpus = mine.get(v.GPUS)
        scale = mine.get(v.SCALE_FROM_ZERO_SECONDS)
        plans.append(PoolPlan(
            pool=pool, checks=tuple(c for c in checks if c.pool == pool), nodes=int(names.expect["nodes"]),
            dcgm_level=int(dcgm.expect.get("level", v.DCGM_LEVEL)) if dcgm else None,
            all_reduce_bytes=int(busbw.expect.get("bytes", v.DEFAULT_ALL_REDUCE_BYTES)) if busbw else None,
            gpus_per_node=int(gpus.expect.get("count", 1)) if gpus else 1,
            start_seconds=float(scale.expect["max"]) if scale and "max" in scale.expect else None))
    return plans


@dataclass(frozen=True)
class ProbeOptions:
    """What the probe is told besides the defaults: --fsx-mib and --fsx-type (verify_probe.Sources.fsx_type says why
    a run would name another file system type: the boot rehearsal's /fsx)."""

    fsx_mib: int | None = None
    fsx_type: str | None = None

    def args(self) -> list[str]:
        return ([f"--fsx-mib={self.fsx_mib}"] if self.fsx_mib else []) + (
            [f"--fsx-type={self.fsx_type}"] if self.fsx_type else [])


def _per_node(command: list[str], output: str) -> str:
    """srun running `command` once per node, its stdout to <output>-<node>.json, its stderr beside it (.err)."""
    inner = f"exec {shlex.join(command)} > {output}-$SLURMD_NODENAME.json 2> {output}-$SLURMD_NODENAME.err"
    return f"srun --ntasks-per-node=1 /bin/sh -c {shlex.quote(inner)}"


# all_reduce_perf as the catalog's published figures were measured: aws-samples/awsome-distributed-training
# micro-benchmarks/nccl-tests (commit 0162aac) slurm/nccl-tests.sbatch and slurm/nccl-tests-ami.sbatch: `-b 8 -e
# <size> -f 2 -g 1 -c 1 -n 100` (one process per GPU, results checked, 100 timed iterations per size) with
# NCCL_BUFFSIZE and NCCL_P2P_NET_CHUNKSIZE so set, ranks unbound (srun --cpu-bind=none; the AMI script's mpirun
# --bind-to none: a task bound to one core would starve NCCL's proxy threads; aws-ofi-nccl's wiki, "CPU Binding").
# PMIX_MCA_gds=hash: the same repository's nccl-tests.Dockerfile sets it ("Turn off PMIx Error",
# open-mpi/ompi#7516): Slurm's PMIx plugin (built against the distribution's OpenPMIx) and the EFA installer's Open
# MPI (its own PMIx) must not pick a shared-memory data store the other cannot read.
ALL_REDUCE_ARGS = ("-b", "8", "-f", "2", "-g", "1", "-c", "1", "-n", "100")
ALL_REDUCE_ENV = {"NCCL_DEBUG": "INFO", "NCCL_BUFFSIZE": "8388608", "NCCL_P2P_NET_CHUNKSIZE": "524288",
                  "PMIX_MCA_gds": "hash"}


def job_script(plan: PoolPlan, run_dir: str, fsx_lock: str, options: ProbeOptions = ProbeOptions()) -> str:
    """The user's batch job: its start time first, the probe on every node (holding `fsx_lock`, which every pool's
    job of the run shares: FSX_LOCK), then all_reduce_perf across them as the published figures were measured
    (ALL_REDUCE_ARGS, ALL_REDUCE_ENV; srun --mpi=pmix starts the ranks as Slurm sites do), with NCCL's INFO log,
    which names the network and the libfabric provider NCCL chose (nccl_tests.transport)."""
    where = shlex.quote(run_dir)
    probe = [PYTHON, VERIFY_PROBE_PROGRAM, "--without-dcgm", f"--fsx-dir={run_dir}", *options.args()]
    lines = ["#!/bin/bash", f"# gpucluster verify: pool {plan.pool}, {plan.nodes} node(s)",
             f"date +%s.%N > {where}/{STARTED_FILE}",
             f"flock {shlex.quote(fsx_lock)} {_per_node(probe, f'{where}/probe')}"]
    if plan.all_reduce_bytes is not None:
        lines += ["export " + " ".join(f"{name}={value}" for name, value in ALL_REDUCE_ENV.items()),
                  f"srun --mpi=pmix --cpu-bind=none --ntasks-per-node={plan.gpus_per_node} {ALL_REDUCE_PERF} "
                  f"{' '.join(ALL_REDUCE_ARGS)} -e {plan.all_reduce_bytes} > {where}/{ALL_REDUCE_OUT} 2>&1"]
    return "\n".join(lines) + "\n"


def dcgm_script(plan: PoolPlan, run_dir: str) -> str:
    """Root's job on the user job's nodes: DCGM's diagnostic at the plan's level on each."""
    level = ["--deep"] if plan.dcgm_level == v.DCGM_DEEP_LEVEL else []
    return "\n".join(["#!/bin/bash", f"# gpucluster verify: DCGM diagnostic, pool {plan.pool}",
                      _per_node([PYTHON, VERIFY_PROBE_PROGRAM, "--dcgm-only", *level], f"{shlex.quote(run_dir)}/dcgm")
                      ]) + "\n"


def sbatch_args(plan: PoolPlan, run_dir: str, minutes: int, nodelist: str = "", after: str = "") -> list[str]:
    """The pool's nodes only: its partition, and each of its nodes carries the pool's name as a feature (slurm.conf).
    `nodelist`: exactly those nodes (root's DCGM job on the user job's), once job `after` has ended."""
    who = "dcgm" if nodelist else "job"
    return ["sbatch", "--parsable", f"--job-name=gpucluster-verify-{plan.pool}", f"--partition={plan.pool}",
            f"--constraint={plan.pool}", f"--nodes={plan.nodes}", "--exclusive", f"--time={minutes}",
            f"--output={run_dir}/{who}.out", f"--chdir={run_dir}",
            *([f"--nodelist={nodelist}", f"--account={SLURM_ROOT_ACCOUNT}"] if nodelist else []),
            *([f"--dependency=afterany:{after}"] if after else [])]


# --- Slurm ----------------------------------------------------------------------------------------------------------
class Slurm(SlurmControl):
    """Slurm's controller (SlurmControl's scontrol, its timeout and its logged errors), and sbatch and scancel as the
    run calls them; `user` submits the measuring jobs (runuser when the run is root's and the user is another)."""

    def __init__(self, user: str):
        super().__init__()
        self.user = user

    def submit(self, args: list[str], script: str, as_user: bool) -> str:
        runas = ["runuser", "-u", self.user, "--"] if as_user and os.geteuid() == 0 and self.user != "root" else []
        done = subprocess.run([*runas, *args], input=script, capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise RunError(f"{' '.join(args[:1] + args[2:5])}: {done.stderr.strip() or done.stdout.strip()}")
        return done.stdout.strip().split(";")[0]

    def jobs(self) -> dict[str, slurm_json.Job]:
        return {job.job_id: job for job in slurm_json.jobs(self._run(*slurm_json.SHOW_JOBS))}

    def cancel(self, job: str) -> None:
        subprocess.run(["scancel", job], capture_output=True, timeout=60)  # a job that ended meanwhile: nothing to do

    def node_states(self) -> dict[str, frozenset[str]]:
        return {node.name: node.state for node in self.nodes()}


@dataclass
class Tracked:
    """A job the run waits for: Slurm has `queue_seconds` from its submission to give it nodes, the nodes
    `boot_seconds` from then to start it, the job `run_seconds` from its start to end."""

    job_id: str
    submitted: float
    queue_seconds: float
    boot_seconds: float
    run_seconds: float
    waited_until: float = 0.0  # the last look that found it waiting for nodes (its submission when none did)
    nodes: tuple[str, ...] = ()
    started: bool = False
    started_at: float = 0.0
    ended: bool = False
    why: str = ""  # what kept its measurements from being taken ("" when it ran to its end)
    held: str = ""  # Slurm's reason, when it was cancelled still waiting for nodes

    def __post_init__(self) -> None:
        self.waited_until = self.waited_until or self.submitted


def wait(slurm: Slurm, tracked: list[Tracked], clock: Callable[[], float] = time.time,
         pause: Callable[[float], None] = time.sleep, on_start: Callable[[Tracked], None] = lambda t: None,
         watch: Callable[[float], None] = lambda now: None) -> None:
    """Until every job has ended (`tracked` may grow: on_start may add a job): a job waiting for nodes past its
    queue_seconds, booting past its boot_seconds or running past its run_seconds is cancelled, and says why.
    `on_start` runs once for each job as it is seen started; `watch` once per look."""
    while not all(t.ended for t in tracked):
        jobs = slurm.jobs()
        now = clock()
        for t in [t for t in tracked if not t.ended]:
            job = jobs.get(t.job_id)
            if job is not None and job.pending:
                t.waited_until = now
                if now - t.submitted > t.queue_seconds:
                    slurm.cancel(t.job_id)
                    t.held = job.reason or "none given"
                    t.ended, t.why = True, (f"job {t.job_id} waited {now - t.submitted:.0f} s for nodes (Slurm's "
                                            f"reason: {t.held}); cancelled")
                continue
            # CONFIGURING: Slurm gave it nodes that are still booting (or running the Prolog).
            if job is not None and BOOTING in job.state:
                if now - t.waited_until > t.boot_seconds:
                    slurm.cancel(t.job_id)
                    t.ended, t.why = True, (f"job {t.job_id}'s nodes were still booting {now - t.waited_until:.0f} s "
                                            "after Slurm gave them to it; cancelled")
                continue
            if job is not None and job.active:
                if not t.started:
                    t.started, t.nodes, t.started_at = True, job.nodes, now
                    on_start(t)
                elif now > t.started_at + t.run_seconds:
                    slurm.cancel(t.job_id)
                    t.ended, t.why = True, f"job {t.job_id} ran out of its {t.run_seconds:.0f} s; cancelled"
                continue
            # Ended (or gone from Slurm's memory): what it wrote is what there is.
            t.ended = True
            if job is not None and not t.started:
                t.nodes = job.nodes
            if job is not None and "COMPLETED" not in job.state:
                t.why = f"job {t.job_id} ended {'+'.join(sorted(job.state))} ({job.reason or 'no reason given'})"
        watch(now)
        if not all(t.ended for t in tracked):
            pause(POLL_SECONDS)


# --- reading and judging -----------------------------------------------------------------------------------------
def read_json(path: Path) -> tuple[dict[str, Any] | None, str]:
    """A probe's JSON, or None and why not (its stderr's last line when it left one)."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        err = path.with_suffix(".err")
        said = err.read_text().strip().splitlines()[-1:] if err.exists() else []
        return None, f"no reading in {path}" + (f": {said[0]}" if said else f" ({type(exc).__name__})")
    return (doc, "") if isinstance(doc, dict) else (None, f"{path} holds no JSON object")


@dataclass
class PoolReadings:
    """What a pool's jobs left: each node's readings, the across-nodes ones, the start delay and Prometheus' count."""

    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    across: dict[str, Any] = field(default_factory=dict)
    scale_seconds: float | None = None
    scale_warning: str = ""  # why the scale-up was not measured though the job ran (its nodes were already up)
    scraped: int | None = None
    missing: str = ""  # why a reading is absent: the job's fate
    queue_seconds: float | None = None  # from the user job's submission to Slurm giving it nodes
    dcgm_busy: str = ""  # root's DCGM job never got the nodes because other work or a limit held them: why


def _named(node: str, result: v.Result) -> v.Result:
    if result.result != v.FAIL:
        return result
    return v.Result(result.pool, result.check, result.expect, result.measured, result.result, f"{node}: {result.fix}")


def _absent(why: str) -> dict[str, str]:
    return {"error": why or "not measured"}


def judge_pool(plan: PoolPlan, readings: PoolReadings) -> list[v.Result]:
    """Every check of the pool judged on what its jobs measured."""
    results = []
    queued: v.Details = {v.QUEUE_SECONDS_KEY: readings.queue_seconds} if readings.queue_seconds is not None else {}
    for check in plan.checks:
        if check.check == v.SCALE_FROM_ZERO_SECONDS and readings.scale_warning:
            results.append(v.Result(check.pool, check.check, check.expect, None, v.WARN, readings.scale_warning,
                                    queued))
        elif check.check == v.SCALE_FROM_ZERO_SECONDS:
            results.append(replace(v.judge_reading(check, readings.scale_seconds if readings.scale_seconds is not None
                                                   else _absent(readings.missing)), details=queued))
        elif check.check == v.DCGM_DIAG and readings.dcgm_busy:
            results.append(v.Result(check.pool, check.check, check.expect, None, v.WARN, readings.dcgm_busy))
        elif check.check == v.PROMETHEUS_SCRAPES:
            results.append(v.judge_reading(check, readings.scraped if readings.scraped is not None
                                           else _absent(readings.missing)))
        elif check.check in ACROSS:
            results.append(v.judge_reading(check, readings.across.get(check.check, _absent(readings.missing))))
        elif check.check in SUMMED:
            results.append(summed(check, readings))
        else:
            results.append(worst_node(check, readings))
    return results


# Slurm's reasons for a job that waits on other work or on the team's own limits (squeue(1), JOB REASON CODES): the pool
# is busy, not broken. Any other reason (a partition down, nodes unavailable, a constraint no node has) is a fault.
BUSY_REASONS = ("Resources", "Priority")
LIMIT_PREFIXES = ("QOS", "Assoc")


def busy_note(job: Tracked) -> str:
    """Why a job Slurm never gave nodes measured nothing, when that is the pool's being busy or the team's being at a
    limit (a warning); "" when it was not held so (it ran, or its reason is a fault)."""
    if job.held and (job.held in BUSY_REASONS or job.held.startswith(LIMIT_PREFIXES)):
        return (f"not measured: {job.why}: the pool's nodes are busy or the team is at a Slurm limit "
                "(`squeue`, `sshare`); verify it again when it has idle nodes")
    return ""


def held_results(plan: PoolPlan, job: Tracked) -> list[v.Result]:
    """A pool whose job Slurm never gave nodes: every check warns with Slurm's reason when the pool is busy or the team
    at a limit (nothing was measured, nothing is known broken), and fails with it otherwise."""
    if note := busy_note(job):
        return [v.Result(c.pool, c.check, c.expect, None, v.WARN, note) for c in plan.checks]
    return [v.judge_reading(c, _absent(job.why)) for c in plan.checks]


def worst_node(check: v.Check, readings: PoolReadings) -> v.Result:
    """A per-node check's pool result: its worst node's, the node named in a failure's fix."""
    if not readings.nodes:
        return v.judge_reading(check, _absent(readings.missing))
    results = [_named(node, v.judge_reading(check, measured.get(check.check, _absent(
        measured.get("(missing)", "") or f"{node} gave no {check.check} reading"))))
        for node, measured in sorted(readings.nodes.items())]
    return max(results, key=lambda r: SEVERITY[r.result])  # the first of the worst


def summed(check: v.Check, readings: PoolReadings) -> v.Result:
    """/fsx throughput of the job's nodes together: the sum of their concurrent figures, or the first node's failure
    to measure."""
    total = 0.0
    for node, measured in sorted(readings.nodes.items()):
        value = measured.get(check.check, _absent(measured.get("(missing)", "") or f"{node} gave no reading"))
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return _named(node, v.judge_reading(check, value))
        total += value
    return v.judge_reading(check, round(total, 1) if readings.nodes else _absent(readings.missing))


def node_readings(run_dir: Path, nodes: tuple[str, ...], dcgm_why: str) -> dict[str, dict[str, Any]]:
    """node -> its probe's readings, with its DCGM diagnostic from root's job. A node without a reading file gets
    "(missing)": why, which every check of it then fails with."""
    readings: dict[str, dict[str, Any]] = {}
    for node in nodes:
        probed, why = read_json(run_dir / f"probe-{node}.json")
        readings[node] = dict(probed) if probed is not None else {"(missing)": why}
        dcgm, dcgm_missing = read_json(run_dir / f"dcgm-{node}.json")
        if dcgm is not None:
            readings[node].update(dcgm)
        elif v.DCGM_DIAG not in readings[node]:
            readings[node][v.DCGM_DIAG] = _absent(dcgm_why or dcgm_missing)
    return readings


def across_readings(run_dir: Path, why: str) -> dict[str, Any]:
    path = run_dir / ALL_REDUCE_OUT
    if not path.exists():
        return {name: _absent(why or f"all_reduce_perf left no output ({path})") for name in ACROSS}
    return nccl_tests.measurements(path.read_text(errors="replace"))


# --- Prometheus and the cluster's checks ---------------------------------------------------------------------------
def scraped_nodes(targets: dict[str, Any], nodes: tuple[str, ...]) -> int:
    """How many of the nodes Prometheus scrapes with success: their node exporter's target is up."""
    up = {t.get("labels", {}).get("node") for t in targets.get("activeTargets", [])
          if t.get("labels", {}).get("job") == NODE_JOB.name and t.get("health") == "up"}
    return len(up & set(nodes))


def gpu_idle_loaded(rules: dict[str, Any]) -> bool:
    return any(rule.get("name") == v.GPU_IDLE_ALERT for group in rules.get("groups", [])
               for rule in group.get("rules", []))


def budget_topic(settings: ClusterSettings) -> dict[str, Any]:
    """The stack's topic, as the head's role sees it (GetTopicAttributes)."""
    if not settings.alerts_topic_arn:
        return {"error": "the settings name no alerts topic (alerts_topic_arn)"}
    try:
        import boto3

        boto3.client("sns", region_name=settings.region).get_topic_attributes(TopicArn=settings.alerts_topic_arn)
    except Exception as exc:  # any failure to reach it is the finding: its text says which
        return {"error": f"{settings.alerts_topic_arn}: {exc}"}
    return {"reachable": True}


def cluster_results(checks: list[v.Check], settings: ClusterSettings, prometheus: str) -> list[v.Result]:
    results = []
    for check in (c for c in checks if c.pool == v.CLUSTER):
        if check.check == v.BUDGET_TOPIC:
            reading: Any = budget_topic(settings)
        elif check.check == v.GPU_IDLE_RULE:
            try:
                reading = {"loaded": gpu_idle_loaded(prometheus_get(prometheus, "rules"))}
            except (OSError, ValueError, KeyError) as exc:
                reading = {"error": f"Prometheus' rules ({prometheus}): {exc}"}
        else:
            reading = {"error": f"a verify run measures no {check.check} of the cluster"}
        results.append(v.judge_reading(check, reading))
    return results


# --- the run ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Setup:
    """Where the run reads and writes: production's by default."""

    settings: ClusterSettings
    user: str = LOGIN_USER
    verify_dir: Path = Path(VERIFY_DIR)
    textfile: Path = Path(VERIFY_TEXTFILE)
    prometheus: str = f"http://127.0.0.1:{PROMETHEUS_PORT}"
    probe: ProbeOptions = ProbeOptions()


def run_name(started: float, pools: list[str]) -> str:
    """A run's file name (without .json): its UTC start, sortable, and its pools."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(started)) + "-" + "+".join(pools or [v.CLUSTER.strip("()")])


def run_time(path: Path) -> float:
    return float(calendar.timegm(time.strptime(path.name.split("-", 1)[0], "%Y%m%dT%H%M%SZ")))


def measure(checks: list[v.Check], setup: Setup, slurm: Slurm, clock: Callable[[], float] = time.time,
            pause: Callable[[float], None] = time.sleep) -> tuple[str, list[v.Result]]:
    """Runs the jobs, judges every check; returns the run's name and its results."""
    plans = pool_plans(checks)
    by_pool = {p.pool: p for p in plans}
    started = clock()
    name = run_name(started, [p.pool for p in plans])
    owner = pwd.getpwnam(setup.user)
    root_dir = setup.verify_dir / name
    dirs = {p.pool: root_dir / p.pool for p in plans}
    fsx_lock = str(root_dir / FSX_LOCK)  # the user's jobs create it in the run's directory, theirs
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
        for path in (d, d.parent):
            os.chown(path, owner.pw_uid, owner.pw_gid)

    # Which nodes a job must boot: those powered off now (a job given only up nodes scales nothing).
    powered_off = {node for node, state in slurm.node_states().items() if state & POWERED_OFF}
    user_jobs: dict[str, Tracked] = {}
    for plan in plans:
        submitted = clock()
        job = slurm.submit(sbatch_args(plan, str(dirs[plan.pool]), JOB_SECONDS // 60),
                           job_script(plan, str(dirs[plan.pool]), fsx_lock, setup.probe), as_user=True)
        # Always-on nodes start it at once; they get the job's time to boot should something else hold them.
        boot = plan.start_seconds if plan.start_seconds is not None else JOB_SECONDS
        user_jobs[plan.pool] = Tracked(job, submitted, QUEUE_SECONDS, boot, JOB_SECONDS)
    tracked = list(user_jobs.values())
    dcgm_jobs: dict[str, Tracked] = {}
    scrapes = Scrapes(setup.prometheus, plans)

    def dcgm_after(user_job: Tracked) -> None:
        """Root's DCGM job on the user job's nodes, queued behind it: it holds them from the user job's end on."""
        pool = next((pool for pool, t in user_jobs.items() if t is user_job), None)
        if pool is None:
            return  # root's DCGM job itself starting
        plan = by_pool[pool]
        scrapes.start(pool, user_job.nodes, clock())
        if plan.dcgm_level is None or not user_job.nodes:
            return
        seconds = v.dcgm_job_seconds(plan.dcgm_level)
        try:
            job = slurm.submit(sbatch_args(plan, str(dirs[pool]), -(-seconds // 60), ",".join(user_job.nodes),
                                           after=user_job.job_id), dcgm_script(plan, str(dirs[pool])), as_user=False)
        except RunError as exc:  # only the diagnostic is lost (root with no Slurm association, say)
            dcgm_jobs[pool] = Tracked("", clock(), 0.0, 0.0, 0.0, ended=True,
                                      why=f"root's DCGM job was refused: {exc}")
            return
        # It waits for the user's job (at most JOB_SECONDS), then gets nodes that are up and idle.
        dcgm_jobs[pool] = Tracked(job, clock(), JOB_SECONDS + DCGM_START_SECONDS, DCGM_START_SECONDS, seconds)
        tracked.append(dcgm_jobs[pool])

    def held_by_the_run() -> set[str]:
        return {node for t in tracked if t.started and not t.ended for node in t.nodes}

    wait(slurm, tracked, clock, pause, on_start=dcgm_after,
         watch=lambda now: scrapes.look(now, held_by_the_run(), slurm))
    while scrapes.waiting(clock()):  # the jobs ended first: asked while Slurm says the nodes are still up
        scrapes.look(clock(), set(), slurm)
        if scrapes.waiting(clock()):
            pause(POLL_SECONDS)

    results: list[v.Result] = []
    for plan in plans:
        user_job, d = user_jobs[plan.pool], dirs[plan.pool]
        if user_job.held:
            results += held_results(plan, user_job)
            continue
        readings = PoolReadings(missing=user_job.why, scraped=scrapes.counts.get(plan.pool))
        dcgm_job = dcgm_jobs.get(plan.pool)
        readings.dcgm_busy = busy_note(dcgm_job) if dcgm_job is not None else ""
        if user_job.started:
            readings.queue_seconds = round(user_job.waited_until - user_job.submitted, 1)
            readings.nodes = node_readings(d, user_job.nodes, dcgm_jobs[plan.pool].why if plan.pool in dcgm_jobs
                                           else "")
            readings.across = across_readings(d, user_job.why)
            if plan.start_seconds is not None and not set(user_job.nodes) & powered_off:
                readings.scale_warning = ("not measured: the pool's nodes were already up when the run submitted "
                                          "its job; verify again once they have powered down (SuspendTime idle)")
            try:
                readings.scale_seconds = round(float((d / STARTED_FILE).read_text()) - user_job.waited_until, 1)
            except (OSError, ValueError):
                readings.missing = readings.missing or f"the job wrote no start time ({d / STARTED_FILE})"
        results += judge_pool(plan, readings)
    results += cluster_results(checks, setup.settings, setup.prometheus)
    return name, results


class Scrapes:
    """How many of each pool's job's nodes the head's Prometheus scrapes (their node exporter's target up), for
    pools whose plan asks; asked only while the nodes are up, from the user job's start for PROMETHEUS_SECONDS or
    until it scrapes them all. The count kept is the highest seen: a node that powered off later was scraped."""

    def __init__(self, base: str, plans: list[PoolPlan]):
        self.base = base
        self.asked = {p.pool for p in plans if any(c.check == v.PROMETHEUS_SCRAPES for c in p.checks)}
        self.nodes: dict[str, tuple[str, ...]] = {}
        self.until: dict[str, float] = {}
        self.counts: dict[str, int] = {}

    def start(self, pool: str, nodes: tuple[str, ...], now: float) -> None:
        if pool in self.asked:
            self.nodes[pool], self.until[pool], self.counts[pool] = nodes, now + PROMETHEUS_SECONDS, 0

    def waiting(self, now: float) -> list[str]:
        return [pool for pool, nodes in self.nodes.items()
                if self.counts[pool] < len(nodes) and now <= self.until[pool]]

    def look(self, now: float, held: set[str], slurm: Slurm) -> None:
        """One look for the waiting pools whose nodes are all up: held by a job of the run, or so in Slurm's eyes."""
        pools = self.waiting(now)
        if not pools:
            return
        if not all(set(self.nodes[pool]) <= held for pool in pools):
            states = slurm.node_states()
            held = held | {node for node, state in states.items() if not state & NOT_UP}
            for pool in [pool for pool in pools if not set(self.nodes[pool]) <= held]:
                self.until[pool] = 0.0  # powered off (or going): Prometheus can no longer scrape it
            pools = [pool for pool in pools if set(self.nodes[pool]) <= held]
        if not pools:
            return
        try:
            targets = prometheus_get(self.base, "targets?state=active")
        except (OSError, ValueError, KeyError):
            return
        for pool in pools:
            self.counts[pool] = max(self.counts[pool], scraped_nodes(targets, self.nodes[pool]))


# --- what the run leaves -----------------------------------------------------------------------------------------
def keep(setup: Setup, name: str, results: list[v.Result]) -> Path:
    """The run document (root's, 0644) and the board's metrics, from every run kept."""
    setup.verify_dir.mkdir(parents=True, exist_ok=True)
    path = setup.verify_dir / f"{name}.json"
    temporary = setup.verify_dir / f".{name}.json.tmp"
    temporary.write_text(v.run_json(results) + "\n")
    os.chmod(temporary, 0o644)
    os.replace(temporary, path)
    textfile.write(board(setup.verify_dir), setup.textfile.parent, setup.textfile.name)
    return path


def run_files(verify_dir: Path) -> list[Path]:
    """The kept runs, oldest first (their names start with their UTC time)."""
    return sorted(p for p in verify_dir.glob("*.json") if p.name[:1].isdigit()) if verify_dir.is_dir() else []


def board(verify_dir: Path) -> str:
    """Each pool's last result per check and when that run was, from the newest run that verified the pool."""
    last: dict[str, tuple[float, list[v.Result]]] = {}
    for path in run_files(verify_dir):
        try:
            results = v.run_from_json(path.read_text())
        except (OSError, ValueError):
            continue  # a damaged file is no pool's last result
        for pool in {r.pool for r in results}:
            last[pool] = (run_time(path), [r for r in results if r.pool == pool])
    results_samples = [textfile.sample(v.RESULT_METRIC, v.RESULT_CODES[r.result], pool=pool, check=r.check)
                       for pool, (_, rs) in sorted(last.items()) for r in rs]
    time_samples = [textfile.sample(v.RUN_TIME_METRIC, when, pool=pool) for pool, (when, _) in sorted(last.items())]
    codes = ", ".join(f"{code} {word}" for word, code in v.RESULT_CODES.items())
    return (textfile.family(v.RESULT_METRIC, "gauge", f"gpucluster verify's last result per pool and check ({codes})",
                            results_samples)
            + textfile.family(v.RUN_TIME_METRIC, "gauge", "when the pool's last verify run was (Unix time)",
                              time_samples))


def exit_status(results: list[v.Result]) -> int:
    return 1 if any(r.result == v.FAIL for r in results) else 0


def print_results(results: list[v.Result], as_json: bool, where: Path | None = None) -> None:
    if as_json:
        print(v.run_json(results))
        return
    print("\n".join(v.run_table(results)))
    if where is not None:
        print(f"\n{where}")


def run(checks: list[v.Check], as_json: bool, setup: Setup) -> int:
    """The whole run: measure, keep, print. Exit 0 when nothing failed, 1 otherwise."""
    try:
        name, results = measure(checks, setup, Slurm(setup.user))
    except (RunError, v.VerifyFormatError, KeyError, subprocess.SubprocessError) as exc:
        print(f"verify: {exc}", file=sys.stderr)
        return 1
    path = keep(setup, name, results)
    print_results(results, as_json, path)
    return exit_status(results)


def last(as_json: bool, verify_dir: Path | None = None) -> int:
    """The newest run kept (in VERIFY_DIR by default): 0 when nothing failed in it, 1 when something did, there is
    none yet or it cannot be read."""
    verify_dir = verify_dir or Path(VERIFY_DIR)
    files = run_files(verify_dir)
    if not files:
        print(f"verify: no run yet (none in {verify_dir})", file=sys.stderr)
        return 1
    try:
        results = v.run_from_json(files[-1].read_text())
    except (OSError, ValueError) as exc:  # VerifyFormatError and json's errors are ValueErrors
        print(f"verify: the latest run, {files[-1]}, cannot be read: {exc}", file=sys.stderr)
        return 1
    print_results(results, as_json, files[-1])
    return exit_status(results)
