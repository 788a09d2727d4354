"""The Grafana dashboards (gpucluster/render/dashboards.py): every query parses with Prometheus' own promtool, names
only metrics our exporters produce or our rules record, and the cost board's idle-cost query computes what it
claims."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import STACK_FILES
from gpucluster.contract import settings, verify
from gpucluster.render import dashboards, monitoring, prometheus
from gpucluster.spec.model import Stack, load_stack

STACKS = {p.name: load_stack(p) for p in STACK_FILES}
Board = dict[str, Any]  # a dashboard's JSON model
KNOWN_METRICS = frozenset().union(*prometheus.EXPORTED.values()) | {name for name, _ in prometheus.RECORDING_RULES}
# Grafana's built-in variables, replaced with values of the kind Grafana sends.
GRAFANA_VARIABLES = {"__range": "2592000s", "__rate_interval": "2m", "__interval": "30s"}
LABEL_VALUES = re.compile(r"label_values\((?P<expr>.+),\s*(?P<label>[a-zA-Z_]\w*)\)")

# PromQL's functions and aggregation operators (Prometheus 2.x): a name before "(" must be one of them.
FUNCTIONS = frozenset("""
    abs absent absent_over_time acos acosh asin asinh atan atanh avg_over_time ceil changes clamp clamp_max clamp_min
    cos cosh count_over_time day_of_month day_of_week day_of_year days_in_month deg delta deriv exp floor
    histogram_quantile holt_winters hour idelta increase irate label_join label_replace last_over_time ln log10 log2
    max_over_time min_over_time minute month pi predict_linear present_over_time quantile_over_time rad rate resets
    round scalar sgn sin sinh sort sort_desc sqrt stddev_over_time stdvar_over_time sum_over_time tan tanh time
    timestamp vector year""".split())
AGGREGATIONS = frozenset("sum min max avg group stddev stdvar count count_values bottomk topk quantile".split())
KEYWORDS = frozenset("by without on ignoring group_left group_right bool and or unless offset atan2 inf nan".split())


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects. Raises on a call of anything but a PromQL function, so that a
    misspelled function is not taken for a metric (promtool rejects it too)."""
    assert "__name__" not in expr, f"select metrics by name, not by __name__: {expr}"
    text = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)  # label values, regexes
    text = re.sub(r"\{[^{}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # ranges and subquery steps
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", r"\1", text)  # label lists
    names = set()
    for m in re.finditer(r"(?<![\w.:])([A-Za-z_:][\w:]*)(\s*\()?", text):
        name, call = m.group(1), m.group(2)
        if name.lower() in KEYWORDS or name.lower() in AGGREGATIONS:
            continue
        if call:
            if name not in FUNCTIONS:
                raise ValueError(f"{name}( is no PromQL function: {expr}")
            continue
        names.add(name)
    return names


def boards(stack: Stack) -> dict[str, Board]:
    return {path: json.loads(text) for path, text in dashboards.files(stack).items()}


def panels(board: Board) -> list[dict[str, Any]]:
    return [p for p in board["panels"] if p["type"] != "row"]


def substituted(expr: str, board: Board) -> str:
    """The expression as Prometheus gets it: Grafana's variables and the board's own replaced with valid values."""
    values = GRAFANA_VARIABLES | {v["name"]: "x" for v in board.get("templating", {}).get("list", [])}
    return re.sub(r"\$\{?(\w+)\}?", lambda m: values[m.group(1)], expr)  # KeyError: a variable the board lacks


def expressions(board: Board) -> Iterator[str]:
    """Every PromQL expression of a board, variables substituted: its panels' queries and its variables' selectors."""
    for panel in panels(board):
        for target in panel["targets"]:
            yield substituted(target["expr"], board)
    for variable in board.get("templating", {}).get("list", []):
        m = LABEL_VALUES.fullmatch(variable["query"])
        assert m, f"variable {variable['name']}: not label_values(<selector>, <label>): {variable['query']}"
        yield substituted(m["expr"], board)


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    path = shutil.which("promtool")
    # No skip: `make test` installs Debian's prometheus package, which ships promtool.
    assert path, "promtool not found: install Debian's prometheus package (make system-packages does)"
    return subprocess.run([path, *args], capture_output=True, text=True, timeout=60)


def check_expressions(exprs: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """promtool's check of the expressions, each as a recording rule."""
    rules = tmp_path / "dashboards.rules.yml"
    rules.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": [
        {"record": f"dashboard:expr:{i}", "expr": e} for i, e in enumerate(exprs)]}]}))
    return promtool("check", "rules", str(rules))


@pytest.mark.parametrize("name", STACKS)
def test_every_panel_queries_and_every_query_parses(name: str, tmp_path: Path) -> None:
    exprs = []
    for path, board in boards(STACKS[name]).items():
        assert panels(board), path
        for panel in panels(board):
            assert panel["targets"], f"{path}: panel {panel['title']!r} has no query"
            assert all(t["expr"].strip() for t in panel["targets"]), f"{path}: {panel['title']!r}"
        exprs += list(expressions(board))
    done = check_expressions(exprs, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{len(exprs)} rules found" in done.stdout, done.stdout


def test_promtool_rejects_a_broken_expression(tmp_path: Path) -> None:
    good = "sum by (pool) (rate(gpucluster_efa_rx_bytes_total[2m]))"
    assert check_expressions([good], tmp_path).returncode == 0
    for broken in ("sum by (pool) (rate(gpucluster_efa_rx_bytes_total[2m])", "sum(rat(up[2m]))",
                   "sum(gpucluster:gpu_idle[$__range])"):
        done = check_expressions([good, broken], tmp_path)
        assert done.returncode != 0, broken


@pytest.mark.parametrize("name", STACKS)
def test_every_metric_is_exported_or_recorded(name: str) -> None:
    for path, board in boards(STACKS[name]).items():
        for expr in expressions(board):
            names = metric_names(expr)
            assert names, f"{path}: no metric in {expr}"
            assert names <= KNOWN_METRICS, f"{path}: {sorted(names - KNOWN_METRICS)} in {expr}"


def test_metric_names_are_parsed_strictly() -> None:
    assert metric_names('1 - avg by (pool, node) (rate(node_cpu_seconds_total{mode="idle", node=~"a|b"}[2m]))') == {
        "node_cpu_seconds_total"}
    assert metric_names(dashboards.IDLE_COST_BY_POOL.replace("$__range", "1h")) == {
        "gpucluster:gpu_idle", "gpucluster_pool_gpu_hour_usd"}
    assert metric_names("count(up) / 1e3 > bool 0.5") == {"up"}
    with pytest.raises(ValueError, match="rat"):
        metric_names("sum(rat(up[5m]))")
    # A misspelled metric in a real query is caught.
    board = boards(STACKS["Pulumi.team-b.yaml"])[f"{settings.DASHBOARDS_DIR}/{dashboards.COST_UID}.json"]
    idle_cost = [e for e in expressions(board) if "gpucluster_pool_gpu_hour_usd" in e]
    assert idle_cost
    for right, wrong in (("gpucluster_pool_gpu_hour_usd", "gpucluster_pool_gpu_hours_usd"),
                         ("gpucluster:gpu_idle", "gpucluster:gpu_idel")):
        assert wrong in metric_names(idle_cost[0].replace(right, wrong)) - KNOWN_METRICS


@pytest.mark.parametrize("name", STACKS)
def test_json_is_deterministic_and_canonical(name: str) -> None:
    first, second = dashboards.files(STACKS[name]), dashboards.files(STACKS[name])
    assert first == second
    for text in first.values():
        assert text == json.dumps(json.loads(text), sort_keys=True, indent=2) + "\n"


def datasources(node: object) -> Iterator[object]:
    if isinstance(node, dict):
        if "datasource" in node:
            yield node["datasource"]
        for value in node.values():
            yield from datasources(value)
    elif isinstance(node, list):
        for value in node:
            yield from datasources(value)


@pytest.mark.parametrize("name", STACKS)
def test_boards_have_fixed_unique_uids_and_use_the_datasource_uid(name: str) -> None:
    assert dashboards.DATASOURCE_UID == "prometheus"  # the uid the head provisions its Prometheus datasource under
    found = boards(STACKS[name])
    uids = [board["uid"] for board in found.values()]
    assert sorted(uids) == sorted({dashboards.OVERVIEW_UID, dashboards.JOBS_UID, dashboards.COST_UID})
    assert sorted(found) == sorted(f"{settings.DASHBOARDS_DIR}/{uid}.json" for uid in uids)
    for path, board in found.items():
        for panel in panels(board):
            assert panel["datasource"]["uid"] == dashboards.DATASOURCE_UID, (path, panel["title"])
            assert all(t["datasource"]["uid"] == dashboards.DATASOURCE_UID for t in panel["targets"]), path
        for variable in board.get("templating", {}).get("list", []):
            assert variable["datasource"]["uid"] == dashboards.DATASOURCE_UID, (path, variable["name"])
        assert {json.dumps(d, sort_keys=True) for d in datasources(board)} == {
            json.dumps({"type": "prometheus", "uid": dashboards.DATASOURCE_UID})}, path
        assert len({p["id"] for p in board["panels"]}) == len(board["panels"]), path
        assert len({p["title"] for p in board["panels"]}) == len(board["panels"]), path


def cost_board(stack: Stack) -> Board:
    return boards(stack)[f"{settings.DASHBOARDS_DIR}/{dashboards.COST_UID}.json"]


def test_cost_board_shows_this_month_in_utc() -> None:
    board = cost_board(STACKS["Pulumi.team-a.yaml"])
    assert board["time"] == {"from": "now/M", "to": "now"}
    assert board["timezone"] == "utc"  # AWS's billing month


def test_idle_cost_joins_each_gpu_on_its_pools_price() -> None:
    exprs = [t["expr"] for p in panels(cost_board(STACKS["Pulumi.team-a.yaml"])) for t in p["targets"]
             if "gpucluster_pool_gpu_hour_usd" in t["expr"]]
    assert exprs
    for expr in exprs:
        assert re.search(r"sum_over_time\(gpucluster:gpu_idle\[\$__range\]\) \* on\(pool\) group_left\(\) "
                         r"max by \(pool\) \(gpucluster_pool_gpu_hour_usd\)", expr), expr
        assert f"* {prometheus.SCRAPE_SECONDS} / 3600" in expr, expr


def test_idle_gpu_hours_and_their_cost_per_pool(tmp_path: Path) -> None:
    """The cost board's idle queries evaluated by promtool on known series: pool a has one GPU idle for an hour and
    another for half an hour at $4 per GPU-hour; pool b's GPU is busy; pool a's price also comes from a replaced
    head."""
    board = cost_board(STACKS["Pulumi.team-a.yaml"])
    by_title = {p["title"]: [t["expr"] for t in p["targets"]] for p in panels(board)}
    step = prometheus.SCRAPE_SECONDS
    window = 241 * step  # 242 samples from 0; the idle ones lie inside, whichever end the range includes
    evaluate = lambda expr: expr.replace("$__range", f"{window}s")  # noqa: E731
    hour = 3600 // step  # samples in an hour
    idle_hours = 1.5
    test: dict[str, Any] = {"rule_files": [], "evaluation_interval": f"{step}s", "tests": [{
        "interval": f"{step}s",
        "input_series": [
            {"series": 'gpucluster:gpu_idle{pool="a", node="a-1", gpu="0"}', "values": f"0x40 1x{hour - 1} 0x80"},
            {"series": 'gpucluster:gpu_idle{pool="a", node="a-1", gpu="1"}', "values": f"0x40 1x{hour // 2 - 1} 0x140"},
            {"series": 'gpucluster:gpu_idle{pool="b", node="b-1", gpu="0"}', "values": "0x241"},
            {"series": 'gpucluster_pool_gpu_hour_usd{pool="a", instance="head"}', "values": "4x241"},
            {"series": 'gpucluster_pool_gpu_hour_usd{pool="a", instance="old-head"}', "values": "4x241"},
            {"series": 'gpucluster_pool_gpu_hour_usd{pool="b", instance="head"}', "values": "10x241"},
        ],
        "promql_expr_test": [
            {"expr": evaluate(by_title["Idle GPU-hours"][0]), "eval_time": f"{window}s",
             "exp_samples": [{"labels": "{}", "value": idle_hours}]},
            {"expr": evaluate(by_title["Cost of idle GPUs"][0]), "eval_time": f"{window}s",
             "exp_samples": [{"labels": "{}", "value": idle_hours * 4}]},
            {"expr": evaluate(by_title["Idle GPU-hours and their cost by pool"][0]), "eval_time": f"{window}s",
             "exp_samples": [{"labels": '{pool="a"}', "value": idle_hours}, {"labels": '{pool="b"}', "value": 0}]},
            {"expr": evaluate(by_title["Idle GPU-hours and their cost by pool"][1]), "eval_time": f"{window}s",
             "exp_samples": [{"labels": '{pool="a"}', "value": idle_hours * 4}, {"labels": '{pool="b"}', "value": 0}]},
        ]}]}
    (tmp_path / "test.yml").write_text(yaml.safe_dump(test))
    done = promtool("test", "rules", str(tmp_path / "test.yml"))
    assert done.returncode == 0, done.stdout + done.stderr
    # The same test fails on a wrong figure, so the pass above means something.
    test["tests"][0]["promql_expr_test"][1]["exp_samples"][0]["value"] = idle_hours * 4 + 1
    (tmp_path / "test.yml").write_text(yaml.safe_dump(test))
    assert promtool("test", "rules", str(tmp_path / "test.yml")).returncode != 0


def test_utilisation_panels_mark_the_idle_threshold() -> None:
    found = 0
    for board in boards(STACKS["Pulumi.team-b.yaml"]).values():
        for panel in panels(board):
            defaults = panel["fieldConfig"]["defaults"]
            if "utilisation" in panel["title"].lower() and "thresholds" in defaults:
                full = {"percent": 100, "percentunit": 1}[defaults["unit"]]
                levels = [s["value"] for s in defaults["thresholds"]["steps"]]
                assert levels == [None, monitoring.IDLE_PERCENT * full / 100], panel["title"]
                found += 1
    assert found >= 4  # the GPUs' and the NeuronCores' on the overview, the mean stat, the jobs' graph


def test_overview_covers_the_cluster_and_only_its_accelerators() -> None:
    def used(stack: Stack) -> set[str]:
        board = boards(stack)[f"{settings.DASHBOARDS_DIR}/{dashboards.OVERVIEW_UID}.json"]
        return set().union(*(metric_names(e) for e in expressions(board)))

    nvidia_only, both = used(STACKS["Pulumi.team-a.yaml"]), used(STACKS["Pulumi.team-b.yaml"])
    assert both >= {"DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_POWER_USAGE",
                    "DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "gpucluster_efa_rx_bytes_total",
                    "gpucluster_efa_tx_bytes_total", "gpucluster_lustre_read_bytes_total",
                    "gpucluster_lustre_write_bytes_total", "node_cpu_seconds_total", "node_memory_MemAvailable_bytes",
                    "gpucluster_slurm_node_state", "gpucluster_slurm_jobs", "neuroncore_utilization_ratio"}
    assert both - nvidia_only == {"neuroncore_utilization_ratio"}


def test_jobs_board_groups_gpus_by_slurm_job() -> None:
    board = boards(STACKS["Pulumi.team-a.yaml"])[f"{settings.DASHBOARDS_DIR}/{dashboards.JOBS_UID}.json"]
    [variable] = board["templating"]["list"]
    assert (variable["name"], variable["query"]) == ("job", "label_values(DCGM_FI_DEV_GPU_UTIL, hpc_job)")
    for panel in panels(board):
        for target in panel["targets"]:
            assert 'hpc_job=~"$job"' in target["expr"], panel["title"]
            assert re.search(r"by \(hpc_job\b", target["expr"]), panel["title"]


def test_every_rule_names_only_metrics_an_exporter_we_ship_produces() -> None:
    """Prometheus' own rules (rules.yml) by the same strict reading as the panels."""
    for rule in prometheus.alert_rules() + [{"expr": expr} for _, expr in prometheus.RECORDING_RULES]:
        names = metric_names(str(rule["expr"]))
        assert names and names <= KNOWN_METRICS, (rule, names - KNOWN_METRICS)


def verify_panel(stack: Stack) -> dict[str, Any]:
    board = boards(stack)[f"{settings.DASHBOARDS_DIR}/{dashboards.OVERVIEW_UID}.json"]
    (panel,) = [p for p in panels(board) if p["title"] == "Verify: last result per pool"]
    return panel


def test_the_verify_panel_names_the_contracts_metrics_and_its_words() -> None:
    """On every stack's overview: the result and the run time the head's `gpucluster verify` exports, by the
    contract's names, and each result code shown as its word in its colour."""
    for stack in STACKS.values():
        panel = verify_panel(stack)
        assert panel["type"] == "table"
        exprs = [t["expr"] for t in panel["targets"]]
        assert [metric_names(e) for e in exprs] == [{verify.RESULT_METRIC},
                                                    {verify.RESULT_METRIC, verify.RUN_TIME_METRIC}]
        assert all("by (pool, check)" in e for e in exprs)
    result = next(o for o in panel["fieldConfig"]["overrides"] if o["matcher"]["options"] == "Result")
    (mapping,) = next(p["value"] for p in result["properties"] if p["id"] == "mappings")
    shown = {int(code): (m["text"], m["color"]) for code, m in mapping["options"].items()}
    assert shown == {verify.RESULT_CODES[word]: (word, dashboards.RESULT_COLOURS[word]) for word in verify.RESULT_CODES}
    assert len({colour for _, colour in shown.values()}) == len(shown)


def test_the_verify_panel_shows_each_check_of_a_pool_with_that_pools_run_time(tmp_path: Path) -> None:
    """promtool evaluates the panel's two queries on the series the head's textfile collector exports (with the head
    target's labels beside the pool's, as honor_labels keeps them): one row per pool and check, the result code, and
    the pool's own run time in milliseconds on every one of its rows."""
    a, b = dashboards.VERIFY_RESULTS, dashboards.VERIFY_RUN_TIMES
    head = 'instance="head:9100", job="node", node="head"'
    code = verify.RESULT_CODES
    series = [(verify.RESULT_METRIC, 'pool="p5", check="gpus"', code[verify.FAIL]),
              (verify.RESULT_METRIC, 'pool="p5", check="efa_devices"', code[verify.PASS]),
              (verify.RESULT_METRIC, f'pool="{verify.CLUSTER}", check="budget_topic"', code[verify.PASS]),
              (verify.RESULT_METRIC, 'pool="g6", check="gpus"', code[verify.WARN]),
              (verify.RUN_TIME_METRIC, 'pool="p5"', 1000), (verify.RUN_TIME_METRIC, f'pool="{verify.CLUSTER}"', 1000),
              (verify.RUN_TIME_METRIC, 'pool="g6"', 2000)]
    rows = [(labels, value) for name, labels, value in series if name == verify.RESULT_METRIC]
    run_time = {labels.split(",")[0]: value for name, labels, value in series if name == verify.RUN_TIME_METRIC}

    def samples(by_row: Any) -> list[dict[str, Any]]:
        return [{"labels": "{" + labels + "}", "value": by_row(labels, value)} for labels, value in rows]

    test: dict[str, Any] = {"rule_files": [], "evaluation_interval": "30s", "tests": [{
        "interval": "30s",
        "input_series": [{"series": f"{name}{{{labels}, {head}}}", "values": f"{value}x4"}
                         for name, labels, value in series],
        "promql_expr_test": [
            {"expr": a, "eval_time": "1m", "exp_samples": samples(lambda labels, value: value)},
            {"expr": b, "eval_time": "1m",
             "exp_samples": samples(lambda labels, value: 1000 * run_time[labels.split(",")[0]])}]}]}
    (tmp_path / "test.yml").write_text(yaml.safe_dump(test))
    done = promtool("test", "rules", str(tmp_path / "test.yml"))
    assert done.returncode == 0, done.stdout + done.stderr
    # Another pool's run time on a row fails the same test: the pass above means the join is by pool.
    test["tests"][0]["promql_expr_test"][1]["exp_samples"][0]["value"] = 1000 * run_time['pool="g6"']
    (tmp_path / "test.yml").write_text(yaml.safe_dump(test))
    assert promtool("test", "rules", str(tmp_path / "test.yml")).returncode != 0


def test_the_person_table_gives_each_persons_gpu_hours_and_shares(tmp_path: Path) -> None:
    """promtool evaluates the cost board's table by person on the head's series: alice used 30 GPU-hours of the
    team's 40 and bob 10 (his series also from a replaced head, with the same figure), of a month's spend of $1,000.
    Each row is the person's hours, share and that share of the spend."""
    board = cost_board(STACKS["Pulumi.team-a.yaml"])
    table_panel = next(p for p in panels(board) if p["title"] == "GPU-hours and spend by person")
    hours_expr, share_expr, spend_expr = (t["expr"] for t in table_panel["targets"])
    used = {"alice": 30.0, "bob": 10.0}
    team, spent = sum(used.values()), 1000.0
    head = 'instance="head:9100", job="node", node="head"'
    series = [{"series": f'gpucluster_person_gpu_used_seconds{{user="{u}", {head}}}', "values": f"{3600 * h}x4"}
              for u, h in used.items()]
    series += [{"series": 'gpucluster_person_gpu_used_seconds{user="bob", instance="old-head:9100"}',
                "values": f"{3600 * used['bob']}x4"},
               {"series": f"gpucluster_gpu_used_seconds{{{head}}}", "values": f"{3600 * team}x4"},
               {"series": f"gpucluster_budget_actual_usd{{{head}}}", "values": f"{spent}x4"}]

    def rows(value: Any) -> list[dict[str, Any]]:
        return [{"labels": f'{{user="{u}"}}', "value": value(h)} for u, h in used.items()]

    test: dict[str, Any] = {"rule_files": [], "evaluation_interval": "30s", "tests": [{
        "interval": "30s", "input_series": series,
        "promql_expr_test": [
            {"expr": hours_expr, "eval_time": "1m", "exp_samples": rows(lambda h: h)},
            {"expr": share_expr, "eval_time": "1m", "exp_samples": rows(lambda h: h / team)},
            {"expr": spend_expr, "eval_time": "1m", "exp_samples": rows(lambda h: spent * h / team)}]}]}
    (tmp_path / "test.yml").write_text(yaml.safe_dump(test))
    done = promtool("test", "rules", str(tmp_path / "test.yml"))
    assert done.returncode == 0, done.stdout + done.stderr
    # A wrong share of the spend fails the same test, so the pass above means something.
    test["tests"][0]["promql_expr_test"][2]["exp_samples"][0]["value"] = spent
    (tmp_path / "test.yml").write_text(yaml.safe_dump(test))
    assert promtool("test", "rules", str(tmp_path / "test.yml")).returncode != 0
