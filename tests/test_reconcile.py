"""The reconciler: each node's status from its Slurm state and its instance, and what a pass does about it; against
in-process moto and a recording stand-in for scontrol."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from gpucluster.contract import reasons, slurm_json
from gpucluster.contract.settings import CLUSTER_TAG, POOL_TAG, ClusterSettings, PoolSettings
from gpucluster.node import fleet
from gpucluster.node.reconcile import NodeView, Status, classify, reconcile
from gpucluster.node.registry import read_registry, registry
from gpucluster.node.resume import resume
from head_fakes import NOW, FakeSlurm, ec2_fixture, live, make_config  # noqa: F401  (the ec2 fixture)
from slurm_samples import document, node


def view(state: str, reason: str = "", user: str = "slurm", ago: float = 0, **known: object) -> NodeView:
    record = node("p5-od-1", state, reason, user if reason else "", NOW - ago if reason else 0)
    return NodeView.from_slurm(slurm_json.nodes(document("nodes", [record]))[0], **known)


S = Status


@pytest.mark.parametrize("case,expected", [
    (view("IDLE+CLOUD+POWERED_DOWN"), S.HEALTHY),  # off, no instance
    (view("IDLE+CLOUD+POWERED_DOWN", has_instance=True), S.LEFTOVER),  # off, but its instance runs
    (view("IDLE+CLOUD+POWERED_DOWN", always_on=True), S.POWER_UP),
    (view("ALLOCATED+CLOUD+POWERING_UP"), S.CHANGING),  # being launched: the resume program has it
    (view("IDLE+CLOUD+POWERING_DOWN", has_instance=True), S.CHANGING),
    (view("MIXED+CLOUD", has_instance=True), S.HEALTHY),
    (view("MIXED+CLOUD"), S.LOST),  # Slurm counts on it, its instance is gone
    (view("IDLE+CLOUD", always_on=True), S.LOST),
    (view("DOWN+CLOUD+POWERED_DOWN", "gpucluster: capacity: ICE: x", ago=601), S.RETRY),
    (view("DOWN+CLOUD+POWERED_DOWN", "gpucluster: capacity: ICE: x", ago=599), S.BACKING_OFF),
    (view("DOWN+CLOUD", "gpucluster: instance vanished", ago=1199, failures=1), S.BACKING_OFF),  # doubled
    (view("DOWN+CLOUD", "gpucluster: instance vanished", ago=1201, failures=1), S.RETRY),
    (view("DOWN+CLOUD", "gpucluster: instance vanished", ago=3601, failures=9), S.RETRY),  # capped at an hour
    (view("DOWN+CLOUD+NOT_RESPONDING", "Not responding", ago=700, has_instance=True), S.RETRY),  # Slurm's own
    (view("DOWN+CLOUD", "ResumeTimeout reached", ago=700), S.RETRY),
    (view("DOWN+CLOUD", "gpucluster: configuration: fix the stack and pulumi up: InvalidSubnetID.NotFound: x",
          ago=9999), S.NEEDS_FIX),
    # slurmctld appends its own reason to one already there ("old : new"): the configuration error still shows.
    (view("DOWN+CLOUD", "Not responding : gpucluster: configuration: fix the stack and pulumi up: X", ago=9999),
     S.NEEDS_FIX),
    # A node's own first-boot check (as root): DOWN while it was being launched; Slurm's ResumeTimeout then appends.
    (view("DOWN+CLOUD+POWERING_UP", "gpucluster: configuration: no Lustre client module for kernel 7.0.0-1012-aws",
          user="root", has_instance=True), S.NEEDS_FIX),
    (view("DOWN+CLOUD+POWERED_DOWN", "gpucluster: configuration: instance not tagged : ResumeTimeout reached",
          ago=9999), S.NEEDS_FIX),
    (view("DOWN+CLOUD", "bad GPU, RMA", user="root", ago=9999), S.HELD),  # an admin's
    (view("IDLE+DRAIN+CLOUD", "gpucluster: configuration: x", user="root", has_instance=True), S.HELD),  # drained
    (view("IDLE+DRAIN+CLOUD", "Kill task failed", ago=9999, has_instance=True), S.HELD),
    (view("IDLE+CLOUD+FUTURE"), S.HEALTHY),
    # Drained by the cluster for a new instance (a spot warning, a rebalance recommendation): replaced once idle or
    # once EC2 took the instance; left to finish its jobs otherwise. The same words from an admin are an admin's hold.
    (view("ALLOCATED+DRAIN+CLOUD", "gpucluster: replace: rebalance recommendation", has_instance=True), S.DRAINING),
    (view("MIXED+DRAIN+CLOUD", "gpucluster: replace: spot interruption warning", has_instance=True), S.DRAINING),
    (view("IDLE+DRAIN+CLOUD", "gpucluster: replace: spot interruption warning", has_instance=True), S.REPLACE),
    (view("ALLOCATED+DRAIN+CLOUD", "gpucluster: replace: spot interruption warning"), S.REPLACE),  # reclaimed
    (view("IDLE+DRAIN+CLOUD", "gpucluster: replace: health: 7 of 8 GPUs", user="root", has_instance=True),
     S.REPLACE),  # the node's own health check drains as root
    (view("IDLE+DRAIN+CLOUD", "gpucluster: replace: spot interruption warning", user="alice", has_instance=True),
     S.HELD),
])
def test_classify(case: NodeView, expected: Status) -> None:
    assert classify(case, NOW, retry_base=600) is expected


def test_reconcile_acts_per_status(ec2) -> None:
    config = make_config(ec2, capacity_retry_seconds=600)
    launched = resume(config, ec2, FakeSlurm(), "p5-od-1,p5-od-2,p5-od-4").launched
    ec2.terminate_instances(InstanceIds=[launched["p5-od-4"]])  # a spot reclaim, say
    table = [
        node("p5-od-1", "IDLE+CLOUD+POWERED_DOWN"),  # Slurm thinks it is off: instance is leftover
        node("p5-od-2", "ALLOCATED+CLOUD"),  # healthy
        node("p5-od-4", "MIXED+CLOUD"),  # up in Slurm, but its instance is gone
        node("p5-spot-1", "DOWN+CLOUD+POWERED_DOWN", "gpucluster: capacity: InsufficientInstanceCapacity: x", "slurm",
             time.time() - 700),
        node("p5-spot-2", "DOWN+CLOUD+POWERED_DOWN", "gpucluster: capacity: InsufficientInstanceCapacity: x", "slurm",
             time.time()),
        node("other-1", "IDLE+CLOUD"),  # not one of this cluster's pools: not ours to judge
    ]
    slurm = FakeSlurm(table)
    done = reconcile(config, ec2, slurm)
    assert done == {"leftover": ["p5-od-1"], "down": ["p5-od-4"], "retried": ["p5-spot-1"]}
    assert set(live(config, ec2)) == {"p5-od-2"} and len(fleet.cluster_instances(config, ec2)) == 1
    assert ("update", "nodename=p5-spot-1", "state=power_down_force") in slurm.updates()
    assert read_registry(config).failures == {"p5-spot-1": 1}  # its next try waits twice as long


def test_a_reconcile_during_a_resume_terminates_nothing(ec2) -> None:
    """An instance EC2 launched a moment ago that no node owns yet (the resume program has not recorded it) is left
    alone until its launch grace is over; past it, it is an orphan."""
    config = make_config(ec2, orphan_grace_seconds=300)
    request = fleet.fleet_request(config, config.pools["p5-od"], 1, False)
    fresh = ec2.create_fleet(**request)["Instances"][0]["InstanceIds"]
    assert reconcile(config, ec2, FakeSlurm([node("p5-od-1", "IDLE+CLOUD+POWERING_UP")])) == {}
    assert set(fleet.cluster_instances(config, ec2)) == set(fresh)
    done = reconcile(config, ec2, FakeSlurm(), now=time.time() + 301)
    assert done == {"terminated": fresh} and not fleet.cluster_instances(config, ec2)


def test_the_head_node_is_never_an_orphan(ec2) -> None:
    config = make_config(ec2, orphan_grace_seconds=0)
    ec2.run_instances(ImageId="ami-12c6146b", MinCount=1, MaxCount=1, TagSpecifications=[
        {"ResourceType": "instance", "Tags": [{"Key": CLUSTER_TAG, "Value": config.cluster}]}])
    assert reconcile(config, ec2, FakeSlurm()) == {}


def test_one_failing_action_does_not_stop_the_others(ec2, caplog: pytest.LogCaptureFixture) -> None:
    config = make_config(ec2, orphan_grace_seconds=0)
    request = fleet.fleet_request(config, config.pools["p5-od"], 1, False)
    stray = ec2.create_fleet(**request)["Instances"][0]["InstanceIds"]

    class RefusingSlurm(FakeSlurm):
        def set_down(self, nodes: list[str], reason: str) -> None:
            raise subprocess.CalledProcessError(1, "scontrol")

    done = reconcile(config, ec2, RefusingSlurm([node("p5-od-3", "IDLE+CLOUD"),
                                                      node("p5-od-4", "IDLE+CLOUD+POWERED_DOWN")]))
    assert done == {"terminated": stray}  # setting p5-od-3 DOWN failed; the orphan went all the same
    assert "reconcile: down p5-od-3 failed" in caplog.text


def always_on_config(ec2, budget_state: Path | None = None) -> ClusterSettings:
    config = make_config(ec2)
    pools = {name: PoolSettings(**{**pool.__dict__, "min_nodes": 2 if name == "p5-od" else 0})
             for name, pool in config.pools.items()}
    extra: dict[str, Any] = {"budget_state_file": str(budget_state)} if budget_state else {}
    return ClusterSettings(cluster="c1", region="us-east-1", pools=pools, log_file="/dev/null",
                                registry_file=config.registry_file, **extra)


def test_reconcile_powers_up_always_on_nodes_through_slurm(ec2) -> None:
    """Slurm powers them up (and runs the resume program): it then counts on them and never suspends them."""
    config = always_on_config(ec2)
    table = [node("p5-od-1", "IDLE+CLOUD+POWERED_DOWN"),
             node("p5-od-2", "IDLE+CLOUD+POWERED_DOWN"),
             node("p5-od-3", "IDLE+CLOUD+POWERED_DOWN")]
    slurm = FakeSlurm(table)
    assert reconcile(config, ec2, slurm) == {"powered up": ["p5-od-1", "p5-od-2"]}
    assert slurm.updates() == [("update", "nodename=p5-od-1,p5-od-2", "state=power_up")]
    assert not fleet.cluster_instances(config, ec2)  # launching is the resume program's part


def test_reconcile_powers_up_no_always_on_node_while_the_budget_is_closed(ec2, tmp_path: Path) -> None:
    state = tmp_path / "budget.json"
    config = always_on_config(ec2, state)
    state.write_text('{"closed": true}')  # as the budget guardrail writes it
    table = [node("p5-od-1", "IDLE+CLOUD+POWERED_DOWN")]
    slurm = FakeSlurm(table)
    assert reconcile(config, ec2, slurm) == {} and not slurm.updates()
    state.write_text('{"closed": false}')
    assert reconcile(config, ec2, FakeSlurm(table)) == {"powered up": ["p5-od-1"]}


def test_instances_of_nodes_slurm_no_longer_has_are_terminated_after_the_grace(ec2) -> None:
    """A stack that dropped nodes, applied by a new head: the registry still names their instances, Slurm does not
    list the nodes. A node Slurm still lists (a dropped pool draining) keeps its instance."""
    config = make_config(ec2, orphan_grace_seconds=300)
    launched = resume(config, ec2, FakeSlurm(), "p5-od-[1-2]").launched
    draining = FakeSlurm([node("p5-od-2", "ALLOCATED+CLOUD")])  # p5-od-1 is gone from slurm.conf
    assert "forgotten" not in reconcile(config, ec2, draining)  # within the grace: perhaps a resume under way
    done = reconcile(config, ec2, draining, now=time.time() + 301)
    assert done.get("forgotten") == ["p5-od-1"]
    assert set(live(config, ec2)) == {"p5-od-2"} and launched["p5-od-1"] not in fleet.cluster_instances(config, ec2)


def test_reconcile_replaces_a_drained_node_once_idle(ec2, tmp_path) -> None:
    config = make_config(ec2, events_log=str(tmp_path / "events.jsonl"))
    launched = resume(config, ec2, FakeSlurm(), "p5-spot-1,p5-od-1").launched
    reason = "gpucluster: replace: spot interruption warning"
    slurm = FakeSlurm([node("p5-spot-1", "IDLE+DRAIN+CLOUD", reason, "slurm", time.time()),
                       node("p5-od-1", "ALLOCATED+DRAIN+CLOUD", reason, "slurm", time.time())])
    done = reconcile(config, ec2, slurm)
    assert done["replaced"] == ["p5-spot-1"] and "p5-od-1" not in str(done)  # the busy one finishes its jobs
    assert set(live(config, ec2)) == {"p5-od-1"}
    assert ("update", "nodename=p5-spot-1", "state=power_down_force") in slurm.calls
    assert launched["p5-spot-1"] in (tmp_path / "events.jsonl").read_text()


def test_a_node_down_for_a_configuration_fault_loses_its_instance_and_is_never_relaunched(ec2) -> None:
    """Its first boot found a fault (no Lustre module, no pool tag...) and set it DOWN: the instance is terminated at
    the next pass (found by the registry, even without its pool tag), and no later pass, however late, brings the node
    back or launches anything for it."""
    config = make_config(ec2, capacity_retry_seconds=600)
    launched = resume(config, ec2, FakeSlurm(), "p5-od-[1-2]").launched
    ec2.delete_tags(Resources=[launched["p5-od-1"]], Tags=[{"Key": POOL_TAG}])  # one of the faults it can find
    faulty = node("p5-od-1", "DOWN+CLOUD+POWERING_UP+NOT_RESPONDING",
                  f"gpucluster: configuration: instance not tagged, not {POOL_TAG}=p5-od", "root", time.time())
    slurm = FakeSlurm([faulty, node("p5-od-2", "IDLE+CLOUD")])
    assert reconcile(config, ec2, slurm) == {"ended": ["p5-od-1"]}
    state = ec2.describe_instances(InstanceIds=[launched["p5-od-1"]])["Reservations"][0]["Instances"][0]["State"]
    assert state["Name"] in ("shutting-down", "terminated")
    assert slurm.updates() == [] and "p5-od-1" not in read_registry(config).instances
    # At ResumeTimeout Slurm powers it down and appends its own reason; an hour on, it is still left DOWN.
    faulty.update(node("p5-od-1", "DOWN+CLOUD+POWERED_DOWN", faulty["reason"] + " : ResumeTimeout reached", "slurm",
                       time.time() + 3600))
    assert reconcile(config, ec2, slurm, now=time.time() + 7200) == {}
    assert slurm.updates() == [] and set(live(config, ec2)) == {"p5-od-2"}


# --- a health fault that follows fresh instances: replacements stop at a bound ---------------------------------------
def health_drained(name: str, problem: str = "DCGM health: GPU 0: Detected XID 79 for GPU 0") -> dict[str, Any]:
    """A node its own health check drained (as root), idle: the reconciler's REPLACE."""
    return node(name, "IDLE+DRAIN+CLOUD", f"{reasons.HEALTH}: {problem}", "root", time.time())


DAY = 86400


@pytest.mark.parametrize("earlier,replaced", [
    ([], True),  # the pool's first in the window
    ([-60, -3600], True),  # two before it: the third is still replaced
    ([-60, -3600, -7200], False),  # three within the window: no fourth
    ([-DAY - 1, -DAY - 60, -DAY - 3600], True),  # three, all older than the window: forgotten
    ([-60, -DAY - 60, -DAY - 3600], True),  # one within the window
])
def test_health_replacements_stop_at_the_bound_and_the_bound_resets_after_the_window(
        ec2, tmp_path: Path, earlier: list[int], replaced: bool) -> None:
    config = make_config(ec2, events_log=str(tmp_path / "events.jsonl"), health_replacements=3,
                         health_replacement_window_seconds=DAY)
    launched = resume(config, ec2, FakeSlurm(), "p5-od-1").launched
    now = time.time()
    with registry(config) as state:
        state.health_replacements["p5-od"] = [now + t for t in earlier]
        state.health_replacements["p5-spot"] = [now - 60] * 3  # another pool's count is its own
    slurm = FakeSlurm([health_drained("p5-od-1")])
    done = reconcile(config, ec2, slurm, now=now)
    counted = read_registry(config).health_replacements["p5-od"]
    if replaced:
        assert done == {"replaced": ["p5-od-1"]} and "p5-od-1" not in live(config, ec2)
        assert counted == [now + t for t in earlier if t > -DAY] + [now]
        return
    assert done == {"not replaced": ["p5-od-1"]}
    assert set(live(config, ec2)) == {"p5-od-1"} and counted == [now + t for t in earlier]  # not counted again
    (down,) = slurm.updates()
    assert down[:3] == ("update", "nodename=p5-od-1", "state=down"), down
    reason = down[3].removeprefix("reason=")
    assert reason == (f"{reasons.HEALTH_REPEATS} in pool p5-od (3 replaced in 24 h): not replaced again; find the "
                      "cause (image, driver, a job), then resume the node (scontrol update ... state resume)"), reason
    assert len(reason) < 200  # what Slurm keeps of it
    (event,) = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert (event["event"], event["nodes"], event["pool"], event["health"]) == (
        "replacement stopped", ["p5-od-1"], "p5-od", ["DCGM health: GPU 0: Detected XID 79 for GPU 0"])
    # DOWN under CONFIGURATION (as Slurm then shows it): the next pass ends the instance and relaunches nothing.
    later = FakeSlurm([node("p5-od-1", "DOWN+CLOUD", reason, "slurm", time.time())])
    assert reconcile(config, ec2, later, now=now + 60) == {"ended": ["p5-od-1"]}
    assert not live(config, ec2) and later.updates() == []
    assert launched["p5-od-1"] not in fleet.cluster_instances(config, ec2)


def test_only_health_drains_count_toward_the_bound(ec2) -> None:
    """Three health replacements in a row, then a spot warning's replacement (no health fault: never bounded), then a
    fourth health fault: refused."""
    config = make_config(ec2, health_replacements=3)
    for name in ("p5-od-1", "p5-od-2", "p5-od-3"):
        resume(config, ec2, FakeSlurm(), name)
        assert reconcile(config, ec2, FakeSlurm([health_drained(name)])) == {"replaced": [name]}
    resume(config, ec2, FakeSlurm(), "p5-od-4")
    warned = node("p5-od-4", "IDLE+DRAIN+CLOUD", f"{reasons.REPLACE}: spot interruption warning", "slurm", time.time())
    assert reconcile(config, ec2, FakeSlurm([warned])) == {"replaced": ["p5-od-4"]}
    resume(config, ec2, FakeSlurm(), "p5-od-1")
    assert reconcile(config, ec2, FakeSlurm([health_drained("p5-od-1", "2 of 8 GPUs")])) == {
        "not replaced": ["p5-od-1"]}
    assert len(read_registry(config).health_replacements["p5-od"]) == 3
