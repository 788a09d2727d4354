"""preflight: end to end against a moto server for what moto serves, and each check against recorded answers
(botocore Stubber) for what it does not: quotas, capacity reservations, spot placement scores, denials."""

from __future__ import annotations

import contextlib
import datetime as dt
import io
import os
import subprocess
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import boto3
import pytest
import yaml
from botocore.stub import Stubber

from conftest import FIXTURES, ROOT, in_process_moto, reset_moto
from gpucluster import cli
from gpucluster.aws import preflight
from gpucluster.spec import bom
from gpucluster.spec.model import load_stack

TEAM_B = ROOT / "stacks" / "Pulumi.team-b.yaml"
MOTO_ACCOUNT = "123456789012"


def stack_file(tmp_path: Path, ami: str | None, parents: dict[str, dict[str, str]] | None = None) -> Path:
    """team-b with every pool pinned to `ami`, and image.parent_images set to `parents`."""
    doc = yaml.safe_load(TEAM_B.read_text())
    for pool in doc["config"]["gpucluster:cluster"]["pools"]:
        pool["ami_id"] = ami
    if parents:
        doc["config"]["gpucluster:cluster"].setdefault("image", {})["parent_images"] = parents
    path = tmp_path / "Pulumi.team-b.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def run_cli(path: Path, url: str, *, cold: bool = False) -> subprocess.CompletedProcess[str]:
    """`python -m gpucluster preflight PATH` against the moto server at `url`: the command line's main() in this
    process (a fresh one costs seconds of CPU in imports), or with `cold` a fresh process as a user starts it
    (test_preflight_against_moto: the entry point, once). The command makes its own boto3.Session from the
    environment."""
    env = {"AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"}
    args = ["preflight", str(path)]
    if cold:
        return subprocess.run([sys.executable, "-m", "gpucluster", *args], cwd=ROOT, env={**os.environ, **env},
                              capture_output=True, text=True, timeout=300)
    out, err = io.StringIO(), io.StringIO()
    with mock.patch.dict(os.environ, env), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
            contextlib.chdir(ROOT):
        code = cli.main(args)
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def spot_role(iam: Any) -> None:
    """AWSServiceRoleForEC2Spot as AWS makes it. moto's create_service_linked_role names the spot role
    AWSServiceRoleForspot, so it is made with create_role at the service-linked path."""
    iam.create_role(RoleName=preflight.SPOT_ROLE, Path="/aws-service-role/spot.amazonaws.com/",
                    AssumeRolePolicyDocument='{"Version": "2012-10-17", "Statement": [{"Effect": "Allow", '
                    '"Principal": {"Service": "spot.amazonaws.com"}, "Action": "sts:AssumeRole"}]}')


def register_parents(url: str, monkeypatch: pytest.MonkeyPatch, roles: tuple[bom.ParentRole, ...] = bom.PARENT_ROLES
                     ) -> dict[str, dict[str, str]]:
    """In a fresh moto account, the BOM's parent releases of `roles` under their exact names, and image.parent_images
    naming every role's release with that account as owner (moto makes images as the caller's own only, and keeps an
    architecture only for one made from an instance: register_image drops it). The account has moto's default
    (amazon's) images, which the unit tests otherwise go without (conftest.py: moto_without_default_amis)."""
    monkeypatch.setenv("MOTO_EC2_LOAD_DEFAULT_AMIS", "true")
    reset_moto(url)
    ec2 = boto3.client("ec2", region_name="us-west-2", endpoint_url=url, aws_access_key_id="t",
                       aws_secret_access_key="t")
    base = ec2.describe_images(Owners=["amazon"], Filters=[{"Name": "architecture", "Values": ["x86_64"]}])["Images"][0]
    instance = ec2.run_instances(ImageId=base["ImageId"], MinCount=1, MaxCount=1)["Instances"][0]["InstanceId"]
    for role in roles:
        ec2.create_image(InstanceId=instance, Name=bom.PARENT_IMAGES[role].name)
    return {role: {"name": parent.name, "owner": MOTO_ACCOUNT} for role, parent in bom.PARENT_IMAGES.items()}


def test_preflight_against_moto(moto_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    parents = register_parents(moto_url, monkeypatch)
    ec2 = boto3.client("ec2", region_name="us-west-2", endpoint_url=moto_url, aws_access_key_id="t",
                       aws_secret_access_key="t")
    spot_role(boto3.client("iam", region_name="us-west-2", endpoint_url=moto_url, aws_access_key_id="t",
                           aws_secret_access_key="t"))
    image = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    done = run_cli(stack_file(tmp_path, image, parents), moto_url, cold=True)
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert f"PASS head ami    {bom.PARENT_IMAGES['head'].name} ({MOTO_ACCOUNT}): ami-" in out
    assert "PASS offered     p4d.24xlarge is offered in us-west-2b" in out
    assert "PASS efa         4 EFA interface(s)" in out and "PASS efa         8 EFA interface(s)" in out
    assert f"PASS ami         {image} exists" in out
    # moto has no EC2 quotas or placement scores: warnings that name the API, not failures.
    assert "WARN quota       not checked, unavailable (NoSuchResourceException): servicequotas:GetServiceQuota" in out
    assert "WARN spot score  not checked, ec2:GetSpotPlacementScores unavailable" in out
    # moto's (fake) live spot price replaces the on-demand upper bound in the cost table.
    assert "PASS spot price" in out and "live spot" in out
    assert "PASS spot role   arn:aws:iam::123456789012:role/aws-service-role/spot.amazonaws.com/" \
        "AWSServiceRoleForEC2Spot exists (spot pools: p4d-spot)" in out
    # moto serves no GetEbsDefaultKmsKeyId: a warning that names what was not read.
    assert "WARN ebs key     not checked, ec2:GetEbsEncryptionByDefault, ec2:GetEbsDefaultKmsKeyId, kms:DescribeKey " \
        "unavailable" in out
    assert "0 fail" in out


def test_a_failing_check_exits_1_with_its_fix(moto_url: str, tmp_path: Path) -> None:
    done = run_cli(stack_file(tmp_path, "ami-0000000000000dead"), moto_url)
    assert done.returncode == 1
    assert "FAIL ami         ami-0000000000000dead not found in this region" in done.stdout
    assert "fix: fix ami_id, or remove it to boot the stack's own image" in done.stdout


def test_pinned_parent_releases_are_looked_up_by_exact_name_and_owner(moto_url: str, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Pools without ami_id boot their image baked on the pinned parent, or with image.build false the parent itself:
    it must exist in the region under its exact name and owner (never the newest DLAMI through SSM)."""
    parents = register_parents(moto_url, monkeypatch, roles=("head", "gpu"))  # the Neuron release is not in this region
    done = run_cli(stack_file(tmp_path, None, parents), moto_url)
    out = done.stdout
    assert done.returncode == 1, out + done.stderr
    assert f"PASS head ami    {bom.PARENT_IMAGES['head'].name} ({MOTO_ACCOUNT}): ami-" in out
    assert f"PASS ami         {bom.PARENT_IMAGES['gpu'].name} ({MOTO_ACCOUNT}): ami-" in out  # g6e
    assert (f"FAIL ami         no x86_64 image {bom.PARENT_IMAGES['neuron'].name!r} of owner {MOTO_ACCOUNT} in this "
            "region") in out  # trn1
    assert "fix: set image.parent_images.neuron to a release this region has" in out
    assert "/aws/service/" not in out


def test_a_parent_by_its_region_id_and_a_name_two_images_carry() -> None:
    parent = bom.ParentImage(bom.PARENT_IMAGES["gpu"].name, "amazon", {"us-east-1": "ami-0123456789abcdef0"})
    ec2 = client("ec2")
    with Stubber(ec2) as stub:
        stub.add_response("describe_images", {"Images": [{"ImageId": "ami-0123456789abcdef0"}]},
                          {"ImageIds": ["ami-0123456789abcdef0"]})
        check = preflight.check_parent(ec2, "p5", "gpu", parent, "us-east-1")
    assert check.status == "pass" and "ami-0123456789abcdef0 (region_ids) exists" in check.detail
    ec2 = client("ec2")
    with Stubber(ec2) as stub:
        stub.add_response("describe_images", {"Images": [{"ImageId": "ami-0000000000000000a"},
                                                         {"ImageId": "ami-0000000000000000b"}]})
        check = preflight.check_parent(ec2, "p5", "gpu", parent, "us-west-2")
    assert check.status == "fail" and "ami-0000000000000000a, ami-0000000000000000b" in check.detail
    assert check.fix == "name the one in image.parent_images.gpu.region_ids"


def test_bad_stack_exits_2(tmp_path: Path) -> None:
    done = run_cli(ROOT / "tests" / "bad_stacks" / "Pulumi.min-above-max.yaml", "http://127.0.0.1:9")
    assert done.returncode == 2 and "must be <= max_nodes" in done.stderr and "Traceback" not in done.stderr


# --- recorded answers ------------------------------------------------------------------------------------------------

def client(service: str) -> Any:
    return boto3.client(service, region_name="us-east-1", aws_access_key_id="t", aws_secret_access_key="t")


def test_quota_shared_by_two_pools_fails_with_the_request_to_make() -> None:
    stack = load_stack(ROOT / "stacks" / "Pulumi.team-a.yaml")  # p5-od (4) on-demand, p5-spot (8) spot
    quotas = client("service-quotas")
    with Stubber(quotas) as stub:
        for code, value in (("L-417A185B", 768.0), ("L-7212CCBC", 192.0)):
            stub.add_response("get_service_quota", {"Quota": {"QuotaCode": code, "Value": value}},
                              {"ServiceCode": "ec2", "QuotaCode": code})
        checks = {c.pool: c for c in preflight.check_quotas(quotas, stack, "us-east-1")}
    assert checks["p5-od"].status == "pass" and "768 vCPUs cover 768" in checks["p5-od"].detail
    spot = checks["p5-spot"]
    assert spot.status == "fail" and "L-7212CCBC All P Spot Instance Requests: 192 vCPUs, 1536 needed" in spot.detail
    assert spot.fix.endswith("--quota-code L-7212CCBC --desired-value 1536")


def test_denied_quota_api_is_a_warning_naming_the_permission() -> None:
    stack = load_stack(ROOT / "stacks" / "Pulumi.dev.yaml")
    quotas = client("service-quotas")
    with Stubber(quotas) as stub:
        stub.add_client_error("get_service_quota", service_error_code="AccessDeniedException")
        (check,) = preflight.check_quotas(quotas, stack, "us-east-1")
    assert check.status == "warn"
    assert check.detail == "not checked, denied (AccessDeniedException): grant servicequotas:GetServiceQuota"


def _reservation(**overrides: object) -> dict:
    base = {"CapacityReservationId": "cr-0a1b2c3d4e5f60718", "InstanceType": "p5en.48xlarge", "State": "active",
            "AvailabilityZone": "us-east-2b", "TotalInstanceCount": 2,
            "StartDate": dt.datetime(2026, 12, 1, tzinfo=dt.timezone.utc),
            "EndDate": dt.datetime(2026, 12, 8, tzinfo=dt.timezone.utc)}
    return {"CapacityReservations": [{**base, **overrides}]}


@pytest.mark.parametrize("overrides,status,words", [
    ({}, "pass", ["active, 2 x p5en.48xlarge in us-east-2b"]),
    ({"AvailabilityZone": "us-east-2a", "TotalInstanceCount": 1}, "fail",
     ["it is in us-east-2a, the stack in us-east-2b", "it holds 1 instances, the pool needs 2"]),
    ({"State": "expired"}, "fail", ["state is expired"]),
])
def test_capacity_block_reservation(overrides: dict, status: str, words: list[str]) -> None:
    stack = load_stack(FIXTURES / "Pulumi.existing.yaml")
    pool = stack.spec.pools[0]
    ec2 = client("ec2")
    with Stubber(ec2) as stub:
        stub.add_response("describe_capacity_reservations", _reservation(**overrides),
                          {"CapacityReservationIds": ["cr-0a1b2c3d4e5f60718"]})
        check = preflight.check_reservation(ec2, pool, "us-east-2b")
    assert check.status == status and all(w in check.detail for w in words), check.detail


@pytest.mark.parametrize("score,status", [(9, "pass"), (1, "warn")])
def test_spot_placement_score(score: int, status: str) -> None:
    pool = load_stack(ROOT / "stacks" / "Pulumi.team-a.yaml").spec.pools[1]
    ec2 = client("ec2")
    with Stubber(ec2) as stub:
        stub.add_response("get_spot_placement_scores", {"SpotPlacementScores": [
            {"Region": "us-east-1", "AvailabilityZoneId": "use1-az4", "Score": score},
            {"Region": "us-east-1", "AvailabilityZoneId": "use1-az6", "Score": 7}]})
        check = preflight.check_spot_score(ec2, pool, "us-east-1", "use1-az4")
    assert check.status == status and f"placement score {score}/10 for 8 nodes in use1-az4" in check.detail
    if status == "warn":
        assert "best here: use1-az6 scores 7" in check.detail and check.fix


def test_type_not_offered_in_the_zone_fails_with_the_zones_that_offer_it() -> None:
    pool = load_stack(ROOT / "stacks" / "Pulumi.team-a.yaml").spec.pools[0]
    ec2 = client("ec2")
    with Stubber(ec2) as stub:
        stub.add_response("describe_instance_type_offerings", {"InstanceTypeOfferings": [
            {"InstanceType": "p5.48xlarge", "LocationType": "availability-zone", "Location": "us-east-1f"}]})
        check = preflight.check_offered(ec2, pool, "us-east-1a")
    assert check.status == "fail" and check.fix == "set availability_zone to one of: us-east-1f"


def test_unresolvable_ami_parameter_fails() -> None:
    stack = load_stack(ROOT / "stacks" / "Pulumi.team-k8s.yaml")  # a Slurm stack's pools: check_parent
    pool = stack.spec.pools[0]
    ssm = client("ssm")
    with Stubber(ssm) as stub:
        stub.add_client_error("get_parameter", service_error_code="ParameterNotFound")
        check = preflight.check_ami(ssm, client("ec2"), pool, preflight.ami_parameter(stack, pool))
    assert check.status == "fail" and "does not resolve in this region" in check.detail


# --- the spot service-linked role ------------------------------------------------------------------------------------

class Session:
    """A boto3 Session stand-in: hands out the given clients and records which services were asked for."""

    def __init__(self, **clients: Any):
        self.clients = clients
        self.asked: list[str] = []

    def client(self, service: str, region_name: str | None = None) -> Any:
        self.asked.append(service)
        return self.clients.get(service) or client(service)


def test_missing_spot_role_is_made_by_a_slurm_stack() -> None:
    stack = load_stack(ROOT / "stacks" / "Pulumi.team-a.yaml")
    with in_process_moto():
        check = preflight.check_spot_role(boto3.client("iam", region_name="us-east-1"), stack)
    assert check.status == "pass" and check.pool is None and not check.fix
    assert check.detail.startswith("no AWSServiceRoleForEC2Spot in this account yet: `pulumi up` creates it for the "
                                   "spot pools (p5-spot) and never deletes it")
    assert "iam:CreateServiceLinkedRole for spot.amazonaws.com" in check.detail


def test_missing_spot_role_fails_a_kubernetes_stack_with_the_command_to_create_it() -> None:
    stack = load_stack(ROOT / "stacks" / "Pulumi.team-k8s.yaml")
    spot = ", ".join(p.name for p in stack.spec.pools if p.capacity == "spot")
    with in_process_moto():
        check = preflight.check_spot_role(boto3.client("iam", region_name="us-east-1"), stack)
    assert check.status == "fail" and check.pool is None
    assert f"no AWSServiceRoleForEC2Spot in this account: spot launches ({spot}) fail" in check.detail
    assert check.fix == "once per account: aws iam create-service-linked-role --aws-service-name spot.amazonaws.com"


def test_existing_spot_role_passes() -> None:
    stack = load_stack(ROOT / "stacks" / "Pulumi.team-a.yaml")
    with in_process_moto():
        iam = boto3.client("iam", region_name="us-east-1")
        spot_role(iam)
        check = preflight.check_spot_role(iam, stack)
    assert check.status == "pass" and check.detail.endswith("AWSServiceRoleForEC2Spot exists (spot pools: p5-spot)")


def test_denied_get_role_is_a_warning_naming_the_permission() -> None:
    stack = load_stack(ROOT / "stacks" / "Pulumi.team-a.yaml")
    iam = client("iam")
    with Stubber(iam) as stub:
        stub.add_client_error("get_role", service_error_code="AccessDenied", http_status_code=403,
                              expected_params={"RoleName": "AWSServiceRoleForEC2Spot"})
        checks = preflight.guarded(None, "spot role", "iam:GetRole", lambda: preflight.check_spot_role(iam, stack))
        stub.assert_no_pending_responses()
    assert checks == [preflight.Check(None, "spot role", "warn",
                                      "not checked, denied (AccessDenied): grant iam:GetRole")]


def _all_denied(service: str) -> Any:
    """A client whose every call is denied before it is sent: run() then has only warnings, and asks no AWS."""
    from botocore.exceptions import ClientError

    def deny(model: Any, **_: Any) -> None:
        raise ClientError({"Error": {"Code": "AccessDenied", "Message": "denied"}}, model.name)

    c = client(service)
    c.meta.events.register("before-call", deny)
    return c


def test_run_asks_iam_only_for_a_stack_with_spot_pools() -> None:
    denied = preflight.Check(None, "spot role", "warn", "not checked, denied (AccessDenied): grant iam:GetRole")
    for stack, asks in ((load_stack(ROOT / "stacks" / "Pulumi.team-a.yaml"), True),
                        (load_stack(FIXTURES / "Pulumi.existing.yaml"), False)):  # capacity-block only
        assert any(p.capacity == "spot" for p in stack.spec.pools) is asks
        session = Session(**{s: _all_denied(s) for s in ("ec2", "ssm", "service-quotas", "iam", "kms")})
        report = preflight.run(stack, session)
        assert ("iam" in session.asked) is asks
        assert [c for c in report.checks if c.name == "spot role"] == ([denied] if asks else [])


# --- the default EBS key: moto has no GetEbsDefaultKmsKeyId, and marks every key customer managed ------------------

def _ebs_default(ec2: Any, key_id: str, by_default: bool = True) -> Stubber:
    """EC2's answers on the default EBS key, recorded."""
    stub = Stubber(ec2)
    stub.add_response("get_ebs_encryption_by_default", {"EbsEncryptionByDefault": by_default}, {})
    stub.add_response("get_ebs_default_kms_key_id", {"KmsKeyId": key_id}, {})
    return stub


def _ebs_key_check(stack_file: Path, enabled: bool = True) -> tuple[preflight.Check, str]:
    """The check in an account whose default EBS key is a customer managed key (moto's KMS), and that key's ARN."""
    stack = load_stack(stack_file)
    with in_process_moto():
        kms = boto3.client("kms", region_name="us-east-1")
        key = kms.create_key(Description="the team's EBS key")["KeyMetadata"]
        if not enabled:
            kms.disable_key(KeyId=key["KeyId"])
        ec2 = client("ec2")
        with _ebs_default(ec2, key["Arn"]):
            return preflight.check_ebs_key(ec2, kms, stack), key["Arn"]


def test_a_customer_managed_default_ebs_key_says_what_the_stack_grants() -> None:
    check, key = _ebs_key_check(ROOT / "stacks" / "Pulumi.team-a.yaml")  # a spot pool
    assert check.status == "warn" and check.pool is None
    assert check.detail == (
        f"the default EBS key {key} is customer managed (encryption by default on): `pulumi up` grants it to "
        "AWSServiceRoleForImageBuilder (image builds) and AWSServiceRoleForEC2Spot (spot nodes) and lets the head role "
        "use it through EC2 (on-demand nodes); the head node's volumes are made with your credentials")
    assert "kms:CreateGrant" in check.fix and "key policy" in check.fix


def test_without_spot_pools_no_spot_role_is_granted_the_key() -> None:
    check, _ = _ebs_key_check(FIXTURES / "Pulumi.existing.yaml")
    assert check.status == "warn" and "AWSServiceRoleForEC2Spot" not in check.detail


def test_a_customer_managed_key_fails_the_kubernetes_flavour() -> None:
    check, key = _ebs_key_check(ROOT / "stacks" / "Pulumi.team-k8s.yaml")
    assert check.status == "fail" and key in check.detail and "AWSServiceRoleForAutoScaling" in check.fix


def test_a_disabled_default_ebs_key_fails() -> None:
    check, key = _ebs_key_check(ROOT / "stacks" / "Pulumi.team-a.yaml", enabled=False)
    assert check.status == "fail" and check.detail.startswith(f"the default EBS key {key} is Disabled")
    assert check.fix.endswith("aws ec2 modify-ebs-default-kms-key-id --kms-key-id KEY")


def test_aws_own_default_ebs_key_needs_nothing() -> None:
    ec2, kms = client("ec2"), client("kms")
    arn = "arn:aws:kms:us-east-1:123456789012:key/0a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9"
    with _ebs_default(ec2, "alias/aws/ebs", by_default=False), Stubber(kms) as stub:
        stub.add_response("describe_key", {"KeyMetadata": {"KeyId": arn.rsplit("/", 1)[1], "Arn": arn,
                                                           "KeyManager": "AWS", "KeyState": "Enabled"}},
                          {"KeyId": "alias/aws/ebs"})
        check = preflight.check_ebs_key(ec2, kms, load_stack(ROOT / "stacks" / "Pulumi.team-a.yaml"))
    assert check == preflight.Check(None, "ebs key", "pass", "the default EBS key is AWS managed (encryption by "
                                                             "default off): nothing to grant")
