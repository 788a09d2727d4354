"""The offline plan: run the real Pulumi program under Pulumi's mock runtime and record what it declares.

No credentials, no network, no Pulumi CLI. Where AWS would compute a value (an id, the AMI behind an SSM parameter),
the plan shows a placeholder that says so.
"""

from __future__ import annotations

import hashlib
import json
import runpy
import sys
from dataclasses import dataclass
from typing import Any

from gpucluster import sources
from gpucluster.spec import CONFIG_KEY, REGION_KEY, Stack, stack_config

MOCK_ACCOUNT = "123456789012"
# An interface's private IP as AWS gives it, from the documentation range (RFC 5737): never a real address.
PLAN_INTERFACE_IP = "192.0.2.10"


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


def _placeholder_outputs(typ: str, name: str, inputs: dict[str, Any], region: str) -> dict[str, Any]:
    """Values AWS would compute, for the program's `apply`s and exports to run on."""
    out: dict[str, Any] = {"arn": f"arn:aws:plan:{region}:{MOCK_ACCOUNT}:{name}"}
    if typ in IMAGE_BUILDER_ARNS:
        kind, version = IMAGE_BUILDER_ARNS[typ]
        out["arn"] = f"arn:aws:imagebuilder:{region}:{MOCK_ACCOUNT}:{kind}/{name.lower()}{version}"
    if "name" not in inputs:
        out["name"] = name
    if typ == "aws:ec2/launchTemplate:LaunchTemplate":
        out["latestVersion"] = 1
    elif typ == "aws:s3/bucket:Bucket":
        out["bucket"] = f"{name}-<suffix at up>"
    elif typ == "aws:ec2/instance:Instance":
        out["privateIp"] = "<private IP at up>"
    elif typ == "aws:ec2/networkInterface:NetworkInterface":
        out["privateIp"] = PLAN_INTERFACE_IP
    elif typ == "aws:fsx/lustreFileSystem:LustreFileSystem":
        out["dnsName"] = f"<{name} DNS name at up>"
        out["mountName"] = "<mount name at up>"
    elif typ == "aws:sqs/queue:Queue":
        out["url"] = f"https://sqs.{region}.amazonaws.com/{MOCK_ACCOUNT}/{name}-<suffix at up>"
    elif typ == "aws:budgets/budgetAction:BudgetAction":
        out["actionId"] = "<action id at up>"
    elif typ == "aws:imagebuilder/image:Image":
        out["outputResources"] = [{"amis": [{"image": planned_ami_id(name), "region": region,
                                             "accountId": MOCK_ACCOUNT, "name": f"{name}-<build date at up>"}]}]
    return out


def _mocks(region: str):  # type: ignore[no-untyped-def]
    from pulumi.runtime import Mocks

    class PlanMocks(Mocks):
        def new_resource(self, args):  # type: ignore[no-untyped-def]
            state = {**args.inputs, **_placeholder_outputs(args.typ, args.name, args.inputs, region)}
            return f"{args.name}-id", state

        def call(self, args):  # type: ignore[no-untyped-def]
            if args.token == "aws:ssm/getParameter:getParameter":
                name = args.args["name"]
                return {"name": name, "type": "String", "value": f"<AMI from {name} at up>"}
            if args.token == "aws:index/getCallerIdentity:getCallerIdentity":
                return {"accountId": MOCK_ACCOUNT, "arn": f"arn:aws:iam::{MOCK_ACCOUNT}:user/plan", "userId": "plan"}
            raise NotImplementedError(f"the offline plan has no answer for {args.token}")

    return PlanMocks()


def _recording_monitor(mocks):  # type: ignore[no-untyped-def]
    from pulumi.runtime import rpc
    from pulumi.runtime.mocks import MockMonitor

    class RecordingMonitor(MockMonitor):
        def __init__(self, mocks):  # type: ignore[no-untyped-def]
            super().__init__(mocks)
            self.declared: list[Declared] = []

        def RegisterResource(self, request):  # type: ignore[no-untyped-def]
            response = super().RegisterResource(request)
            if request.type != "pulumi:pulumi:Stack":
                self.declared.append(
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


def run_program(stack: Stack, config: dict[str, str] | None = None) -> list[Declared]:
    """Run `__main__.py` for `stack` under the mock runtime. Returns what it declared, in declaration order.

    `config` replaces the stack's own config, as `pulumi up` would read it from the stack file."""
    import pulumi
    from pulumi.runtime import settings
    from pulumi.runtime.stack import run_pulumi_func
    from pulumi.runtime.sync_await import _sync_await

    if str(sources.ROOT) not in sys.path:
        sys.path.insert(0, str(sources.ROOT))
    monitor = _recording_monitor(_mocks(stack.region))
    settings.set_root_resource(None)  # a fresh stack on every run, also when one process plans several stacks
    pulumi.runtime.set_all_config(config or pulumi_config(stack))
    pulumi.runtime.set_mocks(monitor.mocks, project="gpucluster", stack=stack.name, preview=False, monitor=monitor)

    def program() -> None:
        runpy.run_path(str(sources.PROGRAM), run_name="__main__")

    _sync_await(run_pulumi_func(program))
    return monitor.declared
