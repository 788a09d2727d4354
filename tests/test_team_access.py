"""Who gets in (components/team_access.py), under the mock runtime: a Session Manager document per kind of shell on
the head node and one that forwards a local port to Grafana on the head's loopback; per shell document one policy that
allows StartSession on this stack's head node only, with that document or the dashboard's only, and Run Command of the
verify document on that head only (its script: tests/test_verify_remote.py)."""

from __future__ import annotations

import json
import re

import pytest

from conftest import ROOT, of_type, planned
from gpucluster.aws import verify_remote
from gpucluster.contract import verify as v
from gpucluster.contract.settings import GRAFANA_PORT, LOGIN_USER, command_document_name, session_document_name
from gpucluster.plan import planned_id

ACCOUNT = "123456789012"


def test_sessions_on_the_head_node_as_the_login_user_or_as_admin() -> None:
    stack, declared = planned(ROOT / "stacks" / "Pulumi.team-a.yaml")
    region, cluster = stack.region, stack.cluster_name
    (head,) = of_type(declared, "ec2/instance:Instance")
    documents = {d.inputs["name"]: json.loads(d.inputs["content"]) for d in of_type(declared, "ssm/document:Document")
                 if d.inputs["documentType"] == "Session"}
    assert set(documents) == {session_document_name(cluster, k) for k in ("user", "admin", "dashboard")}
    assert session_document_name(cluster, "user") == f"{cluster}-user-session"
    user, admin = documents[f"{cluster}-user-session"], documents[f"{cluster}-admin-session"]
    assert user["sessionType"] == admin["sessionType"] == "Standard_Stream"
    # Users: the login user, whom the lockdown leaves without sudo. Admins: Session Manager's ssm-user (sudo).
    assert user["inputs"]["runAsEnabled"] is True and user["inputs"]["runAsDefaultUser"] == LOGIN_USER
    assert user["inputs"]["maxSessionDuration"] == admin["inputs"]["maxSessionDuration"] == "720"
    assert admin["inputs"]["runAsEnabled"] is False and "runAsDefaultUser" not in admin["inputs"]
    assert all(d.inputs["documentFormat"] == "JSON" for d in of_type(declared, "ssm/document:Document"))

    policies = {d.name.removeprefix(f"{cluster}-"): json.loads(d.inputs["policy"])
                for d in of_type(declared, "iam/policy:Policy") if d.name.endswith("-access")}
    assert set(policies) == {"user-access", "admin-access"}
    instance = f"arn:aws:ec2:{region}:{ACCOUNT}:instance/{planned_id(head, region)}"
    for kind, policy in policies.items():
        start, own, channel, find, send, outcome = policy["Statement"]
        document = f"arn:aws:ssm:{region}:{ACCOUNT}:document/{cluster}-{kind.split('-')[0]}-session"
        dashboard = f"arn:aws:ssm:{region}:{ACCOUNT}:document/{cluster}-dashboard-session"
        assert start["Action"] == "ssm:StartSession" and start["Resource"] == [instance, document, dashboard], start
        # Without the check, a caller could name AWS's default document and start as ssm-user, who has sudo.
        assert start["Condition"]["BoolIfExists"] == {"ssm:SessionDocumentAccessCheck": "true"}
        # A caller's SSMSessionRunAs tag would override the login user with any user of the node (slurm, ssm-user):
        # the users' policy admits only callers without one; the admins' shell is ssm-user's anyway.
        assert start["Condition"].get("Null") == ({"aws:PrincipalTag/SSMSessionRunAs": "true"}
                                                  if kind == "user-access" else None)
        sessions = f"arn:aws:ssm:{region}:{ACCOUNT}:session/${{aws:userid}}-*"
        assert own["Action"] == ["ssm:TerminateSession", "ssm:ResumeSession"] and own["Resource"] == sessions
        assert channel["Action"] == "ssmmessages:OpenDataChannel" and channel["Resource"] == sessions
        # What `gpucluster dashboard` calls (tests/test_dashboard_command.py).
        assert find["Action"] == "ec2:DescribeInstances"
        # `gpucluster verify STACK`: the verify document on the head only, never AWS-RunShellScript (root); --deep's
        # (an hour of the nodes under Slurm's root account, outside the team's limits) for admins only.
        verify = [f"arn:aws:ssm:{region}:{ACCOUNT}:document/{cluster}-{kind}-command"
                  for kind in (["verify"] if kind == "user-access" else ["verify", "verify-deep"])]
        assert send == {"Sid": "VerifyOnTheHeadNode", "Effect": "Allow", "Action": "ssm:SendCommand",
                        "Resource": [instance, *verify]}
        assert outcome["Action"] == ["ssm:GetCommandInvocation", "ssm:ListCommandInvocations"]
        assert not {"ssm:SendCommand", "ssm:StartSession"} & set(json.dumps(outcome).split('"'))
    # Nothing else in the stack grants StartSession or SendCommand.
    for action in ("ssm:StartSession", "ssm:SendCommand"):
        grants = [d.name for d in declared if "policy" in d.inputs and action in d.inputs["policy"]]
        assert sorted(grants) == sorted(f"{cluster}-{k}" for k in policies), action


def test_dashboard_document_forwards_to_grafana_on_the_heads_loopback_only() -> None:
    """The caller chooses the local port and nothing else: no remote port parameter, no host (the agent then connects
    to localhost), so the document cannot reach another port of the head or anything the head reaches."""
    stack, declared = planned(ROOT / "stacks" / "Pulumi.team-b.yaml")
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


@pytest.mark.parametrize("kind", ["verify", "verify-deep"])
def test_verify_document_runs_gpucluster_verify_as_root_with_checked_parameters_only(kind: str) -> None:
    """The Run Command documents run the head's `gpucluster verify --json` (their script: tests/test_verify_remote.py);
    each parameter is a value checked by SendCommand (a pattern or a list) and reaches the script as an environment
    variable, never as text spliced into it: no `{{ }}` anywhere in the script. Only the admins' one takes `deep`."""
    stack, declared = planned(ROOT / "stacks" / "Pulumi.team-a.yaml")
    documents = {d.inputs["name"]: d for d in of_type(declared, "ssm/document:Document")
                 if d.inputs["documentType"] == "Command"}
    assert set(documents) == {command_document_name(stack.cluster_name, k) for k in ("verify", "verify-deep")}
    document = documents[f"{stack.cluster_name}-{kind}-command"]
    content = json.loads(document.inputs["content"])
    assert content["schemaVersion"] == "2.2"
    (step,) = content["mainSteps"]
    assert step["action"] == "aws:runShellScript" and step["inputs"]["runCommand"] == verify_remote.SCRIPT
    assert "{{" not in json.dumps(step)
    # As long as the head's run can take (its own limits summed, nodes booting up to the stack's ResumeTimeout), and
    # no longer: --deep's DCGM level 3 holds the nodes an hour, level 1 minutes.
    deep = kind == "verify-deep"
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
