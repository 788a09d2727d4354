"""The resume program's own time and EC2 calls to bring up 1, 64 and 1024 nodes, against a moto server on 127.0.0.1.

    python benchmarks/resume_scale.py [--sizes 1 64 1024]

Each size twice: one job of all its nodes, and as many single-node jobs (SLURM_RESUME_FILE as Slurm 23.02+ writes it).
Slurm is replaced by a stand-in that records the scontrol calls (their count is printed); EC2 is a moto server in a
process of its own (as EC2 is a service of its own), so the figures include real request encoding and round trips,
not AWS's own latency.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import boto3
from botocore.exceptions import EndpointConnectionError

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the library: the settings contract and the node programs
from gpucluster.contract.settings import ClusterSettings, PoolSettings  # noqa: E402
from gpucluster.node.resume import resume  # noqa: E402
from gpucluster.node.slurm_control import SlurmControl  # noqa: E402
from gpucluster.node.suspend import suspend  # noqa: E402

# The resume program's own part of bringing up 1024 nodes: under 3 s, and EC2 calls per CreateFleet batch, not per node.
TARGET_NODES, TARGET_SECONDS = 1024, 3.0


class RecordingSlurm(SlurmControl):
    def __init__(self) -> None:
        self.calls = 0

    def _run(self, *args: str) -> str:
        self.calls += 1
        return ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 64, 1024])
    args = parser.parse_args()
    port = free_port()
    server = subprocess.Popen([str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ec2 = boto3.client("ec2", region_name="us-east-1", endpoint_url=f"http://127.0.0.1:{port}",
                       aws_access_key_id="bench", aws_secret_access_key="bench")
    wait_for_server(ec2)
    calls: Counter[str] = Counter()
    ec2.meta.events.register("before-call.ec2", lambda model, **kw: calls.update([model.name]))
    vpc = ec2.create_vpc(CidrBlock="10.0.0.0/16")["Vpc"]["VpcId"]
    subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.0.0.0/20", AvailabilityZone="us-east-1a")["Subnet"]["SubnetId"]
    template = ec2.create_launch_template(LaunchTemplateName="bench", LaunchTemplateData={
        "ImageId": "ami-12c6146b", "InstanceType": "p5.48xlarge"})["LaunchTemplate"]["LaunchTemplateId"]
    pool = PoolSettings("p5", template, subnet, "p5.48xlarge", "on-demand")
    registry = Path(tempfile.mkdtemp(prefix="resume-scale-")) / "instances.json"
    config = ClusterSettings(cluster="bench", region="us-east-1", pools={"p5": pool}, log_file="/dev/null",
                             registry_file=str(registry))
    print(f"{'nodes':>6} {'jobs':>5} {'seconds':>8} {'s/node':>7} {'scontrol':>8}  EC2 calls")
    met = True
    for size in args.sizes:
        # One job of `size` nodes (all or nothing, one call), then `size` single-node jobs (batches of 500), as
        # Slurm 23.02 and later describe them in SLURM_RESUME_FILE.
        for jobs in dict.fromkeys((1, size)):
            calls.clear()
            slurm = RecordingSlurm()
            resume_file = write_resume_file(registry.parent, size, jobs)
            start = time.perf_counter()
            result = resume(config, ec2, slurm, f"p5-[1-{size}]", resume_file)
            seconds = time.perf_counter() - start
            assert len(result.launched) == size, result.failed
            ops = ", ".join(f"{op} {n}" for op, n in sorted(calls.items()))
            print(f"{size:6d} {jobs:5d} {seconds:8.2f} {seconds / size:7.3f} {slurm.calls:8d}  {ops}")
            if size == TARGET_NODES:
                met = met and seconds < TARGET_SECONDS and sum(calls.values()) <= -(-size // config.batch_size)
            suspend(config, ec2, f"p5-[1-{size}]")  # the registry empty again for the next run
    if TARGET_NODES in args.sizes:
        print(f"target for {TARGET_NODES} nodes: under {TARGET_SECONDS} s, one EC2 call per batch of "
              f"{config.batch_size}: {'met' if met else 'NOT met'}")
    server.terminate()
    server.wait()


def write_resume_file(where: Path, size: int, jobs: int) -> str:
    per_job = size // jobs
    path = where / "resume.json"
    path.write_text(json.dumps({"all_nodes_resume": f"p5-[1-{size}]", "jobs": [
        {"job_id": j + 1, "nodes_resume": f"p5-[{j * per_job + 1}-{(j + 1) * per_job}]"} for j in range(jobs)]}))
    return str(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_server(ec2: Any) -> None:
    for _ in range(100):
        try:
            ec2.describe_regions()
            return
        except EndpointConnectionError:
            time.sleep(0.1)
    raise RuntimeError("the moto server did not start")


if __name__ == "__main__":
    main()
