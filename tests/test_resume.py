"""The resume program (Slurm's ResumeProgram): what it launches, how a job gets all its nodes or none, and the reasons
it gives Slurm for nodes EC2 did not launch; against in-process moto and a recording stand-in for scontrol."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from botocore.stub import Stubber

from gpucluster.contract import reasons
from gpucluster.contract.settings import ClusterSettings
from gpucluster.node import fleet, program, resume as resume_program
from gpucluster.node.resume import job_nodes, resume
from head_fakes import FakeSlurm, ec2_fixture, fake_scontrol, live, make_config  # noqa: F401  (the ec2 fixture)


def resume_file(tmp_path: Path, jobs: dict[int, str]) -> str:
    """SLURM_RESUME_FILE as Slurm 23.02 and later write it."""
    path = tmp_path / "resume.json"
    path.write_text(json.dumps({"all_nodes_resume": ",".join(jobs.values()), "jobs": [
        {"job_id": job, "nodes_alloc": nodes, "nodes_resume": nodes, "partition": "p", "oversubscribe": "OK"}
        for job, nodes in jobs.items()]}))
    return str(path)


def refuse_market(ec2, market: str, code: str = "InsufficientInstanceCapacity") -> None:
    """EC2 answers an instant fleet of `market` with no instance and the error, as it does when it has no room."""
    original = ec2.create_fleet

    def create_fleet(**kw):
        if kw["TargetCapacitySpecification"]["DefaultTargetCapacityType"] == market:
            return {"FleetId": "fleet-1", "Instances": [], "Errors": [{"ErrorCode": code, "ErrorMessage": "no room"}]}
        return original(**kw)

    ec2.create_fleet = create_fleet


SPOT_ROLE_DOWN = ("gpucluster: launch failed: no spot service-linked role, run once: "
                  "aws iam create-service-linked-role --aws-service-name spot.amazonaws.com")


def test_resume_launches_and_records_each_node_without_a_call_per_instance(ec2) -> None:
    config, slurm = make_config(ec2), FakeSlurm()
    calls: list[str] = []
    ec2.meta.events.register("before-call.ec2", lambda model, **kw: calls.append(model.name))
    result = resume(config, ec2, slurm, "p5-od-[1-2],p5-spot-3")
    assert calls == ["CreateFleet", "CreateFleet"]  # one per pool; no tags, no DescribeInstances
    assert set(result.launched) == {"p5-od-1", "p5-od-2", "p5-spot-3"} and not result.failed
    assert live(config, ec2) == result.launched  # the registry knows each instance as its node
    spot = ec2.describe_instances(InstanceIds=[result.launched["p5-spot-3"]])["Reservations"][0]["Instances"][0]
    assert spot.get("InstanceLifecycle") == "spot"
    # Slurm learns each node's instance in one call; the instance finds its node by it.
    assert slurm.updates() == [("update", "nodename=p5-od-1,p5-od-2,p5-spot-3",
                                "nodehostname=" + ",".join(result.launched[n]
                                                           for n in ("p5-od-1", "p5-od-2", "p5-spot-3")))]


def test_resume_keeps_a_nodes_live_instance(ec2) -> None:
    """Slurm may resume a node again (a repeated power up, a restarted controller): no second instance for it."""
    config = make_config(ec2)
    first = resume(config, ec2, FakeSlurm(), "p5-od-1").launched
    again = resume(config, ec2, FakeSlurm(), "p5-od-[1-2]").launched
    assert again["p5-od-1"] == first["p5-od-1"] and len(fleet.cluster_instances(config, ec2)) == 2


def test_best_effort_batches_respect_the_batch_size(ec2) -> None:
    config = make_config(ec2, batch_size=2, all_or_nothing=False)
    calls = []
    original = ec2.create_fleet

    def counted(**kw):
        calls.append(kw["TargetCapacitySpecification"]["TotalTargetCapacity"])
        return original(**kw)
    ec2.create_fleet = counted
    resume(config, ec2, FakeSlurm(), "p5-od-[1-5]")
    assert calls == [2, 2, 1]


def test_a_job_is_never_split_and_single_node_jobs_share_calls(ec2, tmp_path: Path) -> None:
    config = make_config(ec2, batch_size=2)
    sent = []
    original = ec2.create_fleet

    def recorded(**kw):
        sent.append(kw)
        return original(**kw)
    ec2.create_fleet = recorded
    jobs = {7: "p5-od-[1-3]", 8: "p5-od-4", 9: "p5-od-5", 10: "p5-od-6"}
    resume(config, ec2, FakeSlurm(), "p5-od-[1-6]", resume_file(tmp_path, jobs))
    shapes = [(kw["TargetCapacitySpecification"]["TotalTargetCapacity"], kw["OnDemandOptions"].get("MinTargetCapacity"))
              for kw in sent]
    # Job 7's three nodes in one all-or-nothing call, over the batch size; the single-node jobs packed best effort.
    assert shapes == [(3, 3), (2, None), (1, None)]


def test_a_resume_file_of_a_manual_power_up_has_no_jobs(ec2, tmp_path: Path) -> None:
    """`scontrol update state=power_up` (the reconciler's, for always-on nodes): Slurm writes an empty job list, and
    null for fields without a value."""
    config = make_config(ec2)
    path = tmp_path / "resume.json"
    path.write_text(json.dumps({"all_nodes_resume": "p5-od-[1-2]", "jobs": [
        {"job_id": 5, "nodes_alloc": None, "nodes_resume": None, "extra": None, "features": None}]}))
    assert job_nodes(config, ["p5-od-1", "p5-od-2"], str(path)) == {"5": []}
    path.write_text(json.dumps({"all_nodes_resume": "p5-od-[1-2]", "jobs": []}))
    result = resume(config, ec2, FakeSlurm(), "p5-od-[1-2]", str(path))
    assert set(result.launched) == {"p5-od-1", "p5-od-2"}


def test_two_coalesced_jobs_succeed_or_fail_on_their_own(ec2, tmp_path: Path) -> None:
    """Slurm resumes the nodes of two jobs in one call; spot has no room. The spot job's nodes go DOWN (it is
    requeued); the on-demand job's nodes are launched."""
    config, slurm = make_config(ec2), FakeSlurm()
    refuse_market(ec2, "spot")
    result = resume(config, ec2, slurm, "p5-od-[1-2],p5-spot-[1-2]",
                         resume_file(tmp_path, {11: "p5-spot-[1-2]", 12: "p5-od-[1-2]"}))
    assert set(result.launched) == {"p5-od-1", "p5-od-2"} and set(live(config, ec2)) == {"p5-od-1", "p5-od-2"}
    assert set(result.failed) == {"p5-spot-1", "p5-spot-2"}
    (down,) = [c for c in slurm.updates() if "state=down" in c]
    assert down[1] == "nodename=p5-spot-1,p5-spot-2"


def test_a_job_across_two_pools_gets_all_its_nodes_or_none(ec2, tmp_path: Path) -> None:
    """A partition with a fallback pool can give one job nodes of two pools: all of them, or none."""
    config, slurm = make_config(ec2), FakeSlurm()
    refuse_market(ec2, "spot")
    result = resume(config, ec2, slurm, "p5-od-1,p5-spot-1", resume_file(tmp_path, {13: "p5-od-1,p5-spot-1"}))
    assert not result.launched and not fleet.cluster_instances(config, ec2) and not live(config, ec2)
    assert set(result.failed) == {"p5-od-1", "p5-spot-1"}


def test_all_or_nothing_terminates_a_partial_fleet(ec2) -> None:
    config, slurm = make_config(ec2), FakeSlurm()
    real = ec2.create_fleet

    def partial(**kw):
        kw["TargetCapacitySpecification"]["TotalTargetCapacity"] = 1  # EC2 found room for one of two
        reply = real(**kw)
        reply["Errors"] = [{"ErrorCode": "InsufficientInstanceCapacity", "ErrorMessage": "no room"}]
        return reply

    ec2.create_fleet = partial
    result = resume(config, ec2, slurm, "p5-od-1,p5-od-2")
    assert not result.launched and set(result.failed) == {"p5-od-1", "p5-od-2"}
    assert not fleet.cluster_instances(config, ec2)  # the one that did launch was terminated
    (down,) = slurm.updates()
    assert down[:3] == ("update", "nodename=p5-od-1,p5-od-2", "state=down")
    assert down[3] == "reason=gpucluster: capacity: InsufficientInstanceCapacity: no room"


@pytest.mark.parametrize("code,kind", [
    ("VcpuLimitExceeded", "capacity"),
    ("UnauthorizedOperation", "launch failed"),  # the budget's deny action: lifted when the budget reopens
    ("InvalidLaunchTemplateId.NotFound", "configuration: fix the stack and pulumi up"),
])
def test_api_errors_mark_nodes_down_with_the_aws_reason(ec2, code: str, kind: str) -> None:
    config, slurm = make_config(ec2), FakeSlurm()
    with Stubber(ec2) as stub:
        stub.add_client_error("create_fleet", service_error_code=code, service_message="quota or template")
        result = resume(config, ec2, slurm, "p5-spot-1")
    assert result.failed == {"p5-spot-1": f"gpucluster: {kind}: {code}: quota or template"}
    assert slurm.updates()[0][2] == "state=down"


@pytest.mark.parametrize("code,message", [
    ("AuthFailure.ServiceLinkedRoleCreationNotPermitted",
     "The provided credentials do not have permission to create the service-linked role for EC2 Spot Instances."),
    ("AuthFailure", "The provided credentials do not have permission to create the service-linked role for EC2 Spot "
                    "Instances."),  # another code, the same message
])
def test_missing_spot_role_sets_nodes_down_with_the_command_that_fixes_it(ec2, code: str, message: str) -> None:
    config, slurm = make_config(ec2), FakeSlurm()
    with Stubber(ec2) as stub:
        stub.add_client_error("create_fleet", service_error_code=code, service_message=message, http_status_code=403)
        result = resume(config, ec2, slurm, "p5-spot-1,p5-spot-2")
    reason = f"{SPOT_ROLE_DOWN} ({code})"
    assert result.failed == {"p5-spot-1": reason, "p5-spot-2": reason} and len(reason) <= 200
    (down,) = slurm.updates()
    assert down == ("update", "nodename=p5-spot-1,p5-spot-2", "state=down", f"reason={reason}")
    # Retried with backoff, not held for a fix to the stack: the nodes come back once someone creates the role.
    assert not reason.startswith(reasons.CONFIGURATION)


def test_missing_spot_role_in_an_instant_fleets_errors(ec2) -> None:
    """An instant fleet may answer 200 with no instance and the error in Errors: the same reason."""
    config, slurm = make_config(ec2), FakeSlurm()
    ec2.create_fleet = lambda **kw: {"FleetId": "fleet-1", "Instances": [], "Errors": [
        {"ErrorCode": "AuthFailure.ServiceLinkedRoleCreationNotPermitted", "ErrorMessage": "The provided credentials "
         "do not have permission to create the service-linked role for EC2 Spot Instances.", "Lifecycle": "spot"}]}
    result = resume(config, ec2, slurm, "p5-spot-1")
    assert result.failed == {"p5-spot-1": f"{SPOT_ROLE_DOWN} (AuthFailure.ServiceLinkedRoleCreationNotPermitted)"}
    assert slurm.updates()[0][3].startswith(f"reason={SPOT_ROLE_DOWN}")


def test_unknown_pool_is_refused_not_launched(ec2) -> None:
    config, slurm = make_config(ec2), FakeSlurm()
    result = resume(config, ec2, slurm, "ghost-1")
    assert "no pool ghost" in result.failed["ghost-1"] and not fleet.cluster_instances(config, ec2)



def test_resume_logs_nodes_as_a_hostlist(ec2, caplog: pytest.LogCaptureFixture) -> None:
    config = make_config(ec2)
    with caplog.at_level("INFO", logger="gpucluster-node"):
        resume(config, ec2, FakeSlurm(), ",".join(f"p5-od-{i}" for i in (1, 2, 3, 10)))
    assert "resume p5-od-[1-3,10]: 4 node(s) of pool p5-od" in caplog.text


def test_main_survives_a_failing_scontrol_in_its_fallback(ec2, tmp_path: Path,
                                                         caplog: pytest.LogCaptureFixture,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    config = make_config(ec2, scontrol=fake_scontrol(tmp_path, 'echo "Unable to contact slurm controller" >&2; exit 1'))
    monkeypatch.setattr(ClusterSettings, "load", classmethod(lambda cls: config))
    monkeypatch.setattr(program, "setup_logging", lambda log_file: None)  # keep pytest's log capture
    assert resume_program.main(["resume.py", "p5-od-[1-2]"]) == 1  # resume failed, and so did the fallback's set_down
    assert "could not set p5-od-[1-2] DOWN after the failure" in caplog.text
    assert "stderr: Unable to contact slurm controller" in caplog.text


@pytest.fixture
def slow_metadata(monkeypatch: pytest.MonkeyPatch, moto_url: str) -> Iterator[None]:
    """Instance metadata (IMDSv2) that answers the credentials request 1.5 s late, as a busy head's may: longer than
    botocore's default timeout of 1 s for one attempt. The only credentials there are; EC2 is moto."""
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def _reply(self, text: str) -> None:
            data = text.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_PUT(self) -> None:
            self._reply("token")

        def do_GET(self) -> None:
            if self.path.endswith("/"):  # the role's name
                return self._reply("gpucluster-head")
            time.sleep(1.5)
            expires = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 3600))
            self._reply(json.dumps({"Code": "Success", "AccessKeyId": "testing", "SecretAccessKey": "testing",
                                    "Token": "testing", "Expiration": expires}))

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_url)
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    yield
    server.shutdown()
    server.server_close()


def test_the_programs_ec2_client_waits_for_slow_instance_metadata(slow_metadata: None) -> None:
    """The resume, suspend and resume-fail programs and the reconciler get their credentials from a metadata service
    that answers late (botocore's default would have none: NoCredentialsError, the resume's nodes DOWN)."""
    ec2 = fleet.ec2_client(ClusterSettings(cluster="c1", region="us-east-1", pools={}, log_file="/dev/null"))
    assert ec2.describe_instances()["Reservations"] == []
