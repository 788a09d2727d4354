"""What every node of the cluster reads at boot: the bundle in S3, and the compute nodes' IAM role that may read it
together with the cluster's SSM parameters, nothing else."""

from __future__ import annotations

import base64
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from components import child, private_bucket
from components.iam import EC2_ASSUME, PARAMETER_READ, SSM_AGENT, policy
from gpucluster.render import monitoring


@dataclass(frozen=True)
class NodeAccessArgs:
    region: str
    account_id: pulumi.Input[str]  # components.iam.account_id
    bundle: bytes  # gpucluster.render.bundle.build
    bundle_key: str
    config_parameter: str
    munge_key_parameter: str


class NodeAccess(pulumi.ComponentResource):
    bucket: pulumi.Output[str]
    bundle_arn: pulumi.Output[str]
    config_parameter_arn: pulumi.Output[str]
    munge_key_parameter_arn: pulumi.Output[str]
    compute_role_arn: pulumi.Output[str]
    compute_instance_profile_arn: pulumi.Output[str]

    def __init__(self, name: str, args: NodeAccessArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpucluster:access:NodeAccess", name, None, opts)
        self.config_parameter_arn = pulumi.Output.concat(
            f"arn:aws:ssm:{args.region}:", args.account_id, f":parameter{args.config_parameter}")
        self.munge_key_parameter_arn = pulumi.Output.concat(
            f"arn:aws:ssm:{args.region}:", args.account_id, f":parameter{args.munge_key_parameter}")

        bucket = private_bucket(f"{name}-bundle", child(self), force_destroy=True)
        bundle = aws.s3.BucketObjectv2(f"{name}-bundle", bucket=bucket.id, key=args.bundle_key,
                                        content_base64=base64.b64encode(args.bundle).decode(), opts=child(self))
        # Through the object, so that the settings naming it are written only once it is in the bucket.
        self.bucket = pulumi.Output.all(name=bucket.bucket, uploaded=bundle.id).apply(lambda v: v["name"])
        self.bundle_arn = pulumi.Output.concat("arn:aws:s3:::", self.bucket, f"/{args.bundle_key}")

        role = aws.iam.Role(f"{name}-compute", assume_role_policy=EC2_ASSUME, opts=child(self))
        aws.iam.RolePolicy(f"{name}-compute", role=role.id, policy=pulumi.Output.all(
            config_arn=self.config_parameter_arn, munge_arn=self.munge_key_parameter_arn,
            bundle_arn=self.bundle_arn).apply(lambda v: policy(compute_statements(**v))), opts=child(self))
        profile = aws.iam.InstanceProfile(f"{name}-compute", role=role.name, opts=child(self))
        self.compute_role_arn = role.arn
        self.compute_instance_profile_arn = profile.arn
        self.register_outputs({"bucket": self.bucket, "compute_role_arn": self.compute_role_arn,
                               "compute_instance_profile_arn": self.compute_instance_profile_arn})


def compute_statements(config_arn: str, munge_arn: str, bundle_arn: str) -> list[dict[str, object]]:
    """Read the cluster's settings, the munge key and the bundle, publish GPU metrics, let the SSM agent work:
    nothing else. Only root on the node gets these credentials (gpucluster.contract.lockdown): a job gets none."""
    return [
        # The boot reads both in one call. The munge key lets a node join Slurm: root on any node of the cluster
        # holds it anyway (munged needs it on every node), and no user reaches the credentials that read it.
        {"Sid": "ClusterSettings", "Effect": "Allow", "Action": PARAMETER_READ, "Resource": [config_arn, munge_arn]},
        # The Slurm files, node programs and examples: this stack's bundle object only.
        {"Sid": "Bundle", "Effect": "Allow", "Action": "s3:GetObject", "Resource": bundle_arn},
        # The CloudWatch agent's GPU metrics (idle-GPU alarms), in the cluster's namespace only.
        {"Sid": "GpuMetrics", "Effect": "Allow", "Action": "cloudwatch:PutMetricData", "Resource": "*",
         "Condition": {"StringEquals": {"cloudwatch:namespace": monitoring.NAMESPACE}}},
        SSM_AGENT,
    ]
