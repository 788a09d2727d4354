"""What `pulumi destroy` must do that deleting the declared resources does not: stop the cluster launching, terminate
the nodes Slurm launched (they are not in Pulumi's state), delete what the nodes created at run time, and flush the
file system to S3 before it goes.

Run by the dynamic resources of components/teardown.py on the machine that runs `pulumi destroy`, with its
credentials; boto3 clients come in, so tests drive the same code against moto.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from gpucluster.contract.settings import BUDGET_UNIT, CLUSTER_TAG, INTERRUPTIONS_UNIT, RECONCILE_UNIT, UPDATE_UNIT

log = logging.getLogger("gpucluster.aws.teardown")

# States of an instance that still bills or may come back; "shutting-down" is on its way out, but not gone yet.
LIVE_STATES = ("pending", "running", "stopping", "stopped", "shutting-down")
TERMINATE_BATCH = 1000  # TerminateInstances takes up to 1000 ids per call
GONE_CODES = ("InvalidInstanceID.NotFound", "InvalidInstanceID.Malformed")
# Refusals no retry can change: the destroying principal may not terminate (or see) the instances.
DENIED_CODES = ("UnauthorizedOperation", "AuthFailure")


class TeardownError(Exception):
    """A step could not finish; the message names what is left and why. Pulumi then stops the deletion there."""


class HeadUnreachable(Exception):
    """The head node cannot run a command: it is stopped, its SSM agent is offline, or SSM refused."""


class HeadChannel(Protocol):
    def run(self, script: str) -> str:
        """Run a shell script as root on the head node; its output. Raises HeadUnreachable."""


Clock = Callable[[], float]
Sleep = Callable[[float], None]


@dataclass(frozen=True)
class Fleet:
    """The cluster as the teardown step needs it: what to find by tag, what to spare, what to delete."""

    cluster: str
    head_instance_id: str
    munge_key_parameter: str
    timeout_seconds: float = 900.0  # p5 instances take minutes to terminate
    poll_seconds: float = 5.0
    # How long sweeps must find nothing before the fleet counts as gone: an instance CreateFleet made just before the
    # head stopped, and one DescribeInstances does not list yet (eventual consistency), show within it.
    quiet_seconds: float = 30.0


def quiesce_script() -> str:
    """What the head runs first: nothing of the cluster may launch a node any more. The reconciler (which powers
    always-on nodes up), the update timer and a run of it in progress (which reconfigures slurmctld, so reopens the
    partitions) and the budget guardrail (which reopens them too) stop; every partition goes DOWN, so slurmctld starts
    no job and resumes no node, and the script fails unless they all are. Running jobs are not cancelled: their nodes
    are terminated next."""
    units = [f"{RECONCILE_UNIT}.timer", f"{RECONCILE_UNIT}.service", f"{UPDATE_UNIT}.timer", f"{UPDATE_UNIT}.service",
             f"{BUDGET_UNIT}.service", f"{INTERRUPTIONS_UNIT}.service"]
    return "\n".join([
        "set -eu",
        f"systemctl stop {' '.join(units)}",
        "partitions=$(sinfo --noheader --format=%R)",
        '[ -n "$partitions" ] || { echo "slurmctld lists no partition" >&2; exit 1; }',
        "for partition in $partitions; do",
        '  scontrol update partitionname="$partition" state=down',
        "done",
        "open=$(sinfo --noheader --format='%R %a' | awk '$2 != \"down\" {print $1}')",
        '[ -z "$open" ] || { echo "still open: $open" >&2; exit 1; }',
        'echo "partitions down:" $partitions',
    ])


class SsmChannel:
    """The head through Session Manager's Run Command (AWS-RunShellScript), as the machine running `destroy` reaches
    it: the head has no SSH and no public address."""

    def __init__(self, ssm: Any, instance_id: str, timeout_seconds: float = 120.0, poll_seconds: float = 2.0,
                 clock: Clock = time.monotonic, sleep: Sleep = time.sleep):
        self.ssm, self.instance_id = ssm, instance_id
        self.timeout, self.poll, self.clock, self.sleep = timeout_seconds, poll_seconds, clock, sleep

    def run(self, script: str) -> str:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            info = self.ssm.describe_instance_information(
                Filters=[{"Key": "InstanceIds", "Values": [self.instance_id]}])["InstanceInformationList"]
            if not info or info[0].get("PingStatus") != "Online":
                status = info[0]["PingStatus"] if info else "not registered"
                raise HeadUnreachable(f"its SSM agent is not online ({status})")
            command = self.ssm.send_command(
                InstanceIds=[self.instance_id], DocumentName="AWS-RunShellScript",
                Parameters={"commands": [script]}, TimeoutSeconds=max(30, int(self.timeout)),
                Comment="gpucluster teardown: stop launching nodes")["Command"]["CommandId"]
            deadline = self.clock() + self.timeout
            while self.clock() < deadline:
                self.sleep(self.poll)
                try:
                    result = self.ssm.get_command_invocation(CommandId=command, InstanceId=self.instance_id)
                except ClientError as exc:
                    if exc.response["Error"]["Code"] == "InvocationDoesNotExist":  # not registered yet
                        continue
                    raise
                if result["Status"] == "Success":
                    return str(result.get("StandardOutputContent", ""))
                if result["Status"] in ("Failed", "Cancelled", "TimedOut", "Cancelling"):
                    error = result.get("StandardErrorContent", "")[-500:]
                    raise HeadUnreachable(f"the command {result['Status']}: {error}")
            raise HeadUnreachable(f"the command did not finish in {self.timeout:.0f} s")
        except (BotoCoreError, ClientError) as exc:
            raise HeadUnreachable(f"SSM: {exc}") from exc


def quiesce_head(channel: HeadChannel, ec2: Any, fleet: Fleet, clock: Clock = time.monotonic,
                 sleep: Sleep = time.sleep) -> str:
    """Stop the head launching nodes: close the partitions through `channel` (when it answers), then stop the head
    instance itself, which Pulumi deletes right after the fleet anyway: a resume program already running, or one
    slurmctld started just before the partitions closed, ends with it. Returns what was done."""
    try:
        closed = f"quiesced ({channel.run(quiesce_script()).strip()})"
    except HeadUnreachable as exc:
        log.warning("the head node %s cannot close its partitions (%s): stopping it all the same",
                    fleet.head_instance_id, exc)
        closed = f"could not close its partitions ({exc})"
    return f"head {fleet.head_instance_id} {closed}; {stop_head(ec2, fleet, clock, sleep)}"


def stop_head(ec2: Any, fleet: Fleet, clock: Clock = time.monotonic, sleep: Sleep = time.sleep) -> str:
    from botocore.exceptions import ClientError

    deadline = clock() + fleet.timeout_seconds
    asked = False
    while True:
        state = _state(ec2, fleet.head_instance_id)
        if state in ("stopped", "terminated", "shutting-down", None):
            return f"{state or 'gone'}"
        if not asked and state in ("pending", "running"):
            try:
                ec2.stop_instances(InstanceIds=[fleet.head_instance_id], Force=True)
                asked = True
            except ClientError as exc:
                if exc.response["Error"]["Code"] != "IncorrectInstanceState":  # it changed state meanwhile
                    raise TeardownError(f"the head node {fleet.head_instance_id} could not be stopped ({exc}): it "
                                        "could launch nodes while they are terminated") from exc
        if clock() >= deadline:
            raise TeardownError(f"the head node {fleet.head_instance_id} is still {state} after "
                                f"{fleet.timeout_seconds:.0f} s of stopping")
        sleep(fleet.poll_seconds)


def _state(ec2: Any, instance_id: str) -> str | None:
    from botocore.exceptions import ClientError

    try:
        reservations = ec2.describe_instances(InstanceIds=[instance_id])["Reservations"]
    except ClientError as exc:
        if exc.response["Error"]["Code"] in GONE_CODES:
            return None
        raise
    return next((i["State"]["Name"] for r in reservations for i in r["Instances"]), None)


def cluster_instances(ec2: Any, cluster: str, spare: Iterable[str] = ()) -> dict[str, str]:
    """Instances tagged with the cluster that still bill or may: instance id -> state. `spare` is left out (the head,
    which Pulumi deletes itself)."""
    spared = set(spare)
    found: dict[str, str] = {}
    pages = ec2.get_paginator("describe_instances").paginate(Filters=[
        {"Name": f"tag:{CLUSTER_TAG}", "Values": [cluster]},
        {"Name": "instance-state-name", "Values": list(LIVE_STATES)}])
    for page in pages:
        for reservation in page["Reservations"]:
            for instance in reservation["Instances"]:
                if instance["InstanceId"] not in spared:
                    found[instance["InstanceId"]] = instance["State"]["Name"]
    return found


def terminate(ec2: Any, instance_ids: list[str]) -> dict[str, str]:
    """Terminate the instances; returns those EC2 refused, with its reason. One call per batch; when a batch is
    refused (one protected instance fails the whole call), one call per instance, so the others still go."""
    from botocore.exceptions import ClientError

    refused: dict[str, str] = {}
    for start in range(0, len(instance_ids), TERMINATE_BATCH):
        batch = instance_ids[start:start + TERMINATE_BATCH]
        try:
            ec2.terminate_instances(InstanceIds=batch)
            continue
        except ClientError as exc:
            if len(batch) == 1:
                if exc.response["Error"]["Code"] not in GONE_CODES:
                    refused[batch[0]] = f"{exc.response['Error']['Code']}: {exc.response['Error']['Message']}"
                continue
        for instance in batch:
            refused |= terminate(ec2, [instance])
    return refused


def terminate_fleet(ec2: Any, fleet: Fleet, clock: Clock = time.monotonic, sleep: Sleep = time.sleep) -> list[str]:
    """Terminate every instance tagged with the cluster but the head, sweep after sweep, until sweeps have found none
    for `quiet_seconds` (an instance launched moments ago shows in a later sweep); within the step's time, or a
    TeardownError naming each instance left, its state and what EC2 said. Returns the instances terminated."""
    start = clock()
    deadline = start + fleet.timeout_seconds
    terminated: list[str] = []
    refused: dict[str, str] = {}
    last_seen = start
    while True:
        live = cluster_instances(ec2, fleet.cluster, spare=[fleet.head_instance_id])
        going = [i for i, state in live.items() if state != "shutting-down"]
        if going:
            log.info("terminating %d instance(s) of %s: %s", len(going), fleet.cluster, " ".join(sorted(going)))
            refused = terminate(ec2, going)
            terminated += [i for i in going if i not in refused and i not in terminated]
            denied = {i: why for i, why in refused.items() if why.startswith(DENIED_CODES)}
            if denied:
                raise TeardownError(f"may not terminate the instances of cluster {fleet.cluster}: " + ", ".join(
                    f"{i}: {why}" for i, why in sorted(denied.items())) + ". Destroy with credentials allowed "
                    "ec2:TerminateInstances on them, then run it again")
        if live:
            last_seen = clock()
        elif clock() - last_seen >= fleet.quiet_seconds:
            return terminated
        if clock() >= deadline:
            left = ", ".join(f"{i} ({state}{': ' + refused[i] if i in refused else ''})"
                             for i, state in sorted(live.items()))
            raise TeardownError(f"{len(live)} instance(s) of cluster {fleet.cluster} still not terminated after "
                                f"{fleet.timeout_seconds:.0f} s: {left}. Terminate them (`aws ec2 "
                                f"terminate-instances --instance-ids ...`; protected ones first `aws ec2 "
                                f"modify-instance-attribute --no-disable-api-termination`), then run destroy again")
        sleep(fleet.poll_seconds)


def delete_run_time_leftovers(ec2: Any, ssm: Any, fleet: Fleet) -> list[str]:
    """Delete what the cluster created at run time rather than Pulumi: the munge key parameter the head created, and
    the AMIs (with their snapshots) Image Builder baked for the stack, which it never deregisters. An AMI another
    cluster's instance runs from is kept and said. Returns one line per thing done."""
    from botocore.exceptions import ClientError

    done = []
    try:
        ssm.delete_parameter(Name=fleet.munge_key_parameter)
        done.append(f"deleted parameter {fleet.munge_key_parameter}")
    except ClientError as exc:
        if exc.response["Error"]["Code"] != "ParameterNotFound":
            raise
    images = ec2.describe_images(Owners=["self"], Filters=[{"Name": f"tag:{CLUSTER_TAG}", "Values": [fleet.cluster]}])
    for image in images["Images"]:
        users = [i["InstanceId"] for r in ec2.describe_instances(Filters=[
            {"Name": "image-id", "Values": [image["ImageId"]]},
            {"Name": "instance-state-name", "Values": list(LIVE_STATES)}])["Reservations"] for i in r["Instances"]
            if {"Key": CLUSTER_TAG, "Value": fleet.cluster} not in i.get("Tags", [])]
        if users:
            done.append(f"kept image {image['ImageId']} ({image.get('Name', '')}): other instances run from it: "
                        f"{' '.join(users)}")
            continue
        snapshots = [m["Ebs"]["SnapshotId"] for m in image.get("BlockDeviceMappings", [])
                     if m.get("Ebs", {}).get("SnapshotId")]
        # With its snapshots in the same call: once deregistered, the AMI is no longer found, nor are they by it.
        ec2.deregister_image(ImageId=image["ImageId"], DeleteAssociatedSnapshots=True)
        for snapshot in snapshots:  # what the call left (older APIs and stand-ins ignore the flag)
            try:
                ec2.delete_snapshot(SnapshotId=snapshot)
            except ClientError as exc:
                if exc.response["Error"]["Code"] != "InvalidSnapshot.NotFound":
                    raise
        done.append(f"deregistered image {image['ImageId']} ({image.get('Name', '')}), deleted "
                    f"{' '.join(snapshots) or 'no snapshot'}")
    return done


def tear_down_fleet(fleet: Fleet, ec2: Any, ssm: Any, channel: HeadChannel, clock: Clock = time.monotonic,
                    sleep: Sleep = time.sleep) -> list[str]:
    """The whole step, in order: quiesce the head, terminate the fleet, delete the run-time leftovers."""
    said = [quiesce_head(channel, ec2, fleet, clock, sleep)]
    terminated = terminate_fleet(ec2, fleet, clock, sleep)
    said.append(f"terminated {len(terminated)} instance(s) of {fleet.cluster}"
                + (f": {' '.join(sorted(terminated))}" if terminated else ""))
    said += delete_run_time_leftovers(ec2, ssm, fleet)
    for line in said:
        log.info("%s", line)
    return said


def flush_to_s3(fsx: Any, file_system_id: str, timeout_seconds: float = 6 * 3600.0, poll_seconds: float = 15.0,
                clock: Clock = time.monotonic, sleep: Sleep = time.sleep) -> str:
    """Export what the file system holds and S3 does not yet (an EXPORT_TO_REPOSITORY task over the whole namespace)
    and wait for it. A task already running (FSx runs one at a time) is waited out first. A failed, cancelled or
    unfinished export is a TeardownError: the file system must not be deleted with data only it holds."""
    from botocore.exceptions import ClientError

    deadline = clock() + timeout_seconds
    while True:
        try:
            task = fsx.create_data_repository_task(Type="EXPORT_TO_REPOSITORY", FileSystemId=file_system_id,
                                                   Report={"Enabled": False})["DataRepositoryTask"]
            break
        except ClientError as exc:
            code, message = exc.response["Error"]["Code"], exc.response["Error"]["Message"]
            if code == "FileSystemNotFound":
                return f"file system {file_system_id} is gone already: nothing to export"
            if code != "DataRepositoryTaskExecuting" or clock() >= deadline:
                raise TeardownError(f"could not export {file_system_id} to S3 ({code}: {message}); the file system "
                                    "is not deleted. Fix the cause and run destroy again") from exc
            log.info("%s: another data repository task is running; waiting to start the export", file_system_id)
            sleep(poll_seconds)
    task_id = task["TaskId"]
    while True:
        task = fsx.describe_data_repository_tasks(TaskIds=[task_id])["DataRepositoryTasks"][0]
        lifecycle, status = task["Lifecycle"], task.get("Status", {})
        if lifecycle == "SUCCEEDED":
            return (f"exported {file_system_id} to S3 ({task_id}: {status.get('SucceededCount', 0)} of "
                    f"{status.get('TotalCount', 0)} files)")
        if lifecycle in ("FAILED", "CANCELED", "CANCELING"):
            why = task.get("FailureDetails", {}).get("Message", "no failure details")
            raise TeardownError(f"the export of {file_system_id} to S3 ({task_id}) {lifecycle}: {why} "
                                f"({status.get('FailedCount', 0)} of {status.get('TotalCount', 0)} files failed); the "
                                "file system is not deleted. Fix the cause and run destroy again")
        if clock() >= deadline:
            raise TeardownError(f"the export of {file_system_id} to S3 ({task_id}) is still {lifecycle} after "
                                f"{timeout_seconds / 3600:.1f} h; the file system is not deleted. Run destroy again "
                                "when it has finished")
        log.info("%s: export %s %s, %s of %s files", file_system_id, task_id, lifecycle,
                 status.get("SucceededCount", 0), status.get("TotalCount", "?"))
        sleep(poll_seconds)
