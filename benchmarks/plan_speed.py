"""How long `python -m gpucluster plan` takes in a cold process (interpreter start and imports included), and its peak
memory, for the team-a stack and for a generated stack of 64 pools.

    python benchmarks/plan_speed.py [--runs N]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
TYPES = ["p5.48xlarge", "p4d.24xlarge", "p5en.48xlarge", "g6e.12xlarge", "trn1.32xlarge", "g6.xlarge",
         "p6-b200.48xlarge"]


def many_pools_stack(directory: Path, pools: int) -> Path:
    doc = yaml.safe_load((ROOT / "stacks" / "Pulumi.team-a.yaml").read_text())
    cluster = doc["config"]["gpucluster:cluster"]
    cluster["pools"] = [
        {"name": f"pool{i}", "instance_type": TYPES[i % len(TYPES)], "capacity": "spot" if i % 2 else "on-demand",
         "max_nodes": 4}
        for i in range(pools)
    ]
    path = directory / f"Pulumi.bench-{pools}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def measure(stack: str, runs: int) -> tuple[list[float], int, int]:
    """Wall seconds of each run, the resources declared, and the peak RSS (KiB) of the slowest child."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "gpucluster", "plan", stack, "--json"], cwd=ROOT,
                             capture_output=True, text=True, check=True)
        times.append(time.perf_counter() - start)
    resources = len(json.loads(out.stdout)["resources"])
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return times, resources, peak_kib


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cases = [("team-a", "team-a"), ("64 pools", str(many_pools_stack(Path(tmp), 64)))]
        print(f"{'stack':10} {'resources':>9} {'median s':>9} {'min s':>7} {'max s':>7} {'peak RSS MiB':>13}")
        for label, stack in cases:
            times, resources, peak = measure(stack, args.runs)
            print(f"{label:10} {resources:9d} {statistics.median(times):9.2f} {min(times):7.2f} {max(times):7.2f} "
                  f"{peak / 1024:13.0f}")
    print(f"({args.runs} cold runs each, {sys.version.split()[0]}; peak RSS is the largest child so far)")


if __name__ == "__main__":
    main()
