#!/usr/bin/env python3
"""gpucluster's node programs, run by Slurm on the head node.

Installed as /opt/gpucluster/bin/gpucluster_node.py with the links `resume`, `suspend`, `resume-fail` and `reconcile`;
the name it is called by picks the command. Slurm passes a host list such as `p5-spot-[1-4]` as the only argument.

- resume: launch one EC2 instance per node with CreateFleet (type instant) from the pool's launch template, grouped by
  job (SLURM_RESUME_FILE, Slurm 23.02 and later): a multi-node job gets all its nodes in one request or none, and one
  job's shortage does not fail another's nodes. The registry records which instance is which node the moment EC2
  answers; Slurm gets each node's instance id, and the instance learns its node name from Slurm by that id (no
  per-instance API call, no DescribeInstances). Nodes that EC2 cannot launch are set DOWN with the AWS reason, so Slurm requeues the job and
  schedules it where it can run (a fallback pool).
- suspend: terminate the instances of the listed nodes.
- resume-fail: a launched node that never registered: terminate it and set it DOWN with the reason.
- reconcile (timer): classify every node (its Slurm state and its instance) and every unowned instance into a status,
  then act per status: power up always-on nodes, set DOWN nodes whose instance vanished, return nodes DOWN for a passing
  cause to service with backoff, replace the instance of a node drained for it once idle, terminate instances nothing
  owns once their launch grace is over.
- interruptions (service): EC2's spot interruption warnings and rebalance recommendations from the stack's queue:
  drain the node, signal its jobs to checkpoint and requeue them (see Interruptions).

Needs only the standard library and boto3. Every action is logged to the log file and to stderr (the journal).
"""

from __future__ import annotations

import enum
import fcntl
import json
import logging
import os
import re
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

# The bundle carries the library beside this program (lib/); the settings contract is in it (standard library only).
sys.path.insert(0, str(Path(__file__).resolve().parent / "lib"))
from gpucluster.contract.hostlist import compress_hostlist, expand_hostlist  # noqa: E402
from gpucluster.contract.scontrol import job_records, node_records, state_flags  # noqa: E402
from gpucluster.contract.settings import (  # noqa: E402
    CLUSTER_TAG, POOL_TAG, REPLACE_REASON, SETTINGS_FILE, SLURM_USER, ClusterSettings, PoolSettings,
)

REASON_PREFIX = "gpucluster:"
CAPACITY_PREFIX = f"{REASON_PREFIX} capacity"
# Reasons that a retry cannot cure: the node stays DOWN until someone fixes the stack.
CONFIGURATION_PREFIX = f"{REASON_PREFIX} configuration"
# Drained by the cluster for a new instance: the reconciler terminates the node's instance once it is idle (or gone)
# and returns the node to service. Spot interruption warnings and rebalance recommendations use it.
REPLACE_PREFIX = REPLACE_REASON
SPOT_WARNING = "EC2 Spot Instance Interruption Warning"
REBALANCE = "EC2 Instance Rebalance Recommendation"
SCONTROL_BATCH = 200  # nodes per scontrol update
# A hung slurmctld must not hang the program: Slurm kills a ResumeProgram only after ResumeTimeout, with nodes half set.
SCONTROL_TIMEOUT = 60
DESCRIBE_BATCH = 200  # instance ids per DescribeInstances filter (EC2 takes at most 200 values per filter)
TERMINATE_BATCH = 1000  # instance ids per TerminateInstances
MAX_RETRY_SECONDS = 3600  # the backoff of a node that keeps failing stops doubling here
# EC2 answers that mean "not now, try elsewhere or later" rather than "this request is wrong".
CAPACITY_ERRORS = {
    "InsufficientInstanceCapacity", "InsufficientCapacityOnHost", "UnfulfillableCapacity", "InsufficientHostCapacity",
    "MaxSpotInstanceCountExceeded", "SpotMaxPriceTooLow", "VcpuLimitExceeded", "InstanceLimitExceeded",
    "ReservationCapacityExceeded", "InsufficientReservedInstanceCapacity",
}
# EC2 answers that say the request itself is wrong (a template, subnet or instance type the stack names): retrying
# cannot help. UnauthorizedOperation is not among them: the budget's deny action causes it, and reopening lifts it.
CONFIGURATION_ERRORS = re.compile(r"^(Invalid|MissingParameter|Unsupported|OptInRequired)")
# A new account has no spot service-linked role until someone allowed to (iam:CreateServiceLinkedRole) makes it; the
# head role may not, so EC2 refuses every spot launch. The DOWN reason carries the fix (sinfo -R shows it); the
# reconciler retries with backoff, so the nodes come back once the role exists.
SPOT_ROLE_ERROR = "AuthFailure.ServiceLinkedRoleCreationNotPermitted"
SPOT_ROLE_FIX = "aws iam create-service-linked-role --aws-service-name spot.amazonaws.com"

log = logging.getLogger("gpucluster-node")


class Slurm:
    """The few scontrol calls the programs make."""

    def __init__(self, scontrol: str = "scontrol"):
        self.scontrol = scontrol

    def _run(self, *args: str) -> str:
        try:
            return subprocess.run([self.scontrol, *args], check=True, capture_output=True, text=True,
                                  timeout=SCONTROL_TIMEOUT).stdout
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            # The exception's text has neither scontrol's stderr nor the nodes; stderr is what says why.
            log.error("%s; stderr: %s", exc, _text(exc.stderr).strip() or "(none)")
            raise

    def _update(self, nodes: list[str], *settings: str) -> None:
        for batch in chunks(sorted(nodes), SCONTROL_BATCH):
            self._run("update", f"nodename={','.join(batch)}", *settings)

    def set_instances(self, instances: dict[str, str]) -> None:
        """Each node's instance id as its NodeHostName, many nodes per call (scontrol takes matching lists): the
        instance finds its node by it. When the node registers, Slurm sets NodeAddr and NodeHostName from it
        (cloud_reg_addrs), and back to the node name when it powers down."""
        items = sorted(instances.items())
        for i in range(0, len(items), SCONTROL_BATCH):
            names = ",".join(n for n, _ in items[i : i + SCONTROL_BATCH])
            ids = ",".join(a for _, a in items[i : i + SCONTROL_BATCH])
            self._run("update", f"nodename={names}", f"nodehostname={ids}")

    def set_down(self, nodes: list[str], reason: str) -> None:
        """DOWN with the reason: Slurm requeues the job (held for the credential lifetime, 120 s by default) and
        schedules it on nodes that are not DOWN. The reconciler returns the node to service later, unless the reason
        is a configuration error."""
        if nodes:
            self._update(nodes, "state=down", f"reason={reason[:200]}")

    def power_down(self, nodes: list[str]) -> None:
        """Back to powered-down cloud nodes (idle~), schedulable again."""
        if nodes:
            self._update(nodes, "state=power_down_force")

    def power_up(self, nodes: list[str]) -> None:
        """Slurm runs the resume program for them and counts on them from then on (always-on nodes)."""
        if nodes:
            self._update(nodes, "state=power_up")

    def nodes(self) -> list[dict[str, str]]:
        """One dict per node of `scontrol show nodes --oneliner` (keys such as NodeName, State, Reason)."""
        out = self._run("show", "nodes", "--oneliner")
        return node_records(out)

    def drain(self, nodes: list[str], reason: str) -> None:
        """No new job; running ones go on. The reconciler replaces the node once it is idle (REPLACE_PREFIX)."""
        if nodes:
            self._update(nodes, "state=drain", f"reason={reason[:200]}")

    def jobs_on(self, node: str) -> list[str]:
        """Ids of the jobs running on the node (`scontrol show node` lists none; `show jobs` does)."""
        jobs = []
        for record in job_records(self._run("show", "jobs", "--oneliner")):
            if record.get("JobState") in ("RUNNING", "COMPLETING", "CONFIGURING") and \
                    node in expand_hostlist(record.get("NodeList", "")):
                jobs.append(record["JobId"])
        return jobs

    def signal_job(self, job: str, signal_name: str) -> None:
        """To the batch step and every job step (`scancel --full`): the job's processes hear it, wherever they run."""
        scancel = str(Path(self.scontrol).with_name("scancel")) if "/" in self.scontrol else "scancel"
        subprocess.run([scancel, f"--signal={signal_name}", "--full", job], check=True, capture_output=True,
                       text=True, timeout=SCONTROL_TIMEOUT)

    def requeue(self, job: str) -> None:
        self._run("requeue", job)


def _text(data: str | bytes | None) -> str:
    # TimeoutExpired carries raw bytes even when the call asked for text.
    return data.decode(errors="replace") if isinstance(data, bytes) else data or ""


def pool_of(node: str) -> str:
    return node.rsplit("-", 1)[0]


def chunks(items: list[str], size: int) -> Iterable[list[str]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def ec2_client(config: ClusterSettings):  # type: ignore[no-untyped-def]
    import boto3
    from botocore.config import Config as BotoConfig

    # Throttling (RequestLimitExceeded) is retried with client-side rate limiting and exponential backoff.
    return boto3.client("ec2", region_name=config.region,
                        config=BotoConfig(retries={"mode": "adaptive", "max_attempts": 10}))


# --- the registry: which instance is which node ---------------------------------------------------------------------

@dataclass
class RegistryState:
    """node -> {"instance": id, "launched": epoch seconds}, and node -> consecutive failed returns to service."""

    instances: dict[str, dict[str, Any]] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)

    def owner(self) -> dict[str, str]:
        """instance id -> node."""
        return {entry["instance"]: node for node, entry in self.instances.items()}


@contextmanager
def registry(config: ClusterSettings, write: bool = True) -> Iterator[RegistryState]:
    """Read, change and write the registry under its lock (resume, suspend and the reconciler run side by side).
    Written by rename, so a crash leaves the old file or the new one, never half of one."""
    path = Path(config.registry_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        raw = json.loads(path.read_text()) if path.exists() else {}
        state = RegistryState(raw.get("instances", {}), raw.get("failures", {}))
        yield state
        if write:
            temporary = path.with_suffix(".tmp")
            temporary.write_text(json.dumps({"instances": state.instances, "failures": state.failures}, sort_keys=True))
            os.replace(temporary, path)


def read_registry(config: ClusterSettings) -> RegistryState:
    with registry(config, write=False) as state:
        return state


# --- launching --------------------------------------------------------------------------------------------------------

@dataclass
class LaunchResult:
    launched: dict[str, str] = field(default_factory=dict)  # node -> instance id
    failed: dict[str, str] = field(default_factory=dict)  # node -> reason


@dataclass(frozen=True)
class LaunchGroup:
    """Nodes of one pool launched in one CreateFleet call: all of them or none when `whole` (the nodes of one
    multi-node job), as many as EC2 gives otherwise (single-node jobs packed together)."""

    pool: str
    nodes: tuple[str, ...]
    whole: bool = False
    job: str = ""


def _fleet_request(config: ClusterSettings, pool: PoolSettings, count: int, all_or_nothing: bool) -> dict[str, Any]:
    override: dict[str, Any] = {"InstanceType": pool.instance_type, "SubnetId": pool.subnet_id}
    if pool.placement_group:
        override["Placement"] = {"GroupName": pool.placement_group}
    request: dict[str, Any] = {
        "Type": "instant",
        "LaunchTemplateConfigs": [
            {"LaunchTemplateSpecification": {"LaunchTemplateId": pool.launch_template_id, "Version": "$Default"},
             "Overrides": [override]}
        ],
        "TargetCapacitySpecification": {"TotalTargetCapacity": count, "DefaultTargetCapacityType": pool.market},
        "TagSpecifications": [{"ResourceType": "instance", "Tags": [{"Key": CLUSTER_TAG, "Value": config.cluster}]}],
    }
    # MinTargetCapacity makes EC2 launch the whole request or nothing; it needs one type in one AZ.
    whole = {"MinTargetCapacity": count, "SingleInstanceType": True, "SingleAvailabilityZone": True} \
        if all_or_nothing else {}
    if pool.market == "spot":
        request["SpotOptions"] = {"AllocationStrategy": "price-capacity-optimized", **whole}
    elif pool.market == "capacity-block":
        # The template's market type and reservation target pick the block. No AllocationStrategy (a block is one
        # instance pool; ParallelCluster and Karpenter send none) and no CapacityReservationOptions: EC2's Capacity
        # Blocks fleet tutorial says that with DefaultTargetCapacityType capacity-block they raise an exception.
        if whole:
            request["OnDemandOptions"] = whole
    else:
        request["OnDemandOptions"] = {"AllocationStrategy": "lowest-price", **whole}
    return request


def _reason(code: str, message: str) -> str:
    lowered = message.lower()
    if code == SPOT_ROLE_ERROR or ("service-linked role" in lowered and "spot" in lowered):
        # The fix first: set_down keeps 200 characters of a reason.
        return f"{REASON_PREFIX} launch failed: no spot service-linked role, run once: {SPOT_ROLE_FIX} ({code})"
    if CONFIGURATION_ERRORS.match(code):
        return f"{CONFIGURATION_PREFIX}: fix the stack and pulumi up: {code}: {message}".replace("\n", " ")
    kind = "capacity" if code in CAPACITY_ERRORS else "launch failed"
    return f"{REASON_PREFIX} {kind}: {code}: {message}".replace("\n", " ")


def launch_groups(config: ClusterSettings, nodes: list[str], jobs: dict[str, list[str]]) -> list[LaunchGroup]:
    """The CreateFleet calls for `nodes`: each multi-node job's nodes of a pool in one all-or-nothing call, whatever
    its size (a job is never split across calls); every other node packed per pool into best-effort calls of
    `batch_size`. `jobs` maps a job id to its nodes being resumed (see `job_nodes`)."""
    wanted = set(nodes)
    groups: list[LaunchGroup] = []
    loose: dict[str, list[str]] = defaultdict(list)
    placed: set[str] = set()
    for job, members in jobs.items():
        mine = [n for n in dict.fromkeys(members) if n in wanted and n not in placed]
        placed.update(mine)
        by_pool: dict[str, list[str]] = defaultdict(list)
        for n in mine:
            by_pool[pool_of(n)].append(n)
        for pool, of_pool in by_pool.items():
            if config.all_or_nothing and len(mine) > 1:
                groups.append(LaunchGroup(pool, tuple(of_pool), whole=True, job=job))
            else:
                loose[pool] += of_pool
    for n in nodes:
        if n not in placed:
            loose[pool_of(n)].append(n)
    for pool, members in loose.items():
        groups += [LaunchGroup(pool, tuple(batch)) for batch in chunks(members, config.batch_size)]
    return groups


def launch_group(config: ClusterSettings, ec2, pool: PoolSettings, group: LaunchGroup) -> LaunchResult:  # type: ignore[no-untyped-def]
    from botocore.exceptions import ClientError

    batch = list(group.nodes)
    try:
        # The token makes botocore's own retries of a timed-out call idempotent: never a second fleet for it.
        response = ec2.create_fleet(**_fleet_request(config, pool, len(batch), group.whole), ClientToken=str(uuid.uuid4()))
    except ClientError as exc:
        error = exc.response.get("Error", {})
        reason = _reason(error.get("Code", "Unknown"), error.get("Message", str(exc)))
        log.error("CreateFleet for %s failed: %s", compress_hostlist(batch), reason)
        return LaunchResult(failed={n: reason for n in batch})
    ids = [i for fleet in response.get("Instances", []) for i in fleet.get("InstanceIds", [])]
    if len(ids) < len(batch) and group.whole and ids:
        log.warning("pool %s: %d of %d instances launched, all-or-nothing: terminating them", pool.name, len(ids),
                    len(batch))
        terminate(ec2, ids)
        ids = []
    result = LaunchResult(launched=dict(zip(batch, ids)))
    if len(ids) < len(batch):
        errors = response.get("Errors", [])
        first = errors[0] if errors else {"ErrorCode": "UnfulfillableCapacity", "ErrorMessage": "no instance launched"}
        reason = _reason(first.get("ErrorCode", "Unknown"), first.get("ErrorMessage", ""))
        log.error("pool %s: %s", pool.name, reason)
        result.failed = {n: reason for n in batch[len(ids):]}
    return result


def job_nodes(config: ClusterSettings, nodes: list[str], resume_file: str | None) -> dict[str, list[str]]:
    """Job id -> its nodes being resumed, from SLURM_RESUME_FILE (Slurm 23.02 and later). Slurm 22.05 writes none: the
    call's nodes then count as one job when all-or-nothing holds, since no one can tell them apart."""
    if resume_file and Path(resume_file).exists():
        doc = json.loads(Path(resume_file).read_text())
        # Slurm writes null for a field without a value; a manual power_up has no job at all.
        return {str(job["job_id"]): expand_hostlist(job.get("nodes_resume") or "") for job in doc.get("jobs") or []}
    return {"(this call)": nodes} if config.all_or_nothing else {}


def live_instances(ec2, ids: Iterable[str]) -> dict[str, dict[str, Any]]:  # type: ignore[no-untyped-def]
    """The pending or running ones among `ids`: id -> DescribeInstances' record. EC2 keeps terminated instances
    visible for a while; an id it no longer knows at all is simply not live."""
    from botocore.exceptions import ClientError

    found: dict[str, dict[str, Any]] = {}
    for batch in chunks(sorted(set(ids)), DESCRIBE_BATCH):
        try:
            pages = ec2.get_paginator("describe_instances").paginate(Filters=[
                {"Name": "instance-id", "Values": batch}, {"Name": "instance-state-name", "Values": ["pending", "running"]}])
            for page in pages:
                for reservation in page["Reservations"]:
                    found.update({i["InstanceId"]: i for i in reservation["Instances"]})
        except ClientError as exc:
            log.error("DescribeInstances for %d instance(s) failed: %s", len(batch), exc)
            raise
    return found


def resume(config: ClusterSettings, ec2, slurm: Slurm, hostlist: str,  # type: ignore[no-untyped-def]
           resume_file: str | None = None) -> LaunchResult:
    nodes = expand_hostlist(hostlist)
    total = LaunchResult()
    # A node whose instance still lives (a resume Slurm repeats, an always-on node powered up again) keeps it.
    entries = read_registry(config).instances
    live = live_instances(ec2, [entries[n]["instance"] for n in nodes if n in entries])
    kept = {n: entries[n]["instance"] for n in nodes if n in entries and entries[n]["instance"] in live}
    if kept:
        log.info("resume %s: their instances still run, not launching others", compress_hostlist(kept))
        total.launched.update(kept)
    jobs = job_nodes(config, nodes, resume_file)
    for group in launch_groups(config, [n for n in nodes if n not in kept], jobs):
        pool = config.pools.get(group.pool)
        if pool is None:
            reason = f"{CONFIGURATION_PREFIX}: no pool {group.pool} in {SETTINGS_FILE}"
            log.error(reason)
            total.failed.update({n: reason for n in group.nodes})
            continue
        log.info("resume %s: %d node(s) of pool %s (%s)%s", compress_hostlist(group.nodes), len(group.nodes),
                 pool.name, pool.market, f", job {group.job}, all or nothing" if group.whole else "")
        result = launch_group(config, ec2, pool, group)
        _record(config, result.launched)  # before anything else can go wrong: a launched instance is never unowned
        total.launched.update(result.launched)
        total.failed.update(result.failed)
    # A job gets all its nodes or none, across pools too (a partition with a fallback pool).
    for job, members in jobs.items():
        failed = [n for n in members if n in total.failed]
        doomed = [n for n in members if n in total.launched and n not in kept] if failed and config.all_or_nothing else []
        if doomed:
            log.warning("job %s: %s failed, terminating its other node(s) %s", job, compress_hostlist(failed),
                        compress_hostlist(doomed))
            terminate(ec2, [total.launched.pop(n) for n in doomed])
            _forget(config, doomed)
            total.failed.update({n: total.failed[failed[0]] for n in doomed})
    if total.launched:
        slurm.set_instances(total.launched)
        for name, instance in sorted(total.launched.items()):
            log.info("node %s is %s", name, instance)
    for reason, down in _group(total.failed).items():
        slurm.set_down(down, reason)
    return total


def _record(config: ClusterSettings, launched: dict[str, str]) -> None:
    if launched:
        now = time.time()
        with registry(config) as state:
            state.instances.update({n: {"instance": i, "launched": now} for n, i in launched.items()})


def _forget(config: ClusterSettings, nodes: Iterable[str], seen: dict[str, str] | None = None) -> list[str]:
    """Drop the nodes from the registry; returns their instances. With `seen` (node -> instance, as a reconciler pass
    saw them), only entries still naming that instance: a resume that ran meanwhile keeps its fresh one."""
    with registry(config) as state:
        return [state.instances.pop(n)["instance"] for n in nodes
                if n in state.instances and (seen is None or state.instances[n]["instance"] == seen.get(n))]


def _group(reasons: dict[str, str]) -> dict[str, list[str]]:
    grouped: dict[str, list[str]] = defaultdict(list)
    for node, reason in reasons.items():
        grouped[reason].append(node)
    return grouped


def cluster_instances(config: ClusterSettings, ec2) -> dict[str, dict[str, Any]]:  # type: ignore[no-untyped-def]
    """Live (pending or running) instances of this cluster's pools: id -> DescribeInstances' record. The head node
    carries the cluster tag too, but no pool tag."""
    filters = [{"Name": f"tag:{CLUSTER_TAG}", "Values": [config.cluster]}, {"Name": "tag-key", "Values": [POOL_TAG]},
               {"Name": "instance-state-name", "Values": ["pending", "running"]}]
    found: dict[str, dict[str, Any]] = {}
    for page in ec2.get_paginator("describe_instances").paginate(Filters=filters):
        for reservation in page["Reservations"]:
            found.update({i["InstanceId"]: i for i in reservation["Instances"]})
    return found


def terminate(ec2, ids: list[str]) -> None:  # type: ignore[no-untyped-def]
    for batch in chunks(sorted(set(ids)), TERMINATE_BATCH):
        ec2.terminate_instances(InstanceIds=batch)


def suspend(config: ClusterSettings, ec2, slurm: Slurm, hostlist: str) -> list[str]:  # type: ignore[no-untyped-def]
    nodes = expand_hostlist(hostlist)
    ids = _forget(config, nodes)
    log.info("suspend %s: terminating %s", compress_hostlist(nodes), ",".join(ids) or "nothing")
    terminate(ec2, ids)
    return ids


def resume_fail(config: ClusterSettings, ec2, slurm: Slurm, hostlist: str) -> list[str]:  # type: ignore[no-untyped-def]
    """Nodes Slurm gave up on at ResumeTimeout. Only those the resume program launched are set DOWN with this reason:
    the others were set DOWN by it already, with EC2's reason (a configuration error's fix must stay visible)."""
    nodes = expand_hostlist(hostlist)
    with registry(config) as state:
        launched = {n: state.instances.pop(n)["instance"] for n in nodes if n in state.instances}
    log.error("resume failed for %s (never registered): terminating %s", compress_hostlist(nodes),
              ",".join(launched.values()) or "nothing")
    terminate(ec2, list(launched.values()))
    slurm.set_down(sorted(launched), f"{REASON_PREFIX} launch failed: node did not register before ResumeTimeout")
    return list(launched.values())


# --- the reconciler: classify, then act -------------------------------------------------------------------------------

class Status(enum.Enum):
    HEALTHY = "healthy"  # up with its instance, or off without one
    CHANGING = "changing"  # powering up or down: the resume and suspend programs (and ResumeTimeout) see to it
    POWER_UP = "power up"  # an always-on node that is off: Slurm is asked to power it up (the resume program runs)
    LOST = "lost"  # Slurm counts on it, its instance is gone (spot reclaim, terminated outside Slurm): set DOWN
    RETRY = "retry"  # DOWN for a passing cause and its backoff is over: terminate what is left, back to service
    BACKING_OFF = "backing off"  # DOWN for a passing cause, waiting for its next try
    NEEDS_FIX = "needs a fix"  # DOWN for a configuration error: stays DOWN, its reason says what to fix
    HELD = "held by an admin"  # DOWN or DRAIN set by a person (or drained by Slurm): left alone
    LEFTOVER = "leftover"  # Slurm has it off but its instance runs: terminate
    DRAINING = "draining for a new instance"  # drained by the cluster (REPLACE_PREFIX), jobs still on it: wait
    REPLACE = "replace"  # drained by the cluster, idle or its instance gone: new instance (back to service)


@dataclass(frozen=True)
class NodeView:
    """What the reconciler knows of one node."""

    name: str
    flags: frozenset[str]
    reason: str = ""
    reason_user: str = ""
    reason_time: float = 0.0
    always_on: bool = False
    has_instance: bool = False  # a live instance the registry gives it
    failures: int = 0  # consecutive returns to service that did not stick

    @classmethod
    def from_slurm(cls, record: dict[str, str], **known: Any) -> NodeView:
        reason = record.get("Reason", "")
        # scontrol shows `Reason=text [user@2026-11-29T15:10:00]`.
        stamp = re.search(r"\[([^@\]]+)@(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)\]$", reason)
        return cls(name=record["NodeName"], flags=frozenset(state_flags(record)), reason=reason,
                   reason_user=stamp.group(1) if stamp else "",
                   reason_time=time.mktime(time.strptime(stamp.group(2), "%Y-%m-%dT%H:%M:%S")) if stamp else 0.0,
                   **known)


def retry_delay(failures: int, base: int) -> float:
    """Seconds a node waits, DOWN, before its next return to service: the base, doubled per failure before, capped."""
    return min(base * 2 ** min(failures, 16), max(base, MAX_RETRY_SECONDS))


def classify(node: NodeView, now: float, retry_base: int) -> Status:
    """The node's status from its Slurm state and its instance: a pure function, one row per case."""
    flags = node.flags
    if "FUTURE" in flags:
        return Status.HEALTHY
    # The interruptions service drains as slurm, a node's own health check as root.
    if "DRAIN" in flags and "DOWN" not in flags and node.reason_user in (SLURM_USER, "root") and \
            node.reason.startswith(REPLACE_PREFIX):
        busy = flags & {"ALLOCATED", "MIXED", "COMPLETING"}
        return Status.DRAINING if busy and node.has_instance else Status.REPLACE
    if "DOWN" in flags or "DRAIN" in flags:
        if node.reason_user != SLURM_USER or "DOWN" not in flags:
            return Status.HELD  # an admin's hold; drained nodes finish their jobs first (health checks drain)
        if CONFIGURATION_PREFIX in node.reason:  # slurmctld appends its own reasons to one already there: "old : new"
            return Status.NEEDS_FIX
        return Status.RETRY if now - node.reason_time >= retry_delay(node.failures, retry_base) else Status.BACKING_OFF
    if flags & {"POWERING_UP", "POWERING_DOWN", "POWER_DOWN", "POWER_UP"}:  # asked for, or under way
        return Status.CHANGING
    if "POWERED_DOWN" in flags:
        if node.has_instance:
            return Status.LEFTOVER
        return Status.POWER_UP if node.always_on else Status.HEALTHY
    return Status.HEALTHY if node.has_instance else Status.LOST


def orphans(instances: dict[str, dict[str, Any]], owned: set[str], now: float, grace: int) -> list[str]:
    """Live pool instances no node owns, launched more than `grace` seconds ago."""
    return sorted(i for i, inst in instances.items() if i not in owned and now - _launch_time(inst) >= grace)


def _launch_time(instance: dict[str, Any]) -> float:
    launched = instance.get("LaunchTime")
    return launched.timestamp() if hasattr(launched, "timestamp") else time.time()


def always_on_nodes(config: ClusterSettings) -> set[str]:
    return {f"{pool.name}-{i}" for pool in config.pools.values() for i in range(1, pool.min_nodes + 1)}


def reconcile(config: ClusterSettings, ec2, slurm: Slurm, now: float | None = None) -> dict[str, list[str]]:  # type: ignore[no-untyped-def]
    """One pass of the timer. Returns what it did, by status. Each action is guarded on its own: one that fails is
    logged and the others still run."""
    now = time.time() if now is None else now
    instances = cluster_instances(config, ec2)
    state = read_registry(config)
    always_on = always_on_nodes(config)
    records = slurm.nodes()
    views = [NodeView.from_slurm(record, always_on=record["NodeName"] in always_on,
                                 has_instance=state.instances.get(record["NodeName"], {}).get("instance") in instances,
                                 failures=state.failures.get(record["NodeName"], 0))
             for record in records if pool_of(record["NodeName"]) in config.pools]
    statuses = {view.name: classify(view, now, config.capacity_retry_seconds) for view in views}
    by_status: dict[Status, list[str]] = defaultdict(list)
    for name, status in statuses.items():
        by_status[status].append(name)
    stray = orphans(instances, set(state.owner()), now, config.orphan_grace_seconds)
    # Entries for nodes Slurm no longer has (a stack that dropped them, applied by a new head): their instances are
    # nobody's, past the same grace.
    known = {record["NodeName"] for record in records}  # a pool the new settings drop may still be draining
    gone = [n for n, e in state.instances.items()
            if n not in known and now - e.get("launched", 0) >= config.orphan_grace_seconds]
    seen = {n: e["instance"] for n, e in state.instances.items()}
    done: dict[str, list[str]] = {}

    def act(what: str, nodes: list[str], action: Callable[[list[str]], object]) -> None:
        if not nodes:
            return
        try:
            if action(nodes) is not False:
                done[what] = sorted(nodes)
        except Exception:  # the next pass tries again; the other actions of this pass still run
            log.exception("reconcile: %s %s failed", what, compress_hostlist(nodes))

    act("terminated", stray, lambda ids: _terminate_orphans(ec2, ids))
    act("forgotten", gone, lambda nodes: _terminate_orphans(ec2, _forget(config, nodes, seen)))
    act("leftover", by_status[Status.LEFTOVER], lambda nodes: terminate(ec2, _forget(config, nodes, seen)))
    act("down", by_status[Status.LOST], lambda nodes: _set_lost(slurm, nodes))
    act("retried", by_status[Status.RETRY], lambda nodes: _return_to_service(config, ec2, slurm, nodes, seen))
    act("replaced", by_status[Status.REPLACE], lambda nodes: _replace(config, ec2, slurm, nodes, seen))
    act("powered up", by_status[Status.POWER_UP], lambda nodes: _power_up(config, slurm, nodes))
    healthy_up = [v.name for v in views if statuses[v.name] is Status.HEALTHY and v.has_instance and v.failures]
    act("recovered", healthy_up, lambda nodes: _clear_failures(config, nodes))
    log.info("reconcile: %s", "; ".join(f"{status.value} {compress_hostlist(nodes)}"
                                         for status, nodes in sorted(by_status.items(), key=lambda i: i[0].value)
                                         if nodes))
    return done


def _terminate_orphans(ec2, ids: list[str]) -> None:  # type: ignore[no-untyped-def]
    if ids:
        log.warning("instance(s) %s belong to no node (past their launch grace): terminating", ",".join(ids))
        terminate(ec2, ids)


def _set_lost(slurm: Slurm, nodes: list[str]) -> None:
    log.error("node(s) %s lost their instance: setting them DOWN", compress_hostlist(nodes))
    slurm.set_down(nodes, f"{REASON_PREFIX} instance vanished (spot reclaim or terminated outside Slurm)")


def _return_to_service(config: ClusterSettings, ec2, slurm: Slurm, nodes: list[str],  # type: ignore[no-untyped-def]
                       seen: dict[str, str]) -> None:
    """Terminate what is left of the nodes' instances and power them down: idle~, ready for the next job (or, for an
    always-on node, for the next pass to power it up). Counts the attempt, so the next one waits twice as long."""
    ids = _forget(config, nodes, seen)
    log.info("node(s) %s: returning to service (terminating %s)", compress_hostlist(nodes), ",".join(ids) or "nothing")
    terminate(ec2, ids)
    with registry(config) as state:
        for n in nodes:
            state.failures[n] = state.failures.get(n, 0) + 1
    slurm.power_down(nodes)


def _replace(config: ClusterSettings, ec2, slurm: Slurm, nodes: list[str],  # type: ignore[no-untyped-def]
             seen: dict[str, str]) -> None:
    """A node drained for a new instance, now idle or without its instance: the old instance goes, the node powers
    down (idle~) and its next job gets a fresh one. Not a failure: no backoff is counted."""
    ids = _forget(config, nodes, seen)
    log.info("node(s) %s: replacing their instance (terminating %s)", compress_hostlist(nodes), ",".join(ids) or "none")
    terminate(ec2, ids)
    slurm.power_down(nodes)
    record_event(config, "replaced", nodes=nodes, instances=ids)


def _power_up(config: ClusterSettings, slurm: Slurm, nodes: list[str]) -> bool:
    if budget_closed(config):
        log.warning("always-on node(s) %s are off: not powering up, the budget guardrail has closed the cluster",
                    compress_hostlist(nodes))
        return False
    log.info("always-on node(s) %s are off: powering them up", compress_hostlist(nodes))
    slurm.power_up(nodes)
    return True


def _clear_failures(config: ClusterSettings, nodes: list[str]) -> None:
    with registry(config) as state:
        for n in nodes:
            state.failures.pop(n, None)


def budget_closed(config: ClusterSettings) -> bool:
    try:
        return bool(json.loads(Path(config.budget_state_file).read_text()).get("closed"))
    except FileNotFoundError:
        return False


def record_event(config: ClusterSettings, what: str, **details: Any) -> None:
    """One line of the events log (`gpucluster events`): when, what, and its details."""
    try:
        Path(config.events_log).parent.mkdir(parents=True, exist_ok=True)
        with open(config.events_log, "a") as f:
            f.write(json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "event": what,
                                **details}, sort_keys=True) + "\n")
    except OSError:
        log.exception("could not record %s in %s", what, config.events_log)


RECEIVE_WAIT_SECONDS = 20  # SQS long polling: one call a 20 s when nothing happens


@dataclass
class Interruptions:
    """The head's answer to EC2's warnings about this cluster's instances (EventBridge -> SQS). A spot interruption
    warning (two minutes before EC2 reclaims the instance): drain the node, send its jobs SIGUSR1 so they checkpoint,
    requeue them `checkpoint_grace_seconds` later; the reconciler replaces the node once it is idle or its instance
    gone. A rebalance recommendation (the instance is at higher risk): drain only, when the stack says so. Events
    for instances no node of this cluster has are not ours: the rule sees the whole account's."""

    config: ClusterSettings
    slurm: Slurm
    sns: Any = None
    clock: Callable[[], float] = time.time
    requeue_at: dict[str, float] = field(default_factory=dict)  # job -> when to requeue it

    def handle(self, event: dict[str, Any]) -> list[str]:
        kind, detail = event.get("detail-type", ""), event.get("detail", {})
        instance = detail.get("instance-id", "")
        owners = read_registry(self.config).owner()
        node = owners.get(instance)
        if node is None or kind not in (SPOT_WARNING, REBALANCE):
            return []
        when = event.get("time", "")
        if kind == REBALANCE:
            if not self.config.drain_on_rebalance:
                self._said("rebalance recommendation (not drained: drain_on_rebalance is off)", node, instance)
                return []
            self.slurm.drain([node], f"{REPLACE_PREFIX}: rebalance recommendation for {instance} at {when}")
            self._said("rebalance recommendation: drained, its jobs run on", node, instance)
            return [node]
        self.slurm.drain([node], f"{REPLACE_PREFIX}: spot interruption warning for {instance} at {when}")
        jobs = self.slurm.jobs_on(node)
        for job in jobs:
            try:
                self.slurm.signal_job(job, "USR1")
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:  # it still gets requeued
                log.error("job %s on %s: SIGUSR1 not delivered: %s", job, node, _text(exc.stderr).strip() or exc)
            self.requeue_at.setdefault(job, self.clock() + self.config.checkpoint_grace_seconds)
        self._said(f"spot interruption warning: drained, job(s) {' '.join(jobs) or 'none'} signalled (SIGUSR1) and "
                   f"to be requeued in {self.config.checkpoint_grace_seconds} s", node, instance, jobs=jobs)
        return [node]

    def requeue_due(self) -> list[str]:
        now = self.clock()
        due = sorted(job for job, at in self.requeue_at.items() if at <= now)
        for job in due:
            del self.requeue_at[job]
            try:
                self.slurm.requeue(job)
                record_event(self.config, "requeued", job=job, why="spot interruption warning")
                log.info("job %s requeued (spot interruption warning)", job)
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired):  # ended meanwhile: nothing to requeue
                log.info("job %s: not requeued (it has ended)", job)
        return due

    def wait_seconds(self) -> int:
        if not self.requeue_at:
            return RECEIVE_WAIT_SECONDS
        return max(0, min(RECEIVE_WAIT_SECONDS, int(min(self.requeue_at.values()) - self.clock()) + 1))

    def _said(self, what: str, node: str, instance: str, **details: Any) -> None:
        log.warning("node %s (%s): %s", node, instance, what)
        record_event(self.config, what.split(":")[0], node=node, instance=instance, **details)
        if self.sns is not None and self.config.alerts_topic_arn:
            try:
                self.sns.publish(TopicArn=self.config.alerts_topic_arn, Subject=f"gpucluster {self.config.cluster}: "
                                 f"{what.split(':')[0]} on {node}"[:100], Message=f"node {node} ({instance}): {what}")
            except Exception:  # the drain and the requeue matter; the message is a courtesy
                log.exception("could not tell the topic about %s", node)


def serve_interruptions(service: Interruptions, sqs, stop: Callable[[], bool] = lambda: False) -> None:  # type: ignore[no-untyped-def]
    """Long-poll the queue, act on each event, requeue what is due; until `stop`. A message is deleted once handled;
    one that fails is left for SQS to deliver again."""
    url = service.config.interruption_queue_url
    while not stop():
        try:
            messages = sqs.receive_message(QueueUrl=url, WaitTimeSeconds=service.wait_seconds(),
                                           MaxNumberOfMessages=10).get("Messages", [])
        except Exception:
            log.exception("interruptions: receiving from %s failed; trying again", url)
            time.sleep(5)
            messages = []
        for message in messages:
            try:
                service.handle(json.loads(message["Body"]))
                sqs.delete_message(QueueUrl=url, ReceiptHandle=message["ReceiptHandle"])
            except Exception:
                log.exception("interruptions: message %s failed; SQS delivers it again", message.get("MessageId"))
        service.requeue_due()


def setup_logging(config: ClusterSettings) -> None:
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if Path("/dev/log").exists():  # the journal: slurmctld keeps nothing of what its programs print
        from logging.handlers import SysLogHandler

        syslog = SysLogHandler(address="/dev/log")
        syslog.setFormatter(logging.Formatter("gpucluster-node[%(process)d]: %(levelname)s %(message)s"))
        handlers.append(syslog)
    try:
        Path(config.log_file).parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(config.log_file))
    except OSError as exc:  # the journal still gets everything
        print(f"gpucluster-node: cannot open {config.log_file}: {exc}", file=sys.stderr)
    logging.basicConfig(level=logging.INFO, handlers=handlers,
                        format="%(asctime)s %(name)s[%(process)d] %(levelname)s %(message)s", force=True)


COMMANDS = {"suspend": suspend, "resume-fail": resume_fail}


def main(argv: list[str]) -> int:
    command = Path(argv[0]).name
    args = argv[1:]
    if command not in (*COMMANDS, "resume", "reconcile", "interruptions") and args:
        command, args = args[0], args[1:]
    config = ClusterSettings.load()
    setup_logging(config)
    slurm = Slurm(config.scontrol)
    try:
        ec2 = ec2_client(config)
        if command == "reconcile" and not args:
            reconcile(config, ec2, slurm)
        elif command == "interruptions" and not args:
            import boto3

            service = Interruptions(config, slurm, sns=boto3.client("sns", region_name=config.region))
            serve_interruptions(service, boto3.client("sqs", region_name=config.region))
        elif command == "resume" and len(args) == 1:
            resume(config, ec2, slurm, args[0], os.environ.get("SLURM_RESUME_FILE"))
        elif command in COMMANDS and len(args) == 1:
            COMMANDS[command](config, ec2, slurm, args[0])
        else:
            print(f"usage: {{resume|suspend|resume-fail}} HOSTLIST | reconcile | interruptions (called as {command})",
                  file=sys.stderr)
            return 2
    except Exception:
        # Slurm only sees the exit status; the log keeps the whole story.
        log.exception("%s %s failed", command, " ".join(args))
        if command == "resume" and args:
            try:
                # Passing: the reconciler returns them to service with backoff (and terminates what was launched).
                slurm.set_down(expand_hostlist(args[0]), f"{REASON_PREFIX} launch failed: resume program error, see log")
            except Exception:  # scontrol itself may be what failed; the exit status still tells Slurm
                log.exception("could not set %s DOWN after the failure", args[0])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
