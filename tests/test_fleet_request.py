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

from conftest import ROOT, STACK_FILES, of_type, planned
from gpucluster.contract.settings import LAUNCH_TAGGED, ClusterSettings, PoolSettings
from gpucluster.node.fleet import fleet_request

GOLDEN = ROOT / "tests" / "golden" / "fleet"
TEMPLATE, SUBNET = "lt-0123456789abcdef0", "subnet-0123456789abcdef0"
CLUSTER = "gpucluster-team-a"


def pool_tags(pool: str) -> dict[str, str]:
    """What the team-a stack's launch template of `pool` tags (the stack's tags and the pool's)."""
    return {"gpucluster:cluster": CLUSTER, "gpucluster:team": "vision", "gpucluster:stack": "team-a",
            "gpucluster:pool": pool}


# scenario -> (pool, all_or_nothing); four p5 nodes each, pools as the GpuPool component exports them.
SCENARIOS: dict[str, tuple[PoolSettings, bool]] = {
    "on-demand": (PoolSettings("p5-od", TEMPLATE, SUBNET, "p5.48xlarge", "on-demand",
                               placement_group="team-a-p5-od-pg", tags=pool_tags("p5-od")), False),
    "spot": (PoolSettings("p5-spot", TEMPLATE, SUBNET, "p5.48xlarge", "spot",
                          placement_group="team-a-p5-spot-pg", tags=pool_tags("p5-spot")), False),
    "capacity-block": (PoolSettings("p5en-cb", TEMPLATE, SUBNET, "p5en.48xlarge", "capacity-block",
                                    capacity_reservation_id="cr-0a1b2c3d4e5f60718",
                                    placement_group="team-a-p5en-cb-pg", tags=pool_tags("p5en-cb")), False),
    "all-or-nothing": (PoolSettings("p5-spot", TEMPLATE, SUBNET, "p5.48xlarge", "spot",
                                    placement_group="team-a-p5-spot-pg", tags=pool_tags("p5-spot")), True),
}


def request(scenario: str) -> dict[str, Any]:
    pool, all_or_nothing = SCENARIOS[scenario]
    config = ClusterSettings(cluster=CLUSTER, region="us-east-1", pools={pool.name: pool})
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
    aon = fleet_request(ClusterSettings(CLUSTER, "us-east-1", {pool.name: pool}), pool, 4, True)
    assert aon["OnDemandOptions"] == {"MinTargetCapacity": 4, "SingleInstanceType": True,
                                      "SingleAvailabilityZone": True}


def _tags(tag_list: list[dict[str, str]]) -> dict[str, str]:
    return {t["Key"]: t["Value"] for t in tag_list}


@pytest.mark.parametrize("path", STACK_FILES, ids=lambda p: p.name)
def test_each_pool_request_tags_what_its_launch_template_tags(path: Any) -> None:
    """Whether or not EC2 adds a template's tags to an instant fleet's, the instances, volumes and interfaces of a
    node carry the same tags: the request built from the published settings names every tag of the pool's template
    (the cluster and pool tags the reconciler finds nodes by among them)."""
    stack, declared = planned(path)
    (parameter,) = [d for d in of_type(declared, "ssm/parameter:Parameter") if d.name.endswith("-config")]
    config = ClusterSettings.from_json(parameter.inputs["insecureValue"])
    templates = {lt.name.removeprefix(f"{stack.cluster_name}-").removesuffix("-lt"): lt
                 for lt in of_type(declared, "ec2/launchTemplate:LaunchTemplate")}
    assert set(templates) == set(config.pools)
    for name, pool in config.pools.items():
        template_tags = {spec["resourceType"]: spec["tags"] for spec in templates[name].inputs["tagSpecifications"]}
        sent = {spec["ResourceType"]: _tags(spec["Tags"])
                for spec in fleet_request(config, pool, 2, False)["TagSpecifications"]}
        assert sent == template_tags and set(sent) == set(LAUNCH_TAGGED), name
        assert sent["instance"]["gpucluster:cluster"] == stack.cluster_name
        assert sent["instance"]["gpucluster:pool"] == name
        assert sent["instance"]["gpucluster:stack"] == stack.name


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_golden_requests_carry_the_pool_and_stack_tags(scenario: str) -> None:
    pool, _ = SCENARIOS[scenario]
    golden = json.loads((GOLDEN / f"{scenario}.json").read_text())
    for spec in golden["TagSpecifications"]:
        assert _tags(spec["Tags"]) == pool_tags(pool.name), (scenario, spec["ResourceType"])
