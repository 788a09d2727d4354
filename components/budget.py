"""A monthly AWS Budget over everything tagged with this stack: early warnings by email through SNS, a queue that
wakes the head node's guardrail, and (LaunchDeny) the Budgets action that denies launches when the head node cannot act.
"""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from components import child
from components.iam import allow_service, policy
from gpucluster.spec.cost import COST_TAG
from gpucluster.spec.model import BudgetSpec


@dataclass(frozen=True)
class BudgetArgs:
    budget_name: str
    spec: BudgetSpec
    stack: str  # the value of the cost-allocation tag COST_TAG
    account_id: pulumi.Input[str]  # components.iam.account_id: only its own account's services may publish
    activate_cost_tag: bool = True


def tag_filter(stack: str) -> str:
    """Budgets' TagKeyValue filter: `user:<key>$<value>`."""
    return f"user:{COST_TAG}${stack}"


class Budget(pulumi.ComponentResource):
    topic_arn: pulumi.Output[str]
    budget_name: pulumi.Output[str]
    budget_arn: pulumi.Output[str]
    # The guardrail's queue (None when act_threshold_percent is null: alerts only).
    queue_url: pulumi.Output[str] | None = None
    queue_arn: pulumi.Output[str] | None = None

    def __init__(self, name: str, args: BudgetArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpucluster:budget:Budget", name, None, opts)
        # SNS server-side encryption is left off: Budgets cannot publish to a topic under the AWS-managed SNS key.
        topic = aws.sns.Topic(f"{name}-alerts", opts=child(self))
        aws.sns.TopicPolicy(
            f"{name}-alerts",
            arn=topic.arn,
            policy=pulumi.Output.all(topic.arn, args.account_id).apply(
                # Budgets for its notifications and actions, CloudWatch for the idle-GPU alarms.
                lambda a: allow_service(["budgets.amazonaws.com", "cloudwatch.amazonaws.com"], "SNS:Publish", a[0],
                                        {"StringEquals": {"aws:SourceAccount": a[1]}})),
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

        act = args.spec.act_threshold_percent
        if act is not None:
            # Every message on the topic wakes the guardrail, which then reads the budget itself.
            queue = aws.sqs.Queue(f"{name}-guardrail", sqs_managed_sse_enabled=True,
                                  message_retention_seconds=14 * 24 * 3600, visibility_timeout_seconds=120,
                                  opts=child(self))
            aws.sqs.QueuePolicy(f"{name}-guardrail", queue_url=queue.url, policy=pulumi.Output.all(
                queue.arn, topic.arn).apply(lambda a: allow_service("sns.amazonaws.com", "sqs:SendMessage", a[0],
                                                                    {"ArnEquals": {"aws:SourceArn": a[1]}})),
                opts=child(self))
            aws.sns.TopicSubscription(f"{name}-guardrail", topic=topic.arn, protocol="sqs", endpoint=queue.arn,
                                      opts=child(self))
            self.queue_url, self.queue_arn = queue.url, queue.arn
        actual_at = sorted(set(args.spec.thresholds_percent) | ({act} if act is not None else set()))
        notifications: list[aws.budgets.BudgetNotificationArgsDict] = [
            {
                "comparison_operator": "GREATER_THAN",
                "notification_type": kind,
                "threshold": float(percent),
                "threshold_type": "PERCENTAGE",
                "subscriber_sns_topic_arns": [topic.arn],
            }
            for kind, percents in (("ACTUAL", actual_at), ("FORECASTED", args.spec.thresholds_percent))
            for percent in percents
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
        self.budget_arn = budget.arn
        self.register_outputs({"topic_arn": self.topic_arn, "budget_name": self.budget_name,
                               "budget_arn": self.budget_arn, "queue_url": self.queue_url})


LAUNCH_ACTIONS = ["ec2:RunInstances", "ec2:CreateFleet", "ec2:RequestSpotInstances", "ec2:StartInstances"]


@dataclass(frozen=True)
class LaunchDenyArgs:
    budget_name: pulumi.Input[str]
    act_threshold_percent: int
    role_name: pulumi.Input[str]  # the role that launches nodes (the head node's)
    role_arn: pulumi.Input[str]
    topic_arn: pulumi.Input[str]
    account_id: pulumi.Input[str]  # components.iam.account_id: only its own account's Budgets may run the action
    # What the role may no longer do: launch instances (the Slurm head), or resize groups (Kubernetes' autoscaler).
    denied_actions: tuple[str, ...] = tuple(LAUNCH_ACTIONS)


class LaunchDeny(pulumi.ComponentResource):
    """The backstop that works with the head node down: at the act threshold, AWS Budgets itself attaches a policy
    denying every instance launch to the launching role. The guardrail reverses it when spend falls back."""

    def __init__(self, name: str, args: LaunchDenyArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpucluster:budget:LaunchDeny", name, None, opts)
        deny = aws.iam.Policy(f"{name}-launch-deny", description="gpucluster budget action: no instance launches",
                              policy=policy([{"Sid": "BudgetSpent", "Effect": "Deny",
                                              "Action": list(args.denied_actions), "Resource": "*"}]),
                              opts=child(self))
        executor = aws.iam.Role(f"{name}-budget-action", assume_role_policy=pulumi.Output.from_input(
            args.account_id).apply(lambda acct: policy([{
                "Effect": "Allow", "Principal": {"Service": "budgets.amazonaws.com"}, "Action": "sts:AssumeRole",
                "Condition": {"StringEquals": {"aws:SourceAccount": acct}}}])), opts=child(self))
        # Attach and detach exactly that policy on exactly that role.
        aws.iam.RolePolicy(f"{name}-budget-action", role=executor.id, policy=pulumi.Output.all(
            args.role_arn, deny.arn).apply(lambda a: policy([{
                "Sid": "AttachTheLaunchDenyOnly", "Effect": "Allow",
                "Action": ["iam:AttachRolePolicy", "iam:DetachRolePolicy"], "Resource": a[0],
                "Condition": {"ArnEquals": {"iam:PolicyARN": a[1]}}}])), opts=child(self))
        action = aws.budgets.BudgetAction(
            f"{name}-launch-deny",
            budget_name=args.budget_name,
            action_type="APPLY_IAM_POLICY",
            approval_model="AUTOMATIC",
            notification_type="ACTUAL",
            action_threshold={"action_threshold_type": "PERCENTAGE",
                              "action_threshold_value": float(args.act_threshold_percent)},
            definition={"iam_action_definition": {"policy_arn": deny.arn, "roles": [args.role_name]}},
            execution_role_arn=executor.arn,
            subscribers=[{"address": args.topic_arn, "subscription_type": "SNS"}],
            opts=child(self),
        )
        self.action_id = action.action_id
        self.action_arn = action.arn
        self.policy_arn = deny.arn
        self.register_outputs({"action_id": self.action_id, "policy_arn": self.policy_arn})
