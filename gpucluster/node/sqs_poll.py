"""The one loop of the services that wait on an SQS queue: the head's interruptions service (EC2's spot warnings) and
budget guardrail (AWS Budgets' notifications), and the EKS flavour's queue guardrail (in its pod, which carries this
file). Standard library only: the caller brings its boto3 SQS client."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Iterable

RECEIVE_WAIT_SECONDS = 20  # SQS long polling's longest wait: one call every 20 s while nothing happens
MAX_MESSAGES = 10  # per ReceiveMessage call (SQS's limit)

Message = dict[str, Any]
log = logging.getLogger(__name__)


def serve(sqs: Any, queue_url: str, act: Callable[[list[Message]], Iterable[Message]],
          stop: Callable[[], bool] = lambda: False,
          wait_seconds: Callable[[], float] = lambda: RECEIVE_WAIT_SECONDS,
          retry_seconds: float = 5, sleep: Callable[[float], None] = time.sleep) -> None:
    """Until `stop`: receive what the queue has, waiting up to `wait_seconds()` for a first message; hand it to `act`
    (after a failed receive too, with nothing: what is due still gets done) and delete the messages `act` returns,
    those it acted on. The others come back after the queue's visibility timeout. A failure is logged, and the loop
    pauses `retry_seconds` before going on."""
    while not stop():
        try:
            messages = sqs.receive_message(QueueUrl=queue_url, WaitTimeSeconds=int(wait_seconds()),
                                           MaxNumberOfMessages=MAX_MESSAGES).get("Messages", [])
        except Exception:
            log.exception("receiving from %s failed; trying again", queue_url)
            sleep(retry_seconds)
            messages = []
        try:
            for message in act(messages):
                sqs.delete_message(QueueUrl=queue_url, ReceiptHandle=message["ReceiptHandle"])
        except Exception:
            log.exception("acting on the messages of %s failed; they come back", queue_url)
            sleep(retry_seconds)
