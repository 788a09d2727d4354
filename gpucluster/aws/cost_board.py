"""`gpucluster cost --all`: the cost board across teams, one row per stack and a total, with the operator's credentials.

AWS calls for the whole board, whatever the number of teams:
- budgets:DescribeBudgets, once (paginated): a stack is deployed when its AWS Budget exists (every stack creates one,
  components/budget.py), and the budget's own spend and forecast stand in where Cost Explorer is denied;
- ce:GetCostAndUsage, once: the month's spend grouped by the cost-allocation tag gpucluster:stack (its value is the
  stack's name), filtered to the board's stacks; a stack no longer deployed still shows what bills under its tag;
- ce:GetCostForecast, once per deployed stack: it takes no GroupBy.
GPU-hours and idle GPU-hours are known only on a head node (Slurm's accounting; its Prometheus's gpucluster:gpu_idle
rule): the board run on a stack's head fills that stack's, and says "unknown" with the reason for the others.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpucluster.aws import spend
from gpucluster.spec.cost import COST_TAG, money
from gpucluster.spec.model import Stack

EXIT_OVER_BUDGET = 1  # a team is over its budget or forecast to be, or its spend could not be read
HEAD_ONLY = ("only the stack's head node has them (Slurm's accounting, its Prometheus): run `gpucluster cost --all` "
             "there")
NOT_DEPLOYED = "not deployed"


@dataclass(frozen=True)
class Usage:
    """A stack's GPU-hours and idle GPU-hours this month, each a figure or why there is none."""

    gpu_hours: float | str
    idle_gpu_hours: float | str


@dataclass(frozen=True)
class Row:
    stack: str
    team: str
    deployed: bool | None  # None: the account's budgets could not be listed
    spent: float | None
    forecast: float | None
    budget: float
    usage: Usage
    notes: tuple[str, ...] = ()

    @property
    def over_budget(self) -> bool:
        return spend.over_budget(self.spent, self.forecast, self.budget)

    @property
    def unread(self) -> bool:
        """A stack that may bill whose spend nobody could read: the board cannot say it is within budget."""
        return self.deployed is not False and self.spent is None

    @property
    def status(self) -> str:
        if self.deployed is False:
            return "not deployed" + (f" (still {money(self.spent)} this month: `gpucluster leftovers`)"
                                     if self.spent else "")
        if self.spent is not None and self.spent > self.budget:
            return "OVER BUDGET"
        if self.forecast is not None and self.forecast > self.budget:
            return "forecast over budget"
        return "spend unknown" if self.spent is None else "within budget"

    def as_json(self) -> dict[str, Any]:
        figure = lambda v: v if isinstance(v, float) else None  # noqa: E731
        why = lambda v: v if isinstance(v, str) else None  # noqa: E731
        return {"stack": self.stack, "team": self.team, "deployed": self.deployed, "spent_usd": self.spent,
                "forecast_usd": self.forecast, "budget_usd": self.budget,
                "gpu_hours": figure(self.usage.gpu_hours), "gpu_hours_unknown": why(self.usage.gpu_hours),
                "idle_gpu_hours": figure(self.usage.idle_gpu_hours),
                "idle_gpu_hours_unknown": why(self.usage.idle_gpu_hours),
                "over_budget": self.over_budget, "status": self.status, "notes": list(self.notes)}


def usage(on_the_head: tuple[float | str, float | str] | None) -> Usage:
    """A stack's row figures from what its head read (gpucluster.node.usage.head_usage), or, read elsewhere (None),
    where they are."""
    return Usage(HEAD_ONLY, HEAD_ONLY) if on_the_head is None else Usage(*on_the_head)


def budgets_by_name(budgets: Any, account: str | None) -> tuple[dict[str, dict[str, Any]] | None, str | None]:
    """Every AWS Budget of the account by name, or None and why."""
    from botocore.exceptions import BotoCoreError, ClientError

    if not account:
        return None, "the account could not be read (sts:GetCallerIdentity)"
    found: dict[str, dict[str, Any]] = {}
    try:
        for page in budgets.get_paginator("describe_budgets").paginate(AccountId=account):
            found |= {b["BudgetName"]: b for b in page.get("Budgets", [])}
    except ClientError as exc:
        return None, f"budgets not listed: {exc.response['Error']['Code']} (needs budgets:ViewBudget)"
    except BotoCoreError as exc:
        return None, f"budgets not listed: {exc}"
    return found, None


def spend_by_stack(ce: Any, stacks: list[Stack], today: dt.date) -> tuple[dict[str, float] | None, str | None]:
    """The month's spend of each stack, from one Cost Explorer query grouped by the stack tag (a stack with no cost
    under its tag has no group: 0), or None and why."""
    from botocore.exceptions import BotoCoreError, ClientError

    request: dict[str, Any] = {
        "TimePeriod": spend.month_to_date(today), "Granularity": "MONTHLY", "Metrics": ["UnblendedCost"],
        "Filter": {"Tags": {"Key": COST_TAG, "Values": sorted(s.name for s in stacks), "MatchOptions": ["EQUALS"]}},
        "GroupBy": [{"Type": "TAG", "Key": COST_TAG}]}
    totals = dict.fromkeys((s.name for s in stacks), 0.0)
    try:
        while True:
            reply = ce.get_cost_and_usage(**request)
            for period in reply["ResultsByTime"]:
                for group in period.get("Groups", []):
                    # A tag group's key is "<tag key>$<value>" (Cost Explorer API reference, Group.Keys).
                    name = group["Keys"][0].removeprefix(f"{COST_TAG}$")
                    if name in totals:
                        totals[name] += float(group["Metrics"]["UnblendedCost"]["Amount"])
            if not reply.get("NextPageToken"):
                return totals, None
            request["NextPageToken"] = reply["NextPageToken"]
    except ClientError as exc:
        return None, exc.response["Error"]["Code"]
    except BotoCoreError as exc:
        return None, str(exc)


def board(stacks: list[Stack], ce: Any, budgets: Any, account: str | None, today: dt.date,
          usage: Callable[[Stack], Usage]) -> tuple[list[Row], list[str]]:
    """The rows, in the stacks' order, and the notes that concern the whole board."""
    notes: list[str] = []
    known_budgets, budgets_why = budgets_by_name(budgets, account)
    if budgets_why:
        notes.append(f"whether each stack is deployed is unknown: {budgets_why}")
    spent, ce_why = spend_by_stack(ce, stacks, today)
    if ce_why:
        notes.append(f"Cost Explorer: {ce_why} (needs ce:GetCostAndUsage)"
                     + ("; spend and forecast from each stack's AWS Budget, refreshed a few times a day"
                        if known_budgets is not None else ""))
    rows = []
    for stack in stacks:
        deployed = None if known_budgets is None else stack.budget_name in known_budgets
        row_notes: list[str] = []
        so_far = forecast = None
        if spent is not None:
            so_far = spent[stack.name]
            if deployed is not False:
                forecast, why = spend.month_forecast(ce, stack, today, so_far)
                row_notes += [why] if why else []
        elif known_budgets is not None and deployed:
            calculated = known_budgets[stack.budget_name].get("CalculatedSpend", {})
            so_far, forecast = (float(calculated[key]["Amount"]) if key in calculated else None
                                for key in ("ActualSpend", "ForecastedSpend"))
        elif known_budgets is None and budgets is not None and account:
            # Neither Cost Explorer nor the list of budgets (the head's role reads its own budget only): this one.
            own = spend.from_budget(budgets, account, stack, ce_why or "")
            so_far, forecast, row_notes = own.month_to_date, own.forecast, list(own.notes)
            deployed = True if so_far is not None else None
        rows.append(Row(stack.name, stack.spec.team, deployed, so_far, forecast, float(stack.spec.budget.monthly_usd),
                        usage(stack) if deployed is not False else Usage(NOT_DEPLOYED, NOT_DEPLOYED),
                        tuple(row_notes)))
    return rows, notes


def total(rows: list[Row]) -> dict[str, float | None]:
    """Each column summed; None where a stack that may bill has no figure (a partial sum would pass for the whole)."""
    def summed(values: list[float | str | None]) -> float | None:
        return None if any(not isinstance(v, float) for v in values) else sum(v for v in values
                                                                               if isinstance(v, float))

    billing = [r for r in rows if r.deployed is not False]
    leftovers = sum(r.spent or 0.0 for r in rows if r.deployed is False)  # what still bills under a removed stack
    spent = summed([r.spent for r in billing])
    return {"spent_usd": None if spent is None else spent + leftovers,
            "forecast_usd": summed([r.forecast for r in billing]),
            "budget_usd": sum(r.budget for r in billing), "gpu_hours": summed([r.usage.gpu_hours for r in billing]),
            "idle_gpu_hours": summed([r.usage.idle_gpu_hours for r in billing])}


def exit_code(rows: list[Row]) -> int:
    return EXIT_OVER_BUDGET if any(r.over_budget or r.unread for r in rows) else 0


def as_json(rows: list[Row], notes: list[str]) -> dict[str, Any]:
    return {"teams": [r.as_json() for r in rows], "total": total(rows), "notes": notes,
            "over_budget": [r.stack for r in rows if r.over_budget],
            "spend_unknown": [r.stack for r in rows if r.unread]}


def _hours(value: float | str | None) -> str:
    return f"{value:,.1f}" if isinstance(value, float) else "-" if value == NOT_DEPLOYED else "unknown"


def text(rows: list[Row], notes: list[str], today: dt.date) -> list[str]:
    table = [("stack", "team", "spent", "forecast", "budget", "GPU-hours", "idle GPU-hours", "status")]
    table += [(r.stack, r.team, money(r.spent), money(r.forecast) if r.deployed is not False else "-",
               money(r.budget), _hours(r.usage.gpu_hours),
               _hours(r.usage.idle_gpu_hours), r.status) for r in rows]
    whole = total(rows)
    table.append(("total", "", money(whole["spent_usd"]), money(whole["forecast_usd"]), money(whole["budget_usd"]),
                  _hours(whole["gpu_hours"]), _hours(whole["idle_gpu_hours"]), ""))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = [f"Cost board for {today:%B %Y} (to {today:%-d %B}), spend by the tag {COST_TAG}; the total's budget "
             "and forecast are the deployed stacks'", ""]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in table]
    lines.insert(3, "  ".join("-" * w for w in widths))
    lines.insert(len(lines) - 1, "  ".join("-" * w for w in widths))
    # Why a figure is unknown, once per reason with the stacks it concerns.
    reasons: dict[str, list[str]] = {}
    for r in rows:
        gpu, idle = r.usage.gpu_hours, r.usage.idle_gpu_hours
        unknown = [] if r.deployed is False else [("GPU-hours and idle GPU-hours", gpu)] if gpu == idle else [
            ("GPU-hours", gpu), ("idle GPU-hours", idle)]
        for column, value in unknown:
            if isinstance(value, str):
                reasons.setdefault(f"{column} unknown: {value}", []).append(r.stack)
        for note in r.notes:
            reasons.setdefault(note, []).append(r.stack)
    lines += [""] * bool(reasons or notes) + [f"Note: {n}" for n in notes]
    lines += [f"Note ({', '.join(stacks)}): {reason}" for reason, stacks in reasons.items()]
    return lines
