"""`python -m gpucluster cost STACK`: this month's spend by the stack's tag, the forecast, the budget, and (on the head
node) GPU-hours per Slurm account against the team's quota."""

from __future__ import annotations

import datetime as dt
import shutil
import subprocess
from dataclasses import dataclass
from typing import Any

from gpucluster.spec import cost
from gpucluster.spec.cost import COST_TAG, money
from gpucluster.spec.model import Stack


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


def spend(ce: Any, stack: Stack, today: dt.date, budgets: Any = None, account: str | None = None) -> Spend:
    """Month to date and forecast from Cost Explorer (whose data lags by up to a day). Where Cost Explorer is denied
    (the head node's role may not read account-wide costs), from the stack's own AWS Budget, which tracks the same
    tag: `budgets` and `account` given."""
    from botocore.exceptions import BotoCoreError, ClientError

    start, end = month_bounds(today)
    notes: list[str] = []
    so_far = forecast = None
    try:
        reply = ce.get_cost_and_usage(
            TimePeriod={"Start": start.isoformat(), "End": max(today, start + dt.timedelta(days=1)).isoformat()},
            Granularity="MONTHLY", Metrics=["UnblendedCost"], Filter=_tag_filter(stack))
        so_far = sum(float(r["Total"]["UnblendedCost"]["Amount"]) for r in reply["ResultsByTime"])
    except ClientError as exc:
        if budgets is not None and account:
            return from_budget(budgets, account, stack, exc.response["Error"]["Code"])
        notes.append(f"spend not read: {exc.response['Error']['Code']} (needs ce:GetCostAndUsage)")
    except BotoCoreError as exc:  # no credentials, no network
        notes.append(f"spend not read: {exc}")
        return Spend(None, None, notes)
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


def from_budget(budgets: Any, account: str, stack: Stack, ce_error: str) -> Spend:
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        budget = budgets.describe_budget(AccountId=account, BudgetName=stack.budget_name)["Budget"]
    except (BotoCoreError, ClientError) as exc:
        return Spend(None, None,
                     [f"spend not read: Cost Explorer {ce_error}, and the budget {stack.budget_name}: {exc}"])
    calculated = budget.get("CalculatedSpend", {})
    amount = lambda key: float(calculated[key]["Amount"]) if key in calculated else None  # noqa: E731
    return Spend(amount("ActualSpend"), amount("ForecastedSpend"),
                 [f"from the AWS Budget {stack.budget_name} (Cost Explorer: {ce_error}); refreshed a few times a day"])


def gpu_hours_by_account(sshare_output: str) -> dict[str, float]:
    """GPU-hours per account from `sshare -n -P -a -o Account,User,GrpTRESRaw`: the TRES-minutes each association
    used since the monthly reset, the very figure GrpTRESMins is enforced against (live, unlike sreport's hourly
    rollups). Account rows have no user; sshare indents accounts by depth."""
    hours: dict[str, float] = {}
    for line in sshare_output.splitlines():
        fields = line.split("|")
        if len(fields) >= 3 and not fields[1]:
            used = dict(item.split("=", 1) for item in fields[2].split(",") if "=" in item)
            hours[fields[0].strip()] = int(used.get("gres/gpu", 0)) / 60
    return hours


def slurm_gpu_hours(env: dict[str, str] | None = None) -> dict[str, float] | None:
    """From Slurm, when this runs on the head node (sshare present); None elsewhere."""
    if not shutil.which("sshare", path=(env or {}).get("PATH")):
        return None
    out = subprocess.run(["sshare", "-n", "-P", "-a", "-o", "Account,User,GrpTRESRaw"], capture_output=True,
                         text=True, check=True, env=env)
    return gpu_hours_by_account(out.stdout)


def report(stack: Stack, result: Spend, gpu_hours: dict[str, float] | None) -> list[str]:
    budget = stack.spec.budget.monthly_usd
    share = f" ({100 * result.month_to_date / budget:.0f}% of the budget)" if result.month_to_date is not None else ""
    lines = [f"Stack {stack.name} (team {stack.spec.team}), tag {COST_TAG}={stack.name}",
             f"Spent this month:    {money(result.month_to_date)}{share}",
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
        # root is the sum of all accounts, not an account of its own
        lines += [f"  {account}: {h:,.1f}" for account, h in sorted(gpu_hours.items())
                  if account not in (stack.spec.team, "root")]
    lines += [f"Note: {n}" for n in result.notes]
    return lines
