"""`cost`: Cost Explorer by the stack's tag (recorded answers: moto has no Cost Explorer) and Slurm's GPU-hours."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import boto3
from botocore.stub import Stubber

from conftest import ROOT
from gpucluster.aws import spend
from gpucluster.project import EXAMPLES_DIR
from gpucluster.spec.model import load_stack

TEAM_A = load_stack(ROOT / "stacks" / "Pulumi.team-a.yaml")
TODAY = dt.date(2026, 11, 20)
TAG = {"Tags": {"Key": "gpucluster:stack", "Values": ["team-a"], "MatchOptions": ["EQUALS"]}}


def ce() -> Any:
    return boto3.client("ce", region_name="us-east-1", aws_access_key_id="t", aws_secret_access_key="t")


def test_spend_and_forecast_by_the_stack_tag() -> None:
    client = ce()
    with Stubber(client) as stub:
        stub.add_response("get_cost_and_usage", {"ResultsByTime": [
            {"Total": {"UnblendedCost": {"Amount": "180000.50", "Unit": "USD"}}}]},
            {"TimePeriod": {"Start": "2026-11-01", "End": "2026-11-20"}, "Granularity": "MONTHLY",
             "Metrics": ["UnblendedCost"], "Filter": TAG})
        stub.add_response("get_cost_forecast", {"Total": {"Amount": "95000", "Unit": "USD"}},
                          {"TimePeriod": {"Start": "2026-11-21", "End": "2026-12-01"}, "Metric": "UNBLENDED_COST",
                           "Granularity": "MONTHLY", "Filter": TAG})
        result = spend.spend(client, TEAM_A, TODAY)
    assert result.month_to_date == 180000.50 and result.forecast == 275000.50 and not result.notes
    lines = spend.report(TEAM_A, result, {"root": 20005.0, "vision": 20000.0, "other": 5.0})
    assert "Spent this month:    $180,000.50 (72% of the budget)" in lines
    assert "Forecast for month:  $275,000.50 - over budget" in lines
    assert "GPU-hours:           20,000.0 of 36,337 (55%) for account vision" in lines
    assert "  other: 5.0" in lines and not any("root" in line for line in lines)


def test_denied_and_missing_forecast_are_said_not_crashed() -> None:
    client = ce()
    with Stubber(client) as stub:
        stub.add_client_error("get_cost_and_usage", service_error_code="AccessDeniedException")
        stub.add_client_error("get_cost_forecast", service_error_code="DataUnavailableException")
        result = spend.spend(client, TEAM_A, TODAY)
    assert result.month_to_date is None and result.forecast is None
    assert result.notes == ["spend not read: AccessDeniedException (needs ce:GetCostAndUsage)",
                            "no forecast: DataUnavailableException (needs ce:GetCostForecast and some history)"]
    assert "GPU-hours:           run this on the head node to read Slurm accounting" \
        in spend.report(TEAM_A, result, None)


def test_gpu_hours_from_sshare_account_rows() -> None:
    # As the node image's Slurm (24.11) prints it, seen in the rehearsal (and checked against the real one in
    # tests/integration): minutes per TRES, gres/gpumem and gres/gpuutil beside gres/gpu, no trailing separator.
    out = ("root||cpu=0,mem=0,energy=0,node=0,billing=0,fs/disk=0,vmem=0,pages=0,gres/gpu=0,gres/gpumem=0,"
           "gres/gpuutil=0\n"
           " root|root|cpu=0,mem=0,energy=0,node=0,billing=0,fs/disk=0,vmem=0,pages=0,gres/gpu=0,gres/gpumem=0,"
           "gres/gpuutil=0\n"
           " vision||cpu=7200,mem=9000,node=60,billing=7200,gres/gpu=91230,gres/gpumem=5000,gres/gpuutil=40\n"
           "  vision|alice|cpu=7200,mem=9000,node=60,billing=7200,gres/gpu=90000,gres/gpumem=5000,gres/gpuutil=40\n"
           " speech||cpu=3,mem=0,gres/gpumem=0\n")
    assert spend.gpu_hours_by_account(out) == {"root": 0.0, "vision": 1520.5, "speech": 0.0}


def test_month_bounds() -> None:
    assert spend.month_bounds(dt.date(2026, 12, 31)) == (dt.date(2026, 12, 1), dt.date(2027, 1, 1))


def test_the_head_nodes_command_runs_from_the_bundle_without_pulumi(tmp_path: Path) -> None:
    """The bundle's library and stack file, run as the head node's `gpucluster cost`: no Pulumi there, no
    credentials here (said, not a crash)."""
    import gzip
    import io
    import subprocess
    import sys
    import tarfile

    from gpucluster.render import bundle

    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(bundle.build(TEAM_A, EXAMPLES_DIR)))) as tar:
        tar.extractall(tmp_path, filter="data")
    program = ("import sys; sys.modules['pulumi'] = None; sys.path.insert(0, sys.argv[1]); "
               "from gpucluster.cli import main; sys.exit(main(['cost', 'team-a']))")
    env = {"PATH": "/nonexistent", "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x",
           "AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_MAX_ATTEMPTS": "1", "HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-I", "-c", program, str(tmp_path / "lib")], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Stack team-a (team vision)" in out.stdout and "Budget:              $250,000.00" in out.stdout
    assert "Note: spend not read: Could not connect" in out.stdout
    # The stack file it read is the stack that was planned, to the last setting.
    from gpucluster.spec.model import load_stack as load

    assert load(tmp_path / "lib" / "stacks" / "Pulumi.team-a.yaml") == TEAM_A


def test_where_cost_explorer_is_denied_the_stacks_budget_answers() -> None:
    """The head node's role may read its own budget, not the account's costs."""
    from moto import mock_aws

    with mock_aws():
        budgets = boto3.client("budgets", region_name="us-east-1")
        budgets.create_budget(AccountId="123456789012", Budget={
            "BudgetName": TEAM_A.budget_name, "BudgetType": "COST", "TimeUnit": "MONTHLY",
            "BudgetLimit": {"Amount": "250000", "Unit": "USD"},
            "CalculatedSpend": {"ActualSpend": {"Amount": "120000.25", "Unit": "USD"},
                                "ForecastedSpend": {"Amount": "260000", "Unit": "USD"}}})
        client = ce()
        with Stubber(client) as stub:
            stub.add_client_error("get_cost_and_usage", service_error_code="AccessDeniedException")
            result = spend.spend(client, TEAM_A, TODAY, budgets=budgets, account="123456789012")
        assert (result.month_to_date, result.forecast) == (120000.25, 260000.0)
        assert result.notes == ["from the AWS Budget gpucluster-team-a-monthly (Cost Explorer: AccessDeniedException); "
                                "refreshed a few times a day"]
        with Stubber(client) as stub:  # and no budget either: said, with both causes
            stub.add_client_error("get_cost_and_usage", service_error_code="AccessDeniedException")
            missing = spend.spend(client, load_stack(ROOT / "stacks" / "Pulumi.dev.yaml"), TODAY, budgets=budgets,
                                  account="123456789012")
        assert missing.month_to_date is None
        assert missing.notes[0].startswith("spend not read: Cost Explorer AccessDeniedException, and the budget "
                                           "gpucluster-dev-monthly:")
