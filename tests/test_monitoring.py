"""Idle-GPU alarms: one per NVIDIA pool, watching exactly what the nodes' CloudWatch agent sends."""

from __future__ import annotations

import gzip
import io
import json
import tarfile

from conftest import of_type
from gpucluster import bundle, monitoring
from gpucluster.plan import Declared
from gpucluster.spec import Stack


def test_one_idle_gpu_alarm_per_nvidia_pool(shipped: tuple[Stack, tuple[Declared, ...]]) -> None:
    stack, declared = shipped
    alarms = {a.inputs["dimensions"]["gpucluster:pool"]: a.inputs for a in of_type(declared, "metricAlarm:MetricAlarm")}
    nvidia = {p.name for p in stack.spec.pools if p.itype.accelerator.kind == "nvidia"}
    assert set(alarms) == nvidia  # Trainium pools report through neuron-monitor, not nvidia-smi
    (topic,) = of_type(declared, "sns/topic:Topic")
    topic_arn = f"arn:aws:plan:{stack.region}:123456789012:{topic.name}"
    for pool, alarm in alarms.items():
        assert (alarm["namespace"], alarm["metricName"]) == ("CWAgent", "nvidia_smi_utilization_gpu")
        assert alarm["dimensions"] == {"gpucluster:cluster": stack.cluster_name, "gpucluster:pool": pool}
        assert (alarm["threshold"], alarm["comparisonOperator"]) == (30, "LessThanThreshold")
        assert (alarm["period"], alarm["evaluationPeriods"], alarm["statistic"]) == (60, 5, "Average")
        assert alarm["treatMissingData"] == "notBreaching" and alarm["alarmActions"] == [topic_arn]


def test_nodes_send_what_the_alarm_watches(shipped: tuple[Stack, tuple[Declared, ...]]) -> None:
    stack, declared = shipped
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(bundle.build(stack)))) as tar:
        for pool in monitoring.watched_pools(stack):
            config = json.load(tar.extractfile(f"cloudwatch-agent/{pool.name}.json"))  # type: ignore[arg-type]
            metrics = config["metrics"]
            assert metrics["namespace"] == monitoring.NAMESPACE
            assert metrics["global_dimensions"] == monitoring.dimensions(stack, pool)
            assert metrics["aggregation_dimensions"] == [["gpucluster:cluster", "gpucluster:pool"]]
            # The agent names the metric nvidia_smi_<measurement>.
            assert f"nvidia_smi_{metrics['metrics_collected']['nvidia_gpu']['measurement'][0]}" == \
                monitoring.UTILISATION_METRIC
    (policy,) = [p for p in of_type(declared, "iam/rolePolicy:RolePolicy") if p.name.endswith("-compute")]
    statements = {s["Sid"]: s for s in json.loads(policy.inputs["policy"])["Statement"]}
    assert statements["GpuMetrics"]["Condition"] == {"StringEquals": {"cloudwatch:namespace": "CWAgent"}}
