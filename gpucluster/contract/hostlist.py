"""Slurm's host lists (p5-od-[1-3,7]) in both directions, and long lists in batches. Standard library only: the node
programs and the bootstrap import it from the bundle with the system python3."""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Iterable, Iterator


def expand_hostlist(hostlist: str) -> list[str]:
    """Slurm's host list to names, as `scontrol show hostnames` gives them but without repeats: p5-od-[1-3,7],head ->
    p5-od-1, p5-od-2, p5-od-3, p5-od-7, head. Zero padding is kept (n[01-02] -> n01, n02); several bracket groups in
    one name multiply out (r[1-2]n[1-2] -> r1n1, r1n2, r2n1, r2n2). No scontrol call: the programs run per node list."""
    names: list[str] = []
    for item in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", hostlist):
        expanded = [""]
        for literal, ranges in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", item):
            numbers = []
            for span in filter(None, (ranges or "").split(",")):
                first, _, last = span.partition("-")
                numbers += [str(n).zfill(len(first)) for n in range(int(first), int(last or first) + 1)]
            expanded = [e + literal + n for e in expanded for n in (numbers or [""])]
        names += [e for e in expanded if e]
    return list(dict.fromkeys(names))


def compress_hostlist(nodes: Iterable[str]) -> str:
    """Slurm's compressed form of node names, for log lines: p5-od-1,p5-od-2,p5-od-3,p5-od-7 -> p5-od-[1-3,7].
    Numbers sort as numbers (9 before 10); a name without a trailing number, or with a zero-padded one, stays as is."""
    numbered: dict[str, set[int]] = defaultdict(set)
    plain: set[str] = set()
    for node in nodes:
        match = re.fullmatch(r"(.*?)(\d+)", node)
        if match and (match.group(2) == "0" or not match.group(2).startswith("0")):
            numbered[match.group(1)].add(int(match.group(2)))
        else:
            plain.add(node)
    parts = sorted(plain)
    for prefix in sorted(numbered):
        numbers = sorted(numbered[prefix])
        ranges: list[list[int]] = []
        for n in numbers:
            if ranges and n == ranges[-1][1] + 1:
                ranges[-1][1] = n
            else:
                ranges.append([n, n])
        spans = ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)
        parts.append(f"{prefix}{numbers[0]}" if len(numbers) == 1 else f"{prefix}[{spans}]")
    return ",".join(parts)


def in_batches(items: list[str], size: int) -> Iterator[list[str]]:
    """Node names or instance ids `size` at a time: one scontrol or EC2 call each, under their limits."""
    for i in range(0, len(items), size):
        yield items[i : i + size]
