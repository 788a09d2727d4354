"""GPU utilisation, published by the CloudWatch agent on every NVIDIA node and watched per pool.

The agent's configuration and the alarms share the names below, so that an alarm always watches the metric the agent
sends. The rule every GPU dashboard carries: utilisation under 30% for 5 minutes is money burning.
"""

from __future__ import annotations

import json

from gpucluster.spec import Pool, Stack

NAMESPACE = "CWAgent"
UTILISATION_METRIC = "nvidia_smi_utilization_gpu"
CLUSTER_DIMENSION = "gpucluster:cluster"
POOL_DIMENSION = "gpucluster:pool"
IDLE_PERCENT = 30
IDLE_MINUTES = 5


def watched_pools(stack: Stack) -> list[Pool]:
    """NVIDIA pools: the agent's nvidia_gpu plugin reads nvidia-smi (Neuron devices report through neuron-monitor)."""
    return [p for p in stack.spec.pools if p.itype.accelerator and p.itype.accelerator.kind == "nvidia"]


def dimensions(stack: Stack, pool: Pool) -> dict[str, str]:
    return {CLUSTER_DIMENSION: stack.cluster_name, POOL_DIMENSION: pool.name}


def agent_config(stack: Stack, pool: Pool) -> str:
    """amazon-cloudwatch-agent configuration for the pool's nodes: per-GPU metrics every minute, aggregated to the
    pool (the dimensions the alarm watches)."""
    return json.dumps({
        "agent": {"metrics_collection_interval": 60},
        "metrics": {
            "namespace": NAMESPACE,
            "global_dimensions": dimensions(stack, pool),
            "aggregation_dimensions": [[CLUSTER_DIMENSION, POOL_DIMENSION]],
            "metrics_collected": {
                "nvidia_gpu": {"measurement": ["utilization_gpu", "utilization_memory", "memory_used", "memory_total"]},
            },
        },
    }, indent=1, sort_keys=True) + "\n"
