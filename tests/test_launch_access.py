"""What EC2 needs of the account (components/launch_access.py), planned in accounts of each kind: without and with the
spot service-linked role, with AWS's own default EBS key and with a customer managed one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import FIXTURES, ROOT, STACK_FILES, of_type, planned
from gpucluster.plan import MOCK_ACCOUNT, AccountFacts, Declared
from gpucluster.spec import account
from gpucluster.spec.model import Stack, load_stack

TEAM_A = ROOT / "stacks" / "Pulumi.team-a.yaml"  # an on-demand and a spot pool, images baked
NO_SPOT = FIXTURES / "Pulumi.existing.yaml"  # capacity-block and on-demand pools
SPOT_ROLE_ARN = account.service_role_arn(MOCK_ACCOUNT, account.SPOT_SERVICE, account.SPOT_ROLE)
BUILDER_ROLE_ARN = account.service_role_arn(MOCK_ACCOUNT, account.IMAGE_BUILDER_SERVICE, account.IMAGE_BUILDER_ROLE)
CMK = AccountFacts(customer_managed_ebs_key=True)
SPOT_STACKS = [p for p in STACK_FILES if any(pool.capacity == "spot" for pool in load_stack(p).spec.pools)]


def _spot_roles(declared: tuple[Declared, ...]) -> list[Declared]:
    return of_type(declared, "iam/serviceLinkedRole:ServiceLinkedRole")


def _by_urn(declared: tuple[Declared, ...]) -> dict[str, Declared]:
    return {d.urn: d for d in declared}


def _head_policy(stack: Stack, declared: tuple[Declared, ...]) -> dict[str, dict]:
    (head,) = [d for d in of_type(declared, "iam/rolePolicy:RolePolicy") if d.name == f"{stack.cluster_name}-head"]
    return {s["Sid"]: s for s in json.loads(head.inputs["policy"])["Statement"]}


@pytest.mark.parametrize("path", SPOT_STACKS, ids=lambda p: p.name)
def test_a_new_account_gets_the_spot_role_kept_when_the_stack_goes(path: Path) -> None:
    stack, declared = planned(path)
    (role,) = _spot_roles(declared)
    assert role.inputs == {"awsServiceName": account.SPOT_SERVICE}
    assert role.retain_on_delete  # `destroy`, and the next `up` that finds it, never delete it
    # On a provider without the stack's tags: no stack's tags on the account's role, so `leftovers` never lists it.
    provider = _by_urn(declared)[role.provider.rsplit("::", 1)[0]]
    assert provider.type == "pulumi:providers:aws" and "defaultTags" not in provider.inputs
    assert provider.inputs["region"] == stack.region
    # The head, which launches spot nodes, comes after it.
    (access,) = of_type(declared, "launch_access:SpotLaunchAccess")
    (head,) = of_type(declared, "head:HeadNode")
    assert role.parent_urn == access.urn and role.urn in head.dependencies  # a component's children, as Pulumi waits


def test_an_account_with_the_spot_role_gets_none_declared() -> None:
    _, declared = planned(TEAM_A, AccountFacts(spot_role=True))
    assert not _spot_roles(declared)
    assert [d.name for d in declared if d.type == "pulumi:providers:aws"] == ["aws"]  # no untagged provider either
    assert of_type(declared, "launch_access:SpotLaunchAccess")  # still there: it holds the key grant when needed


def test_a_stack_without_spot_pools_declares_no_spot_role() -> None:
    _, declared = planned(NO_SPOT)
    assert not _spot_roles(declared) and not of_type(declared, "launch_access:SpotLaunchAccess")


@pytest.mark.parametrize("path", [*STACK_FILES, NO_SPOT], ids=lambda p: p.name)
def test_with_aws_own_ebs_key_nothing_is_granted(path: Path) -> None:
    stack, declared = planned(path)
    assert not of_type(declared, "kms/grant:Grant")
    assert not [sid for sid, s in _head_policy(stack, declared).items() if "kms:" in json.dumps(s["Action"])]


def test_a_customer_managed_key_is_granted_to_whoever_launches_with_it() -> None:
    stack, declared = planned(TEAM_A, CMK)
    key = CMK.ebs_key(stack.region)[1]
    operations = list(account.SERVICE_GRANT_OPERATIONS)
    # Spot nodes: launched by the spot service-linked role, granted once the role exists.
    spot = [g for g in of_type(declared, "kms/grant:Grant") if g.inputs["granteePrincipal"] == SPOT_ROLE_ARN]
    assert len(spot) == 1 and spot[0].inputs["keyId"] == key and spot[0].inputs["operations"] == operations
    (role,) = _spot_roles(declared)
    assert role.urn in spot[0].dependencies
    # Each image build: Image Builder's service-linked role launches it and snapshots its volume; the build waits for
    # the grant, which waits for the image's components (the first Image Builder resource makes that role).
    builder = [g for g in of_type(declared, "kms/grant:Grant") if g.inputs["granteePrincipal"] == BUILDER_ROLE_ARN]
    images = of_type(declared, "imagebuilder/image:Image")
    assert len(builder) == len(images) == len(stack.spec.image_builds)
    assert len(spot) + len(builder) == len(of_type(declared, "kms/grant:Grant"))  # no one else
    urns = _by_urn(declared)
    for image in images:
        (grant,) = [urns[u] for u in image.dependencies if urns[u].type == "aws:kms/grant:Grant"]
        assert grant.inputs["keyId"] == key and grant.inputs["operations"] == operations
        assert any(urns[u].type == "aws:imagebuilder/component:Component" and urns[u].parent_urn == image.parent_urn
                   for u in grant.dependencies)
    # On-demand and capacity-block nodes: launched as the head role (an instant fleet runs as its caller), which may
    # use this key only, only through EC2, and grant it only to AWS resources.
    head = _head_policy(stack, declared)
    via_ec2 = {"kms:ViaService": f"ec2.{stack.region}.amazonaws.com"}
    assert head["UseDefaultEbsKey"] == {
        "Sid": "UseDefaultEbsKey", "Effect": "Allow", "Resource": key, "Condition": {"StringEquals": via_ec2},
        "Action": ["kms:Decrypt", "kms:DescribeKey", "kms:GenerateDataKeyWithoutPlaintext", "kms:ReEncryptFrom",
                   "kms:ReEncryptTo"]}
    assert head["GrantDefaultEbsKeyToVolumes"] == {
        "Sid": "GrantDefaultEbsKeyToVolumes", "Effect": "Allow", "Action": "kms:CreateGrant", "Resource": key,
        "Condition": {"StringEquals": via_ec2, "Bool": {"kms:GrantIsForAWSResource": "true"}}}


def test_a_customer_managed_key_in_an_account_with_the_spot_role_is_granted_to_that_role() -> None:
    _, declared = planned(TEAM_A, AccountFacts(spot_role=True, customer_managed_ebs_key=True))
    assert not _spot_roles(declared)
    assert [g.inputs["granteePrincipal"] for g in of_type(declared, "kms/grant:Grant")].count(SPOT_ROLE_ARN) == 1


def test_a_customer_managed_key_without_spot_pools_grants_no_spot_role() -> None:
    _, declared = planned(NO_SPOT, CMK)
    principals = {g.inputs["granteePrincipal"] for g in of_type(declared, "kms/grant:Grant")}
    assert principals == {BUILDER_ROLE_ARN}
