"""A hostile stack file is answered as bad input within 2 s and 200 MB: exit 2, one line per problem, no traceback.

The corpus is generated here (a 2 MiB file has no place in the repository). All of it runs through the command line's
plan path in one child process (`cli.main(["plan", FILE])`, in-process there), because a regression must fail the
test, not hang or exhaust the machine: the child has a time limit and a cap on its data segment. Inside it each file
is measured twice over:
- time with time.perf_counter() while tracemalloc traces (tracing slows Python down, so the bound holds a fortiori
  without it);
- memory as tracemalloc's peak for that file (every object the YAML loader, pydantic's inputs and the messages are
  built of) and, for what tracemalloc cannot see (libyaml's and pydantic-core's own buffers), the growth of the
  process's peak resident set (getrusage's ru_maxrss) over the whole corpus, taken after the imports.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conftest import ROOT

SECONDS = 2.0
MEGABYTES = 200
BASE = (ROOT / "stacks" / "Pulumi.dev.yaml").read_text()


def billion_laughs(leaf: str) -> str:
    """Nine levels of nine aliases each: 9**9 (387 million) leaves once expanded."""
    lines = [f"l0: &l0 [{', '.join([leaf] * 9)}]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 9)]
    return "\n".join(lines) + "\nconfig: {gpucluster:cluster: {team: *l8}}\n"


CORPUS: dict[str, tuple[bytes | Callable[[Path], None], str]] = {  # name: (the file or what makes it, its one problem)
    "alias-bomb-yes": (billion_laughs("yes").encode(), "aliases (*l0) are not taken"),
    "alias-bomb-strings": (billion_laughs("lol").encode(), "aliases (*l0) are not taken"),
    "self-containing-list": (b"config: &a [*a]\n", "aliases (*a) are not taken"),
    "self-containing-map": (b"config: &a {gpucluster:cluster: *a}\n", "aliases (*a) are not taken"),
    "merge-alias": (BASE.replace("    storage:", "    extra: &x {a: 1}\n    more: {<<: *x}\n    storage:").encode(),
                    "aliases (*x) are not taken"),
    "deep-flow-5000": (b"config: " + b"[" * 5000 + b"]" * 5000 + b"\n", "nest"),
    "deep-flow-map": (b"config: " + b"{a: " * 200 + b"1" + b"}" * 200 + b"\n", "nested deeper than"),
    "deep-block": ("".join(" " * i + "a:\n" for i in range(300)).encode(), "nested deeper than"),
    "int-5001-digits": (BASE.replace("monthly_usd: 500", "monthly_usd: " + "9" * 5001).encode(),
                        "budget.monthly_usd: an integer written in 5,001 characters"),
    "int-tagged-quoted": (BASE.replace("max_nodes: 2", "max_nodes: !!int '" + "7" * 100_000 + "'").encode(),
                          "pools[0].max_nodes: an integer written in 100,000 characters"),
    "int-base-60": (BASE.replace("monthly_usd: 500", "monthly_usd: " + "59:" * 3000 + "59").encode(),
                    "budget.monthly_usd: an integer written in"),
    "control-bell": (BASE.replace("team: platform", "team: plat\x07form").encode(), "control character U+0007"),
    "control-escape": (BASE.replace("# Use", "# \x1b[2J\x1b]0;owned\x07 Use").encode(), "control character U+001B"),
    "control-nul": (BASE.encode() + b"\x00" * 1000, "control character U+0000"),
    "control-c1": (BASE.replace("team: platform", "team: \u009bplatform").encode(), "control character U+009B"),
    "not-utf8": (BASE.encode().replace(b"platform", b"plat\xe9form"), "not UTF-8 text (byte 0xe9"),
    "utf16": (BASE.encode("utf-16"), "not UTF-8 text"),
    "huge-comment": (BASE.encode() + b"#" + b"x" * (2 * 1024 * 1024) + b"\n", "larger than 1024 KiB"),
    "huge-scalar": (BASE.replace("team: platform", "team: " + "a" * (8 * 1024 * 1024)).encode(), "larger than"),
    "many-values": (b"config: [" + b"0," * 400_000 + b"0]\n", "more than 20,000 values"),
    "many-keys": (("config:\n" + "".join(f"  k{i}: {i}\n" for i in range(60_000))).encode(),
                  "more than 20,000 values"),
    "two-documents": (BASE.encode() + b"---\n" + BASE.encode(), "expected a single document"),
    "unclosed-flow": (b"config: [1, 2\n", "not valid YAML"),
    # Nobody writes to the FIFO: a read waits forever (the child's time limit below fails the test then).
    "fifo": (os.mkfifo, "not a regular file (a FIFO)"),
    "directory": (Path.mkdir, "not a regular file (a directory)"),
    "device": (lambda path: path.symlink_to("/dev/zero"), "not a regular file (a character device)"),
}

CHILD = """
import contextlib, io, json, resource, sys, time, tracemalloc, traceback
from gpucluster import cli
resource.setrlimit(resource.RLIMIT_DATA, (4 * 2**30, 4 * 2**30))  # a regression fails here, not the machine
results = {}
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
for name, path in json.loads(sys.argv[1]).items():
    err, out = io.StringIO(), io.StringIO()
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            code = cli.main(["plan", path])
    except BaseException:
        code, err = None, io.StringIO(err.getvalue() + traceback.format_exc())
    seconds = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    results[name] = {"code": code, "seconds": seconds, "peak_bytes": peak, "stderr": err.getvalue(),
                     "stdout": out.getvalue()}
growth_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps({"results": results, "rss_growth_bytes": growth_kib * 1024}))
"""


@pytest.fixture(scope="module")
def answers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("hostile")
    files = {}
    for name, (data, _) in CORPUS.items():
        if isinstance(data, bytes):
            (folder / f"Pulumi.{name}.yaml").write_bytes(data)
        else:
            data(folder / f"Pulumi.{name}.yaml")
        files[name] = str(folder / f"Pulumi.{name}.yaml")
    # Generous for the imports and a loaded machine; a file that blows the bound fails the assertions below.
    child = subprocess.run([sys.executable, "-c", CHILD, json.dumps(files)], cwd=ROOT, capture_output=True,
                           text=True, timeout=60, check=False)
    assert child.returncode == 0, child.stderr[-3000:]
    answer: dict[str, Any] = json.loads(child.stdout)
    return answer


@pytest.mark.parametrize("name", CORPUS)
def test_hostile_file_is_bad_input_within_bounds(answers: dict[str, Any], name: str) -> None:
    result = answers["results"][name]
    stderr = str(result["stderr"])
    assert "Traceback" not in stderr, stderr[-3000:]
    assert result["code"] == 2, stderr[-3000:]
    assert result["seconds"] < SECONDS, f"{name}: {result['seconds']} s"
    assert result["peak_bytes"] < MEGABYTES * 10**6, f"{name}: {result['peak_bytes']} bytes traced"
    header, *problems = stderr.splitlines()
    assert header.endswith("problem(s):") and problems, stderr
    assert all(line.startswith("  ") and len(line) < 1000 for line in problems), stderr[:3000]
    assert CORPUS[name][1] in stderr, stderr[:3000]
    assert not result["stdout"]


def test_the_corpus_stays_within_the_memory_bound_outside_python_too(answers: dict[str, Any]) -> None:
    assert answers["rss_growth_bytes"] < MEGABYTES * 10**6


def test_a_shipped_stack_passes_the_same_gate() -> None:
    """The bounds leave every real stack file through (the caps are not a refusal of everything)."""
    from gpucluster.spec.model import load_stack

    for path in sorted((ROOT / "stacks").glob("Pulumi.*.yaml")):
        assert load_stack(path).name == path.name.split(".")[1]
