"""Every IAM policy document of every shipped stack, as the mock runtime declares it, through parliament's analysis
(its own auditors and the community ones): no finding, except the few judged wrong in SUPPRESSED, each with why."""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from typing import Any

from conftest import ALL_STACK_FILES as STACK_FILES, ROOT, planned
from gpucluster.plan import AccountFacts, Declared, planned_outputs

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # parliament imports pkg_resources, which warns of its own deprecation
    from parliament import analyze_policy_string

# Inputs that hold a policy document: identity policies (RolePolicy, Policy), resource policies (TopicPolicy,
# QueuePolicy, BucketPolicy) and trust policies (Role).
POLICY_INPUTS = ("policy", "assumeRolePolicy")

SESSION_DOCUMENT_CHECK = "Unknown condition ssm:SessionDocumentAccessCheck for action ssm:StartSession"
# (issue, policy's name without the cluster name, action or what it is about) -> why the finding is wrong here.
SUPPRESSED = {
    ("MALFORMED", "role trust policy", "Statement contains neither Resource nor NotResource"):
        "a trust policy has no Resource (its resource is the role); parliament reads every document as an identity "
        "policy. The same document is linted again with the role's ARN as its Resource, so its action and condition "
        "keys are still checked",
    ("CREDENTIALS_EXPOSURE", "role trust policy on its role", "sts:assumerole"):
        "the community auditor flags an identity policy that hands out credentials; read as a trust policy, "
        "sts:AssumeRole by its one service principal is what the document is for",
    ("RESOURCE_MISMATCH", "head", "ec2:RunInstances"):
        "parliament wants every required resource type of an action in each statement; IAM matches each resource of "
        "the request against all statements. The instance is granted apart, under aws:RequestTag (which the "
        "template, subnet, group and image resources do not carry), as in AWS's own tag-on-launch examples",
    ("RESOURCE_MISMATCH", "head", "ec2:CreateFleet"):
        "as for ec2:RunInstances: the fleet and the instance are granted in separate statements of one policy",
    ("PERMISSIONS_MANAGEMENT_ACTIONS", "head", "iam:passrole"):
        "the head node passes the compute role (that role's ARN only, to ec2.amazonaws.com only) to the nodes it "
        "launches",
    ("PERMISSIONS_MANAGEMENT_ACTIONS", "head", "kms:creategrant"):
        "with a customer managed default EBS key, EC2 creates a grant on it for each volume of a node the head "
        "launches: that key only, through EC2 only (kms:ViaService), for AWS resources only "
        "(kms:GrantIsForAWSResource), as AWS's own aws/ebs key policy allows any principal of the account",
    ("PRIVILEGE_ESCALATION", "head", "CreateEC2WithExistingIP"):
        "the same PassRole: the one role it can pass is the compute role, which has less than the head's own",
    ("UNKNOWN_CONDITION_FOR_ACTION", "user-access", SESSION_DOCUMENT_CHECK):
        "parliament's IAM database predates the key; AWS's Session Manager quickstart end-user policies use it on "
        "ssm:StartSession so that a caller cannot fall back to the default document (ssm-user, sudo)",
    ("UNKNOWN_CONDITION_FOR_ACTION", "admin-access", SESSION_DOCUMENT_CHECK):
        "as for user-access: the admin document, only with its own name",
    ("RESOURCE_MISMATCH", "user-access", "ssmmessages:OpenDataChannel"):
        "parliament's database has no resource type for it; the policy scopes it to the region's sessions of the "
        "account (opening a channel takes the token of a StartSession or ResumeSession the policy bounds)",
    ("RESOURCE_MISMATCH", "admin-access", "ssmmessages:OpenDataChannel"):
        "as for user-access",
    ("PERMISSIONS_MANAGEMENT_ACTIONS", "budget-action", "iam:attachrolepolicy"):
        "the Budgets action's role attaches exactly the launch-deny policy (iam:PolicyARN) to exactly the head role",
    ("PERMISSIONS_MANAGEMENT_ACTIONS", "budget-action", "iam:detachrolepolicy"):
        "and detaches it again: same policy, same role",
}


def _about(finding: Any) -> list[str]:
    """What a finding is about, in the terms SUPPRESSED uses: its actions, its escalation type or its detail."""
    location, detail = finding.location or {}, finding.detail
    if finding.issue == "RESOURCE_MISMATCH":
        return sorted({d["action"] for d in detail})
    if finding.issue == "PRIVILEGE_ESCALATION":
        return [location["type"]]
    if "actions" in location:
        return sorted(location["actions"])
    return [str(detail)]


def _documents(stack_name: str, declared: tuple[Declared, ...], region: str) -> Iterator[tuple[str, str, str]]:
    """(what, policy's short name, document) for every policy document declared; a trust policy twice: as written,
    and with its role's ARN as the Resource of each statement."""
    prefix = f"gpucluster-{stack_name}-"
    for d in declared:
        for key in POLICY_INPUTS:
            if key not in d.inputs:
                continue
            if key == "assumeRolePolicy":
                yield f"{d.name} trust policy", "role trust policy", d.inputs[key]
                document = json.loads(d.inputs[key])
                for statement in document["Statement"]:
                    statement["Resource"] = planned_outputs(d, region)["arn"]
                yield f"{d.name} trust policy on its role", "role trust policy on its role", json.dumps(document)
            else:
                yield f"{d.name} ({d.type})", d.name.removeprefix(prefix), d.inputs[key]


# Every shipped stack in a new account, and a stack with spot pools where the default EBS key is customer managed (the
# head role's key statements, the key grants).
PLANS = [*((path, AccountFacts()) for path in STACK_FILES),
         (ROOT / "stacks" / "Pulumi.team-a.yaml", AccountFacts(customer_managed_ebs_key=True))]


def _findings() -> Iterator[tuple[str, str, str, Any]]:
    for path, facts in PLANS:
        stack, declared = planned(path, facts)
        for what, short, document in _documents(stack.name, declared, stack.region):
            for finding in analyze_policy_string(document, include_community_auditors=True).findings:
                yield path.name, what, short, finding


def test_every_policy_document_of_every_shipped_stack_passes_parliament() -> None:
    unexpected, used = [], set()
    for stack, what, short, finding in _findings():
        for about in _about(finding):
            key = (finding.issue, short, about)
            if key in SUPPRESSED:
                used.add(key)
            else:
                unexpected.append(f"{stack}: {what}: {finding.issue} {about}: {finding.detail} {finding.location}")
    assert not unexpected, "\n".join(unexpected)
    assert used == set(SUPPRESSED), f"suppressions no finding needs any more: {set(SUPPRESSED) - used}"


def test_the_lint_sees_every_kind_of_policy_document() -> None:
    """Identity, resource and trust policies of the shipped stacks all reach the linter (nothing silently skipped)."""
    kinds = set()
    for path in STACK_FILES:
        stack, declared = planned(path)
        kinds |= {d.type for d in declared if set(POLICY_INPUTS) & set(d.inputs)}
    assert {"aws:iam/rolePolicy:RolePolicy", "aws:iam/policy:Policy", "aws:iam/role:Role",
            "aws:sns/topicPolicy:TopicPolicy", "aws:sqs/queuePolicy:QueuePolicy"} <= kinds


def test_the_linter_finds_what_it_should() -> None:
    """parliament is live: an unknown action and a mistyped ARN are findings."""
    bad = json.dumps({"Version": "2012-10-17", "Statement": [
        {"Effect": "Allow", "Action": "ec2:LaunchEverything", "Resource": "*"},
        {"Effect": "Allow", "Action": "s3:GetObject", "Resource": "arn:aws:sqs:us-east-1:123456789012:q"}]})
    issues = {f.issue for f in analyze_policy_string(bad).findings}
    assert {"UNKNOWN_ACTION", "RESOURCE_MISMATCH"} <= issues
