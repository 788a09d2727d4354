"""`gpucluster status STACK` from a team member's machine: one Run Command of the cluster's status document on the
head node (`<cluster>-status-command`, components/team_access.py), with the caller's credentials, no Pulumi CLI or
state. The document runs exactly `/usr/local/bin/gpucluster status --json` as root on the head (gpucluster/node/
status_run.py) and has no parameters: nothing of the caller's reaches the head's shell, and it reads, never changes.

Exit 0 with the status printed; 1 when the head does not run or does not answer (said why); 2 bad input.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from gpucluster.aws.head import HeadNotFound, running_head
from gpucluster.aws.run_command import DELIVERY_SECONDS, HEAD_COMMAND, wait
from gpucluster.cli_errors import credentials_problem
from gpucluster.contract.settings import STATUS_COMMAND, command_document_name
from gpucluster.contract.status import StatusFormatError, status_from_json, table
from gpucluster.spec.model import Stack

# The head's run reads scontrol and sshare, each bounded by SlurmControl's 60 s: a minute and a half and some.
EXECUTION_SECONDS = 180


def command_document(stack: Stack) -> str:
    """The cluster's status document (schema 2.2, JSON): `gpucluster status --json` as root on the head."""
    return json.dumps({
        "schemaVersion": "2.2",
        "description": f"gpucluster {stack.cluster_name}: gpucluster status on the head node (read only), its JSON "
                       "on stdout",
        "mainSteps": [{
            "action": "aws:runShellScript", "name": "status",
            "precondition": {"StringEquals": ["platformType", "Linux"]},
            "inputs": {"timeoutSeconds": str(EXECUTION_SECONDS),
                       "runCommand": ["#!/bin/sh", f"exec {HEAD_COMMAND} status --json"]},
        }],
    })


def _fail(reason: str, as_json: bool) -> int:
    if as_json:
        print(json.dumps({"errors": [{"path": "", "message": reason}]}))
    print(f"status: {reason}", file=sys.stderr)
    return 1


def run(stack: Stack, as_json: bool, session: Any, sleep: Callable[[float], None] = time.sleep) -> int:
    """The status of the stack's cluster, read on its running head in one Run Command."""
    ec2 = session.client("ec2", region_name=stack.region)
    try:
        head = running_head(ec2, stack)
    except HeadNotFound as exc:
        return _fail(str(exc), as_json)
    ssm = session.client("ssm", region_name=stack.region)
    document = command_document_name(stack.cluster_name, STATUS_COMMAND)
    try:
        sent = ssm.send_command(InstanceIds=[head], DocumentName=document, TimeoutSeconds=DELIVERY_SECONDS,
                                Comment="gpucluster status")
        invocation = wait(ssm, sent["Command"]["CommandId"], head, DELIVERY_SECONDS + EXECUTION_SECONDS + 60,
                          sleep=sleep, command="status")
    except (BotoCoreError, ClientError) as exc:
        if credentials_problem(exc):  # the command line says what to renew (exit 2)
            raise
        return _fail(f"AWS answered: {exc}", as_json)
    if invocation is None or invocation["Status"] != "Success":
        said = (invocation or {}).get("StandardErrorContent", "").strip()
        return _fail(f"the head {head} did not answer ({(invocation or {}).get('StatusDetails', 'no answer')})"
                     f"{': ' + said[:500] if said else ''}", as_json)
    stdout = invocation.get("StandardOutputContent", "")
    try:
        status = status_from_json(stdout)
    except (ValueError, StatusFormatError) as exc:
        return _fail(f"the head's output is no status document ({exc}); it said: {stdout.strip()[:500] or 'nothing'}",
                     as_json)
    status["head"] = {"instance_id": head, "state": "running"}
    print(json.dumps(status, indent=1) if as_json else "\n".join(table(status)))
    return 0
