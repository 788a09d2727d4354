"""The interruptions service: EC2's spot interruption warnings and rebalance recommendations drain nodes, signal and
requeue their jobs; against in-process moto (EC2, SQS) and a recording stand-in for scontrol."""

from __future__ import annotations

import dataclasses
import json

from gpucluster.node.interruptions import REBALANCE, SPOT_WARNING, Interruptions, serve
from gpucluster.node.resume import resume
from head_fakes import NOW, FakeSlurm, ec2_fixture, make_config  # noqa: F401  (the ec2 fixture)


def spot_event(kind: str, instance: str) -> dict:
    """As EventBridge delivers EC2's warnings (the rule's target is the queue: the event is the message body)."""
    detail = {"instance-id": instance, "instance-action": "terminate"} if kind == SPOT_WARNING else \
        {"instance-id": instance}
    return {"version": "0", "id": "e1", "detail-type": kind, "source": "aws.ec2", "account": "123456789012",
            "time": "2026-11-30T16:00:00Z", "region": "us-east-1",
            "resources": [f"arn:aws:ec2:us-east-1:123456789012:instance/{instance}"], "detail": detail}


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


def test_a_spot_warning_drains_signals_and_requeues_after_the_grace(ec2, tmp_path) -> None:
    config = make_config(ec2, events_log=str(tmp_path / "events.jsonl"), checkpoint_grace_seconds=60)
    slurm, clock = FakeSlurm(), Clock()
    launched = resume(config, ec2, slurm, "p5-spot-[1-2]").launched
    slurm.jobs = {"p5-spot-1": ["41", "42"]}
    service = Interruptions(config, slurm, clock=clock)
    assert service.handle(spot_event(SPOT_WARNING, launched["p5-spot-1"])) == ["p5-spot-1"]
    assert ("update", "nodename=p5-spot-1", "state=drain",
            f"reason=gpucluster: replace: spot interruption warning for {launched['p5-spot-1']} at "
            "2026-11-30T16:00:00Z") in slurm.calls
    assert [c for c in slurm.calls if c[0] == "signal"] == [("signal", "41", "USR1"), ("signal", "42", "USR1")]
    assert service.requeue_due() == [] and service.wait_seconds() == 20  # checkpoints are being written
    clock.now += 59
    assert service.wait_seconds() == 2 and service.requeue_due() == []
    clock.now += 1
    assert service.requeue_due() == ["41", "42"]
    assert [c for c in slurm.calls if c[0] == "requeue"] == [("requeue", "41"), ("requeue", "42")]
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["spot interruption warning", "requeued", "requeued"]
    assert events[0]["node"] == "p5-spot-1" and events[0]["jobs"] == ["41", "42"]


def test_rebalance_drains_without_signalling_unless_turned_off(ec2, tmp_path) -> None:
    config = make_config(ec2, events_log=str(tmp_path / "events.jsonl"))
    slurm = FakeSlurm()
    instance = resume(config, ec2, slurm, "p5-spot-1").launched["p5-spot-1"]
    slurm.jobs = {"p5-spot-1": ["41"]}
    assert Interruptions(config, slurm).handle(spot_event(REBALANCE, instance)) == ["p5-spot-1"]
    assert [c[2] for c in slurm.calls if c[0] == "update" and c[2].startswith("state=")] == ["state=drain"]
    assert not [c for c in slurm.calls if c[0] in ("signal", "requeue")]
    off = dataclasses.replace(config, drain_on_rebalance=False)
    quiet = FakeSlurm()
    assert Interruptions(off, quiet).handle(spot_event(REBALANCE, instance)) == []
    assert not [c for c in quiet.calls if c[0] == "update"]


def test_warnings_for_other_clusters_instances_are_not_ours(ec2, tmp_path) -> None:
    config = make_config(ec2, events_log=str(tmp_path / "events.jsonl"))
    slurm = FakeSlurm()
    assert Interruptions(config, slurm).handle(spot_event(SPOT_WARNING, "i-0123456789abcdef0")) == []
    assert not slurm.calls


def test_the_service_reads_the_queue_and_deletes_what_it_handled(ec2, tmp_path) -> None:
    import boto3

    sqs = boto3.client("sqs", region_name="us-east-1")
    url = sqs.create_queue(QueueName="interruptions")["QueueUrl"]
    config = make_config(ec2, events_log=str(tmp_path / "events.jsonl"), interruption_queue_url=url)
    slurm = FakeSlurm()
    instance = resume(config, ec2, slurm, "p5-spot-1").launched["p5-spot-1"]
    sqs.send_message(QueueUrl=url, MessageBody=json.dumps(spot_event(SPOT_WARNING, instance)))
    sqs.send_message(QueueUrl=url, MessageBody="not an event")  # left for SQS to deliver again, then its DLQ
    passes = iter(range(2))
    # Polls that do not wait: the messages are there, and a pass with none left would wait out SQS's long poll.
    serve(Interruptions(config, slurm, poll_seconds=0), sqs, stop=lambda: next(passes, None) is None)
    assert any(c[:3] == ("update", "nodename=p5-spot-1", "state=drain") for c in slurm.calls)
    left = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["ApproximateNumberOfMessages",
                                                                  "ApproximateNumberOfMessagesNotVisible"])
    assert sum(int(v) for v in left["Attributes"].values()) == 1  # the bad one only
