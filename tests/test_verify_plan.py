"""`gpucluster verify --plan`: the checks a run makes per pool and the figures they must reach, from the stack file and
the catalog (gpucluster/render/verify.py); how a measured figure is judged and the JSON both sides exchange
(gpucluster/contract/verify.py); the command line's output and exit codes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from components import storage
from conftest import FIXTURES, K8S_STACK_FILES, ROOT, STACK_FILES
from gpucluster import cli
from gpucluster.contract import settings, verify as v
from gpucluster.project import EXAMPLES_DIR
from gpucluster.render import bundle, prometheus, verify as planning
from gpucluster.spec import catalog
from gpucluster.spec.model import Stack, load_stack

DEV = ROOT / "stacks" / "Pulumi.dev.yaml"
TEAM_A = ROOT / "stacks" / "Pulumi.team-a.yaml"
TEAM_B = ROOT / "stacks" / "Pulumi.team-b.yaml"


def variant(tmp_path: Path, source: Path, pool_changes: dict[str, Any] | None = None,
            lustre: dict[str, Any] | None = None, monthly_usd: float | None = None) -> Path:
    """A copy of a stack file with every pool's keys, the Lustre section and the budget changed."""
    doc = yaml.safe_load(source.read_text())
    cluster = doc["config"]["gpucluster:cluster"]
    for pool in cluster["pools"]:
        pool.update(pool_changes or {})
    if lustre is not None:
        cluster["storage"]["lustre"] = lustre
    if monthly_usd is not None:
        cluster["budget"]["monthly_usd"] = monthly_usd
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / source.name
    path.write_text(yaml.safe_dump(doc))
    return path


def by_check(checks: list[v.Check], pool: str) -> dict[str, v.Expect]:
    return {c.check: c.expect for c in checks if c.pool == pool}


def verify_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli.main(["verify", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("path", STACK_FILES, ids=lambda p: p.stem)
def test_plan_json_is_the_issues_shape_for_every_shipped_stack(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = verify_cli(capsys, str(path), "--plan", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert list(doc) == ["checks"]
    assert doc["checks"] and all(list(entry) == ["pool", "check", "expect"] for entry in doc["checks"])
    stack = load_stack(path)
    order = [p.name for p in stack.spec.pools] + [v.CLUSTER]  # the pools in the stack's order, the cluster last
    assert [e["pool"] for e in doc["checks"]] == sorted((e["pool"] for e in doc["checks"]), key=order.index)
    for pool in stack.spec.pools:  # every pool, with the checks the issue names for all of them
        names = {e["check"] for e in doc["checks"] if e["pool"] == pool.name}
        assert {v.FSX_WRITE_MBPS, v.FSX_READ_MBPS, v.METADATA_REFUSED, v.NAMES_RESOLVE} <= names
        assert (v.EFA_DEVICES in names) == pool.uses_efa
        assert {e["expect"]["nodes"] for e in doc["checks"] if e["pool"] == pool.name and e["check"] in (
            v.NAMES_RESOLVE, v.PROMETHEUS_SCRAPES)} == {min(planning.DEFAULT_NODES, pool.max_nodes)}
    assert {e["check"] for e in doc["checks"]} <= set(v.CHECK_NAMES)
    assert v.plan_from_json(out) == planning.plan(stack)  # what the head reads back is what was planned


def test_p5_pools_carry_an_all_reduce_floor_and_32_efa_devices() -> None:
    checks = planning.plan(load_stack(TEAM_A))
    p5 = catalog.ACCELERATED["p5.48xlarge"]
    figure = p5.all_reduce
    assert figure is not None and 0 < figure.floor_gbps < figure.published_gbps
    for pool in ("p5-od", "p5-spot"):
        expect = by_check(checks, pool)
        assert expect[v.EFA_DEVICES] == {"count": 32} == {"count": p5.efa_interfaces}
        assert expect[v.GPUS] == {"count": p5.accelerator.count if p5.accelerator else None}
        assert expect[v.NCCL_ALL_REDUCE_BUSBW_GBPS] == {"min": figure.floor_gbps, "bytes": figure.message_bytes}
        assert expect[v.NCCL_TRANSPORT] == {"provider": "efa"}
        assert expect[v.NCCL_EFA_PLUGIN] == {"found": True}
        assert expect[v.NAMES_RESOLVE] == {"nodes": planning.DEFAULT_NODES}


def test_a_single_node_g6_xlarge_pool_has_no_efa_and_no_all_reduce_check(tmp_path: Path) -> None:
    stack = load_stack(variant(tmp_path, DEV, {"max_nodes": 1}))
    (pool,) = stack.spec.pools
    assert pool.instance_type == "g6.xlarge"
    expect = by_check(planning.plan(stack), pool.name)
    for absent in (v.EFA_DEVICES, v.NCCL_EFA_PLUGIN, v.NCCL_ALL_REDUCE_BUSBW_GBPS, v.NCCL_TRANSPORT):
        assert absent not in expect
    assert expect[v.NAMES_RESOLVE] == {"nodes": 1}
    assert expect[v.GPUS] == {"count": 1}


def test_a_type_without_a_published_figure_is_judged_warn() -> None:
    """dev's g6.xlarge pool on two nodes: the all_reduce check is there, with no floor, and whatever is measured it
    warns (a run never passes a figure it cannot compare)."""
    assert catalog.ACCELERATED["g6.xlarge"].all_reduce is None
    (check,) = [c for c in planning.plan(load_stack(DEV)) if c.check == v.NCCL_ALL_REDUCE_BUSBW_GBPS]
    assert check.expect == {"bytes": v.DEFAULT_ALL_REDUCE_BYTES}  # the sweep still has its size
    for measured in (0.0, 1e6):
        assert v.judge(check, measured).result == v.WARN
    # a short sweep of a type without a figure is still a warning, never a pass
    assert v.judge_reading(check, {"min": 1e6, "bytes": 8}).result == v.WARN
    assert v.expectation(check) == f"no known figure: warns (at {v.DEFAULT_ALL_REDUCE_BYTES // 2**30}G)"


@pytest.mark.parametrize("check,expect,measured,result", [
    (v.GPUS, {"count": 8}, 8, v.PASS),
    (v.GPUS, {"count": 8}, 7, v.FAIL),
    (v.GPUS, {"count": 1}, True, v.FAIL),  # a yes is no count
    (v.NCCL_TRANSPORT, {"provider": "efa"}, "efa", v.PASS),
    (v.NCCL_TRANSPORT, {"provider": "efa"}, "socket", v.FAIL),
    (v.METADATA_REFUSED, {"refused": True}, True, v.PASS),
    (v.METADATA_REFUSED, {"refused": True}, False, v.FAIL),
    (v.METADATA_REFUSED, {"refused": True}, 1, v.FAIL),  # a count is no yes
    (v.NCCL_ALL_REDUCE_BUSBW_GBPS, {"min": 400.0}, 400.0, v.PASS),
    (v.NCCL_ALL_REDUCE_BUSBW_GBPS, {"min": 400.0}, 399.9, v.FAIL),
    (v.NCCL_ALL_REDUCE_BUSBW_GBPS, {"min": 400.0}, True, v.FAIL),
    (v.FSX_WRITE_MBPS, {}, 100, v.WARN),
    (v.ECC_UNCORRECTED, {"max": 0}, 0, v.PASS),
    (v.ECC_UNCORRECTED, {"max": 0}, 1, v.FAIL),
    (v.SCALE_FROM_ZERO_SECONDS, {"max": 600}, 601.5, v.FAIL),
    (v.DCGM_DIAG, {"level": 1}, True, v.PASS),
    (v.DCGM_DIAG, {"level": 3}, False, v.FAIL),
    (v.FSX_MOUNTED, {}, True, v.PASS),
    (v.FSX_MOUNTED, {}, False, v.FAIL),
    (v.GPUS, {"count": 8}, None, v.FAIL),  # nothing measured
    (v.FSX_MOUNTED, {}, None, v.FAIL),
])
def test_judge_each_kind(check: str, expect: v.Expect, measured: v.Measured, result: str) -> None:
    verdict = v.judge(v.Check("p", check, expect), measured)
    assert (verdict.result, verdict.measured, verdict.expect) == (result, measured, expect)
    assert (verdict.fix == v.RULES[check].fix) == (result == v.FAIL)
    assert verdict.fix or result != v.FAIL


@pytest.mark.parametrize("path", STACK_FILES, ids=lambda p: p.stem)
def test_the_cluster_checks_come_once_per_plan_whichever_pools(path: Path) -> None:
    """The budget's topic and the GpuIdle rule, once, under pool CLUSTER, whether the plan has every pool or one; what
    they check is in every Slurm stack: its (required) budget's topic, and GpuIdle in the head's rules."""
    stack = load_stack(path)
    expected = [v.Check(v.CLUSTER, v.BUDGET_TOPIC, {"reachable": True}),
                v.Check(v.CLUSTER, v.GPU_IDLE_RULE, {"loaded": True})]
    for options in (planning.Options(), planning.Options(pools=(stack.spec.pools[-1].name,))):
        assert [c for c in planning.plan(stack, options) if c.pool == v.CLUSTER] == expected
    assert stack.spec.budget.notify_emails  # the topic's subscribers: the budget is there with its topic
    alerts = [r["alert"] for g in yaml.safe_load(prometheus.rules(stack))["groups"] for r in g["rules"] if "alert" in r]
    assert "GpuIdle" in alerts
    assert v.CLUSTER not in {p.name for p in stack.spec.pools}


def test_every_check_has_its_own_one_line_fix() -> None:
    fixes = [rule.fix for rule in v.RULES.values()]
    assert len(set(fixes)) == len(fixes) and all(fix and "\n" not in fix for fix in fixes)


def test_run_json_adds_measured_and_result_and_a_fix_on_failures_only() -> None:
    checks = [v.Check("p5-od", v.GPUS, {"count": 8}), v.Check("p5-od", v.EFA_DEVICES, {"count": 32}),
              v.Check("g6", v.NCCL_ALL_REDUCE_BUSBW_GBPS, {})]
    results = [v.judge(checks[0], 8), v.judge(checks[1], 31), v.judge(checks[2], 12.5)]
    text = v.run_json(results)
    entries = json.loads(text)["checks"]
    assert [list(e) for e in entries] == [["pool", "check", "expect", "measured", "result"],
                                          ["pool", "check", "expect", "measured", "result", "fix"],
                                          ["pool", "check", "expect", "measured", "result"]]
    assert [e["result"] for e in entries] == ["pass", "fail", "warn"]
    assert entries[1]["fix"] == v.RULES[v.EFA_DEVICES].fix
    assert v.run_from_json(text) == results
    plan = json.loads(v.plan_json(checks))["checks"]
    assert [{k: e[k] for k in ("pool", "check", "expect")} for e in entries] == plan


@pytest.mark.parametrize("text,message", [
    ('{"checks": [{"pool": "p", "check": "gpu", "expect": {}}]}', "unknown check 'gpu'"),
    ('{"checks": [{"pool": "p", "check": "gpus"}]}', "expected the keys check, expect, pool"),
    ('{"checks": [{"pool": "p", "check": "gpus", "expect": {"count": [8]}}]}', "expect: expected an object"),
    ('[{"pool": "p", "check": "gpus", "expect": {}}]', 'expected {"checks": [...]}'),
])
def test_a_plan_that_breaks_the_contract_is_refused(text: str, message: str) -> None:
    with pytest.raises(v.VerifyFormatError, match=message.replace("[", r"\[").replace("{", r"\{")):
        v.plan_from_json(text)


def test_a_run_with_an_unknown_result_is_refused() -> None:
    text = '{"checks": [{"pool": "p", "check": "gpus", "expect": {}, "measured": 8, "result": "ok"}]}'
    with pytest.raises(v.VerifyFormatError, match="pass, warn or fail"):
        v.run_from_json(text)


def test_fsx_floors_follow_the_file_system_and_what_the_nodes_can_carry(tmp_path: Path) -> None:
    def floors(stack: Stack, pool: str) -> tuple[object, object]:
        expect = by_check(planning.plan(stack), pool)
        return expect[v.FSX_WRITE_MBPS].get("min"), expect[v.FSX_READ_MBPS].get("min")

    small = {"deployment_type": "PERSISTENT_2", "storage_capacity_gib": 2400, "throughput_mb_per_tib": 250}
    big = small | {"storage_capacity_gib": 48000}
    p5_small = floors(load_stack(variant(tmp_path / "a", TEAM_A, lustre=small)), "p5-od")
    p5_big = floors(load_stack(variant(tmp_path / "b", TEAM_A, lustre=big)), "p5-od")
    for big_floor, small_floor in zip(p5_big, p5_small, strict=True):  # the file system is the bound: 20 x its size
        assert isinstance(big_floor, int) and isinstance(small_floor, int)
        assert 20 * small_floor <= big_floor < 20 * (small_floor + 1)
    # SCRATCH_2 writes half as fast as it reads (its disk baseline: 100 and 200 MB/s per TiB)
    write, read = floors(load_stack(TEAM_B), "g6e")
    assert isinstance(write, int) and isinstance(read, int) and abs(2 * write - read) <= 1
    # Two g6.xlarge nodes cannot carry a big file system's throughput: their network is the bound
    g6 = load_stack(variant(tmp_path / "c", DEV, lustre=big, monthly_usd=20000))  # a budget beyond the big Lustre
    one_node = catalog.ACCELERATED["g6.xlarge"].primary_network_gbps * planning.MB_PER_S_PER_GBPS
    g6_write, g6_read = floors(g6, "g6-spot")
    assert g6_write == g6_read and isinstance(g6_write, int) and g6_write <= 2 * one_node
    assert isinstance(p5_big[0], int) and g6_write < p5_big[0]


def test_an_existing_file_system_has_no_fsx_floor_and_warns() -> None:
    checks = planning.plan(load_stack(FIXTURES / "Pulumi.existing.yaml"))
    fsx = [c for c in checks if c.check in (v.FSX_WRITE_MBPS, v.FSX_READ_MBPS)]
    assert fsx and all(c.expect == {} and v.judge(c, 5000.0).result == v.WARN for c in fsx)


def test_fsx_mounted_expects_the_lustre_version_of_a_file_system_the_stack_creates() -> None:
    """The version components/storage.py gives the file system it creates; an existing one's is not in the stack."""
    created = [c for c in planning.plan(load_stack(TEAM_A)) if c.check == v.FSX_MOUNTED]
    assert created and all(c.expect == {v.LUSTRE_VERSION_KEY: catalog.LUSTRE_VERSION} for c in created)
    assert storage.LUSTRE_VERSION is catalog.LUSTRE_VERSION  # one figure for the file system and its check
    existing = [c for c in planning.plan(load_stack(FIXTURES / "Pulumi.existing.yaml")) if c.check == v.FSX_MOUNTED]
    assert existing and all(c.expect == {} for c in existing)


def older_and_newer(version: str) -> tuple[str, str, str]:
    """A client one minor release older than `version`, one of its patch releases, one minor release newer."""
    major, minor = map(int, version.split(".")[:2])
    return f"{major}.{minor - 1}.9", f"{major}.{minor}.6", f"{major}.{minor + 1}.0"


def test_a_lustre_client_older_than_the_file_system_fails_and_its_version_is_kept() -> None:
    check = v.Check("p5-od", v.FSX_MOUNTED, {v.LUSTRE_VERSION_KEY: catalog.LUSTRE_VERSION})
    older, same, newer = older_and_newer(catalog.LUSTRE_VERSION)
    for client in (same, newer):
        result = v.judge_reading(check, {"mounted": True, "type": "lustre", v.LUSTRE_VERSION_KEY: client})
        assert (result.result, result.measured, result.details) == (v.PASS, True, {v.LUSTRE_VERSION_KEY: client})
    old = v.judge_reading(check, {"mounted": True, "type": "lustre", v.LUSTRE_VERSION_KEY: older})
    assert old.result == v.FAIL and old.fix.startswith(f"lustre_version {older} where the plan asks "
                                                       f"{catalog.LUSTRE_VERSION}: {v.LUSTRE_CLIENT_FIX}")
    unread = v.judge_reading(check, {"mounted": True, "type": "lustre", v.LUSTRE_VERSION_KEY: None})
    assert unread.result == v.FAIL  # a version nobody could read is not a recent one
    # Not mounted: the mount's own fix, not the client's.
    unmounted = v.judge_reading(check, {"mounted": False, "type": "nfs4", v.LUSTRE_VERSION_KEY: None})
    assert unmounted.result == v.FAIL and unmounted.fix == v.RULES[v.FSX_MOUNTED].fix
    # An existing file system: mounted is enough, and the client's version is still recorded.
    kept = v.judge_reading(v.Check("p", v.FSX_MOUNTED, {}), {"mounted": True, v.LUSTRE_VERSION_KEY: older})
    assert kept.result == v.PASS and v.run_from_json(v.run_json([kept])) == [kept]
    assert json.loads(v.run_json([kept]))["checks"][0]["details"] == {v.LUSTRE_VERSION_KEY: older}
    assert f"true ({v.LUSTRE_VERSION_KEY} {older})" in "\n".join(v.run_table([kept]))


def test_always_on_nodes_do_not_scale_from_zero() -> None:
    stack = load_stack(FIXTURES / "Pulumi.local.yaml")
    checks = planning.plan(stack)
    always = next(p for p in stack.spec.pools if p.min_nodes)
    assert v.SCALE_FROM_ZERO_SECONDS not in by_check(checks, always.name)
    (scaled,) = {c.expect["max"] for c in checks if c.check == v.SCALE_FROM_ZERO_SECONDS}
    assert isinstance(scaled, int) and 0 < scaled <= stack.spec.slurm.resume_timeout_seconds


def test_cli_pools_nodes_and_deep(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = verify_cli(capsys, "team-a", "--plan", "--json", "--pool", "p5-spot", "--nodes", "1", "--deep")
    assert code == 0
    checks = v.plan_from_json(out)
    assert {c.pool for c in checks} == {"p5-spot", v.CLUSTER}
    expect = by_check(checks, "p5-spot")
    assert expect[v.DCGM_DIAG] == {"level": v.DCGM_DEEP_LEVEL}
    assert v.NCCL_ALL_REDUCE_BUSBW_GBPS not in expect and expect[v.NAMES_RESOLVE] == {"nodes": 1}


def test_cli_table(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = verify_cli(capsys, "dev", "--plan")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["pool", "check", "expected"]
    sweep = f"{v.DEFAULT_ALL_REDUCE_BYTES // 2**30}G"
    assert f"g6-spot    nccl_all_reduce_busbw_gbps  no known figure: warns (at {sweep})" in out
    assert f"{v.CLUSTER}  budget_topic                = true" in out
    assert len(lines) == 2 + len(planning.plan(load_stack(DEV)))


@pytest.mark.parametrize("args,message", [
    ([], "verify: STACK is needed off the head node"),
    (["--plan"], "verify: --plan needs STACK"),
    (["dev", "--last", "--deep"], "--last prints the latest run as it was"),
    (["team-a", "--plan", "--pool", "p5", "--pool", "gpu"],
     "no pool p5, gpu in stack team-a; its pools: p5-od, p5-spot"),
    (["team-a", "--plan", "--nodes", "5"], "--nodes 5 is more than pool p5-od's max_nodes (4)"),
    (["team-a", "--plan", "--nodes", "0"], "--nodes must be at least 1"),
    ([str(K8S_STACK_FILES[0]), "--plan"], "a run goes through Slurm"),
    (["no-such-stack", "--plan"], "no such stack file"),
])
def test_cli_bad_input_exits_2_with_one_line_each(args: list[str], message: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = verify_cli(capsys, *args)
    assert (code, out) == (cli.EXIT_BAD_INPUT, "")
    assert message in err and "Traceback" not in err


def test_team_a_nodes_5_names_only_the_pool_that_is_too_small(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = verify_cli(capsys, "team-a", "--plan", "--nodes", "5")
    assert code == cli.EXIT_BAD_INPUT and "p5-spot" not in err  # p5-spot's max_nodes is 8


def test_the_bundle_carries_the_default_plan_for_the_head() -> None:
    stack = load_stack(TEAM_A)
    files = bundle.contents(stack, EXAMPLES_DIR)
    data, mode = files[str(Path(settings.VERIFY_PLAN).relative_to(settings.BUNDLE_DIR))]
    assert mode == 0o644
    assert v.plan_from_json(data.decode()) == planning.plan(stack)
