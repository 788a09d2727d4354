#!/usr/bin/env python3
"""First step on every gpucluster node: read the cluster's settings from SSM, fetch the bundle from S3, run its
bootstrap in this node's role. Written by cloud-init from user data; stdlib and boto3 only."""

import io
import json
import os
import subprocess
import sys
import tarfile
import time

import boto3

ENV_FILE = "/etc/gpucluster/node.env"
TARGET = "/opt/gpucluster"


def main() -> int:
    env = dict(line.strip().split("=", 1) for line in open(ENV_FILE) if "=" in line)
    ssm = boto3.client("ssm", region_name=env["GPUCLUSTER_REGION"])
    for attempt in range(30):  # the parameter may lag the instance on a first `pulumi up`
        try:
            raw = ssm.get_parameter(Name=env["GPUCLUSTER_CONFIG_PARAMETER"])["Parameter"]["Value"]
            break
        except ssm.exceptions.ParameterNotFound:
            time.sleep(10)
    else:
        print("gpucluster: no cluster settings in SSM after 5 minutes", file=sys.stderr)
        return 1
    config = json.loads(raw)
    os.makedirs("/etc/gpucluster", exist_ok=True)
    with open("/etc/gpucluster/cluster.json", "w") as f:
        f.write(raw)
    body = boto3.client("s3", region_name=env["GPUCLUSTER_REGION"]).get_object(
        Bucket=config["bundle_bucket"], Key=config["bundle_key"])["Body"].read()
    with tarfile.open(fileobj=io.BytesIO(body)) as bundle:
        bundle.extractall(TARGET, filter="data")
    return subprocess.call([sys.executable, f"{TARGET}/bootstrap.py", env["GPUCLUSTER_ROLE"]])


if __name__ == "__main__":
    sys.exit(main())
