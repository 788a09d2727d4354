#!/usr/bin/env python3
"""Trainium utilisation for the pool's idle alarm (settings.NEURON_METRICS_PROGRAM): reads neuron-monitor's JSON
reports and publishes, once a period, the mean utilisation of all the node's NeuronCores and the device memory its
runtimes hold to CloudWatch.

`neuron_metrics.py CONFIG [-- COMMAND...]`: CONFIG is the bundle's neuron-metrics/<pool>.json (namespace,
metric name, dimensions, period); COMMAND defaults to `neuron-monitor`. Unlike a plain relay of neuron-monitor, a core
no runtime uses counts as 0 and a node with no runtime at all reports 0: an idle node is exactly what the alarm is for,
and a silent one would read as missing data. Standard library and boto3 only.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from typing import Any, Callable, Iterable

log = logging.getLogger("gpucluster-neuron-metrics")


def utilisation(report: dict[str, Any]) -> float | None:
    """Mean NeuronCore utilisation (percent) over the node's cores in one neuron-monitor report; None if the report
    says nothing about the cores (no hardware info and no runtime)."""
    in_use: dict[str, float] = {}
    for runtime in report.get("neuron_runtime_data") or []:
        counters = ((runtime.get("report") or {}).get("neuroncore_counters") or {}).get("neuroncores_in_use") or {}
        for core, values in counters.items():
            # Two runtimes never share a core; max() keeps a report that lists one twice sane.
            in_use[core] = max(in_use.get(core, 0.0), float(values.get("neuroncore_utilization") or 0.0))
    hardware = report.get("neuron_hardware_info") or {}
    cores = int(hardware.get("neuron_device_count") or 0) * int(hardware.get("neuroncore_per_device_count") or 0)
    cores = max(cores, len(in_use))
    if not cores:
        return None
    return sum(in_use.values()) / cores


def memory_used(report: dict[str, Any]) -> float:
    """Bytes of Neuron device memory held by all runtimes in one report."""
    return float(sum(((r.get("report") or {}).get("memory_used") or {}).get("neuron_runtime_used_bytes", {})
                     .get("neuron_device", 0) or 0 for r in report.get("neuron_runtime_data") or []))


def publish(lines: Iterable[str], config: dict[str, Any], cloudwatch: Any,
            clock: Callable[[], float] = time.time) -> int:
    """Average the reports of each period and publish one data point per period. Returns how many it published."""
    dimensions = [{"Name": k, "Value": v} for k, v in sorted(config["dimensions"].items())]
    period = float(config["period_seconds"])
    samples: list[tuple[float, float]] = []  # (utilisation, memory) per report
    started = clock()
    published = 0

    def flush() -> None:
        nonlocal samples, started, published
        if samples:
            busy, held = (sum(column) / len(samples) for column in zip(*samples, strict=True))
            try:
                cloudwatch.put_metric_data(Namespace=config["namespace"], MetricData=[
                    {"MetricName": config["metric_name"], "Dimensions": dimensions, "Value": busy, "Unit": "Percent"},
                    {"MetricName": config["memory_metric_name"], "Dimensions": dimensions, "Value": held,
                     "Unit": "Bytes"}])
                published += 1
            except Exception:  # the next period tries again; the node's work does not depend on this
                log.exception("PutMetricData failed")
        samples, started = [], clock()

    for line in lines:
        try:
            report = json.loads(line)
            value = utilisation(report)
            held = memory_used(report)
        except (ValueError, TypeError, AttributeError):
            log.warning("not a neuron-monitor report: %.120s", line)
            continue
        if value is not None:
            samples.append((value, held))
        if clock() - started >= period:
            flush()
    flush()
    return published


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(levelname)s %(message)s")
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[1]) as f:
        config = json.load(f)
    command = argv[3:] if len(argv) > 2 and argv[2] == "--" else ["neuron-monitor"]
    import boto3

    cloudwatch = boto3.client("cloudwatch")  # the region comes from the instance (AWS_DEFAULT_REGION in the unit)
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as monitor:
        assert monitor.stdout is not None
        publish(monitor.stdout, config, cloudwatch)
    return monitor.returncode or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
