#!/usr/bin/env python3
"""The reconciler on the head node (settings.RECONCILE_PROGRAM, run by its timer every minute): classify every node
(its Slurm state and its instance) and every unowned instance into a status, then act per status: power up always-on
nodes, set DOWN nodes whose instance vanished, return nodes DOWN for a passing cause to service with backoff, replace
the instance of a node drained for it once idle (a pool whose fresh instances keep failing their health check, only up
to a bound: then DOWN, needing a fix), terminate instances nothing owns once their launch grace is over and those of
nodes DOWN for a configuration fault (never relaunched).
Standard library and boto3."""

from __future__ import annotations

import enum
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the library this program is part of (the bundle's lib/)
from gpucluster.contract import reasons
from gpucluster.contract.hostlist import compress_hostlist
from gpucluster.contract.settings import SLURM_USER, ClusterSettings
from gpucluster.contract.slurm_json import Node
from gpucluster.node import log, program
from gpucluster.node.budget import budget_closed
from gpucluster.node.fleet import cluster_instances, ec2_client, terminate
from gpucluster.node.registry import forget, read_registry, registry
from gpucluster.node.slurm_control import SlurmControl

MAX_RETRY_SECONDS = 3600  # the backoff of a node that keeps failing stops doubling here


class Status(enum.Enum):
    HEALTHY = "healthy"  # up with its instance, or off without one
    CHANGING = "changing"  # powering up or down: the resume and suspend programs (and ResumeTimeout) see to it
    POWER_UP = "power up"  # an always-on node that is off: Slurm is asked to power it up (the resume program runs)
    LOST = "lost"  # Slurm counts on it, its instance is gone (spot reclaim, terminated outside Slurm): set DOWN
    RETRY = "retry"  # DOWN for a passing cause and its backoff is over: terminate what is left, back to service
    BACKING_OFF = "backing off"  # DOWN for a passing cause, waiting for its next try
    # DOWN for a configuration error: stays DOWN, its reason says what to fix; an instance it has is terminated
    NEEDS_FIX = "needs a fix"
    HELD = "held by an admin"  # DOWN or DRAIN set by a person (or drained by Slurm): left alone
    LEFTOVER = "leftover"  # Slurm has it off but its instance runs: terminate
    DRAINING = "draining for a new instance"  # drained by the cluster (reasons.REPLACE), jobs still on it: wait
    REPLACE = "replace"  # drained by the cluster, idle or its instance gone: new instance (back to service)


@dataclass(frozen=True)
class NodeView:
    """What the reconciler knows of one node."""

    name: str
    flags: frozenset[str]
    reason: str = ""
    reason_user: str = ""
    reason_time: float = 0.0
    always_on: bool = False
    has_instance: bool = False  # a live instance the registry gives it
    failures: int = 0  # consecutive returns to service that did not stick

    @classmethod
    def from_slurm(cls, node: Node, **known: Any) -> NodeView:
        return cls(name=node.name, flags=node.state, reason=node.reason, reason_user=node.reason_user,
                   reason_time=node.reason_time, **known)


def retry_delay(failures: int, base: int) -> float:
    """Seconds a node waits, DOWN, before its next return to service: the base, doubled per failure before, capped."""
    doubled: int = base * 2 ** min(failures, 16)  # int ** int is typed Any: a negative power would be a float
    return min(doubled, max(base, MAX_RETRY_SECONDS))


def classify(node: NodeView, now: float, retry_base: int) -> Status:
    """The node's status from its Slurm state and its instance: a pure function, one row per case."""
    flags = node.flags
    if "FUTURE" in flags:
        return Status.HEALTHY
    # The interruptions service drains as slurm, a node's own health check as root.
    if "DRAIN" in flags and "DOWN" not in flags and node.reason_user in (SLURM_USER, "root") and \
            node.reason.startswith(reasons.REPLACE):
        busy = flags & {"ALLOCATED", "MIXED", "COMPLETING"}
        return Status.DRAINING if busy and node.has_instance else Status.REPLACE
    if "DOWN" in flags or "DRAIN" in flags:
        # The cluster's programs (as slurm) and a node's own first-boot checks (as root) set it. slurmctld appends its
        # own reasons to one already there: "old : new".
        if "DOWN" in flags and node.reason_user in (SLURM_USER, "root") and reasons.CONFIGURATION in node.reason:
            return Status.NEEDS_FIX
        if node.reason_user != SLURM_USER or "DOWN" not in flags:
            return Status.HELD  # an admin's hold; drained nodes finish their jobs first (health checks drain)
        return Status.RETRY if now - node.reason_time >= retry_delay(node.failures, retry_base) else Status.BACKING_OFF
    if flags & {"POWERING_UP", "POWERING_DOWN", "POWER_DOWN", "POWER_UP"}:  # asked for, or under way
        return Status.CHANGING
    if "POWERED_DOWN" in flags:
        if node.has_instance:
            return Status.LEFTOVER
        return Status.POWER_UP if node.always_on else Status.HEALTHY
    return Status.HEALTHY if node.has_instance else Status.LOST


def orphans(instances: dict[str, dict[str, Any]], owned: set[str], now: float, grace: int) -> list[str]:
    """Live pool instances no node owns, launched more than `grace` seconds ago."""
    return sorted(i for i, inst in instances.items() if i not in owned and now - _launch_time(inst) >= grace)


def _launch_time(instance: dict[str, Any]) -> float:
    launched = instance.get("LaunchTime")  # botocore parses it into a datetime
    return launched.timestamp() if isinstance(launched, datetime) else time.time()


def reconcile(config: ClusterSettings, ec2: Any, slurm: SlurmControl,
              now: float | None = None) -> dict[str, list[str]]:
    """One pass of the timer. Returns what it did, by status. Each action is guarded on its own: one that fails is
    logged and the others still run."""
    now = time.time() if now is None else now
    instances = cluster_instances(config, ec2)
    state = read_registry(config)
    always_on = config.always_on_nodes()
    records = slurm.nodes()
    views = [NodeView.from_slurm(node, always_on=node.name in always_on,
                                 has_instance=state.instances.get(node.name, {}).get("instance") in instances,
                                 failures=state.failures.get(node.name, 0))
             for node in records if config.pool_of(node.name)]
    statuses = {view.name: classify(view, now, config.capacity_retry_seconds) for view in views}
    by_status: dict[Status, list[str]] = defaultdict(list)
    for name, status in statuses.items():
        by_status[status].append(name)
    stray = orphans(instances, set(state.owner()), now, config.orphan_grace_seconds)
    # Entries for nodes Slurm no longer has (a stack that dropped them, applied by a new head): their instances are
    # nobody's, past the same grace.
    known = {node.name for node in records}  # a pool the new settings drop may still be draining
    gone = [n for n, e in state.instances.items()
            if n not in known and now - e.get("launched", 0) >= config.orphan_grace_seconds]
    seen = {n: e["instance"] for n, e in state.instances.items()}
    done: dict[str, list[str]] = {}

    def act(what: str, nodes: list[str], action: Callable[[list[str]], object]) -> None:
        if not nodes:
            return
        try:
            if action(nodes) is not False:
                done[what] = sorted(nodes)
        except Exception:  # the next pass tries again; the other actions of this pass still run
            log.exception("reconcile: %s %s failed", what, compress_hostlist(nodes))

    act("terminated", stray, lambda ids: _terminate_orphans(ec2, ids))
    act("forgotten", gone, lambda nodes: _terminate_orphans(ec2, forget(config, nodes, seen)))
    act("leftover", by_status[Status.LEFTOVER], lambda nodes: terminate(ec2, forget(config, nodes, seen)))
    act("down", by_status[Status.LOST], lambda nodes: _set_lost(slurm, nodes))
    # By the registry, not by tags: an instance that lacks its pool tag (one of the faults) is not among `instances`.
    act("ended", [n for n in by_status[Status.NEEDS_FIX] if n in seen],
        lambda nodes: _end_faulty(config, ec2, nodes, seen))
    act("retried", by_status[Status.RETRY],
        lambda nodes: _fresh_start(config, ec2, slurm, nodes, seen, replacing=False))
    # A pool whose fresh instances keep failing their health check: no more fresh instances past the bound.
    sick = [v for v in views if statuses[v.name] is Status.REPLACE and v.reason.startswith(reasons.HEALTH)]
    refused = _health_bound(config, sick, now)
    act("not replaced", refused, lambda nodes: _stop_replacing(config, slurm, nodes, sick))
    act("replaced", [n for n in by_status[Status.REPLACE] if n not in refused],
        lambda nodes: _fresh_start(config, ec2, slurm, nodes, seen, replacing=True))
    act("powered up", by_status[Status.POWER_UP], lambda nodes: _power_up(config, slurm, nodes))
    healthy_up = [v.name for v in views if statuses[v.name] is Status.HEALTHY and v.has_instance and v.failures]
    act("recovered", healthy_up, lambda nodes: _clear_failures(config, nodes))
    log.info("reconcile: %s", "; ".join(f"{status.value} {compress_hostlist(nodes)}"
                                         for status, nodes in sorted(by_status.items(), key=lambda i: i[0].value)
                                         if nodes))
    return done


def _terminate_orphans(ec2: Any, ids: list[str]) -> None:
    if ids:
        log.warning("instance(s) %s belong to no node (past their launch grace): terminating", ",".join(ids))
        terminate(ec2, ids)


def _end_faulty(config: ClusterSettings, ec2: Any, nodes: list[str], seen: dict[str, str]) -> None:
    """A node DOWN for a configuration fault that its instance found at boot: no job can use the instance, and
    another would meet the same fault. It goes now, not at ResumeTimeout; the node stays DOWN, never relaunched."""
    ids = forget(config, nodes, seen)
    log.error("node(s) %s are DOWN for a configuration fault (sinfo -R says what to fix): terminating %s; they stay "
              "DOWN until it is fixed", compress_hostlist(nodes), ",".join(ids))
    terminate(ec2, ids)


def _set_lost(slurm: SlurmControl, nodes: list[str]) -> None:
    log.error("node(s) %s lost their instance: setting them DOWN", compress_hostlist(nodes))
    slurm.set_down(nodes, f"{reasons.PREFIX} instance vanished (spot reclaim or terminated outside Slurm)")


def _fresh_start(config: ClusterSettings, ec2: Any, slurm: SlurmControl, nodes: list[str],
                 seen: dict[str, str], replacing: bool) -> None:
    """Terminate what is left of the nodes' instances and power them down: idle~, the next job gets a fresh instance
    (an always-on node, the next pass's power up). A return to service after a failure counts the attempt, so the
    next one waits twice as long; a replacement (the node was drained for it) is no failure, and an event."""
    ids = forget(config, nodes, seen)
    what = "replacing their instance" if replacing else "returning to service"
    log.info("node(s) %s: %s (terminating %s)", compress_hostlist(nodes), what, ",".join(ids) or "nothing")
    terminate(ec2, ids)
    if not replacing:
        with registry(config) as state:
            for n in nodes:
                state.failures[n] = state.failures.get(n, 0) + 1
    slurm.power_down(nodes)
    if replacing:
        program.record_event(config, "replaced", nodes=nodes, instances=ids)


def _health_bound(config: ClusterSettings, sick: list[NodeView], now: float) -> list[str]:
    """The nodes drained by their health check that their pool may not replace: it replaced
    config.health_replacements within the window already. Each one it may replace is counted now (under the
    registry's lock, in the head's state: the count outlives the pass and the head's reboot); the count of a pool
    forgets what is older than the window."""
    window = config.health_replacement_window_seconds
    refused = []
    with registry(config) as state:
        for pool in list(state.health_replacements):
            recent = [t for t in state.health_replacements[pool] if now - t < window]
            state.health_replacements[pool] = recent
            if not recent:
                del state.health_replacements[pool]
        for view in sorted(sick, key=lambda v: v.name):
            pool = config.pool_of(view.name)
            times = state.health_replacements.setdefault(pool, [])
            if len(times) >= config.health_replacements:
                refused.append(view.name)
            else:
                times.append(now)
    return refused


def _stop_replacing(config: ClusterSettings, slurm: SlurmControl, nodes: list[str], sick: list[NodeView]) -> None:
    """DOWN under reasons.CONFIGURATION, saying why and what to do: the next pass ends the instance (NEEDS_FIX) and
    nothing relaunches the node until someone returns it to service. The NodeDown alert follows in 10 minutes."""
    window_hours = config.health_replacement_window_seconds / 3600
    found = {v.name: v.reason.removeprefix(f"{reasons.HEALTH}: ") for v in sick}
    by_pool: dict[str, list[str]] = defaultdict(list)
    for node in nodes:
        by_pool[config.pool_of(node)].append(node)
    for pool, members in sorted(by_pool.items()):
        log.error("pool %s: %d instances replaced for their health within %g h; not replacing %s (%s)", pool,
                  config.health_replacements, window_hours, compress_hostlist(members), found[members[0]])
        # Slurm keeps 200 characters of a reason: what each node failed is in the log and the event.
        slurm.set_down(members, f"{reasons.HEALTH_REPEATS} in pool {pool} ({config.health_replacements} replaced "
                                f"in {window_hours:g} h): not replaced again; find the cause (image, driver, a job), "
                                "then resume the node (scontrol update ... state resume)")
        program.record_event(config, "replacement stopped", nodes=members, pool=pool,
                             replaced=config.health_replacements,
                             window_seconds=config.health_replacement_window_seconds,
                             health=[found[n] for n in members])


def _power_up(config: ClusterSettings, slurm: SlurmControl, nodes: list[str]) -> bool:
    if budget_closed(config.budget_state_file):
        log.warning("always-on node(s) %s are off: not powering up, the budget guardrail has closed the cluster",
                    compress_hostlist(nodes))
        return False
    log.info("always-on node(s) %s are off: powering them up", compress_hostlist(nodes))
    slurm.power_up(nodes)
    return True


def _clear_failures(config: ClusterSettings, nodes: list[str]) -> None:
    with registry(config) as state:
        for n in nodes:
            state.failures.pop(n, None)


def main(argv: list[str]) -> int:
    return program.run(argv, lambda config, slurm: reconcile(config, ec2_client(config), slurm))


if __name__ == "__main__":
    sys.exit(main(sys.argv))
