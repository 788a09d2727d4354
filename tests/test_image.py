"""The node image: gpucluster/node/build_image.sh, run here with stand-ins for what needs the internet, and the
NodeImage component under the mock runtime for every shipped stack."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from conftest import FIXTURES, ROOT, of_type, planned
from gpucluster.contract import settings
from gpucluster.plan import Declared, planned_id, planned_outputs, run_program
from gpucluster.project import pulumi_program
from gpucluster.spec import bom, catalog, cost
from gpucluster.spec.model import Stack, load_stack, stack_config, validate

SCRIPT = ROOT / "gpucluster" / "node" / "build_image.sh"
KERNEL = "6.8.0-1021-aws"
GPU_TOOLS = ("nvidia-smi", "dcgmi", "docker", "nvidia-ctk")  # the NVIDIA Deep Learning AMI's
STANDIN_NAMES = ("apt-get", "curl", "git", "make", "gpg", "systemctl", "uname", "python3", "aa-enabled",
                 "apparmor_parser", *GPU_TOOLS)
ENROOT_CPPFLAGS = "-DALLOW_SPECULATION -DINHERIT_FDS"  # the standard flavour, as NVIDIA builds its enroot .deb

# One program behind every stand-in command; it records each call (with what it saw) as a JSON line.
STANDIN = r'''#!{python}
"""Stand-in for a command this machine cannot run for real: it has no internet (apt, downloads, git, pip), and
a package manager, systemd or a kernel module here would change a machine others share."""
import json, os, sys
from pathlib import Path

name, args = Path(sys.argv[0]).name, sys.argv[1:]
env = os.environ
call = " ".join([name, *args])
root = env["GPUCLUSTER_IMAGE_ROOT"]
record = {{"cmd": [name, *args], "manifest_existed": Path(root + "{manifest}").exists(),
          "debian_frontend": env.get("DEBIAN_FRONTEND")}}
if name == "pip" and "--constraint" in args:
    record["constraints"] = Path(args[args.index("--constraint") + 1]).read_text().split()
if name == "make":
    record["cppflags"] = env.get("CPPFLAGS")
state = Path(env["STANDIN_STATE"])
for i, (pattern, times) in enumerate(json.loads(env.get("STANDIN_FAIL", "[]"))):
    if pattern in call:
        seen = state / f"fail-{{i}}"
        count = int(seen.read_text()) if seen.exists() else 0
        if count < times:
            seen.write_text(str(count + 1))
            record["failed"] = True
with open(env["STANDIN_LOG"], "a") as log:
    log.write(json.dumps(record) + "\n")
if record.get("failed"):
    sys.exit(1)

def arg_after(flag):
    return args[args.index(flag) + 1]

if name == "curl":
    Path(arg_after("-o")).write_text(f"stand-in download of {{args[-1]}}\n")
elif name == "uname":
    print(env["STANDIN_KERNEL"])
elif name == "gpg" and "--dearmor" in args:
    Path(arg_after("-o")).write_bytes(Path(args[-1]).read_bytes())
elif name == "gpg" and "--fingerprint" in args:
    print(f"pub:-:4096:1:D58167303B789C72:::::::\nfpr:::::::::{{env['STANDIN_GPG_FINGERPRINT']}}:")
elif name == "gpg" and "--show-keys" in args:  # STANDIN_KEYS: the URL a key came from -> its primary keys
    url = Path(args[-1]).read_text().split()[-1]
    for i, fpr in enumerate(json.loads(env["STANDIN_KEYS"])[url]):
        print(f"pub:-:4096:1:{{fpr[-16:]}}:::::::\nfpr:::::::::{{fpr}}:\nsub:-:4096:1:{{i:016X}}:::::::\n"
              f"fpr:::::::::{{i:040X}}:")
elif name == "git" and "clone" in args:  # the remote: STANDIN_GIT_TAGS, "REPO TAG" -> the commit the tag names
    tag = f"{{args[-2]}} {{arg_after('--branch')}}"
    if tag not in json.loads(env["STANDIN_GIT_TAGS"]):
        sys.exit(f"fatal: Remote branch {{tag}} not found in upstream origin")
    Path(args[-1]).mkdir(parents=True)
    (Path(args[-1]) / ".standin-tag").write_text(tag)
elif name == "git" and "rev-parse" in args:
    print(json.loads(env["STANDIN_GIT_TAGS"])[(Path(arg_after("-C")) / ".standin-tag").read_text()])
elif name == "make" and "install" in args:  # where the real Makefiles put what the script checks afterwards
    make = {{k: v for k, v in (a.split("=", 1) for a in args if "=" in a)}}
    destdir = make.get("DESTDIR", "")
    if not destdir.startswith(root):
        sys.exit(f"stand-in make: DESTDIR {{destdir!r}} is outside {{root}}")
    if Path(arg_after("-C")).name == "pyxis":
        made = [destdir + "/usr/local/lib/slurm/spank_pyxis.so"]
    else:  # enroot's Makefile: its defaults for what the command line leaves out
        prefix = make.get("prefix", "/usr/local")
        exec_prefix = make.get("exec_prefix", prefix)
        datadir = make.get("datadir", make.get("datarootdir", prefix + "/share"))
        made = [destdir + make.get("bindir", exec_prefix + "/bin") + "/enroot",
                destdir + make.get("sysconfdir", prefix + "/etc") + "/enroot/enroot.conf",
                destdir + datadir + "/enroot/apparmor.profile"]
    for path in map(Path, made):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(mode=0o755)
elif name == "aa-enabled":
    sys.exit(0 if env["STANDIN_APPARMOR"] == "yes" else 1)
elif name == "python3" and args[:2] == ["-m", "venv"]:
    bin_dir = Path(args[-1]) / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    (bin_dir / "pip").symlink_to(sys.argv[0])
'''


def pins() -> dict[str, str]:
    """The script's top-level NAME=value assignments, unquoted, with earlier ones expanded as bash would."""
    values: dict[str, str] = {}
    for m in re.finditer(r"^([A-Z][A-Z0-9_]*)=(\S*)", SCRIPT.read_text(), flags=re.M):
        values[m[1]] = re.sub(r"\$\{?([A-Z][A-Z0-9_]*)\}?", lambda v: values.get(v[1], v[0]), m[2].strip('"'))
    return values


def upstream_tags() -> dict[str, str]:
    """What the stand-in git's remotes answer: each pinned tag names the pinned commit."""
    p = pins()
    return {f"{p['ENROOT_REPO']} {p['ENROOT_TAG']}": p["ENROOT_COMMIT"],
            f"{p['PYXIS_REPO']} {p['PYXIS_TAG']}": p["PYXIS_COMMIT"]}


@dataclass
class Run:
    returncode: int
    stderr: str
    calls: list[dict]
    root: Path

    def commands(self, name: str) -> list[list[str]]:
        return [c["cmd"][1:] for c in self.calls if c["cmd"][0] == name]

    @property
    def manifest(self) -> Path:
        return self.root / settings.IMAGE_MANIFEST.lstrip("/")


# The fixture below: runs the build script for a role, with the stand-ins' keyword arguments.
Build = Callable[..., Run]


@pytest.fixture
def build(tmp_path: Path) -> Build:
    """Run the build script with stand-ins. Seams, each forced by this machine: the commands above (no internet,
    a shared machine), GPUCLUSTER_IMAGE_ROOT (the script writes system paths, as root) and GPUCLUSTER_RETRY_BASE_MS
    (real back-off waits add up to minutes). `tags` changes what a remote's tag names (upstream_tags)."""

    def run(role: str, *, fail: Sequence[tuple[str, int]] = (), gpu_tools: tuple[str, ...] = GPU_TOOLS,
            edits: dict[str, str] | None = None, agent_present: bool = False, tags: dict[str, str] | None = None,
            apparmor: bool = True, neuron_tools: tuple[str, ...] | None = None,
            keys: dict[str, list[str]] | None = None) -> Run:
        bin_dir, root, state = tmp_path / "bin", tmp_path / "root", tmp_path / "state"
        for d in (bin_dir, root, state):
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir()
        standin = bin_dir / "standin"
        standin.write_text(STANDIN.format(python=sys.executable, manifest=settings.IMAGE_MANIFEST))
        standin.chmod(0o755)
        for name in STANDIN_NAMES:
            if name in gpu_tools or name not in GPU_TOOLS:
                (bin_dir / name).symlink_to(standin)
        if neuron_tools is not None:  # a Neuron image: its tools directory, with these in it
            tools = root / pins()["NEURON_BIN"].lstrip("/")
            tools.mkdir(parents=True)
            for tool in neuron_tools:
                (tools / tool).touch(mode=0o755)
        if agent_present:
            ctl = root / "opt/aws/amazon-cloudwatch-agent/bin/amazon-cloudwatch-agent-ctl"
            ctl.parent.mkdir(parents=True)
            ctl.touch(mode=0o755)
        p = pins()
        text = SCRIPT.read_text()
        for name, value in (edits or {}).items():
            text, n = re.subn(rf"^{name}=\S*", f"{name}={value}", text, flags=re.M)
            assert n == 1, name
        script = tmp_path / "build_image.sh"
        script.write_text(text)
        env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "GPUCLUSTER_IMAGE_ROOT": str(root),
               "GPUCLUSTER_RETRY_BASE_MS": "10", "STANDIN_LOG": str(tmp_path / "calls.jsonl"),
               "STANDIN_STATE": str(state), "STANDIN_FAIL": json.dumps(list(fail)), "STANDIN_KERNEL": KERNEL,
               "STANDIN_GPG_FINGERPRINT": p["CWAGENT_KEY_FINGERPRINT"],
               "STANDIN_KEYS": json.dumps(keys or {f"{p['GRAFANA_REPO']}/gpg.key": [p["GRAFANA_KEY_FINGERPRINT"]]}),
               "STANDIN_GIT_TAGS": json.dumps({**upstream_tags(), **(tags or {})}),
               "STANDIN_APPARMOR": "yes" if apparmor else "no"}
        (tmp_path / "calls.jsonl").write_text("")
        done = subprocess.run(["bash", str(script), role], env=env, capture_output=True, text=True, timeout=60)
        calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
        return Run(done.returncode, done.stderr, calls, root)

    return run


# --- the script as text ----------------------------------------------------------------------------------------------

def test_shellcheck_is_clean() -> None:
    shellcheck = shutil.which("shellcheck")
    assert shellcheck, "shellcheck is missing: install Debian's shellcheck package (make test's system packages)"
    done = subprocess.run([shellcheck, str(SCRIPT)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


def test_manifest_path_is_the_settings_contract() -> None:
    assert pins()["MANIFEST"] == settings.IMAGE_MANIFEST
    assert pins()["VENV"] == str(Path(settings.IMAGE_MANIFEST).parent / "venv")


def test_usage_without_a_role(build: Build) -> None:
    run = build("")
    assert run.returncode == 2 and "usage" in run.stderr and run.calls == []


# --- head -------------------------------------------------------------------------------------------------------------

def test_head_build_installs_pinned_packages_once_and_writes_the_manifest_last(build: Build) -> None:
    p = pins()
    run = build("head")
    assert run.returncode == 0, run.stderr
    apt = run.commands("apt-get")
    assert all(c[:2] == ["-o", "DPkg::Lock::Timeout=120"] for c in apt), apt
    assert all(c["debian_frontend"] == "noninteractive" for c in run.calls if c["cmd"][0] == "apt-get")
    assert [c for c in apt if "update" in c] == [["-o", "DPkg::Lock::Timeout=120", "-q", "-y", "update",
                                                 "--error-on=any"]]
    installs = [c[c.index("install") + 1:] for c in apt if "install" in c]
    assert installs[0] == ["--no-install-recommends", f"munge={p['MUNGE_VERSION']}",
                           f"slurmctld={p['SLURM_VERSION']}", f"slurmdbd={p['SLURM_VERSION']}",
                           f"slurm-client={p['SLURM_VERSION']}", f"mariadb-server={p['MARIADB_VERSION']}",
                           f"python3-boto3={p['BOTO3_VERSION']}", f"python3-venv={p['PYTHON3_VENV_VERSION']}",
                           f"python3-yaml={p['PYYAML_VERSION']}", "iptables",  # the lockdown's
                           f"prometheus={p['PROMETHEUS_VERSION']}",
                           f"prometheus-alertmanager={p['ALERTMANAGER_VERSION']}",
                           f"prometheus-node-exporter={p['NODE_EXPORTER_VERSION']}", f"grafana={p['GRAFANA_VERSION']}"]
    assert installs[1] == ["--no-install-recommends", f"lustre-client-modules-{KERNEL}"]  # no kernel-following meta
    assert len(installs) == 2
    prefs = (run.root / "etc/apt/preferences.d/gpucluster-slurm").read_text()
    assert prefs == f"Package: src:slurm-wlm\nPin: version {p['SLURM_VERSION']}\nPin-Priority: 1001\n"
    lustre = (run.root / "etc/apt/sources.list.d/fsxlustreclientrepo.list").read_text()
    assert lustre == (f"deb [signed-by=/usr/share/keyrings/fsx-ubuntu-public-key.gpg] {p['LUSTRE_REPO']} noble main\n")
    # Grafana's repository, signed by the pinned key, known to apt before its one index refresh; Grafana kept pinned.
    grafana_key = f"{p['GRAFANA_REPO']}/gpg.key"
    assert [c[-1] for c in run.commands("curl")] == [p["LUSTRE_KEY_URL"], grafana_key]
    assert p["GRAFANA_REPO"] == "https://apt.grafana.com" and re.fullmatch(r"11\.6\.\d+", p["GRAFANA_VERSION"])
    grafana = (run.root / "etc/apt/sources.list.d/grafana.list").read_text()
    assert grafana == f"deb [signed-by=/usr/share/keyrings/grafana.gpg] {p['GRAFANA_REPO']} stable main\n"
    assert (run.root / "usr/share/keyrings/grafana.gpg").read_text() == f"stand-in download of {grafana_key}\n"
    prefs = (run.root / "etc/apt/preferences.d/gpucluster-grafana").read_text()
    assert prefs == f"Package: grafana\nPin: version {p['GRAFANA_VERSION']}\nPin-Priority: 1001\n"
    order = [c["cmd"] for c in run.calls if c["cmd"][0] in ("gpg", "apt-get")]
    checked, updated = (next(i for i, c in enumerate(order) if word in c) for word in ("--show-keys", "update"))
    assert checked < updated
    (pip,) = [c for c in run.calls if c["cmd"][0] == "pip"]
    # The SDK's epoch (its PyPI versions start at 1769699379!) reaches pip whole; it depends on nothing to constrain.
    assert pip["cmd"][-2:] == [f"pydantic=={p['PYDANTIC_VERSION']}", "grafana-foundation-sdk==1769699379!11.6.0"]
    assert "--only-binary=:all:" in pip["cmd"]
    assert all(re.fullmatch(r"[a-z0-9-]+==[0-9][\w.]*", c) for c in pip["constraints"]), pip["constraints"]
    assert run.commands("systemctl") == [["disable", "--now", "munge", "slurmctld", "slurmdbd", "mariadb", "prometheus",
                                          "prometheus-alertmanager", "prometheus-node-exporter", "grafana-server"]]
    assert not any(c["manifest_existed"] for c in run.calls)
    manifest = json.loads(run.manifest.read_text())
    assert manifest["role"] == "head" and manifest["kernel"] == KERNEL and manifest["built_at"].endswith("Z")
    assert manifest["versions"]["slurm"] == p["SLURM_VERSION"]
    assert manifest["versions"]["pydantic"] == p["PYDANTIC_VERSION"]
    for name, pin in (("prometheus", "PROMETHEUS_VERSION"), ("alertmanager", "ALERTMANAGER_VERSION"),
                      ("node_exporter", "NODE_EXPORTER_VERSION"), ("grafana", "GRAFANA_VERSION"),
                      ("grafana_foundation_sdk", "GRAFANA_SDK_VERSION")):
        assert manifest["versions"][name] == p[pin], name


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
    assert sum("update" in c for c in run.commands("apt-get")) == 3
    assert re.findall(r"attempt (\d) of 5 failed, next in ([\d.]+)s", run.stderr) == [("1", "0.010"), ("2", "0.020")]
    assert run.manifest.exists()


def test_a_step_that_keeps_failing_stops_the_build_without_a_manifest(build: Build) -> None:
    run = build("head", fail=[("lustre-client-modules-", 99)])
    assert run.returncode != 0
    assert sum(f"lustre-client-modules-{KERNEL}" in c for c in run.commands("apt-get")) == 5
    waits = re.findall(r"next in ([\d.]+)s: apt_get install --no-install-recommends lustre", run.stderr)
    assert waits == ["0.010", "0.020", "0.040", "0.080"]
    assert "giving up after 5 attempts" in run.stderr
    assert not run.manifest.exists() and not run.commands("systemctl")


def test_an_old_manifest_does_not_survive_a_failed_rebuild(build: Build, tmp_path: Path) -> None:
    assert build("head").manifest.exists()
    run = build("head", fail=[("mariadb-server", 99)])
    assert run.returncode != 0 and not run.manifest.exists()


# --- compute ----------------------------------------------------------------------------------------------------------

def test_compute_build_fetches_only_pinned_and_verified_artifacts(build: Build) -> None:
    p = pins()
    run = build("compute")
    assert run.returncode == 0, run.stderr
    cw = f"{p['CWAGENT_URL']}/ubuntu/amd64/{p['CWAGENT_VERSION']}/amazon-cloudwatch-agent.deb"
    assert [c[-1] for c in run.commands("curl")] == [
        p["LUSTRE_KEY_URL"], f"{p['CWAGENT_URL']}/assets/amazon-cloudwatch-agent.gpg", cw, f"{cw}.sig"]
    installs = [c[c.index("install") + 1:] for c in run.commands("apt-get") if "install" in c]
    assert installs[0] == ["--no-install-recommends", f"munge={p['MUNGE_VERSION']}", f"slurmd={p['SLURM_VERSION']}",
                           f"slurm-client={p['SLURM_VERSION']}", f"libslurm-dev={p['SLURM_VERSION']}",
                           f"python3-boto3={p['BOTO3_VERSION']}", f"python3-venv={p['PYTHON3_VENV_VERSION']}",
                           "iptables", f"prometheus-node-exporter={p['NODE_EXPORTER_VERSION']}"]
    assert installs[1][1:] == [f"lustre-client-modules-{KERNEL}"]
    assert sum("update" in c for c in run.commands("apt-get")) == 1
    assert installs[2][1:] == ["git", "gcc", "make", "libcap2-bin", "patch",  # enroot's build and run time
                               "curl", "gawk", "jq", "parallel", "squashfs-tools", "zstd", "bsdmainutils"]
    assert [Path(a).name for a in installs[3][1:]] == ["amazon-cloudwatch-agent.deb"]
    assert len(installs) == 4
    pyxis = next(c for c in run.commands("git") if "clone" in c and p["PYXIS_REPO"] in c)
    assert pyxis[pyxis.index("--branch") + 1] == p["PYXIS_TAG"]
    pyxis_make = [c for c in run.commands("make") if c[1] == pyxis[-1]]
    assert pyxis_make == [["-C", pyxis[-1], "install", f"DESTDIR={run.root}"]]
    gpg = run.commands("gpg")
    assert any("--verify" in c for c in gpg)
    (pip,) = [c for c in run.calls if c["cmd"][0] == "pip"]
    assert pip["cmd"][-1] == f"torch=={p['TORCH_VERSION']}"
    assert os.readlink(run.root / "usr/local/bin/torchrun") == f"{p['VENV']}/bin/torchrun"
    assert run.commands("systemctl") == [["disable", "--now", "munge", "slurmd", "prometheus-node-exporter"]]
    assert not any(c["manifest_existed"] for c in run.calls)
    # dcgm-exporter's image by its digest (a tag can move), pulled at the build: the boot needs no registry.
    dcgm_exporter = f"{p['DCGM_EXPORTER_IMAGE']}@{p['DCGM_EXPORTER_DIGEST']}"
    assert re.fullmatch(r"nvcr\.io/nvidia/k8s/dcgm-exporter:[34]\.\d+\.\d+-\d+\.\d+\.\d+-ubuntu\d\d\.04"
                        r"@sha256:[0-9a-f]{64}", dcgm_exporter)
    # Pulled by digest, then tagged with the name the boot's unit runs (settings.DCGM_EXPORTER_IMAGE).
    assert run.commands("docker") == [["pull", "-q", dcgm_exporter],
                                      ["tag", dcgm_exporter, "gpucluster/dcgm-exporter:image"]]
    manifest = json.loads(run.manifest.read_text())
    assert manifest["versions"]["dcgm_exporter"] == dcgm_exporter
    assert manifest["versions"]["node_exporter"] == p["NODE_EXPORTER_VERSION"]
    assert manifest["versions"]["neuron_monitor"] == "none (no Neuron tools)"
    assert manifest["role"] == "compute"
    assert manifest["versions"]["slurm"] == p["SLURM_VERSION"]
    assert manifest["versions"]["dcgm"] == "from the parent image"
    assert manifest["versions"]["enroot"] == f"{p['ENROOT_VERSION']} {p['ENROOT_COMMIT']}"
    assert manifest["versions"]["pyxis"] == f"{p['PYXIS_TAG']} {p['PYXIS_COMMIT']}"


def test_same_slurm_version_on_head_and_compute(build: Build) -> None:
    def slurm_pins(run: Run) -> set[str]:
        return {a.split("=", 1)[1] for c in run.commands("apt-get") for a in c if re.match(r"slurm|libslurm", a)}

    assert slurm_pins(build("head")) == slurm_pins(build("compute")) == {pins()["SLURM_VERSION"]}


def test_enroot_pin_is_a_release_tag_and_a_full_commit() -> None:
    p = pins()
    assert p["ENROOT_REPO"] == "https://github.com/NVIDIA/enroot.git"
    assert p["ENROOT_TAG"] == f"v{p['ENROOT_VERSION']}" and re.fullmatch(r"[0-9a-f]{40}", p["ENROOT_COMMIT"])


def test_enroot_is_built_from_the_pinned_commit_with_its_submodules(build: Build) -> None:
    p = pins()
    run = build("compute")
    assert run.returncode == 0, run.stderr
    git = run.commands("git")
    clone = next(c for c in git if "clone" in c and p["ENROOT_REPO"] in c)
    src = clone[-1]
    # The tag's tree pins the submodules; they come whole (no shallow fetch of a commit by id from musl's server).
    assert clone[clone.index("--branch") + 1] == p["ENROOT_TAG"] and "--recurse-submodules" in clone
    assert not any(a.startswith("--shallow-submodules") for a in clone)
    make = [(c["cmd"][1:], c["cppflags"]) for c in run.calls if c["cmd"][:3] == ["make", "-C", src]]
    layout = ["prefix=/usr", "sysconfdir=/etc"]  # the .deb's: /usr/bin, /usr/lib/enroot, /etc/enroot
    assert make == [(["-C", src, *layout, "all"], ENROOT_CPPFLAGS),  # built without DESTDIR, so none is written in
                    (["-C", src, *layout, "install", f"DESTDIR={run.root}"], ENROOT_CPPFLAGS),
                    (["-C", src, *layout, "setcap", f"DESTDIR={run.root}"], ENROOT_CPPFLAGS)]
    # HEAD is checked after the clone and before the first make.
    order = [c["cmd"] for c in run.calls if c["cmd"][0] in ("git", "make") and src in c["cmd"]]
    assert order[:3] == [["git", *clone], ["git", "-C", src, "rev-parse", "HEAD"], ["make", *make[0][0]]]
    # Where bootstrap.py adds its enroot.conf.d, and the AppArmor profile the .deb installed and loaded.
    assert (run.root / "etc/enroot/enroot.conf").is_file() and os.access(run.root / "usr/bin/enroot", os.X_OK)
    assert (run.root / "etc/apparmor.d/enroot").is_file()
    assert run.commands("apparmor_parser") == [["-r", "-T", "-W", f"{run.root}/etc/apparmor.d/enroot"]]


def test_enroot_profile_is_installed_but_not_loaded_without_apparmor(build: Build) -> None:
    run = build("compute", apparmor=False)
    assert run.returncode == 0, run.stderr
    assert (run.root / "etc/apparmor.d/enroot").is_file() and not run.commands("apparmor_parser")


def _stopped_at_enroot(run: Run) -> None:
    assert run.returncode != 0 and not run.manifest.exists()
    assert not run.commands("make") and not (run.root / "usr/bin/enroot").exists()
    assert not any("clone" in c and pins()["PYXIS_REPO"] in c for c in run.commands("git"))
    assert not run.commands("pip") and not run.commands("systemctl")


def test_enroot_tag_that_names_another_commit_stops_the_build(build: Build) -> None:
    p = pins()
    run = build("compute", tags={f"{p['ENROOT_REPO']} {p['ENROOT_TAG']}": "1" * 40})
    _stopped_at_enroot(run)
    assert f"enroot {p['ENROOT_TAG']} is not {p['ENROOT_COMMIT']}" in run.stderr


def test_enroot_commit_pin_is_what_head_is_checked_against(build: Build) -> None:
    _stopped_at_enroot(build("compute", edits={"ENROOT_COMMIT": "0" * 40}))


def test_enroot_clone_is_retried_and_a_missing_tag_stops_the_build(build: Build) -> None:
    run = build("compute", fail=[("--recurse-submodules", 2)])
    assert run.returncode == 0, run.stderr
    assert sum("--recurse-submodules" in c for c in run.commands("git")) == 3
    run = build("compute", edits={"ENROOT_TAG": "v0.0.0-not-upstream"})
    _stopped_at_enroot(run)
    assert "giving up after 5 attempts" in run.stderr


def test_pyxis_at_another_commit_stops_the_build(build: Build) -> None:
    run = build("compute", edits={"PYXIS_COMMIT": "0" * 40})
    assert run.returncode != 0 and not run.manifest.exists()
    assert not any(c[1].endswith("/pyxis") for c in run.commands("make"))


def test_cloudwatch_agent_with_another_signing_key_is_not_installed(build: Build) -> None:
    run = build("compute", edits={"CWAGENT_KEY_FINGERPRINT": "0" * 40})
    assert run.returncode != 0 and "CloudWatch agent key" in run.stderr
    assert not any("amazon-cloudwatch-agent.deb" in a for c in run.commands("apt-get") for a in c)
    assert not run.manifest.exists()


def test_cloudwatch_agent_already_in_the_image_is_kept(build: Build) -> None:
    run = build("compute", agent_present=True)
    assert run.returncode == 0, run.stderr
    assert not any("amazoncloudwatch-agent" in c[-1] for c in run.commands("curl"))


def test_nvidia_image_without_dcgm_fails_and_neuron_image_needs_none(build: Build) -> None:
    run = build("compute", gpu_tools=("nvidia-smi", "docker", "nvidia-ctk"))
    assert run.returncode != 0 and "without DCGM" in run.stderr and run.calls == [] and not run.manifest.exists()
    run = build("compute", gpu_tools=(), neuron_tools=("neuron-monitor", "neuron-monitor-prometheus.py"))
    assert run.returncode == 0, run.stderr
    versions = json.loads(run.manifest.read_text())["versions"]
    assert versions["dcgm"] == "none (no NVIDIA driver)" and versions["dcgm_exporter"] == "none"
    assert versions["neuron_monitor"] == "from the parent image"
    assert not run.commands("docker")


@pytest.mark.parametrize("missing", ["docker", "nvidia-ctk"])
def test_nvidia_image_without_its_container_runtime_fails_first(build: Build, missing: str) -> None:
    """dcgm-exporter runs in a container: docker and NVIDIA's container toolkit are the DLAMI's, never installed."""
    run = build("compute", gpu_tools=tuple(t for t in GPU_TOOLS if t != missing))
    assert run.returncode != 0 and "without docker or the NVIDIA container toolkit" in run.stderr
    assert run.calls == [] and not run.manifest.exists()


@pytest.mark.parametrize("missing", ["neuron-monitor", "neuron-monitor-prometheus.py"])
def test_neuron_image_without_neuron_monitor_fails_first(build: Build, missing: str) -> None:
    tools = tuple(t for t in ("neuron-monitor", "neuron-monitor-prometheus.py") if t != missing)
    run = build("compute", gpu_tools=(), neuron_tools=tools)
    assert run.returncode != 0 and f"a Neuron image without {pins()['NEURON_BIN']}/{missing}" in run.stderr
    assert run.calls == [] and not run.manifest.exists()


def test_dcgm_exporter_pull_is_retried_and_its_failure_stops_the_build(build: Build) -> None:
    run = build("compute", fail=[("docker pull", 2)])
    assert run.returncode == 0, run.stderr
    assert [c[0] for c in run.commands("docker")] == ["pull", "pull", "pull", "tag"]
    run = build("compute", fail=[("docker pull", 99)])
    assert run.returncode != 0 and not run.manifest.exists() and not run.commands("systemctl")


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
    stack, declared = shipped
    images = {d.name.removeprefix(f"{stack.cluster_name}-"): d
              for d in declared if d.type == "gpucluster:image:NodeImage"}
    assert set(images) == _expected_keys(stack)
    assert set(images) == {i.key for i in cost.estimate(stack).images}
    for image in images.values():
        assert 2 <= len(_children(declared, image, "component:Component")) <= 3  # the BOM, the script's parts
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
        parent = stack.spec.image.parent_images.parent(bom.parent_role(key.partition("-")[2] or None))
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
        assert ami["amiTags"]["gpucluster:bom"] == hashlib.sha256(bom.render(stack).encode()).hexdigest()


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
        assert (target / "bom.json").read_text() == bom.render(stack)


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
    assert templates["trn1"]["imageId"] == f"<AMI from {catalog.AMI_PARAMETERS['neuron']} at up>"
    assert templates["g6e"]["imageId"] == f"<AMI from {catalog.AMI_PARAMETERS['nvidia']} at up>"
    (head,) = of_type(declared, "ec2/instance:Instance")  # the exact Ubuntu release, as it is
    parent = stack.spec.image.parent_images.head
    assert head.inputs["ami"] == planned_ami_id(f"{stack.region}/{parent.owner}/{parent.name}")


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
