"""Submit-to-running latency of a 2-node job on powered-down nodes, in the local Slurm cluster of the tests
(real slurmctld, slurmd, slurmdbd, munge; EC2 in moto), split into the resume program's own time and the rest.

    python benchmarks/submit_to_running.py [--runs 3]

"rest" is Slurm scheduling, the harness's simulated boot (local_cluster.BOOT_SECONDS; a real instance boots in
minutes) and slurmd registration. Needs root and the packages `make test` installs. For comparison,
ParallelCluster's own baseline is a median of 294 s to a running job on a cold dynamic node, most of it EC2 boot.
"""

from __future__ import annotations

import argparse
import logging
import re
import shutil
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
from gpucluster.contract import settings  # noqa: E402
from gpucluster.spec.model import load_stack  # noqa: E402
from local_cluster import BOOT_SECONDS, LocalCluster  # noqa: E402

STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) gpucluster-node\[\d+\] INFO (resume|node) ")


def resume_seconds(log: Path) -> float:
    """From the resume program's first line to its last 'node X is ...' line."""
    times = [datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f") for line in log.read_text().splitlines()
             if (m := STAMP.match(line))]
    return (max(times) - min(times)).total_seconds()


def one_run() -> tuple[float, float]:
    root = Path(tempfile.mkdtemp(prefix="gpucluster-bench-"))
    cluster = LocalCluster(load_stack(ROOT / "tests" / "stacks" / "Pulumi.local.yaml"), root).start()
    try:
        start = time.monotonic()
        job = cluster.run("sbatch", "--parsable", "-p", "standby", "-N", "2", "-o", "/dev/null", "--wrap",
                          "sleep 5").strip()
        cluster.wait("job running", lambda: cluster.job_state(job) in ("RUNNING", "COMPLETED"), 120)
        total = time.monotonic() - start
        return total, resume_seconds(cluster.head.path(settings.NODE_LOG))
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    logging.disable(logging.CRITICAL)
    runs = [one_run() for _ in range(args.runs)]
    print(f"{'run':>3} {'submit->running s':>18} {'resume program s':>17} {'rest s':>7}")
    for i, (total, resume) in enumerate(runs, 1):
        print(f"{i:3d} {total:18.2f} {resume:17.2f} {total - resume:7.2f}")
    totals, ours = [r[0] for r in runs], [r[1] for r in runs]
    print(f"median: {statistics.median(totals):.2f} s to running, of which the resume program "
          f"{statistics.median(ours):.2f} s (simulated boot {BOOT_SECONDS:.0f} s)")


if __name__ == "__main__":
    main()
