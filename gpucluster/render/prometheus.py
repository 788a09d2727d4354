"""Prometheus on the head node: what it scrapes, how long it keeps it, and the rules that alert.

Rendered from the stack alone, so `gpucluster render STACK --out DIR` writes byte for byte what the head gets in its
bundle. Targets come from file_sd lists that the head's node-name publisher keeps (HOSTS_PROGRAM): a node is
scraped from the moment it registers with Slurm until it is powered down, with its Slurm name, pool, team and cluster as
labels. Every metric a rule or a dashboard names is listed in `EXPORTED`, by the exporter we ship that produces it.
"""

from __future__ import annotations

import yaml

from gpucluster.contract import settings, verify
from gpucluster.render import monitoring
from gpucluster.spec import cost
from gpucluster.spec.model import Stack

SCRAPE_SECONDS = 30  # dcgm-exporter samples every 30 s by default: scraping faster would only repeat its figures
RETENTION_DAYS = 62  # the cost board's "this month" and the month before it
# The share of the head's state volume Prometheus may fill (slurmctld's state and MariaDB live there too).
RETENTION_SHARE = 0.5
PROMETHEUS_CONFIG = f"{settings.BUNDLE_DIR}/{settings.MONITORING_FILES[0]}"

# The counters our dcgm-exporter collects (its -f file, in the bundle): name, Prometheus type, help.
DCGM_COUNTERS = (
    ("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %)."),
    ("DCGM_FI_DEV_MEM_COPY_UTIL", "gauge", "Memory utilization (in %)."),
    ("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB)."),
    ("DCGM_FI_DEV_FB_FREE", "gauge", "Framebuffer memory free (in MiB)."),
    ("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W)."),
    ("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C)."),
    ("DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock frequency (in MHz)."),
    ("DCGM_FI_DEV_XID_ERRORS", "gauge", "Value of the last XID error encountered."),
    # The last XID above never resets; this counts each XID (label xid) over dcgm-exporter's window (5 minutes).
    ("DCGM_EXP_XID_ERRORS_COUNT", "gauge", "Count of XID Errors within user-specified time window."),
    ("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "gauge", "Ratio of cycles the tensor (HMMA) pipe is active."),
)
# Labels dcgm-exporter sets on every series, whatever scrapes it (Slurm here, Kubernetes elsewhere).
DCGM_LABELS = ("gpu", "UUID", "device", "modelName", "Hostname")

# Every metric a rule or a panel may name, by the exporter that produces it.
EXPORTED: dict[str, frozenset[str]] = {
    "dcgm-exporter": frozenset(name for name, _, _ in DCGM_COUNTERS),
    "node_exporter": frozenset({
        "node_cpu_seconds_total", "node_memory_MemAvailable_bytes", "node_memory_MemTotal_bytes",
        "node_filesystem_avail_bytes", "node_filesystem_size_bytes", "node_network_receive_bytes_total",
        "node_network_transmit_bytes_total", "node_load1", "up"}),
    # Our programs, through node_exporter's textfile collector: METRICS_PROGRAM on the compute nodes (EFA's hardware
    # counters, the Lustre client's byte counts) and on the head (Slurm's queue and nodes, the money quota, each
    # person's GPU time, the pools' prices), and the budget guardrail on the head (the budget).
    "gpucluster_metrics": frozenset({
        "gpucluster_efa_rx_bytes_total", "gpucluster_efa_tx_bytes_total", "gpucluster_lustre_read_bytes_total",
        "gpucluster_lustre_write_bytes_total", "gpucluster_slurm_node_state", "gpucluster_slurm_jobs",
        "gpucluster_gpu_used_seconds", "gpucluster_quota_used_usd", "gpucluster_quota_usd",
        "gpucluster_person_gpu_used_seconds",
        "gpucluster_pool_gpu_hour_usd",
        "gpucluster_budget_limit_usd", "gpucluster_budget_actual_usd", "gpucluster_budget_forecast_usd"}),
    # `gpucluster verify` on the head, through the same collector: the last run's result per pool and check.
    "gpucluster_verify": frozenset({verify.RESULT_METRIC, verify.RUN_TIME_METRIC}),
    # neuron-monitor's Prometheus output (neuron-monitor-prometheus.py) on Trainium nodes.
    "neuron-monitor": frozenset({"neuroncore_utilization_ratio", "neuron_runtime_memory_used_bytes"}),
}


def retention_bytes() -> int:
    return int(cost.HEAD_STATE_GIB * RETENTION_SHARE) << 30


def prometheus_args() -> str:
    """/etc/default/prometheus on the head (the packaged unit runs `prometheus $ARGS`)."""
    flags = [f"--config.file={PROMETHEUS_CONFIG}", f"--storage.tsdb.path={settings.PROMETHEUS_DATA_DIR}",
             f"--storage.tsdb.retention.time={RETENTION_DAYS}d",
             f"--storage.tsdb.retention.size={retention_bytes() >> 30}GB",
             f"--web.listen-address=127.0.0.1:{settings.PROMETHEUS_PORT}"]
    return f'ARGS="{" ".join(flags)}"\n'


def config(stack: Stack) -> str:
    """prometheus.yml."""
    doc = {
        "global": {"scrape_interval": f"{SCRAPE_SECONDS}s", "evaluation_interval": f"{SCRAPE_SECONDS}s",
                   "external_labels": {"cluster": stack.cluster_name, "team": stack.spec.team}},
        # Beside this file: Prometheus reads a relative path from the configuration file's directory.
        "rule_files": [settings.MONITORING_FILES[1].rsplit("/", 1)[1]],
        "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{settings.ALERTMANAGER_PORT}"]}]}]},
        "scrape_configs": [{"job_name": "prometheus",
                            "static_configs": [{"targets": [f"127.0.0.1:{settings.PROMETHEUS_PORT}"]}]}] + [
            # A list file that is missing or empty is no target, not an error: a cluster at zero has none.
            # honor_labels: the head's textfile figures carry their own node and pool (Slurm's nodes, the pools'
            # prices), which the head's target labels must not rename to exported_node and exported_pool.
            {"job_name": job.name, "honor_labels": True,
             "file_sd_configs": [{"files": [f"{settings.SCRAPE_TARGETS_DIR}/{job.targets_file}"],
                                  "refresh_interval": "1m"}]}
            for job in settings.SCRAPE_JOBS],
    }
    return "# Rendered by gpucluster for stack {}: Prometheus on the head node.\n".format(stack.name) + \
        yaml.safe_dump(doc, sort_keys=False, default_flow_style=False)


def gpu_idle_expr() -> str:
    """The seed's alert, on what dcgm-exporter always sets (so the same expression serves Kubernetes)."""
    return f'avg_over_time(DCGM_FI_DEV_GPU_UTIL{{UUID!=""}}[{monitoring.IDLE_MINUTES}m]) < {monitoring.IDLE_PERCENT}'


QUOTA_WARN_SHARE = 0.9
# The head's state volume (slurmctld's queue, MariaDB, Prometheus): the alert fires while this share is still free,
# well before slurmctld fails to write a job's files and every submission fails with it.
STATE_VOLUME_ALERT_FREE_SHARE = 0.2
IDLE_FOR = f"{monitoring.IDLE_MINUTES}m"

RECORDING_RULES = (
    # 1 for a GPU idle by the alert's measure, 0 for a busy one: its sum over a range is idle samples, hence hours.
    # Without hpc_job: when a job starts on a GPU its series gains the label, and the old series would still answer
    # for its last 5 minutes, counting them idle once more.
    ("gpucluster:gpu_idle", f'max without (hpc_job) (avg_over_time(DCGM_FI_DEV_GPU_UTIL{{UUID!=""}}'
                            f'[{monitoring.IDLE_MINUTES}m])) < bool {monitoring.IDLE_PERCENT}'),
    ("gpucluster:quota_used:ratio", "gpucluster_quota_used_usd / gpucluster_quota_usd"),
)


def idle_gpu_hours_query(seconds: int) -> str:
    """The GPUs' idle hours over the last `seconds` by the GpuIdle alert's measure (gpucluster:gpu_idle, evaluated
    every SCRAPE_SECONDS): what `gpucluster cost --all` reads on the head."""
    return f"sum(sum_over_time(gpucluster:gpu_idle[{seconds}s])) * {SCRAPE_SECONDS} / 3600"


def alert_rules() -> list[dict[str, object]]:
    minutes = monitoring.IDLE_MINUTES
    return [
        # For the window again: a fresh series (a node just up, a job loading its data) is not yet idleness.
        {"alert": verify.GPU_IDLE_ALERT, "expr": gpu_idle_expr(), "for": IDLE_FOR, "labels": {"severity": "warning"},
         "annotations": {
             "summary": f"GPU {{{{ $labels.gpu }}}} of {{{{ $labels.node }}}} ({{{{ $labels.pool }}}}) under "
                        f"{monitoring.IDLE_PERCENT}% for {minutes} minutes",
             "description": "Average utilisation {{ $value | printf \"%.0f\" }}% over " f"{minutes} minutes; "
                            "Slurm job {{ $labels.hpc_job }}. An idle GPU still costs its hour."}},
        {"alert": "GpuXidError",
         "expr": f'DCGM_EXP_XID_ERRORS_COUNT{{UUID!="",xid=~"{"|".join(map(str, settings.FATAL_XIDS))}"}} > 0',
         "labels": {"severity": "critical"},
         "annotations": {"summary": "GPU {{ $labels.gpu }} of {{ $labels.node }} reported XID {{ $labels.xid }}",
                         "description": "The health check drains a node whose XID needs a reset (see `sinfo -R`)."}},
        {"alert": "QuotaNearlySpent", "expr": f"gpucluster:quota_used:ratio >= {QUOTA_WARN_SHARE}",
         "labels": {"severity": "warning"},
         "annotations": {"summary": "{{ $value | humanizePercentage }} of the team's monthly quota for jobs is spent",
                         "description": "Slurm holds new jobs of the team's account once the quota is spent."}},
        {"alert": "NodeDown", "expr": 'gpucluster_slurm_node_state{state="down"} == 1', "for": "10m",
         "labels": {"severity": "warning"},
         "annotations": {"summary": "Slurm node {{ $labels.node }} ({{ $labels.pool }}) DOWN for 10 minutes",
                         "description": "`sinfo -R -n {{ $labels.node }}` says why."}},
        {"alert": "StateVolumeFilling",
         "expr": f'node_filesystem_avail_bytes{{job="node",mountpoint="{settings.STATE_DIR}"}} / '
                 f'node_filesystem_size_bytes{{job="node",mountpoint="{settings.STATE_DIR}"}} '
                 f"< {STATE_VOLUME_ALERT_FREE_SHARE}",
         "for": "5m", "labels": {"severity": "critical"},
         "annotations": {
             "summary": f"The head's state volume ({settings.STATE_DIR}) is {{{{ $value | humanizePercentage }}}} "
                        "free",
             "description": "Slurm's queue, the accounting database and Prometheus live there: when it is full, "
                            f"every sbatch fails. `sudo du -sh {settings.STATE_DIR}/*` says what grew; `sudo squeue "
                            "-h -t PD -o %u | sort | uniq -c` who queues most."}},
        {"alert": "NodeExporterDown", "expr": 'up{job="node"} == 0', "for": "5m", "labels": {"severity": "warning"},
         "annotations": {"summary": "{{ $labels.node }} registered with Slurm but its metrics do not answer"}},
    ]


def rules(stack: Stack) -> str:
    """rules.yml: recording rules for the dashboards, then the alerts."""
    doc = {"groups": [
        {"name": "gpucluster-records", "rules": [{"record": name, "expr": expr} for name, expr in RECORDING_RULES]},
        {"name": "gpucluster-alerts", "rules": alert_rules()},
    ]}
    return "# Rendered by gpucluster for stack {}: recording rules and alerts.\n".format(stack.name) + \
        yaml.safe_dump(doc, sort_keys=False, default_flow_style=False, width=1000)


def dcgm_counters() -> str:
    """dcgm-exporter's counters file (its -f): exactly the metrics the rules and dashboards use."""
    return "# Rendered by gpucluster: the DCGM fields dcgm-exporter collects.\n" + "".join(
        f"{name}, {kind}, {help_text}\n" for name, kind, help_text in DCGM_COUNTERS)


def files(stack: Stack) -> dict[str, str]:
    """Path (as in the bundle and `render --out`) -> content."""
    config_path, rules_path = settings.MONITORING_FILES
    return {config_path: config(stack), rules_path: rules(stack), "prometheus/prometheus.env": prometheus_args(),
            "dcgm-exporter/counters.csv": dcgm_counters()}
