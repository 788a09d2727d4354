"""`gpucluster verify`'s contract: the checks by name, what each expects, how a measured figure is judged, and the
JSON both sides exchange. The plan (gpucluster/render/verify.py, from the stack file and the catalog) writes Checks;
the run on the head node measures them and judges each with `judge`, reading its expectations from the plan alone.

    plan: {"checks": [{"pool": P, "check": NAME, "expect": {...}}, ...]}
    run:  {"checks": [{"pool": P, "check": NAME, "expect": {...}, "measured": M, "result": "pass"|"warn"|"fail",
                       "fix": "..." (failures, and warnings that say why nothing was measured),
                       "details": {...} (what was read beside the figure: the Lustre client's version, the queue
                                     wait before a scale-up)}, ...]}

A check's `expect` holds the figure it is compared with under the key its kind names (count, min, max, or a value that
must be equal); an `expect` without that key says the figure is unknown (an instance type without a published
bandwidth, an existing file system), and the check is judged "warn", never a silent pass. Standard library only: the
head node's run imports this file from the bundle.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Final, Literal, Union

# --- the checks -------------------------------------------------------------------------------------------------------
# Per node (the run keeps a pool's worst node as the pool's figure).
GPUS = "gpus"  # {"count": N}: NVIDIA GPUs the driver sees
NEURON_DEVICES = "neuron_devices"  # {"count": N}: Neuron devices (Trainium pools)
EFA_DEVICES = "efa_devices"  # {"count": N}: EFA devices, on EFA pools only
ECC_UNCORRECTED = "ecc_uncorrected"  # {"max": 0}: uncorrected ECC errors (NVIDIA)
DCGM_DIAG = "dcgm_diag"  # {"level": 1}, 3 with --deep: DCGM's diagnostic passed at that level (NVIDIA)
DCGM_LEVEL, DCGM_DEEP_LEVEL = 1, 3  # DCGM diagnostic levels: 1 takes seconds, 3 about half an hour per node
# Level 3 takes "approximately 15 minutes" (NVIDIA's dcgmi-diag reference, --run): a deep run's limit is four times
# that, for a large GPU count or a slow first start of the host engine.
DCGM_DEEP_SECONDS = 4 * 15 * 60
# Level 1 "normally lasting seconds" (the same reference); node/devices.py holds the same figure for the health check
# (the burn-in's pod has only that file; tests/test_verify_run.py holds the two equal).
DCGM_SECONDS = 300
DCGM_LEVEL_SECONDS = {DCGM_LEVEL: DCGM_SECONDS, DCGM_DEEP_LEVEL: DCGM_DEEP_SECONDS}
FSX_MOUNTED = "fsx_mounted"  # {} or {"lustre_version": "2.15"}: /fsx is a Lustre mount, its client that recent
# fsx_mounted's expectation for a file system the stack creates: its Lustre version (spec/catalog.LUSTRE_VERSION); a
# node's client must be of that major.minor or newer. An existing file system's version is unknown: mounted only.
LUSTRE_VERSION_KEY = "lustre_version"
NCCL_EFA_PLUGIN = "nccl_efa_plugin"  # {"found": true}: aws-ofi-nccl where NCCL loads it (NVIDIA EFA pools)
METADATA_REFUSED = "metadata_refused"  # {"refused": true}: a job cannot reach the instance metadata service
NAMES_RESOLVE = "names_resolve"  # {"nodes": N}: how many of the job's node names resolve on every node
# Across the job's nodes (multi-node pools).
NCCL_ALL_REDUCE_BUSBW_GBPS = "nccl_all_reduce_busbw_gbps"  # {"min": X}: nccl-tests' busbw at its largest size, GB/s
NCCL_TRANSPORT = "nccl_transport"  # {"provider": "efa"}: the libfabric provider NCCL's log names (EFA pools)
# Storage, from the job's nodes together.
FSX_WRITE_MBPS = "fsx_write_mbps"  # {"min": X}: sequential write throughput on /fsx, MB/s
FSX_READ_MBPS = "fsx_read_mbps"  # {"min": X}: sequential read throughput on /fsx, MB/s
# The pool.
SCALE_FROM_ZERO_SECONDS = "scale_from_zero_seconds"  # {"max": S}: from getting powered-off nodes to the job's start
QUEUE_SECONDS_KEY = "queue_seconds"  # scale_from_zero's details: from submitting the job to Slurm giving it nodes
PROMETHEUS_SCRAPES = "prometheus_scrapes"  # {"nodes": N}: the job's nodes whose exporters Prometheus scrapes (up)
# The cluster (pool CLUSTER): what the head offers every pool.
CLUSTER = "(cluster)"  # the pool name of the cluster's checks: no pool can have it (POOL_NAME_RE)
BUDGET_TOPIC = "budget_topic"  # {"reachable": true}: the stack's topic answers the head's role (GetTopicAttributes)
GPU_IDLE_RULE = "gpu_idle_rule"  # {"loaded": true}: Prometheus has the GpuIdle alert rule loaded
GPU_IDLE_ALERT = "GpuIdle"  # the alert's name in the head's rules (render/prometheus.py)
# all_reduce_perf's sweep ends at this size when the catalog publishes no figure for the type (nccl_all_reduce's
# expect always holds "bytes": the size the run sweeps to and reads busbw at).
DEFAULT_ALL_REDUCE_BYTES = 1 << 30

# The last run per pool on the team's board: node_exporter's textfile collector on the head reads these.
RESULT_METRIC = "gpucluster_verify_result"  # {pool, check}: RESULT_CODES of the pool's last run
RUN_TIME_METRIC = "gpucluster_verify_run_timestamp_seconds"  # {pool}: when its last run ended (Unix time)

# --- how long a run may take: the head's run (node/verify_run.py) waits by these, and the operator's Run Command
# document (aws/verify_remote.py) allows their sum (run_seconds), so that the document never stops a run that the
# run itself would have let go on.
# A job queued behind other work (Slurm's reason Resources, Priority, a QOS or association limit) is waited for this
# long before its nodes are given to it; its pool's checks then say Slurm's reason.
QUEUE_SECONDS = 10 * 60
# After its nodes are up, the user's job has this long: the probe (4 GiB written and read back per node, seconds at
# FSx's throughput) and nccl-tests' sweep to the largest size (100 iterations per size: seconds each on EFA, minutes
# over sockets).
JOB_SECONDS = 20 * 60
# Root's DCGM job follows the user's job on the same nodes (afterany): Slurm starts it at its next scheduling pass.
DCGM_START_SECONDS = 5 * 60
DCGM_JOB_SLACK_SECONDS = 120  # the root job's Slurm overhead beyond the diagnostic's own limit
RUN_SLACK_SECONDS = 5 * 60  # sbatch, Slurm's passes, the cluster's checks and keeping the run


def dcgm_job_seconds(level: int) -> int:
    """Root's DCGM job's time limit at a diagnostic level: a level 1 run's nodes are held minutes, not an hour."""
    return DCGM_LEVEL_SECONDS[level] + DCGM_JOB_SLACK_SECONDS


def run_seconds(start_seconds: float, deep: bool) -> int:
    """The longest a run can take when its slowest pool's nodes may take `start_seconds` to boot: queued, booted, the
    user's job, root's DCGM job after it (the pools run side by side)."""
    level = DCGM_DEEP_LEVEL if deep else DCGM_LEVEL
    return int(QUEUE_SECONDS + start_seconds + JOB_SECONDS + DCGM_START_SECONDS + dcgm_job_seconds(level)
               + RUN_SLACK_SECONDS)


ResultWord = Literal["pass", "warn", "fail"]
PASS: Final = "pass"
WARN: Final = "warn"
FAIL: Final = "fail"
RESULT_CODES: dict[str, int] = {PASS: 0, WARN: 1, FAIL: 2}  # RESULT_METRIC's values
# What a check measures: a figure, a yes/no, a name; None when nothing was measured (a node that never started).
Measured = Union[int, float, bool, str, None]
Expect = dict[str, Union[int, float, bool, str]]
Details = dict[str, Measured]  # what a reading said beside its figure, recorded, never judged on its own

Kind = Literal["equal", "min", "max", "true"]


@dataclass(frozen=True)
class Rule:
    """How a check is judged: `kind` compares the measured value with `expect[key]` (equal to it, at least it, at most
    it) or wants it true (`key` "": nothing to compare with); `fix` is the one line a failure prints."""

    kind: Kind
    key: str
    fix: str


RULES: dict[str, Rule] = {
    GPUS: Rule("equal", "count",
               "a GPU is missing: the node's driver or hardware is at fault; drain the node "
               "(scontrol update nodename=N state=drain reason=gpus) so that a fresh instance replaces it"),
    NEURON_DEVICES: Rule("equal", "count",
                         "a Neuron device is missing: check `neuron-ls` and the aws-neuronx-dkms driver on the node, "
                         "then drain it for a fresh instance"),
    EFA_DEVICES: Rule("equal", "count",
                      "EFA devices are missing: check the pool's launch template interfaces and the EFA driver "
                      "(`fi_info -p efa`), then drain the node for a fresh instance"),
    ECC_UNCORRECTED: Rule("max", "max",
                          "uncorrected ECC errors: the GPU needs a reset or a replacement; drain the node for a fresh "
                          "instance"),
    DCGM_DIAG: Rule("true", "",
                    "DCGM's diagnostic failed: read `dcgmi diag -r LEVEL` on the node, drain it for a fresh instance"),
    FSX_MOUNTED: Rule("true", "",
                      "/fsx is not mounted: read the node's boot log (/var/log/gpucluster/boot.log) and check the "
                      "Lustre client module for its kernel"),
    NCCL_EFA_PLUGIN: Rule("equal", "found",
                          "aws-ofi-nccl is missing, NCCL falls back to sockets: rebuild the image "
                          "(/opt/amazon/ofi-nccl/lib must hold libnccl-net-ofi.so)"),
    METADATA_REFUSED: Rule("equal", "refused",
                           "a job reached the instance metadata service, and so the node's role: check the node "
                           "lockdown's firewall rules"),
    NAMES_RESOLVE: Rule("equal", "nodes",
                        "node names do not resolve on every node: check the head's hosts publisher "
                        "(/fsx/.gpucluster/hosts) and the node's /etc/hosts"),
    NCCL_ALL_REDUCE_BUSBW_GBPS: Rule("min", "min",
                                     "all_reduce bus bandwidth below the instance type's floor: check nccl_transport, "
                                     "the placement group and NCCL's environment (/etc/gpucluster/nccl.env)"),
    NCCL_TRANSPORT: Rule("equal", "provider",
                         "NCCL did not use EFA: check nccl_efa_plugin, the EFA devices and the security group's "
                         "self-referencing rules"),
    FSX_WRITE_MBPS: Rule("min", "min",
                         "/fsx writes below the file system's throughput: check its throughput tier, its CloudWatch "
                         "DataWriteBytes and other jobs' I/O"),
    FSX_READ_MBPS: Rule("min", "min",
                        "/fsx reads below the file system's throughput: check its throughput tier, its CloudWatch "
                        "DataReadBytes and other jobs' I/O"),
    SCALE_FROM_ZERO_SECONDS: Rule("max", "max",
                                  "nodes took too long to start: read `gpucluster events` and the resume log "
                                  "(/var/log/gpucluster/nodes.log) for capacity errors and slow boots"),
    PROMETHEUS_SCRAPES: Rule("equal", "nodes",
                             "Prometheus does not scrape every node of the pool: read its targets page (`gpucluster "
                             "dashboard`, Prometheus' /targets) and the node's node-exporter service"),
    BUDGET_TOPIC: Rule("equal", "reachable",
                       "the head cannot reach the stack's topic, so budget alarms and alerts go nowhere: check the "
                       "head role's statements on the topic (VerifyTheTeamTopic: sns:GetTopicAttributes, which this "
                       "check calls; TellTheTeam: sns:Publish) and the VPC's SNS endpoint"),
    GPU_IDLE_RULE: Rule("equal", "loaded",
                        "Prometheus has no GpuIdle rule: check /etc/prometheus/rules on the head and "
                        "`promtool check rules`, then restart prometheus"),
}
CHECK_NAMES = tuple(RULES)


@dataclass(frozen=True)
class Check:
    """One check of one pool, as the plan lists it."""

    pool: str
    check: str
    expect: Expect

    def as_dict(self) -> dict[str, object]:
        return {"pool": self.pool, "check": self.check, "expect": dict(self.expect)}


@dataclass(frozen=True)
class Result:
    """A check as a run judged it: the plan's entry, the figure measured, the verdict, the fix of a failure (or why a
    warning measured nothing)."""

    pool: str
    check: str
    expect: Expect
    measured: Measured
    result: ResultWord
    fix: str = ""
    details: Details = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        doc = asdict(self)
        doc["expect"] = dict(self.expect)
        if not self.fix:  # a failure's fix, or why a warning measured nothing (a run's note)
            del doc["fix"]
        if not self.details:
            del doc["details"]
        return doc


class VerifyFormatError(ValueError):
    """A plan or a run document that does not match this contract."""


def judge(check: Check, measured: Measured) -> Result:
    """The verdict on one measured value: pass, warn (the expected figure is unknown), or fail with the check's fix."""
    rule = RULES.get(check.check)
    if rule is None:
        raise VerifyFormatError(f"unknown check {check.check!r}; known: {', '.join(CHECK_NAMES)}")

    def verdict(word: ResultWord) -> Result:
        return Result(check.pool, check.check, check.expect, measured, word, rule.fix if word == FAIL else "")

    if rule.key and rule.key not in check.expect:
        return verdict(WARN)  # no figure to compare with: said, never passed silently
    if measured is None:
        return verdict(FAIL)  # nothing measured (a node that never ran the check)
    if rule.kind == "true":
        return verdict(PASS if measured is True else FAIL)
    expected = check.expect[rule.key]
    if rule.kind == "equal":
        # bool is an int to Python: True must not equal a count of 1, nor 1 the expectation true.
        same = type(measured) is type(expected) or (_is_number(measured) and _is_number(expected))
        return verdict(PASS if same and measured == expected else FAIL)
    if isinstance(measured, (bool, str)) or isinstance(expected, (bool, str)):
        return verdict(FAIL)  # a figure was expected; a yes/no or a name is no figure
    ok = measured >= expected if rule.kind == "min" else measured <= expected
    return verdict(PASS if ok else FAIL)


# The key of a probe's reading that a "true" check judges (the others read their expectation's key).
TRUE_KEYS = {DCGM_DIAG: "passed", FSX_MOUNTED: "mounted"}
# What a run records of a reading beside its figure whatever the plan expects (the expectation's other keys always).
DETAIL_KEYS = {FSX_MOUNTED: (LUSTRE_VERSION_KEY,)}
LUSTRE_CLIENT_FIX = ("the node's Lustre client is older than the file system's Lustre version: rebuild the image with "
                     "the FSx Lustre client of that version or newer (spec/bom.py, the image's lustre-client packages)")


def reading(check: str, probed: object) -> tuple[Measured, str]:
    """A node probe's or nccl_tests' reading of one check (gpucluster/node/verify_probe.py: a figure, or an object
    such as {"count": 8} or {"error": why}) as the figure a run records, and what else it says (an error, the tests
    DCGM failed, the names that did not resolve) for a failure's fix."""
    if not isinstance(probed, dict):
        return (probed if probed is None or isinstance(probed, (int, float, bool, str)) else None), ""
    if "error" in probed:
        return None, str(probed["error"])
    rule = RULES[check]
    value = probed.get(rule.key or TRUE_KEYS.get(check, ""))
    rest = {k: v for k, v in probed.items() if k != (rule.key or TRUE_KEYS.get(check)) and v not in ([], None, "")}
    note = ", ".join(f"{k} {v}" for k, v in sorted(rest.items()) if k in ("failures", "unresolved", "answer"))
    return (value if value is None or isinstance(value, (int, float, bool, str)) else None), note


def judge_reading(check: Check, probed: object) -> Result:
    """`judge` on a probe's reading; a failure's fix starts with what the reading said beside its figure, which the
    result keeps in its details."""
    value, note = reading(check.check, probed)
    result = judge(check, value)
    rule_key = RULES[check.check].key
    readings = probed if isinstance(probed, dict) and "error" not in probed else {}
    details = {k: readings[k] for k in (*(k for k in check.expect if k != rule_key), *DETAIL_KEYS.get(check.check, ()))
               if k in readings and (readings[k] is None or isinstance(readings[k], (int, float, bool, str)))}
    result = replace(result, details=details)
    # What the reading says of the expectation's other keys must be what was asked (a level 1 diagnostic is no
    # answer to a plan that asks level 3; a Lustre client older than the file system is no answer to its version).
    other = {k: readings[k] for k in check.expect if k != rule_key and k in readings
             and not _meets(k, readings[k], check.expect[k])
             and not (k == LUSTRE_VERSION_KEY and result.result == FAIL)}  # no Lustre mount: its own fix first
    if other and result.result != WARN:
        asked = ", ".join(f"{k} {v} where the plan asks {check.expect[k]}" for k, v in other.items())
        fix = LUSTRE_CLIENT_FIX if LUSTRE_VERSION_KEY in other else RULES[check.check].fix
        return replace(result, result=FAIL, fix=f"{asked}: {fix}")
    if result.result == FAIL and note:
        return replace(result, fix=f"{note}: {result.fix}")
    return result


def _meets(key: str, read: object, expected: object) -> bool:
    """A reading's other key against the plan's: a Lustre version at least the file system's major.minor, anything
    else equal."""
    if key == LUSTRE_VERSION_KEY:
        have, want = _major_minor(read), _major_minor(expected)
        return have is not None and want is not None and have >= want
    return read == expected


def _major_minor(version: object) -> tuple[int, int] | None:
    """(2, 15) of "2.15" or "2.15.6"; None for anything else."""
    parts = str(version).split(".")[:2] if isinstance(version, str) else []
    return (int(parts[0]), int(parts[1])) if len(parts) == 2 and all(p.isdigit() for p in parts) else None


def columns(rows: Sequence[tuple[str, ...]]) -> list[str]:
    """Rows as aligned columns (the last one unpadded), the first row a header underlined with dashes."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * (width if i < len(widths) - 1 else len(rows[0][-1]))
                              for i, width in enumerate(widths)))
    return lines


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def plan_json(checks: list[Check]) -> str:
    return json.dumps({"checks": [c.as_dict() for c in checks]}, indent=1)


def run_json(results: list[Result]) -> str:
    return json.dumps({"checks": [r.as_dict() for r in results]}, indent=1)


def expectation(check: Check) -> str:
    """What a check expects, in words ("= 8", ">= 400 (at 16G)"); an unknown figure says that the run warns."""
    rule = RULES[check.check]
    if rule.kind == "true":
        return ", ".join(f"{k} {_shown(val)}" for k, val in check.expect.items()) or "yes"
    words = ({"equal": "= ", "min": ">= ", "max": "<= "}[rule.kind] + _shown(check.expect[rule.key])
             if rule.key in check.expect else "no known figure: warns")
    size = check.expect.get("bytes")  # all_reduce's sweep ends there
    return f"{words} (at {_size(size)})" if isinstance(size, int) and not isinstance(size, bool) else words


def _size(size: int) -> str:
    """A message size as nccl-tests' -e takes it (a power-of-two multiple: 16G, 512M), else in bytes."""
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale}{unit}"
    return str(size)


def _shown(value: Measured) -> str:
    if value is None:
        return "-"  # nothing measured
    if isinstance(value, bool):
        return str(value).lower()
    return f"{value:g}" if isinstance(value, float) else str(value)


def run_table(results: list[Result]) -> list[str]:
    """A run as a readable table, one line per check: pool, check, result, measured, expected, and a failure's fix."""
    lines = columns([("pool", "check", "result", "measured", "expected", "fix")] + [
        (r.pool, r.check, r.result, _shown(r.measured) + "".join(f" ({k} {_shown(val)})" for k, val in
                                                                  r.details.items()),
         expectation(Check(r.pool, r.check, r.expect)), r.fix)
        for r in results])
    failed = sum(r.result == FAIL for r in results)
    warned = sum(r.result == WARN for r in results)
    return [*lines, f"{len(results)} checks: {failed} failed, {warned} warned"]


def _entries(text: str, keys: set[str], optional: set[str]) -> list[dict[str, object]]:
    doc = json.loads(text)
    if not isinstance(doc, dict) or set(doc) != {"checks"} or not isinstance(doc["checks"], list):
        raise VerifyFormatError('expected {"checks": [...]}')
    entries: list[dict[str, object]] = []
    for i, entry in enumerate(doc["checks"]):
        if not isinstance(entry, dict) or not keys <= set(entry) <= keys | optional:
            raise VerifyFormatError(f"checks[{i}]: expected the keys {', '.join(sorted(keys))}"
                                    + (f" (and {', '.join(sorted(optional))})" if optional else ""))
        if entry["check"] not in RULES:
            raise VerifyFormatError(f"checks[{i}]: unknown check {entry['check']!r}")
        entries.append(entry)
    return entries


def plan_from_json(text: str) -> list[Check]:
    return [Check(str(e["pool"]), str(e["check"]), _expect(e["expect"], f"checks[{i}]"))
            for i, e in enumerate(_entries(text, {"pool", "check", "expect"}, set()))]


def run_from_json(text: str) -> list[Result]:
    results: list[Result] = []
    for i, e in enumerate(_entries(text, {"pool", "check", "expect", "measured", "result"}, {"fix", "details"})):
        word, measured, details = e["result"], e["measured"], e.get("details", {})
        if word not in (PASS, WARN, FAIL):
            raise VerifyFormatError(f"checks[{i}].result: expected pass, warn or fail, got {word!r}")
        if measured is not None and not isinstance(measured, (int, float, bool, str)):
            raise VerifyFormatError(f"checks[{i}].measured: expected a number, a boolean, a string or null")
        if not isinstance(details, dict) or not all(d is None or isinstance(d, (int, float, bool, str))
                                                    for d in details.values()):
            raise VerifyFormatError(f"checks[{i}].details: expected an object of numbers, booleans, strings and nulls")
        results.append(Result(str(e["pool"]), str(e["check"]), _expect(e["expect"], f"checks[{i}]"), measured,
                              PASS if word == PASS else WARN if word == WARN else FAIL, str(e.get("fix", "")),
                              {str(k): d for k, d in details.items()}))
    return results


def _expect(raw: object, where: str) -> Expect:
    if not isinstance(raw, dict) or not all(isinstance(v, (int, float, bool, str)) for v in raw.values()):
        raise VerifyFormatError(f"{where}.expect: expected an object of numbers, booleans and strings")
    return {str(k): v for k, v in raw.items()}
