"""`pulumi destroy`'s own steps (gpucluster.aws.teardown, components/teardown.py) against a moto server: the fleet the
resume program launched is terminated and awaited, including instances launched while the step runs; a refused
termination fails the step with the instance's id; run-time leftovers go; the file system's flush is awaited and a
failed one stops the deletion (FSx data repository tasks: recorded answers, moto has none). Under the mock runtime:
the steps' dependencies make Pulumi delete them first. The serialised provider, as the plan stores it in the state,
runs its delete in a fresh process."""

from __future__ import annotations

import base64
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.stub import Stubber

from conftest import ROOT, ClientFactory, of_type, planned, reset_moto
from gpucluster.aws import teardown
from gpucluster.contract.settings import CLUSTER_TAG, POOL_TAG, STACK_TAG, ClusterSettings, PoolSettings
from gpucluster.node.resume import resume
from gpucluster.node.slurm_control import SlurmControl
from gpucluster.plan import Declared, planned_id

CLUSTER = "gpucluster-t1"
MUNGE = f"/gpucluster/{CLUSTER}/munge-key"
AMI = "ami-12c6146b"  # one of moto's own images


@pytest.fixture
def aws(moto_url: str) -> ClientFactory:
    """Clients on an empty account (moto's backends are reset per test)."""
    reset_moto(moto_url)

    def client(service: str) -> Any:
        return boto3.client(service, region_name="us-east-1", endpoint_url=moto_url, aws_access_key_id="t",
                            aws_secret_access_key="t")
    return client


class RecordingHead:
    """Stands in for Session Manager's Run Command, which needs an SSM agent on a real instance (the local cluster's
    test, tests/integration/test_destroy.py, runs the same script on a real slurmctld). Records the script and when
    it ran among the EC2 calls."""

    def __init__(self, events: list[str], reachable: bool = True):
        self.events, self.reachable = events, reachable
        self.scripts: list[str] = []

    def run(self, script: str) -> str:
        self.events.append("quiesce")
        if not self.reachable:
            raise teardown.HeadUnreachable("its SSM agent is not online (ConnectionLost)")
        self.scripts.append(script)
        return "partitions down: p5-od p5-spot"


class Clock:
    """Time that passes only when the step sleeps: waits without waiting."""

    def __init__(self, on_sleep: Callable[[int], None] | None = None):
        self.now, self.sleeps, self.on_sleep = 0.0, 0, on_sleep

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.sleeps += 1
        if self.on_sleep:
            self.on_sleep(self.sleeps)


def world(aws: ClientFactory, cluster: str = CLUSTER) -> tuple[ClusterSettings, str]:
    """The cluster's network and pool templates as `pulumi up` leaves them, its head instance, and settings for the
    resume program with a registry of its own."""
    ec2 = aws("ec2")
    tags = {CLUSTER_TAG: cluster, STACK_TAG: "t1"}
    vpc = ec2.create_vpc(CidrBlock="10.0.0.0/16")["Vpc"]["VpcId"]
    subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.0.0.0/24", AvailabilityZone="us-east-1a")["Subnet"]["SubnetId"]
    pools = {}
    for name, market in (("p5-od", "on-demand"), ("p5-spot", "spot")):
        created = ec2.create_launch_template(LaunchTemplateName=f"{cluster}-{name}", LaunchTemplateData={
            "ImageId": AMI, "InstanceType": "p5.48xlarge", "TagSpecifications": [{"ResourceType": "instance", "Tags": [
                {"Key": k, "Value": v} for k, v in {**tags, POOL_TAG: name}.items()]}]})
        template = created["LaunchTemplate"]["LaunchTemplateId"]
        pools[name] = PoolSettings(name, template, subnet, "p5.48xlarge", market)
    head = ec2.run_instances(ImageId=AMI, InstanceType="m7i.large", MinCount=1, MaxCount=1, SubnetId=subnet,
                             TagSpecifications=[{"ResourceType": "instance", "Tags": [
                                 {"Key": k, "Value": v} for k, v in tags.items()]}])["Instances"][0]["InstanceId"]
    registry = Path(tempfile.mkdtemp(prefix="registry-")) / "instances.json"
    config = ClusterSettings(cluster=cluster, region="us-east-1", pools=pools, log_file="/dev/null",
                             registry_file=str(registry))
    return config, head


def states(ec2: Any) -> dict[str, str]:
    return {i["InstanceId"]: i["State"]["Name"]
            for r in ec2.describe_instances()["Reservations"] for i in r["Instances"]}


def test_the_fleet_goes_first_including_instances_launched_while_the_step_runs(aws: ClientFactory) -> None:
    ec2, ssm = aws("ec2"), aws("ssm")
    config, head = world(aws)
    slurm = _Slurm()
    first = resume(config, ec2, slurm, "p5-od-[1-2],p5-spot-1").launched
    assert len(first) == 3
    # Another cluster's instance in the same account is not this step's business.
    other = ec2.run_instances(ImageId=AMI, InstanceType="g6.xlarge", MinCount=1, MaxCount=1, TagSpecifications=[
        {"ResourceType": "instance", "Tags": [{"Key": CLUSTER_TAG, "Value": "gpucluster-other"}]}],
    )["Instances"][0]["InstanceId"]
    ssm.put_parameter(Name=MUNGE, Type="SecureString", Value="key")
    events: list[str] = []
    ec2.meta.events.register("before-call.ec2.StopInstances", lambda **kw: events.append("stop head"))
    ec2.meta.events.register("before-call.ec2.TerminateInstances", lambda **kw: events.append("terminate"))
    late: dict[str, str] = {}

    def resume_in_flight(sleeps: int) -> None:
        # A resume program that was mid-CreateFleet when the partitions closed: its instance shows after the first
        # sweep terminated the others.
        if sleeps == 1:
            late.update(resume(config, ec2, slurm, "p5-spot-2").launched)

    clock = Clock(resume_in_flight)
    channel = RecordingHead(events)
    fleet = teardown.Fleet(CLUSTER, head, MUNGE, timeout_seconds=60, poll_seconds=5)
    said = teardown.tear_down_fleet(fleet, ec2, ssm, channel, clock=clock, sleep=clock.sleep)

    # The partitions close and the head stops before anything is terminated.
    assert events[:3] == ["quiesce", "stop head", "terminate"], events
    assert channel.scripts == [teardown.quiesce_script()]
    after = states(ec2)
    assert late and all(after[i] == "terminated" for i in [*first.values(), *late.values()]), after
    assert after[head] == "stopped" and after[other] == "running"  # the head is Pulumi's to delete
    assert not teardown.cluster_instances(ec2, CLUSTER, spare=[head])
    assert clock.now >= fleet.quiet_seconds  # it kept sweeping for the quiet period after the last instance seen
    assert f"terminated 4 instance(s) of {CLUSTER}" in " ".join(said)
    assert f"deleted parameter {MUNGE}" in said
    assert not ssm.describe_parameters()["Parameters"]


def test_an_instance_that_refuses_fails_the_step_with_its_id(aws: ClientFactory) -> None:
    ec2, ssm = aws("ec2"), aws("ssm")
    config, head = world(aws)
    launched = resume(config, ec2, _Slurm(), "p5-od-[1-2]").launched
    protected = launched["p5-od-1"]
    ec2.modify_instance_attribute(InstanceId=protected, DisableApiTermination={"Value": True})
    clock = Clock()
    fleet = teardown.Fleet(CLUSTER, head, MUNGE, timeout_seconds=30, poll_seconds=5)
    with pytest.raises(teardown.TeardownError) as failed:
        teardown.tear_down_fleet(fleet, ec2, ssm, RecordingHead([]), clock=clock, sleep=clock.sleep)
    message = str(failed.value)
    assert protected in message and "OperationNotPermitted" in message and "running" in message, message
    assert launched["p5-od-2"] not in message
    assert clock.now >= 30  # it waited out its bound, retrying
    after = states(ec2)
    assert after[protected] == "running" and after[launched["p5-od-2"]] == "terminated"  # the others still went


def test_a_head_that_cannot_close_its_partitions_is_stopped_before_the_sweep(aws: ClientFactory) -> None:
    ec2, ssm = aws("ec2"), aws("ssm")
    config, head = world(aws)
    resume(config, ec2, _Slurm(), "p5-od-1")
    events: list[str] = []
    ec2.meta.events.register("before-call.ec2.StopInstances", lambda **kw: events.append("stop head"))
    ec2.meta.events.register("before-call.ec2.TerminateInstances", lambda **kw: events.append("terminate"))
    clock = Clock()
    said = teardown.tear_down_fleet(teardown.Fleet(CLUSTER, head, MUNGE, timeout_seconds=60), ec2, ssm,
                                    RecordingHead(events, reachable=False), clock=clock, sleep=clock.sleep)
    assert events[:3] == ["quiesce", "stop head", "terminate"]
    assert states(ec2)[head] == "stopped"
    assert said[0] == (f"head {head} could not close its partitions (its SSM agent is not online (ConnectionLost)); "
                       "stopped")


def test_a_head_already_gone_does_not_stop_the_teardown(aws: ClientFactory) -> None:
    ec2, ssm = aws("ec2"), aws("ssm")
    config, head = world(aws)
    launched = resume(config, ec2, _Slurm(), "p5-od-1").launched
    ec2.terminate_instances(InstanceIds=[head])
    clock = Clock()
    said = teardown.tear_down_fleet(teardown.Fleet(CLUSTER, head, MUNGE), ec2, ssm, RecordingHead([], reachable=False),
                                    clock=clock, sleep=clock.sleep)
    assert said[0].endswith("; terminated") and states(ec2)[launched["p5-od-1"]] == "terminated"


def test_credentials_that_may_not_terminate_fail_at_once() -> None:
    ec2 = boto3.client("ec2", region_name="us-east-1", aws_access_key_id="t", aws_secret_access_key="t")
    stub = Stubber(ec2)
    stub.add_response("describe_instances", {"Reservations": [{"Instances": [
        {"InstanceId": "i-0123456789abcdef0", "State": {"Name": "running", "Code": 16}}]}]})
    stub.add_client_error("terminate_instances", "UnauthorizedOperation", "You are not authorized",
                          expected_params={"InstanceIds": ["i-0123456789abcdef0"]})
    clock = Clock()
    with stub, pytest.raises(teardown.TeardownError, match="may not terminate the instances of cluster .*"
                             "i-0123456789abcdef0: UnauthorizedOperation"):
        teardown.terminate_fleet(ec2, teardown.Fleet(CLUSTER, "i-0head", MUNGE), clock=clock, sleep=clock.sleep)
    assert clock.sleeps == 0  # no quarter of an hour of retries


def test_the_stacks_images_go_unless_another_cluster_runs_from_them(aws: ClientFactory) -> None:
    ec2, ssm = aws("ec2"), aws("ssm")
    _, head = world(aws)
    tags = [{"Key": CLUSTER_TAG, "Value": CLUSTER}, {"Key": "gpucluster:image", "Value": "compute-nvidia"}]
    images = {}
    for name in ("baked", "shared"):
        builder = ec2.run_instances(ImageId=AMI, InstanceType="m7i.xlarge", MinCount=1, MaxCount=1)["Instances"][0]
        images[name] = ec2.create_image(InstanceId=builder["InstanceId"], Name=f"{CLUSTER}-{name}", TagSpecifications=[
            {"ResourceType": "image", "Tags": tags}])["ImageId"]
        ec2.terminate_instances(InstanceIds=[builder["InstanceId"]])
    snapshots = [m["Ebs"]["SnapshotId"] for m in ec2.describe_images(ImageIds=[images["baked"]])["Images"][0][
        "BlockDeviceMappings"] if "Ebs" in m]
    user = ec2.run_instances(ImageId=images["shared"], InstanceType="g6.xlarge", MinCount=1, MaxCount=1,
                             TagSpecifications=[{"ResourceType": "instance", "Tags": [
                                 {"Key": CLUSTER_TAG, "Value": "gpucluster-other"}]}])["Instances"][0]["InstanceId"]
    said = teardown.delete_run_time_leftovers(ec2, ssm, teardown.Fleet(CLUSTER, head, MUNGE))
    left = {i["ImageId"] for i in ec2.describe_images(Owners=["self"])["Images"]}
    assert images["baked"] not in left and images["shared"] in left
    assert snapshots
    assert not {s["SnapshotId"] for s in ec2.describe_snapshots(OwnerIds=["self"])["Snapshots"]} & set(snapshots)
    assert any(images["shared"] in line and user in line for line in said), said


# --- the file system's flush ------------------------------------------------------------------------------------------
FS = "fs-0123456789abcdef0"
TASK = "task-0123456789abcdef0"


def task(lifecycle: str, **extra: object) -> dict[str, object]:
    return {"TaskId": TASK, "Lifecycle": lifecycle, "Type": "EXPORT_TO_REPOSITORY", "FileSystemId": FS,
            "CreationTime": dt.datetime(2026, 11, 30), **extra}


def stubbed_fsx() -> tuple[Any, Stubber]:
    fsx = boto3.client("fsx", region_name="us-east-1", aws_access_key_id="t", aws_secret_access_key="t")
    return fsx, Stubber(fsx)


EXPORT = {"Type": "EXPORT_TO_REPOSITORY", "FileSystemId": FS, "Report": {"Enabled": False}}


def test_the_flush_exports_and_waits_for_the_task() -> None:
    fsx, stub = stubbed_fsx()
    stub.add_client_error("create_data_repository_task", "DataRepositoryTaskExecuting",
                          "an auto-export task is running", expected_params=EXPORT)
    stub.add_response("create_data_repository_task", {"DataRepositoryTask": task("PENDING")}, EXPORT)
    stub.add_response("describe_data_repository_tasks", {"DataRepositoryTasks": [task("EXECUTING")]},
                      {"TaskIds": [TASK]})
    stub.add_response("describe_data_repository_tasks", {"DataRepositoryTasks": [task(
        "SUCCEEDED", Status={"TotalCount": 12, "SucceededCount": 12, "FailedCount": 0})]}, {"TaskIds": [TASK]})
    clock = Clock()
    with stub:
        said = teardown.flush_to_s3(fsx, FS, timeout_seconds=600, poll_seconds=15, clock=clock, sleep=clock.sleep)
    stub.assert_no_pending_responses()
    assert clock.sleeps == 2  # once for the running task, once while the export ran
    assert said == f"exported {FS} to S3 ({TASK}: 12 of 12 files)"


def test_a_failed_flush_stops_the_deletion_with_its_cause() -> None:
    fsx, stub = stubbed_fsx()
    stub.add_response("create_data_repository_task", {"DataRepositoryTask": task("PENDING")}, EXPORT)
    stub.add_response("describe_data_repository_tasks", {"DataRepositoryTasks": [task(
        "FAILED", FailureDetails={"Message": "Access denied to s3://gpucluster-t1-data"},
        Status={"TotalCount": 5, "SucceededCount": 3, "FailedCount": 2})]}, {"TaskIds": [TASK]})
    clock = Clock()
    with stub, pytest.raises(teardown.TeardownError) as failed:
        teardown.flush_to_s3(fsx, FS, clock=clock, sleep=clock.sleep)
    assert "FAILED: Access denied to s3://gpucluster-t1-data (2 of 5 files failed); the file system is not deleted" \
        in str(failed.value)


def test_a_flush_that_outlasts_its_bound_stops_the_deletion() -> None:
    fsx, stub = stubbed_fsx()
    stub.add_response("create_data_repository_task", {"DataRepositoryTask": task("PENDING")}, EXPORT)
    for _ in range(3):
        stub.add_response("describe_data_repository_tasks", {"DataRepositoryTasks": [task("EXECUTING")]},
                          {"TaskIds": [TASK]})
    clock = Clock()
    with stub, pytest.raises(teardown.TeardownError, match="still EXECUTING after"):
        teardown.flush_to_s3(fsx, FS, timeout_seconds=30, poll_seconds=15, clock=clock, sleep=clock.sleep)


# --- the steps in the Pulumi program ----------------------------------------------------------------------------------
TEAM_A = ROOT / "stacks" / "Pulumi.team-a.yaml"


def _by_urn(declared: Sequence[Declared]) -> dict[str, Declared]:
    return {d.urn: d for d in declared}


def test_pulumi_deletes_the_fleet_step_before_what_the_fleet_uses() -> None:
    """Pulumi deletes a resource before its dependencies: the step must depend on every resource the nodes use."""
    stack, declared = planned(TEAM_A)
    (step,) = of_type(declared, "dynamic/gpucluster:FleetTeardown")
    depends = {_by_urn(declared)[urn].type for urn in step.dependencies}
    for needed in ("ec2/vpc:Vpc", "ec2/subnet:Subnet", "ec2/securityGroup:SecurityGroup",
                   "ec2/placementGroup:PlacementGroup", "ec2/launchTemplate:LaunchTemplate", "ec2/instance:Instance",
                   "ec2/natGateway:NatGateway", "dynamic/gpucluster:LustreExport", "budgets/budget:Budget",
                   "iam/role:Role"):
        assert any(t.endswith(needed) for t in depends), needed
    # Every placement group and template of every pool, and the head instance itself.
    for kind in ("ec2/placementGroup:PlacementGroup", "ec2/launchTemplate:LaunchTemplate", "ec2/instance:Instance"):
        assert {d.urn for d in of_type(declared, kind)} <= set(step.dependencies), kind
    (head,) = of_type(declared, "ec2/instance:Instance")
    assert step.inputs["head_instance_id"] == planned_id(head, stack.region)  # the head is spared, not swept
    assert step.inputs["cluster"] == stack.cluster_name and step.inputs["region"] == stack.region
    assert step.inputs["munge_key_parameter"] == f"/gpucluster/{stack.cluster_name}/munge-key"
    assert not step.retain_on_delete
    # What destroy keeps, said by the step as it runs (and by the plan).
    assert step.inputs["kept"] == ["the stack's S3 bucket (the data written under /fsx, exported): S3 Standard "
                                   "$0.023/GB-month of what it holds"]


def test_the_flush_runs_before_the_association_and_the_file_system_go() -> None:
    _, declared = planned(TEAM_A)
    (flush,) = of_type(declared, "dynamic/gpucluster:LustreExport")
    (association,) = of_type(declared, "fsx/dataRepositoryAssociation:DataRepositoryAssociation")
    (fs,) = of_type(declared, "fsx/lustreFileSystem:LustreFileSystem")
    assert association.urn in flush.dependencies and fs.urn in flush.dependencies
    assert flush.inputs["file_system_id"].startswith("fs-")
    # team-b imports from the team's own bucket only: nothing is exported, so nothing to flush.
    _, team_b = planned(ROOT / "stacks" / "Pulumi.team-b.yaml")
    assert not of_type(team_b, "dynamic/gpucluster:LustreExport")


def test_a_step_is_never_replaced_and_keeps_its_inputs_for_delete() -> None:
    from components.teardown import FleetTeardownProvider

    provider = FleetTeardownProvider()
    olds = {"__provider": "x", "cluster": "c", "head_instance_id": "i-1"}
    news = {"__provider": "x", "cluster": "c", "head_instance_id": "i-2"}
    diff = provider.diff("c-fleet", olds, news)
    assert diff.changes is True and diff.replaces == [] and diff.delete_before_replace is False
    assert provider.diff("c-fleet", olds, dict(olds)).changes is False
    # What update returns is what delete gets: the new head's id.
    assert provider.update("c-fleet", olds, news).outs == {"cluster": "c", "head_instance_id": "i-2"}


def test_the_serialised_provider_tears_the_fleet_down_in_a_fresh_process(aws: ClientFactory, moto_url: str) -> None:
    """What `pulumi destroy` does with the state: unpickle the provider the program stored and call its delete, in a
    process of its own started from the project directory, with the credentials of the environment."""
    stack, declared = planned(TEAM_A)
    (step,) = of_type(declared, "dynamic/gpucluster:FleetTeardown")
    config, head = world(aws, stack.cluster_name)
    ec2 = aws("ec2")
    launched = resume(config, ec2, _Slurm(), "p5-od-[1-2]").launched
    props = {**{k: v for k, v in step.inputs.items()}, "head_instance_id": head, "timeout_seconds": 60,
             "quiet_seconds": 2}
    program = ("import base64, json, sys, dill\n"
               "props = json.loads(sys.stdin.read())\n"
               "provider = dill.loads(base64.b64decode(props['__provider']))\n"
               "provider.delete(props['name'], props)\n")
    env = {**os.environ, "AWS_ENDPOINT_URL": moto_url, "AWS_ACCESS_KEY_ID": "t", "AWS_SECRET_ACCESS_KEY": "t"}
    env.pop("PYTHONPATH", None)
    done = subprocess.run([sys.executable, "-c", program], input=json.dumps(props), cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    after = states(ec2)
    assert all(after[i] == "terminated" for i in launched.values()), after
    # moto has no Session Manager agents: the head cannot run the script, so the step stopped it first.
    assert after[head] == "stopped"
    assert "gpucluster teardown: terminated 2 instance(s)" in done.stderr, done.stderr[-3000:]
    assert base64.b64decode(step.inputs["__provider"]).startswith(b"\x80")  # a pickle, by reference
    assert b"components.teardown" in base64.b64decode(step.inputs["__provider"])


class _Slurm(SlurmControl):
    """The resume program tells Slurm each node's instance; nothing listens here."""

    def __init__(self) -> None:
        pass

    def _run(self, *args: str) -> str:
        if args[:2] == ("show", "hostnames"):
            return "\n".join(args[2].split(","))
        return ""


def test_the_steps_urns_never_change() -> None:
    """A step whose URN changes is deleted by the next `pulumi up`, and its delete terminates the running fleet: a
    rename here must be a deliberate migration (`pulumi state rename`), never a refactoring's side effect."""
    _, declared = planned(TEAM_A)
    assert {d.urn for d in declared if d.type.startswith("pulumi-python:dynamic/gpucluster:")} == {
        "urn:pulumi:team-a::gpucluster::gpucluster:teardown:Teardown$pulumi-python:dynamic/gpucluster:FleetTeardown"
        "::gpucluster-team-a-fleet",
        "urn:pulumi:team-a::gpucluster::gpucluster:storage:Storage$pulumi-python:dynamic/gpucluster:LustreExport"
        "::gpucluster-team-a-flush",
    }


def test_a_flush_can_be_skipped_by_the_destroying_operator() -> None:
    """GPUCLUSTER_SKIP_FLUSH=1: a file system that can no longer export (FAILED, a broken bucket policy) must not
    keep destroy failing for ever. No FSx call is made (the endpoint would refuse every one)."""
    from components.teardown import SKIP_FLUSH

    env = {**os.environ, SKIP_FLUSH: "1", "AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_ACCESS_KEY_ID": "t",
           "AWS_SECRET_ACCESS_KEY": "t"}
    program = ("from components.teardown import LustreExportProvider\n"
               "LustreExportProvider().delete('f', {'region': 'us-east-1', 'file_system_id': 'fs-0123456789abcdef0', "
               "'timeout_seconds': 5})\n")
    done = subprocess.run([sys.executable, "-c", program], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"{SKIP_FLUSH}=1: fs-0123456789abcdef0 is deleted without exporting" in done.stderr
