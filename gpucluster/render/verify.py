"""`gpucluster verify --plan`: the checks a verify run makes on a stack's pools and the figures each must reach, from
the stack file and the instance catalog alone (offline). The run on the head node reads the same list from the bundle
(settings.VERIFY_PLAN) and judges what it measures with gpucluster.contract.verify.judge.

The expected figures:
- devices: the catalog's GPUs or Neuron devices, and EFA interfaces on an EFA pool;
- all_reduce bus bandwidth (NVIDIA pools, two nodes or more): the catalog's floor for the type, none when no figure
  is published for it (the run then warns), and always the size the sweep must reach and read it at (the published
  run's largest, else contract.verify.DEFAULT_ALL_REDUCE_BYTES);
- /fsx mounted, with the Lustre version of a file system the stack creates (catalog.LUSTRE_VERSION, the one
  components/storage.py creates) for the nodes' client to meet;
- /fsx sequential write and read: the file system's disk baseline (catalog.LUSTRE_DISK_MBPS_PER_TIB x its TiB), or
  what the job's nodes can carry if less (each node's primary network card, which carries Lustre's TCP), times
  FSX_FLOOR_FRACTION; none for an existing file system, whose size and tier the stack does not state;
- scale from zero: the type's provision time (catalog), never above the stack's Slurm ResumeTimeout (after which
  Slurm gives the node up anyway);
- Prometheus scraping every node of the job;
- once per plan, the cluster's (pool contract.verify.CLUSTER): the budget's topic reachable and the GpuIdle rule
  loaded. Every Slurm stack has both: the budget (and with it the topic, components/budget.py) is required, and
  render/prometheus.py loads GpuIdle on every head.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gpucluster.contract import verify as v
from gpucluster.spec import catalog
from gpucluster.spec.model import PoolSpec, Stack

DEFAULT_NODES = 2  # per pool, where its max_nodes allows: the fewest that exercise NCCL across nodes
# Sequential I/O through Lustre's TCP clients stays below the file system's baseline (protocol overhead, the job's
# files striped over a few targets): verify requires 80% of it. A mount on the wrong path, or a client throttled to a
# fraction of its link, is far below that.
FSX_FLOOR_FRACTION = 0.8
MB_PER_S_PER_GBPS = 125  # 1 Gbit/s = 125 MB/s (decimal units, as EC2 and FSx state them)


class PlanError(ValueError):
    """Options that name no pool of the stack, or more nodes than a pool has: every problem at once."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("; ".join(problems))


@dataclass(frozen=True)
class Options:
    pools: tuple[str, ...] = ()  # () : every pool
    nodes: int | None = None  # None: DEFAULT_NODES where a pool allows, else its max_nodes
    deep: bool = False


def plan(stack: Stack, options: Options = Options()) -> list[v.Check]:
    """The checks of a verify run on the chosen pools, in the stack's pool order, then the cluster's."""
    chosen = _chosen_pools(stack, options)
    return [check for pool in chosen for check in pool_checks(stack, pool, _nodes(pool, options), options.deep)] + \
        cluster_checks()


def cluster_checks() -> list[v.Check]:
    """What the head offers every pool, checked once per run whichever pools it verifies."""
    return [v.Check(v.CLUSTER, v.BUDGET_TOPIC, {"reachable": True}),
            v.Check(v.CLUSTER, v.GPU_IDLE_RULE, {"loaded": True})]


def _chosen_pools(stack: Stack, options: Options) -> list[PoolSpec]:
    problems: list[str] = []
    if stack.spec.scheduler != "slurm":
        problems.append(f"a run goes through Slurm, and stack {stack.name} is scheduler: {stack.spec.scheduler} (its "
                        "accelerator nodes prove themselves in their burn-in)")
    names = [p.name for p in stack.spec.pools]
    unknown = [name for name in options.pools if name not in names]
    if unknown:
        problems.append(f"no pool {', '.join(unknown)} in stack {stack.name}; its pools: {', '.join(names)}")
    chosen = [p for p in stack.spec.pools if not options.pools or p.name in options.pools]
    if options.nodes is not None:
        if options.nodes < 1:
            problems.append(f"--nodes must be at least 1, got {options.nodes}")
        problems += [f"--nodes {options.nodes} is more than pool {p.name}'s max_nodes ({p.max_nodes})"
                     for p in chosen if options.nodes > p.max_nodes]
    if problems:
        raise PlanError(problems)
    return chosen


def _nodes(pool: PoolSpec, options: Options) -> int:
    return options.nodes if options.nodes is not None else min(DEFAULT_NODES, pool.max_nodes)


def pool_checks(stack: Stack, pool: PoolSpec, nodes: int, deep: bool) -> list[v.Check]:
    itype = pool.itype
    accelerator = pool.accelerator
    nvidia = accelerator.kind == "nvidia"
    checks: list[tuple[str, v.Expect]] = []
    if pool.min_nodes < nodes:  # always-on nodes are up already: only the others scale from zero
        checks.append((v.SCALE_FROM_ZERO_SECONDS, {"max": min(itype.provision_minutes * 60,
                                                              stack.spec.slurm.resume_timeout_seconds)}))
    checks.append((v.GPUS if nvidia else v.NEURON_DEVICES, {"count": accelerator.count}))
    if nvidia:
        checks += [(v.ECC_UNCORRECTED, {"max": 0}),
                   (v.DCGM_DIAG, {"level": v.DCGM_DEEP_LEVEL if deep else v.DCGM_LEVEL})]
    if pool.uses_efa:
        checks.append((v.EFA_DEVICES, {"count": itype.efa_interfaces}))
        if nvidia:  # aws-ofi-nccl is NCCL's; Neuron's collectives use libfabric directly
            checks.append((v.NCCL_EFA_PLUGIN, {"found": True}))
    checks += [(v.FSX_MOUNTED, fsx_mounted_expect(stack)), (v.METADATA_REFUSED, {"refused": True}),
               (v.NAMES_RESOLVE, {"nodes": nodes}),
               (v.PROMETHEUS_SCRAPES, {"nodes": nodes})]
    if nvidia and nodes >= 2:  # nccl-tests needs CUDA; one node's all_reduce never leaves NVLink
        checks.append((v.NCCL_ALL_REDUCE_BUSBW_GBPS, all_reduce_expect(itype)))
        if pool.uses_efa:
            checks.append((v.NCCL_TRANSPORT, {"provider": "efa"}))
    write, read = fsx_floors_mbps(stack, itype, nodes)
    checks += [(v.FSX_WRITE_MBPS, {"min": write} if write else {}),
               (v.FSX_READ_MBPS, {"min": read} if read else {})]
    return [v.Check(pool.name, name, expect) for name, expect in checks]


def all_reduce_expect(itype: catalog.InstanceType) -> v.Expect:
    """The busbw floor where the catalog has one, and always the sweep's largest size: a floor read at a smaller size
    would judge a run that never reached the bandwidth the figure was published at."""
    figure = itype.all_reduce
    if figure is None:
        return {"bytes": v.DEFAULT_ALL_REDUCE_BYTES}
    return {"min": figure.floor_gbps, "bytes": figure.message_bytes}


def fsx_mounted_expect(stack: Stack) -> v.Expect:
    """The Lustre version of a file system the stack creates (its nodes' client must be as recent); none for an
    existing file system, whose version the stack does not state."""
    return {} if stack.spec.storage.lustre.file_system_id else {v.LUSTRE_VERSION_KEY: catalog.LUSTRE_VERSION}


def fsx_floors_mbps(stack: Stack, itype: catalog.InstanceType, nodes: int) -> tuple[int | None, int | None]:
    """(write, read) floors in MB/s for `nodes` nodes of a type together; None for an existing file system."""
    lustre = stack.spec.storage.lustre
    if lustre.file_system_id or lustre.deployment_type is None or lustre.storage_capacity_gib is None:
        return None, None
    per_tib_read, per_tib_write = catalog.LUSTRE_DISK_MBPS_PER_TIB[
        (lustre.deployment_type, lustre.throughput_mb_per_tib)]
    tib = lustre.storage_capacity_gib / 1024
    clients = nodes * itype.primary_network_gbps * MB_PER_S_PER_GBPS

    def floor(per_tib: int) -> int:
        return int(min(per_tib * tib, clients) * FSX_FLOOR_FRACTION)

    return floor(per_tib_write), floor(per_tib_read)


def table(checks: Sequence[v.Check]) -> list[str]:
    """The plan as a readable table: pool, check, expected."""
    return v.columns([("pool", "check", "expected")] + [(c.pool, c.check, v.expectation(c)) for c in checks])
