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

from gpucluster.contract.settings import LOGIN_USER
from gpucluster.spec.model import load_stack
from local_cluster import LocalCluster

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
