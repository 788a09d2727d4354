"""A stack's use as its head node knows it: GPU-hours and billing from Slurm's accounting (sshare), idle GPU-hours
from its Prometheus, for `gpucluster cost` and the cost board (`cost --all`) run there; and the one rule for whether
this machine is a stack's head, which `cost`, `status` and `verify` share. No AWS call, no credentials: the
operator's side (gpucluster/aws/spend.py, cost_board.py) is handed what this reads, or why it could not.
Standard library only: the head runs it from the bundle."""

from __future__ import annotations

import datetime as dt
import subprocess
import urllib.parse
from collections.abc import Callable
from pathlib import Path

from gpucluster.contract import slurm_json
from gpucluster.contract.settings import PROMETHEUS_PORT, SETTINGS_FILE, ClusterSettings
from gpucluster.contract.slurm_json import GpuHours
from gpucluster.node.prometheus_api import prometheus_get
from gpucluster.node.slurm_control import SlurmControl, error_text

# What `cost` says of GPU-hours off the head node: only Slurm's accounting there has them.
OFF_THE_HEAD = "run this on the head node to read Slurm accounting"
PROMETHEUS = f"http://127.0.0.1:{PROMETHEUS_PORT}"


class SlurmUnanswered(Exception):
    """sshare failed or hung on the head node (slurmctld or slurmdbd down): said in the report, not a traceback."""


def here(cluster: str | None = None, settings_file: str | Path = SETTINGS_FILE) -> ClusterSettings | str:
    """This head node's settings (the bootstrap writes them, readable by all) when it is `cluster`'s head (any
    cluster's when None), else why it is not one: no settings file here, one that cannot be read or is not settings,
    or another cluster's. Not "sshare is on PATH": an operator's or a login machine may have Slurm's client, and
    another cluster's head has sshare too but not this stack's accounting."""
    try:
        found = ClusterSettings.load(settings_file)
    except FileNotFoundError:
        return f"no {settings_file} here"
    # ValueError: not JSON, not UTF-8, or not the contract's shape or keys (SettingsError).
    except (OSError, ValueError) as exc:
        return f"{settings_file} cannot be read as the cluster's settings: {exc}"
    if cluster is not None and found.cluster != cluster:
        return f"this is the head node of {found.cluster}, not of {cluster}"
    return found


def on_the_head(cluster: str, settings_file: str | Path = SETTINGS_FILE) -> bool:
    return isinstance(here(cluster, settings_file), ClusterSettings)


def slurm_gpu_hours(slurm: SlurmControl | None = None) -> GpuHours:
    """Every association's use this month, from sshare (as root: all of them; as anyone else, Slurm's PrivateData
    shows their own)."""
    try:
        return slurm_json.gpu_hours((slurm or SlurmControl()).account_usage())
    except subprocess.CalledProcessError as exc:
        raise SlurmUnanswered(f"sshare exited {exc.returncode}: {error_text(exc).strip() or 'no message'}") from None
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SlurmUnanswered(f"sshare: {exc}") from None


def head_gpu_hours(cluster: str, settings_file: str | Path = SETTINGS_FILE) -> GpuHours | str:
    """The cluster's GPU-hours where they can be read (its head node), else what the report says instead."""
    if not on_the_head(cluster, settings_file):
        return OFF_THE_HEAD
    try:
        return slurm_gpu_hours()
    except SlurmUnanswered as exc:
        return f"Slurm did not answer ({exc})"


def head_usage(cluster: str, team: str, idle_query: Callable[[int], str], now: dt.datetime,
               settings_file: str | Path = SETTINGS_FILE,
               prometheus: str = PROMETHEUS) -> tuple[float | str, float | str] | None:
    """On the cluster's head: the team account's GPU-hours from Slurm, and its GPUs' idle hours since the month began
    from Prometheus (`idle_query(seconds)`, render/prometheus.py), each a figure or why there is none. None elsewhere:
    neither can be read here."""
    used = head_gpu_hours(cluster, settings_file)
    if used == OFF_THE_HEAD:
        return None
    if isinstance(used, str):
        return used, used
    hours: float | str = used.accounts[team] if team in used.accounts else \
        f"Slurm shows account {team}'s to root only (an admin's sudo)"
    month_start = now.astimezone(dt.timezone.utc).replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    seconds = max(1, int((now - month_start).total_seconds()))
    return hours, prometheus_value(prometheus, idle_query(seconds), now)


def prometheus_value(base: str, query: str, at: dt.datetime) -> float | str:
    """An instant query's one value at `at` (Prometheus' HTTP API, /api/v1/query); an empty answer is 0: no series
    had a sample in the range (no GPU reported)."""
    try:
        result = prometheus_get(base, "query?" + urllib.parse.urlencode(
            {"query": query, "time": f"{at.timestamp():.3f}"}))["result"]
        return float(result[0]["value"][1]) if result else 0.0
    except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
        return f"Prometheus did not answer ({exc})"
