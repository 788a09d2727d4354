"""Cost arithmetic, checked by hand against the catalog's reference prices."""

from __future__ import annotations

import pytest

from conftest import FIXTURES, ROOT
from gpucluster.spec import cost
from gpucluster.spec.model import load_stack


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


def test_gpu_hour_quota_derived_from_budget_and_prices() -> None:
    stack = load_stack(ROOT / "stacks" / "Pulumi.team-a.yaml")  # $250,000; p5.48xlarge $55.04/h for 8 GPUs
    assert cost.gpu_hour_quota(stack) == int(250000 / (55.04 / 8))
    explicit = stack.spec.model_copy(
        update={"budget": stack.spec.budget.model_copy(update={"gpu_hours_per_month": 5000})})
    assert cost.gpu_hour_quota(type(stack)(stack.name, stack.region, explicit)) == 5000


def test_gpu_hour_quota_weights_pools_by_their_gpus() -> None:
    stack = load_stack(ROOT / "stacks" / "Pulumi.team-b.yaml")  # p4d x4 (8 GPUs), g6e.12xlarge x4 (4 GPUs); trn1 none
    gpus = 4 * 8 + 4 * 4
    dollars = 4 * 21.96 + 4 * 10.49264
    assert cost.gpu_hour_quota(stack) == int(40000 / (dollars / gpus))


def test_image_costs_follow_what_is_baked() -> None:
    stack = load_stack(ROOT / "stacks" / "Pulumi.team-b.yaml")  # head + Trainium + NVIDIA pools
    est = cost.estimate(stack)
    assert [i.key for i in est.images] == ["head", "compute-neuron", "compute-nvidia"]
    assert est.image_build_usd == pytest.approx(3 * 0.2016)
    assert est.image_snapshots_monthly == pytest.approx(0.05 * (20 + 120 + 120))  # $13.00
    assert est.summary()["image_build_usd"] == 0.6 and est.summary()["image_snapshots_monthly_usd"] == 13.0
    stock = stack.spec.model_copy(update={"image": stack.spec.image.model_copy(update={"build": False})})
    unbaked = cost.estimate(type(stack)(stack.name, stack.region, stock))
    assert unbaked.images == [] and unbaked.image_build_usd == 0
    assert est.hourly_min - unbaked.hourly_min == pytest.approx(13.0 / 730)  # snapshots are a monthly fixed cost
