"""Prometheus on the head node, checked by Prometheus' own tools (Debian's prometheus and prometheus-alertmanager
packages): the rendered configuration and rules, the alerts proven with `promtool test rules`, Alertmanager's route to
the stack's topic, the scrape-target lists the node-name publisher keeps, and the figures our metrics program writes."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import STACK_FILES
from gpucluster.contract import settings, slurm_json
from gpucluster.contract.settings import ClusterSettings, PoolSettings
from gpucluster.node import bootstrap, budget_guardrail, hosts, metrics
from gpucluster.node.budget import BudgetSpend
from gpucluster.node.slurm_control import SlurmControl
from gpucluster.render import monitoring, prometheus
from gpucluster.spec.model import load_stack
from slurm_samples import document, job, node


def tool(name: str) -> str:
    found = shutil.which(name)
    assert found, f"{name} is missing: install Debian's prometheus and prometheus-alertmanager (make test does)"
    return found


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([tool("promtool"), *args], capture_output=True, text=True, cwd=cwd, timeout=60)


def write_rendered(stack_path: Path, out: Path) -> None:
    for name, text in prometheus.files(load_stack(stack_path)).items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)


@pytest.mark.parametrize("path", STACK_FILES, ids=lambda p: p.name)
def test_promtool_accepts_the_rendered_configuration_and_rules(path: Path, tmp_path: Path) -> None:
    write_rendered(path, tmp_path)
    config, rules = (tmp_path / name for name in settings.MONITORING_FILES)
    checked = promtool("check", "config", str(config))
    assert checked.returncode == 0 and "SUCCESS: 1 rule files found" in checked.stdout, checked.stdout + checked.stderr
    checked = promtool("check", "rules", str(rules))
    assert checked.returncode == 0 and f"SUCCESS: {len(prometheus.RECORDING_RULES) + len(prometheus.alert_rules())} " \
        "rules found" in checked.stdout, checked.stdout + checked.stderr
    doc = yaml.safe_load(config.read_text())
    assert doc["global"]["external_labels"]["team"] == load_stack(path).spec.team
    assert {job["job_name"] for job in doc["scrape_configs"]} == {"prometheus", "node", "dcgm", "neuron"}


def test_promtool_refuses_a_broken_rule(tmp_path: Path) -> None:
    """The check above can fail."""
    (tmp_path / "rules.yml").write_text(
        "groups:\n- name: x\n  rules:\n  - alert: Broken\n    expr: avg_over_time(up[5m]\n")
    assert promtool("check", "rules", str(tmp_path / "rules.yml")).returncode != 0


def gpu_series(values: str, gpu: str = "0") -> dict[str, str]:
    return {"series": f'DCGM_FI_DEV_GPU_UTIL{{gpu="{gpu}",UUID="GPU-{gpu}",modelName="NVIDIA H100 80GB HBM3",'
                      f'Hostname="p5-od-1",node="p5-od-1",pool="p5-od",job="dcgm"}}', "values": values}


def gpu_idle_alert(gpu: str = "0") -> dict[str, object]:
    return {"exp_labels": {"severity": "warning", "gpu": gpu, "UUID": f"GPU-{gpu}",
                           "modelName": "NVIDIA H100 80GB HBM3", "Hostname": "p5-od-1", "node": "p5-od-1",
                           "pool": "p5-od", "job": "dcgm"},
            "exp_annotations": {
                "summary": f"GPU {gpu} of p5-od-1 (p5-od) under {monitoring.IDLE_PERCENT}% for "
                           f"{monitoring.IDLE_MINUTES} minutes",
                "description": f"Average utilisation 10% over {monitoring.IDLE_MINUTES} minutes; Slurm job . An idle "
                               "GPU still costs its hour."}}


def test_the_alerts_fire_when_they_should_and_only_then(tmp_path: Path) -> None:
    """`promtool test rules` on the rendered rules: a GPU at 10% for 15 minutes fires GpuIdle (once its window has held
    for as long again: not on a fresh series), one at 80% never does, a dip shorter than the window does not; a fatal
    XID fires at once and an application's XID never, the quota at 90%, a node DOWN after 10 minutes."""
    write_rendered(STACK_FILES[0], tmp_path)
    every = f"{prometheus.SCRAPE_SECONDS}s"
    samples = 15 * 60 // prometheus.SCRAPE_SECONDS
    # promtool evaluates the groups in no fixed order unless told (Prometheus itself runs them independently): the
    # quota alert reads the recording rule of the same step only when the records go first.
    tests = {"rule_files": [str(tmp_path / settings.MONITORING_FILES[1])], "evaluation_interval": every,
             "group_eval_order": ["gpucluster-records", "gpucluster-alerts"], "tests": [
        {"interval": every,
         "input_series": [gpu_series(f"10x{samples}", "0"), gpu_series(f"80x{samples}", "1"),
                          # 80%, four and a half minutes at 0%, 80% again: shorter than the window.
                          gpu_series(f"80x10 0x9 80x{samples - 19}", "2")],
         "alert_rule_test": [
             {"eval_time": "15m", "alertname": "GpuIdle", "exp_alerts": [gpu_idle_alert("0")]},
             *({"eval_time": f"{m}m", "alertname": "GpuIdle", "exp_alerts": [gpu_idle_alert("0")]} for m in (6, 9, 12)),
             *({"eval_time": f"{m}m", "alertname": "GpuIdle", "exp_alerts": []} for m in (1, 3, 4)),  # fresh series
         ]},
        {"interval": every,
         "input_series": [gpu_series(f"80x{samples}", "1"), gpu_series(f"80x10 0x9 80x{samples - 19}", "2")],
         "alert_rule_test": [{"eval_time": f"{m}m", "alertname": "GpuIdle", "exp_alerts": []} for m in range(1, 16)]},
        {"interval": every,
         "input_series": [
             {"series": 'DCGM_EXP_XID_ERRORS_COUNT{gpu="3",UUID="GPU-3",node="p5-od-1",xid="79"}', "values": "0 0 1 1"},
             # XID 13: an application's illegal memory access, the job's problem, not the GPU's.
             {"series": 'DCGM_EXP_XID_ERRORS_COUNT{gpu="2",UUID="GPU-2",node="p5-od-1",xid="13"}', "values": "1 1 1 1"},
             {"series": "gpucluster_quota_used_usd", "values": "800 900 950"},
             {"series": "gpucluster_quota_usd", "values": "1000 1000 1000"},
             {"series": 'gpucluster_slurm_node_state{node="p5-od-2",pool="p5-od",state="down"}', "values": "1x30"}],
         "alert_rule_test": [
             {"eval_time": "30s", "alertname": "GpuXidError", "exp_alerts": []},
             {"eval_time": "1m", "alertname": "GpuXidError", "exp_alerts": [{
                 "exp_labels": {"severity": "critical", "gpu": "3", "UUID": "GPU-3", "node": "p5-od-1", "xid": "79"},
                 "exp_annotations": {"summary": "GPU 3 of p5-od-1 reported XID 79", "description":
                                     "The health check drains a node whose XID needs a reset (see `sinfo -R`)."}}]},
             {"eval_time": "0m", "alertname": "QuotaNearlySpent", "exp_alerts": []},
             {"eval_time": "30s", "alertname": "QuotaNearlySpent", "exp_alerts": [{
                 "exp_labels": {"severity": "warning"},
                 "exp_annotations": {"summary": "90% of the team's monthly quota for jobs is spent", "description":
                                     "Slurm holds new jobs of the team's account once the quota is spent."}}]},
             {"eval_time": "9m", "alertname": "NodeDown", "exp_alerts": []},
             {"eval_time": "11m", "alertname": "NodeDown", "exp_alerts": [{
                 "exp_labels": {"severity": "warning", "node": "p5-od-2", "pool": "p5-od", "state": "down"},
                 "exp_annotations": {"summary": "Slurm node p5-od-2 (p5-od) DOWN for 10 minutes",
                                     "description": "`sinfo -R -n p5-od-2` says why."}}]}]},
    ]}
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(tests, sort_keys=False))
    done = promtool("test", "rules", str(tmp_path / "tests.yml"))
    assert done.returncode == 0 and "SUCCESS" in done.stdout, done.stdout + done.stderr


def test_a_wrong_expectation_fails_the_rule_test(tmp_path: Path) -> None:
    """The proof above can fail: an 80% GPU expected to fire GpuIdle is refused."""
    write_rendered(STACK_FILES[0], tmp_path)
    tests = {"rule_files": [str(tmp_path / settings.MONITORING_FILES[1])], "tests": [
        {"interval": "30s", "input_series": [gpu_series("80x40", "1")],
         "alert_rule_test": [{"eval_time": "15m", "alertname": "GpuIdle", "exp_alerts": [gpu_idle_alert("1")]}]}]}
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(tests))
    assert promtool("test", "rules", str(tmp_path / "tests.yml")).returncode != 0


def test_dcgm_counters_are_what_the_rules_and_exporter_list_agree_on() -> None:
    lines = [line for line in prometheus.dcgm_counters().splitlines() if not line.startswith("#")]
    assert [line.split(", ")[0] for line in lines] == sorted(prometheus.EXPORTED["dcgm-exporter"], key=[
        name for name, _, _ in prometheus.DCGM_COUNTERS].index)
    assert all(line.split(", ")[1] in ("gauge", "counter") for line in lines)


def test_prometheus_keeps_at_most_its_share_of_the_state_volume() -> None:
    args = prometheus.prometheus_args()
    assert "--storage.tsdb.retention.size=100GB" in args
    assert f"--storage.tsdb.path={settings.PROMETHEUS_DATA_DIR}" in args
    assert "--web.listen-address=127.0.0.1:" in args  # never on the node's network address


def cluster_settings(**extra: Any) -> ClusterSettings:
    pools = {"p5-od": PoolSettings("p5-od", "lt-1", "subnet-1", "p5.48xlarge", "on-demand", max_nodes=4,
                                   accelerator="nvidia", accelerators=8, node_hour_usd=98.32),
             "trn": PoolSettings("trn", "lt-2", "subnet-1", "trn1.32xlarge", "spot", max_nodes=2, accelerator="neuron",
                                 accelerators=16, node_hour_usd=21.5),
             "cpu": PoolSettings("cpu", "lt-3", "subnet-1", "c7i.4xlarge", "on-demand", max_nodes=2)}
    return ClusterSettings(cluster="gpucluster-team-a", region="us-east-1", pools=pools, team="vision",
                           head_address="10.0.0.5", **extra)


def test_the_target_lists_follow_the_registered_nodes_with_their_labels() -> None:
    lists = {name: json.loads(text) for name, text in hosts.scrape_targets(
        {"p5-od-1": "10.0.0.11", "trn-2": "10.0.0.12", "cpu-1": "10.0.0.13"}, cluster_settings()).items()}
    labels = {"cluster": "gpucluster-team-a", "team": "vision"}
    assert lists["node.json"] == [
        {"targets": ["10.0.0.13:9100"], "labels": {"node": "cpu-1", "pool": "cpu", **labels}},
        {"targets": ["10.0.0.5:9100"], "labels": {"node": "head", **labels}},
        {"targets": ["10.0.0.11:9100"], "labels": {"node": "p5-od-1", "pool": "p5-od", **labels}},
        {"targets": ["10.0.0.12:9100"], "labels": {"node": "trn-2", "pool": "trn", **labels}}]
    assert lists["dcgm.json"] == [
        {"targets": ["10.0.0.11:9400"], "labels": {"node": "p5-od-1", "pool": "p5-od", **labels}}]
    assert lists["neuron.json"] == [
        {"targets": ["10.0.0.12:9500"], "labels": {"node": "trn-2", "pool": "trn", **labels}}]


def test_a_node_that_leaves_slurm_leaves_the_target_lists(tmp_path: Path) -> None:
    up = document("nodes", [node("p5-od-1", "ALLOCATED+CLOUD", address="10.0.0.11")])
    gone = document("nodes", [node("p5-od-1", "IDLE+CLOUD+POWERED_DOWN")])
    (tmp_path / "etc-hosts").write_text("127.0.0.1 localhost\n")
    for scontrol, expected in ((up, ["10.0.0.11:9400"]), (gone, [])):
        hosts.publish_once(tmp_path / "hosts", tmp_path / "etc-hosts", scontrol, cluster_settings(),
                           tmp_path / "targets")
        assert [t for entry in json.loads((tmp_path / "targets" / "dcgm.json").read_text()) for t in entry["targets"]] \
            == expected


def test_rehearsal_ports_are_distinct_per_node_and_exporter() -> None:
    """The boot rehearsal's seam (all its nodes share one address): every node's every exporter its own port."""
    s = cluster_settings(exporter_port_base=20000)
    nodes = ["head"] + [f"{p}-{n}" for p, pool in s.pools.items() for n in range(1, pool.max_nodes + 1)]
    ports = [s.exporter_port(job, node) for node in nodes for job in settings.SCRAPE_JOBS]
    assert len(set(ports)) == len(ports) and min(ports) == 20000
    assert cluster_settings().exporter_port(settings.SCRAPE_JOBS[1], "p5-od-3") == settings.DCGM_EXPORTER_PORT


def test_the_head_figures_parse_and_say_what_slurm_says() -> None:
    s = cluster_settings()
    nodes = document("nodes", [node("p5-od-1", "ALLOCATED+CLOUD"), node("p5-od-2", "IDLE+DRAIN+CLOUD"),
                               node("p5-od-3", "IDLE+CLOUD+POWERED_DOWN"), node("trn-1", "DOWN+CLOUD"),
                               node("trn-2", "MIXED+DRAIN+CLOUD")])
    jobs = document("jobs", [job(1, "RUNNING", "p5-od-1", "p5-od"), job(2, "PENDING", partition="p5-od"),
                             job(3, "PENDING+REQUEUED", partition="p5-od"), job(4, "RUNNING", "trn-2", "trn"),
                             job(5, "COMPLETED", "trn-2", "trn"),  # ended: squeue would not list it
                             job(6, "COMPLETED+COMPLETING", "trn-2", "trn")])
    text = (metrics.pool_prices(s) + metrics.slurm_nodes(slurm_json.nodes(nodes), s)
            + metrics.slurm_jobs(slurm_json.jobs(jobs)) + metrics.gpu_hours(
        "vision||cpu=5000,mem=1000,billing=90000,gres/gpu=2700|billing=360000,gres/gpu=-1\n"
        "vision|ubuntu|cpu=5000,gres/gpu=2700|\n", "vision",
        ("ubuntu",)))
    assert 'gpucluster_slurm_node_state{node="p5-od-2",pool="p5-od",state="drained"} 1' in text
    assert 'gpucluster_slurm_node_state{node="trn-2",pool="trn",state="draining"} 1' in text
    assert 'gpucluster_slurm_node_state{node="p5-od-3",pool="p5-od",state="powered_down"} 1' in text
    assert 'gpucluster_slurm_node_state{node="trn-1",pool="trn",state="down"} 1' in text
    assert 'gpucluster_slurm_jobs{partition="p5-od",state="pending"} 2' in text
    assert 'gpucluster_slurm_jobs{partition="trn",state="running"} 1' in text
    assert 'gpucluster_slurm_jobs{partition="trn",state="completing"} 1' in text
    assert 'state="completed"' not in text
    # 45 GPU-hours; 90000 and 360000 cent-minutes of billing are $15 and $60
    assert "gpucluster_gpu_used_seconds 162000\n" in text
    assert "gpucluster_quota_used_usd 15\n" in text and "gpucluster_quota_usd 60\n" in text
    assert 'gpucluster_pool_gpu_hour_usd{pool="p5-od"} 12.29\n' in text and 'pool="cpu"' not in text
    checked = subprocess.run([tool("promtool"), "check", "metrics"], input=text, capture_output=True, text=True,
                             timeout=30)
    assert checked.returncode == 0, checked.stdout + checked.stderr


# `sshare -n -P -a -A vision -o Account,User,GrpTRESRaw,GrpTRESMins` as Slurm 24.11 prints it (tests/test_spend.py
# has the whole tree): the account's row, then its users' rows a level deeper. dave is a user an admin added by hand.
TEAM_SSHARE = (" vision||cpu=9000,gres/gpu=4800,gres/gpumem=0|gres/gpu=60000\n"
               "  vision|alice|cpu=6000,gres/gpu=3600,gres/gpumem=0|\n"
               "  vision|bob|cpu=3000,gres/gpu=1170,gres/gpumem=0|\n"
               "  vision|dave|cpu=0,gres/gpu=0,gres/gpumem=0|\n"
               "  vision|ubuntu|cpu=0,gres/gpu=30,gres/gpumem=0|\n")


class TeamSshare(SlurmControl):
    """sshare's answer, given; no scontrol (this machine runs no controller)."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[tuple[str, ...]] = []

    def _call(self, *command: str) -> str:
        self.asked.append(command)
        if command[0] != "sshare":
            raise OSError(f"{command[0]}: not on this machine")
        return TEAM_SSHARE


def test_each_persons_gpu_time_is_labelled_with_their_name_and_only_the_stacks_people() -> None:
    """The head's round asks sshare for every user of the team account (-a) and writes a series per person of the
    stack and one for the login user (verify's jobs); someone else's association adds no label value."""
    people = tuple(settings.PersonSettings(name, uid, uid) for name, uid in (("alice", 20001), ("bob", 20002)))
    slurm = TeamSshare()
    text = metrics.head_figures(cluster_settings(people=people), slurm)
    sshare = next(args for args in slurm.asked if args[0] == "sshare")
    assert "-a" in sshare and sshare[sshare.index("-A") + 1] == "vision"
    per_person = dict(re.findall(r'^gpucluster_person_gpu_used_seconds\{user="(\w+)"\} (\S+)$', text, re.M))
    assert per_person == {"alice": str(3600 * 60), "bob": str(1170 * 60), "ubuntu": str(30 * 60)}
    assert f"gpucluster_gpu_used_seconds {4800 * 60}\n" in text
    checked = subprocess.run([tool("promtool"), "check", "metrics"], input=text, capture_output=True, text=True,
                             timeout=30)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    # Without people, the login user is everyone's.
    alone = metrics.head_figures(cluster_settings(), TeamSshare())
    assert re.findall(r'^gpucluster_person_gpu_used_seconds\{user="(\w+)"\}', alone, re.M) == ["ubuntu"]


def test_the_compute_figures_read_efa_and_lustre_counters(tmp_path: Path) -> None:
    """A root prefix for /sys (this machine has no EFA device) and lctl's output as Lustre 2.15 prints it."""
    for device, rx, tx in (("rdmap16s27", "1234567890123", "2000"), ("rdmap32s27", "30", "40")):
        counters = tmp_path / "sys/class/infiniband" / device / "ports/1/hw_counters"
        counters.mkdir(parents=True)
        (counters / "rx_bytes").write_text(rx + "\n")
        (counters / "tx_bytes").write_text(tx + "\n")
        (counters / "rdma_read_bytes").write_text("7\n")
    lctl = ("llite.fsx-ffff9b0c5b5a1000.stats=\nsnapshot_time             1700000000.1 secs.nsecs\n"
            "read_bytes                8 samples [bytes] 4096 1048576 4198400\n"
            "write_bytes               2 samples [bytes] 65536 65536 131072\n"
            "open                      5 samples [usecs]\n")
    text = metrics.efa_bytes(tmp_path) + metrics.lustre_bytes(lctl)
    assert 'gpucluster_efa_rx_bytes_total{device="rdmap16s27",port="1"} 1234567890123\n' in text  # every digit
    assert 'gpucluster_efa_tx_bytes_total{device="rdmap32s27",port="1"} 40' in text
    assert 'gpucluster_lustre_read_bytes_total{fs="fsx"} 4198400\n' in text
    assert 'gpucluster_lustre_write_bytes_total{fs="fsx"} 131072' in text
    checked = subprocess.run([tool("promtool"), "check", "metrics"], input=text, capture_output=True, text=True,
                             timeout=30)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_alertmanager_sends_to_the_stack_topic(tmp_path: Path) -> None:
    s = cluster_settings(alerts_topic_arn="arn:aws:sns:us-east-1:123456789012:gpucluster-team-a-alerts")
    config = tmp_path / "alertmanager.yml"
    config.write_text(bootstrap.alertmanager_config(s))
    checked = subprocess.run([tool("amtool"), "check-config", str(config)], capture_output=True, text=True, timeout=30)
    assert checked.returncode == 0 and "SUCCESS" in checked.stdout, checked.stdout + checked.stderr
    receiver = json.loads(config.read_text())["receivers"][0]["sns_configs"][0]
    assert receiver["topic_arn"] == s.alerts_topic_arn and receiver["sigv4"] == {"region": "us-east-1"}
    config.write_text(bootstrap.alertmanager_config(s).replace('"sns_configs"', '"sns_config"'))
    assert subprocess.run([tool("amtool"), "check-config", str(config)], capture_output=True).returncode != 0


def exposed_names(text: str) -> set[str]:
    return {line.split("{")[0].split()[0] for line in text.splitlines() if line and not line.startswith("#")}


def test_the_node_exporter_metrics_we_name_are_what_a_real_node_exporter_serves(tmp_path: Path) -> None:
    """Debian's node_exporter with our flags, scraped: every node_exporter metric a rule or board names is there
    (`up` is Prometheus' own), and the collectors we turned off are off."""
    import socket
    import time
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exporter = subprocess.Popen([tool("prometheus-node-exporter"), f"--web.listen-address=127.0.0.1:{port}",
                                 f"--collector.textfile.directory={tmp_path}", *settings.NODE_EXPORTER_FLAGS],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
                break
            except OSError:
                time.sleep(0.1)
        else:
            raise AssertionError("node_exporter did not answer")
    finally:
        exporter.kill()
    served = exposed_names(text)
    assert prometheus.EXPORTED["node_exporter"] - {"up"} <= served, prometheus.EXPORTED["node_exporter"] - served
    assert "node_cpu_guest_seconds_total" not in served and "node_network_mtu_bytes" not in served


def test_the_gpucluster_metrics_we_name_are_what_our_programs_write(tmp_path: Path) -> None:
    budget_guardrail.publish_spend(BudgetSpend(actual=1.0, limit=2.0, act_at=2.0, forecast=3.0), tmp_path)
    s = cluster_settings()
    counters = tmp_path / "sys/class/infiniband/rdmap0/ports/1/hw_counters"
    counters.mkdir(parents=True)
    for name in ("rx_bytes", "tx_bytes"):
        (counters / name).write_text("1\n")
    written = "".join([
        (tmp_path / "gpucluster-budget.prom").read_text(), metrics.pool_prices(s),
        metrics.slurm_nodes(slurm_json.nodes(document("nodes", [node("p5-od-1")])), s),
        metrics.slurm_jobs(slurm_json.jobs(document("jobs", [job(1, "RUNNING", "p5-od-1", "p5-od")]))),
        metrics.gpu_hours("vision||billing=1,gres/gpu=1|billing=2\n vision|alice|gres/gpu=1|\n", "vision", ("alice",)),
        metrics.efa_bytes(tmp_path),
        metrics.lustre_bytes("llite.fsx-1.stats=\n"
                             "read_bytes 1 samples [bytes] 1 1 1\nwrite_bytes 1 samples [bytes] 1 1 1\n")])
    assert exposed_names(written) == prometheus.EXPORTED["gpucluster_metrics"]


def test_gpu_idle_selects_only_on_what_dcgm_exporter_always_sets() -> None:
    """The issue's interface: GpuIdle by metric name and dcgm-exporter's own labels, never ours (node, pool: they
    are Slurm's scrape labels, absent on Kubernetes)."""
    expr = prometheus.gpu_idle_expr()
    assert expr.startswith("avg_over_time(DCGM_FI_DEV_GPU_UTIL{")
    matchers = re.findall(r'([A-Za-z_]+)\s*(?:=|!=|=~|!~)\s*"', expr.split("{", 1)[1].split("}", 1)[0])
    assert matchers and set(matchers) <= set(prometheus.DCGM_LABELS), matchers


def test_the_state_volume_alert_fires_before_the_volume_is_full(tmp_path: Path) -> None:
    """`promtool test rules`: the head's state volume falling under its free share for 5 minutes fires
    StateVolumeFilling; a dip shorter than that, the volume with room, or another filesystem as full (a compute node's
    root) never does."""
    write_rendered(STACK_FILES[0], tmp_path)
    size = 200 << 30
    low = int(size * prometheus.STATE_VOLUME_ALERT_FREE_SHARE) - (1 << 30)  # just under the share
    roomy = size // 2

    def volume(node: str, mountpoint: str, avail: str) -> list[dict[str, str]]:
        labels = f'job="node",node="{node}",device="/dev/nvme1n1",fstype="ext4",mountpoint="{mountpoint}"'
        return [{"series": f"node_filesystem_avail_bytes{{{labels}}}", "values": avail},
                {"series": f"node_filesystem_size_bytes{{{labels}}}", "values": f"{size}x40"}]

    tests = {"rule_files": [str(tmp_path / settings.MONITORING_FILES[1])], "evaluation_interval": "30s", "tests": [
        {"interval": "30s",
         "input_series": volume("head", settings.STATE_DIR, f"{roomy}x4 {low}x36")
         + volume("p5-od-1", "/", f"{low // 10}x40"),
         "alert_rule_test": [
             {"eval_time": "4m", "alertname": "StateVolumeFilling", "exp_alerts": []},  # under the share 2 minutes
             {"eval_time": "8m", "alertname": "StateVolumeFilling", "exp_alerts": [{
                 "exp_labels": {"severity": "critical", "job": "node", "node": "head", "device": "/dev/nvme1n1",
                                "fstype": "ext4", "mountpoint": settings.STATE_DIR},
                 "exp_annotations": {
                     "summary": f"The head's state volume ({settings.STATE_DIR}) is 19.5% free",
                     "description": "Slurm's queue, the accounting database and Prometheus live there: when it is "
                                    f"full, every sbatch fails. `sudo du -sh {settings.STATE_DIR}/*` says what grew; "
                                    "`sudo squeue -h -t PD -o %u | sort | uniq -c` who queues most."}}]}]},
        {"interval": "30s", "input_series": volume("head", settings.STATE_DIR, f"{roomy}x40"),
         "alert_rule_test": [{"eval_time": "15m", "alertname": "StateVolumeFilling", "exp_alerts": []}]},
    ]}
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(tests, sort_keys=False))
    done = promtool("test", "rules", str(tmp_path / "tests.yml"))
    assert done.returncode == 0 and "SUCCESS" in done.stdout, done.stdout + done.stderr
