#!/usr/bin/python3
"""The figures no exporter has, for node_exporter's textfile collector (settings.METRICS_PROGRAM into TEXTFILE_DIR).

`metrics.py head` (gpucluster-metrics.service on the head, as root): Slurm's nodes by state, jobs by
partition and state, the team's GPU time this month against its quota and each person's part of it (Slurm's own
account of them: the associations' GrpTRESRaw and GrpTRESMins for gres/gpu, reset monthly), each pool's price of a
GPU-hour (for the cost board).
`metrics.py compute` (on every compute node): EFA's hardware byte counters per device and the Lustre
client's bytes read and written. Every INTERVAL_SECONDS, into one file by rename, so a scrape never sees half of it.
A source that fails (slurmctld restarting, no Lustre yet) leaves its figures out for that round, with a log line.

Standard library only.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the library this program is part of (the bundle's lib/)
from gpucluster.contract import slurm_json
from gpucluster.contract.settings import LOGIN_USER, TEXTFILE_DIR, ClusterSettings
from gpucluster.node.slurm_control import SlurmControl
from gpucluster.node.textfile import family, sample, write

INTERVAL_SECONDS = 30  # prometheus.SCRAPE_SECONDS
COMMAND_SECONDS = 30
OUTPUT = "gpucluster.prom"
log = logging.getLogger("gpucluster-metrics")

# A node's state as one word, first match wins: what a person looking at the cluster asks first.
NODE_STATES = (("down", {"DOWN"}), ("fail", {"FAIL"}), ("drained", {"DRAIN", "IDLE"}), ("draining", {"DRAIN"}),
               ("powering_up", {"POWERING_UP"}), ("powering_down", {"POWERING_DOWN"}),
               ("powered_down", {"POWERED_DOWN"}), ("allocated", {"ALLOCATED"}), ("mixed", {"MIXED"}),
               ("completing", {"COMPLETING"}), ("idle", {"IDLE"}))
# A job's state as one word, first match wins; jobs that have ended are not counted.
JOB_STATES = (("completing", {"COMPLETING"}), ("configuring", {"CONFIGURING"}), ("pending", {"PENDING"}),
              ("running", {"RUNNING"}), ("suspended", {"SUSPENDED"}))


def first_state(table: tuple[tuple[str, set[str]], ...], flags: frozenset[str]) -> str | None:
    """The word of the table's first entry whose flags Slurm's state has."""
    return next((word for word, needed in table if needed <= flags), None)


def node_state(flags: frozenset[str]) -> str:
    return first_state(NODE_STATES, flags) or "unknown"


def slurm_nodes(nodes: list[slurm_json.Node], settings: ClusterSettings) -> str:
    samples = [sample("gpucluster_slurm_node_state", 1, node=n.name, pool=settings.pool_of(n.name),
                      state=node_state(n.state)) for n in nodes]
    return family("gpucluster_slurm_node_state", "gauge", "1 for each Slurm node, labelled with its state.", samples)


def slurm_jobs(jobs: list[slurm_json.Job]) -> str:
    counts = Counter((job.partition, word) for job in jobs if (word := first_state(JOB_STATES, job.state)))
    samples = [sample("gpucluster_slurm_jobs", n, partition=p, state=s) for (p, s), n in sorted(counts.items())]
    return family("gpucluster_slurm_jobs", "gauge", "Jobs by partition and state.", samples)


def gpu_hours(sshare_output: str, account: str, users: tuple[str, ...]) -> str:
    """From SlurmControl.account_usage(ACCOUNT): the account's own row for the team's GPU time and its money quota,
    and the rows of `users` under it (each person's association) for each one's GPU time. Only `users`: the label's
    values stay the stack's people."""
    team = slurm_json.account_row(sshare_output, account)
    if team is None:
        return ""
    people = [sample("gpucluster_person_gpu_used_seconds", row.gpu_minutes * 60, user=row.user)
              for row in slurm_json.account_rows(sshare_output) if row.account == account and row.user in users]
    text = family("gpucluster_gpu_used_seconds", "gauge", "GPU time the team used this month (Slurm).",
                  [sample("gpucluster_gpu_used_seconds", team.gpu_minutes * 60)])
    text += family("gpucluster_quota_used_usd", "gauge", "What the team's jobs billed this month (Slurm).",
                   [sample("gpucluster_quota_used_usd", slurm_json.billing_usd(team.billing_minutes))])
    if team.quota_billing_minutes is not None:
        text += family("gpucluster_quota_usd", "gauge", "The team's monthly money quota for jobs.",
                       [sample("gpucluster_quota_usd", slurm_json.billing_usd(team.quota_billing_minutes))])
    return text + family("gpucluster_person_gpu_used_seconds", "gauge",
                         "GPU time each of the stack's people (and the login user) used this month (Slurm).", people)


def pool_prices(settings: ClusterSettings) -> str:
    samples = [sample("gpucluster_pool_gpu_hour_usd", p.node_hour_usd / p.accelerators, pool=name)
               for name, p in sorted(settings.pools.items()) if p.accelerators and p.node_hour_usd]
    return family("gpucluster_pool_gpu_hour_usd", "gauge", "The plan's price of one accelerator-hour in the pool.",
                  samples)


def efa_bytes(sys_root: Path = Path("/")) -> str:
    """EFA devices' hw_counters (rx_bytes, tx_bytes) under /sys/class/infiniband."""
    samples: dict[str, list[str]] = {"rx": [], "tx": []}
    for counter in sorted((sys_root / "sys/class/infiniband").glob("*/ports/*/hw_counters/[rt]x_bytes")):
        device, port = counter.parents[3].name, counter.parents[1].name
        direction = counter.name[:2]
        samples[direction].append(sample(f"gpucluster_efa_{direction}_bytes_total",
                                         float(counter.read_text().strip()), device=device, port=port))
    return "".join(family(f"gpucluster_efa_{d}_bytes_total", "counter",
                          f"EFA bytes {'received' if d == 'rx' else 'sent'}.", samples[d]) for d in ("rx", "tx"))


def lustre_bytes(lctl_output: str) -> str:
    """From `lctl get_param llite.*.stats`: read_bytes and write_bytes lines end with their sum."""
    totals: dict[str, dict[str, float]] = {"read": {}, "write": {}}
    mount = ""
    for line in lctl_output.splitlines():
        if line.startswith("llite.") and line.rstrip().endswith("stats="):
            mount = line.split(".")[1].rsplit("-", 1)[0]  # llite.<fsname>-<superblock>.stats=
        fields = line.split()
        if fields and fields[0] in ("read_bytes", "write_bytes") and fields[-1].isdigit():
            kind = fields[0].split("_")[0]
            totals[kind][mount] = totals[kind].get(mount, 0) + float(fields[-1])
    return "".join(family(f"gpucluster_lustre_{kind}_bytes_total", "counter", f"Bytes the Lustre client {kind}.",
                          [sample(f"gpucluster_lustre_{kind}_bytes_total", v, fs=m)
                           for m, v in sorted(totals[kind].items())])
                   for kind in ("read", "write"))


def command(*args: str) -> str:
    return subprocess.run(list(args), check=True, capture_output=True, text=True, timeout=COMMAND_SECONDS).stdout


def head_figures(settings: ClusterSettings, slurm: SlurmControl | None = None) -> str:
    slurm = slurm or SlurmControl(settings.scontrol, COMMAND_SECONDS)
    people = (*settings.accounts, LOGIN_USER)
    readers: tuple[tuple[str, Callable[[SlurmControl], str]], ...] = (
        ("scontrol show nodes", lambda s: slurm_nodes(s.nodes(), settings)),
        ("scontrol show jobs", lambda s: slurm_jobs(s.queue())),
        ("sshare", lambda s: gpu_hours(s.account_usage(settings.team), settings.team, people)),
    )
    parts = [pool_prices(settings)]
    for name, read in readers:
        try:
            parts.append(read(slurm))
        except (OSError, subprocess.SubprocessError, ValueError) as exc:
            log.warning("%s failed: %s", name, exc)
    return "".join(parts)


def compute_figures() -> str:
    parts = [efa_bytes()]
    try:
        parts.append(lustre_bytes(command("lctl", "get_param", "llite.*.stats")))
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("Lustre client statistics: %s", exc)
    return "".join(parts)


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(levelname)s %(message)s", stream=sys.stderr)
    if argv[1:] not in (["head"], ["compute"]):
        print("usage: metrics.py head|compute", file=sys.stderr)
        return 2
    while True:  # the head's settings anew each round: a later `pulumi up` may add pools
        write(head_figures(ClusterSettings.load()) if argv[1] == "head" else compute_figures(), Path(TEXTFILE_DIR),
              OUTPUT)
        time.sleep(INTERVAL_SECONDS)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
