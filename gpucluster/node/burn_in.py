"""The Kubernetes flavour's burn-in verdict on a new accelerator node, run in the burn-in DaemonSet's pod
(gpucluster/render/kube_health.py ships it in a ConfigMap with the contract module it imports).

Before it, on NVIDIA nodes, an init container of NVIDIA's DCGM image ran `dcgmi diag -r 1 -j` and left its output in
a file. This program reads that report, counts the node's devices (the GPUs DCGM found, /dev/neuron*, the RDMA devices
the EFA driver registers under /sys/class/infiniband), compares them with what the pool's instance type has (the
catalog's counts, in the environment), and marks the Node: on a pass it lifts the startup taint and labels the node
passed; on a failure it puts the failed taint in the startup taint's place, labels the node failed and says why in an
annotation. The DaemonSet runs only on nodes without the label, so its pod leaves the node once this marks it, and a
decided node (which may run jobs) is never tested again.

Fail closed: a node whose diagnostic gives no report (DCGM cannot reach the GPUs, its image did not run) fails. The
burn-in exists so that no job lands on a node nobody has checked; the autoscaler removes the failed node, so the price
is one replaced instance. Standard library only; it talks to the API server with its service account's token.
"""

from __future__ import annotations

import json
import os
import ssl
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the library this program is part of (the ConfigMap's)
from gpucluster.contract import node_health
from gpucluster.node.devices import count_neuron_devices, dcgm_problems

SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"


@dataclass(frozen=True)
class Expected:
    """What one node of the pool has (the catalog's counts); 0 where the pool has none."""

    gpus: int
    neuron_devices: int
    efa_devices: int


@dataclass(frozen=True)
class Found:
    """What the node showed: the DCGM report's text (None where no diagnostic ran: Neuron nodes) and device counts."""

    dcgm_report: str | None
    neuron_devices: int
    efa_devices: int


@dataclass(frozen=True)
class Verdict:
    check: str  # "" on a pass; else the first failed check (the failed taint's value)
    problems: tuple[str, ...]

    @property
    def passed(self) -> bool:
        return not self.problems


def decide(expected: Expected, found: Found) -> Verdict:
    """Every check that failed, the first one naming the taint's value."""
    failed: list[tuple[str, str]] = []
    if expected.gpus:
        problems, gpus = dcgm_problems(found.dcgm_report or "")
        failed += [("dcgm", p) for p in problems]
        if gpus is not None and gpus < expected.gpus:
            failed.append(("gpu-count", f"DCGM found {gpus} GPUs, the instance type has {expected.gpus}"))
    if found.neuron_devices < expected.neuron_devices:
        failed.append(("neuron-count", f"{found.neuron_devices} Neuron devices under /dev, the instance type has "
                                       f"{expected.neuron_devices}"))
    if found.efa_devices < expected.efa_devices:
        failed.append(("efa-count", f"{found.efa_devices} EFA devices under /sys/class/infiniband, the instance type "
                                    f"has {expected.efa_devices}"))
    return Verdict(failed[0][0] if failed else "", tuple(p for _, p in failed))


def count_efa_devices(infiniband_dir: Path) -> int:
    """The EFA driver registers one RDMA device per EFA interface; an instance has no other kind."""
    return sum(1 for _ in infiniband_dir.iterdir()) if infiniband_dir.is_dir() else 0


def node_patch(node: dict[str, Any], verdict: Verdict) -> dict[str, Any]:
    """A JSON merge patch of the Node: the taint list (a merge patch replaces lists whole, so the node's own taints
    are carried over, less ours), the result label and the reason. The node's resourceVersion makes the API server
    refuse the patch (409) if the taints changed since they were read."""
    ours = {node_health.STARTUP_TAINT, node_health.FAILED_TAINT}
    taints = [t for t in node.get("spec", {}).get("taints", []) if t["key"] not in ours]
    if not verdict.passed:
        taints.append({"key": node_health.FAILED_TAINT, "value": verdict.check, "effect": "NoSchedule"})
    reason = "; ".join(verdict.problems)[:1000] if verdict.problems else None
    return {"metadata": {"resourceVersion": node["metadata"]["resourceVersion"],
                         "labels": {node_health.RESULT_LABEL: node_health.PASSED if verdict.passed
                                    else node_health.FAILED},
                         "annotations": {node_health.REASON_ANNOTATION: reason}},
            "spec": {"taints": taints}}


def api(method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    with open(f"{SERVICE_ACCOUNT}/token") as f:
        token = f.read()
    request = urllib.request.Request(
        f"https://{os.environ['KUBERNETES_SERVICE_HOST']}{path}", method=method,
        data=json.dumps(body).encode() if body is not None else None,
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/merge-patch+json"})
    context = ssl.create_default_context(cafile=f"{SERVICE_ACCOUNT}/ca.crt")
    with urllib.request.urlopen(request, context=context, timeout=30) as response:
        result: dict[str, Any] = json.loads(response.read())
        return result


def main() -> None:
    """Exit 0 once the node is marked (pass or fail); an API error exits non-zero, and the kubelet runs the init
    container again."""
    path = f"/api/v1/nodes/{os.environ['NODE_NAME']}"
    node = api("GET", path)
    expected = Expected(int(os.environ["EXPECTED_GPUS"]), int(os.environ["EXPECTED_NEURON_DEVICES"]),
                        int(os.environ["EXPECTED_EFA_DEVICES"]))
    report = Path(os.environ["DCGM_REPORT"])
    found = Found(report.read_text() if report.is_file() else None,
                  count_neuron_devices(Path(os.environ["DEV_DIR"])),
                  count_efa_devices(Path(os.environ["INFINIBAND_DIR"])))
    verdict = decide(expected, found)
    api("PATCH", path, node_patch(node, verdict))
    print(json.dumps({"passed": verdict.passed, "check": verdict.check, "problems": verdict.problems}), flush=True)


if __name__ == "__main__":
    main()
