"""The bake rehearsal: build_image.sh's package steps run for real, as root in a chroot of the rehearsal's Debian 13
root file system, against a stand-in Ubuntu archive served on 127.0.0.1 with a dated snapshot beside it.

The stand-in archive is the seam this machine forces (no Ubuntu archive, no snapshot service here). It behaves as
Ubuntu's does where the build depends on it: its live pocket lists only the newest version of each package (as
noble-updates does once an update is out), while the snapshot the bill of materials names still serves the versions it
pins; its Release file names its snapshot server (`Snapshots:`), which is how apt finds one it has no built-in entry
for. So apt's real snapshot mechanism decides what gets installed. The archive is unsigned, trusted by its sources line
(`[trusted=yes]`): signature checking is apt's own and not under test, and a signed one would need a throwaway key in
the chroot's keyring. The chroot is an overlay over the root file system (its own upper directory in tmp_path, in a
private mount namespace): the root file system is never changed. Steps that need GitHub, AWS or a DLAMI do not run
here (build_image.sh's GPUCLUSTER_BUILD_STEPS seam)."""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil
import subprocess
import threading
from collections.abc import Iterator
from email.utils import formatdate
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from conftest import ROOT
from gpucluster.spec import bom as bom_spec
from gpucluster.spec.model import load_stack
from rehearsal_image import REHEARSAL_ROOTFS

pytestmark = pytest.mark.rehearsal

# The bake runs in the rehearsal's Debian 13 root file system: its apt is apt 3.0, its python3 the system one
# build_image.sh reads the BOM with.
SCRIPT = ROOT / "gpucluster" / "node" / "build_image.sh"
SNAPSHOT = "20250601T000000Z"
STEPS = "snapshot apt_packages"
# Stand-in packages with Ubuntu's version shapes (epochs, +ds, ubuntuN.M), named so that no package of the root file
# system is replaced. Each is at its pinned version in the snapshot and at a later one in the live pocket.
PINNED = {"gpucluster-standin-munge": "0.5.15-4ubuntu0.1", "gpucluster-standin-mariadb": "1:10.11.14-0ubuntu0.24.04.1",
          "gpucluster-standin-prometheus": "2.45.3+ds-2ubuntu0.3"}
# Not in the BOM: a dependency of the first pinned package, which must come from the snapshot too.
DEPENDENCY = ("gpucluster-standin-libmunge", "0.5.15-4ubuntu0.1")


def later(version: str) -> str:
    return version + "+live1"


def deb(out: Path, name: str, version: str, depends: str = "") -> Path:
    tree = out / f"{name}-tree"
    (tree / "DEBIAN").mkdir(parents=True)
    (tree / "usr/share/doc" / name).mkdir(parents=True)
    (tree / "usr/share/doc" / name / "standin").write_text(f"{name} {version}\n")
    control = (f"Package: {name}\nVersion: {version}\nArchitecture: all\nMaintainer: gpucluster tests <t@localhost>\n"
               + (f"Depends: {depends}\n" if depends else "") + "Description: stand-in for the bake rehearsal\n")
    (tree / "DEBIAN" / "control").write_text(control)
    path = out / f"{name}_{version.replace(':', '%3a')}_all.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "-Zgzip", "-b", str(tree), str(path)], check=True,
                   capture_output=True)
    shutil.rmtree(tree)
    return path


def archive(base: Path, packages: dict[str, str], port: int) -> None:
    """One suite (noble, main, amd64) at `base`, in the layout apt reads: pool, Packages, Release."""
    pool, index = base / "pool", base / "dists" / "noble" / "main" / "binary-amd64"
    pool.mkdir(parents=True)
    index.mkdir(parents=True)
    stanzas = []
    for name, version in packages.items():
        depends = f"{DEPENDENCY[0]} (>= {DEPENDENCY[1]})" if name == next(iter(PINNED)) else ""
        path = deb(pool, name, version, depends)
        data = path.read_bytes()
        control = subprocess.run(["dpkg-deb", "-f", str(path)], check=True, capture_output=True, text=True).stdout
        stanzas.append(control.rstrip("\n") + f"\nFilename: pool/{path.name}\nSize: {len(data)}\n"
                       f"SHA256: {hashlib.sha256(data).hexdigest()}\n")
    (index / "Packages").write_text("\n".join(stanzas))
    (index / "Packages.gz").write_bytes(gzip.compress((index / "Packages").read_bytes(), mtime=0))
    sums = "".join(f" {hashlib.sha256(f.read_bytes()).hexdigest()} {f.stat().st_size} main/binary-amd64/{f.name}\n"
                   for f in sorted(index.iterdir()))
    (base / "dists" / "noble" / "Release").write_text(
        "Origin: Ubuntu\nLabel: Ubuntu\nSuite: noble\nCodename: noble\nArchitectures: amd64\nComponents: main\n"
        f"Date: {formatdate(usegmt=True)}\nSnapshots: http://127.0.0.1:{port}/snapshot/@SNAPSHOTID@/\n"
        f"SHA256:\n{sums}")


class _Handler(SimpleHTTPRequestHandler):
    requested: list[str]

    def log_message(self, format: str, *args: object) -> None:
        self.requested.append(self.path)


@pytest.fixture
def standin_archive(tmp_path: Path) -> Iterator[tuple[int, list[str]]]:
    """The stand-in Ubuntu archive: live at /ubuntu/, the snapshot SNAPSHOT at /snapshot/SNAPSHOT/. Yields the port and
    the paths requested so far."""
    served, requested = tmp_path / "archive", list[str]()
    handler = type("Handler", (_Handler,), {"requested": requested})
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(handler, directory=str(served)))
    port = server.server_address[1]
    pinned = {**PINNED, DEPENDENCY[0]: DEPENDENCY[1]}
    archive(served / "snapshot" / SNAPSHOT, pinned, port)
    archive(served / "ubuntu", {name: later(version) for name, version in pinned.items()}, port)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield port, requested
    server.shutdown()
    server.server_close()


def bom(packages: dict[str, str]) -> dict:
    """team-a's bill of materials as `render` writes it, with the stand-in archive's snapshot and the compute role's
    apt list replaced by `packages` (the steps run here need nothing else of it)."""
    real = json.loads(bom_spec.render(load_stack(ROOT / "stacks" / "Pulumi.team-a.yaml")))
    real["ubuntu_snapshot"] = SNAPSHOT
    real["packages"] |= packages
    real["roles"]["compute"]["apt"] = list(packages)
    return real


def installed(upper: Path) -> dict[str, str]:
    """What dpkg has installed in the chroot, from the status file the run left in the overlay's upper directory."""
    status = upper / "var/lib/dpkg/status"
    if not status.exists():
        return {}
    got = {}
    for stanza in status.read_text().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in stanza.splitlines() if ": " in line and not line[0].isspace())
        if fields.get("Status") == "install ok installed":
            got[fields["Package"]] = fields["Version"]
    return got


def bake(tmp_path: Path, port: int, packages: dict[str, str]) -> tuple[subprocess.CompletedProcess[str], Path]:
    """build_image.sh compute, its package steps only, in the chroot; returns the run and the overlay's upper dir."""
    assert REHEARSAL_ROOTFS.is_dir(), f"no rehearsal root file system at {REHEARSAL_ROOTFS} (make test builds it)"
    upper, work, merged = (tmp_path / d for d in ("upper", "work", "merged"))
    for d in (upper, work, merged):
        d.mkdir()
    # What the parent image brings: its Ubuntu sources (here the stand-in's live pocket, as a DLAMI names the EC2
    # mirror), and the build's files where the image component writes them.
    sources = upper / "etc/apt/sources.list"
    sources.parent.mkdir(parents=True)
    sources.write_text(f"deb [trusted=yes] http://127.0.0.1:{port}/ubuntu/ noble main\n")
    image = upper / "opt/gpucluster-image"
    image.mkdir(parents=True)
    shutil.copy(SCRIPT, image / "build_image.sh")
    (image / "bom.json").write_text(json.dumps(bom(packages)))
    inside = (f"mount -t overlay overlay -o lowerdir={REHEARSAL_ROOTFS},upperdir={upper},workdir={work} {merged} && "
              f"mount -t proc proc {merged}/proc && mount --bind /dev {merged}/dev && "
              f"exec chroot {merged} /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin "
              f"GPUCLUSTER_BUILD_STEPS='{STEPS}' GPUCLUSTER_RETRY_BASE_MS=10 "
              "bash /opt/gpucluster-image/build_image.sh compute")
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", inside],
                          capture_output=True, text=True, timeout=600)
    return done, upper


def test_the_installed_set_equals_the_bom_and_comes_from_the_snapshot(
        tmp_path: Path, standin_archive: tuple[int, list[str]]) -> None:
    port, requested = standin_archive
    before = installed_in_rootfs()
    done, upper = bake(tmp_path, port, PINNED)
    assert done.returncode == 0, done.stderr
    got = installed(upper)
    assert {name: got.get(name) for name in PINNED} == PINNED
    # The dependency the BOM does not name resolved from the snapshot too, not from the live pocket.
    assert got[DEPENDENCY[0]] == DEPENDENCY[1]
    # Nothing else changed: every other package is the root file system's, at its version.
    assert {n: v for n, v in got.items() if n not in PINNED and n != DEPENDENCY[0]} == before
    assert any(p.startswith(f"/snapshot/{SNAPSHOT}/pool/") for p in requested), requested
    assert not any(p.startswith("/ubuntu/pool/") for p in requested), requested
    # The snapshot is the build's: the image's own apt goes back to the live archive.
    assert not (upper / "etc/apt/apt.conf.d/50gpucluster-snapshot").exists()
    assert not (upper / "opt/gpucluster-image/manifest.json").exists()  # a subset of the steps never vouches


def test_a_version_absent_from_the_snapshot_fails_naming_the_package(
        tmp_path: Path, standin_archive: tuple[int, list[str]]) -> None:
    port, _ = standin_archive
    name = "gpucluster-standin-mariadb"
    wanted = {**PINNED, name: later(PINNED[name])}  # what the live pocket serves, and the snapshot does not
    done, upper = bake(tmp_path, port, wanted)
    assert done.returncode != 0
    assert f"not in Ubuntu's snapshot {SNAPSHOT}" in done.stderr and f"{name}={wanted[name]}" in done.stderr
    (failed,) = [line for line in done.stderr.splitlines() if "FAILED" in line]
    assert not [other for other in PINNED if other != name and other in failed], failed  # that one package only
    assert not set(installed(upper)) & set(PINNED)  # checked before anything was installed


def installed_in_rootfs() -> dict[str, str]:
    got = installed(REHEARSAL_ROOTFS)
    clash = set(got) & {*PINNED, DEPENDENCY[0]}
    assert not clash, f"the root file system already has {clash}: rename the stand-ins"
    return got
