"""The world the head's node programs meet in the unit tests: moto's EC2 with two pools of p5 (spot and on-demand)
and a registry of their own, and a stand-in for scontrol that records what the programs ask of Slurm."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import boto3
import pytest

from conftest import in_process_moto
from gpucluster.contract import slurm_json
from gpucluster.contract.settings import POOL_TAG, ClusterSettings, PoolSettings
from gpucluster.node import fleet
from gpucluster.node.registry import read_registry
from gpucluster.node.slurm_control import SlurmControl
from slurm_samples import document


class FakeSlurm(SlurmControl):
    """Records what the programs ask of Slurm; serves a node table (slurm_samples.node records) for the reconciler."""

    def __init__(self, table: list[dict[str, Any]] | None = None):
        self.calls: list[tuple[str, ...]] = []
        self.table = table or []

    def _run(self, *args: str) -> str:
        self.calls.append(args)
        if args == slurm_json.SHOW_NODES:
            return document("nodes", self.table)
        return ""

    def updates(self) -> list[tuple[str, ...]]:
        return [c for c in self.calls if c[0] == "update"]

    jobs: dict[str, list[str]] = {}  # node -> its running jobs

    def jobs_on(self, node_name: str) -> list[str]:
        return self.jobs.get(node_name, [])

    def signal_job(self, job: str, signal_name: str) -> None:
        self.calls.append(("signal", job, signal_name))


@pytest.fixture(name="ec2")
def ec2_fixture():
    """An EC2 client of in-process moto (import the fixture by this name: test functions take `ec2`)."""
    with in_process_moto():
        yield boto3.client("ec2", region_name="us-east-1")


def make_config(ec2, **overrides: Any) -> ClusterSettings:
    """Two pools of p5 (spot and on-demand) in moto; the registry in a fresh directory."""
    overrides.setdefault("registry_file", str(Path(tempfile.mkdtemp(prefix="registry-")) / "instances.json"))
    vpc = ec2.create_vpc(CidrBlock="10.0.0.0/16")["Vpc"]["VpcId"]
    subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.0.0.0/24", AvailabilityZone="us-east-1a")["Subnet"]["SubnetId"]
    template = ec2.create_launch_template(LaunchTemplateName="lt", LaunchTemplateData={
        "ImageId": "ami-12c6146b", "InstanceType": "p5.48xlarge", "TagSpecifications": [
            {"ResourceType": "instance", "Tags": [{"Key": POOL_TAG, "Value": "p5"}]}]}
    )["LaunchTemplate"]["LaunchTemplateId"]
    pools = {name: PoolSettings(name, template, subnet, "p5.48xlarge", market)
             for name, market in (("p5-spot", "spot"), ("p5-od", "on-demand"))}
    return ClusterSettings(cluster="c1", region="us-east-1", pools=pools, log_file="/dev/null", **overrides)


def live(config: ClusterSettings, ec2) -> dict[str, str]:
    """node -> instance, for the registry's nodes whose instance runs."""
    running = fleet.cluster_instances(config, ec2)
    return {n: e["instance"] for n, e in read_registry(config).instances.items() if e["instance"] in running}


NOW = 1_800_000_000.0


def fake_scontrol(tmp_path: Path, body: str) -> str:
    script = tmp_path / "scontrol"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)
    return str(script)
