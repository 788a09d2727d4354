"""`gpucluster cost STACK`: this month's spend by the stack's tag, the forecast, the budget, and (on the head
node) GPU-hours per Slurm account against the team's quota and per person, with each person's share of the spend."""

from __future__ import annotations

import datetime as dt
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpucluster.contract import settings
from gpucluster.spec import cost
from gpucluster.spec.cost import COST_TAG, money
from gpucluster.spec.model import Stack

SSHARE_SECONDS = 60  # sshare asks slurmctld, which answers within its MessageTimeout when it runs


@dataclass(frozen=True)
class Spend:
    month_to_date: float | None
    forecast: float | None  # the whole month: spend so far plus Cost Explorer's forecast for the rest
    notes: list[str]

    def fails(self, budget: float) -> bool:
        """What `cost` exits 1 for: over the budget or forecast to be, or a spend nobody could read."""
        return self.month_to_date is None or over_budget(self.month_to_date, self.forecast, budget)


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


@dataclass(frozen=True)
class GpuHours:
    """GPU-hours this month from `sshare -n -P -a -o Account,User,GrpTRESRaw`: the TRES-minutes each association used
    since the monthly reset, the very figure GrpTRESMins is enforced against (live, unlike sreport's hourly rollups)."""

    accounts: dict[str, float]  # an account's own row: its users' and sub-accounts' use summed
    users: dict[tuple[str, str], float]  # (account, user): a person's association under an account
    # What each account's jobs billed against the money quota (the billing TRES, cost.BILLING_UNITS_PER_USD).
    billed_usd: dict[str, float] = field(default_factory=dict)


def gpu_hours(sshare_output: str) -> GpuHours:
    """Account rows have no user; user rows name their account in the first field. sshare indents both by depth in
    the tree (a user row one level below its account), so the account is read stripped."""
    accounts: dict[str, float] = {}
    users: dict[tuple[str, str], float] = {}
    billed: dict[str, float] = {}
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
            billed[account] = int(used.get("billing", 0)) / 60 / cost.BILLING_UNITS_PER_USD
    return GpuHours(accounts, users, billed)


class SlurmUnanswered(Exception):
    """sshare failed or hung on the head node (slurmctld or slurmdbd down): said in the report, not a traceback."""


# What the report says of GPU-hours off the head node: only Slurm's accounting there has them.
OFF_THE_HEAD = "run this on the head node to read Slurm accounting"


def on_the_head(stack: Stack, settings_file: str | Path = settings.SETTINGS_FILE) -> bool:
    """Whether this runs on the stack's own head node: its settings file (written by the bootstrap, readable by all)
    is here and names the stack's cluster. Not "sshare is on PATH": an operator's or a login machine may have Slurm's
    client, and another cluster's head has sshare too but not this stack's accounting."""
    try:
        return settings.ClusterSettings.load(settings_file).cluster == stack.cluster_name
    except (OSError, ValueError):  # missing, unreadable or not settings (SettingsError is a ValueError)
        return False


def slurm_gpu_hours(env: dict[str, str] | None = None) -> GpuHours:
    """From Slurm, on the head node. Slurm's PrivateData=usage (render/slurm.py PRIVATE_DATA) shows someone who is
    not root only their own associations."""
    try:
        out = subprocess.run(["sshare", "-n", "-P", "-a", "-o", "Account,User,GrpTRESRaw"], capture_output=True,
                             text=True, env=env, timeout=SSHARE_SECONDS)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SlurmUnanswered(f"sshare: {exc}") from None
    if out.returncode != 0:
        raise SlurmUnanswered(f"sshare exited {out.returncode}: {out.stderr.strip() or 'no message'}")
    return gpu_hours(out.stdout)


def head_gpu_hours(stack: Stack, settings_file: str | Path = settings.SETTINGS_FILE) -> GpuHours | str:
    """The stack's GPU-hours where they can be read (its head node), else what the report says instead."""
    if not on_the_head(stack, settings_file):
        return OFF_THE_HEAD
    try:
        return slurm_gpu_hours()
    except SlurmUnanswered as exc:
        return f"Slurm did not answer ({exc})"


def report(stack: Stack, result: Spend, gpu_hours: GpuHours | str) -> list[str]:
    """`gpu_hours`: Slurm's, or why there are none (head_gpu_hours)."""
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
    elif team not in gpu_hours.accounts and any(account == team for account, _ in gpu_hours.users):
        # Slurm's PrivateData=usage: someone who is not root sees their own association only.
        lines.append(f"GPU-hours:           only your own: Slurm shows account {team}'s to root (an admin's sudo)")
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
    # The people's rows under the team's account, as by_person lists them (most GPU-hours first).
    rows = sorted(((user, hours) for (account, user), hours in gpu_hours.users.items() if account == team),
                  key=lambda row: (-row[1], row[0]))
    if team not in gpu_hours.accounts and rows:  # Slurm's PrivateData=usage: the caller's own association (report)
        return doc | {"gpu_hours_unknown": f"only your own: Slurm shows account {team}'s to root",
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
