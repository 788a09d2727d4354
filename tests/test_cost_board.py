"""`gpucluster cost --all`: the board across teams. Budgets in moto; Cost Explorer recorded with botocore's Stubber
where the calls themselves are the point (moto has no GetCostForecast, and answers GetCostAndUsage from a queue
whatever the request), else moto's queue; idle GPU-hours from a real Prometheus over a backfilled month."""

from __future__ import annotations

import contextlib
import datetime as dt
import io
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import boto3
import pytest
from botocore.stub import Stubber

from conftest import ALL_STACK_FILES, ROOT, in_process_moto, reset_moto
from gpucluster import cli
from gpucluster.aws import cost_board
from gpucluster.node import usage
from gpucluster.render import prometheus
from gpucluster.spec import cost
from gpucluster.spec.cost import COST_TAG
from gpucluster.spec.model import Stack, load_stack

STACKS = [load_stack(p) for p in ALL_STACK_FILES]
BY_NAME = {s.name: s for s in STACKS}
ACCOUNT = "123456789012"
TODAY = dt.date(2026, 11, 20)
DEPLOYED = ("dev", "team-a", "team-b")  # team-k8s has no budget: not deployed
# The month's spend by the stack tag as Cost Explorer groups it; team-k8s's is what still bills after its destroy.
SPENT = {"dev": 120.25, "team-a": 180000.5, "team-k8s": 12.0}
FORECAST_REST = {"dev": 80.0, "team-a": 95000.0, "team-b": 1000.0}  # team-a's month: over its $250,000


def off_the_head(stack: Stack) -> cost_board.Usage:
    return cost_board.usage(usage.head_usage(stack.cluster_name, stack.spec.team, prometheus.idle_gpu_hours_query,
                                             dt.datetime(2026, 11, 20, tzinfo=dt.UTC),
                                             settings_file="/nonexistent/cluster.json"))


@pytest.fixture
def budgets() -> Iterator[Any]:
    with in_process_moto():
        client = boto3.client("budgets", region_name="us-east-1")
        for name in DEPLOYED:
            stack = BY_NAME[name]
            client.create_budget(AccountId=ACCOUNT, Budget={
                "BudgetName": stack.budget_name, "BudgetType": "COST", "TimeUnit": "MONTHLY",
                "BudgetLimit": {"Amount": str(stack.spec.budget.monthly_usd), "Unit": "USD"},
                "CalculatedSpend": {"ActualSpend": {"Amount": str(SPENT.get(name, 0.0) + 1), "Unit": "USD"},
                                    "ForecastedSpend": {"Amount": str(2 * SPENT.get(name, 0.0)), "Unit": "USD"}}})
        yield client


def ce() -> Any:
    return boto3.client("ce", region_name="us-east-1", aws_access_key_id="t", aws_secret_access_key="t")


def grouped_request() -> dict[str, Any]:
    return {"TimePeriod": {"Start": "2026-11-01", "End": "2026-11-20"}, "Granularity": "MONTHLY",
            "Metrics": ["UnblendedCost"], "GroupBy": [{"Type": "TAG", "Key": COST_TAG}],
            "Filter": {"Tags": {"Key": COST_TAG, "Values": sorted(BY_NAME), "MatchOptions": ["EQUALS"]}}}


def groups(spent: dict[str, float]) -> list[dict[str, Any]]:
    return [{"Keys": [f"{COST_TAG}${name}"], "Metrics": {"UnblendedCost": {"Amount": str(usd), "Unit": "USD"}}}
            for name, usd in spent.items()]


def test_one_grouped_query_for_every_team_and_a_forecast_per_deployed_one(budgets: Any) -> None:
    client = ce()
    with Stubber(client) as stub:
        # Cost Explorer pages a grouped answer: the board follows NextPageToken.
        first, rest = dict(list(SPENT.items())[:2]), dict(list(SPENT.items())[2:])
        stub.add_response("get_cost_and_usage", {"ResultsByTime": [{"Groups": groups(first)}], "NextPageToken": "p2"},
                          grouped_request())
        stub.add_response("get_cost_and_usage", {"ResultsByTime": [{"Groups": groups(rest)}]},
                          grouped_request() | {"NextPageToken": "p2"})
        for name in DEPLOYED:
            stub.add_response("get_cost_forecast", {"Total": {"Amount": str(FORECAST_REST[name]), "Unit": "USD"}},
                              {"TimePeriod": {"Start": "2026-11-21", "End": "2026-12-01"},
                               "Metric": "UNBLENDED_COST", "Granularity": "MONTHLY",
                               "Filter": {"Tags": {"Key": COST_TAG, "Values": [name], "MatchOptions": ["EQUALS"]}}})
        rows, notes = cost_board.board(STACKS, client, budgets, ACCOUNT, TODAY, off_the_head)
        stub.assert_no_pending_responses()
    assert notes == []
    by = {r.stack: r for r in rows}
    assert [r.stack for r in rows] == [s.name for s in STACKS]
    for name in DEPLOYED:
        row, spent = by[name], SPENT.get(name, 0.0)
        assert row.deployed and row.spent == spent and row.forecast == spent + FORECAST_REST[name]
        # The board's budget is the one `plan --json` prints for the stack.
        assert row.budget == cost.estimate(BY_NAME[name]).summary()["budget_monthly_usd"]
    assert by["team-a"].status == "forecast over budget" and by["dev"].status == "within budget"
    assert not by["team-k8s"].deployed and by["team-k8s"].forecast is None
    assert by["team-k8s"].status == "not deployed (still $12.00 this month: `gpucluster leftovers`)"
    assert cost_board.exit_code(rows) == 1
    assert cost_board.exit_code([by["dev"], by["team-b"], by["team-k8s"]]) == 0
    total = cost_board.total(rows)
    assert total["spent_usd"] == pytest.approx(sum(SPENT.values()))
    assert total["forecast_usd"] == pytest.approx(sum(SPENT.get(n, 0.0) + FORECAST_REST[n] for n in DEPLOYED))
    assert total["budget_usd"] == sum(BY_NAME[n].spec.budget.monthly_usd for n in DEPLOYED)
    # Off the head nobody knows the GPU-hours: unknown, with where to read them; never 0.
    assert total["gpu_hours"] is None and total["idle_gpu_hours"] is None
    doc = cost_board.as_json(rows, notes)
    assert {t["gpu_hours"] for t in doc["teams"]} == {None}
    assert {t["gpu_hours_unknown"] for t in doc["teams"] if t["deployed"]} == {cost_board.HEAD_ONLY}
    assert doc["over_budget"] == ["team-a"] and doc["spend_unknown"] == []
    text = cost_board.text(rows, notes, TODAY)
    assert f"Note (dev, team-a, team-b): GPU-hours and idle GPU-hours unknown: {cost_board.HEAD_ONLY}" in text
    total_line = next(line for line in text if line.startswith("total"))
    assert f"${sum(SPENT.values()):,.2f}" in total_line and total_line.split()[-2:] == ["unknown", "unknown"]


def test_where_cost_explorer_is_denied_each_budget_answers_and_no_forecast_is_asked(budgets: Any) -> None:
    client = ce()
    with Stubber(client) as stub:
        stub.add_client_error("get_cost_and_usage", service_error_code="AccessDeniedException")
        rows, notes = cost_board.board(STACKS, client, budgets, ACCOUNT, TODAY, off_the_head)
        stub.assert_no_pending_responses()
    by = {r.stack: r for r in rows}
    for name in DEPLOYED:
        assert (by[name].spent, by[name].forecast) == (SPENT.get(name, 0.0) + 1, 2 * SPENT.get(name, 0.0))
    assert by["team-k8s"].spent is None and not by["team-k8s"].unread  # not deployed: nothing to read
    assert notes == ["Cost Explorer: AccessDeniedException (needs ce:GetCostAndUsage); spend and forecast from each "
                     "stack's AWS Budget, refreshed a few times a day"]


def test_without_any_access_every_figure_is_unknown_and_the_board_fails() -> None:
    client = ce()
    with Stubber(client) as stub:
        stub.add_client_error("get_cost_and_usage", service_error_code="AccessDeniedException")
        rows, notes = cost_board.board(STACKS, client, None, None, TODAY, off_the_head)
    assert {(r.deployed, r.spent, r.forecast) for r in rows} == {(None, None, None)}
    assert all(r.unread and r.status == "spend unknown" for r in rows)
    assert cost_board.exit_code(rows) == 1
    assert notes[0] == ("whether each stack is deployed is unknown: the account could not be read "
                        "(sts:GetCallerIdentity)")


def run(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), mock.patch.dict("os.environ", env), \
            contextlib.chdir(ROOT):
        code = cli.main(list(args))
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def moto_env(url: str) -> dict[str, str]:
    return {"AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "t", "AWS_SECRET_ACCESS_KEY": "t",
            "AWS_MAX_ATTEMPTS": "1", "AWS_DEFAULT_REGION": "us-east-1"}


def test_the_command_against_moto(moto_url: str) -> None:
    """The command line over moto: the shipped stacks, dev and team-b deployed (their budgets), Cost Explorer's
    grouped answer from moto's queue; moto has no GetCostForecast: said per team, not a crash."""
    import urllib.request

    reset_moto(moto_url)
    env = moto_env(moto_url)
    with mock.patch.dict("os.environ", env):
        account = boto3.client("sts").get_caller_identity()["Account"]
        client = boto3.client("budgets")
        for name in ("dev", "team-b"):
            client.create_budget(AccountId=account, Budget={
                "BudgetName": BY_NAME[name].budget_name, "BudgetType": "COST", "TimeUnit": "MONTHLY",
                "BudgetLimit": {"Amount": "1", "Unit": "USD"}})
    answer = {"results": [{"ResultsByTime": [{"Groups": groups({"dev": 600.0, "team-b": 10.0})}]}]}
    urllib.request.urlopen(urllib.request.Request(f"{moto_url}/moto-api/static/ce/cost-and-usage-results",
                                                  data=json.dumps(answer).encode(), method="POST"))
    out = run("cost", "--all", "--json", env=env)
    assert "Traceback" not in out.stderr, out.stderr
    doc = json.loads(out.stdout)
    by = {t["stack"]: t for t in doc["teams"]}
    assert [t["stack"] for t in doc["teams"]] == sorted(BY_NAME)
    assert {n for n, t in by.items() if t["deployed"]} == {"dev", "team-b"}
    assert by["dev"]["spent_usd"] == 600.0 and by["team-a"]["spent_usd"] == 0.0
    # dev's $600 is over its $500 budget: the board's exit says a team is over.
    assert doc["over_budget"] == ["dev"] and out.returncode == 1
    for name, team in by.items():
        assert team["budget_usd"] == cost.estimate(BY_NAME[name]).summary()["budget_monthly_usd"]
    assert by["dev"]["forecast_usd"] is None and by["dev"]["notes"][0].startswith("no forecast: ")
    text = run("cost", "--all", env=env)
    assert text.returncode == 1 and any(line.startswith("dev ") and "OVER BUDGET" in line
                                        for line in text.stdout.splitlines())


def test_bad_input_is_exit_2_with_every_problem(tmp_path: Path) -> None:
    bad = tmp_path / "Pulumi.bad.yaml"
    bad.write_text((ROOT / "stacks" / "Pulumi.dev.yaml").read_text().replace("monthly_usd: 500", "monthly_usd: -5"))
    out = run("cost", "--all", str(bad), str(tmp_path / "Pulumi.missing.yaml"), "--json", env={})
    assert out.returncode == 2
    errors = json.loads(out.stdout)["errors"]
    assert [e["path"] for e in errors] == ["gpucluster:cluster.budget.monthly_usd", "file"]
    assert errors[1]["message"] == f"{tmp_path / 'Pulumi.missing.yaml'}: no such stack file"
    nothing = run("cost", env={})
    assert nothing.returncode == 2 and "say which stacks" in nothing.stderr


def test_where_neither_cost_explorer_nor_the_list_of_budgets_is_allowed_each_stacks_budget_is_read() -> None:
    """As the head's role: budgets:ViewBudget on its own budget only (components/head_node.py), no Cost Explorer."""
    client, budgets = ce(), boto3.client("budgets", region_name="us-east-1", aws_access_key_id="t",
                                         aws_secret_access_key="t")
    team_a = BY_NAME["team-a"]
    with Stubber(client) as ce_stub, Stubber(budgets) as budget_stub:
        ce_stub.add_client_error("get_cost_and_usage", service_error_code="AccessDeniedException")
        budget_stub.add_client_error("describe_budgets", service_error_code="AccessDeniedException")
        budget_stub.add_response("describe_budget", {"Budget": {
            "BudgetName": team_a.budget_name, "BudgetType": "COST", "TimeUnit": "MONTHLY",
            "CalculatedSpend": {"ActualSpend": {"Amount": "1000.5", "Unit": "USD"},
                                "ForecastedSpend": {"Amount": "2000", "Unit": "USD"}}}},
            {"AccountId": ACCOUNT, "BudgetName": team_a.budget_name})
        (row,), notes = cost_board.board([team_a], client, budgets, ACCOUNT, TODAY, off_the_head)
        budget_stub.assert_no_pending_responses()
    assert (row.deployed, row.spent, row.forecast) == (True, 1000.5, 2000.0)
    assert row.notes[0].startswith(f"from the AWS Budget {team_a.budget_name} (Cost Explorer: AccessDeniedException)")
    assert notes[0].startswith("whether each stack is deployed is unknown: budgets not listed: AccessDeniedException")


@pytest.mark.parametrize("as_json", [False, True])
def test_one_stacks_exit_is_the_boards_as_text_or_json(moto_url: str, as_json: bool) -> None:
    """`cost dev`, one stack's report in text or JSON: over its $500 budget, exit 1 either way; within it, 0. Cost
    Explorer's answer from moto's queue (moto keeps the first answer to a request: reset each time)."""
    import urllib.request

    for usd in (600.0, 10.0):
        reset_moto(moto_url)
        result = {"ResultsByTime": [{"Total": {"UnblendedCost": {"Amount": str(usd), "Unit": "USD"}}}]}
        urllib.request.urlopen(urllib.request.Request(f"{moto_url}/moto-api/static/ce/cost-and-usage-results",
                                                      data=json.dumps({"results": [result]}).encode(),
                                                      method="POST"))
        out = run("cost", "dev", *(["--json"] if as_json else []), env=moto_env(moto_url))
        assert "Traceback" not in out.stderr, out.stderr
        if as_json:  # the stack's own report, not the board's row
            doc = json.loads(out.stdout)
            assert (doc["stack"], doc["spent_usd"], "teams" in doc) == ("dev", usd, False)
        else:
            assert out.stdout.splitlines()[1].startswith(f"Spent this month:    {cost.money(usd)}"), out.stdout
        assert out.returncode == (1 if usd > BY_NAME["dev"].spec.budget.monthly_usd else 0), out.stdout
