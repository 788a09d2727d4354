"""`python -m gpucluster cost STACK`: this month's spend by the stack's tag, the forecast, the budget, and (on the head
node) GPU-hours per Slurm account against the team's quota."""

from __future__ import annotations

import datetime as dt
import shutil
import subprocess
from dataclasses import dataclass
from typing import Any

from gpucluster import cost
from gpucluster.cost import COST_TAG
from gpucluster.spec import Stack


@dataclass(frozen=True)
class Spend:
    month_to_date: float | None
    forecast: float | None  # the whole month: spend so far plus Cost Explorer's forecast for the rest
    notes: list[str]


def month_bounds(today: dt.date) -> tuple[dt.date, dt.date]:
    start = today.replace(day=1)
    end = (start + dt.timedelta(days=32)).replace(day=1)
    return start, end


def _tag_filter(stack: Stack) -> dict[str, Any]:
    return {"Tags": {"Key": COST_TAG, "Values": [stack.name], "MatchOptions": ["EQUALS"]}}


def spend(ce: Any, stack: Stack, today: dt.date) -> Spend:
    """Month to date and forecast from Cost Explorer (whose data lags by up to a day)."""
    from botocore.exceptions import ClientError

    start, end = month_bounds(today)
    notes: list[str] = []
    so_far = forecast = None
    try:
        reply = ce.get_cost_and_usage(
            TimePeriod={"Start": start.isoformat(), "End": max(today, start + dt.timedelta(days=1)).isoformat()},
            Granularity="MONTHLY", Metrics=["UnblendedCost"], Filter=_tag_filter(stack))
        so_far = sum(float(r["Total"]["UnblendedCost"]["Amount"]) for r in reply["ResultsByTime"])
    except ClientError as exc:
        notes.append(f"spend not read: {exc.response['Error']['Code']} (needs ce:GetCostAndUsage)")
    if today + dt.timedelta(days=1) < end:
        try:
            reply = ce.get_cost_forecast(
                TimePeriod={"Start": (today + dt.timedelta(days=1)).isoformat(), "End": end.isoformat()},
                Metric="UNBLENDED_COST", Granularity="MONTHLY", Filter=_tag_filter(stack))
            forecast = (so_far or 0.0) + float(reply["Total"]["Amount"])
        except ClientError as exc:
            # Cost Explorer forecasts only once it has enough history for the filter.
            notes.append(f"no forecast: {exc.response['Error']['Code']} (needs ce:GetCostForecast and some history)")
    return Spend(so_far, forecast, notes)


def gpu_hours_by_account(sreport_output: str) -> dict[str, float]:
    """GPU-hours per account from `sreport -n -P cluster AccountUtilizationByUser -t Hours --tres=gres/gpu`
    (Cluster|Account|Login|Proper Name|TRES Name|Used); account totals are the lines without a login."""
    hours: dict[str, float] = {}
    for line in sreport_output.splitlines():
        fields = line.split("|")
        if len(fields) >= 6 and not fields[2] and fields[4] == "gres/gpu":
            hours[fields[1]] = float(fields[5] or 0)
    return hours


def slurm_gpu_hours(start: dt.date) -> dict[str, float] | None:
    """From Slurm accounting, when this runs on the head node (sreport present); None elsewhere."""
    if not shutil.which("sreport"):
        return None
    out = subprocess.run(["sreport", "-n", "-P", "cluster", "AccountUtilizationByUser", f"start={start.isoformat()}",
                          "end=now", "-t", "Hours", "--tres=gres/gpu"], capture_output=True, text=True, check=True)
    return gpu_hours_by_account(out.stdout)


def report(stack: Stack, result: Spend, gpu_hours: dict[str, float] | None) -> list[str]:
    budget = stack.spec.budget.monthly_usd
    money = lambda v: "unknown" if v is None else f"${v:,.2f}"  # noqa: E731
    lines = [f"Stack {stack.name} (team {stack.spec.team}), tag {COST_TAG}={stack.name}",
             f"Spent this month:    {money(result.month_to_date)}"
             + (f" ({100 * result.month_to_date / budget:.0f}% of the budget)" if result.month_to_date is not None else ""),
             f"Forecast for month:  {money(result.forecast)}"
             + (" - over budget" if result.forecast is not None and result.forecast > budget else ""),
             f"Budget:              {money(budget)}"]
    quota = cost.gpu_hour_quota(stack)
    if gpu_hours is None:
        lines.append("GPU-hours:           run this on the head node to read Slurm accounting")
    else:
        used = gpu_hours.get(stack.spec.team, 0.0)
        of = f" of {quota:,} ({100 * used / quota:.0f}%)" if quota else ""
        lines.append(f"GPU-hours:           {used:,.1f}{of} for account {stack.spec.team}")
        lines += [f"  {account}: {h:,.1f}" for account, h in sorted(gpu_hours.items()) if account != stack.spec.team]
    lines += [f"Note: {n}" for n in result.notes]
    return lines
