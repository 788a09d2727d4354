"""`gpucluster cost STACK`: this month's spend by the stack's tag, the forecast, the budget, and (on the head
node) GPU-hours per Slurm account against the team's quota and per person, with each person's share of the spend.
The head reads Slurm's figures (gpucluster.node.usage); this side reports them beside AWS's."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from gpucluster.cli_errors import credentials_problem
from gpucluster.contract import settings
from gpucluster.contract.slurm_json import GpuHours
from gpucluster.spec import cost
from gpucluster.spec.cost import COST_TAG, money
from gpucluster.spec.model import Stack


@dataclass(frozen=True)
class Spend:
    month_to_date: float | None
    forecast: float | None  # the whole month: spend so far plus Cost Explorer's forecast for the rest
    notes: list[str]

    def fails(self, budget: float) -> bool:
        """What `cost` exits 1 for: over the budget or forecast to be, or a spend nobody could read."""
        return self.month_to_date is None or over_budget(self.month_to_date, self.forecast, budget)


def account_id(session: Any, region: str) -> str | None:
    """The caller's AWS account (sts:GetCallerIdentity), or None where STS refuses: what needs it says so in its own
    report. Missing or expired credentials are raised, the caller's to renew (cli_errors)."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        return str(session.client("sts", region_name=region).get_caller_identity()["Account"])
    except (BotoCoreError, ClientError) as exc:
        if credentials_problem(exc):
            raise
        return None


def over_budget(spent: float | None, forecast: float | None, budget: float) -> bool:
    return any(v is not None and v > budget for v in (spent, forecast))


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

    notes: list[str] = []
    so_far = None
    try:
        reply = ce.get_cost_and_usage(TimePeriod=month_to_date(today), Granularity="MONTHLY",
                                      Metrics=["UnblendedCost"], Filter=_tag_filter(stack))
        so_far = sum(float(r["Total"]["UnblendedCost"]["Amount"]) for r in reply["ResultsByTime"])
    except ClientError as exc:
        if budgets is not None and account:
            return from_budget(budgets, account, stack, exc.response["Error"]["Code"])
        notes.append(f"spend not read: {exc.response['Error']['Code']} (needs ce:GetCostAndUsage)")
    except BotoCoreError as exc:  # no credentials, no network
        notes.append(f"spend not read: {exc}")
        return Spend(None, None, notes)
    forecast, why = month_forecast(ce, stack, today, so_far)
    return Spend(so_far, forecast, notes + ([why] if why else []))


def month_to_date(today: dt.date) -> dict[str, str]:
    """Cost Explorer's period for this month so far (its End is exclusive, and after its Start)."""
    start, _ = month_bounds(today)
    return {"Start": start.isoformat(), "End": max(today, start + dt.timedelta(days=1)).isoformat()}


def month_forecast(ce: Any, stack: Stack, today: dt.date, so_far: float | None) -> tuple[float | None, str | None]:
    """The whole month: spend so far plus Cost Explorer's forecast for the days left (None on the month's last day,
    when there is none left to forecast), and why there is none. GetCostForecast takes no GroupBy: one call a stack."""
    from botocore.exceptions import BotoCoreError, ClientError

    _, end = month_bounds(today)
    if today + dt.timedelta(days=1) >= end:
        return None, None
    try:
        reply = ce.get_cost_forecast(
            TimePeriod={"Start": (today + dt.timedelta(days=1)).isoformat(), "End": end.isoformat()},
            Metric="UNBLENDED_COST", Granularity="MONTHLY", Filter=_tag_filter(stack))
    except ClientError as exc:
        # Cost Explorer forecasts only once it has enough history for the filter.
        return None, f"no forecast: {exc.response['Error']['Code']} (needs ce:GetCostForecast and some history)"
    except BotoCoreError as exc:
        return None, f"no forecast: {exc}"
    return (so_far or 0.0) + float(reply["Total"]["Amount"]), None


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


def team_people(gpu_hours: GpuHours, team: str) -> list[tuple[str, float]]:
    """The team account's user associations, most GPU-hours first."""
    return sorted(((user, hours) for (account, user), hours in gpu_hours.users.items() if account == team),
                  key=lambda row: (-row[1], row[0]))


def only_own(gpu_hours: GpuHours, team: str) -> bool:
    """Slurm's PrivateData=usage: someone who is not root sees their own association only, not the team's."""
    return team not in gpu_hours.accounts and any(account == team for account, _ in gpu_hours.users)


def only_own_note(stack: Stack) -> str:
    """Why the team's GPU-hours are missing when only one's own are, and where a team member sees them: status runs
    as root on the head through the status document, which every user's policy allows."""
    return (f"only your own: Slurm shows account {stack.spec.team}'s to root (an admin's sudo); "
            f"`gpucluster status {stack.name}` shows what the team billed and its GPU-hours")


def report(stack: Stack, result: Spend, gpu_hours: GpuHours | str) -> list[str]:
    """`gpu_hours`: Slurm's, or why there are none (gpucluster.node.usage.head_gpu_hours)."""
    budget = stack.spec.budget.monthly_usd
    share = f" ({100 * result.month_to_date / budget:.0f}% of the budget)" if result.month_to_date is not None else ""
    lines = [f"Stack {stack.name} (team {stack.spec.team}), tag {COST_TAG}={stack.name}",
             f"Spent this month:    {money(result.month_to_date)}{share}",
             f"Forecast for month:  {money(result.forecast)}"
             + (" - over budget" if result.forecast is not None and result.forecast > budget else ""),
             f"Budget:              {money(budget)}"]
    quota = cost.quota(stack).usd
    team = stack.spec.team
    if isinstance(gpu_hours, str):
        lines.append(f"GPU-hours:           {gpu_hours}")
    elif only_own(gpu_hours, team):
        lines.append(f"GPU-hours:           {only_own_note(stack)}")
        lines += by_person(stack, gpu_hours, None, None)
    else:
        used = gpu_hours.accounts.get(team, 0.0)
        billed = gpu_hours.billed_usd.get(team, 0.0)
        share = f" ({100 * billed / quota:.0f}%)" if quota else ""
        lines.append(f"Quota:               {money(billed)} of {money(quota)}{share} billed to account {team}")
        lines.append(f"GPU-hours:           {used:,.1f} for account {team}")
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
    rows = team_people(gpu_hours, stack.spec.team)
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


def as_json(stack: Stack, result: Spend, gpu_hours: GpuHours | str) -> dict[str, Any]:
    """`cost STACK --json`: report's figures as one object (keys as the cost board's rows name them); a figure nobody
    could read is null, and why is in gpu_hours_unknown or notes."""
    budget, team = stack.spec.budget.monthly_usd, stack.spec.team
    doc: dict[str, Any] = {
        "stack": stack.name, "team": team, "tag": {COST_TAG: stack.name}, "spent_usd": result.month_to_date,
        "forecast_usd": result.forecast, "budget_usd": budget,
        "over_budget": over_budget(result.month_to_date, result.forecast, budget), "quota": None, "gpu_hours": None,
        "gpu_hours_unknown": None, "other_accounts_gpu_hours": {}, "people": [], "notes": result.notes}
    if isinstance(gpu_hours, str):
        return doc | {"gpu_hours_unknown": gpu_hours}
    rows = team_people(gpu_hours, team)
    if only_own(gpu_hours, team):
        return doc | {"gpu_hours_unknown": only_own_note(stack),
                      "people": [{"user": user, "gpu_hours": hours} for user, hours in rows]}
    used = gpu_hours.accounts.get(team, 0.0)
    spent = result.month_to_date
    return doc | {
        "quota": {"usd": round(cost.quota(stack).usd, 2), "billed_usd": round(gpu_hours.billed_usd.get(team, 0.0), 2)},
        "gpu_hours": used,
        "other_accounts_gpu_hours": {account: hours for account, hours in sorted(gpu_hours.accounts.items())
                                     if account not in (team, "root")},
        "people": [{"user": user, "gpu_hours": hours, "share_percent": round(100 * hours / used, 1) if used else None,
                    "allocated_usd": round(spent * hours / used, 2) if used and spent is not None else None}
                   for user, hours in rows]}
