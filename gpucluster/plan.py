"""The offline plan: run the real Pulumi program under Pulumi's mock runtime and record what it declares.

No credentials, no network, no Pulumi CLI. Where AWS would compute a value (an id, the AMI behind an SSM parameter),
the plan shows a placeholder that says so.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from gpucluster.aws import checkip
from gpucluster.spec import account
from gpucluster.spec.model import CONFIG_KEY, REGION_KEY, Stack, stack_config

if TYPE_CHECKING:  # pulumi is imported where the plan runs: the head node's command line has no pulumi
    from pulumi.runtime import Mocks
    from pulumi.runtime.mocks import MockMonitor
    from pulumi.runtime.proto.resource_pb2 import RegisterResourceRequest, RegisterResourceResponse

MOCK_ACCOUNT = "123456789012"
# An interface's private IP as AWS gives it, from the documentation range (RFC 5737): never a real address.
PLAN_INTERFACE_IP = "192.0.2.10"
# The public address of the machine running `up` (`operator` in kubernetes.public_access_cidrs), from another
# documentation range: `up` asks checkip.amazonaws.com (gpucluster/aws/checkip.py).
PLAN_OPERATOR_IP = "198.51.100.7"


@dataclass(frozen=True)
class AccountFacts:
    """What the program looks up in the account to decide what it declares, which an offline plan cannot ask: by
    default a new account (no spot service-linked role yet) whose default EBS key is AWS's own, and an operator at a
    documentation address. Tests plan other accounts with it; `preflight` reads the real one."""

    spot_role: bool = False  # AWSServiceRoleForEC2Spot exists
    customer_managed_ebs_key: bool = False  # the default EBS key is a customer managed key
    # The public address of the machine running `up`; None: ask checkip.amazonaws.com, as `up` does.
    operator_ip: str | None = PLAN_OPERATOR_IP

    def describe(self) -> str:
        role = "has the spot service-linked role" if self.spot_role else "has no spot service-linked role yet"
        key = "customer managed" if self.customer_managed_ebs_key else "AWS managed (aws/ebs)"
        return f"the account {role}; its default EBS key is {key}"

    def ebs_key(self, region: str) -> tuple[str, str]:
        """(default key id as EC2 gives it, key ARN) of this account."""
        if self.customer_managed_ebs_key:
            arn = f"arn:aws:kms:{region}:{MOCK_ACCOUNT}:key/{_uuid('customer-managed-ebs-key')}"
            return arn, arn
        return account.AWS_EBS_KEY_ALIAS, f"arn:aws:kms:{region}:{MOCK_ACCOUNT}:key/{_uuid('aws-ebs')}"


NEW_ACCOUNT = AccountFacts()  # what `plan` assumes


@dataclass(frozen=True)
class Declared:
    """One resource the program declared."""

    type: str
    name: str
    urn: str
    parent_urn: str
    inputs: dict[str, Any]
    retain_on_delete: bool
    provider: str
    delete_before_replace: bool = False
    ignore_changes: tuple[str, ...] = ()
    dependencies: tuple[str, ...] = ()  # URNs it waits for: its inputs' resources and its depends_on

    @property
    def parent_type(self) -> str | None:
        """The parent's type token; None for resources directly under the stack."""
        if not self.parent_urn:
            return None
        parent = urn_type(self.parent_urn)
        return None if parent == "pulumi:pulumi:Stack" else parent


def urn_type(urn: str) -> str:
    # urn:pulumi:<stack>::<project>::<parent types joined by $>$<type>::<name>
    return urn.split("::")[2].split("$")[-1]


# EC2 Image Builder ARNs by resource type: <kind>/<name>, then the semantic version and build where AWS adds them.
IMAGE_BUILDER_ARNS = {
    "aws:imagebuilder/component:Component": ("component", "/1.0.0/1"),
    "aws:imagebuilder/imageRecipe:ImageRecipe": ("image-recipe", "/1.0.0"),
    "aws:imagebuilder/infrastructureConfiguration:InfrastructureConfiguration": ("infrastructure-configuration", ""),
    "aws:imagebuilder/distributionConfiguration:DistributionConfiguration": ("distribution-configuration", ""),
    "aws:imagebuilder/image:Image": ("image", "/1.0.0/1"),
}


def planned_ami_id(name: str) -> str:
    """The AMI id a planned image build stands for: shaped like AWS's, stable per resource name."""
    return "ami-" + hashlib.sha256(name.encode()).hexdigest()[:17]


def _hex(typ: str, name: str, length: int) -> str:
    return hashlib.sha256(f"{typ}::{name}".encode()).hexdigest()[:length]


def planned_asg_name(node_group: str) -> str:
    """The Auto Scaling group the offline plan says EKS made for a managed node group: eks-<node group>-<uuid>, the
    form EKS gives it (the autoscaler's priority expander matches that uuid)."""
    return f"eks-{node_group}-{_uuid(node_group)}"


def _uuid(seed: str) -> str:
    """A UUID-shaped id (KMS keys, grants' tokens), stable per seed."""
    h = hashlib.sha256(seed.encode()).hexdigest()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


# EC2 and FSx ids by resource type: AWS's prefix, then 17 hex digits (the ARN's resource kind where it has one).
EC2_IDS = {
    "aws:ec2/vpc:Vpc": ("vpc", "vpc"),
    "aws:ec2/subnet:Subnet": ("subnet", "subnet"),
    "aws:ec2/securityGroup:SecurityGroup": ("sg", "security-group"),
    "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule": ("sgr", "security-group-rule"),
    "aws:vpc/securityGroupEgressRule:SecurityGroupEgressRule": ("sgr", "security-group-rule"),
    "aws:ec2/internetGateway:InternetGateway": ("igw", "internet-gateway"),
    "aws:ec2/natGateway:NatGateway": ("nat", "natgateway"),
    "aws:ec2/eip:Eip": ("eipalloc", "elastic-ip"),
    "aws:ec2/routeTable:RouteTable": ("rtb", "route-table"),
    "aws:ec2/routeTableAssociation:RouteTableAssociation": ("rtbassoc", None),
    "aws:ec2/vpcEndpoint:VpcEndpoint": ("vpce", "vpc-endpoint"),
    "aws:ec2/networkInterface:NetworkInterface": ("eni", "network-interface"),
    "aws:ec2/instance:Instance": ("i", "instance"),
    "aws:ec2/launchTemplate:LaunchTemplate": ("lt", "launch-template"),
    "aws:ebs/volume:Volume": ("vol", "volume"),
    "aws:ec2/volumeAttachment:VolumeAttachment": ("vai", None),
    "aws:fsx/lustreFileSystem:LustreFileSystem": ("fs", "file-system"),
    "aws:fsx/dataRepositoryAssociation:DataRepositoryAssociation": ("dra", None),
}


def autoname(typ: str, name: str) -> str:
    """The physical name Pulumi gives a resource declared without one: its name, a dash, 7 random hex digits
    (here derived from the name, so the plan is the same at every run)."""
    return f"{name}-{_hex(typ, name, 7)}"


def _placeholder_outputs(typ: str, name: str, inputs: dict[str, Any], region: str) -> dict[str, Any]:
    """Values AWS would compute, for the program's `apply`s and exports to run on: ids and ARNs in AWS's format for
    the type, the rest as placeholders that say so. The resource's id is under "id"."""
    out: dict[str, Any] = {}
    if "name" not in inputs:
        out["name"] = name
    physical = inputs.get("name", name)
    service = typ.split(":")[1].split("/")[0]
    acct = MOCK_ACCOUNT
    if typ in EC2_IDS:
        prefix, kind = EC2_IDS[typ]
        out["id"] = f"{prefix}-{_hex(typ, name, 17)}"
        if kind:
            out["arn"] = f"arn:aws:{'fsx' if service == 'fsx' else 'ec2'}:{region}:{acct}:{kind}/{out['id']}"
        if typ == "aws:fsx/dataRepositoryAssociation:DataRepositoryAssociation":
            out["arn"] = f"arn:aws:fsx:{region}:{acct}:association/{inputs.get('fileSystemId')}/{out['id']}"
    elif typ in IMAGE_BUILDER_ARNS:
        kind, version = IMAGE_BUILDER_ARNS[typ]
        out["id"] = out["arn"] = f"arn:aws:imagebuilder:{region}:{acct}:{kind}/{name.lower()}{version}"
    elif typ == "aws:ec2/placementGroup:PlacementGroup":
        out["id"], out["placementGroupId"] = physical, f"pg-{_hex(typ, name, 17)}"
        out["arn"] = f"arn:aws:ec2:{region}:{acct}:placement-group/{physical}"
    elif typ in ("aws:iam/role:Role", "aws:iam/instanceProfile:InstanceProfile"):
        out["id"] = physical
        out["arn"] = f"arn:aws:iam::{acct}:{'role' if typ.endswith('Role') else 'instance-profile'}/{physical}"
        out["uniqueId"] = ("AROA" if typ.endswith("Role") else "AIPA") + _hex(typ, name, 17).upper()
    elif typ == "aws:iam/policy:Policy":
        out["id"] = out["arn"] = f"arn:aws:iam::{acct}:policy/{physical}"
    elif typ == "aws:iam/rolePolicy:RolePolicy":
        out["id"] = f"{inputs['role']}:{physical}"
    elif typ == "aws:iam/rolePolicyAttachment:RolePolicyAttachment":
        out["id"] = f"{inputs['role']}-{int(_hex(typ, name, 16), 16):026d}"
    elif typ == "aws:s3/bucket:Bucket":
        bucket = inputs.get("bucket") or autoname(typ, name)
        out["id"], out["bucket"], out["arn"] = bucket, bucket, f"arn:aws:s3:::{bucket}"
    elif typ == "aws:s3/bucketObjectv2:BucketObjectv2":
        out["id"], out["arn"] = inputs["key"], f"arn:aws:s3:::{inputs['bucket']}/{inputs['key']}"
    elif typ.startswith("aws:s3/"):
        out["id"] = inputs["bucket"]  # the bucket's settings are known by its name
    elif typ == "aws:sns/topic:Topic":
        out["id"] = out["arn"] = f"arn:aws:sns:{region}:{acct}:{physical}"
    elif typ == "aws:sns/topicPolicy:TopicPolicy":
        out["id"] = inputs["arn"]
    elif typ == "aws:sns/topicSubscription:TopicSubscription":
        h = _hex(typ, name, 32)
        out["id"] = out["arn"] = f"{inputs['topic']}:{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
    elif typ == "aws:sqs/queue:Queue":
        out["arn"] = f"arn:aws:sqs:{region}:{acct}:{physical}"
        out["id"] = out["url"] = f"https://sqs.{region}.amazonaws.com/{acct}/{physical}"
    elif typ == "aws:sqs/queuePolicy:QueuePolicy":
        out["id"] = inputs["queueUrl"]
    elif typ == "aws:ssm/parameter:Parameter":
        out["id"], out["arn"] = physical, f"arn:aws:ssm:{region}:{acct}:parameter/{physical.lstrip('/')}"
    elif typ == "aws:budgets/budget:Budget":
        out["id"], out["arn"] = f"{acct}:{physical}", f"arn:aws:budgets::{acct}:budget/{physical}"
    elif typ == "aws:budgets/budgetAction:BudgetAction":
        h = _hex(typ, name, 32)
        out["actionId"] = f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
        budget = inputs["budgetName"]
        out["id"] = f"{acct}:{out['actionId']}:{budget}"
        out["arn"] = f"arn:aws:budgets::{acct}:budget/{budget}/action/{out['actionId']}"
    elif typ == "aws:cloudwatch/eventRule:EventRule":
        out["id"], out["arn"] = physical, f"arn:aws:events:{region}:{acct}:rule/{physical}"
    elif typ == "aws:cloudwatch/eventTarget:EventTarget":
        out["id"] = f"{inputs['rule']}-{_hex(typ, name, 8)}"
    elif typ == "aws:cloudwatch/metricAlarm:MetricAlarm":
        out["id"], out["arn"] = physical, f"arn:aws:cloudwatch:{region}:{acct}:alarm:{physical}"
    elif typ == "aws:costexplorer/costAllocationTag:CostAllocationTag":
        out["id"] = inputs["tagKey"]
    elif typ == "aws:eks/cluster:Cluster":
        out["id"], out["arn"] = physical, f"arn:aws:eks:{region}:{acct}:cluster/{physical}"
        out["endpoint"] = f"https://{_hex(typ, name, 32).upper()}.gr7.{region}.eks.amazonaws.com"
        out["certificateAuthority"] = {"data": "<cluster CA at up>"}
        # The security group EKS makes for the cluster (control plane, managed add-ons, template-less node groups).
        out["vpcConfig"] = {**inputs.get("vpcConfig", {}),
                            "clusterSecurityGroupId": f"sg-{_hex(typ, name + '-cluster', 17)}"}
    elif typ == "aws:eks/nodeGroup:NodeGroup":
        group = inputs["nodeGroupName"]
        out["id"] = f"{inputs['clusterName']}:{group}"
        out["arn"] = f"arn:aws:eks:{region}:{acct}:nodegroup/{inputs['clusterName']}/{group}/{_uuid(group)}"
        out["resources"] = [{"autoscalingGroups": [{"name": planned_asg_name(group)}]}]
    elif typ == "aws:kms/key:Key":
        out["keyId"] = out["id"] = _uuid(f"{typ}::{name}")
        out["arn"] = f"arn:aws:kms:{region}:{acct}:key/{out['id']}"
    elif typ == "aws:kms/grant:Grant":
        out["grantId"] = _hex(typ, name, 64)
        out["id"] = f"{inputs['keyId']}:{out['grantId']}"
    elif typ == "aws:iam/serviceLinkedRole:ServiceLinkedRole" and inputs["awsServiceName"] == account.SPOT_SERVICE:
        out["id"] = out["arn"] = account.service_role_arn(acct, account.SPOT_SERVICE, account.SPOT_ROLE)
        out["name"], out["path"] = account.SPOT_ROLE, account.service_role_path(account.SPOT_SERVICE)
    else:
        out["id"] = f"{name}-id"  # not an AWS resource (the provider), or one the plan has no format for yet

    if typ == "aws:ec2/launchTemplate:LaunchTemplate":
        out["latestVersion"] = 1
    elif typ == "aws:ec2/instance:Instance":
        out["privateIp"] = "<private IP at up>"
    elif typ == "aws:ec2/networkInterface:NetworkInterface":
        out["privateIp"] = PLAN_INTERFACE_IP
    elif typ == "aws:fsx/lustreFileSystem:LustreFileSystem":
        out["dnsName"] = f"{out['id']}.fsx.{region}.amazonaws.com"
        out["mountName"] = "<mount name at up>"
    elif typ == "aws:imagebuilder/image:Image":
        out["outputResources"] = [{"amis": [{"image": planned_ami_id(name), "region": region,
                                             "accountId": acct, "name": f"{name}-<build date at up>"}]}]
    return out


def planned_id(declared: Declared, region: str) -> str:
    """The id the plan gave a declared resource (what another resource's input holds when it names this one)."""
    return _placeholder_outputs(declared.type, declared.name, declared.inputs, region)["id"]


def planned_outputs(declared: Declared, region: str) -> dict[str, Any]:
    """What the plan gave a declared resource beside its inputs: id, ARN and the values AWS computes."""
    return _placeholder_outputs(declared.type, declared.name, declared.inputs, region)


def _mocks(region: str, facts: AccountFacts) -> Mocks:
    from pulumi.runtime import MockCallArgs, MockResourceArgs, Mocks

    class PlanMocks(Mocks):
        def new_resource(self, args: MockResourceArgs) -> tuple[str | None, dict[str, Any]]:
            outputs = _placeholder_outputs(args.typ, args.name, args.inputs, region)
            return outputs.pop("id"), {**args.inputs, **outputs}

        def call(self, args: MockCallArgs) -> tuple[dict[str, Any], list[tuple[str, str]] | None]:
            if args.token == "aws:ssm/getParameter:getParameter":
                name = args.args["name"]
                return {"name": name, "type": "String", "value": f"<AMI from {name} at up>"}, []
            if args.token == "aws:ec2/getAmi:getAmi":  # a parent image by exact name and owner
                (name,) = next(f["values"] for f in args.args["filters"] if f["name"] == "name")
                ami = planned_ami_id(f"{region}/{args.args['owners'][0]}/{name}")
                return {"id": ami, "imageId": ami, "name": name, "architecture": "x86_64", "state": "available"}, []
            if args.token == "aws:index/getCallerIdentity:getCallerIdentity":
                return {"accountId": MOCK_ACCOUNT, "arn": f"arn:aws:iam::{MOCK_ACCOUNT}:user/plan",
                        "userId": "plan"}, []
            if args.token == "aws:iam/getRoles:getRoles":
                # ListRoles by path: the spot service-linked role's, when the account has it.
                path = account.service_role_path(account.SPOT_SERVICE)
                names = [account.SPOT_ROLE] if args.args.get("pathPrefix") == path and facts.spot_role else []
                arns = [account.service_role_arn(MOCK_ACCOUNT, account.SPOT_SERVICE, n) for n in names]
                return {**args.args, "id": region, "names": names, "arns": arns}, []
            if args.token == "aws:ebs/getDefaultKmsKey:getDefaultKmsKey":
                return {"id": region, "region": region, "keyArn": facts.ebs_key(region)[0]}, []
            if args.token == "aws:kms/getKey:getKey":
                key_id, key_arn = facts.ebs_key(region)
                if args.args["keyId"] not in (key_id, key_arn):
                    raise NotImplementedError(f"the offline plan knows no KMS key {args.args['keyId']}")
                return {"id": key_arn.rsplit("/", 1)[1], "keyId": args.args["keyId"], "arn": key_arn,
                        "keyManager": "CUSTOMER" if facts.customer_managed_ebs_key else "AWS",
                        "keyState": "Enabled", "enabled": True, "keyUsage": "ENCRYPT_DECRYPT",
                        "keySpec": "SYMMETRIC_DEFAULT", "origin": "AWS_KMS", "awsAccountId": MOCK_ACCOUNT}, []
            raise NotImplementedError(f"the offline plan has no answer for {args.token}")

    return PlanMocks()


def _recording_monitor(mocks: Mocks, declared: list[Declared]) -> MockMonitor:
    """The mock runtime's monitor, appending every resource the program registers to `declared`."""
    from pulumi.runtime import rpc
    from pulumi.runtime.mocks import MockMonitor

    class RecordingMonitor(MockMonitor):
        def RegisterResource(self, request: RegisterResourceRequest) -> RegisterResourceResponse:
            response = super().RegisterResource(request)
            if request.type != "pulumi:pulumi:Stack":
                declared.append(
                    Declared(
                        type=request.type,
                        name=request.name,
                        urn=response.urn,
                        parent_urn=request.parent,
                        inputs=rpc.deserialize_properties(request.object),
                        retain_on_delete=bool(request.retainOnDelete),
                        provider=request.provider,
                        delete_before_replace=request.deleteBeforeReplace,
                        ignore_changes=tuple(request.ignoreChanges),
                        dependencies=tuple(request.dependencies),
                    )
                )
            return response

    return RecordingMonitor(mocks)


def pulumi_config(stack: Stack) -> dict[str, str]:
    """The validated stack as Pulumi hands config to a program: structured values arrive as JSON text."""
    config = stack_config(stack)
    return {REGION_KEY: config[REGION_KEY], CONFIG_KEY: json.dumps(config[CONFIG_KEY])}


def run_program(stack: Stack, program: Callable[[], None], config: dict[str, str] | None = None,
                facts: AccountFacts = NEW_ACCOUNT) -> list[Declared]:
    """Run the Pulumi `program` for `stack` under the mock runtime. Returns what it declared, in declaration order.

    `config` replaces the stack's own config, as `pulumi up` would read it from the stack file; `facts` is the
    account the program's look-ups see."""
    import pulumi
    from pulumi.runtime import settings
    from pulumi.runtime.stack import run_pulumi_func
    from pulumi.runtime.sync_await import _sync_await

    declared: list[Declared] = []
    monitor = _recording_monitor(_mocks(stack.region, facts), declared)
    settings.ROOT.set(None)  # a fresh stack on every run, also when one process plans several stacks
    pulumi.runtime.set_all_config(config or pulumi_config(stack))
    pulumi.runtime.set_mocks(monitor.mocks, project="gpucluster", stack=stack.name, preview=False, monitor=monitor)

    address = checkip.PLANNED_ADDRESS.set(facts.operator_ip)
    try:
        _sync_await(run_pulumi_func(program))
    finally:
        checkip.PLANNED_ADDRESS.reset(address)
    return declared
