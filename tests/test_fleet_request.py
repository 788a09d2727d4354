"""The CreateFleet requests the resume program sends, per scenario, reviewed like code (ParallelCluster keeps its
expected launch parameters the same way). Regenerate with GPUCLUSTER_UPDATE_GOLDEN=1 and read the diff."""

from __future__ import annotations

import json
import os
from typing import Any

import botocore.session
import pytest
from botocore.model import Shape
from botocore.validate import ParamValidator

from conftest import ROOT
from gpucluster.contract.settings import ClusterSettings, PoolSettings
from gpucluster.node.fleet import fleet_request

GOLDEN = ROOT / "tests" / "golden" / "fleet"
TEMPLATE, SUBNET = "lt-0123456789abcdef0", "subnet-0123456789abcdef0"

# scenario -> (pool, all_or_nothing); four p5 nodes each, pools as the GpuPool component exports them.
SCENARIOS: dict[str, tuple[PoolSettings, bool]] = {
    "on-demand": (PoolSettings("p5-od", TEMPLATE, SUBNET, "p5.48xlarge", "on-demand",
                                    placement_group="team-a-p5-od-pg"), False),
    "spot": (PoolSettings("p5-spot", TEMPLATE, SUBNET, "p5.48xlarge", "spot",
                               placement_group="team-a-p5-spot-pg"), False),
    "capacity-block": (PoolSettings("p5en-cb", TEMPLATE, SUBNET, "p5en.48xlarge", "capacity-block",
                                         capacity_reservation_id="cr-0a1b2c3d4e5f60718",
                                         placement_group="team-a-p5en-cb-pg"), False),
    "all-or-nothing": (PoolSettings("p5-spot", TEMPLATE, SUBNET, "p5.48xlarge", "spot",
                                         placement_group="team-a-p5-spot-pg"), True),
}


def request(scenario: str) -> dict[str, Any]:
    pool, all_or_nothing = SCENARIOS[scenario]
    config = ClusterSettings(cluster="team-a", region="us-east-1", pools={pool.name: pool})
    return fleet_request(config, pool, 4, all_or_nothing)


def ec2_input() -> Shape:
    return botocore.session.get_session().get_service_model("ec2").operation_model("CreateFleet").input_shape


def enum_errors(value: Any, shape: Shape, where: str = "") -> list[str]:
    """botocore's validator checks types and required keys, not enum values: this does."""
    if shape.type_name == "structure":
        return [e for k, v in value.items() for e in enum_errors(v, shape.members[k], f"{where}.{k}")]
    if shape.type_name == "list":
        return [e for i, v in enumerate(value) for e in enum_errors(v, shape.member, f"{where}[{i}]")]
    if getattr(shape, "enum", None) and value not in shape.enum:  # only string shapes have enums
        return [f"{where}: {value!r} not in {shape.enum}"]
    return []


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_golden_fleet_request(scenario: str) -> None:
    path = GOLDEN / f"{scenario}.json"
    sent = request(scenario)
    if os.environ.get("GPUCLUSTER_UPDATE_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(sent, indent=2) + "\n")
    assert sent == json.loads(path.read_text()), f"{scenario} differs from {path.relative_to(ROOT)}"


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_fleet_request_matches_the_ec2_model(scenario: str) -> None:
    sent, shape = request(scenario), ec2_input()
    report = ParamValidator().validate(sent, shape)
    assert not report.has_errors(), report.generate_report()
    assert not enum_errors(sent, shape)


def test_capacity_block_fleet_names_the_block_market_and_nothing_a_block_refuses() -> None:
    sent = request("capacity-block")
    assert sent["TargetCapacitySpecification"]["DefaultTargetCapacityType"] == "capacity-block"
    assert "OnDemandOptions" not in sent and "SpotOptions" not in sent
    pool, _ = SCENARIOS["capacity-block"]
    aon = fleet_request(ClusterSettings("team-a", "us-east-1", {pool.name: pool}), pool, 4, True)
    assert aon["OnDemandOptions"] == {"MinTargetCapacity": 4, "SingleInstanceType": True,
                                      "SingleAvailabilityZone": True}
