"""Shared storage: FSx for Lustre at /fsx, linked to S3 so that datasets come in and, in the stack's own bucket,
checkpoints outlive the cluster."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from components import child, private_bucket
from components.teardown import lustre_export
from gpucluster.spec.catalog import LUSTRE_VERSION
from gpucluster.spec.model import LustreSpec


@dataclass(frozen=True)
class StorageArgs:
    lustre: LustreSpec
    region: str
    subnet_id: pulumi.Input[str]
    security_group_id: pulumi.Input[str]
    # The group's rules (Network.security_group_rules): FSx refuses a group whose rules are not yet in force.
    security_group_rules: Sequence[pulumi.Resource] = ()


class Storage(pulumi.ComponentResource):
    file_system_id: pulumi.Output[str]
    dns_name: pulumi.Output[str]
    mount_name: pulumi.Output[str]
    bucket: pulumi.Output[str] | None
    data_repository: pulumi.Output[str] | None

    def __init__(self, name: str, args: StorageArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpucluster:storage:Storage", name, None, opts)
        lustre = args.lustre
        self.bucket = None
        self.data_repository = None
        if lustre.file_system_id:
            # An existing file system: mounted as is, never touched by this stack.
            dns_name, mount_name = lustre.dns_name, lustre.mount_name
            if not dns_name or not mount_name:
                raise ValueError(f"the existing file system {lustre.file_system_id} is mounted by its dns_name and "
                                 f"mount_name: give both (got {dns_name!r}, {mount_name!r})")
            self.file_system_id = pulumi.Output.from_input(lustre.file_system_id)
            self.dns_name = pulumi.Output.from_input(dns_name)
            self.mount_name = pulumi.Output.from_input(mount_name)
        else:
            self._create(name, args)
        self.register_outputs(
            {
                "file_system_id": self.file_system_id,
                "dns_name": self.dns_name,
                "mount_name": self.mount_name,
                "bucket": self.bucket,
                "data_repository": self.data_repository,
            }
        )

    def _create(self, name: str, args: StorageArgs) -> None:
        lustre = args.lustre
        # retain_on_delete: `pulumi destroy` forgets what it keeps instead of deleting it.
        keep_fs = child(self, retain_on_delete=lustre.keeps_file_system)
        if lustre.data_repository:
            self.data_repository = pulumi.Output.from_input(lustre.data_repository)
        else:
            bucket = self._bucket(name, child(self, retain_on_delete=lustre.keep_bucket_on_destroy))
            self.bucket = bucket.bucket
            self.data_repository = pulumi.Output.concat("s3://", bucket.bucket)

        fs = aws.fsx.LustreFileSystem(
            f"{name}-lustre",
            deployment_type=lustre.deployment_type,
            storage_capacity=lustre.storage_capacity_gib,
            per_unit_storage_throughput=lustre.throughput_mb_per_tib,
            storage_type="SSD",
            file_system_type_version=LUSTRE_VERSION,
            data_compression_type="LZ4",
            subnet_ids=args.subnet_id,
            security_group_ids=[args.security_group_id],
            # FSx encrypts Lustre at rest always (AWS-managed key). Only PERSISTENT_2 has backups to carry the tags,
            # and a final backup at delete, which would outlive the stack and bill: the data is in S3 already.
            copy_tags_to_backups=True if lustre.deployment_type == "PERSISTENT_2" else None,
            skip_final_backup=True if lustre.deployment_type == "PERSISTENT_2" else None,
            # CreateFileSystem checks the group's rules synchronously (InvalidNetworkSettings,
            # aws-parallelcluster#6181).
            opts=child(self, retain_on_delete=lustre.keeps_file_system,
                       depends_on=list(args.security_group_rules)),
        )
        # One association for the whole namespace: new, changed and deleted S3 objects show under /fsx.
        events = ["NEW", "CHANGED", "DELETED"]
        policies: aws.fsx.DataRepositoryAssociationS3ArgsDict = {"auto_import_policy": {"events": events}}
        # Only the stack's own bucket takes exports (checkpoints, and deletions under /fsx). A bucket the team named
        # holds their dataset: exporting would let `rm` under /fsx delete their objects.
        if lustre.exports:
            policies["auto_export_policy"] = {"events": events}
        association = aws.fsx.DataRepositoryAssociation(
            f"{name}-s3",
            file_system_id=fs.id,
            file_system_path="/",
            data_repository_path=self.data_repository,
            batch_import_meta_data_on_create=True,
            s3=policies,
            # Deleting the association must not delete the data it exported.
            delete_data_in_filesystem=False,
            opts=keep_fs,
        )
        if lustre.exports and lustre.keep_bucket_on_destroy:
            # At destroy, before the association and the file system go: what automatic export has not yet written
            # to the kept bucket is exported and awaited; a failed export stops the deletion.
            lustre_export(f"{name}-flush", args.region, fs.id, child(self, depends_on=[association]))
        self.file_system_id = fs.id
        self.dns_name = fs.dns_name
        self.mount_name = fs.mount_name

    def _bucket(self, name: str, keep: pulumi.ResourceOptions) -> aws.s3.Bucket:
        bucket = private_bucket(f"{name}-data", keep, force_destroy=not keep.retain_on_delete)
        aws.s3.BucketVersioning(
            f"{name}-data", bucket=bucket.id, versioning_configuration={"status": "Enabled"}, opts=keep
        )
        aws.s3.BucketOwnershipControls(
            f"{name}-data", bucket=bucket.id, rule={"object_ownership": "BucketOwnerEnforced"}, opts=keep
        )
        return bucket
