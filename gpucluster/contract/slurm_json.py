"""What Slurm says of its nodes, jobs and partitions, read from its JSON (`scontrol show nodes|jobs|partitions --json`,
Slurm 24.11's data_parser) once for every program: the node programs, the budget guardrail, the bootstrap, the node
names and the metrics. Never from `--oneliner` text: there a job's comment, name or work directory (any user's
text) can carry " JobId=2 NodeList=..." and a repeated key's last value wins, so one user's job would read as
another's. In JSON each field is its own string. The records carry only the fields the programs use; the raw
documents stay here. Standard library only: the nodes import it from the bundle with the system python3."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from gpucluster.contract.hostlist import expand_hostlist

# Slurm's billing TRES counts US cents per hour (gpucluster.spec.cost.BILLING_UNITS_PER_USD, which the node programs
# cannot import): a job's billing minutes are cent-minutes.
BILLING_CENTS_PER_USD = 100


def tres_minutes(tres: str, name: str = "gres/gpu") -> float | None:
    """A TRES (gres/gpu unless named) from a list such as `cpu=120,billing=9000,gres/gpu=4800`; None when absent."""
    found = re.search(rf"(?:^|,){re.escape(name)}=(\d+)", tres)
    return float(found.group(1)) if found else None

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
