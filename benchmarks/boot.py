"""What a node's boot does, per role, measured in the boot rehearsal (tests/local_cluster.py): the head and two compute
nodes boot from their user data through gpucluster-boot.service, fetch_bundle.py and bootstrap.py.

    python benchmarks/boot.py

Per node: AWS API calls (counted at its own AWS endpoint), package installs and internet downloads its boot ran
(commands in its boot log), and our own wall time: from fetch_bundle.py's first line to "bootstrap ... done". The
Slurm daemons' start-up is inside that time; EC2's boot and the image's own start-up are not.
Targets on the node image: 0 installs, 0 internet downloads, at most 3 AWS calls per compute node, under 5 s of our
own time. Needs root and the packages `make test` installs.
"""

from __future__ import annotations

import logging
import re
import shutil
import sys
import tempfile
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
from gpucluster.contract import settings  # noqa: E402
from gpucluster.spec.model import load_stack  # noqa: E402
from local_cluster import LocalCluster, RehearsalNode  # noqa: E402

STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
INSTALLS = re.compile(r"\$ ((apt-get|apt|dpkg|pip\S*) .*\binstall\b|bash \S*build_image\.sh)")
DOWNLOADS = re.compile(r"\$ (curl|wget|git clone)\b")
TARGETS = {"installs": 0, "downloads": 0, "aws_calls": 3, "seconds": 5.0}


def measure(node: RehearsalNode, calls: list[str]) -> dict[str, Any]:
    log = node.path(settings.BOOT_LOG).read_text().splitlines()
    times = [datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f") for line in log if (m := STAMP.match(line))]
    done = [line for line in log if "bootstrap" in line and line.endswith(" done")]
    return {"installs": sum(bool(INSTALLS.search(line)) for line in log),
            "downloads": sum(bool(DOWNLOADS.search(line)) for line in log),
            "aws_calls": len(calls), "calls": dict(Counter(calls)),
            "seconds": (max(times) - min(times)).total_seconds(), "done": bool(done)}


def main() -> int:
    logging.disable(logging.CRITICAL)
    root = Path(tempfile.mkdtemp(prefix="gpucluster-boot-"))
    cluster = LocalCluster(load_stack(ROOT / "tests" / "stacks" / "Pulumi.local.yaml"), root).start()
    try:
        job = cluster.run("sbatch", "--parsable", "-p", "standby", "-N", "2", "-o", "/dev/null", "--wrap",
                          "srun true").strip()
        cluster.wait("the 2-node job", lambda: cluster.job_state(job) == "COMPLETED", 240)
        rows = {"head": measure(cluster.head, [a for w, a in cluster.calls if w == "head" and not a.startswith(
            ("CreateFleet", "DescribeInstances", "CreateTags", "Receive", "DescribeBudget", "Publish"))])}
        rows |= {f"compute {i}": measure(node, [a for w, a in cluster.calls if w == instance])
                 for i, (instance, node) in enumerate(sorted(cluster.nodes.items()), 1)}
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
    print(f"{'node':<10} {'installs':>8} {'downloads':>9} {'AWS calls':>9} {'our s':>6}  calls")
    for name, row in rows.items():
        print(f"{name:<10} {row['installs']:>8} {row['downloads']:>9} {row['aws_calls']:>9} {row['seconds']:>6.2f}  "
              f"{row['calls']}")
    compute = [r for n, r in rows.items() if n.startswith("compute")]
    ok = all(r["done"] and all(r[k] <= TARGETS[k] for k in TARGETS) for r in compute)
    print(f"targets per compute node: {TARGETS}: {'met' if ok else 'NOT met'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
