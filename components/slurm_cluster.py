"""The Slurm flavour of a cluster: node images, node access, a GPU pool per pool of the stack, the head node that
launches the pools' nodes on demand, the team's way in, idle-GPU alarms and the teardown step, on the shared network,
file system and budget (components/shared.py)."""

from __future__ import annotations

import base64
import shlex
from pathlib import Path

import pulumi

from components.budget import LaunchDeny, LaunchDenyArgs
from components.gpu_pool import GpuPool, GpuPoolArgs
from components.head_node import GuardrailWiring, HeadNode, HeadNodeArgs, NodeProgramSettings
from components.image import NodeImage, NodeImageArgs
from components.interruptions import InterruptionEvents, InterruptionEventsArgs
from components.launch_access import SpotLaunchAccess, SpotLaunchAccessArgs, default_ebs_key
from components.monitoring import IdleGpuAlarms, IdleGpuAlarmsArgs
from components.node_access import NodeAccess, NodeAccessArgs
from components.shared import create_shared_parts, shared_outputs
from components.team_access import TeamAccess, TeamAccessArgs
from components.teardown import Teardown, TeardownArgs
from gpucluster.aws import status_remote, verify_remote
from gpucluster.contract.settings import start_session_command
from gpucluster.render import bundle, userdata
from gpucluster.spec import bom, cost
from gpucluster.spec.model import Stack


def create_slurm_cluster(stack: Stack, examples_dir: Path) -> dict[str, object]:
    """Declare every resource of a Slurm stack and return the stack outputs. `examples_dir`: the first-job files the
    head copies to the shared file system."""
    spec = stack.spec
    shared = create_shared_parts(stack)
    opts, account, network, storage, budget = (shared.opts, shared.account_id, shared.network, shared.storage,
                                               shared.budget)
    ebs_key = default_ebs_key(opts)
    # Spot nodes launch through the account's spot service-linked role (made here when the account has none).
    spot = SpotLaunchAccess(stack.cluster_name, SpotLaunchAccessArgs(
        region=stack.region, account_id=account, ebs_key_arn=ebs_key), opts) \
        if any(pool.capacity == "spot" for pool in spec.pools) else None
    # The build instances need the private subnet's route out (NAT) and its SSM endpoints: the whole network first.
    bill_of_materials = bom.render(stack)
    images = {
        build.key: NodeImage(
            f"{stack.cluster_name}-{build.key}",
            NodeImageArgs(cluster_name=stack.cluster_name, build=build, region=stack.region,
                          subnet_id=network.subnet_id, security_group_id=network.security_group_id, tags=stack.tags,
                          bill_of_materials=bill_of_materials,
                          parent=spec.image.parent_images.parent(bom.parent_role(build.accelerator)),
                          account_id=account, ebs_key_arn=ebs_key),
            pulumi.ResourceOptions.merge(opts, pulumi.ResourceOptions(depends_on=[network])),
        )
        for build in spec.image_builds
    }

    def baked(key: str) -> pulumi.Output[str] | None:
        """The id of the image baked under `key`; None where none is (image.build false, or an ami_id given)."""
        return images[key].image_id if key in images else None

    bundle_bytes = bundle.build(stack, examples_dir)
    bundle_key = bundle.key(bundle_bytes)
    access = NodeAccess(
        stack.cluster_name,
        NodeAccessArgs(
            region=stack.region,
            account_id=account,
            bundle=bundle_bytes,
            bundle_key=bundle_key,
            config_parameter=userdata.config_parameter(stack),
            munge_key_parameter=userdata.munge_key_parameter(stack),
        ),
        opts,
    )
    pools = {
        pool.name: GpuPool(
            f"{stack.cluster_name}-{pool.name}",
            GpuPoolArgs(
                cluster_name=stack.cluster_name,
                pool=pool,
                subnet_id=network.subnet_id,
                security_group_id=network.security_group_id,
                instance_tags=stack.tags,
                user_data=base64.b64encode(userdata.pool_nodes(stack, pool).encode()).decode(),
                instance_profile_arn=access.compute_instance_profile_arn,
                image_id=baked(f"compute-{pool.accelerator.kind}"),
                parent=spec.image.parent_images.parent(bom.parent_role(pool.accelerator.kind)), region=stack.region,
            ),
            opts,
        )
        for pool in spec.pools
    }
    # EC2 warns only of spot instances: a stack without spot pools has no use for the rule and its queue.
    events = InterruptionEvents(stack.cluster_name, InterruptionEventsArgs(cluster_name=stack.cluster_name), opts) \
        if any(pool.capacity == "spot" for pool in spec.pools) else None
    act = spec.budget.act_threshold_percent
    guardrail = None if act is None else GuardrailWiring(
        budget_name=budget.budget_name, budget_arn=budget.budget_arn, act_threshold_percent=act,
        queue_url=budget.queue_url, queue_arn=budget.queue_arn,  # type: ignore[arg-type]  # the budget has it: act is set
        topic_arn=budget.topic_arn)
    head = HeadNode(
        stack.cluster_name,
        HeadNodeArgs(
            cluster_name=stack.cluster_name,
            team=spec.team,
            region=stack.region,
            account_id=account,
            availability_zone=spec.availability_zone,
            instance_type=spec.head_node.instance_type,
            subnet_id=network.subnet_id,
            security_group_id=network.security_group_id,
            security_group_rules=network.security_group_rules,
            user_data=userdata.head_node(stack),
            access=access,
            bundle_key=bundle_key,
            config_parameter=userdata.config_parameter(stack),
            munge_key_parameter=userdata.munge_key_parameter(stack),
            pools={name: pool.launch_spec for name, pool in pools.items()},
            launch_template_ids=[pool.launch_template_id for pool in pools.values()],
            image_ids=[pool.image_id for pool in pools.values()],
            fsx_dns_name=storage.dns_name,
            fsx_mount_name=storage.mount_name,
            node_program_settings=NodeProgramSettings.of(spec.slurm),
            alerts_topic_arn=budget.topic_arn,
            interruption_queue_url=events.queue_url if events else None,
            interruption_queue_arn=events.queue_arn if events else None,
            ami_id=spec.head_node.ami_id or baked("head"),
            parent=spec.image.parent_images.head.image,
            guardrail=guardrail,
            ebs_key_arn=ebs_key,
            people=spec.people,
        ),
        # No spot node launches before the account's role (and its key grant) exists.
        pulumi.ResourceOptions.merge(opts, pulumi.ResourceOptions(depends_on=[spot] if spot else [])),
    )
    team = TeamAccess(stack.cluster_name, TeamAccessArgs(cluster_name=stack.cluster_name, region=stack.region,
                                                         account_id=account, head_instance_id=head.instance_id,
                                                         verify_document=verify_remote.command_document(stack, False),
                                                         verify_deep_document=verify_remote.command_document(
                                                             stack, True),
                                                         status_document=status_remote.command_document(stack),
                                                         people=tuple(spec.users or ())), opts)
    deny = None if act is None else LaunchDeny(
        stack.cluster_name, LaunchDenyArgs(budget_name=budget.budget_name, act_threshold_percent=act,
                                           role_name=head.role_name, role_arn=head.role_arn,
                                           topic_arn=budget.topic_arn, account_id=account), opts)
    IdleGpuAlarms(stack.cluster_name, IdleGpuAlarmsArgs(stack=stack, topic_arn=budget.topic_arn), opts)
    kept = [f"{k.what}: {cost.money(k.monthly_usd) + ' per month' if k.monthly_usd is not None else k.note}"
            for k in cost.kept_on_destroy(stack)]
    # Deleted before everything it depends on: the nodes Slurm launched go before the network, the placement
    # groups, the templates and the head; the file system's flush after them (nothing writes any more); the budget
    # and its deny action last of all, so they watch the fleet until it is gone.
    Teardown(stack.cluster_name, TeardownArgs(
        cluster_name=stack.cluster_name, region=stack.region, head_instance_id=head.instance_id,
        munge_key_parameter=userdata.munge_key_parameter(stack),
        cluster_resources=[network, storage, access, *pools.values(), *images.values(), head, budget,
                           *([events] if events else []), *([spot] if spot else []),
                           *([deny] if deny else [])],
        kept=kept), opts)
    return {
        **shared_outputs(stack, shared),
        "pools": {name: pool.launch_spec.as_dict() for name, pool in pools.items()},
        "head_node_instance_id": head.instance_id,
        "head_node_private_ip": head.private_ip,
        "head_node_image": head.image_id,
        # A shell on the head as the login user (no sudo), or with people a map of each person's name to the command
        # that opens a shell as them; and the admins' (ssm-user, sudo): each needs its policy attached.
        "connect": {person: start_session(stack.region, head.instance_id, document)
                    for person, document in team.person_documents.items()} if team.user_document is None
        else start_session(stack.region, head.instance_id, team.user_document),
        "connect_admin": start_session(stack.region, head.instance_id, team.admin_document),
        # Grafana through a Session Manager port forward (either policy): `gpucluster dashboard STACK`.
        "connect_dashboard": team.dashboard_document,
        "user_access_policy_arn": team.user_policy_arn,
        "admin_access_policy_arn": team.admin_policy_arn,
        "kept_on_destroy": kept,
    }


def start_session(region: str, instance_id: pulumi.Input[str], document: pulumi.Input[str]) -> pulumi.Output[str]:
    """The AWS CLI command that opens a Session Manager shell on the head with `document`, as `gpucluster connect`
    runs it."""
    return pulumi.Output.all(instance_id=instance_id, document=document).apply(
        lambda known: shlex.join(start_session_command(region, **known)))
