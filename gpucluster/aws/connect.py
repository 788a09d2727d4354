"""`gpucluster connect STACK`, `gpucluster ssh-config STACK` and the `ssh-proxy` they configure: a team member's way
onto the head node with their own AWS credentials, the head found by its tags (gpucluster.aws.head), no Pulumi CLI
or state.

Which shell: with people (`users:`), each person's Session document (`<cluster>-user-<name>-session`) runs the shell
as that person, and the users' access policy allows it to that person's principals only
(components/team_access.py). `--user NAME` names the person; without it the caller is found among the stack's
principals by STS GetCallerIdentity (an assumed role answers with its role session's ARN, which names the role: the
role is the principal). `--admin`: the admins' document (ssm-user, sudo). Without people: the login user's document.

The shell itself is the AWS CLI's `aws ssm start-session` with AWS's Session Manager plugin, exec'd in place of this
process so the terminal is theirs. The CLI calls StartSession and hands its answer to the plugin
(aws-cli awscli/customizations/sessionmanager.py: `session-manager-plugin <response> <region> StartSession <profile>
<parameters> <endpoint>`); that argument list is the CLI's private interface with the plugin, so this program runs
the CLI rather than speak it.

SSH (scp, rsync, editors' remote modes) goes through Session Manager as well, never an open port: the cluster's
`<cluster>-ssh-session` document forwards the session's stream to port 22 on the head's loopback (sessionType Port
without LocalPortForwarding: the plugin pipes stdin and stdout, session-manager-plugin
src/sessionmanagerplugin/session/portsession/portsession.go). The key is a local one that never lives on the head:
before each connection `ssh-proxy` pushes its public half with EC2 Instance Connect's SendSSHPublicKey, which the
head's sshd accepts for 60 seconds for that OS user only (EC2 User Guide, "Connect using EC2 Instance Connect"), and
the users' policy allows a push only as the caller's own person (condition ec2:osuser).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from gpucluster.aws.head import HeadNotFound, running_head
from gpucluster.cli_errors import credentials_problem
from gpucluster.contract.settings import (
    ADMIN_SESSION,
    LOGIN_USER,
    SSH_SESSION,
    USER_SESSION,
    person_session_document_name,
    session_document_name,
    start_session_command,
)
from gpucluster.spec.model import CONFIG_KEY, Stack, principal_key, ssh_logins

EXIT_FAILED, EXIT_BAD_INPUT = 1, 2
PLUGIN = "session-manager-plugin"  # the name the AWS CLI looks for on PATH
PLUGIN_HELP = ("https://docs.aws.amazon.com/systems-manager/latest/userguide/"
               "session-manager-working-with-install-plugin.html")
CLI_HELP = "https://docs.aws.amazon.com/cli/latest/userguide/getting-started-install.html"


class ConnectError(Exception):
    def __init__(self, message: str, code: int):
        self.code = code
        super().__init__(message)


@dataclass(frozen=True)
class Shell:
    document: str
    os_user: str  # whom the session or the SSH connection logs in as ("" : the admins' ssm-user)


def caller_principal(sts: Any) -> str:
    """The caller's IAM principal as the stack file lists it: an IAM user's ARN, or for an assumed role's session
    the role (arn:aws:sts::ACCOUNT:assumed-role/ROLE/SESSION -> arn:aws:iam::ACCOUNT:role/ROLE)."""
    try:
        arn: str = sts.get_caller_identity()["Arn"]
    except (BotoCoreError, ClientError) as exc:
        if credentials_problem(exc):  # the command line says what to renew (exit 2)
            raise
        raise ConnectError(f"AWS answered: {exc}", EXIT_FAILED) from None
    prefix, _, rest = arn.partition(":assumed-role/")
    if rest:
        return f"{prefix.replace(':sts:', ':iam:', 1)}:role/{rest.split('/')[0]}"
    return arn


def _same_principal(caller: str, listed: str) -> bool:
    """An ARN of the caller against one of the stack's, by model.principal_key (the path left out: an assumed role's
    ARN carries none)."""
    key = principal_key(caller)
    return key is not None and key == principal_key(listed)


def person_of(stack: Stack, caller: str) -> str:
    """The stack's person whose principals include the caller."""
    found = [user.name for user in stack.spec.users or () if any(_same_principal(caller, p) for p in user.principals)]
    if not found:
        raise ConnectError(f"{caller} is none of the principals of {CONFIG_KEY}.users in stack {stack.name}: name "
                           "yourself with --user NAME, or sign in with your own principal", EXIT_BAD_INPUT)
    return found[0]


def shell(stack: Stack, admin: bool, user: str | None, sts: Any) -> Shell:
    """The Session document the caller's shell starts with, and as whom."""
    cluster = stack.cluster_name
    names = [u.name for u in stack.spec.users or ()]
    if admin and user:
        raise ConnectError("--admin and --user are two different shells: give one", EXIT_BAD_INPUT)
    if admin:
        return Shell(session_document_name(cluster, ADMIN_SESSION), "")
    if user and not names:
        raise ConnectError(f"stack {stack.name} lists no people ({CONFIG_KEY}.users): everyone connects as "
                           f"{LOGIN_USER}, without --user", EXIT_BAD_INPUT)
    if user and user not in names:
        raise ConnectError(f"no person {user!r} in {CONFIG_KEY}.users of stack {stack.name}; its people: "
                           f"{', '.join(names)}", EXIT_BAD_INPUT)
    if not names:
        return Shell(session_document_name(cluster, USER_SESSION), LOGIN_USER)
    person = user or person_of(stack, caller_principal(sts))
    return Shell(person_session_document_name(cluster, person), person)


def missing_tools() -> str | None:
    """What a Session Manager session needs on this machine and is not on PATH, with where to get it."""
    if not shutil.which("aws"):
        return (f"the AWS CLI (aws) is not on PATH: install it ({CLI_HELP}) and its Session Manager plugin "
                f"({PLUGIN_HELP})")
    if not shutil.which(PLUGIN):
        return f"AWS's Session Manager plugin ({PLUGIN}) is not on PATH: install it ({PLUGIN_HELP})"
    return None


def _head(stack: Stack, session: Any) -> str:
    try:
        return running_head(session.client("ec2", region_name=stack.region), stack)
    except HeadNotFound as exc:
        raise ConnectError(str(exc), EXIT_FAILED) from None


def connect(stack: Stack, admin: bool, user: str | None, session: Any) -> int:
    """Replace this process by the Session Manager shell; returns only on a problem (said on stderr)."""
    try:
        chosen = shell(stack, admin, user, session.client("sts", region_name=stack.region))
        missing = missing_tools()
        if missing:
            raise ConnectError(missing, EXIT_BAD_INPUT)
        command = start_session_command(stack.region, _head(stack, session), chosen.document)
    except ConnectError as exc:
        print(f"connect: {exc}", file=sys.stderr)
        return exc.code
    print(f"connect: {shlex.join(command)}", file=sys.stderr)
    sys.stderr.flush()
    os.execvp(command[0], command)
    return EXIT_FAILED  # not reached: execvp returns only by raising


# --- SSH --------------------------------------------------------------------------------------------------------------
def key_path(stack: Stack, home: Path | None = None) -> Path:
    """The caller's key for this cluster: made once on their machine; its public half is pushed per connection."""
    return (home or Path.home()) / ".ssh" / f"gpucluster-{stack.cluster_name}"


def ssh_config(stack: Stack, stack_file: Path, user: str | None, session: Any, home: Path | None = None) -> int:
    """Print a Host block for ~/.ssh/config; make the key it names if there is none yet."""
    try:
        os_user = shell(stack, False, user, session.client("sts", region_name=stack.region)).os_user
    except ConnectError as exc:
        print(f"ssh-config: {exc}", file=sys.stderr)
        return exc.code
    key = key_path(stack, home)
    if not key.exists():
        key.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"gpucluster {stack.cluster_name}",
                            "-f", str(key)], check=True, capture_output=True, timeout=30)
        except (OSError, subprocess.SubprocessError) as exc:
            print(f"ssh-config: could not make the key {key} with ssh-keygen (OpenSSH's client): {exc}",
                  file=sys.stderr)
            return EXIT_BAD_INPUT
    # This interpreter, which has the package installed (pip install, or make's editable install): ssh runs the
    # command from any directory.
    proxy = [sys.executable, "-m", "gpucluster", "ssh-proxy", str(stack_file.resolve()), "--user", os_user]
    print("\n".join([
        f"# gpucluster {stack.cluster_name}: the head node through Session Manager (no open port); the key's public "
        "half is pushed for 60 s per connection (EC2 Instance Connect)",
        f"Host {stack.cluster_name}",
        f"  User {os_user}",
        f"  IdentityFile {key}",
        "  IdentitiesOnly yes",
        # A replaced head has a new host key: the alias keeps the known_hosts entry apart from other hosts'.
        f"  HostKeyAlias {stack.cluster_name}",
        f"  ProxyCommand {shlex.join(proxy)}",
        "  ServerAliveInterval 30",
    ]))
    return 0


def ssh_proxy(stack: Stack, user: str, session: Any, home: Path | None = None) -> int:
    """ssh's ProxyCommand: push the caller's public key for `user`, then become the Session Manager stream to the
    head's port 22."""
    key = key_path(stack, home).with_suffix(".pub")
    try:
        if user not in dict(ssh_logins(stack.spec.users or ())):
            raise ConnectError(f"no person {user!r} in {CONFIG_KEY}.users of stack {stack.name}", EXIT_BAD_INPUT)
        if not key.exists():
            raise ConnectError(f"no key {key}: `gpucluster ssh-config {stack.name}` makes it", EXIT_BAD_INPUT)
        missing = missing_tools()
        if missing:
            raise ConnectError(missing, EXIT_BAD_INPUT)
        head = _head(stack, session)
        connect_client = session.client("ec2-instance-connect", region_name=stack.region)
        try:
            connect_client.send_ssh_public_key(InstanceId=head, InstanceOSUser=user, SSHPublicKey=key.read_text())
        except (BotoCoreError, ClientError) as exc:
            if credentials_problem(exc):
                raise
            raise ConnectError(f"EC2 Instance Connect refused the key for {user}: {exc}", EXIT_FAILED) from None
    except ConnectError as exc:
        print(f"ssh-proxy: {exc}", file=sys.stderr)
        return exc.code
    command = start_session_command(stack.region, head, session_document_name(stack.cluster_name, SSH_SESSION))
    os.execvp(command[0], command)
    return EXIT_FAILED  # not reached
