"""The boot path itself, on nodes booted the way EC2 boots them (tests/local_cluster.py): user data -> cloud-init ->
gpucluster-boot.service -> fetch_bundle.py -> bootstrap.py -> packaged units with our drop-ins."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import pytest

from gpucluster.contract import settings
from gpucluster.contract.settings import LOGIN_USER
from local_cluster import LocalCluster

pytestmark = pytest.mark.rehearsal


def head_shell(cluster: LocalCluster, command: str) -> str:
    return cluster.head.enter("sh", "-c", command).stdout


def test_head_runs_its_services_from_the_packaged_units_as_their_users(cluster: LocalCluster) -> None:
    # MariaDB runs as mysql on the data directory the bootstrap prepared on the state volume (finding: a root-owned
    # copy kept it from starting, and the head stopped before Slurm).
    processes = head_shell(cluster, "ps -eo user:12,args")
    assert any(line.split()[0] == "mysql" and "mariadbd" in line for line in processes.splitlines()), processes
    assert head_shell(cluster, "stat -c %U /var/lib/gpucluster/mysql /var/lib/gpucluster/mysql/mysql").split() == [
        "mysql", "mysql"]
    assert "datadir = /var/lib/gpucluster/mysql" in head_shell(cluster, "cat /etc/mysql/mariadb.conf.d/*gpucluster*")
    assert "mariadbd" not in head_shell(cluster, "ss -ltnp")  # reached over its socket only
    assert head_shell(cluster, "findmnt -n -o SOURCE /var/lib/gpucluster").strip().startswith("/dev/loop")
    for unit in ("munge", "mariadb", "slurmdbd", "slurmctld", "gpucluster-budget"):
        assert head_shell(cluster, f"systemctl is-active {unit}").strip() == "active", unit
    assert "bootstrap head done" in cluster.head.path(settings.BOOT_LOG).read_text()


# What a job tries to get the node's credentials or its munge key with (the probe's answer, or why it got none).
PROBE = ("import urllib.request\n"
         "request = urllib.request.Request('http://169.254.169.254/latest/api/token', method='PUT', "
         "headers={'X-aws-ec2-metadata-token-ttl-seconds': '60'})\n"
         "try:\n    print('metadata:', urllib.request.urlopen(request, timeout=3).read().decode())\n"
         "except OSError as exc:\n    print('metadata: refused', type(exc).__name__)\n"
         "for key in ('/etc/munge/munge.key', '/etc/gpucluster/munge.key'):\n"
         "    try:\n        open(key, 'rb').read()\n        print('key: read', key)\n"
         "    except OSError as exc:\n        print('key: refused', key, type(exc).__name__)\n")


def test_compute_nodes_boot_with_two_aws_calls_through_throttling(cluster: LocalCluster) -> None:
    # Parameter Store's shared rate is spent: more throttles than botocore's own retries absorb.
    cluster.throttle["GetParameters"] = 14
    # The login user submits a plain batch script that sources nothing from the home directory on the head: it runs on
    # the compute nodes (the same home there), writes its output back there, and every task has the node's NCCL
    # settings (the TaskProlog), with the user's own NCCL_DEBUG winning over ours. Each task also tries for the
    # instance's credentials and the munge key.
    home = cluster.fsx / "home" / LOGIN_USER
    script = home / "env.sbatch"
    (home / "probe.py").write_text(PROBE)
    script.write_text("#!/bin/bash\nsrun bash -c 'echo \"task $(hostname) $NCCL_SOCKET_IFNAME $NCCL_DEBUG $PWD\"; "
                      "/usr/bin/python3 probe.py'\n")
    for path in (script, home / "probe.py"):
        os.chown(path, home.stat().st_uid, home.stat().st_gid)
    with cluster.link_local_metadata():
        job = head_shell(cluster, f"runuser -l {LOGIN_USER} -c 'NCCL_DEBUG=INFO sbatch --parsable -p standby -N 2 "
                                  "env.sbatch'").strip()
        cluster.wait(f"job {job} to complete", lambda: cluster.job_state(job) == "COMPLETED", 240)
        # Root on the same node gets the answer: the rule is the node's lockdown, not a dead endpoint.
        root = next(iter(cluster.nodes.values())).enter("/usr/bin/python3", "-c", PROBE).stdout
    output = home / f"slurm-{job}.out"
    assert output.stat().st_uid == home.stat().st_uid  # written by the job, as the user, on a compute node
    lines = output.read_text().splitlines()
    tasks = sorted(line for line in lines if line.startswith("task"))
    assert tasks == [f"task standby-{n} ^docker,lo,veth INFO /home/{LOGIN_USER}" for n in (1, 2)], tasks
    # The job gets no credentials and no munge key, on either node.
    assert sorted(line for line in lines if line.startswith(("metadata:", "key:"))) == sorted(2 * [
        "metadata: refused URLError", "key: refused /etc/munge/munge.key PermissionError",
        "key: refused /etc/gpucluster/munge.key PermissionError"]), lines
    assert "metadata: token" in root and "key: read /etc/munge/munge.key" in root, root
    assert cluster.throttle["GetParameters"] == 0
    # The resume program (as slurm) logs beside the budget guardrail (as root), whichever started first: the log
    # belongs to slurm (a root-owned one, made by the guardrail's first line, silenced the resume program).
    assert head_shell(cluster, f"stat -c %U {settings.NODE_LOG}").strip() == "slurm"
    node_log = cluster.head.path(settings.NODE_LOG).read_text()
    assert "gpucluster-node" in node_log and "gpucluster-budget" in node_log, node_log[-2000:]
    nodes = list(cluster.nodes.values())
    booted = {who for who, _ in cluster.calls if who.startswith("i-")}
    assert len(booted) == 2
    for who in booted:
        answered = [a for w, a in cluster.calls if w == who]
        # Each node: one GetParameters (settings + munge key) and one GetObject (the bundle), after the throttles.
        assert answered.count("s3:GetObject") == 1 and set(answered) == {"GetParameters", "s3:GetObject"}, answered
    for node in nodes:
        # slurmd came up from Debian's unit, whose ConditionPathExists=/etc/slurm/slurm.conf our drop-in resets.
        assert "ConditionPathExists=\n" in node.path("/etc/systemd/system/slurmd.service.d/gpucluster.conf").read_text()
        assert not node.path("/etc/slurm/slurm.conf").exists()  # configless: nothing to satisfy the packaged condition


def test_head_reboot_and_replacement_keep_queue_and_accounting(cluster: LocalCluster) -> None:
    held = cluster.run("sbatch", "--parsable", "--hold", "-p", "standby", "--wrap", "true").strip()
    account = cluster.run("sacctmgr", "-n", "-P", "show", "assoc", "where", "account=local", "user=",
                          "format=GrpTRESMins")
    # A reboot runs the bootstrap again from its unit (runcmd alone would run once per instance).
    cluster.reboot(cluster.head)
    assert cluster.head.path(settings.BOOT_LOG).read_text().count("bootstrap head done") == 2
    assert cluster.job_state(held) == "PENDING"
    # A new head instance on the old state volume and the same address: queue and accounting are still there.
    cluster.replace_head()
    assert cluster.head.name != "head"
    assert cluster.job_state(held) == "PENDING"
    assert cluster.run("sacctmgr", "-n", "-P", "show", "assoc", "where", "account=local", "user=",
                       "format=GrpTRESMins") == account
    cluster.run("scontrol", "release", held)
    cluster.wait(f"job {held} to complete on the new head", lambda: cluster.job_state(held) == "COMPLETED", 240)


def metadata_answer(cluster: LocalCluster, *as_user: str) -> str:
    """What the head's instance metadata tells a process of the user (root without `as_user`)."""
    answer = cluster.head.enter(*as_user, "/usr/bin/python3", "-c", PROBE).stdout
    return next(line for line in answer.splitlines() if line.startswith("metadata:"))


def test_two_clusters_run_side_by_side_and_the_lockdown_of_one_outlives_the_other(
        start_cluster: Callable[[], LocalCluster]) -> None:
    """Each cluster in a network of its own: two heads of one stack boot at once on the same ports, and when one
    cluster stops, the other's lockdown (its rules, from its own nodes' bootcmd) still refuses the login user."""
    with ThreadPoolExecutor(2) as pool:
        first, second = pool.map(lambda _: start_cluster(), range(2))
    # The same ports (slurmctld's, slurmd's, the exporters'; Prometheus' 9090): neither network is the other's.
    assert (first.layout.controller_port, first.exporter_port_base) == (second.layout.controller_port,
                                                                        second.exporter_port_base)
    for cluster in (first, second):
        assert head_shell(cluster, "systemctl is-active prometheus slurmctld").split() == ["active", "active"]
    login = ("runuser", "-u", LOGIN_USER, "--")
    with second.link_local_metadata():
        assert metadata_answer(second, *login) == "metadata: refused URLError"
        first.stop()
        assert metadata_answer(second, *login) == "metadata: refused URLError"
        assert metadata_answer(second) == "metadata: token"  # the stand-in answers whoever the rules let through
    assert set(second.run("sinfo", "--noheader", "--format=%R").split()) == {p.name for p in second.stack.spec.pools}
