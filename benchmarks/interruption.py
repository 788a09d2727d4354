"""Our own time between EC2's spot warning and the node drained with its jobs signalled, and the Prolog's added time
per job (the health check's fast part).

    python benchmarks/interruption.py

The warning: the interruptions service handles an event from a queue on a moto server in this process, for a node of
a registry of 1024 nodes, with Slurm's scontrol and scancel replaced by stand-ins that answer at once (their own time
is Slurm's, not ours). The Prolog: the health check's `prolog` checks with a stand-in nvidia-smi that answers at
once (a real one takes its own time, about 0.1 to 0.5 s on an 8-GPU node), run as Slurm runs it: a fresh process.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import boto3
from moto.server import ThreadedMotoServer

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from gpucluster.contract.settings import ClusterSettings, PoolSettings  # noqa: E402
from gpucluster.node.interruptions import SPOT_WARNING, Interruptions  # noqa: E402
from gpucluster.node.slurm_control import SlurmControl  # noqa: E402

TARGET_WARNING_SECONDS = 5.0  # warning received -> node drained, jobs signalled (the requeue follows the grace)
TARGET_PROLOG_SECONDS = 2.0  # added to every job's start
NODES = 1024


class InstantSlurm(SlurmControl):
    """scontrol and scancel that answer at once; a job on every node."""

    def _run(self, *args: str) -> str:
        return ""

    def jobs_on(self, name: str) -> list[str]:
        return ["41"]

    def signal_job(self, job: str, signal_name: str) -> None:
        pass


def warning_seconds() -> list[float]:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    sqs = boto3.client("sqs", region_name="us-east-1", endpoint_url=f"http://{host}:{port}",
                       aws_access_key_id="t", aws_secret_access_key="t")
    url = sqs.create_queue(QueueName="interruptions")["QueueUrl"]
    work = Path(tempfile.mkdtemp(prefix="interruption-bench-"))
    registry = work / "instances.json"
    registry.write_text(json.dumps({"instances": {f"p5-spot-{i}": {"instance": f"i-{i:017x}", "launched": 0}
                                                  for i in range(1, NODES + 1)}, "failures": {}}))
    config = ClusterSettings(cluster="bench", region="us-east-1", pools={"p5-spot": PoolSettings(
        "p5-spot", "lt-1", "subnet-1", "p5.48xlarge", "spot", max_nodes=NODES)}, registry_file=str(registry),
        log_file=str(work / "nodes.log"), events_log=str(work / "events.jsonl"), interruption_queue_url=url)
    service = Interruptions(config, InstantSlurm())
    times = []
    for i in range(1, 21):
        event = {"detail-type": SPOT_WARNING, "time": "2026-11-30T16:00:00Z",
                 "detail": {"instance-id": f"i-{i * 37:017x}", "instance-action": "terminate"}}
        sqs.send_message(QueueUrl=url, MessageBody=json.dumps(event))
        start = time.perf_counter()
        (message,) = sqs.receive_message(QueueUrl=url, WaitTimeSeconds=1)["Messages"]
        assert service.handle(json.loads(message["Body"])) == [f"p5-spot-{i * 37}"]
        sqs.delete_message(QueueUrl=url, ReceiptHandle=message["ReceiptHandle"])
        times.append(time.perf_counter() - start)
    server.stop()
    return times


def prolog_seconds() -> list[float]:
    work = Path(tempfile.mkdtemp(prefix="prolog-bench-"))
    (work / "bin").mkdir()
    smi = work / "bin" / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + "".join(f'echo "{i}, 0"\n' for i in range(8)))
    smi.chmod(0o755)
    # What the Prolog runs before the node names (whose wait depends on the other nodes' registration, not on us).
    program = ("from gpucluster.node import health as h; from gpucluster.contract.settings import "
               "PoolSettings; h.check(PoolSettings('p5', 'lt', 's', 'p5.48xlarge', 'spot', accelerator='nvidia', "
               "accelerators=8), 'prolog')")
    env = {**os.environ, "PATH": f"{work / 'bin'}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT)}
    times = []
    for _ in range(10):
        start = time.perf_counter()
        subprocess.run(["/usr/bin/python3", "-c", program], env=env, check=True)
        times.append(time.perf_counter() - start)
    return times


def main() -> int:
    warning, prolog = warning_seconds(), prolog_seconds()
    print(f"spot warning -> drained and signalled, {NODES}-node registry: median {statistics.median(warning):.3f} s, "
          f"max {max(warning):.3f} s (target under {TARGET_WARNING_SECONDS} s)")
    print(f"Prolog health check, fresh process: median {statistics.median(prolog):.3f} s, max {max(prolog):.3f} s "
          f"(target under {TARGET_PROLOG_SECONDS} s)")
    return 0 if max(warning) < TARGET_WARNING_SECONDS and max(prolog) < TARGET_PROLOG_SECONDS else 1


if __name__ == "__main__":
    sys.exit(main())
