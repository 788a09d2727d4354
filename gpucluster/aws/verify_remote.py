"""`gpucluster verify STACK` from the operator's machine: the run happens on the stack's head node, as root, through
Session Manager's Run Command with the caller's credentials (no Pulumi CLI or state).

The cluster's verify documents (components/team_access.py creates them from `command_document`) run exactly
`/usr/local/bin/gpucluster verify --json [--pool P ...] [--nodes N] [--deep] [--last]` on the head; their parameters
are values, never shell: each has an allowedPattern or allowedValues that SendCommand checks, and the agent hands them
to the script as environment variables (interpolationType ENV_VAR), not as text spliced into it. The team's access
policies may send them to the head only: never AWS-RunShellScript, which would be root on the head.

Two documents, because root's DCGM job runs under Slurm's root account, outside the team's limits: the users' one
(`verify`) has no `deep` parameter, so a user's run holds its nodes minutes; only the admins' policy allows the one
with it (`verify-deep`), whose level 3 diagnostic holds them an hour. `--deep` sends the latter.

`run` sends it, polls GetCommandInvocation until the command ends (bounded by the document's own timeouts), and maps
the outcome: the head's exit 0, 1 and 2 are this command's; a command that was not delivered, timed out or was
cancelled is 1 with the reason, as is a head that does not run.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from gpucluster.aws.head import HeadNotFound, running_head
from gpucluster.aws.run_command import DELIVERY_SECONDS, HEAD_COMMAND, wait
from gpucluster.cli_errors import UserError, credentials_problem
from gpucluster.contract.settings import DEEP_VERIFY_COMMAND, VERIFY_COMMAND, command_document_name
from gpucluster.contract.verify import VerifyFormatError, run_from_json, run_json, run_seconds, run_table
from gpucluster.spec.model import POOL_NAME_RE, Stack

EXIT_BAD_INPUT = 2  # the head's exit for bad input, passed on as is

# --- the document ----------------------------------------------------------------------------------------------------
_POOL = POOL_NAME_RE.removeprefix("^").removesuffix("$")
POOLS_PATTERN = f"^({_POOL}( {_POOL})*)?$"  # pool names, one space apart; "": every pool
NODES_PATTERN = "^([1-9][0-9]{0,3})?$"  # 1-9999 (a pool has at most 1024 nodes); "": the plan's default
FLAG_VALUES = ["false", "true"]
# The SSM Agent cuts what GetCommandInvocation returns of stdout to its first 24,000 characters (SSM API reference,
# StandardOutputContent) and ends the cut with its OutputTruncatedSuffix (amazon-ssm-agent
# agent/framework/processor/executer/iohandler/iohandler.go, DefaultOutputConfig; "---Output truncated---" there is
# TruncateOutput's, for the plugin's short combined Output, not for StandardOutputContent).
OUTPUT_LIMIT = 24_000
TRUNCATED_MARK = "--output truncated--"
# ENV_VAR interpolation needs SSM Agent 3.3.2746.0 or later (Systems Manager user guide, "Troubleshooting parameter
# handling issues"); an older agent sets no SSM_* variable: the script refuses rather than run other options.
OLD_AGENT_EXIT = 3

SCRIPT = [
    "#!/bin/sh",
    "set -f",  # no globbing of the pool list (its pattern admits no wildcard anyway)
    'if [ -z "${SSM_last+set}" ]; then',
    '  echo "the SSM Agent on the head passes no parameters as environment variables (interpolationType ENV_VAR'
    ' needs agent 3.3.2746.0 or later): update amazon-ssm-agent" >&2',
    f"  exit {OLD_AGENT_EXIT}",
    "fi",
    "set -- verify --json",
    'for pool in $SSM_pools; do set -- "$@" --pool "$pool"; done',
    'if [ -n "$SSM_nodes" ]; then set -- "$@" --nodes "$SSM_nodes"; fi',
    'if [ "$SSM_deep" = true ]; then set -- "$@" --deep; fi',
    'if [ "$SSM_last" = true ]; then set -- "$@" --last; fi',
    f'exec {HEAD_COMMAND} "$@"',
]


def execution_timeout_seconds(stack: Stack, deep: bool) -> int:
    """The longest the head's run can take (contract.verify.run_seconds, the run's own limits summed), its nodes
    booting for at most the stack's ResumeTimeout (Slurm gives up on them then)."""
    return run_seconds(stack.spec.slurm.resume_timeout_seconds, deep)


def document_kind(deep: bool) -> str:
    return DEEP_VERIFY_COMMAND if deep else VERIFY_COMMAND


def command_document(stack: Stack, deep: bool) -> str:
    """A verify document of the cluster (schema 2.2, JSON): gpucluster verify --json as root on the head; `deep`:
    the admins' one, with the `deep` parameter and the time a level 3 diagnostic takes."""

    def parameter(description: str, **rule: object) -> dict[str, object]:
        return {"type": "String", "description": description, "interpolationType": "ENV_VAR", **rule}

    deep_parameter = {"deep": parameter("The longer diagnostics (DCGM level 3)", default="false",
                                        allowedValues=FLAG_VALUES)} if deep else {}
    return json.dumps({
        "schemaVersion": "2.2",
        "description": f"gpucluster {stack.cluster_name}: gpucluster verify on the head node (as root), its run "
                       f"document on stdout{' (--deep allowed)' if deep else ''}",
        "parameters": {
            "pools": parameter("Pools to verify, one space apart (empty: every pool)", default="",
                               allowedPattern=POOLS_PATTERN),
            "nodes": parameter("Nodes per pool (empty: 2 where a pool allows, else its max_nodes)", default="",
                               allowedPattern=NODES_PATTERN),
            **deep_parameter,
            "last": parameter("Print the latest run instead of running", default="false",
                              allowedValues=FLAG_VALUES),
        },
        "mainSteps": [{
            "action": "aws:runShellScript", "name": "verify",
            "precondition": {"StringEquals": ["platformType", "Linux"]},
            "inputs": {"timeoutSeconds": str(execution_timeout_seconds(stack, deep)), "runCommand": SCRIPT},
        }],
    })


# --- the operator's side ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Request:
    """What the operator asked, as the document's parameters; `as_json`: print the run document, not a table."""

    pools: tuple[str, ...] = ()
    nodes: int | None = None
    deep: bool = False
    last: bool = False
    as_json: bool = False

    def parameters(self) -> dict[str, list[str]]:
        """SendCommand's Parameters; the document's defaults stand for what was not asked (everyone's document has
        no `deep`: SendCommand refuses a parameter a document does not declare)."""
        chosen = {"last": [str(self.last).lower()], **({"deep": ["true"]} if self.deep else {})}
        if self.pools:
            chosen["pools"] = [" ".join(self.pools)]
        if self.nodes is not None:
            chosen["nodes"] = [str(self.nodes)]
        return chosen


class BadRequest(ValueError):
    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("; ".join(problems))


def request(stack: Stack, head_args: list[str]) -> Request:
    """The head's `gpucluster verify` options (without STACK): --json, --pool NAME (repeatable), --nodes N, --deep,
    --last. Checked here against the stack and the document's patterns (every problem at once); the head checks the
    rest (a pool's max_nodes) and answers 2."""
    options = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    options.add_argument("--json", action="store_true")
    options.add_argument("--pool", action="append", default=[])
    options.add_argument("--nodes")
    options.add_argument("--deep", action="store_true")
    options.add_argument("--last", action="store_true")
    try:
        parsed, unknown = options.parse_known_args(head_args)
    except argparse.ArgumentError as exc:
        raise BadRequest([str(exc)]) from None
    problems = [f"unknown option {arg!r}" for arg in unknown]
    names = [p.name for p in stack.spec.pools]
    missing = [pool for pool in parsed.pool if pool not in names]
    if missing:
        problems.append(f"no pool {', '.join(missing)} in stack {stack.name}; its pools: {', '.join(names)}")
    if parsed.nodes is not None and not re.fullmatch(NODES_PATTERN, parsed.nodes):
        problems.append(f"--nodes must be a whole number from 1, got {parsed.nodes!r}")
    if parsed.last and (parsed.pool or parsed.nodes is not None or parsed.deep):
        problems.append("--last prints the latest run: it takes no --pool, --nodes or --deep")
    if problems:
        raise BadRequest(problems)
    return Request(tuple(dict.fromkeys(parsed.pool)), int(parsed.nodes) if parsed.nodes else None, parsed.deep,
                   parsed.last, parsed.json)


def outcome(invocation: dict[str, Any], req: Request, stack: Stack) -> int:
    """Print what the head answered and return this command's exit code."""
    status, code = invocation["Status"], invocation.get("ResponseCode", -1)
    stdout, stderr = invocation.get("StandardOutputContent", ""), invocation.get("StandardErrorContent", "")
    head = invocation.get("InstanceId", "the head")
    if status == "TimedOut":
        # StatusDetails' words, spaces and all (SSM API reference, GetCommandInvocation's StatusDetails).
        why = {"Delivery Timed Out": f"the head's SSM Agent did not take the command within {DELIVERY_SECONDS} s "
                                   "(is it online? `aws ssm describe-instance-information`)",
               "Execution Timed Out": f"the run took longer than the document allows "
                                    f"({execution_timeout_seconds(stack, req.deep)} s) and was stopped; its jobs "
                                    "may still be in Slurm's queue (squeue on the head)"}
        return _fail(why.get(invocation.get("StatusDetails", ""), f"the command timed out "
                                                                  f"({invocation.get('StatusDetails', '')})"))
    if status == "Cancelled":
        return _fail("the command was cancelled on the head (the console or `aws ssm cancel-command`)")
    if code == EXIT_BAD_INPUT:
        raise UserError([(path, f"verify: the head refused the options: {message}")
                         for path, message in refusal(stdout, stderr)])
    if code not in (0, 1):
        detail = invocation.get("StatusDetails", status)
        return _fail(f"the command ended {detail} on {head} with exit code {code}"
                     f"{': ' + stderr.strip() if stderr.strip() else ''}")
    if TRUNCATED_MARK in stdout or len(stdout) >= OUTPUT_LIMIT:
        print(f"verify: the run document is longer than Run Command returns ({OUTPUT_LIMIT:,} characters): read it "
              f"on the head (`gpucluster verify --last` in a shell), or verify fewer pools (--pool). The head said: "
              f"{'nothing failed' if code == 0 else 'something failed'}.", file=sys.stderr)
        return int(code)
    try:
        results = run_from_json(stdout)
    except (ValueError, VerifyFormatError) as exc:  # json's JSONDecodeError is a ValueError
        return _fail(f"the head's output is no run document ({exc}); it said: "
                     f"{(stdout.strip() or stderr.strip() or 'nothing')[:500]}")
    print(run_json(results) if req.as_json else "\n".join(run_table(results)))
    return int(code)


def refusal(stdout: str, stderr: str) -> list[tuple[str, str]]:
    """The head's reasons for exit 2, each (config path, message): the script runs `verify --json`, so the head
    prints its errors as {"errors": [{"path": ..., "message": ...}]} on stdout (cli_errors.print_errors); stderr's
    lines when stdout holds no such document (a usage error argparse printed before --json was read)."""
    try:
        errors = json.loads(stdout)["errors"]
        found = [(str(e.get("path", "")), str(e["message"]).removeprefix("verify: ")) for e in errors]
    except (ValueError, KeyError, TypeError, AttributeError):
        found = []
    return found or [("", line.removeprefix("verify: ")) for line in stderr.strip().splitlines()[-5:]] or [
        ("", "no reason given")]


def _fail(reason: str) -> int:
    print(f"verify: {reason}", file=sys.stderr)
    return 1


def run(stack: Stack, head_args: list[str], session: Any,
        sleep: Callable[[float], None] = time.sleep) -> int:
    """`gpucluster verify` on the stack's running head through Run Command; `head_args` as the head's command takes
    them (without STACK). Exit 0 nothing failed, 1 something failed (or the head could not be reached); bad input,
    ours or the head's, raises UserError (exit 2, as {"errors": ...} with --json)."""
    try:
        req = request(stack, head_args)
    except BadRequest as exc:
        raise UserError([("", f"verify: {problem}") for problem in exc.problems]) from None
    try:
        head = running_head(session.client("ec2", region_name=stack.region), stack)
    except HeadNotFound as exc:
        return _fail(str(exc))
    ssm = session.client("ssm", region_name=stack.region)
    document = command_document_name(stack.cluster_name, document_kind(req.deep))
    try:
        sent = ssm.send_command(InstanceIds=[head], DocumentName=document, Parameters=req.parameters(),
                                TimeoutSeconds=DELIVERY_SECONDS,
                                Comment=f"gpucluster verify{' --last' if req.last else ''}"[:100])
    except (BotoCoreError, ClientError) as exc:
        if credentials_problem(exc):  # the command line says what to renew (exit 2)
            raise
        denied = isinstance(exc, ClientError) and "AccessDenied" in exc.response.get("Error", {}).get("Code", "")
        return _fail(f"AWS answered: {exc}" + (f"; --deep sends {document}, which only the stack's admin access "
                                                 "policy allows" if denied and req.deep else ""))
    command_id = sent["Command"]["CommandId"]
    print(f"verify: sent {document} to {head} (command {command_id}); "
          f"{'reading the latest run' if req.last else 'a run takes minutes (scaling from zero)'}", file=sys.stderr)
    bound = DELIVERY_SECONDS + execution_timeout_seconds(stack, req.deep) + 120  # the agent's last report
    # Once sent, the run is the head's: losing our side (credentials that expire during an hour's deep run, the
    # network, Ctrl-C) ends only the waiting.
    goes_on = (f"the run goes on on the head (command {command_id}): `verify {stack.name} --last` prints it once it "
               "has ended")
    try:
        invocation = wait(ssm, command_id, head, bound, sleep=sleep, command="verify")
    except (BotoCoreError, ClientError) as exc:
        return _fail(f"stopped waiting, AWS answered: {exc}; {goes_on}")
    except KeyboardInterrupt:
        return _fail(f"stopped waiting; {goes_on}")
    if invocation is None:
        return _fail(f"no answer from {head} after {bound} s (command {command_id}): `verify {stack.name} --last` "
                     "prints the run if it ended")
    return outcome(invocation, req, stack)
