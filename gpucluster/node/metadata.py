"""Instance metadata (IMDSv2, as the launch templates require), for the programs that run on an instance at its boot:
the bootstrap (instance id, address) and the first-boot checks (the instance's tags). Standard library only."""

from __future__ import annotations

import os
import urllib.request

from gpucluster.contract.settings import IMDS_URL


def imds(path: str) -> str:
    """`latest/<path>` of the instance metadata; urllib's HTTPError for an answer such as 404 (not there), OSError when
    the service does not answer. AWS_EC2_METADATA_SERVICE_ENDPOINT is the AWS SDKs' own override."""
    base = os.environ.get("AWS_EC2_METADATA_SERVICE_ENDPOINT", IMDS_URL).rstrip("/")
    token = urllib.request.urlopen(urllib.request.Request(
        f"{base}/latest/api/token", method="PUT",
        headers={"X-aws-ec2-metadata-token-ttl-seconds": "300"}), timeout=5).read().decode()
    answer: bytes = urllib.request.urlopen(urllib.request.Request(
        f"{base}/latest/{path}", headers={"X-aws-ec2-metadata-token": token}), timeout=5).read()
    return answer.decode()
