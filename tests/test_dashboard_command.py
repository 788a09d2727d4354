"""`python -m gpucluster dashboard STACK` against a moto server: it finds the stack's running head node by its tags and
prints the Session Manager port forward to Grafana; no head, no credentials: a message and exit 1.

`--run` is tested in this process with os.execvp replaced: there is no AWS CLI or Session Manager plugin here, and a
real exec would replace the test runner. That is the one seam: the command given to execvp is the one printed."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from typing import Any

import boto3
import pytest

from conftest import ROOT, reset_moto
from gpucluster import cli, cli_errors
from gpucluster.contract.settings import CLUSTER_TAG, POOL_TAG, head_instance_name, session_document_name
from gpucluster.spec.model import load_stack

STACK = load_stack(ROOT / "stacks" / "Pulumi.team-a.yaml")


def launch(ec2: Any, cluster: str, name: str, *, pool: str | None = None) -> str:
    tags = [{"Key": CLUSTER_TAG, "Value": cluster}, {"Key": "Name", "Value": name}]
    tags += [{"Key": POOL_TAG, "Value": pool}] if pool else []
    launched = ec2.run_instances(ImageId="ami-12c6146b", InstanceType="m7i.xlarge", MinCount=1, MaxCount=1,
                                 TagSpecifications=[{"ResourceType": "instance", "Tags": tags}])
    return launched["Instances"][0]["InstanceId"]


@pytest.fixture
def ec2(moto_url: str) -> Any:
    reset_moto(moto_url)
    return boto3.client("ec2", region_name=STACK.region, endpoint_url=moto_url, aws_access_key_id="t",
                        aws_secret_access_key="t")


def run(moto_url: str | None, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env |= {"AWS_SHARED_CREDENTIALS_FILE": os.devnull, "AWS_CONFIG_FILE": os.devnull,
            "AWS_EC2_METADATA_DISABLED": "true"}  # no instance role to fall back on
    if moto_url:
        env |= {"AWS_ENDPOINT_URL": moto_url, "AWS_ACCESS_KEY_ID": "t", "AWS_SECRET_ACCESS_KEY": "t"}
    return subprocess.run([sys.executable, "-m", "gpucluster", "dashboard", STACK.name, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_prints_the_port_forward_to_the_running_head(ec2: Any, moto_url: str) -> None:
    cluster = STACK.cluster_name
    old_head = launch(ec2, cluster, head_instance_name(cluster))
    ec2.terminate_instances(InstanceIds=[old_head])  # a replaced head
    head = launch(ec2, cluster, head_instance_name(cluster))
    launch(ec2, cluster, f"{cluster}-h100-1", pool="h100")  # a compute node of the same cluster
    launch(ec2, "gpucluster-other", head_instance_name("gpucluster-other"))  # another stack's head

    done = run(moto_url, "--local-port", "8301")
    assert done.returncode == 0, done.stderr
    command, url = done.stdout.splitlines()
    assert shlex.split(command) == ["aws", "ssm", "start-session", "--region", STACK.region, "--target", head,
                                    "--document-name", f"{cluster}-dashboard-session",
                                    "--parameters", "localPortNumber=8301"]
    assert url.startswith("Grafana: http://localhost:8301/ ")
    assert session_document_name(cluster, "dashboard") == f"{cluster}-dashboard-session"

    default = run(moto_url)
    assert default.returncode == 0 and "localPortNumber=3000" in default.stdout  # settings.GRAFANA_PORT


def test_no_running_head_is_said_and_exits_1(ec2: Any, moto_url: str) -> None:
    cluster = STACK.cluster_name
    launch(ec2, cluster, f"{cluster}-h100-1", pool="h100")
    stopped = launch(ec2, cluster, head_instance_name(cluster))
    ec2.stop_instances(InstanceIds=[stopped])
    done = run(moto_url)
    assert done.returncode == 1 and done.stdout == ""
    assert f"no running head node(s) of {cluster} in {STACK.region}" in done.stderr
    assert "Traceback" not in done.stderr


def test_no_credentials_is_said_and_exits_2() -> None:
    done = run(None)
    assert done.returncode == 2 and done.stdout == ""  # the convention: a missing precondition is bad input
    assert done.stderr == f"gpucluster: {cli_errors.NO_CREDENTIALS}\n"


def test_a_port_outside_1_to_65535_is_refused() -> None:
    for port in ("0", "65536"):
        done = run(None, "--local-port", port)
        assert done.returncode == 2 and "is not a TCP port" in done.stderr


def test_run_execs_the_printed_command(ec2: Any, moto_url: str, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    head = launch(ec2, STACK.cluster_name, head_instance_name(STACK.cluster_name))
    for name, value in (("AWS_ENDPOINT_URL", moto_url), ("AWS_ACCESS_KEY_ID", "t"), ("AWS_SECRET_ACCESS_KEY", "t")):
        monkeypatch.setenv(name, value)
    execs: list[tuple[str, list[str]]] = []
    monkeypatch.setattr(os, "execvp", lambda file, argv: execs.append((file, list(argv))))
    assert cli.main(["dashboard", STACK.name, "--run", "--local-port", "8302"]) == 0
    printed = capsys.readouterr().out.splitlines()[0]
    assert execs == [("aws", shlex.split(printed))] and head in printed

    def missing(file: str, argv: list[str]) -> None:
        raise FileNotFoundError(file)

    monkeypatch.setattr(os, "execvp", missing)
    assert cli.main(["dashboard", STACK.name, "--run"]) == 1
    assert "the AWS CLI (aws) is not on PATH" in capsys.readouterr().err
