#!/usr/bin/env python3
"""The interruptions service on the head node (settings.INTERRUPTIONS_PROGRAM, run as INTERRUPTIONS_UNIT): EC2's spot
interruption warnings and rebalance recommendations for this cluster's instances, from the stack's queue (EventBridge
-> SQS). It drains the node, signals its jobs to checkpoint and requeues them (see Interruptions); the reconciler
replaces the node's instance once it is idle. Standard library and boto3."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the library this program is part of (the bundle's lib/)
from gpucluster.contract import reasons
from gpucluster.contract.settings import ClusterSettings
from gpucluster.node import log, program, sqs_poll
from gpucluster.node.registry import read_registry
from gpucluster.node.slurm_control import SlurmControl, error_text

SPOT_WARNING = "EC2 Spot Instance Interruption Warning"
REBALANCE = "EC2 Instance Rebalance Recommendation"


@dataclass
class Interruptions:
    """The head's answer to EC2's warnings about this cluster's instances. A spot interruption warning (two minutes
    before EC2 reclaims the instance): drain the node, send its jobs SIGUSR1 so they checkpoint, requeue them
    `checkpoint_grace_seconds` later; the reconciler replaces the node once it is idle or its instance gone. A
    rebalance recommendation (the instance is at higher risk): drain only, when the stack says so. Events for
    instances no node of this cluster has are not ours: the rule sees the whole account's."""

    config: ClusterSettings
    slurm: SlurmControl
    sns: Any = None
    clock: Callable[[], float] = time.time
    poll_seconds: int = sqs_poll.RECEIVE_WAIT_SECONDS  # the longest wait for a message
    requeue_at: dict[str, float] = field(default_factory=dict)  # job -> when to requeue it

    def handle(self, event: dict[str, Any]) -> list[str]:
        kind, detail = event.get("detail-type", ""), event.get("detail", {})
        instance = detail.get("instance-id", "")
        owners = read_registry(self.config).owner()
        node = owners.get(instance)
        if node is None or kind not in (SPOT_WARNING, REBALANCE):
            return []
        when = event.get("time", "")
        if kind == REBALANCE:
            if not self.config.drain_on_rebalance:
                self._said("rebalance recommendation (not drained: drain_on_rebalance is off)", node, instance)
                return []
            self.slurm.drain([node], f"{reasons.REPLACE}: rebalance recommendation for {instance} at {when}")
            self._said("rebalance recommendation: drained, its jobs run on", node, instance)
            return [node]
        self.slurm.drain([node], f"{reasons.REPLACE}: spot interruption warning for {instance} at {when}")
        jobs = self.slurm.jobs_on(node)
        for job in jobs:
            try:
                self.slurm.signal_job(job, "USR1")
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:  # it still gets requeued
                log.error("job %s on %s: SIGUSR1 not delivered: %s", job, node, error_text(exc).strip() or exc)
            self.requeue_at.setdefault(job, self.clock() + self.config.checkpoint_grace_seconds)
        self._said(f"spot interruption warning: drained, job(s) {' '.join(jobs) or 'none'} signalled (SIGUSR1) and "
                   f"to be requeued in {self.config.checkpoint_grace_seconds} s", node, instance, jobs=jobs)
        return [node]

    def requeue_due(self) -> list[str]:
        now = self.clock()
        due = sorted(job for job, at in self.requeue_at.items() if at <= now)
        for job in due:
            del self.requeue_at[job]
            try:
                self.slurm.requeue(job)
                program.record_event(self.config, "requeued", job=job, why="spot interruption warning")
                log.info("job %s requeued (spot interruption warning)", job)
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired):  # ended meanwhile: nothing to requeue
                log.info("job %s: not requeued (it has ended)", job)
        return due

    def wait_seconds(self) -> int:
        """How long to wait for a message: no longer than until the next requeue is due."""
        if not self.requeue_at:
            return self.poll_seconds
        return max(0, min(self.poll_seconds, int(min(self.requeue_at.values()) - self.clock()) + 1))

    def act(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Each event handled on its own, then the requeues that are due; returns the messages handled. One that
        fails is left for SQS to deliver again."""
        handled = []
        for message in messages:
            try:
                self.handle(json.loads(message["Body"]))
                handled.append(message)
            except Exception:
                log.exception("interruptions: message %s failed; SQS delivers it again", message.get("MessageId"))
        self.requeue_due()
        return handled

    def _said(self, what: str, node: str, instance: str, **details: Any) -> None:
        log.warning("node %s (%s): %s", node, instance, what)
        program.record_event(self.config, what.split(":")[0], node=node, instance=instance, **details)
        if self.sns is not None and self.config.alerts_topic_arn:
            try:
                self.sns.publish(TopicArn=self.config.alerts_topic_arn, Subject=f"gpucluster {self.config.cluster}: "
                                 f"{what.split(':')[0]} on {node}"[:100], Message=f"node {node} ({instance}): {what}")
            except Exception:  # the drain and the requeue matter; the message is a courtesy
                log.exception("could not tell the topic about %s", node)


def serve(service: Interruptions, sqs: Any, stop: Callable[[], bool] = lambda: False) -> None:
    """Long-poll the stack's queue, act on each event, requeue what is due; until `stop`."""
    sqs_poll.serve(sqs, service.config.interruption_queue_url, service.act, stop, service.wait_seconds)


def run_service(config: ClusterSettings, slurm: SlurmControl) -> None:
    import boto3

    serve(Interruptions(config, slurm, sns=boto3.client("sns", region_name=config.region)),
          boto3.client("sqs", region_name=config.region))


def main(argv: list[str]) -> int:
    return program.run(argv, run_service)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
