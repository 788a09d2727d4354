"""`gpucluster status` on the head node: the cluster as its Slurm and its budget guardrail see it, as one JSON document
(gpucluster.contract.status) or a table. Run Command's `<cluster>-status-command` runs it as root for
`gpucluster status STACK` on the operator's machine (gpucluster/aws/status_remote.py).

- partitions: open or closed, and why: closed by the budget guardrail (its state file says which it closed and
  why), closed otherwise (an admin's scontrol), or open in Slurm but starting nothing because the team's money
  quota is used up (the account's GrpTRESMins=billing, which Slurm enforces: its jobs pend), or with jobs whose time
  limit does not fit in what is left of it (AssocGrpBillingMinutes);
- nodes per pool by state; jobs running and pending, with Slurm's pending reasons counted;
- the month's spend, budget and forecast as the guardrail last read them from AWS Budgets (its textfile for the
  cost board: this program makes no AWS call, so it needs no credentials and answers in a second);
- what the team's jobs billed against the quota, and its GPU-hours, live from sshare.

Standard library only: the head runs it from the bundle.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from gpucluster.contract.settings import BUDGET_TEXTFILE, TEXTFILE_DIR, ClusterSettings
from gpucluster.contract.slurm_json import account_row, billing_usd
from gpucluster.contract.status import BUDGET_WHY, QUOTA_REASON, QUOTA_WHY, node_state, table
from gpucluster.node.budget import GuardrailState
from gpucluster.node.slurm_control import SlurmControl

EXIT_FAILED = 1


def usd(billing_minutes: float) -> float:
    """The document's dollars, to the cent."""
    return round(billing_usd(billing_minutes), 2)


def budget_figures(textfile: Path, act_threshold_percent: float) -> dict[str, Any] | None:
    """The budget as the guardrail last published it (budget_guardrail.publish_spend); None before its first read."""
    try:
        text, as_of = textfile.read_text(), textfile.stat().st_mtime
    except FileNotFoundError:
        return None
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name.startswith("gpucluster_budget_") and name.endswith("_usd"):
            values[name.removeprefix("gpucluster_budget_").removesuffix("_usd")] = float(value)
    if "limit" not in values or "actual" not in values:
        return None
    return {"limit_usd": values["limit"], "spent_usd": values["actual"], "forecast_usd": values.get("forecast"),
            "act_at_usd": values["limit"] * act_threshold_percent / 100, "as_of": as_of}


def collect(settings: ClusterSettings, slurm: SlurmControl, textfile_dir: Path = Path(TEXTFILE_DIR)) -> dict[str, Any]:
    """The status document (contract.status) from Slurm, the guardrail's state and its published spend."""
    team = account_row(slurm.account_usage(settings.team), settings.team) if settings.team else None
    limit = None if team is None else team.quota_billing_minutes
    gpu_hours = None if team is None else {"used": round(team.gpu_minutes / 60, 2)}
    quota = None if team is None else {"used_usd": usd(team.billing_minutes),
                                       "usd": None if limit is None else usd(limit)}
    quota_spent = team is not None and limit is not None and team.billing_minutes >= limit
    jobs = slurm.queue()
    pending = [job for job in jobs if job.pending]
    # AccountingStorageEnforce=safe starts a job only if its time limit at its billing fits in what is left of the
    # quota: jobs wait on it (AssocGrpBillingMinutes) long before it is all spent. A job may name several partitions.
    on_quota = Counter(name for job in pending if job.reason == QUOTA_REASON for name in job.partition.split(","))
    guard = GuardrailState.load(Path(settings.budget_state_file))
    partitions = []
    for name, state in sorted(slurm.partitions().items()):
        if state != "UP":
            why = (f"{BUDGET_WHY}: {guard.reason}" if guard.closed and name in guard.partitions
                   else f"{state} by an admin (scontrol), not by the budget guardrail")
        elif quota_spent and quota is not None:
            why = (f"{QUOTA_WHY}: the team's jobs billed ${quota['used_usd']:,.2f} of its ${quota['usd']:,.2f} this "
                   "month; its jobs pend until the month ends or the quota (budget.quota_usd_per_month) is raised")
        elif on_quota[name]:
            left = (f"the ${usd(limit - team.billing_minutes):,.2f} left of the team's ${usd(limit):,.2f}"
                    if team is not None and limit is not None else "what is left of the team's quota")
            why = (f"{QUOTA_WHY}: {on_quota[name]} job(s) wait ({QUOTA_REASON}): their time limit at the partition's "
                   f"price is more than {left} this month; a job with a shorter --time still starts")
        else:
            why = ""
        partitions.append({"name": name, "open": not why, "state": state, "why": why})
    pools: dict[str, Counter[str]] = {pool: Counter() for pool in settings.pools}
    for node in slurm.nodes():
        if pool := settings.pool_of(node.name):
            pools[pool][node_state(node.state)] += 1
    budget = (budget_figures(textfile_dir / BUDGET_TEXTFILE, settings.budget.act_threshold_percent)
              if settings.budget else None)
    return {"cluster": settings.cluster, "partitions": partitions,
            "pools": {pool: dict(sorted(counts.items())) for pool, counts in sorted(pools.items())},
            "jobs": {"running": sum(job.active for job in jobs), "pending": len(pending),
                     "pending_reasons": dict(Counter(job.reason or "None" for job in pending).most_common())},
            "budget": budget, "gpu_hours": gpu_hours, "quota": quota}


def run(as_json: bool, settings: ClusterSettings | None = None) -> int:
    """Print the status; 1 with the reason when Slurm does not answer."""
    settings = settings or ClusterSettings.load()
    try:
        status = collect(settings, SlurmControl(settings.scontrol))
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        print(f"status: Slurm did not answer: {exc}", file=sys.stderr)
        return EXIT_FAILED
    print(json.dumps(status, indent=1) if as_json else "\n".join(table(status)))
    return 0

