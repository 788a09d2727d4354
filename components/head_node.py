"""The Slurm head node: slurmctld, slurmdbd with MariaDB and munge, configured by cloud-init and the S3 bundle,
with its least-privilege IAM role, its state volume, its fixed network interface, and the SSM parameter that tells
every node what `pulumi up` learned (bucket, file system, head address, pools).

The head node can be replaced (a new user data or image): its address lives on its own network interface and
its Slurm state and accounting on their own volume, so compute nodes and running jobs keep their head.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import pulumi
import pulumi_aws as aws

from components import child
from components.gpu_pool import LaunchSpec
from components.iam import EC2_ASSUME, PARAMETER_READ, SSM_AGENT, policy
from components.image import parent_ami
from components.node_access import NodeAccess
from gpucluster.contract.settings import CLUSTER_TAG, ClusterSettings, PersonSettings, head_instance_name
from gpucluster.spec import bom
from gpucluster.spec.account import CALLER_KEY_ACTIONS
from gpucluster.spec.cost import HEAD_ROOT_GIB, HEAD_STATE_GIB
from gpucluster.spec.model import SlurmSpec

STATE_DEVICE = "/dev/sdf"


@dataclass(frozen=True)
class HeadNodeArgs:
    cluster_name: str
    team: str
    region: str
    account_id: pulumi.Input[str]  # components.iam.account_id
    availability_zone: str
    instance_type: str
    subnet_id: pulumi.Input[str]
    security_group_id: pulumi.Input[str]
    user_data: str  # rendered cloud-config (gpucluster.render.userdata.head_node)
    access: NodeAccess
    bundle_key: str
    config_parameter: str
    munge_key_parameter: str
    # Pool name -> GpuPool.launch_spec, published to every node through the config parameter.
    pools: dict[str, LaunchSpec]
    # The stack's topic: Alertmanager (GpuIdle, XID errors and the rest), the interruptions service and the budget
    # guardrail tell the team there.
    alerts_topic_arn: pulumi.Input[str]
    launch_template_ids: list[pulumi.Input[str]]
    image_ids: list[pulumi.Input[str]]  # the AMIs of those templates: the only images the head may launch
    fsx_dns_name: pulumi.Input[str]
    fsx_mount_name: pulumi.Input[str]
    node_program_settings: NodeProgramSettings
    # The head's image: the stack's ami_id or baked head image; None: the stack's head parent (an exact Ubuntu
    # release, looked up by name) as it is, the software installed at first boot.
    ami_id: pulumi.Input[str] | None = None
    parent: bom.ParentImage = bom.PARENT_IMAGES["head"]
    # The group's rules (Network.security_group_rules): the head's boot mounts /fsx and reaches S3 and SSM through them.
    security_group_rules: Sequence[pulumi.Resource] = ()
    guardrail: GuardrailWiring | None = None  # None: the budget only alerts
    # The stack's people (ClusterSpec.people), published to every node; none: the shared login user.
    people: tuple[PersonSettings, ...] = ()
    interruption_queue_url: pulumi.Input[str] | None = None  # EC2's spot warnings (InterruptionEvents); None: no spot
    interruption_queue_arn: pulumi.Input[str] | None = None
    # The account's default EBS key when it is customer managed (components.launch_access.default_ebs_key), else None.
    ebs_key_arn: str | None = None


@dataclass(frozen=True)
class NodeProgramSettings:
    """The stack's settings the node programs read as they are: ClusterSettings fields of the same names."""

    all_or_nothing: bool
    capacity_retry_seconds: int
    checkpoint_grace_seconds: int
    drain_on_rebalance: bool

    @classmethod
    def of(cls, slurm: SlurmSpec) -> NodeProgramSettings:
        return cls(all_or_nothing=slurm.all_or_nothing, capacity_retry_seconds=slurm.capacity_retry_seconds,
                   checkpoint_grace_seconds=slurm.checkpoint_grace_seconds, drain_on_rebalance=slurm.drain_on_rebalance)


@dataclass(frozen=True)
class GuardrailWiring:
    """What the head node's budget guardrail reads and may touch (outputs of the Budget component)."""

    budget_name: pulumi.Input[str]
    budget_arn: pulumi.Input[str]
    act_threshold_percent: int
    queue_url: pulumi.Input[str]
    queue_arn: pulumi.Input[str]
    topic_arn: pulumi.Input[str]


class HeadNode(pulumi.ComponentResource):
    instance_id: pulumi.Output[str]
    image_id: pulumi.Output[str]  # the AMI the head runs
    private_ip: pulumi.Output[str]
    role_name: pulumi.Output[str]
    role_arn: pulumi.Output[str]

    def __init__(self, name: str, args: HeadNodeArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpucluster:head:HeadNode", name, None, opts)
        access = args.access
        pools = {pool: spec.as_dict() for pool, spec in args.pools.items()}
        head_role = aws.iam.Role(f"{name}-head", assume_role_policy=EC2_ASSUME, opts=child(self))
        aws.iam.RolePolicy(f"{name}-head", role=head_role.id, policy=pulumi.Output.all(
            account=args.account_id, config_arn=access.config_parameter_arn, munge_arn=access.munge_key_parameter_arn,
            bundle_arn=access.bundle_arn, compute_role_arn=access.compute_role_arn,
            template_ids=args.launch_template_ids, image_ids=args.image_ids, subnet_id=args.subnet_id,
            security_group_id=args.security_group_id, pools=pools, topic_arn=args.alerts_topic_arn).apply(
                lambda v: policy(head_statements(args, **v))),
            opts=child(self))
        if args.interruption_queue_arn is not None:
            aws.iam.RolePolicy(f"{name}-head-interruptions", role=head_role.id,
                               policy=pulumi.Output.from_input(args.interruption_queue_arn).apply(
                                   lambda arn: policy(interruption_statements(arn))), opts=child(self))
        guard = args.guardrail
        if guard is not None:
            aws.iam.RolePolicy(f"{name}-head-guardrail", role=head_role.id, policy=pulumi.Output.all(
                queue_arn=guard.queue_arn, budget_arn=guard.budget_arn).apply(
                lambda v: policy(guardrail_statements(**v))), opts=child(self))
        self.role_name, self.role_arn = head_role.name, head_role.arn
        head_profile = aws.iam.InstanceProfile(f"{name}-head", role=head_role.name, opts=child(self))

        # The head's address: an interface of its own that outlives every instance it is attached to (attached at
        # launch, EC2 does not delete it on termination), so nodes and jobs keep reaching slurmctld after a replacement.
        interface = aws.ec2.NetworkInterface(
            f"{name}-head-address", subnet_id=args.subnet_id, security_groups=[args.security_group_id],
            description=f"gpucluster {args.cluster_name}: the head node's fixed address",
            tags={"Name": f"{args.cluster_name}-head"}, opts=child(self))
        # Slurm state and the accounting database live on their own volume: a replaced head node keeps the queue.
        # Nothing of the instance is among its inputs, so replacing the instance never replaces the volume.
        state = aws.ebs.Volume(f"{name}-state", availability_zone=args.availability_zone, size=HEAD_STATE_GIB,
                               type="gp3", encrypted=True, tags={"Name": f"{args.cluster_name}-state"},
                               opts=child(self))
        image = (pulumi.Output.from_input(args.ami_id) if args.ami_id is not None else
                 parent_ami(args.parent, args.region, pulumi.InvokeOutputOptions(parent=self)))
        instance = aws.ec2.Instance(
            f"{name}-head",
            ami=image,
            instance_type=args.instance_type,
            # Device 0 is the fixed interface; subnet, security group and "no public IP" are the interface's
            # (EC2 refuses them beside an existing interface).
            primary_network_interface={"network_interface_id": interface.id},
            iam_instance_profile=head_profile.name,
            metadata_options={"http_endpoint": "enabled", "http_tokens": "required", "http_put_response_hop_limit": 1,
                              "http_protocol_ipv6": "disabled"},  # the lockdown guards IPv4 metadata
            root_block_device={"volume_size": HEAD_ROOT_GIB, "volume_type": "gp3", "encrypted": True},
            user_data=args.user_data,
            user_data_replace_on_change=True,
            tags={"Name": head_instance_name(args.cluster_name)},
            # Delete before replace: two slurmctld must never run at once, and the interface and the state volume
            # attach to one instance at a time. Every image the head can take is an exact one (never "the newest"):
            # a new one (a rebake from a changed BOM, another parent or ami_id) replaces the head at that `up`, as
            # `pulumi preview` shows, rather than leaving it on the old image unsaid.
            opts=child(self, delete_before_replace=True, depends_on=list(args.security_group_rules)),
        )
        # Stop the instance before detaching: slurmctld and MariaDB shut down cleanly and the volume is unmounted.
        aws.ec2.VolumeAttachment(f"{name}-state", device_name=STATE_DEVICE, volume_id=state.id,
                                 instance_id=instance.id, stop_instance_before_detaching=True,
                                 opts=child(self, delete_before_replace=True))
        self.instance_id, self.image_id = instance.id, instance.ami
        # A failed host (EC2's system status check): EC2 recovers the instance onto new hardware with the same id,
        # interface, address and EBS volumes, so slurmctld comes back by its boot unit with the queue and accounting
        # of its state volume. Compute nodes and their jobs go on meanwhile (SlurmdTimeout: 3 minutes).
        aws.cloudwatch.MetricAlarm(
            f"{name}-head-recover",
            alarm_description=f"gpucluster {args.cluster_name}: recover the head node when its host fails",
            namespace="AWS/EC2", metric_name="StatusCheckFailed_System", dimensions={"InstanceId": instance.id},
            statistic="Maximum", period=60, evaluation_periods=2, threshold=1,
            comparison_operator="GreaterThanOrEqualToThreshold",
            alarm_actions=[f"arn:aws:automate:{args.region}:ec2:recover", args.alerts_topic_arn],
            opts=child(self))
        self.private_ip = interface.private_ip

        budget = None if guard is None else {
            "budget_name": guard.budget_name, "account_id": args.account_id, "queue_url": guard.queue_url,
            "topic_arn": guard.topic_arn, "act_threshold_percent": guard.act_threshold_percent}
        settings = pulumi.Output.all(
            bundle_bucket=access.bucket, head_address=interface.private_ip, state_volume_id=state.id,
            fsx_dns_name=args.fsx_dns_name, fsx_mount_name=args.fsx_mount_name, pools=pools,
            budget=budget, alerts_topic_arn=args.alerts_topic_arn,
            interruption_queue_url=args.interruption_queue_url or "").apply(lambda v: settings_document(args, v))
        # insecure_value: these settings are not secret (pulumi-aws would otherwise encrypt them in state and hide
        # them).
        aws.ssm.Parameter(f"{name}-config", name=args.config_parameter, type="String", insecure_value=settings,
                          description=f"gpucluster {args.cluster_name}: what every node needs to know",
                          opts=child(self))
        self.register_outputs({"instance_id": self.instance_id, "private_ip": self.private_ip,
                               "role_arn": self.role_arn, "image_id": self.image_id})


def settings_document(args: HeadNodeArgs, learned: dict[str, Any]) -> str:
    """The settings parameter's JSON, built through the one contract: a key the contract does not know, or a
    missing one, fails `pulumi up` here instead of a node at boot."""
    pools = {name: {**spec, "launch_template_version": str(spec["launch_template_version"])}  # the contract's type
             for name, spec in learned["pools"].items()}
    return ClusterSettings.from_dict({
        "cluster": args.cluster_name, "team": args.team, "region": args.region, "bundle_key": args.bundle_key,
        "munge_key_parameter": args.munge_key_parameter, **asdict(args.node_program_settings), **learned,
        "pools": pools, "people": [asdict(person) for person in args.people],
    }).to_json()


def head_statements(args: HeadNodeArgs, account: str, config_arn: str, munge_arn: str, bundle_arn: str,
                    compute_role_arn: str, template_ids: list[str], image_ids: list[str], subnet_id: str,
                    security_group_id: str, pools: dict[str, dict[str, Any]],
                    topic_arn: str) -> list[dict[str, object]]:
    """Launch only from this cluster's templates, images, subnet, security group, placement groups and reservations,
    and only instances tagged with this cluster (ParallelCluster's explicit-resource form: every resource a
    CreateFleet/RunInstances call touches is named); terminate only this cluster's instances, pass only the
    compute role, create and read only this cluster's parameters. Only root and the slurm user on the head get these
    credentials (gpucluster.contract.lockdown): a login user gets none, so cannot launch outside Slurm, terminate nodes
    or reverse the budget's action."""
    region = args.region
    ec2 = f"arn:aws:ec2:{region}:{account}"
    templates = [f"{ec2}:launch-template/{t}" for t in template_ids]
    groups = sorted({f"{ec2}:placement-group/{p['placement_group']}" for p in pools.values() if p["placement_group"]})
    reservations = sorted({f"{ec2}:capacity-reservation/{p['capacity_reservation_id']}"
                           for p in pools.values() if p["capacity_reservation_id"]})
    created = [f"{ec2}:{kind}/*" for kind in ("fleet", "network-interface", "volume")]
    return [
        # The resume program's CreateFleet tags every instance with the cluster (TagSpecifications, the same tags as
        # the pool's template): no other. Karpenter's published controller policy holds CreateFleet's instances to
        # its request tags the same way; the template's own resource is held to none (a fleet's launch does not show
        # it the request's tags).
        {"Sid": "LaunchClusterInstancesOnly", "Effect": "Allow", "Action": ["ec2:RunInstances", "ec2:CreateFleet"],
         "Resource": f"{ec2}:instance/*",
         "Condition": {"StringEquals": {f"aws:RequestTag/{CLUSTER_TAG}": args.cluster_name}}},
        # Every other resource a launch touches, named: the pools' templates, the subnet, the security group, the
        # images, placement groups and reservations of this cluster; the fleet, interfaces and volumes it creates.
        {"Sid": "LaunchFromClusterResourcesOnly", "Effect": "Allow", "Action": ["ec2:RunInstances", "ec2:CreateFleet"],
         "Resource": [*templates, f"{ec2}:subnet/{subnet_id}", f"{ec2}:security-group/{security_group_id}",
                      *sorted({f"arn:aws:ec2:{region}::image/{i}" for i in image_ids}), *groups, *reservations,
                      *created]},
        # Tags only as part of a launch (the templates' TagSpecifications): no retagging an existing instance into
        # the cluster, which would let the terminate statement below reach it.
        {"Sid": "TagAtLaunch", "Effect": "Allow", "Action": "ec2:CreateTags",
         "Resource": [f"{ec2}:instance/*", *created],
         "Condition": {"StringEquals": {"ec2:CreateAction": ["RunInstances", "CreateFleet"]}}},
        # Suspend, resume-fail and the reconciler end nodes: only instances tagged with this cluster.
        {"Sid": "TerminateClusterInstancesOnly", "Effect": "Allow",
         "Action": "ec2:TerminateInstances", "Resource": f"{ec2}:instance/*",
         "Condition": {"StringEquals": {f"aws:ResourceTag/{CLUSTER_TAG}": args.cluster_name}}},
        # Resume and the reconciler read instance states; these Describe actions take no resource but "*".
        {"Sid": "Describe", "Effect": "Allow", "Action": ["ec2:DescribeInstances", "ec2:DescribeInstanceStatus",
                                                        "ec2:DescribeLaunchTemplates",
                                                        "ec2:DescribeLaunchTemplateVersions"],
         "Resource": "*"},
        # An UnauthorizedOperation from a launch carries an encoded message: this reads which statement refused.
        {"Sid": "DecodeLaunchErrors", "Effect": "Allow", "Action": "sts:DecodeAuthorizationMessage", "Resource": "*"},
        # The nodes it launches get the compute role, which holds less than this one; to EC2 only.
        {"Sid": "PassComputeRoleOnly", "Effect": "Allow", "Action": "iam:PassRole", "Resource": compute_role_arn,
         "Condition": {"StringEquals": {"iam:PassedToService": "ec2.amazonaws.com"}}},
        # The boot and the update timer read the cluster's settings and its munge key: this cluster's two only.
        {"Sid": "ClusterParameters", "Effect": "Allow", "Action": PARAMETER_READ,
         "Resource": [config_arn, munge_arn]},
        # The first head creates the key (fetch_bundle.py, Overwrite=False); the parameter is this cluster's.
        {"Sid": "CreateMungeKeyOnce", "Effect": "Allow", "Action": "ssm:PutParameter", "Resource": munge_arn,
         "Condition": {"StringEquals": {"ssm:Overwrite": "false"}}},
        # The Slurm files and node programs: this stack's bundle object only.
        {"Sid": "Bundle", "Effect": "Allow", "Action": "s3:GetObject", "Resource": bundle_arn},
        # Alertmanager (GpuIdle, GPU XID errors, ...), the interruptions service and the budget guardrail tell the
        # team: the stack's topic only, whatever pools and budget the stack has.
        {"Sid": "TellTheTeam", "Effect": "Allow", "Action": "sns:Publish", "Resource": topic_arn},
        # `gpucluster verify`'s budget_topic check asks whether the head reaches that topic (GetTopicAttributes):
        # reading its attributes only.
        {"Sid": "VerifyTheTeamTopic", "Effect": "Allow", "Action": "sns:GetTopicAttributes", "Resource": topic_arn},
        SSM_AGENT,
        *([] if args.ebs_key_arn is None else ebs_key_statements(args.ebs_key_arn, region)),
    ]


def ebs_key_statements(key_arn: str, region: str) -> list[dict[str, object]]:
    """A customer managed default EBS key: the head's on-demand and capacity-block launches (an instant fleet launches
    as its caller) have EC2 encrypt the nodes' volumes with it. Through EC2 only, as AWS's own aws/ebs key policy
    allows, and grants only for AWS resources (the volumes)."""
    through_ec2 = {"kms:ViaService": f"ec2.{region}.amazonaws.com"}
    return [
        {"Sid": "UseDefaultEbsKey", "Effect": "Allow", "Action": list(CALLER_KEY_ACTIONS), "Resource": key_arn,
         "Condition": {"StringEquals": through_ec2}},
        {"Sid": "GrantDefaultEbsKeyToVolumes", "Effect": "Allow", "Action": "kms:CreateGrant", "Resource": key_arn,
         "Condition": {"StringEquals": through_ec2, "Bool": {"kms:GrantIsForAWSResource": "true"}}},
    ]


def interruption_statements(queue_arn: str) -> list[dict[str, object]]:
    """The interruptions service (as the slurm user): EC2's warnings from its own queue (it tells the team of each
    drain and requeue through the head's TellTheTeam statement)."""
    return [
        {"Sid": "InterruptionQueue", "Effect": "Allow", "Action": ["sqs:ReceiveMessage", "sqs:DeleteMessage",
                                                                  "sqs:GetQueueAttributes"], "Resource": queue_arn},
    ]


def guardrail_statements(queue_arn: str, budget_arn: str) -> list[dict[str, object]]:
    """Read the budget and its queue, reverse this budget's actions: nothing else (it tells the subscribers through
    the head's TellTheTeam statement). The guardrail runs as root; the slurm user's programs share the role but not
    this need."""
    return [
        # Budget notifications arrive through the stack's own queue (SNS -> SQS).
        {"Sid": "BudgetQueue", "Effect": "Allow", "Action": ["sqs:ReceiveMessage", "sqs:DeleteMessage",
                                                            "sqs:GetQueueAttributes"], "Resource": queue_arn},
        # The spend it compares with the act threshold, and whether the backstop action has fired: this budget only.
        {"Sid": "ReadBudget", "Effect": "Allow",
         "Action": ["budgets:ViewBudget", "budgets:DescribeBudgetActionsForBudget"],
         "Resource": budget_arn},
        # `gpucluster-budget reopen` (by an admin: sudo) lifts the deny policy the backstop attached: this budget's
        # actions only. A login user cannot: the head's credentials are root's and slurm's
        # (gpucluster.contract.lockdown).
        {"Sid": "ReverseBudgetActions", "Effect": "Allow", "Action": "budgets:ExecuteBudgetAction",
         "Resource": f"{budget_arn}/action/*"},
    ]
