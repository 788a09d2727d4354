"""`gpucluster cost STACK`: this month's spend by the stack's tag, the forecast, the budget, and (on the head
node) GPU-hours per Slurm account against the team's quota and per person, with each person's share of the spend."""

from __future__ import annotations

import datetime as dt
import shutil
import subprocess
from dataclasses import dataclass
from typing import Any

from gpucluster.contract import settings
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


@dataclass(frozen=True)
class GpuHours:
    """GPU-hours this month from `sshare -n -P -a -o Account,User,GrpTRESRaw`: the TRES-minutes each association used
    since the monthly reset, the very figure GrpTRESMins is enforced against (live, unlike sreport's hourly rollups)."""

    accounts: dict[str, float]  # an account's own row: its users' and sub-accounts' use summed
    users: dict[tuple[str, str], float]  # (account, user): a person's association under an account


def gpu_hours(sshare_output: str) -> GpuHours:
    """Account rows have no user; user rows name their account in the first field. sshare indents both by depth in
    the tree (a user row one level below its account), so the account is read stripped."""
    accounts: dict[str, float] = {}
    users: dict[tuple[str, str], float] = {}
    for line in sshare_output.splitlines():
        fields = line.split("|")
        if len(fields) < 3:
            continue
        used = dict(item.split("=", 1) for item in fields[2].split(",") if "=" in item)
        hours = int(used.get("gres/gpu", 0)) / 60
        account, user = fields[0].strip(), fields[1].strip()
        if user:
            users[(account, user)] = hours
        else:
            accounts[account] = hours
    return GpuHours(accounts, users)


def slurm_gpu_hours(env: dict[str, str] | None = None) -> GpuHours | None:
    """From Slurm, when this runs on the head node (sshare present); None elsewhere. Slurm's PrivateData=usage
    (render/slurm.py PRIVATE_DATA) shows someone who is not root only their own associations."""
    if not shutil.which("sshare", path=(env or {}).get("PATH")):
        return None
    out = subprocess.run(["sshare", "-n", "-P", "-a", "-o", "Account,User,GrpTRESRaw"], capture_output=True,
                         text=True, check=True, env=env)
    return gpu_hours(out.stdout)


def report(stack: Stack, result: Spend, gpu_hours: GpuHours | None) -> list[str]:
    budget = stack.spec.budget.monthly_usd
    share = f" ({100 * result.month_to_date / budget:.0f}% of the budget)" if result.month_to_date is not None else ""
    lines = [f"Stack {stack.name} (team {stack.spec.team}), tag {COST_TAG}={stack.name}",
             f"Spent this month:    {money(result.month_to_date)}{share}",
             f"Forecast for month:  {money(result.forecast)}"
             + (" - over budget" if result.forecast is not None and result.forecast > budget else ""),
             f"Budget:              {money(budget)}"]
    quota = cost.gpu_hour_quota(stack)
    team = stack.spec.team
    if gpu_hours is None:
        lines.append("GPU-hours:           run this on the head node to read Slurm accounting")
    elif team not in gpu_hours.accounts and any(account == team for account, _ in gpu_hours.users):
        # Slurm's PrivateData=usage: someone who is not root sees their own association only.
        lines.append(f"GPU-hours:           only your own: Slurm shows account {team}'s to root (an admin's sudo)")
        lines += by_person(stack, gpu_hours, None, None)
    else:
        used = gpu_hours.accounts.get(team, 0.0)
        of = f" of {quota:,} ({100 * used / quota:.0f}%)" if quota else ""
        lines.append(f"GPU-hours:           {used:,.1f}{of} for account {team}")
        # root is the sum of all accounts, not an account of its own
        lines += [f"  {account}: {h:,.1f}" for account, h in sorted(gpu_hours.accounts.items())
                  if account not in (team, "root")]
        lines += by_person(stack, gpu_hours, used, result.month_to_date)
    lines += [f"Note: {n}" for n in result.notes]
    return lines


def by_person(stack: Stack, gpu_hours: GpuHours, team_hours: float | None, spent: float | None) -> list[str]:
    """The team account's user associations, most GPU-hours first: each person's GPU-hours, their share of the
    team's, and that share of the month's spend. An allocation by GPU-hours, not a bill: the head node, storage and
    network are shared out with the GPUs, and every GPU-hour counts the same whatever its pool's price (Slurm's
    GrpTRESRaw counts gres/gpu without its type)."""
    team = stack.spec.team
    rows = sorted(((user, hours) for (account, user), hours in gpu_hours.users.items() if account == team),
                  key=lambda row: (-row[1], row[0]))
    if not rows:
        return []
    people = {person.name for person in stack.spec.people}
    width = max(len(user) for user, _ in rows)
    lines = ["GPU-hours by person" + (" (the month's spend allocated by share of GPU-hours, not a bill)" if team_hours
                                     else "") + ":"]
    for user, hours in rows:
        line = f"  {user:<{width}}  {hours:>10,.1f}"
        if team_hours:
            allocated = spent * hours / team_hours if spent is not None else None
            line += f"  {100 * hours / team_hours:>3.0f}%  {money(allocated):>14}"
        if people and user == settings.LOGIN_USER:
            line += "  (the cluster's own: verify's jobs)"
        elif people and user not in people:
            line += "  (not in the stack's users:)"
        lines.append(line.rstrip())
    return lines
