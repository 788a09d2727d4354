"""The stack's people on the boot rehearsal's cluster (tests/local_cluster.py): each an account of their own on the
head and on compute nodes scaled from zero, a home of their own, an association of their own in Slurm with their
max_gpus; and a changed `users:` list applied in place by the head's update (`pulumi up` on day 2), no reboot: a
removed person's processes on the head killed and account deleted there, their association gone at the update
timer's next tick after their last job, and an older signed people file brought back into /fsx refused."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Callable

import pytest

from conftest import FIXTURES
from gpucluster.contract import slurm_json
from gpucluster.contract.settings import LOGIN_USER
from gpucluster.node import usage
from gpucluster.node.slurm_control import SlurmControl
from gpucluster.spec.model import Stack, load_stack
from local_cluster import LocalCluster

pytestmark = pytest.mark.rehearsal

ALWAYS_POOL = """      - name: always  # one always-on node (min_nodes), which the reconciler keeps up
        instance_type: g6.xlarge
        capacity: on-demand
        min_nodes: 1
        max_nodes: 1
"""
SUSPEND = "      suspend_time_seconds: 15\n"
PERSON = """      - name: {name}
        principals: [arn:aws:iam::123456789012:role/{name}]
        max_gpus: 1
"""


def people_stack(tmp_path: Path, *names: str) -> Stack:
    """The local stack with these people, each at most one GPU at once. No always-on node; an idle node stays up a
    minute (not 15 s), so that a node booted before a change is still there to take a job after it."""
    text = (FIXTURES / "Pulumi.local.yaml").read_text()
    assert ALWAYS_POOL in text and text.endswith(SUSPEND)
    text = text.replace(ALWAYS_POOL, "").replace(SUSPEND, "      suspend_time_seconds: 60\n")
    path = tmp_path / "Pulumi.local.yaml"
    path.write_text(text + "    users:\n" + "".join(PERSON.format(name=name) for name in names))
    return load_stack(path)


def as_person(cluster: LocalCluster, name: str, *command: str) -> subprocess.CompletedProcess[str]:
    """A command of `name`'s on the head (what their Session Manager session runs), from their home."""
    return cluster.head.enter("runuser", "-u", name, "--", "sh", "-c", 'cd "$HOME" && exec "$@"', "sh", *command,
                              check=False)


def submit(cluster: LocalCluster, name: str, *args: str) -> str:
    done = as_person(cluster, name, "sbatch", "--parsable", "-o", "/dev/null", *args)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def job_field(cluster: LocalCluster, job: str, key: str) -> str:
    fields = dict(word.split("=", 1) for word in cluster.run("scontrol", "show", "job", job).split() if "=" in word)
    return fields[key]


def test_people_have_accounts_homes_and_limits_of_their_own_and_a_change_reaches_the_running_cluster(
        start_cluster: Callable[[Stack], LocalCluster], tmp_path: Path) -> None:
    stack = people_stack(tmp_path, "alice", "bob")
    alice, bob = stack.spec.people
    cluster = start_cluster(stack)
    home = cluster.fsx / "home"

    hold_alice, release_alice = cluster.held("alice")
    mine = submit(cluster, "alice", "-p", "spot", "--gres=gpu:1", "--wrap", f"id -u > ran-as; {hold_alice}")
    hold_bob, release_bob = cluster.held("bob")
    first = submit(cluster, "bob", "-p", "standby", "--gres=gpu:1", "--wrap", hold_bob)
    cluster.wait("alice's and bob's jobs to run on nodes scaled from zero",
                 lambda: cluster.job_state(mine) == cluster.job_state(first) == "RUNNING", 150)
    node = job_field(cluster, mine, "NodeList")

    # alice's job ran as alice, on a compute node, and wrote into her home, which is hers alone.
    assert job_field(cluster, mine, "UserId") == f"alice({alice.uid})"
    cluster.wait("alice's job to write into her home", lambda: (home / "alice" / "ran-as").exists(), 30)
    assert (home / "alice" / "ran-as").read_text().strip() == str(alice.uid)
    assert (home / "alice" / "ran-as").stat().st_uid == alice.uid
    assert {p.name: (p.stat().st_uid, p.stat().st_mode & 0o777) for p in home.iterdir()} == {
        "alice": (alice.uid, 0o700), "bob": (bob.uid, 0o700)}

    # bob can neither read alice's home nor cancel or hold her job.
    assert as_person(cluster, "bob", "ls", "/home/alice").returncode != 0
    assert as_person(cluster, "bob", "cat", "/home/alice/ran-as").returncode != 0
    assert as_person(cluster, "bob", "scancel", mine).returncode != 0
    assert as_person(cluster, "bob", "scontrol", "hold", mine).returncode != 0
    assert cluster.job_state(mine) == "RUNNING" and job_field(cluster, mine, "Priority") != "0"

    # Slurm's fair share knows both under the team's account; bob's second GPU is one too many, alice's job runs.
    shares = cluster.run("sshare", "-a", "-n", "-P", "-o", "Account,User").split()
    assert {f"{stack.spec.team}|alice", f"{stack.spec.team}|bob"} <= set(shares), shares
    # `gpucluster cost` by person: root (an admin's sudo) reads each person's row under the team's account beside the
    # team's own; alice without sudo reads her own row only (PrivateData=usage), and no account's.
    everyone = usage.slurm_gpu_hours(SlurmControl(str(shutil.which("scontrol", path=cluster.env["PATH"]))))
    assert stack.spec.team in everyone.accounts
    assert {(stack.spec.team, "alice"), (stack.spec.team, "bob")} <= set(everyone.users), everyone
    own = as_person(cluster, "alice", "sshare", "-n", "-P", "-a", "-o", slurm_json.SSHARE_FORMAT)
    assert own.returncode == 0, own.stderr
    assert set(slurm_json.gpu_hours(own.stdout).users) == {(stack.spec.team, "alice")}, own.stdout
    assert not slurm_json.gpu_hours(own.stdout).accounts, own.stdout
    second = submit(cluster, "bob", "-p", "standby", "--gres=gpu:1", "--wrap", "true")
    cluster.wait("bob's second job to meet his limit",
                 lambda: job_field(cluster, second, "Reason") == "AssocGrpGRES", 30)
    assert cluster.job_state(second) == "PENDING" and cluster.job_state(mine) == "RUNNING"

    # Day 2: bob leaves, carol comes. bob's running job runs on, his pending one goes; his home stays. On the head,
    # where his Session Manager shells run, his processes are killed and his account deleted (the agent never asks
    # PAM: only `id bob` failing stops a session as him).
    release_alice.touch()
    cluster.wait(f"job {mine} to finish", lambda: cluster.job_state(mine) == "COMPLETED", 60)
    # As his open session's shell. (The rehearsal's nodes share one PID space: his job's processes are in the head's
    # /proc too, and must survive: a job is Slurm's to end.)
    shell = ["pgrep", "-u", str(bob.uid), "-f", "sleep 601"]
    cluster.head.enter("sh", "-c", "runuser -u bob -- sleep 601 >/dev/null 2>&1 &")
    cluster.wait("bob's shell on the head", lambda: cluster.head.enter(*shell, check=False).returncode == 0, 10)
    old_people = (cluster.fsx / ".gpucluster" / "people.json").read_bytes()  # signed, with bob and without carol
    cluster.apply(people_stack(tmp_path, "alice", "carol"))
    log = cluster.update()
    assert "the changed stack is applied" in log, log
    assert "killed bob's processes" in log and "deleted bob" in log and "terminate-session" in log, log
    assert cluster.head.enter(*shell, check=False).returncode == 1
    assert cluster.job_state(first) == "RUNNING"
    assert cluster.job_state(second) == "CANCELLED"
    assert cluster.head.enter("id", "bob", check=False).returncode != 0  # what the SSM agent asks
    # Slurm takes no job of his while his running job keeps his association (sacctmgr refuses to delete it).
    submit_limit = ["sacctmgr", "-n", "-P", "list", "associations", "where", "user=bob",
                    f"account={stack.spec.team}", "format=GrpSubmit"]
    assert cluster.run(*submit_limit).split() == ["0"]
    assert (home / "bob").stat().st_uid == bob.uid

    # carol's job runs on the node alice's job had, which booted before carol was in the stack.
    carol = cluster.settings.people[1]
    assert carol.name == "carol"
    hers = submit(cluster, "carol", "-p", "spot", "-w", node, "--wrap", "id -un > ran-as")
    cluster.wait("carol's job to run on a node booted without her",
                 lambda: cluster.job_state(hers) == "COMPLETED", 60)
    assert (home / "carol" / "ran-as").read_text().strip() == "carol"
    assert (home / "carol" / "ran-as").stat().st_uid == carol.uid
    booted = cluster.nodes[next(i for i, name in cluster.registry().items() if name == node)]
    # A compute node locks him and keeps the account: no session reaches it, and a job of his may still run there.
    assert booted.enter("getent", "passwd", "bob").stdout.strip().endswith(":/usr/sbin/nologin")

    # The people file of before the change, signed by the head at the time, brought back into /fsx (as an S3 import
    # could): the node refuses it, keeps carol and keeps bob locked, and serves on.
    (cluster.fsx / ".gpucluster" / "people.json").write_bytes(old_people)
    again = submit(cluster, "carol", "-p", "spot", "-w", node, "--wrap", "id -un > ran-again")
    cluster.wait("carol's job beside the old file", lambda: cluster.job_state(again) == "COMPLETED", 60)
    assert (home / "carol" / "ran-again").read_text().strip() == "carol"
    # Applied, the old file would have unlocked bob and locked carol.
    assert booted.enter("getent", "passwd", "bob").stdout.strip().endswith(":/usr/sbin/nologin")
    assert booted.enter("getent", "passwd", "carol").stdout.strip().endswith(":/bin/bash")

    release_bob.touch()
    cluster.wait(f"bob's job {first} to finish", lambda: cluster.job_state(first) == "COMPLETED", 60)
    # The update timer's next tick, with no stack change, deletes his association now that nothing of his runs.
    log = cluster.update()
    assert "applying it in place" not in log, log
    users = cluster.run("sacctmgr", "-n", "-P", "list", "associations", "where",
                        f"account={stack.spec.team}", "format=user")
    # root: the harness's hand-added user stays; the login user: verify's identity, which nobody connects as.
    assert set(users.split()) == {"alice", "carol", "root", LOGIN_USER}, users
