"""The one settings contract between the Pulumi program and the programs that run on the nodes.

The head node component writes `ClusterSettings` (as JSON, into the SSM parameter `/gpucluster/<cluster>/config`);
fetch_bundle.py, bootstrap.py, the node programs and the budget guardrail read it through `ClusterSettings.load`.
Paths, ports and program names live here once, for both sides.

Standard library only: the nodes import this file from the bundle
(`/opt/gpucluster/lib/gpucluster/contract/settings.py`) with the system python3, which has no pydantic.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from gpucluster.contract import people as people_rules

# --- where things are on a node ---------------------------------------------------------------------------------------
BUNDLE_DIR = "/opt/gpucluster"  # the unpacked bundle: lib/ (the library and its node programs), Slurm files, examples
LIB_DIR = f"{BUNDLE_DIR}/lib"  # the gpucluster library (this file among it) and the stack's file
FETCHER = f"{BUNDLE_DIR}/fetch_bundle.py"  # written by cloud-init, run by gpucluster-boot.service at every boot
ETC_DIR = "/etc/gpucluster"
NODE_ENV_FILE = f"{ETC_DIR}/node.env"  # from user data: cluster, region, role, pool, the settings parameter
SETTINGS_FILE = f"{ETC_DIR}/cluster.json"  # ClusterSettings as last fetched
APPLIED_FILE = f"{ETC_DIR}/applied"  # the head: the SHA-256 of the settings (which name the bundle) it has applied
UPDATE_UNIT = "gpucluster-update"  # the head: its timer applies a changed stack (a later `pulumi up`) in place
MUNGE_KEY_STAGED = f"{ETC_DIR}/munge.key"  # the key as fetched (root only), installed by the bootstrap
SLURMD_SPOOL_DIR = "/var/spool/slurmd"
STATE_DIR = "/var/lib/gpucluster"  # the head node's state volume: slurmctld state and MariaDB
LOG_DIR = "/var/log/gpucluster"
NODE_LOG = f"{LOG_DIR}/nodes.log"
BOOT_LOG = f"{LOG_DIR}/boot.log"
# What happened to nodes and jobs that a user would ask about (interruptions, drains, replacements, requeues): one JSON
# object per line, read by `gpucluster events`.
EVENTS_LOG = f"{LOG_DIR}/events.jsonl"
BUDGET_STATE_FILE = f"{STATE_DIR}/budget.json"  # written by the budget guardrail, read by the reconciler
# Which instance is which Slurm node: written by the resume program the moment CreateFleet answers, read by suspend and
# the reconciler. On the state volume (a replaced head keeps it), in a directory the slurm user owns.
NODE_REGISTRY_DIR = f"{STATE_DIR}/nodes"
NODE_REGISTRY = f"{NODE_REGISTRY_DIR}/instances.json"
NODE_NAME_FILE = f"{ETC_DIR}/node-name"  # a compute instance's Slurm node name, learned at its first boot
SLURM_CLIENT_CONF = f"{ETC_DIR}/slurm-client.conf"  # enough for scontrol to reach the controller before slurmd runs
NCCL_ENV_FILE = f"{ETC_DIR}/nccl.env"  # a compute node's NCCL/EFA settings (NAME=value), for every job step
# aws-ofi-nccl, NCCL's network plugin for EFA, where the EFA installer puts it: the image adds the directory to the
# loader's path (build_image.sh, ld.so.conf.d), nccl.env puts it on each task's LD_LIBRARY_PATH and names the plugin,
# and an EFA node's first boot checks that the plugin is there.
AWS_OFI_NCCL_LIB_DIR = "/opt/amazon/ofi-nccl/lib"
# Every directory the image looks in for the plugin, in its order (build_image.sh's OFI_NCCL_DIRS: Ubuntu's multiarch
# layout below the EFA installer's); `gpucluster verify` looks in the same.
AWS_OFI_NCCL_LIB_DIRS = (f"{AWS_OFI_NCCL_LIB_DIR}/x86_64-linux-gnu", AWS_OFI_NCCL_LIB_DIR)
NCCL_NET_PLUGIN = "ofi"  # NCCL_NET_PLUGIN=ofi: NCCL loads libnccl-net-ofi.so from the loader path (any release)
NCCL_NET_PLUGIN_FILE = f"libnccl-net-{NCCL_NET_PLUGIN}.so"  # aws-ofi-nccl always installs it (src/Makefile.am)
# nccl-tests' all_reduce_perf, built into NVIDIA images at the BOM's commit (build_image.sh's nccl_tests: MPI=1 against
# the EFA installer's Open MPI, so `srun --mpi=pmix` launches it); `gpucluster verify` runs it across a pool's nodes.
ALL_REDUCE_PERF = "/opt/nccl-tests/build/all_reduce_perf"
IMDS_URL = "http://169.254.169.254"  # EC2's instance metadata service (IMDSv2: a PUT for a token first)
IMAGE_MANIFEST = "/opt/gpucluster-image/manifest.json"  # written last by build_image.sh: the image is complete
# The bill of materials build_image.sh installs (gpucluster/spec/bom.py, rendered as image/bom.json): the image
# component writes it here before the build runs, and the image keeps it beside the manifest.
IMAGE_BOM = "/opt/gpucluster-image/bom.json"
# The same bytes in the bundle, for a node booted on a stock AMI (image.build false): its boot runs build_image.sh
# with this bill of materials.
BUNDLE_BOM = f"{BUNDLE_DIR}/image/bom.json"
# What `gpucluster verify` on the head expects of each pool (its plan at the default options, in the bundle): the run
# judges against it without the instance catalog.
VERIFY_PLAN = f"{BUNDLE_DIR}/verify/plan.json"
BOOT_UNIT = "gpucluster-boot.service"
# The head's units that may launch or keep nodes, besides slurmctld: stopped first when the cluster is torn down.
RECONCILE_UNIT = "gpucluster-reconcile"  # a service and its timer
BUDGET_UNIT = "gpucluster-budget"  # the guardrail service (it reopens partitions when the spend falls back)
INTERRUPTIONS_UNIT = "gpucluster-interruptions"  # acts on EC2's spot warnings (drains, signals, requeues)

# --- the tags every resource of a cluster carries, and the node name the resume program gives an instance ----------
CLUSTER_TAG = "gpucluster:cluster"
TEAM_TAG = "gpucluster:team"
STACK_TAG = "gpucluster:stack"
POOL_TAG = "gpucluster:pool"  # on the instances, volumes and interfaces of a pool (its launch template)
# What a pool's launch template and the resume program's CreateFleet tag at launch (an instant fleet may tag these).
LAUNCH_TAGGED = ("instance", "volume", "network-interface")

# --- the cluster's network names and ports ---------------------------------------------------------------------------
HEAD_HOSTNAME = "head"
SLURM_USER = "slurm"  # SlurmUser: the daemons, the node programs and the reconciler run as it
# The top of every Slurm cluster's account tree (sacctmgr makes it with the cluster): root's jobs run under it, outside
# the team's account and its caps.
SLURM_ROOT_ACCOUNT = "root"
# The images' login user: in the team's Slurm account, its home on the shared file system. Only for a stack without
# `users:`; with them, each person has an account of their own instead (ClusterSettings.accounts).
LOGIN_USER = "ubuntu"
SHARED_DIR = "/fsx"  # the Lustre file system, on every node
SHARED_HOME = f"{SHARED_DIR}/home"  # bind-mounted at /home on every node: code, venvs and job output follow the job
NODE_HOSTS_FILE = f"{SHARED_DIR}/.gpucluster/hosts"  # registered nodes' names and addresses, kept by the head
# The stack's people, signed by the head for the compute nodes' Prolog (gpucluster/node/accounts.py).
SHARED_PEOPLE_FILE = f"{SHARED_DIR}/.gpucluster/people.json"
# Root's, on every node (gpucluster/node/accounts.py; on the head the state volume, which a replaced head keeps):
# the accounts the cluster made on this node ("name:uid" lines, kept after a removal), the only ones it ever removes;
# and the people file's generation: on the head the last one it published, on a compute node the highest it applied.
PEOPLE_ACCOUNTS_FILE = f"{STATE_DIR}/people-accounts"
PEOPLE_GENERATION_FILE = f"{STATE_DIR}/people-generation"
# The head's update timer runs it every minute: a removed person's association goes once their last job has ended.
PEOPLE_LEAVERS_SCRIPT = f"{BUNDLE_DIR}/people-leavers.sh"
SHARED_EXAMPLES = f"{SHARED_DIR}/examples"  # the bundle's examples, copied once by the head (bootstrap)
# `gpucluster verify`: one JSON file per run (gpucluster/contract/verify.py), kept on the shared file system.
VERIFY_DIR = f"{SHARED_DIR}/.gpucluster/verify"
# A compute node's scratch space, never /tmp: on the instance store where there is one (a link to a directory on
# /opt/dlami/nvme), else a directory on the root volume. Root's, 0755, all the way down to the per-user directories.
LOCAL_SCRATCH = "/var/lib/gpucluster-local"
JOB_TMP_DIR = f"{LOCAL_SCRATCH}/jobs"  # Slurm's job_container/tmpfs BasePath: each job's private /tmp
ENROOT_DIR = f"{LOCAL_SCRATCH}/enroot"  # enroot's directories, one per uid under each kind, made by the Prolog
ENROOT_KINDS = ("cache", "data", "runtime")  # ENROOT_<KIND>_PATH = ENROOT_DIR/<kind>/<uid>
# mpi.conf's PMIxCliTmpDirBase: slurmstepd makes each step's PMIx directory for its tasks here, where both see it (in
# /tmp, its default, the tasks' private /tmp would hide it from them).
PMIX_TMP_DIR = f"{LOCAL_SCRATCH}/pmix"
SLURMCTLD_PORT = 6817
SLURMD_PORT = 6818
SLURMDBD_PORT = 6819

# --- monitoring: exporters on every node; Prometheus, Alertmanager and Grafana on the head ----------------------------
NODE_EXPORTER_PORT = 9100  # every node, on its private address (never 0.0.0.0: nothing else needs to reach it)
DCGM_EXPORTER_PORT = 9400  # NVIDIA nodes (dcgm-exporter's default port)
NEURON_EXPORTER_PORT = 9500  # Trainium nodes: neuron-monitor's Prometheus output
PROMETHEUS_PORT = 9090  # the head, on 127.0.0.1: Grafana and Alertmanager are its only clients
ALERTMANAGER_PORT = 9093  # the head, on 127.0.0.1
GRAFANA_PORT = 3000  # the head, on 127.0.0.1: reached through a Session Manager port forward only
MONITORING_FILES = ("prometheus/prometheus.yml", "prometheus/rules.yml")  # in the bundle and in `render --out`
DASHBOARDS_DIR = "grafana/dashboards"  # in the bundle and in `render --out`
# file_sd target lists the head's node-name publisher keeps (HOSTS_PROGRAM): one file per exporter kind.
SCRAPE_TARGETS_DIR = f"{STATE_DIR}/scrape-targets"
PROMETHEUS_DATA_DIR = f"{STATE_DIR}/prometheus"  # on the state volume: a replaced head keeps its history
# node_exporter's textfile collector (Debian's and Ubuntu's default directory): the Slurm, budget, EFA and Lustre
# figures our programs write as *.prom files.
TEXTFILE_DIR = "/var/lib/prometheus/node-exporter"
BUDGET_TEXTFILE = "gpucluster-budget.prom"  # the budget guardrail's spend, read by `gpucluster status` too
# The head's `gpucluster verify` writes each pool's last result here (contract/verify.py RESULT_METRIC).
VERIFY_TEXTFILE = f"{TEXTFILE_DIR}/gpucluster_verify.prom"
# A p5 has 192 vCPUs and 33 network interfaces: guest CPU time and each interface's sysfs class data would be a third
# of its series (benchmarks/prometheus_scale.py) and no board or rule reads them.
NODE_EXPORTER_FLAGS = ("--no-collector.netclass", "--no-collector.cpu.guest")
# dcgm-exporter's HPC job mapping: one file per GPU index holding the ids of the jobs on it (the Prolog writes, the
# Epilog removes); dcgm-exporter adds them to that GPU's series as the label `hpc_job`.
GPU_JOB_MAP_DIR = "/run/gpucluster/gpu-jobs"
# The dcgm-exporter container as build_image.sh tags it after pulling NVIDIA's image by digest: the boot needs no
# registry.
DCGM_EXPORTER_IMAGE = "gpucluster/dcgm-exporter:image"
# DCGM's host engine (nv-hostengine) on NVIDIA compute nodes: TCP on 127.0.0.1, no authentication (the lockdown
# keeps everyone but root off it).
DCGM_HOSTENGINE_PORT = 5555
GRAFANA_DATASOURCE_UID = "prometheus"  # the head's provisioned Prometheus, as every dashboard panel names it
# NVIDIA XIDs that mean the GPU needs a reset or a replacement (NVIDIA's XID catalogue: double-bit ECC, fallen off
# the bus, uncontained ECC, GSP errors): the GpuXidError alert fires on them (dcgm-exporter's count, from the driver's
# events). The health check drains on DCGM's own verdict (health.gpu_faults), never on the kernel log.
FATAL_XIDS = (48, 63, 64, 74, 79, 94, 95, 119, 120)

# --- the node programs: files of the library's gpucluster/node, run where the bundle unpacks them -----------------
# Each puts the library it is part of (LIB_DIR) on its path itself: Slurm, systemd and the boot run them by these paths.
NODE_PROGRAMS_DIR = f"{LIB_DIR}/gpucluster/node"
BOOTSTRAP_PROGRAM = f"{NODE_PROGRAMS_DIR}/bootstrap.py"  # FETCHER runs it at every boot (node.env names it)
BUNDLE_FETCHER = f"{NODE_PROGRAMS_DIR}/fetch_bundle.py"  # the bundle's FETCHER: the head's UPDATE_UNIT runs it
BUILD_IMAGE_SCRIPT = f"{NODE_PROGRAMS_DIR}/build_image.sh"  # the boot of a stock AMI runs it first
RESUME_PROGRAM = f"{NODE_PROGRAMS_DIR}/resume.py"  # Slurm's ResumeProgram
SUSPEND_PROGRAM = f"{NODE_PROGRAMS_DIR}/suspend.py"  # Slurm's SuspendProgram
RESUME_FAIL_PROGRAM = f"{NODE_PROGRAMS_DIR}/resume_fail.py"  # Slurm's ResumeFailProgram
RECONCILE_PROGRAM = f"{NODE_PROGRAMS_DIR}/reconcile.py"  # RECONCILE_UNIT's
INTERRUPTIONS_PROGRAM = f"{NODE_PROGRAMS_DIR}/interruptions.py"  # INTERRUPTIONS_UNIT's
BUDGET_PROGRAM = f"{NODE_PROGRAMS_DIR}/budget_guardrail.py"  # BUDGET_UNIT's, and BUDGET_COMMAND's
BUDGET_COMMAND = "gpucluster-budget"  # on the head's admins' PATH: status, check, close, reopen
# Slurm's HealthCheckProgram, Prolog and Epilog (the fast checks, then HOSTS_PROGRAM's part).
HEALTH_PROGRAM = f"{NODE_PROGRAMS_DIR}/health.py"
HOSTS_PROGRAM = f"{NODE_PROGRAMS_DIR}/hosts.py"  # publishes NODE_HOSTS_FILE (head); the Prolog's second part (compute)
METRICS_PROGRAM = f"{NODE_PROGRAMS_DIR}/metrics.py"  # Slurm, EFA and Lustre figures into TEXTFILE_DIR
NEURON_METRICS_PROGRAM = f"{NODE_PROGRAMS_DIR}/neuron_metrics.py"  # NeuronCore utilisation to CloudWatch
# `gpucluster verify`'s measurements on a compute node, one task per node of the verify job (python3 runs it).
VERIFY_PROBE_PROGRAM = f"{NODE_PROGRAMS_DIR}/verify_probe.py"
TASK_PROLOG = f"{NODE_PROGRAMS_DIR}/task_prolog.sh"  # Slurm's TaskProlog: NCCL_ENV_FILE into each task's environment
NODE_PROGRAMS = (BOOTSTRAP_PROGRAM, BUNDLE_FETCHER, BUILD_IMAGE_SCRIPT, RESUME_PROGRAM, SUSPEND_PROGRAM,
                 RESUME_FAIL_PROGRAM, RECONCILE_PROGRAM, INTERRUPTIONS_PROGRAM, BUDGET_PROGRAM, HEALTH_PROGRAM,
                 HOSTS_PROGRAM, METRICS_PROGRAM, NEURON_METRICS_PROGRAM, TASK_PROLOG)  # executable in the bundle
# All a compute node unpacks of the bundle's lib/ (node.env tells the fetcher; paths in the bundle): what the node
# programs import. The head unpacks the whole library: its admins run `gpucluster cost|render|preflight` there.
NODE_LIBRARY = ("lib/gpucluster/__init__.py", "lib/gpucluster/contract/", "lib/gpucluster/node/")
ROLES = ("head", "compute")


@dataclass(frozen=True)
class ScrapeJob:
    """One Prometheus scrape job over a file_sd list: which nodes are in it and on which port they answer."""

    name: str  # Prometheus' job label
    targets_file: str  # under SCRAPE_TARGETS_DIR
    port: int
    accelerator: str = ""  # "": every node (the head too); else the nodes of pools with this accelerator kind


NODE_JOB = ScrapeJob("node", "node.json", NODE_EXPORTER_PORT)
SCRAPE_JOBS = (NODE_JOB, ScrapeJob("dcgm", "dcgm.json", DCGM_EXPORTER_PORT, accelerator="nvidia"),
               ScrapeJob("neuron", "neuron.json", NEURON_EXPORTER_PORT, accelerator="neuron"))


class SettingsError(ValueError):
    """The settings document does not match this contract (missing or unknown keys)."""


def _mapping(raw: Any, where: str) -> dict[str, Any]:
    """`raw` when it is a JSON object; any other shape is a settings document this contract cannot read."""
    if not isinstance(raw, dict):
        raise SettingsError(f"{where}: a mapping expected, got {type(raw).__name__}")
    return raw


def _build(cls: type, raw: dict[str, Any], where: str) -> Any:
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise SettingsError(f"{where}: unknown key(s) {', '.join(unknown)}")
    try:
        return cls(**raw)
    except TypeError as exc:  # a required key is missing
        raise SettingsError(f"{where}: {exc}") from None


@dataclass(frozen=True)
class PoolSettings:
    """What the resume program needs to launch one pool's nodes, and what the bootstrap needs to configure them."""

    name: str
    launch_template_id: str
    subnet_id: str
    instance_type: str
    market: str  # on-demand | spot | capacity-block
    launch_template_version: str = "$Latest"
    capacity_reservation_id: str | None = None
    placement_group: str | None = None
    min_nodes: int = 0  # <pool>-1 .. <pool>-<min_nodes> are always on: the reconciler keeps them launched
    max_nodes: int = 0
    efa_interfaces: int = 0
    accelerator: str = ""  # nvidia | neuron | "": what the health check counts
    accelerators: int = 0  # GPUs or Neuron devices per node
    node_hour_usd: float = 0.0  # the plan's price of a node-hour (on-demand; a spot pool's upper bound): the cost board
    # The tags the pool's launch template puts on its instances, volumes and interfaces: the resume program's
    # CreateFleet sends them too.
    tags: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class BudgetSettings:
    """The budget guardrail's wiring (outputs of the Budget component)."""

    budget_name: str
    account_id: str
    act_threshold_percent: float
    queue_url: str
    topic_arn: str
    check_seconds: int = 3600  # AWS refreshes a budget's spend a few times a day
    launch_deny_action: bool = True  # the stack has an AWS Budgets action to reverse on reopening


@dataclass(frozen=True)
class PersonSettings:
    """One of the stack's people (`users:`): an account of the same uid on every node, with a personal group of the
    same name whose gid is the uid. Their IAM principals stay with the Pulumi side (the nodes never need them)."""

    name: str
    uid: int
    gid: int
    admin: bool = False  # sudo in their sessions
    max_gpus: int | None = None  # GPUs in use at once; None: no limit of their own


def load_people(raw: Any) -> tuple[PersonSettings, ...]:
    """The settings' people, checked with the stack's own rules (gpucluster.contract.people): a document that breaks
    them stops the loader, every problem at once, before a node makes an account from it."""
    if not isinstance(raw, list):
        raise SettingsError(f"people: a list of people expected, got {type(raw).__name__}")
    found = [_build(PersonSettings, entry, f"people[{i}]") if isinstance(entry, dict) else None
             for i, entry in enumerate(raw)]
    problems = [f"people[{i}]: a mapping expected, got {type(raw[i]).__name__}"
                for i, person in enumerate(found) if person is None]
    names: dict[str, int] = {}
    uids: dict[int, int] = {}
    for i, person in enumerate(found):
        if person is None:
            continue
        where = f"people[{i}]"
        mistyped = [f"{where}.{key}: {kind.__name__} expected, got {value!r}"
                    for key, kind in (("name", str), ("uid", int), ("gid", int), ("admin", bool))
                    if not isinstance(value := getattr(person, key), kind) or (kind is int and isinstance(value, bool))]
        if mistyped:
            problems += mistyped
            continue
        if problem := people_rules.name_problem(person.name):
            problems.append(f"{where}.name: {problem}")
        if problem := people_rules.uid_problem(person.uid):
            problems.append(f"{where}.uid: {problem}")
        if person.gid != person.uid:
            problems.append(f"{where}.gid: must equal the uid ({person.uid}): each person's group is their own")
        if person.max_gpus is not None and (isinstance(person.max_gpus, bool) or not isinstance(person.max_gpus, int)
                                            or person.max_gpus < 1):
            problems.append(f"{where}.max_gpus: an integer >= 1 or null expected, got {person.max_gpus!r}")
        if person.name in names:
            problems.append(f"{where}.name: {person.name!r} is also people[{names[person.name]}]'s")
        if person.uid in uids:
            problems.append(f"{where}.uid: {person.uid} is also people[{uids[person.uid]}]'s")
        names.setdefault(person.name, i)
        uids.setdefault(person.uid, i)
    if problems:
        raise SettingsError("; ".join(problems))
    return tuple(person for person in found if person is not None)


@dataclass(frozen=True)
class ClusterSettings:
    """Everything `pulumi up` learned that a node needs: one JSON document, one loader."""

    cluster: str
    region: str
    pools: dict[str, PoolSettings]
    team: str = ""
    bundle_bucket: str = ""
    bundle_key: str = ""
    head_address: str = ""
    state_volume_id: str = ""
    fsx_dns_name: str = ""
    fsx_mount_name: str = ""
    munge_key_parameter: str = ""
    slurmctld_port: int = SLURMCTLD_PORT  # compute nodes fetch their configuration from it (configless)
    # The node programs' behaviour (stack settings) and where they write.
    all_or_nothing: bool = True  # a multi-node job gets all its nodes or none
    capacity_retry_seconds: int = 600  # first retry of a node DOWN for a passing cause; doubles per failure, to 1 h
    batch_size: int = 500  # nodes per CreateFleet call (a multi-node job is never split: its nodes go in one call)
    # An instance no node owns is left alone this long after its launch (ParallelCluster: 300 s): the resume program
    # records it a moment after CreateFleet answers, and a reconciler pass may fall in between.
    orphan_grace_seconds: int = 300
    # A pool whose nodes were replaced for a failed health check this many times within the window gets no more
    # replacements: a fault that follows fresh instances is not the instances' (reconcile: HEALTH_REPEATS).
    health_replacements: int = 3
    health_replacement_window_seconds: int = 86400
    registry_file: str = NODE_REGISTRY
    log_file: str = NODE_LOG
    scontrol: str = "scontrol"
    budget_state_file: str = BUDGET_STATE_FILE
    budget: BudgetSettings | None = None
    # EC2's interruption warnings and rebalance recommendations, through EventBridge into this queue ("": none).
    interruption_queue_url: str = ""
    drain_on_rebalance: bool = True  # a rebalance recommendation drains the node (its jobs run on)
    # Between the checkpoint signal (SIGUSR1) and the requeue: the two-minute warning leaves a job this long to save.
    checkpoint_grace_seconds: int = 60
    alerts_topic_arn: str = ""  # the stack's topic: what the programs do that users should hear of
    events_log: str = EVENTS_LOG
    # The boot rehearsal only (tests/local_cluster.py): its nodes share one address, so each node's exporters listen
    # on ports of their own counted from this base (SlurmLayout.node_port_base is the same seam for slurmd).
    # 0: every node uses the exporters' standard ports.
    exporter_port_base: int = 0
    # The stack's people (`users:`), in the stack's order; none: the stack has no `users:` and everyone connects as
    # the shared LOGIN_USER (see `accounts`).
    people: tuple[PersonSettings, ...] = ()

    @property
    def accounts(self) -> tuple[str, ...]:
        """The login accounts every node must have: the people's, or the shared login user when the stack lists no
        people (a stack's `users:` is never an empty list)."""
        return tuple(person.name for person in self.people) or (LOGIN_USER,)

    def pool_of(self, node: str) -> str:
        """The stack's pool that the node is one of: <pool>-<n> of a pool of these settings; "" for any other name
        (the head's). `named_pool` is what a name claims, whether the stack has that pool or not."""
        pool, _, number = node.rpartition("-")
        return pool if pool in self.pools and number.isdigit() else ""

    def always_on_nodes(self) -> set[str]:
        """<pool>-1 .. <pool>-<min_nodes> of every pool: kept launched by the reconciler, never suspended."""
        return {f"{pool.name}-{i}" for pool in self.pools.values() for i in range(1, pool.min_nodes + 1)}

    def exporter_port(self, job: ScrapeJob, node: str) -> int:
        if not self.exporter_port_base:
            return job.port
        index = 0  # the head
        if pool := self.pool_of(node):
            names = list(self.pools)
            before = sum(self.pools[p].max_nodes for p in names[:names.index(pool)])
            index = 1 + before + int(node.rsplit("-", 1)[1]) - 1
        return self.exporter_port_base + index * len(SCRAPE_JOBS) + SCRAPE_JOBS.index(job)

    @classmethod
    def from_dict(cls, raw: Any) -> ClusterSettings:
        _mapping(raw, "settings")
        raw = dict(raw)
        pools = {name: _build(PoolSettings, {"name": name, **{k: v for k, v in _mapping(spec, f"pools.{name}").items()
                                                              if k != "name"}}, f"pools.{name}")
                 for name, spec in _mapping(raw.pop("pools", {}), "pools").items()}
        budget = raw.pop("budget", None)
        if budget:
            _mapping(budget, "budget")
        budget_settings = _build(BudgetSettings, budget, "budget") if budget else None
        people = load_people(raw.pop("people", []))
        settings: ClusterSettings = _build(cls, {**raw, "pools": pools, "budget": budget_settings, "people": people},
                                           "settings")
        return settings  # typed here: _build makes whichever settings class it is given

    @classmethod
    def from_json(cls, text: str) -> ClusterSettings:
        return cls.from_dict(json.loads(text))

    @classmethod
    def load(cls, path: str | Path = SETTINGS_FILE) -> ClusterSettings:
        return cls.from_json(Path(path).read_text())

    def to_json(self) -> str:
        doc = asdict(self)
        for spec in doc["pools"].values():
            del spec["name"]  # the key says it
        if doc["budget"] is None:
            del doc["budget"]
        return json.dumps(doc, sort_keys=True, indent=1)


def named_pool(node: str) -> str:
    """The pool a node's name names, <pool>-<n> -> <pool> (p5-od-3 -> p5-od), whether the stack has it or not: what the
    resume program launches from, or says it has no settings for. `ClusterSettings.pool_of` knows the stack's pools."""
    return node.rsplit("-", 1)[0]


def read_env_file(path: str | Path = NODE_ENV_FILE) -> dict[str, str]:
    """node.env: KEY=VALUE lines that user data writes (no secret in it)."""
    return dict(line.strip().split("=", 1) for line in Path(path).read_text().splitlines() if "=" in line)


def head_instance_name(cluster: str) -> str:
    """The head instance's Name tag (components/head_node.py): `gpucluster dashboard` finds the head by it."""
    return f"{cluster}-head"


# The kinds of the cluster's Session Manager documents (session_document_name): the login user's shell, the admins'
# (ssm-user, sudo), the port forward to Grafana and the stream to sshd for ssh's ProxyCommand.
USER_SESSION, ADMIN_SESSION, DASHBOARD_SESSION, SSH_SESSION = "user", "admin", "dashboard", "ssh"


def session_document_name(cluster: str, kind: str) -> str:
    """A Session Manager document of the cluster (components/team_access.py); kind: one of the *_SESSION kinds, or
    user-<person> (person_session_document_name). `gpucluster dashboard` names the dashboard's in the command it
    prints."""
    return f"{cluster}-{kind}-session"


def start_session_command(region: str, instance_id: str, document: str,
                          parameters: dict[str, str] | None = None) -> list[str]:
    """The AWS CLI command line that opens a Session Manager session on the head node with one of the cluster's
    documents: what `gpucluster connect|ssh-proxy|dashboard` exec and the Slurm stack's `connect` outputs print.
    `parameters`: the document's, in the CLI's shorthand (aws ssm start-session --parameters key=value,...)."""
    command = ["aws", "ssm", "start-session", "--region", region, "--target", instance_id, "--document-name", document]
    if parameters:
        command += ["--parameters", ",".join(f"{key}={value}" for key, value in parameters.items())]
    return command


def person_session_document_name(cluster: str, person: str) -> str:
    """The Session Manager document of one of the stack's people (`users:`): a shell on the head as that person. The
    `user-` prefix keeps it apart from the other kinds whatever the person's name."""
    return session_document_name(cluster, f"user-{person}")


# The kinds of the cluster's Run Command documents (command_document_name): everyone's verify (no --deep), the
# admins' verify with --deep too, and everyone's status.
VERIFY_COMMAND, DEEP_VERIFY_COMMAND, STATUS_COMMAND = "verify", "verify-deep", "status"


def command_document_name(cluster: str, kind: str) -> str:
    """A Run Command document of the cluster (components/team_access.py); kind: one of the *_COMMAND kinds
    (`gpucluster verify STACK` and `gpucluster status STACK` from the operator's machine send them to the head)."""
    return f"{cluster}-{kind}-command"


def alertmanager_routing(topic_arn: Any, region: str, cluster: str) -> dict[str, Any]:
    """Alertmanager's route and receiver for both flavours: every alert to the stack's topic (the budget's
    subscribers), grouped per alert and pool, repeated every 4 h while it fires, through SNS with the credentials the
    process has (SigV4: the head's instance role, or on EKS a Pod Identity role). No topic: a receiver that drops."""
    receiver: dict[str, Any] = {"name": "stack-topic"}
    if topic_arn:
        receiver["sns_configs"] = [{
            "topic_arn": topic_arn, "sigv4": {"region": region}, "send_resolved": True,
            "subject": "[{{ .Status | toUpper }}] {{ .CommonLabels.alertname }} on " + cluster,
            "message": "{{ range .Alerts }}{{ .Annotations.summary }}\n{{ end }}"}]
    return {"route": {"receiver": "stack-topic", "group_by": ["alertname", "pool"], "group_wait": "30s",
                      "group_interval": "5m", "repeat_interval": "4h"},
            "receivers": [receiver]}
