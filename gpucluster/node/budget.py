"""The team's budget as the guardrails see it: the month's spend that AWS Budgets reports, the one decision on it (at
or past the act threshold, the cluster is held), and what the Slurm head's guardrail did about it (its state file,
which the reconciler reads). Shared by the head's budget guardrail, the reconciler and the EKS flavour's queue
guardrail (in its pod, which carries this file). Standard library only: the caller brings its boto3 Budgets client."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class BudgetSpend:
    """The month's spend against the team's monthly budget (dollars)."""

    actual: float
    limit: float
    act_at: float  # the act threshold
    forecast: float | None = None  # AWS forecasts a month's spend once it has some history
    computed: bool = True  # False for a new budget: AWS has computed no spend for it yet, read as $0

    @property
    def over(self) -> bool:
        """At or past the act threshold: the guardrails hold the cluster (Slurm's partitions, Kueue's ClusterQueue)."""
        return self.actual >= self.act_at

    def describe(self, team: str) -> str:
        not_yet = "" if self.computed else "; AWS Budgets has computed no spend yet"
        return (f"team {team} spent ${self.actual:,.2f} of its ${self.limit:,.2f} monthly budget "
                f"(the guardrail acts at ${self.act_at:,.2f}){not_yet}")


def read_spend(budgets: Any, account_id: str, budget_name: str, act_threshold_percent: float) -> BudgetSpend:
    """The budget as AWS Budgets has it now (DescribeBudget): it refreshes the spend a few times a day. A new budget
    has no CalculatedSpend until AWS has computed one (botocore's model makes it optional, and ActualSpend required
    within it): no spend yet reads as $0."""
    budget = budgets.describe_budget(AccountId=account_id, BudgetName=budget_name)["Budget"]
    limit = float(budget["BudgetLimit"]["Amount"])
    calculated = budget.get("CalculatedSpend") or {}
    actual = calculated.get("ActualSpend")
    forecast = calculated.get("ForecastedSpend")
    return BudgetSpend(actual=float(actual["Amount"]) if actual else 0.0, limit=limit,
                       act_at=limit * act_threshold_percent / 100,
                       forecast=float(forecast["Amount"]) if forecast else None, computed=actual is not None)


@dataclass
class GuardrailState:
    """What the Slurm head's guardrail did, kept across restarts (settings.BUDGET_STATE_FILE)."""

    closed: bool = False
    reason: str = ""
    since: float = 0.0
    partitions: list[str] = field(default_factory=list)  # the ones it closed: only those reopen
    reopened_by_hand: str = ""  # the month (YYYY-MM, UTC) a person reopened: no closing again in it
    closed_by_hand: bool = False  # a person closed: only a person reopens

    @classmethod
    def load(cls, path: Path) -> GuardrailState:
        try:
            return cls(**json.loads(path.read_text()))
        except FileNotFoundError:
            return cls()

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1))
        tmp.chmod(0o644)  # the reconciler (slurm user) reads it
        tmp.replace(path)


def budget_closed(state_file: str) -> bool:
    """Whether the guardrail has closed the cluster: the reconciler then powers up no always-on node."""
    return GuardrailState.load(Path(state_file)).closed
