"""`gpucluster verify STACK` from the operator's machine (gpucluster/aws/verify_remote.py): it finds the stack's
running head, sends the cluster's verify document through Run Command, waits for the command, and passes the head's
answer on (0 nothing failed, 1 something failed, 2 bad input; 1 with the reason when the command never ran through).

Against a moto server: the head lookup and the SendCommand request as AWS receives it (document, target, parameters,
timeout). moto answers every command with Success and an empty stdout, as no agent runs anything behind it; the
head's answers (a run document, exit 1 and 2, time-outs, cancellation, a cut output) and the polling come from
botocore's Stubber, with the shapes of SSM's API model. The document's script runs for real under /bin/sh."""

from __future__ import annotations

import inspect
import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.exceptions import NoCredentialsError
from botocore.stub import Stubber

from conftest import ROOT, reset_moto
from gpucluster import cli
from gpucluster.aws import run_command, verify_remote as remote
from gpucluster.cli_errors import UserError, print_errors
from gpucluster.contract import verify as v
from gpucluster.contract.settings import (
    DEEP_VERIFY_COMMAND,
    VERIFY_COMMAND,
    command_document_name,
    head_instance_name,
)
from gpucluster.node import bootstrap
from gpucluster.spec.model import load_stack
from test_dashboard_command import launch  # a tagged instance in moto

STACK = load_stack(ROOT / "stacks" / "Pulumi.team-a.yaml")
POOLS = [p.name for p in STACK.spec.pools]
HEAD = "i-0123456789abcdef0"
COMMAND_ID = "11111111-2222-3333-4444-555555555555"
DOCUMENT = command_document_name(STACK.cluster_name, VERIFY_COMMAND)
DEEP_DOCUMENT = command_document_name(STACK.cluster_name, DEEP_VERIFY_COMMAND)  # the admins' only


def no_sleep(seconds: float) -> None:
    """The waits between polls: minutes on AWS, nothing here."""


@pytest.fixture
def aws_env(moto_url: str, monkeypatch: pytest.MonkeyPatch) -> str:
    reset_moto(moto_url)
    for name, value in (("AWS_ENDPOINT_URL", moto_url), ("AWS_ACCESS_KEY_ID", "t"), ("AWS_SECRET_ACCESS_KEY", "t")):
        monkeypatch.setenv(name, value)
    return moto_url


def test_sends_the_verify_document_to_the_running_head_with_the_options_as_parameters(
        aws_env: str, capsys: pytest.CaptureFixture[str]) -> None:
    session = boto3.Session()
    ec2 = session.client("ec2", region_name=STACK.region)
    old = launch(ec2, STACK.cluster_name, head_instance_name(STACK.cluster_name))
    ec2.terminate_instances(InstanceIds=[old])  # a replaced head
    head = launch(ec2, STACK.cluster_name, head_instance_name(STACK.cluster_name))
    launch(ec2, STACK.cluster_name, f"{STACK.cluster_name}-{POOLS[0]}-1", pool=POOLS[0])  # a compute node
    launch(ec2, "gpucluster-other", head_instance_name("gpucluster-other"))  # another stack's head

    requests: list[dict[str, Any]] = []
    session.events.register("provide-client-params.ssm.SendCommand", lambda params, **_: requests.append(params))
    code = remote.run(STACK, ["--pool", POOLS[1], "--pool", POOLS[0], "--nodes", "2", "--deep"], session, no_sleep)
    (request,) = requests
    assert request["DocumentName"] == DEEP_DOCUMENT and request["InstanceIds"] == [head]
    # moto adds every instance of the account to a command sent without Targets: what it recorded is checked above
    # as sent, and here for the rest.
    (sent,) = session.client("ssm", region_name=STACK.region).list_commands()["Commands"]
    assert sent["DocumentName"] == DEEP_DOCUMENT and head in sent["InstanceIds"]
    assert sent["Parameters"] == {"pools": [f"{POOLS[1]} {POOLS[0]}"], "nodes": ["2"], "deep": ["true"],
                                  "last": ["false"]}
    assert sent["TimeoutSeconds"] == run_command.DELIVERY_SECONDS
    # moto runs nothing on the head: its empty stdout is no run document, and is said so, not read as a pass.
    out, err = capsys.readouterr()
    assert code == 1 and out == ""
    assert f"sent {DEEP_DOCUMENT} to {head}" in err and "the head's output is no run document" in err


def test_last_sends_only_last(aws_env: str) -> None:
    session = boto3.Session()
    launch(session.client("ec2", region_name=STACK.region), STACK.cluster_name, head_instance_name(STACK.cluster_name))
    remote.run(STACK, ["--last", "--json"], session, no_sleep)
    (sent,) = session.client("ssm", region_name=STACK.region).list_commands()["Commands"]
    # pools and nodes: the document's defaults; no deep, which everyone's document does not declare.
    assert sent["Parameters"] == {"last": ["true"]} and sent["DocumentName"] == DOCUMENT


def test_a_user_refused_the_deep_document_is_told_it_is_the_admins(capsys: pytest.CaptureFixture[str]) -> None:
    session = StubbedSession(sends=False)
    session.stubs["ec2"].add_response("describe_instances", {"Reservations": [{"Instances": [{"InstanceId": HEAD}]}]})
    session.stubs["ssm"].add_client_error(
        "send_command", service_error_code="AccessDeniedException",
        service_message=f"not authorized to perform ssm:SendCommand on {DEEP_DOCUMENT}")
    assert remote.run(STACK, ["--deep"], session.answers(), no_sleep) == 1
    said = capsys.readouterr().err
    assert f"--deep sends {DEEP_DOCUMENT}, which only the stack's admin access policy allows" in said


def test_no_running_head_is_said_and_sends_nothing(aws_env: str, capsys: pytest.CaptureFixture[str]) -> None:
    session = boto3.Session()
    ec2 = session.client("ec2", region_name=STACK.region)
    stopped = launch(ec2, STACK.cluster_name, head_instance_name(STACK.cluster_name))
    ec2.stop_instances(InstanceIds=[stopped])
    assert remote.run(STACK, [], session, no_sleep) == 1
    assert f"no running head node(s) of {STACK.cluster_name} in {STACK.region} ({stopped} is stopped:" in \
        capsys.readouterr().err
    assert session.client("ssm", region_name=STACK.region).list_commands()["Commands"] == []


def test_no_credentials_go_up_to_the_command_line(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """botocore's error, unsaid here: the command line says it once, exit 2 (tests/test_cli.py)."""
    for name in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(name)
    for name, value in (("AWS_SHARED_CREDENTIALS_FILE", os.devnull), ("AWS_CONFIG_FILE", os.devnull),
                        ("AWS_EC2_METADATA_DISABLED", "true")):
        monkeypatch.setenv(name, value)
    with pytest.raises(NoCredentialsError):
        remote.run(STACK, [], boto3.Session(), no_sleep)
    assert capsys.readouterr() == ("", "")


class Refusing:
    """A session that fails the test if anything reaches AWS."""

    def client(self, name: str, region_name: str) -> Any:
        raise AssertionError(f"{name} called for bad input")


@pytest.mark.parametrize(("args", "said"), [
    (["--pool", "nope", "--pool", "gone"], f"no pool nope, gone in stack {STACK.name}; its pools: {', '.join(POOLS)}"),
    (["--nodes", "0"], "--nodes must be a whole number from 1, got '0'"),
    (["--nodes", "$(id)"], "--nodes must be a whole number from 1, got '$(id)'"),
    (["--pool", "p5-od;id"], "no pool p5-od;id"),
    (["--shell", "id"], "unknown option '--shell'"),
    (["--last", "--pool", POOLS[0]], "--last prints the latest run: it takes no --pool, --nodes or --deep"),
])
def test_bad_options_exit_2_before_any_aws_call(args: list[str], said: str) -> None:
    with pytest.raises(UserError) as refused:
        remote.run(STACK, args, Refusing(), no_sleep)
    assert refused.value.code == 2 and any(said in message for _, message in refused.value.problems)


def test_every_problem_is_said_at_once() -> None:
    with pytest.raises(UserError) as refused:
        remote.run(STACK, ["--pool", "nope", "--nodes", "x", "--bogus"], Refusing(), no_sleep)
    assert len(refused.value.problems) == 3


SMALLEST = min(STACK.spec.pools, key=lambda pool: pool.max_nodes)
TOO_MANY = SMALLEST.max_nodes + 1


@pytest.mark.parametrize(("args", "said"), [
    (["--pool", "nope"], [f"verify: no pool nope in stack {STACK.name}; its pools: {', '.join(POOLS)}"]),
    (["--nodes", str(TOO_MANY)], [f"verify: --nodes {TOO_MANY} is more than pool {p.name}'s max_nodes ({p.max_nodes})"
                                  for p in STACK.spec.pools if p.max_nodes < TOO_MANY]),
])
def test_the_command_lines_bad_input_is_refused_before_aws_as_json_errors(
        args: list[str], said: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Off the head, --pool and --nodes are checked against the stack file (its pools, their max_nodes) before
    anything reaches AWS; with --json the problems print as the command line's {"errors": [...]}."""
    monkeypatch.setattr(cli, "SETTINGS_FILE", str(tmp_path / "absent.json"))
    monkeypatch.setattr(cli, "aws_session", Refusing)
    assert cli.main(["verify", STACK.name, "--json", *args]) == 2
    out = capsys.readouterr().out
    assert [e["message"] for e in json.loads(out)["errors"]] == said


# --- the head's answers, through botocore's Stubber ------------------------------------------------------------------
RESULTS = [
    v.judge(v.Check(POOLS[0], v.GPUS, {"count": 8}), 8),
    v.judge(v.Check(POOLS[0], v.NCCL_ALL_REDUCE_BUSBW_GBPS, {"min": 400, "bytes": 1 << 34}), 455.5),
    v.judge(v.Check(POOLS[0], v.FSX_READ_MBPS, {}), 1500),
]
FAILED = [*RESULTS, v.judge(v.Check(POOLS[1], v.GPUS, {"count": 8}), 7)]


# Where the stubbed clients come from: one session for the module, as a new one loads botocore's models again (EC2's
# is large). Each StubbedSession still has clients of its own.
REAL_SESSION = boto3.Session(aws_access_key_id="t", aws_secret_access_key="t", region_name=STACK.region)


class StubbedSession:
    """boto3.Session's client(): real botocore clients whose answers are queued with Stubber (validated against SSM's
    and EC2's API models)."""

    def __init__(self, sends: bool = True) -> None:
        self.clients = {name: REAL_SESSION.client(name) for name in ("ec2", "ssm")}
        self.stubs = {name: Stubber(client) for name, client in self.clients.items()}
        if sends:
            self.stubs["ec2"].add_response("describe_instances",
                                           {"Reservations": [{"Instances": [{"InstanceId": HEAD}]}]})
            self.stubs["ssm"].add_response("send_command", {"Command": {"CommandId": COMMAND_ID}})

    def answers(self, *invocations: dict[str, Any]) -> StubbedSession:
        for invocation in invocations:
            if invocation.get("error"):
                self.stubs["ssm"].add_client_error("get_command_invocation", service_error_code=invocation["error"])
            else:
                self.stubs["ssm"].add_response(
                    "get_command_invocation", {"CommandId": COMMAND_ID, "InstanceId": HEAD, **invocation},
                    expected_params={"CommandId": COMMAND_ID, "InstanceId": HEAD})
        for stub in self.stubs.values():
            stub.activate()
        return self

    def client(self, name: str, region_name: str) -> Any:
        assert region_name == STACK.region
        return self.clients[name]

    def all_answered(self) -> None:
        for stub in self.stubs.values():
            stub.assert_no_pending_responses()


def ended(status: str, code: int, stdout: str = "", stderr: str = "", details: str = "") -> dict[str, Any]:
    return {"Status": status, "StatusDetails": details or status, "ResponseCode": code,
            "StandardOutputContent": stdout, "StandardErrorContent": stderr}


def test_waits_through_pending_and_prints_the_heads_run_as_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    session = StubbedSession().answers({"error": "InvocationDoesNotExist"}, {"Status": "Pending"},
                                       {"Status": "InProgress"}, ended("Success", 0, v.run_json(RESULTS)))
    waits: list[float] = []
    assert remote.run(STACK, [], session, waits.append) == 0
    session.all_answered()
    assert waits == sorted(waits) and waits[0] < waits[-1]  # backs off
    out = capsys.readouterr().out
    assert out.splitlines() == v.run_table(RESULTS)
    assert "nccl_all_reduce_busbw_gbps" in out and ">= 400" in out and "no known figure: warns" in out


def test_json_prints_the_run_document() -> None:
    session = StubbedSession().answers(ended("Success", 0, v.run_json(RESULTS)))
    done = _captured(lambda: remote.run(STACK, ["--json"], session, no_sleep))
    assert done[0] == 0 and v.run_from_json(done[1]) == RESULTS


def test_a_failed_check_exits_1_with_the_table_and_its_fix(capsys: pytest.CaptureFixture[str]) -> None:
    session = StubbedSession().answers(ended("Failed", 1, v.run_json(FAILED), details="Failed"))
    assert remote.run(STACK, [], session, no_sleep) == 1
    out = capsys.readouterr().out
    (line,) = [line for line in out.splitlines() if line.startswith(POOLS[1])]
    assert " fail " in line and v.RULES[v.GPUS].fix in line


def test_the_heads_bad_input_is_2_with_its_reason() -> None:
    """The document runs `verify --json`: the head prints its refusal as {"errors": [...]} on stdout, exit 2, and
    nothing on stderr (cli_errors.print_errors); its reasons are this command's bad input."""
    head_said = io.StringIO()
    print_errors([("", "verify: --nodes 3 is more than pool p5-od's max_nodes (2)")], True, "gpucluster",
                 out=head_said)
    session = StubbedSession().answers(ended("Failed", 2, stdout=head_said.getvalue()))
    with pytest.raises(UserError) as refused:
        remote.run(STACK, ["--nodes", "3"], session, no_sleep)
    assert refused.value.code == 2
    assert refused.value.problems == [
        ("", "verify: the head refused the options: --nodes 3 is more than pool p5-od's max_nodes (2)")]


def test_a_refusal_without_a_json_document_gives_stderrs_reason() -> None:
    session = StubbedSession().answers(ended("Failed", 2, stderr="usage: gpucluster verify\nunrecognized arguments"))
    with pytest.raises(UserError, match="the head refused the options: unrecognized arguments"):
        remote.run(STACK, [], session, no_sleep)


@pytest.mark.parametrize(("invocation", "said"), [
    (ended("TimedOut", -1, details="Delivery Timed Out"), "the head's SSM Agent did not take the command"),
    (ended("TimedOut", -1, details="Execution Timed Out"), "the run took longer than the document allows"),
    (ended("Cancelled", -1), "the command was cancelled"),
    (ended("Failed", -1, details="Undeliverable"), "ended Undeliverable on"),
    (ended("Failed", remote.OLD_AGENT_EXIT, stderr="the SSM Agent on the head passes no parameters"),
     "the SSM Agent on the head passes no parameters"),
    (ended("Success", 0, stdout="not json"), "the head's output is no run document"),
    (ended("Failed", 1, stderr="Traceback (most recent call last):"), "it said: Traceback"),
])
def test_a_command_that_did_not_run_through_is_1_with_the_reason(invocation: dict[str, Any], said: str,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert remote.run(STACK, [], StubbedSession().answers(invocation), no_sleep) == 1
    out, err = capsys.readouterr()
    assert out == "" and said in err


@pytest.mark.parametrize("code", [0, 1])
def test_a_cut_output_is_said_not_misparsed(code: int, capsys: pytest.CaptureFixture[str]) -> None:
    """The agent returns the first 24,000 characters and marks the cut; the head's exit code still stands."""
    whole = v.run_json(FAILED * 200)
    cut = whole[:remote.OUTPUT_LIMIT - 40] + "--output truncated--"  # the agent's own suffix (iohandler.go)
    session = StubbedSession().answers(ended("Success" if code == 0 else "Failed", code, cut))
    assert remote.run(STACK, [], session, no_sleep) == code
    out, err = capsys.readouterr()
    assert out == "" and "longer than Run Command returns (24,000 characters)" in err and "--last" in err


def test_credentials_that_expire_while_waiting_say_the_run_goes_on_and_how_to_read_it(
        capsys: pytest.CaptureFixture[str]) -> None:
    """A deep run lasts longer than many operators' session credentials: the head's run is not lost with them."""
    session = StubbedSession().answers({"Status": "InProgress"}, {"error": "ExpiredTokenException"})
    assert remote.run(STACK, [], session, no_sleep) == 1
    session.all_answered()
    err = capsys.readouterr().err.splitlines()[-1]
    assert "ExpiredTokenException" in err and "the run goes on on the head" in err
    assert COMMAND_ID in err and f"verify {STACK.name} --last" in err


def test_the_wait_is_bounded_and_says_its_progress(capsys: pytest.CaptureFixture[str]) -> None:
    """A command that stays InProgress: progress lines about once a minute, None once the bound has passed."""
    now = [0.0]

    def sleep(seconds: float) -> None:
        assert 0 < seconds <= 30
        now[0] += seconds

    session = StubbedSession(sends=False).answers(*[{"Status": "InProgress"}] * 40)
    found = run_command.wait(session.client("ssm", STACK.region), COMMAND_ID, HEAD, 600, sleep=sleep,
                             clock=lambda: now[0], command="verify")
    assert found is None and 600 <= now[0] < 660
    progress = capsys.readouterr().err.splitlines()
    assert 8 <= len(progress) <= 10 and all(line.startswith("verify: InProgress on ") for line in progress)


def _captured(call: Any) -> tuple[int, str]:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = call()
    return code, out.getvalue()


# --- the document's script, run --------------------------------------------------------------------------------------
@pytest.fixture
def script(tmp_path: Path) -> Iterator[Path]:
    """The document's script with a stand-in for the head's /usr/local/bin/gpucluster (the one seam: that path is on
    the head) that prints its argv as JSON and exits with $STAND_IN_EXIT."""
    stand_in = tmp_path / "gpucluster"
    stand_in.write_text(f"#!{sys.executable}\nimport json, os, sys\nprint(json.dumps(sys.argv[1:]))\n"
                        "sys.exit(int(os.environ.get('STAND_IN_EXIT', '0')))\n")
    stand_in.chmod(0o755)
    path = tmp_path / "_script.sh"  # the agent's name for it; it runs `sh -c _script.sh` (runshellscript.go)
    path.write_text("\n".join(remote.SCRIPT).replace(run_command.HEAD_COMMAND, str(stand_in)) + "\n")
    path.chmod(0o755)
    yield path


def run_script(script: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["sh", "-c", str(script)], env={"PATH": "/usr/bin:/bin", **env}, capture_output=True,
                          text=True, timeout=30, cwd=script.parent)


def test_the_script_runs_exactly_gpucluster_verify_json_with_the_parameters(script: Path) -> None:
    assert run_command.HEAD_COMMAND == str(inspect.signature(bootstrap.command_line).parameters["bin_dir"].default
                                      / "gpucluster")
    defaults = {"SSM_pools": "", "SSM_nodes": "", "SSM_deep": "false", "SSM_last": "false"}
    assert json.loads(run_script(script, **defaults).stdout) == ["verify", "--json"]
    chosen = run_script(script, **defaults | {"SSM_pools": "p5-spot p5-od", "SSM_nodes": "3", "SSM_deep": "true"})
    assert json.loads(chosen.stdout) == ["verify", "--json", "--pool", "p5-spot", "--pool", "p5-od", "--nodes", "3",
                                         "--deep"]
    assert json.loads(run_script(script, **defaults | {"SSM_last": "true"}).stdout) == ["verify", "--json", "--last"]
    # The head's exit code is the command's ResponseCode.
    assert run_script(script, **defaults | {"STAND_IN_EXIT": "1"}).returncode == 1
    assert run_script(script, **defaults | {"STAND_IN_EXIT": "2"}).returncode == 2


def test_a_value_that_got_past_a_pattern_stays_data(script: Path) -> None:
    """The patterns refuse these (tests/test_team_access.py); the environment variables keep them data even so."""
    marker = script.parent / "injected"
    done = run_script(script, SSM_pools="", SSM_nodes=f"$(touch {marker}); touch {marker}", SSM_deep="false",
                      SSM_last="false")
    assert json.loads(done.stdout) == ["verify", "--json", "--nodes", f"$(touch {marker}); touch {marker}"]
    globbed = run_script(script, SSM_pools="*", SSM_nodes="", SSM_deep="false", SSM_last="false")
    assert json.loads(globbed.stdout) == ["verify", "--json", "--pool", "*"]
    assert not marker.exists()


def test_an_agent_without_environment_parameters_is_refused(script: Path) -> None:
    done = run_script(script)
    assert done.returncode == remote.OLD_AGENT_EXIT and done.stdout == ""
    assert "3.3.2746.0" in done.stderr
