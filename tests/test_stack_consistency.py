"""Sections of one stack agree on its region, and the stacks of one directory and region keep their VPCs apart."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel

from gpucluster.spec import model
from gpucluster.spec.model import ZONE_KEYS, ClusterSpec, SpecError, validate


def zone_fields(cls: type[BaseModel], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """The paths of every field named *availability_zone in the spec's models, however deep."""
    found = []
    for name, info in cls.model_fields.items():
        if name.endswith("availability_zone"):
            found.append((*prefix, name))
        for arg in (info.annotation, *getattr(info.annotation, "__args__", ())):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                found += zone_fields(arg, (*prefix, name))
    return found


def test_every_zone_key_of_the_spec_is_checked_against_the_region() -> None:
    assert sorted(zone_fields(ClusterSpec)) == sorted(ZONE_KEYS)


def kubernetes_stack(region: str, zone: str, control_plane_zone: str) -> dict[str, Any]:
    return {model.REGION_KEY: region, model.CONFIG_KEY: {
        "team": "vision", "availability_zone": zone, "scheduler": "kubernetes",
        "kubernetes": {"public_access_cidrs": ["operator"], "control_plane_availability_zone": control_plane_zone},
        "network": {"vpc_cidr": "10.42.0.0/16"},
        "pools": [{"name": "gpu", "instance_type": "g6.xlarge", "max_nodes": 1}],
        "storage": {"lustre": {"deployment_type": "SCRATCH_2", "storage_capacity_gib": 1200}},
        "budget": {"monthly_usd": 1000, "notify_emails": ["a@example.com"]}}}


@pytest.mark.parametrize(("zone", "control_plane_zone", "wrong"), [
    ("eu-west-1a", "us-east-1b", ["availability_zone"]),
    ("us-east-1a", "eu-west-1b", ["kubernetes.control_plane_availability_zone"]),
    ("eu-west-1a", "eu-west-1b", ["availability_zone", "kubernetes.control_plane_availability_zone"]),
])
def test_each_zone_in_another_region_is_named(zone: str, control_plane_zone: str, wrong: list[str]) -> None:
    with pytest.raises(SpecError) as err:
        validate("vision", kubernetes_stack("us-east-1", zone, control_plane_zone))
    named = [path.removeprefix(f"{model.CONFIG_KEY}.") for path, message in err.value.problems
             if "is not in region us-east-1" in message]
    assert named == wrong


def test_zones_of_the_region_pass() -> None:
    assert validate("vision", kubernetes_stack("us-east-1", "us-east-1a", "us-east-1b")).region == "us-east-1"
