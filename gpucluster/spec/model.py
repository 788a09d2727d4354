"""The per-team stack file: its typed spec and every rule AWS and Slurm would otherwise enforce late.

`load_stack(path)` reads `stacks/Pulumi.<stack>.yaml` and returns a `Stack`, or raises `SpecError` carrying every
problem at once, each as (config path, message).
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails, InitErrorDetails, PydanticCustomError

from gpucluster.contract import people, settings
from gpucluster.spec import bom, catalog, eks, ubuntu_lock

CONFIG_KEY = "gpucluster:cluster"
REGION_KEY = "aws:region"

NAME_RE = r"^[a-z][a-z0-9-]*[a-z0-9]$"
# Pool names become Slurm partition names and node-name prefixes (<pool>-<n>): no '_', ',', '[' or upper case,
# which Slurm's hostlist syntax or DNS would mangle.
POOL_NAME_RE = r"^[a-z][a-z0-9-]{0,22}[a-z0-9]$"
# FSx for Lustre SSD capacity: 1200, 2400, then steps of 2400 GiB (SCRATCH_2 and PERSISTENT_2).
LUSTRE_STEP_GIB = 2400
LUSTRE_THROUGHPUTS = {"PERSISTENT_2": (125, 250, 500, 1000)}
# A pool's smallest root volume; the compute node images are baked at this size, so every pool's template holds them.
MIN_POOL_ROOT_GIB = 120
# The head node's state volume (components/head_node.py): slurmctld's state, MariaDB and Prometheus' history.
HEAD_STATE_GIB = 200
# slurm.conf's MaxJobCount (Slurm's default, named): the jobs slurmctld holds, finished ones too until MinJobAge (5
# minutes) purges them. The team's cap on queued jobs leaves room under it for the admins' jobs and for finished ones.
MAX_JOB_COUNT = 10000
# What slurmctld writes to the state volume for each job it holds (hash.N/job.N/ in its StateSaveLocation, kept until
# the job is purged, minutes after it ended): the batch script, at most max_batch_script_kib, and the environment
# sbatch sends. Slurm does not bound the environment: counted at what sbatch carries under Linux's default 8 MiB stack
# limit (a quarter of it for arguments and environment). A user who raises the limit or uses --export-file can send
# more; the StateVolumeFilling alert watches for that (docs/explanation/security.md).
JOB_ENVIRONMENT_KIB = 2 * 1024
# The share of the state volume those files may take at worst: Prometheus keeps to half of it
# (render/prometheus.RETENTION_SHARE), the rest holds MariaDB and the margin the StateVolumeFilling alert watches.
JOB_FILES_SHARE = 0.25


# Slurm words a pool name may not take. slurm.conf's PartitionName=DEFAULT line sets defaults for the partitions after
# it and defines no partition: src/common/read_config.c (_parse_partitionname) compares the name with
# xstrcasecmp(value, "DEFAULT"), so any case of "default" is taken. ("ALL" is a keyword of Nodes=, AllowGroups= and the
# like, not of PartitionName, and pool names are lowercase anyway.)
SLURM_RESERVED_POOL_NAMES = frozenset({"default"})

# Pulumi auto-names a resource without an explicit name "<logical name>-<7 hex digits>" (pulumi-terraform-bridge:
# resource.NewUniqueHex(name+"-", 7, ...)): 8 characters past the logical name.
AUTONAME_SUFFIX = 8
# The AWS names the program derives from the stack name, with AWS's limit on each (the longest of each kind; a
# `{stack}` is the stack name). Read off components/: NodeImage's build role "<cluster>-<image key>-build" (image keys
# head, compute-nvidia, compute-neuron), NodeAccess's bundle bucket, Budget's guardrail queue and its budget, whose
# name is explicit (no suffix). Limits: IAM role names 64 (IAM quotas page), S3 bucket names 63 (S3 bucket naming
# rules), SQS queue names 80 (CreateQueue), AWS Budgets names 100 (Budgets API, BudgetName). Every other derived name
# (instance profiles and policies 128, Image Builder 128, launch templates 128, SNS topics 256, security groups 255)
# is longer-limited and no longer than these.
DERIVED_NAMES: tuple[tuple[str, str, int, int], ...] = (
    ("IAM role", "gpucluster-{stack}-compute-nvidia-build", 64, AUTONAME_SUFFIX),
    ("IAM role", "gpucluster-{stack}-budget-action", 64, AUTONAME_SUFFIX),
    ("S3 bucket", "gpucluster-{stack}-bundle", 63, AUTONAME_SUFFIX),
    ("SQS queue", "gpucluster-{stack}-guardrail", 80, AUTONAME_SUFFIX),
    ("AWS budget", "gpucluster-{stack}-monthly", 100, 0),
)
# The longest stack name every derived name fits (24 with the IAM build role).
MAX_STACK_NAME = min(limit - suffix - len(t.format(stack="")) for _, t, limit, suffix in DERIVED_NAMES)

# A plain e-mail address, as AWS SNS and Budgets take it: a dot-atom local part and a DNS domain with a letter TLD.
_ATOM = r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+"
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
EMAIL_RE = rf"{_ATOM}(?:\.{_ATOM})*@(?:{_LABEL}\.)+[A-Za-z]{{2,63}}"


class _Model(BaseModel):
    """A mapping of the stack file, named after its key with Spec (`network:` is NetworkSpec): the components of the
    plain names (components/network.py's Network) build what it asks for."""

    # .nan and .inf are floats in YAML 1.1 and 1.2 alike: no field of the spec means anything with them.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def _rule_errors(model: str, problems: Sequence[tuple[tuple[str | int, ...], str]], data: Any) -> ValidationError:
    """Turn cross-field problems into one ValidationError so pydantic reports them next to the field errors."""
    return ValidationError.from_exception_data(
        model,
        [InitErrorDetails(type=PydanticCustomError("rule", msg), loc=loc, input=data) for loc, msg in problems],
    )


class NetworkSpec(_Model):
    # A new VPC's range: a private IPv4 network, /16 to /20 (room for a private and a public subnet). Give each
    # team's stack a range of its own.
    vpc_cidr: str | None = None
    # An existing VPC, with subnet_id, instead of vpc_cidr.
    vpc_id: str | None = Field(default=None, pattern=r"^vpc-[0-9a-f]{8,17}$")
    # The existing VPC's subnet that the nodes and the file system use, with vpc_id.
    subnet_id: str | None = Field(default=None, pattern=r"^subnet-[0-9a-f]{8,17}$")

    @field_validator("vpc_cidr")
    @classmethod
    def _cidr(cls, value: str | None) -> str | None:
        if value is None:
            return value
        try:
            net = ipaddress.IPv4Network(value)
        except ValueError:
            raise ValueError("must be an IPv4 network such as 10.42.0.0/16") from None
        if not 16 <= net.prefixlen <= 20:
            raise ValueError("prefix length must be /16 to /20 (room for a private and a public subnet)")
        if not net.is_private:
            raise ValueError("must be a private range (10.0.0.0/8, 172.16.0.0/12 or 192.168.0.0/16)")
        return value

    @model_validator(mode="after")
    def _one_network(self) -> NetworkSpec:
        existing = (self.vpc_id, self.subnet_id)
        if self.vpc_cidr and any(existing):
            raise _rule_errors("network", [((), "give vpc_cidr (new VPC) or vpc_id + subnet_id (existing), not both")],
                               None)
        if not self.vpc_cidr and not all(existing):
            raise _rule_errors("network", [((), "give vpc_cidr for a new VPC, or both vpc_id and subnet_id")], None)
        return self

    @property
    def creates_vpc(self) -> bool:
        return self.vpc_cidr is not None


def _in_catalog(table: dict[str, catalog.InstanceType], what: str) -> AfterValidator:
    def check(value: str) -> str:
        if value not in table:
            raise ValueError(f"unsupported {what} {value!r}; allowed: {', '.join(table)}")
        return value

    return AfterValidator(check)


AmiId = Annotated[str | None, Field(default=None, pattern=r"^ami-[0-9a-f]{8,17}$")]


class HeadNodeSpec(_Model):
    # The head node's instance type: it runs slurmctld, slurmdbd with MariaDB, Prometheus, Alertmanager and Grafana.
    instance_type: Annotated[str, _in_catalog(catalog.HEAD_NODE, "head node type")] = "m7i.2xlarge"
    # The head node's image. Default: the stack's baked head image, or with image.build false its parent
    # (image.parent_images.head) as it is. A new image replaces the head at `up` (its queue and accounting are kept).
    ami_id: AmiId = None


class PoolSpec(_Model):
    # The pool's Slurm partition, and its nodes' names: <name>-1, <name>-2, ... (not `default`: Slurm reserves it).
    name: str = Field(pattern=POOL_NAME_RE)
    # Every node's EC2 instance type (see Instance types).
    instance_type: Annotated[str, _in_catalog(catalog.ACCELERATED, "instance type")]
    # How the nodes are bought: on demand, as spot, or from a capacity block (named by capacity_reservation_id).
    capacity: Literal["on-demand", "spot", "capacity-block"] = "on-demand"
    # Nodes kept running (always on), at most max_nodes; a capacity-block pool's must equal max_nodes (the block is
    # paid for whole).
    min_nodes: int = Field(default=0, ge=0)
    # The most nodes the pool runs at once.
    max_nodes: int = Field(ge=1, le=1024)
    # EFA network interfaces, for NCCL across nodes. Default: on where the type supports EFA (true where it does not
    # is refused).
    efa: bool | None = None
    # The capacity block's reservation: required with capacity: capacity-block, and only allowed there.
    capacity_reservation_id: str | None = Field(default=None, pattern=r"^cr-[0-9a-f]{8,17}$")
    # The nodes' image. Default: the stack's baked image of the pool's accelerator kind; with image.build false, its
    # pinned parent release (image.parent_images: the Deep Learning Base AMI, the Neuron DLAMI for trn types). It may
    # name an image another stack of the account baked. Not allowed with scheduler: kubernetes.
    ami_id: AmiId = None
    # A spot pool's partition also lists this pool's nodes: when spot capacity runs out, jobs run there.
    fallback: str | None = None
    # Each node's root volume in GiB (encrypted gp3). Container images, enroot caches and checkpoints staged locally
    # need room; the DLAMIs ship 100+ GiB snapshots.
    root_volume_gib: int = Field(default=200, ge=MIN_POOL_ROOT_GIB, le=16384)

    @field_validator("name")
    @classmethod
    def _not_reserved(cls, value: str) -> str:
        if value.lower() in SLURM_RESERVED_POOL_NAMES:
            raise ValueError(f"{value!r} is reserved by Slurm (PartitionName={value} sets partition defaults in "
                             "slurm.conf): choose another name")
        return value

    @model_validator(mode="after")
    def _rules(self) -> PoolSpec:
        problems = _pool_rules(self.model_dump())
        if problems:
            raise _rule_errors("pool", problems, self.name)
        return self

    @property
    def itype(self) -> catalog.InstanceType:
        return catalog.ACCELERATED[self.instance_type]

    @property
    def accelerator(self) -> catalog.Accelerator:
        """The pool's GPUs or Neuron devices: every type a pool may name has them (catalog.ACCELERATED)."""
        if self.itype.accelerator is None:
            allowed = ", ".join(name for name, itype in catalog.ACCELERATED.items() if itype.accelerator)
            raise ValueError(f"pool {self.name}: {self.instance_type} has no accelerator; a pool takes one of: "
                             f"{allowed}")
        return self.itype.accelerator

    @property
    def uses_efa(self) -> bool:
        """EFA is on by default wherever the type supports it."""
        return self.itype.efa_supported if self.efa is None else self.efa


def _pool_rules(pool: dict[str, Any]) -> list[tuple[tuple[str | int, ...], str]]:
    """A pool's rules across its fields, on a mapping: the model's own, and the raw one when a field error (a typo in
    its instance type, say) stopped pydantic before the model's validator, so that it does not hide them. A value of
    the wrong type is left to its field's error."""
    def count(key: str, default: int | None = None) -> int | None:
        value = pool.get(key, default)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    problems: list[tuple[tuple[str | int, ...], str]] = []
    min_nodes, max_nodes = count("min_nodes", 0), count("max_nodes")
    capacity = pool.get("capacity", "on-demand")
    instance_type = pool.get("instance_type")
    itype = catalog.ACCELERATED.get(instance_type) if isinstance(instance_type, str) else None
    if min_nodes is not None and max_nodes is not None and min_nodes > max_nodes:
        problems.append((("min_nodes",), f"must be <= max_nodes ({max_nodes}), got {min_nodes}"))
    if pool.get("efa") is True and itype is not None and not itype.efa_supported:
        with_efa = ", ".join(t.name for t in catalog.ACCELERATED.values() if t.efa_supported)
        problems.append((("efa",), f"{instance_type} does not support EFA; types with EFA: {with_efa}"))
    if capacity == "capacity-block":
        if not pool.get("capacity_reservation_id"):
            problems.append((("capacity_reservation_id",), "a capacity-block pool must name its reservation (cr-...)"))
        if min_nodes is not None and max_nodes is not None and min_nodes != max_nodes:
            problems.append((("min_nodes",), f"a capacity-block pool is paid for whole: min_nodes must equal max_nodes "
                                             f"({max_nodes})"))
    elif pool.get("capacity_reservation_id"):
        problems.append((("capacity_reservation_id",), "only allowed with capacity: capacity-block"))
    if pool.get("fallback") is not None and capacity != "spot":
        problems.append((("fallback",), "only a spot pool falls back (to an on-demand or capacity-block pool)"))
    return problems


class LustreSpec(_Model):
    # The FSx for Lustre deployment type: required unless file_system_id names an existing file system.
    deployment_type: Literal["SCRATCH_2", "PERSISTENT_2"] | None = None
    # The file system's size: 1200, 2400 or a multiple of 2400 GiB (required unless file_system_id).
    storage_capacity_gib: int | None = Field(default=None, ge=1200)
    # PERSISTENT_2's throughput per TiB of storage, in MB/s: 125, 250, 500 or 1000 (required there; AWS fixes
    # SCRATCH_2's).
    throughput_mb_per_tib: int | None = None
    # A team's own S3 location, imported into /fsx; nothing is exported to it. Default: the stack creates a private,
    # versioned, encrypted bucket that /fsx imports from and exports to.
    data_repository: str | None = Field(default=None, pattern=r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[^\s]*)?$")
    # An existing FSx for Lustre file system, mounted as is instead of creating one (with dns_name and mount_name).
    file_system_id: str | None = Field(default=None, pattern=r"^fs-[0-9a-f]{8,17}$")
    # The existing file system's DNS name, with file_system_id: an existing file system is mounted by DNS name and
    # mount name; FSx has no lookup by id in Pulumi.
    dns_name: str | None = None
    # The existing file system's mount name, with file_system_id (`aws fsx describe-file-systems` shows both).
    mount_name: str | None = None
    # What `pulumi destroy` keeps. The data lives in S3 (the association exports to the stack's bucket); the file
    # system is a cache of it that bills every month, so it goes unless asked for. The stack's bucket stays. With a
    # team's bucket nothing is exported: the stack must say whether the file system (homes, checkpoints) stays.
    keep_file_system_on_destroy: bool | None = None
    # Whether `pulumi destroy` keeps the stack's bucket, which holds what was exported from /fsx. Not allowed with
    # data_repository: the stack never deletes a team's bucket.
    keep_bucket_on_destroy: bool = True

    @model_validator(mode="after")
    def _rules(self) -> LustreSpec:
        problems: list[tuple[tuple[str | int, ...], str]] = []
        if self.file_system_id:
            for key in ("deployment_type", "storage_capacity_gib", "throughput_mb_per_tib", "data_repository"):
                if getattr(self, key) is not None:
                    problems.append(
                        ((key,), "not allowed with file_system_id (the existing file system is used as is)"))
            for key in ("dns_name", "mount_name"):
                if not getattr(self, key):
                    problems.append(((key,), "required with file_system_id (see `aws fsx describe-file-systems`)"))
            for key in ("keep_file_system_on_destroy", "keep_bucket_on_destroy"):
                if key in self.model_fields_set:
                    problems.append(((key,), "not allowed with file_system_id (the stack never deletes it)"))
        else:
            if self.deployment_type is None:
                problems.append((("deployment_type",), "required: SCRATCH_2 or PERSISTENT_2 (or file_system_id)"))
            cap = self.storage_capacity_gib
            if cap is None:
                problems.append((("storage_capacity_gib",), "required: 1200, 2400 or a multiple of 2400"))
            elif cap != 1200 and cap % LUSTRE_STEP_GIB:
                lo = cap // LUSTRE_STEP_GIB * LUSTRE_STEP_GIB
                near = f"{lo} or {lo + LUSTRE_STEP_GIB}" if lo else "1200 or 2400"
                problems.append(
                    (("storage_capacity_gib",), f"must be 1200, 2400 or a multiple of 2400 GiB; nearest: {near}")
                )
            allowed = LUSTRE_THROUGHPUTS.get(self.deployment_type or "")
            if allowed and self.throughput_mb_per_tib not in allowed:
                problems.append(
                    (("throughput_mb_per_tib",), f"{self.deployment_type} takes one of {list(allowed)} MB/s per TiB")
                )
            elif not allowed and self.throughput_mb_per_tib is not None and self.deployment_type:
                problems.append((("throughput_mb_per_tib",), f"not settable for {self.deployment_type} (fixed by AWS)"))
            for key in ("dns_name", "mount_name"):
                if getattr(self, key):
                    problems.append(((key,), "only allowed with file_system_id"))
            if self.data_repository and "keep_bucket_on_destroy" in self.model_fields_set:
                problems.append((("keep_bucket_on_destroy",), "not allowed with data_repository (the stack never "
                                 "deletes the team's bucket)"))
            if self.data_repository and self.keep_file_system_on_destroy is None:
                problems.append((("keep_file_system_on_destroy",), "required with data_repository: nothing written "
                                 "under /fsx (homes, checkpoints) is exported to the team's bucket, so say true to "
                                 "keep the file system at `pulumi destroy` (it bills monthly) or false to lose it"))
            if self.keep_file_system_on_destroy and not self.data_repository and not self.keep_bucket_on_destroy:
                problems.append((("keep_bucket_on_destroy",), "must be true when the file system is kept: its "
                                 "association would name a deleted bucket"))
        if problems:
            raise _rule_errors("lustre", problems, None)
        return self

    @property
    def keeps_file_system(self) -> bool:
        return bool(self.keep_file_system_on_destroy)

    @property
    def exports(self) -> bool:
        """Files written under /fsx go to S3: only to the stack's own bucket (a team's bucket is imported only)."""
        return not self.file_system_id and not self.data_repository


class StorageSpec(_Model):
    # FSx for Lustre, linked to S3.
    lustre: LustreSpec


class BudgetSpec(_Model):
    # The monthly budget in US dollars.
    monthly_usd: float = Field(gt=0)
    # Percentages of monthly_usd (each 1 to 1000, none repeated) at which the subscribers hear: each an alert on
    # actual and one on forecasted spend.
    thresholds_percent: list[int] = Field(default=[50, 80, 100], min_length=1)
    # Who receives the budget's and the cluster's alerts (the stack's SNS topic); each confirms AWS's e-mail first.
    notify_emails: list[str] = Field(min_length=1)
    # Percent of the monthly budget in actual spend at which the cluster stops starting GPU nodes: the head node's
    # guardrail closes the partitions and an AWS Budgets action denies the head node's launches. null: alert only.
    act_threshold_percent: int | None = Field(default=100, ge=1, le=1000)
    # US dollars the team's jobs may spend per month (scheduler: slurm): from a cent (0 would hold every job) to
    # monthly_usd. Slurm bills each job the on-demand price of its share of a node (a spot pool at its ceiling) and
    # holds new jobs once the month's quota is spent (GrpTRESMins on its billing TRES, reset monthly). Default:
    # monthly_usd less the cluster's fixed costs (head node, network, Lustre, images), which must leave a quota, so
    # that jobs and fixed costs together stay within the budget.
    quota_usd_per_month: float | None = Field(default=None, ge=0)
    # Cost-allocation tags are account-wide and only the payer account may switch them on; turn this off in a member
    # account of an AWS Organization and ask the payer to activate `gpucluster:stack` once.
    activate_cost_allocation_tag: bool = True

    @model_validator(mode="after")
    def _quota_within_budget(self) -> BudgetSpec:
        if self.quota_usd_per_month is not None and self.quota_usd_per_month > self.monthly_usd:
            raise _rule_errors("budget", [(("quota_usd_per_month",), (
                f"{self.quota_usd_per_month:g} is more than monthly_usd ({self.monthly_usd:g}): the quota must not "
                "let jobs spend past the budget"))], None)
        return self

    @field_validator("thresholds_percent")
    @classmethod
    def _thresholds(cls, value: list[int]) -> list[int]:
        if any(not 1 <= t <= 1000 for t in value):
            raise ValueError("each threshold must be 1..1000 percent of the monthly budget")
        if len(set(value)) != len(value):
            raise ValueError("thresholds must not repeat")
        return sorted(value)

    @field_validator("notify_emails")
    @classmethod
    def _emails(cls, value: list[str]) -> list[str]:
        problems = [((i,), f"not an email address: {e!r}")
                    for i, e in enumerate(value) if not re.fullmatch(EMAIL_RE, e)]
        if problems:
            raise _rule_errors("notify_emails", problems, value)
        return value


class SlurmSpec(_Model):
    # Idle seconds before a cloud node is terminated. Short saves money; long keeps warm nodes for the next job.
    suspend_time_seconds: int = Field(default=600, ge=10, le=86400)
    # How long a launched node may take to register with slurmctld; p5 nodes with 32 EFA interfaces boot slowly.
    resume_timeout_seconds: int = Field(default=1800, ge=300, le=7200)
    # A multi-node job gets all its nodes from EC2 or none (no paying for half a job waiting for the rest).
    all_or_nothing: bool = True
    # Nodes set DOWN for lack of capacity (or another passing cause) become schedulable again after this many
    # seconds, doubled for each failure in a row up to an hour (or this many seconds, if more).
    capacity_retry_seconds: int = Field(default=600, ge=60, le=86400)
    # A spot interruption warning comes two minutes before EC2 reclaims the instance: its jobs get SIGUSR1 to
    # checkpoint, and are requeued this many seconds later (their checkpoint must be written by then).
    checkpoint_grace_seconds: int = Field(default=60, ge=10, le=110)
    # A rebalance recommendation (the spot instance is at higher risk) drains its node: running jobs go on, no new
    # job starts there, and the node gets a fresh instance once idle. false: recommendations are only logged.
    drain_on_rebalance: bool = True
    # Jobs one user may have queued and running at once (each array task counts). More are refused at submission
    # (AssocMaxSubmitJobLimit), so one user's flood of held jobs cannot fill the head or crowd out the team. The
    # admins (root) are outside the team's account and keep submitting.
    max_submitted_jobs_per_user: int = Field(default=1000, ge=1, le=MAX_JOB_COUNT // 2)
    # Jobs one user may have running at once; the rest wait in the queue (reason AssocMaxJobsLimit).
    max_running_jobs_per_user: int = Field(default=500, ge=1, le=MAX_JOB_COUNT // 2)
    # Jobs the whole team may have queued and running at once; at most half of Slurm's MaxJobCount (10000), the rest
    # is room for the admins' jobs and for finished jobs Slurm keeps for a few minutes.
    max_submitted_jobs: int = Field(default=5000, ge=1, le=MAX_JOB_COUNT // 2)
    # Jobs the whole team may have running at once; the rest wait (reason AssocGrpJobsLimit).
    max_running_jobs: int = Field(default=2000, ge=1, le=MAX_JOB_COUNT // 2)
    # The largest batch script sbatch may submit, in KiB (Slurm's own default is 4 MiB). Scripts are small: data and
    # code belong on /fsx. slurmctld keeps each job's script and environment on the head's state volume: a bound
    # whose worst case (10000 jobs, Slurm's MaxJobCount) does not fit in a quarter of it (over 3194 KiB) is refused.
    max_batch_script_kib: int = Field(default=512, ge=16, le=64 * 1024)
    # The partition (a pool's name) of jobs that name none (`sbatch` without `-p`). Default: the NVIDIA pool whose
    # GPU-hour is cheapest (with none, the cheapest Neuron pool), so a forgotten `-p` never lands on the dearest
    # nodes; `plan` says which.
    default_partition: str | None = None

    @model_validator(mode="after")
    def _limits(self) -> SlurmSpec:
        problems = _job_limit_problems(self)
        if problems:
            raise _rule_errors("slurm", problems, None)
        return self


def job_files_worst_case_gib(slurm: SlurmSpec) -> float:
    """The most the queue's job files can take on the head's state volume: every job slurmctld may hold (MaxJobCount,
    finished ones not yet purged included: a user who submits and cancels in a loop is bounded by it, not by the
    cap on queued jobs) with the largest script and environment."""
    return MAX_JOB_COUNT * (slurm.max_batch_script_kib + JOB_ENVIRONMENT_KIB) / (1 << 20)


def job_files_room_gib() -> float:
    return HEAD_STATE_GIB * JOB_FILES_SHARE


def _job_limit_problems(slurm: SlurmSpec) -> list[tuple[tuple[str | int, ...], str]]:
    problems: list[tuple[tuple[str | int, ...], str]] = []
    for per_user, team in (("max_submitted_jobs_per_user", "max_submitted_jobs"),
                           ("max_running_jobs_per_user", "max_running_jobs")):
        if getattr(slurm, per_user) > getattr(slurm, team):
            problems.append(((per_user,), f"must be <= {team} ({getattr(slurm, team)}): one user cannot have more "
                                          "than the whole team"))
    for running, submitted in (("max_running_jobs_per_user", "max_submitted_jobs_per_user"),
                               ("max_running_jobs", "max_submitted_jobs")):
        if getattr(slurm, running) > getattr(slurm, submitted):
            problems.append(((running,), f"must be <= {submitted} ({getattr(slurm, submitted)}): a running job is "
                                         "a submitted one"))
    worst, room = job_files_worst_case_gib(slurm), job_files_room_gib()
    if worst > room:
        problems.append((("max_batch_script_kib",),
                         f"{MAX_JOB_COUNT} jobs (Slurm's MaxJobCount) with scripts of {slurm.max_batch_script_kib} KiB "
                         f"and their environments can take {worst:.0f} GiB of the head's state volume, more than the "
                         f"{room:.0f} GiB kept for them: at most "
                         f"{int(room * (1 << 20) / MAX_JOB_COUNT) - JOB_ENVIRONMENT_KIB} KiB"))
    return problems


class ParentImageSpec(_Model):
    # The image's exact name, ending in its release date YYYYMMDD (AWS's and Canonical's names do): the same in every
    # region (`aws ec2 describe-images --owners OWNER --filters Name=name,Values=NAME`).
    name: str = Field(min_length=3, max_length=128)
    # Who publishes it: `amazon` (AWS's own images) or an account id (Canonical's is 099720109477).
    owner: str = Field(pattern=r"^(amazon|[0-9]{12})$")
    # Its id in given regions, taken instead of looking the name up there (an image copied into your account, say).
    region_ids: dict[str, Annotated[str, Field(pattern=r"^ami-[0-9a-f]{8,17}$")]] = {}

    @field_validator("name")
    @classmethod
    def _dated(cls, value: str) -> str:
        if bom.release_date(value) is None:
            raise ValueError(f"{value!r} does not end in its release date YYYYMMDD: name an exact release (the Ubuntu "
                             "snapshot is checked against the date)")
        return value

    @field_validator("region_ids")
    @classmethod
    def _regions(cls, value: dict[str, str]) -> dict[str, str]:
        problems = [((region,), f"{region!r} is not an AWS region (known: {catalog.REGIONS_SOURCE})")
                    for region in value if region not in catalog.AWS_REGIONS]
        if problems:
            raise _rule_errors("region_ids", problems, value)
        return value

    @classmethod
    def of(cls, parent: bom.ParentImage) -> ParentImageSpec:
        return cls(name=parent.name, owner=parent.owner, region_ids=dict(parent.region_ids))

    @property
    def image(self) -> bom.ParentImage:
        return bom.ParentImage(self.name, self.owner, self.region_ids)


class ParentImagesSpec(_Model):
    # The head node image's parent: Canonical's Ubuntu 24.04 server image.
    head: ParentImageSpec = ParentImageSpec.of(bom.PARENT_IMAGES["head"])
    # The NVIDIA pools' image's parent: AWS's Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 24.04).
    gpu: ParentImageSpec = ParentImageSpec.of(bom.PARENT_IMAGES["gpu"])
    # The Trainium pools' image's parent: AWS's Neuron multi-framework Deep Learning AMI (Ubuntu 24.04).
    neuron: ParentImageSpec = ParentImageSpec.of(bom.PARENT_IMAGES["neuron"])

    def parent(self, role: bom.ParentRole) -> bom.ParentImage:
        spec: ParentImageSpec = getattr(self, role)
        return spec.image


class ImageSpec(_Model):
    # Bake the nodes' software into AMIs with EC2 Image Builder at `up` (about an hour per image when it changes), so
    # that a node starts in seconds. false: stock AMIs, and every node installs its software at first boot (minutes).
    build: bool = True
    # The Ubuntu archive snapshot (a UTC time, YYYYMMDDTHHMMSSZ) every Ubuntu package of the images comes from, at the
    # versions gpucluster/spec/ubuntu-lock.json records for it. Not before any parent image's release date.
    ubuntu_snapshot: str = Field(default=ubuntu_lock.latest_snapshot(), pattern=ubuntu_lock.SNAPSHOT_RE)
    # The exact releases the images are baked on, per role (moving one rebakes that image). Default: the releases
    # gpucluster/spec/bom.py names.
    parent_images: ParentImagesSpec = ParentImagesSpec()

    @field_validator("ubuntu_snapshot")
    @classmethod
    def _locked(cls, value: str) -> str:
        locked = ubuntu_lock.load()
        if value not in locked:
            raise ValueError(f"no versions are locked for snapshot {value}: run `{ubuntu_lock.LOCK_COMMAND} {value}` "
                             f"and commit gpucluster/spec/{ubuntu_lock.LOCK_FILE.name} (locked: {', '.join(locked)})")
        return value


ROLE_ARN_RE = r"^arn:aws:iam::[0-9]{12}:role/[A-Za-z0-9+=,.@_/-]{1,512}$"
# In kubernetes.public_access_cidrs: the public IPv4 address of the machine running `pulumi up` (aws/checkip.py).
OPERATOR = "operator"


class CpuNodesSpec(_Model):
    """The team's CPU node group (components/kubernetes.py CpuNodes): from zero, on demand, for pods that ask for no
    accelerator. Kueue tries its flavour first, so CPU-only work never starts an accelerator node."""

    # A general-purpose type without accelerators (the catalog's head node types: priced in `plan`).
    instance_type: Annotated[str, _in_catalog(catalog.HEAD_NODE, "CPU node type")] = eks.CPU_INSTANCE_TYPE
    # At most this many CPU nodes at once (the group scales from zero; the team's CPU quota is this many nodes' worth).
    max_nodes: int = Field(default=eks.CPU_MAX_NODES, ge=1, le=20)

    @property
    def itype(self) -> catalog.InstanceType:
        return catalog.HEAD_NODE[self.instance_type]


class KubernetesSpec(_Model):
    """The EKS cluster of a `scheduler: kubernetes` stack (components/kubernetes.py)."""

    # A version EKS offers in standard support (gpucluster/spec/eks.py); `preflight` asks EKS whether it still does.
    version: str = eks.DEFAULT_VERSION
    # Who reaches the API server's public endpoint (the nodes use its private one): IPv4 networks, /8 or narrower
    # (never 0.0.0.0/0), and/or `operator`, the public address of the machine running `pulumi up` as a /32, looked up
    # at each `up` from https://checkip.amazonaws.com. `up` declares the cluster's objects through the API, so a stack
    # needs this or private_access_cidrs (docs/how-to/kubernetes.md, "Choosing the way in").
    public_access_cidrs: list[str] = []
    # With an existing network (vpc_id) only: networks that reach the VPC (VPN, Direct Connect, peered VPCs), admitted
    # to the API's private endpoint on TCP 443, for `up` and kubectl run from there. IPv4 networks, /8 or narrower.
    private_access_cidrs: list[str] = []
    # IAM roles granted cluster admin (AmazonEKSClusterAdminPolicy) besides the identity that runs `pulumi up`.
    admin_role_arns: list[Annotated[str, Field(pattern=ROLE_ARN_RE)]] = []
    # The control plane needs subnets in two AZs; the second is a small subnet in this AZ (default: another letter of
    # the stack's region). With an existing network, name a subnet of the VPC in another AZ instead.
    control_plane_availability_zone: str | None = Field(default=None, pattern=r"^[a-z]{2}(-[a-z]+)+-\d[a-z]$")
    # With an existing network (vpc_id): a subnet of the VPC in another AZ, for the control plane (required then).
    control_plane_subnet_id: str | None = Field(default=None, pattern=r"^subnet-[0-9a-f]{8,17}$")
    # The node group for pods that request no accelerator (every key has a default).
    cpu_nodes: CpuNodesSpec = CpuNodesSpec()

    @field_validator("version")
    @classmethod
    def _version(cls, value: str) -> str:
        if value not in eks.VERSIONS:
            raise ValueError(f"unsupported Kubernetes version {value!r}; allowed: {', '.join(eks.VERSIONS)}")
        return value

    @field_validator("public_access_cidrs", "private_access_cidrs")
    @classmethod
    def _cidrs(cls, value: list[str], info: ValidationInfo) -> list[str]:
        public = info.field_name == "public_access_cidrs"
        problems = []
        for i, cidr in enumerate(value):
            if public and cidr == OPERATOR:
                continue
            try:
                net = ipaddress.IPv4Network(cidr)
            except ValueError:
                also = f" or {OPERATOR!r} (the address of the machine running `pulumi up`)" if public else ""
                problems.append(((i,), f"not an IPv4 network{also}: {cidr!r}"))
                continue
            if net.prefixlen < 8:
                problems.append(((i,), f"{cidr} opens the API endpoint to too much of the "
                                       f"{'internet' if public else 'network'}: /8 or narrower"))
            elif public and not net.is_global:
                # EKS refuses such a range at CreateCluster, after this `up` has built the VPC: refused here instead.
                problems.append(((i,), f"{cidr} is not a public network (private, shared or reserved addresses never "
                                       "reach the public endpoint): list public networks or "
                                       f"{OPERATOR!r}; a network reaching the VPC privately belongs in "
                                       "private_access_cidrs"))
        if problems:
            raise _rule_errors(str(info.field_name), problems, value)
        return value


# A person's IAM principal: an IAM user's or role's ARN, a path allowed (arn:PARTITION:iam::ACCOUNT:role/PATH/NAME).
# IAM's patterns (IAM API reference, CreateRole and CreateUser): RoleName and UserName 1-64 ASCII characters of
# [\w+=,.@-], Path `/` or printable ASCII (! to DEL) between slashes (here each segment non-empty). Read in any
# partition so that another one is named in the message; the stack's is `aws` (catalog.AWS_REGIONS).
PRINCIPAL_RE = re.compile(r"arn:(aws(?:-[a-z]+)*):iam::([0-9]{12}):(user|role)/(?:[\x21-\x2e\x30-\x7f]+/)*"
                          r"([\w+=,.@-]{1,64})", re.ASCII)
STACK_PARTITION = "aws"
# What is sometimes taken for a principal: a role session (what `aws sts get-caller-identity` shows under a role) and a
# group. Neither can be one: a session's name is whatever its caller chose, and IAM never names a group as a principal.
SESSION_ARN_RE = re.compile(r"arn:aws(?:-[a-z]+)*:sts::([0-9]{12}):assumed-role/([\w+=,.@-]{1,64})/.+", re.ASCII)
GROUP_ARN_RE = re.compile(r"arn:aws(?:-[a-z]+)*:iam::[0-9]{12}:group/.+")


def principal_key(arn: str) -> tuple[str, ...] | None:
    """Who an ARN names: (partition, account, user|role, name). IAM's user and role names are unique in an account
    regardless of case (CreateRole: "Names are not distinguished by case") and of path, so the key is the lowercased
    name without the path. None: not a principal ARN."""
    match = PRINCIPAL_RE.fullmatch(arn)
    return None if match is None else (*match.group(1, 2, 3), match.group(4).lower())


def _principal_problem(arn: str) -> str | None:
    if session := SESSION_ARN_RE.fullmatch(arn):
        account, role = session.groups()
        return (f"{arn!r} is a session of a role, not a principal (its session name is whatever the caller chose): "
                f"list the role, arn:{STACK_PARTITION}:iam::{account}:role/{role} (with its path, if any)")
    if GROUP_ARN_RE.fullmatch(arn):
        return f"{arn!r} is an IAM group, which IAM never takes as a principal: list its members' user ARNs"
    key = principal_key(arn)
    if key is None:
        return (f"{arn!r} is not allowed: use an IAM role or user ARN such as arn:aws:iam::123456789012:role/alice or "
                "arn:aws:iam::123456789012:user/alice (a path such as role/researchers/alice is allowed)")
    if key[0] != STACK_PARTITION:
        return (f"{arn!r} is in partition {key[0]}: the stack's region is in {STACK_PARTITION} (catalog.AWS_REGIONS), "
                "and IAM principals of one partition cannot act in another")
    return None


class UserSpec(_Model):
    # The person's login name on every node, and their personal group's: a lowercase letter, then lowercase letters,
    # digits, '-' and '_', at most 32 characters; not a name the nodes already have (root, slurm, munge, ubuntu,
    # ssm-user and the other system and package accounts: gpucluster/contract/people.py RESERVED_NAMES).
    name: str
    # The person's uid, and their personal group's gid, on every node: 20000 to 59999 (a range the images and their
    # software never use). Left out: 20000 + (the first 8 bytes of the SHA-256 of the name, big-endian, modulo 40000),
    # which depends on the name alone: adding or removing another person never changes it. When two people's uids meet,
    # give one of them a uid.
    uid: int | None = None
    # The IAM principals (role or user ARNs, a path allowed) allowed to connect as this person, at least one; each names
    # one person only. Not a role session (arn:aws:sts::...:assumed-role/...): list its role.
    principals: list[str] = Field(min_length=1)
    # Admins get sudo in their sessions.
    admin: bool = False
    # The most GPUs this person may have in use at once (Slurm's per-user limit on gres/gpu); at most the cluster's GPUs
    # at max_nodes. Not allowed with scheduler: kubernetes (no per-person limits there). Default: no limit of their own.
    max_gpus: int | None = Field(default=None, ge=1)

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if problem := people.name_problem(value):
            raise ValueError(problem)
        return value

    @field_validator("uid")
    @classmethod
    def _uid(cls, value: int | None) -> int | None:
        if value is not None and (problem := people.uid_problem(value)):
            raise ValueError(problem)
        return value

    @field_validator("principals")
    @classmethod
    def _principals(cls, value: list[str]) -> list[str]:
        problems = [((i,), problem) for i, arn in enumerate(value) if (problem := _principal_problem(arn))]
        if problems:
            raise _rule_errors("principals", problems, value)
        return value

    @property
    def person(self) -> settings.PersonSettings:
        """The account the nodes make: the uid given, or the one assigned from the name; the gid is the uid."""
        uid = self.uid if self.uid is not None else people.assigned_uid(self.name)
        return settings.PersonSettings(name=self.name, uid=uid, gid=uid, admin=self.admin, max_gpus=self.max_gpus)


def ssh_logins(people: Sequence[UserSpec]) -> list[tuple[str, Sequence[str]]]:
    """Who may log in to the head over SSH as whom (`gpucluster ssh-proxy` pushes a key for that account; the users'
    policy allows the push): each person as themselves, by their principals; without people, whoever holds the
    policy as the login user (the account everyone's shell already is). (OS user, IAM principals; none: any caller)."""
    return [(person.name, person.principals) for person in people] or [(settings.LOGIN_USER, ())]


def cluster_gpus(pools: Sequence[Any]) -> int | None:
    """The NVIDIA GPUs of every pool at max_nodes (Slurm's gres/gpu; Neuron devices are gres/neuron), on the pools'
    mappings (also the raw ones when a field error stops pydantic). None when a pool's type or size cannot be read:
    no bound is known then."""
    total = 0
    for pool in pools:
        name = pool.get("instance_type") if isinstance(pool, dict) else None
        itype = catalog.ACCELERATED.get(name) if isinstance(name, str) else None
        count = pool.get("max_nodes") if isinstance(pool, dict) else None
        if itype is None or not isinstance(count, int) or isinstance(count, bool):
            return None
        if itype.accelerator and itype.accelerator.kind == "nvidia":
            total += itype.accelerator.count * count
    return total


def _user_set_problems(spec: dict[str, Any]) -> list[tuple[tuple[str | int, ...], str]]:
    """Rules across the people, on the mapping as given (also run when a field error stops pydantic before
    ClusterSpec's rules): unique names, uids (given or assigned) and principals; max_gpus within the cluster."""
    users = spec.get("users")
    if not isinstance(users, list):
        return []
    problems: list[tuple[tuple[str | int, ...], str]] = []
    names: dict[str, int] = {}
    uids: dict[int, tuple[int, str]] = {}
    principals: dict[tuple[str, ...], tuple[int, int]] = {}
    pools = spec.get("pools")
    gpus = cluster_gpus(pools if isinstance(pools, list) else [])
    # On kubernetes each principal gets one access entry, which EKS allows once per principal (EKS user guide,
    # "Create access entries"): a cluster admin's role cannot also be a person's.
    section = spec.get("kubernetes") if spec.get("scheduler", "slurm") == "kubernetes" else None
    listed_admins = section.get("admin_role_arns") if isinstance(section, dict) else None
    admins = {principal_key(arn) for arn in listed_admins if isinstance(arn, str)} - {None} \
        if isinstance(listed_admins, list) else set()
    for i, user in enumerate(users):
        if not isinstance(user, dict):
            continue
        given, uid = user.get("name"), user.get("uid")
        name = given if isinstance(given, str) and people.name_problem(given) is None else None
        if name is not None and name in names:
            problems.append((("users", i, "name"), f"{name!r} is also users[{names[name]}]'s name"))
        if name is not None and uid is None:
            uid, how = people.assigned_uid(name), f"assigned from the name {name!r}"
        else:
            how = "given"
        if isinstance(uid, int) and not isinstance(uid, bool) and people.uid_problem(uid) is None:
            if uid in uids:
                other, other_how = uids[uid]
                problems.append((("users", i, "uid"), f"{uid} ({how}) is also users[{other}]'s uid ({other_how}): "
                                                      "set `uid` explicitly for one of them"))
            uids.setdefault(uid, (i, how))
        if name is not None:
            names.setdefault(name, i)
        listed = user.get("principals")
        for j, arn in enumerate(listed if isinstance(listed, list) else []):
            key = principal_key(arn) if isinstance(arn, str) else None
            if key is None:
                continue
            if key in admins:
                problems.append((("users", i, "principals", j), f"{arn!r} is also in kubernetes.admin_role_arns: "
                                 "EKS gives a principal one access entry, and the admins' is the cluster's admin"))
            if key in principals and principals[key][0] != i:
                first, at = principals[key]
                problems.append((("users", i, "principals", j), f"{arn!r} is also users[{first}].principals[{at}]: "
                                 "a principal connects as one person only"))
            elif key in principals:
                problems.append((("users", i, "principals", j),
                                 f"{arn!r} is listed twice (principals[{principals[key][1]}])"))
            principals.setdefault(key, (i, j))
        max_gpus = user.get("max_gpus")
        if isinstance(max_gpus, int) and not isinstance(max_gpus, bool) and max_gpus >= 1:
            if spec.get("scheduler", "slurm") == "kubernetes":
                problems.append((("users", i, "max_gpus"), "not allowed with scheduler: kubernetes (per-person limits "
                                                           "are Slurm's; the team's GPUs are shared there)"))
            elif gpus is not None and max_gpus > gpus:
                problems.append((("users", i, "max_gpus"), f"{max_gpus} is more than the cluster's {gpus} GPUs at "
                                                           "max_nodes (NVIDIA pools): it would never limit anything"))
    return problems


@dataclass(frozen=True)
class ImageBuild:
    """One node image that `up` bakes: the head node's, or the compute nodes' of one accelerator kind."""

    role: Literal["head", "compute"]
    accelerator: catalog.AcceleratorKind | None = None

    @property
    def key(self) -> str:
        return self.role if self.accelerator is None else f"{self.role}-{self.accelerator}"


class ClusterSpec(_Model):
    # The team's name: in resource names and tags (gpucluster:team), its Slurm account and its Kubernetes namespace.
    team: str = Field(pattern=NAME_RE, max_length=32)
    # The one AZ of the nodes and the file system (EFA and cluster placement groups need one); in aws:region.
    availability_zone: str = Field(pattern=r"^[a-z]{2}(-[a-z]+)+-\d[a-z]$")
    # slurm: a Slurm head node launching nodes on demand; kubernetes: an EKS cluster (the `kubernetes:` section).
    scheduler: Literal["slurm", "kubernetes"] = "slurm"
    # The EKS cluster (scheduler: kubernetes only; every key has a default).
    kubernetes: KubernetesSpec | None = None
    # A new VPC (vpc_cidr), or an existing network (vpc_id and subnet_id).
    network: NetworkSpec
    # The Slurm head node (scheduler: slurm only).
    head_node: HeadNodeSpec = HeadNodeSpec()
    # The node pools, names unique: each a Slurm partition (or an EKS node group) of one instance type, from zero.
    pools: list[PoolSpec] = Field(min_length=1, max_length=64)
    # The shared file system, mounted at /fsx on every node.
    storage: StorageSpec
    # The monthly AWS budget of the spend tagged with the stack, its alerts, and what acts at its threshold.
    budget: BudgetSpec
    # Slurm's settings (scheduler: slurm only).
    slurm: SlurmSpec = SlurmSpec()
    # The node images (scheduler: slurm only).
    image: ImageSpec = ImageSpec()
    # The people who use the cluster, each with an account of their own on every node (at least one person; names, uids
    # and principals unique). Left out: everyone connects as the shared login user (ubuntu), as before. The Kubernetes
    # flavour takes the list too, without max_gpus (per-person limits are Slurm's): each person's principals get an
    # access entry in the team's group there (none of them may be in kubernetes.admin_role_arns).
    users: list[UserSpec] | None = Field(default=None, min_length=1)

    @property
    def image_builds(self) -> list[ImageBuild]:
        """The images to bake: the head node's unless it names an AMI, and one per accelerator kind of the pools that
        name none (an `ami_id` may be an image another stack of the account baked). None with `image.build: false`."""
        if not self.image.build or self.scheduler == "kubernetes":  # EKS nodes boot EKS's own accelerated AMIs
            return []
        kinds = sorted({acc.kind for p in self.pools if not p.ami_id and (acc := p.itype.accelerator)})
        return ([] if self.head_node.ami_id else [ImageBuild("head")]) + [ImageBuild("compute", k) for k in kinds]

    @property
    def parent_roles(self) -> list[bom.ParentRole]:
        """The parent images the stack's images need (whether baked or installed at first boot)."""
        return _parent_roles(self.model_dump())

    @property
    def people(self) -> tuple[settings.PersonSettings, ...]:
        """The accounts of the stack's people, in its order; none without `users:` (the shared login user then)."""
        return tuple(user.person for user in self.users or ())

    @property
    def eks(self) -> KubernetesSpec:
        """The Kubernetes section, defaults filled in (a kubernetes stack may leave it out)."""
        return self.kubernetes or KubernetesSpec()

    @model_validator(mode="after")
    def _unique_pools(self) -> ClusterSpec:
        problems = _pool_set_problems([p.model_dump() for p in self.pools])
        problems += _scheduler_problems({**self.model_dump(exclude_unset=True), "scheduler": self.scheduler})
        problems += _image_problems(self.image, self.parent_roles)
        problems += _user_set_problems(self.model_dump())
        names = [p.name for p in self.pools]
        if self.slurm.default_partition is not None and self.slurm.default_partition not in names:
            problems.append((("slurm", "default_partition"), f"must name a pool: {names}"))
        if problems:
            raise _rule_errors("cluster", problems, None)
        return self


def _pool_set_problems(pools: list[Any]) -> list[tuple[tuple[str | int, ...], str]]:
    """Rules across the pools. Also run on the raw mappings when a field error stops pydantic before its model
    validators, so that a typo elsewhere does not hide a duplicate name or a bad fallback."""
    pools = [p if isinstance(p, dict) else {} for p in pools]
    seen: dict[str, int] = {}
    problems: list[tuple[tuple[str | int, ...], str]] = []
    for i, pool in enumerate(pools):
        name = pool.get("name")
        if not isinstance(name, str):
            continue
        if name in seen:
            problems.append((("pools", i, "name"), f"duplicate pool name {name!r} (also pools[{seen[name]}])"))
        seen.setdefault(name, i)
    for i, pool in enumerate(pools):
        fallback = pool.get("fallback")
        if fallback is None:
            continue
        target = next((p for p in pools if p.get("name") == fallback), None)
        if target is None or target.get("capacity", "on-demand") == "spot":
            names = [p.get("name") for p in pools if p.get("capacity", "on-demand") != "spot"]
            problems.append((("pools", i, "fallback"), f"must name an on-demand or capacity-block pool: {names}"))
    return problems


def _parent_roles(spec: dict[str, Any]) -> list[bom.ParentRole]:
    """The parent images a stack's mapping needs: the head's unless it names an AMI, and one per accelerator kind of
    the pools that name none (on the raw mapping too, when a field error stops pydantic)."""
    if spec.get("scheduler", "slurm") != "slurm":
        return []
    head = spec.get("head_node")
    roles: list[bom.ParentRole] = [] if isinstance(head, dict) and head.get("ami_id") else ["head"]
    pools = spec.get("pools")
    for pool in pools if isinstance(pools, list) else []:
        name = pool.get("instance_type") if isinstance(pool, dict) else None
        itype = catalog.ACCELERATED.get(name) if isinstance(name, str) else None
        if itype is not None and itype.accelerator is not None and not pool.get("ami_id"):
            roles.append(bom.parent_role(itype.accelerator.kind))
    return sorted(set(roles), key=bom.PARENT_ROLES.index)


def _image_problems(image: ImageSpec, roles: Sequence[bom.ParentRole]) -> list[tuple[tuple[str | int, ...], str]]:
    """A snapshot older than a parent the stack uses: that image's own packages (its python3, say) are newer than the
    snapshot's, which then cannot install beside them (python3-venv depends on exactly one python3)."""
    taken = date(int(image.ubuntu_snapshot[:4]), int(image.ubuntu_snapshot[4:6]), int(image.ubuntu_snapshot[6:8]))
    problems: list[tuple[tuple[str | int, ...], str]] = []
    for role in roles:
        parent = image.parent_images.parent(role)
        if taken < parent.released:
            problems.append((("image", "ubuntu_snapshot"), (
                f"{image.ubuntu_snapshot} predates the {role} parent image {parent.name!r} (released "
                f"{parent.released}): its packages are newer than the snapshot's; take a snapshot from "
                f"{parent.released:%Y%m%d} on (`{ubuntu_lock.LOCK_COMMAND} ID`)")))
    return problems


def _raw_image_problems(spec: dict[str, Any]) -> list[tuple[tuple[str | int, ...], str]]:
    """The image rules on the raw mapping, when a field error elsewhere stopped pydantic before ClusterSpec's rules;
    an image section with errors of its own is left to them."""
    try:
        image = ImageSpec.model_validate(spec.get("image", {}))
    except ValidationError:
        return []
    return _image_problems(image, _parent_roles(spec))


# Namespaces Kubernetes, EKS, the Kubernetes flavour's charts (gpucluster/spec/eks.py) and its burn-in
# (gpucluster/render/kube_health.py) use: no team may be named so.
RESERVED_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease", "kueue-system", "monitoring",
                       "gpucluster-system")
# The Kubernetes flavour's CPU node group and its Kueue flavour (kubernetes.cpu_nodes): no pool may take the name.
CPU_NODES_NAME = "cpu"


def _scheduler_problems(spec: dict[str, Any]) -> list[tuple[tuple[str | int, ...], str]]:
    """The sections each scheduler takes, on the mapping as given (also run when a field error stops pydantic)."""
    scheduler = spec.get("scheduler", "slurm")
    problems: list[tuple[tuple[str | int, ...], str]] = []
    if scheduler == "kubernetes":
        for key, why in (("head_node", "EKS runs the control plane: there is no head node"),
                         ("slurm", "the Slurm settings have no meaning on Kubernetes"),
                         ("image", "EKS nodes boot EKS's accelerated AMIs: nothing is baked")):
            if key in spec:
                problems.append(((key,), f"not allowed with scheduler: kubernetes ({why})"))
        if spec.get("team") in RESERVED_NAMESPACES:
            problems.append((("team",), f"{spec['team']!r} is a namespace the cluster's own software uses (the team "
                             f"gets a namespace of its name): choose another; taken: {', '.join(RESERVED_NAMESPACES)}"))
        pools = spec.get("pools")
        pools = pools if isinstance(pools, list) else []
        for i, pool in enumerate(pools):
            if isinstance(pool, dict) and pool.get("ami_id") is not None:
                problems.append((("pools", i, "ami_id"), "not allowed with scheduler: kubernetes (node groups boot "
                                                         "the EKS-optimized accelerated AMI of the cluster's version)"))
            if isinstance(pool, dict) and pool.get("name") == CPU_NODES_NAME:
                problems.append((("pools", i, "name"), f"{CPU_NODES_NAME!r} is the CPU node group's name and Kueue "
                                                       "flavour on kubernetes: choose another"))
            if isinstance(pool, dict) and pool.get("fallback") is not None and any(
                    isinstance(q, dict) and q.get("fallback") == pool["fallback"] for q in pools[:i]):
                problems.append((("pools", i, "fallback"), f"{pool['fallback']!r} is another spot pool's fallback: on "
                                 "kubernetes a spot pool and its fallback share one node label and Kueue flavour"))
        section = spec.get("kubernetes")
        section = section if isinstance(section, dict) else {}
        network = spec.get("network")
        existing = isinstance(network, dict) and network.get("vpc_id") is not None
        if existing and not section.get("control_plane_subnet_id"):
            problems.append((("kubernetes", "control_plane_subnet_id"), "required with an existing network: a subnet "
                             "of the VPC in another AZ (the EKS control plane needs two)"))
        if not existing and section.get("control_plane_subnet_id"):
            problems.append((("kubernetes", "control_plane_subnet_id"), "only allowed with an existing network "
                             "(vpc_id, subnet_id); a new VPC gets its own"))
        if existing and section.get("control_plane_availability_zone"):
            problems.append((("kubernetes", "control_plane_availability_zone"), "only allowed with a new VPC "
                             "(vpc_cidr); an existing network names control_plane_subnet_id"))
        if section.get("control_plane_availability_zone") is not None \
                and section.get("control_plane_availability_zone") == spec.get("availability_zone"):
            problems.append((("kubernetes", "control_plane_availability_zone"), "must differ from availability_zone "
                             "(EKS needs subnets in two AZs)"))
        problems += _way_in_problems(section, existing)
    elif scheduler == "slurm" and "kubernetes" in spec:
        problems.append((("kubernetes",), "only allowed with scheduler: kubernetes"))
    return problems


def _way_in_problems(section: dict[str, Any], existing: bool) -> list[tuple[tuple[str | int, ...], str]]:
    """`pulumi up` declares the cluster's Helm releases and objects through its API: a stack names how it gets there.
    A VPC this `up` creates has no VPN or peering into it yet, so only the public endpoint can be the way in. In an
    existing network the way may be one this file does not show (a runner inside the VPC whose group the operator
    admits by hand): `plan` warns (`way_in_warning`) and `preflight` fails instead."""
    if section.get("private_access_cidrs") and not existing:
        return [(("kubernetes", "private_access_cidrs"), "only allowed with an existing network (vpc_id): nothing "
                 "outside a VPC this `up` creates can reach into it; use public_access_cidrs (CIDRs or "
                 f"{OPERATOR!r})")]
    if not existing and not section.get("public_access_cidrs"):
        return [(("kubernetes", "public_access_cidrs"), "the cluster's API needs a way in for `pulumi up` and kubectl, "
                 f"or every Helm release and object times out: list {OPERATOR!r} (the public address of the machine "
                 "running `up`, a /32) and/or the IPv4 networks they run from (/8 or narrower) (private_access_cidrs "
                 "needs an existing network: nothing outside a VPC this `up` creates reaches into it)")]
    return []


def way_in_warning(spec: ClusterSpec) -> str | None:
    """An existing network's stack that names no way into the cluster's API: the private endpoint then admits only
    the VPC's own members of the cluster's groups, which no operator's machine is."""
    eks_spec = spec.eks
    if spec.scheduler != "kubernetes" or eks_spec.public_access_cidrs or eks_spec.private_access_cidrs:
        return None
    return ("the cluster's API is private and admits no network outside the VPC's own nodes: `pulumi up` times out "
            "unless it runs where the API's security group admits it. List the networks that reach the VPC (VPN, "
            f"Direct Connect, peering) in kubernetes.private_access_cidrs, or {OPERATOR!r} or CIDRs in "
            "kubernetes.public_access_cidrs")


# IAM Identity Center's permission-set roles: one per permission set assigned to an account, named
# AWSReservedSSO_<set>_<unique suffix> under role/aws-reserved/sso.amazonaws.com/<region>/ (IAM Identity Center user
# guide, "Referencing permission sets in resource policies, Amazon EKS, and AWS KMS").
SSO_ROLE_PREFIX = "awsreservedsso_"  # principal_key's names are lowercased


def sso_role_warnings(spec: ClusterSpec) -> list[tuple[str, str]]:
    """(config path, warning) for each person's principal that is an IAM Identity Center permission-set role: one
    role for everyone the permission set is assigned to, so aws:PrincipalArn (what the person's Session document's
    policy and their EKS access entry match) cannot tell them apart. (Listed for two people it is refused like any
    principal listed twice.)"""
    found = []
    for i, user in enumerate(spec.users or ()):
        for j, arn in enumerate(user.principals):
            key = principal_key(arn)
            if key is not None and key[2] == "role" and key[3].startswith(SSO_ROLE_PREFIX):
                found.append((f"{CONFIG_KEY}.users[{i}].principals[{j}]",
                              f"{arn} is an IAM Identity Center permission-set role, which every user the permission "
                              f"set is assigned to signs in as: each of them may connect as {user.name}. Give each "
                              "person a role of their own (a permission set per person, or an IAM role each person "
                              "assumes). Telling the permission set's users apart would need their session's "
                              "aws:userid (AROA...:<username>), which starts with the role's unique id: IAM assigns "
                              "it when Identity Center creates the role, and a stack file cannot name it"))
    return found


@dataclass(frozen=True)
class Stack:
    """A validated stack: its name (from the file name), region and cluster spec."""

    name: str
    region: str
    spec: ClusterSpec

    @property
    def cluster_name(self) -> str:
        return f"gpucluster-{self.name}"

    @property
    def budget_name(self) -> str:
        """The AWS Budget of the stack (the guardrail and `cost` read it by this name)."""
        return f"{self.cluster_name}-monthly"

    @property
    def tags(self) -> dict[str, str]:
        return {settings.CLUSTER_TAG: self.cluster_name, settings.TEAM_TAG: self.spec.team,
                settings.STACK_TAG: self.name}


class SpecError(Exception):
    """Every problem found in a stack, each as (config path, message)."""

    def __init__(self, source: str, problems: list[tuple[str, str]]):
        self.source = source
        self.problems = problems
        super().__init__(self.render())

    def render(self) -> str:
        lines = [f"{self.source}: {len(self.problems)} problem(s):"]
        lines += [f"  {path}: {msg}" for path, msg in self.problems]
        return "\n".join(lines)


def _path(loc: tuple[str | int, ...]) -> str:
    out = CONFIG_KEY
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


# What a field's pattern allows, in words, keyed by the field's name.
PATTERN_HELP = {
    "team": "lowercase letters, digits and '-', starting with a letter (used in names and tags)",
    "name": "2-24 lowercase letters, digits and '-', starting with a letter (a Slurm partition and node-name prefix)",
    "availability_zone": "an availability zone such as us-east-1a",
    "vpc_id": "a VPC id such as vpc-0123456789abcdef0",
    "subnet_id": "a subnet id such as subnet-0123456789abcdef0",
    "capacity_reservation_id": "a capacity reservation id such as cr-0123456789abcdef0",
    "ami_id": "an AMI id such as ami-0123456789abcdef0",
    "file_system_id": "an FSx file system id such as fs-0123456789abcdef0",
    "data_repository": "an S3 URL such as s3://bucket/prefix",
    "admin_role_arns": "an IAM role ARN such as arn:aws:iam::123456789012:role/platform-admins",
    "control_plane_subnet_id": "a subnet id such as subnet-0123456789abcdef0",
    "control_plane_availability_zone": "an availability zone such as us-east-1b",
    "ubuntu_snapshot": "a UTC time YYYYMMDDTHHMMSSZ such as 20261201T171259Z (an Ubuntu snapshot's id)",
    "owner": "amazon or a 12-digit account id",
}


# Keys an earlier release read, and what took their place.
RENAMED = {
    "keep_on_destroy": "keep_file_system_on_destroy (default false) and keep_bucket_on_destroy (default true)",
    "gpu_hours_per_month": "quota_usd_per_month (the quota in US dollars, which a mix of pools cannot overshoot; "
                           "default: the budget less the fixed costs)",
}


def _message(err: ErrorDetails) -> str:
    field = next((part for part in reversed(err["loc"]) if isinstance(part, str)), "")  # a list item: its list
    if err["type"] == "string_pattern_mismatch" and field in PATTERN_HELP:
        return f"{err['input']!r} is not allowed: use {PATTERN_HELP[field]}"
    if err["type"] == "extra_forbidden":
        if field in RENAMED:
            return f"renamed: {RENAMED[field]}"
        return "unknown key (check the spelling; the keys: docs/reference/stack-file.md)"
    if err["type"] == "missing":
        return "required key is missing"
    if err["type"] == "model_type":  # pydantic would add "or instance of <the model's Python class>"
        return "Input should be a valid dictionary"
    return err["msg"].removeprefix("Value error, ")


def _region_problems(region: Any) -> list[tuple[str, str]]:
    if region is None:
        return [(REGION_KEY, "required: the AWS region, e.g. us-east-1")]
    if not isinstance(region, str) or region not in catalog.AWS_REGIONS:
        return [(REGION_KEY, (f"{region!r} is not an AWS region (known: {catalog.REGIONS_SOURCE}): use one such "
                              "as us-east-1"))]
    return []


def _stack_name_problems(stack: str) -> list[tuple[str, str]]:
    if not re.fullmatch(NAME_RE, stack):
        return [("stack", f"stack name {stack!r} must be lowercase letters, digits and '-'")]
    if len(stack) > MAX_STACK_NAME:
        worst = min(DERIVED_NAMES, key=lambda d: d[2] - d[3] - len(d[1].format(stack="")))
        name = worst[1].format(stack=stack)
        return [("stack", (f"stack name {stack!r} is {len(stack)} characters; at most {MAX_STACK_NAME} fit AWS's "
                           f"names (the {worst[0]} {name}{'-xxxxxxx' if worst[3] else ''} would be "
                           f"{len(name) + worst[3]} of {worst[2]})"))]
    return []


# Every key of the spec that names an availability zone: each must be a zone of aws:region (a test walks the models
# for keys named *availability_zone and expects them here).
ZONE_KEYS: tuple[tuple[str, ...], ...] = (("availability_zone",), ("kubernetes", "control_plane_availability_zone"))


def _zone_problems(raw: dict[str, Any], region: str) -> list[tuple[str, str]]:
    """Zones outside the stack's region (a malformed zone is its field's own error)."""
    problems = []
    for loc in ZONE_KEYS:
        value: Any = raw
        for key in loc:
            value = value.get(key) if isinstance(value, dict) else None
        if isinstance(value, str) and re.fullmatch(r"[a-z]{2}(-[a-z]+)+-\d[a-z]", value) \
                and not re.fullmatch(re.escape(region) + "[a-z]", value):
            problems.append((_path(loc), f"{value} is not in region {region}"))
    return problems


def validate(stack: str, config: dict[str, Any], source: str = "") -> Stack:
    """Validate the `config:` mapping of a stack file. Raises SpecError listing every problem: field errors, the
    rules across fields and the region's, all at once (a field error does not hide the others)."""
    problems: list[tuple[str, str]] = []
    region = config.get(REGION_KEY)
    problems += _region_problems(region)
    problems += _stack_name_problems(stack)
    raw = config.get(CONFIG_KEY)
    spec = None
    if not isinstance(raw, dict):
        problems.append((CONFIG_KEY, "required: the cluster mapping (team, availability_zone, network, pools, ...)"))
    else:
        try:
            spec = ClusterSpec.model_validate(raw)
        except ValidationError as exc:
            found = [(_path(e["loc"]), _message(e)) for e in exc.errors()]
            # Pydantic skips a model's own validators when one of its fields fails: run each pool's rules and the
            # rules across pools on the raw mappings, keeping what pydantic did not already say.
            if isinstance(raw.get("pools"), list):
                rules = [(("pools", i, *loc), msg) for i, pool in enumerate(raw["pools"]) if isinstance(pool, dict)
                         for loc, msg in _pool_rules(pool)]
                found += [(p, m) for p, m in dict.fromkeys((_path(loc), msg) for loc, msg in
                                                           rules + _pool_set_problems(raw["pools"]))
                          if (p, m) not in found]
            found += [(p, m) for p, m in ((_path(loc), msg) for loc, msg in
                                          _scheduler_problems(raw) + _raw_image_problems(raw) +
                                          _user_set_problems(raw))
                      if (p, m) not in found]
            problems += found
        if isinstance(region, str) and not _region_problems(region):
            problems += _zone_problems(raw, region)
            if spec is not None:  # the quota needs the whole stack's fixed costs
                from gpucluster.spec import cost  # cost builds on this module

                problems += [(_path(loc), msg) for loc, msg in cost.quota_problems(Stack(stack, region, spec))]
    if problems or spec is None or not isinstance(region, str):  # a region that is no string is among the problems
        raise SpecError(source or stack, problems)
    return Stack(name=stack, region=region, spec=spec)


def stack_name_from_path(path: Path) -> str:
    match = re.fullmatch(r"Pulumi\.(.+)\.ya?ml", path.name)
    if not match:
        raise SpecError(str(path), [("file", "a stack file is named Pulumi.<stack>.yaml")])
    return match.group(1)


def stack_config(stack: Stack) -> dict[str, Any]:
    """The `config:` mapping of the validated stack, as the stack file gave it (defaults left out, explicit nulls
    kept)."""
    return {REGION_KEY: stack.region, CONFIG_KEY: stack.spec.model_dump(mode="json", exclude_unset=True)}


def stack_file(stack: Stack) -> str:
    """The validated stack as a stack file (JSON is YAML): what the head node's `gpucluster` command reads."""
    return json.dumps({"config": stack_config(stack)}, indent=1, sort_keys=True) + "\n"


# PyYAML reads YAML 1.1; Pulumi reads the same stack file with Go's YAML 1.2 reader. Where the two disagree on what a
# plain (unquoted) scalar is, the stack file is refused rather than read as YAML 1.2 here: a file is checked by this
# module and then deployed by Pulumi, and only a file both readers take the same way makes the check mean anything.
# (Reading as 1.2 here would still leave `yes` a string here and a string in Pulumi while the author meant a boolean.)
_YAML12_BOOL = re.compile(r"true|True|TRUE|false|False|FALSE")
_YAML12_INT = re.compile(r"[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+")
_YAML12_FLOAT = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?|[-+]?\.(inf|Inf|INF)|\.(nan|NaN|NAN)")
_YAML12_NULL = re.compile(r"~|null|Null|NULL|")


def _yaml12_kind(text: str) -> str:
    """What YAML 1.2's core schema makes of a plain scalar."""
    for kind, pattern in (("null", _YAML12_NULL), ("bool", _YAML12_BOOL), ("int", _YAML12_INT),
                          ("float", _YAML12_FLOAT)):
        if pattern.fullmatch(text):
            return kind
    return "str"


_YAML11_KIND = {"tag:yaml.org,2002:null": "null", "tag:yaml.org,2002:bool": "bool", "tag:yaml.org,2002:int": "int",
                "tag:yaml.org,2002:float": "float", "tag:yaml.org,2002:timestamp": "timestamp"}


def _scalar_problem(node: yaml.ScalarNode) -> str | None:
    if node.style or not node.tag.startswith("tag:yaml.org,2002:"):
        return None  # quoted, block or explicitly tagged: both readers agree (libyaml marks plain "", PyYAML None)
    # y/Y/n/N are booleans in the YAML 1.1 spec's bool type (and Go's yaml.v2) though PyYAML leaves them strings.
    v11 = "bool" if node.value in ("y", "Y", "n", "N") else _YAML11_KIND.get(node.tag, "str")
    v12 = _yaml12_kind(node.value)
    if v11 == v12 and (v11 != "int" or not re.fullmatch(r"[-+]?0[0-9]+", node.value)):
        return None
    if v11 == "bool" or v12 == "bool":
        return (f"{node.value!r} is a boolean in YAML 1.1 but not in YAML 1.2 (Pulumi's reader): write true or false, "
                "or quote it if it is a string")
    if v11 == "int" and v12 == "int":
        return (f"{node.value!r} is octal in YAML 1.1 but decimal in YAML 1.2 (Pulumi's reader): write the number "
                "without the leading 0, or quote it if it is a string")
    if ":" in node.value and v11 in ("int", "float"):
        return (f"{node.value!r} is a base-60 number in YAML 1.1 but a string in YAML 1.2 (Pulumi's reader): quote "
                "it, or write the number in decimal")

    def kind(k: str) -> str:
        return {"str": "a string", "int": "an integer", "float": "a float", "null": "null"}.get(k, f"a {k}")

    return (f"{node.value!r} is {kind(v11)} in YAML 1.1 but {kind(v12)} in YAML 1.2 (Pulumi's reader): quote it if "
            "it is a string, or write the number in plain decimal")


def _node_problems(node: yaml.Node, path: list[str | int]) -> list[tuple[list[str | int], str]]:
    """Duplicate keys (PyYAML keeps the last one silently) and YAML 1.1-only scalars, each with its path."""
    out: list[tuple[list[str | int], str]] = []
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key, value in node.value:
            name = key.value if isinstance(key, yaml.ScalarNode) else str(key.tag)
            if isinstance(key, yaml.ScalarNode) and key.value == "<<":
                out.append((path, "merge keys (<<) are YAML 1.1 only: write the keys out"))
                continue
            if isinstance(key, yaml.ScalarNode) and (problem := _scalar_problem(key)):
                out.append((path + [name], f"key {problem}"))
            if name in seen:
                out.append((path + [name], (f"duplicate key (also on line {seen[name] + 1}); "
                                             "YAML keeps only the last one")))
            seen.setdefault(name, key.start_mark.line)
            out += _node_problems(value, path + [name])
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            out += _node_problems(item, path + [i])
    elif isinstance(node, yaml.ScalarNode) and _long_int(node):
        out.append((path, (f"an integer written in {len(node.value):,} characters: no figure of a stack file "
                           f"needs more than {MAX_INT_CHARS}")))
    elif isinstance(node, yaml.ScalarNode):
        problem = _scalar_problem(node)
        if problem:
            out.append((path, problem))
    return out


def _doc_path(path: list[str | int]) -> str:
    """A document path as the config path the other messages use."""
    if path[:2] == ["config", CONFIG_KEY]:
        return _path(tuple(path[2:]))
    if path[:1] == ["config"] and len(path) > 1:
        rest = path[1:]
        return str(rest[0]) + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in rest[1:])
    return ".".join(str(p) for p in path) or "file"


# A stack file is answered in bounded time and memory whatever it holds (issue 27): the shipped stacks are a few KiB
# with a few hundred YAML nodes at most 6 levels deep, and no aliases. The caps sit far above any real stack file and
# far below what would take seconds: libyaml's events cost about 3 us each here, PyYAML's pure-Python reader 40 us.
MAX_STACK_BYTES = 1024 * 1024
MAX_YAML_NODES = 20_000
MAX_YAML_DEPTH = 32
# Integers of the stack file are counts, sizes, uids and dollars: 18 digits hold any of them (and every int64).
MAX_INT_CHARS = 18
# What YAML's reader takes but no stack file needs and a terminal may act on: C0 controls other than tab, line feed
# and carriage return, DEL, and C1 controls.
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")
# libyaml's reader when PyYAML was built with it (Debian's python3-yaml and the PyPI wheels are); else PyYAML's own.
_LOADER: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _long_int(node: yaml.Node) -> bool:
    return node.tag == "tag:yaml.org,2002:int" and len(node.value) > MAX_INT_CHARS


class _StackLoader(_LOADER):  # type: ignore[valid-type,misc]  # the C or the Python loader, whichever PyYAML has
    """Leaves an integer too long for any figure as its text (Python refuses to read one past 4300 digits with a
    ValueError): _node_problems reports it with its path, and the file is refused."""

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int | str:
        return str(node.value) if _long_int(node) else int(super().construct_yaml_int(node))


_StackLoader.add_constructor("tag:yaml.org,2002:int", _StackLoader.construct_yaml_int)


class NotAFile(SpecError):
    """A stack file's name on something that is not a regular file (a FIFO, a directory, a device)."""


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _read_bytes(path: Path) -> bytes:
    """At most MAX_STACK_BYTES + 1 bytes of a regular file. Opened without blocking and looked at before any read:
    reading a FIFO waits for a writer that may never come, a device may never end."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # O_NONBLOCK changes nothing for a regular file's reads
    except FileNotFoundError:
        raise SpecError(str(path), [("file", "no such stack file")]) from None
    except OSError as exc:
        raise SpecError(str(path), [("file", f"cannot read: {exc.strerror}")]) from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = next((name for test, name in _KINDS if test(mode)), "not a file")
            raise NotAFile(str(path), [("file", f"not a regular file ({kind}): a stack file is a file of text")])
        with open(fd, "rb", closefd=False) as handle:
            return handle.read(MAX_STACK_BYTES + 1)
    except OSError as exc:
        raise SpecError(str(path), [("file", f"cannot read: {exc.strerror}")]) from None
    finally:
        os.close(fd)


def _read_text(path: Path, data: bytes | None = None) -> str:
    """The stack file's text, or every reason it is not one; `data`: its bytes read elsewhere (a git revision's)."""
    if data is None:
        data = _read_bytes(path)
    if len(data) > MAX_STACK_BYTES:
        raise SpecError(str(path), [("file", (f"larger than {MAX_STACK_BYTES // 1024} KiB: a stack file is a few KiB "
                                              "(is this the right file?)"))])
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError(str(path), [("file", (f"not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset "
                                              f"{exc.start}): save the file as UTF-8"))]) from None
    found = list(_CONTROL.finditer(text))
    if found:
        first = found[0]
        line = text.count("\n", 0, first.start()) + 1
        column = first.start() - (text.rfind("\n", 0, first.start()) + 1) + 1
        more = f" ({len(found) - 1} more after it)" if len(found) > 1 else ""
        raise SpecError(str(path), [("file", (f"control character U+{ord(first.group()):04X} on line {line}, column "
                                              f"{column}{more}: a stack file holds printable text, tabs and "
                                              "newlines only"))])
    return text


def _shape_problem(text: str) -> str | None:
    """What makes a document too costly to build, found on the event stream before any node is built: an alias (one
    line of aliases can stand for billions of nodes, or for a list inside itself), nesting deeper than MAX_YAML_DEPTH
    (the composer recurses) or more than MAX_YAML_NODES nodes."""
    depth = nodes = 0
    for event in yaml.parse(text, Loader=_LOADER):
        where = f"line {event.start_mark.line + 1}" if event.start_mark else "the document"
        if isinstance(event, yaml.AliasEvent):
            return f"{where}: aliases (*{event.anchor}) are not taken in a stack file: write the value out"
        if isinstance(event, yaml.NodeEvent):
            nodes += 1
            if nodes > MAX_YAML_NODES:
                return f"{where}: more than {MAX_YAML_NODES:,} values: a stack file holds a few hundred"
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_YAML_DEPTH:
                return f"{where}: nested deeper than {MAX_YAML_DEPTH} levels: a stack file nests about 6"
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1
    return None


def _parse(path: Path, text: str) -> tuple[yaml.Node | None, Any]:
    """The stack file's node tree and document, refusing first what would cost unbounded time or memory."""
    try:
        shape = _shape_problem(text)
        if shape:
            raise SpecError(str(path), [("file", shape)])
        loader = _StackLoader(text)
        try:
            node = loader.get_single_node()
            return node, loader.construct_document(node) if node is not None else None
        finally:
            loader.dispose()
    except yaml.YAMLError as exc:  # PyYAML's message spans lines (problem, context, where): one line here
        raise SpecError(str(path), [("file", "not valid YAML: " + " ".join(str(exc).split()))]) from None


def load_stack(path: Path, data: bytes | None = None) -> Stack:
    """The stack file at `path`, or with `data` the bytes it held elsewhere (`plan --against git:REV`): the same
    checks either way; the name is the path's."""
    name = stack_name_from_path(path)
    node, doc = _parse(path, _read_text(path, data))
    syntax = [(_doc_path(p), m) for p, m in _node_problems(node, [])] if node is not None else []
    if not isinstance(doc, dict) or not isinstance(doc.get("config"), dict):
        raise SpecError(str(path), syntax + [("config", "a stack file has a top-level `config:` mapping")])
    try:
        validate(name, doc["config"], str(path))
    except SpecError as exc:
        raise SpecError(str(path), syntax + [p for p in exc.problems if p not in syntax]) from None
    if syntax:
        raise SpecError(str(path), syntax)
    return validate(name, doc["config"], str(path))


def _new_vpc(path: Path) -> tuple[str, ipaddress.IPv4Network] | None:
    """The region and new VPC range a stack file asks for, read without validating it (a sibling's own problems are
    its own plan's to tell); None when it names none that parses."""
    try:
        _, doc = _parse(path, _read_text(path))
    except NotAFile:
        raise
    except SpecError:
        return None
    config = doc.get("config") if isinstance(doc, dict) else None
    cluster = config.get(CONFIG_KEY) if isinstance(config, dict) else None
    network = cluster.get("network") if isinstance(cluster, dict) else None
    region = config.get(REGION_KEY) if isinstance(config, dict) else None
    cidr = network.get("vpc_cidr") if isinstance(network, dict) else None
    try:
        return (region, ipaddress.IPv4Network(cidr)) if isinstance(region, str) and isinstance(cidr, str) else None
    except ValueError:
        return None


def sibling_overlaps(path: Path, stack: Stack, note: Callable[[str], None]) -> list[tuple[str, str]]:
    """The stack's new VPC against those of the other stack files of its directory in its region: teams' VPCs are
    peered or joined to a transit gateway later, which overlapping ranges rule out. Each sibling is only read (the
    same bounded reader), never planned; one that is no regular file is skipped, with a `note`."""
    cidr = stack.spec.network.vpc_cidr
    if cidr is None:
        return []
    mine = ipaddress.IPv4Network(cidr)
    problems = []
    siblings = sorted({*path.parent.glob("Pulumi.*.yaml"), *path.parent.glob("Pulumi.*.yml")})
    for sibling in siblings:
        if sibling.resolve() == path.resolve():
            continue
        try:
            found = _new_vpc(sibling)
        except NotAFile as exc:
            note(f"{sibling} skipped in the check of VPC ranges: {exc.problems[0][1]}")
            continue
        if found and found[0] == stack.region and found[1].overlaps(mine):
            problems.append((_path(("network", "vpc_cidr")),
                             f"{cidr} overlaps {found[1]} of {sibling} (network.vpc_cidr, also in {stack.region}): "
                             "give each stack of a region a range of its own"))
    return problems


def load_stack_among_siblings(path: Path, note: Callable[[str], None]) -> Stack:
    """load_stack, and the stack's VPC range apart from its siblings' (plan and preflight); `note` hears of a
    sibling skipped."""
    stack = load_stack(path)
    overlaps = sibling_overlaps(path, stack, note)
    if overlaps:
        raise SpecError(str(path), overlaps)
    return stack


def stack_from_pulumi_config() -> Stack:
    """The validated stack of the running Pulumi program; bad config stops it with the messages and no traceback."""
    import pulumi

    name = pulumi.get_stack()
    config = {
        REGION_KEY: pulumi.Config("aws").get("region"),
        CONFIG_KEY: pulumi.Config("gpucluster").get_object("cluster"),
    }
    try:
        return validate(name, config, f"stack {name}")
    except SpecError as exc:
        raise pulumi.RunError(exc.render()) from None
