"""The steps `pulumi destroy` runs before it deletes the cluster's declared resources: the fleet Slurm launched goes
first, and the file system is flushed to S3 before it goes.

Each step is a dynamic resource whose *delete* does the work (gpucluster.aws.teardown). Why a dynamic resource: Pulumi
deletes a resource before everything it depends on, so a step that depends on the network, the placement groups, the
launch templates and the head node runs before any of them is deleted; and a dynamic provider is serialised into the
stack's state, so `pulumi destroy` runs it without the program. (A resource hook would need `pulumi destroy
--run-program` every time; the command provider would need the AWS CLI and another plugin on the destroying machine.)
The provider runs where `pulumi destroy` runs, with its AWS credentials (AWS_PROFILE or keys from the
environment) and the stack's region, passed in; it is pickled by reference to this module, so `destroy` must run
from the project directory, as Pulumi's own commands do.

Creating or updating a step does nothing; a step is never replaced (a replacement would delete it: terminate the
fleet during an `up`). For the same reason its URN must never change: renaming the cluster, a step, its component
or its type, or moving it to another parent, makes `pulumi up` delete the old step, which terminates the running
fleet and deletes the munge key and the node images. tests/test_teardown.py pins the URNs.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pulumi
from pulumi.dynamic import CreateResult, DiffResult, Resource, ResourceProvider, UpdateResult

from components import child

PROVIDER_KEY = "__provider"
SKIP_FLUSH = "GPUCLUSTER_SKIP_FLUSH"  # set to 1 for a destroy that gives up what only the file system holds


def _clients(region: str, *services: str) -> list[Any]:
    import boto3
    from botocore.config import Config

    session = boto3.Session(region_name=region)
    retries = Config(retries={"mode": "standard", "max_attempts": 6})  # throttling during a large teardown
    return [session.client(service, config=retries) for service in services]


def _log_to_stderr() -> None:
    """The provider's process has no Pulumi logger: progress goes to stderr, where Pulumi keeps a plugin's output."""
    logger = logging.getLogger("gpucluster.aws.teardown")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("gpucluster teardown: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


class _Step(ResourceProvider):
    """A step that exists to be deleted: create and update only record their inputs."""

    serialize_as_secret_always = False  # it captures nothing secret

    def create(self, props: dict[str, Any]) -> CreateResult:
        return CreateResult(f"{props['name']}", _inputs(props))

    def diff(self, _id: str, olds: dict[str, Any], news: dict[str, Any]) -> DiffResult:
        return DiffResult(changes=_inputs(olds) != _inputs(news), replaces=[], delete_before_replace=False)

    def update(self, _id: str, _olds: dict[str, Any], news: dict[str, Any]) -> UpdateResult:
        # The outputs are what `delete` gets: they must carry the new inputs.
        return UpdateResult(_inputs(news))


def _inputs(props: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in props.items() if k != PROVIDER_KEY}


class FleetTeardownProvider(_Step):
    def delete(self, _id: str, props: dict[str, Any]) -> None:
        from gpucluster.aws import teardown

        _log_to_stderr()
        ec2, ssm = _clients(props["region"], "ec2", "ssm")
        fleet = teardown.Fleet(cluster=props["cluster"], head_instance_id=props["head_instance_id"],
                               munge_key_parameter=props["munge_key_parameter"],
                               timeout_seconds=float(props["timeout_seconds"]),
                               quiet_seconds=float(props["quiet_seconds"]))
        teardown.tear_down_fleet(fleet, ec2, ssm, teardown.SsmChannel(ssm, fleet.head_instance_id))
        for line in props.get("kept", []):
            logging.getLogger("gpucluster.aws.teardown").info("kept: %s", line)


class LustreExportProvider(_Step):
    def delete(self, _id: str, props: dict[str, Any]) -> None:
        import os

        from gpucluster.aws import teardown

        _log_to_stderr()
        if os.environ.get(SKIP_FLUSH) == "1":  # a file system that can no longer export must not block destroy
            logging.getLogger("gpucluster.aws.teardown").warning(
                "%s=1: %s is deleted without exporting what S3 does not have yet", SKIP_FLUSH, props["file_system_id"])
            return
        (fsx,) = _clients(props["region"], "fsx")
        teardown.flush_to_s3(fsx, props["file_system_id"], timeout_seconds=float(props["timeout_seconds"]))


class FleetTeardownStep(Resource, module="gpucluster", name="FleetTeardown"):
    def __init__(self, name: str, props: dict[str, Any], opts: pulumi.ResourceOptions | None = None):
        super().__init__(FleetTeardownProvider(), name, {"name": name, **props}, opts)


class LustreExportStep(Resource, module="gpucluster", name="LustreExport"):
    def __init__(self, name: str, props: dict[str, Any], opts: pulumi.ResourceOptions | None = None):
        super().__init__(LustreExportProvider(), name, {"name": name, **props}, opts)


FLEET_TIMEOUT_SECONDS = 900  # terminating a fleet of p5 takes minutes
FLEET_QUIET_SECONDS = 30  # no instance seen for this long after the head stopped: the fleet is gone
EXPORT_TIMEOUT_SECONDS = 6 * 3600  # an export of a large, freshly written file system takes hours


@dataclass(frozen=True)
class TeardownArgs:
    cluster_name: str
    region: str
    head_instance_id: pulumi.Input[str]
    munge_key_parameter: str
    # Everything the fleet uses and destroy must not delete while it runs: the network, security group, placement
    # groups, launch templates, head node, file system (its flush), budget. The step depends on them all.
    cluster_resources: Sequence[pulumi.Resource]
    kept: Sequence[str] = ()  # what destroy keeps, with its monthly cost (gpucluster.spec.cost.kept_on_destroy)


class Teardown(pulumi.ComponentResource):
    """Runs at `pulumi destroy` before the rest of the cluster: partitions closed, every instance tagged with the
    cluster terminated and awaited, the run-time leftovers deleted."""

    def __init__(self, name: str, args: TeardownArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpucluster:teardown:Teardown", name, None, opts)
        self.step = FleetTeardownStep(
            f"{name}-fleet",
            {"cluster": args.cluster_name, "region": args.region, "head_instance_id": args.head_instance_id,
             "munge_key_parameter": args.munge_key_parameter, "timeout_seconds": FLEET_TIMEOUT_SECONDS,
             "quiet_seconds": FLEET_QUIET_SECONDS,
             "kept": list(args.kept)},
            child(self, depends_on=list(args.cluster_resources)),
        )
        self.register_outputs({})


def lustre_export(name: str, region: str, file_system_id: pulumi.Input[str],
                  opts: pulumi.ResourceOptions) -> LustreExportStep:
    """The file system's flush to S3 at `pulumi destroy`; `opts` must make it depend on the data repository
    association, so that it runs before the association and the file system are deleted."""
    return LustreExportStep(name, {"region": region, "file_system_id": file_system_id,
                                   "timeout_seconds": EXPORT_TIMEOUT_SECONDS}, opts)
