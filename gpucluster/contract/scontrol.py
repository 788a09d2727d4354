"""What `scontrol show ... --oneliner` prints, read once for every program (node programs, budget guardrail,
bootstrap, node names). Standard library only: the nodes import it from the bundle with the system python3."""

from __future__ import annotations

import re


def parse_oneliner(line: str) -> dict[str, str]:
    """One record of `scontrol show ... --oneliner`. Values run to the next " Key=" (reasons contain spaces)."""
    parts = re.split(r" (?=[A-Za-z]+=)", line.strip())
    return dict(p.split("=", 1) for p in parts if "=" in p)


def node_records(text: str) -> list[dict[str, str]]:
    """Every node of `scontrol show nodes --oneliner`."""
    return [parse_oneliner(line) for line in text.splitlines() if line.startswith("NodeName=")]


def job_records(text: str) -> list[dict[str, str]]:
    """Every job of `scontrol show jobs --oneliner`."""
    return [parse_oneliner(line) for line in text.splitlines() if line.startswith("JobId=")]


def state_flags(record: dict[str, str]) -> set[str]:
    """A node's State as its flags: IDLE+CLOUD+POWERED_DOWN -> {IDLE, CLOUD, POWERED_DOWN}."""
    return set(record.get("State", "").split("+"))
