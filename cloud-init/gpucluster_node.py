#!/usr/bin/env python3
"""gpucluster's node programs, run by Slurm on the head node.

Installed as /opt/gpucluster/bin/gpucluster_node.py with the links `resume`, `suspend`, `resume-fail` and `reconcile`;
the name it is called by picks the command. Slurm passes a host list such as `p5-spot-[1-4]` as the only argument.

- resume: launch one EC2 instance per node with CreateFleet (type instant) from the pool's launch template, tag it with
  its node name and give Slurm its address. Nodes that EC2 cannot launch (capacity, quota, spot price) are set DOWN
  with the AWS reason, so Slurm requeues the job and schedules it where it can run (a fallback pool).
- suspend: terminate the instances of the listed nodes.
- resume-fail: a launched node that never registered: terminate it and set it DOWN with the reason.
- reconcile (timer): terminate instances that no Slurm node owns; set DOWN nodes whose instance vanished; give nodes that
  were set DOWN for lack of capacity another chance after `capacity_retry_seconds`.

Needs only the standard library and boto3. Every action is logged to the log file and to stderr (the journal).
"""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

# The bundle carries the library beside this program (lib/); the settings contract is in it (standard library only).
sys.path.insert(0, str(Path(__file__).resolve().parent / "lib"))
from gpucluster.settings import CLUSTER_TAG, NODE_TAG, SETTINGS_FILE, ClusterSettings, PoolSettings  # noqa: E402

REASON_PREFIX = "gpucluster:"
CAPACITY_PREFIX = f"{REASON_PREFIX} capacity"
SCONTROL_BATCH = 200  # nodes per scontrol update
# A hung slurmctld must not hang the program: Slurm kills a ResumeProgram only after ResumeTimeout, with nodes half set.
SCONTROL_TIMEOUT = 60
TAG_WORKERS = 16  # CreateTags calls in flight (one per instance: each gets its own node name)
# EC2 answers that mean "not now, try elsewhere or later" rather than "this request is wrong".
CAPACITY_ERRORS = {
    "InsufficientInstanceCapacity", "InsufficientCapacityOnHost", "UnfulfillableCapacity", "InsufficientHostCapacity",
    "MaxSpotInstanceCountExceeded", "SpotMaxPriceTooLow", "VcpuLimitExceeded", "InstanceLimitExceeded",
    "ReservationCapacityExceeded", "InsufficientReservedInstanceCapacity",
}
# A new account has no spot service-linked role until someone allowed to (iam:CreateServiceLinkedRole) makes it; the
# head role may not, so EC2 refuses every spot launch. The DOWN reason carries the fix (sinfo -R shows it); the
# reconciler does not retry these nodes: once the role exists, `scontrol update nodename=... state=resume`.
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

    def expand(self, hostlist: str) -> list[str]:
        return self._run("show", "hostnames", hostlist).split()

    def set_addresses(self, addresses: dict[str, str]) -> None:
        """NodeAddr for many nodes per call: scontrol takes matching lists of names and addresses."""
        items = sorted(addresses.items())
        for i in range(0, len(items), SCONTROL_BATCH):
            names = ",".join(n for n, _ in items[i : i + SCONTROL_BATCH])
            addrs = ",".join(a for _, a in items[i : i + SCONTROL_BATCH])
            self._run("update", f"nodename={names}", f"nodeaddr={addrs}", f"nodehostname={names}")

    def set_down(self, nodes: list[str], reason: str) -> None:
        """DOWN with the reason: Slurm requeues the job (held for the credential lifetime, 120 s by default) and
        schedules it on nodes that are not DOWN. The nodes stay DOWN until the reconciler retries them."""
        if nodes:
            self._run("update", f"nodename={','.join(nodes)}", "state=down", f"reason={reason[:200]}")

    def power_down(self, nodes: list[str]) -> None:
        """Back to powered-down cloud nodes (idle~), schedulable again."""
        if nodes:
            self._run("update", f"nodename={','.join(nodes)}", "state=power_down_force")

    def nodes(self) -> list[dict[str, str]]:
        """One dict per node of `scontrol show nodes --oneliner` (keys such as NodeName, State, Reason)."""
        out = self._run("show", "nodes", "--oneliner")
        return [parse_oneliner(line) for line in out.splitlines() if line.startswith("NodeName=")]


def _text(data: str | bytes | None) -> str:
    # TimeoutExpired carries raw bytes even when the call asked for text.
    return data.decode(errors="replace") if isinstance(data, bytes) else data or ""


def compress_hostlist(nodes: Iterable[str]) -> str:
    """Slurm's compressed form of node names, for log lines: p5-od-1,p5-od-2,p5-od-3,p5-od-7 -> p5-od-[1-3,7].
    Numbers sort as numbers (9 before 10); a name without a trailing number, or with a zero-padded one, stays as is."""
    numbered: dict[str, set[int]] = defaultdict(set)
    plain: set[str] = set()
    for node in nodes:
        match = re.fullmatch(r"(.*?)(\d+)", node)
        if match and (match.group(2) == "0" or not match.group(2).startswith("0")):
            numbered[match.group(1)].add(int(match.group(2)))
        else:
            plain.add(node)
    parts = sorted(plain)
    for prefix in sorted(numbered):
        numbers = sorted(numbered[prefix])
        ranges: list[list[int]] = []
        for n in numbers:
            if ranges and n == ranges[-1][1] + 1:
                ranges[-1][1] = n
            else:
                ranges.append([n, n])
        spans = ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)
        parts.append(f"{prefix}{numbers[0]}" if len(numbers) == 1 else f"{prefix}[{spans}]")
    return ",".join(parts)


def parse_oneliner(line: str) -> dict[str, str]:
    """One record of `scontrol show ... --oneliner`. Values run to the next " Key=" (reasons contain spaces)."""
    parts = re.split(r" (?=[A-Za-z]+=)", line.strip())
    return dict(p.split("=", 1) for p in parts if "=" in p)


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


@dataclass
class LaunchResult:
    launched: dict[str, str] = field(default_factory=dict)  # node -> instance id
    failed: dict[str, str] = field(default_factory=dict)  # node -> reason


def _fleet_request(config: ClusterSettings, pool: PoolSettings, count: int) -> dict[str, Any]:
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
    # MinTargetCapacity makes EC2 launch the whole batch or nothing; it needs one type in one AZ.
    all_or_nothing = {"MinTargetCapacity": count, "SingleInstanceType": True, "SingleAvailabilityZone": True} \
        if config.all_or_nothing else {}
    if pool.market == "spot":
        request["SpotOptions"] = {"AllocationStrategy": "price-capacity-optimized", **all_or_nothing}
    elif pool.market == "capacity-block":
        # The template's market type and reservation target pick the block. No AllocationStrategy (a block is one
        # instance pool; ParallelCluster and Karpenter send none) and no CapacityReservationOptions: EC2's Capacity
        # Blocks fleet tutorial says that with DefaultTargetCapacityType capacity-block they raise an exception.
        if all_or_nothing:
            request["OnDemandOptions"] = all_or_nothing
    else:
        request["OnDemandOptions"] = {"AllocationStrategy": "lowest-price", **all_or_nothing}
    return request


def _reason(code: str, message: str) -> str:
    lowered = message.lower()
    if code == SPOT_ROLE_ERROR or ("service-linked role" in lowered and "spot" in lowered):
        # The fix first: set_down keeps 200 characters of a reason.
        return f"{REASON_PREFIX} launch failed: no spot service-linked role, run once: {SPOT_ROLE_FIX} ({code})"
    kind = "capacity" if code in CAPACITY_ERRORS else "launch failed"
    return f"{REASON_PREFIX} {kind}: {code}: {message}".replace("\n", " ")


def launch(config: ClusterSettings, ec2, pool: PoolSettings, nodes: list[str]) -> LaunchResult:  # type: ignore[no-untyped-def]
    from botocore.exceptions import ClientError

    result = LaunchResult()
    for batch in chunks(nodes, config.batch_size):
        try:
            response = ec2.create_fleet(**_fleet_request(config, pool, len(batch)))
        except ClientError as exc:
            error = exc.response.get("Error", {})
            reason = _reason(error.get("Code", "Unknown"), error.get("Message", str(exc)))
            log.error("CreateFleet for %s failed: %s", compress_hostlist(batch), reason)
            result.failed.update({n: reason for n in batch})
            continue
        ids = [i for group in response.get("Instances", []) for i in group.get("InstanceIds", [])]
        errors = response.get("Errors", [])
        if len(ids) < len(batch) and config.all_or_nothing and ids:
            log.warning("pool %s: %d of %d instances launched, all-or-nothing: terminating them", pool.name, len(ids),
                        len(batch))
            ec2.terminate_instances(InstanceIds=ids)
            ids = []
        for node, instance in zip(batch, ids):
            result.launched[node] = instance
        if len(ids) < len(batch):
            first = errors[0] if errors else {"ErrorCode": "UnfulfillableCapacity", "ErrorMessage": "no instance launched"}
            reason = _reason(first.get("ErrorCode", "Unknown"), first.get("ErrorMessage", ""))
            log.error("pool %s: %s", pool.name, reason)
            result.failed.update({n: reason for n in batch[len(ids):]})
    return result


def _tag_and_address(ec2, slurm: Slurm, launched: dict[str, str]) -> None:  # type: ignore[no-untyped-def]
    from concurrent.futures import ThreadPoolExecutor

    def tag(item: tuple[str, str]) -> None:
        node, instance = item
        ec2.create_tags(Resources=[instance], Tags=[{"Key": "Name", "Value": node}, {"Key": NODE_TAG, "Value": node}])

    with ThreadPoolExecutor(TAG_WORKERS) as pool:
        list(pool.map(tag, launched.items()))
    by_id = {v: k for k, v in launched.items()}
    pending = set(by_id)
    # A new instance may take a moment to show its private address.
    for _ in range(30):
        found: dict[str, str] = {}
        for batch in chunks(sorted(pending), 500):
            for reservation in ec2.describe_instances(InstanceIds=batch)["Reservations"]:
                for inst in reservation["Instances"]:
                    if inst.get("PrivateIpAddress") and inst["InstanceId"] in pending:
                        found[by_id[inst["InstanceId"]]] = inst["PrivateIpAddress"]
                        pending.discard(inst["InstanceId"])
        if found:
            slurm.set_addresses(found)
            for node, address in sorted(found.items()):
                log.info("node %s is %s at %s", node, launched[node], address)
        if not pending:
            return
        time.sleep(2)
    log.error("no address for %s", compress_hostlist(by_id[i] for i in pending))


def resume(config: ClusterSettings, ec2, slurm: Slurm, hostlist: str) -> LaunchResult:  # type: ignore[no-untyped-def]
    by_pool: dict[str, list[str]] = defaultdict(list)
    for node in slurm.expand(hostlist):
        by_pool[pool_of(node)].append(node)
    total = LaunchResult()
    for name, nodes in by_pool.items():
        pool = config.pools.get(name)
        if pool is None:
            reason = f"{REASON_PREFIX} launch failed: no pool {name} in {SETTINGS_FILE}"
            log.error(reason)
            total.failed.update({n: reason for n in nodes})
            continue
        log.info("resume %s: %d node(s) of pool %s (%s)", compress_hostlist(nodes), len(nodes), name, pool.market)
        result = launch(config, ec2, pool, nodes)
        total.launched.update(result.launched)
        total.failed.update(result.failed)
    if total.launched:
        _tag_and_address(ec2, slurm, total.launched)
    for reason, nodes in _group(total.failed).items():
        slurm.set_down(nodes, reason)
    return total


def _group(reasons: dict[str, str]) -> dict[str, list[str]]:
    grouped: dict[str, list[str]] = defaultdict(list)
    for node, reason in reasons.items():
        grouped[reason].append(node)
    return grouped


def cluster_instances(config: ClusterSettings, ec2, nodes: list[str] | None = None) -> dict[str, list[str]]:  # type: ignore[no-untyped-def]
    """Live (pending or running) instances of this cluster: node name -> instance ids."""
    filters = [{"Name": f"tag:{CLUSTER_TAG}", "Values": [config.cluster]},
               {"Name": "instance-state-name", "Values": ["pending", "running"]}]
    if nodes is not None:
        filters.append({"Name": f"tag:{NODE_TAG}", "Values": nodes})
    found: dict[str, list[str]] = defaultdict(list)
    for page in ec2.get_paginator("describe_instances").paginate(Filters=filters):
        for reservation in page["Reservations"]:
            for inst in reservation["Instances"]:
                tags = {t["Key"]: t["Value"] for t in inst.get("Tags", [])}
                found[tags.get(NODE_TAG, "")].append(inst["InstanceId"])
    return found


def terminate(ec2, ids: list[str]) -> None:  # type: ignore[no-untyped-def]
    for batch in chunks(ids, 1000):
        ec2.terminate_instances(InstanceIds=batch)


def suspend(config: ClusterSettings, ec2, slurm: Slurm, hostlist: str) -> list[str]:  # type: ignore[no-untyped-def]
    nodes = slurm.expand(hostlist)
    ids = [i for found in cluster_instances(config, ec2, nodes).values() for i in found]
    log.info("suspend %s: terminating %s", compress_hostlist(nodes), ",".join(ids) or "nothing")
    terminate(ec2, ids)
    return ids


def resume_fail(config: ClusterSettings, ec2, slurm: Slurm, hostlist: str) -> list[str]:  # type: ignore[no-untyped-def]
    nodes = slurm.expand(hostlist)
    ids = [i for found in cluster_instances(config, ec2, nodes).values() for i in found]
    log.error("resume failed for %s (never registered): terminating %s", compress_hostlist(nodes),
              ",".join(ids) or "nothing")
    terminate(ec2, ids)
    slurm.set_down(nodes, f"{REASON_PREFIX} launch failed: node did not register before ResumeTimeout")
    return ids


def reconcile(config: ClusterSettings, ec2, slurm: Slurm, now: float | None = None) -> dict[str, list[str]]:  # type: ignore[no-untyped-def]
    """One pass of the timer. Returns what it did, by kind."""
    now = time.time() if now is None else now
    nodes = {n["NodeName"]: n for n in slurm.nodes()}
    instances = cluster_instances(config, ec2)
    done: dict[str, list[str]] = {"terminated": [], "down": [], "retried": [], "launched": []}

    for node, ids in instances.items():
        state = nodes.get(node, {}).get("State", "")
        # POWERED_DOWN (not POWERING_UP): Slurm believes the node is off, so the instance is a leftover.
        if node not in nodes or ("POWERED_DOWN" in state and "POWERING_UP" not in state):
            log.warning("instance(s) %s of %s have no live Slurm node: terminating", ",".join(ids), node or "no node")
            terminate(ec2, ids)
            done["terminated"] += ids
    vanished = [name for name, n in nodes.items()
                if name not in instances and _is_up(n["State"]) and pool_of(name) in config.pools]
    if vanished:
        log.error("node(s) %s lost their instance: setting them DOWN", compress_hostlist(vanished))
        slurm.set_down(vanished, f"{REASON_PREFIX} instance vanished (spot reclaim or terminated outside Slurm)")
        done["down"] = vanished
    # Always-on nodes (never suspended, so Slurm never resumes them): launch those without an instance.
    missing = [f"{pool.name}-{i}" for pool in config.pools.values() for i in range(1, pool.min_nodes + 1)
               if f"{pool.name}-{i}" not in instances and f"{pool.name}-{i}" in nodes]
    if missing and budget_closed(config):
        log.warning("always-on node(s) %s have no instance: not launching, the budget guardrail has closed the cluster",
                    compress_hostlist(missing))
    elif missing:
        log.info("always-on node(s) %s have no instance: launching", compress_hostlist(missing))
        done["launched"] = sorted(resume(config, ec2, slurm, ",".join(missing)).launched)
    retry = [name for name, n in nodes.items()
             if n.get("Reason", "").startswith(CAPACITY_PREFIX) and "DOWN" in n["State"]
             and now - _reason_time(n) >= config.capacity_retry_seconds]
    if retry:
        log.info("node(s) %s: capacity may be back, making them schedulable again", compress_hostlist(retry))
        slurm.power_down(retry)
        done["retried"] = retry
    return done


def budget_closed(config: ClusterSettings) -> bool:
    try:
        return bool(json.loads(Path(config.budget_state_file).read_text()).get("closed"))
    except FileNotFoundError:
        return False


def _is_up(state: str) -> bool:
    """A node Slurm counts on: powered up, not on its way up or down, not already DOWN."""
    flags = set(state.split("+"))
    return not flags & {"POWERED_DOWN", "POWERING_UP", "POWERING_DOWN", "DOWN", "DRAIN", "FUTURE"}


def _reason_time(node: dict[str, str]) -> float:
    # scontrol shows `Reason=text [user@2026-11-29T15:10:00]`.
    match = re.search(r"@(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)\]", node.get("Reason", ""))
    if not match:
        return 0.0
    return time.mktime(time.strptime(match.group(1), "%Y-%m-%dT%H:%M:%S"))


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


COMMANDS = {"resume": resume, "suspend": suspend, "resume-fail": resume_fail}


def main(argv: list[str]) -> int:
    command = Path(argv[0]).name
    args = argv[1:]
    if command not in (*COMMANDS, "reconcile") and args:
        command, args = args[0], args[1:]
    config = ClusterSettings.load()
    setup_logging(config)
    slurm = Slurm(config.scontrol)
    try:
        ec2 = ec2_client(config)
        if command == "reconcile":
            reconcile(config, ec2, slurm)
        elif command in COMMANDS and len(args) == 1:
            COMMANDS[command](config, ec2, slurm, args[0])
        else:
            print(f"usage: {{resume|suspend|resume-fail}} HOSTLIST | reconcile (called as {command})", file=sys.stderr)
            return 2
    except Exception:
        # Slurm only sees the exit status; the log keeps the whole story.
        log.exception("%s %s failed", command, " ".join(args))
        if command == "resume" and args:
            try:
                slurm.set_down(slurm.expand(args[0]), f"{REASON_PREFIX} launch failed: resume program error, see log")
            except Exception:  # scontrol itself may be what failed; the exit status still tells Slurm
                log.exception("could not set %s DOWN after the failure", args[0])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
