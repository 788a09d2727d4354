"""slurm.conf, gres.conf, cgroup.conf, job_container.conf and job_submit.lua rendered from the stack: one partition
per pool, cloud nodes that Slurm powers up on demand.

For the Slurm release the node image runs (gpucluster.spec.bom.SLURM_VERSION); the tests start the same release.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from gpucluster.contract import settings
from gpucluster.contract.slurm_json import BILLING_CENTS_PER_USD
from gpucluster.render import job_submit
from gpucluster.spec import cost
from gpucluster.spec.catalog import Accelerator
from gpucluster.spec.model import MAX_JOB_COUNT, PoolSpec, Stack

# Slurm must not hand out memory the kernel, the CUDA driver and the EFA stack keep. EC2's figure is the nominal size;
# keep 5% back. (A node that reads a little under RealMemory still registers: node_reg_mem_percent below.)
MEMORY_FRACTION = 0.95


@dataclass(frozen=True)
class SlurmLayout:
    """Where things live on the head node (names and paths the nodes share come from the settings contract). The boot
    rehearsal changes only ports and the fields whose comments name them (simulated_hardware, cgroups,
    power_save_min_interval, suspend_timeout, cred_expire, dev_dir)."""

    controller_host: str = settings.HEAD_HOSTNAME
    controller_port: int = settings.SLURMCTLD_PORT
    node_port: int = settings.SLURMD_PORT
    dbd_port: int = settings.SLURMDBD_PORT
    state_dir: str = f"{settings.STATE_DIR}/slurmctld"  # on the state volume that survives a head-node replacement
    spool_dir: str = settings.SLURMD_SPOOL_DIR
    log_dir: str = "/var/log/slurm"
    run_dir: str = "/run/slurm"
    munge_socket: str = "/run/munge/munge.socket.2"
    slurm_user: str = settings.SLURM_USER
    # Tests run several slurmd on one host: each node then gets its own port from here up, and the slurmd paths
    # carry %n (the node name). On the cluster every node is its own host and uses node_port.
    node_port_base: int | None = None
    dev_dir: str = "/dev"  # where the accelerator device files are
    # The test machine's nodes are not the hardware the config describes (2 cores, no GPU): slurmd must then report
    # the configured CPUs and memory. Never set on a real cluster.
    simulated_hardware: bool = False
    # Track and confine job processes with cgroups (GPU isolation, clean kills, per-job accounting). Only the tests'
    # sandbox, whose cgroup mounts Slurm cannot use, turns this off.
    cgroups: bool = True
    # Seconds slurmctld gathers resume and suspend requests before acting on them (batched EC2 calls, as
    # ParallelCluster does). The tests shorten it: they wait on Slurm's timers, they do not sleep through them.
    power_save_min_interval: int = 30
    # Seconds a node takes to power down (the suspend program terminates its instance): no job lands on it meanwhile.
    # EC2 needs a minute or two; the tests' instances are gone at once.
    suspend_timeout: int = 120
    # Seconds a requeued job waits before it may start again (the job credential's lifetime, AuthInfo cred_expire;
    # Slurm's default 120). The tests shorten it; None leaves Slurm's default.
    cred_expire: int | None = None

    @property
    def node_file(self) -> str:
        return "slurmd-%n" if self.node_port_base else "slurmd"


def hostlist(prefix: str, first: int, last: int) -> str:
    """Slurm's compressed host list: p5-od-[1-4], or p5-od-3 for one node."""
    return f"{prefix}-{first}" if first == last else f"{prefix}-[{first}-{last}]"


def node_names(pool: PoolSpec) -> list[str]:
    return [f"{pool.name}-{n}" for n in range(1, pool.max_nodes + 1)]


def _gres_name_type(acc: Accelerator) -> tuple[str, str | None]:
    """Slurm's name for the accelerators and, for GPUs, their type (h100, a100, ...)."""
    return ("gpu", acc.model.lower()) if acc.kind == "nvidia" else ("neuron", None)


def gres(pool: PoolSpec) -> str | None:
    """The node's generic resources: typed GPUs (gpu:h100:8) or Neuron devices (neuron:16)."""
    acc = pool.itype.accelerator
    if acc is None:
        return None
    name, kind = _gres_name_type(acc)
    return f"{name}:{kind}:{acc.count}" if kind else f"{name}:{acc.count}"


DEFAULT_TIME_HOURS = 24  # a job without --time gets a day; longer runs say so
DEFAULT_TIME = f"{DEFAULT_TIME_HOURS // 24}-{DEFAULT_TIME_HOURS % 24:02d}:00:00"

# Slurm allocates the lowest Weight first: a partition with a fallback pool fills spot, then reserved, then on-demand.
WEIGHTS = {"spot": 1, "capacity-block": 10, "on-demand": 100}


def real_memory(pool: PoolSpec) -> int:
    """The node's RealMemory in MiB: what Slurm may allocate to jobs."""
    return int(pool.itype.memory_mib * MEMORY_FRACTION)


def job_defaults(members: list[PoolSpec]) -> dict[str, int]:
    """A partition's defaults for jobs that do not say how much they need, so that a small job leaves the rest of the
    node to others (CR_Core_Memory without a default gives a job without --mem the whole node's memory).

    - DefMemPerCPU: the node's memory shared out by CPU, for jobs without GPUs.
    - DefCpuPerGPU and DefMemPerGPU, on partitions of NVIDIA nodes: ML jobs ask for GPUs (--gpus, --gpus-per-node), so
      they get the CPUs and memory that come with their share of the node (1 of 8 GPUs: 1/8 of the CPUs and memory).
      A job that asks for GPUs and no memory takes DefMemPerGPU, not DefMemPerCPU (select/cons_tres); --mem and
      --mem-per-* replace the memory default, --cpus-per-task and --cpus-per-gpu the CPU one. Slurm's manual calls
      the DefMem settings mutually exclusive, but Slurm only refuses DefMemPerCPU next to DefMemPerNode.
    Rounded down, so that N shares never exceed the node; the smallest over the partition's pools (a spot pool with
    an on-demand fallback of another type), so the default fits any node of the partition. slurm-gcp takes the same
    minimum of memory / CPUs per partition; ParallelCluster sets none (it schedules memory only when asked to).
    """
    defaults = {"DefMemPerCPU": min(real_memory(p) // p.itype.vcpus for p in members)}
    gpus = [(p, acc.count) for p in members if (acc := p.itype.accelerator) and acc.kind == "nvidia"]
    if gpus:
        defaults["DefCpuPerGPU"] = min(p.itype.vcpus // count for p, count in gpus)
        defaults["DefMemPerGPU"] = min(real_memory(p) // count for p, count in gpus)
    return defaults


def partitions(stack: Stack) -> dict[str, list[PoolSpec]]:
    """One partition per pool, named after it: its nodes, then its fallback pool's (spot falling back to on-demand)."""
    by_name = {p.name: p for p in stack.spec.pools}
    return {pool.name: [pool] + ([by_name[pool.fallback]] if pool.fallback else []) for pool in stack.spec.pools}


def default_partition(stack: Stack) -> str:
    """Where a job that names no partition goes (cost.default_partition says why)."""
    return cost.default_partition(stack)[0]


def billing_weights(members: list[PoolSpec]) -> dict[str, float]:
    """A partition's TRESBillingWeights: each TRES of a node weighs the node's price per hour in cents (cost.py's
    billing unit) divided by the node's count of it. With PriorityFlags=MAX_TRES a job bills the largest of its
    weighted TRES (slurm.conf(5), Slurm 24.11): the price of the largest share of a node it holds, whether GPUs,
    CPUs or memory (one GPU with all the memory bills the whole node). Mem is per MB, Slurm's memory unit. The highest
    weight over the partition's pools (a spot pool falling back to another type), so no node bills less than it
    costs."""
    weights: dict[str, float] = {}
    for pool in members:
        cents = cost.billed_node_hour_usd(pool)[0] * BILLING_CENTS_PER_USD
        for tres, count in _whole_node(pool):
            weights[tres] = max(weights.get(tres, 0.0), cents / count)
    return weights


def _whole_node(pool: PoolSpec) -> tuple[tuple[str, int], ...]:
    """The TRES a node of the pool has, as TRESBillingWeights names them, and how many (Mem in MB)."""
    name = _gres_name_type(pool.accelerator)[0]
    return ("CPU", pool.itype.vcpus), ("Mem", real_memory(pool)), (f"GRES/{name}", pool.accelerator.count)


def whole_node_usd_per_hour(stack: Stack) -> dict[str, float]:
    """What a job holding one whole node for an hour bills in each partition, in dollars: with MAX_TRES its largest
    weighted TRES, on the partition's dearest node (a fallback pool's node of another type may bill above its
    price). What `plan` divides the quota by for the longest whole-node job (cost.job_time)."""
    billed = {}
    for name, members in partitions(stack).items():
        weights = billing_weights(members)
        billed[name] = max(weights[tres] * count for pool in members for tres, count in _whole_node(pool))
    return {name: cents / BILLING_CENTS_PER_USD for name, cents in billed.items()}


def job_time(stack: Stack) -> cost.JobTime:
    """The quota against the partitions' DefaultTime and whole-node billing (`plan`)."""
    return cost.job_time(stack, whole_node_usd_per_hour(stack), DEFAULT_TIME_HOURS)


def _node_line(pool: PoolSpec, first_port: int | None) -> str:
    """One line per pool. Every node is a CLOUD node, the always-on ones too (they are in SuspendExcNodes and the
    reconciler has them powered up): a node without State=CLOUD needs an address Slurm can resolve at its start, which
    an instance that does not exist yet has not (Slurm hides such a node as FUTURE)."""
    itype = pool.itype
    features = [pool.name, itype.name, pool.capacity] + (["efa"] if pool.uses_efa else [])
    line = f"NodeName={hostlist(pool.name, 1, pool.max_nodes)} CPUs={itype.vcpus} RealMemory={real_memory(pool)}" \
           f" Weight={WEIGHTS[pool.capacity]}"
    if g := gres(pool):
        line += f" Gres={g}"
    line += f" Features={','.join(features)}"
    if first_port is not None:
        last_port = first_port + pool.max_nodes - 1
        line += f" Port={first_port}" if pool.max_nodes == 1 else f" Port=[{first_port}-{last_port}]"
    return line + " State=CLOUD"


# What a user sees of others (slurm.conf and slurmdbd.conf): nothing of their jobs (squeue, scontrol show job, sacct
# -a), usage (sshare, sreport), user and account records, reservations or node events. Root and SlurmUser see all, so
# the head's programs (the metrics writer and guardrails as root; reconciler, interruptions, resume and suspend as
# slurm) still see every job. `cloud`: sinfo shows powered-down nodes to every user.
PRIVATE_DATA = "cloud,jobs,usage,users,accounts,reservations,events"


def slurm_conf(stack: Stack, layout: SlurmLayout = SlurmLayout()) -> str:
    spec = stack.spec
    pools = spec.pools
    timers = spec.slurm
    always_on = [hostlist(p.name, 1, p.min_nodes) for p in pools if p.min_nodes]
    gres_types = accelerator_gres(stack)
    lines: list[str | None] = [
        f"# Rendered by gpucluster for stack {stack.name}. "
        "Change the stack file and run `pulumi up`; edits here are lost.",
        f"ClusterName={stack.cluster_name}",
        f"SlurmctldHost={layout.controller_host}",
        f"SlurmctldPort={layout.controller_port}",
        f"SlurmdPort={layout.node_port}",
        f"SlurmUser={layout.slurm_user}",
        "AuthType=auth/munge",
        f"AuthInfo=socket={layout.munge_socket}" + (f",cred_expire={layout.cred_expire}" if layout.cred_expire else ""),
        f"StateSaveLocation={layout.state_dir}",
        f"SlurmdSpoolDir={layout.spool_dir}" + ("/%n" if layout.node_port_base else ""),
        f"SlurmctldPidFile={layout.run_dir}/slurmctld.pid",
        f"SlurmdPidFile={layout.run_dir}/{layout.node_file}.pid",
        f"SlurmctldLogFile={layout.log_dir}/slurmctld.log",
        f"SlurmdLogFile={layout.log_dir}/{layout.node_file}.log",
        # Jobs start their own launchers (torchrun, NCCL bootstrap); no PMI plugin is needed to wire ranks.
        "MpiDefault=none",
        f"ProctrackType=proctrack/{'cgroup' if layout.cgroups else 'linuxproc'}",
        f"TaskPlugin=task/affinity{',task/cgroup' if layout.cgroups else ''}",
        # Every task gets the node's NCCL/EFA settings, batch scripts that read no profile too; the user's own win.
        f"TaskProlog={settings.TASK_PROLOG}",
        # Before a job starts, on each of its nodes: the names of the job's nodes resolve (/etc/hosts), the user's
        # container directories exist. Alloc: at the job's start on all its nodes, not at each node's first step.
        # Contain: the job's extern step, which holds its private /tmp and /dev/shm (job_container.conf).
        f"Prolog={settings.HEALTH_PROGRAM}",
        "PrologFlags=Alloc,Contain",
        # Each job's own /tmp and /dev/shm, removed when it ends: nothing of one job is there for the next one.
        "JobContainerType=job_container/tmpfs",
        # After a job, on each of its nodes: its GPUs' job labels for dcgm-exporter are taken off.
        f"Epilog={settings.HEALTH_PROGRAM}",
        # The node's health (accelerators, ECC, XIDs, EFA, /fsx, disk) every 5 minutes on every node; a failing node
        # drains itself. A job whose Prolog finds its node unhealthy is requeued, not held.
        f"HealthCheckProgram={settings.HEALTH_PROGRAM}",
        "HealthCheckInterval=300",
        "HealthCheckNodeState=ANY,CYCLE",
        "SchedulerType=sched/backfill",
        # A batch script over the stack's bound is refused at submission: slurmctld keeps every queued job's script
        # on the head's state volume.
        f"SchedulerParameters=nohold_on_prolog_fail,max_script_size={timers.max_batch_script_kib * 1024}",
        # Slurm's default, named: the stack's caps on the team's jobs stay under it (spec.model.MAX_JOB_COUNT).
        f"MaxJobCount={MAX_JOB_COUNT}",
        # job_submit.lua beside this file: a job no node of its partition could ever run is refused at submission,
        # naming the partition's node shape, instead of pending for ever.
        "JobSubmitPlugins=lua",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core_Memory",
        f"GresTypes={','.join(gres_types)}" if gres_types else None,
        # A node that comes back after a failure is usable again without an administrator.
        "ReturnToService=2",
        "SlurmdParameters=config_overrides" if layout.simulated_hardware else None,
        "",
        "# Nodes are EC2 instances launched on demand and terminated when idle.",
        f"ResumeProgram={settings.RESUME_PROGRAM}",
        f"SuspendProgram={settings.SUSPEND_PROGRAM}",
        f"ResumeFailProgram={settings.RESUME_FAIL_PROGRAM}",
        f"ResumeTimeout={timers.resume_timeout_seconds}",
        f"SuspendTime={timers.suspend_time_seconds}",
        f"SuspendTimeout={layout.suspend_timeout}",
        "ResumeRate=0",
        "SuspendRate=0",
        f"SuspendExcNodes={','.join(always_on)}" if always_on else None,
        # Nodes that may not exist yet cannot forward messages for others: the controller talks to each directly.
        "TreeWidth=65533",
        # Cloud nodes change address on every launch.
        "CommunicationParameters=NoAddrCache",
        f"PrivateData={PRIVATE_DATA}",
        # slurmctld runs MailProg as the slurm user with text from --mail-user: the head sends no mail.
        "MailProg=/bin/true",
        # Compute nodes fetch slurm.conf, gres.conf, cgroup.conf, job_container.conf, plugstack.conf from the controller
        # (slurmd --conf-server), so they never drift. A cloud node's address is the one it registers from (Slurm
        # does this for every cloud node): the resume program need not ask EC2 for it. A node whose memory reads up
        # to a quarter under RealMemory still registers instead of being drained (the CLOUD default is 90%, a node
        # outside power saving 100%). The power saving thread acts at most every 30 s: nodes asked for in a burst of
        # jobs resume in one call, one CreateFleet (ParallelCluster's settings).
        "SlurmctldParameters=enable_configless,idle_on_node_suspend,"
        "node_reg_mem_percent=75,"
        f"power_save_min_interval={layout.power_save_min_interval}",
        # ParallelCluster's timeouts. Messages may wait a minute for a controller busy with a burst of registrations
        # (default 10 s); a node that stopped answering, such as a reclaimed spot instance, is set DOWN after 3 minutes
        # (default 5); a batch job on a freshly booted node has 3 minutes to launch (prolog, environment; default 10 s).
        "MessageTimeout=60",
        "SlurmdTimeout=180",
        "BatchStartTimeout=180",
        "",
        "# Accounting in slurmdbd (MariaDB on the head node), GPU use counted per account.",
        "AccountingStorageType=accounting_storage/slurmdbd",
        f"AccountingStorageHost={layout.controller_host}",
        f"AccountingStoragePort={layout.dbd_port}",
        # With slurmdbd this names the munge socket of the accounting connection (not a password).
        f"AccountingStoragePass={layout.munge_socket}",
        f"AccountingStorageTRES={','.join(f'gres/{t}' for t in gres_types)}" if gres_types else None,
        # Every job runs under the team's account, and within its money quota: `safe` starts a job only if its
        # time limit fits in what is left, so partitions carry a default time limit.
        "AccountingStorageEnforce=associations,limits,qos,safe",
        # Fair share between the team's people: who spent less of the team's quota lately goes first (usage is the
        # billing TRES; the factor's weight; the others are 0 by default). Usage never decays (half-life 0), it
        # resets each month, with the quota. MAX_TRES: a job bills its largest share of a node (billing_weights).
        "PriorityType=priority/multifactor",
        "PriorityFlags=MAX_TRES",
        "PriorityWeightFairshare=10000",
        "PriorityUsageResetPeriod=MONTHLY",
        "PriorityDecayHalfLife=0",
        f"JobAcctGatherType=jobacct_gather/{'cgroup' if layout.cgroups else 'linux'}",
        "",
    ]
    port = layout.node_port_base
    for pool in pools:
        lines.append(_node_line(pool, port))
        port = port + pool.max_nodes if port is not None else None
    lines.append("")
    for name, members in partitions(stack).items():
        default = " Default=YES" if name == default_partition(stack) else ""
        nodes = ",".join(hostlist(p.name, 1, p.max_nodes) for p in members)
        defaults = "".join(f" {key}={value}" for key, value in job_defaults(members).items())
        weights = ",".join(f"{tres}={weight:.8g}" for tres, weight in billing_weights(members).items())
        lines.append(f"PartitionName={name} Nodes={nodes}{default} DefaultTime={DEFAULT_TIME} MaxTime=INFINITE"
                     f"{defaults} TRESBillingWeights={weights} State=UP")
    return "\n".join(line for line in lines if line is not None) + "\n"


def device_files(acc: Accelerator, dev_dir: str = "/dev") -> str:
    """The accelerators' device files as gres.conf names them: /dev/nvidia[0-7], /dev/neuron[0-15]."""
    return f"{dev_dir}/{acc.kind}0" if acc.count == 1 else f"{dev_dir}/{acc.kind}[0-{acc.count - 1}]"


def gres_conf(stack: Stack, layout: SlurmLayout = SlurmLayout()) -> str:
    """Explicit device files: AutoDetect cannot be used for cloud nodes, which do not exist when slurmctld starts."""
    lines = ["# Rendered by gpucluster. One line per pool with accelerators."]
    for pool in stack.spec.pools:
        acc = pool.itype.accelerator
        if acc is None:
            continue
        name, kind = _gres_name_type(acc)
        files = device_files(acc, layout.dev_dir)
        lines.append(f"NodeName={hostlist(pool.name, 1, pool.max_nodes)} Name={name}"
                     f"{f' Type={kind}' if kind else ''} File={files}")
    return "\n".join(lines) + "\n"


ACCOUNTING_DB = "slurm_acct_db"
# MariaDB authenticates slurmdbd by its Unix user over the local socket: there is no database password to generate,
# store or leak. Run once by the head node (and by the tests) as the database's root. The database is made here, not
# by slurmdbd: slurmdbd 24.11 then reconnects on the handle whose connection failed, and MariaDB 11.8's client library
# fails every query of that handle ("Number of columns in result (=1) ... exceeds maximum allowed (=0)", seen).
ACCOUNTING_DB_SQL = (
    f"CREATE DATABASE IF NOT EXISTS {ACCOUNTING_DB}; "
    "CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED VIA unix_socket; "
    f"GRANT ALL ON {ACCOUNTING_DB}.* TO 'slurm'@'localhost';"
)


def job_limits(stack: Stack) -> dict[str, int]:
    """The team account's association limits on jobs. Grp*: the whole team; Max*: each user, because a user's
    association takes its account's Max* limits (sacctmgr copies them when the user is added and passes a changed one
    on to the users who have none of their own)."""
    limits = stack.spec.slurm
    return {"GrpSubmitJobs": limits.max_submitted_jobs, "GrpJobs": limits.max_running_jobs,
            "MaxSubmitJobs": limits.max_submitted_jobs_per_user, "MaxJobs": limits.max_running_jobs_per_user}


def accelerator_gres(stack: Stack) -> list[str]:
    """The accelerators' gres names the cluster schedules and counts (gres.conf, AccountingStorageTRES)."""
    return sorted({g.split(":")[0] for p in stack.spec.pools if (g := gres(p))})


def accounting_script(stack: Stack) -> str:
    """sacctmgr commands the head node runs once slurmctld is up (and again at each `pulumi up`): the team's account
    with its monthly money quota (the whole team's, shared; cost.quota) and its caps on jobs; an association under
    it for each of the stack's people and one for the login user (everyone's without `users:`; with people, nobody
    connects as it and it is the cluster's own: `gpucluster verify` submits its measuring jobs as it), `max_gpus` as
    a limit on GPUs in use at once (GrpTRES=gres/gpu on the user's association: a job beyond it pends with
    AssocGrpGRES); fair share between them (slurm.conf's PriorityWeightFairshare). Then the leavers
    (`leavers_script`). Idempotent: `add` of what exists is a no-op,
    `modify` sets the limits anew. Root is not in the team's account, so the team's caps never stop an admin's job:
    it submits under Slurm's own root account (`gpucluster verify`'s DCGM job, run as root because DCGM's host
    engine answers root only)."""
    team = stack.spec.team
    quota = cost.quota(stack)
    lines = ["#!/bin/sh", "# Rendered by gpucluster: the team's Slurm account, money quota and caps on jobs.",
             f"sacctmgr -i add cluster {stack.cluster_name} >/dev/null 2>&1 || true",
             f"sacctmgr -i add account {team} Description='team {team}' Organization={team} >/dev/null 2>&1 || true"]
    # The quota in cent-minutes of the billing TRES; a cluster made before the money quota loses its GPU-minute one.
    limit = f"billing={quota.billing_minutes}" + (",gres/gpu=-1" if "gpu" in accelerator_gres(stack) else "")
    caps = " ".join(f"{key}={value}" for key, value in job_limits(stack).items())
    lines.append(f"sacctmgr -i modify account where name={team} set GrpTRESMins={limit} {caps}")
    counts_gpus = "gpu" in accelerator_gres(stack)  # max_gpus: NVIDIA GPUs (Neuron devices are no GPUs)
    for user, max_gpus in _team_users(stack).items():
        lines.append(f"sacctmgr -i add user {user} Account={team} DefaultAccount={team} >/dev/null 2>&1 || true")
        # GrpSubmitJobs cleared: a person listed again after a removal had it at 0. (A Grp* limit, not the Max* ones
        # the user's association takes from the account's as long as it has none of its own.)
        own = ["GrpSubmitJobs=-1"]
        if counts_gpus:  # sacctmgr(1), Slurm 24.11: GrpTRES bounds what running jobs of "this association and all
            # associations which are children of this association" hold; a user's association has no children.
            own.append(f"GrpTRES=gres/gpu={max_gpus or -1}")
        lines.append(f"sacctmgr -i modify user where name={user} account={team} set {' '.join(own)}")
    lines += _leavers(stack)
    lines.append(f"sacctmgr -i add user root Account={settings.SLURM_ROOT_ACCOUNT} >/dev/null 2>&1 || true")
    return "\n".join(lines) + "\n"


def _team_users(stack: Stack) -> dict[str, int | None]:
    """The team's users and their max_gpus: the people and the login user."""
    return {person.name: person.max_gpus for person in stack.spec.people} | {settings.LOGIN_USER: None}


def _leavers(stack: Stack) -> list[str]:
    team = stack.spec.team
    listed = " ".join(_team_users(stack))
    # Only whom the cluster made (the head's root-owned list, which keeps a removed person's name; never the GECOS
    # mark, which anyone making an account can copy): a user an admin added by hand keeps their association.
    made = f'uid=$(grep "^$user:" {settings.PEOPLE_ACCOUNTS_FILE} 2>/dev/null | cut -d: -f2)'
    # Their pending jobs by uid: the head deleted their account, and scancel --user takes only a name it can resolve.
    pending = (f"squeue -h -t PENDING -A {team} -o '%i %U' | "
               'while read -r job owner; do [ "$owner" = "$uid" ] && scancel "$job"; done')
    return [f"for user in $(sacctmgr -n -P list associations where account={team} format=user); do",
            f'  case " {listed} " in *" $user "*) continue ;; esac',
            f'  {made}; [ -n "$uid" ] || continue',
            f"  {pending} >/dev/null 2>&1 || true",
            f'  sacctmgr -i delete user where name="$user" account={team} >/dev/null 2>&1 ||',
            f'    sacctmgr -i modify user where name="$user" account={team} set GrpSubmitJobs=0',
            "done"]


def leavers_script(stack: Stack) -> str:
    """Someone the stack no longer lists loses their pending jobs and their association. While jobs of theirs still
    run, Slurm keeps the association (sacctmgr refuses to delete it), which then takes no new job (GrpSubmitJobs=0):
    the head's update timer runs this every minute (settings.PEOPLE_LEAVERS_SCRIPT), so the association goes within a
    minute of their last job's end, with no `pulumi up`. Part of the accounting script too."""
    return "\n".join(["#!/bin/sh", "# Rendered by gpucluster: the associations of people the stack removed.",
                      *_leavers(stack)]) + "\n"


# sacct and sreport ask slurmdbd, which has its own PrivateData (no `cloud`: nodes are slurmctld's).
SLURMDBD_PRIVATE_DATA = PRIVATE_DATA.removeprefix("cloud,")


def slurmdbd_conf(stack: Stack, layout: SlurmLayout = SlurmLayout()) -> str:
    return "\n".join([
        f"# Rendered by gpucluster for stack {stack.name}. "
        "slurmdbd requires this file to be mode 0600, owned by SlurmUser.",
        "AuthType=auth/munge",
        f"AuthInfo=socket={layout.munge_socket}",
        "DbdHost=localhost",
        f"DbdPort={layout.dbd_port}",
        f"SlurmUser={layout.slurm_user}",
        f"LogFile={layout.log_dir}/slurmdbd.log",
        f"PidFile={layout.run_dir}/slurmdbd.pid",
        f"PrivateData={SLURMDBD_PRIVATE_DATA}",
        "StorageType=accounting_storage/mysql",
        "StorageHost=localhost",
        f"StorageLoc={ACCOUNTING_DB}",
        f"StorageUser={layout.slurm_user}",
        "",
    ])


def cgroup_conf(stack: Stack) -> str:
    """Confinement by task/cgroup (slurmd reads it; configless nodes fetch it from the controller with slurm.conf)."""
    return "\n".join([
        f"# Rendered by gpucluster for stack {stack.name}. Jobs are confined to what Slurm allocated them.",
        # A job sees only the GPUs (and Neuron devices) it was given: CUDA_VISIBLE_DEVICES alone is advice, not a fence.
        "ConstrainDevices=yes",
        "ConstrainCores=yes",
        # The memory limit is the job's allocation (--mem, or the partition's DefMemPerCPU / DefMemPerGPU).
        "ConstrainRAMSpace=yes",
        "",
    ])


def job_container_conf(stack: Stack) -> str:
    """job_container/tmpfs: a private /tmp (under BasePath, on the node's scratch space: the instance store where
    there is one) and a private /dev/shm (a tmpfs of its own) for every job, unmounted and removed when the job ends.
    slurmd reads it; configless nodes fetch it from the controller with slurm.conf (slurmd_config_files).
    Shared: mounts made outside after the job started reach it (/fsx and /home are systemd automounts).
    slurmstepd stays outside (no EntireStepInNS: it would open the job's output files inside, where a path under /tmp
    is the job's own and goes with it); what it makes for the tasks goes elsewhere (mpi_conf)."""
    return "\n".join([
        f"# Rendered by gpucluster for stack {stack.name}. Every job its own /tmp and /dev/shm, gone when it ends.",
        "AutoBasePath=true",
        f"BasePath={settings.JOB_TMP_DIR}",
        "Dirs=/tmp,/dev/shm",
        "Shared=true",
        "",
    ])


def mpi_conf(stack: Stack) -> str:
    """mpi/pmix: slurmstepd makes each step's PMIx directory (its shared-memory store) for the tasks under /tmp by
    default, outside the job's namespace, where the tasks' own /tmp hides it (seen: MPI_Init failed with
    PMIX_ERR_FILE_OPEN_FAILURE). On the node's scratch space both see it. Configless nodes fetch it with slurm.conf."""
    return (f"# Rendered by gpucluster for stack {stack.name}. PMIx's directories for tasks: not in their /tmp.\n"
            f"PMIxCliTmpDirBase={settings.PMIX_TMP_DIR}\n")


# pyxis gives srun --container-image (enroot underneath). Optional: a node without the plugin still runs jobs. The
# head leaves out a plugin its image lacks (bootstrap.installed_spank_plugins); compute nodes take the head's file.
PYXIS_PLUGIN = "/usr/local/lib/slurm/spank_pyxis.so"
PLUGSTACK_CONF = f"# Rendered by gpucluster: pyxis for `srun --container-image`.\noptional {PYXIS_PLUGIN}\n"


def _lua_string(text: str) -> str:
    return json.dumps(text)  # pool names and GPU models are ASCII letters, digits and dashes: JSON's quotes are Lua's


def _lua_gres(pool: PoolSpec) -> str:
    acc = pool.itype.accelerator
    if acc is None:
        return "{}"
    name, kind = _gres_name_type(acc)
    return f"{{{name} = {{count = {acc.count}{f', type = {_lua_string(kind)}' if kind else ''}}}}}"


def job_submit_lua(stack: Stack) -> str:
    """slurmctld's job_submit.lua: each partition's pools, what one node of each offers jobs (as slurm.conf's node
    lines say) and how many nodes it has, then the fixed check (job_submit.CHECK) that refuses what none could run."""
    lines = [f"-- Rendered by gpucluster for stack {stack.name}. "
             "Change the stack file and run `pulumi up`; edits here are lost.",
             "",
             f"local DEFAULT_PARTITION = {_lua_string(default_partition(stack))}",
             "local PARTITIONS = {"]
    for name, members in partitions(stack).items():
        lines.append(f"  [{_lua_string(name)}] = {{")
        lines += [f"    {{name = {_lua_string(p.name)}, nodes = {p.max_nodes}, cpus = {p.itype.vcpus}, "
                  f"memory_mib = {real_memory(p)}, gres = {_lua_gres(p)}}}," for p in members]
        lines.append("  },")
    lines.append("}")
    return "\n".join(lines) + "\n" + job_submit.CHECK


def all_files(stack: Stack, layout: SlurmLayout = SlurmLayout()) -> dict[str, str]:
    """The files the head node writes to /etc/slurm (compute nodes get them from the controller: configless)."""
    # Without cgroups (the tests' sandbox), slurmd still loads a cgroup plugin unless told there is none.
    cgroups = cgroup_conf(stack) if layout.cgroups else "CgroupPlugin=disabled\n"
    return {"slurm.conf": slurm_conf(stack, layout), "gres.conf": gres_conf(stack, layout),
            "slurmdbd.conf": slurmdbd_conf(stack, layout), "plugstack.conf": PLUGSTACK_CONF,
            "job_submit.lua": job_submit_lua(stack), "cgroup.conf": cgroups,
            "job_container.conf": job_container_conf(stack), "mpi.conf": mpi_conf(stack)}
