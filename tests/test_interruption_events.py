"""EC2's spot warnings reach the head (components/interruptions.py), under the mock runtime: the rule matches both
kinds of warning, only the rule may send to the encrypted queue, and the head learns the queue and may read it."""

from __future__ import annotations

import json

from conftest import ROOT, of_type, planned
from gpucluster.plan import planned_outputs


def test_spot_warnings_go_to_a_queue_only_the_rule_may_send_to() -> None:
    stack, declared = planned(ROOT / "stacks" / "Pulumi.team-a.yaml")  # team-a has a spot pool
    (rule,) = of_type(declared, "cloudwatch/eventRule:EventRule")
    assert json.loads(rule.inputs["eventPattern"]) == {
        "source": ["aws.ec2"],
        "detail-type": ["EC2 Spot Instance Interruption Warning", "EC2 Instance Rebalance Recommendation"]}
    queue = next(q for q in of_type(declared, "sqs/queue:Queue") if q.name.endswith("-interruptions"))
    assert queue.inputs["sqsManagedSseEnabled"] is True and queue.inputs["messageRetentionSeconds"] == 600
    (target,) = of_type(declared, "cloudwatch/eventTarget:EventTarget")
    queue_arn = planned_outputs(queue, stack.region)["arn"]
    assert target.inputs["arn"] == queue_arn
    policy = next(p for p in of_type(declared, "sqs/queuePolicy:QueuePolicy") if p.name.endswith("-interruptions"))
    (statement,) = json.loads(policy.inputs["policy"])["Statement"]
    assert statement["Principal"] == {"Service": "events.amazonaws.com"} and statement["Resource"] == queue_arn
    assert statement["Condition"] == {"ArnEquals": {"aws:SourceArn": planned_outputs(rule, stack.region)["arn"]}}
    (config,) = [p for p in of_type(declared, "ssm/parameter:Parameter") if p.name.endswith("-config")]
    settings = json.loads(config.inputs["insecureValue"])
    assert settings["interruption_queue_url"] == planned_outputs(queue, stack.region)["url"]
    assert settings["checkpoint_grace_seconds"] == 60 and settings["drain_on_rebalance"] is True
    assert settings["alerts_topic_arn"].startswith("arn:aws:sns:")


def test_no_rule_without_spot_pools() -> None:
    _, declared = planned(ROOT / "tests" / "stacks" / "Pulumi.existing.yaml")
    assert not of_type(declared, "cloudwatch/eventRule:EventRule")
