"""`gpucluster status STACK` from a team member's machine (gpucluster/aws/status_remote.py): one Run Command of the
cluster's status document on the running head, its JSON passed on with the head added, or a table.

Against a moto server for the head lookup and SendCommand as AWS receives it; moto runs nothing on the head (every
command Succeeds with an empty stdout), so the head's answers come from botocore's Stubber (StubbedSession of
test_verify_remote), with a status document of the shape the head prints (its run on a real cluster:
tests/integration/test_budget_closes_partitions.py)."""

from __future__ import annotations

import json
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError

from conftest import ROOT
from gpucluster.aws import status_remote
from gpucluster.cli_errors import credentials_problem
from gpucluster.contract.settings import STATUS_COMMAND, command_document_name, head_instance_name
from gpucluster.contract.status import table
from gpucluster.spec.model import load_stack
from test_dashboard_command import launch
from test_verify_remote import COMMAND_ID, HEAD, StubbedSession, aws_env, ended, no_sleep  # noqa: F401 (a fixture)

STACK = load_stack(ROOT / "stacks" / "Pulumi.team-a.yaml")
STATUS = {"cluster": STACK.cluster_name,
          "partitions": [{"name": "h100", "open": False, "state": "DOWN",
                          "why": "budget: team a spent $510.00 of its $500.00 monthly budget"}],
          "pools": {"h100": {"powered_down": 3, "busy": 1}},
          "jobs": {"running": 1, "pending": 3, "pending_reasons": {"PartitionDown": 2, "Priority": 1}},
          "budget": {"limit_usd": 500.0, "spent_usd": 510.0, "forecast_usd": None, "act_at_usd": 450.0,
                     "as_of": 1764650000.0},
          "gpu_hours": {"used": 12.5}, "quota": {"used_usd": 125.0, "usd": 1000.0}}


@pytest.mark.usefixtures("aws_env")
def test_sends_the_status_document_to_the_running_head_only(capsys: pytest.CaptureFixture[str]) -> None:
    session = boto3.Session()
    ec2 = session.client("ec2", region_name=STACK.region)
    head = launch(ec2, STACK.cluster_name, head_instance_name(STACK.cluster_name))
    launch(ec2, "gpucluster-other", head_instance_name("gpucluster-other"))
    requests: list[dict[str, Any]] = []
    session.events.register("provide-client-params.ssm.SendCommand", lambda params, **_: requests.append(params))
    code = status_remote.run(STACK, True, session, no_sleep)
    (request,) = requests
    assert request["DocumentName"] == command_document_name(STACK.cluster_name, STATUS_COMMAND)
    assert request["InstanceIds"] == [head] and "Parameters" not in request
    # moto's empty stdout is no status document: said, exit 1, as JSON errors with --json.
    out, err = capsys.readouterr()
    assert code == 1 and "the head's output is no status document" in err
    assert json.loads(out)["errors"][0]["path"] == ""


def test_prints_the_heads_status_with_the_head_added(capsys: pytest.CaptureFixture[str]) -> None:
    session = StubbedSession().answers({"Status": "InProgress"}, ended("Success", 0, json.dumps(STATUS)))
    assert status_remote.run(STACK, True, session, no_sleep) == 0
    session.all_answered()
    assert json.loads(capsys.readouterr().out) == {**STATUS, "head": {"instance_id": HEAD, "state": "running"}}

    session = StubbedSession().answers(ended("Success", 0, json.dumps(STATUS)))
    assert status_remote.run(STACK, False, session, no_sleep) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == table({**STATUS, "head": {"instance_id": HEAD, "state": "running"}})
    assert "  partition   h100: CLOSED (budget: team a spent $510.00 of its $500.00 monthly budget)" in lines
    assert "  jobs        1 running, 3 pending (PartitionDown 2, Priority 1)" in lines
    assert "  quota       $125.00 billed this month of $1,000.00 (the team's quota); 12.5 GPU-hours" in lines


@pytest.mark.usefixtures("aws_env")
def test_a_head_that_fails_or_is_missing_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    session = StubbedSession().answers(ended("Failed", 1, "", "status: Slurm did not answer: timed out"))
    assert status_remote.run(STACK, False, session, no_sleep) == 1
    assert "Slurm did not answer" in capsys.readouterr().err
    assert status_remote.run(STACK, True, boto3.Session(), no_sleep) == 1  # moto: no head at all
    out, err = capsys.readouterr()
    assert "no running head node(s)" in json.loads(out)["errors"][0]["message"] and COMMAND_ID not in err


@pytest.mark.parametrize("code,exits", [("ExpiredToken", None), ("AccessDeniedException", 1)])
def test_credentials_refused_go_up_to_the_command_line(code: str, exits: int | None,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """The head found, then SendCommand refused: expired credentials are the caller's to renew (the command line
    exits 2 saying so, tests/test_cli.py), any other refusal is status's to say (exit 1)."""
    session = StubbedSession(sends=False)
    session.stubs["ec2"].add_response("describe_instances", {"Reservations": [{"Instances": [{"InstanceId": HEAD}]}]})
    session.stubs["ssm"].add_client_error("send_command", service_error_code=code)
    session.answers()
    if exits is None:
        with pytest.raises(ClientError) as refused:
            status_remote.run(STACK, True, session, no_sleep)
        assert credentials_problem(refused.value) and capsys.readouterr().out == ""
    else:
        assert status_remote.run(STACK, True, session, no_sleep) == exits
        assert code in json.loads(capsys.readouterr().out)["errors"][0]["message"]
