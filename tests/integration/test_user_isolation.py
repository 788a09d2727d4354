"""A user cannot disturb other users or the cluster: the login user's attacks, from a login shell on the head and from
inside jobs, on one local cluster (tests/local_cluster.py) that this module's tests share (one boot for all; each test
leaves no job of its own behind). Root's commands stand for the admin's; the login user's for any team member's."""

from __future__ import annotations

import dataclasses
import json
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpucluster.contract.settings import BUNDLE_DIR, ENROOT_DIR, EVENTS_LOG, JOB_TMP_DIR, LOGIN_USER, STATE_DIR
from gpucluster.spec.model import SlurmSpec, load_stack
from local_cluster import LocalCluster, RehearsalNode, missing_tools, new_cluster_root, spot_warning

# One cluster for the module: under xdist its tests stay on one worker (--dist loadgroup).
pytestmark = [pytest.mark.rehearsal, pytest.mark.xdist_group("user-isolation")]

STACK = Path(__file__).resolve().parents[1] / "stacks" / "Pulumi.local.yaml"
# Caps small enough for a flood to reach in a test, large enough for the other tests' few jobs of the login user.
CAPS = {"max_submitted_jobs_per_user": 10, "max_running_jobs_per_user": 10, "max_submitted_jobs": 20,
        "max_running_jobs": 20, "max_batch_script_kib": 64}


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    assert not missing_tools(), f"make setup first (make test does): missing {missing_tools()}"
    root = new_cluster_root()
    stack = load_stack(STACK)
    stack = dataclasses.replace(stack, spec=stack.spec.model_copy(update={"slurm": SlurmSpec(
        **{**stack.spec.slurm.model_dump(), **CAPS})}))
    local = LocalCluster(stack, root).start()  # stopped itself if it failed
    try:
        yield local
    finally:
        local.stop()
        shutil.rmtree(root, ignore_errors=True)


def as_login_user(cluster: LocalCluster, command: str) -> subprocess.CompletedProcess[str]:
    """A login shell of the login user's on the head (what Session Manager gives), its exit status kept."""
    return cluster.head.enter("runuser", "-l", LOGIN_USER, "-c", command, check=False)


# An XID line as the NVIDIA driver writes it into the kernel log, and the two ways a user puts it there: a program
# whose file name is the line, run with an empty argv (Linux 5.18 and later log "process '...' launched '<path>' with
# NULL argv", once a boot), and /dev/kmsg where it is writable.
FORGE_XID = r'''
import ctypes, os, tempfile
line = "NVRM: Xid (PCI:0000:53:00): 79, pid=1234, GPU has fallen off the bus."
program = os.path.join(tempfile.mkdtemp(), line)
with open(program, "w") as f:
    f.write("#!/bin/sh\nexit 0\n")
os.chmod(program, 0o755)
child = os.fork()
if child == 0:  # os.execve refuses an empty argv; the kernel takes one
    empty = (ctypes.c_char_p * 1)(None)
    ctypes.CDLL(None).execve(program.encode(), empty, empty)
    os._exit(127)
print("ran with an empty argv:", os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]))
try:
    with open("/dev/kmsg", "w") as kmsg:
        kmsg.write("<3>" + line + "\n")
    print("/dev/kmsg: written")
except OSError as exc:
    print("/dev/kmsg:", exc.strerror)
'''


def test_a_forged_kernel_log_xid_drains_nothing_and_a_driver_counted_fault_does(cluster: LocalCluster) -> None:
    """Inside a job on a GPU node, the login user writes a fatal XID line into the kernel log both ways; the node's
    health check (as slurmd runs it) then drains nothing, and the reconciler terminates nothing. The same check does
    drain for a fault the driver reports (DCGM's injected XID 79), with DCGM's words: the check ran and looked."""
    forge = cluster.fsx / "forge-xid.py"
    forge.write_text(FORGE_XID)
    forge.chmod(0o644)
    hold, release = cluster.held("forged-xid")
    job = as_login_user(cluster, f"sbatch --parsable -p spot -o forged-xid-%j.out --wrap "
                                 f"'/usr/bin/python3 /fsx/{forge.name}; {hold}'").stdout.strip()
    assert job.isdigit(), job
    try:
        cluster.wait(f"job {job} to forge its XID lines", lambda: "/dev/kmsg:" in as_login_user(
            cluster, f"cat forged-xid-{job}.out 2>/dev/null").stdout, 240)
        said = as_login_user(cluster, f"cat forged-xid-{job}.out").stdout
        assert "ran with an empty argv: 0" in said, said
        node = cluster.run("squeue", "-h", "-j", job, "-o", "%N").strip()
        instance = cluster.instances()[node]

        checked = cluster.health_check(node)
        assert checked.returncode == 0 and "gpucluster health" not in checked.stderr, checked.stderr
        assert not cluster.run("sinfo", "--noheader", "-R", "-n", node, "--format=%E").strip()
        assert "replacing" not in cluster.reconcile() and cluster.instances()[node] == instance

        # The driver's own report of the same XID (through DCGM): drained, the job on it finishes first.
        cluster.inject_gpu_fault(node, field=230, value=79)
        cluster.health_check(node)
        reason = cluster.run("sinfo", "--noheader", "-R", "-n", node, "--format=%E")
        assert reason.startswith("gpucluster: replace: health: DCGM health: GPU 0: Detected XID 79"), reason
        # A fresh host engine forgets the injected fault; the node goes back to service, its instance never left.
        cluster.node(node).enter("systemctl", "restart", "nvidia-dcgm.service")
        cluster.run("scontrol", "update", f"nodename={node}", "state=resume")
        assert cluster.health_check(node).returncode == 0  # sets the watches again
        assert not cluster.run("sinfo", "--noheader", "-R", "-n", node, "--format=%E").strip()
        assert cluster.instances()[node] == instance
    finally:
        release.touch()
        cluster.wait(f"job {job} to end", lambda: cluster.run("squeue", "-h", "-j", job, check=False).strip() == "",
                     120)
        release.unlink(missing_ok=True)
        forge.unlink(missing_ok=True)


REFUSED = "sbatch: error: Batch job submission failed: "


def login_jobs(cluster: LocalCluster) -> list[str]:
    """The login user's jobs, as root sees them."""
    return cluster.run("squeue", "--noheader", "--user", LOGIN_USER, "--format=%i").split()


def cancel_login_jobs(cluster: LocalCluster) -> None:
    cluster.run("scancel", "--user", LOGIN_USER)
    cluster.wait("the login user's jobs to leave the queue", lambda: not login_jobs(cluster), 60)


def test_a_flood_of_held_jobs_stops_at_the_users_cap_and_root_still_submits(cluster: LocalCluster) -> None:
    cap = CAPS["max_submitted_jobs_per_user"]
    try:
        flood = as_login_user(cluster, f"for i in $(seq {cap + 5}); do sbatch --hold --parsable --wrap true "
                                       "|| exit 1; done")
        assert flood.returncode == 1, flood.stdout + flood.stderr
        assert len(flood.stdout.split()) == cap == len(login_jobs(cluster)), flood.stdout
        # Slurm's own reason, as the user reads it.
        assert flood.stderr.splitlines() == [
            "sbatch: error: AssocMaxSubmitJobLimit",
            f"{REFUSED}Job violates accounting/QOS policy (job submit limit, user's size and/or time limits)"], \
            flood.stderr
        # Root under its own account, as on a cluster (here root is in the team's account too, for other tests).
        admin = cluster.run("sbatch", "--account=root", "--hold", "--parsable", "--wrap", "true").strip()
        assert admin.isdigit()
        cluster.run("scancel", admin)
    finally:
        cancel_login_jobs(cluster)


def test_a_batch_script_over_the_bound_is_refused(cluster: LocalCluster) -> None:
    limit = CAPS["max_batch_script_kib"] * 1024
    scripts = {}
    for name, size in (("fits", limit), ("too-big", limit + 1)):
        # A comment line fills the script to its size: at the bound the job is taken; a byte more, refused.
        head, tail = "#!/bin/sh\n#", "\ntrue\n"
        scripts[name] = cluster.fsx / f"limit-{name}.sh"
        scripts[name].write_text(head + "x" * (size - len(head) - len(tail)) + tail)
        assert scripts[name].stat().st_size == size
    try:
        fits = as_login_user(cluster, f"sbatch --hold --parsable /fsx/{scripts['fits'].name}")
        assert fits.returncode == 0 and fits.stdout.strip().isdigit(), fits.stdout + fits.stderr
        too_big = as_login_user(cluster, f"sbatch --hold --parsable /fsx/{scripts['too-big'].name}")
        assert too_big.returncode != 0 and too_big.stderr.startswith(REFUSED), too_big.stdout + too_big.stderr
        assert login_jobs(cluster) == [fits.stdout.strip()]
    finally:
        cancel_login_jobs(cluster)
        for script in scripts.values():
            script.unlink()


def test_users_see_only_their_own_jobs_and_admins_see_all(cluster: LocalCluster) -> None:
    secret = "root-secret"
    admin = cluster.run("sbatch", "--hold", "--parsable", f"--job-name={secret}", f"--comment={secret}",
                        "--wrap", "true").strip()
    try:
        mine = as_login_user(cluster, "sbatch --hold --parsable --job-name=mine --wrap true").stdout.strip()
        assert mine.isdigit()
        shown = as_login_user(cluster, f"scontrol show job {admin}")
        assert shown.returncode != 0 and secret not in shown.stdout + shown.stderr, shown.stdout
        assert secret in cluster.run("scontrol", "show", "job", admin)  # the check above can fail
        queue = as_login_user(cluster, "squeue --all --noheader --format='%i %j'")
        assert queue.returncode == 0 and queue.stdout.split() == [mine, "mine"], queue.stdout
        assert "JobName=mine" in cluster.run("scontrol", "show", "job", mine)  # the admin sees the user's job
    finally:
        cluster.run("scancel", admin)
        cancel_login_jobs(cluster)
    # Held jobs reach accounting when they end: both are there for root before the user asks, so an answer without
    # root's job is privacy, not a record still on its way.
    accounted = ("sacct", "-a", "-X", "-n", "-P", f"--jobs={admin},{mine}", "-o", "JobID,JobName")
    cluster.wait("accounting to record both jobs", lambda: {f"{admin}|{secret}", f"{mine}|mine"} <= set(
        cluster.run(*accounted).split()), 60)
    seen = as_login_user(cluster, " ".join(accounted))
    assert seen.returncode == 0 and secret not in seen.stdout and f"{mine}|mine" in seen.stdout.split(), seen.stdout


def test_a_changed_cap_reaches_the_users_at_the_next_update(cluster: LocalCluster) -> None:
    """The head runs accounting.sh again at each `pulumi up`: it sets the account's caps, and the users' associations
    (which have none of their own) take them."""
    team, cap = cluster.stack.spec.team, CAPS["max_submitted_jobs_per_user"]
    user_cap = ("sacctmgr", "-n", "-P", "show", "assoc", "where", f"account={team}", f"user={LOGIN_USER}",
                "format=MaxSubmit")
    cluster.run("sacctmgr", "-i", "modify", "account", "where", f"name={team}", "set", "MaxSubmitJobs=3")
    try:
        assert cluster.run(*user_cap).strip() == "3"  # an earlier stack's cap, as the user has it
    finally:
        cluster.head.enter("sh", f"{BUNDLE_DIR}/accounting.sh")
    assert cluster.run(*user_cap).strip() == str(cap)


def test_slurms_state_is_on_the_state_volume_apart_from_what_users_fill(cluster: LocalCluster) -> None:
    """slurmctld's state directory is on the head's state volume (what the StateVolumeFilling alert watches); homes,
    /tmp, logs and /fsx are elsewhere, and no user can write onto the volume directly: what users put there is what
    Slurm keeps of their jobs, within the stack's bounds."""
    def mount_of(path: str) -> str:
        return cluster.head.enter("findmnt", "-n", "-o", "TARGET", "-T", path).stdout.strip()

    assert mount_of(f"{STATE_DIR}/slurmctld") == STATE_DIR
    assert all(mount_of(path) != STATE_DIR for path in ("/tmp", "/var/tmp", "/home", "/var/log", "/fsx", "/dev/shm"))
    writable = as_login_user(cluster, f"for d in $(find {STATE_DIR} -maxdepth 2 -type d); do "
                                      "test -w $d && echo $d; done; true")
    assert writable.returncode == 0 and writable.stdout == "", writable.stdout


def job_record(cluster: LocalCluster, job: str) -> dict[str, Any]:
    """The job as Slurm's JSON has it (never scontrol's text, which the job's own fields can forge)."""
    record: dict[str, Any] = json.loads(cluster.run("scontrol", "show", "job", job, "--json"))["jobs"][0]
    return record


def test_a_forged_job_comment_makes_no_program_act_on_another_users_job(cluster: LocalCluster) -> None:
    """Root's job runs on standby-1, another on standby-2. The login user's held job names root's job as running on
    standby-2 in its comment and its name (scontrol's `--oneliner` text let them pass for its real fields). EC2 warns
    of standby-2's reclaim: the interruptions service (as slurm) signals and requeues the job really there, and
    neither root's job elsewhere nor the job that only claims to be there."""
    hold, release = cluster.held("forged-comment")
    # Each job says when it is ready to hear SIGUSR1 (a job is RUNNING while its prolog still runs) and when it did.
    trap = "trap 'echo USR1 >> /fsx/signalled-$SLURM_JOB_ID' USR1; touch /fsx/ready-$SLURM_JOB_ID; "
    jobs: list[str] = []
    try:
        for node in ("standby-1", "standby-2"):  # pinned: requeued, the warned job waits for its drained node
            jobs.append(cluster.run("sbatch", "--parsable", "-p", "standby", "-w", node, "-o", "/dev/null", "--wrap",
                                    trap + hold).strip())
        victim, warned_job = jobs
        forged_text = f" JobId={victim} JobState=RUNNING NodeList=standby-2 BatchHost=standby-2"
        submitted = as_login_user(cluster, " ".join([
            "sbatch --parsable --hold -p standby -o /dev/null", "--comment", shlex.quote(forged_text),
            "--job-name", shlex.quote(f"x\nJobId={victim} JobState=RUNNING NodeList=standby-2"), "--wrap true"]))
        assert submitted.returncode == 0, submitted.stderr
        forged = submitted.stdout.strip()
        jobs.append(forged)
        assert job_record(cluster, forged)["comment"] == forged_text  # Slurm keeps the text as it was given
        cluster.wait("both of root's jobs to run", lambda: all(
            (cluster.fsx / f"ready-{j}").exists() for j in (victim, warned_job)), 240)
        instance = cluster.instances()["standby-2"]

        cluster.aws("sqs").send_message(QueueUrl=cluster.interruptions, MessageBody=spot_warning(instance))

        def events() -> list[dict[str, Any]]:
            log = cluster.head.path(EVENTS_LOG)
            return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

        def requeued() -> list[str]:
            return [e["job"] for e in events() if e["event"] == "requeued" and e["job"] in jobs]

        cluster.wait(f"job {warned_job} to be requeued", lambda: bool(requeued()), 60)
        warned = [e for e in events() if e["event"] == "spot interruption warning" and e.get("instance") == instance]
        assert [e["jobs"] for e in warned] == [[warned_job]], warned
        assert requeued() == [warned_job]
        assert job_record(cluster, warned_job)["restart_cnt"] == 1
        assert (cluster.fsx / f"signalled-{warned_job}").exists()
        # Root's job elsewhere: not signalled, not requeued, still running. The forged one: untouched, still held.
        assert not (cluster.fsx / f"signalled-{victim}").exists()
        for job, state in ((victim, ["RUNNING"]), (forged, ["PENDING"])):
            record = job_record(cluster, job)
            assert (record["job_state"], record["restart_cnt"]) == (state, 0), record
    finally:
        if jobs:
            cluster.run("scancel", *jobs, check=False)
        release.touch()
    # What the reconciler does to a node drained for a new instance once it is idle (without its other work, such as
    # powering up the always-on node): the next test finds the cluster as it was.
    cluster.run("scontrol", "update", "nodename=standby-2", "state=power_down_force")
    cluster.wait("standby-2's instance to go", lambda: "standby-2" not in cluster.instances(), 60)


def always_on_node(cluster: LocalCluster) -> tuple[str, RehearsalNode]:
    """The always-on pool's node (it is never suspended: jobs on it run on one instance) and its instance."""
    node = "always-1"
    if node not in cluster.instances():
        cluster.reconcile()  # the reconciler powers it up (its timer does not fire in the rehearsal: one pass here)
    cluster.wait(f"{node} to come up", lambda: cluster.run("sinfo", "-h", "-n", node, "-o", "%T").strip() == "idle",
                 240)
    return node, cluster.nodes[cluster.instances()[node]]


def test_nothing_a_job_leaves_in_tmp_or_dev_shm_is_there_for_the_next_job(cluster: LocalCluster) -> None:
    """Slurm's job_container/tmpfs: each job its own /tmp and /dev/shm, gone when it ends. Found before: 200 MiB a
    job left in /dev/shm, and a file in /tmp, were there for the next user's job on the node."""
    node, instance = always_on_node(cluster)
    home = cluster.fsx / "home" / LOGIN_USER
    left = as_login_user(cluster, f"sbatch --wait --parsable -p always -w {node} -o left.out --wrap '"
                                  "echo secret > /tmp/left-behind && head -c 1048576 /dev/zero > /dev/shm/left-behind "
                                  "&& ls /tmp/left-behind /dev/shm/left-behind'")
    assert left.returncode == 0, left.stderr + (home / "left.out").read_text()
    assert sorted((home / "left.out").read_text().split()) == ["/dev/shm/left-behind", "/tmp/left-behind"]  # written
    out = cluster.root / "next.out"
    cluster.run("sbatch", "--wait", "-p", "always", "-w", node, "-o", str(out), "--wrap",
                "find /tmp /dev/shm -name left-behind; echo looked")
    assert out.read_text() == "looked\n"
    assert cluster.instances()[node] == instance.name  # one instance throughout: the node was not replaced between
    # Nor on the node outside jobs: the job's /tmp lived under the scratch space, and went with the job.
    left_on_node = instance.enter("sh", "-c", f"ls /tmp/left-behind /dev/shm/left-behind 2>/dev/null; "
                                              f"find {JOB_TMP_DIR} -name left-behind", check=False)
    assert left_on_node.stdout == "", left_on_node.stdout


def test_container_directories_are_made_by_root_one_per_user(cluster: LocalCluster) -> None:
    """enroot's directories: root's parents (no 1777), so a user cannot make another's (root's: uid 0) first; the
    Prolog makes each job user's own, and sets aside what is not (a link planted by an older image's layout)."""
    node, instance = always_on_node(cluster)
    data = Path(ENROOT_DIR) / "data"
    made = as_login_user(cluster, f"srun -p always -w {node} mkdir {data}/4242")  # a uid no job used yet
    assert made.returncode != 0 and "Permission denied" in made.stderr, made
    uid = int(instance.enter("id", "-u", LOGIN_USER).stdout)
    mine = data / str(uid)
    instance.enter("rm", "-rf", str(mine))
    instance.enter("ln", "-s", "/etc", str(mine))  # as a user could have left it under the old 1777 layout
    instance.enter("chown", "-h", f"{uid}:{uid}", str(mine))
    seen = as_login_user(cluster, f"srun -p always -w {node} stat -c '%U %F %a' {mine} {data}")
    assert seen.returncode == 0, seen.stderr
    assert seen.stdout.splitlines() == [f"{LOGIN_USER} directory 700", "root directory 755"]
    aside = instance.enter("find", str(data), "-maxdepth", "1", "-name", f"{uid}.set-aside-*", "-type", "l").stdout
    assert aside.strip(), "the planted link was not set aside"
    instance.enter("rm", "-f", *aside.split())
    # root's job gets root's own; the user's stays the user's
    assert cluster.run("srun", "-p", "always", "-w", node, "stat", "-c", "%U", str(data / "0")).split() == ["root"]
