"""What the programs ask of Slurm (SlurmControl, over scontrol) and read from it (contract.slurm_json,
contract.hostlist, and a node's pool by its name), against stand-ins for scontrol. Hostile job and node fields:
test_slurm_json.py."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from gpucluster.contract import hostlist, slurm_json
from gpucluster.contract.settings import ClusterSettings, PoolSettings, named_pool
from gpucluster.node.slurm_control import SlurmControl
from head_fakes import fake_scontrol
from slurm_samples import document, job, node


def test_a_node_reason_comes_with_who_set_it_and_when() -> None:
    record = node("a-1", "DOWN+CLOUD", "gpucluster: capacity: ICE: no room", "slurm", 1_796_156_183)
    (read,) = slurm_json.nodes(document("nodes", [record]))
    assert (read.name, read.state) == ("a-1", frozenset({"DOWN", "CLOUD"}))
    assert (read.reason, read.reason_user, read.reason_time) == (record["reason"], "slurm", 1_796_156_183)


@pytest.mark.parametrize("text", ["", "JobId=1 JobState=RUNNING", '{"jobs": 3}', '{"errors": ["x"]}'])
def test_what_is_not_slurms_json_is_an_error(text: str) -> None:
    with pytest.raises(ValueError):
        slurm_json.jobs(text)


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
            assert args == slurm_json.SHOW_JOBS
            return document("jobs", [job(41, "RUNNING", "spot-[1-2]"), job(42, "PENDING"),
                                     job(43, "RUNNING", "standby-1"), job(44, "COMPLETED", "standby-1"),
                                     job(45, "COMPLETED+COMPLETING", "standby-2")])
    assert Jobs().jobs_on("spot-2") == ["41"] and Jobs().jobs_on("standby-1") == ["43"]
    assert Jobs().jobs_on("standby-2") == ["45"]  # its epilog still runs there


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
