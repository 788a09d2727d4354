"""What `gpucluster verify STACK` and `gpucluster status STACK` share to run one of the cluster's Run Command documents
on the head node (gpucluster/aws/verify_remote.py, status_remote.py): the program the documents run there, SendCommand's
delivery timeout, and the wait for the invocation's end."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

from botocore.exceptions import ClientError

HEAD_COMMAND = "/usr/local/bin/gpucluster"  # gpucluster/node/bootstrap.py command_line writes it on the head
# SendCommand's delivery timeout (min 30 s): the head's agent takes a command within seconds when it is online.
DELIVERY_SECONDS = 300

TERMINAL = ("Success", "Failed", "Cancelled", "TimedOut")  # GetCommandInvocation's Status; the others still move


def wait(ssm: Any, command_id: str, head: str, seconds: float, *, sleep: Callable[[float], None] = time.sleep,
         clock: Callable[[], float] = time.monotonic, progress_every: float = 60,
         command: str) -> dict[str, Any] | None:
    """GetCommandInvocation until the command ends, backing off from 2 s to 30 s; None when `seconds` pass first.
    A progress line to stderr about once a `progress_every`."""
    start = clock()
    delay, said = 2.0, start
    while True:
        try:
            invocation: dict[str, Any] = ssm.get_command_invocation(CommandId=command_id, InstanceId=head)
        except ClientError as exc:
            # Right after SendCommand the invocation may not exist yet (botocore's CommandExecuted waiter retries it).
            if exc.response.get("Error", {}).get("Code") != "InvocationDoesNotExist":
                raise
            invocation = {"Status": "Pending"}
        if invocation["Status"] in TERMINAL:
            return invocation
        now = clock()
        if now - start >= seconds:
            return None
        if now - said >= progress_every:
            print(f"{command}: {invocation['Status']} on {head} for {(now - start) / 60:.0f} min "
                  f"(command {command_id})", file=sys.stderr)
            said = now
        sleep(min(delay, max(seconds - (now - start), 0)))
        delay = min(delay * 1.5, 30.0)
