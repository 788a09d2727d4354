"""`python -m gpucluster render`: the exact user data EC2 gets, checked by the real cloud-init, and the Slurm files."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, STACK_FILES
from gpucluster import node
from gpucluster.contract import settings
from gpucluster.render import dashboards, slurm, userdata
from gpucluster.spec import bom
from gpucluster.spec.model import load_stack

GOLDEN = ROOT / "tests" / "golden"


def render(stack: str, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpucluster", "render", stack, "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def cloud_init_schema(path: Path) -> subprocess.CompletedProcess[str]:
    assert shutil.which("cloud-init"), "install cloud-init first (make test does)"
    return subprocess.run(["cloud-init", "schema", "--config-file", str(path)], capture_output=True, text=True)


@pytest.mark.parametrize("path", STACK_FILES, ids=lambda p: p.name)
def test_render_writes_valid_small_user_data_and_slurm_files(path: Path, tmp_path: Path) -> None:
    stack = load_stack(path)
    done = render(str(path), tmp_path)
    assert done.returncode == 0, done.stderr
    expected = {"head-node.user-data", *(f"{p.name}.user-data" for p in stack.spec.pools),
                "slurm/slurm.conf", "slurm/gres.conf", "slurm/slurmdbd.conf", "slurm/plugstack.conf",
                "slurm/cgroup.conf", "slurm/job_submit.lua", "slurm/job_container.conf",
                "slurm/mpi.conf",
                *settings.MONITORING_FILES, "prometheus/prometheus.env", "dcgm-exporter/counters.csv",
                *dashboards.files(stack), "image/bom.json"}
    written = {str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()}
    assert written == expected
    for name in {n for n in expected if n.endswith(".user-data")}:
        data = (tmp_path / name).read_bytes()
        assert data.startswith(b"#cloud-config\n")
        # Most of it is fetch_bundle.py (about 6 KB, the same for every node); a quarter of EC2's limit stays free
        # for it to grow and for long stack and pool names.
        assert len(data) < userdata.EC2_USER_DATA_LIMIT * 3 // 4, f"{name}: {len(data)} bytes, too little headroom"
        checked = cloud_init_schema(tmp_path / name)
        assert checked.returncode == 0, checked.stdout + checked.stderr
        assert f"GPUCLUSTER_CONFIG_PARAMETER={userdata.config_parameter(stack)}" in data.decode()
    assert (tmp_path / "slurm" / "slurm.conf").read_text() == slurm.slurm_conf(stack)
    assert (tmp_path / "image" / "bom.json").read_text() == bom.render(stack)  # what the image builds get


def test_schema_checker_rejects_a_broken_file(tmp_path: Path) -> None:
    """The check above can fail: cloud-init refuses a malformed document."""
    broken = tmp_path / "broken.user-data"
    broken.write_text("#cloud-config\npackages: 5\nwrite_files:\n  - content: x\n")
    checked = cloud_init_schema(broken)
    assert checked.returncode != 0 and "packages" in (checked.stdout + checked.stderr)


def test_user_data_carries_no_secret() -> None:
    """User data is readable by anyone who may describe the instance: it names where the munge key is (the SSM
    parameter to read, the file to stage it in) and holds no key material, no password, no credential."""
    for path in STACK_FILES:
        stack = load_stack(path)
        for name, text in userdata.all_user_data(stack).items():
            doc = yaml.safe_load(text)
            files = {f["path"]: f["content"] for f in doc["write_files"]}
            # Three files, none of them a key: the node's names, the fetcher (the repository's code) and its unit.
            assert set(files) == {settings.NODE_ENV_FILE, settings.FETCHER, f"/etc/systemd/system/{settings.BOOT_UNIT}"}
            assert files[settings.FETCHER].encode() == node.source(userdata.FETCHER)
            assert files[f"/etc/systemd/system/{settings.BOOT_UNIT}"] == userdata.boot_unit()
            env = dict(line.split("=", 1) for line in files[settings.NODE_ENV_FILE].splitlines())
            assert env["GPUCLUSTER_MUNGE_KEY_PARAMETER"] == userdata.munge_key_parameter(stack)  # a name
            assert env["GPUCLUSTER_MUNGE_KEY_FILE"] == settings.MUNGE_KEY_STAGED  # a path
            assert all(re.fullmatch(r"[\w./:-]{1,100}", value) for value in env.values()), env
            # The key file's path is the only mention of it; nothing that looks like key material anywhere.
            lowered = text.replace(f"GPUCLUSTER_MUNGE_KEY_FILE={settings.MUNGE_KEY_STAGED}\n", "").lower()
            assert "munge.key" not in lowered and "password" not in lowered and "secret" not in lowered, name
            assert "akia" not in lowered and "-----begin" not in lowered, name
            assert not re.search(r"[A-Za-z0-9+/=]{64,}", text), name  # a 1024-byte munge key is 1368 base64 chars


def test_golden_team_a(tmp_path: Path) -> None:
    """The rendered team-a artifacts, reviewed like code. Regenerate with GPUCLUSTER_UPDATE_GOLDEN=1 and read the
    diff."""
    assert render("team-a", tmp_path).returncode == 0
    golden = GOLDEN / "team-a"
    if os.environ.get("GPUCLUSTER_UPDATE_GOLDEN"):
        shutil.rmtree(golden, ignore_errors=True)
        shutil.copytree(tmp_path, golden)
    rendered = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert rendered == sorted(p.relative_to(golden) for p in golden.rglob("*") if p.is_file())
    for rel in rendered:
        assert (tmp_path / rel).read_text() == (golden / rel).read_text(), f"{rel} differs from tests/golden/team-a"


def test_render_bad_input_exits_2(tmp_path: Path) -> None:
    done = render("tests/bad_stacks/Pulumi.min-above-max.yaml", tmp_path)
    assert done.returncode == 2 and "must be <= max_nodes" in done.stderr and "Traceback" not in done.stderr
    assert not any(tmp_path.iterdir())


# --- slurm.conf for cloud nodes: settings that must not quietly disappear ---------------------------------------------

def conf_lines(text: str) -> list[dict[str, str]]:
    """slurm.conf as Slurm reads it: one dict of key=value per line, comments and blank lines dropped."""
    return [dict(word.split("=", 1) for word in line.split()) for line in text.splitlines()
            if line and not line.startswith("#")]


def conf_settings(text: str) -> dict[str, str]:
    """The single-key lines (ClusterName=..., SlurmctldParameters=...)."""
    return {k: v for line in conf_lines(text) if len(line) == 1 for k, v in line.items()}


def partitions(text: str) -> dict[str, dict[str, str]]:
    return {line["PartitionName"]: line for line in conf_lines(text) if "PartitionName" in line}


def nodes(text: str) -> dict[str, dict[str, str]]:
    return {line["NodeName"]: line for line in conf_lines(text) if "NodeName" in line}


def test_p5_partitions_share_cpus_and_memory_by_gpu() -> None:
    """A job without --mem gets its share of the node, not all of it. p5.48xlarge, by hand: 2 097 152 MiB * 0.95 =
    1 992 294 MiB RealMemory; / 192 vCPUs = 10 376.5 -> 10 376 MiB per CPU; / 8 GPUs = 249 036.75 -> 249 036 MiB and
    192 / 8 = 24 CPUs per GPU."""
    text = slurm.slurm_conf(load_stack(ROOT / "stacks" / "Pulumi.team-a.yaml"))
    assert nodes(text)["p5-od-[1-4]"]["RealMemory"] == "1992294"
    for name in ("p5-od", "p5-spot"):
        part = partitions(text)[name]
        assert part["DefMemPerCPU"] == "10376"
        assert part["DefCpuPerGPU"] == "24"
        assert part["DefMemPerGPU"] == "249036"
        assert "DefMemPerNode" not in part  # Slurm ignores DefMemPerCPU next to it
    # Eight 1-GPU jobs fill the node exactly, never more.
    assert 8 * 249036 <= 1992294 and 8 * 24 == 192 and 192 * 10376 <= 1992294


@pytest.mark.parametrize("path", STACK_FILES, ids=lambda p: p.name)
def test_every_partition_has_defaults_that_fit_its_nodes(path: Path) -> None:
    stack = load_stack(path)
    text = slurm.slurm_conf(stack)
    parts = partitions(text)
    for pool in stack.spec.pools:
        part = parts[pool.name]
        memory = slurm.real_memory(pool)
        assert 0 < int(part["DefMemPerCPU"]) * pool.itype.vcpus <= memory
        assert int(part["DefMemPerCPU"]) > memory // pool.itype.vcpus - 1  # rounded down, not thrown away
        acc = pool.itype.accelerator
        if acc and acc.kind == "nvidia":
            assert int(part["DefCpuPerGPU"]) * acc.count == pool.itype.vcpus
            assert 0 < int(part["DefMemPerGPU"]) * acc.count <= memory
        else:  # Neuron devices are no "gpu" GRES: the GPU defaults would mean nothing there
            assert "DefCpuPerGPU" not in part and "DefMemPerGPU" not in part


def test_partition_defaults_fit_the_smallest_node_of_a_fallback(tmp_path: Path) -> None:
    """A spot pool that falls back to another instance type: the defaults fit both kinds of node."""
    text = (ROOT / "tests" / "stacks" / "Pulumi.local.yaml").read_text()
    assert text.count("instance_type: g6.xlarge") == 3
    bigger = tmp_path / "Pulumi.local.yaml"
    bigger.write_text(text.replace("instance_type: g6.xlarge", "instance_type: g6e.xlarge", 1))  # the spot pool
    stack = load_stack(bigger)
    parts = partitions(slurm.slurm_conf(stack))
    # g6.xlarge: 4 vCPUs, 16 384 MiB * 0.95 = 15 564 MiB, 1 GPU; g6e.xlarge: 4 vCPUs, 31 129 MiB, 1 GPU.
    assert parts["spot"]["Nodes"] == "spot-[1-2],standby-[1-2]"
    assert (parts["spot"]["DefMemPerCPU"], parts["spot"]["DefMemPerGPU"]) == ("3891", "15564")
    assert (parts["standby"]["DefMemPerCPU"], parts["standby"]["DefMemPerGPU"]) == ("3891", "15564")


def test_always_on_nodes_are_cloud_nodes_that_are_never_suspended() -> None:
    """Every node is State=CLOUD (Slurm hides or drops a non-cloud node whose address nothing resolves); the
    always-on ones (min_nodes) are kept out of power saving, and the reconciler powers them up."""
    text = slurm.slurm_conf(load_stack(ROOT / "tests" / "stacks" / "Pulumi.existing.yaml"))  # p5en-cb: min 2 of 2
    assert {name: line.get("State") for name, line in nodes(text).items()} == {
        "p5en-cb-[1-2]": "CLOUD", "b200-[1-2]": "CLOUD"}
    assert conf_settings(text)["SuspendExcNodes"] == "p5en-cb-[1-2]"


def test_cloud_parameters_and_timeouts() -> None:
    """What cloud nodes need from the controller (ParallelCluster's values), loaded by the rehearsal's slurmctld of
    the node image's release (tests/integration/test_slurm_controller.py)."""
    settings = conf_settings(slurm.slurm_conf(load_stack(ROOT / "stacks" / "Pulumi.team-a.yaml")))
    assert set(settings["SlurmctldParameters"].split(",")) == {
        "enable_configless", "idle_on_node_suspend", "node_reg_mem_percent=75", "power_save_min_interval=30"}
    assert settings["MessageTimeout"] == "60"
    assert settings["SlurmdTimeout"] == "180"
    assert settings["BatchStartTimeout"] == "180"
    # The pid files live in /run/slurm (systemd's RuntimeDirectory=slurm).
    assert settings["SlurmctldPidFile"] == "/run/slurm/slurmctld.pid"
    assert settings["SlurmdPidFile"] == "/run/slurm/slurmd.pid"
    assert settings["SelectTypeParameters"] == "CR_Core_Memory"


@pytest.mark.parametrize("path", STACK_FILES, ids=lambda p: p.name)
def test_cgroup_conf_confines_jobs_when_cgroups_are_on(path: Path) -> None:
    stack = load_stack(path)
    files = slurm.all_files(stack)
    lines = {line for line in files["cgroup.conf"].splitlines() if line and not line.startswith("#")}
    assert lines == {"ConstrainDevices=yes", "ConstrainCores=yes", "ConstrainRAMSpace=yes"}
    settings = conf_settings(files["slurm.conf"])
    assert settings["ProctrackType"] == "proctrack/cgroup"
    assert settings["TaskPlugin"] == "task/affinity,task/cgroup"


def test_no_cgroup_plugin_when_cgroups_are_off() -> None:
    """The test harness's sandbox cannot use cgroups: no cgroup plugin, and no confinement that would need one (Slurm
    24.11's slurmd loads a cgroup plugin unless cgroup.conf disables it)."""
    stack = load_stack(ROOT / "stacks" / "Pulumi.team-a.yaml")
    files = slurm.all_files(stack, slurm.SlurmLayout(cgroups=False))
    assert files["cgroup.conf"] == "CgroupPlugin=disabled\n"
    assert "cgroup" not in files["slurm.conf"]


@pytest.mark.parametrize("cgroups", [True, False], ids=["cgroups", "no cgroups"])
def test_every_job_gets_its_own_tmp_and_dev_shm(cgroups: bool) -> None:
    """job_container/tmpfs, in the tests' sandbox too (the boot rehearsal proves it there): its BasePath on the
    nodes' scratch space, its file beside slurm.conf, which configless slurmd fetches with it."""
    files = slurm.all_files(load_stack(ROOT / "stacks" / "Pulumi.team-a.yaml"), slurm.SlurmLayout(cgroups=cgroups))
    conf = conf_settings(files["slurm.conf"])
    assert conf["JobContainerType"] == "job_container/tmpfs" and "Contain" in conf["PrologFlags"].split(",")
    assert "Alloc" in conf["PrologFlags"].split(",")  # the Prolog on every node at the job's start
    container = conf_settings(files["job_container.conf"])
    assert container["BasePath"] == settings.JOB_TMP_DIR and container["Dirs"].split(",") == ["/tmp", "/dev/shm"]
    # PMIx's directories for the tasks, which slurmstepd makes outside the job's namespace: not in /tmp (MPI jobs)
    assert "EntireStepInNS" not in container
    assert conf_settings(files["mpi.conf"])["PMIxCliTmpDirBase"] == settings.PMIX_TMP_DIR
