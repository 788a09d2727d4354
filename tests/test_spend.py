"""`cost`: Cost Explorer by the stack's tag (recorded answers: moto has no Cost Explorer) and Slurm's GPU-hours."""

from __future__ import annotations

import datetime as dt

import boto3
from botocore.stub import Stubber

from conftest import ROOT
from gpucluster import spend
from gpucluster.spec import load_stack

TEAM_A = load_stack(ROOT / "stacks" / "Pulumi.team-a.yaml")
TODAY = dt.date(2026, 11, 20)
TAG = {"Tags": {"Key": "gpucluster:stack", "Values": ["team-a"], "MatchOptions": ["EQUALS"]}}


def ce():  # type: ignore[no-untyped-def]
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
    assert "GPU-hours:           run this on the head node to read Slurm accounting" in spend.report(TEAM_A, result, None)


def test_gpu_hours_from_sshare_account_rows() -> None:
    # As Slurm 22.05's sshare prints it (checked against the real one in tests/integration): minutes per TRES.
    out = (" root|root|cpu=0,mem=0,energy=0,node=0,billing=0,fs/disk=0,vmem=0,pages=0,gres/gpu=0|\n"
           "  vision||cpu=7200,mem=9000,node=60,billing=7200,gres/gpu=91230|\n"
           "   vision|alice|cpu=7200,mem=9000,node=60,billing=7200,gres/gpu=90000|\n"
           "  speech||cpu=3,mem=0|\n")
    assert spend.gpu_hours_by_account(out) == {"vision": 1520.5, "speech": 0.0}


def test_month_bounds() -> None:
    assert spend.month_bounds(dt.date(2026, 12, 31)) == (dt.date(2026, 12, 1), dt.date(2027, 1, 1))
