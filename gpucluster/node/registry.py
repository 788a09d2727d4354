"""Which EC2 instance is which Slurm node: the head's registry (settings.NODE_REGISTRY), written by the resume program
the moment EC2 answers, read and changed by the suspend and resume-fail programs, the reconciler and the
interruptions service, which run side by side. Standard library only."""

from __future__ import annotations

import fcntl
import json
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

from gpucluster.contract.settings import ClusterSettings


@dataclass
class RegistryState:
    """node -> {"instance": id, "launched": epoch seconds}, node -> consecutive failed returns to service, and pool ->
    when its nodes' instances were replaced for a failed health check (epoch seconds, the reconciler's bound)."""

    instances: dict[str, dict[str, Any]] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)
    health_replacements: dict[str, list[float]] = field(default_factory=dict)

    def owner(self) -> dict[str, str]:
        """instance id -> node."""
        return {entry["instance"]: node for node, entry in self.instances.items()}


@contextmanager
def registry(config: ClusterSettings, write: bool = True) -> Iterator[RegistryState]:
    """Read, change and write the registry under its lock. Written by rename, so a crash leaves the old file or the
    new one, never half of one."""
    path = Path(config.registry_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        raw = json.loads(path.read_text()) if path.exists() else {}
        state = RegistryState(raw.get("instances", {}), raw.get("failures", {}), raw.get("health_replacements", {}))
        yield state
        if write:
            temporary = path.with_suffix(".tmp")
            temporary.write_text(json.dumps({"instances": state.instances, "failures": state.failures,
                                             "health_replacements": state.health_replacements}, sort_keys=True))
            os.replace(temporary, path)


def read_registry(config: ClusterSettings) -> RegistryState:
    with registry(config, write=False) as state:
        return state


def record(config: ClusterSettings, launched: dict[str, str]) -> None:
    """The nodes' new instances (node -> instance id), launched now."""
    if launched:
        now = time.time()
        with registry(config) as state:
            state.instances.update({n: {"instance": i, "launched": now} for n, i in launched.items()})


def forget(config: ClusterSettings, nodes: Iterable[str], seen: dict[str, str] | None = None) -> list[str]:
    """Drop the nodes from the registry; returns their instances. With `seen` (node -> instance, as a reconciler pass
    saw them), only entries still naming that instance: a resume that ran meanwhile keeps its fresh one."""
    with registry(config) as state:
        return [state.instances.pop(n)["instance"] for n in nodes
                if n in state.instances and (seen is None or state.instances[n]["instance"] == seen.get(n))]
