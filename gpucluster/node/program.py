"""What the head's node programs share around their work: the log they write (settings.NODE_LOG, the journal and
stderr), the events log `gpucluster events` reads, and the frame of a run (its arguments, the settings, Slurm, the
exit status Slurm or systemd sees). Standard library only."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any, Callable

from gpucluster.contract.settings import ClusterSettings
from gpucluster.node import log
from gpucluster.node.slurm_control import SlurmControl


def setup_logging(log_file: str) -> None:
    """Every line to stderr, the journal and the log file."""
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if Path("/dev/log").exists():  # the journal: slurmctld keeps nothing of what its programs print
        from logging.handlers import SysLogHandler

        syslog = SysLogHandler(address="/dev/log")
        syslog.setFormatter(logging.Formatter("gpucluster-node[%(process)d]: %(levelname)s %(message)s"))
        handlers.append(syslog)
    try:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(log_file))
    except OSError as exc:  # the journal still gets everything
        print(f"gpucluster-node: cannot open {log_file}: {exc}", file=sys.stderr)
    logging.basicConfig(level=logging.INFO, handlers=handlers,
                        format="%(asctime)s %(name)s[%(process)d] %(levelname)s %(message)s", force=True)


def record_event(config: ClusterSettings, what: str, **details: Any) -> None:
    """One line of the events log (`gpucluster events`): when, what, and its details."""
    try:
        Path(config.events_log).parent.mkdir(parents=True, exist_ok=True)
        with open(config.events_log, "a") as f:
            f.write(json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "event": what,
                                **details}, sort_keys=True) + "\n")
    except OSError:
        log.exception("could not record %s in %s", what, config.events_log)


def run(argv: list[str], act: Callable[..., object], arguments: tuple[str, ...] = ()) -> int:
    """A head program's run: `act(config, slurm, *arguments)` with the cluster's settings and Slurm, logged. Slurm and
    systemd see only the exit status; the log keeps the whole story of a failure."""
    name = Path(argv[0]).name
    if len(argv) != 1 + len(arguments):
        print(" ".join(["usage:", name, *arguments]), file=sys.stderr)
        return 2
    config = ClusterSettings.load()
    setup_logging(config.log_file)
    try:
        act(config, SlurmControl(config.scontrol), *argv[1:])
    except Exception:
        log.exception("%s failed", " ".join([name, *argv[1:]]))
        return 1
    return 0
