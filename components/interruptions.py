"""EC2's warnings about spot instances, delivered to the head node: an EventBridge rule for spot interruption warnings
and rebalance recommendations, and the SQS queue it sends them to, which the head's `gpucluster-interruptions`
service reads (the budget guardrail's pattern: an encrypted queue only this rule may send to).

EventBridge events carry no instance tags, so the rule takes the account's warnings in the region; the service acts
only on instances its own registry knows."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from components import child
from components.iam import allow_service

EVENT_TYPES = ["EC2 Spot Instance Interruption Warning", "EC2 Instance Rebalance Recommendation"]
# A warning is worth two minutes: one older than this is of no use to anyone.
RETENTION_SECONDS = 600


@dataclass(frozen=True)
class InterruptionEventsArgs:
    cluster_name: str


class InterruptionEvents(pulumi.ComponentResource):
    queue_url: pulumi.Output[str]
    queue_arn: pulumi.Output[str]

    def __init__(self, name: str, args: InterruptionEventsArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpucluster:interruptions:InterruptionEvents", name, None, opts)
        queue = aws.sqs.Queue(f"{name}-interruptions", sqs_managed_sse_enabled=True,
                              message_retention_seconds=RETENTION_SECONDS, visibility_timeout_seconds=60,
                              opts=child(self))
        rule = aws.cloudwatch.EventRule(
            f"{name}-interruptions", description=f"gpucluster {args.cluster_name}: spot warnings to the head node",
            event_pattern=json.dumps({"source": ["aws.ec2"], "detail-type": EVENT_TYPES}), opts=child(self))
        policy = aws.sqs.QueuePolicy(f"{name}-interruptions", queue_url=queue.url, policy=pulumi.Output.all(
            queue.arn, rule.arn).apply(lambda a: allow_service("events.amazonaws.com", "sqs:SendMessage", a[0],
                                                               {"ArnEquals": {"aws:SourceArn": a[1]}})),
            opts=child(self))
        aws.cloudwatch.EventTarget(f"{name}-interruptions", rule=rule.name, arn=queue.arn,
                                   opts=child(self, depends_on=[policy]))
        self.queue_url, self.queue_arn = queue.url, queue.arn
        self.register_outputs({"queue_url": self.queue_url, "queue_arn": self.queue_arn})
