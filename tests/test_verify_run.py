"""The head's verify run (gpucluster/node/verify_run.py), its pure parts: what each pool's jobs do (from the plan of
a shipped stack), how the nodes' readings become a pool's results, what the run leaves (its file, the board's lines),
`verify --last`, and the command line's choice between the run here and the run through Session Manager. The run
through real Slurm is tests/integration/test_verify.py."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from conftest import STACK_FILES
from gpucluster import cli
from gpucluster.aws import verify_remote
from gpucluster.contract import slurm_json, verify as v
from gpucluster.contract.settings import ALL_REDUCE_PERF, VERIFY_PROBE_PROGRAM, ClusterSettings
from gpucluster.contract.status import QUOTA_REASON
from gpucluster.node import verify_run as vr
from gpucluster.render import verify as planning
from gpucluster.spec.model import load_stack

TEAM_A = next(p for p in STACK_FILES if p.name == "Pulumi.team-a.yaml")


def team_a_plans(deep: bool = False) -> dict[str, vr.PoolPlan]:
    return {p.pool: p for p in vr.pool_plans(planning.plan(load_stack(TEAM_A), planning.Options(deep=deep)))}


def test_each_pool_job_follows_its_plan() -> None:
    plans = team_a_plans()
    p5 = plans["p5-od"]
    stack = load_stack(TEAM_A)
    pool = next(p for p in stack.spec.pools if p.name == "p5-od")
    assert (p5.nodes, p5.gpus_per_node, p5.dcgm_level) == (2, pool.accelerator.count, v.DCGM_LEVEL)
    busbw = next(c for c in p5.checks if c.check == v.NCCL_ALL_REDUCE_BUSBW_GBPS)
    assert p5.all_reduce_bytes == busbw.expect.get("bytes", v.DEFAULT_ALL_REDUCE_BYTES)
    scale = next(c for c in p5.checks if c.check == v.SCALE_FROM_ZERO_SECONDS)
    assert p5.start_seconds == scale.expect["max"]
    assert team_a_plans(deep=True)["p5-od"].dcgm_level == v.DCGM_DEEP_LEVEL


def test_a_plan_without_a_node_count_is_refused() -> None:
    with pytest.raises(vr.RunError, match="no node count"):
        vr.pool_plans([v.Check("a", v.GPUS, {"count": 8})])


def test_the_job_writes_its_start_first_then_probes_each_node_then_runs_all_reduce_as_nccl_tests_does() -> None:
    p5 = team_a_plans()["p5-od"]
    script = vr.job_script(p5, "/fsx/.gpucluster/verify/run/p5-od", "/fsx/.gpucluster/verify/run/lock",
                           vr.ProbeOptions(fsx_mib=64))
    commands = [line for line in script.splitlines() if not line.startswith("#")]
    assert commands[0] == f"date +%s.%N > /fsx/.gpucluster/verify/run/p5-od/{vr.STARTED_FILE}"
    assert commands[1].startswith("flock /fsx/.gpucluster/verify/run/lock srun --ntasks-per-node=1 /bin/sh -c ")
    for word in (VERIFY_PROBE_PROGRAM, "--without-dcgm", "--fsx-mib=64", "probe-$SLURMD_NODENAME.json"):
        assert word in commands[1]
    assert commands[2:] == [
        "export NCCL_DEBUG=INFO NCCL_BUFFSIZE=8388608 NCCL_P2P_NET_CHUNKSIZE=524288 PMIX_MCA_gds=hash",
        f"srun --mpi=pmix --cpu-bind=none --ntasks-per-node={p5.gpus_per_node} {ALL_REDUCE_PERF} -b 8 -f 2 -g 1 "
        f"-c 1 -n 100 -e {p5.all_reduce_bytes} > /fsx/.gpucluster/verify/run/p5-od/{vr.ALL_REDUCE_OUT} 2>&1"]
    one_node = vr.PoolPlan("g6", (), 1, v.DCGM_LEVEL, None, 1, None)
    one_node_script = vr.job_script(one_node, "/d", "/d/lock")
    assert "all_reduce_perf" not in one_node_script and "NCCL_DEBUG" not in one_node_script


def test_root_job_runs_only_the_dcgm_diagnostic_at_the_plans_level_on_the_user_jobs_nodes() -> None:
    deep = team_a_plans(deep=True)["p5-od"]
    script = vr.dcgm_script(deep, "/d")
    assert "--dcgm-only --deep" in script and "dcgm-$SLURMD_NODENAME.json" in script
    assert "--deep" not in vr.dcgm_script(team_a_plans()["p5-od"], "/d")
    args = vr.sbatch_args(deep, "/d", 10, "p5-od-1,p5-od-2")
    assert {"--partition=p5-od", "--constraint=p5-od", "--nodes=2", "--exclusive", "--nodelist=p5-od-1,p5-od-2",
            "--time=10"} <= set(args)
    assert not any(a.startswith("--nodelist") for a in vr.sbatch_args(deep, "/d", 10))


def plan_of(*checks: tuple[str, dict[str, Any]], nodes: int = 2) -> vr.PoolPlan:
    made = [v.Check("p", name, expect) for name, expect in checks] + [v.Check("p", v.NAMES_RESOLVE, {"nodes": nodes})]
    return vr.pool_plans(made)[0]


def test_a_per_node_check_is_its_worst_node_named_in_the_fix() -> None:
    plan = plan_of((v.GPUS, {"count": 8}))
    readings = vr.PoolReadings(nodes={"p-1": {v.GPUS: {"count": 8}, v.NAMES_RESOLVE: {"nodes": 2}},
                                      "p-2": {v.GPUS: {"count": 7}, v.NAMES_RESOLVE: {"nodes": 2}}})
    gpus, names = vr.judge_pool(plan, readings)
    assert (gpus.result, gpus.measured) == (v.FAIL, 7) and gpus.fix.startswith("p-2: ")
    assert names.result == v.PASS


def test_fsx_throughput_is_the_sum_of_the_nodes_or_the_first_nodes_failure() -> None:
    plan = plan_of((v.FSX_WRITE_MBPS, {"min": 500}))
    both = vr.PoolReadings(nodes={"p-1": {v.FSX_WRITE_MBPS: 300.0}, "p-2": {v.FSX_WRITE_MBPS: 250.5}})
    write = vr.judge_pool(plan, both)[0]
    assert (write.result, write.measured) == (v.PASS, 550.5)
    alone = vr.judge_pool(plan, vr.PoolReadings(nodes={"p-1": {v.FSX_WRITE_MBPS: 300.0}}))[0]
    assert (alone.result, alone.measured) == (v.FAIL, 300.0)
    broken = vr.PoolReadings(nodes={"p-1": {v.FSX_WRITE_MBPS: 300.0}, "p-2": {v.FSX_WRITE_MBPS: {"error": "EIO"}}})
    failed = vr.judge_pool(plan, broken)[0]
    assert failed.result == v.FAIL and failed.measured is None and failed.fix.startswith("p-2: EIO: ")


def test_a_node_without_readings_fails_every_check_saying_why(tmp_path: Path) -> None:
    (tmp_path / "probe-p-1.json").write_text(json.dumps({v.GPUS: {"count": 8}}))
    (tmp_path / "probe-p-2.err").write_text("Traceback...\nPermissionError: /fsx\n")
    readings = vr.PoolReadings(nodes=vr.node_readings(tmp_path, ("p-1", "p-2"), ""))
    gpus = vr.judge_pool(plan_of((v.GPUS, {"count": 8})), readings)[0]
    assert gpus.result == v.FAIL and gpus.fix.startswith("p-2: no reading in ") and "PermissionError" in gpus.fix


def test_a_job_that_never_started_fails_its_pool_with_slurms_reason() -> None:
    plan = plan_of((v.SCALE_FROM_ZERO_SECONDS, {"max": 600}), (v.GPUS, {"count": 8}),
                   (v.NCCL_ALL_REDUCE_BUSBW_GBPS, {"min": 100}))
    why = "job 7's nodes were still booting 601 s after Slurm gave them to it; cancelled"
    results = vr.judge_pool(plan, vr.PoolReadings(missing=why))
    assert [r.result for r in results] == [v.FAIL] * len(plan.checks)
    scale = results[0]
    assert scale.measured is None and scale.fix.startswith(why) and scale.fix.endswith(v.RULES[scale.check].fix)


@pytest.mark.parametrize(("reason", "word"), [("Resources", v.WARN), ("Priority", v.WARN),
                                              (QUOTA_REASON, v.WARN), ("QOSMaxNodePerUserLimit", v.WARN),
                                              ("ReqNodeNotAvail", v.FAIL), ("PartitionDown", v.FAIL)])
def test_a_job_slurm_held_back_warns_when_the_pool_is_busy_and_fails_otherwise(reason: str, word: str) -> None:
    """A busy pool or a team at its quota (Slurm's reason for the billing limit) is not a broken pool: nothing was
    measured, Slurm's reason says why; a partition down or unavailable nodes are faults."""
    plan = plan_of((v.SCALE_FROM_ZERO_SECONDS, {"max": 600}), (v.GPUS, {"count": 8}))
    held = vr.Tracked("7", 0.0, 600.0, 600.0, 60.0, ended=True, held=reason,
                      why=f"job 7 waited 601 s for nodes (Slurm's reason: {reason}); cancelled")
    results = vr.held_results(plan, held)
    assert {r.result for r in results} == {word} and len(results) == len(plan.checks)
    assert all(held.why in r.fix and r.measured is None for r in results)


def test_dcgm_comes_from_roots_job_and_its_absence_is_a_failure(tmp_path: Path) -> None:
    (tmp_path / "probe-p-1.json").write_text(json.dumps({v.GPUS: {"count": 8}}))
    (tmp_path / "dcgm-p-1.json").write_text(json.dumps({v.DCGM_DIAG: {"level": 1, "passed": True, "failures": []}}))
    (tmp_path / "probe-p-2.json").write_text(json.dumps({v.GPUS: {"count": 8}}))
    readings = vr.PoolReadings(nodes=vr.node_readings(tmp_path, ("p-1", "p-2"), ""))
    dcgm = vr.judge_pool(plan_of((v.DCGM_DIAG, {"level": 1})), readings)[0]
    assert dcgm.result == v.FAIL and dcgm.fix.startswith(f"p-2: no reading in {tmp_path / 'dcgm-p-2.json'}")
    refused = "root's DCGM job was refused: sbatch: error: Invalid account"
    readings = vr.PoolReadings(nodes=vr.node_readings(tmp_path, ("p-2",), refused))
    assert vr.judge_pool(plan_of((v.DCGM_DIAG, {"level": 1})), readings)[0].fix.startswith(f"p-2: {refused}: ")
    (tmp_path / "dcgm-p-2.json").write_text((tmp_path / "dcgm-p-1.json").read_text())
    readings = vr.PoolReadings(nodes=vr.node_readings(tmp_path, ("p-1", "p-2"), ""))
    assert vr.judge_pool(plan_of((v.DCGM_DIAG, {"level": 1})), readings)[0].result == v.PASS


def test_prometheus_answers_are_counted_per_node_and_rule() -> None:
    # Prometheus' HTTP API's shapes (/api/v1/targets and /rules: prometheus.io/docs/prometheus/latest/querying/api).
    targets = {"activeTargets": [
        {"labels": {"job": "node", "node": "p-1"}, "health": "up"},
        {"labels": {"job": "node", "node": "p-2"}, "health": "down"},
        {"labels": {"job": "dcgm", "node": "p-2"}, "health": "up"},
        {"labels": {"job": "node", "node": "other-1"}, "health": "up"}]}
    assert vr.scraped_nodes(targets, ("p-1", "p-2")) == 1
    rules = {"groups": [{"name": "gpucluster", "rules": [{"name": "NodeDown", "type": "alerting"},
                                                         {"name": v.GPU_IDLE_ALERT, "type": "alerting"}]}]}
    assert vr.gpu_idle_loaded(rules) and not vr.gpu_idle_loaded({"groups": []})


class FakeSlurm(vr.Slurm):
    """Slurm's answers over time, without a controller (the integration test has a real one)."""

    def __init__(self, answers: list[dict[str, slurm_json.Job]]):
        super().__init__("ubuntu")
        self.answers = answers
        self.cancelled: list[str] = []

    def jobs(self) -> dict[str, slurm_json.Job]:
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]

    def cancel(self, job: str) -> None:
        self.cancelled.append(job)


def job(state: str, reason: str = "None", nodes: tuple[str, ...] = ()) -> slurm_json.Job:
    return slurm_json.Job("7", frozenset({state}), "p", nodes, "", reason)


def test_a_job_still_pending_at_its_limit_is_cancelled_with_its_reason() -> None:
    now = [0.0]
    slurm = FakeSlurm([{"7": job("PENDING", "Resources")}])
    tracked = vr.Tracked("7", 0.0, 600.0, 600.0, 60.0)
    vr.wait(slurm, [tracked], clock=lambda: now[0], pause=lambda s: now.__setitem__(0, now[0] + 100))
    assert slurm.cancelled == ["7"] and not tracked.started and tracked.held == "Resources"
    assert "waited 700 s for nodes" in tracked.why and "Resources" in tracked.why


def test_a_job_whose_nodes_are_still_booting_at_its_limit_has_not_started() -> None:
    now = [0.0]
    booting = slurm_json.Job("7", frozenset({"RUNNING", vr.BOOTING}), "p", ("p-1", "p-2"), "", "None")
    slurm = FakeSlurm([{"7": booting}])
    tracked = vr.Tracked("7", 0.0, 600.0, 600.0, 60.0)
    vr.wait(slurm, [tracked], clock=lambda: now[0], pause=lambda s: now.__setitem__(0, now[0] + 100))
    assert slurm.cancelled == ["7"] and "nodes were still booting 700 s" in tracked.why and not tracked.held


def test_the_boot_limit_counts_from_slurm_giving_the_nodes_not_from_the_submission() -> None:
    """Queued 500 s behind other work, then booted in 400 s: within a 600 s boot limit, so it starts, and its boot
    is measured from the last look that found it waiting."""
    now = [0.0]
    booting = slurm_json.Job("7", frozenset({"RUNNING", vr.BOOTING}), "p", ("p-1", "p-2"), "", "None")
    slurm = FakeSlurm([{"7": job("PENDING", "Resources")}] * 6 + [{"7": booting}] * 4
                      + [{"7": job("RUNNING", nodes=("p-1", "p-2"))}, {"7": job("COMPLETED", nodes=("p-1", "p-2"))}])
    tracked = vr.Tracked("7", 0.0, 600.0, 600.0, 60.0)
    vr.wait(slurm, [tracked], clock=lambda: now[0], pause=lambda s: now.__setitem__(0, now[0] + 100))
    assert slurm.cancelled == [] and tracked.started and tracked.waited_until == 500.0


def test_a_job_that_ran_and_completed_keeps_its_nodes_and_no_complaint() -> None:
    now = [0.0]
    slurm = FakeSlurm([{"7": job("PENDING")}, {"7": job("RUNNING", nodes=("p-1", "p-2"))},
                       {"7": job("COMPLETED", nodes=("p-1", "p-2"))}])
    tracked = vr.Tracked("7", 0.0, 600.0, 600.0, 60.0)
    vr.wait(slurm, [tracked], clock=lambda: now[0], pause=lambda s: now.__setitem__(0, now[0] + 1))
    assert (tracked.started, tracked.nodes, tracked.why, slurm.cancelled) == (True, ("p-1", "p-2"), "", [])


def results_of(pool: str, word: v.ResultWord) -> list[v.Result]:
    return [v.Result(pool, v.GPUS, {"count": 8}, 8 if word == v.PASS else 7, word, "fix" if word == v.FAIL else "")]


def test_the_run_is_kept_for_all_to_read_and_the_board_shows_each_pools_last_result(tmp_path: Path) -> None:
    setup = vr.Setup(ClusterSettings("c", "us-east-1", {}), verify_dir=tmp_path / "verify",
                     textfile=tmp_path / "textfile" / "verify.prom")
    older = vr.keep(setup, "20261201T100000Z-a+b", results_of("a", v.FAIL) + results_of("b", v.FAIL))
    newer = vr.keep(setup, "20261202T100000Z-a", results_of("a", v.PASS))
    assert stat.S_IMODE(newer.stat().st_mode) == 0o644 and v.run_from_json(older.read_text())[1].pool == "b"
    lines = set(setup.textfile.read_text().splitlines())
    assert f'{v.RESULT_METRIC}{{check="gpus",pool="a"}} {v.RESULT_CODES[v.PASS]}' in lines
    assert f'{v.RESULT_METRIC}{{check="gpus",pool="b"}} {v.RESULT_CODES[v.FAIL]}' in lines  # its last run: the older
    assert f'{v.RUN_TIME_METRIC}{{pool="a"}} {vr.run_time(newer):.0f}' in lines
    assert f'{v.RUN_TIME_METRIC}{{pool="b"}} {vr.run_time(older):.0f}' in lines
    assert vr.run_time(newer) - vr.run_time(older) == 86400


def test_last_prints_the_newest_run_and_its_verdict(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert vr.last(True, tmp_path) == 1
    assert str(tmp_path) in capsys.readouterr().err
    setup = vr.Setup(ClusterSettings("c", "us-east-1", {}), verify_dir=tmp_path, textfile=tmp_path / "t.prom")
    vr.keep(setup, "20261201T100000Z-a", results_of("a", v.FAIL))
    vr.keep(setup, "20261202T100000Z-a", results_of("a", v.PASS))
    assert vr.last(True, tmp_path) == 0
    assert v.run_from_json(capsys.readouterr().out) == results_of("a", v.PASS)
    vr.keep(setup, "20261203T100000Z-a", results_of("a", v.FAIL))
    assert vr.last(False, tmp_path) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["pool", "check", "result", "measured", "expected", "fix"]
    assert lines[2].split() == ["a", v.GPUS, v.FAIL, "7", "=", "8", "fix"]


def test_verify_with_a_stack_off_its_head_runs_there_through_session_manager(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The CLI hands the operator's options to the Session Manager path (tests/test_verify_remote.py runs that path
    against moto and botocore's Stubber)."""
    called: list[tuple[Any, ...]] = []

    def run(stack: Any, head_args: list[str], session: Any) -> int:
        called.append((stack.name, head_args, session))
        return 1

    monkeypatch.setattr(verify_remote, "run", run)
    monkeypatch.setattr(cli, "SETTINGS_FILE", str(tmp_path / "absent.json"))
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):  # credentials to hand on (none: exit 2 before)
        monkeypatch.setenv(name, "t")
    assert cli.main(["verify", "team-a", "--pool", "p5-od", "--nodes", "2", "--deep", "--json"]) == 1
    (name, head_args, session), = called
    assert (name, head_args) == ("team-a", ["--json", "--pool", "p5-od", "--nodes=2", "--deep"])
    assert type(session).__name__ == "Session"
    cli.main(["verify", "team-a", "--last"])
    assert called[-1][1] == ["--last"]


def test_on_the_head_a_run_needs_root_and_last_does_not(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    settings = tmp_path / "cluster.json"
    settings.write_text(ClusterSettings("c", "us-east-1", {}).to_json())
    monkeypatch.setattr(cli, "SETTINGS_FILE", str(settings))
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert cli.main(["verify"]) == cli.EXIT_BAD_INPUT
    assert "run it as root" in capsys.readouterr().err
    # The kept runs are readable by all (0644): --last needs no root.
    monkeypatch.setattr(vr, "VERIFY_DIR", str(tmp_path))
    vr.keep(vr.Setup(ClusterSettings("c", "us-east-1", {}), verify_dir=tmp_path, textfile=tmp_path / "t.prom"),
            "20261201T100000Z-a", results_of("a", v.PASS))
    assert cli.main(["verify", "--last", "--json"]) == 0
    assert v.run_from_json(capsys.readouterr().out) == results_of("a", v.PASS)


@pytest.mark.parametrize("damage", ["{not json", '{"checks": [{"pool": "a"}]}'])
def test_last_says_in_one_line_that_a_damaged_newest_run_cannot_be_read(
        damage: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "20261201T100000Z-a.json").write_text(damage)
    assert vr.last(False, tmp_path) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    (said,) = captured.err.splitlines()
    assert said.startswith(f"verify: the latest run, {tmp_path / '20261201T100000Z-a.json'}, cannot be read")


class ScriptedCluster(vr.Slurm):
    """A pool of two nodes on a fake clock: the user's job waits for nodes until t=`queued` (10), boots them for 90 s,
    runs until t=300; a job with --dependency=afterany on it waits until then and runs 60 s, or, `taken`, waits for
    ever behind another job that took the nodes. The nodes power off 30 s after the last job (SuspendTime); `warm`:
    they were up from the start. A job's start writes its start time where its --chdir says, as the job script's first
    line does."""

    def __init__(self, clock: list[float], warm: bool = False, queued: float = 10, taken: bool = False):
        super().__init__(pwd_name())
        self.clock, self.warm, self.queued, self.taken = clock, warm, queued, taken
        self.submitted: list[tuple[float, list[str]]] = []
        self.scripts: list[str] = []

    def submit(self, args: list[str], script: str, as_user: bool) -> str:
        self.submitted.append((self.clock[0], args))
        self.scripts.append(script)
        return str(len(self.submitted))

    def state(self, job_id: str) -> tuple[str, str]:
        now, args = self.clock[0], self.submitted[int(job_id) - 1][1]
        if any(a.startswith("--dependency=afterany:") for a in args):
            if now >= 300 and self.taken:
                return "PENDING", "Resources"
            return ("PENDING", "Dependency") if now < 300 else ("RUNNING", "None") if now < 360 else ("COMPLETED", "")
        if now < self.queued:
            return "PENDING", "Resources"
        if now < self.queued + 90 and not self.warm:
            return "CONFIGURING", "None"
        if now < 300:
            chdir = next(a.split("=", 1)[1] for a in args if a.startswith("--chdir="))
            started = Path(chdir) / vr.STARTED_FILE
            if not started.exists():
                started.write_text(f"{now}\n")
            return "RUNNING", "None"
        return "COMPLETED", ""

    def jobs(self) -> dict[str, slurm_json.Job]:
        answer = {}
        for job_id in map(str, range(1, len(self.submitted) + 1)):
            word, reason = self.state(job_id)
            flags = {"RUNNING", vr.BOOTING} if word == "CONFIGURING" else {word}
            nodes = ("p-1", "p-2") if word != "PENDING" else ()
            answer[job_id] = slurm_json.Job(job_id, frozenset(flags), "p", nodes, "", reason)
        return answer

    def node_states(self) -> dict[str, frozenset[str]]:
        off = (self.clock[0] < 10 and not self.warm) or self.clock[0] > 390
        return {n: frozenset({"IDLE", "CLOUD", "POWERED_DOWN"} if off else {"IDLE", "CLOUD"}) for n in ("p-1", "p-2")}


def pwd_name() -> str:
    import pwd

    return pwd.getpwuid(os.getuid()).pw_name


def scripted_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, warm: bool, **scripted: Any
                 ) -> tuple[ScriptedCluster, dict[str, v.Result], list[float]]:
    """measure() over ScriptedCluster, Prometheus answering that it scrapes both nodes from t=150 on."""
    clock = [0.0]
    asked: list[float] = []

    def prometheus(base: str, path: str) -> Any:
        asked.append(clock[0])
        health = "up" if clock[0] >= 150 else "unknown"
        return {"activeTargets": [{"labels": {"job": "node", "node": n}, "health": health} for n in ("p-1", "p-2")]}

    monkeypatch.setattr(vr, "prometheus_get", prometheus)
    plan = [v.Check("p", v.SCALE_FROM_ZERO_SECONDS, {"max": 600}), v.Check("p", v.DCGM_DIAG, {"level": 1}),
            v.Check("p", v.PROMETHEUS_SCRAPES, {"nodes": 2}), v.Check("p", v.NAMES_RESOLVE, {"nodes": 2})]
    slurm = ScriptedCluster(clock, warm, **scripted)
    setup = vr.Setup(ClusterSettings("c", "us-east-1", {}), user=pwd_name(), verify_dir=tmp_path)
    _, results = vr.measure(plan, setup, slurm, clock=lambda: clock[0],
                            pause=lambda s: clock.__setitem__(0, clock[0] + 10))
    return slurm, {r.check: r for r in results}, asked


def test_roots_dcgm_job_is_queued_behind_the_users_job_on_its_nodes_as_soon_as_it_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Submitted while the user's job runs (so Slurm gives it the nodes as that job ends, before SuspendTime can
    power them off), on exactly its nodes, after it; the scale-up measured from Slurm giving the nodes to the start;
    Prometheus asked only while the nodes are up."""
    slurm, results, asked = scripted_run(tmp_path, monkeypatch, warm=False)
    (user_at, user_args), (dcgm_at, dcgm_args) = slurm.submitted
    assert 100 <= dcgm_at < 300  # while the user's job ran
    assert {"--nodelist=p-1,p-2", "--dependency=afterany:1"} <= set(dcgm_args)
    assert f"--time={-(-v.dcgm_job_seconds(v.DCGM_LEVEL) // 60)}" in dcgm_args  # level 1: minutes, not an hour
    assert results[v.SCALE_FROM_ZERO_SECONDS].result == v.PASS
    assert results[v.SCALE_FROM_ZERO_SECONDS].measured == 100.0 - 0.0  # from the last look that found it waiting
    assert results[v.PROMETHEUS_SCRAPES].measured == 2 and results[v.PROMETHEUS_SCRAPES].result == v.PASS
    assert asked and all(100 <= t <= 390 for t in asked)


def test_the_queue_wait_before_the_scale_up_is_recorded_beside_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                   ) -> None:
    """Submit to running, split: queue_seconds from the submission to the last look that found the job waiting for
    nodes, scale_from_zero_seconds from then to the job's start; both kept in the run document."""
    slurm, results, _ = scripted_run(tmp_path, monkeypatch, warm=False, queued=40)
    scale = results[v.SCALE_FROM_ZERO_SECONDS]
    waited = 30.0  # the looks come every 10 s (the scripted pause): the last that saw it pending was t=30
    assert slurm.submitted[0][0] == 0.0 and scale.details == {v.QUEUE_SECONDS_KEY: waited - 0.0}
    assert scale.measured == 40.0 + 90 - waited and scale.result == v.PASS
    assert v.run_from_json(v.run_json([scale])) == [scale]


def test_a_dcgm_job_kept_from_the_nodes_by_other_work_warns_as_a_held_pool_does(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another job takes the nodes between the user's job and root's: DCGM measured nothing, the pool is busy, not
    broken (held_results' rule): a warning with Slurm's reason; the user job's checks keep their verdicts."""
    _, results, _ = scripted_run(tmp_path, monkeypatch, warm=False, taken=True)
    dcgm = results[v.DCGM_DIAG]
    assert dcgm.result == v.WARN and dcgm.measured is None, dcgm
    assert "Slurm's reason: Resources" in dcgm.fix and "busy" in dcgm.fix
    assert results[v.SCALE_FROM_ZERO_SECONDS].result == v.PASS


def test_the_pools_probe_steps_take_one_lock_so_one_pool_at_a_time_measures_fsx(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each pool's /fsx floor is a share of the whole file system's baseline: two pools measuring at once would
    divide it. Every pool's job runs its probe step (the throughput) under flock on the same file of the run."""
    monkeypatch.setattr(vr, "prometheus_get", lambda base, path: {"activeTargets": []})
    plan = [v.Check(pool, v.NAMES_RESOLVE, {"nodes": 2}) for pool in ("p", "q")]
    clock = [0.0]
    slurm = ScriptedCluster(clock)
    setup = vr.Setup(ClusterSettings("c", "us-east-1", {}), user=pwd_name(), verify_dir=tmp_path)
    name, _ = vr.measure(plan, setup, slurm, clock=lambda: clock[0],
                         pause=lambda s: clock.__setitem__(0, clock[0] + 10))
    probe_steps = [next(line for line in script.splitlines() if VERIFY_PROBE_PROGRAM in line)
                   for script in slurm.scripts]
    lock = tmp_path / name / vr.FSX_LOCK
    assert len(probe_steps) == 2 and all(step.startswith(f"flock {lock} srun ") for step in probe_steps), probe_steps


def test_a_warm_pool_says_its_scale_up_was_not_measured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, results, _ = scripted_run(tmp_path, monkeypatch, warm=True)
    scale = results[v.SCALE_FROM_ZERO_SECONDS]
    assert scale.result == v.WARN and "already up" in scale.fix and scale.measured is None
    assert v.run_from_json(v.run_json([scale])) == [scale]  # the warning's reason is kept in the run document


def test_the_level_1_diagnostic_has_one_limit_for_the_probe_and_the_health_check() -> None:
    """node/devices.py keeps its own copy (the burn-in's pod has only that file): the two must agree."""
    from gpucluster.node import devices

    assert devices.DCGM_SECONDS == v.DCGM_LEVEL_SECONDS[v.DCGM_LEVEL]
