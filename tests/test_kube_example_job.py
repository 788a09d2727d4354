"""The Kubernetes flavour's first job (gpucluster/render/kube.py example_job): valid for every Kubernetes stack and
pool, a pod failure policy that retries interruptions and fails on bugs, EFA devices and EFA's huge pages on EFA pools
only, AWS's PyTorch DLC (NCCL's EFA plugin) from the stack's region, and torchrun's elastic rendezvous (run for real by
tests/integration/test_kube_job_restart.py). That ddp_train.py resumes exactly where it stopped is
tests/integration/test_ddp_checkpoints.py's.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import K8S_STACK_FILES, ROOT, of_type, planned
from gpucluster.project import EXAMPLES_DIR
from gpucluster.render import kube
from gpucluster.spec.model import PoolSpec, Stack, load_stack, validate
from test_kubernetes import check

TEAM_K8S = ROOT / "stacks" / "Pulumi.team-k8s.yaml"
SCRIPT = (EXAMPLES_DIR / "ddp_train.py").read_text()


def nvidia_pools(stack: Stack) -> list[PoolSpec]:
    return [p for p in stack.spec.pools if p.accelerator.kind == "nvidia"]


def job_of(stack: Stack, pool: PoolSpec) -> dict[str, Any]:
    *_, job = kube.example_job(stack, pool, SCRIPT)
    return job


def trainer(job: dict[str, Any]) -> dict[str, Any]:
    (container,) = job["spec"]["template"]["spec"]["containers"]
    return container


def with_changes(path: Path, region: str | None = None, **pool_changes: dict[str, Any]) -> Stack:
    """A shipped stack with some pools' keys changed (and another region)."""
    doc = yaml.safe_load(path.read_text())["config"]
    if region:
        doc["aws:region"] = region
        doc["gpucluster:cluster"]["availability_zone"] = f"{region}a"
    for pool in doc["gpucluster:cluster"]["pools"]:
        pool.update(copy.deepcopy(pool_changes.get(pool["name"], {})))
    return validate("k8s-example", doc)


@pytest.mark.parametrize("path", K8S_STACK_FILES, ids=lambda p: p.name)
def test_the_job_is_valid_on_every_pool(path: Path) -> None:
    stack = load_stack(path)
    for pool in nvidia_pools(stack):
        for obj in kube.example_job(stack, pool, SCRIPT):
            check(obj, stack.spec.eks.version)


# --- Interruptions are retried, bugs fail the Job ----------------------------------------------------------------

def failure_action(policy: dict[str, Any], pod: dict[str, Any]) -> str:
    """What the Job controller does with a failed pod under `policy`, as Kubernetes decides it
    (pkg/controller/job/pod_failure_policy.go, matchPodFailurePolicy): the first rule that matches wins; an
    onExitCodes rule looks at the named container's non-zero exit code, an onPodConditions rule at a condition with
    that type and status; no rule matching counts the failure against backoffLimit."""
    for rule in policy["rules"]:
        codes = rule.get("onExitCodes")
        if codes is not None:
            for status in pod["status"]["containerStatuses"]:
                code = status["state"]["terminated"]["exitCode"]
                if code == 0 or codes.get("containerName", status["name"]) != status["name"]:
                    continue
                if (code in codes["values"]) == (codes["operator"] == "In"):
                    return str(rule["action"])
        for pattern in rule.get("onPodConditions", []):
            if any(c["type"] == pattern["type"] and c["status"] == pattern["status"]
                   for c in pod["status"].get("conditions", [])):
                return str(rule["action"])
    return "Count"


def failed_pod(exit_code: int, *conditions: str) -> dict[str, Any]:
    return {"status": {"phase": "Failed",
                       "conditions": [{"type": c, "status": "True"} for c in conditions],
                       "containerStatuses": [{"name": kube.TRAINER,
                                              "state": {"terminated": {"exitCode": exit_code}}}]}}


def test_an_interruption_is_retried_and_a_bug_fails_the_job() -> None:
    stack = load_stack(TEAM_K8S)
    spec = job_of(stack, kube.example_pool(stack))["spec"]
    policy = spec["podFailurePolicy"]
    # Drained or evicted for a spot interruption (SIGKILLed after the grace period): not counted, replaced.
    assert failure_action(policy, failed_pod(137, "DisruptionTarget")) == "Ignore"
    assert failure_action(policy, failed_pod(1, "DisruptionTarget")) == "Ignore"
    # torchrun gave up (its restarts spent, or no rendezvous in time): a real failure, counted and retried.
    assert failure_action(policy, failed_pod(1)) == "Count"
    assert failure_action(policy, failed_pod(137)) == "Count"  # OOM-killed
    # No torchrun in the image, or bad arguments: no retry mends it.
    for code in (2, 126, 127):
        assert failure_action(policy, failed_pod(code)) == "FailJob"
    assert spec["backoffLimit"] > 0
    # Kubernetes requires restartPolicy Never with a pod failure policy; a replacement waits for its predecessor to be
    # gone, so one index never has two pods (one hostname, one rendezvous host).
    assert spec["template"]["spec"]["restartPolicy"] == "Never" and spec["podReplacementPolicy"] == "Failed"


# --- EFA ---------------------------------------------------------------------------------------------------------

def test_efa_and_huge_pages_on_efa_pools_only() -> None:
    stack = with_changes(TEAM_K8S, g6e={"efa": False})
    efa = {p.name: p.uses_efa for p in nvidia_pools(stack)}
    assert True in efa.values() and False in efa.values()
    for pool in nvidia_pools(stack):
        resources = trainer(job_of(stack, pool))["resources"]
        assert resources["limits"] == resources["requests"]
        requests = resources["requests"]
        if pool.uses_efa:
            assert requests["vpc.amazonaws.com/efa"] == str(pool.itype.efa_interfaces), pool.name
            assert requests["hugepages-2Mi"] == kube.EFA_POD_HUGEPAGES == "5120Mi"  # EKS's EFA guide
        else:
            assert "vpc.amazonaws.com/efa" not in requests and "hugepages-2Mi" not in requests, pool.name
        # Kubernetes takes huge pages only beside a CPU or memory request.
        assert {"cpu", "memory"} <= set(requests)


def test_the_image_is_the_regions_pytorch_dlc_with_nccls_efa_plugin() -> None:
    stack = with_changes(TEAM_K8S, region="eu-west-1", g6e={"efa": False})
    for pool in nvidia_pools(stack):
        container = trainer(job_of(stack, pool))
        registry, _, image = container["image"].partition("/")
        assert registry == f"{kube.DLC_ACCOUNT}.dkr.ecr.eu-west-1.amazonaws.com"
        assert image == kube.DLC_IMAGE and image.startswith("pytorch:") and image.endswith("-amzn2023")
        env = {e["name"]: e.get("value") for e in container["env"]}
        if pool.uses_efa:
            # libfabric's EFA provider, aws-ofi-nccl by name (libnccl-net-ofi.so), and NCCL's INFO log that names
            # the provider it selected.
            assert (env["FI_PROVIDER"], env["NCCL_NET_PLUGIN"], env["NCCL_DEBUG"]) == ("efa", "ofi", "INFO")
        else:
            assert "FI_PROVIDER" not in env and "NCCL_NET_PLUGIN" not in env
        # Left to libfabric, which uses the device's RDMA where the type has it (1 would abort where it has not).
        assert "FI_EFA_USE_DEVICE_RDMA" not in env


def test_the_node_role_may_pull_the_dlc() -> None:
    stack, declared = planned(TEAM_K8S)
    attached = {d.inputs["policyArn"] for d in of_type(declared, "iam/rolePolicyAttachment:RolePolicyAttachment")
                if d.name.startswith(f"{stack.cluster_name}-node-")}
    assert "arn:aws:iam::aws:policy/AmazonEC2ContainerRegistryPullOnly" in attached


# --- torchrun's elastic rendezvous -------------------------------------------------------------------------------

def torchrun_args(job: dict[str, Any]) -> dict[str, str]:
    (line,) = [w for w in trainer(job)["command"][-1].splitlines() if "torchrun " in w]
    return dict(re.findall(r"--([a-z-]+)=(\S+)", line))


def test_torchrun_restarts_and_rendezvous_at_index_0s_service_name() -> None:
    stack = load_stack(TEAM_K8S)
    config_map, service, job = kube.example_job(stack, kube.example_pool(stack), SCRIPT)
    args = torchrun_args(job)
    assert int(args["max-restarts"]) > 0 and args["rdzv-backend"] == "c10d"
    # Index 0's pod name under the Service's subdomain: the DNS name moves to index 0's replacement.
    host, port = args["rdzv-endpoint"].split(":")
    assert host == f"{job['metadata']['name']}-0.{job['spec']['template']['spec']['subdomain']}"
    assert service["metadata"]["name"] == job["spec"]["template"]["spec"]["subdomain"]
    assert [p["port"] for p in service["spec"]["ports"]] == [int(port)]
    # A lost peer is waited for as long as the autoscaler may take to bring a node up, and more (the image pull).
    join_timeout = re.search(r"join_timeout=(\d+)", args["rdzv-conf"])
    assert join_timeout
    autoscaler = kube.autoscaler_values(stack, {p.name: p.name for p in stack.spec.pools} | {kube.CPU_FLAVOR: "cpu"},
                                       "sa")
    provision = autoscaler["extraArgs"]["max-node-provision-time"]
    assert provision.endswith("m")
    assert int(provision[:-1]) > 0
    # ... the node's start (its burn-in) and the image pull included: no giving up on a node still burning in.
    waited = int(provision[:-1]) + int(autoscaler["extraArgs"]["max-node-startup-time"][:-1]) + kube.IMAGE_PULL_MINUTES
    assert int(join_timeout.group(1)) >= waited * 60
    assert "--nnodes=2" in trainer(job)["command"][-1] and "--node-rank" not in trainer(job)["command"][-1]
