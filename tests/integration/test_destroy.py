"""`pulumi destroy`'s fleet step on the boot rehearsal's cluster (tests/local_cluster.py): while a two-node job runs,
the step quiesces the real head (its script on the real slurmctld and units), stops the head instance, terminates
every other instance of the cluster in moto and waits for it; the rehearsal powers a terminated instance's node off
as EC2 would, so no slurmd of the cluster is left; the munge key parameter is gone."""

from __future__ import annotations

import pytest

from gpucluster.aws import teardown
from gpucluster.render import userdata
from local_cluster import LocalCluster

pytestmark = pytest.mark.rehearsal


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


def test_destroy_while_a_job_runs_terminates_its_nodes_and_leaves_no_slurmd(cluster: LocalCluster) -> None:
    job = cluster.run("sbatch", "--parsable", "-p", "standby", "-N", "2", "-o", "/dev/null", "--wrap",
                      "srun sleep 600").strip()
    cluster.wait(f"job {job} to run on two nodes", lambda: cluster.job_state(job) == "RUNNING", 180)
    nodes = cluster.instances()
    slurmd = cluster.network.processes("slurmd")  # the cluster's own (another cluster may run beside it)
    assert len(nodes) == 2 and len(slurmd) == 2, (nodes, slurmd)

    fleet = teardown.Fleet(cluster.stack.cluster_name, cluster.head_instance,
                           userdata.munge_key_parameter(cluster.stack), timeout_seconds=60, poll_seconds=1,
                           quiet_seconds=3)
    said = teardown.tear_down_fleet(fleet, cluster.ec2(), cluster.aws("ssm"), HeadShell(cluster))

    # The script ran on the real slurmctld, which it checked had every partition down, before EC2 stopped the head.
    assert said[0] == (f"head {cluster.head_instance} quiesced (partitions down: spot standby always); stopped"), said
    states = {i["InstanceId"]: i["State"]["Name"] for r in cluster.ec2().describe_instances()["Reservations"]
              for i in r["Instances"]}
    assert all(states[i] == "terminated" for i in nodes.values()) and states[cluster.head_instance] == "stopped"
    assert not cluster.instances_by_id(), cluster.instances_by_id()  # nothing of the cluster left in EC2 ...
    # ... and, as EC2 ends a terminated instance's processes, no slurmd of the cluster. (The rehearsal powers off
    # the compute instances EC2 terminates; the head's stop it leaves to the test, which stops it now.)
    cluster.wait("the terminated nodes' slurmd to be gone", lambda: not cluster.network.processes("slurmd"), 15)
    cluster.head.power_off()
    cluster.wait("the stopped head's slurmctld to be gone",
                 lambda: not cluster.network.processes("slurmctld"), 15)
    assert any(line == f"deleted parameter {fleet.munge_key_parameter}" for line in said), said
