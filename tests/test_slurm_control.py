"""What the programs ask of Slurm (SlurmControl, over scontrol) and read from it (contract.scontrol, contract.hostlist,
and a node's pool by its name), against stand-ins for scontrol."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from gpucluster.contract import hostlist, scontrol
from gpucluster.contract.settings import ClusterSettings, PoolSettings, named_pool
from gpucluster.node.slurm_control import SlurmControl
from head_fakes import fake_scontrol


def test_parse_oneliner_keeps_reasons_with_spaces() -> None:
    line = ("NodeName=a-1 Arch=x86_64 State=DOWN+CLOUD Reason=gpucluster: capacity: ICE: no room "
            "[slurm@2026-01-01T00:00:00] Comment=(null)")
    parsed = scontrol.parse_oneliner(line)
    assert parsed["Reason"] == "gpucluster: capacity: ICE: no room [slurm@2026-01-01T00:00:00]"
    assert parsed["State"] == "DOWN+CLOUD"


@pytest.mark.parametrize("text,expected", [
    ("p5-od-[1-3,7]", ["p5-od-1", "p5-od-2", "p5-od-3", "p5-od-7"]),
    ("p5-od-2,head", ["p5-od-2", "head"]),
    ("n[01-02]", ["n01", "n02"]),  # padding kept
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("a-[1-2],a-2,b-[3]", ["a-1", "a-2", "b-3"]),
    ("", []),
])
def test_hostlist_expands_like_slurm(text: str, expected: list[str]) -> None:
    assert hostlist.expand_hostlist(text) == expected


@pytest.mark.parametrize("nodes,expected", [
    (["p5-od-3"], "p5-od-3"),  # a single node has no brackets
    (["p5-od-1", "p5-od-2", "p5-od-3", "p5-od-4", "p5-od-7"], "p5-od-[1-4,7]"),  # a gap
    (["p5-od-10", "p5-od-9", "p5-od-11", "p5-od-2"], "p5-od-[2,9-11]"),  # numeric order: 9 before 10
    (["p5-spot-2", "p5-od-1", "p5-spot-1", "p5-od-2", "p5-od-2"], "p5-od-[1-2],p5-spot-[1-2]"),  # pools, a duplicate
    (["head", "p5-od-01", "p5-od-1"], "head,p5-od-01,p5-od-1"),  # no number, a padded number: as they are
    ([], ""),
])
def test_hostlist_compresses_like_slurm(nodes: list[str], expected: str) -> None:
    assert hostlist.compress_hostlist(nodes) == expected


def test_a_failing_scontrol_is_logged_with_its_stderr(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    slurm = SlurmControl(fake_scontrol(tmp_path, 'echo "slurm_update error: Invalid node name specified" >&2; exit 1'))
    with pytest.raises(subprocess.CalledProcessError):
        slurm.set_down(["p5-od-1"], "gpucluster: test")
    assert "returned non-zero exit status 1" in caplog.text and "nodename=p5-od-1" in caplog.text
    assert "stderr: slurm_update error: Invalid node name specified" in caplog.text


def test_a_hung_scontrol_times_out(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    slurm = SlurmControl(fake_scontrol(tmp_path, 'echo "waiting for slurmctld" >&2; exec sleep 10'), timeout=0.3)
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        slurm.nodes()
    assert time.monotonic() - started < 5
    assert "timed out after 0.3 seconds" in caplog.text and "stderr: waiting for slurmctld" in caplog.text


def test_jobs_on_a_node_from_scontrol_show_jobs() -> None:
    class Jobs(SlurmControl):
        def _run(self, *args: str) -> str:
            assert args == ("show", "jobs", "--oneliner")
            return ("JobId=41 JobName=ddp UserId=ubuntu(1100) JobState=RUNNING Reason=None NodeList=spot-[1-2] "
                    "BatchHost=spot-1\n"
                    "JobId=42 JobName=x UserId=ubuntu(1100) JobState=PENDING Reason=Priority NodeList=(null)\n"
                    "JobId=43 JobName=y UserId=ubuntu(1100) JobState=RUNNING Reason=None NodeList=standby-1\n")
    assert Jobs().jobs_on("spot-2") == ["41"] and Jobs().jobs_on("standby-1") == ["43"]


@pytest.mark.parametrize(("node", "named", "of_the_stack"), [
    ("p5-od-3", "p5-od", "p5-od"),
    ("p5-od-spot-1", "p5-od-spot", ""),  # a name of a pool the stack does not have
    ("ghost-1", "ghost", ""),
    ("head", "head", ""),  # no number: no pool's node
    ("p5-od-x", "p5-od", ""),
])
def test_a_nodes_pool_by_its_name_and_in_the_stack(node: str, named: str, of_the_stack: str) -> None:
    """The resume program launches (or refuses, naming it) the pool a node's name names; the reconciler, the metrics
    and the scrape targets go by the stack's pools."""
    config = ClusterSettings(cluster="c1", region="us-east-1", pools={
        name: PoolSettings(name, "lt-1", "subnet-1", "p5.48xlarge", "on-demand") for name in ("p5-od", "p5")})
    assert named_pool(node) == named and config.pool_of(node) == of_the_stack
