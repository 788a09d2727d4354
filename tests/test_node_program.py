"""The node programs' decisions, against in-process moto and a recording stand-in for scontrol."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import boto3
import pytest
from botocore.stub import Stubber
from moto import mock_aws

from conftest import ROOT

sys.path.insert(0, str(ROOT / "cloud-init"))
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


@pytest.fixture
def ec2():  # type: ignore[no-untyped-def]
    with mock_aws():
        yield boto3.client("ec2", region_name="us-east-1")


def make_config(ec2, **overrides: object) -> node.ClusterSettings:  # type: ignore[no-untyped-def]
    vpc = ec2.create_vpc(CidrBlock="10.0.0.0/16")["Vpc"]["VpcId"]
    subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.0.0.0/24", AvailabilityZone="us-east-1a")["Subnet"]["SubnetId"]
    template = ec2.create_launch_template(LaunchTemplateName="lt", LaunchTemplateData={
        "ImageId": "ami-12c6146b", "InstanceType": "p5.48xlarge"})["LaunchTemplate"]["LaunchTemplateId"]
    pools = {name: node.PoolSettings(name, template, subnet, "p5.48xlarge", market)
             for name, market in (("p5-spot", "spot"), ("p5-od", "on-demand"))}
    return node.ClusterSettings(cluster="c1", region="us-east-1", pools=pools, log_file="/dev/null", **overrides)  # type: ignore[arg-type]


def test_resume_launches_tags_and_addresses_each_node(ec2) -> None:  # type: ignore[no-untyped-def]
    config, slurm = make_config(ec2), FakeSlurm()
    result = node.resume(config, ec2, slurm, "p5-od-1,p5-od-2,p5-spot-3")
    assert set(result.launched) == {"p5-od-1", "p5-od-2", "p5-spot-3"} and not result.failed
    live = node.cluster_instances(config, ec2)
    assert {n: len(ids) for n, ids in live.items()} == {"p5-od-1": 1, "p5-od-2": 1, "p5-spot-3": 1}
    spot = ec2.describe_instances(InstanceIds=live["p5-spot-3"])["Reservations"][0]["Instances"][0]
    assert spot.get("InstanceLifecycle") == "spot"
    (update,) = [c for c in slurm.updates() if c[2].startswith("nodeaddr=")]  # one call for all three
    addresses = dict(zip(update[1].split("=")[1].split(","), update[2].split("=")[1].split(",")))
    assert set(addresses) == {"p5-od-1", "p5-od-2", "p5-spot-3"}
    assert update[3] == f"nodehostname={update[1].split('=')[1]}"
    assert all(a.startswith("10.0.0.") for a in addresses.values())


def test_batches_respect_the_batch_size(ec2) -> None:  # type: ignore[no-untyped-def]
    config = make_config(ec2, batch_size=2)
    calls = []
    original = ec2.create_fleet
    ec2.create_fleet = lambda **kw: calls.append(kw["TargetCapacitySpecification"]["TotalTargetCapacity"]) or original(**kw)
    node.resume(config, ec2, FakeSlurm(), ",".join(f"p5-od-{i}" for i in range(1, 6)))
    assert calls == [2, 2, 1]


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


@pytest.mark.parametrize("code,kind", [("VcpuLimitExceeded", "capacity"), ("InvalidLaunchTemplateId.NotFound", "launch failed")])
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
    assert not reason.startswith(node.CAPACITY_PREFIX)  # not retried by the reconciler: it would fail again


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
    assert set(node.cluster_instances(config, ec2)) == {"p5-od-2"}


def test_reconcile_cleans_both_ways_and_retries_capacity(ec2) -> None:  # type: ignore[no-untyped-def]
    config = make_config(ec2, capacity_retry_seconds=600)
    node.resume(config, ec2, FakeSlurm(), "p5-od-1,p5-od-2")
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() - 700))
    table = [
        {"NodeName": "p5-od-1", "State": "IDLE+CLOUD+POWERED_DOWN"},  # Slurm thinks it is off: instance is leftover
        {"NodeName": "p5-od-2", "State": "ALLOCATED+CLOUD"},  # healthy
        {"NodeName": "p5-od-3", "State": "MIXED+CLOUD"},  # up in Slurm, but no instance: vanished
        {"NodeName": "p5-spot-1", "State": "DOWN+CLOUD+POWERED_DOWN",
         "Reason": f"gpucluster: capacity: InsufficientInstanceCapacity: x [slurm@{stamp}]"},
        {"NodeName": "p5-spot-2", "State": "DOWN+CLOUD+POWERED_DOWN",
         "Reason": f"gpucluster: capacity: InsufficientInstanceCapacity: x [slurm@{time.strftime('%Y-%m-%dT%H:%M:%S')}]"},
    ]
    slurm = FakeSlurm(table)
    done = node.reconcile(config, ec2, slurm)
    assert len(done["terminated"]) == 1 and set(node.cluster_instances(config, ec2)) == {"p5-od-2"}
    assert done["down"] == ["p5-od-3"]
    assert done["retried"] == ["p5-spot-1"]  # p5-spot-2 went down a moment ago: not yet
    assert ("update", "nodename=p5-spot-1", "state=power_down_force") in slurm.updates()


def test_parse_oneliner_keeps_reasons_with_spaces() -> None:
    line = "NodeName=a-1 Arch=x86_64 State=DOWN+CLOUD Reason=gpucluster: capacity: ICE: no room [slurm@2026-01-01T00:00:00] Comment=(null)"
    parsed = node.parse_oneliner(line)
    assert parsed["Reason"] == "gpucluster: capacity: ICE: no room [slurm@2026-01-01T00:00:00]"
    assert parsed["State"] == "DOWN+CLOUD"


def test_reconcile_launches_always_on_nodes_without_an_instance(ec2) -> None:  # type: ignore[no-untyped-def]
    config = make_config(ec2)
    pools = {name: node.PoolSettings(**{**pool.__dict__, "min_nodes": 2 if name == "p5-od" else 0})
             for name, pool in config.pools.items()}
    config = node.ClusterSettings(cluster="c1", region="us-east-1", pools=pools, log_file="/dev/null")
    node.resume(config, ec2, FakeSlurm(), "p5-od-1")
    table = [{"NodeName": n, "State": "IDLE"} for n in ("p5-od-1", "p5-od-2")]
    done = node.reconcile(config, ec2, FakeSlurm(table))
    assert done["launched"] == ["p5-od-2"] and set(node.cluster_instances(config, ec2)) == {"p5-od-1", "p5-od-2"}


def test_reconcile_launches_no_always_on_node_while_the_budget_is_closed(ec2, tmp_path) -> None:  # type: ignore[no-untyped-def]
    config = make_config(ec2)
    pools = {name: node.PoolSettings(**{**pool.__dict__, "min_nodes": 1}) for name, pool in config.pools.items()}
    state = tmp_path / "budget.json"
    config = node.ClusterSettings(cluster="c1", region="us-east-1", pools=pools, log_file="/dev/null", budget_state_file=str(state))
    state.write_text('{"closed": true}')  # as the budget guardrail writes it
    table = [{"NodeName": n, "State": "IDLE"} for n in ("p5-od-1", "p5-spot-1")]
    assert node.reconcile(config, ec2, FakeSlurm(table))["launched"] == [] and not node.cluster_instances(config, ec2)
    state.write_text('{"closed": false}')
    assert node.reconcile(config, ec2, FakeSlurm(table))["launched"] == ["p5-od-1", "p5-spot-1"]


@pytest.mark.parametrize("nodes,expected", [
    (["p5-od-3"], "p5-od-3"),  # a single node has no brackets
    (["p5-od-1", "p5-od-2", "p5-od-3", "p5-od-4", "p5-od-7"], "p5-od-[1-4,7]"),  # a gap
    (["p5-od-10", "p5-od-9", "p5-od-11", "p5-od-2"], "p5-od-[2,9-11]"),  # numeric order: 9 before 10
    (["p5-spot-2", "p5-od-1", "p5-spot-1", "p5-od-2", "p5-od-2"], "p5-od-[1-2],p5-spot-[1-2]"),  # pools, a duplicate
    (["head", "p5-od-01", "p5-od-1"], "head,p5-od-01,p5-od-1"),  # no number, a padded number: as they are
    ([], ""),
])
def test_hostlist_compresses_like_slurm(nodes: list[str], expected: str) -> None:
    assert node.compress_hostlist(nodes) == expected


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
        slurm.expand("p5-od-[1-2]")
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
