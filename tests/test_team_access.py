"""Who gets in (components/team_access.py), under the mock runtime: a Session Manager document per kind of shell on
the head node and one that forwards a local port to Grafana on the head's loopback; per shell document one policy that
allows StartSession on this stack's head node only, with that document or the dashboard's only, and Run Command of the
verify document on that head only (its script: tests/test_verify_remote.py). With people (`users:`): a shell document
per person, and the users' policy checked as a document by a small IAM evaluator, principal x requested document."""

from __future__ import annotations

import fnmatch
import functools
import json
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pulumi
import pytest
import yaml

from components import team_access
from conftest import ROOT, of_type, planned
from gpucluster import cli
from gpucluster.aws import verify_remote
from gpucluster.contract import verify as v
from gpucluster.contract.settings import (
    DEEP_VERIFY_COMMAND,
    GRAFANA_PORT,
    LOGIN_USER,
    STATUS_COMMAND,
    VERIFY_COMMAND,
    command_document_name,
    person_session_document_name,
    session_document_name,
)
from gpucluster.plan import MOCK_ACCOUNT, Declared, planned_id, run_program
from gpucluster.project import EXAMPLES_DIR
from gpucluster.spec.model import Stack, UserSpec, validate

ACCOUNT = MOCK_ACCOUNT
TEAM_A = ROOT / "stacks" / "Pulumi.team-a.yaml"
TEAM_B = ROOT / "stacks" / "Pulumi.team-b.yaml"


def test_sessions_on_the_head_node_as_the_login_user_or_as_admin() -> None:
    """A stack without `users:`: everyone's shell is the login user's."""
    stack, declared = planned(TEAM_B)
    assert stack.spec.users is None
    region, cluster = stack.region, stack.cluster_name
    (head,) = of_type(declared, "ec2/instance:Instance")
    documents = {d.inputs["name"]: json.loads(d.inputs["content"]) for d in of_type(declared, "ssm/document:Document")
                 if d.inputs["documentType"] == "Session"}
    assert set(documents) == {session_document_name(cluster, k) for k in ("user", "admin", "dashboard", "ssh")}
    assert session_document_name(cluster, "user") == f"{cluster}-user-session"
    user, admin = documents[f"{cluster}-user-session"], documents[f"{cluster}-admin-session"]
    assert user["sessionType"] == admin["sessionType"] == "Standard_Stream"
    # Users: the login user, whom the lockdown leaves without sudo. Admins: Session Manager's ssm-user (sudo).
    assert user["inputs"]["runAsEnabled"] is True and user["inputs"]["runAsDefaultUser"] == LOGIN_USER
    assert user["inputs"]["maxSessionDuration"] == admin["inputs"]["maxSessionDuration"] == "720"
    assert admin["inputs"]["runAsEnabled"] is False and "runAsDefaultUser" not in admin["inputs"]
    assert all(d.inputs["documentFormat"] == "JSON" for d in of_type(declared, "ssm/document:Document"))

    policies = access_policies(declared, cluster)
    instance = f"arn:aws:ec2:{region}:{ACCOUNT}:instance/{planned_id(head, region)}"
    for kind, policy in policies.items():
        start, own, channel, find, send, outcome, *keys = policy["Statement"]
        document = f"arn:aws:ssm:{region}:{ACCOUNT}:document/{cluster}-{kind.split('-')[0]}-session"
        dashboard = f"arn:aws:ssm:{region}:{ACCOUNT}:document/{cluster}-dashboard-session"
        # The users' SSH stream (to port 22 only); the admins' shell is ssm-user's, whom no key is pushed for.
        ssh = [f"arn:aws:ssm:{region}:{ACCOUNT}:document/{cluster}-ssh-session"] if kind == "user-access" else []
        assert start["Action"] == "ssm:StartSession" and start["Resource"] == [instance, document, dashboard, *ssh]
        assert keys == ([{"Effect": "Allow", "Action": "ec2-instance-connect:SendSSHPublicKey", "Resource": instance,
                          "Condition": {"StringEquals": {"ec2:osuser": LOGIN_USER}}}] if kind == "user-access" else [])
        # Without the check, a caller could name AWS's default document and start as ssm-user, who has sudo.
        assert start["Condition"]["BoolIfExists"] == {"ssm:SessionDocumentAccessCheck": "true"}
        # A caller's SSMSessionRunAs tag would override the login user with any user of the node (slurm, ssm-user):
        # the users' policy admits only callers without one; the admins' shell is ssm-user's anyway.
        assert start["Condition"].get("Null") == ({"aws:PrincipalTag/SSMSessionRunAs": "true"}
                                                  if kind == "user-access" else None)
        # One's own sessions: Session Manager tags each with its starter's user id.
        assert own["Action"] == ["ssm:TerminateSession", "ssm:ResumeSession"]
        assert own["Resource"] == f"arn:aws:ssm:{region}:{ACCOUNT}:session/*"
        assert own["Condition"] == {"StringEquals": {"ssm:resourceTag/aws:ssmmessages:session-id": "${aws:userid}"}}
        # The data channel of a session the caller started or resumed (its token): a session id starts with the user's
        # or the role session's name, never with aws:userid, so no pattern of the caller's id would match a role's.
        assert channel["Action"] == "ssmmessages:OpenDataChannel" and channel["Resource"] == own["Resource"]
        # What `gpucluster dashboard` calls (tests/test_dashboard_command.py).
        assert find["Action"] == "ec2:DescribeInstances"
        # `gpucluster verify STACK` and `status STACK`: their documents on the head only, never AWS-RunShellScript
        # (root); --deep's (an hour of the nodes under Slurm's root account, outside the team's limits) for admins only.
        admins = kind == "admin-access"
        kinds = [VERIFY_COMMAND, *([DEEP_VERIFY_COMMAND] if admins else []), STATUS_COMMAND]
        commands = [f"arn:aws:ssm:{region}:{ACCOUNT}:document/{cluster}-{k}-command" for k in kinds]
        assert send == {"Sid": "CommandsOnTheHeadNode", "Effect": "Allow", "Action": "ssm:SendCommand",
                        "Resource": [instance, *commands]}
        assert outcome["Action"] == ["ssm:GetCommandInvocation", "ssm:ListCommandInvocations"]
        assert not {"ssm:SendCommand", "ssm:StartSession"} & set(json.dumps(outcome).split('"'))
    # Nothing else in the stack grants StartSession or SendCommand.
    for action in ("ssm:StartSession", "ssm:SendCommand"):
        grants = [d.name for d in declared if "policy" in d.inputs and action in d.inputs["policy"]]
        assert sorted(grants) == sorted(f"{cluster}-{k}" for k in policies), action


def access_policies(declared: tuple[Declared, ...], cluster: str) -> dict[str, dict[str, Any]]:
    """The stack's two access policies by short name (user-access, admin-access), parsed."""
    policies = {d.name.removeprefix(f"{cluster}-"): json.loads(d.inputs["policy"])
                for d in of_type(declared, "iam/policy:Policy") if d.name.endswith("-access")}
    assert set(policies) == {"user-access", "admin-access"}
    return policies


def test_dashboard_document_forwards_to_grafana_on_the_heads_loopback_only() -> None:
    """The caller chooses the local port and nothing else: no remote port parameter, no host (the agent then connects
    to localhost), so the document cannot reach another port of the head or anything the head reaches."""
    stack, declared = planned(TEAM_B)
    (document,) = [d for d in of_type(declared, "ssm/document:Document")
                   if d.inputs["name"] == session_document_name(stack.cluster_name, "dashboard")]
    assert document.inputs["documentType"] == "Session" and document.inputs["documentFormat"] == "JSON"
    content = json.loads(document.inputs["content"])
    assert content["schemaVersion"] == "1.0" and content["sessionType"] == "Port"
    assert content["properties"] == {"type": "LocalPortForwarding", "portNumber": str(GRAFANA_PORT),
                                     "localPortNumber": "{{ localPortNumber }}"}
    (name, local), = content["parameters"].items()
    assert name == "localPortNumber" and local["type"] == "String" and local["default"] == str(GRAFANA_PORT)
    pattern = re.compile(local["allowedPattern"])
    assert all(pattern.fullmatch(port) for port in ("1", "80", "3000", "9999", "10000", "59999", "65535"))
    # 0 would let the plugin pick a port other than the one `gpucluster dashboard` printed.
    assert not any(pattern.fullmatch(port) for port in ("0", "65536", "99999", "030", "3000 ", "3000;22", ""))


@pytest.mark.parametrize("kind", [VERIFY_COMMAND, DEEP_VERIFY_COMMAND])
def test_verify_document_runs_gpucluster_verify_as_root_with_checked_parameters_only(kind: str) -> None:
    """The Run Command documents run the head's `gpucluster verify --json` (their script: tests/test_verify_remote.py);
    each parameter is a value checked by SendCommand (a pattern or a list) and reaches the script as an environment
    variable, never as text spliced into it: no `{{ }}` anywhere in the script. Only the admins' one takes `deep`."""
    stack, declared = planned(ROOT / "stacks" / "Pulumi.team-a.yaml")
    documents = {d.inputs["name"]: d for d in of_type(declared, "ssm/document:Document")
                 if d.inputs["documentType"] == "Command"}
    kinds = (VERIFY_COMMAND, DEEP_VERIFY_COMMAND, STATUS_COMMAND)
    assert set(documents) == {command_document_name(stack.cluster_name, k) for k in kinds}
    document = documents[f"{stack.cluster_name}-{kind}-command"]
    content = json.loads(document.inputs["content"])
    assert content["schemaVersion"] == "2.2"
    (step,) = content["mainSteps"]
    assert step["action"] == "aws:runShellScript" and step["inputs"]["runCommand"] == verify_remote.SCRIPT
    assert "{{" not in json.dumps(step)
    # As long as the head's run can take (its own limits summed, nodes booting up to the stack's ResumeTimeout), and
    # no longer: --deep's DCGM level 3 holds the nodes an hour, level 1 minutes.
    deep = kind == DEEP_VERIFY_COMMAND
    timeout = int(step["inputs"]["timeoutSeconds"])
    assert timeout == v.run_seconds(stack.spec.slurm.resume_timeout_seconds, deep)
    assert timeout - v.dcgm_job_seconds(v.DCGM_DEEP_LEVEL if deep else v.DCGM_LEVEL) > (
        stack.spec.slurm.resume_timeout_seconds + v.QUEUE_SECONDS + v.JOB_SECONDS + v.DCGM_START_SECONDS)
    parameters = content["parameters"]
    assert set(parameters) == {"pools", "nodes", "last", *(["deep"] if deep else [])}
    assert all(p["type"] == "String" and p["interpolationType"] == "ENV_VAR" for p in parameters.values())
    for name in ("deep", "last") if deep else ("last",):
        assert parameters[name]["allowedValues"] == ["false", "true"] and parameters[name]["default"] == "false"
    pools, nodes = (re.compile(parameters[name]["allowedPattern"]) for name in ("pools", "nodes"))
    names = [p.name for p in stack.spec.pools]
    assert all(pools.fullmatch(value) for value in ("", names[0], " ".join(names), parameters["pools"]["default"]))
    assert all(nodes.fullmatch(value) for value in ("", "1", "2", "1024", parameters["nodes"]["default"]))
    injections = ("; rm -rf /", "$(id)", "`id`", f"{names[0]}\nid", f"{names[0]};id", f"{names[0]} && id", "*",
                  f"{names[0]}|id", f"{names[0]} ", "../etc", "-rf", "'x'", '"x"')
    assert not any(pattern.fullmatch(bad) for pattern in (pools, nodes) for bad in injections)
    assert not any(nodes.fullmatch(bad) for bad in ("0", "02", "-1", "2 3", "99999", "2\n"))


# --- People (`users:`): a shell per person, and who may start it ---

class Unsupported(Exception):
    """The policy uses something the evaluator does not model: the test fails, it never guesses an answer."""


# IAM's condition operators the evaluator models: only what the access policies use. Semantics from the IAM User
# Guide, "IAM JSON policy elements: Condition operators": ArnEquals and ArnLike compare each of an ARN's six
# colon-separated parts, case-sensitively, with * and ? as wildcards; StringEquals is exact and case-sensitive; Bool
# compares "true"/"false"; ...IfExists is true when the key is absent; Null "true" means the key is absent. With no
# IfExists, a key absent from the request fails the condition.
OPERATORS = ("ArnEquals", "ArnLike", "StringEquals", "Bool", "Null")
STATEMENT_KEYS = {"Sid", "Effect", "Action", "Resource", "Condition"}


def _wildcard(pattern: str, value: str, case_sensitive: bool = True) -> bool:
    if not case_sensitive:
        pattern, value = pattern.lower(), value.lower()
    return re.fullmatch(fnmatch.translate(pattern).removeprefix("(?s:").removesuffix(")\\Z"), value) is not None \
        if "[" not in pattern else _refuse(f"a [ in {pattern!r}")


def _refuse(what: str) -> bool:
    raise Unsupported(what)


def _substitute(text: str, context: Mapping[str, str]) -> str:
    """Policy variables: ${aws:userid} from the request; any other variable is refused."""
    for variable in re.findall(r"\$\{([^}]*)\}", text):
        if variable != "aws:userid":
            raise Unsupported(f"policy variable ${{{variable}}}")
        if variable not in context:
            raise Unsupported(f"a request without {variable} for a policy that uses it")
        text = text.replace("${" + variable + "}", context[variable])
    return text


def _arn_matches(pattern: str, arn: str) -> bool:
    parts, values = pattern.split(":", 5), arn.split(":", 5)
    return len(parts) == len(values) == 6 and all(_wildcard(p, v) for p, v in zip(parts, values, strict=True))


def _condition_holds(operator: str, key: str, wanted: str | list[str], context: Mapping[str, str]) -> bool:
    base = operator.removesuffix("IfExists")
    if base not in OPERATORS or (operator.endswith("IfExists") and base == "Null"):
        raise Unsupported(f"condition operator {operator}")
    values = [wanted] if isinstance(wanted, str) else wanted
    if base == "Null":
        (absent,) = values
        return (key not in context) == (absent == "true")
    if key not in context:
        return operator.endswith("IfExists")
    actual = context[key]
    if base in ("ArnEquals", "ArnLike"):
        return any(_arn_matches(_substitute(v, context), actual) for v in values)
    if base == "StringEquals":
        return any(_substitute(v, context) == actual for v in values)
    return any(v.lower() == actual.lower() for v in values)  # Bool


def _statement_applies(statement: dict[str, Any], action: str, resource: str, context: Mapping[str, str]) -> bool:
    if set(statement) - STATEMENT_KEYS or statement.get("Effect") not in ("Allow", "Deny"):
        raise Unsupported(f"statement {statement}")
    actions = statement["Action"] if isinstance(statement["Action"], list) else [statement["Action"]]
    resources = statement["Resource"] if isinstance(statement["Resource"], list) else [statement["Resource"]]
    return (any(_wildcard(a, action, case_sensitive=False) for a in actions)
            and any(_wildcard(_substitute(r, context), resource) for r in resources)
            and all(_condition_holds(operator, key, wanted, context)
                    for operator, keys in statement.get("Condition", {}).items() for key, wanted in keys.items()))


def is_allowed(policy: dict[str, Any], action: str, resource: str, context: Mapping[str, str]) -> bool:
    """IAM's evaluation inside one identity policy: an explicit Deny wins, else an Allow allows, else denied."""
    applying = [s["Effect"] for s in policy["Statement"] if _statement_applies(s, action, resource, context)]
    return "Deny" not in applying and "Allow" in applying


def may_start_session(policy: dict[str, Any], principal: str, instance: str, document: str,
                      run_as_tag: str | None = None) -> bool:
    """StartSession on `instance` with `document` (an ARN): the request is authorized on both resources. With
    ssm:SessionDocumentAccessCheck in the policy, Session Manager checks the document too, the default one
    (SSM-SessionManagerRunShell, what a start-session without --document-name uses) included (Session Manager user
    guide, "Start a default shell session by specifying the default session document in IAM policies"). For a role's
    session, aws:PrincipalArn is the role's ARN: `principal` is that ARN."""
    context = {"aws:PrincipalArn": principal, "ssm:SessionDocumentAccessCheck": "true"}
    if run_as_tag is not None:
        context["aws:PrincipalTag/SSMSessionRunAs"] = run_as_tag
    return all(is_allowed(policy, "ssm:StartSession", r, context) for r in (instance, document))


def test_the_evaluator_refuses_what_it_does_not_model() -> None:
    """An operator or a variable it does not know fails loudly instead of allowing (or denying) by guess."""
    arn = "arn:aws:ec2:us-east-1:123456789012:instance/i-0123456789abcdef0"
    for condition in ({"StringLike": {"aws:PrincipalArn": "*"}}, {"ArnNotEquals": {"aws:PrincipalArn": arn}},
                      {"StringEquals": {"aws:PrincipalArn": "${aws:username}"}}):
        policy = {"Statement": [{"Effect": "Allow", "Action": "ssm:StartSession", "Resource": arn,
                                 "Condition": condition}]}
        with pytest.raises(Unsupported):
            is_allowed(policy, "ssm:StartSession", arn, {"aws:PrincipalArn": arn, "aws:userid": "AIDA"})
    with pytest.raises(Unsupported):
        is_allowed({"Statement": [{"Effect": "Allow", "NotAction": "iam:*", "Resource": "*"}]}, "ssm:StartSession",
                   arn, {})
    # And what it models, it models: a Deny wins; ArnLike's wildcard stays inside one part of the ARN.
    both = {"Statement": [{"Effect": "Allow", "Action": "ssm:*", "Resource": "*"},
                          {"Effect": "Deny", "Action": "ssm:StartSession", "Resource": arn}]}
    assert not is_allowed(both, "ssm:StartSession", arn, {}) and is_allowed(both, "ssm:SendCommand", arn, {})
    like = {"Statement": [{"Effect": "Allow", "Action": "ssm:StartSession", "Resource": "*",
                           "Condition": {"ArnLike": {"aws:PrincipalArn": "arn:aws:iam::*:role/a*"}}}]}
    assert is_allowed(like, "ssm:StartSession", arn, {"aws:PrincipalArn": "arn:aws:iam::123456789012:role/alice"})
    assert not is_allowed(like, "ssm:StartSession", arn, {"aws:PrincipalArn": "arn:aws:iam::1:2:role/alice"})


def _head_arn(stack: Stack, declared: tuple[Declared, ...]) -> str:
    (head,) = of_type(declared, "ec2/instance:Instance")
    return f"arn:aws:ec2:{stack.region}:{ACCOUNT}:instance/{planned_id(head, stack.region)}"


@functools.cache
def _people_plan(path: Any = TEAM_A, edit: Any = None) -> tuple[Stack, tuple[Declared, ...], dict[str, Any]]:
    """A Slurm stack with people, planned (once per stack file and edit); `edit` changes its cluster mapping first.
    Also its stack outputs."""
    document = yaml.safe_load(path.read_text())
    if edit:
        edit(document["config"]["gpucluster:cluster"])
    stack = validate(path.name.split(".")[1], document["config"])
    outputs: dict[str, Any] = {}

    def program() -> None:
        from components.cluster import create_cluster

        def keep(key: str) -> Callable[[Any], None]:
            return lambda value: outputs.__setitem__(key, value)

        for key, value in create_cluster(stack, EXAMPLES_DIR).items():
            pulumi.Output.from_input(value).apply(keep(key))

    return stack, tuple(run_program(stack, program)), outputs


def _document_arn(stack: Stack, name: str) -> str:
    return f"arn:aws:ssm:{stack.region}:{ACCOUNT}:document/{name}"


def test_each_person_has_a_shell_document_as_themselves_and_a_connect_command() -> None:
    stack, declared, outputs = _people_plan()
    cluster, people = stack.cluster_name, stack.spec.users or []
    assert [p.name for p in people] == ["alice", "bob"]
    documents = {d.inputs["name"]: json.loads(d.inputs["content"]) for d in of_type(declared, "ssm/document:Document")
                 if d.inputs["documentType"] == "Session"}
    # No shared login user's document: people connect as themselves; the admins' and the dashboard's stay.
    assert set(documents) == {*(person_session_document_name(cluster, p.name) for p in people),
                              *(session_document_name(cluster, k) for k in ("admin", "dashboard", "ssh"))}
    shared_shell = documents[session_document_name(cluster, "admin")]
    for person in people:
        shell = documents[f"{cluster}-user-{person.name}-session"]
        assert shell["sessionType"] == "Standard_Stream"
        assert shell["inputs"]["runAsEnabled"] is True and shell["inputs"]["runAsDefaultUser"] == person.name
        # The same shell profile and time limits as the other shells.
        assert {k: v for k, v in shell["inputs"].items() if not k.startswith("runAs")} == \
            {k: v for k, v in shared_shell["inputs"].items() if not k.startswith("runAs")}
    (head,) = of_type(declared, "ec2/instance:Instance")
    instance_id = planned_id(head, stack.region)
    # The command `gpucluster connect` execs (tests/test_connect.py), as a line for the shell.
    assert outputs["connect"] == {
        p.name: f"aws ssm start-session --region {stack.region} --target {instance_id} --document-name "
                f"{cluster}-user-{p.name}-session" for p in people}
    assert outputs["connect_admin"] == (f"aws ssm start-session --region {stack.region} --target {instance_id} "
                                        f"--document-name {cluster}-admin-session")
    # Without people, one command: the login user's shell.
    shared, declared, outputs = _people_plan(TEAM_B)
    (head,) = of_type(declared, "ec2/instance:Instance")
    assert outputs["connect"] == (f"aws ssm start-session --region {shared.region} --target "
                                  f"{planned_id(head, shared.region)} --document-name "
                                  f"{shared.cluster_name}-user-session")


# The table: principal x requested shell (the OS user it runs as) -> may start it, under the users' policy. Session
# Manager runs no session as root (user guide, "Turn on Run As support"): a root shell could only come from a
# document naming it, which a person named root would get, and root is a reserved name; the row asks for it anyway.
ALICE = "arn:aws:iam::123456789012:role/researchers/alice"
BOB_ROLE = "arn:aws:iam::123456789012:role/platform-admins"
BOB_USER = "arn:aws:iam::123456789012:user/bob"
STRANGER = "arn:aws:iam::123456789012:role/researchers/mallory"
SHELLS = {LOGIN_USER: "user", "ssm-user": "admin"}  # the shared shells; a person's (or root's): user-<name>
TABLE = [
    (ALICE, "alice", True), (ALICE, "bob", False), (ALICE, LOGIN_USER, False), (ALICE, "ssm-user", False),
    (ALICE, "root", False), (ALICE, "default", False), (ALICE, "dashboard", True),
    (BOB_ROLE, "bob", True), (BOB_USER, "bob", True), (BOB_ROLE, "alice", False), (BOB_USER, "alice", False),
    (BOB_USER, "ssm-user", False), (BOB_ROLE, "default", False),
    (STRANGER, "alice", False), (STRANGER, "bob", False), (STRANGER, "default", False), (STRANGER, "ssm-user", False),
    # Someone listed nowhere may still have the users' policy attached: the dashboard is all it opens.
    (STRANGER, "dashboard", True),
    # A session of alice's role is not a principal of its own: aws:PrincipalArn is the role's ARN. A session ARN
    # never arrives there, so one listed nowhere opens nothing.
    ("arn:aws:sts::123456789012:assumed-role/alice/alice", "alice", False),
]


def _requested(stack: Stack, shell: str) -> str:
    """The ARN of the document a caller names for `shell`: an OS user's, the dashboard's, or the default one."""
    if shell == "default":
        return _document_arn(stack, "SSM-SessionManagerRunShell")
    kind = "dashboard" if shell == "dashboard" else SHELLS.get(shell, f"user-{shell}")
    return _document_arn(stack, session_document_name(stack.cluster_name, kind))


@pytest.mark.parametrize(("principal", "shell", "allowed"), TABLE,
                         ids=[f"{p.rsplit(':', 1)[1]}->{s}" for p, s, _ in TABLE])
def test_who_may_start_which_shell(principal: str, shell: str, allowed: bool) -> None:
    stack, declared, _ = _people_plan()
    instance = _head_arn(stack, declared)
    users = access_policies(declared, stack.cluster_name)["user-access"]
    assert may_start_session(users, principal, instance, _requested(stack, shell)) is allowed
    # An SSMSessionRunAs tag would make Session Manager run the shell as any user it names: refused outright.
    assert not may_start_session(users, principal, instance, _requested(stack, shell), run_as_tag="slurm")
    # Another instance (another stack's head, any node) is never reached.
    other = instance.rsplit("/", 1)[0] + "/i-0123456789abcdef0"
    assert other != instance and not may_start_session(users, principal, other, _requested(stack, shell))


def test_the_admins_policy_is_the_platform_teams_ssm_user_shell_only() -> None:
    """The admins' policy is for whoever the account attaches it to (the platform team): ssm-user's shell and the
    dashboard; no person's shell, so it never lets one person be another."""
    stack, declared, _ = _people_plan()
    instance = _head_arn(stack, declared)
    admins = access_policies(declared, stack.cluster_name)["admin-access"]
    for principal in (ALICE, BOB_ROLE, STRANGER):
        allowed = {shell for shell in (*SHELLS, "default", "dashboard")
                   if may_start_session(admins, principal, instance, _requested(stack, shell))}
        assert allowed == {"ssm-user", "dashboard"}, principal


def test_one_ends_and_resumes_only_ones_own_sessions() -> None:
    stack, declared, _ = _people_plan()
    for policy in access_policies(declared, stack.cluster_name).values():
        session = f"arn:aws:ssm:{stack.region}:{ACCOUNT}:session/alice-0a1b2c3d4e5f67890"
        owner = {"ssm:resourceTag/aws:ssmmessages:session-id": "AROAEXAMPLEALICE:alice"}
        for action in ("ssm:TerminateSession", "ssm:ResumeSession"):
            assert is_allowed(policy, action, session, {**owner, "aws:userid": "AROAEXAMPLEALICE:alice"})
            assert not is_allowed(policy, action, session, {**owner, "aws:userid": "AROAEXAMPLEBOB:bob"})


def _remove_bob_add_carol(cluster: dict[str, Any]) -> None:
    cluster["users"] = [u for u in cluster["users"] if u["name"] != "bob"] + [
        {"name": "carol", "principals": ["arn:aws:iam::123456789012:role/researchers/carol"]}]


def test_a_removed_person_can_no_longer_start_a_shell_and_a_new_one_can() -> None:
    stack, declared, outputs = _people_plan(edit=_remove_bob_add_carol)
    instance = _head_arn(stack, declared)
    users = access_policies(declared, stack.cluster_name)["user-access"]
    names = {d.inputs["name"] for d in of_type(declared, "ssm/document:Document")}
    assert f"{stack.cluster_name}-user-bob-session" not in names and set(outputs["connect"]) == {"alice", "carol"}
    carol = "arn:aws:iam::123456789012:role/researchers/carol"
    for principal in (BOB_ROLE, BOB_USER):
        assert not any(may_start_session(users, principal, instance, _requested(stack, shell))
                       for shell in ("bob", "alice", "carol", "default", LOGIN_USER, "ssm-user"))
    assert may_start_session(users, carol, instance, _requested(stack, "carol"))
    assert not may_start_session(users, carol, instance, _requested(stack, "alice"))


def _crowd(cluster: dict[str, Any]) -> None:
    cluster["users"] = [{"name": f"researcher{i:02d}", "principals": [
        f"arn:aws:iam::123456789012:role/researchers/researcher{i:02d}",
        f"arn:aws:iam::123456789012:user/researcher{i:02d}"]} for i in range(30)]


def test_the_users_policy_stays_within_iams_size_for_a_managed_policy(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Each person adds a statement: a team too large for one managed policy is refused before anything is declared,
    naming the key (`gpucluster plan`: exit 2, as for any bad input); the shipped stack fits."""
    refusal = (r"gpucluster:cluster\.users: the team's users' access policy would be \d+ characters, over IAM's 6144 "
               r"for a managed policy")
    with pytest.raises(pulumi.RunError, match=f"^{refusal}"):
        _people_plan(edit=_crowd)
    document = yaml.safe_load(TEAM_A.read_text())
    _crowd(document["config"]["gpucluster:cluster"])
    crowded = tmp_path / "Pulumi.crowd.yaml"
    crowded.write_text(yaml.safe_dump(document))
    assert cli.main(["plan", str(crowded)]) == cli.EXIT_BAD_INPUT
    assert re.fullmatch("gpucluster: " + refusal + r".*\n", capsys.readouterr().err)
    stack, declared, _ = _people_plan()
    (policy,) = [d for d in of_type(declared, "iam/policy:Policy") if d.name.endswith("-user-access")]
    assert sum(not c.isspace() for c in policy.inputs["policy"]) < 6144
    # The check measured the policy declared: the same document, with stand-ins of the same length for the account's
    # and the head's ids, which did not exist yet.
    (head,) = of_type(declared, "ec2/instance:Instance")
    people, instance_id = stack.spec.users or [], planned_id(head, stack.region)
    assert team_access.users_policy(stack.cluster_name, people, team_access.PolicyArns(
        stack.region, ACCOUNT, instance_id)) == policy.inputs["policy"]
    measured = team_access.users_policy(stack.cluster_name, people, team_access.PolicyArns(
        stack.region, team_access.PLACEHOLDER_ACCOUNT, team_access.PLACEHOLDER_INSTANCE))
    assert team_access.policy_characters(measured) == sum(not c.isspace() for c in policy.inputs["policy"])



def test_the_team_size_the_security_page_states_is_the_largest_that_fits() -> None:
    """docs/explanation/security.md says how many people of one shape team-a's users' policy holds (each brings a
    shell statement and an SSH key push): that many fit the size check, one more does not."""
    page = (ROOT / "docs" / "explanation" / "security.md").read_text()
    stated = re.search(r"team-a's stack would fit (\d+) people with five-character names and one role each under a "
                       r"path like alice's \(`role/researchers/<name>`\)", " ".join(page.split()))
    assert stated, "security.md no longer states the team size the users' policy holds"
    stack = validate("team-a", yaml.safe_load(TEAM_A.read_text())["config"])

    def problem(size: int) -> str | None:
        people = [UserSpec(name=f"usr{i:02d}", principals=[ALICE.replace("alice", f"usr{i:02d}")])
                  for i in range(size)]
        return team_access.users_policy_problem(team_access.TeamAccessArgs(
            stack.cluster_name, stack.region, ACCOUNT, "i-unused", "", "", "", people))

    largest = int(stated[1])
    assert problem(largest) is None
    assert problem(largest + 1) is not None


KEY_TABLE = [
    (ALICE, "alice", True), (ALICE, "bob", False), (ALICE, "root", False), (ALICE, LOGIN_USER, False),
    (ALICE, "ssm-user", False), (BOB_ROLE, "bob", True), (BOB_USER, "bob", True), (BOB_USER, "alice", False),
    (STRANGER, "alice", False), (STRANGER, LOGIN_USER, False),
]


@pytest.mark.parametrize(("principal", "os_user", "allowed"), KEY_TABLE,
                         ids=[f"{p.rsplit(':', 1)[1]}->{u}" for p, u, _ in KEY_TABLE])
def test_who_may_push_an_ssh_key_as_whom(principal: str, os_user: str, allowed: bool) -> None:
    """EC2 Instance Connect's SendSSHPublicKey (`gpucluster ssh-proxy`): to the head only, as one's own person only."""
    stack, declared, _ = _people_plan()
    instance = _head_arn(stack, declared)
    policies = access_policies(declared, stack.cluster_name)
    context = {"aws:PrincipalArn": principal, "ec2:osuser": os_user}
    action = "ec2-instance-connect:SendSSHPublicKey"
    assert is_allowed(policies["user-access"], action, instance, context) is allowed
    other = instance.rsplit("/", 1)[0] + "/i-0123456789abcdef0"
    assert not is_allowed(policies["user-access"], action, other, context)
    assert not is_allowed(policies["admin-access"], action, instance, context)  # no key for ssm-user (sudo)


def test_ssh_goes_to_port_22_on_the_heads_loopback_only() -> None:
    """The SSH document fixes the port (no parameter a caller could point at slurmctld or Alertmanager) and names no
    host; it is a stream session (no LocalPortForwarding): ssh's ProxyCommand speaks through stdin and stdout."""
    stack, declared = planned(TEAM_B)
    (document,) = [d for d in of_type(declared, "ssm/document:Document")
                   if d.inputs["name"] == session_document_name(stack.cluster_name, "ssh")]
    content = json.loads(document.inputs["content"])
    assert content["sessionType"] == "Port" and content["properties"] == {"portNumber": "22"}
    assert "parameters" not in content and "{{" not in document.inputs["content"]


def test_status_document_runs_gpucluster_status_as_root_without_parameters() -> None:
    stack, declared = planned(ROOT / "stacks" / "Pulumi.team-a.yaml")
    (document,) = [d for d in of_type(declared, "ssm/document:Document")
                   if d.inputs["name"] == command_document_name(stack.cluster_name, STATUS_COMMAND)]
    content = json.loads(document.inputs["content"])
    assert "parameters" not in content and "{{" not in document.inputs["content"]
    (step,) = content["mainSteps"]
    assert step["inputs"]["runCommand"][-1] == "exec /usr/local/bin/gpucluster status --json"
    arn = f"arn:aws:ssm:{stack.region}:{ACCOUNT}:document/{document.inputs['name']}"
    for policy in access_policies(declared, stack.cluster_name).values():
        instance = _head_arn(stack, declared)
        assert is_allowed(policy, "ssm:SendCommand", arn, {}) and is_allowed(policy, "ssm:SendCommand", instance, {})
