"""Who gets into the cluster, and as whom: Session Manager documents that start a shell on the head node as the
images' login user (no sudo) or, for admins, as Session Manager's own `ssm-user` (sudo), one that forwards a local
port to Grafana on the head's loopback (no public endpoint, no inbound rule), and the two IAM policies (stack outputs)
that the team's account admins attach to the team's users or roles. Each allows StartSession on this cluster's head
node only, and only with its shell document or the dashboard's: without `ssm:SessionDocumentAccessCheck`, a caller
could name AWS's default document and get `ssm-user`, who has sudo, or AWS-StartPortForwardingSession and reach any
port of the head. Both allow a Run Command document, on the head only: `gpucluster verify` as root with checked
options (gpucluster/aws/verify_remote.py), never AWS-RunShellScript, which would be any command as root; the admins'
policy also allows its twin with --deep (an hour of the nodes under Slurm's root account, outside the team's limits).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from components import child
from gpucluster.contract.settings import GRAFANA_PORT, LOGIN_USER, command_document_name, session_document_name

IDLE_SESSION_MINUTES = 60
MAX_SESSION_MINUTES = 720  # a forgotten shell ends after a working day
# A TCP port number, 1-65535: AWS-StartPortForwardingSession's pattern without its 0 ("any free port"), so that the
# port a user asked for is the one `gpucluster dashboard` prints.
LOCAL_PORT_PATTERN = r"^([1-9][0-9]{0,3}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-5])$"


def session_document(description: str, run_as: str | None) -> str:
    """A Session Manager shell document; `run_as`: the OS user the session starts as (None: ssm-user)."""
    inputs: dict[str, object] = {"idleSessionTimeout": str(IDLE_SESSION_MINUTES),
                                 "maxSessionDuration": str(MAX_SESSION_MINUTES), "runAsEnabled": run_as is not None,
                                 "shellProfile": {"linux": "cd ~ && exec bash -l"}}
    if run_as:
        inputs["runAsDefaultUser"] = run_as
    return json.dumps({"schemaVersion": "1.0", "description": description, "sessionType": "Standard_Stream",
                       "inputs": inputs})


def dashboard_document(description: str) -> str:
    """A Session Manager port forward from the caller's machine to Grafana on the head's loopback. Shaped as AWS's
    AWS-StartPortForwardingSession (Session document schema 1.0, sessionType Port), except that the remote port is a
    constant of `properties`, not a parameter, and there is no `host`: the agent connects to localhost, and the caller
    may choose the local port only (StartSession refuses a parameter the document does not declare)."""
    return json.dumps({
        "schemaVersion": "1.0", "description": description, "sessionType": "Port",
        "parameters": {"localPortNumber": {
            "type": "String", "description": "The port on your machine that forwards to Grafana",
            "allowedPattern": LOCAL_PORT_PATTERN, "default": str(GRAFANA_PORT)}},
        "properties": {"type": "LocalPortForwarding", "portNumber": str(GRAFANA_PORT),
                       "localPortNumber": "{{ localPortNumber }}"},
    })


def access_policy(instance_arn: str, document_arns: list[str], sessions_arn: str, verify_arns: list[str],
                  run_as_tag_free: bool) -> str:
    """StartSession on the head node with the given documents only; end, resume and stream one's own sessions; the
    given verify documents on the head node, and their commands' outcome.
    `run_as_tag_free`: only for callers without an `SSMSessionRunAs` tag, which would override the document's user
    with any user of the node (slurm, which reaches instance metadata on the head; ssm-user, which has sudo)."""
    condition: dict[str, dict[str, str]] = {"BoolIfExists": {"ssm:SessionDocumentAccessCheck": "true"}}
    if run_as_tag_free:
        condition["Null"] = {"aws:PrincipalTag/SSMSessionRunAs": "true"}
    return json.dumps({"Version": "2012-10-17", "Statement": [
        {"Sid": "HeadNodeWithThisDocumentOnly", "Effect": "Allow", "Action": "ssm:StartSession",
         "Resource": [instance_arn, *document_arns], "Condition": condition},
        {"Sid": "OwnSessionsOnly", "Effect": "Allow", "Action": ["ssm:TerminateSession", "ssm:ResumeSession"],
         "Resource": sessions_arn},
        # The caller's end of the session's data channel (the AWS CLI's session plugin).
        {"Sid": "OwnSessionChannel", "Effect": "Allow", "Action": "ssmmessages:OpenDataChannel",
         "Resource": sessions_arn},
        # `gpucluster dashboard` finds the running head by its tags. DescribeInstances has no resource-level
        # permissions: it names instances, not their data.
        {"Sid": "FindTheHeadNode", "Effect": "Allow", "Action": "ec2:DescribeInstances", "Resource": "*"},
        # `gpucluster verify STACK`: these documents, on this head only (SendCommand needs both resources).
        {"Sid": "VerifyOnTheHeadNode", "Effect": "Allow", "Action": "ssm:SendCommand",
         "Resource": [instance_arn, *verify_arns]},
        # Its outcome; neither action has resource-level permissions. They read commands' output, start nothing.
        {"Sid": "VerifyOutcome", "Effect": "Allow",
         "Action": ["ssm:GetCommandInvocation", "ssm:ListCommandInvocations"], "Resource": "*"},
    ]})


@dataclass(frozen=True)
class TeamAccessArgs:
    cluster_name: str
    region: str
    account_id: pulumi.Input[str]  # components.iam.account_id
    head_instance_id: pulumi.Input[str]
    verify_document: str  # gpucluster.aws.verify_remote.command_document(stack, deep=False)
    verify_deep_document: str  # gpucluster.aws.verify_remote.command_document(stack, deep=True): admins only


class TeamAccess(pulumi.ComponentResource):
    user_document: pulumi.Output[str]
    admin_document: pulumi.Output[str]
    dashboard_document: pulumi.Output[str]
    verify_document: pulumi.Output[str]
    verify_deep_document: pulumi.Output[str]
    user_policy_arn: pulumi.Output[str]
    admin_policy_arn: pulumi.Output[str]

    def __init__(self, name: str, args: TeamAccessArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpucluster:access:TeamAccess", name, None, opts)
        instance_arn = pulumi.Output.concat(f"arn:aws:ec2:{args.region}:", args.account_id, ":instance/",
                                            args.head_instance_id)
        # ${aws:userid}: each caller's own sessions (Session Manager names a session after its caller's user id).
        sessions_arn = pulumi.Output.concat(f"arn:aws:ssm:{args.region}:", args.account_id, ":session/${aws:userid}-*")
        users = aws.ssm.Document(
            f"{name}-user-session", name=session_document_name(args.cluster_name, "user"), document_type="Session",
            document_format="JSON", content=session_document(
                f"gpucluster {args.cluster_name}: a shell on the head node as {LOGIN_USER} (no sudo)", LOGIN_USER),
            opts=child(self))
        admins = aws.ssm.Document(
            f"{name}-admin-session", name=session_document_name(args.cluster_name, "admin"), document_type="Session",
            document_format="JSON", content=session_document(
                f"gpucluster {args.cluster_name}: an admin shell on the head node (ssm-user, sudo)", None),
            opts=child(self))
        # Users and admins alike may open the dashboards: Grafana's own login decides what each may change there.
        dashboard = aws.ssm.Document(
            f"{name}-dashboard-session", name=session_document_name(args.cluster_name, "dashboard"),
            document_type="Session", document_format="JSON", content=dashboard_document(
                f"gpucluster {args.cluster_name}: Grafana on the head node, forwarded to a port of your machine"),
            opts=child(self))
        verify = aws.ssm.Document(
            f"{name}-verify-command", name=command_document_name(args.cluster_name, "verify"),
            document_type="Command", document_format="JSON", content=args.verify_document, opts=child(self))
        verify_deep = aws.ssm.Document(
            f"{name}-verify-deep-command", name=command_document_name(args.cluster_name, "verify-deep"),
            document_type="Command", document_format="JSON", content=args.verify_deep_document, opts=child(self))

        def document_arn(document: aws.ssm.Document) -> pulumi.Output[str]:
            return pulumi.Output.concat(f"arn:aws:ssm:{args.region}:", args.account_id, ":document/", document.name)

        # The descriptions stay as they were: a changed one replaces the policy, and the old one, attached to the
        # team's users, could not be deleted.
        user_policy = aws.iam.Policy(
            f"{name}-user-access", description=f"gpucluster {args.cluster_name}: shell on the head node as "
            f"{LOGIN_USER}", policy=pulumi.Output.all(
                instance_arn, document_arn(users), document_arn(dashboard), sessions_arn, document_arn(verify)).apply(
                lambda v: access_policy(v[0], [v[1], v[2]], v[3], [v[4]], run_as_tag_free=True)), opts=child(self))
        admin_policy = aws.iam.Policy(
            f"{name}-admin-access", description=f"gpucluster {args.cluster_name}: admin shell (sudo) on the head "
            "node", policy=pulumi.Output.all(
                instance_arn, document_arn(admins), document_arn(dashboard), sessions_arn, document_arn(verify),
                document_arn(verify_deep)).apply(
                lambda v: access_policy(v[0], [v[1], v[2]], v[3], [v[4], v[5]], run_as_tag_free=False)),
            opts=child(self))
        self.user_document, self.admin_document, self.dashboard_document = users.name, admins.name, dashboard.name
        self.verify_document, self.verify_deep_document = verify.name, verify_deep.name
        self.user_policy_arn, self.admin_policy_arn = user_policy.arn, admin_policy.arn
        self.register_outputs({"user_document": self.user_document, "admin_document": self.admin_document,
                               "dashboard_document": self.dashboard_document,
                               "verify_document": self.verify_document,
                               "verify_deep_document": self.verify_deep_document,
                               "user_policy_arn": self.user_policy_arn, "admin_policy_arn": self.admin_policy_arn})
