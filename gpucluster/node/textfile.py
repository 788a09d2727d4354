"""Prometheus' text format into node_exporter's textfile collector (settings.TEXTFILE_DIR): the figures no exporter
has, written by the metrics program and the budget guardrail. Standard library only."""

from __future__ import annotations

import os
from pathlib import Path


def label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def sample(name: str, value: float, **labels: str) -> str:
    inner = ",".join(f'{k}="{label_value(v)}"' for k, v in sorted(labels.items()))
    # Every digit (shortest exact form): a byte counter in the terabytes must still rate() smoothly.
    text = str(int(value)) if float(value).is_integer() else repr(float(value))
    return f"{name}{{{inner}}} {text}\n" if inner else f"{name} {text}\n"


def family(name: str, kind: str, help_text: str, samples: list[str]) -> str:
    return f"# HELP {name} {help_text}\n# TYPE {name} {kind}\n" + "".join(samples) if samples else ""


def write(text: str, directory: Path, name: str) -> None:
    """Into one file by rename, so that a scrape never sees half of it."""
    directory.mkdir(parents=True, exist_ok=True)
    temporary = directory / f".{name}.tmp"  # the collector reads *.prom only
    temporary.write_text(text)
    os.chmod(temporary, 0o644)
    os.replace(temporary, directory / name)
