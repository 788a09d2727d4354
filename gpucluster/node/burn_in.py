"""The Kubernetes flavour's burn-in verdict on a new accelerator node, run in the burn-in DaemonSet's pod
(gpucluster/render/kube_health.py ships it in a ConfigMap with the contract module it imports).

Before it, on NVIDIA nodes, an init container of NVIDIA's DCGM image ran `dcgmi diag -r 1 -j` and left its output in
a file; on EFA pools an init container of the first job's image (AWS's Deep Learning Container, with the EFA
installer's libfabric) listed what libfabric's EFA provider can open (`fi_info -p efa -t FI_EP_RDM`). This program
reads those, counts the node's devices (the GPUs DCGM found, /dev/neuron*, the RDMA devices the EFA driver registers
under /sys/class/infiniband, the RDM domains the EFA provider opened), compares them with what the pool's instance
type has (the catalog's counts, in the environment), and marks the Node: on a pass it lifts the startup taint and
labels the node passed; on a failure it puts the failed taint in the startup taint's place, labels the node failed
and says why in an annotation. The DaemonSet runs only on nodes without the label, so its pod leaves the node once
this marks it, and a decided node (which may run jobs) is never tested again.

Fail closed: a node whose diagnostic gives no report (DCGM cannot reach the GPUs, its image did not run) fails. The
burn-in exists so that no job lands on a node nobody has checked; the price is one replaced instance.

A failed node's instance is then terminated through its Auto Scaling group without lowering the group's desired
capacity, so the group launches a replacement at once: always, not only when the group is at its minimum (where the
autoscaler would keep the failed node for good, and node auto repair does not read our taint). Above the minimum the
autoscaler would remove the node only after its unneeded time and then start another for the pods still pending; one
rule, with no read of the group's size to race the autoscaler's, replaces it sooner, and a replacement nothing needs
is removed by the autoscaler as unneeded, as the failed node would have been. Bounded: at most
node_health.REPLACEMENTS per pool within the window, counted in a ConfigMap (the Slurm flavour's reconciler bounds its
health replacements alike); past the bound the node stays tainted and its annotation says why.

The order: the replacement is counted, the instance terminated, and only then the Node marked with what the call did.
Marking it first would end this program: the DaemonSet runs only on unmarked nodes, so its controller deletes the pod
at the mark and the kubelet kills it (PID 1 ignores SIGTERM) before the AWS call. Meanwhile the startup taint keeps
jobs off the node; the instance's shutdown takes longer than the mark that follows the call.

Standard library only, but for that one AWS call: boto3 is installed for it when it is made (the DaemonSet hands over
the hash-checked install command), so that a passing burn-in needs nothing from PyPI. It talks to the API server with
its service account's token.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the library this program is part of (the ConfigMap's)
from gpucluster.contract import node_health
from gpucluster.node.devices import count_neuron_devices, dcgm_problems, efa_rdm_domains
from gpucluster.node.kube_api import KubeApi


@dataclass(frozen=True)
class Expected:
    """What one node of the pool has (the catalog's counts); 0 where the pool has none."""

    gpus: int
    neuron_devices: int
    efa_devices: int


@dataclass(frozen=True)
class Found:
    """What the node showed: the DCGM report's text (None where no diagnostic ran: Neuron nodes), device counts, and
    fi_info's listing (None where it did not run: pools without EFA)."""

    dcgm_report: str | None
    neuron_devices: int
    efa_devices: int
    fi_info: str | None = None


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
    if expected.efa_devices:
        # A device the driver lists may still be one libfabric cannot open (and NCCL then falls back to TCP).
        domains = len(efa_rdm_domains(found.fi_info or ""))
        if domains < expected.efa_devices:
            said = (found.fi_info or "no output").strip().splitlines()[-1:] if not domains else []
            failed.append(("efa-provider", f"libfabric's EFA provider opened {domains} RDM domains, the instance type "
                                           f"has {expected.efa_devices} EFA devices" + "".join(f": {s}" for s in said)))
    return Verdict(failed[0][0] if failed else "", tuple(p for _, p in failed))


def count_efa_devices(infiniband_dir: Path) -> int:
    """The EFA driver registers one RDMA device per EFA interface; an instance has no other kind."""
    return sum(1 for _ in infiniband_dir.iterdir()) if infiniband_dir.is_dir() else 0


def node_patch(node: dict[str, Any], verdict: Verdict, replacement: str | None = None) -> dict[str, Any]:
    """A JSON merge patch of the Node: the taint list (a merge patch replaces lists whole, so the node's own taints
    are carried over, less ours), the result label, the reason and what becomes of a failed node's instance. The
    node's resourceVersion makes the API server refuse the patch (409) if the taints changed since they were read."""
    ours = {node_health.STARTUP_TAINT, node_health.FAILED_TAINT}
    taints = [t for t in node.get("spec", {}).get("taints", []) if t["key"] not in ours]
    if not verdict.passed:
        taints.append({"key": node_health.FAILED_TAINT, "value": verdict.check, "effect": "NoSchedule"})
    reason = "; ".join(verdict.problems)[:1000] if verdict.problems else None
    return {"metadata": {"resourceVersion": node["metadata"]["resourceVersion"],
                         "labels": {node_health.RESULT_LABEL: node_health.PASSED if verdict.passed
                                    else node_health.FAILED},
                         "annotations": {node_health.REASON_ANNOTATION: reason,
                                         node_health.REPLACEMENT_ANNOTATION: replacement}},
            "spec": {"taints": taints}}


# A Node's spec.providerID on EC2, as the AWS cloud provider sets it: aws:///<availability zone>/<instance id>.
PROVIDER_ID = re.compile(r"aws:///[a-z0-9-]+/(i-[0-9a-f]+)")


def instance_id(node: dict[str, Any]) -> str | None:
    match = PROVIDER_ID.fullmatch(node.get("spec", {}).get("providerID", ""))
    return match.group(1) if match else None


@dataclass(frozen=True)
class Bound:
    """At most `replacements` instances of one pool terminated for a failed burn-in within `window_seconds`."""

    replacements: int
    window_seconds: int


@dataclass(frozen=True)
class Replacement:
    instance: str | None  # the instance to terminate; None: none (the note says why)
    note: str  # with no instance, the Node's replacement annotation; else which of the pool's replacements this is
    records: list[dict[str, Any]]  # the pool's record, as it is to be stored (this replacement counted)
    again: bool = False  # counted by an earlier run, which may have terminated the instance already


def plan_replacement(records: list[dict[str, Any]], bound: Bound, now: float, pool: str, node: dict[str, Any],
                     verdict: Verdict) -> Replacement:
    """Whether a failed node's instance is to be replaced, from the pool's record of its replacements (older ones
    than the window forgotten); a replacement is counted before it is made, so that two failures cannot both take
    the last one."""
    recent = [r for r in records if now - r["at"] < bound.window_seconds]
    instance = instance_id(node)
    if instance is None:
        return Replacement(None, f"not replaced: no EC2 instance in its providerID "
                                 f"{node.get('spec', {}).get('providerID')!r}", recent)
    if any(r["instance"] == instance for r in recent):  # counted by a run that stopped before the node's mark
        return Replacement(instance, "counted before", recent, again=True)
    if len(recent) >= bound.replacements:
        return Replacement(None, f"not replaced: pool {pool} replaced {len(recent)} nodes for a failed burn-in within "
                                 f"{bound.window_seconds / 3600:g} h (the bound); find the cause (the image, the "
                                 f"driver, the capacity), then terminate its instance through its group", recent)
    record = {"at": int(now), "node": node["metadata"]["name"], "instance": instance, "check": verdict.check}
    return Replacement(instance, f"{len(recent) + 1} of {bound.replacements} in {pool} within "
                                 f"{bound.window_seconds / 3600:g} h", [*recent, record])


def replacements_patch(config_map: dict[str, Any], pool: str, records: list[dict[str, Any]]) -> dict[str, Any]:
    """The pool's record in the ConfigMap, under its resourceVersion: two burn-ins that read the same count cannot
    both write (the second gets 409 and its container runs again)."""
    return {"metadata": {"resourceVersion": config_map["metadata"]["resourceVersion"]},
            "data": {pool: json.dumps(records)}}


@dataclass(frozen=True)
class Termination:
    done: bool
    detail: str  # the Auto Scaling activity's description, or why there is none


def terminate(autoscaling: Any, instance: str) -> Termination:
    """Terminate the instance through its Auto Scaling group, the group's desired capacity kept: the group launches a
    replacement. An AWS refusal is reported, not raised: the node is marked either way."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        activity = autoscaling.terminate_instance_in_auto_scaling_group(
            InstanceId=instance, ShouldDecrementDesiredCapacity=False)["Activity"]
    except (BotoCoreError, ClientError) as error:
        return Termination(False, str(error))
    return Termination(True, activity["Description"])


def replacement_note(replacement: Replacement, termination: Termination | None) -> str:
    """The Node's replacement annotation: what the AWS call did, not what it was meant to do."""
    if replacement.instance is None or termination is None:
        return replacement.note
    if termination.done:
        return f"replaced: instance {replacement.instance} terminated for a new one ({replacement.note})"
    if replacement.again:  # AWS refuses an instance already terminating: the earlier call may well have been made
        return (f"terminating instance {replacement.instance} again failed: {termination.detail}; an earlier run "
                f"counted it and may have terminated it (if it still runs, terminate it through its Auto Scaling "
                f"group)")[:1000]
    return (f"not replaced: terminating instance {replacement.instance} failed: {termination.detail} "
            f"({replacement.note}); terminate it through its Auto Scaling group")[:1000]


def autoscaling_client() -> Any:
    """boto3's Auto Scaling client (credentials from the pod's Pod Identity association), boto3 installed first by the
    command in BOTO3_INSTALL (gpucluster/render/kube.py boto3_install) into BOTO3_TARGET."""
    subprocess.run(["sh", "-c", os.environ["BOTO3_INSTALL"]], check=True, capture_output=True, text=True, timeout=300)
    sys.path.insert(0, os.environ["BOTO3_TARGET"])
    importlib.invalidate_caches()  # the directory did not exist when the interpreter started
    import boto3

    return boto3.client("autoscaling")


def api(method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    """The API server, as the pod's service account (the tests' seam: no API server runs here)."""
    return KubeApi.in_cluster().call(method, path, body)


def replace_failed(node_path: str, verdict: Verdict) -> tuple[Replacement, Termination | None]:
    """The failed node's replacement: counted in the pool's record, then its instance terminated (boto3 installed
    first); no call where none is to be made."""
    node = api("GET", node_path)
    pool = os.environ["POOL"]
    records_path = (f"/api/v1/namespaces/{os.environ['POD_NAMESPACE']}/configmaps/"
                    f"{node_health.REPLACEMENTS_CONFIG_MAP}")
    config_map = api("GET", records_path)
    stored = json.loads((config_map.get("data") or {}).get(pool, "[]"))
    replacement = plan_replacement(stored, Bound(int(os.environ["REPLACEMENTS"]),
                                                 int(os.environ["REPLACEMENT_WINDOW_SECONDS"])),
                                   time.time(), pool, node, verdict)
    if replacement.instance is None:
        return replacement, None
    if replacement.records != stored:
        api("PATCH", records_path, replacements_patch(config_map, pool, replacement.records))
    try:
        autoscaling = autoscaling_client()
    except subprocess.SubprocessError as error:
        return replacement, Termination(False, f"boto3 could not be installed: {error} "
                                               f"{getattr(error, 'stderr', '')}")
    return replacement, terminate(autoscaling, replacement.instance)


def main() -> None:
    """Exit 0 once the node is marked (pass or fail); an API error exits non-zero, and the kubelet runs the init
    container again. A failed node is marked last, with what its replacement came to (see the module's docstring)."""
    path = f"/api/v1/nodes/{os.environ['NODE_NAME']}"
    expected = Expected(int(os.environ["EXPECTED_GPUS"]), int(os.environ["EXPECTED_NEURON_DEVICES"]),
                        int(os.environ["EXPECTED_EFA_DEVICES"]))
    report, listing = Path(os.environ["DCGM_REPORT"]), Path(os.environ["FI_INFO_REPORT"])
    found = Found(report.read_text() if report.is_file() else None,
                  count_neuron_devices(Path(os.environ["DEV_DIR"])),
                  count_efa_devices(Path(os.environ["INFINIBAND_DIR"])),
                  listing.read_text() if listing.is_file() else None)
    verdict = decide(expected, found)
    note = replacement_note(*replace_failed(path, verdict)) if not verdict.passed else None
    # Read just before the patch: the taints as they are after the minutes a replacement can take.
    api("PATCH", path, node_patch(api("GET", path), verdict, note))
    print(json.dumps({"passed": verdict.passed, "check": verdict.check, "problems": verdict.problems,
                      "replacement": note}), flush=True)


if __name__ == "__main__":
    main()
