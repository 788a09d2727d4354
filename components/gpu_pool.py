"""A GPU (or Trainium) node pool: the launch template a node is started from, and its cluster placement group.

The pool launches nothing itself. The Slurm head node's resume program starts nodes on demand with EC2 CreateFleet
from this template, so the pool exports what that call needs: template id, subnet, market, placement group and counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import pulumi
import pulumi_aws as aws

from components import child
from gpucluster.contract import settings
from gpucluster.spec import bom, catalog
from gpucluster.spec.model import PoolSpec

ROOT_DEVICE = "/dev/sda1"  # Ubuntu-based DLAMIs


@dataclass(frozen=True)
class GpuPoolArgs:
    cluster_name: str
    pool: PoolSpec
    subnet_id: pulumi.Input[str]
    security_group_id: pulumi.Input[str]
    # Tags EC2 puts on each launched instance, volume and interface (provider default tags do not reach them).
    instance_tags: dict[str, str]
    instance_profile_arn: pulumi.Input[str] | None = None
    user_data: pulumi.Input[str] | None = None  # base64, as EC2 takes it
    # The node image baked for the pool's accelerator kind (components/image.py); the pool's own ami_id wins.
    image_id: pulumi.Input[str] | None = None
    # Without either (image.build false): the pinned parent release of the pool's kind, looked up in the region.
    parent: bom.ParentImage | None = None
    region: str | None = None


def network_interfaces(
        pool: PoolSpec, subnet_id: pulumi.Input[str] | None,
        security_group_ids: Sequence[pulumi.Input[str]]) -> list[aws.ec2.LaunchTemplateNetworkInterfaceArgsDict]:
    """The pool's interfaces: one per network card with EFA. `subnet_id` None leaves the subnet to the launcher (EKS
    managed node groups reject a template whose interfaces name one)."""
    return [
        {
            "network_card_index": nic.network_card_index,
            "device_index": nic.device_index,
            "interface_type": nic.interface_type,
            "subnet_id": subnet_id,
            "security_groups": list(security_group_ids),
            "delete_on_termination": "true",
            "associate_public_ip_address": "false" if nic.interface_type != "efa-only" and subnet_id else None,
        }
        for nic in catalog.interface_layout(pool.itype, pool.uses_efa)
    ]


def placement_group(name: str, pool: PoolSpec, opts: pulumi.ResourceOptions) -> pulumi.Output[str] | None:
    """A cluster placement group for an EFA pool (nodes close together on the network); None without EFA."""
    if not pool.uses_efa:
        return None
    return aws.ec2.PlacementGroup(f"{name}-pg", strategy="cluster", opts=opts).name


def launch_template(name: str, pool: PoolSpec, *, description: str, subnet_id: pulumi.Input[str] | None,
                    security_group_ids: Sequence[pulumi.Input[str]], group_name: pulumi.Input[str] | None,
                    node_tags: dict[str, str], root_device: str, opts: pulumi.ResourceOptions,
                    image_id: pulumi.Input[str] | None = None, instance_profile_arn: pulumi.Input[str] | None = None,
                    user_data: pulumi.Input[str] | None = None,
                    tags_in_metadata: bool = False) -> aws.ec2.LaunchTemplate:
    """A pool's launch template, the same for both schedulers: EFA layout, placement group, IMDSv2 with one hop,
    encrypted gp3 root, capacity-block targeting and tags on what EC2 launches. `tags_in_metadata`: the instance's
    tags in its metadata, where a Slurm node's first boot reads its pool tag (no AWS call, no permission). EC2 then
    refuses to launch an instance with a tag key that has '/' or a space (EKS puts such keys on its nodes: off there);
    gpucluster's keys have neither (settings.POOL_TAG and the others, tested)."""
    # Typed one by one: the resource's overloads of unions are too many for mypy to match literals against.
    metadata_options: aws.ec2.LaunchTemplateMetadataOptionsArgsDict = {
        "http_endpoint": "enabled",
        "http_tokens": "required",  # IMDSv2 only
        # One hop: enroot/pyxis containers share the host network namespace; Kubernetes pods, in their own, get
        # AWS credentials from EKS Pod Identity only and must not borrow the node's role.
        "http_put_response_hop_limit": 1,
        # The node's lockdown guards IPv4 metadata; the IPv6 endpoint stays off.
        "http_protocol_ipv6": "disabled",
    }
    if tags_in_metadata:
        metadata_options["instance_metadata_tags"] = "enabled"
    block_device_mappings: list[aws.ec2.LaunchTemplateBlockDeviceMappingArgsDict] = [
        {
            "device_name": root_device,
            "ebs": {
                "volume_size": pool.root_volume_gib,
                "volume_type": "gp3",
                "encrypted": "true",
                "delete_on_termination": "true",
            },
        }
    ]
    # Capacity blocks are reservations: the node must target its block, and EC2 launches into a block only
    # with the capacity-block market type on the template. Spot/on-demand is chosen by the launcher
    # (CreateFleet's market, a node group's capacity type).
    capacity_reservation: aws.ec2.LaunchTemplateCapacityReservationSpecificationArgsDict | None = (
        {"capacity_reservation_target": {"capacity_reservation_id": pool.capacity_reservation_id}}
        if pool.capacity == "capacity-block"
        else None
    )
    market: aws.ec2.LaunchTemplateInstanceMarketOptionsArgsDict | None = (
        {"market_type": "capacity-block"} if pool.capacity == "capacity-block" else None)
    placement: aws.ec2.LaunchTemplatePlacementArgsDict | None = {"group_name": group_name} if group_name else None
    profile: aws.ec2.LaunchTemplateIamInstanceProfileArgsDict | None = (
        {"arn": instance_profile_arn} if instance_profile_arn else None)
    tag_specifications: list[aws.ec2.LaunchTemplateTagSpecificationArgsDict] = [
        {"resource_type": kind, "tags": node_tags} for kind in settings.LAUNCH_TAGGED
    ]
    return aws.ec2.LaunchTemplate(
        f"{name}-lt",
        description=description,
        image_id=image_id,
        instance_type=pool.instance_type,
        network_interfaces=network_interfaces(pool, subnet_id, security_group_ids),
        placement=placement,
        metadata_options=metadata_options,
        block_device_mappings=block_device_mappings,
        capacity_reservation_specification=capacity_reservation,
        instance_market_options=market,
        iam_instance_profile=profile,
        user_data=user_data,
        tag_specifications=tag_specifications,
        update_default_version=True,
        opts=opts,
    )


@dataclass(frozen=True)
class LaunchSpec:
    """What the resume program needs to launch the pool's nodes: the settings contract's PoolSettings (the pool's name
    aside), with what `pulumi up` learns still as outputs."""

    launch_template_id: pulumi.Output[str]
    launch_template_version: pulumi.Output[int]
    subnet_id: pulumi.Input[str]
    instance_type: str
    market: str
    capacity_reservation_id: str | None
    placement_group: pulumi.Output[str] | None
    min_nodes: int
    max_nodes: int
    efa_interfaces: int
    accelerator: str
    accelerators: int
    node_hour_usd: float
    tags: dict[str, str]  # what the template tags its instances with: the resume program's CreateFleet sends them too

    def as_dict(self) -> dict[str, object]:
        """The fields by name, for Pulumi to resolve (`Output.all`, component and stack outputs)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}  # asdict would deep-copy the outputs


class GpuPool(pulumi.ComponentResource):
    launch_template_id: pulumi.Output[str]
    launch_template_version: pulumi.Output[int]
    placement_group: pulumi.Output[str] | None
    image_id: pulumi.Output[str]
    launch_spec: LaunchSpec

    def __init__(self, name: str, args: GpuPoolArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpucluster:pool:GpuPool", name, None, opts)
        pool = args.pool
        accelerator = pool.accelerator

        image_id = pool.ami_id or args.image_id
        if image_id is not None:
            self.image_id = pulumi.Output.from_input(image_id)
        else:
            # No baked image (image.build false): the bill of materials' parent release, the exact DLAMI a bake would
            # start from (never the newest one); nodes install their software at first boot from the bundle's BOM.
            if args.parent is None or args.region is None:
                raise ValueError(f"pool {pool.name}: no image (ami_id, a baked image, or a parent and its region)")
            from components.image import parent_ami  # here: components.image imports this module

            self.image_id = parent_ami(args.parent, args.region, pulumi.InvokeOutputOptions(parent=self))

        self.placement_group = placement_group(name, pool, child(self))
        node_tags = {**args.instance_tags, settings.POOL_TAG: pool.name}
        template = launch_template(
            name, pool, description=f"{args.cluster_name} pool {pool.name}: {pool.instance_type}",
            subnet_id=args.subnet_id, security_group_ids=[args.security_group_id], group_name=self.placement_group,
            node_tags=node_tags, root_device=ROOT_DEVICE,
            opts=child(self), image_id=self.image_id, instance_profile_arn=args.instance_profile_arn,
            user_data=args.user_data, tags_in_metadata=True)
        self.launch_template_id = template.id
        self.launch_template_version = template.latest_version
        self.launch_spec = LaunchSpec(
            launch_template_id=self.launch_template_id,
            launch_template_version=self.launch_template_version,
            subnet_id=args.subnet_id,
            instance_type=pool.instance_type,
            market=pool.capacity,
            capacity_reservation_id=pool.capacity_reservation_id,
            placement_group=self.placement_group,
            min_nodes=pool.min_nodes,
            max_nodes=pool.max_nodes,
            efa_interfaces=pool.itype.efa_interfaces if pool.uses_efa else 0,
            accelerator=accelerator.kind,
            accelerators=accelerator.count,
            node_hour_usd=pool.itype.on_demand_usd_per_hour or 0.0,
            tags=node_tags,
        )
        self.register_outputs(self.launch_spec.as_dict())
