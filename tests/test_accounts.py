"""The people's accounts on a node (gpucluster/node/accounts.py), made by the real shadow tools (useradd, usermod,
userdel, groupadd with --prefix) in a temporary root, and the admins' sudo rules checked by the real visudo; the
signed copy the compute nodes' Prolog applies, and its refusal of an older copy; the accounting script's and the
update timer's associations, run against a recording sacctmgr."""

from __future__ import annotations

import hmac
import json
import os
import shutil
import signal
import stat
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from gpucluster.contract.lockdown import PRIVILEGED_GROUPS
from gpucluster.contract.settings import (
    BUNDLE_DIR,
    LOGIN_USER,
    PEOPLE_ACCOUNTS_FILE,
    PEOPLE_LEAVERS_SCRIPT,
    UPDATE_UNIT,
    PersonSettings,
)
from gpucluster.node import accounts, bootstrap
from gpucluster.render import bundle, slurm
from gpucluster.spec import cost
from gpucluster.spec.model import Stack, load_stack

ROOT_DIR = Path(__file__).resolve().parent.parent
ALICE = PersonSettings(name="alice", uid=20001, gid=20001, max_gpus=1)
BOB = PersonSettings(name="bob", uid=20002, gid=20002, admin=True)
IMAGE_PASSWD = f"root:x:0:0:root:/root:/bin/bash\n{LOGIN_USER}:x:1000:1000::/home/{LOGIN_USER}:/bin/bash\n"
IMAGE_GROUP = f"root:x:0:\n{LOGIN_USER}:x:1000:\nsudo:x:27:{LOGIN_USER}\ndocker:x:999:\n"

needs_tools = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("useradd"),
                                 reason="the shadow tools, as root")


@pytest.fixture
def node(tmp_path: Path) -> Path:
    """A node's account files as an image has them: root, the login user in sudo, an empty docker group."""
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "passwd").write_text(IMAGE_PASSWD)
    (etc / "group").write_text(IMAGE_GROUP)
    for name, text in (("shadow", f"root:*:19000:0:99999:7:::\n{LOGIN_USER}:!:19000:0:99999:7:::\n"),
                       ("gshadow", f"root:*::\n{LOGIN_USER}:!::\nsudo:*::{LOGIN_USER}\ndocker:!::\n")):
        (etc / name).write_text(text)
        (etc / name).chmod(0o600)
    return tmp_path


def test_a_nodes_accounts_are_settled_one_call_at_a_time(node: Path) -> None:
    """Slurm runs the Prologs of jobs starting together side by side: each call's commands run under the node's lock,
    so a second call waits and finds the first one's accounts (a second groupadd of a person would fail)."""
    import fcntl

    held: list[bool] = []

    def run(*args: str) -> None:
        with open(node / accounts.SETTLE_LOCK.lstrip("/"), "a") as other:  # another open file: as another Prolog
            try:
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                held.append(True)
            else:
                held.append(False)

    accounts.settle((ALICE,), node, run=run)
    assert held and all(held)


def entry(root: Path, table: str, name: str) -> list[str]:
    return next(line.split(":") for line in (root / "etc" / table).read_text().splitlines()
                if line.split(":")[0] == name)


@needs_tools
def test_a_person_is_made_with_their_ids_a_locked_password_and_a_group_of_their_own(node: Path) -> None:
    assert accounts.settle((ALICE,), node) == ["made alice (uid 20001)", f"locked {LOGIN_USER}"]
    listed = node / accounts.ACCOUNTS_FILE  # what the cluster made, root's own
    assert listed.read_text() == "alice:20001\n" and stat.S_IMODE(listed.stat().st_mode) == 0o644
    assert entry(node, "passwd", "alice") == ["alice", "x", "20001", "20001", accounts.MARK, "/home/alice", "/bin/bash"]
    assert entry(node, "group", "alice")[:3] == ["alice", "x", "20001"]
    assert entry(node, "shadow", "alice")[1] == "!"  # no password: none to log in with
    assert not (node / accounts.SUDOERS).exists()
    assert accounts.settle((ALICE,), node) == []  # a second boot or update changes nothing


@needs_tools
def test_without_people_the_login_user_is_left_as_the_image_has_it(node: Path) -> None:
    assert accounts.settle((), node) == []
    assert (node / "etc" / "passwd").read_text() == IMAGE_PASSWD
    assert (node / "etc" / "group").read_text() == IMAGE_GROUP


@needs_tools
def test_on_a_compute_node_a_removed_person_is_locked_and_kept_and_a_person_listed_again_gets_in_again(
        node: Path) -> None:
    """No session reaches a compute node; a job of the removed person's still running there may start more steps,
    for which slurmd looks the user up: the account stays, locked."""
    accounts.settle((ALICE, BOB), node)
    assert accounts.settle((ALICE,), node) == ["locked bob", "admins' sudo rules rewritten"]
    bob = entry(node, "passwd", "bob")
    assert bob[2] == "20002" and bob[6] == accounts.NOLOGIN  # kept: his files on /fsx keep their name
    shadow = entry(node, "shadow", "bob")
    assert shadow[1].startswith("!") and shadow[7] == "1"  # expired since 2 January 1970
    assert accounts.settle((ALICE, BOB), node) == ["unlocked bob", "admins' sudo rules rewritten"]
    assert entry(node, "passwd", "bob")[6] == "/bin/bash" and entry(node, "shadow", "bob")[7] == ""


@pytest.fixture
def bobs_process() -> Iterator[subprocess.Popen[bytes]]:
    """A process of bob's uid (his Session Manager shell on the head)."""
    process = subprocess.Popen(["setpriv", f"--reuid={BOB.uid}", f"--regid={BOB.uid}", "--clear-groups",
                                "sleep", "600"])
    yield process
    process.kill()
    process.wait()


@needs_tools
def test_on_the_head_a_removed_persons_processes_are_killed_and_the_account_deleted_its_home_kept(
        node: Path, bobs_process: subprocess.Popen[bytes]) -> None:
    """Session Manager's agent only asks whether the run-as user exists (`id <name>`), never PAM: on the head a
    removed person's account goes, and whatever of theirs runs there (their open shells) is killed."""
    accounts.settle((ALICE, BOB), node, sessions_here=True)
    home = node / "home" / "bob"
    home.mkdir(parents=True)
    (home / "results").write_text("bob's")
    changed = accounts.settle((ALICE,), node, sessions_here=True)
    assert changed == [f"killed bob's processes {bobs_process.pid}", "deleted bob (uid 20002), the home kept",
                       "admins' sudo rules rewritten"]
    assert bobs_process.wait(timeout=10) == -signal.SIGKILL
    for table in ("passwd", "shadow", "group"):
        assert "bob" not in [line.split(":")[0] for line in (node / "etc" / table).read_text().splitlines()], table
    assert (home / "results").read_text() == "bob's"
    assert "bob:20002" in (node / accounts.ACCOUNTS_FILE).read_text().split()  # his uid stays his
    assert accounts.settle((ALICE,), node, sessions_here=True) == []
    assert accounts.settle((ALICE, BOB), node, sessions_here=True) == ["made bob (uid 20002)",
                                                                       "admins' sudo rules rewritten"]


@needs_tools
def test_a_slurm_jobs_processes_are_slurms_and_a_program_named_slurmstepd_is_no_job(tmp_path: Path) -> None:
    """A job of the removed person's runs on (Slurm ends it, or it ends); a program of theirs that merely bears
    slurmstepd's name shelters nothing: only a root slurmstepd's descendants are a job's."""
    stepd = tmp_path / "slurmstepd"
    shutil.copy("/bin/sh", stepd)
    as_bob = f"setpriv --reuid={BOB.uid} --regid={BOB.uid} --clear-groups"
    job = subprocess.Popen([str(stepd), "-c", f"{as_bob} sleep 600; true"])  # root's slurmstepd, bob's job under it
    fake = subprocess.Popen([*as_bob.split(), str(stepd), "-c", "sleep 600; true"])  # bob's own "slurmstepd"
    try:
        deadline = time.monotonic() + 10
        while not _children(job.pid):
            assert time.monotonic() < deadline, "the job's processes did not start"
            time.sleep(0.05)
        jobs = _children(job.pid)
        assert set(jobs) <= accounts.job_processes(accounts._processes(Path("/proc")))
        killed = accounts.end_processes(BOB.uid)
        assert fake.pid in killed and not set(jobs) & set(killed)
        assert fake.wait(timeout=10) == -signal.SIGKILL and job.poll() is None
    finally:
        for process in (job, fake):
            subprocess.run(["pkill", "-KILL", "-P", str(process.pid)], check=False)
            process.kill()
            process.wait()


def _children(pid: int) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(child) for child in found]


@needs_tools
def test_an_account_the_cluster_did_not_make_is_never_touched_whatever_its_gecos(node: Path) -> None:
    """Only the root-owned list says what the cluster made: an admin's account with the people's GECOS mark stays."""
    with (node / "etc" / "passwd").open("a") as passwd:
        passwd.write(f"mallory:x:3000:3000:{accounts.MARK}:/home/mallory:/bin/bash\n")
    for sessions_here in (False, True):
        accounts.settle((ALICE,), node, sessions_here=sessions_here)
        assert entry(node, "passwd", "mallory")[6] == "/bin/bash"


@needs_tools
def test_a_removed_persons_uid_is_not_handed_to_someone_else(node: Path) -> None:
    accounts.settle((ALICE, BOB), node, sessions_here=True)
    accounts.settle((ALICE,), node, sessions_here=True)
    dave = PersonSettings(name="dave", uid=BOB.uid, gid=BOB.uid)
    with pytest.raises(accounts.AccountError) as refused:
        accounts.settle((ALICE, dave), node, sessions_here=True)
    assert str(refused.value) == "dave (uid 20002): uid 20002 was bob's, whom the stack removed"


@needs_tools
def test_a_name_or_uid_the_node_gives_another_account_stops_everything_naming_both(node: Path) -> None:
    with (node / "etc" / "passwd").open("a") as passwd:
        passwd.write("carl:x:20001:1000::/home/carl:/bin/bash\nbob:x:1500:1000::/home/bob:/bin/bash\n")
    before = {name: (node / "etc" / name).read_text() for name in ("passwd", "group", "shadow")}
    with pytest.raises(accounts.AccountError) as refused:
        accounts.settle((ALICE, BOB), node)
    assert str(refused.value) == ("alice (uid 20001): id 20001 is the node's account carl's; "
                                  "bob (uid 20002): the node's account bob exists with id 1500")
    assert {name: (node / "etc" / name).read_text() for name in before} == before  # nothing renumbered or made


@needs_tools
def test_no_person_keeps_a_privileged_group(node: Path) -> None:
    accounts.settle((ALICE, BOB), node)
    group = (node / "etc" / "group").read_text()
    (node / "etc" / "group").write_text(group.replace("docker:x:999:", "docker:x:999:alice,bob"))
    assert "took alice out of docker" in accounts.settle((ALICE, BOB), node)
    members = {fields[0]: fields[3].split(",") for fields in
               (line.split(":") for line in (node / "etc" / "group").read_text().splitlines())}
    assert not {"alice", "bob"} & {m for name in PRIVILEGED_GROUPS for m in members.get(name, [])}


@pytest.mark.skipif(not Path("/usr/sbin/visudo").exists(), reason="sudo's visudo")
def test_only_admins_get_sudo_in_one_file_that_visudo_accepts(tmp_path: Path) -> None:
    assert accounts.sudo_rules((ALICE, BOB), tmp_path)
    rules = tmp_path / accounts.SUDOERS
    assert stat.S_IMODE(rules.stat().st_mode) == 0o440
    granted = [line.split()[0] for line in rules.read_text().splitlines() if line and not line.startswith("#")]
    assert granted == ["bob"]
    assert subprocess.run(["/usr/sbin/visudo", "-cf", str(rules)], capture_output=True).returncode == 0
    assert not accounts.sudo_rules((ALICE, BOB), tmp_path)  # unchanged
    assert accounts.sudo_rules((ALICE,), tmp_path) and not rules.exists()  # no admin left: no file


def test_a_rule_visudo_refuses_never_takes_effect(tmp_path: Path) -> None:
    def refuse(*args: str) -> None:
        raise RuntimeError(f"{' '.join(args)}: syntax error")

    if not Path("/usr/sbin/visudo").exists():
        pytest.skip("sudo's visudo")
    with pytest.raises(RuntimeError):
        accounts.sudo_rules((BOB,), tmp_path, run=refuse)
    assert not (tmp_path / accounts.SUDOERS).exists()


def test_the_people_reach_compute_nodes_signed_with_a_key_derived_from_the_munge_key(tmp_path: Path) -> None:
    key, path, counter = tmp_path / "munge.key", tmp_path / "people.json", tmp_path / "published"
    key.write_bytes(os.urandom(1024))
    assert accounts.published(path, key) is None  # nothing published yet: the boot's own settings hold
    generation = accounts.publish((ALICE, BOB), path, key, counter)
    assert accounts.published(path, key) == (generation, (ALICE, BOB))
    document = json.loads(path.read_text())
    # Not the munge key itself: its own key, HMAC of the label under the munge key.
    assert document["hmac_sha256"] != hmac.new(key.read_bytes(), document["signed"].encode(), "sha256").hexdigest()
    assert document["hmac_sha256"] == hmac.new(hmac.new(key.read_bytes(), b"gpucluster-people-v1", "sha256").digest(),
                                               document["signed"].encode(), "sha256").hexdigest()
    forged = path.read_text().replace('\\"admin\\": false', '\\"admin\\": true')
    assert forged != path.read_text()
    for planted in (forged, "not json", '["a list"]'):
        path.write_text(planted)
        with pytest.raises(accounts.UnsignedFile):
            accounts.published(path, key)


def test_each_publication_has_a_higher_generation_even_when_the_clock_steps_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key, path, counter = tmp_path / "munge.key", tmp_path / "people.json", tmp_path / "published"
    key.write_bytes(os.urandom(1024))
    first = accounts.publish((ALICE,), path, key, counter)
    assert first >= time.time_ns() // 1000 - 60_000_000  # the clock's (a replaced head's new counter starts there)
    monkeypatch.setattr(accounts, "clock_generation", lambda: first - 3_600_000_000)  # an hour back
    assert accounts.publish((ALICE,), path, key, counter) == first + 1
    assert accounts.read_generation(counter) == first + 1


@needs_tools
def test_an_older_signed_copy_brought_back_is_refused_and_the_node_keeps_its_accounts(node: Path) -> None:
    """A copy of an earlier people file (bob still listed, an admin), signed by the head at the time, brought back
    into /fsx (an S3 import): the compute node refuses it, logs why and keeps what it has."""
    key, path, counter = node / "munge.key", node / "people.json", node / "published"
    applied = node / accounts.GENERATION_FILE.relative_to("/")
    key.write_bytes(os.urandom(1024))
    accounts.publish((ALICE, BOB), path, key, counter)
    old = path.read_bytes()
    accounts.apply_published(path, key, applied, node)
    assert entry(node, "passwd", "bob")[6] == "/bin/bash" and (node / accounts.SUDOERS).exists()
    newest = accounts.publish((ALICE,), path, key, counter)
    assert accounts.apply_published(path, key, applied, node) == ["locked bob", "admins' sudo rules rewritten"]
    assert accounts.read_generation(applied) == newest
    path.write_bytes(old)  # brought back
    with pytest.raises(accounts.OlderFile, match="the node keeps its accounts"):
        accounts.apply_published(path, key, applied, node)
    assert entry(node, "passwd", "bob")[6] == accounts.NOLOGIN and not (node / accounts.SUDOERS).exists()
    assert accounts.read_generation(applied) == newest


@needs_tools
def test_a_compute_node_holds_its_boots_settings_against_any_file_published_before_it_booted(node: Path) -> None:
    """A new node's accounts come from the settings it booted with; a file the head published earlier (perhaps a
    copy brought back) is older than that, and refused."""
    key, path, counter = node / "munge.key", node / "people.json", node / "published"
    applied = node / "var/lib/gpucluster/people-generation"
    key.write_bytes(os.urandom(1024))
    accounts.publish((ALICE, BOB), path, key, counter)
    accounts.settle((ALICE,), node)
    accounts.record_generation(accounts.clock_generation(), applied)  # what bootstrap.people_accounts does at boot
    with pytest.raises(accounts.OlderFile):
        accounts.apply_published(path, key, applied, node)
    assert "bob" not in (node / "etc" / "passwd").read_text()
    accounts.publish((ALICE, BOB), path, key, counter)  # a later update
    assert "made bob (uid 20002)" in accounts.apply_published(path, key, applied, node)


# --- Slurm: the associations ------------------------------------------------------------------------------------------

SACCTMGR = """#!/bin/sh
echo "sacctmgr $*" >> "$CALLS"
case "$*" in
  *"list associations"*) printf '\\nalice\\nbob\\ncarol\\ndave\\n' ;;
  *"delete user where name=carol"*) exit 1 ;;  # carol still has a running job: Slurm refuses
esac
"""

# The head's list of the accounts the cluster made: carol left the stack; dave, added by an admin by hand, is not in
# it (whatever his GECOS says).
MADE = "alice:20001\nbob:20002\ncarol:20003\n"
# The team's pending jobs (job id, owner's uid): 101 carol's, 102 alice's, 103 dave's.
SQUEUE = """#!/bin/sh
echo "squeue $*" >> "$CALLS"
printf '101 20003\\n102 20001\\n103 3000\\n'
"""


def run_accounting(stack_text: str, tmp_path: Path,
                   render: Callable[[Stack], str] = slurm.accounting_script) -> list[str]:
    stack_file = tmp_path / "Pulumi.team-t.yaml"
    stack_file.write_text(stack_text)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("sacctmgr", SACCTMGR), ("scancel", '#!/bin/sh\necho "scancel $*" >> "$CALLS"\n'),
                       ("squeue", SQUEUE)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    calls = tmp_path / "calls"
    made = tmp_path / "people-accounts"
    made.write_text(MADE)
    # The list's path, the head's root-owned file, pointed at a temporary copy: the tests do not write under /var/lib.
    script = render(load_stack(stack_file)).replace(PEOPLE_ACCOUNTS_FILE, str(made))
    assert str(made) in script
    subprocess.run(["sh", "-c", script], check=True, env={"PATH": f"{bin_dir}:/usr/bin:/bin", "CALLS": str(calls)})
    return calls.read_text().splitlines()


def team_a() -> str:
    return (ROOT_DIR / "stacks" / "Pulumi.team-a.yaml").read_text()


def test_each_person_is_an_association_under_the_team_with_max_gpus_as_its_gpu_limit(tmp_path: Path) -> None:
    stack = load_stack(ROOT_DIR / "stacks" / "Pulumi.team-a.yaml")
    team = stack.spec.team
    calls = run_accounting(team_a(), tmp_path)
    for person in stack.spec.people:
        assert f"sacctmgr -i add user {person.name} Account={team} DefaultAccount={team}" in calls
        [limits] = [c for c in calls if c.startswith(f"sacctmgr -i modify user where name={person.name} ")]
        assert f"GrpTRES=gres/gpu={person.max_gpus or -1}" in limits.split()
    # The team's money quota stays on the account, shared (cent-minutes of the billing TRES).
    quota = f"GrpTRESMins=billing={cost.quota(stack).billing_minutes},gres/gpu=-1"
    assert any(c.startswith(f"sacctmgr -i modify account where name={team} set {quota} ") for c in calls)


def test_someone_no_longer_listed_loses_pending_jobs_and_association_or_else_submits_nothing(tmp_path: Path) -> None:
    stack = load_stack(ROOT_DIR / "stacks" / "Pulumi.team-a.yaml")
    team = stack.spec.team
    listed = {person.name for person in stack.spec.people}
    assert listed == {"alice", "bob"}  # the stand-in's associations: alice, bob, carol (who left) and dave
    calls = run_accounting(team_a(), tmp_path)
    # Her pending jobs by her uid (her account is gone from the head), only hers, once: dave is nobody the cluster made.
    assert f"squeue -h -t PENDING -A {team} -o %i %U" in calls
    assert [c for c in calls if c.startswith("scancel")] == ["scancel 101"]
    assert f"sacctmgr -i delete user where name=carol account={team}" in calls
    assert f"sacctmgr -i modify user where name=carol account={team} set GrpSubmitJobs=0" in calls  # delete refused
    assert not [c for c in calls if ("delete" in c or "GrpSubmitJobs=0" in c)
                and any(name in c for name in ("alice", "bob", "dave"))]


def test_the_head_removes_a_leavers_association_every_minute_once_their_jobs_are_gone(tmp_path: Path) -> None:
    """The update timer's first command is the leavers' script: a removed person's association, kept while a job of
    theirs ran, goes within a minute of its end, without a `pulumi up`."""
    bootstrap.update_timer(tmp_path)
    service = (tmp_path / f"{UPDATE_UNIT}.service").read_text()
    assert f"ExecStart=-/bin/sh {PEOPLE_LEAVERS_SCRIPT}\n" in service
    stack = load_stack(ROOT_DIR / "stacks" / "Pulumi.team-a.yaml")
    shipped = bundle.contents(stack, ROOT_DIR / "examples")
    assert shipped[str(Path(PEOPLE_LEAVERS_SCRIPT).relative_to(BUNDLE_DIR))] == (
        slurm.leavers_script(stack).encode(), 0o755)
    calls = run_accounting(team_a(), tmp_path, slurm.leavers_script)
    team = stack.spec.team
    assert f"sacctmgr -i delete user where name=carol account={team}" in calls
    assert not [c for c in calls if " add " in c or "delete" in c and "carol" not in c]


def test_with_people_the_login_user_keeps_its_association_for_verifys_jobs(tmp_path: Path) -> None:
    """Nobody connects as the login user once the stack lists people (its account is locked), but `gpucluster
    verify` submits its measuring jobs as it (root through runuser): its association stays in the team's account."""
    team = load_stack(ROOT_DIR / "stacks" / "Pulumi.team-a.yaml").spec.team
    calls = run_accounting(team_a(), tmp_path)
    assert f"sacctmgr -i add user {LOGIN_USER} Account={team} DefaultAccount={team}" in calls
    assert not [c for c in calls if ("delete" in c or "scancel" in c or "GrpSubmitJobs=0" in c) and LOGIN_USER in c]


def test_without_people_the_login_user_is_the_teams_only_user(tmp_path: Path) -> None:
    document = yaml.safe_load(team_a())
    del document["config"]["gpucluster:cluster"]["users"]
    adds = [c for c in run_accounting(yaml.safe_dump(document), tmp_path) if " add user " in c]
    assert [c.split()[4] for c in adds] == [LOGIN_USER, "root"]


def test_fair_share_orders_the_teams_people() -> None:
    conf = slurm.slurm_conf(load_stack(ROOT_DIR / "stacks" / "Pulumi.team-a.yaml"))
    settings = dict(line.split("=", 1) for line in conf.splitlines() if "=" in line and not line.startswith("#"))
    assert settings["PriorityType"] == "priority/multifactor"
    assert int(settings["PriorityWeightFairshare"]) > 0


def test_the_prolog_serves_on_with_a_planted_file_and_stops_at_a_clash(monkeypatch: pytest.MonkeyPatch) -> None:
    """health.py's Prolog: a file the head did not sign changes nothing and keeps no job off the node; a clash is the
    node's problem (it goes DOWN with it, the job requeued elsewhere)."""
    from gpucluster.node import health

    for refusal in (accounts.UnsignedFile("/fsx/.gpucluster/people.json is not signed"),
                    accounts.OlderFile("/fsx/.gpucluster/people.json has generation 1, older than 2")):
        def planted(error: Exception = refusal) -> list[str]:
            raise error

        monkeypatch.setattr(accounts, "apply_published", planted)
        assert health.people_accounts() == ""

    def clash() -> list[str]:
        raise accounts.AccountError("alice (uid 20001): id 20001 is the node's account carl's")

    monkeypatch.setattr(accounts, "apply_published", clash)
    assert health.people_accounts() == "accounts: alice (uid 20001): id 20001 is the node's account carl's"
