"""The way into a Kubernetes stack's API for `pulumi up` and kubectl: `operator` in kubernetes.public_access_cidrs
(this machine's public address from checkip.amazonaws.com at `up`, a documentation address in the offline plan),
networks listed there, or private_access_cidrs to the private endpoint of an existing network; a stack with no way
in is refused; `preflight` checks this machine against the list."""

from __future__ import annotations

import copy
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from ipaddress import IPv4Address, IPv4Network
from typing import Any

import pulumi
import pytest
import yaml

from conftest import ROOT, of_type, planned
from gpucluster.aws import checkip, preflight
from gpucluster.plan import PLAN_OPERATOR_IP, AccountFacts, Declared, planned_id, run_program
from gpucluster.project import pulumi_program
from gpucluster.spec.model import OPERATOR, SpecError, Stack, load_stack, validate, way_in_warning

TEAM_K8S = ROOT / "stacks" / "Pulumi.team-k8s.yaml"
EXISTING = {"vpc_id": "vpc-0a1b2c3d4e5f60718", "subnet_id": "subnet-0a1b2c3d4e5f60718"}
CONTROL_PLANE_SUBNET = "subnet-0f0e0d0c0b0a09080"
# What the stand-in answers as this machine's public address, and public networks to list (a listed network must be
# public: the documentation ranges are not). Whose they are is no matter: nothing is reached here.
ADDRESS = "1.2.3.45"
INSIDE, OUTSIDE = "1.2.3.0/24", "5.6.0.0/16"


class Checkip:
    """A stand-in for https://checkip.amazonaws.com on 127.0.0.1: this machine has no way out to the internet, and no
    test may depend on one. It answers as the service does (200, the caller's address and a newline) unless told to
    answer otherwise, and counts the requests."""

    def __init__(self) -> None:
        self.status, self.body, self.requests = 200, f"{ADDRESS}\n".encode(), 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.requests += 1
                self.send_response(outer.status)
                self.send_header("Content-Length", str(len(outer.body)))
                self.end_headers()
                self.wfile.write(outer.body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/"
        # A short poll: shutdown() waits for the loop's next look (0.5 s by default, at every test's teardown).
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def service(monkeypatch: pytest.MonkeyPatch) -> Iterator[Checkip]:
    """The stand-in, as the service the Pulumi program asks at `up`."""
    stand_in = Checkip()
    monkeypatch.setattr(checkip, "CHECKIP_URL", stand_in.url)
    yield stand_in
    stand_in.close()


@pytest.fixture
def unreachable() -> str:
    """A URL on 127.0.0.1 where nothing listens (a port just freed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/"


def k8s_stack(network: dict[str, str] | None = None, **kubernetes: Any) -> Stack:
    """team-k8s with its kubernetes section replaced by `kubernetes` (and an existing network when given)."""
    doc = yaml.safe_load(TEAM_K8S.read_text())["config"]
    cluster = doc["gpucluster:cluster"]
    cluster["kubernetes"] = {"version": "1.35", **copy.deepcopy(kubernetes)}
    if network:
        cluster["network"] = network
        cluster["kubernetes"]["control_plane_subnet_id"] = CONTROL_PLANE_SUBNET
    return validate("k8s-access", doc)


def vpc_config(declared: tuple[Declared, ...] | list[Declared]) -> dict[str, Any]:
    (cluster,) = of_type(declared, "eks/cluster:Cluster")
    return cluster.inputs["vpcConfig"]


# --- The lookup ---------------------------------------------------------------------------------------------------

def test_the_address_is_what_checkip_answers(service: Checkip) -> None:
    assert checkip.public_address(service.url) == IPv4Address(ADDRESS)


@pytest.mark.parametrize(("status", "body", "words"), [
    (200, b"<html>captive portal</html>", "answered '<html>captive portal</html>', not an IPv4 address"),
    (200, b"2001:db8::1\n", "answered '2001:db8::1', not an IPv4 address"),
    (200, b"", "answered '', not an IPv4 address"),
    (503, b"busy", "answered HTTP 503"),
], ids=["garbage", "ipv6", "empty", "http-error"])
def test_a_wrong_answer_is_one_line(service: Checkip, status: int, body: bytes, words: str) -> None:
    service.status, service.body = status, body
    with pytest.raises(checkip.LookupFailed) as caught:
        checkip.public_address(service.url)
    assert str(caught.value) == f"{service.url} {words}"


def test_an_unreachable_service_is_one_line(unreachable: str) -> None:
    with pytest.raises(checkip.LookupFailed, match=rf"^{unreachable} is unreachable: .*refused") as caught:
        checkip.public_address(unreachable)
    assert "\n" not in str(caught.value)


def test_operator_becomes_the_machines_slash_32_and_is_asked_only_when_listed(service: Checkip) -> None:
    assert checkip.public_access_cidrs([OUTSIDE, OUTSIDE]) == [OUTSIDE]
    assert service.requests == 0
    assert checkip.public_access_cidrs([OPERATOR, f"{ADDRESS}/32", OUTSIDE]) == [f"{ADDRESS}/32", OUTSIDE]
    assert service.requests == 1


# --- The plan and `up` --------------------------------------------------------------------------------------------

def test_the_shipped_stack_plans_its_way_in_without_the_network(service: Checkip) -> None:
    stack = load_stack(TEAM_K8S)
    declared = run_program(stack, pulumi_program())
    assert stack.spec.eks.public_access_cidrs == [OPERATOR]
    vpc = vpc_config(declared)
    assert vpc["endpointPublicAccess"] is True and vpc["endpointPrivateAccess"] is True
    assert vpc["publicAccessCidrs"] == [f"{PLAN_OPERATOR_IP}/32"]
    assert IPv4Address(PLAN_OPERATOR_IP) in IPv4Network("198.51.100.0/24")  # TEST-NET-2 (RFC 5737): no one's address
    assert service.requests == 0


def test_up_asks_checkip_for_operator(service: Checkip) -> None:
    stack = k8s_stack(public_access_cidrs=[OPERATOR, OUTSIDE])
    declared = run_program(stack, pulumi_program(), facts=AccountFacts(operator_ip=None))
    assert vpc_config(declared)["publicAccessCidrs"] == [f"{ADDRESS}/32", OUTSIDE]
    assert service.requests == 1


@pytest.mark.parametrize("answer", ["garbage", "unreachable"])
def test_a_failed_lookup_at_up_names_the_key(service: Checkip, unreachable: str, monkeypatch: pytest.MonkeyPatch,
                                             answer: str) -> None:
    if answer == "garbage":
        service.body = b"<html>captive portal</html>"
    else:
        monkeypatch.setattr(checkip, "CHECKIP_URL", unreachable)
    stack = k8s_stack(public_access_cidrs=[OPERATOR])
    with pytest.raises(pulumi.RunError) as caught:
        run_program(stack, pulumi_program(), facts=AccountFacts(operator_ip=None))
    message = str(caught.value)
    assert message.startswith("gpucluster:cluster.kubernetes.public_access_cidrs: 'operator' is this machine's public "
                              "address, which could not be looked up: ")
    assert ("not an IPv4 address" if answer == "garbage" else "is unreachable") in message
    assert "\n" not in message


def test_private_access_admits_exactly_its_networks_to_the_api_not_to_the_nodes() -> None:
    private = ["10.8.0.0/16", "172.20.0.0/14"]
    stack = k8s_stack(EXISTING, private_access_cidrs=[*private, private[0]])  # a network listed twice: one rule
    declared = run_program(stack, pulumi_program())
    vpc = vpc_config(declared)
    assert vpc["endpointPrivateAccess"] is True and vpc["endpointPublicAccess"] is False
    assert "publicAccessCidrs" not in vpc
    groups = {planned_id(g, stack.region): g for g in of_type(declared, "ec2/securityGroup:SecurityGroup")}
    (api,) = [i for i, g in groups.items() if g.name.endswith("-api")]
    assert groups[api].inputs["vpcId"] == EXISTING["vpc_id"]
    nodes = [i for i in vpc["securityGroupIds"] if i != api]
    assert api in vpc["securityGroupIds"] and len(nodes) == 1
    rules = of_type(declared, "vpc/securityGroupIngressRule:SecurityGroupIngressRule")
    api_rules = [r.inputs for r in rules if r.inputs["securityGroupId"] == api]
    assert sorted((r["cidrIpv4"], r["ipProtocol"], r["fromPort"], r["toPort"]) for r in api_rules) == [
        (cidr, "tcp", 443, 443) for cidr in private]
    # The nodes' group (and every node's launch template) stays as it was: no 443, no private network.
    assert not [r for r in rules if r.inputs["securityGroupId"] == nodes[0]
                and (r.inputs.get("fromPort") == 443 or r.inputs.get("cidrIpv4") in private)]
    for template in of_type(declared, "ec2/launchTemplate:LaunchTemplate"):
        named = template.inputs.get("vpcSecurityGroupIds") or [
            g for nic in template.inputs.get("networkInterfaces", []) for g in nic["securityGroups"]]
        assert named and api not in named, template.name


def test_a_new_vpc_has_no_private_api_group() -> None:
    _, declared = planned(TEAM_K8S)
    assert not [g for g in of_type(declared, "ec2/securityGroup:SecurityGroup") if g.name.endswith("-api")]
    assert len(vpc_config(declared)["securityGroupIds"]) == 1


# --- The rule ------------------------------------------------------------------------------------------------------

def _problems(network: dict[str, str] | None = None, **kubernetes: Any) -> dict[str, str]:
    with pytest.raises(SpecError) as caught:
        k8s_stack(network, **kubernetes)
    return dict(caught.value.problems)


def test_no_way_in_is_refused_saying_what_is_allowed() -> None:
    new_vpc = _problems()["gpucluster:cluster.kubernetes.public_access_cidrs"]
    assert "'operator'" in new_vpc and "IPv4 networks" in new_vpc
    assert "private_access_cidrs needs an existing network" in new_vpc


def test_an_existing_network_without_a_way_in_plans_with_a_warning_and_fails_preflight(
        service: Checkip) -> None:
    """The way in may be one the file does not show (a runner inside the VPC admitted by hand): plan warns, preflight,
    which is run from the machine that will run `up`, fails."""
    stack = k8s_stack(EXISTING)
    warning = way_in_warning(stack.spec)
    assert warning and "kubernetes.private_access_cidrs" in warning
    assert way_in_warning(k8s_stack(EXISTING, private_access_cidrs=["10.8.0.0/16"]).spec) is None
    assert way_in_warning(k8s_stack(public_access_cidrs=["operator"]).spec) is None
    check = preflight.check_way_in(stack, service.url)
    assert (check.name, check.status) == ("api access", "fail") and check.detail == warning
    assert not service.requests  # nothing to place: no listed network


def test_private_access_needs_an_existing_network() -> None:
    assert _problems(private_access_cidrs=["10.8.0.0/16"]) == {
        "gpucluster:cluster.kubernetes.private_access_cidrs": (
            "only allowed with an existing network (vpc_id): nothing outside a VPC this `up` creates can reach into "
            "it; use public_access_cidrs (CIDRs or 'operator')")}
    assert k8s_stack(EXISTING, private_access_cidrs=["10.8.0.0/16"]).spec.eks.private_access_cidrs == ["10.8.0.0/16"]


@pytest.mark.parametrize(("key", "entry", "words"), [
    ("public_access_cidrs", "Operator", "not an IPv4 network or 'operator'"),
    ("public_access_cidrs", "0.0.0.0/0", "0.0.0.0/0 opens the API endpoint to too much of the internet"),
    ("private_access_cidrs", OPERATOR, "not an IPv4 network: 'operator'"),
    ("private_access_cidrs", "10.0.0.0/7", "10.0.0.0/7 opens the API endpoint to too much of the network"),
])
def test_each_entry_is_a_network_or_operator(key: str, entry: str, words: str) -> None:
    problems = _problems(EXISTING, **{key: [entry]})
    assert problems[f"gpucluster:cluster.kubernetes.{key}[0]"].startswith(words)


@pytest.mark.parametrize("cidr", ["10.8.0.0/16", "172.16.0.0/12", "192.168.0.0/24", "100.64.0.0/10",
                                  "169.254.0.0/16", "127.0.0.0/8", "198.18.0.0/15", "203.0.113.0/24", "240.0.0.0/8"])
def test_a_public_entry_must_be_a_public_network(cidr: str) -> None:
    """EKS refuses a non-public range at CreateCluster, after this `up` has built the VPC: the stack file is refused
    first, naming the entry and what belongs there; the same range is fine as a private way in."""
    assert not IPv4Network(cidr).is_global
    problems = _problems(public_access_cidrs=[OPERATOR, cidr])
    assert list(problems) == ["gpucluster:cluster.kubernetes.public_access_cidrs[1]"]
    message = problems["gpucluster:cluster.kubernetes.public_access_cidrs[1]"]
    assert message.startswith(f"{cidr} is not a public network")
    assert "'operator'" in message and "private_access_cidrs" in message
    assert k8s_stack(EXISTING, public_access_cidrs=[OPERATOR],
                     private_access_cidrs=[cidr]).spec.eks.private_access_cidrs == [cidr]


def test_a_public_network_is_taken_as_listed() -> None:
    public = "8.8.8.0/24"  # a public network (whose is no matter: nothing is reached here)
    assert IPv4Network(public).is_global
    assert k8s_stack(public_access_cidrs=[public]).spec.eks.public_access_cidrs == [public]


def test_plan_refuses_a_stack_without_a_way_in() -> None:
    done = subprocess.run([sys.executable, "-m", "gpucluster", "plan", "tests/bad_stacks/Pulumi.k8s-no-way-in.yaml"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "gpucluster:cluster.kubernetes.public_access_cidrs: the cluster's API needs a way in" in done.stderr


# --- preflight -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("kubernetes", "status", "words"), [
    ({"public_access_cidrs": [OPERATOR]}, "pass", f"`operator`: this machine's {ADDRESS}/32"),
    ({"public_access_cidrs": [OUTSIDE, INSIDE]}, "pass", f"this machine ({ADDRESS}) is inside {INSIDE}"),
    ({"public_access_cidrs": [OUTSIDE]}, "fail", f"this machine ({ADDRESS}) is outside public_access_cidrs"),
    ({"public_access_cidrs": [OUTSIDE], "private_access_cidrs": ["10.8.0.0/16"]}, "pass",
     f"this machine ({ADDRESS}) is outside public_access_cidrs: `up` goes through the private endpoint from "
     "10.8.0.0/16"),
], ids=["operator", "inside", "outside", "outside-with-private"])
def test_preflight_places_this_machine(service: Checkip, kubernetes: dict[str, Any], status: str, words: str) -> None:
    check = preflight.check_way_in(k8s_stack(EXISTING, **kubernetes), service.url)
    assert (check.name, check.status) == ("api access", status) and check.detail.startswith(words), check
    if status == "fail":
        assert check.fix.startswith(f"add `operator` or {ADDRESS}/32")


def test_preflight_with_private_access_only_asks_no_one(service: Checkip) -> None:
    check = preflight.check_way_in(k8s_stack(EXISTING, private_access_cidrs=["10.8.0.0/16"]), service.url)
    assert check.status == "pass" and "private endpoint admits 10.8.0.0/16" in check.detail
    assert service.requests == 0


@pytest.mark.parametrize(("public", "status"), [([OPERATOR], "fail"), ([OUTSIDE], "warn")])
def test_preflight_without_an_answer(service: Checkip, unreachable: str, public: list[str], status: str) -> None:
    service.body = b"<html>captive portal</html>"
    for url, words in ((service.url, "not an IPv4 address"), (unreachable, "is unreachable")):
        check = preflight.check_way_in(k8s_stack(public_access_cidrs=public), url)
        assert check.status == status and words in check.detail, check
        if status == "fail":
            assert "https://checkip.amazonaws.com" in check.fix
