"""`gpucluster status`'s contract: the JSON document the head node prints (gpucluster/node/status_run.py) and the
operator's side reads back through Run Command (gpucluster/aws/status_remote.py), and its table. Standard library
only: the head imports this file from the bundle.

    {"cluster": C,
     "partitions": [{"name": P, "open": bool, "state": "UP"|"DOWN"|..., "why": "" | "budget: ..." | "quota: ..."}],
     "pools": {POOL: {NODE_STATE: count}},
     "jobs": {"running": N, "pending": N, "pending_reasons": {REASON: count}},
     "budget": null | {"limit_usd", "spent_usd", "forecast_usd" (null: none yet), "act_at_usd", "as_of" (epoch s)},
     "gpu_hours": null | {"used": H} (the team's GPU-hours this month),
     "quota": null | {"used_usd": $, "usd": $ | null (no quota)} (what the team's jobs billed against its money
              quota: Slurm's billing TRES, the account's GrpTRESMins=billing),
     "head": {"instance_id", "state"} (added by the operator's side: the head does not look itself up)}
"""

from __future__ import annotations

import json
import time
from typing import Any

# A node's one word per pool count, most telling first: a node both DOWN and POWERED_DOWN counts as down.
NODE_STATES = (("DOWN", "down"), ("DRAIN", "drained"), ("POWERING_UP", "booting"), ("POWERING_DOWN", "stopping"),
               ("POWERED_DOWN", "powered_down"), ("ALLOCATED", "busy"), ("MIXED", "busy"), ("COMPLETING", "busy"),
               ("IDLE", "idle"))
BUDGET_WHY = "budget"  # a partition the budget guardrail closed
QUOTA_WHY = "quota"  # the team's money quota is used up, or jobs of the partition wait on it
QUOTA_REASON = "AssocGrpBillingMinutes"  # Slurm's pending reason of a job that would bill past the account's quota
KEYS = ("cluster", "partitions", "pools", "jobs", "budget", "gpu_hours", "quota")


class StatusFormatError(ValueError):
    """The head's answer is no status document."""


def node_state(flags: frozenset[str]) -> str:
    """One word for a node's Slurm state and flags (`scontrol show nodes --json`)."""
    return next((word for flag, word in NODE_STATES if flag in flags), "other")


def status_from_json(text: str) -> dict[str, Any]:
    """The document, its keys checked; json's own errors are ValueErrors too."""
    document = json.loads(text)
    if not isinstance(document, dict):
        raise StatusFormatError("a JSON object expected")
    missing = [key for key in KEYS if key not in document]
    if missing:
        raise StatusFormatError(f"no {', '.join(missing)} in the status document")
    return document


def table(status: dict[str, Any]) -> list[str]:
    """The status for a person: one line per fact."""
    lines = [f"Cluster {status['cluster']}"]
    head = status.get("head")
    if head:
        lines.append(f"  head node   {head['instance_id']} {head['state']}")
    for partition in status["partitions"]:
        why = f" ({partition['why']})" if partition["why"] else ""
        lines.append(f"  partition   {partition['name']}: {'open' if partition['open'] else 'CLOSED'}{why}")
    for pool, states in sorted(status["pools"].items()):
        counts = ", ".join(f"{n} {state}" for state, n in sorted(states.items())) or "no nodes"
        lines.append(f"  pool        {pool}: {counts}")
    jobs = status["jobs"]
    reasons = ", ".join(f"{reason} {n}" for reason, n in sorted(jobs["pending_reasons"].items(),
                                                                 key=lambda item: (-item[1], item[0])))
    lines.append(f"  jobs        {jobs['running']} running, {jobs['pending']} pending"
                 f"{' (' + reasons + ')' if reasons else ''}")
    budget = status["budget"]
    if budget is None:
        lines.append("  budget      no guardrail (budget.act_threshold_percent is null), or no spend read yet")
    else:
        forecast = budget["forecast_usd"]
        as_of = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(budget["as_of"]))
        lines.append(f"  budget      ${budget['spent_usd']:,.2f} spent of ${budget['limit_usd']:,.2f} this month, "
                     f"forecast {'$' + format(forecast, ',.2f') if forecast is not None else 'not yet'}; the "
                     f"guardrail closes at ${budget['act_at_usd']:,.2f} (AWS Budgets, read {as_of})")
    hours, quota = status["gpu_hours"], status["quota"]
    if hours is None or quota is None:
        lines.append("  quota       unknown (sshare gave no row for the team's account)")
    else:
        of = f"of ${quota['usd']:,.2f} (the team's quota)" if quota["usd"] is not None else "(no quota)"
        lines.append(f"  quota       ${quota['used_usd']:,.2f} billed this month {of}; {hours['used']:,.1f} GPU-hours")
    return lines
