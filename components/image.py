"""A node image, baked once by EC2 Image Builder at `pulumi up`: gpucluster/node/build_image.sh run on the parent AMI.

The parent is the newest Deep Learning AMI of the accelerator kind (compute) or Ubuntu 24.04 (head): the recipe names
the public SSM parameter (`ssm:` prefix) and Image Builder reads it when a build starts, so a new DLAMI or Ubuntu
release changes nothing at `up`. A change of build script, role or root size replaces the recipe and bakes a new image
on the parent of that day; to take a newer parent without one, `pulumi up --replace` the image. Image Builder never
deregisters the AMIs it made (their snapshots stay billed until removed).
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
from gpucluster.spec import account, catalog, cost
from gpucluster.spec.model import ImageBuild

BUILD_SCRIPT = "build_image.sh"  # a node program (gpucluster.node)
# On the build instance the script sits beside the manifest it writes: the image keeps what built it.
SCRIPT_ON_IMAGE = f"{Path(settings.IMAGE_MANIFEST).parent}/build_image.sh"
HEREDOC_END = "GPUCLUSTER_BUILD_SCRIPT"
COMPONENT_DATA_LIMIT = 16000  # characters of inline YAML that CreateComponent accepts (its `data`)
IMAGE_BUILDER_POLICY = MANAGED_POLICY + "EC2InstanceProfileForImageBuilder"
# A build is an hour or so, and Image Builder snapshots a 100+ GiB DLAMI volume after it.
BUILD_TIMEOUT = "180m"


@dataclass(frozen=True)
class NodeImageArgs:
    cluster_name: str
    build: ImageBuild
    region: str
    subnet_id: pulumi.Input[str]  # private: the build instance reaches apt, GitHub and PyPI through the NAT gateway
    security_group_id: pulumi.Input[str]
    # The stack's tags, for what the provider's default tags do not reach: the build instance and the AMI.
    tags: dict[str, str]
    account_id: pulumi.Input[str]  # components.iam.account_id
    # The account's default EBS key when it is customer managed (components.launch_access.default_ebs_key), else None.
    ebs_key_arn: str | None = None


def parent_image(build: ImageBuild) -> str:
    """The recipe's parent: the public SSM parameter naming the newest AMI, which Image Builder resolves at build time
    (a value resolved at `up` would replace the recipe, and rebake, at every new release). Image Builder's
    service-linked role may read /aws/service/* parameters, so the build role needs nothing for it."""
    parameter = catalog.AMI_PARAMETERS[build.accelerator] if build.accelerator else catalog.UBUNTU_AMI_PARAMETER
    return f"ssm:{parameter}"


class _LiteralDumper(yaml.SafeDumper):
    """Multi-line strings as YAML literal blocks: the script reads in the console as it does in the repository."""


_LiteralDumper.add_representer(
    str, lambda dumper, value: dumper.represent_scalar("tag:yaml.org,2002:str", value,
                                                       style="|" if "\n" in value else None))


def component_document(role: str, part: str, index: int, count: int) -> str:
    """The AWSTOE document of one part of the build script: write it as it is (a quoted heredoc expands nothing), after
    the parts before it; the last part then runs the script."""
    target = f"{'>' if index == 0 else '>>'} {SCRIPT_ON_IMAGE} <<'{HEREDOC_END}'\n{part}{HEREDOC_END}\n"
    write = f"install -d {Path(SCRIPT_ON_IMAGE).parent}\ncat {target}" if index == 0 else f"cat {target}"
    steps = [{"name": "WriteBuildScript", "action": "ExecuteBash", "inputs": {"commands": [write]}}]
    if index == count - 1:
        steps.append({"name": "Build", "action": "ExecuteBash",
                      "inputs": {"commands": [f"bash {SCRIPT_ON_IMAGE} {role}"]}})
    which = f" (part {index + 1} of {count})" if count > 1 else ""
    return yaml.dump({
        "name": f"gpucluster-node-{role}" + (f"-{index + 1}" if count > 1 else ""),
        "description": f"gpucluster {role} node: gpucluster/node/build_image.sh {role}{which}",
        "schemaVersion": 1.0,
        "phases": [{"name": "build", "steps": steps}],
    }, Dumper=_LiteralDumper, sort_keys=False, width=1000)


def component_documents(role: str, script: str) -> list[str]:
    """The build script in as few AWSTOE documents as Image Builder's inline limit allows, split between lines; the
    recipe runs them in this order. Plain text, not compressed: the script reads in the console as in the repository,
    and the documents (hence the recipe, hence the image) change only when the script does."""
    if not script.endswith("\n") or f"\n{HEREDOC_END}\n" in script or "{{" in script:
        raise ValueError("build_image.sh must end with a newline, never contain the heredoc end line, and never "
                         "contain '{{' (AWSTOE's variable syntax)")
    lines = script.splitlines(keepends=True)
    if len(component_document(role, max(lines, key=len), 0, 1)) > COMPONENT_DATA_LIMIT:
        raise ValueError(f"a line of build_image.sh does not fit in the {COMPONENT_DATA_LIMIT} characters of inline "
                         "YAML that CreateComponent takes")
    for count in range(1, len(lines) + 1):
        # Each line to the part its first character falls in when the script is cut in `count` equal lengths.
        parts = [""] * count
        offset = 0
        for line in lines:
            parts[offset * count // len(script)] += line
            offset += len(line)
        documents = [component_document(role, part, i, count) for i, part in enumerate(parts)]
        if all(part and len(document) <= COMPONENT_DATA_LIMIT for part, document in zip(parts, documents, strict=True)):
            return documents
    raise ValueError(f"build_image.sh does not cut into documents of {COMPONENT_DATA_LIMIT} characters")


BUILD_LOG_DAYS = 30



def built_ami(resources: Sequence[aws.imagebuilder.outputs.ImageOutputResource]) -> str:
    """The AMI an image build made, from the image's output resources."""
    amis = resources[0].amis
    if not amis or not amis[0].image:
        raise ValueError("the image build reports no AMI among its output resources")
    return amis[0].image


class NodeImage(pulumi.ComponentResource):
    image_id: pulumi.Output[str]

    def __init__(self, name: str, args: NodeImageArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpucluster:image:NodeImage", name, None, opts)
        build = args.build
        role = aws.iam.Role(f"{name}-build", assume_role_policy=EC2_ASSUME, opts=child(self))
        attachments = [
            aws.iam.RolePolicyAttachment(f"{name}-build-{short}", role=role.name, policy_arn=arn, opts=child(self))
            for short, arn in (("ssm", SSM_CORE), ("imagebuilder", IMAGE_BUILDER_POLICY))
        ]
        profile = aws.iam.InstanceProfile(f"{name}-build", role=role.name, opts=child(self))

        # The first part keeps the component's name from when one document held the whole script.
        components = [
            aws.imagebuilder.Component(
                name if i == 0 else f"{name}-{i + 1}", platform="Linux", version="1.0.0",
                description=f"{args.cluster_name}: build_image.sh {build.role}", data=document, opts=child(self))
            for i, document in enumerate(component_documents(build.role, node.source(BUILD_SCRIPT).decode()))
        ]
        recipe = aws.imagebuilder.ImageRecipe(
            name, version="1.0.0", parent_image=parent_image(build),
            components=[{"component_arn": component.arn} for component in components],
            description=f"{args.cluster_name} {build.key} node image",
            block_device_mappings=[{"device_name": ROOT_DEVICE, "ebs": {
                "volume_size": cost.IMAGE_ROOT_GIB[build.role], "volume_type": "gp3", "encrypted": "true",
                "delete_on_termination": "true"}}],
            opts=child(self))
        infrastructure = aws.imagebuilder.InfrastructureConfiguration(
            name, instance_profile_name=profile.name, instance_types=[catalog.IMAGE_BUILD_INSTANCE_TYPE],
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
                "ami_tags": {**args.tags, "gpucluster:image": build.key},
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
        self.register_outputs({"image_id": self.image_id})
