"""The Kubernetes flavour's burn-in of new accelerator nodes: the node groups' startup taint (and the autoscaler's view
of it), the DaemonSet per pool, and the verdict program (gpucluster/node/burn_in.py) on DCGM reports and device counts.

The DCGM reports in tests/dcgm-diag/ are shaped as `dcgmi diag -r 1 -j` of DCGM 4.5.2 writes them (NVIDIA/DCGM
v4.5.2: dcgmi/Diag.cpp HelperJsonBuildOutput, HelperJsonAddResult, HelperDisplayFailureMessage; keys in
nvvs/include/NvvsJsonStrings.h; jsoncpp's styled output: keys sorted, three-space indent): a p5.48xlarge's eight H100s
passing the software test, the same with GPU 3's pending row remapping (DCGM_FR_PENDING_ROW_REMAP, its message as
dcgmlib/dcgm_errors.h words it), and a diagnostic that could not run.

The fi_info listings in tests/fi-info/: `fi_info -p efa -t FI_EP_RDM` on a p4de.24xlarge with libfabric 1.19, as
recorded in aws-samples/awsome-distributed-training's EFA troubleshooting notes (its four devices), and the error
libfabric's util/info.c run() prints when the provider opens nothing (fi_getinfo: -FI_ENODATA, fi_strerror's words).
Longer listings (a p5's 32 devices; libfabric 2's second fabric per device, "efa-direct") are written here in the
format of util/info.c print_short_info.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import boto3
import botocore.session
import kubernetes_validate
import pytest
import yaml
from botocore.stub import Stubber

import standard_library
from components.kubernetes import autoscaler_node_template_tags
from conftest import K8S_STACK_FILES, ROOT, of_type, planned
from gpucluster.contract import node_health
from gpucluster.contract.settings import ClusterSettings
from gpucluster.node import burn_in, devices
from gpucluster.plan import Declared
from gpucluster.project import EXAMPLES_DIR
from gpucluster.render import kube, kube_health
from gpucluster.spec.model import RESERVED_NAMESPACES, PoolSpec, Stack, load_stack, validate
from test_kubernetes import TEAM_K8S

REPORTS = ROOT / "tests" / "dcgm-diag"
FI_INFO = ROOT / "tests" / "fi-info"
# What dcgmi prints (plain text, not JSON) when it finds no host engine and cannot start one in itself
# (NVIDIA/DCGM v4.5.2 dcgmi/Diag.cpp StartDiag::DoExecuteConnectionFailure).
UNREACHABLE = "Error: Unable to start an embedded host engine. Host engine connection invalid/disconnected.\n"
# The Cluster Autoscaler's taint prefixes (kubernetes/autoscaler cluster-autoscaler/utils/taints/taints.go): a taint
# with one of them is left out of node templates; the first two also make the node count as starting (unready).
AUTOSCALER_STARTUP_PREFIXES = ("ignore-taint.cluster-autoscaler.kubernetes.io/",
                               "startup-taint.cluster-autoscaler.kubernetes.io/")
AUTOSCALER_STATUS_PREFIX = "status-taint.cluster-autoscaler.kubernetes.io/"


@pytest.fixture(params=K8S_STACK_FILES, ids=lambda p: p.name)
def k8s(request: pytest.FixtureRequest) -> tuple[Stack, tuple[Declared, ...]]:
    return planned(request.param)


def trainium() -> Stack:
    """The shipped stack with a Trainium pool instead of its own (which are all NVIDIA)."""
    doc = yaml.safe_load(TEAM_K8S.read_text())["config"]
    doc["gpucluster:cluster"]["pools"] = [{"name": "trn1", "instance_type": "trn1.32xlarge", "max_nodes": 2}]
    return validate("k8s-trainium", doc)


def pool_of(stack: Stack, name: str) -> PoolSpec:
    return next(p for p in stack.spec.pools if p.name == name)


def expected(pool: PoolSpec) -> burn_in.Expected:
    """The counts the pool's DaemonSet hands the program (its environment), as the program reads them."""
    env = kube_health.expected(pool)
    return burn_in.Expected(env["EXPECTED_GPUS"], env["EXPECTED_NEURON_DEVICES"], env["EXPECTED_EFA_DEVICES"])


def report(name: str) -> str:
    return (REPORTS / name).read_text()


def fi_info_listing(devices: int, fabrics: tuple[str, ...] = ("efa", "efa-direct")) -> str:
    """What `fi_info -p efa -t FI_EP_RDM` prints for a node whose EFA provider opens `devices` devices, an entry per
    fabric and device (libfabric util/info.c print_short_info; device names shaped as the recorded p4de's)."""
    return "".join(f"provider: efa\n    fabric: {fabric}\n    domain: rdmap{16 * (i + 1)}s27-rdm\n"
                   f"    version: 206.0\n    type: FI_EP_RDM\n    protocol: FI_PROTO_EFA\n"
                   for i in range(devices) for fabric in fabrics)


def without_gpu(text: str, entity_id: int) -> str:
    """A passing report from a node where one GPU fell off the bus: DCGM neither lists nor tests it."""
    doc = json.loads(text)
    for group in doc["entity_groups"]:
        group["entities"] = [e for e in group["entities"] if e["entity_id"] != entity_id]
    for category in doc["DCGM Diagnostic"]["test_categories"]:
        for test in category["tests"]:
            test["results"] = [r for r in test["results"] if r["entity_id"] != entity_id]
    return json.dumps(doc)


# --- The verdict ------------------------------------------------------------------------------------------------

P5 = pool_of(load_stack(TEAM_K8S), "p5-spot")
REGION = load_stack(TEAM_K8S).region
INSTANCE = "i-0123456789abcdef0"
P5_EFA = P5.itype.efa_interfaces
P5_FI_INFO = fi_info_listing(P5_EFA)


def test_the_catalog_counts_reach_the_program() -> None:
    """A p5's burn-in expects its eight GPUs and all its EFA interfaces; the fixtures are of such a node."""
    assert P5.uses_efa and P5.accelerator.kind == "nvidia"
    assert expected(P5) == burn_in.Expected(P5.accelerator.count, 0, P5_EFA)
    assert devices.dcgm_problems(report("p5-pass.json")) == ([], P5.accelerator.count)


@pytest.mark.parametrize(("dcgm_report", "efa", "check", "words"), [
    (report("p5-pass.json"), P5_EFA, "", []),
    (report("p5-row-remap-pending.json"), P5_EFA, "dcgm",
     ["Deployment/software failed on GPU 3", "GPU 3 had memory errors and row remappings are pending"]),
    (without_gpu(report("p5-pass.json"), 5), P5_EFA, "gpu-count", [f"{P5.accelerator.count - 1} GPUs"]),
    (report("p5-pass.json"), P5_EFA - 1, "efa-count", [f"{P5_EFA - 1} EFA devices"]),
    # Fail closed: no report is no burn-in.
    (UNREACHABLE, P5_EFA, "dcgm", ["no report", "Unable to start an embedded host engine"]),
    (report("runtime-error.json"), P5_EFA, "dcgm", ["could not run", "homogeneous group"]),
    (None, P5_EFA, "dcgm", ["no report: no output"]),
    (json.dumps({"DCGM Diagnostic": {"test_categories": []}}), P5_EFA, "dcgm", ["ran no test"]),
    # Every problem at once, the first naming the taint.
    (report("p5-row-remap-pending.json"), 0, "dcgm", ["GPU 3", "0 EFA devices"]),
], ids=["pass", "failed-dcgm-test", "too-few-gpus", "too-few-efa", "dcgm-unreachable", "dcgm-runtime-error",
        "no-report", "no-test", "several"])
def test_verdict_on_a_p5(dcgm_report: str | None, efa: int, check: str, words: list[str]) -> None:
    verdict = burn_in.decide(expected(P5), burn_in.Found(dcgm_report, 0, efa, P5_FI_INFO))
    assert verdict.check == check and verdict.passed == (check == "")
    for word in words:
        assert word in "; ".join(verdict.problems)
    if check == "dcgm" and "no report" in "; ".join(verdict.problems):
        assert not any("GPUs" in p for p in verdict.problems)  # an unknown count is not reported as zero GPUs


def test_a_passing_report_with_a_warning_level_result_fails() -> None:
    """DCGM writes a warning as "Fail" in its JSON (HelperDisplayDiagResult's default): a result failed alone, with
    the test's summary still passing, fails the node."""
    doc = json.loads(report("p5-pass.json"))
    doc["DCGM Diagnostic"]["test_categories"][0]["tests"][0]["results"][6]["status"] = "Fail"
    verdict = burn_in.decide(expected(P5), burn_in.Found(json.dumps(doc), 0, P5_EFA, P5_FI_INFO))
    assert verdict.check == "dcgm" and "GPU 6" in verdict.problems[0]


@pytest.mark.parametrize(("neuron", "check"), [(16, ""), (15, "neuron-count")])
def test_verdict_on_a_trainium_node_needs_no_dcgm(neuron: int, check: str) -> None:
    pool = pool_of(trainium(), "trn1")
    want = expected(pool)
    assert want.gpus == 0 and want.neuron_devices == pool.accelerator.count == 16
    verdict = burn_in.decide(want, burn_in.Found(None, neuron, pool.itype.efa_interfaces,
                                                 fi_info_listing(pool.itype.efa_interfaces)))
    assert verdict.check == check


def p4de() -> PoolSpec:
    """A p4de pool (the recorded listing's instance type) in the shipped stack."""
    doc = yaml.safe_load(TEAM_K8S.read_text())["config"]
    doc["gpucluster:cluster"]["pools"] = [{"name": "p4de", "instance_type": "p4de.24xlarge", "max_nodes": 2}]
    return pool_of(validate("k8s-p4de", doc), "p4de")


@pytest.mark.parametrize(("listing", "check", "words"), [
    ((FI_INFO / "p4de-libfabric-1.19.txt").read_text(), "", []),
    # libfabric 2 lists each device twice (fabrics efa and efa-direct): still four devices.
    (fi_info_listing(4), "", []),
    ("\n".join((FI_INFO / "p4de-libfabric-1.19.txt").read_text().splitlines()[:-6]), "efa-provider",
     ["opened 3 RDM domains", "has 4 EFA devices"]),
    ((FI_INFO / "no-efa-provider.txt").read_text(), "efa-provider",
     ["opened 0 RDM domains", "fi_getinfo: -61 (No data available)"]),
    (None, "efa-provider", ["opened 0 RDM domains", "no output"]),  # fail closed: the listing never came
], ids=["recorded-p4de", "libfabric-2", "one-device-short", "no-provider", "no-listing"])
def test_the_efa_provider_must_open_every_device(listing: str | None, check: str, words: list[str]) -> None:
    """The EFA driver lists all four devices under /sys/class/infiniband; what libfabric opens decides."""
    pool = p4de()
    want = expected(pool)
    assert want.efa_devices == pool.itype.efa_interfaces == 4 and pool.uses_efa
    # A passing diagnostic of eight GPUs (a p4de has eight too): the listing alone decides.
    verdict = burn_in.decide(want, burn_in.Found(report("p5-pass.json"), 0, 4, listing))
    assert verdict.check == check and len(verdict.problems) == (check != "")
    for word in words:
        assert word in "; ".join(verdict.problems)


def test_device_counts(tmp_path: Path) -> None:
    dev, infiniband = tmp_path / "dev", tmp_path / "infiniband"
    dev.mkdir()
    infiniband.mkdir()
    for name in ("neuron0", "neuron1", "neuron15", "nvidia0", "neuron", "neuronx"):
        (dev / name).touch()
    for i in range(3):
        (infiniband / f"rdmap{16 + i}s0").mkdir()
    assert devices.count_neuron_devices(dev) == 3
    assert burn_in.count_efa_devices(infiniband) == 3
    assert burn_in.count_efa_devices(tmp_path / "absent") == 0 and devices.count_neuron_devices(tmp_path / "x") == 0


# --- The Node patch ---------------------------------------------------------------------------------------------

def a_new_node(pool: PoolSpec) -> dict[str, Any]:
    """A node of the pool as it registers: the node group's taints (the startup taint among them)."""
    return {"metadata": {"name": "ip-10-44-0-17.ec2.internal", "resourceVersion": "4711",
                         "labels": kube.pool_labels(load_stack(TEAM_K8S), pool)},
            "spec": {"taints": kube_health.node_group_taints(pool), "providerID": f"aws:///{REGION}a/{INSTANCE}"}}


def test_a_pass_lifts_the_startup_taint_and_labels_the_node() -> None:
    node = a_new_node(P5)
    patch = burn_in.node_patch(node, burn_in.Verdict("", ()))
    assert patch == {"metadata": {"resourceVersion": "4711", "labels": {"gpucluster/burn-in": "passed"},
                                  "annotations": {"gpucluster/burn-in-reason": None,
                                                  "gpucluster/burn-in-replacement": None}},
                     "spec": {"taints": kube.pool_taints(P5)}}


def test_a_failure_puts_the_failed_taint_in_the_startup_taints_place() -> None:
    node = a_new_node(P5)
    node["spec"]["taints"].append({"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"})
    verdict = burn_in.Verdict("efa-count", ("31 EFA devices under /sys/class/infiniband, the instance type has 32",))
    patch = burn_in.node_patch(node, verdict, "replaced: ...")
    assert patch["metadata"] == {"resourceVersion": "4711", "labels": {"gpucluster/burn-in": "failed"},
                                 "annotations": {"gpucluster/burn-in-reason": verdict.problems[0],
                                                 "gpucluster/burn-in-replacement": "replaced: ..."}}
    assert patch["spec"]["taints"] == [*kube.pool_taints(P5),
                                       {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"},
                                       {"key": node_health.FAILED_TAINT, "value": "efa-count",
                                        "effect": "NoSchedule"}]
    # Run again on that node (its label removed by hand): still one failed taint, with the new verdict's value.
    node["spec"]["taints"] = patch["spec"]["taints"]
    again = burn_in.node_patch(node, burn_in.Verdict("dcgm", ("x",)))["spec"]["taints"]
    assert [t["value"] for t in again if t["key"] == node_health.FAILED_TAINT] == ["dcgm"]
    assert not any(t["key"] == node_health.STARTUP_TAINT for t in again)


class ApiServer:
    """A stand-in for the API server's two objects the program reads and patches (`burn_in.api` replaced): no API
    server runs on this machine. It applies merge patches as the server does, so a second run sees the first's
    record."""

    def __init__(self, node: dict[str, Any], records: dict[str, str] | None = None) -> None:
        self.node = node
        self.config_map: dict[str, Any] = {"metadata": {"name": node_health.REPLACEMENTS_CONFIG_MAP,
                                                        "resourceVersion": "1"}, "data": records}
        self.calls: list[tuple[str, str, dict[str, Any] | None]] = []

    def __call__(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        self.calls.append((method, path, body))
        if path.endswith(f"/configmaps/{node_health.REPLACEMENTS_CONFIG_MAP}"):
            if body is not None:
                assert body["metadata"]["resourceVersion"] == self.config_map["metadata"]["resourceVersion"]
                self.config_map["data"] = (self.config_map["data"] or {}) | body["data"]
                self.config_map["metadata"]["resourceVersion"] += "1"
            return self.config_map
        assert path == f"/api/v1/nodes/{self.node['metadata']['name']}", path
        return self.node


def replacement_note(server: ApiServer) -> str:
    """The replacement annotation of the last Node patch the stand-in API server took."""
    body = server.calls[-1][2]
    assert body is not None, "the last call carried no body"
    return str(body["metadata"]["annotations"][node_health.REPLACEMENT_ANNOTATION])


def run_burn_in(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, server: ApiServer, dcgm_report: str,
                autoscaling: Any = None, boto3_install: str | None = None) -> None:
    """main() from the verdict container's own environment, on a p5 with all its EFA devices; `boto3_install` in
    place of the container's install command runs the program's own install step."""
    (tmp_path / "dcgm.json").write_text(dcgm_report)
    (tmp_path / "infiniband").mkdir(exist_ok=True)
    for i in range(P5_EFA):
        (tmp_path / "infiniband" / f"rdmap{i}").mkdir(exist_ok=True)
    daemon_set = kube_health.daemon_set(P5, REGION)
    (verdict_container,) = [c for c in daemon_set["spec"]["template"]["spec"]["initContainers"]
                            if c["name"] == "verdict"]
    for variable in verdict_container["env"]:
        if "value" in variable:
            monkeypatch.setenv(variable["name"], variable["value"])
    monkeypatch.setenv("NODE_NAME", server.node["metadata"]["name"])
    monkeypatch.setenv("POD_NAMESPACE", kube_health.NAMESPACE)
    monkeypatch.setenv("DCGM_REPORT", str(tmp_path / "dcgm.json"))
    (tmp_path / "fi_info.txt").write_text(P5_FI_INFO)
    monkeypatch.setenv("FI_INFO_REPORT", str(tmp_path / "fi_info.txt"))
    monkeypatch.setenv("INFINIBAND_DIR", str(tmp_path / "infiniband"))
    monkeypatch.setattr(burn_in, "api", server)

    def no_boto3() -> Any:
        raise AssertionError("a passing node, or one past the bound, needs no AWS call")

    if boto3_install is not None:
        monkeypatch.setenv("BOTO3_INSTALL", boto3_install)
    else:
        monkeypatch.setattr(burn_in, "autoscaling_client", (lambda: autoscaling) if autoscaling else no_boto3)
    burn_in.main()


def terminating(instance: str, server: ApiServer | None = None, refusal: str | None = None) -> tuple[Any, Stubber]:
    """An Auto Scaling client that expects exactly the replacement's call (botocore's Stubber: no AWS here; moto
    does not model what the call is about, the group launching another instance), answering it or refusing it with
    `refusal`; the call is logged among the server's, to show their order."""
    client = boto3.client("autoscaling", region_name=REGION, aws_access_key_id="x", aws_secret_access_key="x")
    if server is not None:
        client.meta.events.register(
            "before-parameter-build.auto-scaling.TerminateInstanceInAutoScalingGroup",
            lambda params, **_: server.calls.append(("AWS", "TerminateInstanceInAutoScalingGroup", params)))
    stub = Stubber(client)
    expected_params = {"InstanceId": instance, "ShouldDecrementDesiredCapacity": False}
    if refusal:
        stub.add_client_error("terminate_instance_in_auto_scaling_group", "ValidationError", refusal,
                              expected_params=expected_params)
    else:
        stub.add_response("terminate_instance_in_auto_scaling_group", {"Activity": {
            "ActivityId": "5b1e0d2c-0000-4000-8000-000000000001", "AutoScalingGroupName": "eks-x-p5-spot-uuid",
            "Description": f"Terminating EC2 instance: {instance}", "Cause": "user request",
            "StartTime": "2026-01-01T00:00:00Z", "StatusCode": "InProgress"}}, expected_params)
    stub.activate()
    return client, stub


# AWS's words for an instance no group manages any more (one already terminating, say).
REFUSAL = f"Instance Id not found - No managed instance found for instance ID: {INSTANCE}"


def test_the_program_replaces_a_failed_node_then_marks_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A failed node: its replacement counted in the pool's record (under the record's resourceVersion), its instance
    terminated with the group's capacity kept, and only then the node marked (the mark ends the pod), with what the
    call did."""
    server = ApiServer(a_new_node(P5))
    client, stub = terminating(INSTANCE, server)
    run_burn_in(monkeypatch, tmp_path, server, report("p5-row-remap-pending.json"), client)
    stub.assert_no_pending_responses()
    node_path = f"/api/v1/nodes/{server.node['metadata']['name']}"
    record_path = f"/api/v1/namespaces/{kube_health.NAMESPACE}/configmaps/{node_health.REPLACEMENTS_CONFIG_MAP}"
    assert [(m, p) for m, p, _ in server.calls] == [
        ("GET", node_path), ("GET", record_path), ("PATCH", record_path),
        ("AWS", "TerminateInstanceInAutoScalingGroup"), ("GET", node_path), ("PATCH", node_path)]
    (record,) = json.loads(server.config_map["data"][P5.name])
    assert (record["instance"], record["node"], record["check"]) == (INSTANCE, server.node["metadata"]["name"], "dcgm")
    patch = server.calls[-1][2]
    assert patch is not None and patch["metadata"]["labels"] == {"gpucluster/burn-in": "failed"}
    assert {"key": node_health.FAILED_TAINT, "value": "dcgm", "effect": "NoSchedule"} in patch["spec"]["taints"]
    assert patch["metadata"]["annotations"][node_health.REPLACEMENT_ANNOTATION].startswith(
        f"replaced: instance {INSTANCE} terminated")

    # Run again (its Node patch refused, say, and the kubelet ran the container again): counted once, and AWS's
    # refusal of the second call (the instance already terminating) is what the annotation says.
    server.calls.clear()
    client, stub = terminating(INSTANCE, server, REFUSAL)
    run_burn_in(monkeypatch, tmp_path, server, report("p5-row-remap-pending.json"), client)
    stub.assert_no_pending_responses()
    assert [m for m, _, _ in server.calls] == ["GET", "GET", "AWS", "GET", "PATCH"]
    assert len(json.loads(server.config_map["data"][P5.name])) == 1
    note = replacement_note(server)
    assert note.startswith(f"terminating instance {INSTANCE} again failed") and REFUSAL in note
    assert "an earlier run counted it" in note


def test_a_refused_termination_is_what_the_node_says(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """AWS refuses the first call (a group's suspended process, say): the node is marked, not replaced, with AWS's
    words and what to do; the replacement stays counted (the call was made)."""
    server = ApiServer(a_new_node(P5))
    client, stub = terminating(INSTANCE, server, REFUSAL)
    run_burn_in(monkeypatch, tmp_path, server, report("p5-row-remap-pending.json"), client)
    stub.assert_no_pending_responses()
    assert [m for m, _, _ in server.calls] == ["GET", "GET", "PATCH", "AWS", "GET", "PATCH"]
    note = replacement_note(server)
    assert note.startswith(f"not replaced: terminating instance {INSTANCE} failed") and REFUSAL in note
    assert "terminate it through its Auto Scaling group" in note


def test_a_failed_boto3_install_is_what_the_node_says(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No boto3 (PyPI unreachable, say): the node is still marked, its annotation saying its instance was not
    replaced and what the install printed (the program's own install step runs, with a command that fails as pip
    does)."""
    server = ApiServer(a_new_node(P5))
    pip_error = "ERROR: No matching distribution found for boto3==1.44.8"
    run_burn_in(monkeypatch, tmp_path, server, report("p5-row-remap-pending.json"),
                boto3_install=f"echo '{pip_error}' >&2; exit 1")
    assert [m for m, _, _ in server.calls] == ["GET", "GET", "PATCH", "GET", "PATCH"]
    note = replacement_note(server)
    assert note.startswith(f"not replaced: terminating instance {INSTANCE} failed: boto3 could not be installed")
    assert pip_error in note


def test_a_pool_past_its_bound_keeps_its_failed_node(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The bound's worth of replacements within the window: the next failed node is marked and left (no AWS call),
    its annotation saying why; a passing node never reads the record."""
    env = kube_health.replacement_env(P5, REGION)
    bound, window = int(env["REPLACEMENTS"]), int(env["REPLACEMENT_WINDOW_SECONDS"])
    recent = [{"at": int(time.time()) - window // 2, "node": f"n{i}", "instance": f"i-{i:017x}", "check": "dcgm"}
              for i in range(bound)]
    server = ApiServer(a_new_node(P5), {P5.name: json.dumps(recent)})
    run_burn_in(monkeypatch, tmp_path, server, report("p5-row-remap-pending.json"))
    assert [m for m, _, _ in server.calls] == ["GET", "GET", "GET", "PATCH"]  # the record unchanged
    note = replacement_note(server)
    assert note.startswith("not replaced") and f"replaced {bound} nodes" in note

    passing = ApiServer(a_new_node(P5))
    run_burn_in(monkeypatch, tmp_path, passing, report("p5-pass.json"))
    assert [(m, p.split("/")[-2]) for m, p, _ in passing.calls] == [("GET", "nodes"), ("PATCH", "nodes")]


def test_the_bound_counts_replacements_within_its_window() -> None:
    env = kube_health.replacement_env(P5, REGION)
    bound = burn_in.Bound(int(env["REPLACEMENTS"]), int(env["REPLACEMENT_WINDOW_SECONDS"]))
    # The Slurm flavour's figures: one bound for both.
    assert (bound.replacements, bound.window_seconds) == (ClusterSettings.health_replacements,
                                                          ClusterSettings.health_replacement_window_seconds)
    node, verdict, now = a_new_node(P5), burn_in.Verdict("efa-count", ("x",)), 1_900_000_000.0
    taken = [{"at": int(now) - 60 * (i + 1), "node": "n", "instance": "i-1", "check": "dcgm"}
             for i in range(bound.replacements - 1)]
    last = burn_in.plan_replacement(taken, bound, now, P5.name, node, verdict)
    assert last.instance == INSTANCE and len(last.records) == bound.replacements
    assert f"{bound.replacements} of {bound.replacements}" in last.note
    # The next node's instance: past the bound.
    other = a_new_node(P5)
    other["spec"]["providerID"] = f"aws:///{REGION}b/i-0fedcba9876543210"
    refused = burn_in.plan_replacement(last.records, bound, now + 1, P5.name, other, verdict)
    assert refused.instance is None and refused.records == last.records
    # Once the oldest has left the window, one more.
    oldest = min(r["at"] for r in last.records)
    later = burn_in.plan_replacement(last.records, bound, oldest + bound.window_seconds, P5.name, other, verdict)
    assert later.instance == "i-0fedcba9876543210" and len(later.records) == bound.replacements
    assert all(oldest + bound.window_seconds - r["at"] < bound.window_seconds for r in later.records)


@pytest.mark.parametrize(("provider_id", "instance"), [
    (f"aws:///{REGION}a/{INSTANCE}", INSTANCE),
    ("aws:///us-west-2-lax-1a/i-0abc", "i-0abc"),  # a Local Zone
    ("", None), ("kind://docker/kind/kind-worker", None), (f"aws:///{REGION}a/{INSTANCE}/x", None)])
def test_the_instance_comes_from_the_provider_id(provider_id: str, instance: str | None) -> None:
    node = a_new_node(P5)
    node["spec"]["providerID"] = provider_id
    assert burn_in.instance_id(node) == instance
    planned_replacement = burn_in.plan_replacement([], burn_in.Bound(3, 86400), 0.0, P5.name, node,
                                                   burn_in.Verdict("dcgm", ("x",)))
    assert planned_replacement.instance == instance
    if instance is None:
        assert planned_replacement.note.startswith("not replaced: no EC2 instance") and not planned_replacement.records


def test_an_aws_refusal_is_reported_not_raised() -> None:
    client, _ = terminating(INSTANCE, refusal=REFUSAL)
    assert burn_in.terminate(client, INSTANCE) == burn_in.Termination(False, f"An error occurred (ValidationError) "
                                                                            f"when calling the TerminateInstanceIn"
                                                                            f"AutoScalingGroup operation: {REFUSAL}")
    client, _ = terminating(INSTANCE)
    assert burn_in.terminate(client, INSTANCE) == burn_in.Termination(True, f"Terminating EC2 instance: {INSTANCE}")


def test_boto3_is_importable_once_installed_after_start(tmp_path: Path) -> None:
    """The program starts without boto3 and installs it only to replace a node: the install's directory, made after
    the interpreter started, is importable then. The install here links this machine's boto3 closure into place (the
    real command needs PyPI: tests/test_kube_wheels.py checks it); the interpreter runs without site-packages."""
    target = tmp_path / "lib"
    site = Path(boto3.__file__).parents[1]
    links = " ".join(str(site / name) for name in ("boto3", "botocore", "s3transfer", "jmespath", "dateutil",
                                                    "urllib3", "six.py"))
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
            "from gpucluster.node import burn_in\n"
            "try:\n    import boto3\nexcept ImportError:\n    pass\nelse:\n    raise SystemExit('boto3 before')\n"
            "print(burn_in.autoscaling_client().meta.service_model.service_name)\n")
    env = {"BOTO3_INSTALL": f"mkdir -p {target} && ln -s {links} {target}/", "BOTO3_TARGET": str(target),
           "PATH": "/usr/bin:/bin", **kube.boto3_region(REGION)}
    done = subprocess.run([sys.executable, "-S", "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "autoscaling"


def test_the_burn_in_pod_has_every_file_its_program_imports(tmp_path: Path) -> None:
    """The ConfigMap, projected as the DaemonSet's volume puts it, runs with the standard library alone."""
    manifests = kube_health.burn_in_manifests(load_stack(TEAM_K8S))
    (config_map,) = [m for m in manifests if m["kind"] == "ConfigMap" and m["metadata"]["name"] == kube_health.BURN_IN]
    pod = kube_health.daemon_set(P5, REGION)["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v.get("configMap", {}).get("name") == config_map["metadata"]["name"]]
    assert {item["key"] for item in volume["configMap"]["items"]} == set(config_map["data"])
    for item in volume["configMap"]["items"]:
        (tmp_path / item["path"]).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / item["path"]).write_text(config_map["data"][item["key"]])
    (verdict_container,) = [c for c in pod["initContainers"] if c["name"] == "verdict"]
    (mount,) = [m["mountPath"] for m in verdict_container["volumeMounts"] if m["name"] == volume["name"]]
    program = verdict_container["command"][-1]
    code = standard_library.ONLY + "import runpy\nrunpy.run_path(sys.argv[1])\n"
    done = subprocess.run([sys.executable, "-I", "-c", code, str(tmp_path / program.removeprefix(f"{mount}/"))],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert config_map["data"]["gpucluster.node.burn_in.py"] == Path(burn_in.__file__).read_text()


# --- The DaemonSet ----------------------------------------------------------------------------------------------

def every_pool() -> list[tuple[Stack, PoolSpec]]:
    stacks = [load_stack(p) for p in K8S_STACK_FILES] + [trainium()]
    return [(stack, pool) for stack in stacks for pool in stack.spec.pools]


def containers(daemon_set: dict[str, Any]) -> list[dict[str, Any]]:
    spec = daemon_set["spec"]["template"]["spec"]
    return [*spec["initContainers"], *spec["containers"]]


@pytest.mark.parametrize(("stack", "pool"), every_pool(), ids=lambda x: getattr(x, "name", ""))
def test_the_burn_in_takes_no_device_from_the_jobs(stack: Stack, pool: PoolSpec) -> None:
    """No container asks a device plugin for anything (an init container's request is held for the pod's life); only
    CPU and memory, and the main container nothing at all."""
    daemon_set = kube_health.daemon_set(pool, stack.region)
    for container in containers(daemon_set):
        for kind in ("requests", "limits"):
            assert set(container.get("resources", {}).get(kind, {})) <= {"cpu", "memory"}, container["name"]
    # Nor through the pod: no pod-level resources, no dynamic resource claims.
    assert not {"resources", "resourceClaims"} & set(daemon_set["spec"]["template"]["spec"])
    (main,) = daemon_set["spec"]["template"]["spec"]["containers"]
    assert "resources" not in main


@pytest.mark.parametrize(("stack", "pool"), every_pool(), ids=lambda x: getattr(x, "name", ""))
def test_each_pool_is_checked_for_what_it_has(stack: Stack, pool: PoolSpec) -> None:
    daemon_set = kube_health.daemon_set(pool, stack.region)
    spec = daemon_set["spec"]["template"]["spec"]
    by_name = {c["name"]: c for c in spec["initContainers"]}
    verdict = by_name["verdict"]
    env = {e["name"]: e.get("value") for e in verdict["env"]}
    assert (int(env["EXPECTED_GPUS"]), int(env["EXPECTED_NEURON_DEVICES"]), int(env["EXPECTED_EFA_DEVICES"])) == (
        pool.accelerator.count if pool.accelerator.kind == "nvidia" else 0,
        pool.accelerator.count if pool.accelerator.kind == "neuron" else 0,
        pool.itype.efa_interfaces if pool.uses_efa else 0)
    mounts = {m["mountPath"]: m for m in verdict["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    efa_info = ["efa-info"] if pool.uses_efa else []
    if pool.accelerator.kind == "nvidia":  # DCGM first, writing the report the verdict reads, with every GPU
        assert list(by_name) == ["dcgm-diag", *efa_info, "verdict"]
        dcgm = by_name["dcgm-diag"]
        assert dcgm["image"].startswith("nvcr.io/nvidia/cloud-native/dcgm:")
        assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"} in dcgm["env"]
        assert f"dcgmi diag -r 1 -j > {env['DCGM_REPORT']}" in dcgm["command"][-1]
        (shared,) = [m for m in dcgm["volumeMounts"] if env["DCGM_REPORT"].startswith(m["mountPath"] + "/")]
        assert mounts[shared["mountPath"]]["name"] == shared["name"] and "emptyDir" in volumes[shared["name"]]
    else:
        assert list(by_name) == [*efa_info, "verdict"]
        assert volumes[mounts[env["DEV_DIR"]]["name"]]["hostPath"]["path"] == "/dev"
    if pool.uses_efa:  # the EFA installer's fi_info from AWS's DLC of the pool's kind, its listing where the verdict
        listing = by_name["efa-info"]  # reads
        dlc = kube.dlc_image(stack.region) if pool.accelerator.kind == "nvidia" else kube_health.NEURON_DLC_IMAGE
        assert listing["image"] == dlc
        assert f"/opt/amazon/efa/bin/fi_info -p efa -t FI_EP_RDM > {env['FI_INFO_REPORT']}" in listing["command"][-1]
        (shared,) = [m for m in listing["volumeMounts"] if env["FI_INFO_REPORT"].startswith(m["mountPath"] + "/")]
        assert mounts[shared["mountPath"]]["name"] == shared["name"] and "emptyDir" in volumes[shared["name"]]
        infiniband = mounts[env["INFINIBAND_DIR"]]
        assert infiniband["readOnly"] is True
        assert volumes[infiniband["name"]]["hostPath"]["path"] == "/sys/class/infiniband"
    else:
        assert env["INFINIBAND_DIR"] not in mounts
    assert all(m.get("readOnly") for m in verdict["volumeMounts"] if "hostPath" in volumes[m["name"]])
    assert verdict["securityContext"]["runAsNonRoot"] is True and "privileged" not in verdict["securityContext"]


def test_the_daemon_sets_run_only_on_undecided_nodes_of_their_pool(k8s: tuple[Stack, tuple[Declared, ...]]) -> None:
    """Each pool's DaemonSet tolerates every taint its node group starts with (the startup taint, the accelerator's,
    spot's) and selects the pool's nodes without a verdict: the verdict's label removes the pod from the node."""
    stack, declared = k8s
    groups = {g.inputs["nodeGroupName"].removeprefix(f"{stack.cluster_name}-"): g.inputs
              for g in of_type(declared, "eks/nodeGroup:NodeGroup")}
    daemon_sets = {d.inputs["metadata"]["name"]: d.inputs for d in of_type(declared, "apps/v1:DaemonSet")}
    assert set(daemon_sets) == {f"gpucluster-burn-in-{p.name}" for p in stack.spec.pools}
    for pool in stack.spec.pools:
        spec = daemon_sets[f"gpucluster-burn-in-{pool.name}"]["spec"]["template"]["spec"]
        tolerated = {(t["key"], t["effect"]) for t in spec["tolerations"] if t["operator"] == "Exists"}
        assert {(t["key"], t["effect"].replace("NO_SCHEDULE", "NoSchedule"))
                for t in groups[pool.name]["taints"]} <= tolerated
        (term,) = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
            "nodeSelectorTerms"]
        assert {"key": "gpucluster/pool", "operator": "In", "values": [pool.name]} in term["matchExpressions"]
        assert {"key": "gpucluster/burn-in", "operator": "DoesNotExist"} in term["matchExpressions"]
        assert groups[pool.name]["labels"]["gpucluster/pool"] == pool.name


def test_its_own_namespace_and_only_node_rights(k8s: tuple[Stack, tuple[Declared, ...]]) -> None:
    stack, declared = k8s
    (namespace,) = [n.inputs for n in of_type(declared, "core/v1:Namespace")
                    if n.inputs["metadata"]["name"] == kube_health.NAMESPACE]
    assert kube_health.NAMESPACE != kube.namespace_name(stack) and kube_health.NAMESPACE in RESERVED_NAMESPACES
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    (role,) = [r.inputs for r in of_type(declared, "rbac.authorization.k8s.io/v1:ClusterRole")
               if r.inputs["metadata"]["name"] == kube_health.BURN_IN]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]}]
    (binding,) = [b.inputs for b in of_type(declared, "rbac.authorization.k8s.io/v1:ClusterRoleBinding")
                  if b.inputs["metadata"]["name"] == kube_health.BURN_IN]
    assert binding["roleRef"]["name"] == kube_health.BURN_IN
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": kube_health.BURN_IN,
                                    "namespace": kube_health.NAMESPACE}]
    ns_urn = next(d.urn for d in of_type(declared, "core/v1:Namespace")
                  if d.inputs["metadata"]["name"] == kube_health.NAMESPACE)
    for d in declared:
        if d.type.startswith("kubernetes:") and d.inputs.get("metadata", {}).get("namespace") == kube_health.NAMESPACE:
            assert ns_urn in d.dependencies, d.name
            if d.type.endswith("apps/v1:DaemonSet"):
                assert d.inputs["spec"]["template"]["spec"]["serviceAccountName"] == kube_health.BURN_IN


def test_the_manifests_are_valid_for_every_accelerator_kind() -> None:
    """Strict validation of the Neuron variant too (the shipped stack has only NVIDIA pools; tests/test_kubernetes.py
    validates every object the shipped stacks declare and render)."""
    stack = trainium()
    for manifest in kube_health.burn_in_manifests(stack):
        kubernetes_validate.validate(manifest, stack.spec.eks.version, strict=True)
    broken = kube_health.daemon_set(pool_of(stack, "trn1"), stack.region)
    broken["spec"]["template"]["spec"]["initContainers"][0]["volumeMount"] = []
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, stack.spec.eks.version, strict=True)


def test_render_writes_the_burn_in(tmp_path: Path) -> None:
    from gpucluster.cli import main

    assert main(["render", str(TEAM_K8S), "--out", str(tmp_path)]) == 0
    text = (tmp_path / "kubernetes" / "burn-in.yaml").read_text()
    assert text.startswith("# Reference, not for kubectl apply")
    kinds = [d["kind"] for d in yaml.safe_load_all(text)]
    assert kinds[0] == "Namespace" and kinds.count("DaemonSet") == len(load_stack(TEAM_K8S).spec.pools)


# --- The node groups and the autoscaler -------------------------------------------------------------------------

def test_node_groups_start_tainted_but_the_template_says_nothing_of_it(
        k8s: tuple[Stack, tuple[Declared, ...]]) -> None:
    """Jobs wait for the burn-in; the autoscaler still counts the coming node as room for them: its node template
    (the ASG tags it reads at zero nodes) carries the pool's taints and not the startup taint."""
    stack, declared = k8s
    groups = {g.inputs["nodeGroupName"]: g.inputs for g in of_type(declared, "eks/nodeGroup:NodeGroup")}
    tags = [t.inputs["tag"]["key"] for t in of_type(declared, "autoscaling/tag:Tag")]
    assert tags and not any(node_health.STARTUP_TAINT in key for key in tags)
    for pool in stack.spec.pools:
        taints = groups[f"{stack.cluster_name}-{pool.name}"]["taints"]
        assert {"key": node_health.STARTUP_TAINT, "value": "true", "effect": "NO_SCHEDULE"} in taints
        assert not any(node_health.STARTUP_TAINT in key for key in autoscaler_node_template_tags(stack, pool))
    system = groups[f"{stack.cluster_name}-system"]["taints"]
    assert not any(t["key"] == node_health.STARTUP_TAINT for t in system)


def test_no_job_tolerates_the_startup_taint() -> None:
    stack = load_stack(TEAM_K8S)
    for flavour in kube.resource_flavors(stack):
        assert not any(t["key"] == node_health.STARTUP_TAINT for t in flavour["spec"]["tolerations"])
    *_, job = kube.example_job(stack, kube.example_pool(stack), (EXAMPLES_DIR / "ddp_train.py").read_text())
    tolerations = job["spec"]["template"]["spec"]["tolerations"]
    assert not any(t.get("key") == node_health.STARTUP_TAINT or "key" not in t for t in tolerations)


def test_the_taints_as_the_autoscaler_and_eks_read_them() -> None:
    """The startup taint has the autoscaler's startup prefix (a starting node, not a template taint) and fits EKS's
    Taint shape (its key's length limit, from botocore's model: node groups set it); the failed taint has none of the
    autoscaler's status prefix: left out of a template built from a failed node, and not counted as unready, so a
    failed node is a ready node no pod can use, which its scale-down removes as unneeded."""
    assert node_health.STARTUP_TAINT.startswith(AUTOSCALER_STARTUP_PREFIXES[1])
    assert node_health.FAILED_TAINT.startswith(AUTOSCALER_STATUS_PREFIX)
    limits = botocore.session.get_session().get_service_model("eks").shape_for("Taint").members["key"].metadata
    for key in (node_health.STARTUP_TAINT, node_health.FAILED_TAINT):
        assert limits["min"] <= len(key) <= limits["max"], key


def test_the_autoscaler_waits_for_a_burn_in_past_its_default_start_up_time() -> None:
    """A node under burn-in is not ready to the autoscaler (its startup taint); its default wait from registration to
    Ready (15 minutes) would count a slow DCGM pull and diagnostic as a node that failed to start."""
    stack = load_stack(TEAM_K8S)
    args = kube.autoscaler_values(stack, {p.name: p.name for p in stack.spec.pools} | {kube.CPU_FLAVOR: "cpu"},
                                  "sa")["extraArgs"]
    assert args["max-node-startup-time"].endswith("m") and int(args["max-node-startup-time"][:-1]) > 15


# --- The replacement's identity ---------------------------------------------------------------------------------

def test_the_burn_in_may_terminate_only_its_pools_instances(k8s: tuple[Stack, tuple[Declared, ...]]) -> None:
    """Its Pod Identity role: TerminateInstanceInAutoScalingGroup and nothing else, on the accelerator pools' groups
    (as EKS names them: eks-<node group>-<uuid>) that EKS tagged as this cluster's; not the CPU or system nodes' group,
    not another cluster's. Its DaemonSets start once the association exists; its Kubernetes rights on the record are
    that one ConfigMap's, which it is declared without data (the verdict's, left alone by `up`)."""
    from fnmatch import fnmatchcase

    stack, declared = k8s
    (assoc,) = [a for a in of_type(declared, "eks/podIdentityAssociation:PodIdentityAssociation")
                if a.inputs["serviceAccount"] == kube_health.BURN_IN]
    assert assoc.inputs["namespace"] == kube_health.NAMESPACE
    (role,) = [r for r in of_type(declared, "iam/role:Role") if r.urn in assoc.dependencies]
    assert json.loads(role.inputs["assumeRolePolicy"])["Statement"][0]["Principal"] == {
        "Service": "pods.eks.amazonaws.com"}
    (document,) = [p.inputs["policy"] for p in of_type(declared, "iam/rolePolicy:RolePolicy")
                   if role.urn in p.dependencies]
    (statement,) = json.loads(document)["Statement"]
    assert statement["Action"] == "autoscaling:TerminateInstanceInAutoScalingGroup"
    assert statement["Condition"] == {"StringEquals": {
        f"aws:ResourceTag/k8s.io/cluster-autoscaler/{stack.cluster_name}": "owned"}}
    arn = f"arn:aws:autoscaling:{stack.region}:123456789012:autoScalingGroup:0a1b2c3d-uuid:autoScalingGroupName/"

    def allowed(group: str) -> bool:
        return any(fnmatchcase(arn + group, resource) for resource in statement["Resource"])

    groups = {g.inputs["nodeGroupName"] for g in of_type(declared, "eks/nodeGroup:NodeGroup")}
    pools = {f"{stack.cluster_name}-{p.name}" for p in stack.spec.pools}
    assert pools < groups
    for group in groups:
        assert allowed(f"eks-{group}-7c3a1b2e-uuid") == (group in pools), group
    assert not allowed(f"eks-gpucluster-other-{stack.spec.pools[0].name}-uuid")

    for daemon_set in of_type(declared, "apps/v1:DaemonSet"):
        if daemon_set.inputs["metadata"]["namespace"] == kube_health.NAMESPACE:
            assert assoc.urn in daemon_set.dependencies, daemon_set.name
    (record,) = [c.inputs for c in of_type(declared, "core/v1:ConfigMap")
                 if c.inputs["metadata"]["name"] == node_health.REPLACEMENTS_CONFIG_MAP]
    assert record["metadata"]["namespace"] == kube_health.NAMESPACE and "data" not in record
    (rights,) = [r.inputs for r in of_type(declared, "rbac.authorization.k8s.io/v1:Role")
                 if r.inputs["metadata"]["name"] == kube_health.BURN_IN]
    assert rights["metadata"]["namespace"] == kube_health.NAMESPACE
    assert rights["rules"] == [{"apiGroups": [""], "resources": ["configmaps"],
                                "resourceNames": [node_health.REPLACEMENTS_CONFIG_MAP], "verbs": ["get", "patch"]}]
