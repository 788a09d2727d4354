"""Grafana dashboards on the head node, built with Grafana's typed builders (grafana-foundation-sdk), never as JSON.

Three boards over the head's Prometheus (gpucluster/render/prometheus.py lists every metric they query): the cluster
overview (with the last `gpucluster verify` result per pool), GPU use per Slurm job, and the team's cost board.
`files(stack)` is what `render --out` writes and the head gets in its bundle, byte for byte; Grafana provisions them
from DASHBOARDS_DIR against the datasource whose uid is DATASOURCE_UID.
"""

from __future__ import annotations

import json
from typing import TypeVar

from grafana_foundation_sdk.builders import (
    common as common_builders,
    dashboard,
    gauge,
    prometheus as prom,
    stat,
    table,
    timeseries,
)
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models.dashboard import (
    Dashboard as DashboardModel,
    DashboardCursorSync,
    DataSourceRef,
    DataTransformerConfig,
    DynamicConfigValue,
    Threshold,
    ThresholdsMode,
    ValueMap,
    ValueMappingResult,
    VariableOption,
    VariableRefresh,
    VariableSort,
)
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

from gpucluster.contract import settings, verify
from gpucluster.render import monitoring, prometheus
from gpucluster.spec.model import Stack

# The head provisions its Prometheus datasource under this uid (at 127.0.0.1:PROMETHEUS_PORT): the boards name it by
# uid, so they never depend on the datasource's display name.
DATASOURCE_UID = settings.GRAFANA_DATASOURCE_UID
DATASOURCE = DataSourceRef(type_val="prometheus", uid=DATASOURCE_UID)
OVERVIEW_UID = "gpucluster-overview"
JOBS_UID = "gpucluster-jobs"
COST_UID = "gpucluster-cost"
REFRESH = "1m"  # twice the scrape interval: faster would redraw the same samples

# The overview's template variables; `.*` as "All" keeps the query short however many nodes there are.
NODE_FILTER = 'pool=~"$pool", node=~"$node"'
GPU_FILTER = f'UUID!="", {NODE_FILTER}'  # dcgm-exporter's per-GPU series, as the GpuIdle alert selects them
# `.+` as "All": only a GPU that runs a job carries hpc_job.
JOB_FILTER = 'UUID!="", hpc_job=~"$job"'
BY_NODE = "{{pool}} {{node}}"
BY_JOB = "job {{hpc_job}}"
# Samples of a series evaluated every SCRAPE_SECONDS (gpucluster:gpu_idle, dcgm-exporter's counters) to hours.
SAMPLES_TO_HOURS = f"* {prometheus.SCRAPE_SECONDS} / 3600"
IDLE_SAMPLES = "sum_over_time(gpucluster:gpu_idle[$__range])"
# Idle GPU-hours of each pool over the board's range at the pool's price per GPU-hour. max by (pool): one price per
# pool even if a replaced head still has a series in the window.
IDLE_COST_BY_POOL = (f"sum by (pool) ({IDLE_SAMPLES} * on(pool) group_left() "
                     f"max by (pool) (gpucluster_pool_gpu_hour_usd)) {SAMPLES_TO_HOURS}")
IDLE_HOURS_BY_POOL = f"sum by (pool) ({IDLE_SAMPLES}) {SAMPLES_TO_HOURS}"
# The last verify run of each pool (the head's textfile collector exports it): one row per pool and check. max by: the
# head's series also carry its target's labels, which would split a row.
VERIFY_RESULTS = f"max by (pool, check) ({verify.RESULT_METRIC})"
# When the pool's run ended, on each of its checks' rows (the table joins rows with the same labels), in milliseconds
# for Grafana's date units.
VERIFY_RUN_TIMES = (f"1000 * (0 * {VERIFY_RESULTS} + on(pool) group_left() "
                    f"max by (pool) ({verify.RUN_TIME_METRIC}))")
# Each person's GPU-hours this month (Slurm's, reset monthly: the latest value is the month's), their share of the
# team's, and that share of the month's spend: an allocation by GPU-hours, as `gpucluster cost` prints it. Not priced
# by the pools' gpucluster_pool_gpu_hour_usd: Slurm counts gres/gpu without its type (slurm.conf's
# AccountingStorageTRES, render/slurm.py), so a person's GPU-hours are not split by pool and no join on `pool` exists.
# max by (user): one series per person even if a replaced head still has one in the window; `> 0`: no share (NaN, not
# +Inf) before the team's first GPU-minute.
PERSON_HOURS = "max by (user) (gpucluster_person_gpu_used_seconds)"
PERSON_GPU_HOURS = f"{PERSON_HOURS} / 3600"
PERSON_SHARE = f"{PERSON_HOURS} / scalar(max(gpucluster_gpu_used_seconds) > 0)"
PERSON_SPEND = f"{PERSON_SHARE} * scalar(max(gpucluster_budget_actual_usd))"
RESULT_COLOURS = {verify.PASS: "green", verify.WARN: "orange", verify.FAIL: "red"}
GPU_HOURS = "suffix: GPU-h"  # a Grafana custom unit
USD = "currencyUSD"

P = TypeVar("P", timeseries.Panel, stat.Panel, gauge.Panel, table.Panel)


def query(expr: str, legend: str = "", *, instant: bool = False, as_table: bool = False) -> prom.Dataquery:
    q = prom.Dataquery().expr(expr).datasource(DATASOURCE)
    if legend:
        q = q.legend_format(legend)
    if instant:
        q = q.instant()
    if as_table:
        q = q.format(PromQueryFormat.TABLE)
    return q


def with_queries(panel: P, *queries: prom.Dataquery) -> P:
    """The panel on our datasource with its queries as A, B, ... (a table names each query's values by refId)."""
    for i, q in enumerate(queries):
        panel = panel.with_target(q.ref_id(chr(ord("A") + i)))
    return panel.datasource(DATASOURCE)


def steps(base: str, *levels: tuple[float, str]) -> dashboard.ThresholdsConfig:
    return dashboard.ThresholdsConfig().mode(ThresholdsMode.ABSOLUTE).steps(
        [Threshold(value=None, color=base)] + [Threshold(value=v, color=c) for v, c in levels])


def idle_steps(full: float) -> dashboard.ThresholdsConfig:
    """Red under the GpuIdle alert's threshold, on a scale where `full` is 100%."""
    return steps("red", (monitoring.IDLE_PERCENT * full / 100, "green"))


def series(title: str, unit: str, *queries: prom.Dataquery, span: int = 12) -> timeseries.Panel:
    return with_queries(timeseries.Panel().title(title).unit(unit).span(span).height(8), *queries)


def utilisation(title: str, unit: str, full: float, *queries: prom.Dataquery) -> timeseries.Panel:
    """A utilisation graph with the idle threshold drawn as a dashed line."""
    return series(title, unit, *queries).min(0).max(full).thresholds(idle_steps(full)).thresholds_style(
        common_builders.GraphThresholdsStyleConfig().mode(common.GraphThresholdsStyleMode.DASHED))


def single(title: str, unit: str, expr: str, description: str, *, span: int = 6,
           thresholds: dashboard.ThresholdsConfig | None = None) -> stat.Panel:
    """One figure, the query's latest value."""
    panel = (with_queries(stat.Panel().title(title).description(description).unit(unit).span(span).height(5),
                          query(expr, instant=True))
             .graph_mode(common.BigValueGraphMode.NONE)
             .reduce_options(common_builders.ReduceDataOptions().calcs(["lastNotNull"])))
    return panel.thresholds(thresholds) if thresholds else panel.color_mode(common.BigValueColorMode.NONE)


def dial(title: str, unit: str, expr: str, description: str, top: float,
         thresholds: dashboard.ThresholdsConfig) -> gauge.Panel:
    return (with_queries(gauge.Panel().title(title).description(description).unit(unit).span(6).height(5),
                         query(expr, instant=True))
            .min(0).max(top).thresholds(thresholds)
            .reduce_options(common_builders.ReduceDataOptions().calcs(["lastNotNull"])))


def choice(name: str, label: str, source: str, all_value: str) -> dashboard.QueryVariable:
    """A multi-value variable from label_values, "All" selected by default."""
    return (dashboard.QueryVariable(name).label(label).datasource(DATASOURCE).query(source)
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).sort(VariableSort.NATURAL_ASC)
            .multi(True).include_all(True).all_value(all_value)
            .current(VariableOption(selected=True, text="All", value="$__all")))


def board(uid: str, title: str, stack: Stack) -> dashboard.Dashboard:
    # Read-only: the code is the source, and a change saved in the UI would be lost with the next bundle.
    return (dashboard.Dashboard(f"{title} ({stack.spec.team})").uid(uid).tags(["gpucluster", stack.spec.team])
            .readonly().refresh(REFRESH).tooltip(DashboardCursorSync.CROSSHAIR))


def rates(title: str, counters: tuple[str, str], names: tuple[str, str]) -> timeseries.Panel:
    """Two byte counters of each node as rates, the second drawn below the axis."""
    panel = series(title, "Bps", *(
        query(f"sum by (pool, node) (rate({counter}{{{NODE_FILTER}}}[$__rate_interval]))", f"{{{{node}}}} {name}")
        for counter, name in zip(counters, names, strict=True)))
    return panel.override_by_query("B", [DynamicConfigValue(id_val="custom.transform", value="negative-Y")])


def overview(stack: Stack) -> dashboard.Dashboard:
    kinds = {acc.kind for p in monitoring.watched_pools(stack) if (acc := p.itype.accelerator)}
    b = (board(OVERVIEW_UID, "Cluster overview", stack).time("now-6h", "now")
         .with_variable(choice("pool", "Pool", "label_values(up, pool)", ".*"))
         .with_variable(choice("node", "Node", 'label_values(up{pool=~"$pool"}, node)', ".*"))
         .with_row(dashboard.Row("Slurm"))
         .with_panel(series("Nodes by state", "short", query(
             f"sum by (state) (gpucluster_slurm_node_state{{{NODE_FILTER}}})", "{{state}}"))
             .stacking(common_builders.StackingConfig().mode(common.StackingMode.NORMAL)))
         # Slurm has one partition per pool, named after it.
         .with_panel(series("Jobs by state", "short", query(
             'sum by (state) (gpucluster_slurm_jobs{partition=~"$pool"})', "{{state}}"))))
    if "nvidia" in kinds:
        b = (b.with_row(dashboard.Row("GPUs"))
             .with_panel(single("Idle GPUs", "short", f"sum(gpucluster:gpu_idle{{{NODE_FILTER}}})",
                                f"GPUs under {monitoring.IDLE_PERCENT}% for {monitoring.IDLE_MINUTES} minutes, the "
                                "GpuIdle alert's measure.", thresholds=steps("green", (1, "red"))))
             .with_panel(single("GPUs reporting", "short", f"count(DCGM_FI_DEV_GPU_UTIL{{{GPU_FILTER}}})",
                                "GPUs whose dcgm-exporter answers."))
             .with_panel(single("Mean GPU utilisation", "percent", f"avg(DCGM_FI_DEV_GPU_UTIL{{{GPU_FILTER}}})",
                                "Over the GPUs reporting.", span=12, thresholds=idle_steps(100)))
             .with_panel(utilisation("GPU utilisation per node", "percent", 100, query(
                 f"avg by (pool, node) (DCGM_FI_DEV_GPU_UTIL{{{GPU_FILTER}}})", BY_NODE)))
             .with_panel(utilisation("Tensor pipe active per node", "percentunit", 1, query(
                 f"avg by (pool, node) (DCGM_FI_PROF_PIPE_TENSOR_ACTIVE{{{GPU_FILTER}}})", BY_NODE)))
             .with_panel(series("GPU memory used per node", "percentunit", query(
                 f"sum by (pool, node) (DCGM_FI_DEV_FB_USED{{{GPU_FILTER}}}) / (sum by (pool, node) "
                 f"(DCGM_FI_DEV_FB_USED{{{GPU_FILTER}}}) + sum by (pool, node) (DCGM_FI_DEV_FB_FREE{{{GPU_FILTER}}}))",
                 BY_NODE)).min(0).max(1))
             .with_panel(series("GPU power per node", "watt", query(
                 f"sum by (pool, node) (DCGM_FI_DEV_POWER_USAGE{{{GPU_FILTER}}})", BY_NODE)))
             .with_panel(series("Hottest GPU per node", "celsius", query(
                 f"max by (pool, node) (DCGM_FI_DEV_GPU_TEMP{{{GPU_FILTER}}})", BY_NODE))))
    if "neuron" in kinds:
        b = (b.with_row(dashboard.Row("Trainium"))
             .with_panel(utilisation("NeuronCore utilisation per node", "percentunit", 1, query(
                 f"avg by (pool, node) (neuroncore_utilization_ratio{{{NODE_FILTER}}})", BY_NODE))))
    return (b.with_row(dashboard.Row("Network and storage"))
            .with_panel(rates("EFA throughput per node",
                              ("gpucluster_efa_rx_bytes_total", "gpucluster_efa_tx_bytes_total"), ("received", "sent")))
            .with_panel(rates("Lustre throughput per node",
                              ("gpucluster_lustre_read_bytes_total", "gpucluster_lustre_write_bytes_total"),
                              ("read", "written")))
            .with_row(dashboard.Row("Verify"))
            .with_panel(verify_table())
            .with_row(dashboard.Row("Nodes"))
            .with_panel(series("CPU busy per node", "percentunit", query(
                f'1 - avg by (pool, node) (rate(node_cpu_seconds_total{{mode="idle", {NODE_FILTER}}}'
                '[$__rate_interval]))', BY_NODE)).min(0).max(1))
            .with_panel(series("Memory used per node", "percentunit", query(
                f"1 - sum by (pool, node) (node_memory_MemAvailable_bytes{{{NODE_FILTER}}}) / sum by (pool, node) "
                f"(node_memory_MemTotal_bytes{{{NODE_FILTER}}})", BY_NODE)).min(0).max(1)))


def verify_table() -> table.Panel:
    """The last `gpucluster verify` of each pool: every check's result in words and colours, and when it ran."""
    words = ValueMap(options={str(verify.RESULT_CODES[word]): ValueMappingResult(text=word, color=colour, index=i)
                              for i, (word, colour) in enumerate(RESULT_COLOURS.items())})
    panel = with_queries(
        table.Panel().title("Verify: last result per pool").description(
            "`gpucluster verify` on the head prints each check's figure and, for a failure, its fix; "
            f"`gpucluster verify --last` shows the latest run ({settings.VERIFY_DIR}).").span(24).height(8),
        query(VERIFY_RESULTS, instant=True, as_table=True),
        query(VERIFY_RUN_TIMES, instant=True, as_table=True))
    return (panel.with_transformation(DataTransformerConfig(id_val="merge", options={}))
            .with_transformation(DataTransformerConfig(id_val="organize", options={
                "excludeByName": {"Time": True},
                "renameByName": {"pool": "Pool", "check": "Check", "Value #A": "Result", "Value #B": "When"}}))
            .override_by_name("Result", [
                DynamicConfigValue(id_val="mappings", value=[words]),
                DynamicConfigValue(id_val="custom.cellOptions", value=common.TableColoredBackgroundCellOptions())])
            .override_by_name("When", [DynamicConfigValue(id_val="unit", value="dateTimeFromNow")]))


def job_table() -> table.Panel:
    """One row per job and node over the board's range: the job's GPUs there, their mean utilisation, GPU-hours."""
    over_range = f"DCGM_FI_DEV_GPU_UTIL{{{JOB_FILTER}}}[$__range]"
    panel = with_queries(
        table.Panel().title("Jobs over the range").span(24).height(10),
        query(f"count by (hpc_job, node) (max_over_time({over_range}))", instant=True, as_table=True),
        query(f"avg by (hpc_job, node) (avg_over_time({over_range}))", instant=True, as_table=True),
        query(f"sum by (hpc_job, node) (count_over_time({over_range})) {SAMPLES_TO_HOURS}", instant=True,
              as_table=True))
    # A table query's values are the column "Value #<refId>": merge joins the three on (hpc_job, node).
    return (panel.with_transformation(DataTransformerConfig(id_val="merge", options={}))
            .with_transformation(DataTransformerConfig(id_val="organize", options={
                "excludeByName": {"Time": True},
                "renameByName": {"hpc_job": "Slurm job", "node": "Node", "Value #A": "GPUs",
                                 "Value #B": "Mean GPU utilisation", "Value #C": "GPU-hours"}}))
            .override_by_name("Mean GPU utilisation", [
                DynamicConfigValue(id_val="unit", value="percent"),
                DynamicConfigValue(id_val="thresholds", value=idle_steps(100).build()),
                DynamicConfigValue(id_val="custom.cellOptions", value=common.TableColoredBackgroundCellOptions())]))


def jobs(stack: Stack) -> dashboard.Dashboard:
    return (board(JOBS_UID, "GPU use per Slurm job", stack).time("now-6h", "now")
            .with_variable(choice("job", "Slurm job", "label_values(DCGM_FI_DEV_GPU_UTIL, hpc_job)", ".+"))
            .with_panel(utilisation("Mean GPU utilisation by job", "percent", 100, query(
                f"avg by (hpc_job) (DCGM_FI_DEV_GPU_UTIL{{{JOB_FILTER}}})", BY_JOB)))
            .with_panel(series("GPUs by job", "short", query(
                f"count by (hpc_job) (DCGM_FI_DEV_GPU_UTIL{{{JOB_FILTER}}})", BY_JOB)).min(0))
            .with_panel(series("GPU memory used by job", "mbytes", query(
                f"sum by (hpc_job) (DCGM_FI_DEV_FB_USED{{{JOB_FILTER}}})", BY_JOB)))
            .with_panel(series("GPU power by job", "watt", query(
                f"sum by (hpc_job) (DCGM_FI_DEV_POWER_USAGE{{{JOB_FILTER}}})", BY_JOB)))
            .with_panel(job_table()))


def budget_steps(stack: Stack) -> tuple[float, dashboard.ThresholdsConfig]:
    """The gauge's top and colours in percent of the budget: orange at each alert threshold, red where the guardrail
    stops starting GPU nodes (or at the last threshold when it only alerts)."""
    budget = stack.spec.budget
    stop = budget.act_threshold_percent or budget.thresholds_percent[-1]
    levels = sorted({(float(t), "orange") for t in budget.thresholds_percent if t < stop} | {(float(stop), "red")})
    return float(max(100, stop, *budget.thresholds_percent)), steps("green", *levels)


def cost(stack: Stack) -> dashboard.Dashboard:
    top, budget_colours = budget_steps(stack)
    month = "Month to date, as AWS Budgets reports it."
    limit = "max(gpucluster_budget_limit_usd)"
    idle_description = (f"GPUs under {monitoring.IDLE_PERCENT}% for {monitoring.IDLE_MINUTES} minutes over the "
                        "board's range, at the pool's price per GPU-hour.")
    # UTC: AWS bills by the UTC month, so "this month" (now/M) starts when the budget's month does.
    return (board(COST_UID, "Team cost", stack).time("now/M", "now").timezone("utc")
            .with_row(dashboard.Row("Budget"))
            .with_panel(single("Spent", USD, "max(gpucluster_budget_actual_usd)", month))
            .with_panel(single("Forecast", USD, "max(gpucluster_budget_forecast_usd)",
                               "AWS Budgets' forecast of the month's spend."))
            .with_panel(dial("Spent of budget", "percent", f"100 * max(gpucluster_budget_actual_usd) / {limit}",
                             month, top, budget_colours))
            .with_panel(dial("Forecast of budget", "percent", f"100 * max(gpucluster_budget_forecast_usd) / {limit}",
                             "AWS Budgets' forecast of the month's spend.", top, budget_colours))
            .with_panel(series("Spend and forecast against the budget", USD,
                               query("max(gpucluster_budget_actual_usd)", "spent"),
                               query("max(gpucluster_budget_forecast_usd)", "forecast"),
                               query(limit, "budget"), span=24))
            .with_row(dashboard.Row("GPU-hours"))
            .with_panel(single("GPU-hours used", GPU_HOURS, "max(gpucluster_gpu_used_seconds) / 3600",
                               "Slurm's account of the team's GPU-hours this month."))
            .with_panel(single("Quota for jobs", USD, "max(gpucluster_quota_usd)",
                               "The month's money for jobs, billed at the pools' prices: Slurm holds the team's new "
                               "jobs once it is spent."))
            .with_panel(dial("Quota used", "percentunit", "max(gpucluster:quota_used:ratio)",
                             "The QuotaNearlySpent alert fires at the orange mark.", 1,
                             steps("green", (prometheus.QUOTA_WARN_SHARE, "orange"), (1, "red"))))
            .with_panel(series("Jobs' billing against the quota", USD,
                               query("max(gpucluster_quota_used_usd)", "billed"),
                               query("max(gpucluster_quota_usd)", "quota"), span=6))
            .with_panel(person_table())
            .with_row(dashboard.Row("Idle GPUs"))
            .with_panel(single("Idle GPU-hours", GPU_HOURS, f"sum({IDLE_HOURS_BY_POOL})", idle_description))
            .with_panel(single("Cost of idle GPUs", USD, f"sum({IDLE_COST_BY_POOL})", idle_description))
            .with_panel(single("Idle share of GPU-hours", "percentunit",
                               f"sum({IDLE_SAMPLES}) / sum(count_over_time(gpucluster:gpu_idle[$__range]))",
                               "Of the GPU-hours the nodes were up over the board's range.", span=12))
            .with_panel(idle_table(idle_description))
            .with_panel(series("Idle GPUs per pool", "short", query("sum by (pool) (gpucluster:gpu_idle)", "{{pool}}"))
                        .stacking(common_builders.StackingConfig().mode(common.StackingMode.NORMAL))))


def person_table() -> table.Panel:
    description = ("Slurm's account of each person's GPU-hours this month (sacct and sshare show the same), their "
                   "share of the team's, and that share of the month's spend: an allocation by GPU-hours, not a bill.")
    panel = with_queries(table.Panel().title("GPU-hours and spend by person").description(description)
                         .span(24).height(8),
                         query(PERSON_GPU_HOURS, instant=True, as_table=True),
                         query(PERSON_SHARE, instant=True, as_table=True),
                         query(PERSON_SPEND, instant=True, as_table=True))
    return (panel.with_transformation(DataTransformerConfig(id_val="merge", options={}))
            .with_transformation(DataTransformerConfig(id_val="organize", options={
                "excludeByName": {"Time": True},
                "renameByName": {"user": "Person", "Value #A": "GPU-hours", "Value #B": "Share of the team's",
                                 "Value #C": "Share of the spend"}}))
            .sort_by([common_builders.TableSortByFieldState().display_name("GPU-hours").desc(True)])
            .override_by_name("GPU-hours", [DynamicConfigValue(id_val="unit", value=GPU_HOURS)])
            .override_by_name("Share of the team's", [DynamicConfigValue(id_val="unit", value="percentunit")])
            .override_by_name("Share of the spend", [DynamicConfigValue(id_val="unit", value=USD)]))


def idle_table(description: str) -> table.Panel:
    panel = with_queries(table.Panel().title("Idle GPU-hours and their cost by pool").description(description)
                         .span(12).height(8),
                         query(IDLE_HOURS_BY_POOL, instant=True, as_table=True),
                         query(IDLE_COST_BY_POOL, instant=True, as_table=True))
    return (panel.with_transformation(DataTransformerConfig(id_val="merge", options={}))
            .with_transformation(DataTransformerConfig(id_val="organize", options={
                "excludeByName": {"Time": True},
                "renameByName": {"pool": "Pool", "Value #A": "Idle GPU-hours", "Value #B": "Cost"}}))
            .override_by_name("Idle GPU-hours", [DynamicConfigValue(id_val="unit", value=GPU_HOURS)])
            .override_by_name("Cost", [DynamicConfigValue(id_val="unit", value=USD)]))


def number(model: DashboardModel) -> DashboardModel:
    """Panel ids 1, 2, ... in reading order: Grafana's panel links (viewPanel=N) need them unique and stable."""
    for i, panel in enumerate(model.panels or [], 1):
        panel.id_val = i
    return model


def dashboards(stack: Stack) -> tuple[DashboardModel, ...]:
    return tuple(number(b.build()) for b in (overview(stack), jobs(stack), cost(stack)))


def to_json(model: DashboardModel) -> str:
    return json.dumps(model, cls=JSONEncoder, sort_keys=True, indent=2) + "\n"


def files(stack: Stack) -> dict[str, str]:
    """Path (as in the bundle and `render --out`) -> content: one JSON file per board, named by its uid."""
    return {f"{settings.DASHBOARDS_DIR}/{model.uid}.json": to_json(model) for model in dashboards(stack)}
