"""`python -m gpucluster leftovers STACK` against a moto server: what still carries the stack's tag after a destroy,
priced; what is gone (a terminated instance) is not listed; another stack's resources are not either."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import boto3
import pytest

from conftest import ROOT, reset_moto
from gpucluster import cli
from gpucluster.aws import leftovers
from gpucluster.contract.settings import STACK_TAG
from gpucluster.spec import catalog, cost


def tags(stack: str) -> list[dict[str, str]]:
    return [{"Key": STACK_TAG, "Value": stack}]


def test_leftovers_lists_what_still_bills_with_its_monthly_cost(moto_url: str, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    reset_moto(moto_url)

    def client(service: str) -> Any:
        return boto3.client(service, region_name="us-east-1", endpoint_url=moto_url, aws_access_key_id="t",
                            aws_secret_access_key="t")

    ec2, s3, fsx = client("ec2"), client("s3"), client("fsx")
    team_a = [{"ResourceType": "instance", "Tags": tags("team-a")}]
    running = ec2.run_instances(ImageId="ami-12c6146b", InstanceType="p5.48xlarge", MinCount=1, MaxCount=1,
                                TagSpecifications=team_a)["Instances"][0]
    gone = ec2.run_instances(ImageId="ami-12c6146b", InstanceType="p5.48xlarge", MinCount=1, MaxCount=1,
                             TagSpecifications=team_a)["Instances"][0]
    ec2.terminate_instances(InstanceIds=[gone["InstanceId"]])
    ec2.run_instances(ImageId="ami-12c6146b", InstanceType="g6.xlarge", MinCount=1, MaxCount=1,
                      TagSpecifications=[{"ResourceType": "instance", "Tags": tags("team-b")}])
    volume = ec2.create_volume(AvailabilityZone="us-east-1a", Size=100, VolumeType="gp3",
                               TagSpecifications=[{"ResourceType": "volume", "Tags": tags("team-a")}])["VolumeId"]
    s3.create_bucket(Bucket="gpucluster-team-a-data")
    s3.put_bucket_tagging(Bucket="gpucluster-team-a-data", Tagging={"TagSet": tags("team-a")})
    s3.put_object(Bucket="gpucluster-team-a-data", Key="ckpt/step-100.pt", Body=b"x" * 2_000_000)
    fs = fsx.create_file_system(FileSystemType="LUSTRE", StorageCapacity=2400, SubnetIds=["subnet-0123456789abcdef0"],
                                LustreConfiguration={"DeploymentType": "PERSISTENT_2", "PerUnitStorageThroughput": 250},
                                Tags=tags("team-a"))["FileSystem"]["FileSystemId"]

    clients = {name: client(name) for name in ("resourcegroupstaggingapi", "ec2", "fsx", "s3")}
    found = {item.kind: item for item in leftovers.find(clients, "team-a")}
    assert set(found) == {"ec2:instance", "ec2:volume", "s3:bucket", "fsx:file-system"}, found
    p5 = catalog.lookup("p5.48xlarge").on_demand_usd_per_hour
    assert p5 is not None
    assert found["ec2:instance"].arn.endswith(running["InstanceId"])
    assert found["ec2:instance"].monthly_usd == pytest.approx(p5 * cost.HOURS_PER_MONTH)
    assert found["ec2:volume"].arn.endswith(volume)
    assert found["ec2:volume"].monthly_usd == pytest.approx(100 * cost.GP3_USD_PER_GIB_MONTH)
    assert found["fsx:file-system"].arn.endswith(fs)
    assert found["fsx:file-system"].monthly_usd \
        == pytest.approx(2400 * cost.LUSTRE_USD_PER_GIB_MONTH[("PERSISTENT_2", 250)])
    assert found["s3:bucket"].monthly_usd == pytest.approx(0.002 * cost.S3_STANDARD_USD_PER_GB_MONTH)
    assert "1 object version(s), 0.00 GB" in found["s3:bucket"].detail

    env = {**os.environ, "AWS_ENDPOINT_URL": moto_url, "AWS_ACCESS_KEY_ID": "t", "AWS_SECRET_ACCESS_KEY": "t"}
    done = subprocess.run([sys.executable, "-m", "gpucluster", "leftovers", "team-a"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr  # something still bills: a teardown's check must not pass
    assert "4 resource(s) in us-east-1 still tagged gpucluster:stack=team-a:" in done.stdout, done.stdout
    assert running["InstanceId"] in done.stdout and gone["InstanceId"] not in done.stdout
    total = sum(item.monthly_usd or 0 for item in found.values())
    assert f"Per month, priced ones: {cost.money(total)}" in done.stdout
    none = subprocess.run([sys.executable, "-m", "gpucluster", "leftovers", "dev"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert none.stdout.strip() == "Nothing in us-east-1 is tagged gpucluster:stack=dev.", none.stdout
    assert none.returncode == 0, none.stderr
    for name, value in (("AWS_ENDPOINT_URL", moto_url), ("AWS_ACCESS_KEY_ID", "t"), ("AWS_SECRET_ACCESS_KEY", "t")):
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(ROOT)
    assert cli.main(["leftovers", "team-a", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["still_bills"] is True and doc["monthly_usd"] == pytest.approx(total, abs=0.01)
    assert sorted(r["kind"] for r in doc["resources"]) == sorted(found)


@pytest.mark.parametrize(("arn", "kind", "ident"), [
    ("arn:aws:ec2:us-east-1:123456789012:instance/i-0abc", "ec2:instance", "i-0abc"),
    ("arn:aws:s3:::gpucluster-team-a-data", "s3:bucket", "gpucluster-team-a-data"),
    ("arn:aws:fsx:us-east-1:123456789012:file-system/fs-0123", "fsx:file-system", "fs-0123"),
    ("arn:aws:ssm:us-east-1:123456789012:parameter/gpucluster/c/config", "ssm:parameter", "gpucluster/c/config"),
    ("arn:aws:sns:us-east-1:123456789012:gpucluster-team-a-alerts", "sns", "gpucluster-team-a-alerts"),
])
def test_kinds_from_arns(arn: str, kind: str, ident: str) -> None:
    assert leftovers.kind_of(arn) == (kind, ident)
