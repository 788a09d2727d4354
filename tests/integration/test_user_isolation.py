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
