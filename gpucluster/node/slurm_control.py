"""The scontrol (and scancel and sshare) calls the node programs make, in one place: the resume, suspend and resume-fail
programs, the reconciler, the interruptions service, the budget guardrail, the health check and the readers of usage.
What it reads, it reads from Slurm's JSON (contract.slurm_json), where no user's text can pass for another field, or
from sshare's rows. Standard library only."""

from __future__ import annotations

import subprocess
from pathlib import Path

from gpucluster.contract import slurm_json
from gpucluster.contract.hostlist import in_batches
from gpucluster.contract.slurm_json import Job, Node
from gpucluster.node import log

SCONTROL_BATCH = 200  # nodes per scontrol update
# A hung slurmctld must not hang a program: Slurm kills a ResumeProgram only after ResumeTimeout, with nodes half set.
SCONTROL_TIMEOUT = 60
REASON_LENGTH = 200  # Slurm keeps no more of a reason


class SlurmControl:
    """Slurm's controller as the programs see it, through scontrol. Each call fails with scontrol's own error (logged
    with its stderr) or after `timeout` seconds."""

    def __init__(self, scontrol: str = "scontrol", timeout: float = SCONTROL_TIMEOUT):
        self.scontrol = scontrol
        self.timeout = timeout

    def _run(self, *args: str) -> str:
        return self._call(self.scontrol, *args)

    def _call(self, *command: str) -> str:
        try:
            return subprocess.run(list(command), check=True, capture_output=True, text=True,
                                  timeout=self.timeout).stdout
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            # The exception's text has neither the tool's stderr nor the nodes; stderr is what says why.
            log.error("%s; stderr: %s", exc, error_text(exc).strip() or "(none)")
            raise

    def _tool(self, name: str) -> str:
        """Another Slurm command, from where scontrol is."""
        return str(Path(self.scontrol).with_name(name)) if "/" in self.scontrol else name

    def _update(self, nodes: list[str], *settings: str) -> None:
        for batch in in_batches(sorted(nodes), SCONTROL_BATCH):
            self._run("update", f"nodename={','.join(batch)}", *settings)

    # --- nodes ------------------------------------------------------------------------------------------------------
    def nodes(self) -> list[Node]:
        return slurm_json.nodes(self._run(*slurm_json.SHOW_NODES))

    def set_instances(self, instances: dict[str, str]) -> None:
        """Each node's instance id as its NodeHostName, many nodes per call (scontrol takes matching lists): the
        instance finds its node by it. When the node registers, Slurm sets NodeAddr and NodeHostName from it (as it
        does for every cloud node), and back to the node name when it powers down."""
        for batch in in_batches(sorted(instances), SCONTROL_BATCH):
            self._run("update", f"nodename={','.join(batch)}", f"nodehostname={','.join(instances[n] for n in batch)}")

    def set_down(self, nodes: list[str], reason: str) -> None:
        """DOWN with the reason: Slurm requeues the job (held for the credential lifetime, 120 s by default) and
        schedules it on nodes that are not DOWN. The reconciler returns the node to service later, unless the reason
        is a configuration error."""
        if nodes:
            self._update(nodes, "state=down", f"reason={reason[:REASON_LENGTH]}")

    def drain(self, nodes: list[str], reason: str) -> None:
        """No new job; running ones go on. The reconciler replaces the node once it is idle (reasons.REPLACE)."""
        if nodes:
            self._update(nodes, "state=drain", f"reason={reason[:REASON_LENGTH]}")

    def power_down(self, nodes: list[str]) -> None:
        """Back to powered-down cloud nodes (idle~), schedulable again."""
        if nodes:
            self._update(nodes, "state=power_down_force")

    def power_up(self, nodes: list[str]) -> None:
        """Slurm runs the resume program for them and counts on them from then on (always-on nodes)."""
        if nodes:
            self._update(nodes, "state=power_up")

    def power_down_idle(self, keep: set[str]) -> list[str]:
        """Nodes that are up and idle: powered down now (Slurm calls the suspend program), not after SuspendTime.
        `keep`: the always-on nodes, which the team chose to keep running (a power-down request would override
        SuspendExcNodes)."""
        idle = [n.name for n in self.nodes() if _idle_and_up(n.state) and n.name not in keep]
        if idle:
            self._update(idle, "state=power_down")
        return idle

    # --- jobs -------------------------------------------------------------------------------------------------------
    def queue(self) -> list[Job]:
        """Every job slurmctld still knows (pending, running, recently ended)."""
        return slurm_json.jobs(self._run(*slurm_json.SHOW_JOBS))

    def jobs_on(self, node: str) -> list[str]:
        """Ids of the jobs running on the node (`scontrol show node` lists none; `show jobs` does)."""
        return [job.job_id for job in self.queue() if job.active and node in job.nodes]

    def pending_jobs(self) -> dict[str, str]:
        """Pending job id -> its AdminComment ("" when none)."""
        return {job.job_id: job.admin_comment for job in slurm_json.jobs(self._run(*slurm_json.SHOW_JOBS))
                if job.pending}

    def set_admin_comment(self, job: str, text: str) -> None:
        self._run("update", f"jobid={job}", f"admincomment={text}")

    def signal_job(self, job: str, signal_name: str) -> None:
        """To the batch step and every job step (`scancel --full`): the job's processes hear it, wherever they run."""
        self._call(self._tool("scancel"), f"--signal={signal_name}", "--full", job)

    def requeue(self, job: str) -> None:
        self._run("requeue", job)

    # --- partitions -------------------------------------------------------------------------------------------------
    def partitions(self) -> dict[str, str]:
        """Partition name -> State (UP, DOWN, DRAIN, INACTIVE)."""
        return {p.name: p.state for p in slurm_json.partitions(self._run(*slurm_json.SHOW_PARTITIONS))}

    def account_usage(self, account: str | None = None) -> str:
        """`sshare` of the account and its users, or of every association: rows of slurm_json.SSHARE_FORMAT
        (slurm_json.account_rows), live TRES-minutes (sreport waits for the hourly rollup). Slurm's PrivateData=usage
        (render/slurm.py PRIVATE_DATA) shows someone who is not root only their own associations."""
        return self._call(self._tool("sshare"), "-n", "-P", "-a", *(("-A", account) if account else ()), "-o",
                          slurm_json.SSHARE_FORMAT)

    def set_partition_state(self, names: list[str], state: str) -> None:
        for name in names:
            self._run("update", f"partitionname={name}", f"state={state}")


def _idle_and_up(flags: frozenset[str]) -> bool:
    """An idle cloud node that is up."""
    return {"IDLE", "CLOUD"} <= flags and not flags & {"POWERED_DOWN", "POWERING_DOWN", "POWERING_UP", "DOWN",
                                                        "COMPLETING"}


def error_text(exc: subprocess.CalledProcessError | subprocess.TimeoutExpired) -> str:
    """A failed tool's stderr. TimeoutExpired carries raw bytes even when the call asked for text."""
    data = exc.stderr
    return data.decode(errors="replace") if isinstance(data, bytes) else data or ""
