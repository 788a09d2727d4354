"""`gpucluster plan STACK --against OLD`: what a stack-file change adds, changes and removes, and what it does to the
price, offline. Both versions run through the real Pulumi program under the mock runtime (gpucluster/plan.py) under
STACK's name, so that a resource keeps its URN when only the file around it changed; a resource is "changed" when its
URN is in both plans with different inputs, and only the changed input keys are shown (never values: some are
secrets). The price is spec/cost.py's estimate of each version."""

from __future__ import annotations

import dataclasses
import subprocess
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, cast

from gpucluster.plan import Declared
from gpucluster.spec import cost
from gpucluster.spec.model import MAX_STACK_BYTES, SpecError, Stack, load_stack

GIT_PREFIX = "git:"
STACK_LEVEL = "(stack)"  # what is declared directly under the stack (the provider), not inside a component
COST_FIGURES = ("hourly_usd_min", "hourly_usd_max", "monthly_usd_at_max")


class AgainstError(Exception):
    """OLD cannot be read (no git checkout, an unknown revision): one line, exit 2."""


def old_stack(new_file: Path, against: str) -> Stack | None:
    """The OLD version, renamed to STACK's name: another stack file, or `git:REV`, the new file's own path at that
    revision (None: the file did not exist then, so the change adds the whole stack)."""
    if not against.startswith(GIT_PREFIX):
        if not Path(against).exists():
            raise AgainstError(f"no such stack file: {against} (OLD is a stack file's path, or git:REV)")
        return load_stack(Path(against))
    rev = against.removeprefix(GIT_PREFIX)
    if not rev:
        raise AgainstError(f"{against!r}: say which revision, git:REV (git:main, git:HEAD~1, a commit)")
    folder = new_file.resolve().parent
    top = _git(folder, "rev-parse", "--show-toplevel")
    if top.returncode != 0:
        raise AgainstError(f"{against}: {new_file} is not in a git checkout ({top.stderr.strip() or 'git failed'})")
    if _git(folder, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}").returncode != 0:
        raise AgainstError(f"{against}: no revision {rev!r} in the checkout at {top.stdout.strip()}")
    relative = new_file.resolve().relative_to(Path(top.stdout.strip()).resolve()).as_posix()
    blob = f"{rev}:{relative}"
    if _git(folder, "cat-file", "-e", blob).returncode != 0:  # the revision has no such file: the stack is new
        return None
    try:  # the reader's checks on the revision's bytes (size, UTF-8, controls), said of the file at the revision
        return load_stack(new_file, _blob_head(folder, blob))
    except SpecError as exc:
        raise SpecError(blob, exc.problems) from None


def _blob_head(folder: Path, blob: str) -> bytes:
    """The blob's bytes, at most MAX_STACK_BYTES + 1 of them (the reader refuses more): a revision may hold any
    file under the stack file's name, and only what the reader looks at is read."""
    with subprocess.Popen(["git", "-C", str(folder), "cat-file", "blob", blob], stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL) as git:
        data = cast(IO[bytes], git.stdout).read(MAX_STACK_BYTES + 1)  # stdout=PIPE: never None
        if len(data) > MAX_STACK_BYTES:
            git.kill()
        elif git.wait(timeout=60) != 0:
            raise AgainstError(f"git cat-file could not read {blob}")
    return data


def _git(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    try:
        # git's answers here are paths and messages: bytes that are not UTF-8 are kept as the file system's
        # (os.fsdecode's surrogates), not a UnicodeDecodeError.
        return subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True,
                              errors="surrogateescape", timeout=60)
    except FileNotFoundError:
        return subprocess.CompletedProcess(["git"], 127, "", "git is not installed")


@dataclass(frozen=True)
class Change:
    type: str
    name: str
    component: str  # "<type> <name>" of the top-level component it is in, or STACK_LEVEL
    keys: tuple[str, ...] = ()  # the changed inputs ("changed" only), dotted into nested objects


@dataclass(frozen=True)
class PlanDiff:
    stack: str
    against: str
    added: list[Change]
    changed: list[Change]
    removed: list[Change]
    cost_old: dict[str, float]  # COST_FIGURES of OLD (all 0 for a stack OLD did not have)
    cost_new: dict[str, float]

    @property
    def cost_delta(self) -> dict[str, float]:
        return {k: round(self.cost_new[k] - self.cost_old[k], 4) for k in COST_FIGURES}

    def as_json(self) -> dict[str, Any]:
        rows = lambda changes: [dataclasses.asdict(c) | {"keys": list(c.keys)} for c in changes]  # noqa: E731
        return {"stack": self.stack, "against": self.against, "added": rows(self.added),
                "changed": rows(self.changed), "removed": rows(self.removed),
                "cost": {"old": self.cost_old, "new": self.cost_new, "delta": self.cost_delta}}


def cost_figures(stack: Stack | None) -> dict[str, float]:
    """The figures `plan --json` prints under "cost" (CostEstimate.summary, same rounding)."""
    if stack is None:
        return dict.fromkeys(COST_FIGURES, 0.0)
    summary = cost.estimate(stack).summary()
    return {k: float(cast(float, summary[k])) for k in COST_FIGURES}


def diff(stack: Stack, old: Stack | None, against: str,
         run: Callable[[Stack], Sequence[Declared]]) -> PlanDiff:
    """`run` plans a stack (plan.run_program over the project's program)."""
    new_plan = list(run(stack))
    old_plan = list(run(dataclasses.replace(old, name=stack.name))) if old is not None else []
    new_by_urn, old_by_urn = {d.urn: d for d in new_plan}, {d.urn: d for d in old_plan}
    added = [_change(d, new_by_urn) for d in new_plan if d.urn not in old_by_urn]
    removed = [_change(d, old_by_urn) for d in old_plan if d.urn not in new_by_urn]
    changed = []
    for d in new_plan:
        before = old_by_urn.get(d.urn)
        if before is not None and before.inputs != d.inputs:
            changed.append(dataclasses.replace(_change(d, new_by_urn), keys=tuple(changed_keys(before.inputs,
                                                                                                d.inputs))))
    return PlanDiff(stack.name, against, added, changed, removed, cost_figures(old), cost_figures(stack))


def _change(declared: Declared, by_urn: dict[str, Declared]) -> Change:
    return Change(declared.type, declared.name, component_of(declared, by_urn))


def component_of(declared: Declared, by_urn: dict[str, Declared]) -> str:
    """The top-level component a resource belongs to (itself, for a top-level component)."""
    top = declared
    while top.parent_urn in by_urn:
        top = by_urn[top.parent_urn]
    return f"{top.type} {top.name}" if top.type.startswith("gpucluster:") else STACK_LEVEL


def changed_keys(old: Any, new: Any, prefix: str = "") -> list[str]:
    """The paths where two inputs differ: into objects key by key, a list or a value as a whole."""
    if isinstance(old, dict) and isinstance(new, dict):
        found = []
        for key in sorted(set(old) | set(new)):
            path = f"{prefix}.{key}" if prefix else str(key)
            if key not in old or key not in new:
                found.append(path)
            elif old[key] != new[key]:
                found += changed_keys(old[key], new[key], path)
        return found
    return [prefix] if old != new else []


def by_component(changes: list[Change]) -> dict[str, list[Change]]:
    grouped: dict[str, list[Change]] = defaultdict(list)
    for change in changes:
        grouped[change.component].append(change)
    return dict(sorted(grouped.items()))


def _signed(value: float) -> str:
    return ("+" if value > 0 else "-" if value < 0 else "") + cost.money(abs(value))


def cost_rows(result: PlanDiff) -> list[tuple[str, str, str, str]]:
    labels = {"hourly_usd_min": "$/h at min size", "hourly_usd_max": "$/h at max size",
              "monthly_usd_at_max": "month at max size"}
    return [(labels[k], cost.money(result.cost_old[k]), cost.money(result.cost_new[k]), _signed(result.cost_delta[k]))
            for k in COST_FIGURES]


def text(result: PlanDiff) -> list[str]:
    lines = [f"Stack {result.stack} against {result.against}: {len(result.added)} added, {len(result.changed)} "
             f"changed, {len(result.removed)} removed (offline plans, mock runtime)"]
    for title, changes in (("Added", result.added), ("Changed", result.changed), ("Removed", result.removed)):
        if changes:
            lines += ["", f"{title}:"]
            for component, rows in by_component(changes).items():
                lines.append(f"  {component}")
                lines += [f"    {c.type}  {c.name}" + (f"  ({', '.join(c.keys)})" if c.keys else "") for c in rows]
    width = max(len(row[0]) for row in cost_rows(result))
    lines += ["", f"{'':<{width}}  {'before':>14}  {'after':>14}  {'change':>14}"]
    lines += [f"{label:<{width}}  {old:>14}  {new:>14}  {delta:>14}" for label, old, new, delta in cost_rows(result)]
    return lines


def markdown(result: PlanDiff) -> list[str]:
    """A block for a pull request's comment: the price first, then what changes by component."""
    lines = [f"### gpucluster plan: stack `{result.stack}` against `{result.against}`", "",
             "| | before | after | change |", "|---|---:|---:|---:|"]
    lines += [f"| {label} | {old} | {new} | **{delta}** |" for label, old, new, delta in cost_rows(result)]
    lines += ["", f"{len(result.added)} added, {len(result.changed)} changed, {len(result.removed)} removed "
                  "(offline plans under Pulumi's mock runtime)."]
    for title, changes in (("Added", result.added), ("Changed", result.changed), ("Removed", result.removed)):
        if changes:
            lines += ["", f"<details><summary>{title} ({len(changes)})</summary>", ""]
            for component, rows in by_component(changes).items():
                lines.append(f"- `{component}`")
                lines += [f"  - `{c.type}` `{c.name}`" + (f": {', '.join(f'`{k}`' for k in c.keys)}" if c.keys
                                                         else "") for c in rows]
            lines += ["", "</details>"]
    return lines
