"""What an all_reduce_perf run (NVIDIA/nccl-tests) measured, from its standard output: the bus bandwidth at the largest
message size, the wrong values it counted, and the network NCCL chose (from NCCL_DEBUG=INFO lines in the same output).
`gpucluster verify`'s across-nodes checks: `nccl_all_reduce_busbw_gbps` and `nccl_transport`.

The table's format is nccl-tests' (NVIDIA/nccl-tests a0b82b2, v2.19.6, src/util.cu): a header line
`#       size         count      type   redop    root     time   algbw   busbw  #wrong     time   algbw   busbw  #wrong`
(out-of-place half, then in-place; -S adds a timestamp column), one row per size, `#wrong` as `N/A` without
validation (-c 0), then `# Out of bounds values : N OK|FAILED` and `# Avg bus bandwidth    : X`. The columns are read
by the header's names, the first of each name the out-of-place half's, the second the in-place half's.
Output that is not such a table (a run that died, another program's) raises NcclTestsError: never a silent 0.
`srun --label`'s task prefix ("0: ", the form of the tables published in awsome-distributed-training's nccl-tests
README) is read off each line: a run launched with it reads as one without. Standard library only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from gpucluster.contract.verify import NCCL_ALL_REDUCE_BUSBW_GBPS as BUSBW_CHECK, NCCL_TRANSPORT as TRANSPORT_CHECK

HEADER_COLUMNS = ("size", "count", "type", "time", "algbw", "busbw", "#wrong")  # a table header has at least these
OUT_OF_BOUNDS = re.compile(r"^#\s*Out of bounds values\s*:\s*(\d+)")
AVERAGE = re.compile(r"^#\s*Avg bus bandwidth\s*:\s*(\S+)")
# NCCL's choice of network, one line per rank (NVIDIA/nccl src/init.cc: INFO "Using network %s", the net plugin's
# name): "Socket", "IB", aws-ofi-nccl's "Libfabric" (or "AWS Libfabric": releases before 1.9, or NCCL_NET so set).
NETWORK = re.compile(r"NCCL INFO Using network (.+?)\s*$", re.MULTILINE)
# aws-ofi-nccl's libfabric provider (src/nccl_ofi_net.cpp): "NET/OFI Selected provider is efa, fabric is efa-direct
# (found 32 nics)" since v1.15.0, "NET/OFI Selected Provider is efa (found 4 nics)" before.
OFI_PROVIDER = re.compile(r"NCCL INFO NET/OFI Selected [Pp]rovider is ([^,\s]+)")
OFI_NETWORKS = ("Libfabric", "AWS Libfabric")
# srun --label: "<task id>: " before each line of a task's output, the id right-aligned to the widest (srun(1)).
SRUN_LABEL = re.compile(r"^\s*\d+: ")


class NcclTestsError(ValueError):
    """The output does not hold what the check needs; the message says what is missing."""


@dataclass(frozen=True)
class Half:
    """One half of a row: out-of-place or in-place."""

    time_us: float
    algbw_gbps: float
    busbw_gbps: float
    wrong: int | None  # None: not validated (-c 0)


@dataclass(frozen=True)
class Row:
    size_bytes: int
    out_of_place: Half
    in_place: Half


@dataclass(frozen=True)
class AllReduce:
    rows: tuple[Row, ...]
    out_of_bounds: int
    average_busbw_gbps: float

    @property
    def largest(self) -> Row:
        return largest(self.rows)

    @property
    def busbw_gbps(self) -> float:
        """Bus bandwidth at the largest size, out-of-place: the half the catalog's figures were published from
        (spec/catalog.py ALL_REDUCE_BUSBW), so that floor and reading are the same measurement. The in-place half
        stays in `largest` (and its wrong values count in `wrong`)."""
        return self.largest.out_of_place.busbw_gbps

    @property
    def wrong(self) -> int | None:
        """Wrong values over every row, or None when nothing was validated."""
        counts = [h.wrong for row in self.rows for h in (row.out_of_place, row.in_place) if h.wrong is not None]
        return sum(counts) if counts else None


def _number(text: str, line: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise NcclTestsError(f"not a number: {text!r} in the row {line.strip()!r}") from None


def largest(rows: tuple[Row, ...]) -> Row:
    """The row of the largest size (the last such, if the run repeated: -N)."""
    biggest = max(row.size_bytes for row in rows)
    return [row for row in rows if row.size_bytes == biggest][-1]


@dataclass(frozen=True)
class Table:
    """What the output holds of all_reduce_perf's table: its rows, and its footer's figures (None: not there)."""

    rows: tuple[Row, ...]
    out_of_bounds: int | None
    average_busbw_gbps: float | None


def table(output: str) -> Table:
    """The rows and footer of one all_reduce_perf run's table, whichever of them the output holds."""
    columns: list[str] | None = None
    rows: list[Row] = []
    out_of_bounds: int | None = None
    average: float | None = None
    for line in (SRUN_LABEL.sub("", line, count=1) for line in output.splitlines()):
        if line.startswith("#"):
            names = line[1:].split()
            if all(name in names for name in HEADER_COLUMNS) and names.count("busbw") == 2:
                columns = names
            elif match := OUT_OF_BOUNDS.match(line):
                out_of_bounds = int(match.group(1))
            elif match := AVERAGE.match(line):
                average = _number(match.group(1), line)
            continue
        cells = line.split()
        if columns is None or not cells or not cells[0].isdigit():
            continue  # NCCL's log lines, and anything else before the table
        if len(cells) < len(columns) - ("timestamp" in columns):
            raise NcclTestsError(f"a row with {len(cells)} cells under a header of {len(columns)}: {line.strip()!r}")
        halves = []
        for nth in (0, 1):
            at = {name: [i for i, c in enumerate(columns) if c == name][nth] for name in ("busbw", "algbw", "#wrong")}
            time_at = at["algbw"] - 1  # "time", or "cputime" with -C
            wrong = cells[at["#wrong"]]
            halves.append(Half(_number(cells[time_at], line), _number(cells[at["algbw"]], line),
                               _number(cells[at["busbw"]], line),
                               None if wrong == "N/A" else int(_number(wrong, line))))
        rows.append(Row(int(cells[0]), halves[0], halves[1]))
    if columns is None:
        raise NcclTestsError("no nccl-tests result table (its header line `#  size  count  type ... busbw  #wrong`)")
    if not rows:
        raise NcclTestsError("nccl-tests printed its table header but no row: the run stopped before any size")
    return Table(tuple(rows), out_of_bounds, average)


def parse(output: str) -> AllReduce:
    """The table of one all_reduce_perf run that finished: its rows and its footer."""
    found = table(output)
    if found.out_of_bounds is None or found.average_busbw_gbps is None:
        raise NcclTestsError("no `# Out of bounds values` / `# Avg bus bandwidth` lines: the run did not finish")
    return AllReduce(found.rows, found.out_of_bounds, found.average_busbw_gbps)


@dataclass(frozen=True)
class Transport:
    network: str  # NCCL's network plugin, as NCCL names it
    provider: str  # efa (or another libfabric provider) through aws-ofi-nccl; socket, ib for NCCL's own

    def as_dict(self) -> dict[str, str]:
        return {"provider": self.provider, "network": self.network}


def transport(output: str) -> Transport:
    """The network every rank used. Ranks that disagree give every choice, sorted and comma-joined ("efa,socket"),
    so that no expectation of one provider matches. Only NCCL's own `Using network` line decides: the socket
    transport logs its interfaces whether or not a plugin carries the traffic."""
    networks = sorted(set(NETWORK.findall(output)))
    if not networks:
        raise NcclTestsError("NCCL's log says no `Using network`: run all_reduce_perf with NCCL_DEBUG=INFO")
    providers = set()
    for network in networks:
        if network in OFI_NETWORKS:
            found = set(OFI_PROVIDER.findall(output))
            if not found:
                raise NcclTestsError(f"NCCL used aws-ofi-nccl ({network}) but no `NET/OFI Selected provider` line")
            providers |= found
        else:
            providers.add(network.lower())
    return Transport(",".join(networks), ",".join(sorted(providers)))


def measurements(output: str) -> dict[str, Any]:
    """{check: measured} for the across-nodes checks, each {"error": why} when the output cannot tell it. The
    bandwidth is {"min": busbw, "bytes": the largest size}, read under the plan's keys: contract.verify.judge_reading
    fails a sweep that stopped short of the plan's "bytes". Values the run found wrong make the bandwidth an error: a
    fast wrong answer is no pass."""
    measured: dict[str, Any] = {}
    try:
        result = parse(output)
        wrong = max(result.wrong or 0, result.out_of_bounds)
        measured[BUSBW_CHECK] = ({"error": f"all_reduce_perf counted {wrong} wrong values: NCCL's results are wrong"}
                                 if wrong else {"min": result.busbw_gbps, "bytes": result.largest.size_bytes})
    except NcclTestsError as exc:
        measured[BUSBW_CHECK] = {"error": str(exc)}
    try:
        measured[TRANSPORT_CHECK] = transport(output).as_dict()
    except NcclTestsError as exc:
        measured[TRANSPORT_CHECK] = {"error": str(exc)}
    return measured
