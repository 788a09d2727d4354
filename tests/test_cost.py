"""Cost arithmetic, checked by hand against the catalog's reference prices."""

from __future__ import annotations

import pytest

from conftest import FIXTURES, ROOT
from gpucluster.render import slurm
from gpucluster.spec import catalog, cost
from gpucluster.spec.model import PoolSpec, SpecError, Stack, load_stack, stack_config, validate


def test_dev_stack_by_hand() -> None:
    est = cost.estimate(load_stack(ROOT / "stacks" / "Pulumi.dev.yaml"))
    (pool,) = est.pools
    assert (pool.usd_per_node_hour, pool.min_nodes, pool.max_nodes) == (0.8048, 0, 2)
    assert pool.priced_as == "on-demand (spot upper bound)"
    assert est.lustre_monthly == pytest.approx(0.140 * 1200)  # SCRATCH_2, 1200 GiB
    # m7i.large + root (100) and state (200) gp3
    assert est.head_node_monthly == pytest.approx(0.1008 * 730 + 0.08 * 300)
    assert est.network_monthly == pytest.approx((0.045 + 3 * 0.01) * 730)  # NAT + three SSM endpoints
    # Two baked images (head, compute-nvidia): an hour of m7i.xlarge each per build, and their snapshots at the
    # standard rate for 20 GiB (head) and 120 GiB (compute) roots.
    assert [(i.key, i.root_gib) for i in est.images] == [("head", 20), ("compute-nvidia", 120)]
    assert est.image_build_usd == pytest.approx(2 * 0.2016 * 1.0)
    assert est.image_snapshots_monthly == pytest.approx(0.05 * 20 + 0.05 * 120)  # $7.00
    fixed = (0.140 * 1200 + 0.1008 * 730 + 0.08 * 300 + (0.045 + 0.03) * 730 + 7.0) / 730
    assert est.hourly_min == pytest.approx(fixed)
    assert est.hourly_max == pytest.approx(fixed + 2 * 0.8048)
    assert est.monthly_at_max == pytest.approx((fixed + 2 * 0.8048) * 730)
    assert est.over_budget  # $500 does not cover a month at full size
    assert est.hours_at_max_within_budget == pytest.approx(500 / (fixed + 2 * 0.8048))


def test_team_a_persistent_lustre_and_on_demand_pool() -> None:
    est = cost.estimate(load_stack(ROOT / "stacks" / "Pulumi.team-a.yaml"))
    assert est.lustre_monthly == pytest.approx(0.210 * 4800)  # PERSISTENT_2 at 250 MB/s/TiB
    od = next(p for p in est.pools if p.name == "p5-od")
    assert od.priced_as == "on-demand" and od.hourly_max == pytest.approx(4 * 55.04)


def test_live_prices_override_the_reference() -> None:
    stack = load_stack(ROOT / "stacks" / "Pulumi.team-a.yaml")
    est = cost.estimate(stack, hourly_overrides={"p5-spot": 30.0})
    spot = next(p for p in est.pools if p.name == "p5-spot")
    assert spot.priced_as == "live spot" and spot.hourly_max == pytest.approx(8 * 30.0)
    assert est.hourly_max == pytest.approx(cost.estimate(stack).hourly_max - 8 * (55.04 - 30.0))


def test_existing_network_and_fsx_cost_nothing_here_and_unpriced_types_are_named() -> None:
    est = cost.estimate(load_stack(FIXTURES / "Pulumi.existing.yaml"))
    assert est.network_monthly == 0 and est.lustre_monthly == 0
    assert est.unpriced == []  # p5en and p6-b200 both carry a reference price
    summary = est.summary()
    assert set(summary) >= {"hourly_usd_min", "hourly_usd_max", "monthly_usd_at_max", "budget_monthly_usd"}


def test_budget_that_covers_full_size_is_not_flagged() -> None:
    stack = load_stack(ROOT / "stacks" / "Pulumi.team-a.yaml")
    full_month = cost.estimate(stack).monthly_at_max
    generous = stack.spec.model_copy(
        update={"budget": stack.spec.budget.model_copy(update={"monthly_usd": full_month + 1})})
    est = cost.estimate(type(stack)(stack.name, stack.region, generous))
    assert not est.over_budget and est.hours_at_max_within_budget > 730


def mixed_stack(**budget: object) -> Stack:
    """Issue 27's example: 4 x p5.48xlarge and 4 x g6.12xlarge against a $20,000 budget. The GPU-hour quota this
    replaced gave it 4,024 GPU-hours (the pools' mean price): $27.7k at p5 rates."""
    config = stack_config(load_stack(ROOT / "stacks" / "Pulumi.team-a.yaml"))
    spec = config["gpucluster:cluster"]
    spec["pools"] = [{"name": "p5", "instance_type": "p5.48xlarge", "max_nodes": 4},
                     {"name": "g6", "instance_type": "g6.12xlarge", "max_nodes": 4}]
    spec["budget"] = {**spec["budget"], "monthly_usd": 20000, **budget}
    return validate("mixed", config)


def whole_node_cents_per_hour(weights: dict[str, float], pool: PoolSpec) -> float:
    """What Slurm bills for a job holding the whole node for an hour (PriorityFlags=MAX_TRES: its largest weighted
    TRES)."""
    gpu = "gpu" if pool.accelerator.kind == "nvidia" else "neuron"
    held = {"CPU": pool.itype.vcpus, "Mem": slurm.real_memory(pool), f"GRES/{gpu}": pool.accelerator.count}
    return max(weights[tres] * count for tres, count in held.items())


def test_the_money_quota_of_a_mixed_stack_cannot_overshoot_its_budget() -> None:
    stack = mixed_stack()
    quota = cost.quota(stack)
    fixed = cost.estimate(stack).fixed_hourly * cost.HOURS_PER_MONTH
    assert quota.usd == pytest.approx(20000 - fixed)
    # What Slurm enforces (GrpTRESMins=billing, cent-minutes), spent in full in any one pool, buys node-hours that
    # cost no more than the quota: with the fixed costs, within the budget.
    for pool in stack.spec.pools:
        (members,) = [m for name, m in slurm.partitions(stack).items() if name == pool.name]
        node_hour_cents = whole_node_cents_per_hour(slurm.billing_weights(members), pool)
        price = pool.itype.on_demand_usd_per_hour
        assert price is not None and node_hour_cents >= price * 100  # never bills less than it costs
        node_hours = quota.billing_minutes / 60 / node_hour_cents
        assert node_hours * price + fixed <= 20000
    by_pool = {p.pool: p for p in quota.pools}
    p5 = by_pool["p5"]
    assert p5.usd_per_accelerator_hour == pytest.approx(55.04 / 8)
    assert p5.accelerator_hours * 55.04 / 8 == pytest.approx(quota.usd)
    assert by_pool["g6"].accelerator_hours > p5.accelerator_hours  # the same money buys more of the cheaper GPU


def test_a_job_bills_its_largest_share_of_a_node() -> None:
    """One GPU with the node's memory is the whole node to everyone else: it bills the whole node, not 1/8 of it."""
    stack = mixed_stack()
    (pool,) = [p for p in stack.spec.pools if p.name == "p5"]
    weights = slurm.billing_weights([pool])
    one_gpu = weights["GRES/gpu"] * 1
    one_gpu_all_memory = max(one_gpu, weights["Mem"] * slurm.real_memory(pool))
    assert one_gpu == pytest.approx(55.04 * 100 / 8)
    assert one_gpu_all_memory == pytest.approx(55.04 * 100)


def test_the_quota_given_in_the_stack_file_and_its_bound() -> None:
    assert cost.quota(mixed_stack(quota_usd_per_month=5000)).usd == 5000
    with pytest.raises(SpecError) as caught:
        mixed_stack(quota_usd_per_month=20001)
    assert [path for path, _ in caught.value.problems] == ["gpucluster:cluster.budget.quota_usd_per_month"]


def test_an_unpriced_type_bills_at_the_catalogs_highest_accelerator_hour() -> None:
    config = stack_config(mixed_stack())
    config["gpucluster:cluster"]["pools"][0]["instance_type"] = "p5e.48xlarge"  # no reference price
    stack = validate("mixed", config)
    per_hour = {p.pool: p for p in cost.quota(stack).pools}["p5"]
    assert per_hour.usd_per_accelerator_hour == max(
        t.on_demand_usd_per_hour / t.accelerator.count for t in catalog.ACCELERATED.values()
        if t.on_demand_usd_per_hour and t.accelerator)
    assert per_hour.priced_as.startswith("no price")


def test_default_partition_is_the_cheapest_gpu_pool_unless_named() -> None:
    assert cost.default_partition(mixed_stack())[0] == "g6"
    team_b = load_stack(ROOT / "stacks" / "Pulumi.team-b.yaml")  # Trainium is cheapest, but no CUDA runs there
    assert cost.default_partition(team_b)[0] == "g6e"
    config = stack_config(mixed_stack())
    config["gpucluster:cluster"]["slurm"] = {"default_partition": "p5"}
    assert cost.default_partition(validate("mixed", config)) == ("p5", "slurm.default_partition")
    assert "PartitionName=p5 Nodes=p5-[1-4] Default=YES" in slurm.slurm_conf(validate("mixed", config))
    config["gpucluster:cluster"]["slurm"] = {"default_partition": "p4"}
    with pytest.raises(SpecError) as caught:
        validate("mixed", config)
    assert caught.value.problems == [("gpucluster:cluster.slurm.default_partition", "must name a pool: ['p5', 'g6']")]


def test_image_costs_follow_what_is_baked() -> None:
    stack = load_stack(ROOT / "stacks" / "Pulumi.team-b.yaml")  # head + Trainium + NVIDIA pools
    est = cost.estimate(stack)
    assert [i.key for i in est.images] == ["head", "compute-neuron", "compute-nvidia"]
    assert est.image_build_usd == pytest.approx(3 * 0.2016)
    assert est.image_snapshots_monthly == pytest.approx(0.05 * (20 + 120 + 120))  # $13.00
    fixed = est.summary()["fixed_monthly_usd"]
    assert est.summary()["image_build_usd"] == 0.6 and isinstance(fixed, dict) and fixed["image_snapshots"] == 13.0
    stock = stack.spec.model_copy(update={"image": stack.spec.image.model_copy(update={"build": False})})
    unbaked = cost.estimate(type(stack)(stack.name, stack.region, stock))
    assert unbaked.images == [] and unbaked.image_build_usd == 0
    assert est.hourly_min - unbaked.hourly_min == pytest.approx(13.0 / 730)  # snapshots are a monthly fixed cost


def test_a_budget_within_the_fixed_costs_leaves_no_quota_and_is_refused() -> None:
    """A budget at the cluster's fixed costs would make the quota (the budget less them) $0: GrpTRESMins=billing=0,
    and Slurm would hold every job from the first day. Refused, naming the key and the fixed costs; a quota of $0
    given outright too. A dollar more of budget is a quota."""
    config = stack_config(load_stack(ROOT / "stacks" / "Pulumi.dev.yaml"))
    fixed = cost.estimate(validate("dev", config)).fixed_hourly * cost.HOURS_PER_MONTH
    budget = config["gpucluster:cluster"]["budget"]
    budget["monthly_usd"] = fixed
    with pytest.raises(SpecError) as caught:
        validate("dev", config)
    ((path, message),) = caught.value.problems
    assert path == "gpucluster:cluster.budget.monthly_usd" and cost.money(fixed) in message, message
    budget["monthly_usd"] = fixed + 1
    assert cost.quota(validate("dev", config)).billing_minutes > 0
    budget["quota_usd_per_month"] = 0
    with pytest.raises(SpecError) as caught:
        validate("dev", config)
    ((path, message),) = caught.value.problems
    assert path == "gpucluster:cluster.budget.quota_usd_per_month" and cost.money(fixed) in message, message


def test_the_longest_whole_node_job_and_the_default_time_against_the_quota() -> None:
    """Slurm (AccountingStorageEnforce=safe) starts a job only if its time limit at its billing fits in what is left
    of the quota: the longest whole-node job of each pool is the quota over what a whole node bills an hour, and
    `plan` warns when a whole node of the default partition for DefaultTime (`sbatch` without --time) does not fit."""
    stack = mixed_stack()
    default = cost.default_partition(stack)[0]
    node_usd = {name: whole_node_cents_per_hour(slurm.billing_weights(members), members[0]) / 100
                for name, members in slurm.partitions(stack).items()}
    assert slurm.whole_node_usd_per_hour(stack) == pytest.approx(node_usd)
    default_job = node_usd[default] * slurm.DEFAULT_TIME_HOURS
    short = mixed_stack(quota_usd_per_month=default_job / 2)
    time = slurm.job_time(short)
    assert time.longest_hours == pytest.approx({p: default_job / 2 / usd for p, usd in node_usd.items()})
    assert time.longest_hours[default] == pytest.approx(slurm.DEFAULT_TIME_HOURS / 2)
    assert not time.default_job_fits
    (warning,) = [line for line in cost.quota_lines(short, time) if line.startswith("WARNING")]
    assert f"({cost.money(default_job)})" in warning and "--time" in warning
    for pool, hours in time.longest_hours.items():
        assert any(line.split()[0] == pool and f"at most {hours:,.1f} h" in line
                   for line in cost.quota_lines(short, time)), pool
    enough = mixed_stack(quota_usd_per_month=default_job * 1.01)
    assert slurm.job_time(enough).default_job_fits
    assert not any(line.startswith("WARNING") for line in cost.quota_lines(enough, slurm.job_time(enough)))
