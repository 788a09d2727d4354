"""Slurm 24.11.5's JSON as the programs get it: one real record of each kind in tests/slurm-json/ (a node, a running
job, a partition), captured from the rehearsal's slurmctld (`scontrol show nodes|jobs|partitions --json`; the job's
paths made neutral), with the fields a test sets. Every field a test does not set stays as Slurm printed it, so the
readers (contract.slurm_json) meet the real shapes."""

from __future__ import annotations

import copy
import json
from functools import cache
from pathlib import Path
from typing import Any

SAMPLES = Path(__file__).resolve().parent / "slurm-json"


@cache
def _sample(kind: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((SAMPLES / f"{kind}.json").read_text())
    return loaded


def _time(seconds: float) -> dict[str, Any]:
    return {"set": True, "infinite": False, "number": int(seconds)}


def node(name: str, state: str = "IDLE+CLOUD", reason: str = "", user: str = "", at: float = 0,
         **fields: Any) -> dict[str, Any]:
    """A node record. `state` as scontrol's text shows it (IDLE+CLOUD+POWERED_DOWN); `user` and `at` set the reason;
    `fields`: any other field by its JSON name (hostname, address, comment...)."""
    record = copy.deepcopy(_sample("node"))
    record.update(name=name, hostname=name, address=name, state=state.split("+"), reason=reason,
                  reason_set_by_user=user, reason_changed_at=_time(at))
    record.update(fields)
    return record


def job(job_id: int, state: str = "RUNNING", nodes: str = "", partition: str = "spot", **fields: Any) -> dict[str, Any]:
    """A job record; `state` as Slurm's list joined by + (COMPLETED+COMPLETING); `fields` by their JSON names
    (comment, name, admin_comment, current_working_directory...)."""
    record = copy.deepcopy(_sample("job"))
    record.update(job_id=job_id, job_state=state.split("+"), nodes=nodes, batch_host=nodes.split(",")[0],
                  partition=partition)
    record.update(fields)
    return record


def partition(name: str, state: str = "UP") -> dict[str, Any]:
    record = copy.deepcopy(_sample("partition"))
    record.update(name=name, partition={"state": [state]})
    return record


def document(kind: str, records: list[dict[str, Any]]) -> str:
    """scontrol's whole answer: {"nodes": [...], "meta": ..., "errors": [], "warnings": []}."""
    return json.dumps({kind: records, "meta": {}, "errors": [], "warnings": []})
