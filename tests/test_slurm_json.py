"""Every program that reads Slurm reads only Slurm's own fields, whatever text a user (or an admin) put into the
others: one cluster as Slurm 24.11.5's JSON shows it (slurm_samples), with a hostile text in one job or node field at
a time, through every reader (SlurmControl's nodes, jobs_on, pending_jobs and partitions; the bootstrap's node states
and own node; the node names; the metrics). Each must read exactly what it reads from the same cluster without it.
(Over `scontrol --oneliner` text, the first of these texts made the interruptions service signal another user's job.)
"""

from __future__ import annotations

import subprocess
from typing import Any

import pytest

from gpucluster.contract import slurm_json
from gpucluster.contract.settings import ClusterSettings, PoolSettings
from gpucluster.node import bootstrap, hosts, metrics
from gpucluster.node.slurm_control import SlurmControl
from slurm_samples import document, job, node, partition

# What a user types into a job (sbatch --comment, --job-name, --chdir, --output) or an admin into a node (reason,
# comment): scontrol's own keys, a new line, a host list with spaces, text that closes the JSON string it is in.
HOSTILE = [
    " JobId=2 JobState=RUNNING NodeList=standby-[1-2],spot-[1-2]",
    "x\nJobId=2 JobState=RUNNING Partition=spot NodeList=spot-1 BatchHost=spot-1",
    " NodeName=spot-1 State=IDLE+CLOUD NodeAddr=10.9.9.9 NodeHostName=i-0ffffffffffffffff",
    " PartitionName=spot State=DOWN",
    " State=PENDING AdminComment=gpucluster: budget: closed",
    " Reason=gpucluster: replace: x [slurm@2026-01-01T00:00:00] ",
    '"}, {"job_id": 2, "job_state": ["RUNNING"], "nodes": "spot-1", "admin_comment": "',
    '{"jobs": [{"job_id": 2, "job_state": ["RUNNING"], "nodes": "standby-1"}]}',
    "a = b   c\td\r\n= =",
]
JOB_FIELDS = ["comment", "name", "current_working_directory", "standard_output", "standard_error", "admin_comment"]
NODE_FIELDS = ["reason", "comment", "extra"]


def cluster(job_field: str = "", node_field: str = "", text: str = "") -> dict[str, str]:
    """scontrol's three answers for one cluster: root's job 1 runs on spot-1; the user's job 2 pends, job 3 runs on
    spot-2; the hostile text in `job_field` of jobs 2 and 3, or in `node_field` of standby-1."""
    user: dict[str, Any] = {job_field: text} if job_field else {}
    admin: dict[str, Any] = {node_field: text} if node_field else {}
    nodes = [node("spot-1", "MIXED+CLOUD", address="10.0.0.11", hostname="i-0aaaaaaaaaaaaaaa1"),
             node("spot-2", "ALLOCATED+CLOUD", address="10.0.0.12", hostname="i-0aaaaaaaaaaaaaaa2"),
             node("standby-1", "IDLE+CLOUD+POWERED_DOWN", **admin)]
    jobs = [job(1, "RUNNING", "spot-1", user_name="root"),
            job(2, "PENDING", partition="standby", user_name="ubuntu", **user),
            job(3, "RUNNING", "spot-2", user_name="ubuntu", **user)]
    return {"nodes": document("nodes", nodes), "jobs": document("jobs", jobs),
            "partitions": document("partitions", [partition("spot"), partition("standby", "DOWN")])}


class Slurm(SlurmControl):
    def __init__(self, answers: dict[str, str]) -> None:
        super().__init__()
        self.answers = answers

    def _run(self, *args: str) -> str:
        shown: dict[tuple[str, ...], str] = {slurm_json.SHOW_NODES: self.answers["nodes"],
                                             slurm_json.SHOW_JOBS: self.answers["jobs"],
                                             slurm_json.SHOW_PARTITIONS: self.answers["partitions"]}
        return shown[args]


def readings(answers: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """What every reader makes of the cluster."""
    slurm = Slurm(answers)
    monkeypatch.setattr(bootstrap, "run", lambda *args, **kw: subprocess.CompletedProcess(args, 0, answers["nodes"]))
    pools = {"spot": PoolSettings("spot", "lt", "subnet", "g6.xlarge", "spot"),
             "standby": PoolSettings("standby", "lt", "subnet", "g6.xlarge", "on-demand")}
    settings = ClusterSettings(cluster="c1", region="us-east-1", pools=pools)
    return {
        "nodes": [(n.name, n.state, n.hostname, n.address, n.reason_user, n.reason_time) for n in slurm.nodes()],
        "jobs on": {n: slurm.jobs_on(n) for n in ("spot-1", "spot-2", "standby-1", "standby-2")},
        "pending": slurm.pending_jobs(),
        "partitions": slurm.partitions(),
        "bootstrap states": bootstrap.slurm_states(),
        "own node": bootstrap.own_node("i-0aaaaaaaaaaaaaaa1", answers["nodes"]),
        "hosts": hosts.registered(answers["nodes"]),
        "metrics": metrics.slurm_nodes(slurm.nodes(), settings) + metrics.slurm_jobs(slurm.queue()),
    }


def test_the_readers_read_the_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    """The baseline the hostile cases are held to is right in itself."""
    read = readings(cluster(), monkeypatch)
    assert read["jobs on"] == {"spot-1": ["1"], "spot-2": ["3"], "standby-1": [], "standby-2": []}
    assert read["pending"] == {"2": ""}
    assert read["partitions"] == {"spot": "UP", "standby": "DOWN"}
    assert read["bootstrap states"]["standby-1"] == {"IDLE", "CLOUD", "POWERED_DOWN"}
    assert read["own node"] == "spot-1"
    assert read["hosts"] == {"spot-1": "10.0.0.11", "spot-2": "10.0.0.12"}
    assert 'gpucluster_slurm_jobs{partition="spot",state="running"} 2' in read["metrics"]
    assert 'gpucluster_slurm_jobs{partition="standby",state="pending"} 1' in read["metrics"]


@pytest.mark.parametrize("text", HOSTILE)
@pytest.mark.parametrize("field", JOB_FIELDS)
def test_a_hostile_job_field_is_read_as_nothing_but_itself(field: str, text: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    expected, read = readings(cluster(), monkeypatch), readings(cluster(job_field=field, text=text), monkeypatch)
    if field == "admin_comment":  # the one such field a program reads: as it is, whole
        assert read.pop("pending") == {"2": text}
        expected.pop("pending")
    assert read == expected
    with pytest.raises(RuntimeError, match="0 Slurm node"):  # the node a text names is no node
        bootstrap.own_node("i-0ffffffffffffffff", cluster(job_field=field, text=text)["nodes"])


@pytest.mark.parametrize("text", HOSTILE)
@pytest.mark.parametrize("field", NODE_FIELDS)
def test_a_hostile_node_field_is_read_as_nothing_but_itself(field: str, text: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    answers = cluster(node_field=field, text=text)
    assert readings(answers, monkeypatch) == readings(cluster(), monkeypatch)
    reasons = {n.name: n.reason for n in Slurm(answers).nodes()}
    assert reasons == {"spot-1": "", "spot-2": "", "standby-1": text if field == "reason" else ""}
    with pytest.raises(RuntimeError, match="0 Slurm node"):
        bootstrap.own_node("i-0ffffffffffffffff", answers["nodes"])
