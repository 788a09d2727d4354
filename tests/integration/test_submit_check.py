"""Submitting on the boot rehearsal's cluster (tests/local_cluster.py, 1-GPU g6.xlarge pools): the head's slurmctld
runs the rendered job_submit.lua and refuses what no node of the partition could run, naming the partition's node
shape; what fits is accepted; and neither sbatch on the head nor srun on a compute node prints errors for pyxis, which
this machine's image (the nodes') does not have."""

from __future__ import annotations

import subprocess

import pytest

from local_cluster import LocalCluster

pytestmark = pytest.mark.rehearsal

SHAPE = "a node has 1 GPU (l4), 4 CPUs, 15.2 GiB"
REFUSED = "sbatch: error: Batch job submission failed: "


def sbatch(cluster: LocalCluster, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["sbatch", "--parsable", "-o", str(cluster.root / "job-%j.out"), *args], env=cluster.env,
                          capture_output=True, text=True, timeout=60)


def test_what_no_node_can_run_is_refused_at_submit_and_what_fits_runs_without_plugin_errors(
        cluster: LocalCluster) -> None:
    eight_gpus = sbatch(cluster, "-p", "standby", "--gres=gpu:8", "--wrap", "true")
    assert eight_gpus.returncode != 0
    lines = eight_gpus.stderr.splitlines()
    assert lines[0] == f"sbatch: error: partition standby: {SHAPE}, up to 2 nodes; the job asks 8 GPUs per node"
    # Slurm's own words follow the check's.
    assert lines[1:] == [REFUSED + "Requested node configuration is not available"], eight_gpus.stderr

    many_cpus = sbatch(cluster, "--cpus-per-task=160", "--wrap", "true")  # to the default partition, spot
    assert many_cpus.returncode != 0
    assert many_cpus.stderr.splitlines()[0] == (
        f"sbatch: error: partition spot: {SHAPE} (pool spot, up to 2 nodes) or "
        f"{SHAPE.removeprefix('a node has ')} (pool standby, up to 2 nodes); the job asks 160 CPUs per node")
    assert cluster.run("squeue", "--noheader", "--format=%i") == ""  # neither is queued

    # What fits goes through without a word on stderr: no check message, no pyxis lines from sbatch's SPANK stack;
    # and the srun in it, on a compute node that took the head's plugstack.conf, prints none either.
    fits = sbatch(cluster, "-p", "standby", "--gpus-per-node=1", "--cpus-per-task=4", "--wrap", "srun hostname")
    assert fits.returncode == 0 and fits.stderr == "", fits.stderr
    job = fits.stdout.strip()
    cluster.wait(f"job {job} to complete", lambda: cluster.job_state(job) == "COMPLETED", 240)
    output = (cluster.root / f"job-{job}.out").read_text()
    assert output.strip().startswith("standby-") and "error" not in output, output
