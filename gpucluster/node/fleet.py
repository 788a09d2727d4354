"""The EC2 side of the node programs: launching a pool's nodes with CreateFleet (type instant) from its launch
template, the reason a failed launch gives Slurm, finding the cluster's live instances, terminating them.
Standard library, and boto3 imported where a call needs it (the nodes' system Python has it; the tests' too)."""

from __future__ import annotations

import re
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable

from gpucluster.contract import reasons
from gpucluster.contract.hostlist import compress_hostlist, in_batches
from gpucluster.contract.settings import CLUSTER_TAG, LAUNCH_TAGGED, POOL_TAG, ClusterSettings, PoolSettings, named_pool
from gpucluster.node import log

DESCRIBE_BATCH = 200  # instance ids per DescribeInstances filter (EC2 takes at most 200 values per filter)
TERMINATE_BATCH = 1000  # instance ids per TerminateInstances
# EC2 answers that mean "not now, try elsewhere or later" rather than "this request is wrong".
CAPACITY_ERRORS = {
    "InsufficientInstanceCapacity", "InsufficientCapacityOnHost", "UnfulfillableCapacity", "InsufficientHostCapacity",
    "MaxSpotInstanceCountExceeded", "SpotMaxPriceTooLow", "VcpuLimitExceeded", "InstanceLimitExceeded",
    "ReservationCapacityExceeded", "InsufficientReservedInstanceCapacity",
}
# EC2 answers that say the request itself is wrong (a template, subnet or instance type the stack names): retrying
# cannot help. UnauthorizedOperation is not among them: the budget's deny action causes it, and reopening lifts it.
CONFIGURATION_ERRORS = re.compile(r"^(Invalid|MissingParameter|Unsupported|OptInRequired)")
# `pulumi up` makes the account's spot service-linked role when it has none (components/launch_access.py); should it
# be deleted later, EC2 refuses every spot launch, since the head role may not make it (iam:CreateServiceLinkedRole).
# The DOWN reason carries the fix (sinfo -R shows it); the reconciler retries with backoff, so the nodes come back once
# the role exists.
SPOT_ROLE_ERROR = "AuthFailure.ServiceLinkedRoleCreationNotPermitted"
SPOT_ROLE_FIX = "aws iam create-service-linked-role --aws-service-name spot.amazonaws.com"


# The instance profile's credentials come from instance metadata, which botocore asks once with a 1 s timeout by
# default (configprovider.py: metadata_service_timeout, metadata_service_num_attempts): a head busy enough to answer
# late left a resume without credentials, its nodes DOWN. The same 5 s as the boot's own metadata calls (metadata.py).
METADATA_SECONDS = 5
METADATA_ATTEMPTS = 3


def ec2_client(config: ClusterSettings) -> Any:
    import boto3
    import botocore.session
    from botocore.config import Config as BotoConfig

    session = botocore.session.get_session()
    session.set_config_variable("metadata_service_timeout", METADATA_SECONDS)
    session.set_config_variable("metadata_service_num_attempts", METADATA_ATTEMPTS)
    # Throttling (RequestLimitExceeded) is retried with client-side rate limiting and exponential backoff.
    return boto3.Session(botocore_session=session).client(
        "ec2", region_name=config.region, config=BotoConfig(retries={"mode": "adaptive", "max_attempts": 10}))


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


def launch_tags(config: ClusterSettings, pool: PoolSettings) -> list[dict[str, str]]:
    """The tags CreateFleet puts on what it launches: every tag the pool's launch template carries, the two the
    programs find nodes by (cluster, pool) among them. Sent in the request as well, because no AWS document says
    that an instant fleet adds the template's tags to the request's; if it did not, a node without its pool tag
    would be an orphan to the reconciler."""
    tags = {**pool.tags, CLUSTER_TAG: config.cluster, POOL_TAG: pool.name}
    return [{"Key": key, "Value": tags[key]} for key in sorted(tags)]


def fleet_request(config: ClusterSettings, pool: PoolSettings, count: int, all_or_nothing: bool) -> dict[str, Any]:
    tags = launch_tags(config, pool)
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
        "TagSpecifications": [{"ResourceType": kind, "Tags": tags} for kind in LAUNCH_TAGGED],
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


def launch_reason(code: str, message: str) -> str:
    """The DOWN reason of nodes EC2 did not launch: its kind decides what the reconciler does with them."""
    lowered = message.lower()
    if code == SPOT_ROLE_ERROR or ("service-linked role" in lowered and "spot" in lowered):
        # The fix first: Slurm keeps 200 characters of a reason.
        return f"{reasons.LAUNCH_FAILED}: no spot service-linked role, run once: {SPOT_ROLE_FIX} ({code})"
    if CONFIGURATION_ERRORS.match(code):
        return f"{reasons.CONFIGURATION}: fix the stack and pulumi up: {code}: {message}".replace("\n", " ")
    kind = reasons.CAPACITY if code in CAPACITY_ERRORS else reasons.LAUNCH_FAILED
    return f"{kind}: {code}: {message}".replace("\n", " ")


def launch_groups(config: ClusterSettings, nodes: list[str], jobs: dict[str, list[str]]) -> list[LaunchGroup]:
    """The CreateFleet calls for `nodes`: each multi-node job's nodes of a pool in one all-or-nothing call, whatever
    its size (a job is never split across calls); every other node packed per pool into best-effort calls of
    `batch_size`. `jobs` maps a job id to its nodes being resumed. A group's pool is the one its nodes' names name,
    which the settings may not have."""
    wanted = set(nodes)
    groups: list[LaunchGroup] = []
    loose: dict[str, list[str]] = defaultdict(list)
    placed: set[str] = set()
    for job, members in jobs.items():
        mine = [n for n in dict.fromkeys(members) if n in wanted and n not in placed]
        placed.update(mine)
        by_pool: dict[str, list[str]] = defaultdict(list)
        for n in mine:
            by_pool[named_pool(n)].append(n)
        for pool, of_pool in by_pool.items():
            if config.all_or_nothing and len(mine) > 1:
                groups.append(LaunchGroup(pool, tuple(of_pool), whole=True, job=job))
            else:
                loose[pool] += of_pool
    for n in nodes:
        if n not in placed:
            loose[named_pool(n)].append(n)
    for pool, members in loose.items():
        groups += [LaunchGroup(pool, tuple(batch)) for batch in in_batches(members, config.batch_size)]
    return groups


def launch_group(config: ClusterSettings, ec2: Any, pool: PoolSettings, group: LaunchGroup) -> LaunchResult:
    from botocore.exceptions import ClientError

    batch = list(group.nodes)
    try:
        # The token makes botocore's own retries of a timed-out call idempotent: never a second fleet for it.
        response = ec2.create_fleet(**fleet_request(config, pool, len(batch), group.whole),
                                    ClientToken=str(uuid.uuid4()))
    except ClientError as exc:
        error = exc.response.get("Error", {})
        reason = launch_reason(error.get("Code", "Unknown"), error.get("Message", str(exc)))
        log.error("CreateFleet for %s failed: %s", compress_hostlist(batch), reason)
        return LaunchResult(failed={n: reason for n in batch})
    ids = [i for fleet in response.get("Instances", []) for i in fleet.get("InstanceIds", [])]
    if len(ids) < len(batch) and group.whole and ids:
        log.warning("pool %s: %d of %d instances launched, all-or-nothing: terminating them", pool.name, len(ids),
                    len(batch))
        terminate(ec2, ids)
        ids = []
    result = LaunchResult(launched=dict(zip(batch, ids, strict=False)))  # fewer ids than nodes: a partial launch
    if len(ids) < len(batch):
        errors = response.get("Errors", [])
        first = errors[0] if errors else {"ErrorCode": "UnfulfillableCapacity", "ErrorMessage": "no instance launched"}
        reason = launch_reason(first.get("ErrorCode", "Unknown"), first.get("ErrorMessage", ""))
        log.error("pool %s: %s", pool.name, reason)
        result.failed = {n: reason for n in batch[len(ids):]}
    return result


def live_instances(ec2: Any, ids: Iterable[str]) -> dict[str, dict[str, Any]]:
    """The pending or running ones among `ids`: id -> DescribeInstances' record. EC2 keeps terminated instances
    visible for a while; an id it no longer knows at all is simply not live."""
    from botocore.exceptions import ClientError

    found: dict[str, dict[str, Any]] = {}
    for batch in in_batches(sorted(set(ids)), DESCRIBE_BATCH):
        try:
            found.update(_described(ec2, [{"Name": "instance-id", "Values": batch}]))
        except ClientError as exc:
            log.error("DescribeInstances for %d instance(s) failed: %s", len(batch), exc)
            raise
    return found


def cluster_instances(config: ClusterSettings, ec2: Any) -> dict[str, dict[str, Any]]:
    """Live (pending or running) instances of this cluster's pools: id -> DescribeInstances' record. The head node
    carries the cluster tag too, but no pool tag."""
    return _described(ec2, [{"Name": f"tag:{CLUSTER_TAG}", "Values": [config.cluster]},
                            {"Name": "tag-key", "Values": [POOL_TAG]}])


def _described(ec2: Any, filters: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The pending or running instances that match the filters: id -> DescribeInstances' record."""
    found: dict[str, dict[str, Any]] = {}
    live = {"Name": "instance-state-name", "Values": ["pending", "running"]}
    for page in ec2.get_paginator("describe_instances").paginate(Filters=[*filters, live]):
        for reservation in page["Reservations"]:
            found.update({i["InstanceId"]: i for i in reservation["Instances"]})
    return found


def terminate(ec2: Any, ids: list[str]) -> None:
    for batch in in_batches(sorted(set(ids)), TERMINATE_BATCH):
        ec2.terminate_instances(InstanceIds=batch)
