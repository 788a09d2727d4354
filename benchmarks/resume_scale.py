"""The resume program's own time and EC2 calls to bring up 1, 64 and 1024 nodes, against a moto server on 127.0.0.1.

    python benchmarks/resume_scale.py [--sizes 1 64 1024]

Slurm is replaced by a stand-in that records the scontrol calls (their count is printed); EC2 is moto over HTTP, so
the figures include real request encoding and round trips, not AWS's own latency.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections import Counter
from pathlib import Path

import boto3
from moto.server import ThreadedMotoServer

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "cloud-init"))
import gpucluster_node as node  # noqa: E402


class RecordingSlurm(node.Slurm):
    def __init__(self) -> None:
        self.calls = 0

    def _run(self, *args: str) -> str:
        self.calls += 1
        if args[:2] == ("show", "hostnames"):  # the pool's nodes are named pool-1..pool-N
            prefix, span = args[2].split("[")
            first, last = span.rstrip("]").split("-")
            return "\n".join(f"{prefix}{i}" for i in range(int(first), int(last) + 1))
        return ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 64, 1024])
    args = parser.parse_args()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # the moto server's request log
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    ec2 = boto3.client("ec2", region_name="us-east-1", endpoint_url=f"http://{host}:{port}",
                       aws_access_key_id="bench", aws_secret_access_key="bench")
    calls: Counter[str] = Counter()
    ec2.meta.events.register("before-call.ec2", lambda model, **kw: calls.update([model.name]))
    vpc = ec2.create_vpc(CidrBlock="10.0.0.0/16")["Vpc"]["VpcId"]
    subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.0.0.0/20", AvailabilityZone="us-east-1a")["Subnet"]["SubnetId"]
    template = ec2.create_launch_template(LaunchTemplateName="bench", LaunchTemplateData={
        "ImageId": "ami-12c6146b", "InstanceType": "p5.48xlarge"})["LaunchTemplate"]["LaunchTemplateId"]
    pool = node.PoolSettings("p5", template, subnet, "p5.48xlarge", "on-demand")
    config = node.ClusterSettings(cluster="bench", region="us-east-1", pools={"p5": pool}, log_file="/dev/null")
    print(f"{'nodes':>6} {'seconds':>8} {'s/node':>7} {'scontrol':>8}  EC2 calls")
    for size in args.sizes:
        calls.clear()
        slurm = RecordingSlurm()
        start = time.perf_counter()
        result = node.resume(config, ec2, slurm, f"p5-[1-{size}]")
        seconds = time.perf_counter() - start
        assert len(result.launched) == size, result.failed
        ops = ", ".join(f"{op} {n}" for op, n in sorted(calls.items()))
        print(f"{size:6d} {seconds:8.2f} {seconds / size:7.3f} {slurm.calls:8d}  {ops}")
        node.terminate(ec2, list(result.launched.values()))
    server.stop()


if __name__ == "__main__":
    main()
