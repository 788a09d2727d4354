"""The Kubernetes flavour's first job survives losing its rendezvous host, run for real: two "pods" (the job's own
bash command from gpucluster/render/kube.py example_job, on this machine's CPU torch) lose index 0, whose store the
c10d rendezvous is, and the survivor rejoins its replacement and resumes from the checkpoint. In the rehearsal lane:
real processes for tens of seconds, like the local clusters, not a unit test.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from conftest import ROOT
from gpucluster.render import kube
from gpucluster.spec.model import load_stack
from local_cluster import free_port
from test_kube_example_job import TEAM_K8S, job_of, torchrun_args, trainer

pytestmark = pytest.mark.rehearsal


# Every pod's output goes through this: a test waits on it for what any of them printed.
OUTPUT = threading.Condition()


def wait_until(predicate: Callable[[], bool], timeout: float = 180) -> None:
    with OUTPUT:
        assert OUTPUT.wait_for(predicate, timeout)


class Pod:
    """One pod of the job, run here: the container's own bash command with what only the cluster has put on this
    machine (index 0's DNS name as 127.0.0.1, one CPU process instead of a GPU per process, the script's and the
    claim's paths, each pod's own torchrun log), in its own session so that it can be killed whole like a lost node."""

    def __init__(self, command: str, index: int, tmp: Path) -> None:
        env = dict(os.environ, JOB_COMPLETION_INDEX=str(index), JOB_UID="uid-1",
                   PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
        log = tmp / f"torchrun-{index}-{id(self)}.log"
        self.process = subprocess.Popen(["bash", "-c", command.replace("/tmp/torchrun.log", str(log))], env=env,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        start_new_session=True)
        self.output = ""
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            with OUTPUT:
                self.output += line
                OUTPUT.notify_all()

    def kill(self) -> None:
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=60)

    def finished(self) -> int:
        return self.process.wait(timeout=300)


@pytest.fixture
def pods(tmp_path: Path) -> Iterator[list[Pod]]:
    started: list[Pod] = []
    yield started
    for pod in started:
        if pod.process.poll() is None:
            pod.kill()


def test_the_survivor_rejoins_index_0s_replacement_and_resumes(tmp_path: Path, pods: list[Pod]) -> None:
    stack = load_stack(TEAM_K8S)
    pool = kube.example_pool(stack)
    job = job_of(stack, pool)
    endpoint = torchrun_args(job)["rdzv-endpoint"]
    command = (trainer(job)["command"][-1]
               .replace(endpoint, f"127.0.0.1:{free_port()}")
               .replace(f"--nproc-per-node={pool.accelerator.count}", "--nproc-per-node=1")
               .replace("/opt/example/ddp_train.py", str(ROOT / "examples" / "ddp_train.py"))
               .replace("/fsx/", f"{tmp_path}/fsx/")
               .replace(' 2>&1 |', " --steps 1000 --checkpoint-every 100 2>&1 |"))
    pods += [Pod(command, 0, tmp_path), Pod(command, 1, tmp_path)]
    wait_until(lambda: any("checkpoint at step 100 " in p.output for p in pods))
    pods[0].kill()  # index 0's node is gone, and the rendezvous' store with it
    survivor = pods[1]
    wait_until(lambda: "RendezvousConnectionError" in survivor.output)  # its torchrun lost the store ...
    assert survivor.process.poll() is None  # ... and the pod did not fail: it waits for index 0's replacement
    pods.append(Pod(command, 0, tmp_path))
    assert [pods[2].finished(), survivor.finished()] == [0, 0], pods[2].output[-3000:] + survivor.output[-3000:]
    both = pods[2].output + survivor.output
    resumed = re.search(r"resumed from \S+/step-(\d+) at step (\d+)", both)
    assert resumed and int(resumed.group(2)) >= 100, both[-3000:]
    assert (tmp_path / "fsx" / "checkpoints" / "ddp-example-uid-1").is_dir()
    digests = set(re.findall(r"weights ([0-9a-f]{16})", both))
    assert len(digests) == 1 and re.search(r"rank \d/2 ", both)  # two ranks again, in step
