"""`gpucluster connect|ssh-config|ssh-proxy STACK` (gpucluster/aws/connect.py) against a moto server: the
head found by its tags, the caller found among the stack's principals by STS (moto answers GetCallerIdentity for IAM
users' keys and assumed roles' credentials as AWS does), the Session document chosen, and the AWS CLI exec'd.

The seam: `aws` and `session-manager-plugin` on PATH are stand-ins that record their argv and exit. This machine has
neither the AWS CLI nor AWS's Session Manager plugin (a closed-source binary), and a real session needs a real SSM
Agent behind it; the command line exec'd in place of gpucluster is what these tests can prove, and is checked
argument by argument."""

from __future__ import annotations

import contextlib
import io
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import boto3
import pytest
from botocore.exceptions import ClientError
from botocore.stub import Stubber

from conftest import ROOT, reset_moto
from gpucluster import cli, cli_errors
from gpucluster.aws import connect
from gpucluster.contract.settings import LOGIN_USER, head_instance_name
from gpucluster.spec.model import load_stack
from test_dashboard_command import launch  # a tagged instance in moto

TEAM_A = load_stack(ROOT / "stacks" / "Pulumi.team-a.yaml")  # people: alice (a role), bob (a role and a user)
TEAM_B = load_stack(ROOT / "stacks" / "Pulumi.team-b.yaml")  # no people
STAND_IN = '#!/bin/sh\nprintf "%s\\n" "$(basename "$0")" "$@" > "$RECORD"\n'


@pytest.fixture
def moto(moto_url: str) -> str:
    reset_moto(moto_url)
    return moto_url


def aws_client(moto_url: str, service: str, stack: Any = TEAM_A, **credentials: str) -> Any:
    keys = credentials or {"aws_access_key_id": "t", "aws_secret_access_key": "t"}
    return boto3.client(service, region_name=stack.region, endpoint_url=moto_url, **keys)


def head(moto_url: str, stack: Any = TEAM_A) -> str:
    return launch(aws_client(moto_url, "ec2", stack), stack.cluster_name, head_instance_name(stack.cluster_name))


def stand_ins(tmp_path: Path, *names: str) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in names:
        (bin_dir / name).write_text(STAND_IN)
        (bin_dir / name).chmod(0o755)
    return bin_dir


def environment(tmp_path: Path, moto_url: str | None, tools: tuple[str, ...],
                credentials: dict[str, str] | None) -> dict[str, str]:
    """What the command sees: no AWS_* of this machine's, moto's endpoint and the credentials given, the stand-ins on
    PATH and a home of the test's own (ssh-config's key)."""
    record = tmp_path / "argv"
    record.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env |= {"AWS_SHARED_CREDENTIALS_FILE": os.devnull, "AWS_CONFIG_FILE": os.devnull,
            "AWS_EC2_METADATA_DISABLED": "true", "RECORD": str(record), "HOME": str(tmp_path),
            "PATH": f"{stand_ins(tmp_path, *tools)}:/usr/bin:/bin"}
    if moto_url:
        env |= {"AWS_ENDPOINT_URL": moto_url, **(credentials or {"AWS_ACCESS_KEY_ID": "t",
                                                                  "AWS_SECRET_ACCESS_KEY": "t"})}
    return env


def recorded(tmp_path: Path) -> list[str]:
    record = tmp_path / "argv"
    return record.read_text().splitlines() if record.exists() else []


def run(tmp_path: Path, moto_url: str | None, *args: str, tools: tuple[str, ...] = ("aws", "session-manager-plugin"),
        credentials: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """The command in this process (a cold process per case cost seconds of CPU each; one test runs the real one,
    test_the_command_becomes_the_aws_cli): its exec of the AWS CLI runs the stand-in and ends the command with the
    stand-in's status, as the exec'd program's would. Returns the outcome and the argv the stand-in was given."""
    def become(file: str, argv: list[str]) -> None:
        raise SystemExit(subprocess.run(argv, check=False).returncode)

    out, err = io.StringIO(), io.StringIO()
    env = environment(tmp_path, moto_url, tools, credentials)
    with mock.patch.dict(os.environ, env, clear=True), mock.patch("os.execvp", become), contextlib.chdir(ROOT), \
            contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(list(args))
        except SystemExit as exc:
            code = int(exc.code or 0)
    done = subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())
    assert "Traceback" not in done.stderr, done.stderr
    return done, recorded(tmp_path)


def test_the_command_becomes_the_aws_cli(tmp_path: Path, moto: str) -> None:
    """The real entry point, in a process of its own: it execs the AWS CLI in its place."""
    instance = head(moto)
    done = subprocess.run([sys.executable, "-m", "gpucluster", "connect", "team-a", "--admin"], cwd=ROOT,
                          env=environment(tmp_path, moto, ("aws", "session-manager-plugin"), None),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert recorded(tmp_path) == start_session(TEAM_A, instance, f"{TEAM_A.cluster_name}-admin-session")


def start_session(stack: Any, instance: str, document: str) -> list[str]:
    """The AWS CLI's command line, written out: the Slurm stack's `connect` outputs print it
    (tests/test_team_access.py), `gpucluster dashboard` with its parameters (tests/test_dashboard_command.py)."""
    return ["aws", "ssm", "start-session", "--region", stack.region, "--target", instance, "--document-name",
            document]


def assumed_role(moto_url: str, path: str, name: str) -> dict[str, str]:
    """Credentials of a session of the role path/name, as `aws sso login` or an assume-role profile gives them."""
    iam = aws_client(moto_url, "iam")
    role = iam.create_role(RoleName=name, Path=path, AssumeRolePolicyDocument="{}")["Role"]
    creds = aws_client(moto_url, "sts").assume_role(RoleArn=role["Arn"], RoleSessionName=f"{name}-laptop")[
        "Credentials"]
    return {"AWS_ACCESS_KEY_ID": creds["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": creds["SecretAccessKey"],
            "AWS_SESSION_TOKEN": creds["SessionToken"]}


def test_a_person_gets_their_own_shell_by_their_principal(tmp_path: Path, moto: str) -> None:
    instance = head(moto)
    launch(aws_client(moto, "ec2"), "gpucluster-other", head_instance_name("gpucluster-other"))  # another stack's
    cluster = TEAM_A.cluster_name
    # alice signs in with her role (listed with its path /researchers/; an assumed role's ARN carries none).
    done, argv = run(tmp_path, moto, "connect", "team-a", credentials=assumed_role(moto, "/researchers/", "alice"))
    assert done.returncode == 0, done.stderr
    assert argv == start_session(TEAM_A, instance, f"{cluster}-user-alice-session")
    # bob with his IAM user's keys.
    iam = aws_client(moto, "iam")
    iam.create_user(UserName="bob")
    key = iam.create_access_key(UserName="bob")["AccessKey"]
    done, argv = run(tmp_path, moto, "connect", "team-a", credentials={
        "AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]})
    assert done.returncode == 0 and argv == start_session(TEAM_A, instance, f"{cluster}-user-bob-session")
    # --user names the person; --admin the admins' shell (ssm-user, sudo).
    done, argv = run(tmp_path, moto, "connect", "team-a", "--user", "bob")
    assert done.returncode == 0 and argv[-1] == f"{cluster}-user-bob-session"
    done, argv = run(tmp_path, moto, "connect", "team-a", "--admin")
    assert done.returncode == 0 and argv[-1] == f"{cluster}-admin-session"


def test_a_caller_who_is_nobody_in_the_stack_is_told_and_exits_2(tmp_path: Path, moto: str) -> None:
    head(moto)
    done, argv = run(tmp_path, moto, "connect", "team-a", credentials=assumed_role(moto, "/researchers/", "mallory"))
    assert done.returncode == 2 and argv == []
    assert "assumed" not in done.stderr and "role/mallory is none of the principals of" in done.stderr
    done, argv = run(tmp_path, moto, "connect", "team-a", "--user", "carol")
    assert done.returncode == 2 and argv == [] and "no person 'carol'" in done.stderr
    done, argv = run(tmp_path, moto, "connect", "team-a", "--user", "alice", "--admin")
    assert done.returncode == 2 and argv == []


def test_without_people_everyone_is_the_login_user(tmp_path: Path, moto: str) -> None:
    instance = head(moto, TEAM_B)
    done, argv = run(tmp_path, moto, "connect", "team-b")
    assert done.returncode == 0 and argv == start_session(TEAM_B, instance, f"{TEAM_B.cluster_name}-user-session")
    done, argv = run(tmp_path, moto, "connect", "team-b", "--user", "alice")
    assert done.returncode == 2 and argv == [] and f"everyone connects as {LOGIN_USER}" in done.stderr


def test_no_head_or_a_stopped_one_exits_1(tmp_path: Path, moto: str) -> None:
    done, argv = run(tmp_path, moto, "connect", "team-a", "--user", "alice")
    assert done.returncode == 1 and argv == [] and "no running head node(s)" in done.stderr
    stopped = head(moto)
    aws_client(moto, "ec2").stop_instances(InstanceIds=[stopped])
    done, argv = run(tmp_path, moto, "connect", "team-a", "--user", "alice")
    assert done.returncode == 1 and argv == [] and f"{stopped} is stopped" in done.stderr


def test_a_missing_aws_cli_or_plugin_exits_2_saying_where_to_get_it(tmp_path: Path, moto: str) -> None:
    head(moto)
    done, argv = run(tmp_path, moto, "connect", "team-a", "--user", "alice", tools=("aws",))
    assert done.returncode == 2 and argv == []
    assert "session-manager-plugin) is not on PATH" in done.stderr and "install-plugin.html" in done.stderr
    bare = tmp_path / "bare"
    bare.mkdir()
    done, argv = run(bare, moto, "connect", "team-a", "--user", "alice", tools=())
    assert done.returncode == 2 and argv == [] and "the AWS CLI (aws) is not on PATH" in done.stderr


def test_no_credentials_exits_2(tmp_path: Path) -> None:
    done, argv = run(tmp_path, None, "connect", "team-a")
    assert done.returncode == 2 and argv == [] and "no AWS credentials" in done.stderr


def test_ssh_config_goes_through_session_manager_with_a_key_pushed_per_connection(tmp_path: Path, moto: str) -> None:
    instance = head(moto)
    cluster = TEAM_A.cluster_name
    done, _ = run(tmp_path, moto, "ssh-config", "team-a", "--user", "alice")
    assert done.returncode == 0, done.stderr
    key = tmp_path / ".ssh" / f"gpucluster-{cluster}"
    assert key.exists() and key.with_suffix(".pub").read_text().startswith("ssh-ed25519 ")
    block = dict(line.strip().split(" ", 1) for line in done.stdout.splitlines() if not line.startswith("#"))
    assert block["Host"] == cluster and block["User"] == "alice" and block["IdentityFile"] == str(key)
    # ssh runs the ProxyCommand: it pushes the key as alice, then becomes the stream to the head's port 22.
    proxy = shlex.split(block["ProxyCommand"])
    assert proxy[proxy.index("-m") + 1:] == ["gpucluster", "ssh-proxy", str(ROOT / "stacks" / "Pulumi.team-a.yaml"),
                                             "--user", "alice"]
    # moto accepts SendSSHPublicKey without keeping what it was sent: the push is checked by a Stubber that expects
    # alice, this machine's public key and the head's instance id (any other is a failed push, exit 1).
    pushes = boto3.client("ec2-instance-connect", region_name=TEAM_A.region, aws_access_key_id="t",
                          aws_secret_access_key="t")
    real_client = boto3.session.Session.client

    def client(self: boto3.session.Session, service: str, *args: Any, **kwargs: Any) -> Any:
        return pushes if service == "ec2-instance-connect" else real_client(self, service, *args, **kwargs)

    with Stubber(pushes) as push, mock.patch.object(boto3.session.Session, "client", client):
        push.add_response("send_ssh_public_key", {"RequestId": "r-1", "Success": True}, {
            "InstanceId": instance, "InstanceOSUser": "alice", "SSHPublicKey": key.with_suffix(".pub").read_text()})
        done, argv = run(tmp_path, moto, *proxy[proxy.index("-m") + 1:][1:])
        push.assert_no_pending_responses()
    assert done.returncode == 0, done.stderr
    assert argv == start_session(TEAM_A, instance, f"{cluster}-ssh-session")
    # A second ssh-config keeps the key (known to nobody but this machine).
    before = key.read_bytes()
    assert run(tmp_path, moto, "ssh-config", "team-a", "--user", "alice")[0].returncode == 0
    assert key.read_bytes() == before


def test_ssh_proxy_refuses_an_account_the_stack_does_not_have(tmp_path: Path, moto: str) -> None:
    head(moto)
    assert run(tmp_path, moto, "ssh-config", "team-a", "--user", "alice")[0].returncode == 0
    done, argv = run(tmp_path, moto, "ssh-proxy", "team-a", "--user", "root")
    assert done.returncode == 2 and argv == [] and "no person 'root'" in done.stderr


class RefusingSession:
    """boto3.Session's client(): real botocore clients whose answers are queued with Stubber, so one call can refuse
    the credentials while the calls before it answered (moto takes any credentials)."""

    def __init__(self, refused: str, code: str) -> None:
        real = boto3.Session(aws_access_key_id="t", aws_secret_access_key="t", region_name=TEAM_A.region)
        self.clients = {name: real.client(name) for name in ("ec2", "sts", "ec2-instance-connect")}
        ec2, connect = Stubber(self.clients["ec2"]), Stubber(self.clients["ec2-instance-connect"])
        ec2.add_response("describe_instances",
                         {"Reservations": [{"Instances": [{"InstanceId": "i-0123456789abcdef0"}]}]})
        connect.add_client_error(refused, service_error_code=code)
        sts = Stubber(self.clients["sts"])
        sts.add_client_error("get_caller_identity", service_error_code=code)
        for stub in (ec2, connect, sts):
            stub.activate()

    def client(self, name: str, region_name: str) -> Any:
        return self.clients[name]


@pytest.mark.parametrize("command", ["connect", "ssh-config", "ssh-proxy"])
def test_credentials_refused_go_up_to_the_command_line_others_exit_1(command: str, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Expired credentials are the caller's to renew (the command line exits 2 saying so, tests/test_cli.py); any
    other refusal is this command's to say (exit 1). ssh-proxy's refusal comes after the head was found."""
    monkeypatch.setenv("PATH", f"{stand_ins(tmp_path, 'aws', 'session-manager-plugin')}:/usr/bin:/bin")
    key = connect.key_path(TEAM_A, tmp_path).with_suffix(".pub")
    key.parent.mkdir()
    key.write_text(f"ssh-ed25519 {'A' * 68} test\n")  # EC2 Instance Connect's model: 80 characters at least

    def call(code: str) -> int:
        session = RefusingSession("send_ssh_public_key", code)
        if command == "connect":
            return connect.connect(TEAM_A, False, None, session)
        if command == "ssh-config":
            return connect.ssh_config(TEAM_A, ROOT / "stacks" / "Pulumi.team-a.yaml", None, session, home=tmp_path)
        return connect.ssh_proxy(TEAM_A, "alice", session, home=tmp_path)

    with pytest.raises(ClientError) as refused:
        call("ExpiredToken")
    assert cli_errors.credentials_problem(refused.value)
    assert call("AccessDenied") == 1
