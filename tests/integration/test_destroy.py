"""`pulumi destroy`'s fleet step on the boot rehearsal's cluster (tests/local_cluster.py): while a two-node job runs,
the step quiesces the real head (its script on the real slurmctld and units), terminates every instance of the
cluster in moto and waits for it; the rehearsal powers a terminated instance's node off as EC2 would, so no slurmd of
the cluster is left; the head is spared (Pulumi deletes it next) and the munge key parameter is gone."""

from __future__ import annotations

import subprocess

from gpucluster import teardown, userdata
from local_cluster import LocalCluster


class HeadShell:
    """A root shell on the rehearsal head, where on EC2 the step reaches the head through Session Manager's Run
    Command (this machine has no SSM agent; tests/test_teardown.py covers the SSM side against moto)."""

    def __init__(self, cluster: LocalCluster):
        self.cluster = cluster

    def run(self, script: str) -> str:
        done = self.cluster.head.enter("sh", "-c", script, check=False)
        if done.returncode:
            raise teardown.HeadUnreachable(f"exit {done.returncode}: {done.stderr[-500:]}")
        return done.stdout


def slurmd_running() -> list[str]:
    return subprocess.run(["pgrep", "-a", "-x", "slurmd"], capture_output=True, text=True).stdout.splitlines()


def test_destroy_while_a_job_runs_terminates_its_nodes_and_leaves_no_slurmd(cluster: LocalCluster) -> None:
    job = cluster.run("sbatch", "--parsable", "-p", "standby", "-N", "2", "-o", "/dev/null", "--wrap",
                      "srun sleep 600").strip()
    cluster.wait(f"job {job} to run on two nodes", lambda: cluster.job_state(job) == "RUNNING", 180)
    nodes = cluster.instances()
    assert len(nodes) == 2 and len(slurmd_running()) == 2, (nodes, slurmd_running())

    fleet = teardown.Fleet(cluster.stack.cluster_name, cluster.head_instance,
                           userdata.munge_key_parameter(cluster.stack), timeout_seconds=60, poll_seconds=1)
    said = teardown.tear_down_fleet(fleet, cluster.ec2(), cluster.aws("ssm"), HeadShell(cluster))

    assert said[0].startswith(f"head {cluster.head_instance} quiesced: partitions down: "), said
    partitions = cluster.run("sinfo", "--noheader", "--format=%R %a").split("\n")
    assert partitions and all(row.split()[1] == "down" for row in partitions if row), partitions
    assert not cluster.instances_by_id(), cluster.instances_by_id()  # nothing of the cluster left in EC2 ...
    states = {i["InstanceId"]: i["State"]["Name"] for r in cluster.ec2().describe_instances()["Reservations"]
              for i in r["Instances"]}
    assert all(states[i] == "terminated" for i in nodes.values()) and states[cluster.head_instance] == "running"
    # ... and, as EC2 ends a terminated instance's processes, no slurmd on this machine.
    cluster.wait("the terminated nodes' slurmd to be gone", lambda: not slurmd_running(), 15)
    assert any(line == f"deleted parameter {fleet.munge_key_parameter}" for line in said), said
    # A later sweep of the reconciler (stopped with its timer) or a new job would launch nothing: the partitions are
    # down, so the job that was running cannot be restarted on new nodes.
    launches = cluster.calls.count(("head", "CreateFleet"))
    late = cluster.run("sbatch", "--parsable", "-p", "spot", "-o", "/dev/null", "--wrap", "true").strip()
    cluster.wait(f"job {late} to pend on the closed partition",
                 lambda: "Reason=PartitionDown" in cluster.run("scontrol", "show", "job", late), 30)
    assert cluster.calls.count(("head", "CreateFleet")) == launches
