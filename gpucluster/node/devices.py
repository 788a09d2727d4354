"""Readings of a node's devices and mounts that several node programs share: the health check (health.py), the
Kubernetes burn-in (burn_in.py, shipped with this module in its ConfigMap) and `gpucluster verify`'s probe
(verify_probe.py). Standard library only, and nothing else imported: the burn-in's pod has only these files.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

TOOL_SECONDS = 10  # one tool call; the Prolog makes at most three
# `dcgmi diag -r 1` takes about a minute; contract/verify.py DCGM_SECONDS is the same (a test holds them equal)
DCGM_SECONDS = 300
# Where the images put the tools: slurmd runs its HealthCheckProgram and Prolog with a bare PATH (/bin, /usr/bin...).
TOOL_DIRS = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin", "/opt/amazon/efa/bin",
             "/opt/aws/neuron/bin")


# `fi_info -p efa -t FI_EP_RDM`'s listing: an entry per fabric and domain the EFA provider opened, each line of it
# "provider: ", "    fabric: ", "    domain: ", "    version: ", "    type: ", "    protocol: " (libfabric util/info.c
# print_short_info). A device's RDM domain is its name and "-rdm" (prov/efa/src/efa_domain.h efa_domain_name_suffix),
# listed once per fabric (libfabric 2: "efa" and "efa-direct", prov/efa/src/efa.h). When the provider opens nothing,
# the listing is empty and standard error says "fi_getinfo: -61 (No data available)" (util/info.c run()).
def efa_rdm_domains(listing: str) -> set[str]:
    """The EFA devices whose RDM endpoint libfabric's EFA provider can open, by domain."""
    return set(re.findall(r"^\s*domain:\s*(\S+-rdm)$", listing, re.MULTILINE))


def tool(*args: str, seconds: float | None = None, check: bool = True) -> tuple[str | None, str]:
    """(stdout, "") or (None, why): a missing, failing or hung tool is a finding, never a hang. A hung one is killed
    with everything it started (its own session), which might otherwise hold its output open. Without `check`, a
    tool that exits non-zero with output (a report of what failed) gives that output."""
    limit = seconds or TOOL_SECONDS
    if not shutil.which(args[0]):
        return None, f"{args[0]} not found"
    proc = subprocess.Popen(list(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return None, f"{args[0]} did not answer in {limit:g} s"
    if proc.returncode and (check or not out.strip()):
        return None, f"{args[0]} exited {proc.returncode}: {(err or out).strip()[-200:]}"
    return out, ""


def gpu_rows(nvidia_smi: str = "nvidia-smi") -> tuple[list[list[str]] | None, str]:
    """The GPUs the driver sees, one [index, uncorrected ECC errors since the driver loaded] each (the count is
    "[N/A]" on a GPU without ECC), or (None, why)."""
    out, why = tool(nvidia_smi, "--query-gpu=index,ecc.errors.uncorrected.volatile.total",
                    "--format=csv,noheader,nounits")
    if out is None:
        return None, why
    return [[cell.strip() for cell in line.split(",")] for line in out.splitlines() if line.strip()], ""


def filesystem_type(path: str, mountinfo: str = "/proc/self/mountinfo") -> str | None:
    """The file system type mounted at `path` (the last mount there wins, as it hides the others), or None. A
    mountinfo line's optional fields end at " - ", the type follows (proc(5))."""
    found = None
    for line in Path(mountinfo).read_text().splitlines():
        fields, _, rest = line.partition(" - ")
        if fields.split()[4] == path:
            found = rest.split()[0] if rest.split() else ""
    return found


def first_file(directories: tuple[str, ...], name: str) -> str | None:
    """The path of `name` in the first of `directories` holding it (NCCL's EFA plugin where the image put it)."""
    return next((str(Path(d, name)) for d in directories if Path(d, name).exists()), None)


# The report's keys, as DCGM 4.5.2 writes them (NVIDIA/DCGM v4.5.2: nvvs/include/NvvsJsonStrings.h, dcgmi/Diag.cpp
# HelperJsonBuildOutput and HelperDisplayFailureMessage): the tests under "DCGM Diagnostic" / "test_categories", the
# GPUs under "entity_groups", a diagnostic that could not run as "DCGM Diagnostic" / "runtime_error". A warning is
# written as "Fail" (HelperDisplayDiagResult's default), a test that did not run is left out.
DIAGNOSTIC, RUNTIME_ERROR, CATEGORIES = "DCGM Diagnostic", "runtime_error", "test_categories"
FAIL = "Fail"
GPU_GROUP = "GPU"  # DcgmFieldsGetEntityGroupString(DCGM_FE_GPU)
NEURON_DEVICE = re.compile(r"neuron\d+")


def dcgm_problems(report_text: str) -> tuple[list[str], int | None]:
    """The failures in a `dcgmi diag -j` report, and the GPUs it found (None without a report). No JSON, a runtime
    error or no test at all are failures too."""
    try:
        report = json.loads(report_text)
    except ValueError:
        report = None
    if not isinstance(report, dict):
        return [f"dcgmi diag gave no report: {report_text.strip()[:200] or 'no output'}"], None
    diagnostic = report.get(DIAGNOSTIC, {})
    if RUNTIME_ERROR in diagnostic:
        return [f"dcgmi diag could not run: {diagnostic[RUNTIME_ERROR]}"], None
    gpus = sum(len(group.get("entities", [])) for group in report.get("entity_groups", [])
               if group.get("entity_group") == GPU_GROUP)
    problems, tests = [], 0
    for category in diagnostic.get(CATEGORIES, []):
        for test in category.get("tests", []):
            tests += 1
            failed = [r for r in test.get("results", []) if r.get("status") == FAIL]
            if failed or test.get("test_summary", {}).get("status") == FAIL:
                where = ", ".join(f"{r.get('entity_group', '')} {r.get('entity_id', '')}" for r in failed)
                warnings = [w.get("warning", "") for r in [*failed, test.get("test_summary", {})]
                            for w in r.get("warnings", [])]
                problems.append(f"DCGM {category.get('category')}/{test.get('name')} failed"
                                + (f" on {where}" if where else "") + (f": {'; '.join(warnings)}" if warnings else ""))
    if not tests:
        problems.append("dcgmi diag ran no test")
    return problems, gpus


def count_neuron_devices(dev_dir: Path) -> int:
    return sum(1 for entry in dev_dir.iterdir() if NEURON_DEVICE.fullmatch(entry.name)) if dev_dir.is_dir() else 0
