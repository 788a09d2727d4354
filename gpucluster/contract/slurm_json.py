"""What Slurm says of its nodes, jobs and partitions, read from its JSON (`scontrol show nodes|jobs|partitions --json`,
Slurm 24.11's data_parser) once for every program: the node programs, the budget guardrail, the bootstrap, the node
names and the metrics; and what its associations used this month, from sshare's rows (`account_rows`), for the
metrics, `gpucluster status` and `gpucluster cost`. Never from `--oneliner` text: there a job's comment, name or work
directory (any user's text) can carry " JobId=2 NodeList=..." and a repeated key's last value wins, so one user's job
would read as another's. In JSON each field is its own string. The records carry only the fields the programs use;
the raw documents stay here. Standard library only: the nodes import it from the bundle with the system python3."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from gpucluster.contract.hostlist import expand_hostlist

# Slurm's billing TRES counts US cents per hour: each partition weighs what a job holds (TRESBillingWeights) so that
# its billing is the price of its share of a node, and the team account's GrpTRESMins=billing is the month's quota
# in cent-minutes (render/slurm.py, spec/cost.billing_minutes). Named here because the head's programs read it too:
# a job's billing minutes are cent-minutes.
BILLING_CENTS_PER_USD = 100
# The columns every reader of usage asks sshare for (SlurmControl.account_usage): `-n -P` rows of them.
SSHARE_FORMAT = "Account,User,GrpTRESRaw,GrpTRESMins"


def tres_minutes(tres: str, name: str = "gres/gpu") -> float | None:
    """A TRES (gres/gpu unless named) from a list such as `cpu=120,billing=9000,gres/gpu=4800`; None when absent."""
    found = re.search(rf"(?:^|,){re.escape(name)}=(\d+)", tres)
    return float(found.group(1)) if found else None


def billing_usd(billing_minutes: float) -> float:
    """US dollars from minutes of the billing TRES (cent-minutes)."""
    return billing_minutes / 60 / BILLING_CENTS_PER_USD


@dataclass(frozen=True)
class AccountRow:
    """One association's row of `sshare -n -P -a -o Account,User,GrpTRESRaw,GrpTRESMins`: the TRES-minutes it used
    since the monthly reset (live, unlike sreport's hourly rollups: the very figures GrpTRESMins is enforced against)
    and its limit of billing minutes."""

    account: str
    user: str  # "" on the account's own row, which sums its users' and sub-accounts' use
    gpu_minutes: float  # 0 when the row has no gres/gpu
    billing_minutes: float  # cent-minutes: billing_usd
    quota_billing_minutes: float | None  # GrpTRESMins' billing; None when the association has no such limit


def account_rows(sshare_output: str) -> list[AccountRow]:
    """Every row of sshare's SSHARE_FORMAT. sshare indents each row by its depth in the tree (a user row one level
    below its account, naming the account in its first field): the fields are read stripped."""
    rows = []
    for line in sshare_output.splitlines():
        fields = [f.strip() for f in line.split("|")]
        if len(fields) != len(SSHARE_FORMAT.split(",")):
            continue
        account, user, used, limits = fields
        rows.append(AccountRow(account, user, tres_minutes(used) or 0.0, tres_minutes(used, "billing") or 0.0,
                               tres_minutes(limits, "billing")))
    return rows


def account_row(sshare_output: str, account: str) -> AccountRow | None:
    """The account's own row (the one without a user); None when sshare shows none (Slurm's PrivateData=usage shows
    someone who is not root only their own associations)."""
    return next((row for row in account_rows(sshare_output) if row.account == account and not row.user), None)


@dataclass(frozen=True)
class GpuHours:
    """GPU-hours this month by account and by person, and what each account's jobs billed against the money quota."""

    accounts: dict[str, float]  # an account's own row: its users' and sub-accounts' use summed
    users: dict[tuple[str, str], float]  # (account, user): a person's association under an account
    billed_usd: dict[str, float]  # an account's billing TRES in US dollars


def gpu_hours(sshare_output: str) -> GpuHours:
    """From every row of sshare's SSHARE_FORMAT."""
    rows = account_rows(sshare_output)
    return GpuHours(accounts={r.account: r.gpu_minutes / 60 for r in rows if not r.user},
                    users={(r.account, r.user): r.gpu_minutes / 60 for r in rows if r.user},
                    billed_usd={r.account: billing_usd(r.billing_minutes) for r in rows if not r.user})

# What scontrol runs for each reader.
SHOW_NODES = ("show", "nodes", "--json")
SHOW_JOBS = ("show", "jobs", "--json")
SHOW_PARTITIONS = ("show", "partitions", "--json")

# A job Slurm has started and not yet let go of: its nodes are its own (COMPLETING: its epilog still runs there;
# CONFIGURING: its nodes still boot).
ACTIVE_JOB_STATES = frozenset({"RUNNING", "COMPLETING", "CONFIGURING"})


@dataclass(frozen=True)
class Node:
    name: str
    state: frozenset[str]  # Slurm's state and its flags: {IDLE, CLOUD, POWERED_DOWN}
    hostname: str  # NodeHostName: the instance id the resume program set, until the node registers
    address: str  # NodeAddr: the node's IP once it registered, else its name
    reason: str  # DOWN or DRAIN reason, "" when none (without scontrol's " [user@time]" suffix)
    reason_user: str  # who set the reason
    reason_time: float  # when, in seconds since the epoch (0 when unknown)


@dataclass(frozen=True)
class Job:
    job_id: str
    state: frozenset[str]  # the base state and its flags: {PENDING}, {RUNNING}, {COMPLETED, COMPLETING}
    partition: str  # the partition(s) it asked for ("a,b") or runs in
    nodes: tuple[str, ...]  # the nodes it holds, expanded ("" host list: none)
    admin_comment: str  # only SlurmUser and root set it
    reason: str = ""  # why it waits (Resources, Priority, BeginTime...) or why it ended; "None" when nothing holds it

    @property
    def active(self) -> bool:
        """Running on its nodes (or still starting or ending there)."""
        return bool(self.state & ACTIVE_JOB_STATES)

    @property
    def pending(self) -> bool:
        return "PENDING" in self.state


@dataclass(frozen=True)
class Partition:
    name: str
    state: str  # UP, DOWN, DRAIN or INACTIVE


def nodes(text: str) -> list[Node]:
    """Every node of `scontrol show nodes --json`."""
    return [Node(name=_text(n, "name"), state=_flags(n, "state"), hostname=_text(n, "hostname"),
                 address=_text(n, "address"), reason=_text(n, "reason"), reason_user=_text(n, "reason_set_by_user"),
                 reason_time=float(_number(n.get("reason_changed_at"))))
            for n in _records(text, "nodes")]


def jobs(text: str) -> list[Job]:
    """Every job of `scontrol show jobs --json` (pending, running and recently ended)."""
    return [Job(job_id=str(_number(j.get("job_id"))), state=_flags(j, "job_state"), partition=_text(j, "partition"),
                nodes=tuple(expand_hostlist(_text(j, "nodes"))), admin_comment=_text(j, "admin_comment"),
                reason=_text(j, "state_reason"))
            for j in _records(text, "jobs")]


def partitions(text: str) -> list[Partition]:
    """Every partition of `scontrol show partitions --json`."""
    return [Partition(name=_text(p, "name"), state="+".join(_list(p.get("partition", {}), "state")))
            for p in _records(text, "partitions")]


def _records(text: str, key: str) -> list[dict[str, Any]]:
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"Slurm's {key}: not JSON ({exc})") from None
    records = document.get(key) if isinstance(document, dict) else None
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        errors = document.get("errors") if isinstance(document, dict) else None
        raise ValueError(f"Slurm's JSON lists no {key}" + (f": {errors}" if errors else ""))
    return records


def _text(record: dict[str, Any], key: str) -> str:
    value = record.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ValueError(f"Slurm's JSON: {key} is {type(value).__name__}, not text")
    return value


def _list(record: dict[str, Any], key: str) -> list[str]:
    value = record.get(key) or []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"Slurm's JSON: {key} is not a list of words")
    return value


def _flags(record: dict[str, Any], key: str) -> frozenset[str]:
    return frozenset(_list(record, key))


def _number(value: Any) -> int:
    """A number as data_parser writes it: plain, or {"set": true, "infinite": false, "number": N} (0 when unset)."""
    if isinstance(value, dict):
        return _number(value.get("number")) if value.get("set") and not value.get("infinite") else 0
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise ValueError(f"Slurm's JSON: {value!r} is not a number")
