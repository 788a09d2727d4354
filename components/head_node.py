"""The Slurm head node: slurmctld, slurmdbd with MariaDB and munge, configured by cloud-init and the S3 bundle,
with its least-privilege IAM role, its state volume, and the SSM parameter that tells every node what `pulumi up`
learned (bucket, file system, head address, pools).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from components import child
from components.node_access import EC2_ASSUME, SSM_CORE, NodeAccess, policy
from gpucluster.cost import HEAD_ROOT_GIB, HEAD_STATE_GIB

UBUNTU_AMI_PARAMETER = "/aws/service/canonical/ubuntu/server/24.04/stable/current/amd64/hvm/ebs-gp3/ami-id"
STATE_DEVICE = "/dev/sdf"


@dataclass(frozen=True)
class HeadNodeArgs:
    cluster_name: str
    team: str
    region: str
    availability_zone: str
    instance_type: str
    subnet_id: pulumi.Input[str]
    security_group_id: pulumi.Input[str]
    user_data: str  # rendered cloud-config (gpucluster.userdata.head_node)
    access: NodeAccess
    bundle_key: str
    config_parameter: str
    munge_key_parameter: str
    # Pool name -> launch spec (outputs of each GpuPool), published to every node through the config parameter.
    pools: dict[str, dict[str, object]]
    launch_template_ids: list[pulumi.Input[str]]
    fsx_dns_name: pulumi.Input[str]
    fsx_mount_name: pulumi.Input[str]
    # Settings the node programs read as they are (gpucluster_node.Config): all_or_nothing, capacity_retry_seconds.
    node_program_settings: dict[str, object]
    ami_id: str | None = None
    guardrail: GuardrailWiring | None = None  # None: the budget only alerts


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
    private_ip: pulumi.Output[str]
    role_name: pulumi.Output[str]
    role_arn: pulumi.Output[str]

    def __init__(self, name: str, args: HeadNodeArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpucluster:head:HeadNode", name, None, opts)
        account = aws.get_caller_identity_output(opts=pulumi.InvokeOutputOptions(parent=self)).account_id
        access = args.access
        head_role = aws.iam.Role(f"{name}-head", assume_role_policy=EC2_ASSUME, opts=child(self))
        aws.iam.RolePolicyAttachment(f"{name}-head-ssm", role=head_role.name, policy_arn=SSM_CORE, opts=child(self))
        template_ids = pulumi.Output.all(*args.launch_template_ids).apply(lambda ids: ids)
        aws.iam.RolePolicy(f"{name}-head", role=head_role.id, policy=pulumi.Output.all(
            account, access.config_parameter_arn, access.munge_key_parameter_arn, access.bundle_arn,
            access.compute_role_arn, template_ids).apply(
            lambda a: policy(head_statements(args, a[0], a[1], a[2], a[3], a[4], a[5]))), opts=child(self))
        guard = args.guardrail
        if guard is not None:
            aws.iam.RolePolicy(f"{name}-head-guardrail", role=head_role.id, policy=pulumi.Output.all(
                guard.queue_arn, guard.topic_arn, guard.budget_arn).apply(
                lambda a: policy(guardrail_statements(a[0], a[1], a[2]))), opts=child(self))
        self.role_name, self.role_arn = head_role.name, head_role.arn
        head_profile = aws.iam.InstanceProfile(f"{name}-head", role=head_role.name, opts=child(self))

        # Slurm state and the accounting database live on their own volume: a replaced head node keeps the queue.
        state = aws.ebs.Volume(f"{name}-state", availability_zone=args.availability_zone, size=HEAD_STATE_GIB,
                               type="gp3", encrypted=True, tags={"Name": f"{args.cluster_name}-state"},
                               opts=child(self))
        image = (pulumi.Output.from_input(args.ami_id) if args.ami_id else aws.ssm.get_parameter_output(
            name=UBUNTU_AMI_PARAMETER, opts=pulumi.InvokeOutputOptions(parent=self)).value)
        instance = aws.ec2.Instance(
            f"{name}-head",
            ami=image,
            instance_type=args.instance_type,
            subnet_id=args.subnet_id,
            vpc_security_group_ids=[args.security_group_id],
            iam_instance_profile=head_profile.name,
            associate_public_ip_address=False,
            metadata_options={"http_endpoint": "enabled", "http_tokens": "required", "http_put_response_hop_limit": 1},
            root_block_device={"volume_size": HEAD_ROOT_GIB, "volume_type": "gp3", "encrypted": True},
            user_data=args.user_data,
            user_data_replace_on_change=True,
            tags={"Name": f"{args.cluster_name}-head"},
            opts=child(self, ignore_changes=["ami"]),  # a newer Ubuntu image must not replace a running head node
        )
        aws.ec2.VolumeAttachment(f"{name}-state", device_name=STATE_DEVICE, volume_id=state.id,
                                 instance_id=instance.id, opts=child(self))
        self.instance_id = instance.id
        self.private_ip = instance.private_ip

        budget = (pulumi.Output.all(guard.budget_name, account, guard.queue_url, guard.topic_arn).apply(lambda a: {
            "budget": {"budget_name": a[0], "account_id": a[1], "queue_url": a[2], "topic_arn": a[3],
                       "act_threshold_percent": guard.act_threshold_percent}}) if guard else {})
        settings = pulumi.Output.all(access.bucket, instance.private_ip, state.id, args.fsx_dns_name,
                                     args.fsx_mount_name, args.pools, budget).apply(lambda a: json.dumps({
                                         "cluster": args.cluster_name, "team": args.team, "region": args.region,
                                         "bundle_bucket": a[0], "bundle_key": args.bundle_key, "head_address": a[1],
                                         "state_volume_id": a[2], "fsx_dns_name": a[3], "fsx_mount_name": a[4],
                                         "munge_key_parameter": args.munge_key_parameter, "pools": a[5],
                                         "log_file": "/var/log/gpucluster/nodes.log", **args.node_program_settings,
                                         **a[6]},
                                        sort_keys=True))
        # insecure_value: these settings are not secret (pulumi-aws would otherwise encrypt them in state and hide them).
        aws.ssm.Parameter(f"{name}-config", name=args.config_parameter, type="String", insecure_value=settings,
                          description=f"gpucluster {args.cluster_name}: what every node needs to know",
                          opts=child(self))
        self.register_outputs({"instance_id": self.instance_id, "private_ip": self.private_ip,
                               "role_arn": self.role_arn})


def head_statements(args: HeadNodeArgs, account: str, config_arn: str, munge_arn: str, bundle_arn: str,
                    compute_role_arn: str, template_ids: list[str]) -> list[dict[str, object]]:
    """Launch only from this cluster's templates, tag and terminate only this cluster's instances, pass only the
    compute role, create and read only this cluster's parameters."""
    region = args.region
    cluster_tag = {"aws:ResourceTag/gpucluster:cluster": args.cluster_name}
    templates = [f"arn:aws:ec2:{region}:{account}:launch-template/{t}" for t in template_ids]
    return [
        {"Sid": "LaunchFromClusterTemplatesOnly", "Effect": "Allow", "Action": ["ec2:RunInstances", "ec2:CreateFleet"],
         "Resource": "*", "Condition": {"ArnLike": {"ec2:LaunchTemplate": templates}}},
        {"Sid": "FleetRequest", "Effect": "Allow", "Action": "ec2:CreateFleet",
         "Resource": [f"arn:aws:ec2:{region}:{account}:fleet/*", *templates]},
        {"Sid": "TagAtLaunch", "Effect": "Allow", "Action": "ec2:CreateTags", "Resource": "*",
         "Condition": {"StringEquals": {"ec2:CreateAction": ["RunInstances", "CreateFleet"]}}},
        {"Sid": "TagAndTerminateClusterInstancesOnly", "Effect": "Allow",
         "Action": ["ec2:CreateTags", "ec2:TerminateInstances"],
         "Resource": f"arn:aws:ec2:{region}:{account}:instance/*", "Condition": {"StringEquals": cluster_tag}},
        {"Sid": "Describe", "Effect": "Allow", "Action": ["ec2:DescribeInstances", "ec2:DescribeInstanceStatus",
                                                        "ec2:DescribeLaunchTemplates", "ec2:DescribeLaunchTemplateVersions"],
         "Resource": "*"},
        {"Sid": "PassComputeRoleOnly", "Effect": "Allow", "Action": "iam:PassRole", "Resource": compute_role_arn,
         "Condition": {"StringEquals": {"iam:PassedToService": "ec2.amazonaws.com"}}},
        {"Sid": "ClusterParameters", "Effect": "Allow", "Action": ["ssm:GetParameter"], "Resource": [config_arn, munge_arn]},
        {"Sid": "CreateMungeKeyOnce", "Effect": "Allow", "Action": "ssm:PutParameter", "Resource": munge_arn},
        {"Sid": "Bundle", "Effect": "Allow", "Action": "s3:GetObject", "Resource": bundle_arn},
    ]


def guardrail_statements(queue_arn: str, topic_arn: str, budget_arn: str) -> list[dict[str, object]]:
    """Read the budget and its queue, tell the subscribers, reverse this budget's actions: nothing else."""
    return [
        {"Sid": "BudgetQueue", "Effect": "Allow", "Action": ["sqs:ReceiveMessage", "sqs:DeleteMessage",
                                                            "sqs:GetQueueAttributes"], "Resource": queue_arn},
        {"Sid": "TellSubscribers", "Effect": "Allow", "Action": "sns:Publish", "Resource": topic_arn},
        {"Sid": "ReadBudget", "Effect": "Allow", "Action": ["budgets:ViewBudget", "budgets:DescribeBudgetActionsForBudget"],
         "Resource": budget_arn},
        {"Sid": "ReverseBudgetActions", "Effect": "Allow", "Action": "budgets:ExecuteBudgetAction",
         "Resource": f"{budget_arn}/action/*"},
    ]
