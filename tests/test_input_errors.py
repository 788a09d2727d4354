"""Inputs the renderers and components cannot work with stop them with a message that says what is wrong and what is
allowed: a pool type without accelerators, a network without a range or an existing VPC, an existing file system
without the names it is mounted by, an EKS control plane without its second subnet."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pulumi
import pytest
from pulumi.runtime import settings
from pulumi.runtime.stack import run_pulumi_func
from pulumi.runtime.sync_await import _sync_await

from components.gpu_pool import GpuPool, GpuPoolArgs
from components.kubernetes import EksCluster, EksClusterArgs, NodeGroupPlace, NodePool, NodePoolArgs
from components.network import Network, NetworkArgs
from components.storage import Storage, StorageArgs
from conftest import ROOT
from gpucluster.aws import preflight
from gpucluster.render import kube, monitoring
from gpucluster.spec import catalog
from gpucluster.spec.model import CONFIG_KEY, LustreSpec, PoolSpec, Stack, load_stack, stack_config, validate

NO_ACCELERATOR = r"pool g6-spot: m7i\.large has no accelerator; a pool takes one of: g5\.xlarge, .*p5\.48xlarge"


@pytest.fixture
def headless(monkeypatch: pytest.MonkeyPatch) -> tuple[Stack, PoolSpec]:
    """The dev stack with its pool on a type without accelerators, as if the catalog offered one for pools."""
    monkeypatch.setitem(catalog.ACCELERATED, "m7i.large", catalog.HEAD_NODE["m7i.large"])
    config = stack_config(load_stack(ROOT / "stacks" / "Pulumi.dev.yaml"))
    config[CONFIG_KEY]["pools"][0]["instance_type"] = "m7i.large"
    stack = validate("dev", config)
    return stack, stack.spec.pools[0]


@pytest.mark.parametrize("use", [
    lambda stack, pool: preflight.ami_parameter(stack, pool),
    lambda stack, pool: monitoring.utilisation_metric(pool),
    lambda stack, pool: monitoring.node_config(stack, pool),
    lambda stack, pool: kube.accelerator_resource(pool),
    lambda stack, pool: kube.pool_labels(stack, pool),
    lambda stack, pool: kube.pool_resources(pool),
], ids=["ami_parameter", "utilisation_metric", "node_config", "accelerator_resource", "pool_labels", "pool_resources"])
def test_a_pool_type_without_accelerators_is_refused_where_it_is_read(
        headless: tuple[Stack, PoolSpec], use: Callable[[Stack, PoolSpec], object]) -> None:
    stack, pool = headless
    with pytest.raises(ValueError, match=NO_ACCELERATOR):
        use(stack, pool)


class _Echo(pulumi.runtime.Mocks):
    def new_resource(self, args: pulumi.runtime.MockResourceArgs) -> tuple[str, dict[str, Any]]:
        return f"{args.name}-id", args.inputs

    def call(self, args: pulumi.runtime.MockCallArgs) -> tuple[dict[str, Any], list[tuple[str, str]] | None]:
        return {}, []


def declare_alone(declare: Callable[[], Any]) -> None:
    """Run `declare` as a Pulumi program of its own under the mock runtime."""
    settings.set_root_resource(None)  # type: ignore[arg-type]  # a fresh stack, as gpucluster.plan.run_program does
    pulumi.runtime.set_mocks(_Echo(), project="gpucluster", stack="alone", preview=False)
    _sync_await(run_pulumi_func(declare))


@pytest.mark.parametrize("component", [
    lambda stack, pool: GpuPool("p", GpuPoolArgs(cluster_name=stack.cluster_name, pool=pool, subnet_id="subnet-1",
                                                 security_group_id="sg-1", instance_tags=stack.tags)),
    lambda stack, pool: NodePool("p", NodePoolArgs(stack=stack, pool=pool, place=NodeGroupPlace(
        cluster_name="c", node_role_arn="r", subnet_id="subnet-1", security_group_ids=["sg-1"], version="1"))),
], ids=["GpuPool", "NodePool"])
def test_a_pool_component_refuses_a_type_without_accelerators(
        headless: tuple[Stack, PoolSpec], component: Callable[[Stack, PoolSpec], object]) -> None:
    stack, pool = headless
    with pytest.raises(ValueError, match=NO_ACCELERATOR):
        declare_alone(lambda: component(stack, pool))


def test_network_needs_a_range_or_an_existing_vpc_and_subnet() -> None:
    declare_alone(lambda: Network("n", NetworkArgs(region="us-east-1", availability_zone="us-east-1a",
                                                   vpc_id="vpc-1", subnet_id="subnet-1")))
    with pytest.raises(ValueError, match=r"a network needs vpc_cidr \(a new VPC\) or both vpc_id and subnet_id .*"
                                         r"got vpc_id='vpc-1', subnet_id=None"):
        declare_alone(lambda: Network("n", NetworkArgs(region="us-east-1", availability_zone="us-east-1a",
                                                       vpc_id="vpc-1")))


def test_an_existing_file_system_needs_its_dns_and_mount_names() -> None:
    def storage(lustre: LustreSpec) -> Callable[[], object]:
        return lambda: Storage("s", StorageArgs(lustre=lustre, region="us-east-1", subnet_id="subnet-1",
                                                security_group_id="sg-1"))

    named = LustreSpec.model_construct(file_system_id="fs-0123456789abcdef0", dns_name="d", mount_name="m")
    declare_alone(storage(named))
    with pytest.raises(ValueError, match=r"the existing file system fs-0123456789abcdef0 is mounted by its dns_name "
                                         r"and mount_name: give both \(got 'd', None\)"):
        declare_alone(storage(named.model_copy(update={"mount_name": None})))


def test_the_control_plane_needs_a_second_subnet_or_a_range_for_one() -> None:
    stack = load_stack(ROOT / "stacks" / "Pulumi.team-k8s.yaml")
    args = EksClusterArgs(stack=stack, vpc_id="vpc-1", subnet_id="subnet-1", control_plane_subnet_id=None,
                          control_plane_cidr=None, security_group_id="sg-1", account_id="123456789012")
    with pytest.raises(ValueError, match=r"the EKS control plane needs a second subnet: control_plane_subnet_id .* "
                                         r"or control_plane_cidr"):
        declare_alone(lambda: EksCluster("c", args))
