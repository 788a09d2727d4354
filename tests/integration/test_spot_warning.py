"""A spot interruption warning on the boot rehearsal's cluster (tests/local_cluster.py): EC2's event, as the stack's
EventBridge rule delivers it, lands in the head's queue (moto SQS) for a node running the 2-node DDP example. The
head's interruptions service drains the node, the job gets SIGUSR1 and checkpoints, is requeued (5 s later here), EC2
takes the instance, the reconciler gives the node back to service, and the job runs again on a fresh node, resuming
from the checkpoint's step rather than step 0."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from gpucluster.settings import EVENTS_LOG
from local_cluster import ROOT, LocalCluster

STEPS = 4000  # enough to be running when the warning comes; the whole run is a few seconds of training


def spot_warning(instance: str) -> str:
    return json.dumps({"version": "0", "id": "7e5e1b2a-0000-0000-0000-000000000001",
                       "detail-type": "EC2 Spot Instance Interruption Warning", "source": "aws.ec2",
                       "account": "123456789012", "time": "2026-11-30T16:00:00Z", "region": "us-east-1",
                       "resources": [f"arn:aws:ec2:us-east-1:123456789012:instance/{instance}"],
                       "detail": {"instance-id": instance, "instance-action": "terminate"}})


def test_a_spot_warning_checkpoints_requeues_and_resumes_on_a_fresh_node(cluster: LocalCluster) -> None:
    torchrun = Path(sys.executable).with_name("torchrun")
    env_path = f"{torchrun.parent}:{os.environ['PATH']}"
    checkpoints = cluster.root / "checkpoints"
    job = subprocess.run(
        ["sbatch", "--parsable", "-p", "spot", "--gpus-per-node=1", "--output", str(cluster.root / "ex-%j.out"),
         "--export", f"ALL,PATH={env_path},CHECKPOINT_DIR={checkpoints}", str(ROOT / "examples" / "ddp.sbatch"),
         "--steps", str(STEPS), "--checkpoint-every", str(10 * STEPS)],  # only the signal makes a checkpoint
        cwd=ROOT, env=cluster.env, check=True, capture_output=True, text=True).stdout.strip()
    output = cluster.root / f"ex-{job}.out"
    cluster.wait(f"job {job} to train", lambda: output.exists() and "step 0 " in output.read_text(), 240)
    node = cluster.run("squeue", "-h", "-j", job, "-o", "%N").strip().split(",")[0]
    node = cluster.run("scontrol", "show", "hostnames", node).split()[0]
    instance = cluster.instances()[node]

    cluster.aws("sqs").send_message(QueueUrl=cluster.interruptions, MessageBody=spot_warning(instance))
    cluster.wait("the checkpoint the signal asks for", lambda: "(signalled)" in output.read_text(), 60)
    step = int(re.search(r"checkpoint at step (\d+) \(signalled\)", output.read_text()).group(1))  # type: ignore[union-attr]
    assert 0 < step < STEPS
    reason = cluster.run("sinfo", "-h", "-R", "-n", node, "-o", "%E")
    assert f"gpucluster: replace: spot interruption warning for {instance}" in reason, reason
    cluster.wait(f"job {job} to be requeued", lambda: "Restarts=1" in cluster.run("scontrol", "show", "job", job), 60)

    # EC2 reclaims the instance two minutes after its warning; the reconciler then gives the node a fresh start.
    cluster.ec2().terminate_instances(InstanceIds=[instance])
    cluster.wait(f"{node} to be replaced", lambda: "replace" in cluster.reconcile(), 60)
    cluster.wait(f"job {job} to complete", lambda: cluster.job_state(job) == "COMPLETED", 300)
    text = output.read_text()
    assert f"resumed from {checkpoints}/step-{step} at step {step}" in text, text[-3000:]
    assert instance not in cluster.instances().values()
    events = [json.loads(line)["event"] for line in cluster.head.path(EVENTS_LOG).read_text().splitlines()]
    assert events[:2] == ["spot interruption warning", "requeued"] and "replaced" in events, events
