"""Idle-accelerator alarms: one per GPU or Trainium pool, to the budget's subscribers."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from components import child
from gpucluster.render import monitoring
from gpucluster.spec.model import Stack


@dataclass(frozen=True)
class IdleGpuAlarmsArgs:
    stack: Stack
    topic_arn: pulumi.Input[str]


class IdleGpuAlarms(pulumi.ComponentResource):
    def __init__(self, name: str, args: IdleGpuAlarmsArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpucluster:monitoring:IdleGpuAlarms", name, None, opts)
        for pool in monitoring.watched_pools(args.stack):
            aws.cloudwatch.MetricAlarm(
                f"{name}-{pool.name}-idle-gpu",
                alarm_description=(f"{args.stack.cluster_name} pool {pool.name}: accelerator utilisation under "
                                   f"{monitoring.IDLE_PERCENT}% for {monitoring.IDLE_MINUTES} minutes"),
                namespace=monitoring.NAMESPACE,
                metric_name=monitoring.utilisation_metric(pool),
                dimensions=monitoring.dimensions(args.stack, pool),
                statistic="Average",
                period=monitoring.PERIOD_SECONDS,
                evaluation_periods=monitoring.IDLE_MINUTES,
                threshold=monitoring.IDLE_PERCENT,
                comparison_operator="LessThanThreshold",
                # A pool at zero sends nothing: that is not idleness.
                treat_missing_data="notBreaching",
                alarm_actions=[args.topic_arn],
                ok_actions=[args.topic_arn],
                opts=child(self),
            )
        self.register_outputs({})
