"""A node image, baked once by EC2 Image Builder at `pulumi up`: gpucluster/node/build_image.sh run on the parent AMI,
with the stack's bill of materials (gpucluster/spec/bom.py, the bom.json `render` writes) beside it.

The parent is an exact release the stack file names (image.parent_images, defaults in bom.py), looked up by name and
owner in the stack's region at `up` unless the stack gives its id there. Moving a parent, or a change of BOM, build
script, role or root size, replaces the recipe and bakes a new image. The AMI carries the BOM's sha256 as its
`gpucluster:bom` tag. Image Builder never deregisters the AMIs it made (their snapshots stay billed until removed).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pulumi
import pulumi_aws as aws
import yaml

from components import child
from components.gpu_pool import ROOT_DEVICE
from components.iam import EC2_ASSUME, MANAGED_POLICY, SSM_CORE
from gpucluster import node
from gpucluster.contract import settings
from gpucluster.spec import account, bom, catalog, cost
from gpucluster.spec.model import ImageBuild

BUILD_SCRIPT = "build_image.sh"  # a node program (gpucluster.node)
# On the build instance the script sits beside the manifest it writes: the image keeps what built it.
SCRIPT_ON_IMAGE = f"{Path(settings.IMAGE_MANIFEST).parent}/build_image.sh"
HEREDOC_END = "GPUCLUSTER_BUILD_SCRIPT"
BOM_END = "GPUCLUSTER_BOM"
COMPONENT_DATA_LIMIT = 16000  # characters of inline YAML that CreateComponent accepts (its `data`)
IMAGE_BUILDER_POLICY = MANAGED_POLICY + "EC2InstanceProfileForImageBuilder"
# A build is an hour or so, and Image Builder snapshots a 100+ GiB DLAMI volume after it.
BUILD_TIMEOUT = "180m"
BOM_TAG = "gpucluster:bom"  # the AMI's tag: sha256 of the bom.json it was baked from


@dataclass(frozen=True)
class NodeImageArgs:
    cluster_name: str
    build: ImageBuild
    region: str
    subnet_id: pulumi.Input[str]  # private: the build instance reaches apt, GitHub and PyPI through the NAT gateway
    security_group_id: pulumi.Input[str]
    # The stack's tags, for what the provider's default tags do not reach: the build instance and the AMI.
    tags: dict[str, str]
    bill_of_materials: str  # bom.json's text (gpucluster.spec.bom.render)
    parent: bom.ParentImage
    account_id: pulumi.Input[str]  # components.iam.account_id
    # The account's default EBS key when it is customer managed (components.launch_access.default_ebs_key), else None.
    ebs_key_arn: str | None = None


def parent_ami(parent: bom.ParentImage, region: str, opts: pulumi.InvokeOutputOptions) -> pulumi.Output[str]:
    """The parent's AMI id in the region: its region_ids entry, else the one available x86_64 image of that exact name
    and owner (a name is unique per owner and region; with most_recent off a second match fails the lookup instead of
    being picked). Deprecated images count: AWS and Canonical deprecate releases after a time, and a pinned release
    must keep resolving."""
    if region in parent.region_ids:
        return pulumi.Output.from_input(parent.region_ids[region])
    return aws.ec2.get_ami_output(
        owners=[parent.owner], most_recent=False, include_deprecated=True,
        filters=[{"name": "name", "values": [parent.name]}, {"name": "architecture", "values": ["x86_64"]},
                 {"name": "state", "values": ["available"]}], opts=opts).id


@dataclass(frozen=True)
class ShippedFile:
    """A file the build instance gets from the recipe's components (Image Builder takes no files): written by a quoted
    heredoc, which expands nothing; the last part may then run a command."""

    name: str  # the AWSTOE documents' name
    path: str  # on the build instance
    end: str  # the heredoc's end line
    what: str  # in descriptions and errors
    run: str | None = None


def build_script(role: str) -> ShippedFile:
    return ShippedFile(f"gpucluster-node-{role}", SCRIPT_ON_IMAGE, HEREDOC_END,
                       f"gpucluster/node/build_image.sh {role}", run=f"bash {SCRIPT_ON_IMAGE} {role}")


BOM_FILE = ShippedFile("gpucluster-bom", settings.IMAGE_BOM, BOM_END, "the stack's bom.json")


class _LiteralDumper(yaml.SafeDumper):
    """Multi-line strings as YAML literal blocks: the script reads in the console as it does in the repository."""


_LiteralDumper.add_representer(
    str, lambda dumper, value: dumper.represent_scalar("tag:yaml.org,2002:str", value,
                                                       style="|" if "\n" in value else None))


def component_document(file: ShippedFile, part: str, index: int, count: int) -> str:
    """The AWSTOE document of one part of a file: write it as it is, after the parts before it; the last part then
    runs the file's command."""
    target = f"{'>' if index == 0 else '>>'} {file.path} <<'{file.end}'\n{part}{file.end}\n"
    write = f"install -d {Path(file.path).parent}\ncat {target}" if index == 0 else f"cat {target}"
    steps = [{"name": "Write", "action": "ExecuteBash", "inputs": {"commands": [write]}}]
    if index == count - 1 and file.run:
        steps.append({"name": "Build", "action": "ExecuteBash", "inputs": {"commands": [file.run]}})
    which = f" (part {index + 1} of {count})" if count > 1 else ""
    return yaml.dump({
        "name": file.name + (f"-{index + 1}" if count > 1 else ""),
        "description": f"gpucluster: {file.what}{which}",
        "schemaVersion": 1.0,
        "phases": [{"name": "build", "steps": steps}],
    }, Dumper=_LiteralDumper, sort_keys=False, width=1000)


def file_documents(file: ShippedFile, text: str) -> list[str]:
    """A file in as few AWSTOE documents as Image Builder's inline limit allows, split between lines; the recipe runs
    them in this order. Plain text, not compressed: it reads in the console as in the repository, and the documents
    (hence the recipe, hence the image) change only when the file does."""
    if not text.endswith("\n") or f"\n{file.end}\n" in text or "{{" in text:
        raise ValueError(f"{file.what} must end with a newline, never contain the heredoc end line, and never "
                         "contain '{{' (AWSTOE's variable syntax)")
    lines = text.splitlines(keepends=True)
    if len(component_document(file, max(lines, key=len), 0, 1)) > COMPONENT_DATA_LIMIT:
        raise ValueError(f"a line of {file.what} does not fit in the {COMPONENT_DATA_LIMIT} characters of inline "
                         "YAML that CreateComponent takes")
    for count in range(1, len(lines) + 1):
        # Each line to the part its first character falls in when the text is cut in `count` equal lengths.
        parts = [""] * count
        offset = 0
        for line in lines:
            parts[offset * count // len(text)] += line
            offset += len(line)
        documents = [component_document(file, part, i, count) for i, part in enumerate(parts)]
        if all(part and len(document) <= COMPONENT_DATA_LIMIT for part, document in zip(parts, documents, strict=True)):
            return documents
    raise ValueError(f"{file.what} does not cut into documents of {COMPONENT_DATA_LIMIT} characters")


def component_documents(role: str, script: str) -> list[str]:
    """The build script's documents; the last one runs it."""
    return file_documents(build_script(role), script)


BUILD_LOG_DAYS = 30



def built_ami(resources: Sequence[aws.imagebuilder.outputs.ImageOutputResource]) -> str:
    """The AMI an image build made, from the image's output resources."""
    amis = resources[0].amis
    if not amis or not amis[0].image:
        raise ValueError("the image build reports no AMI among its output resources")
    return amis[0].image


class NodeImage(pulumi.ComponentResource):
    image_id: pulumi.Output[str]
    parent_image: pulumi.Output[str]  # the parent's AMI id in the stack's region

    def __init__(self, name: str, args: NodeImageArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpucluster:image:NodeImage", name, None, opts)
        build = args.build
        role = aws.iam.Role(f"{name}-build", assume_role_policy=EC2_ASSUME, opts=child(self))
        attachments = [
            aws.iam.RolePolicyAttachment(f"{name}-build-{short}", role=role.name, policy_arn=arn, opts=child(self))
            for short, arn in (("ssm", SSM_CORE), ("imagebuilder", IMAGE_BUILDER_POLICY))
        ]
        profile = aws.iam.InstanceProfile(f"{name}-build", role=role.name, opts=child(self))

        # The BOM first: the script's last part runs the script, which reads it. The script's first part keeps the
        # component's name from when one document held the whole script.
        shipped = [(f"{name}-bom", BOM_FILE, file_documents(BOM_FILE, args.bill_of_materials)),
                   (name, build_script(build.role),
                    component_documents(build.role, node.source(BUILD_SCRIPT).decode()))]
        components = [
            aws.imagebuilder.Component(first if i == 0 else f"{first}-{i + 1}", platform="Linux", version="1.0.0",
                                       description=f"{args.cluster_name}: {file.what}", data=document,
                                       opts=child(self))
            for first, file, documents in shipped for i, document in enumerate(documents)
        ]
        self.parent_image = parent_ami(args.parent, args.region, pulumi.InvokeOutputOptions(parent=self))
        recipe = aws.imagebuilder.ImageRecipe(
            name, version="1.0.0", parent_image=self.parent_image,
            components=[{"component_arn": component.arn} for component in components],
            description=f"{args.cluster_name} {build.key} node image on {args.parent.name}",
            block_device_mappings=[{"device_name": ROOT_DEVICE, "ebs": {
                "volume_size": cost.IMAGE_ROOT_GIB[build.role], "volume_type": "gp3", "encrypted": "true",
                "delete_on_termination": "true"}}],
            opts=child(self))
        infrastructure = aws.imagebuilder.InfrastructureConfiguration(
            name, instance_profile_name=profile.name, instance_types=list(catalog.IMAGE_BUILD_INSTANCE_TYPES),
            subnet_id=args.subnet_id, security_group_ids=[args.security_group_id],
            instance_metadata_options={"http_tokens": "required", "http_put_response_hop_limit": 1},
            terminate_instance_on_failure=True,
            resource_tags={**args.tags, "Name": f"{args.cluster_name}-{build.key}-image-build"},
            description=f"{args.cluster_name}: where {build.key} images are built",
            # The profile's policies must be attached before a build instance uses it.
            opts=child(self, depends_on=attachments))
        distribution = aws.imagebuilder.DistributionConfiguration(
            name, description=f"{args.cluster_name} {build.key} node image",
            distributions=[{"region": args.region, "ami_distribution_configuration": {
                "name": f"{args.cluster_name}-{build.key}-{{{{ imagebuilder:buildDate }}}}",
                "description": f"gpucluster {build.key} node image of {args.cluster_name}",
                "ami_tags": {**args.tags, "gpucluster:image": build.key,
                             BOM_TAG: bom.digest(args.bill_of_materials)},
            }}],
            opts=child(self))
        # The build's log, declared here so that it expires and goes with the stack (Image Builder would create
        # /aws/imagebuilder/<recipe> itself, kept forever). Under /aws/imagebuilder/: the build role's managed
        # policy may write there only.
        build_log = aws.cloudwatch.LogGroup(f"{name}-build-log", name=f"/aws/imagebuilder/{name}",
                                            retention_in_days=BUILD_LOG_DAYS, opts=child(self))
        key_grants: list[pulumi.Resource] = []
        if args.ebs_key_arn is not None:
            # Image Builder launches the build instance and snapshots its volume (encrypted with the default key)
            # through its service-linked role, which it makes with the account's first Image Builder resource: after
            # this image's components.
            builder_role = pulumi.Output.from_input(args.account_id).apply(lambda acct: account.service_role_arn(
                acct, account.IMAGE_BUILDER_SERVICE, account.IMAGE_BUILDER_ROLE))
            key_grants.append(aws.kms.Grant(
                f"{name}-ebs-key", key_id=args.ebs_key_arn, grantee_principal=builder_role,
                operations=list(account.SERVICE_GRANT_OPERATIONS), opts=child(self, depends_on=components)))
        image = aws.imagebuilder.Image(
            name, image_recipe_arn=recipe.arn, infrastructure_configuration_arn=infrastructure.arn,
            distribution_configuration_arn=distribution.arn, logging_configuration={"log_group_name": build_log.name},
            opts=child(self, depends_on=key_grants, custom_timeouts=pulumi.CustomTimeouts(create=BUILD_TIMEOUT)))
        self.image_id = image.output_resources.apply(built_ami)
        self.register_outputs({"image_id": self.image_id, "parent_image": self.parent_image})
