"""A user cannot disturb other users or the cluster: the login user's attacks, from a login shell on the head and from
inside jobs, on one local cluster (tests/local_cluster.py) that this module's tests share (one boot for all; each test
leaves no job of its own behind). Root's commands stand for the admin's; the login user's for any team member's."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpucluster.contract.settings import ENROOT_DIR, JOB_TMP_DIR, LOGIN_USER
from gpucluster.spec.model import load_stack
from local_cluster import LocalCluster, RehearsalNode

# One cluster for the module: under xdist its tests stay on one worker (--dist loadgroup).
pytestmark = [pytest.mark.rehearsal, pytest.mark.xdist_group("user-isolation")]

STACK = Path(__file__).resolve().parents[1] / "stacks" / "Pulumi.local.yaml"


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    root = Path(tempfile.mkdtemp(prefix="gpucluster-cluster-"))
    local = LocalCluster(load_stack(STACK), root).start()  # stopped itself if it failed
    try:
        yield local
    finally:
        local.stop()
        shutil.rmtree(root, ignore_errors=True)


def as_login_user(cluster: LocalCluster, command: str) -> subprocess.CompletedProcess[str]:
    """A login shell of the login user's on the head (what Session Manager gives), its exit status kept."""
    return cluster.head.enter("runuser", "-l", LOGIN_USER, "-c", command, check=False)


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
