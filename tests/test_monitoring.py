"""Idle-accelerator alarms: one per GPU or Trainium pool, watching exactly what the nodes publish."""

from __future__ import annotations

import gzip
import io
import json
import tarfile
from pathlib import Path
from typing import Any

import boto3
import pytest

from conftest import ROOT, in_process_moto, of_type
from gpucluster.contract import settings
from gpucluster.node import bootstrap, neuron_metrics as neuron
from gpucluster.plan import Declared
from gpucluster.project import EXAMPLES_DIR
from gpucluster.render import bundle, monitoring
from gpucluster.spec.model import Stack, load_stack

TEAM_B = load_stack(ROOT / "stacks" / "Pulumi.team-b.yaml")  # has a trn1 pool


def json_member(tar: tarfile.TarFile, name: str) -> Any:
    member = tar.extractfile(name)
    assert member is not None, f"{name} is not a file in the bundle"
    return json.load(member)


def test_one_idle_alarm_per_accelerator_pool(shipped: tuple[Stack, tuple[Declared, ...]]) -> None:
    stack, declared = shipped
    alarms = {a.inputs["dimensions"]["gpucluster:pool"]: a.inputs for a in of_type(declared, "metricAlarm:MetricAlarm")
              if a.name.endswith("-idle-gpu")}  # not the head's recovery alarm
    kinds = {p.name: p.itype.accelerator.kind for p in stack.spec.pools if p.itype.accelerator}
    assert set(alarms) == set(kinds)
    (topic,) = of_type(declared, "sns/topic:Topic")
    topic_arn = f"arn:aws:sns:{stack.region}:123456789012:{topic.name}"
    for pool, alarm in alarms.items():
        metric = {"nvidia": "nvidia_smi_utilization_gpu", "neuron": "neuroncore_utilization"}[kinds[pool]]
        assert (alarm["namespace"], alarm["metricName"]) == ("CWAgent", metric)
        assert alarm["dimensions"] == {"gpucluster:cluster": stack.cluster_name, "gpucluster:pool": pool}
        assert (alarm["threshold"], alarm["comparisonOperator"]) == (30, "LessThanThreshold")
        assert (alarm["period"], alarm["evaluationPeriods"], alarm["statistic"]) == (60, 5, "Average")
        assert alarm["treatMissingData"] == "notBreaching" and alarm["alarmActions"] == [topic_arn]


def test_nodes_send_what_the_alarm_watches(shipped: tuple[Stack, tuple[Declared, ...]]) -> None:
    stack, declared = shipped
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(bundle.build(stack, EXAMPLES_DIR)))) as tar:
        for pool in monitoring.watched_pools(stack):
            if pool.accelerator.kind == "nvidia":
                config = json_member(tar, f"cloudwatch-agent/{pool.name}.json")
                metrics = config["metrics"]
                assert metrics["namespace"] == monitoring.NAMESPACE
                assert metrics["global_dimensions"] == monitoring.dimensions(stack, pool)
                assert metrics["aggregation_dimensions"] == [["gpucluster:cluster", "gpucluster:pool"]]
                # The agent names the metric nvidia_smi_<measurement>.
                sent = f"nvidia_smi_{metrics['metrics_collected']['nvidia_gpu']['measurement'][0]}"
            else:
                config = json_member(tar, f"neuron-metrics/{pool.name}.json")
                assert config["namespace"] == monitoring.NAMESPACE and config["period_seconds"] == 60
                assert config["dimensions"] == monitoring.dimensions(stack, pool)
                sent = config["metric_name"]
            assert sent == monitoring.utilisation_metric(pool)
    (policy,) = [p for p in of_type(declared, "iam/rolePolicy:RolePolicy") if p.name.endswith("-compute")]
    statements = {s["Sid"]: s for s in json.loads(policy.inputs["policy"])["Statement"]}
    assert statements["GpuMetrics"]["Condition"] == {"StringEquals": {"cloudwatch:namespace": "CWAgent"}}


def report(cores_in_use: dict[str, float], devices: int = 16, per_device: int = 2) -> str:
    """A neuron-monitor report in the documented layout (trn1.32xlarge: 16 devices, 2 NeuronCores each)."""
    runtimes = [{"pid": 4242, "neuron_runtime_tag": "1", "error": "", "report": {
        "neuroncore_counters": {"period": 5.0, "error": "", "neuroncores_in_use": {
            k: {"neuroncore_utilization": v} for k, v in cores_in_use.items()}},
        "memory_used": {"period": 5.0, "neuron_runtime_used_bytes": {"host": 1 << 20, "neuron_device": 3 << 30}}}}]
    return json.dumps({"neuron_runtime_data": runtimes if cores_in_use else [],
                       "neuron_hardware_info": {"neuron_device_count": devices,
                                                "neuroncore_per_device_count": per_device, "error": ""}})


def test_neuron_utilisation_counts_unused_cores_as_idle() -> None:
    assert neuron.utilisation(json.loads(report({str(i): 90.0 for i in range(32)}))) == 90.0
    assert neuron.utilisation(json.loads(report({"0": 96.0, "1": 64.0}))) == 5.0  # 2 of 32 cores busy
    assert neuron.utilisation(json.loads(report({}))) == 0.0  # no runtime: idle, not silent
    assert neuron.utilisation({"neuron_runtime_data": []}) is None  # nothing known about the cores


def test_trainium_node_publishes_what_the_alarm_reads() -> None:
    pool = next(p for p in TEAM_B.spec.pools if p.accelerator.kind == "neuron")
    config = json.loads(monitoring.neuron_publisher_config(TEAM_B, pool))
    ticks = iter(range(0, 1000, 20))  # a report every 20 s: three reports per 60 s period
    lines = [report({str(i): 90.0 for i in range(32)})] * 3 + [report({})] * 3 + ["not json"]
    with in_process_moto():
        cloudwatch = boto3.client("cloudwatch", region_name=TEAM_B.region)
        assert neuron.publish(lines, config, cloudwatch, clock=lambda: float(next(ticks))) == 2

        def read(metric: str) -> list[dict[str, Any]]:
            """As the alarm reads: the namespace, the metric, the pool's dimensions; all time in one period."""
            return cloudwatch.get_metric_statistics(
                Namespace=monitoring.NAMESPACE, MetricName=metric,
                Dimensions=[{"Name": k, "Value": v} for k, v in monitoring.dimensions(TEAM_B, pool).items()],
                StartTime="2000-01-01T00:00:00Z", EndTime="2100-01-01T00:00:00Z", Period=86400 * 365 * 100,
                Statistics=["Minimum", "Maximum", "SampleCount"])["Datapoints"]

        stats, memory = read(monitoring.utilisation_metric(pool)), read(config["memory_metric_name"])
    assert [(d["SampleCount"], d["Minimum"], d["Maximum"]) for d in stats] == [(2.0, 0.0, 90.0)]
    assert [d["Maximum"] for d in memory] == [float(3 << 30)]  # the busy minute's device memory


def test_trainium_node_runs_the_publisher(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bootstrap, "BUNDLE", tmp_path)
    (tmp_path / "neuron-metrics").mkdir()
    (tmp_path / "neuron-metrics" / "trn1.json").write_text("{}")
    assert bootstrap.gpu_metrics("trn1", "us-west-2", tmp_path) == "gpucluster-neuron-metrics.service"
    unit = (tmp_path / "gpucluster-neuron-metrics.service").read_text()
    monitor = "/opt/aws/neuron/bin/neuron-monitor"
    command = f"{settings.NEURON_METRICS_PROGRAM} {tmp_path}/neuron-metrics/trn1.json -- {monitor}"
    assert command in unit
    assert "AWS_DEFAULT_REGION=us-west-2" in unit and "Restart=always" in unit
    assert bootstrap.gpu_metrics("p5-od", "us-west-2", tmp_path) is None  # NVIDIA: the CloudWatch agent, no unit
