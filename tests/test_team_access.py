"""Who gets in (components/team_access.py), under the mock runtime: a Session Manager document per kind of shell on
the head node, and per document one policy that allows StartSession on this stack's head node only, with that
document only."""

from __future__ import annotations

import json

from conftest import ROOT, of_type, planned
from gpucluster.plan import planned_id
from gpucluster.settings import LOGIN_USER

ACCOUNT = "123456789012"


def test_sessions_on_the_head_node_as_the_login_user_or_as_admin() -> None:
    stack, declared = planned(ROOT / "stacks" / "Pulumi.team-a.yaml")
    region, cluster = stack.region, stack.cluster_name
    (head,) = of_type(declared, "ec2/instance:Instance")
    documents = {d.inputs["name"]: json.loads(d.inputs["content"]) for d in of_type(declared, "ssm/document:Document")}
    assert set(documents) == {f"{cluster}-user-session", f"{cluster}-admin-session"}
    user, admin = documents[f"{cluster}-user-session"], documents[f"{cluster}-admin-session"]
    assert user["sessionType"] == admin["sessionType"] == "Standard_Stream"
    # Users: the login user, whom the lockdown leaves without sudo. Admins: Session Manager's ssm-user (sudo).
    assert user["inputs"]["runAsEnabled"] is True and user["inputs"]["runAsDefaultUser"] == LOGIN_USER
    assert user["inputs"]["maxSessionDuration"] == admin["inputs"]["maxSessionDuration"] == "720"
    assert admin["inputs"]["runAsEnabled"] is False and "runAsDefaultUser" not in admin["inputs"]
    assert all(d.inputs["documentType"] == "Session" and d.inputs["documentFormat"] == "JSON"
               for d in of_type(declared, "ssm/document:Document"))

    policies = {d.name.removeprefix(f"{cluster}-"): json.loads(d.inputs["policy"])
                for d in of_type(declared, "iam/policy:Policy") if d.name.endswith("-access")}
    assert set(policies) == {"user-access", "admin-access"}
    instance = f"arn:aws:ec2:{region}:{ACCOUNT}:instance/{planned_id(head, region)}"
    for kind, policy in policies.items():
        start, own, channel = policy["Statement"]
        document = f"arn:aws:ssm:{region}:{ACCOUNT}:document/{cluster}-{kind.split('-')[0]}-session"
        assert start["Action"] == "ssm:StartSession" and start["Resource"] == [instance, document], start
        # Without the check, a caller could name AWS's default document and start as ssm-user, who has sudo.
        assert start["Condition"]["BoolIfExists"] == {"ssm:SessionDocumentAccessCheck": "true"}
        # A caller's SSMSessionRunAs tag would override the login user with any user of the node (slurm, ssm-user):
        # the users' policy admits only callers without one; the admins' shell is ssm-user's anyway.
        assert start["Condition"].get("Null") == ({"aws:PrincipalTag/SSMSessionRunAs": "true"}
                                                  if kind == "user-access" else None)
        sessions = f"arn:aws:ssm:{region}:{ACCOUNT}:session/${{aws:userid}}-*"
        assert own["Action"] == ["ssm:TerminateSession", "ssm:ResumeSession"] and own["Resource"] == sessions
        assert channel["Action"] == "ssmmessages:OpenDataChannel" and channel["Resource"] == sessions
    # Nothing else in the stack grants StartSession.
    grants = [d.name for d in declared for key in ("policy",) if key in d.inputs and "ssm:StartSession" in d.inputs[key]]
    assert sorted(grants) == sorted(f"{cluster}-{k}" for k in policies)
