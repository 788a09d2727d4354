"""`cost`: Cost Explorer by the stack's tag (recorded answers: moto has no Cost Explorer) and Slurm's GPU-hours."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.stub import Stubber

from conftest import ROOT, in_process_moto
from gpucluster.aws import spend
from gpucluster.contract import slurm_json
from gpucluster.node import usage
from gpucluster.project import EXAMPLES_DIR
from gpucluster.spec import cost
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
    quota = cost.quota(TEAM_A).usd
    lines = spend.report(TEAM_A, result, slurm_json.GpuHours({"root": 20005.0, "vision": 20000.0, "other": 5.0}, {},
                                                        {"vision": quota / 4}))
    assert "Spent this month:    $180,000.50 (72% of the budget)" in lines
    assert "Forecast for month:  $275,000.50 - over budget" in lines
    assert f"Quota:               {cost.money(quota / 4)} of {cost.money(quota)} (25%) billed to account vision" \
        in lines
    assert "GPU-hours:           20,000.0 for account vision" in lines
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
        in spend.report(TEAM_A, result, usage.OFF_THE_HEAD)


# As the node image's Slurm (24.11) prints `sshare -n -P -a -o Account,User,GrpTRESRaw,GrpTRESMins`, seen in the
# rehearsal (and checked against the real one in tests/integration): accounts indented by depth, each user row one level
# below its account and naming it, minutes per TRES with gres/gpumem and gres/gpuutil beside gres/gpu, the account's
# billing quota in its GrpTRESMins, no trailing separator.
SSHARE = ("root||cpu=0,mem=0,energy=0,node=0,billing=0,fs/disk=0,vmem=0,pages=0,gres/gpu=0,gres/gpumem=0,"
          "gres/gpuutil=0|\n"
          " root|root|cpu=0,mem=0,energy=0,node=0,billing=0,fs/disk=0,vmem=0,pages=0,gres/gpu=0,gres/gpumem=0,"
          "gres/gpuutil=0|\n"
          " vision||cpu=7200,mem=9000,node=60,billing=7200,gres/gpu=91230,gres/gpumem=5000,gres/gpuutil=40|"
          "billing=600000\n"
          "  vision|alice|cpu=7200,mem=9000,node=60,billing=7200,gres/gpu=68400,gres/gpumem=5000,gres/gpuutil=40|\n"
          "  vision|bob|cpu=0,mem=0,gres/gpu=22800,gres/gpumem=0|\n"
          "  vision|ubuntu|cpu=0,mem=0,gres/gpu=30,gres/gpumem=0|\n"
          " speech||cpu=3,mem=0,gres/gpumem=0|\n"
          "  speech|carol|cpu=3,mem=0,gres/gpumem=0|\n")


def test_gpu_hours_from_sshare_account_and_user_rows() -> None:
    used = slurm_json.gpu_hours(SSHARE)
    assert used.accounts == {"root": 0.0, "vision": 91230 / 60, "speech": 0.0}
    assert used.users == {("root", "root"): 0.0, ("vision", "alice"): 68400 / 60, ("vision", "bob"): 22800 / 60,
                          ("vision", "ubuntu"): 30 / 60, ("speech", "carol"): 0.0}
    # The account's own row, with its money quota (GrpTRESMins' billing); none where sshare printed no row.
    assert slurm_json.account_row(SSHARE, "vision") == slurm_json.AccountRow("vision", "", 91230, 7200, 600000)
    assert slurm_json.account_row(SSHARE, "speech") == slurm_json.AccountRow("speech", "", 0, 0, None)
    assert slurm_json.account_row("sshare: error: Problem talking to the database\n", "vision") is None


def person_lines(lines: list[str]) -> dict[str, list[str]]:
    """The report's rows by person: name -> the row's other words."""
    start = next(i for i, line in enumerate(lines) if line.startswith("GPU-hours by person"))
    rows = [line.split() for line in lines[start + 1:] if line.startswith("  ")]
    return {row[0]: row[1:] for row in rows}


def test_each_persons_gpu_hours_and_their_share_of_the_spend() -> None:
    """alice used three quarters of the team's GPU-hours, bob a quarter, the login user (verify's jobs) a sliver:
    the spend is shared out in the same proportions, and the people's shares add up to the spend."""
    spent = 100000.0
    used = slurm_json.gpu_hours(SSHARE)
    team = used.accounts["vision"]
    lines = spend.report(TEAM_A, spend.Spend(spent, None, []), used)
    rows = person_lines(lines)
    assert list(rows) == ["alice", "bob", "ubuntu"]  # most first; carol is speech's
    for name, hours in (("alice", 68400 / 60), ("bob", 22800 / 60)):
        assert rows[name] == [f"{hours:,.1f}", f"{100 * hours / team:.0f}%", f"${spent * hours / team:,.2f}"]
    assert " ".join(rows["ubuntu"]).endswith("(the cluster's own: verify's jobs)")
    allocated = sum(float(row[2].strip("$").replace(",", "")) for row in rows.values())
    assert allocated == pytest.approx(spent, abs=0.01 * len(rows))
    assert ("GPU-hours by person (the month's spend allocated by share of GPU-hours, not a bill):") in lines
    assert f"GPU-hours:           {team:,.1f} for account vision" in lines
    # the billing TRES in cent-minutes (sshare's billing=7200): what the team's jobs billed against the money quota
    assert used.billed_usd["vision"] == pytest.approx(7200 / 60 / slurm_json.BILLING_CENTS_PER_USD)


def test_the_json_report_carries_the_texts_figures() -> None:
    """`cost STACK --json`: the text report's content as one object, figure for figure."""
    result = spend.Spend(100000.0, 260000.0, ["a note"])
    used = slurm_json.gpu_hours(SSHARE)
    text, doc = spend.report(TEAM_A, result, used), spend.as_json(TEAM_A, result, used)
    assert f"Spent this month:    {cost.money(doc['spent_usd'])} (40% of the budget)" in text
    assert f"Forecast for month:  {cost.money(doc['forecast_usd'])} - over budget" in text and doc["over_budget"]
    assert f"Budget:              {cost.money(doc['budget_usd'])}" in text
    quota = doc["quota"]
    assert any(line.startswith(f"Quota:               {cost.money(quota['billed_usd'])} of "
                               f"{cost.money(quota['usd'])}") for line in text)
    assert f"GPU-hours:           {doc['gpu_hours']:,.1f} for account vision" in text
    assert doc["other_accounts_gpu_hours"] == {"speech": 0.0} and "  speech: 0.0" in text
    rows = person_lines(text)
    assert [p["user"] for p in doc["people"]] == list(rows)
    for person in doc["people"]:
        hours, share, allocated = rows[person["user"]][:3]
        assert (f"{person['gpu_hours']:,.1f}", f"{person['share_percent']:.0f}%", cost.money(person["allocated_usd"])) \
            == (hours, share, allocated)
    assert doc["notes"] == ["a note"] and "Note: a note" in text
    assert (doc["gpu_hours_unknown"], doc["tag"]) == (None, {"gpucluster:stack": "team-a"})


def test_the_json_report_says_why_gpu_hours_are_missing() -> None:
    off = spend.as_json(TEAM_A, spend.Spend(None, None, []), usage.OFF_THE_HEAD)
    assert (off["gpu_hours"], off["gpu_hours_unknown"], off["quota"], off["people"]) == (None, usage.OFF_THE_HEAD,
                                                                                        None, [])
    assert off["spent_usd"] is None and not off["over_budget"]
    own = spend.as_json(TEAM_A, spend.Spend(1000.0, None, []), slurm_json.gpu_hours("  vision|alice|gres/gpu=120|\n"))
    assert own["gpu_hours"] is None and own["gpu_hours_unknown"].startswith("only your own")
    assert f"`gpucluster status {TEAM_A.name}` shows what the team billed and its GPU-hours" in own["gpu_hours_unknown"]
    assert own["people"] == [{"user": "alice", "gpu_hours": 2.0}]


def test_without_people_the_login_user_is_the_whole_team_and_an_unread_spend_is_said() -> None:
    dev = load_stack(ROOT / "stacks" / "Pulumi.dev.yaml")
    out = "platform||gres/gpu=600|\n platform|ubuntu|gres/gpu=600|\n"
    rows = person_lines(spend.report(dev, spend.Spend(None, None, []), slurm_json.gpu_hours(out)))
    assert rows == {"ubuntu": ["10.0", "100%", "unknown"]}


def test_a_person_who_sees_only_their_own_usage_is_told_so() -> None:
    """Slurm's PrivateData=usage: sshare run by alice lists her association only, not the team account's row; the
    report says so rather than print the team's GPU-hours as nought."""
    lines = spend.report(TEAM_A, spend.Spend(1000.0, None, []), slurm_json.gpu_hours("  vision|alice|gres/gpu=120|\n"))
    assert ("GPU-hours:           only your own: Slurm shows account vision's to root (an admin's sudo); "
            f"`gpucluster status {TEAM_A.name}` shows what the team billed and its GPU-hours") in lines
    assert person_lines(lines) == {"alice": ["2.0"]} and "GPU-hours by person:" in lines
    assert not any(line.startswith("GPU-hours:           0.0") for line in lines)


def test_a_stack_with_no_gpu_use_yet_lists_nobody() -> None:
    lines = spend.report(TEAM_A, spend.Spend(10.0, None, []), slurm_json.gpu_hours("root||gres/gpu=0|\n vision|||\n"))
    assert f"Quota:               $0.00 of {cost.money(cost.quota(TEAM_A).usd)} (0%) billed to account vision" in lines
    assert "GPU-hours:           0.0 for account vision" in lines
    assert not any("by person" in line for line in lines)


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
           "AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_MAX_ATTEMPTS": "1", "HOME": str(tmp_path),
           "GPUCLUSTER_STACKS": str(tmp_path / "lib" / "stacks")}  # as the head's wrapper sets it
    out = subprocess.run([sys.executable, "-I", "-c", program, str(tmp_path / "lib")], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and out.stderr == "", out.stderr  # a spend nobody could read: not within budget
    assert "Stack team-a (team vision)" in out.stdout and "Budget:              $250,000.00" in out.stdout
    assert "Note: spend not read: Could not connect" in out.stdout
    # The stack file it read is the stack that was planned, to the last setting.
    from gpucluster.spec.model import load_stack as load

    assert load(tmp_path / "lib" / "stacks" / "Pulumi.team-a.yaml") == TEAM_A


def test_where_cost_explorer_is_denied_the_stacks_budget_answers() -> None:
    """The head node's role may read its own budget, not the account's costs."""
    with in_process_moto():
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


def test_a_machine_with_slurms_client_is_not_taken_for_the_head(tmp_path: Path) -> None:
    """An operator's machine with Slurm's client (this one has Debian's, whose sshare finds no controller and exits
    1): `cost` says where GPU-hours are read instead of ending in sshare's CalledProcessError."""
    import os
    import shutil
    import subprocess
    import sys

    from gpucluster.contract.settings import SETTINGS_FILE

    sshare = shutil.which("sshare")
    assert sshare, "the test machine has Slurm's client (slurm-client): this test is about such a machine"
    assert not Path(SETTINGS_FILE).exists(), "this machine is no head node"
    env = {"PATH": f"{Path(sshare).parent}:{os.environ['PATH']}", "AWS_ACCESS_KEY_ID": "x",
           "AWS_SECRET_ACCESS_KEY": "x", "AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_MAX_ATTEMPTS": "1",
           "HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "gpucluster", "cost", "team-a"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr  # 1: no spend read (no endpoint)
    assert f"GPU-hours:           {usage.OFF_THE_HEAD}" in out.stdout.splitlines()


class _CostExplorerStubbed:
    """The operator's session as `cost` uses it, Cost Explorer answered by botocore's Stubber: moto records no spend
    to read and has no GetCostForecast. STS and Budgets are moto's."""

    def __init__(self, cost_explorer: Any) -> None:
        self.cost_explorer = cost_explorer

    def client(self, service: str, region_name: str | None = None) -> Any:
        return self.cost_explorer if service == "ce" else boto3.client(service, region_name=region_name)


@pytest.mark.parametrize(("share", "code"), [(1.01, 1), (0.5, 0)], ids=["over the budget", "within it"])
def test_cost_exits_1_over_the_budget_and_0_within_it(share: float, code: int, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from gpucluster import cli

    spent = TEAM_A.spec.budget.monthly_usd * share
    client = ce()
    with in_process_moto(), Stubber(client) as stub:
        stub.add_response("get_cost_and_usage", {"ResultsByTime": [
            {"Total": {"UnblendedCost": {"Amount": f"{spent:.2f}", "Unit": "USD"}}}]})
        # No forecast (not called on the month's last day): the exit follows the spend alone, whatever the date.
        stub.add_client_error("get_cost_forecast", service_error_code="DataUnavailableException")
        monkeypatch.setattr(cli, "aws_session", lambda region=None: _CostExplorerStubbed(client))
        assert cli.main(["cost", str(ROOT / "stacks" / "Pulumi.team-a.yaml")]) == code
    report = capsys.readouterr().out.splitlines()
    assert any(line.startswith(f"Spent this month:    {cost.money(spent)}") for line in report), report
