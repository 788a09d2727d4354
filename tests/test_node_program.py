"""The node programs' decisions, against in-process moto and a recording stand-in for scontrol."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import boto3
import pytest
from botocore.stub import Stubber
from moto import mock_aws

from conftest import ROOT
from gpucluster.contract import hostlist, scontrol

sys.path.insert(0, str(ROOT / "gpucluster" / "node"))
import gpucluster_node as node  # noqa: E402


class FakeSlurm(node.Slurm):
    """Records what the programs ask of Slurm; expands simple lists; serves a node table for the reconciler."""

    def __init__(self, table: list[dict[str, str]] | None = None):
        self.calls: list[tuple[str, ...]] = []
        self.table = table or []

    def _run(self, *args: str) -> str:
        self.calls.append(args)
        if args[:2] == ("show", "hostnames"):
            return "\n".join(args[2].split(","))
        if args[:2] == ("show", "nodes"):
            return "\n".join(" ".join(f"{k}={v}" for k, v in n.items()) for n in self.table)
        return ""

    def updates(self) -> list[tuple[str, ...]]:
        return [c for c in self.calls if c[0] == "update"]

    jobs: dict[str, list[str]] = {}  # node -> its running jobs

    def jobs_on(self, node_name: str) -> list[str]:
        return self.jobs.get(node_name, [])

    def signal_job(self, job: str, signal_name: str) -> None:
        self.calls.append(("signal", job, signal_name))


@pytest.fixture
def ec2():  # type: ignore[no-untyped-def]
    with mock_aws():
        yield boto3.client("ec2", region_name="us-east-1")


def make_config(ec2, **overrides: object) -> node.ClusterSettings:  # type: ignore[no-untyped-def]
    """Two pools of p5 (spot and on-demand) in moto; the registry in a fresh directory."""
    overrides.setdefault("registry_file", str(Path(tempfile.mkdtemp(prefix="registry-")) / "instances.json"))
    vpc = ec2.create_vpc(CidrBlock="10.0.0.0/16")["Vpc"]["VpcId"]
    subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.0.0.0/24", AvailabilityZone="us-east-1a")["Subnet"]["SubnetId"]
    template = ec2.create_launch_template(LaunchTemplateName="lt", LaunchTemplateData={
        "ImageId": "ami-12c6146b", "InstanceType": "p5.48xlarge", "TagSpecifications": [
            {"ResourceType": "instance", "Tags": [{"Key": node.POOL_TAG, "Value": "p5"}]}]})["LaunchTemplate"]["LaunchTemplateId"]
    pools = {name: node.PoolSettings(name, template, subnet, "p5.48xlarge", market)
             for name, market in (("p5-spot", "spot"), ("p5-od", "on-demand"))}
    return node.ClusterSettings(cluster="c1", region="us-east-1", pools=pools, log_file="/dev/null", **overrides)  # type: ignore[arg-type]


def live(config: node.ClusterSettings, ec2) -> dict[str, str]:  # type: ignore[no-untyped-def]
    """node -> instance, for the registry's nodes whose instance runs."""
    running = node.cluster_instances(config, ec2)
    return {n: e["instance"] for n, e in node.read_registry(config).instances.items() if e["instance"] in running}


def test_resume_launches_and_records_each_node_without_a_call_per_instance(ec2) -> None:  # type: ignore[no-untyped-def]
    config, slurm = make_config(ec2), FakeSlurm()
    calls: list[str] = []
    ec2.meta.events.register("before-call.ec2", lambda model, **kw: calls.append(model.name))
    result = node.resume(config, ec2, slurm, "p5-od-[1-2],p5-spot-3")
    assert calls == ["CreateFleet", "CreateFleet"]  # one per pool; no tags, no DescribeInstances
    assert set(result.launched) == {"p5-od-1", "p5-od-2", "p5-spot-3"} and not result.failed
    assert live(config, ec2) == result.launched  # the registry knows each instance as its node
    spot = ec2.describe_instances(InstanceIds=[result.launched["p5-spot-3"]])["Reservations"][0]["Instances"][0]
    assert spot.get("InstanceLifecycle") == "spot"
    # Slurm learns each node's instance in one call; the instance finds its node by it.
    assert slurm.updates() == [("update", "nodename=p5-od-1,p5-od-2,p5-spot-3",
                                "nodehostname=" + ",".join(result.launched[n] for n in ("p5-od-1", "p5-od-2", "p5-spot-3")))]


def test_resume_keeps_a_nodes_live_instance(ec2) -> None:  # type: ignore[no-untyped-def]
    """Slurm may resume a node again (a repeated power up, a restarted controller): no second instance for it."""
    config = make_config(ec2)
    first = node.resume(config, ec2, FakeSlurm(), "p5-od-1").launched
    again = node.resume(config, ec2, FakeSlurm(), "p5-od-[1-2]").launched
    assert again["p5-od-1"] == first["p5-od-1"] and len(node.cluster_instances(config, ec2)) == 2


def test_best_effort_batches_respect_the_batch_size(ec2) -> None:  # type: ignore[no-untyped-def]
    config = make_config(ec2, batch_size=2, all_or_nothing=False)
    calls = []
    original = ec2.create_fleet
    ec2.create_fleet = lambda **kw: calls.append(kw["TargetCapacitySpecification"]["TotalTargetCapacity"]) or original(**kw)
    node.resume(config, ec2, FakeSlurm(), "p5-od-[1-5]")
    assert calls == [2, 2, 1]


def resume_file(tmp_path: Path, jobs: dict[int, str]) -> str:
    """SLURM_RESUME_FILE as Slurm 23.02 and later write it."""
    path = tmp_path / "resume.json"
    path.write_text(json.dumps({"all_nodes_resume": ",".join(jobs.values()), "jobs": [
        {"job_id": job, "nodes_alloc": nodes, "nodes_resume": nodes, "partition": "p", "oversubscribe": "OK"}
        for job, nodes in jobs.items()]}))
    return str(path)


def test_a_job_is_never_split_and_single_node_jobs_share_calls(ec2, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    config = make_config(ec2, batch_size=2)
    sent = []
    original = ec2.create_fleet
    ec2.create_fleet = lambda **kw: sent.append(kw) or original(**kw)
    jobs = {7: "p5-od-[1-3]", 8: "p5-od-4", 9: "p5-od-5", 10: "p5-od-6"}
    node.resume(config, ec2, FakeSlurm(), "p5-od-[1-6]", resume_file(tmp_path, jobs))
    shapes = [(kw["TargetCapacitySpecification"]["TotalTargetCapacity"], kw["OnDemandOptions"].get("MinTargetCapacity"))
              for kw in sent]
    # Job 7's three nodes in one all-or-nothing call, over the batch size; the single-node jobs packed best effort.
    assert shapes == [(3, 3), (2, None), (1, None)]


def refuse_market(ec2, market: str, code: str = "InsufficientInstanceCapacity") -> None:  # type: ignore[no-untyped-def]
    """EC2 answers an instant fleet of `market` with no instance and the error, as it does when it has no room."""
    original = ec2.create_fleet

    def create_fleet(**kw):  # type: ignore[no-untyped-def]
        if kw["TargetCapacitySpecification"]["DefaultTargetCapacityType"] == market:
            return {"FleetId": "fleet-1", "Instances": [], "Errors": [{"ErrorCode": code, "ErrorMessage": "no room"}]}
        return original(**kw)

    ec2.create_fleet = create_fleet


def test_a_resume_file_of_a_manual_power_up_has_no_jobs(ec2, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """`scontrol update state=power_up` (the reconciler's, for always-on nodes): Slurm writes an empty job list, and
    null for fields without a value."""
    config = make_config(ec2)
    path = tmp_path / "resume.json"
    path.write_text(json.dumps({"all_nodes_resume": "p5-od-[1-2]", "jobs": [
        {"job_id": 5, "nodes_alloc": None, "nodes_resume": None, "extra": None, "features": None}]}))
    assert node.job_nodes(config, ["p5-od-1", "p5-od-2"], str(path)) == {"5": []}
    path.write_text(json.dumps({"all_nodes_resume": "p5-od-[1-2]", "jobs": []}))
    result = node.resume(config, ec2, FakeSlurm(), "p5-od-[1-2]", str(path))
    assert set(result.launched) == {"p5-od-1", "p5-od-2"}


def test_two_coalesced_jobs_succeed_or_fail_on_their_own(ec2, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Slurm resumes the nodes of two jobs in one call; spot has no room. The spot job's nodes go DOWN (it is
    requeued); the on-demand job's nodes are launched."""
    config, slurm = make_config(ec2), FakeSlurm()
    refuse_market(ec2, "spot")
    result = node.resume(config, ec2, slurm, "p5-od-[1-2],p5-spot-[1-2]",
                         resume_file(tmp_path, {11: "p5-spot-[1-2]", 12: "p5-od-[1-2]"}))
    assert set(result.launched) == {"p5-od-1", "p5-od-2"} and set(live(config, ec2)) == {"p5-od-1", "p5-od-2"}
    assert set(result.failed) == {"p5-spot-1", "p5-spot-2"}
    (down,) = [c for c in slurm.updates() if "state=down" in c]
    assert down[1] == "nodename=p5-spot-1,p5-spot-2"


def test_a_job_across_two_pools_gets_all_its_nodes_or_none(ec2, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A partition with a fallback pool can give one job nodes of two pools: all of them, or none."""
    config, slurm = make_config(ec2), FakeSlurm()
    refuse_market(ec2, "spot")
    result = node.resume(config, ec2, slurm, "p5-od-1,p5-spot-1", resume_file(tmp_path, {13: "p5-od-1,p5-spot-1"}))
    assert not result.launched and not node.cluster_instances(config, ec2) and not live(config, ec2)
    assert set(result.failed) == {"p5-od-1", "p5-spot-1"}


def test_all_or_nothing_terminates_a_partial_fleet(ec2) -> None:  # type: ignore[no-untyped-def]
    config, slurm = make_config(ec2), FakeSlurm()
    real = ec2.create_fleet

    def partial(**kw):  # type: ignore[no-untyped-def]
        kw["TargetCapacitySpecification"]["TotalTargetCapacity"] = 1  # EC2 found room for one of two
        reply = real(**kw)
        reply["Errors"] = [{"ErrorCode": "InsufficientInstanceCapacity", "ErrorMessage": "no room"}]
        return reply

    ec2.create_fleet = partial
    result = node.resume(config, ec2, slurm, "p5-od-1,p5-od-2")
    assert not result.launched and set(result.failed) == {"p5-od-1", "p5-od-2"}
    assert not node.cluster_instances(config, ec2)  # the one that did launch was terminated
    (down,) = slurm.updates()
    assert down[:3] == ("update", "nodename=p5-od-1,p5-od-2", "state=down")
    assert down[3] == "reason=gpucluster: capacity: InsufficientInstanceCapacity: no room"


@pytest.mark.parametrize("code,kind", [
    ("VcpuLimitExceeded", "capacity"),
    ("UnauthorizedOperation", "launch failed"),  # the budget's deny action: lifted when the budget reopens
    ("InvalidLaunchTemplateId.NotFound", "configuration: fix the stack and pulumi up"),
])
def test_api_errors_mark_nodes_down_with_the_aws_reason(ec2, code: str, kind: str) -> None:  # type: ignore[no-untyped-def]
    config, slurm = make_config(ec2), FakeSlurm()
    with Stubber(ec2) as stub:
        stub.add_client_error("create_fleet", service_error_code=code, service_message="quota or template")
        result = node.resume(config, ec2, slurm, "p5-spot-1")
    assert result.failed == {"p5-spot-1": f"gpucluster: {kind}: {code}: quota or template"}
    assert slurm.updates()[0][2] == "state=down"


SPOT_ROLE_DOWN = ("gpucluster: launch failed: no spot service-linked role, run once: "
                  "aws iam create-service-linked-role --aws-service-name spot.amazonaws.com")


@pytest.mark.parametrize("code,message", [
    ("AuthFailure.ServiceLinkedRoleCreationNotPermitted",
     "The provided credentials do not have permission to create the service-linked role for EC2 Spot Instances."),
    ("AuthFailure", "The provided credentials do not have permission to create the service-linked role for EC2 Spot "
                    "Instances."),  # another code, the same message
])
def test_missing_spot_role_sets_nodes_down_with_the_command_that_fixes_it(ec2, code: str, message: str) -> None:  # type: ignore[no-untyped-def]
    config, slurm = make_config(ec2), FakeSlurm()
    with Stubber(ec2) as stub:
        stub.add_client_error("create_fleet", service_error_code=code, service_message=message, http_status_code=403)
        result = node.resume(config, ec2, slurm, "p5-spot-1,p5-spot-2")
    reason = f"{SPOT_ROLE_DOWN} ({code})"
    assert result.failed == {"p5-spot-1": reason, "p5-spot-2": reason} and len(reason) <= 200
    (down,) = slurm.updates()
    assert down == ("update", "nodename=p5-spot-1,p5-spot-2", "state=down", f"reason={reason}")
    # Retried with backoff, not held for a fix to the stack: the nodes come back once someone creates the role.
    assert not reason.startswith(node.CONFIGURATION_PREFIX)


def test_missing_spot_role_in_an_instant_fleets_errors(ec2) -> None:  # type: ignore[no-untyped-def]
    """An instant fleet may answer 200 with no instance and the error in Errors: the same reason."""
    config, slurm = make_config(ec2), FakeSlurm()
    ec2.create_fleet = lambda **kw: {"FleetId": "fleet-1", "Instances": [], "Errors": [
        {"ErrorCode": "AuthFailure.ServiceLinkedRoleCreationNotPermitted", "ErrorMessage": "The provided credentials "
         "do not have permission to create the service-linked role for EC2 Spot Instances.", "Lifecycle": "spot"}]}
    result = node.resume(config, ec2, slurm, "p5-spot-1")
    assert result.failed == {"p5-spot-1": f"{SPOT_ROLE_DOWN} (AuthFailure.ServiceLinkedRoleCreationNotPermitted)"}
    assert slurm.updates()[0][3].startswith(f"reason={SPOT_ROLE_DOWN}")


def test_unknown_pool_is_refused_not_launched(ec2) -> None:  # type: ignore[no-untyped-def]
    config, slurm = make_config(ec2), FakeSlurm()
    result = node.resume(config, ec2, slurm, "ghost-1")
    assert "no pool ghost" in result.failed["ghost-1"] and not node.cluster_instances(config, ec2)


def test_suspend_terminates_only_the_listed_nodes(ec2) -> None:  # type: ignore[no-untyped-def]
    config = make_config(ec2)
    node.resume(config, ec2, FakeSlurm(), "p5-od-1,p5-od-2")
    node.suspend(config, ec2, FakeSlurm(), "p5-od-1")
    assert set(live(config, ec2)) == {"p5-od-2"} and len(node.cluster_instances(config, ec2)) == 1


NOW = 1_800_000_000.0


def view(state: str, reason: str = "", user: str = "slurm", ago: float = 0, **known: object) -> node.NodeView:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(NOW - ago))
    record = {"NodeName": "p5-od-1", "State": state, **({"Reason": f"{reason} [{user}@{stamp}]"} if reason else {})}
    return node.NodeView.from_slurm(record, **known)  # type: ignore[arg-type]


S = node.Status


@pytest.mark.parametrize("case,expected", [
    (view("IDLE+CLOUD+POWERED_DOWN"), S.HEALTHY),  # off, no instance
    (view("IDLE+CLOUD+POWERED_DOWN", has_instance=True), S.LEFTOVER),  # off, but its instance runs
    (view("IDLE+CLOUD+POWERED_DOWN", always_on=True), S.POWER_UP),
    (view("ALLOCATED+CLOUD+POWERING_UP"), S.CHANGING),  # being launched: the resume program has it
    (view("IDLE+CLOUD+POWERING_DOWN", has_instance=True), S.CHANGING),
    (view("MIXED+CLOUD", has_instance=True), S.HEALTHY),
    (view("MIXED+CLOUD"), S.LOST),  # Slurm counts on it, its instance is gone
    (view("IDLE+CLOUD", always_on=True), S.LOST),
    (view("DOWN+CLOUD+POWERED_DOWN", "gpucluster: capacity: ICE: x", ago=601), S.RETRY),
    (view("DOWN+CLOUD+POWERED_DOWN", "gpucluster: capacity: ICE: x", ago=599), S.BACKING_OFF),
    (view("DOWN+CLOUD", "gpucluster: instance vanished", ago=1199, failures=1), S.BACKING_OFF),  # doubled
    (view("DOWN+CLOUD", "gpucluster: instance vanished", ago=1201, failures=1), S.RETRY),
    (view("DOWN+CLOUD", "gpucluster: instance vanished", ago=3601, failures=9), S.RETRY),  # capped at an hour
    (view("DOWN+CLOUD+NOT_RESPONDING", "Not responding", ago=700, has_instance=True), S.RETRY),  # Slurm's own
    (view("DOWN+CLOUD", "ResumeTimeout reached", ago=700), S.RETRY),
    (view("DOWN+CLOUD", "gpucluster: configuration: fix the stack and pulumi up: InvalidSubnetID.NotFound: x",
          ago=9999), S.NEEDS_FIX),
    # slurmctld appends its own reason to one already there ("old : new"): the configuration error still shows.
    (view("DOWN+CLOUD", "Not responding : gpucluster: configuration: fix the stack and pulumi up: X", ago=9999),
     S.NEEDS_FIX),
    (view("DOWN+CLOUD", "bad GPU, RMA", user="root", ago=9999), S.HELD),  # an admin's
    (view("IDLE+DRAIN+CLOUD", "Kill task failed", ago=9999, has_instance=True), S.HELD),
    (view("IDLE+CLOUD+FUTURE"), S.HEALTHY),
    # Drained by the cluster for a new instance (a spot warning, a rebalance recommendation): replaced once idle or
    # once EC2 took the instance; left to finish its jobs otherwise. The same words from an admin are an admin's hold.
    (view("ALLOCATED+DRAIN+CLOUD", "gpucluster: replace: rebalance recommendation", has_instance=True), S.DRAINING),
    (view("MIXED+DRAIN+CLOUD", "gpucluster: replace: spot interruption warning", has_instance=True), S.DRAINING),
    (view("IDLE+DRAIN+CLOUD", "gpucluster: replace: spot interruption warning", has_instance=True), S.REPLACE),
    (view("ALLOCATED+DRAIN+CLOUD", "gpucluster: replace: spot interruption warning"), S.REPLACE),  # reclaimed
    (view("IDLE+DRAIN+CLOUD", "gpucluster: replace: health: 7 of 8 GPUs", user="root", has_instance=True),
     S.REPLACE),  # the node's own health check drains as root
    (view("IDLE+DRAIN+CLOUD", "gpucluster: replace: spot interruption warning", user="alice", has_instance=True),
     S.HELD),
])
def test_classify(case: node.NodeView, expected: node.Status) -> None:
    assert node.classify(case, NOW, retry_base=600) is expected


def test_reconcile_acts_per_status(ec2) -> None:  # type: ignore[no-untyped-def]
    config = make_config(ec2, capacity_retry_seconds=600)
    launched = node.resume(config, ec2, FakeSlurm(), "p5-od-1,p5-od-2,p5-od-4").launched
    ec2.terminate_instances(InstanceIds=[launched["p5-od-4"]])  # a spot reclaim, say
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() - 700))
    table = [
        {"NodeName": "p5-od-1", "State": "IDLE+CLOUD+POWERED_DOWN"},  # Slurm thinks it is off: instance is leftover
        {"NodeName": "p5-od-2", "State": "ALLOCATED+CLOUD"},  # healthy
        {"NodeName": "p5-od-4", "State": "MIXED+CLOUD"},  # up in Slurm, but its instance is gone
        {"NodeName": "p5-spot-1", "State": "DOWN+CLOUD+POWERED_DOWN",
         "Reason": f"gpucluster: capacity: InsufficientInstanceCapacity: x [slurm@{stamp}]"},
        {"NodeName": "p5-spot-2", "State": "DOWN+CLOUD+POWERED_DOWN",
         "Reason": f"gpucluster: capacity: InsufficientInstanceCapacity: x [slurm@{time.strftime('%Y-%m-%dT%H:%M:%S')}]"},
        {"NodeName": "other-1", "State": "IDLE+CLOUD"},  # not one of this cluster's pools: not ours to judge
    ]
    slurm = FakeSlurm(table)
    done = node.reconcile(config, ec2, slurm)
    assert done == {"leftover": ["p5-od-1"], "down": ["p5-od-4"], "retried": ["p5-spot-1"]}
    assert set(live(config, ec2)) == {"p5-od-2"} and len(node.cluster_instances(config, ec2)) == 1
    assert ("update", "nodename=p5-spot-1", "state=power_down_force") in slurm.updates()
    assert node.read_registry(config).failures == {"p5-spot-1": 1}  # its next try waits twice as long


def test_a_reconcile_during_a_resume_terminates_nothing(ec2) -> None:  # type: ignore[no-untyped-def]
    """An instance EC2 launched a moment ago that no node owns yet (the resume program has not recorded it) is left
    alone until its launch grace is over; past it, it is an orphan."""
    config = make_config(ec2, orphan_grace_seconds=300)
    fresh = ec2.create_fleet(**node._fleet_request(config, config.pools["p5-od"], 1, False))["Instances"][0]["InstanceIds"]
    assert node.reconcile(config, ec2, FakeSlurm([{"NodeName": "p5-od-1", "State": "IDLE+CLOUD+POWERING_UP"}])) == {}
    assert set(node.cluster_instances(config, ec2)) == set(fresh)
    done = node.reconcile(config, ec2, FakeSlurm(), now=time.time() + 301)
    assert done == {"terminated": fresh} and not node.cluster_instances(config, ec2)


def test_the_head_node_is_never_an_orphan(ec2) -> None:  # type: ignore[no-untyped-def]
    config = make_config(ec2, orphan_grace_seconds=0)
    ec2.run_instances(ImageId="ami-12c6146b", MinCount=1, MaxCount=1, TagSpecifications=[
        {"ResourceType": "instance", "Tags": [{"Key": node.CLUSTER_TAG, "Value": config.cluster}]}])
    assert node.reconcile(config, ec2, FakeSlurm()) == {}


def test_one_failing_action_does_not_stop_the_others(ec2, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    config = make_config(ec2, orphan_grace_seconds=0)
    stray = ec2.create_fleet(**node._fleet_request(config, config.pools["p5-od"], 1, False))["Instances"][0]["InstanceIds"]

    class RefusingSlurm(FakeSlurm):
        def set_down(self, nodes: list[str], reason: str) -> None:
            raise subprocess.CalledProcessError(1, "scontrol")

    done = node.reconcile(config, ec2, RefusingSlurm([{"NodeName": "p5-od-3", "State": "IDLE+CLOUD"},
                                                      {"NodeName": "p5-od-4", "State": "IDLE+CLOUD+POWERED_DOWN"}]))
    assert done == {"terminated": stray}  # setting p5-od-3 DOWN failed; the orphan went all the same
    assert "reconcile: down p5-od-3 failed" in caplog.text


def always_on_config(ec2, budget_state: Path | None = None) -> node.ClusterSettings:  # type: ignore[no-untyped-def]
    config = make_config(ec2)
    pools = {name: node.PoolSettings(**{**pool.__dict__, "min_nodes": 2 if name == "p5-od" else 0})
             for name, pool in config.pools.items()}
    extra = {"budget_state_file": str(budget_state)} if budget_state else {}
    return node.ClusterSettings(cluster="c1", region="us-east-1", pools=pools, log_file="/dev/null",
                                registry_file=config.registry_file, **extra)  # type: ignore[arg-type]


def test_reconcile_powers_up_always_on_nodes_through_slurm(ec2) -> None:  # type: ignore[no-untyped-def]
    """Slurm powers them up (and runs the resume program): it then counts on them and never suspends them."""
    config = always_on_config(ec2)
    table = [{"NodeName": "p5-od-1", "State": "IDLE+CLOUD+POWERED_DOWN"},
             {"NodeName": "p5-od-2", "State": "IDLE+CLOUD+POWERED_DOWN"},
             {"NodeName": "p5-od-3", "State": "IDLE+CLOUD+POWERED_DOWN"}]
    slurm = FakeSlurm(table)
    assert node.reconcile(config, ec2, slurm) == {"powered up": ["p5-od-1", "p5-od-2"]}
    assert slurm.updates() == [("update", "nodename=p5-od-1,p5-od-2", "state=power_up")]
    assert not node.cluster_instances(config, ec2)  # launching is the resume program's part


def test_reconcile_powers_up_no_always_on_node_while_the_budget_is_closed(ec2, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    state = tmp_path / "budget.json"
    config = always_on_config(ec2, state)
    state.write_text('{"closed": true}')  # as the budget guardrail writes it
    table = [{"NodeName": "p5-od-1", "State": "IDLE+CLOUD+POWERED_DOWN"}]
    slurm = FakeSlurm(table)
    assert node.reconcile(config, ec2, slurm) == {} and not slurm.updates()
    state.write_text('{"closed": false}')
    assert node.reconcile(config, ec2, FakeSlurm(table)) == {"powered up": ["p5-od-1"]}


def test_parse_oneliner_keeps_reasons_with_spaces() -> None:
    line = "NodeName=a-1 Arch=x86_64 State=DOWN+CLOUD Reason=gpucluster: capacity: ICE: no room [slurm@2026-01-01T00:00:00] Comment=(null)"
    parsed = scontrol.parse_oneliner(line)
    assert parsed["Reason"] == "gpucluster: capacity: ICE: no room [slurm@2026-01-01T00:00:00]"
    assert parsed["State"] == "DOWN+CLOUD"


@pytest.mark.parametrize("text,expected", [
    ("p5-od-[1-3,7]", ["p5-od-1", "p5-od-2", "p5-od-3", "p5-od-7"]),
    ("p5-od-2,head", ["p5-od-2", "head"]),
    ("n[01-02]", ["n01", "n02"]),  # padding kept
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("a-[1-2],a-2,b-[3]", ["a-1", "a-2", "b-3"]),
    ("", []),
])
def test_hostlist_expands_like_slurm(text: str, expected: list[str]) -> None:
    assert hostlist.expand_hostlist(text) == expected


@pytest.mark.parametrize("nodes,expected", [
    (["p5-od-3"], "p5-od-3"),  # a single node has no brackets
    (["p5-od-1", "p5-od-2", "p5-od-3", "p5-od-4", "p5-od-7"], "p5-od-[1-4,7]"),  # a gap
    (["p5-od-10", "p5-od-9", "p5-od-11", "p5-od-2"], "p5-od-[2,9-11]"),  # numeric order: 9 before 10
    (["p5-spot-2", "p5-od-1", "p5-spot-1", "p5-od-2", "p5-od-2"], "p5-od-[1-2],p5-spot-[1-2]"),  # pools, a duplicate
    (["head", "p5-od-01", "p5-od-1"], "head,p5-od-01,p5-od-1"),  # no number, a padded number: as they are
    ([], ""),
])
def test_hostlist_compresses_like_slurm(nodes: list[str], expected: str) -> None:
    assert hostlist.compress_hostlist(nodes) == expected


def test_resume_logs_nodes_as_a_hostlist(ec2, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    config = make_config(ec2)
    with caplog.at_level("INFO", logger="gpucluster-node"):
        node.resume(config, ec2, FakeSlurm(), ",".join(f"p5-od-{i}" for i in (1, 2, 3, 10)))
    assert "resume p5-od-[1-3,10]: 4 node(s) of pool p5-od" in caplog.text


def fake_scontrol(tmp_path: Path, body: str) -> str:
    script = tmp_path / "scontrol"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)
    return str(script)


def test_a_failing_scontrol_is_logged_with_its_stderr(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    slurm = node.Slurm(fake_scontrol(tmp_path, 'echo "slurm_update error: Invalid node name specified" >&2; exit 1'))
    with pytest.raises(subprocess.CalledProcessError):
        slurm.set_down(["p5-od-1"], "gpucluster: test")
    assert "returned non-zero exit status 1" in caplog.text and "nodename=p5-od-1" in caplog.text
    assert "stderr: slurm_update error: Invalid node name specified" in caplog.text


def test_a_hung_scontrol_times_out(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(node, "SCONTROL_TIMEOUT", 0.3)
    slurm = node.Slurm(fake_scontrol(tmp_path, 'echo "waiting for slurmctld" >&2; exec sleep 10'))
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        slurm.nodes()
    assert time.monotonic() - started < 5
    assert "timed out after 0.3 seconds" in caplog.text and "stderr: waiting for slurmctld" in caplog.text


def test_main_survives_a_failing_scontrol_in_its_fallback(ec2, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                         caplog: pytest.LogCaptureFixture,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    config = make_config(ec2, scontrol=fake_scontrol(tmp_path, 'echo "Unable to contact slurm controller" >&2; exit 1'))
    monkeypatch.setattr(node.ClusterSettings, "load", classmethod(lambda cls: config))
    monkeypatch.setattr(node, "setup_logging", lambda config: None)  # keep pytest's log capture
    assert node.main(["resume", "p5-od-[1-2]"]) == 1  # resume failed, and so did the fallback's set_down
    assert "could not set p5-od-[1-2] DOWN after the failure" in caplog.text
    assert "stderr: Unable to contact slurm controller" in caplog.text


def test_instances_of_nodes_slurm_no_longer_has_are_terminated_after_the_grace(ec2) -> None:  # type: ignore[no-untyped-def]
    """A stack that dropped nodes, applied by a new head: the registry still names their instances, Slurm does not
    list the nodes. A node Slurm still lists (a dropped pool draining) keeps its instance."""
    config = make_config(ec2, orphan_grace_seconds=300)
    launched = node.resume(config, ec2, FakeSlurm(), "p5-od-[1-2]").launched
    draining = FakeSlurm([{"NodeName": "p5-od-2", "State": "ALLOCATED+CLOUD"}])  # p5-od-1 is gone from slurm.conf
    assert "forgotten" not in node.reconcile(config, ec2, draining)  # within the grace: perhaps a resume under way
    done = node.reconcile(config, ec2, draining, now=time.time() + 301)
    assert done.get("forgotten") == ["p5-od-1"]
    assert set(live(config, ec2)) == {"p5-od-2"} and launched["p5-od-1"] not in node.cluster_instances(config, ec2)


def test_resume_fail_keeps_the_reason_of_nodes_it_never_launched(ec2) -> None:  # type: ignore[no-untyped-def]
    """At ResumeTimeout Slurm also calls resume-fail for nodes the resume program set DOWN with EC2's reason (a
    configuration error's fix must stay on them)."""
    config, slurm = make_config(ec2), FakeSlurm()
    launched = node.resume(config, ec2, FakeSlurm(), "p5-od-1").launched
    assert node.resume_fail(config, ec2, slurm, "p5-od-[1-2]") == [launched["p5-od-1"]]
    (down,) = slurm.updates()
    assert down[1] == "nodename=p5-od-1" and not node.cluster_instances(config, ec2)


def spot_event(kind: str, instance: str) -> dict:  # type: ignore[type-arg]
    """As EventBridge delivers EC2's warnings (the rule's target is the queue: the event is the message body)."""
    detail = {"instance-id": instance, "instance-action": "terminate"} if kind == node.SPOT_WARNING else \
        {"instance-id": instance}
    return {"version": "0", "id": "e1", "detail-type": kind, "source": "aws.ec2", "account": "123456789012",
            "time": "2026-11-30T16:00:00Z", "region": "us-east-1",
            "resources": [f"arn:aws:ec2:us-east-1:123456789012:instance/{instance}"], "detail": detail}


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


def test_a_spot_warning_drains_signals_and_requeues_after_the_grace(ec2, tmp_path) -> None:  # type: ignore[no-untyped-def]
    config = make_config(ec2, events_log=str(tmp_path / "events.jsonl"), checkpoint_grace_seconds=60)
    slurm, clock = FakeSlurm(), Clock()
    launched = node.resume(config, ec2, slurm, "p5-spot-[1-2]").launched
    slurm.jobs = {"p5-spot-1": ["41", "42"]}
    service = node.Interruptions(config, slurm, clock=clock)
    assert service.handle(spot_event(node.SPOT_WARNING, launched["p5-spot-1"])) == ["p5-spot-1"]
    assert ("update", "nodename=p5-spot-1", "state=drain",
            f"reason=gpucluster: replace: spot interruption warning for {launched['p5-spot-1']} at "
            "2026-11-30T16:00:00Z") in slurm.calls
    assert [c for c in slurm.calls if c[0] == "signal"] == [("signal", "41", "USR1"), ("signal", "42", "USR1")]
    assert service.requeue_due() == [] and service.wait_seconds() == 20  # checkpoints are being written
    clock.now += 59
    assert service.wait_seconds() == 2 and service.requeue_due() == []
    clock.now += 1
    assert service.requeue_due() == ["41", "42"]
    assert [c for c in slurm.calls if c[0] == "requeue"] == [("requeue", "41"), ("requeue", "42")]
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["spot interruption warning", "requeued", "requeued"]
    assert events[0]["node"] == "p5-spot-1" and events[0]["jobs"] == ["41", "42"]


def test_rebalance_drains_without_signalling_unless_turned_off(ec2, tmp_path) -> None:  # type: ignore[no-untyped-def]
    config = make_config(ec2, events_log=str(tmp_path / "events.jsonl"))
    slurm = FakeSlurm()
    instance = node.resume(config, ec2, slurm, "p5-spot-1").launched["p5-spot-1"]
    slurm.jobs = {"p5-spot-1": ["41"]}
    assert node.Interruptions(config, slurm).handle(spot_event(node.REBALANCE, instance)) == ["p5-spot-1"]
    assert [c[2] for c in slurm.calls if c[0] == "update" and c[2].startswith("state=")] == ["state=drain"]
    assert not [c for c in slurm.calls if c[0] in ("signal", "requeue")]
    off = dataclasses.replace(config, drain_on_rebalance=False)
    quiet = FakeSlurm()
    assert node.Interruptions(off, quiet).handle(spot_event(node.REBALANCE, instance)) == []
    assert not [c for c in quiet.calls if c[0] == "update"]


def test_warnings_for_other_clusters_instances_are_not_ours(ec2, tmp_path) -> None:  # type: ignore[no-untyped-def]
    config = make_config(ec2, events_log=str(tmp_path / "events.jsonl"))
    slurm = FakeSlurm()
    assert node.Interruptions(config, slurm).handle(spot_event(node.SPOT_WARNING, "i-0123456789abcdef0")) == []
    assert not slurm.calls


def test_the_service_reads_the_queue_and_deletes_what_it_handled(ec2, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import boto3

    sqs = boto3.client("sqs", region_name="us-east-1")
    url = sqs.create_queue(QueueName="interruptions")["QueueUrl"]
    config = make_config(ec2, events_log=str(tmp_path / "events.jsonl"), interruption_queue_url=url)
    slurm = FakeSlurm()
    instance = node.resume(config, ec2, slurm, "p5-spot-1").launched["p5-spot-1"]
    sqs.send_message(QueueUrl=url, MessageBody=json.dumps(spot_event(node.SPOT_WARNING, instance)))
    sqs.send_message(QueueUrl=url, MessageBody="not an event")  # left for SQS to deliver again, then its DLQ
    passes = iter(range(2))
    node.serve_interruptions(node.Interruptions(config, slurm), sqs, stop=lambda: next(passes, None) is None)
    assert any(c[:3] == ("update", "nodename=p5-spot-1", "state=drain") for c in slurm.calls)
    left = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["ApproximateNumberOfMessages",
                                                                  "ApproximateNumberOfMessagesNotVisible"])
    assert sum(int(v) for v in left["Attributes"].values()) == 1  # the bad one only


def test_reconcile_replaces_a_drained_node_once_idle(ec2, tmp_path) -> None:  # type: ignore[no-untyped-def]
    config = make_config(ec2, events_log=str(tmp_path / "events.jsonl"))
    launched = node.resume(config, ec2, FakeSlurm(), "p5-spot-1,p5-od-1").launched
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    reason = f"gpucluster: replace: spot interruption warning [slurm@{stamp}]"
    slurm = FakeSlurm([{"NodeName": "p5-spot-1", "State": "IDLE+DRAIN+CLOUD", "Reason": reason},
                       {"NodeName": "p5-od-1", "State": "ALLOCATED+DRAIN+CLOUD", "Reason": reason}])
    done = node.reconcile(config, ec2, slurm)
    assert done["replaced"] == ["p5-spot-1"] and "p5-od-1" not in str(done)  # the busy one finishes its jobs
    assert set(live(config, ec2)) == {"p5-od-1"}
    assert ("update", "nodename=p5-spot-1", "state=power_down_force") in slurm.calls
    assert launched["p5-spot-1"] in (tmp_path / "events.jsonl").read_text()


def test_jobs_on_a_node_from_scontrol_show_jobs() -> None:
    class Jobs(node.Slurm):
        def _run(self, *args: str) -> str:
            assert args == ("show", "jobs", "--oneliner")
            return ("JobId=41 JobName=ddp UserId=ubuntu(1100) JobState=RUNNING Reason=None NodeList=spot-[1-2] "
                    "BatchHost=spot-1\n"
                    "JobId=42 JobName=x UserId=ubuntu(1100) JobState=PENDING Reason=Priority NodeList=(null)\n"
                    "JobId=43 JobName=y UserId=ubuntu(1100) JobState=RUNNING Reason=None NodeList=standby-1\n")
    assert Jobs().jobs_on("spot-2") == ["41"] and Jobs().jobs_on("standby-1") == ["43"]
