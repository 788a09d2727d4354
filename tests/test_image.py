"""The node image: gpucluster/node/build_image.sh, run here with stand-ins for what needs the internet, and the
NodeImage component under the mock runtime for every shipped stack. (tests/integration/test_bake_rehearsal.py runs the
package steps for real, with apt, in a chroot.)"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import io
import json
import os
import re
import secrets
import shutil
import socketserver
import subprocess
import sys
import threading
import traceback
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import FIXTURES, ROOT, STACK_FILES, of_type, planned, xdist_session_dir
from gpucluster.contract import settings
from gpucluster.plan import Declared, planned_id, planned_outputs, run_program
from gpucluster.project import pulumi_program
from gpucluster.spec import bom as bom_spec, catalog, cost
from gpucluster.spec.model import Stack, load_stack, stack_config, validate

SCRIPT = ROOT / "gpucluster" / "node" / "build_image.sh"
KERNEL = "6.8.0-1021-aws"
GPU_TOOLS = ("nvidia-smi", "dcgmi", "docker", "nvidia-ctk")  # the NVIDIA Deep Learning AMI's
STANDIN_NAMES = ("apt-get", "apt-cache", "apt-mark", "dpkg-query", "curl", "sha256sum", "git", "gpg", "systemctl",
                 "uname", "python3", "aa-enabled", "apparmor_parser", "make", "tar", "ldconfig", "getent", "groupadd",
                 "useradd", "id", "ldd", *GPU_TOOLS)
# What nccl-tests' build takes from the NVIDIA Deep Learning AMI (build_image.sh's CUDA_HOME, MPI_HOME, NCCL_HOMES[0]).
NVIDIA_SDK = ("/usr/local/cuda/bin/nvcc", "/opt/amazon/openmpi/include/mpi.h", "/usr/local/cuda/include/nccl.h")
# Installed kernel packages and their sources, as dpkg-query lists them on an Ubuntu image: the meta packages come from
# linux-meta*, the kernel itself from its versioned sources.
KERNEL_PACKAGES = {"linux-aws": "linux-meta-aws", "linux-image-aws": "linux-meta-aws",
                   "linux-headers-aws": "linux-meta-aws", f"linux-image-{KERNEL}": "linux-signed-aws",
                   f"linux-modules-{KERNEL}": "linux-aws", "linux-base": "linux-base"}
PMIX_LIB = "/usr/lib/x86_64-linux-gnu/pmix2/lib/libpmix.so"
DLAMI_NCCL_DIR = "/opt/amazon/ofi-nccl/lib/x86_64-linux-gnu"  # where the NVIDIA DLAMI has aws-ofi-nccl's plugin
NEURON_TOOLS = ("neuron-monitor", "neuron-monitor-prometheus.py")  # the Neuron Deep Learning AMI's

# Every stand-in command is one small bash script (STANDIN_CLIENT) that hands its call to a server in the test's own
# process (StandinServer) and replays the answer: one interpreter for a whole build instead of one per command. The
# server records each call (with what it saw) as a JSON line.
STANDIN_CLIENT = r'''#!/bin/bash
# Stand-in for a command this machine cannot run for real: it has no internet (apt, downloads, pip), and a package
# manager, systemd, a compiler run over sources it cannot fetch or a kernel module here would change a machine others
# share. The call goes to the test's stand-in server (tests/test_image.py: standin_answer) over bash's /dev/tcp.
# python3 is a real one, as the image's system python3 with nothing but its standard library (-S: not the packages of
# the venv that runs the tests).
set -euo pipefail
if [[ ${0##*/} == python3 && "${1:-} ${2:-}" != "-m venv" ]]; then  # the script's BOM reader and manifest writer
  exec "$STANDIN_PYTHON" -S "$@"
fi
exec 3<>"/dev/tcp/127.0.0.1/$STANDIN_PORT"
# Unset and empty differ: "=value" when set, "" when not.
printf '%s\0' "$STANDIN_TOKEN" "$0" "$PWD" "${DEBIAN_FRONTEND+=$DEBIAN_FRONTEND}" "${LD_RUN_PATH+=$LD_RUN_PATH}" \
  "$#" "$@" >&3
read -r status <&3
read -r error_size <&3
if ((error_size)); then IFS= read -r -N "$error_size" error <&3; printf '%s' "$error" >&2; fi
IFS= read -r -d '' output <&3 || true
printf '%s' "$output"
((status == 0)) || exit "$status"
if [[ ${0##*/} == python3 ]]; then exec "$STANDIN_PYTHON" -S "$@"; fi  # -m venv: a real venv
'''


@dataclass(frozen=True)
class Call:
    """One stand-in command as its client saw it: argv[0] as invoked, its working directory, its arguments and the
    variables the script sets for it (`env`: the run's own, with those)."""
    argv0: str
    cwd: Path
    args: list[str]
    env: dict[str, str]

    @property
    def name(self) -> str:
        return Path(self.argv0).name

    def path(self, arg: str) -> Path:
        return self.cwd / arg

    def arg_after(self, flag: str) -> str:
        return self.args[self.args.index(flag) + 1]


def standin_answer(call: Call) -> tuple[int, str, str]:
    """What the stand-in command does for this call: its exit status, stdout and stderr (recorded in STANDIN_LOG)."""
    name, args, env, out = call.name, call.args, call.env, io.StringIO()
    root = env["GPUCLUSTER_IMAGE_ROOT"]
    snapshot = Path(root + env["STANDIN_SNAPSHOT_CONF"])
    record: dict[str, Any] = {"cmd": [name, *args], "manifest_existed": Path(root + env["STANDIN_MANIFEST"]).exists(),
                              "debian_frontend": env.get("DEBIAN_FRONTEND"),
                              "snapshot": snapshot.read_text() if snapshot.exists() else None}
    state = Path(env["STANDIN_STATE"])
    for i, (pattern, times) in enumerate(json.loads(env.get("STANDIN_FAIL", "[]"))):
        if pattern in " ".join([name, *args]):
            seen = state / f"fail-{i}"
            count = int(seen.read_text()) if seen.exists() else 0
            if count < times:
                seen.write_text(str(count + 1))
                record["failed"] = True
    if name == "pip" and "-r" in args:
        record["requirements"] = call.path(call.arg_after("-r")).read_text().splitlines()
    if name in ("make", "configure"):
        record["cwd"] = str(call.cwd)
        record["ld_run_path"] = env.get("LD_RUN_PATH")
    with open(env["STANDIN_LOG"], "a") as log:
        log.write(json.dumps(record) + "\n")
    if record.get("failed"):
        return 1, "", ""

    dpkg = state / "installed.json"  # what the stand-in apt-get installed: package -> version
    installed = json.loads(dpkg.read_text()) if dpkg.exists() else {}
    archive = json.loads(env["STANDIN_ARCHIVE"])  # what apt's indexes list: package -> versions
    fetched = state / "fetched.json"  # what the stand-in curl wrote: file -> URL
    client = env["STANDIN_PROGRAM"]
    if name == "curl":  # STANDIN_DOWNLOADS: URL -> a file with its bytes; any other URL serves a line naming it
        url, downloads = args[-1], json.loads(env["STANDIN_DOWNLOADS"])
        data = Path(downloads[url]).read_bytes() if url in downloads else served(url)
        call.path(call.arg_after("-o")).write_bytes(data)
        fetched.write_text(json.dumps({**(json.loads(fetched.read_text()) if fetched.exists() else {}),
                                       str(call.path(call.arg_after("-o")).resolve()): url}))
    elif name == "sha256sum":  # STANDIN_GENUINE: URL -> the sha256 of the real bytes there, which this machine
        urls = json.loads(fetched.read_text()) if fetched.exists() else {}  # cannot fetch
        source = urls.get(str(call.path(args[0]).resolve()))
        genuine = json.loads(env["STANDIN_GENUINE"])
        print(f"{genuine[source] if source in genuine else sha256(call.path(args[0]).read_bytes())}  {args[0]}",
              file=out)
    elif name == "git" and args[0] == "clone":
        call.path(args[-1]).mkdir(parents=True)
    elif name == "git" and args[2:] == ["rev-parse", "HEAD"]:  # STANDIN_COMMITS: what each clone names, by directory
        print(json.loads(env["STANDIN_COMMITS"])[Path(args[1]).name], file=out)
    elif name == "uname":
        print(env["STANDIN_KERNEL"], file=out)
    elif name == "gpg" and "--dearmor" in args:
        call.path(call.arg_after("-o")).write_bytes(call.path(args[-1]).read_bytes())
    elif name == "gpg" and "--fingerprint" in args:
        print(f"pub:-:4096:1:D58167303B789C72:::::::\nfpr:::::::::{env['STANDIN_GPG_FINGERPRINT']}:", file=out)
    elif name == "gpg" and "--show-keys" in args:  # STANDIN_KEYS: the URL a key came from -> its primary keys
        url = call.path(args[-1]).read_text().split()[-1]
        for i, fpr in enumerate(json.loads(env["STANDIN_KEYS"])[url]):
            print(f"pub:-:4096:1:{fpr[-16:]}:::::::\nfpr:::::::::{fpr}:\nsub:-:4096:1:{i:016X}:::::::\n"
                  f"fpr:::::::::{i:040X}:", file=out)
    elif name == "apt-cache" and args[0] == "madison":
        for package in args[1:]:
            for version in archive.get(package, []):
                print(f"{package:>12} | {version:>10} | https://snapshot.ubuntu.com/ubuntu/20250601T000000Z noble/main "
                      "amd64 Packages", file=out)
    elif name == "apt-cache" and args[0] == "show":
        if args[1] not in archive:
            return 100, "", ""
        print(f"Package: {args[1]}\nVersion: {archive[args[1]][-1]}\n", file=out)
    elif name == "apt-get" and "install" in args:  # STANDIN_DPKG_DRIFT: what dpkg ends up with instead of the pin
        files, drift = json.loads(env["STANDIN_PACKAGE_FILES"]), json.loads(env["STANDIN_DPKG_DRIFT"])
        if any(a.startswith("lustre-client-modules-") for a in args):  # STANDIN_LATE_DRIFT: what this install moves
            installed.update(json.loads(env["STANDIN_LATE_DRIFT"]))
        for arg in [a for a in args[args.index("install") + 1:] if not a.startswith("-")]:
            package, _, version = arg.partition("=")
            if package.endswith(".deb"):  # AWS's .deb URLs name the version: .../<version>/<package>.deb
                url = json.loads(fetched.read_text())[str(call.path(package).resolve())]
                package, version = Path(package).stem, url.split("/")[-2]
            installed[package] = drift.get(package, version or archive[package][-1])
            if not installed[package]:  # a drift to "": dpkg does not have it after all
                del installed[package]
            for path in files.get(package, []):
                Path(root + path).parent.mkdir(parents=True, exist_ok=True)
                Path(root + path).touch()
        dpkg.write_text(json.dumps(installed))
    elif name == "dpkg-query":  # the formats build_image.sh asks for
        fmt, packages = call.arg_after("-f"), args[args.index("-f") + 2:]
        if "source:Package" in fmt:
            for package, source in json.loads(env["STANDIN_KERNEL_PACKAGES"]).items():
                print(f"ii  {package} {source}", file=out)
        elif fmt == "${Version}":
            if packages[0] not in installed:
                return 1, "", ""
            print(installed[packages[0]], end="", file=out)
        else:
            if fmt != "${Package}\\t${db:Status-Abbrev}${Version}\\n":
                return 1, f"stand-in dpkg-query: unexpected format {fmt!r}\n", ""
            for package in packages:
                if package in installed:
                    print(f"{package}\tii {installed[package]}", file=out)
            if not set(packages) <= set(installed):
                return 1, "", out.getvalue()
    elif name == "tar":  # a GitHub tag archive: the tree of a configure script (Slurm) or a Makefile (pyxis)
        tree = call.path(call.arg_after("-C"))
        tree.mkdir(parents=True, exist_ok=True)
        if tree.name == "slurm":
            (tree / "configure").symlink_to(client)
    elif name == "make" and Path(call.arg_after("-C")).name == "nccl-tests":  # its tests, in its tree's build/
        built = call.path(call.arg_after("-C")) / "build" / "all_reduce_perf"
        built.parent.mkdir()
        built.touch(mode=0o755)
    elif name == "ldd":  # STANDIN_LDD_MISSING: the libraries the binary's loader would not find
        for library in json.loads(env["STANDIN_LDD_MISSING"]):
            print(f"\t{library} => not found", file=out)
        print("\tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f0000000000)", file=out)
    elif name == "make" and "install" in args:  # where the real Makefiles put what the script checks afterwards
        destdir = call.arg_after("install").removeprefix("DESTDIR=")
        if not destdir.startswith(root):
            return 1, f"stand-in make: DESTDIR {destdir!r} is outside {root}\n", ""
        if Path(call.arg_after("-C")).name == "pyxis":
            made = ["/usr/local/lib/slurm/spank_pyxis.so"]
        elif Path(call.arg_after("-C")).name == "enroot":  # STANDIN_ENROOT_PROFILE: whether its tree ships the profile
            made = ["/usr/bin/enroot", "/etc/enroot/enroot.conf"]
            made += ["/usr/share/enroot/apparmor.profile"] if env["STANDIN_ENROOT_PROFILE"] == "yes" else []
        else:  # Slurm, with the plugins its build dependencies allow (STANDIN_SLURM_WITHOUT: those it lacked)
            without = json.loads(env["STANDIN_SLURM_WITHOUT"])
            made = [f"/usr/lib/slurm/{p}" for p in ("mpi_pmix.so", "mpi_pmix_v5.so", "job_submit_lua.so",
                                                    "cgroup_v2.so", "proctrack_cgroup.so", "task_cgroup.so",
                                                    "auth_munge.so", "accounting_storage_mysql.so")
                    if p not in without]
            made += [f"/usr/lib/systemd/system/{u}" for u in ("slurmctld.service", "slurmd.service",
                                                              "slurmdbd.service", "sackd.service")]
            Path(destdir + "/usr/sbin").mkdir(parents=True, exist_ok=True)
            Path(destdir + "/usr/sbin/slurmd").symlink_to(client)
        for path in made:
            Path(destdir + path).parent.mkdir(parents=True, exist_ok=True)
            Path(destdir + path).touch(mode=0o755 if "/bin/" in path else 0o644)
    elif name == "slurmd" and args == ["-V"]:
        print(f"slurm {env['STANDIN_SLURM_BUILT']}", file=out)
    elif name == "getent":  # STANDIN_SLURM_UID: the uid of a slurm user the parent image already has
        return (0 if env["STANDIN_SLURM_UID"] else 2), "", ""
    elif name == "useradd":
        (state / "slurm-uid").write_text(call.arg_after("--uid"))
    elif name == "id":
        print(env["STANDIN_SLURM_UID"] or (state / "slurm-uid").read_text(), file=out)
    elif name == "systemctl" and args[0] == "cat":
        return (0 if env["STANDIN_DCGM_UNIT"] == "yes" else 1), "", ""
    elif name == "aa-enabled":
        return (0 if env["STANDIN_APPARMOR"] == "yes" else 1), "", ""
    elif name == "pip":  # the venv's pip: installs the requirements as distributions of the venv, none fetched
        drift = json.loads(env["STANDIN_PIP_DRIFT"])
        (site,) = call.path(call.argv0).parent.parent.glob("lib/python*/site-packages")
        pip_pins = [line.split()[0].split("==") for line in record["requirements"]]
        for distribution, version in pip_pins + [p.split("==") for p in drift.get("extra", [])]:
            version = drift.get(distribution, version)
            info = site / f"{distribution}-{version}.dist-info"
            info.mkdir()
            (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n")
    return 0, "", out.getvalue()


class StandinServer(socketserver.TCPServer):
    """The stand-ins' one interpreter: answers each client's call in turn (the build script runs one command at a
    time) on a loopback port, only for clients that present the run's token (the machine is shared)."""

    def __init__(self, env: dict[str, str]) -> None:
        super().__init__(("127.0.0.1", 0), StandinHandler)
        self.env, self.token = env, secrets.token_hex(16)
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)

    def __enter__(self) -> StandinServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
        self.server_close()
        self.thread.join()


class StandinHandler(socketserver.StreamRequestHandler):
    server: StandinServer
    timeout = 60

    def handle(self) -> None:
        # token, argv0, cwd, "=DEBIAN_FRONTEND" or "", "=LD_RUN_PATH" or "", argc, args...: each ends in a NUL.
        fields: list[str] = []
        while len(fields) < 6 or len(fields) < 6 + int(fields[5]):
            field = b""
            while not field.endswith(b"\0"):
                byte = self.rfile.read(1)
                if not byte:
                    return  # not a client of this run's: it hung up early
                field += byte
            fields.append(field[:-1].decode())
            if fields[0] != self.server.token:
                return
        _, argv0, cwd, frontend, ld_run_path, _, *args = fields
        env = dict(self.server.env)
        for variable, value in (("DEBIAN_FRONTEND", frontend), ("LD_RUN_PATH", ld_run_path)):
            if value:
                env[variable] = value.removeprefix("=")
        try:
            status, error, output = standin_answer(Call(argv0, Path(cwd), args, env))
        except Exception:  # a fault of the stand-in's own: the command fails with its traceback, for the test to show
            status, error, output = 1, traceback.format_exc(), ""
        self.wfile.write(f"{status}\n{len(error)}\n{error}{output}".encode())

# The BOM's pip wheel, standing in for pip's: run from the wheel (`python pip.whl/pip install pip.whl`), it installs a
# pip (the stand-in) into the venv that runs it, as pip's own bootstrap does.
PIP_WHEEL_MAIN = '''import json, os, sys
from pathlib import Path
bin_dir = Path(sys.executable).parent
(bin_dir / "pip").symlink_to(os.environ["STANDIN_PROGRAM"])
(site,) = bin_dir.parent.glob("lib/python*/site-packages")
(site / "pip-25.0.dist-info").mkdir()
(site / "pip-25.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\\nName: pip\\nVersion: 25.0\\n")
with open(os.environ["STANDIN_LOG"], "a") as log:
    log.write(json.dumps({"cmd": ["pip-wheel", *sys.argv[1:]], "manifest_existed": False}) + "\\n")
'''


def pip_wheel() -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as wheel:
        wheel.writestr(zipfile.ZipInfo("pip/__main__.py", date_time=(2025, 1, 1, 0, 0, 0)), PIP_WHEEL_MAIN)
    return out.getvalue()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def served(url: str) -> bytes:
    """What the stand-in curl serves for a URL it has no file for."""
    return f"stand-in download of {url}\n".encode()


# The bill of materials the script builds from in these tests: the real one, rendered for a shipped stack, so that a
# name the script reads and the BOM lacks (or one the BOM lists and the script ignores) fails here. Its sources'
# sha256s are of archives this machine cannot fetch: the stand-in sha256sum reports them for the stand-in downloads of
# those URLs, unless a test serves other bytes there (`downloads`).
BOM_STACK = ROOT / "stacks" / "Pulumi.team-a.yaml"


@functools.cache
def _rendered_bom(path: Path) -> str:
    return bom_spec.render(load_stack(path))


def real_bom(edit: Callable[[dict[str, Any]], None] | None = None, stack: Path = BOM_STACK) -> dict[str, Any]:
    """bom.json as `render` writes it for the stack; `edit` breaks a copy of it where a test needs a bad BOM."""
    bom: dict[str, Any] = json.loads(_rendered_bom(stack))
    if edit:
        edit(bom)
    return bom


BOM = real_bom()
PIP_URL = BOM["sources"]["pip"]["url"]


def genuine_digests(bom: dict[str, Any]) -> dict[str, str]:
    """URL -> the sha256 its real bytes have: the BOM's pins of its downloaded sources (not git's or docker's)."""
    return {s["url"]: s["sha256"] for s in bom["sources"].values() if s.get("sha256") and s["url"].startswith("https:")}


def pins() -> dict[str, str]:
    """The script's top-level NAME=value assignments, unquoted, with earlier ones expanded as bash would."""
    values: dict[str, str] = {}
    for m in re.finditer(r"^([A-Z][A-Z0-9_]*)=(\S*)", SCRIPT.read_text(), flags=re.M):
        values[m[1]] = re.sub(r"\$\{?([A-Z][A-Z0-9_]*)\}?", lambda v: values.get(v[1], v[0]), m[2].strip('"'))
    return values


def array(name: str) -> list[str]:
    """A top-level bash array of the script (NAME=(...), possibly over several lines), its words unquoted."""
    m = re.search(rf"^{name}=\((.*?)\)$", SCRIPT.read_text(), flags=re.M | re.S)
    assert m, name
    values = pins()
    return [re.sub(r"\$\{?([A-Z][A-Z0-9_]*)\}?", lambda v: values[v[1]], w.strip('"')) for w in m[1].split()]


@dataclass
class Run:
    returncode: int
    stderr: str
    calls: list[dict]
    root: Path
    bom: dict[str, Any]

    def commands(self, name: str) -> list[list[str]]:
        return [c["cmd"][1:] for c in self.calls if c["cmd"][0] == name]

    @property
    def manifest(self) -> Path:
        return self.root / settings.IMAGE_MANIFEST.lstrip("/")

    def installs(self) -> list[list[str]]:
        return [[a for a in c[c.index("install") + 1:] if not a.startswith("-")]
                for c in self.commands("apt-get") if "install" in c]


# The fixture below: runs the build script for a role, with the stand-ins' keyword arguments.
Build = Callable[..., Run]


def runner(tmp_path: Path) -> Build:
    """Run the build script with stand-ins. Seams, each forced by this machine: the commands above (no internet,
    a shared machine), GPUCLUSTER_IMAGE_ROOT (the script writes system paths, as root) and GPUCLUSTER_RETRY_BASE_MS
    (real back-off waits add up to minutes). `bom` edits the real BOM; `edits` changes the script's NAME=value lines;
    `archive` replaces what apt's indexes list (None: not at all); `drift` and `pip_drift` what dpkg and the venv end
    up with (`late_drift`: what installing the Lustre module changes); `downloads` what a URL serves; `agent`: the
    CloudWatch agent's version the parent image has; `enroot_commit`, `nccl_tests_commit`: what those tags name
    (default the BOM's); `nvidia_sdk`: the NVIDIA parent's files nccl-tests builds with; `ldd_missing`: the libraries
    the built all_reduce_perf would not load; `keep_root`: the image's files as the last run left them."""

    def run(role: str, *, bom: Callable[[dict[str, Any]], None] | None = None, fail: Sequence[tuple[str, int]] = (),
            gpu_tools: tuple[str, ...] = GPU_TOOLS, agent: str | None = None, apparmor: bool = True,
            neuron_tools: tuple[str, ...] | None = None, keys: dict[str, list[str]] | None = None,
            archive: dict[str, list[str] | None] | None = None, drift: dict[str, str] | None = None,
            pip_drift: dict[str, Any] | None = None, late_drift: dict[str, str] | None = None,
            downloads: dict[str, bytes] | None = None,
            slurm_without: Sequence[str] = (), slurm_built: str = bom_spec.SLURM_VERSION, slurm_uid: str = "",
            dcgm_unit: bool = True, nccl_dir: str | None = DLAMI_NCCL_DIR,
            kernel_packages: dict[str, str] = KERNEL_PACKAGES, enroot_profile: bool = True,
            enroot_commit: str | None = None, nccl_tests_commit: str | None = None,
            nvidia_sdk: tuple[str, ...] = NVIDIA_SDK, ldd_missing: Sequence[str] = (),
            pmix_lib: bool = True, steps: str | None = None, keep_root: bool = False,
            edits: dict[str, str] | None = None,
            stack: Path = BOM_STACK) -> Run:
        bin_dir, root, state, files = (tmp_path / d for d in ("bin", "root", "state", "files"))
        for d in (bin_dir, state, files) if keep_root else (bin_dir, root, state, files):
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir()
        standin = bin_dir / "standin"
        standin.write_text(STANDIN_CLIENT)
        standin.chmod(0o755)
        for name in STANDIN_NAMES:
            if name in gpu_tools or name not in GPU_TOOLS:
                (bin_dir / name).symlink_to(standin)
        if neuron_tools is not None:  # a Neuron image: its tools directory, with these in it
            tools = root / pins()["NEURON_BIN"].lstrip("/")
            tools.mkdir(parents=True)
            for tool in neuron_tools:
                (tools / tool).touch(mode=0o755)
        if agent:  # the parent image's package, as dpkg knows it
            (state / "installed.json").write_text(json.dumps({"amazon-cloudwatch-agent": agent}))
        if nccl_dir and "nvidia-smi" in gpu_tools:  # the DLAMI's aws-ofi-nccl
            (root / nccl_dir.lstrip("/")).mkdir(parents=True, exist_ok=keep_root)
            (root / nccl_dir.lstrip("/") / "libnccl-net.so").touch()
        for path in nvidia_sdk if "nvidia-smi" in gpu_tools else ():
            (root / path.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
            (root / path.lstrip("/")).touch(mode=0o755)
        bill = real_bom(bom, stack)
        (tmp_path / "bom.json").write_text(json.dumps(bill))
        served_files = {}
        for i, (url, data) in enumerate({PIP_URL: pip_wheel(), **(downloads or {})}.items()):
            served_files[url] = str(files / f"download-{i}")
            Path(served_files[url]).write_bytes(data)
        packages = bill["packages"]
        available = {name: [version] for name, version in packages.items()} | {f"lustre-client-modules-{KERNEL}":
                                                                               ["2.15.6-1fsx1"]}
        p = pins()
        env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "GPUCLUSTER_IMAGE_ROOT": str(root),
               "GPUCLUSTER_RETRY_BASE_MS": "10", "STANDIN_LOG": str(tmp_path / "calls.jsonl"),
               "STANDIN_PROGRAM": str(standin), "STANDIN_MANIFEST": settings.IMAGE_MANIFEST,
               "STANDIN_SNAPSHOT_CONF": p["SNAPSHOT_CONF"], "STANDIN_STATE": str(state),
               "STANDIN_FAIL": json.dumps(list(fail)), "STANDIN_KERNEL": KERNEL,
               "STANDIN_GPG_FINGERPRINT": p["CWAGENT_KEY_FINGERPRINT"],
               "STANDIN_KEYS": json.dumps(keys or {f"{p['GRAFANA_REPO']}/gpg.key": [p["GRAFANA_KEY_FINGERPRINT"]]}),
               "STANDIN_APPARMOR": "yes" if apparmor else "no", "STANDIN_DOWNLOADS": json.dumps(served_files),
               "STANDIN_ARCHIVE": json.dumps({name: versions for name, versions in (available | (archive or {})).items()
                                              if versions is not None}),
               "STANDIN_PACKAGE_FILES": json.dumps({"libpmix-dev": [PMIX_LIB] if pmix_lib else []}),
               "STANDIN_ENROOT_PROFILE": "yes" if enroot_profile else "no",
               "STANDIN_COMMITS": json.dumps({
                   "enroot": enroot_commit or bill["sources"]["enroot"].get("commit", ""),
                   "nccl-tests": nccl_tests_commit or bill["sources"]["nccl-tests"].get("commit", "")}),
               "STANDIN_LDD_MISSING": json.dumps(list(ldd_missing)),
               "STANDIN_GENUINE": json.dumps({url: digest for url, digest in genuine_digests(bill).items()
                                              if url not in (downloads or {})}),
               "STANDIN_DPKG_DRIFT": json.dumps(drift or {}), "STANDIN_LATE_DRIFT": json.dumps(late_drift or {}),
               "STANDIN_PIP_DRIFT": json.dumps(pip_drift or {}),
               "STANDIN_SLURM_WITHOUT": json.dumps(list(slurm_without)), "STANDIN_SLURM_BUILT": slurm_built,
               "STANDIN_SLURM_UID": slurm_uid, "STANDIN_DCGM_UNIT": "yes" if dcgm_unit else "no",
               "STANDIN_KERNEL_PACKAGES": json.dumps(kernel_packages)}
        if steps is not None:
            env["GPUCLUSTER_BUILD_STEPS"] = steps
        text = SCRIPT.read_text()
        for name, value in (edits or {}).items():
            text, n = re.subn(rf"^{name}=\S*", f"{name}={value}", text, flags=re.M)
            assert n == 1, name
        script = tmp_path / "build_image.sh"
        script.write_text(text)
        (tmp_path / "calls.jsonl").write_text("")
        with StandinServer(env) as server:
            env |= {"STANDIN_PYTHON": sys.executable, "STANDIN_PORT": str(server.server_address[1]),
                    "STANDIN_TOKEN": server.token}
            done = subprocess.run(["bash", str(script), role, str(tmp_path / "bom.json")], env=env,
                                  capture_output=True, text=True, timeout=120)
        calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
        return Run(done.returncode, done.stderr, calls, root, bill)

    return run


@pytest.fixture
def build(tmp_path: Path) -> Build:
    return runner(tmp_path)


def shared_build(tmp_path_factory: pytest.TempPathFactory, role: str, name: str = "", **options: Any) -> Run:
    """One build of the role from the real BOM (with the runner's `options`, under `name`) for the whole session:
    under xdist the first worker to need it builds it under a lock in the session's directory, the others read what it
    left there."""
    name = name or role
    session = xdist_session_dir(tmp_path_factory)
    if session is None:
        return runner(tmp_path_factory.mktemp(name))(role, **options)
    saved = session / f"image-build-{name}.json"
    with open(saved.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not saved.exists():
            (where := session / f"image-build-{name}").mkdir()
            run = runner(where)(role, **options)
            saved.write_text(json.dumps({**run.__dict__, "root": str(run.root)}))
    fields = json.loads(saved.read_text())
    return Run(**{**fields, "root": Path(fields["root"])})


# One build of each role, shared by the tests that only read it (shared_build).
@pytest.fixture(scope="module")
def head(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return shared_build(tmp_path_factory, "head")


@pytest.fixture(scope="module")
def compute(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return shared_build(tmp_path_factory, "compute")


@pytest.fixture(scope="module")
def neuron(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """A compute image on the Neuron Deep Learning AMI: Neuron's tools, no NVIDIA driver (so no NCCL either)."""
    return shared_build(tmp_path_factory, "compute", "neuron", gpu_tools=(), neuron_tools=NEURON_TOOLS)


# --- the script as text ----------------------------------------------------------------------------------------------

def test_shellcheck_is_clean() -> None:
    shellcheck = shutil.which("shellcheck")
    assert shellcheck, "shellcheck is missing: install Debian's shellcheck package (make test's system packages)"
    done = subprocess.run([shellcheck, str(SCRIPT)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout
    done = subprocess.run([shellcheck, "-"], input=STANDIN_CLIENT, capture_output=True, text=True)
    assert done.returncode == 0, f"the stand-ins' client (STANDIN_CLIENT):\n{done.stdout}"


def test_paths_are_the_settings_contract() -> None:
    assert pins()["MANIFEST"] == settings.IMAGE_MANIFEST
    assert pins()["IMAGE_BOM"] == settings.IMAGE_BOM
    assert pins()["VENV"] == str(Path(settings.IMAGE_MANIFEST).parent / "venv")


def test_usage_without_a_role(build: Build) -> None:
    run = build("")
    assert run.returncode == 2 and "usage" in run.stderr and run.calls == []


def test_slurm_is_configured_for_the_paths_the_nodes_use() -> None:
    """slurm.conf and plugstack.conf in /etc/slurm (bootstrap.py writes them there), daemons in /usr/sbin, the units
    Slurm generates in systemd's directory; PMIx from Ubuntu's libpmix-dev, lua for JobSubmitPlugins=lua."""
    configure = array("SLURM_CONFIGURE")
    assert {"--prefix=/usr", "--sysconfdir=/etc/slurm", "--with-lua", "--enable-cgroupv2",
            "--with-systemdsystemunitdir=/usr/lib/systemd/system",
            f"--with-pmix={pins()['PMIX_DIR']}"} <= set(configure)
    assert PMIX_LIB.startswith(pins()["PMIX_DIR"] + "/")
    from gpucluster.node import bootstrap
    from gpucluster.render import slurm

    assert str(bootstrap.SLURM_ETC) == "/etc/slurm"
    plugstack = slurm.PLUGSTACK_CONF.split()[-1]
    assert plugstack == "/usr/local/lib/slurm/spank_pyxis.so" and f"[[ -f $ROOT{plugstack} ]]" in SCRIPT.read_text()


# --- head -------------------------------------------------------------------------------------------------------------

def test_head_build_installs_the_bom_from_the_snapshot_and_writes_the_manifest_last(head: Run) -> None:
    p = pins()
    run = head
    assert run.returncode == 0, run.stderr
    bom = run.bom
    apt = run.commands("apt-get")
    assert all(c[:2] == ["-o", "DPkg::Lock::Timeout=120"] for c in apt), apt
    assert all(c["debian_frontend"] == "noninteractive" for c in run.calls if c["cmd"][0] == "apt-get")
    # Every apt call under the BOM's snapshot (APT::Snapshot), which the image does not keep.
    assert {c["snapshot"] for c in run.calls if c["cmd"][0] in ("apt-get", "apt-cache")} == {
        f'APT::Snapshot "{bom["ubuntu_snapshot"]}";\n'}
    assert not (run.root / p["SNAPSHOT_CONF"].lstrip("/")).exists()
    # Two index refreshes: the second takes from its snapshot a source whose server the first one learnt.
    assert [c for c in apt if "update" in c] == [["-o", "DPkg::Lock::Timeout=120", "-q", "-y", "update",
                                                 "--error-on=any"]] * 2
    installs = run.installs()
    assert installs[0] == [f"{name}={bom['packages'][name]}" for name in bom["roles"]["head"]["apt"]]
    assert installs[1] == [f"lustre-client-modules-{KERNEL}"]  # no kernel-following meta package
    assert len(installs) == 2
    # Availability of every pin was asked before the install, in one call.
    madison = [c[1:] for c in run.commands("apt-cache") if c[0] == "madison"]
    assert madison == [bom["roles"]["head"]["apt"]]
    assert [c["cmd"][-len(madison[0]):] for c in run.calls if c["cmd"][:2] == ["dpkg-query", "-W"]][0] == madison[0]
    lustre = (run.root / "etc/apt/sources.list.d/fsxlustreclientrepo.list").read_text()
    assert lustre == (f"deb [signed-by=/usr/share/keyrings/fsx-ubuntu-public-key.gpg] {p['LUSTRE_REPO']} noble main\n")
    # Grafana's repository, signed by the pinned key, known to apt before its index refreshes; Grafana kept pinned.
    grafana_key = f"{p['GRAFANA_REPO']}/gpg.key"
    assert p["GRAFANA_REPO"] == "https://apt.grafana.com"
    grafana = (run.root / "etc/apt/sources.list.d/grafana.list").read_text()
    assert grafana == f"deb [signed-by=/usr/share/keyrings/grafana.gpg] {p['GRAFANA_REPO']} stable main\n"
    assert (run.root / "usr/share/keyrings/grafana.gpg").read_bytes() == served(grafana_key)
    prefs = (run.root / "etc/apt/preferences.d/gpucluster-grafana").read_text()
    assert prefs == f"Package: grafana\nPin: version {bom['packages']['grafana']}\nPin-Priority: 1001\n"
    order = [c["cmd"] for c in run.calls if c["cmd"][0] in ("gpg", "apt-get")]
    checked, updated = (next(i for i, c in enumerate(order) if word in c) for word in ("--show-keys", "update"))
    assert checked < updated
    # The venv: pip from the BOM's wheel, then exactly the BOM's distributions, each by its hashes, nothing else.
    (bootstrap,) = run.commands("pip-wheel")
    assert bootstrap[0] == "install" and "--no-index" in bootstrap
    assert bootstrap[-1].endswith("/" + PIP_URL.rsplit("/", 1)[-1])
    (pip,) = [c for c in run.calls if c["cmd"][0] == "pip"]
    assert {"--require-hashes", "--no-deps", "--only-binary=:all:"} <= set(pip["cmd"])
    assert pip["requirements"] == [f"{n}=={bom['packages'][n]} --hash={bom['pip_hashes'][n][0]}"
                                   for n in bom["roles"]["head"]["pip"]]
    assert run.commands("systemctl") == [["disable", "--now", "munge", "slurmctld", "slurmdbd", "mariadb", "prometheus",
                                          "prometheus-alertmanager", "prometheus-node-exporter", "grafana-server"]]
    assert not any(c["manifest_existed"] for c in run.calls)
    manifest = json.loads(run.manifest.read_text())
    assert manifest["role"] == "head" and manifest["kernel"] == KERNEL and manifest["built_at"].endswith("Z")
    bom_file = run.root / settings.IMAGE_BOM.lstrip("/")
    assert json.loads(bom_file.read_text()) == bom  # the image carries its BOM, and the manifest its digest
    assert manifest["bom_sha256"] == sha256(bom_file.read_bytes())
    assert manifest["versions"]["slurm"] == bom["slurm_version"] == bom_spec.SLURM_VERSION
    assert manifest["versions"]["lustre_client_modules"] == "2.15.6-1fsx1"
    # The installed set is the BOM's, checked once more, whole, before the manifest.
    queries = [c["cmd"][4:] for c in run.calls if c["cmd"][:2] == ["dpkg-query", "-W"] and "${Package}" in c["cmd"][3]]
    assert queries[-1] == bom["roles"]["head"]["apt"]


@pytest.mark.parametrize("fingerprints", [["0" * 40], [], ["B53AE77BADB630A683046005963FA27710458545", "1" * 40]],
                         ids=["another key", "no key", "a second key beside it"])
def test_grafana_repository_with_any_key_but_the_pinned_one_is_not_added(build: Build, fingerprints: list[str]) -> None:
    p = pins()
    assert p["GRAFANA_KEY_FINGERPRINT"] == "B53AE77BADB630A683046005963FA27710458545"  # Grafana's, since 2023
    run = build("head", keys={f"{p['GRAFANA_REPO']}/gpg.key": fingerprints})
    assert run.returncode != 0 and "Grafana's apt key is" in run.stderr
    assert not (run.root / "etc/apt/sources.list.d/grafana.list").exists()
    assert not (run.root / "usr/share/keyrings/grafana.gpg").exists()
    assert not run.commands("apt-get") and not run.manifest.exists()


def test_a_step_that_fails_twice_is_retried_with_doubling_waits(build: Build) -> None:
    run = build("head", fail=[("apt-get -o DPkg::Lock::Timeout=120 -q -y update", 2)])
    assert run.returncode == 0, run.stderr
    assert sum("update" in c for c in run.commands("apt-get")) == 4  # the first refresh twice more
    assert re.findall(r"attempt (\d) of 5 failed, next in ([\d.]+)s", run.stderr) == [("1", "0.010"), ("2", "0.020")]
    assert run.manifest.exists()


def test_a_step_that_keeps_failing_stops_the_build_without_a_manifest(build: Build) -> None:
    run = build("head", fail=[("--no-install-recommends lustre-client-modules-", 99)])
    assert run.returncode != 0
    assert sum(f"lustre-client-modules-{KERNEL}" in c for c in run.commands("apt-get")) == 5
    waits = re.findall(r"next in ([\d.]+)s: apt_get install --no-install-recommends lustre", run.stderr)
    assert waits == ["0.010", "0.020", "0.040", "0.080"]
    assert "giving up after 5 attempts" in run.stderr
    assert not run.manifest.exists() and not run.commands("systemctl")


def test_an_old_manifest_does_not_survive_a_failed_rebuild(build: Build) -> None:
    assert build("head").manifest.exists()
    run = build("head", fail=[("mariadb-server", 99)], keep_root=True)
    assert run.returncode != 0 and not run.manifest.exists()


# --- the bill of materials, and what got installed against it ---------------------------------------------------------

def test_a_version_apt_does_not_list_fails_naming_it_before_anything_is_installed(build: Build) -> None:
    run = build("compute", archive={"munge": ["0.5.15-4ubuntu0.2"], "libpmix-dev": []})
    assert run.returncode != 0 and not run.manifest.exists()
    (failed,) = [line for line in run.stderr.splitlines() if "FAILED" in line]
    assert f"not in Ubuntu's snapshot {run.bom['ubuntu_snapshot']}" in failed
    absent = [f"{n}={BOM['packages'][n]}" for n in run.bom["roles"]["compute"]["apt"] if n in ("munge", "libpmix-dev")]
    assert len(absent) == 2 and failed.endswith(" ".join(absent))
    assert not run.installs()


@pytest.mark.parametrize("drift", [{"munge": "0.5.16-1"}, {"iptables": "1.8.10-3ubuntu2+local"},
                                   {"build-essential": ""}])
def test_an_installed_version_other_than_the_boms_fails_naming_the_package(build: Build, drift: dict[str, str]) -> None:
    ((name, got),) = drift.items()
    run = build("compute", drift=drift)
    got = got or "not installed"
    assert run.returncode != 0 and not run.manifest.exists()
    differ = f"installed packages differ from the bill of materials: {name} {got} (the BOM: {BOM['packages'][name]})"
    assert differ in run.stderr
    assert not run.commands("make")  # nothing built on it


def test_a_package_a_later_step_moves_fails_the_build_before_the_manifest(build: Build) -> None:
    run = build("head", late_drift={"python3-yaml": "6.0.2-1"})
    assert run.returncode != 0 and not run.manifest.exists()
    assert f"python3-yaml 6.0.2-1 (the BOM: {BOM['packages']['python3-yaml']})" in run.stderr


@pytest.mark.parametrize("drift, named", [({"sympy": "1.15.0"}, "sympy 1.15.0 (the BOM: 1.14.0)"),
                                          ({"extra": ["numpy==2.3.5"]}, "numpy 2.3.5 (not in the BOM)")],
                         ids=["another version", "one the BOM does not list"])
def test_a_venv_other_than_the_boms_fails_naming_the_distribution(build: Build, drift: dict[str, Any],
                                                                   named: str) -> None:
    run = build("compute", pip_drift=drift)
    assert run.returncode != 0 and named in run.stderr and not run.manifest.exists()


def test_every_problem_of_the_bom_at_once(build: Build) -> None:
    def broken(bom: dict[str, Any]) -> None:
        bom["ubuntu_snapshot"] = "2025-06-01"
        bom["roles"]["compute"]["apt"].append("nccl-tests")
        del bom["pip_hashes"]["torch"]
        bom["sources"]["pyxis"]["sha256"] = "0"
        bom["sources"]["enroot"]["commit"] = "v4.2.1"
        bom["roles"]["compute"]["sources"].remove("dcgm-exporter")
        bom["roles"]["compute"]["sources"].append("gdrcopy")
        bom["sources"]["gdrcopy"] = {**bom["sources"]["pyxis"], "sha256": "1" * 64}
        bom["roles"]["compute"]["apt"].remove("liblua5.4-dev")

    run = build("compute", bom=broken)
    assert run.returncode != 0 and not run.calls
    for problem in ("ubuntu_snapshot: '2025-06-01' is not YYYYMMDDTHHMMSSZ", "roles.compute: nccl-tests is not in "
                    "packages", "pip_hashes: no sha256 hash for torch", "sources.pyxis: no url and sha256",
                    "sources.enroot: commit 'v4.2.1' is not a 40-hex commit",
                    "roles.compute.sources: no dcgm-exporter, which build_image.sh installs",
                    "roles.compute.sources: gdrcopy is not a source build_image.sh installs",
                    r"roles.compute.apt: no package named liblua5\.[1-4]-dev, which build_image.sh needs"):
        assert problem in run.stderr, problem


@pytest.mark.parametrize("stack", STACK_FILES, ids=lambda p: p.name)
def test_every_shipped_stacks_bom_builds_both_roles(build: Build, head: Run, compute: Run, stack: Path) -> None:
    """The whole build of each role on the BOM `render` writes for the stack: the script finds every source, apt
    package and pip distribution it names, and each source the BOM gives a role is one it installs (read_bom fails
    otherwise; the tests of the shared builds check that the role's apt and pip lists are installed whole). The script
    reads nothing of the parent images: a stack whose BOM differs from team-a's only there shares team-a's builds."""
    def without_parents(bom: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in bom.items() if k not in ("parent_image", "parent_images")}

    same = without_parents(real_bom(stack=stack)) == without_parents(BOM)
    for run in (head, compute) if same else (build("head", stack=stack), build("compute", stack=stack)):
        assert run.returncode == 0, run.stderr
        assert run.manifest.exists()
        assert without_parents(run.bom) == without_parents(real_bom(stack=stack))


def test_the_boms_lua_is_one_slurms_configure_finds() -> None:
    """Slurm's configure (auxdir/x_ac_lua.m4) asks pkg-config for lua 5.4, 5.3, 5.2, 5.1 in turn, and builds
    job_submit/lua only with one; the role lists carry exactly one Lua's headers, on both roles."""
    for role in ("head", "compute"):
        (lua,) = [n for n in BOM["roles"][role]["apt"] if n.startswith("liblua")]
        assert re.fullmatch(r"liblua5\.[1-4]-dev", lua)
    assert "job_submit_lua.so" in array("SLURM_PLUGINS")


def test_a_missing_bom_stops_the_build_before_anything(build: Build, tmp_path: Path) -> None:
    run = build("head", steps="snapshot")
    assert run.returncode == 0  # the file given is read
    done = subprocess.run(["bash", str(SCRIPT), "head", str(tmp_path / "absent.json")], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "GPUCLUSTER_IMAGE_ROOT": str(tmp_path / "root")})
    assert done.returncode != 0 and f"no bill of materials at {tmp_path / 'absent.json'}" in done.stderr


@pytest.mark.parametrize("name", ["slurm", "pyxis", "pip"])
def test_a_source_that_is_not_what_the_bom_pins_stops_the_build(build: Build, name: str) -> None:
    url = BOM["sources"][name]["url"]
    run = build("compute", downloads={url: b"another release\n"})
    assert run.returncode != 0 and not run.manifest.exists()
    assert f"{name} from {url} has sha256 {sha256(b'another release' + bytes([10]))}, not " in run.stderr


def test_the_step_seam_runs_only_named_steps_and_never_the_manifest(build: Build) -> None:
    run = build("compute", steps="snapshot apt_packages")
    assert run.returncode == 0, run.stderr
    signed = array("SIGNED_DEBS")
    assert run.installs() == [[f"{n}={BOM['packages'][n]}" for n in run.bom["roles"]["compute"]["apt"]
                               if n not in signed]]
    assert not run.manifest.exists() and not run.commands("make") and not run.commands("curl")
    for steps in ("snapshot manifest", "snapshot rm"):
        run = build("compute", steps=steps)
        assert run.returncode != 0 and "is not a step of this script" in run.stderr and not run.calls


# --- Slurm, pyxis, enroot ---------------------------------------------------------------------------------------------

def test_slurm_is_built_from_the_boms_source_the_same_on_head_and_compute(head: Run, compute: Run) -> None:
    def built(run: Run) -> tuple[list[list[str]], list[list[str]]]:
        assert run.returncode == 0, run.stderr
        assert BOM["sources"]["slurm"]["url"] in [c[-1] for c in run.commands("curl")]
        configure = [c for c in run.calls if c["cmd"][0] == "configure"]
        assert [Path(c["cwd"]).name for c in configure] == ["slurm"]
        makes = [c[2:] for c in run.commands("make") if c[1].endswith("/slurm")]
        assert makes[-1] == ["install", f"DESTDIR={run.root}"]
        assert run.commands("slurmd") == [["-V"]]  # the installed daemon says its version
        return [c["cmd"][1:] for c in configure], makes[:-1]

    on_head, on_compute = built(head), built(compute)
    assert on_head == on_compute and on_head[0] == [array("SLURM_CONFIGURE")]


def test_the_built_slurm_must_say_the_boms_version(build: Build) -> None:
    run = build("compute", slurm_built="24.11.4")
    assert run.returncode != 0 and not run.manifest.exists()
    assert f"the built Slurm says 'slurm 24.11.4', the BOM slurm {bom_spec.SLURM_VERSION}" in run.stderr


@pytest.mark.parametrize("role, plugin", [("compute", "mpi_pmix.so"), ("compute", "job_submit_lua.so"),
                                          ("head", "auth_munge.so"),
                                          ("head", "job_submit_lua.so"), ("compute", "cgroup_v2.so"),
                                          ("head", "accounting_storage_mysql.so")])
def test_slurm_without_a_plugin_the_cluster_uses_stops_the_build(build: Build, role: str, plugin: str) -> None:
    run = build(role, slurm_without=[plugin])
    assert run.returncode != 0 and f"Slurm was built without {plugin}" in run.stderr and not run.manifest.exists()


def test_compute_slurm_needs_no_mysql_plugin(build: Build) -> None:
    assert build("compute", slurm_without=["accounting_storage_mysql.so"]).returncode == 0


def test_slurm_needs_pmix_from_the_boms_apt_list(build: Build) -> None:
    def without_pmix(bom: dict[str, Any]) -> None:
        bom["roles"]["compute"]["apt"].remove("libpmix-dev")

    run = build("compute", bom=without_pmix)
    assert run.returncode != 0 and "roles.compute.apt: no package named libpmix-dev" in run.stderr and not run.calls
    run = build("compute", pmix_lib=False)  # a libpmix-dev without the library where Slurm's configure is pointed
    assert run.returncode != 0 and f"no {PMIX_LIB}" in run.stderr and not run.commands("make")


def test_the_slurm_user_has_one_uid_on_every_image(build: Build, compute: Run) -> None:
    run = compute
    uid = pins()["SLURM_UID"]
    assert run.commands("groupadd") == [["--system", "--gid", uid, "slurm"]]
    (useradd,) = run.commands("useradd")
    assert useradd[useradd.index("--uid") + 1] == uid and useradd[-1] == "slurm"
    slurm_only = "snapshot apt_packages slurm"
    assert build("compute", slurm_uid=uid, steps=slurm_only).returncode == 0  # the parent's own, when it is that one
    run = build("compute", slurm_uid="999", steps=slurm_only)
    assert run.returncode != 0 and f"the parent image's slurm user has uid 999, not {uid}" in run.stderr


@pytest.mark.parametrize("role", ["head", "compute"])
def test_pyxis_is_built_against_the_slurm_just_installed_on_both_roles(role: str,
                                                                       request: pytest.FixtureRequest) -> None:
    run: Run = request.getfixturevalue(role)
    assert run.returncode == 0, run.stderr
    makes = [c for c in run.commands("make") if c[1].endswith("/pyxis")]
    assert makes == [["-C", makes[0][1], "install", f"DESTDIR={run.root}"]]
    order = [c["cmd"][2] for c in run.calls if c["cmd"][0] == "make" and "install" in c["cmd"]]
    assert [Path(d).name for d in order][:2] == ["slurm", "pyxis"]  # (enroot's after, on compute nodes)
    assert (run.root / "usr/local/lib/slurm/spank_pyxis.so").is_file()
    assert run.bom["sources"]["pyxis"]["url"] in [c[-1] for c in run.commands("curl")]


def test_enroot_is_built_from_the_boms_commit_with_its_apparmor_profile(head: Run, compute: Run) -> None:
    """enroot's BOM pin is a commit (no archive's digest could be had): its tag cloned with its submodules, HEAD checked
    against the commit before anything is built, then built and installed as its .deb and enroot+caps are."""
    run, enroot = compute, compute.bom["sources"]["enroot"]
    assert run.returncode == 0, run.stderr
    assert re.fullmatch(r"[0-9a-f]{40}", enroot["commit"]) and enroot["sha256"] is None
    (clone,) = [c for c in run.commands("git") if c[0] == "clone" and enroot["url"] in c]
    assert clone[:-1] == ["clone", "-q", "--depth", "1", "--branch", f"v{enroot['version']}", "--recurse-submodules",
                          enroot["url"]]
    checked = next(i for i, c in enumerate(run.calls) if c["cmd"][1:] == ["-C", clone[-1], "rev-parse", "HEAD"])
    makes = [(i, c["cmd"][1:]) for i, c in enumerate(run.calls) if c["cmd"][0] == "make" and c["cmd"][2] == clone[-1]]
    assert checked < makes[0][0]
    assert [c[c.index("sysconfdir=/etc") + 1:] for _, c in makes] == [["all"], ["install", f"DESTDIR={run.root}"],
                                                                       ["setcap", f"DESTDIR={run.root}"]]
    assert os.access(run.root / "usr/bin/enroot", os.F_OK) and (run.root / "etc/enroot/enroot.conf").is_file()
    assert (run.root / "etc/apparmor.d/enroot").is_file()
    assert run.commands("apparmor_parser") == [["-r", "-T", "-W", f"{run.root}/etc/apparmor.d/enroot"]]
    assert json.loads(run.manifest.read_text())["versions"]["enroot"] == f"{enroot['version']} {enroot['commit']}"
    assert not head.commands("git") and "enroot" not in json.dumps(head.commands("make"))


@pytest.mark.parametrize("name", ["enroot", "nccl-tests"])
def test_a_clone_at_another_commit_than_the_boms_stops_the_build(build: Build, name: str) -> None:
    run = build("compute", **{f"{name.replace('-', '_')}_commit": "0" * 40})
    source = run.bom["sources"][name]
    assert run.returncode != 0 and not run.manifest.exists()
    assert (f"{name}'s tag v{source['version']} at {source['url']} is commit {'0' * 40}, not the BOM's "
            f"{source['commit']}") in run.stderr
    assert not [c for c in run.commands("make") if c[1].endswith(f"/{name}")]


def test_enroot_profile_is_installed_but_not_loaded_without_apparmor(build: Build) -> None:
    run = build("compute", apparmor=False)
    assert run.returncode == 0, run.stderr
    assert (run.root / "etc/apparmor.d/enroot").is_file() and not run.commands("apparmor_parser")


def test_enroot_without_an_apparmor_profile_stops_the_build(build: Build) -> None:
    run = build("compute", enroot_profile=False)
    assert run.returncode != 0 and "enroot brought no AppArmor profile" in run.stderr and not run.manifest.exists()


# --- Lustre and the kernel ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("role", ["head", "compute"])
def test_the_kernel_meta_packages_are_held_after_the_lustre_module(build: Build, role: str,
                                                                   request: pytest.FixtureRequest) -> None:
    run: Run = request.getfixturevalue(role)
    assert run.returncode == 0, run.stderr
    assert run.commands("apt-mark") == [["hold", "linux-aws", "linux-image-aws", "linux-headers-aws"]]
    order = [c["cmd"] for c in run.calls if c["cmd"][0] in ("apt-get", "apt-mark")]
    held = next(i for i, c in enumerate(order) if c[0] == "apt-mark")
    assert order[held - 1][-1] == f"lustre-client-modules-{KERNEL}"  # right after the module, in the same build
    run = build(role, kernel_packages={"linux-base": "linux-base"}, steps="snapshot apt_packages lustre")
    assert run.returncode == 0 and run.commands("apt-mark") == []


@pytest.mark.parametrize("role", ["head", "compute"])
def test_a_kernel_without_a_lustre_module_stops_the_build_naming_it(build: Build, role: str) -> None:
    run = build(role, archive={f"lustre-client-modules-{KERNEL}": None})
    assert run.returncode != 0 and not run.manifest.exists()
    assert f"no lustre-client-modules-{KERNEL}: no Lustre client for kernel {KERNEL}" in run.stderr
    assert not any("lustre-client-modules" in a for i in run.installs() for a in i) and not run.commands("apt-mark")


def test_a_pinned_lustre_module_is_installed_at_its_pin(build: Build) -> None:
    def pin(bom: dict[str, Any]) -> None:
        bom["packages"][f"lustre-client-modules-{KERNEL}"] = "2.15.6-1fsx1"

    run = build("compute", bom=pin)
    assert run.returncode == 0, run.stderr
    assert [f"lustre-client-modules-{KERNEL}=2.15.6-1fsx1"] in run.installs()


# --- NVIDIA: DCGM's host engine, NCCL's EFA plugin, dcgm-exporter --------------------------------------------------

def test_compute_build_fetches_only_pinned_and_verified_artifacts(compute: Run) -> None:
    p = pins()
    run = compute
    assert run.returncode == 0, run.stderr
    agent = run.bom["packages"]["amazon-cloudwatch-agent"]
    cw = f"{p['CWAGENT_URL']}/ubuntu/amd64/{agent}/amazon-cloudwatch-agent.deb"
    sources = run.bom["sources"]
    assert [c[-1] for c in run.commands("curl")] == [
        p["LUSTRE_KEY_URL"], sources["slurm"]["url"], sources["pyxis"]["url"],
        f"{p['CWAGENT_URL']}/assets/amazon-cloudwatch-agent.gpg", cw, f"{cw}.sig", sources["pip"]["url"]]
    assert any("--verify" in c for c in run.commands("gpg"))
    # The agent's signed .deb at the BOM's version, beside the apt list's other packages.
    assert [c for c in run.installs() if any(a.endswith(".deb") for a in c)] == [[c for c in run.installs()
                                                                                  if "amazon" in str(c)][-1]]
    assert ["--allow-downgrades"] in [[a for a in c if a == "--allow-downgrades"] for c in run.commands("apt-get")]
    assert os.readlink(run.root / "usr/local/bin/torchrun") == f"{p['VENV']}/bin/torchrun"
    assert run.commands("systemctl")[-1] == ["disable", "--now", "munge", "slurmd", "prometheus-node-exporter"]
    assert not any(c["manifest_existed"] for c in run.calls)
    # dcgm-exporter's image by its digest (a tag can move), pulled at the build: the boot needs no registry.
    dcgm_exporter = f"{sources['dcgm-exporter']['url']}@sha256:{sources['dcgm-exporter']['sha256']}"
    assert re.fullmatch(r"nvcr\.io/nvidia/k8s/dcgm-exporter:[34]\.\d+\.\d+-\d+\.\d+\.\d+-ubuntu\d\d\.04"
                        r"@sha256:[0-9a-f]{64}", dcgm_exporter)
    # Pulled by digest, then tagged with the name the boot's unit runs (settings.DCGM_EXPORTER_IMAGE).
    assert run.commands("docker") == [["pull", "-q", dcgm_exporter],
                                      ["tag", dcgm_exporter, "gpucluster/dcgm-exporter:image"]]
    manifest = json.loads(run.manifest.read_text())
    assert manifest["role"] == "compute"
    versions = manifest["versions"]
    assert versions["dcgm_exporter"] == dcgm_exporter and versions["neuron_monitor"] == "none (no Neuron tools)"
    assert versions["slurm"] == bom_spec.SLURM_VERSION and versions["dcgm"] == "from the parent image"
    assert versions["pyxis"] == sources["pyxis"]["version"]
    assert versions["cloudwatch_agent"] == agent
    # Every apt package and pip distribution of the role's lists installed at its version, and nothing else fetched.
    queries = [c["cmd"][4:] for c in run.calls if c["cmd"][:2] == ["dpkg-query", "-W"] and "${Package}" in c["cmd"][3]]
    assert queries[-1] == run.bom["roles"]["compute"]["apt"]
    (pip,) = [c for c in run.calls if c["cmd"][0] == "pip"]
    assert [line.split("==")[0] for line in pip["requirements"]] == run.bom["roles"]["compute"]["pip"]


def test_dcgm_host_engine_is_enabled_when_the_parent_has_it(build: Build, compute: Run) -> None:
    run = compute
    assert run.returncode == 0, run.stderr
    systemctl = run.commands("systemctl")
    assert systemctl[:2] == [["cat", "nvidia-dcgm.service"], ["enable", "--now", "nvidia-dcgm.service"]]
    assert json.loads(run.manifest.read_text())["versions"]["dcgm_engine"] == "enabled"
    run = build("compute", dcgm_unit=False)
    assert run.returncode == 0, run.stderr
    assert ["enable", "--now", "nvidia-dcgm.service"] not in run.commands("systemctl")
    assert json.loads(run.manifest.read_text())["versions"]["dcgm_engine"] == "none"


@pytest.mark.parametrize("directory", [DLAMI_NCCL_DIR, "/opt/amazon/ofi-nccl/lib"])
def test_nccls_efa_plugin_is_on_the_loaders_path(build: Build, compute: Run, directory: str) -> None:
    run = compute if directory == DLAMI_NCCL_DIR else build("compute", nccl_dir=directory)
    assert run.returncode == 0, run.stderr
    conf = run.root / pins()["OFI_NCCL_CONF"].lstrip("/")
    assert conf.parent.as_posix().endswith("/etc/ld.so.conf.d") and conf.read_text() == f"{directory}\n"
    assert run.commands("ldconfig")  # the cache rebuilt after
    assert json.loads(run.manifest.read_text())["versions"]["nccl_net_plugin"] == directory


def test_an_nvidia_image_without_nccls_efa_plugin_fails(build: Build, neuron: Run) -> None:
    run = build("compute", nccl_dir=None)
    assert run.returncode != 0 and "the parent image lacks aws-ofi-nccl" in run.stderr and not run.manifest.exists()
    run = neuron
    assert run.returncode == 0, run.stderr  # a Trainium image has no NCCL
    assert not (run.root / pins()["OFI_NCCL_CONF"].lstrip("/")).exists()


def test_nccl_tests_is_built_at_the_boms_commit_against_the_images_mpi_cuda_and_nccl(compute: Run) -> None:
    """nccl-tests' tag cloned, its HEAD checked against the BOM's commit before make, built with MPI (the EFA
    installer's Open MPI) and the parent's CUDA and NCCL, with a run path to them; all_reduce_perf where verify runs
    it (settings.ALL_REDUCE_PERF), and the manifest says which."""
    run, source = compute, compute.bom["sources"]["nccl-tests"]
    assert run.returncode == 0, run.stderr
    assert re.fullmatch(r"[0-9a-f]{40}", source["commit"]) and source["sha256"] is None
    assert pins()["ALL_REDUCE_PERF"] == settings.ALL_REDUCE_PERF
    tree = f"{run.root}{pins()['NCCL_TESTS_DIR']}"
    assert settings.ALL_REDUCE_PERF == f"{pins()['NCCL_TESTS_DIR']}/build/all_reduce_perf"
    (clone,) = [c for c in run.commands("git") if c[0] == "clone" and source["url"] in c]
    assert clone == ["clone", "-q", "--depth", "1", "--branch", f"v{source['version']}", source["url"], tree]
    checked = next(i for i, c in enumerate(run.calls) if c["cmd"][1:] == ["-C", tree, "rev-parse", "HEAD"])
    (made,) = [(i, c) for i, c in enumerate(run.calls) if c["cmd"][:3] == ["make", "-C", tree]]
    assert checked < made[0]
    cuda, mpi, nccl = (str(Path(path).parent.parent) for path in NVIDIA_SDK)
    assert made[1]["cmd"][5:] == ["MPI=1", f"MPI_HOME={run.root}{mpi}", f"CUDA_HOME={run.root}{cuda}",
                                  f"NCCL_HOME={run.root}{nccl}"]
    # the run path names the image's directories, not the test's prefix
    assert made[1]["ld_run_path"] == f"{mpi}/lib:{nccl}/lib:{cuda}/lib64"
    assert os.access(run.root / settings.ALL_REDUCE_PERF.lstrip("/"), os.X_OK)
    assert run.commands("ldd") == [[f"{run.root}{settings.ALL_REDUCE_PERF}"]]
    assert json.loads(run.manifest.read_text())["versions"]["nccl_tests"] == f"{source['version']} {source['commit']}"


def test_nccl_tests_is_for_nvidia_images_only(neuron: Run, head: Run) -> None:
    run = neuron
    assert run.returncode == 0, run.stderr
    url = run.bom["sources"]["nccl-tests"]["url"]
    assert not [c for c in run.commands("git") if url in c] and not run.commands("ldd")
    assert json.loads(run.manifest.read_text())["versions"]["nccl_tests"] == "none"
    assert head.returncode == 0 and "nccl-tests" not in json.dumps(head.calls)


@pytest.mark.parametrize("missing", NVIDIA_SDK)
def test_an_nvidia_parent_without_what_nccl_tests_builds_with_stops_the_build(build: Build, missing: str) -> None:
    run = build("compute", nvidia_sdk=tuple(path for path in NVIDIA_SDK if path != missing))
    assert run.returncode != 0 and not run.manifest.exists()
    assert Path(missing).name in run.stderr and "the parent image lacks" in run.stderr
    assert not [c for c in run.commands("make") if c[1].endswith("/nccl-tests")]


def test_an_all_reduce_perf_that_cannot_load_its_libraries_stops_the_build(build: Build) -> None:
    run = build("compute", ldd_missing=("libmpi.so.40", "libnccl.so.2"))
    assert run.returncode != 0 and not run.manifest.exists()
    assert f"{settings.ALL_REDUCE_PERF} cannot load libmpi.so.40 libnccl.so.2" in run.stderr


def test_cloudwatch_agent_with_another_signing_key_is_not_installed(build: Build) -> None:
    run = build("compute", edits={"CWAGENT_KEY_FINGERPRINT": "0" * 40})
    assert run.returncode != 0 and "CloudWatch agent key" in run.stderr
    assert not any("amazon-cloudwatch-agent.deb" in a for c in run.commands("apt-get") for a in c)
    assert not run.manifest.exists()


def test_cloudwatch_agent_already_in_the_image_is_kept_at_the_boms_version_only(build: Build) -> None:
    version = BOM["packages"]["amazon-cloudwatch-agent"]
    run = build("compute", agent=version)
    assert run.returncode == 0, run.stderr
    assert not any("amazoncloudwatch-agent" in c[-1] for c in run.commands("curl"))
    assert json.loads(run.manifest.read_text())["versions"]["cloudwatch_agent"] == f"{version} from the parent image"
    run = build("compute", agent="1.300050.0b1000")  # another release in the parent: the BOM's replaces it
    assert run.returncode == 0, run.stderr
    assert f"{pins()['CWAGENT_URL']}/ubuntu/amd64/{version}/amazon-cloudwatch-agent.deb" in [
        c[-1] for c in run.commands("curl")]
    assert json.loads(run.manifest.read_text())["versions"]["cloudwatch_agent"] == version


def test_nvidia_image_without_dcgm_fails_and_neuron_image_needs_none(build: Build, neuron: Run) -> None:
    run = build("compute", gpu_tools=("nvidia-smi", "docker", "nvidia-ctk"))
    assert run.returncode != 0 and "without DCGM" in run.stderr and run.calls == [] and not run.manifest.exists()
    run = neuron
    assert run.returncode == 0, run.stderr
    versions = json.loads(run.manifest.read_text())["versions"]
    assert versions["dcgm"] == "none (no NVIDIA driver)" and versions["dcgm_exporter"] == "none"
    assert versions["neuron_monitor"] == "from the parent image"
    assert not run.commands("docker") and ["cat", "nvidia-dcgm.service"] not in run.commands("systemctl")


@pytest.mark.parametrize("missing", ["docker", "nvidia-ctk"])
def test_nvidia_image_without_its_container_runtime_fails_first(build: Build, missing: str) -> None:
    """dcgm-exporter runs in a container: docker and NVIDIA's container toolkit are the DLAMI's, never installed."""
    run = build("compute", gpu_tools=tuple(t for t in GPU_TOOLS if t != missing))
    assert run.returncode != 0 and "without docker or the NVIDIA container toolkit" in run.stderr
    assert run.calls == [] and not run.manifest.exists()


@pytest.mark.parametrize("missing", NEURON_TOOLS)
def test_neuron_image_without_neuron_monitor_fails_first(build: Build, missing: str) -> None:
    tools = tuple(t for t in NEURON_TOOLS if t != missing)
    run = build("compute", gpu_tools=(), neuron_tools=tools)
    assert run.returncode != 0 and f"a Neuron image without {pins()['NEURON_BIN']}/{missing}" in run.stderr
    assert run.calls == [] and not run.manifest.exists()


def test_dcgm_exporter_pull_is_retried_and_its_failure_stops_the_build(build: Build) -> None:
    run = build("compute", fail=[("docker pull", 2)])
    assert run.returncode == 0, run.stderr
    assert [c[0] for c in run.commands("docker")] == ["pull", "pull", "pull", "tag"]
    run = build("compute", fail=[("docker pull", 99)])
    assert run.returncode != 0 and not run.manifest.exists()
    assert not [c for c in run.commands("systemctl") if c[0] == "disable"]


# --- the NodeImage component under the mock runtime ---------------------------------------------------------------

def _children(declared: Sequence[Declared], image: Declared, suffix: str) -> list[Declared]:
    return [d for d in declared if d.parent_urn == image.urn and d.type.endswith(suffix)]


def _expected_keys(stack: Stack) -> set[str]:
    spec = stack.spec
    kinds = {p.itype.accelerator.kind for p in spec.pools if not p.ami_id and p.itype.accelerator}
    return ({"head"} if not spec.head_node.ami_id else set()) | {f"compute-{k}" for k in kinds}


def _config(path: Path) -> dict:
    return json.loads(json.dumps(stack_config(load_stack(path))))


def _templates(declared: Sequence[Declared]) -> dict[str, dict]:
    return {lt.inputs["tagSpecifications"][0]["tags"]["gpucluster:pool"]: lt.inputs
            for lt in of_type(declared, "ec2/launchTemplate:LaunchTemplate")}


def test_one_image_per_role_and_accelerator_kind_needed(shipped: tuple[Stack, tuple[Declared, ...]]) -> None:
    from components.image import component_documents

    stack, declared = shipped
    images = {d.name.removeprefix(f"{stack.cluster_name}-"): d
              for d in declared if d.type == "gpucluster:image:NodeImage"}
    assert set(images) == _expected_keys(stack)
    assert set(images) == {i.key for i in cost.estimate(stack).images}
    for image in images.values():
        role = image.name.removeprefix(f"{stack.cluster_name}-").split("-")[0]
        parts = len(component_documents(role, SCRIPT.read_text()))
        assert len(_children(declared, image, "component:Component")) == 1 + parts  # the BOM, the script's parts
        for suffix in ("imageRecipe:ImageRecipe", "image:Image", "iam/role:Role",
                       "infrastructureConfiguration:InfrastructureConfiguration", "iam/instanceProfile:InstanceProfile",
                       "distributionConfiguration:DistributionConfiguration"):
            assert len(_children(declared, image, suffix)) == 1, (image.name, suffix)
    for d in declared:
        if d.type.startswith("aws:imagebuilder/"):
            assert d.parent_type == "gpucluster:image:NodeImage", d.name


def test_recipe_parent_image_and_encrypted_root(shipped: tuple[Stack, tuple[Declared, ...]]) -> None:
    from gpucluster.plan import planned_ami_id

    stack, declared = shipped
    for key, image in ((d.name.removeprefix(f"{stack.cluster_name}-"), d) for d in declared
                       if d.type == "gpucluster:image:NodeImage"):
        (recipe,) = _children(declared, image, "imageRecipe:ImageRecipe")
        # The parent release the stack names, looked up by exact name and owner in the stack's region: an AMI id,
        # never the floating `ssm:` parameter of the newest release.
        parent = stack.spec.image.parent_images.parent(bom_spec.parent_role(key.partition("-")[2] or None))
        assert recipe.inputs["parentImage"] == planned_ami_id(f"{stack.region}/{parent.owner}/{parent.name}")
        assert re.fullmatch(r"ami-[0-9a-f]{17}", recipe.inputs["parentImage"])
        assert parent.name in recipe.inputs["description"]
        (root,) = recipe.inputs["blockDeviceMappings"]
        assert root["deviceName"] == "/dev/sda1"
        assert root["ebs"]["encrypted"] == "true" and root["ebs"]["volumeType"] == "gp3"
        assert root["ebs"]["volumeSize"] <= (100 if key == "head" else min(p.root_volume_gib for p in stack.spec.pools))
        # The BOM first, then the script's parts in the order they write it; the first part keeps the image's name.
        names = [c.name for c in _children(declared, image, "component:Component")]
        in_order = [f"{image.name}-bom", image.name, *(f"{image.name}-{i}" for i in range(2, len(names)))]
        assert sorted(names) == sorted(in_order)
        assert recipe.inputs["components"] == [{"componentArn": f"arn:aws:imagebuilder:{stack.region}:123456789012:"
                                                               f"component/{name}/1.0.0/1"} for name in in_order]


def test_build_instance_private_imdsv2_and_least_privilege(shipped: tuple[Stack, tuple[Declared, ...]]) -> None:
    stack, declared = shipped
    subnet_id = stack.spec.network.subnet_id or next(
        planned_id(s, stack.region) for s in of_type(declared, "ec2/subnet:Subnet") if s.name.endswith("-private"))
    (sg,) = [g for g in of_type(declared, "ec2/securityGroup:SecurityGroup") if g.name.endswith("-cluster")]
    for image in (d for d in declared if d.type == "gpucluster:image:NodeImage"):
        (infra,) = _children(declared, image, "infrastructureConfiguration:InfrastructureConfiguration")
        assert infra.inputs["subnetId"] == subnet_id
        assert infra.inputs["securityGroupIds"] == [planned_id(sg, stack.region)]
        assert infra.inputs["instanceMetadataOptions"]["httpTokens"] == "required"
        assert infra.inputs["terminateInstanceOnFailure"] is True
        # Several types of the one shape: an AZ without one of them (or out of it) still bakes.
        assert infra.inputs["instanceTypes"] == list(catalog.IMAGE_BUILD_INSTANCE_TYPES)
        assert len(set(infra.inputs["instanceTypes"])) >= 2
        assert infra.inputs["resourceTags"]["gpucluster:stack"] == stack.name  # the build's cost is the stack's
        (profile,) = _children(declared, image, "iam/instanceProfile:InstanceProfile")
        assert infra.inputs["instanceProfileName"] == profile.name
        attached = _children(declared, image, "iam/rolePolicyAttachment:RolePolicyAttachment")
        assert {a.inputs["policyArn"] for a in attached} == {"arn:aws:iam::aws:policy/AmazonSSMManagedInstanceCore",
                                                              "arn:aws:iam::aws:policy/EC2InstanceProfileForImageBuilder"}
        assert not _children(declared, image, "iam/rolePolicy:RolePolicy")
        (dist,) = _children(declared, image, "distributionConfiguration:DistributionConfiguration")
        (target,) = dist.inputs["distributions"]
        ami = target["amiDistributionConfiguration"]
        assert target["region"] == stack.region
        assert ami["name"] == f"{image.name}-{{{{ imagebuilder:buildDate }}}}"
        assert ami["amiTags"]["gpucluster:cluster"] == stack.cluster_name
        # The image says which bill of materials made it: sha256 of bom.json's bytes as `render` writes them.
        assert ami["amiTags"]["gpucluster:bom"] == hashlib.sha256(bom_spec.render(stack).encode()).hexdigest()


def test_component_documents_carry_exactly_the_bom_and_the_build_script(
        shipped: tuple[Stack, tuple[Declared, ...]], tmp_path: Path) -> None:
    """Each under Image Builder's inline limit; their write steps, run here in the recipe's order with the paths moved
    into tmp_path, reproduce bom.json (as `render` writes it) and the script byte for byte; the last one runs the
    script, when the BOM is in place."""
    from components.image import COMPONENT_DATA_LIMIT, SCRIPT_ON_IMAGE

    stack, declared = shipped
    image_dir = str(Path(settings.IMAGE_MANIFEST).parent)
    assert Path(settings.IMAGE_BOM).parent == Path(SCRIPT_ON_IMAGE).parent == Path(image_dir)
    for image in (d for d in declared if d.type == "gpucluster:image:NodeImage"):
        role = image.name.removeprefix(f"{stack.cluster_name}-").split("-")[0]
        target = tmp_path / image.name
        (recipe,) = _children(declared, image, "imageRecipe:ImageRecipe")
        by_arn = {planned_outputs(c, stack.region)["arn"]: c for c in _children(declared, image, "component:Component")}
        components = [by_arn[c["componentArn"]] for c in recipe.inputs["components"]]  # the recipe's order
        for i, component in enumerate(components):
            assert component.inputs["platform"] == "Linux" and len(component.inputs["data"]) <= COMPONENT_DATA_LIMIT
            steps = yaml.safe_load(component.inputs["data"])["phases"][0]["steps"]
            (write,) = steps[0]["inputs"]["commands"]
            first = write.startswith("install -d")
            # The path only in the lines before the file: install -d and cat > in a file's first part, cat >> after.
            *head, body = write.split("\n", 2 if first else 1)
            assert re.fullmatch(rf"cat {'>' if first else '>>'} ({SCRIPT_ON_IMAGE}|{settings.IMAGE_BOM}) <<'\w+'",
                                head[-1]), head
            head = [line.replace(image_dir, str(target)) for line in head]
            subprocess.run(["bash", "-c", "\n".join([*head, body])], check=True)
            runs = [step["inputs"]["commands"] for step in steps[1:]]
            assert runs == ([[f"bash {SCRIPT_ON_IMAGE} {role}"]] if i == len(components) - 1 else [])
            if i == len(components) - 1:
                assert (target / "bom.json").exists()  # written before the script runs
        assert (target / "build_image.sh").read_bytes() == SCRIPT.read_bytes()
        assert (target / "bom.json").read_text() == bom_spec.render(stack)


def test_a_script_over_the_inline_limit_is_split_between_lines() -> None:
    from components.image import COMPONENT_DATA_LIMIT, component_documents

    script = "".join(f"echo line {i} {'x' * 70}\n" for i in range(600))  # about 50,000 characters
    documents = component_documents("head", script)
    assert len(documents) >= 4 and all(len(d) <= COMPONENT_DATA_LIMIT for d in documents)
    parts = [yaml.safe_load(d)["phases"][0]["steps"][0]["inputs"]["commands"][0] for d in documents]
    assert "".join(part.split("\n", 2 if i == 0 else 1)[-1].removesuffix("GPUCLUSTER_BUILD_SCRIPT\n")
                   for i, part in enumerate(parts)) == script


def test_templates_and_head_boot_the_baked_images(shipped: tuple[Stack, tuple[Declared, ...]]) -> None:
    from gpucluster.plan import planned_ami_id

    stack, declared = shipped
    for pool in stack.spec.pools:
        image = f"{stack.cluster_name}-compute-{pool.accelerator.kind}"
        assert _templates(declared)[pool.name]["imageId"] == planned_ami_id(image), pool.name
    (head,) = of_type(declared, "ec2/instance:Instance")
    assert head.inputs["ami"] == planned_ami_id(f"{stack.cluster_name}-head")
    assert re.fullmatch(r"ami-[0-9a-f]{17}", head.inputs["ami"])


def test_an_ami_id_wins_and_is_not_built() -> None:
    """team-b with its Trainium pool and head node on images another stack baked: only the NVIDIA image is built."""
    config = _config(ROOT / "stacks" / "Pulumi.team-b.yaml")
    cluster = config["gpucluster:cluster"]
    cluster["head_node"]["ami_id"] = "ami-0123456789abcdef0"
    next(p for p in cluster["pools"] if p["name"] == "trn1")["ami_id"] = "ami-0fedcba9876543210"
    stack = validate("team-b", config)
    declared = run_program(stack, pulumi_program())
    assert {d.name for d in declared if d.type == "gpucluster:image:NodeImage"} == {"gpucluster-team-b-compute-nvidia"}
    assert [i.key for i in cost.estimate(stack).images] == ["compute-nvidia"]
    templates = _templates(declared)
    assert templates["trn1"]["imageId"] == "ami-0fedcba9876543210"
    (head,) = of_type(declared, "ec2/instance:Instance")
    assert head.inputs["ami"] == "ami-0123456789abcdef0"


def test_a_pinned_pool_beside_a_baked_one_of_the_same_kind() -> None:
    stack, declared = planned(FIXTURES / "Pulumi.existing.yaml")  # p5en-cb pins an AMI, b200 does not
    from gpucluster.plan import planned_ami_id

    templates = _templates(declared)
    assert templates["p5en-cb"]["imageId"] == "ami-0a1b2c3d4e5f60718"
    assert templates["b200"]["imageId"] == planned_ami_id("gpucluster-existing-compute-nvidia")


def test_build_false_declares_no_image_builder_resources() -> None:
    from gpucluster.plan import planned_ami_id

    config = _config(ROOT / "stacks" / "Pulumi.team-b.yaml")
    config["gpucluster:cluster"]["image"] = {"build": False}
    stack = validate("team-b", config)
    declared = run_program(stack, pulumi_program())
    assert not [d for d in declared if "imagebuilder" in d.type or d.type == "gpucluster:image:NodeImage"]
    templates = _templates(declared)
    # Every node boots the exact parent release the BOM pins (never the newest one through an SSM parameter) and
    # builds its software from the bundle's bom.json at first boot (tests/test_bootstrap.py).
    parents = stack.spec.image.parent_images
    for pool, parent in (("trn1", parents.neuron), ("g6e", parents.gpu)):
        assert templates[pool]["imageId"] == planned_ami_id(f"{stack.region}/{parent.owner}/{parent.name}")
        assert re.fullmatch(r"ami-[0-9a-f]{17}", templates[pool]["imageId"])
    (head,) = of_type(declared, "ec2/instance:Instance")  # the exact Ubuntu release, as it is
    assert head.inputs["ami"] == planned_ami_id(f"{stack.region}/{parents.head.owner}/{parents.head.name}")


def test_component_documents_refuse_what_aws_or_awstoe_would_mangle() -> None:
    from components.image import component_documents

    script = SCRIPT.read_text()
    for bad in (script.rstrip("\n"), script + "echo {{ build.x }}\n", script + "GPUCLUSTER_BUILD_SCRIPT\n",
                script + "#" * 16000 + "\n"):  # the last: a line no document can hold
        with pytest.raises(ValueError):
            component_documents("compute", bad)


def test_each_build_logs_to_a_group_the_stack_owns() -> None:
    """Image Builder's own default group (/aws/imagebuilder/<recipe>) would outlive the stack, unexpiring."""
    _, declared = planned(ROOT / "stacks" / "Pulumi.team-a.yaml")
    groups = {d.name: d for d in of_type(declared, "cloudwatch/logGroup:LogGroup")}
    for image in of_type(declared, "imagebuilder/image:Image"):
        group = groups[f"{image.name}-build-log"]
        assert group.inputs["name"] == f"/aws/imagebuilder/{image.name}" and group.inputs["retentionInDays"] == 30
        assert image.inputs["loggingConfiguration"] == {"logGroupName": group.inputs["name"]}
        assert not group.retain_on_delete


def test_the_image_tags_dcgm_exporter_by_the_name_the_boot_runs() -> None:
    """build_image.sh pulls NVIDIA's image by digest and tags it; bootstrap's unit runs settings.DCGM_EXPORTER_IMAGE."""
    from gpucluster.contract import settings

    script = (ROOT / "gpucluster" / "node" / "build_image.sh").read_text()
    assert re.search(rf"^DCGM_EXPORTER_LOCAL={re.escape(settings.DCGM_EXPORTER_IMAGE)}\s", script, re.M)
    assert 'docker tag "$DCGM_EXPORTER" "$DCGM_EXPORTER_LOCAL"' in script
