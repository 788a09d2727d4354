"""The DDP example's checkpoints (examples/ddp_train.py), with torchrun on the CPU (gloo), two ranks: a run resumed
from its newest checkpoint ends with exactly the weights of a run that was never interrupted (model, optimizer and
every rank's RNG state are restored), half-written checkpoints are never resumed from, and SIGUSR1 to any one rank
makes all ranks checkpoint at the next step."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT
from local_cluster import free_port

# Real torchrun processes for tens of seconds, like the local clusters: the rehearsal lane (tests/lanes.py).
pytestmark = pytest.mark.rehearsal

TRAIN = ROOT / "examples" / "ddp_train.py"


def torchrun(directory: Path, *args: str) -> subprocess.Popen[str]:
    command = [str(Path(sys.executable).with_name("torchrun")), "--nproc-per-node=2", f"--master-port={free_port()}",
               str(TRAIN), "--checkpoint-dir", str(directory), *args]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finished(directory: Path, *args: str) -> str:
    run = torchrun(directory, *args)
    output, _ = run.communicate(timeout=300)
    assert run.returncode == 0, output[-3000:]
    return output


def weights(output: str) -> set[str]:
    return set(re.findall(r"weights ([0-9a-f]{16})", output))  # two ranks print at once: lines may run together


def test_a_resumed_run_ends_where_an_uninterrupted_one_does(tmp_path: Path) -> None:
    straight = finished(tmp_path / "straight", "--steps", "150", "--checkpoint-every", "1000")
    first = finished(tmp_path / "resumed", "--steps", "100", "--checkpoint-every", "30")
    assert sorted(p.name for p in (tmp_path / "resumed").iterdir()) == ["step-60", "step-90"]  # the newest two
    (tmp_path / "resumed" / "step-95.tmp").mkdir()  # a checkpoint whose writing was cut short
    second = finished(tmp_path / "resumed", "--steps", "150", "--checkpoint-every", "30")
    assert f"resumed from {tmp_path / 'resumed' / 'step-90'} at step 90" in second, second[-2000:]
    assert len(weights(straight)) == 1 and weights(second) == weights(straight) != weights(first)


def test_usr1_to_one_rank_makes_every_rank_checkpoint(tmp_path: Path) -> None:
    run = torchrun(tmp_path, "--steps", "100000000", "--checkpoint-every", "100000000")
    try:
        assert run.stdout is not None
        seen = ""
        while "step 0 " not in seen:
            seen += run.stdout.readline()
            assert run.poll() is None, seen
        # One worker (a child of torchrun running the script) gets the signal, as srun delivers it to a task.
        workers = subprocess.run(["pgrep", "-P", str(run.pid), "-f", str(TRAIN)], capture_output=True,
                                 text=True).stdout.split()
        assert len(workers) == 2, workers
        subprocess.run(["kill", "-USR1", workers[1]], check=True)
        deadline = time.monotonic() + 60
        while "(signalled)" not in seen and time.monotonic() < deadline:
            seen += run.stdout.readline()
        signalled = re.search(r"checkpoint at step (\d+) \(signalled\)", seen)
        assert signalled, seen[-2000:]
        step = int(signalled.group(1))
        assert sorted(p.name for p in (tmp_path / f"step-{step}").iterdir()) == ["rank-0.pt", "rank-1.pt"]
        assert run.poll() is None  # it trains on: the cluster, not the job, decides when it stops
    finally:
        run.send_signal(signal.SIGTERM)
        run.wait(timeout=60)
