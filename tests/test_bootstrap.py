"""The on-node bootstrap's decisions that can be checked off AWS: files it writes, systemd units as this machine's
systemd reads them, the accounting database's directory. (The munge key's trip through SSM: test_fetch_bundle.py.)"""

from __future__ import annotations

import configparser
import logging
import os
import pwd
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT
from gpucluster.contract import lockdown, reasons, settings as contract
from gpucluster.node import bootstrap
from gpucluster.render import slurm, userdata
from slurm_samples import document, node

PACKAGED_SLURMD = Path("/lib/systemd/system/slurmd.service")  # Debian's slurmd package (make test installs it)


def test_munge_key_file_is_munge_only(tmp_path: Path) -> None:
    staged, key = tmp_path / "staged.key", tmp_path / "munge" / "munge.key"
    staged.write_bytes(b"k" * 1024)  # as fetch_bundle.py leaves it
    bootstrap.install_munge_key(staged, key)
    info = key.stat()
    assert key.read_bytes() == b"k" * 1024
    assert stat.S_IMODE(info.st_mode) == 0o400 and info.st_uid == pwd.getpwnam("munge").pw_uid
    # A new key (a replaced head's) replaces the file whole: never a moment of an old mode on new bytes.
    key.chmod(0o644)
    staged.write_bytes(b"n" * 1024)
    bootstrap.install_munge_key(staged, key)
    assert key.read_bytes() == b"n" * 1024 and stat.S_IMODE(key.stat().st_mode) == 0o400
    assert [p.name for p in key.parent.iterdir()] == ["munge.key"]


def test_hosts_entry_replaces_an_old_head_address(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n10.0.0.9 head\n")
    bootstrap.hosts_entry("10.0.0.17", hosts)
    assert hosts.read_text() == "127.0.0.1 localhost\n10.0.0.17 head\n"


def pool(accelerator: str = "nvidia", efa: int = 0) -> contract.PoolSettings:
    return contract.PoolSettings("p", "lt-1", "subnet-1", "p5.48xlarge", "on-demand", efa_interfaces=efa,
                                 accelerator=accelerator, accelerators=8 if accelerator else 0)


def test_nccl_environment_turns_on_efa_only_where_the_pool_has_it() -> None:  # NAME=value lines for the TaskProlog
    efa = bootstrap.nccl_environment(pool(efa=32)).splitlines()
    assert {"FI_PROVIDER=efa", "FI_EFA_USE_HUGE_PAGE=0"} <= set(efa)
    assert "FI_PROVIDER" not in bootstrap.nccl_environment(pool(efa=0))


def test_nccl_environment_puts_the_efa_plugin_on_the_loader_path_names_it_and_makes_it_required() -> None:
    """NCCL finds aws-ofi-nccl (review item 5): its directory on LD_LIBRARY_PATH and NCCL_NET_PLUGIN naming the file
    there on every NVIDIA pool; on EFA pools NCCL_NET names the plugin's network, which every aws-ofi-nccl release
    answers to (NCCL then fails rather than use sockets). Nothing of it on Trainium or CPU pools."""
    plugin = {f"LD_LIBRARY_PATH={contract.AWS_OFI_NCCL_LIB_DIR}", "NCCL_NET_PLUGIN=ofi"}
    assert contract.NCCL_NET_PLUGIN_FILE == "libnccl-net-ofi.so"  # what NCCL opens for NCCL_NET_PLUGIN=ofi
    efa = set(bootstrap.nccl_environment(pool(efa=32)).splitlines())
    assert plugin | {"NCCL_NET=AWS Libfabric"} <= efa
    no_efa = set(bootstrap.nccl_environment(pool(efa=0)).splitlines())
    assert plugin <= no_efa and not any(line.startswith("NCCL_NET=") for line in no_efa)
    for other in (pool("neuron", efa=16), pool("", efa=0)):
        assert not any(line.startswith(("LD_LIBRARY_PATH", "NCCL_NET")) for line in
                       bootstrap.nccl_environment(other).splitlines())


def test_usage_error_exits_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(logging, "FileHandler", lambda path: logging.StreamHandler())
    monkeypatch.setattr(Path, "mkdir", lambda *a, **k: None)
    assert bootstrap.main(["bootstrap.py", "nonsense"]) == 2


def test_head_installs_the_budget_guardrail_service_and_command(tmp_path: Path) -> None:
    systemd, sbin = tmp_path / "systemd", tmp_path / "sbin"
    systemd.mkdir()
    sbin.mkdir()
    bootstrap.budget_guardrail(systemd, sbin)
    bootstrap.budget_guardrail(systemd, sbin)  # a reboot runs it again
    assert (sbin / "gpucluster-budget").readlink() == Path(contract.BUDGET_PROGRAM)
    unit = (systemd / "gpucluster-budget.service").read_text()
    assert f"ExecStart={sbin}/gpucluster-budget run" in unit and "Restart=always" in unit
    assert "After=slurmctld.service" in unit and "WantedBy=multi-user.target" in unit


def test_head_gets_the_command_line_from_the_image_venv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`gpucluster` on the head node: the bundle's library on the image's venv (pydantic), nothing installed at boot."""
    monkeypatch.setattr(bootstrap, "run", lambda *args, **kw: pytest.fail(f"ran {args}"))
    bootstrap.command_line(tmp_path / "bin")
    wrapper = tmp_path / "bin" / "gpucluster"
    assert f"PYTHONPATH={contract.LIB_DIR} exec {bootstrap.IMAGE_VENV}/bin/python -m gpucluster" in wrapper.read_text()
    assert stat.S_IMODE(wrapper.stat().st_mode) == 0o755
    # The venv is the one build_image.sh makes.
    assert f"VENV={bootstrap.IMAGE_VENV}\n" in (ROOT / "gpucluster" / "node" / "build_image.sh").read_text()


def test_fstab_entries_are_added_once(tmp_path: Path) -> None:
    fstab = tmp_path / "fstab"
    fstab.write_text("LABEL=root / ext4 defaults 0 1\n")
    for _ in range(2):  # every boot runs the bootstrap again
        bootstrap.fstab_entry("LABEL=gpucluster-state /var/lib/gpucluster ext4 defaults,nofail 0 2", fstab)
    assert fstab.read_text().splitlines() == ["LABEL=root / ext4 defaults 0 1",
                                              "LABEL=gpucluster-state /var/lib/gpucluster ext4 defaults,nofail 0 2"]


# --- systemd, as this machine's systemd reads our units (finding 2) ---------------------------------------------------

def condition(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["systemd-analyze", "condition", f"--root={root}", "--unit=slurmd.service"],
                          capture_output=True, text=True, timeout=60)


def test_slurmd_drop_in_undoes_the_packaged_condition_on_slurm_conf(tmp_path: Path) -> None:
    """Debian's and Ubuntu's slurmd.service is skipped, without an error, where /etc/slurm/slurm.conf is missing: on
    every configless compute node. The drop-in empties that condition. systemd evaluates conditions on this
    machine's own paths, so this machine must have no slurm.conf either."""
    assert PACKAGED_SLURMD.exists(), "install slurmd first (make test does)"
    if Path("/etc/slurm/slurm.conf").exists():
        pytest.skip("this machine has /etc/slurm/slurm.conf: the packaged condition holds here either way")
    assert "ConditionPathExists=/etc/slurm/slurm.conf" in PACKAGED_SLURMD.read_text()
    units = tmp_path / "lib" / "systemd" / "system"
    units.mkdir(parents=True)
    shutil.copy(PACKAGED_SLURMD, units)
    skipped = condition(tmp_path)
    assert skipped.returncode != 0 and "ConditionPathExists=/etc/slurm/slurm.conf failed" in skipped.stderr

    path = bootstrap.drop_in("slurmd.service", bootstrap.SLURMD_DROP_IN, tmp_path / "etc" / "systemd" / "system")
    assert path == tmp_path / "etc" / "systemd" / "system" / "slurmd.service.d" / "gpucluster.conf"
    started = condition(tmp_path)
    assert started.returncode == 0, started.stdout + started.stderr


def test_boot_unit_is_one_systemd_accepts(tmp_path: Path) -> None:
    """The unit user data writes: systemd refuses some settings outright (Restart=always on a oneshot) and only warns
    about others (an unknown key, a bad value), so no word about the file is allowed either."""
    assert Path("/usr/bin/python3").exists()  # its ExecStart
    unit = tmp_path / contract.BOOT_UNIT
    unit.write_text(userdata.boot_unit())
    done = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    said = done.stdout + done.stderr
    assert done.returncode == 0 and contract.BOOT_UNIT not in said, said


def test_dcgm_exporter_starts_with_the_dcgm_host_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ordered after nvidia-dcgm alone, the exporter would start against no host engine where the image leaves it
    off; Wants= starts it."""
    monkeypatch.setattr(bootstrap, "in_image", lambda tool: True)
    monkeypatch.setattr(contract, "GPU_JOB_MAP_DIR", str(tmp_path / "gpu-jobs"))
    pool = contract.PoolSettings(name="g6e", launch_template_id="lt-1", subnet_id="subnet-1",
                                 instance_type="g6e.xlarge", market="on-demand", max_nodes=2, accelerator="nvidia",
                                 accelerators=1)
    settings = contract.ClusterSettings(cluster="c1", region="us-east-1", pools={"g6e": pool})
    unit = bootstrap.gpu_exporter(settings, pool, "g6e-1", "10.0.0.5", systemd=tmp_path)
    assert unit == "gpucluster-gpu-exporter.service"
    lines = (tmp_path / unit).read_text().splitlines()
    assert {"Wants=nvidia-dcgm.service", "After=nvidia-dcgm.service", "After=docker.service"} <= set(lines)


def test_start_insists_that_each_unit_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """`systemctl enable --now` exits 0 for a unit whose condition fails; the boot must fail instead."""
    ran: list[tuple[str, ...]] = []

    def systemctl(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        ran.append(args)
        state = "inactive\n" if args[1:] == ("is-active", "slurmd") else "active\n"
        return subprocess.CompletedProcess(args, 3 if "inactive" in state else 0, state, "")

    monkeypatch.setattr(bootstrap, "run", systemctl)
    bootstrap.start("munge")
    with pytest.raises(RuntimeError, match="slurmd is inactive after its start"):
        bootstrap.start("slurmd")
    assert ("systemctl", "restart", "slurmd") in ran


# --- the accounting database on the state volume (finding 1) ---------------------------------------------------------

def test_database_dir_from_an_earlier_head_is_given_to_mysql(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A state volume that already holds the database (an earlier head node, whose mysql user may have had another
    uid, or a copy made as root): no new database, every file handed to this image's mysql user."""
    mysql = pwd.getpwnam("mysql")
    data, conf = tmp_path / "state" / "mysql", tmp_path / "etc" / "60-gpucluster.cnf"
    for name in ("mysql/user.frm", "mysql/db.MAI", "slurm_acct_db/job_table.ibd", "ibdata1", "aria_log.00000001"):
        (data / name).parent.mkdir(parents=True, exist_ok=True)
        (data / name).write_bytes(b"x")
    for path in [data, *data.rglob("*")]:
        os.chown(path, 0, 0)
    real_run = bootstrap.run
    ran: list[tuple[str, ...]] = []

    def recorded(*args, **kw):
        ran.append(args)
        return real_run(*args, **kw)
    monkeypatch.setattr(bootstrap, "run", recorded)

    bootstrap.database_dir(data, conf)

    assert not [args for args in ran if args[0] == "mariadb-install-db"]  # the database is there: keep it
    for path in [data, *data.rglob("*")]:
        owner = path.stat()
        assert (owner.st_uid, owner.st_gid) == (mysql.pw_uid, mysql.pw_gid), path
    parsed = configparser.ConfigParser(allow_no_value=True)
    parsed.read_string(conf.read_text())
    assert parsed["mysqld"]["datadir"] == str(data)
    assert "skip-networking" in parsed["mysqld"]  # slurmdbd uses the socket; nothing listens on TCP


def test_database_dir_on_a_new_volume_is_created(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[tuple[str, ...]] = []
    monkeypatch.setattr(bootstrap, "run", lambda *args, **kw: ran.append(args))
    data = tmp_path / "state" / "mysql"
    bootstrap.database_dir(data, tmp_path / "60-gpucluster.cnf")
    assert ran[0][:3] == ("mariadb-install-db", "--user=mysql", f"--datadir={data}")
    assert ran[-1] == ("chown", "-R", "mysql:mysql", str(data))


SCONTROL_NODES = document("nodes", [
    node("p5-od-1", "IDLE+CLOUD+POWERING_UP", hostname="i-0aaaaaaaaaaaaaaa1"),
    node("p5-od-2", "IDLE+CLOUD", address="10.0.0.7"),
    node("p5-od-3", "ALLOCATED+CLOUD+POWERING_UP", hostname="i-0aaaaaaaaaaaaaaa3"),
])


def test_an_instance_finds_its_node_by_its_instance_id() -> None:
    assert bootstrap.own_node("i-0aaaaaaaaaaaaaaa3", SCONTROL_NODES) == "p5-od-3"
    with pytest.raises(RuntimeError, match="0 Slurm node"):  # the resume program has not told Slurm yet: retried
        bootstrap.own_node("i-0bbbbbbbbbbbbbbb9", SCONTROL_NODES)


def test_a_rebooted_instance_keeps_its_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    saved = tmp_path / "node-name"
    saved.write_text("p5-od-3\n")
    monkeypatch.setattr(bootstrap, "imds", lambda path: pytest.fail("asked the metadata service again"))
    assert bootstrap.node_name(None, saved) == "p5-od-3"  # type: ignore[arg-type]  # a saved name needs no settings


def test_real_scontrol_accepts_the_client_conf(tmp_path: Path) -> None:
    """scontrol refuses a configuration without ClusterName even to expand a host list (the boot rehearsal shows the
    file reaching the controller)."""
    settings = contract.ClusterSettings(cluster="team-a", region="us-east-1", pools={}, slurmctld_port=16817)
    conf = bootstrap.slurm_client_conf(settings, tmp_path / "client.conf")
    offline = subprocess.run(["scontrol", "show", "hostnames", "p5-od-[1-2]"],
                             env={**os.environ, "SLURM_CONF": str(conf)}, capture_output=True, text=True, timeout=30)
    assert offline.stdout.split() == ["p5-od-1", "p5-od-2"], offline.stderr


def test_update_units_are_ones_systemd_accepts_and_look_every_minute(tmp_path: Path) -> None:
    """The head's update timer: a changed stack reaches the running head within two minutes of `pulumi up`."""
    bootstrap.update_timer(tmp_path)
    service, timer = tmp_path / f"{contract.UPDATE_UNIT}.service", tmp_path / f"{contract.UPDATE_UNIT}.timer"
    done = subprocess.run(["systemd-analyze", "verify", str(service), str(timer)], capture_output=True, text=True,
                          timeout=60)
    said = done.stdout + done.stderr
    assert done.returncode == 0 and contract.UPDATE_UNIT not in said, said
    assert "OnUnitActiveSec=60s" in timer.read_text()
    # Ordered after the boot unit (a reboot's bootstrap and an update never run together), without starting it.
    assert f"After={contract.BOOT_UNIT}" in service.read_text() and "Wants=" not in service.read_text()
    assert f"fetch_bundle.py {contract.NODE_ENV_FILE} --update {contract.APPLIED_FILE}" in service.read_text()
    # the bundle's fetch_bundle.py
    assert f"ExecStart=/usr/bin/python3 {contract.LIB_DIR}/gpucluster/node/fetch_bundle.py" in service.read_text()


def test_the_fetcher_and_the_bootstrap_agree_on_what_was_applied(tmp_path: Path) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("fetch_bundle", ROOT / "gpucluster" / "node" / "fetch_bundle.py")
    assert spec is not None and spec.loader is not None
    fetcher = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fetcher)
    settings, marker = tmp_path / "cluster.json", tmp_path / "applied"
    settings.write_bytes(b'{"cluster": "c1"}')
    assert not fetcher.applied(str(marker), settings.read_bytes())  # never applied
    bootstrap.mark_applied(settings, marker)
    assert fetcher.applied(str(marker), settings.read_bytes())
    assert not fetcher.applied(str(marker), b'{"cluster": "c1", "bundle_key": "new"}')  # a `pulumi up` later


@pytest.mark.parametrize("states,commands,waiting", [
    # Powered down: done at once; one still schedulable is set DOWN so that no job wakes it meanwhile.
    ({"x-1": {"IDLE", "CLOUD", "POWERED_DOWN"}, "x-2": {"DOWN", "CLOUD", "POWERED_DOWN"}},
     [("nodename=x-1", "state=down")], []),
    # A job was just placed on a powered-down node (it is not powering up yet): busy.
    ({"x-1": {"ALLOCATED", "CLOUD", "POWERED_DOWN"}}, [("nodename=x-1", "state=power_down_asap")], ["x-1"]),
    # Drained by an admin while busy: still powered down once its jobs end.
    ({"x-1": {"MIXED", "CLOUD", "DRAIN"}}, [("nodename=x-1", "state=power_down_asap")], ["x-1"]),
    # Running a job: drained and powered down once the job ends; waited for.
    ({"x-1": {"ALLOCATED", "CLOUD"}}, [("nodename=x-1", "state=power_down_asap")], ["x-1"]),
    # Already on its way: nothing more to ask; waited for.
    ({"x-1": {"IDLE", "CLOUD", "DRAIN", "POWER_DOWN"}, "x-2": {"IDLE", "CLOUD", "POWERING_DOWN"}}, [], ["x-1", "x-2"]),
    # DOWN with an instance perhaps left: no job runs on it, powered down now.
    ({"x-1": {"DOWN", "CLOUD", "NOT_RESPONDING"}}, [("nodename=x-1", "state=power_down_force")], ["x-1"]),
    # Being launched for a job: drained like a busy node.
    ({"x-1": {"ALLOCATED", "CLOUD", "POWERED_DOWN", "POWERING_UP"}}, [("nodename=x-1", "state=power_down_asap")],
     ["x-1"]),
])
def test_nodes_a_stack_drops_are_retired_before_they_go(states: dict[str, set[str]], commands: list[tuple[str, str]],
                                                        waiting: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[tuple[str, ...]] = []
    monkeypatch.setattr(bootstrap, "run", lambda *args, **kw: ran.append(args))
    assert bootstrap.retire(sorted(states), {n: frozenset(flags) for n, flags in states.items()}) == waiting
    assert [call[2:4] for call in ran] == commands
    assert all(call[-1] == f"reason={reasons.REMOVED}" for call in ran if "state=power_down_force" not in call)
    assert reasons.REMOVED.startswith(reasons.CONFIGURATION)  # the reconciler leaves such a node DOWN


def test_an_update_restarts_the_services_on_the_units_it_wrote(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A new bundle may run its programs from other paths: systemd reads the rewritten units before any restart,
    else it would restart a service on its former unit, whose program the new bundle no longer has."""
    for place in ("etc", "bundle/slurm"):
        (tmp_path / place).mkdir(parents=True)
        (tmp_path / place / "slurm.conf").write_text("NodeName=a-[1-2] CPUs=4 State=CLOUD\n")
    monkeypatch.setattr(bootstrap, "SLURM_ETC", tmp_path / "etc")
    monkeypatch.setattr(bootstrap, "BUNDLE", tmp_path / "bundle")
    steps: list[str] = []
    for name in ("slurm_files", "node_control_units", "budget_guardrail", "node_names", "grow_state_volume",
                 "head_monitoring", "command_line", "shared_examples", "people_accounts", "people_homes"):
        monkeypatch.setattr(bootstrap, name, lambda *args, name=name: steps.append(name))
    monkeypatch.setattr(bootstrap, "run", lambda *args, **kw: steps.append(" ".join(args)))
    settings = contract.ClusterSettings(cluster="c1", region="us-east-1", pools={}, interruption_queue_url="q",
                                        budget=contract.BudgetSettings("b", "1", 100, "q", "t"))
    assert bootstrap.update(settings)
    reload = steps.index("systemctl daemon-reload")
    assert {"node_control_units", "budget_guardrail", "node_names"} <= set(steps[:reload])
    restarts = [step for step in steps if step.startswith("systemctl restart")]
    assert len(restarts) == 3 and all(steps.index(step) > reload for step in restarts)
    # The people first, their associations at once: a removal never waits for nodes the stack drops to drain.
    assert steps[:3] == ["people_accounts", "people_homes", f"sh {tmp_path}/bundle/accounting.sh"]


def test_plugstack_keeps_only_the_spank_plugins_the_image_has(tmp_path: Path) -> None:
    """A head without pyxis (this machine, an image that did not build it) names no pyxis: every sbatch and srun
    would print Slurm's two error lines for it. One that has it keeps the rendered line."""
    pyxis = tmp_path / "spank_pyxis.so"
    rendered = slurm.PLUGSTACK_CONF.replace(slurm.PYXIS_PLUGIN, str(pyxis))
    without = bootstrap.installed_spank_plugins(rendered)
    assert str(pyxis) not in without and without.startswith("#")
    pyxis.touch()
    assert bootstrap.installed_spank_plugins(rendered) == rendered


def test_conf_nodes_reads_every_node_of_slurm_conf() -> None:
    text = "ClusterName=c\nNodeName=p5-od-[1-3] CPUs=192 State=CLOUD\nNodeName=extra-1 CPUs=4 State=CLOUD\n" \
           "PartitionName=p5-od Nodes=p5-od-[1-3] State=UP\n"
    assert bootstrap.conf_nodes(text) == {"p5-od-1", "p5-od-2", "p5-od-3", "extra-1"}


def task_prolog(tmp_path: Path, env_text: str, environment: dict[str, str]) -> str:
    """The TaskProlog as slurmstepd runs it, reading its env file from a copy under tmp_path (the path it reads is
    fixed: /etc/gpucluster/nccl.env, so the copy of the script is pointed there)."""
    env_file = tmp_path / "nccl.env"
    env_file.write_text(env_text)
    script = tmp_path / "task_prolog.sh"
    shipped = (ROOT / "gpucluster" / "node" / "task_prolog.sh").read_text()
    script.write_text(shipped.replace(contract.NCCL_ENV_FILE, str(env_file)))
    assert str(env_file) in script.read_text()
    return subprocess.run(["sh", str(script)], env={"PATH": "/usr/bin:/bin", **environment}, capture_output=True,
                          text=True, check=True).stdout


def test_task_prolog_gives_each_task_the_nccl_settings_and_the_users_win(tmp_path: Path) -> None:
    text = bootstrap.nccl_environment(pool(efa=32))
    printed = task_prolog(tmp_path, text, {"NCCL_DEBUG": "INFO"})
    plugin_dir = contract.AWS_OFI_NCCL_LIB_DIR
    assert printed.splitlines() == ["export NCCL_SOCKET_IFNAME=^docker,lo,veth", f"export LD_LIBRARY_PATH={plugin_dir}",
                                    "export NCCL_NET_PLUGIN=ofi", "export FI_PROVIDER=efa",
                                    "export FI_EFA_USE_HUGE_PAGE=0",
                                    "export NCCL_NET=AWS Libfabric"]  # NCCL_DEBUG is the user's
    assert task_prolog(tmp_path, text, {"NCCL_DEBUG": ""}).count("NCCL_DEBUG") == 0  # set, even empty: theirs


def test_task_prolog_adds_the_plugin_directory_after_the_jobs_own_library_path_once(tmp_path: Path) -> None:
    text = bootstrap.nccl_environment(pool())
    plugin_dir = contract.AWS_OFI_NCCL_LIB_DIR

    def library_path(environment: dict[str, str]) -> list[str]:
        return [line for line in task_prolog(tmp_path, text, environment).splitlines()
                if line.startswith("export LD_LIBRARY_PATH=")]

    assert library_path({"LD_LIBRARY_PATH": "/home/u/venv/lib"}) == [
        f"export LD_LIBRARY_PATH=/home/u/venv/lib:{plugin_dir}"]  # the user's own libraries first
    assert library_path({"LD_LIBRARY_PATH": ""}) == [f"export LD_LIBRARY_PATH={plugin_dir}"]
    # An srun task inside a batch job inherits the batch step's path, which has it already: not twice.
    assert library_path({"LD_LIBRARY_PATH": f"/x:{plugin_dir}"}) == []


@pytest.fixture
def login_user(monkeypatch: pytest.MonkeyPatch) -> pwd.struct_passwd:
    """A user of its own uid (any number: root's chown takes it), whatever this machine's accounts are."""
    if os.geteuid() != 0:
        pytest.skip("the bootstrap runs as root: chown needs it")
    account = pwd.struct_passwd(("alice", "x", 4321, 4321, "", "/home/alice", "/bin/bash"))
    real = pwd.getpwnam
    monkeypatch.setattr(pwd, "getpwnam", lambda name: account if name == "alice" else real(name))
    return account


def test_shared_home_makes_the_login_users_home_once_and_binds_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  login_user: pwd.struct_passwd) -> None:
    ran: list[tuple[str, ...]] = []
    monkeypatch.setattr(bootstrap, "run", lambda *args, **kw: ran.append(args))
    monkeypatch.setattr(bootstrap, "mounted", lambda where: False)
    fstab = tmp_path / "fstab"
    monkeypatch.setattr(bootstrap, "fstab_entry", lambda entry: fstab.write_text(fstab.read_text() + entry + "\n"
                                                                              if fstab.exists() else entry + "\n"))
    shared, home = tmp_path / "fsx-home", tmp_path / "home"
    bootstrap.shared_home(shared, home, users=("alice", "no-such-user"))
    mine = shared / "alice"
    assert mine.is_dir() and not (shared / "no-such-user").exists()
    assert (shared.stat().st_uid, stat.S_IMODE(shared.stat().st_mode)) == (0, 0o755)  # only root makes homes there
    assert (mine.stat().st_uid, stat.S_IMODE(mine.stat().st_mode)) == (4321, 0o750)
    assert {os.lstat(p).st_uid for p in mine.rglob("*")} == {4321} and (mine / ".profile").exists()  # /etc/skel's
    assert [p.name for p in shared.iterdir()] == ["alice"]  # no staging directory left
    # nosuid, nodev: S3 imports set owners and modes from object metadata; no setuid program or device from there.
    assert ("mount", "-o", "bind,nosuid,nodev", str(shared), str(home)) in ran
    assert fstab.read_text() == (f"{shared} {home} none bind,nosuid,nodev,_netdev,nofail,"
                                 "x-systemd.requires-mounts-for=/fsx 0 0\n")
    (mine / "work").write_text("kept")
    bootstrap.shared_home(shared, home, users=("alice",))  # the next node, or a reboot: nothing made again
    assert (mine / "work").read_text() == "kept"


def test_shared_home_never_goes_through_what_a_user_planted_on_fsx(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   login_user: pwd.struct_passwd) -> None:
    """/fsx is world-writable and outlives the head: /fsx/home, or a home in it, may be a user's link by the next
    boot. Root's copy of /etc/skel and its chown must not land where it points."""
    monkeypatch.setattr(bootstrap, "run", lambda *args, **kw: None)
    monkeypatch.setattr(bootstrap, "mounted", lambda where: True)
    monkeypatch.setattr(bootstrap, "fstab_entry", lambda entry: None)
    victim = tmp_path / "etc"
    victim.mkdir(mode=0o700)
    fsx = tmp_path / "fsx"
    fsx.mkdir(mode=0o1777)
    (fsx / "home").symlink_to(victim)
    bootstrap.shared_home(fsx / "home", tmp_path / "home", users=("alice",))
    assert list(victim.iterdir()) == [] and victim.stat().st_uid == 0
    assert not (fsx / "home").is_symlink() and (fsx / "home" / "alice").stat().st_uid == 4321
    assert [p.is_symlink() for p in fsx.glob("home.set-aside-*")] == [True]
    # A home that is a link (as an older layout could have let a user make it): set aside, made anew.
    shutil.rmtree(fsx / "home" / "alice")
    (fsx / "home" / "alice").symlink_to(victim)
    bootstrap.shared_home(fsx / "home", tmp_path / "home", users=("alice",))
    assert list(victim.iterdir()) == [] and (fsx / "home" / "alice").is_dir()
    assert not (fsx / "home" / "alice").is_symlink() and len(list((fsx / "home").glob("alice.set-aside-*"))) == 1


def test_examples_are_copied_once_and_never_through_a_planted_link(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("the bootstrap runs as root")
    source, victim, fsx = tmp_path / "bundle-examples", tmp_path / "etc", tmp_path / "fsx"
    (source / "ddp").mkdir(parents=True)
    (source / "ddp" / "train.sbatch").write_text("v1")
    victim.mkdir(mode=0o700)
    fsx.mkdir(mode=0o1777)
    (fsx / "examples").symlink_to(victim)  # a user's, from before this head
    bootstrap.shared_examples(source, fsx / "examples")
    assert list(victim.iterdir()) == [] and (fsx / "examples" / "ddp" / "train.sbatch").read_text() == "v1"
    assert [p.is_symlink() for p in fsx.glob("examples.set-aside-*")] == [True]
    (fsx / "examples" / "ddp" / "train.sbatch").write_text("an admin's edit")
    (source / "ddp" / "train.sbatch").write_text("v2")  # a new bundle (an update, a boot), with a new example
    (source / "submit.sh").write_text("new")
    bootstrap.shared_examples(source, fsx / "examples")
    assert (fsx / "examples" / "ddp" / "train.sbatch").read_text() == "an admin's edit"
    assert (fsx / "examples" / "submit.sh").read_text() == "new"
    assert sorted(p.name for p in fsx.iterdir() if not p.name.startswith("examples.set-aside")) == ["examples"]


def test_local_scratch_is_roots_all_the_way_down_to_the_users_directories(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Jobs' private /tmp and enroot's directories: 0755 root's, an older image's 1777 layout made so again (a user
    could make another uid's directory in it, root's among them)."""
    if os.geteuid() != 0:
        pytest.skip("the bootstrap runs as root")
    scratch = tmp_path / "local"
    monkeypatch.setattr(contract, "JOB_TMP_DIR", str(scratch / "jobs"))
    monkeypatch.setattr(contract, "ENROOT_DIR", str(scratch / "enroot"))
    monkeypatch.setattr(contract, "PMIX_TMP_DIR", str(scratch / "pmix"))
    monkeypatch.setattr(bootstrap, "mounted", lambda where: False)
    (scratch / "enroot" / "data").mkdir(parents=True)
    (scratch / "enroot" / "data").chmod(0o1777)
    assert bootstrap.local_scratch(tmp_path / "nvme", scratch) == scratch
    enroot = scratch / "enroot"
    made = [scratch, scratch / "jobs", scratch / "pmix", enroot, *(enroot / kind for kind in contract.ENROOT_KINDS)]
    assert {(os.lstat(d).st_uid, stat.S_IMODE(os.lstat(d).st_mode)) for d in made} == {(0, 0o755)}
    # With an instance store: the scratch space is a link to a directory of root's on it.
    nvme = tmp_path / "nvme"
    nvme.mkdir(mode=0o1777)
    monkeypatch.setattr(bootstrap, "mounted", lambda where: where == str(nvme))
    bootstrap.local_scratch(nvme, scratch)
    assert scratch.is_symlink() and scratch.resolve() == nvme / "gpucluster"
    assert (scratch / "jobs").is_dir() and (nvme / "gpucluster").stat().st_uid == 0
    assert len(list(tmp_path.glob("local.set-aside-*"))) == 1  # the root-volume directory of before


def test_enroot_paths_are_per_user_under_the_scratch_space(tmp_path: Path) -> None:
    conf = tmp_path / "enroot.conf.d" / "gpucluster.conf"
    bootstrap.container_storage(conf)
    lines = dict(line.split(" ", 1) for line in conf.read_text().splitlines())
    assert lines == {f"ENROOT_{kind.upper()}_PATH": f"{contract.ENROOT_DIR}/{kind}/$(id -u)"
                     for kind in contract.ENROOT_KINDS}


def test_lustre_is_mounted_nosuid_nodev(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Files come into /fsx from S3 with the objects' owner and mode metadata: whoever may write the bucket must not
    be able to plant a setuid-root program or a device node."""
    entries: list[str] = []
    monkeypatch.setattr(bootstrap, "fstab_entry", entries.append)
    monkeypatch.setattr(bootstrap, "mounted", lambda where: True)
    bootstrap.mount_lustre("fs-1.fsx.us-east-1.amazonaws.com", "abcdefgh", str(tmp_path / "fsx"))
    (entry,) = entries
    assert entry.split()[2] == "lustre" and {"nosuid", "nodev"} <= set(entry.split()[3].split(","))


def test_grafana_listens_on_localhost_with_prometheus_and_our_boards(tmp_path: Path, monkeypatch) -> None:
    """The provisioning Grafana reads: the datasource every board names, the boards from the bundle, 127.0.0.1 only.
    Grafana is not in Debian, so the rehearsal's head runs none; its files are checked here."""
    import json

    from gpucluster.render import dashboards

    home, provisioning, systemd = tmp_path / "grafana-home", tmp_path / "provisioning", tmp_path / "systemd"
    assert bootstrap.grafana(systemd, provisioning, home, tmp_path / "password") is None  # an image without Grafana
    home.mkdir()
    owners = []
    monkeypatch.setattr(shutil, "chown", lambda path, user, group: owners.append((path, user, group)))
    assert bootstrap.grafana(systemd, provisioning, home, tmp_path / "password") == "grafana-server"
    (source,) = json.loads((provisioning / "datasources" / "gpucluster.yaml").read_text())["datasources"]
    assert source["uid"] == dashboards.DATASOURCE_UID and source["url"] == f"http://127.0.0.1:{contract.PROMETHEUS_PORT}"
    (provider,) = json.loads((provisioning / "dashboards" / "gpucluster.yaml").read_text())["providers"]
    assert provider["options"]["path"] == f"{contract.BUNDLE_DIR}/{contract.DASHBOARDS_DIR}"
    unit = (systemd / "grafana-server.service.d" / "gpucluster.conf").read_text()
    assert "Environment=GF_SERVER_HTTP_ADDR=127.0.0.1\n" in unit and "GF_AUTH_ANONYMOUS_ORG_ROLE=Viewer" in unit
    password = tmp_path / "password"
    assert stat.S_IMODE(password.stat().st_mode) == 0o640 and len(password.read_text()) == 32
    assert owners == [(password, "root", "grafana")] and f"GF_SECURITY_ADMIN_PASSWORD__FILE={password}" in unit
    first = password.read_text()
    bootstrap.grafana(systemd, provisioning, home, password)
    assert password.read_text() == first  # kept across boots


def test_dcgm_exporter_wants_the_host_engine_and_starts_after_it(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Review item 2: After= alone orders, it starts nothing; with a disabled nvidia-dcgm the exporter had no engine."""
    monkeypatch.setattr(bootstrap, "in_image", lambda tool: True)
    settings = contract.ClusterSettings(cluster="c", region="us-east-1", pools={"p": pool()})
    for accelerator, wanted in (("nvidia", ["nvidia-dcgm.service"]), ("neuron", [])):
        name = bootstrap.gpu_exporter(settings, pool(accelerator), "p-1", "10.0.0.5", systemd=tmp_path)
        assert name is not None
        text = (tmp_path / name).read_text()
        unit = [line.split("=", 1) for line in text.splitlines() if line.startswith(("After=", "Wants="))]
        assert [v for k, v in unit if k == "Wants"] == wanted, text
        ordered = {u for k, v in unit if k == "After" for u in v.split()}
        # dcgm-exporter runs in docker; neuron-monitor does not.
        assert ordered == (set(wanted) | {"docker.service"} if accelerator == "nvidia" else set()), text


def test_a_configuration_fault_ends_the_compute_boot_before_mounts_and_slurmd(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks run before anything needs what they check (/fsx needs the Lustre module); a fault leaves slurmd
    stopped: a node that registers is returned to service (ReturnToService=2)."""
    steps: list[str] = []

    def recorded(*args: str, check: bool = True, env: dict[str, str] | None = None):
        steps.append(" ".join(args))
        failed = args[-1] == "--configuration"
        return subprocess.CompletedProcess(args, 1 if failed else 0, "",
                                           "gpucluster health (configuration) on p-1: no Lustre client module" * failed)

    for name in ("hosts_entry", "install_munge_key", "wait_for_port", "set_hostname", "start", "mount_lustre"):
        monkeypatch.setattr(bootstrap, name, lambda *a, _n=name, **k: steps.append(_n))
    monkeypatch.setattr(bootstrap, "run", recorded)
    monkeypatch.setattr(bootstrap, "node_name", lambda s: "p-1")
    monkeypatch.setattr(contract, "NCCL_ENV_FILE", str(tmp_path / "nccl.env"))
    settings = contract.ClusterSettings(cluster="c", region="us-east-1", pools={"p": pool()})
    bootstrap.compute(settings, {"GPUCLUSTER_POOL": "p"})
    assert steps[-1] == f"/usr/bin/python3 {contract.HEALTH_PROGRAM} --configuration", steps
    assert "mount_lustre" not in steps and steps.count("start") == 1  # munge only
    assert (tmp_path / "nccl.env").exists()


def test_a_stock_ami_builds_its_image_from_the_bundles_bill_of_materials(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """With image.build false nothing bakes an image: the boot runs build_image.sh ROLE with the bom.json the bundle
    carries. Here the bundle is unpacked into tmp_path and the script from it reads that BOM for real (its steps cut to
    the snapshot by the script's test seam: the package steps are tests/test_image.py's)."""
    from gpucluster.project import EXAMPLES_DIR
    from gpucluster.render import bundle
    from gpucluster.spec import bom
    from gpucluster.spec.model import load_stack

    stack = load_stack(ROOT / "stacks" / "Pulumi.team-a.yaml")
    unpacked, root = tmp_path / "bundle", tmp_path / "root"
    for name, (data, _) in bundle.contents(stack, EXAMPLES_DIR).items():
        (unpacked / name).parent.mkdir(parents=True, exist_ok=True)
        (unpacked / name).write_bytes(data)

    def in_bundle(arg: str) -> str:
        inside = arg.startswith(contract.BUNDLE_DIR)
        return str(unpacked / Path(arg).relative_to(contract.BUNDLE_DIR)) if inside else arg

    assert Path(in_bundle(contract.BUNDLE_BOM)).read_text() == bom.render(stack)  # what the bake would get
    ran: list[tuple[str, ...]] = []

    def run(*args: str, **_: object) -> subprocess.CompletedProcess[str]:
        ran.append(args)
        return subprocess.run([in_bundle(a) for a in args], check=True, text=True, capture_output=True,
                              env={"PATH": os.environ["PATH"], "GPUCLUSTER_IMAGE_ROOT": str(root),
                                   "GPUCLUSTER_BUILD_STEPS": "snapshot"})

    monkeypatch.setattr(bootstrap, "run", run)
    with pytest.raises(RuntimeError, match="finished without writing"):  # a cut build writes no manifest
        bootstrap.ensure_image("head", tmp_path / "manifest.json")
    assert ran == [("bash", contract.BUILD_IMAGE_SCRIPT, "head", contract.BUNDLE_BOM)]
    assert contract.BUILD_IMAGE_SCRIPT in contract.NODE_PROGRAMS  # in the bundle, where a compute node unpacks it
    assert contract.BUNDLE_BOM.startswith(contract.BUNDLE_DIR + "/") and "/lib/" not in contract.BUNDLE_BOM


# --- sshd on the head, for `gpucluster ssh-proxy` ---------------------------------------------------------------------

def sshd_settings(etc_ssh: Path, tmp_path: Path) -> dict[str, list[str]]:
    """The settings the real sshd (Debian's openssh-server, make test installs it) takes from `etc_ssh` in place of
    /etc/ssh (a mount namespace of its own, with the /run/sshd it insists on), as `sshd -T` prints them."""
    assert bootstrap.SSHD.exists(), "install openssh-server (make test does)"
    key = etc_ssh / "ssh_host_ed25519_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    inside = (f"mount --bind {etc_ssh} /etc/ssh && mount -t tmpfs tmpfs /run && mkdir /run/sshd && "
              f"{bootstrap.SSHD} -t && {bootstrap.SSHD} -T -C user=alice,host=laptop,addr=127.0.0.1")
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-ec", inside],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    settings: dict[str, list[str]] = {}
    for line in done.stdout.splitlines():
        keyword, _, value = line.partition(" ")
        settings.setdefault(keyword, []).append(value)
    return settings


def test_sshd_takes_our_settings_first_loopback_and_instance_connect_keys_only(tmp_path: Path) -> None:
    """The drop-in as sshd reads it beside the packaged sshd_config (Include first, as Ubuntu's) and cloud-init's and
    the cloud image's drop-ins, which would allow passwords and root: ours wins, being read first."""
    etc_ssh = tmp_path / "ssh"
    (etc_ssh / "sshd_config.d").mkdir(parents=True)
    shutil.copy("/etc/ssh/sshd_config", etc_ssh / "sshd_config")
    assert (etc_ssh / "sshd_config").read_text().lstrip().startswith("#") and \
        "Include /etc/ssh/sshd_config.d/*.conf" in (etc_ssh / "sshd_config").read_text()
    (etc_ssh / "sshd_config.d" / "50-cloud-init.conf").write_text("PasswordAuthentication yes\nPermitRootLogin yes\n")
    (etc_ssh / "sshd_config.d" / "60-cloudimg-settings.conf").write_text("PasswordAuthentication yes\n")
    (etc_ssh / "sshd_config.d" / bootstrap.SSHD_DROP_IN.name).write_text(bootstrap.sshd_config())
    settings = sshd_settings(etc_ssh, tmp_path)
    assert settings["listenaddress"] == ["127.0.0.1:22"]
    assert settings["permitrootlogin"] == ["no"] and settings["passwordauthentication"] == ["no"]
    assert settings["kbdinteractiveauthentication"] == ["no"] and settings["authenticationmethods"] == ["publickey"]
    assert settings["authorizedkeysfile"] == ["none"]
    assert settings["authorizedkeyscommand"] == [f"{bootstrap.EIC_KEYS_COMMAND} %u %f"]
    assert settings["authorizedkeyscommanduser"] == [lockdown.EIC_USER]
    # Without ours, the other drop-ins' passwords and root logins would be what sshd does.
    (etc_ssh / "sshd_config.d" / bootstrap.SSHD_DROP_IN.name).unlink()
    (etc_ssh / "ssh_host_ed25519_key").unlink()
    (etc_ssh / "ssh_host_ed25519_key.pub").unlink()
    assert sshd_settings(etc_ssh, tmp_path)["passwordauthentication"] == ["yes"]


def test_ssh_server_binds_the_socket_to_loopback_and_restarts_it(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Ubuntu 24.04's ssh.socket binds the port: its address is replaced, sshd's own daemon stopped (it holds the
    old socket), the socket started and insisted on; sshd checks the configuration first."""
    ran: list[str] = []

    def systemctl(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        ran.append(" ".join(args))
        answer = "enabled\n" if args[1:2] == ("is-enabled",) else "active\n"
        return subprocess.CompletedProcess(args, 0, answer, "")

    monkeypatch.setattr(bootstrap, "run", systemctl)
    eic = tmp_path / "eic_run_authorized_keys"
    eic.touch()
    monkeypatch.setattr(bootstrap, "EIC_KEYS_COMMAND", str(eic))
    monkeypatch.setattr(lockdown, "EIC_USER", "root")  # a user this machine has
    drop_in = tmp_path / "sshd_config.d" / "10-gpucluster.conf"
    bootstrap.ssh_server(drop_in, tmp_path / "systemd")
    assert drop_in.read_text() == bootstrap.sshd_config()
    socket = tmp_path / "systemd" / "ssh.socket.d" / "gpucluster.conf"
    assert socket.read_text().splitlines()[1:] == ["ListenStream=", "ListenStream=127.0.0.1:22"]
    assert ran.index(f"{bootstrap.SSHD} -t") < ran.index("systemctl stop ssh.service") \
        < ran.index("systemctl restart ssh.socket") < ran.index("systemctl is-active ssh.socket")


def test_a_head_image_without_instance_connect_boots_without_ssh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(bootstrap, "run", lambda *args, **kw: pytest.fail(f"ran {args}"))
    monkeypatch.setattr(bootstrap, "EIC_KEYS_COMMAND", str(tmp_path / "absent"))
    drop_in = tmp_path / "sshd_config.d" / "10-gpucluster.conf"
    with caplog.at_level(logging.WARNING):
        bootstrap.ssh_server(drop_in, tmp_path / "systemd")
    assert not drop_in.exists() and "ec2-instance-connect" in caplog.text and str(tmp_path / "absent") in caplog.text
