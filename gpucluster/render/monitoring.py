"""Accelerator utilisation, published by every GPU and Trainium node and watched per pool.

NVIDIA nodes publish through the CloudWatch agent's nvidia_gpu plugin; Neuron nodes through gpucluster's own small
publisher fed by neuron-monitor (gpucluster/node/neuron_metrics.py). Both configurations and the alarms share the
names below, so that an alarm always watches the metric the nodes send. The rule every GPU dashboard carries:
utilisation under 30% for 5 minutes is money burning.
"""

from __future__ import annotations

import json

from gpucluster.spec.model import PoolSpec, Stack

NAMESPACE = "CWAgent"
# The CloudWatch agent names its metrics nvidia_smi_<measurement>.
UTILISATION_METRICS = {"nvidia": "nvidia_smi_utilization_gpu", "neuron": "neuroncore_utilization"}
CLUSTER_DIMENSION = "gpucluster:cluster"
POOL_DIMENSION = "gpucluster:pool"
IDLE_PERCENT = 30
IDLE_MINUTES = 5
PERIOD_SECONDS = 60  # one data point a minute from every node; the alarm averages per minute


def watched_pools(stack: Stack) -> list[PoolSpec]:
    """Every pool with accelerators."""
    return [p for p in stack.spec.pools if p.itype.accelerator]


def utilisation_metric(pool: PoolSpec) -> str:
    return UTILISATION_METRICS[pool.accelerator.kind]


def node_config(stack: Stack, pool: PoolSpec) -> tuple[str, str]:
    """(file name in the bundle, content) of what the pool's nodes run to publish utilisation."""
    if pool.accelerator.kind == "nvidia":
        return f"cloudwatch-agent/{pool.name}.json", agent_config(stack, pool)
    return f"neuron-metrics/{pool.name}.json", neuron_publisher_config(stack, pool)


def neuron_publisher_config(stack: Stack, pool: PoolSpec) -> str:
    """For neuron_metrics.py: the mean utilisation of all the node's NeuronCores (0 for cores no runtime
    uses, so an idle node reports 0 rather than nothing) and the device memory in use, one data point a minute."""
    return json.dumps({"namespace": NAMESPACE, "metric_name": UTILISATION_METRICS["neuron"],
                       "memory_metric_name": "neuron_memory_used", "dimensions": dimensions(stack, pool),
                       "period_seconds": PERIOD_SECONDS}, indent=1, sort_keys=True) + "\n"


def dimensions(stack: Stack, pool: PoolSpec) -> dict[str, str]:
    return {CLUSTER_DIMENSION: stack.cluster_name, POOL_DIMENSION: pool.name}


def agent_config(stack: Stack, pool: PoolSpec) -> str:
    """amazon-cloudwatch-agent configuration for the pool's nodes: per-GPU metrics every minute, aggregated to the
    pool (the dimensions the alarm watches)."""
    return json.dumps({
        "agent": {"metrics_collection_interval": PERIOD_SECONDS},
        "metrics": {
            "namespace": NAMESPACE,
            "global_dimensions": dimensions(stack, pool),
            "aggregation_dimensions": [[CLUSTER_DIMENSION, POOL_DIMENSION]],
            "metrics_collected": {
                "nvidia_gpu": {"measurement": ["utilization_gpu", "utilization_memory", "memory_used", "memory_total"]},
            },
        },
    }, indent=1, sort_keys=True) + "\n"
