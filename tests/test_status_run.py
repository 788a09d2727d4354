"""The head's `gpucluster status` (gpucluster/node/status_run.py) on Slurm's real JSON records (slurm_samples) and
sshare's real line shape: the cases a local cluster does not reach in one run (the quota used up, a partition an
admin closed, no spend read yet). Its run on a real cluster, against sinfo and squeue:
tests/integration/test_budget_closes_partitions.py."""

from __future__ import annotations

from pathlib import Path

from gpucluster.contract import slurm_json
from gpucluster.contract.settings import BUDGET_TEXTFILE, BudgetSettings, ClusterSettings, PoolSettings
from gpucluster.contract.status import QUOTA_REASON
from gpucluster.node import budget_guardrail, status_run
from gpucluster.node.budget import BudgetSpend, GuardrailState
from gpucluster.node.slurm_control import SlurmControl
from slurm_samples import document, job, node, partition

TEAM = "team-a"


class QuietSlurm(SlurmControl):
    """scontrol's and sshare's answers, given."""

    def __init__(self, partitions: dict[str, str], billed_minutes: int, quota_minutes: int | None) -> None:
        super().__init__()
        self.answers: dict[tuple[str, ...], str] = {
            slurm_json.SHOW_PARTITIONS: document("partitions", [partition(n, s) for n, s in partitions.items()]),
            slurm_json.SHOW_NODES: document("nodes", [
                node("h100-1", "ALLOCATED+CLOUD"), node("h100-2", "IDLE+CLOUD+POWERED_DOWN"),
                node("h100-3", "IDLE+CLOUD+POWERED_DOWN"), node("h100-4", "DOWN+CLOUD", reason="gpucluster: x"),
                node("l4-1", "IDLE+CLOUD+POWERING_UP")]),
            slurm_json.SHOW_JOBS: document("jobs", [
                job(1, "RUNNING", "h100-1", "h100"), job(2, "PENDING", "", "h100", state_reason="Resources"),
                job(3, "PENDING", "", "h100", state_reason="Priority"),
                job(4, "PENDING", "", "l4", state_reason="Priority"), job(5, "COMPLETED", "h100-1", "h100")]),
        }
        quota = f"billing={quota_minutes},gres/gpu=-1" if quota_minutes is not None else ""
        # sshare -n -P -a -A ACCOUNT -o Account,User,GrpTRESRaw,GrpTRESMins: the account's row, then its users'.
        # Billing minutes are cent-minutes; 60 GPU-minutes here.
        self.sshare = (f" {TEAM}||cpu=9000,billing={billed_minutes},gres/gpu=60|{quota}\n"
                       f"  {TEAM}|alice|cpu=1,billing={billed_minutes},gres/gpu=60|\n")

    def _run(self, *args: str) -> str:
        return self.answers[args]

    def account_usage(self, account: str | None = None) -> str:
        assert account == TEAM
        return self.sshare


def settings(tmp_path: Path) -> ClusterSettings:
    pools = {name: PoolSettings(name, "lt", "subnet", "p5.48xlarge", "spot", max_nodes=4) for name in ("h100", "l4")}
    budget = BudgetSettings("b", "123456789012", 90.0, "queue", "topic")
    return ClusterSettings("gpucluster-team-a", "us-east-1", pools, team=TEAM, budget=budget,
                           budget_state_file=str(tmp_path / "budget.json"))


def test_counts_nodes_jobs_and_reasons_and_reads_the_guardrails_spend(tmp_path: Path) -> None:
    config = settings(tmp_path)
    budget_guardrail.publish_spend(BudgetSpend(actual=120.5, limit=500, act_at=450, forecast=610.25), tmp_path)
    status = status_run.collect(config, QuietSlurm({"h100": "UP", "l4": "UP"}, 60_000, 600_000), tmp_path)
    assert status["pools"] == {"h100": {"busy": 1, "powered_down": 2, "down": 1}, "l4": {"booting": 1}}
    assert status["jobs"] == {"running": 1, "pending": 3, "pending_reasons": {"Priority": 2, "Resources": 1}}
    assert status["partitions"] == [{"name": n, "open": True, "state": "UP", "why": ""} for n in ("h100", "l4")]
    assert status["gpu_hours"] == {"used": 1.0}
    assert status["quota"] == {"used_usd": 10.0, "usd": 100.0}  # cent-minutes / 60 / 100
    budget = status["budget"]
    assert (budget["limit_usd"], budget["spent_usd"], budget["forecast_usd"], budget["act_at_usd"]) == (
        500, 120.5, 610.25, 450)
    assert budget["as_of"] == (tmp_path / BUDGET_TEXTFILE).stat().st_mtime


def test_says_why_a_partition_is_closed(tmp_path: Path) -> None:
    config = settings(tmp_path)
    GuardrailState(closed=True, reason="team team-a spent $510.00", partitions=["h100"]).save(
        Path(config.budget_state_file))
    status = status_run.collect(config, QuietSlurm({"h100": "DOWN", "l4": "DOWN"}, 10, None), tmp_path)
    h100, l4 = status["partitions"]
    assert not h100["open"] and h100["why"] == "budget: team team-a spent $510.00"
    assert not l4["open"] and "by an admin (scontrol), not by the budget guardrail" in l4["why"]
    assert status["budget"] is None and status["quota"] == {"used_usd": round(10 / 6000, 2), "usd": None}


def test_an_open_partition_of_a_spent_quota_starts_nothing(tmp_path: Path) -> None:
    status = status_run.collect(settings(tmp_path), QuietSlurm({"h100": "UP"}, 600_000, 600_000), tmp_path)
    (h100,) = status["partitions"]
    assert not h100["open"] and h100["why"].startswith("quota: the team's jobs billed $100.00 of its $100.00")
    below = status_run.collect(settings(tmp_path), QuietSlurm({"h100": "UP"}, 599_999, 600_000), tmp_path)
    assert below["partitions"][0]["open"]


def test_a_partition_whose_jobs_wait_on_the_quota_says_so_before_it_is_spent(tmp_path: Path) -> None:
    """AccountingStorageEnforce=safe holds a job whose time limit would bill past what is left of the quota
    (AssocGrpBillingMinutes) while the quota is far from spent: its partition is reported with the count of such jobs
    and what is left; a partition whose jobs wait on other things stays open."""
    slurm = QuietSlurm({"h100": "UP", "l4": "UP"}, 60_000, 600_000)
    slurm.answers[slurm_json.SHOW_JOBS] = document("jobs", [
        job(1, "RUNNING", "h100-1", "h100"),
        job(2, "PENDING", "", "h100", state_reason=QUOTA_REASON),
        job(3, "PENDING", "", "h100,l4", state_reason=QUOTA_REASON),
        job(4, "PENDING", "", "l4", state_reason="Priority")])
    status = status_run.collect(settings(tmp_path), slurm, tmp_path)
    h100, l4 = status["partitions"]
    assert not h100["open"] and h100["why"].startswith(f"quota: 2 job(s) wait ({QUOTA_REASON})"), h100
    assert "$90.00 left of the team's $100.00" in h100["why"]
    assert not l4["open"] and l4["why"].startswith(f"quota: 1 job(s) wait ({QUOTA_REASON})"), l4
    assert status["jobs"]["pending_reasons"] == {QUOTA_REASON: 2, "Priority": 1}
    slurm.answers[slurm_json.SHOW_JOBS] = document("jobs", [job(4, "PENDING", "", "l4", state_reason="Priority")])
    assert all(p["open"] for p in status_run.collect(settings(tmp_path), slurm, tmp_path)["partitions"])
