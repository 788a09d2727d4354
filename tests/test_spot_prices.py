"""Spot pools show a typical price beside their on-demand ceiling, and old reference prices are flagged."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
from datetime import date, timedelta

import pytest

from conftest import ROOT
from gpucluster import cli
from gpucluster.spec import catalog, cost
from gpucluster.spec.model import Stack, load_stack


def dev() -> Stack:
    return load_stack(ROOT / "stacks" / "Pulumi.dev.yaml")


def with_pool(stack: Stack, region: str, instance_type: str) -> Stack:
    pool = stack.spec.pools[0].model_copy(update={"instance_type": instance_type})
    return dataclasses.replace(stack, region=region, spec=stack.spec.model_copy(update={"pools": [pool]}))


def test_the_advisor_table_speaks_of_catalog_types_and_regions() -> None:
    assert set(catalog.SPOT_ADVISOR) <= set(catalog.ACCELERATED)
    for regions in catalog.SPOT_ADVISOR.values():
        assert set(regions) <= catalog.AWS_REGIONS
        for savings, band in regions.values():
            assert 0 < savings < 100 and 0 <= band < len(catalog.INTERRUPTION_BANDS)


@pytest.mark.parametrize("region", ["us-east-1", "us-west-2"])
def test_a_spot_pool_is_typically_its_ceiling_less_the_regions_savings(region: str) -> None:
    stack = with_pool(dev(), region, "g6.xlarge")
    (pool,) = cost.estimate(stack).pools
    savings, band = catalog.SPOT_ADVISOR["g6.xlarge"][region]
    ceiling = catalog.ACCELERATED["g6.xlarge"].on_demand_usd_per_hour
    typical = pool.typical_usd_per_node_hour
    assert ceiling is not None and typical is not None
    assert pool.usd_per_node_hour == ceiling  # the totals stay at the ceiling
    assert typical == pytest.approx(ceiling * (1 - savings / 100))
    assert pool.spot is not None and pool.spot.interruptions == catalog.INTERRUPTION_BANDS[band]
    assert pool.typical_hourly_max == pytest.approx(typical * pool.max_nodes)


def test_a_type_without_published_savings_gets_no_typical_price_and_the_plan_says_so() -> None:
    unpublished = next(t for t, it in catalog.ACCELERATED.items()
                       if t not in catalog.SPOT_ADVISOR and it.on_demand_usd_per_hour)
    stack = with_pool(dev(), "us-east-1", unpublished)
    estimate = cost.estimate(stack)
    (pool,) = estimate.pools
    assert pool.spot is None and pool.typical_usd_per_node_hour is None
    assert estimate.typical_hourly_max == pytest.approx(estimate.hourly_max)
    lines = cli.spot_lines(stack, estimate)
    assert lines == [f"Spot pool {pool.name}: the Spot Instance Advisor published no savings for {unpublished} in "
                     "us-east-1: priced at the on-demand ceiling only."]


def test_live_and_on_demand_prices_carry_no_typical_figure() -> None:
    stack = load_stack(ROOT / "stacks" / "Pulumi.team-a.yaml")
    estimate = cost.estimate(stack, hourly_overrides={"p5-spot": 30.0})
    assert all(p.spot is None for p in estimate.pools)
    assert all(p.spot is None for p in cost.estimate(stack).pools if p.capacity != "spot")


def test_plan_text_and_json_show_the_typical_price_beside_the_ceiling() -> None:
    stack = dev()
    (pool,) = cost.estimate(stack).pools
    typical = pool.typical_usd_per_node_hour
    assert typical is not None
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        assert cli.main(["plan", "dev"]) == 0
    assert f"Spot pool {pool.name}: typically {cost.money(typical)}/node-h" in text.getvalue()
    doc = io.StringIO()
    with contextlib.redirect_stdout(doc):
        assert cli.main(["plan", "dev", "--json"]) == 0
    (row,) = json.loads(doc.getvalue())["cost"]["pools"]
    assert row["usd_per_node_hour"] == pool.usd_per_node_hour
    assert row["typical_spot"]["usd_per_node_hour"] == round(typical, 4)
    assert row["typical_spot"]["recorded"] == catalog.SPOT_DATE


def six_months_after(recorded: str) -> date:
    day = date.fromisoformat(recorded)
    year, month = divmod(day.month - 1 + cost.STALE_AFTER_MONTHS, 12)
    return date(day.year + year, month + 1, day.day)


def test_prices_are_fresh_for_six_months_then_flagged_with_their_age() -> None:
    first, last = sorted([catalog.PRICE_DATE, catalog.SPOT_DATE])
    assert cost.stale_price_warning(six_months_after(first)) is None
    warning = cost.stale_price_warning(six_months_after(first) + timedelta(days=1))
    assert warning is not None and f"recorded {first} ({cost.STALE_AFTER_MONTHS} months ago)" in warning
    assert f"recorded {last}" not in warning or first == last
    both = cost.stale_price_warning(six_months_after(last) + timedelta(days=400))
    assert both is not None and f"recorded {first}" in both and f"recorded {last}" in both
    assert "`preflight STACK`" in both


@pytest.mark.parametrize("recorded", ["2025-01-30", "2025-08-31", "2024-08-29"])
def test_prices_recorded_late_in_a_month_are_not_flagged_early_and_say_their_age(
        recorded: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Recorded on a day some months lack (the 29th to the 31st): never flagged on or before the same day six months
    on, flagged for good after, and the age the warning gives is then never under STALE_AFTER_MONTHS."""
    monkeypatch.setattr(catalog, "PRICE_DATE", recorded)
    monkeypatch.setattr(catalog, "SPOT_DATE", recorded)
    day = date.fromisoformat(recorded)
    flagged = []
    for offset in range(150, 220):
        today = day + timedelta(days=offset)
        warning = cost.stale_price_warning(today)
        if warning is not None:
            age = int(warning.split(f"recorded {recorded} (")[1].split(" months ago")[0])
            assert age >= cost.STALE_AFTER_MONTHS, warning
            flagged.append(today)
        else:
            assert not flagged, f"fresh again on {today} after being flagged on {flagged[0]}"
    assert flagged
    try:
        same_day = six_months_after(recorded)
    except ValueError:  # no such day six months on (31 August -> 31 February)
        return
    assert flagged[0] == same_day + timedelta(days=1)


def test_the_cost_table_warns_on_the_day_given() -> None:
    stack = dev()
    estimate = cost.estimate(stack)
    fresh = date.fromisoformat(catalog.PRICE_DATE)
    assert not any(line.startswith("WARNING: the reference prices") for line in cli.cost_table(stack, estimate, fresh))
    late = six_months_after(max(catalog.PRICE_DATE, catalog.SPOT_DATE)) + timedelta(days=1)
    assert f"WARNING: {cost.stale_price_warning(late)}." in cli.cost_table(stack, estimate, late)
