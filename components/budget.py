"""A monthly AWS Budget over everything tagged with this stack, with early warnings by email through SNS."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from components import child
from gpucluster.cost import COST_TAG
from gpucluster.spec import Budget as BudgetSpec


@dataclass(frozen=True)
class BudgetArgs:
    budget_name: str
    spec: BudgetSpec
    stack: str  # the value of the cost-allocation tag COST_TAG
    activate_cost_tag: bool = True


def tag_filter(stack: str) -> str:
    """Budgets' TagKeyValue filter: `user:<key>$<value>`."""
    return f"user:{COST_TAG}${stack}"


class Budget(pulumi.ComponentResource):
    topic_arn: pulumi.Output[str]
    budget_name: pulumi.Output[str]

    def __init__(self, name: str, args: BudgetArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpucluster:budget:Budget", name, None, opts)
        account = aws.get_caller_identity_output(opts=pulumi.InvokeOutputOptions(parent=self)).account_id
        # SNS server-side encryption is left off: Budgets cannot publish to a topic under the AWS-managed SNS key.
        topic = aws.sns.Topic(f"{name}-alerts", opts=child(self))
        aws.sns.TopicPolicy(
            f"{name}-alerts",
            arn=topic.arn,
            policy=pulumi.Output.all(topic.arn, account).apply(
                lambda a: json.dumps(
                    {
                        "Version": "2012-10-17",
                        "Statement": [
                            {
                                "Sid": "BudgetsPublish",
                                "Effect": "Allow",
                                "Principal": {"Service": "budgets.amazonaws.com"},
                                "Action": "SNS:Publish",
                                "Resource": a[0],
                                "Condition": {"StringEquals": {"aws:SourceAccount": a[1]}},
                            }
                        ],
                    }
                )
            ),
            opts=child(self),
        )
        for i, email in enumerate(args.spec.notify_emails):
            aws.sns.TopicSubscription(
                f"{name}-email-{i}", topic=topic.arn, protocol="email", endpoint=email, opts=child(self)
            )

        if args.activate_cost_tag:
            # Account-wide and shared by every stack: kept on destroy so one team's teardown does not switch off the
            # others' cost reports. AWS accepts it only once the tag has appeared in billing data (up to 24 hours).
            aws.costexplorer.CostAllocationTag(
                f"{name}-cost-tag", tag_key=COST_TAG, status="Active", opts=child(self, retain_on_delete=True)
            )

        notifications = [
            {
                "comparison_operator": "GREATER_THAN",
                "notification_type": kind,
                "threshold": float(percent),
                "threshold_type": "PERCENTAGE",
                "subscriber_sns_topic_arns": [topic.arn],
            }
            for percent in args.spec.thresholds_percent
            for kind in ("ACTUAL", "FORECASTED")
        ]
        budget = aws.budgets.Budget(
            f"{name}-monthly",
            name=args.budget_name,
            budget_type="COST",
            limit_amount=f"{args.spec.monthly_usd:.2f}",
            limit_unit="USD",
            time_unit="MONTHLY",
            cost_filters=[{"name": "TagKeyValue", "values": [tag_filter(args.stack)]}],
            notifications=notifications,
            opts=child(self),
        )
        self.topic_arn = topic.arn
        self.budget_name = budget.name
        self.register_outputs({"topic_arn": self.topic_arn, "budget_name": self.budget_name})
