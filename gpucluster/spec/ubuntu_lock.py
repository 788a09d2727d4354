"""The Ubuntu packages of the node images, resolved once per archive snapshot into a committed lock file.

An Ubuntu snapshot (https://snapshot.ubuntu.com/ubuntu/<ID>/, ID a UTC time YYYYMMDDTHHMMSSZ) serves the archive as it
was at that instant. Its -updates and -security indexes list only the newest version of a package, so the version to
install is the newest one across the pockets: `gpucluster image-lock --snapshot ID` reads the indexes and
writes each BOM package's version under the ID in ubuntu-lock.json, and the bake installs exactly that (apt reads the
same snapshot). Pure functions here; the command line does the download.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

LOCK_FILE = Path(__file__).with_name("ubuntu-lock.json")
SNAPSHOT_RE = r"^\d{8}T\d{6}Z$"
SNAPSHOT_SERVICE = "https://snapshot.ubuntu.com/ubuntu"
RELEASE = "noble"  # Ubuntu 24.04, every parent image's release
POCKETS = (RELEASE, f"{RELEASE}-updates", f"{RELEASE}-security")  # not -backports: apt does not take it by default
COMPONENTS = ("main", "universe")
ARCHITECTURE = "amd64"
LOCK_COMMAND = "gpucluster image-lock --snapshot"


def archive_url(snapshot: str) -> str:
    """Where the snapshot serves the archive."""
    return f"{SNAPSHOT_SERVICE}/{snapshot}"


def index_paths() -> list[str]:
    """The Packages indexes, relative to the archive, that together list every version apt may install."""
    return [f"dists/{pocket}/{component}/binary-{ARCHITECTURE}/Packages.xz"
            for pocket in POCKETS for component in COMPONENTS]


# --- Debian version ordering (deb-version(7); dpkg's lib/dpkg/version.c) --------------------------------------------

@dataclass(frozen=True)
class DebianVersion:
    epoch: int
    upstream: str
    revision: str

    @classmethod
    def parse(cls, text: str) -> DebianVersion:
        epoch, _, rest = text.partition(":") if ":" in text else ("0", "", text)
        upstream, _, revision = rest.rpartition("-") if "-" in rest else (rest, "", "")
        if not epoch.isdigit() or not upstream or not upstream[0].isdigit():
            raise ValueError(f"not a Debian version: {text!r}")
        return cls(int(epoch), upstream, revision)


def _order(char: str) -> int:
    """A non-digit's weight: '~' before the end of the string, letters before everything else."""
    if char == "~":
        return -1
    if char.isalpha():
        return ord(char)
    return ord(char) + 256


def _compare_part(a: str, b: str) -> int:
    """dpkg's verrevcmp: alternate runs of non-digits (by _order, the end of a run weighing 0) and digits (as
    numbers)."""
    i = j = 0
    while i < len(a) or j < len(b):
        first_diff = 0
        while (i < len(a) and not a[i].isdigit()) or (j < len(b) and not b[j].isdigit()):
            ac = _order(a[i]) if i < len(a) and not a[i].isdigit() else 0
            bc = _order(b[j]) if j < len(b) and not b[j].isdigit() else 0
            if ac != bc:
                return -1 if ac < bc else 1
            i, j = i + 1, j + 1
        while i < len(a) and a[i] == "0":
            i += 1
        while j < len(b) and b[j] == "0":
            j += 1
        while i < len(a) and a[i].isdigit() and j < len(b) and b[j].isdigit():
            if not first_diff:
                first_diff = ord(a[i]) - ord(b[j])
            i, j = i + 1, j + 1
        if i < len(a) and a[i].isdigit():
            return 1
        if j < len(b) and b[j].isdigit():
            return -1
        if first_diff:
            return -1 if first_diff < 0 else 1
    return 0


def compare_versions(a: str, b: str) -> int:
    """-1, 0 or 1 as Debian version `a` sorts before, with or after `b` (what `dpkg --compare-versions` decides)."""
    va, vb = DebianVersion.parse(a), DebianVersion.parse(b)
    if va.epoch != vb.epoch:
        return -1 if va.epoch < vb.epoch else 1
    return _compare_part(va.upstream, vb.upstream) or _compare_part(va.revision, vb.revision)


# --- Packages indexes -----------------------------------------------------------------------------------------------

def packages(index: str) -> Iterator[tuple[str, str]]:
    """(name, version) of every stanza of a Packages index (deb822: stanzas apart by blank lines)."""
    for stanza in re.split(r"\n\s*\n", index):
        fields = dict(re.findall(r"^([A-Za-z0-9-]+):[ \t]*(.*)$", stanza, flags=re.M))
        if "Package" in fields and "Version" in fields:
            yield fields["Package"], fields["Version"]


def newest(indexes: Iterable[str], names: Iterable[str]) -> dict[str, str]:
    """The newest version of each of `names` across the indexes (the pockets of one snapshot). KeyError naming every
    package no index lists."""
    wanted = set(names)
    found: dict[str, str] = {}
    for index in indexes:
        for name, version in packages(index):
            if name in wanted and (name not in found or compare_versions(version, found[name]) > 0):
                found[name] = version
    missing = sorted(wanted - set(found))
    if missing:
        raise KeyError(f"no index of the snapshot lists {', '.join(missing)}")
    return dict(sorted(found.items()))


# --- the lock file --------------------------------------------------------------------------------------------------

def load(path: Path = LOCK_FILE) -> dict[str, dict[str, str]]:
    """Snapshot id -> {package: version}."""
    locked: dict[str, dict[str, str]] = json.loads(path.read_text())
    return locked


def with_entry(locked: dict[str, dict[str, str]], snapshot: str, versions: dict[str, str]) -> str:
    """The lock file's text with the snapshot's entry added (or replaced)."""
    return json.dumps({**locked, snapshot: dict(sorted(versions.items()))}, indent=1, sort_keys=True) + "\n"


def latest_snapshot(path: Path = LOCK_FILE) -> str:
    """The newest snapshot the lock resolves: the stacks' default."""
    return max(load(path))
