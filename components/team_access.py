"""Who gets into the cluster, and as whom: Session Manager documents that start a shell on the head node as the
images' login user (no sudo) or, for admins, as Session Manager's own `ssm-user` (sudo), and the two IAM policies
(stack outputs) that the team's account admins attach to the team's users or roles. Each allows StartSession on
this cluster's head node only, and only with its document: without `ssm:SessionDocumentAccessCheck`, a caller
could name AWS's default document and get `ssm-user`, who has sudo.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from components import child
from gpucluster.settings import LOGIN_USER

IDLE_SESSION_MINUTES = 60
MAX_SESSION_MINUTES = 720  # a forgotten shell ends after a working day


def session_document(description: str, run_as: str | None) -> str:
    """A Session Manager shell document; `run_as`: the OS user the session starts as (None: ssm-user)."""
    inputs: dict[str, object] = {"idleSessionTimeout": str(IDLE_SESSION_MINUTES),
                                 "maxSessionDuration": str(MAX_SESSION_MINUTES), "runAsEnabled": run_as is not None,
                                 "shellProfile": {"linux": "cd ~ && exec bash -l"}}
    if run_as:
        inputs["runAsDefaultUser"] = run_as
    return json.dumps({"schemaVersion": "1.0", "description": description, "sessionType": "Standard_Stream",
                       "inputs": inputs})


def access_policy(instance_arn: str, document_arn: str, sessions_arn: str, run_as_tag_free: bool) -> str:
    """StartSession on the head node with the given document only; end, resume and stream one's own sessions.
    `run_as_tag_free`: only for callers without an `SSMSessionRunAs` tag, which would override the document's user
    with any user of the node (slurm, which reaches instance metadata on the head; ssm-user, which has sudo)."""
    condition: dict[str, dict[str, str]] = {"BoolIfExists": {"ssm:SessionDocumentAccessCheck": "true"}}
    if run_as_tag_free:
        condition["Null"] = {"aws:PrincipalTag/SSMSessionRunAs": "true"}
    return json.dumps({"Version": "2012-10-17", "Statement": [
        {"Sid": "HeadNodeWithThisDocumentOnly", "Effect": "Allow", "Action": "ssm:StartSession",
         "Resource": [instance_arn, document_arn], "Condition": condition},
        {"Sid": "OwnSessionsOnly", "Effect": "Allow", "Action": ["ssm:TerminateSession", "ssm:ResumeSession"],
         "Resource": sessions_arn},
        # The caller's end of the session's data channel (the AWS CLI's session plugin).
        {"Sid": "OwnSessionChannel", "Effect": "Allow", "Action": "ssmmessages:OpenDataChannel",
         "Resource": sessions_arn},
    ]})


@dataclass(frozen=True)
class TeamAccessArgs:
    cluster_name: str
    region: str
    head_instance_id: pulumi.Input[str]


class TeamAccess(pulumi.ComponentResource):
    user_document: pulumi.Output[str]
    admin_document: pulumi.Output[str]
    user_policy_arn: pulumi.Output[str]
    admin_policy_arn: pulumi.Output[str]

    def __init__(self, name: str, args: TeamAccessArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpucluster:access:TeamAccess", name, None, opts)
        account = aws.get_caller_identity_output(opts=pulumi.InvokeOutputOptions(parent=self)).account_id
        instance_arn = pulumi.Output.concat(f"arn:aws:ec2:{args.region}:", account, ":instance/",
                                            args.head_instance_id)
        # ${aws:userid}: each caller's own sessions (Session Manager names a session after its caller's user id).
        sessions_arn = pulumi.Output.concat(f"arn:aws:ssm:{args.region}:", account, ":session/${aws:userid}-*")
        users = aws.ssm.Document(
            f"{name}-user-session", name=f"{args.cluster_name}-user-session", document_type="Session",
            document_format="JSON", content=session_document(
                f"gpucluster {args.cluster_name}: a shell on the head node as {LOGIN_USER} (no sudo)", LOGIN_USER),
            opts=child(self))
        admins = aws.ssm.Document(
            f"{name}-admin-session", name=f"{args.cluster_name}-admin-session", document_type="Session",
            document_format="JSON", content=session_document(
                f"gpucluster {args.cluster_name}: an admin shell on the head node (ssm-user, sudo)", None),
            opts=child(self))

        def document_arn(document: aws.ssm.Document) -> pulumi.Output[str]:
            return pulumi.Output.concat(f"arn:aws:ssm:{args.region}:", account, ":document/", document.name)

        user_policy = aws.iam.Policy(
            f"{name}-user-access", description=f"gpucluster {args.cluster_name}: shell on the head node as "
            f"{LOGIN_USER}", policy=pulumi.Output.all(instance_arn, document_arn(users), sessions_arn).apply(
                lambda v: access_policy(*v, run_as_tag_free=True)), opts=child(self))
        admin_policy = aws.iam.Policy(
            f"{name}-admin-access", description=f"gpucluster {args.cluster_name}: admin shell (sudo) on the head "
            "node", policy=pulumi.Output.all(instance_arn, document_arn(admins), sessions_arn).apply(
                lambda v: access_policy(*v, run_as_tag_free=False)), opts=child(self))
        self.user_document, self.admin_document = users.name, admins.name
        self.user_policy_arn, self.admin_policy_arn = user_policy.arn, admin_policy.arn
        self.register_outputs({"user_document": self.user_document, "admin_document": self.admin_document,
                               "user_policy_arn": self.user_policy_arn, "admin_policy_arn": self.admin_policy_arn})
