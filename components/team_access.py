"""Who gets into the cluster, and as whom: Session Manager documents that start a shell on the head node as the
images' login user (no sudo) or, for admins, as Session Manager's own `ssm-user` (sudo), one that forwards a local
port to Grafana on the head's loopback (no public endpoint, no inbound rule), and the two IAM policies (stack outputs)
that the team's account admins attach to the team's users or roles. Each allows StartSession on this cluster's head
node only, and only with its shell document or the dashboard's: without `ssm:SessionDocumentAccessCheck`, a caller
could name AWS's default document and get `ssm-user`, who has sudo, or AWS-StartPortForwardingSession and reach any
port of the head. Both allow a Run Command document, on the head only: `gpucluster verify` as root with checked
options (gpucluster/aws/verify_remote.py), never AWS-RunShellScript, which would be any command as root; the admins'
policy also allows its twin with --deep (an hour of the nodes under Slurm's root account, outside the team's limits).
With people (`users:`), the login user's document gives way to one document per person (a shell as that person), and
the users' policy allows each person's document only to that person's IAM principals. Both policies run the status
document (`gpucluster status`, read only, no parameters). SSH (`gpucluster ssh-config`) streams to sshd on the head's
loopback through a document fixed to port 22; the users' policy lets each principal push an EC2 Instance Connect key
for its own person's account only (the login user's without people).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from components import child
from gpucluster.contract.settings import (
    ADMIN_SESSION,
    DASHBOARD_SESSION,
    DEEP_VERIFY_COMMAND,
    GRAFANA_PORT,
    LOGIN_USER,
    SSH_SESSION,
    STATUS_COMMAND,
    USER_SESSION,
    VERIFY_COMMAND,
    command_document_name,
    person_session_document_name,
    session_document_name,
)
from gpucluster.spec.model import CONFIG_KEY, UserSpec, ssh_logins

SSH_PORT = 22  # sshd on the head, reached through Session Manager only: no security group opens it
IDLE_SESSION_MINUTES = 60
MAX_SESSION_MINUTES = 720  # a forgotten shell ends after a working day
# A TCP port number, 1-65535: AWS-StartPortForwardingSession's pattern without its 0 ("any free port"), so that the
# port a user asked for is the one `gpucluster dashboard` prints.
LOCAL_PORT_PATTERN = r"^([1-9][0-9]{0,3}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-5])$"
# A managed policy's size limit, in characters not counting white space (IAM User Guide, "IAM and AWS STS quotas":
# managed policy size 6,144 characters). Each person adds a statement to the users' policy.
MANAGED_POLICY_MAX_CHARACTERS = 6144
# The session's tag that holds the user id of the principal who started it (Session Manager user guide, "Additional
# sample IAM policies", Example 4 "Allow a user to end only sessions they started", method 2; the Service
# Authorization Reference lists the key for ssm:TerminateSession and ssm:ResumeSession). A session's id starts with
# the IAM user's or the role session's name, never with aws:userid, so a resource of session/${aws:userid}-* alone
# matches no session of a role.
SESSION_OWNER_TAG = "ssm:resourceTag/aws:ssmmessages:session-id"


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


def ssh_document(description: str) -> str:
    """A Session Manager stream to sshd on the head's loopback, for ssh's ProxyCommand (gpucluster/aws/connect.py):
    AWS-StartSSHSession's shape with the port a constant of `properties`, not a parameter, so the document reaches
    port 22 of the head and nothing else. Without `"type": "LocalPortForwarding"` the plugin pipes the session to
    its stdin and stdout (session-manager-plugin portsession.go: StandardStreamForwarding)."""
    return json.dumps({"schemaVersion": "1.0", "description": description, "sessionType": "Port",
                       "properties": {"portNumber": str(SSH_PORT)}})


def access_policy(instance_arn: str, document_arns: list[str], sessions: str, command_arns: list[str],
                  run_as_tag_free: bool, people: Sequence[tuple[str, Sequence[str]]] = (),
                  key_pushes: Sequence[tuple[str, Sequence[str]]] = ()) -> str:
    """StartSession on the head node with the given documents only; end and resume one's own sessions, stream
    one's own; the given Run Command documents (verify, status) on the head node, and their commands' outcome.
    `run_as_tag_free`: only for callers without an `SSMSessionRunAs` tag, which would override the document's user
    with any user of the node (slurm, which reaches instance metadata on the head; ssm-user, which has sudo).
    `sessions`: the ARN of the region's sessions of the account, up to `session/`.
    `people`: (document ARN, IAM principals) per person: StartSession with that document, which runs the shell as
    the person, only when the caller is one of the person's principals. aws:PrincipalArn is an IAM user's ARN, and for
    a role's sessions the role's ARN with its path, never the session's (IAM User Guide, AWS global condition context
    keys: aws:PrincipalArn), so a role lists as itself and the session name its caller chose plays no part.
    `key_pushes`: (OS user, IAM principals; none: any caller with the policy) per account one may log in to over SSH:
    EC2 Instance Connect's SendSSHPublicKey to the head node for that OS user only (condition key ec2:osuser)."""
    condition: dict[str, dict[str, str]] = {"BoolIfExists": {"ssm:SessionDocumentAccessCheck": "true"}}
    if run_as_tag_free:
        condition["Null"] = {"aws:PrincipalTag/SSMSessionRunAs": "true"}
    return json.dumps({"Version": "2012-10-17", "Statement": [
        {"Sid": "HeadNodeWithThisDocumentOnly", "Effect": "Allow", "Action": "ssm:StartSession",
         "Resource": [instance_arn, *document_arns], "Condition": condition},
        # A person's shell, to their principals only. IAM authorizes StartSession on each resource of the request,
        # the instance and the document: the instance only through the statement above, with its conditions; so
        # these statements name the document alone and stay small (each person adds one to a size-limited policy).
        *({"Effect": "Allow", "Action": "ssm:StartSession", "Resource": document,
           "Condition": {"ArnEquals": {"aws:PrincipalArn": list(principals)}}} for document, principals in people),
        {"Sid": "OwnSessionsOnly", "Effect": "Allow", "Action": ["ssm:TerminateSession", "ssm:ResumeSession"],
         "Resource": f"{sessions}*", "Condition": {"StringEquals": {SESSION_OWNER_TAG: "${aws:userid}"}}},
        # The caller's end of the session's data channel (the AWS CLI's session plugin). Opening it takes the token
        # that StartSession or ResumeSession returned, both bounded above; a session's id starts with the IAM user's
        # or the role session's name, never with aws:userid (SESSION_OWNER_TAG's note), so AWS's quickstart pattern
        # session/${aws:userid}-* would match no role's session: the account's sessions in this region.
        {"Sid": "OwnSessionChannel", "Effect": "Allow", "Action": "ssmmessages:OpenDataChannel",
         "Resource": f"{sessions}*"},
        # `gpucluster dashboard` finds the running head by its tags. DescribeInstances has no resource-level
        # permissions: it names instances, not their data.
        {"Sid": "FindTheHeadNode", "Effect": "Allow", "Action": "ec2:DescribeInstances", "Resource": "*"},
        # `gpucluster verify STACK` and `gpucluster status STACK`: these documents, on this head only (SendCommand
        # needs both resources).
        {"Sid": "CommandsOnTheHeadNode", "Effect": "Allow", "Action": "ssm:SendCommand",
         "Resource": [instance_arn, *command_arns]},
        # Its outcome; neither action has resource-level permissions. They read commands' output, start nothing.
        {"Sid": "VerifyOutcome", "Effect": "Allow",
         "Action": ["ssm:GetCommandInvocation", "ssm:ListCommandInvocations"], "Resource": "*"},
        # `gpucluster ssh-proxy`: a public key that sshd on the head accepts for 60 s, for one's own account only.
        *({"Effect": "Allow", "Action": "ec2-instance-connect:SendSSHPublicKey", "Resource": instance_arn,
           "Condition": {"StringEquals": {"ec2:osuser": os_user},
                         **({"ArnEquals": {"aws:PrincipalArn": list(principals)}} if principals else {})}}
          for os_user, principals in key_pushes),
    ]})


def policy_characters(document: str) -> int:
    """A policy's size as IAM counts it against its quotas: white space is not counted."""
    return sum(not c.isspace() for c in document)


@dataclass(frozen=True)
class PolicyArns:
    """The ARNs the access policies name: the head node, the region's sessions of the account, and the cluster's
    documents by the names the component gives them. Account and instance ids are AWS's to assign; the size check
    (users_policy_problem) renders the same policy with stand-ins of their lengths."""
    region: str
    account_id: str
    instance_id: str

    @property
    def instance(self) -> str:
        return f"arn:aws:ec2:{self.region}:{self.account_id}:instance/{self.instance_id}"

    @property
    def sessions(self) -> str:
        return f"arn:aws:ssm:{self.region}:{self.account_id}:session/"

    def document(self, name: str) -> str:
        return f"arn:aws:ssm:{self.region}:{self.account_id}:document/{name}"


def users_policy(cluster: str, people: Sequence[UserSpec], arns: PolicyArns) -> str:
    """The users' policy: the login user's shell, or with people each person's (to their principals only); the
    dashboard, SSH, verify and status."""
    personal = [(arns.document(person_session_document_name(cluster, p.name)), p.principals) for p in people]
    shells = [] if personal else [arns.document(session_document_name(cluster, USER_SESSION))]
    return access_policy(
        arns.instance, [*shells, *(arns.document(session_document_name(cluster, kind))
                                   for kind in (DASHBOARD_SESSION, SSH_SESSION))],
        arns.sessions, [arns.document(command_document_name(cluster, kind))
                        for kind in (VERIFY_COMMAND, STATUS_COMMAND)],
        run_as_tag_free=True, people=personal, key_pushes=ssh_logins(people))


def admins_policy(cluster: str, arns: PolicyArns) -> str:
    """The admins' policy: their shell (ssm-user, sudo), which a `SSMSessionRunAs` tag may not override here; the
    dashboard, verify with and without --deep, and status."""
    return access_policy(
        arns.instance, [arns.document(session_document_name(cluster, kind))
                        for kind in (ADMIN_SESSION, DASHBOARD_SESSION)],
        arns.sessions, [arns.document(command_document_name(cluster, kind))
                        for kind in (VERIFY_COMMAND, DEEP_VERIFY_COMMAND, STATUS_COMMAND)],
        run_as_tag_free=False)


@dataclass(frozen=True)
class TeamAccessArgs:
    cluster_name: str
    region: str
    account_id: pulumi.Input[str]  # components.iam.account_id
    head_instance_id: pulumi.Input[str]
    verify_document: str  # gpucluster.aws.verify_remote.command_document(stack, deep=False)
    verify_deep_document: str  # gpucluster.aws.verify_remote.command_document(stack, deep=True): admins only
    status_document: str  # gpucluster.aws.status_remote.command_document(stack): everyone's, read only
    people: Sequence[UserSpec] = ()  # the stack's `users:`; none: everyone connects as the login user


# What the size check renders the users' policy with before the real ARNs exist: an account id and an instance id of
# the lengths AWS's have (12 digits; i- and 17 hex digits).
PLACEHOLDER_ACCOUNT = "0" * 12
PLACEHOLDER_INSTANCE = "i-" + "0" * 17


class TeamAccess(pulumi.ComponentResource):
    user_document: pulumi.Output[str] | None  # None with people: each has a document of their own
    person_documents: dict[str, pulumi.Output[str]]  # person -> their document's name
    admin_document: pulumi.Output[str]
    dashboard_document: pulumi.Output[str]
    verify_document: pulumi.Output[str]
    verify_deep_document: pulumi.Output[str]
    status_document: pulumi.Output[str]
    ssh_document: pulumi.Output[str]
    user_policy_arn: pulumi.Output[str]
    admin_policy_arn: pulumi.Output[str]

    def __init__(self, name: str, args: TeamAccessArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpucluster:access:TeamAccess", name, None, opts)
        cluster = args.cluster_name
        too_big = users_policy_problem(args)
        if too_big:
            raise pulumi.RunError(too_big)

        def shell(key: str, document_name: str, description: str, run_as: str | None) -> aws.ssm.Document:
            return aws.ssm.Document(
                f"{name}-{key}-session", name=document_name, document_type="Session", document_format="JSON",
                content=session_document(f"gpucluster {cluster}: {description}", run_as), opts=child(self))

        users = None if args.people else shell(
            "user", session_document_name(cluster, USER_SESSION),
            f"a shell on the head node as {LOGIN_USER} (no sudo)", LOGIN_USER)
        # Each person's shell runs as their own account, which the nodes make (admins: with sudo).
        people = {person.name: shell(f"user-{person.name}", person_session_document_name(cluster, person.name),
                                     f"a shell on the head node as {person.name}", person.name)
                  for person in args.people}
        admins = shell("admin", session_document_name(cluster, ADMIN_SESSION),
                       "an admin shell on the head node (ssm-user, sudo)", None)
        # Users and admins alike may open the dashboards: Grafana's own login decides what each may change there.
        dashboard = aws.ssm.Document(
            f"{name}-dashboard-session", name=session_document_name(cluster, DASHBOARD_SESSION),
            document_type="Session", document_format="JSON", content=dashboard_document(
                f"gpucluster {cluster}: Grafana on the head node, forwarded to a port of your machine"),
            opts=child(self))
        ssh = aws.ssm.Document(
            f"{name}-ssh-session", name=session_document_name(cluster, SSH_SESSION), document_type="Session",
            document_format="JSON", content=ssh_document(
                f"gpucluster {cluster}: sshd on the head node's loopback, for ssh's ProxyCommand"), opts=child(self))
        status = aws.ssm.Document(
            f"{name}-status-command", name=command_document_name(cluster, STATUS_COMMAND),
            document_type="Command", document_format="JSON", content=args.status_document, opts=child(self))
        verify = aws.ssm.Document(
            f"{name}-verify-command", name=command_document_name(cluster, VERIFY_COMMAND),
            document_type="Command", document_format="JSON", content=args.verify_document, opts=child(self))
        verify_deep = aws.ssm.Document(
            f"{name}-verify-deep-command", name=command_document_name(cluster, DEEP_VERIFY_COMMAND),
            document_type="Command", document_format="JSON", content=args.verify_deep_document, opts=child(self))

        ids = pulumi.Output.all(account_id=args.account_id, instance_id=args.head_instance_id)
        # The policies name the documents by the names given above (PolicyArns) and come after them: no grant of a
        # document that does not exist yet.
        # The descriptions stay as they were, also with people (whose shells are their own, not the login user's): a
        # changed one replaces the policy, and the old one, attached to the team's users, could not be deleted.
        user_policy = aws.iam.Policy(
            f"{name}-user-access", description=f"gpucluster {cluster}: shell on the head node as {LOGIN_USER}",
            policy=ids.apply(lambda known: users_policy(cluster, args.people, PolicyArns(args.region, **known))),
            opts=child(self, depends_on=[*([users] if users else []), *people.values(), dashboard, ssh, verify,
                                         status]))
        admin_policy = aws.iam.Policy(
            f"{name}-admin-access", description=f"gpucluster {cluster}: admin shell (sudo) on the head "
            "node", policy=ids.apply(lambda known: admins_policy(cluster, PolicyArns(args.region, **known))),
            opts=child(self, depends_on=[admins, dashboard, verify, verify_deep, status]))
        self.user_document = users.name if users else None
        self.person_documents = {person: document.name for person, document in people.items()}
        self.admin_document, self.dashboard_document = admins.name, dashboard.name
        self.verify_document, self.verify_deep_document = verify.name, verify_deep.name
        self.status_document, self.ssh_document = status.name, ssh.name
        self.user_policy_arn, self.admin_policy_arn = user_policy.arn, admin_policy.arn
        self.register_outputs({"user_document": self.user_document, "person_documents": self.person_documents,
                               "admin_document": self.admin_document,
                               "dashboard_document": self.dashboard_document,
                               "verify_document": self.verify_document,
                               "verify_deep_document": self.verify_deep_document,
                               "status_document": self.status_document, "ssh_document": self.ssh_document,
                               "user_policy_arn": self.user_policy_arn, "admin_policy_arn": self.admin_policy_arn})


def users_policy_problem(args: TeamAccessArgs) -> str | None:
    """Why the users' policy would be over IAM's size limit for a managed policy, or None. Checked before anything is
    declared, on the policy rendered with ARNs of AWS's lengths, so that `plan` and the preview say so, not IAM
    half-way through an `up`."""
    size = policy_characters(users_policy(args.cluster_name, args.people,
                                          PolicyArns(args.region, PLACEHOLDER_ACCOUNT, PLACEHOLDER_INSTANCE)))
    if size <= MANAGED_POLICY_MAX_CHARACTERS:
        return None
    return (f"{CONFIG_KEY}.users: the team's users' access policy would be {size} characters, over IAM's "
            f"{MANAGED_POLICY_MAX_CHARACTERS} for a managed policy (each person adds a statement with their "
            "principals): list fewer principals per person, or split the team into stacks")
