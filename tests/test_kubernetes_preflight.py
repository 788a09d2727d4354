"""preflight for a Kubernetes stack: the EKS version offered in standard support, the add-ons' versions for it, and
the accelerated AL2023 AMI parameter of that version (botocore Stubber: moto serves none of EKS's version APIs)."""

from __future__ import annotations

import datetime as dt

import pytest
from botocore.stub import Stubber

from conftest import ROOT
from gpucluster.aws import preflight
from gpucluster.spec import eks
from gpucluster.spec.model import load_stack
from test_preflight import Session, _all_denied, client

TEAM_K8S = ROOT / "stacks" / "Pulumi.team-k8s.yaml"


@pytest.mark.parametrize(("answer", "status", "words"), [
    ([{"clusterVersion": "1.35", "versionStatus": "STANDARD_SUPPORT",
       "endOfStandardSupportDate": dt.datetime(2027, 3, 27)}], "pass", "standard support until 2027-03-27"),
    ([{"clusterVersion": "1.35", "versionStatus": "EXTENDED_SUPPORT"}], "fail", "is in extended support on EKS"),
    ([], "fail", "EKS does not offer Kubernetes 1.35 in this region"),
])
def test_eks_version(answer: list, status: str, words: str) -> None:
    c = client("eks")
    with Stubber(c) as stub:
        stub.add_response("describe_cluster_versions", {"clusterVersions": answer},
                          {"clusterVersions": ["1.35"], "includeAll": True})
        check = preflight.check_eks_version(c, "1.35")
    assert check.status == status and words in check.detail


def _addon(name: str, version: str, default: bool) -> dict:
    return {"addons": [{"addonName": name, "addonVersions": [{"addonVersion": "v9.9.9-eksbuild.1", "compatibilities": [
        {"clusterVersion": version, "defaultVersion": default}]}]}]}


def test_addons_have_a_default_for_the_version() -> None:
    c = client("eks")
    with Stubber(c) as stub:
        for name in eks.ADDONS:
            # The FSx CSI driver answers with versions for another Kubernetes version only: it fails.
            stub.add_response("describe_addon_versions",
                              _addon(name, "1.34" if name == "aws-fsx-csi-driver" else "1.35", True),
                              {"kubernetesVersion": "1.35", "addonName": name})
        checks = preflight.check_addons(c, "1.35")
    by_status = {c.detail.split()[0]: c.status for c in checks}
    assert by_status == {name: "fail" if name == "aws-fsx-csi-driver" else "pass" for name in eks.ADDONS}


def test_ami_parameter_is_the_eks_accelerated_one() -> None:
    stack = load_stack(TEAM_K8S)
    pool = stack.spec.pools[0]
    name = preflight.ami_parameter(stack, pool)
    assert name == "/aws/service/eks/optimized-ami/1.35/amazon-linux-2023/x86_64/nvidia/recommended/image_id"
    ssm = client("ssm")
    with Stubber(ssm) as stub:
        stub.add_response("get_parameter",
                          {"Parameter": {"Name": name, "Type": "String", "Value": "ami-0123456789abcdef0"}},
                          {"Name": name})
        check = preflight.check_ami(ssm, client("ec2"), pool, name)
    assert check.status == "pass" and check.detail == f"{name} -> ami-0123456789abcdef0"


def test_run_checks_eks_only_for_a_kubernetes_stack() -> None:
    for path, asks in ((TEAM_K8S, True), (ROOT / "stacks" / "Pulumi.team-a.yaml", False)):
        session = Session(**{s: _all_denied(s) for s in ("ec2", "ssm", "service-quotas", "iam", "eks")})
        report = preflight.run(load_stack(path), session, checkip_url="http://127.0.0.1:9")  # no network in tests
        assert ("eks" in session.asked) is asks
        eks_checks = [c for c in report.checks if c.name in ("k8s version", "add-on")]
        assert len(eks_checks) == (2 if asks else 0)
        assert all(c.status == "warn" and "grant eks:" in c.detail for c in eks_checks)
