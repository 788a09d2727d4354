"""preflight: the per-region limits a stack's new VPC consumes, against a moto account near each limit.

moto's Service Quotas answers the `vpc` codes with AWS's defaults and nothing for `ec2` codes: the Elastic IP quota is
given here through a stand-in (QuotasWithEip) in the one test that needs it, and is a warning otherwise.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import boto3
import pytest

from conftest import FIXTURES, ROOT, reset_moto
from gpucluster.aws import preflight
from gpucluster.spec.model import Stack, load_stack

DEV = load_stack(ROOT / "stacks" / "Pulumi.dev.yaml")  # a new VPC in us-east-1a


@pytest.fixture
def aws(moto_url: str) -> Iterator[dict[str, Any]]:
    reset_moto(moto_url)
    keys = {"region_name": DEV.region, "endpoint_url": moto_url, "aws_access_key_id": "t",
            "aws_secret_access_key": "t"}
    yield {"ec2": boto3.client("ec2", **keys), "quotas": boto3.client("service-quotas", **keys)}


def by_code(checks: list[preflight.Check]) -> dict[str, preflight.Check]:
    return {c.detail.split()[0]: c for c in checks}


def quota(aws: dict[str, Any], code: str) -> int:
    return int(aws["quotas"].get_service_quota(ServiceCode="vpc", QuotaCode=code)["Quota"]["Value"])


def test_a_fresh_account_has_room_for_every_limit(aws: dict[str, Any]) -> None:
    checks = preflight.check_network_limits(aws["ec2"], aws["quotas"], DEV)
    assert len(checks) == len(preflight.NETWORK_LIMITS)
    found = by_code([c for c in checks if c.status != "warn"])
    assert {code: c.status for code, c in found.items()} == {
        limit.code: "pass" for limit in preflight.NETWORK_LIMITS if limit.service == "vpc"}
    (eip,) = [c for c in checks if c.status == "warn"]  # moto has no ec2 quota codes
    assert "servicequotas:GetServiceQuota, ec2:DescribeAddresses" in eip.detail
    vpcs = len(aws["ec2"].describe_vpcs()["Vpcs"])  # moto's default VPC
    assert found["L-F678F1CE"].detail == (f"L-F678F1CE VPCs per Region: {quota(aws, 'L-F678F1CE')}, {vpcs} used, "
                                          "1 more for this stack")


def test_the_vpc_past_the_regions_quota_fails_with_the_increase_to_ask(aws: dict[str, Any]) -> None:
    limit = quota(aws, "L-F678F1CE")
    for i in range(limit - len(aws["ec2"].describe_vpcs()["Vpcs"])):
        aws["ec2"].create_vpc(CidrBlock=f"10.{100 + i}.0.0/16")
    check = by_code(preflight.check_network_limits(aws["ec2"], aws["quotas"], DEV))["L-F678F1CE"]
    assert check.status == "fail" and f"{limit} used" in check.detail
    assert check.fix == (f"free 1, or aws service-quotas request-service-quota-increase --region {DEV.region} "
                         f"--service-code vpc --quota-code L-F678F1CE --desired-value {limit + 1}")


def nat_gateways(ec2: Any, zone: str, count: int, second_octet: int) -> None:
    vpc = ec2.create_vpc(CidrBlock=f"10.{second_octet}.0.0/16")["Vpc"]["VpcId"]
    subnet = ec2.create_subnet(VpcId=vpc, CidrBlock=f"10.{second_octet}.0.0/24", AvailabilityZone=zone)
    for _ in range(count):
        address = ec2.allocate_address(Domain="vpc")["AllocationId"]
        ec2.create_nat_gateway(SubnetId=subnet["Subnet"]["SubnetId"], AllocationId=address)


def test_nat_gateways_count_in_the_stacks_zone_only(aws: dict[str, Any]) -> None:
    limit = quota(aws, "L-FE5A380F")
    nat_gateways(aws["ec2"], "us-east-1b", limit, 200)
    check = by_code(preflight.check_network_limits(aws["ec2"], aws["quotas"], DEV))["L-FE5A380F"]
    assert check.status == "pass" and "0 used in us-east-1a" in check.detail
    nat_gateways(aws["ec2"], DEV.spec.availability_zone, limit, 201)
    check = by_code(preflight.check_network_limits(aws["ec2"], aws["quotas"], DEV))["L-FE5A380F"]
    assert check.status == "fail" and f"{limit} used in us-east-1a" in check.detail


def test_gateway_endpoints_of_the_region_count(aws: dict[str, Any]) -> None:
    limit = quota(aws, "L-1B52E74A")
    vpc = aws["ec2"].create_vpc(CidrBlock="10.210.0.0/16")["Vpc"]["VpcId"]
    for _ in range(limit):
        aws["ec2"].create_vpc_endpoint(VpcId=vpc, ServiceName=f"com.amazonaws.{DEV.region}.s3",
                                       VpcEndpointType="Gateway")
    check = by_code(preflight.check_network_limits(aws["ec2"], aws["quotas"], DEV))["L-1B52E74A"]
    assert check.status == "fail" and f"{limit} used" in check.detail


class QuotasWithEip:
    """moto's Service Quotas, plus the EC2-VPC Elastic IP quota it does not serve (its `ec2` codes are missing)."""

    def __init__(self, quotas: Any, eips: int):
        self.quotas, self.eips = quotas, eips

    def get_service_quota(self, ServiceCode: str, QuotaCode: str) -> dict[str, Any]:
        if (ServiceCode, QuotaCode) == ("ec2", "L-0263D0A3"):
            return {"Quota": {"QuotaCode": QuotaCode, "Value": float(self.eips)}}
        return dict(self.quotas.get_service_quota(ServiceCode=ServiceCode, QuotaCode=QuotaCode))


def test_elastic_ips_in_use_leave_no_room_for_the_nat_gateways(aws: dict[str, Any]) -> None:
    for _ in range(3):
        aws["ec2"].allocate_address(Domain="vpc")
    roomy = by_code(preflight.check_network_limits(aws["ec2"], QuotasWithEip(aws["quotas"], 4), DEV))
    assert roomy["L-0263D0A3"].status == "pass" and "4, 3 used, 1 more" in roomy["L-0263D0A3"].detail
    full = by_code(preflight.check_network_limits(aws["ec2"], QuotasWithEip(aws["quotas"], 3), DEV))
    assert full["L-0263D0A3"].status == "fail"
    assert full["L-0263D0A3"].fix.endswith("--service-code ec2 --quota-code L-0263D0A3 --desired-value 4")


def test_an_existing_network_consumes_none_of_them(aws: dict[str, Any]) -> None:
    existing: Stack = load_stack(FIXTURES / "Pulumi.existing.yaml")
    (check,) = preflight.check_network_limits(aws["ec2"], aws["quotas"], existing)
    assert check.status == "pass" and "existing network" in check.detail


def test_preflight_runs_the_limits(aws: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    limit = quota(aws, "L-F678F1CE")
    for i in range(limit - len(aws["ec2"].describe_vpcs()["Vpcs"])):
        aws["ec2"].create_vpc(CidrBlock=f"10.{100 + i}.0.0/16")
    monkeypatch.setenv("AWS_ENDPOINT_URL", aws["ec2"].meta.endpoint_url)
    session = boto3.Session(aws_access_key_id="t", aws_secret_access_key="t", region_name=DEV.region)
    report = preflight.run(DEV, session, checkip_url="http://127.0.0.1:9")
    limits = [c for c in report.checks if c.name == "limit"]
    assert len(limits) == len(preflight.NETWORK_LIMITS) and report.failed
    assert any(c.status == "fail" and c.detail.startswith("L-F678F1CE") for c in limits)
