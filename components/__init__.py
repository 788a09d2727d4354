"""Pulumi ComponentResources of a gpucluster, each usable alone. `create_cluster` in components.cluster wires them
into one of the two flavours (components/slurm_cluster.py, components/kubernetes_cluster.py)."""

from __future__ import annotations

from typing import Any

import pulumi
import pulumi_aws as aws


def child(parent: pulumi.Resource, **kwargs: Any) -> pulumi.ResourceOptions:
    """Options for a resource owned by a component: parented, so it inherits the component's provider."""
    return pulumi.ResourceOptions(parent=parent, **kwargs)


def private_bucket(name: str, opts: pulumi.ResourceOptions, force_destroy: bool) -> aws.s3.Bucket:
    """An S3 bucket closed to the public and encrypted at rest (SSE-S3: FSx and the nodes read it without a key
    policy to maintain)."""
    bucket = aws.s3.Bucket(name, force_destroy=force_destroy, opts=opts)
    aws.s3.BucketPublicAccessBlock(name, bucket=bucket.id, block_public_acls=True, block_public_policy=True,
                                   ignore_public_acls=True, restrict_public_buckets=True, opts=opts)
    aws.s3.BucketServerSideEncryptionConfiguration(
        name, bucket=bucket.id, rules=[{"apply_server_side_encryption_by_default": {"sse_algorithm": "AES256"}}],
        opts=opts)
    return bucket
