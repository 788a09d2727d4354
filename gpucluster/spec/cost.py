"""What a stack costs, from the catalog's reference prices (offline) or live prices (preflight).

Spot pools are priced at the on-demand rate: the offline plan cannot know the spot price, and on-demand is its upper
bound (the totals and the budget warning use it). Beside it a spot pool shows a typical price: the on-demand rate less
the savings the Spot Instance Advisor published for its type and the stack's region (catalog.SPOT_ADVISOR), where it
published one. `preflight` passes live spot prices in `hourly_overrides`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import date, timedelta

from gpucluster.contract.slurm_json import BILLING_CENTS_PER_USD
from gpucluster.spec import catalog, eks
from gpucluster.spec.model import CPU_NODES_NAME, HEAD_STATE_GIB, MIN_POOL_ROOT_GIB, ImageBuild, PoolSpec, Stack

COST_TAG = "gpucluster:stack"  # the cost-allocation tag that budgets and spend reports filter on
HOURS_PER_MONTH = 730  # AWS's own convention in its pricing calculator

# us-east-1 reference rates, same date and source as the catalog.
NAT_GATEWAY_USD_PER_HOUR = 0.045
INTERFACE_ENDPOINT_USD_PER_HOUR = 0.01  # per endpoint per AZ
GP3_USD_PER_GIB_MONTH = 0.08
S3_STANDARD_USD_PER_GB_MONTH = 0.023  # first 50 TB
PUBLIC_IPV4_USD_PER_HOUR = 0.005  # an Elastic IP, attached or not
# FSx for Lustre SSD, $/GiB-month, by deployment type and throughput tier (MB/s/TiB; None where fixed).
LUSTRE_USD_PER_GIB_MONTH = {
    ("SCRATCH_2", None): 0.140,
    ("PERSISTENT_2", 125): 0.145,
    ("PERSISTENT_2", 250): 0.210,
    ("PERSISTENT_2", 500): 0.340,
    ("PERSISTENT_2", 1000): 0.600,
}
# The SSM, SSM messages and EC2 messages endpoints that Session Manager needs in a private subnet.
SSM_ENDPOINTS = ("ssm", "ssmmessages", "ec2messages")
# The head node's disks, as components/head_node.py creates them (gp3, encrypted).
HEAD_ROOT_GIB = 100
# HEAD_STATE_GIB (model.py): slurmctld state, MariaDB and Prometheus (half of it: benchmarks/prometheus_scale.py)
# The root volume of each baked node image (components/image.py), within what its nodes launch with: Ubuntu's 8 GiB
# plus the head's packages; for compute the DLAMI's volume plus torch, and no more than a pool's smallest root.
IMAGE_ROOT_GIB = {"head": 20, "compute": MIN_POOL_ROOT_GIB}


def money(value: float | None) -> str:
    """Dollars as every report prints them; None is a figure nobody could read."""
    return "unknown" if value is None else f"${value:,.2f}"


@dataclass(frozen=True)
class PoolCost:
    name: str
    instance_type: str
    capacity: str
    usd_per_node_hour: float | None  # None: no published price for the type
    min_nodes: int
    max_nodes: int
    priced_as: str  # "on-demand", "on-demand (spot upper bound)", "live spot", "no price"
    # A spot pool priced at its ceiling: the advisor's figures for its type and region, when it published them.
    spot: catalog.SpotFigure | None = None

    @property
    def hourly_min(self) -> float:
        return (self.usd_per_node_hour or 0.0) * self.min_nodes

    @property
    def hourly_max(self) -> float:
        return (self.usd_per_node_hour or 0.0) * self.max_nodes

    @property
    def typical_usd_per_node_hour(self) -> float | None:
        """What a node typically cost on spot: the ceiling less the advisor's 30-day savings. The advisor's savings are
        against its region's on-demand rate, applied here to the reference region's (catalog.PRICE_REGION)."""
        if self.spot is None or self.usd_per_node_hour is None:
            return None
        return self.usd_per_node_hour * (100 - self.spot.savings_percent) / 100

    @property
    def typical_hourly_max(self) -> float:
        """At max size, at the typical price where there is one, else at the ceiling."""
        typical = self.typical_usd_per_node_hour
        return self.hourly_max if typical is None else typical * self.max_nodes

    def row(self) -> dict[str, object]:
        """The pool's figures as `plan --json` gives them."""
        return {"pool": self.name, "instance_type": self.instance_type, "capacity": self.capacity,
                "usd_per_node_hour": self.usd_per_node_hour, "priced_as": self.priced_as,
                "min_nodes": self.min_nodes, "max_nodes": self.max_nodes,
                "hourly_usd_min": round(self.hourly_min, 4), "hourly_usd_max": round(self.hourly_max, 4),
                "typical_spot": None if self.spot is None else {
                    "usd_per_node_hour": round(self.typical_usd_per_node_hour or 0.0, 4),
                    "savings_percent": self.spot.savings_percent, "interruptions": self.spot.interruptions,
                    "source": catalog.SPOT_SOURCE, "recorded": catalog.SPOT_DATE}}


@dataclass(frozen=True)
class ImageCost:
    """One node image that `up` bakes: a build's instance time, and its AMI's snapshot each month."""

    key: str  # head, compute-nvidia, compute-neuron
    root_gib: int
    build_usd: float
    snapshot_monthly: float


@dataclass(frozen=True)
class CostEstimate:
    pools: list[PoolCost]
    head_node_monthly: float
    network_monthly: float
    lustre_monthly: float
    budget_monthly: float
    unpriced: list[str] = field(default_factory=list)  # pools whose type has no price: totals are lower bounds
    images: list[ImageCost] = field(default_factory=list)
    # Kubernetes stacks: the EKS control plane's hourly fee and the system node group, per month (0 for Slurm).
    kubernetes_monthly: float = 0.0

    @property
    def image_build_usd(self) -> float:
        """What building every image once costs: at the first `up`, and again when a parent AMI or the script
        changes. Not in the hourly figures."""
        return sum(i.build_usd for i in self.images)

    @property
    def image_snapshots_monthly(self) -> float:
        """The AMIs' snapshots, priced at their full root volume (EBS bills only the blocks written: an upper bound)."""
        return sum(i.snapshot_monthly for i in self.images)

    @property
    def fixed_monthly_parts(self) -> dict[str, float]:
        """What bills every month whether jobs run or not, by part."""
        return {"head_node": self.head_node_monthly, "lustre": self.lustre_monthly, "network": self.network_monthly,
                "kubernetes": self.kubernetes_monthly, "image_snapshots": self.image_snapshots_monthly}

    @property
    def fixed_monthly(self) -> float:
        return sum(self.fixed_monthly_parts.values())

    @property
    def fixed_hourly(self) -> float:
        return self.fixed_monthly / HOURS_PER_MONTH

    @property
    def hourly_min(self) -> float:
        return self.fixed_hourly + sum(p.hourly_min for p in self.pools)

    @property
    def hourly_max(self) -> float:
        return self.fixed_hourly + sum(p.hourly_max for p in self.pools)

    @property
    def typical_hourly_max(self) -> float:
        """At max size with the spot pools at their typical price (the ceiling where none is published)."""
        return self.fixed_hourly + sum(p.typical_hourly_max for p in self.pools)

    @property
    def monthly_at_min(self) -> float:
        return self.hourly_min * HOURS_PER_MONTH

    @property
    def monthly_at_max(self) -> float:
        return self.hourly_max * HOURS_PER_MONTH

    @property
    def over_budget(self) -> bool:
        return self.monthly_at_max > self.budget_monthly

    @property
    def hours_at_max_within_budget(self) -> float:
        """How many hours the cluster can run at full size before the month's budget is gone."""
        return self.budget_monthly / self.hourly_max if self.hourly_max else float("inf")

    def summary(self) -> dict[str, object]:
        """The estimate as `plan --json` and `preflight --json` give it under "cost"."""
        return {
            "pools": [p.row() for p in self.pools],
            "hourly_usd_min": round(self.hourly_min, 4),
            "hourly_usd_max": round(self.hourly_max, 4),
            "hourly_usd_max_typical_spot": round(self.typical_hourly_max, 4),
            "monthly_usd_at_min": round(self.monthly_at_min, 2),
            "monthly_usd_at_max": round(self.monthly_at_max, 2),
            "budget_monthly_usd": self.budget_monthly,
            "unpriced_pools": self.unpriced,
            "image_build_usd": round(self.image_build_usd, 2),
            "fixed_monthly_usd": {part: round(usd, 2) for part, usd in self.fixed_monthly_parts.items()},
            "over_budget": self.over_budget,
            "hours_at_max_within_budget": round(self.hours_at_max_within_budget, 1) if self.over_budget else None,
            "price_date": catalog.PRICE_DATE,
        }


def estimate(stack: Stack, hourly_overrides: dict[str, float] | None = None) -> CostEstimate:
    """Cost of the stack. `hourly_overrides` maps a pool name to a measured $/node-hour (live spot price)."""
    spec = stack.spec
    overrides = hourly_overrides or {}
    pools = []
    for pool in spec.pools:
        price = pool.itype.on_demand_usd_per_hour
        if pool.name in overrides:
            price, how = overrides[pool.name], "live spot" if pool.capacity == "spot" else "live"
        elif price is None:
            how = "no price"
        elif pool.capacity == "spot":
            how = "on-demand (spot upper bound)"
        else:
            how = "on-demand"
        spot = catalog.spot_figure(pool.instance_type, stack.region) if how.startswith("on-demand (spot") else None
        pools.append(PoolCost(pool.name, pool.instance_type, pool.capacity, price, pool.min_nodes, pool.max_nodes, how,
                              spot))
    if spec.scheduler == "kubernetes":  # the CPU node group: on demand, from zero, like a pool
        cpu_nodes = spec.eks.cpu_nodes
        pools.append(PoolCost(CPU_NODES_NAME, cpu_nodes.instance_type, "on-demand",
                              cpu_nodes.itype.on_demand_usd_per_hour, 0, cpu_nodes.max_nodes, "on-demand"))

    head_type = catalog.HEAD_NODE[spec.head_node.instance_type]
    head = (head_type.on_demand_usd_per_hour or 0.0) * HOURS_PER_MONTH + GP3_USD_PER_GIB_MONTH * (
        HEAD_ROOT_GIB + HEAD_STATE_GIB
    )
    kubernetes = 0.0
    if spec.scheduler == "kubernetes":
        head = 0.0  # no head node: EKS runs the control plane
        kubernetes = kubernetes_monthly()
    network = 0.0
    if spec.network.creates_vpc:
        network = (NAT_GATEWAY_USD_PER_HOUR + INTERFACE_ENDPOINT_USD_PER_HOUR * len(SSM_ENDPOINTS)) * HOURS_PER_MONTH

    lustre = spec.storage.lustre
    lustre_monthly = 0.0
    if lustre.deployment_type and lustre.storage_capacity_gib:
        lustre_monthly = lustre_usd_per_month(lustre.deployment_type, lustre.throughput_mb_per_tib,
                                                     lustre.storage_capacity_gib)

    return CostEstimate(
        pools=pools,
        head_node_monthly=head,
        network_monthly=network,
        lustre_monthly=lustre_monthly,
        budget_monthly=spec.budget.monthly_usd,
        unpriced=[p.name for p in pools if p.usd_per_node_hour is None],
        images=[_image_cost(build) for build in spec.image_builds],
        kubernetes_monthly=kubernetes,
    )


# Reference prices older than this are flagged: AWS changes rates (the catalog's were recorded after the June 2025 GPU
# price change) and spot savings move month to month.
STALE_AFTER_MONTHS = 6


def _months_between(earlier: date, later: date) -> int:
    """Whole months from `earlier` to `later`."""
    return (later.year - earlier.year) * 12 + later.month - earlier.month - (later.day < earlier.day)


def stale_price_warning(today: date) -> str | None:
    """A warning when the catalog's reference prices (on-demand rates, spot savings) are older than STALE_AFTER_MONTHS
    on `today`; None while they are fresh."""
    old = []
    for what, recorded in (("on-demand rates", catalog.PRICE_DATE), ("spot savings", catalog.SPOT_DATE)):
        day = date.fromisoformat(recorded)
        # Older than the limit: it was already reached yesterday (on the day itself they are just that old).
        if _months_between(day, today - timedelta(days=1)) >= STALE_AFTER_MONTHS:
            old.append(f"{what} recorded {recorded} ({_months_between(day, today)} months ago)")
    if not old:
        return None
    return (f"the reference prices are older than {STALE_AFTER_MONTHS} months: {'; '.join(old)}. `preflight STACK` "
            "reads the live spot prices of the account and region; the reference figures are refreshed in "
            "gpucluster/spec/catalog.py (PRICE_DATE, SPOT_DATE)")


def kubernetes_monthly() -> float:
    """EKS's hourly fee (standard support) and the system node group's on-demand nodes, per month."""
    system = catalog.lookup(eks.SYSTEM_INSTANCE_TYPE).on_demand_usd_per_hour or 0.0
    return (eks.CONTROL_PLANE_USD_PER_HOUR + eks.SYSTEM_NODES * system) * HOURS_PER_MONTH


def _image_cost(build: ImageBuild) -> ImageCost:
    hourly = catalog.lookup(catalog.IMAGE_BUILD_INSTANCE_TYPES[0]).on_demand_usd_per_hour or 0.0
    root_gib = IMAGE_ROOT_GIB[build.role]
    return ImageCost(build.key, root_gib, hourly * catalog.IMAGE_BUILD_HOURS,
                     catalog.EBS_SNAPSHOT_USD_PER_GB_MONTH * root_gib)


@dataclass(frozen=True)
class Kept:
    """Something `pulumi destroy` leaves on purpose, and what it goes on costing."""

    what: str
    monthly_usd: float | None  # None: it depends on what it will hold
    note: str


def lustre_usd_per_month(deployment_type: str, throughput_mb_per_tib: int | None, capacity_gib: int) -> float:
    return LUSTRE_USD_PER_GIB_MONTH[(deployment_type, throughput_mb_per_tib)] * capacity_gib


def kept_on_destroy(stack: Stack) -> list[Kept]:
    """What survives `pulumi destroy` of the stack (storage.lustre's keep_*_on_destroy)."""
    lustre = stack.spec.storage.lustre
    kept = []
    if lustre.exports and lustre.keep_bucket_on_destroy:
        kept.append(Kept("the stack's S3 bucket (the data written under /fsx, exported)", None,
                         f"S3 Standard ${S3_STANDARD_USD_PER_GB_MONTH}/GB-month of what it holds"))
    if lustre.keeps_file_system and lustre.deployment_type and lustre.storage_capacity_gib:
        what = f"the FSx for Lustre file system ({lustre.deployment_type}, {lustre.storage_capacity_gib} GiB)"
        kept.append(Kept(what,
                         lustre_usd_per_month(lustre.deployment_type, lustre.throughput_mb_per_tib,
                                              lustre.storage_capacity_gib),
                         "storage.lustre.keep_file_system_on_destroy"))
    return kept


def billing_minutes(usd: float) -> int:
    """GrpTRESMins=billing: a quota in cent-minutes (one cent per hour bills one unit for each minute)."""
    return int(usd * BILLING_CENTS_PER_USD) * 60


@dataclass(frozen=True)
class PoolQuota:
    """What the quota buys in one pool: its price per accelerator-hour as Slurm bills it, and how many hours."""

    pool: str
    accelerator: str  # gpu, neuron
    usd_per_accelerator_hour: float
    priced_as: str  # "on-demand", or the upper bound an unpriced type is billed at
    accelerator_hours: float


@dataclass(frozen=True)
class Quota:
    """The month's money the team's jobs may spend (Slurm enforces it, partition by partition, at the pools' prices)."""

    usd: float
    why: str
    pools: tuple[PoolQuota, ...]

    @property
    def billing_minutes(self) -> int:
        return billing_minutes(self.usd)

    def as_dict(self) -> dict[str, object]:
        return {"usd_per_month": round(self.usd, 2), "why": self.why,
                "pools": [{"pool": p.pool, "accelerator": p.accelerator,
                           "usd_per_accelerator_hour": round(p.usd_per_accelerator_hour, 4),
                           "priced_as": p.priced_as, "accelerator_hours": round(p.accelerator_hours, 1)}
                          for p in self.pools]}


def _ceiling_per_accelerator_hour() -> float:
    """The highest on-demand price of one accelerator-hour in the catalog: what an unpriced type is billed at, so
    that its jobs cannot spend more of the quota than they cost."""
    return max(t.on_demand_usd_per_hour / t.accelerator.count for t in catalog.ACCELERATED.values()
               if t.accelerator and t.on_demand_usd_per_hour)


def billed_node_hour_usd(pool: PoolSpec) -> tuple[float, str]:
    """What one node-hour of the pool bills against the quota: its on-demand price (a spot pool's ceiling), or, for a
    type the catalog has no price for, the catalog's highest price per accelerator-hour times its accelerators."""
    price = pool.itype.on_demand_usd_per_hour
    if price is not None:
        return price, "on-demand (spot ceiling)" if pool.capacity == "spot" else "on-demand"
    return _ceiling_per_accelerator_hour() * pool.accelerator.count, "no price: the catalog's highest $/accelerator-h"


def _quota_usd(stack: Stack, fixed: float) -> tuple[float, str]:
    """The month's quota in dollars, and where it comes from (quota); `fixed`: the stack's fixed monthly costs."""
    budget = stack.spec.budget
    if budget.quota_usd_per_month is not None:
        return budget.quota_usd_per_month, "budget.quota_usd_per_month"
    return max(budget.monthly_usd - fixed, 0.0), (f"budget.monthly_usd {money(budget.monthly_usd)} less the fixed "
                                                  f"costs of {money(fixed)} a month: head node, network, Lustre, "
                                                  "images")


def quota(stack: Stack) -> Quota:
    """The Slurm team account's monthly money quota: budget.quota_usd_per_month, or the budget less the cluster's
    fixed costs (what bills whether jobs run or not), so that jobs and fixed costs together stay within the budget.
    (Slurm stacks only: Kueue has no accumulated-usage limit.)"""
    usd, why = _quota_usd(stack, estimate(stack).fixed_monthly)
    pools = []
    for pool in stack.spec.pools:
        node_hour, priced_as = billed_node_hour_usd(pool)
        per_hour = node_hour / pool.accelerator.count
        pools.append(PoolQuota(pool.name, "gpu" if pool.accelerator.kind == "nvidia" else "neuron", per_hour,
                               priced_as, usd / per_hour))
    return Quota(usd, why, tuple(pools))


def default_partition(stack: Stack) -> tuple[str, str]:
    """Where a job that names no partition goes, and why: slurm.default_partition, or the pool whose GPU-hour bills
    least (the first of equals; a CUDA script without `-p` must not land on Trainium), or with no NVIDIA pool the
    cheapest Neuron device-hour."""
    chosen = stack.spec.slurm.default_partition
    if chosen is not None:
        return chosen, "slurm.default_partition"
    pools = stack.spec.pools
    candidates = [p for p in pools if p.accelerator.kind == "nvidia"] or pools
    cheapest = min(candidates, key=lambda p: billed_node_hour_usd(p)[0] / p.accelerator.count)
    unit = "GPU-hour" if cheapest.accelerator.kind == "nvidia" else "Neuron device-hour"
    return cheapest.name, f"the cheapest {unit} (slurm.default_partition names another)"


def quota_problems(stack: Stack) -> list[tuple[tuple[str, ...], str]]:
    """A quota that lets no job start (less than a cent: GrpTRESMins=billing=0), as (path under the cluster, message):
    Slurm would hold every job of the team with AssocGrpBillingMinutes from the first day. Slurm stacks only."""
    if stack.spec.scheduler != "slurm":
        return []
    budget, estimated = stack.spec.budget, estimate(stack)
    fixed = estimated.fixed_monthly
    if billing_minutes(_quota_usd(stack, fixed)[0]) > 0:
        return []
    parts = (f"head node {money(estimated.head_node_monthly)}, network {money(estimated.network_monthly)}, Lustre "
             f"{money(estimated.lustre_monthly)}, node images {money(estimated.image_snapshots_monthly)}")
    held = "Slurm would hold every job of the team (AssocGrpBillingMinutes)"
    if budget.quota_usd_per_month is not None:
        left = money(budget.monthly_usd - fixed) if budget.monthly_usd > fixed else "nothing"
        return [(("budget", "quota_usd_per_month"), (
            f"{budget.quota_usd_per_month:g} leaves no quota for jobs: {held}. Give what jobs may spend a month "
            f"(monthly_usd leaves {left} after the fixed costs of {money(fixed)}: {parts}), or remove the key for "
            "that default"))]
    return [(("budget", "monthly_usd"), (
        f"{budget.monthly_usd:g} leaves no quota for jobs: the quota is monthly_usd less the cluster's fixed costs of "
        f"{money(fixed)} a month ({parts}), and {held}. Raise monthly_usd above {money(fixed)} by what jobs may "
        "spend, or set budget.quota_usd_per_month (jobs then spend past the budget)"))]


@dataclass(frozen=True)
class JobTime:
    """How long a job may run under the quota (slurm.conf's AccountingStorageEnforce=safe: Slurm starts a job only if
    its time limit times its billing fits in what is left of GrpTRESMins), per pool for one whole node, and whether a
    whole node of the default partition fits for DefaultTime (what `sbatch` without --time asks for)."""

    default_time_hours: float
    default_partition: str
    default_node_usd: float  # one whole node of the default partition for DefaultTime
    longest_hours: dict[str, float]  # pool -> the longest one-whole-node job the month's quota allows

    @property
    def default_job_fits(self) -> bool:
        return self.longest_hours[self.default_partition] >= self.default_time_hours

    def as_dict(self) -> dict[str, object]:
        return {"default_time_hours": self.default_time_hours, "default_whole_node_job_usd": round(
                    self.default_node_usd, 2), "default_whole_node_job_fits": self.default_job_fits,
                "longest_whole_node_job_hours": {pool: round(h, 1) for pool, h in self.longest_hours.items()}}


def job_time(stack: Stack, whole_node_usd_per_hour: dict[str, float], default_time_hours: float) -> JobTime:
    """`whole_node_usd_per_hour`: what a job holding a whole node bills an hour in each partition (render/slurm.py
    whole_node_usd_per_hour, from its TRESBillingWeights); `default_time_hours`: the partitions' DefaultTime."""
    usd = quota(stack).usd
    partition = default_partition(stack)[0]
    return JobTime(default_time_hours, partition, whole_node_usd_per_hour[partition] * default_time_hours,
                   {pool.name: usd / whole_node_usd_per_hour[pool.name] for pool in stack.spec.pools})


def quota_lines(stack: Stack, time: JobTime) -> list[str]:
    """`plan`'s account of the money quota, the longest job it allows and the default partition (scheduler: slurm)."""
    spent = quota(stack)
    partition, why = default_partition(stack)
    lines = [f"Quota for jobs per month:        {money(spent.usd)} ({spent.why}); Slurm holds new jobs once it is "
             "spent, and starts a job only if its --time fits in what is left. What it buys in each pool, billed at:"]
    rows = [(p.pool, f"{money(p.usd_per_accelerator_hour)}/{p.accelerator}-h", f"{p.accelerator_hours:,.0f} "
             f"{p.accelerator}-hours", f"one whole node for at most {time.longest_hours[p.pool]:,.1f} h",
             p.priced_as) for p in spent.pools]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines += ["  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
              for row in rows]
    lines.append(f"Default partition (sbatch without -p): {partition}, {why}.")
    if not time.default_job_fits:
        lines.append(
            f"WARNING: the quota ({money(spent.usd)}) is less than one whole node of {partition} bills in the "
            f"{time.default_time_hours:g} hours a job without --time asks for ({money(time.default_node_usd)}): Slurm "
            "never starts such a job (it pends with AssocGrpBillingMinutes). Jobs need a --time within the hours "
            "above, or raise the quota (budget.monthly_usd or budget.quota_usd_per_month).")
    return lines
