"""`python -m gpucluster plan` as a user runs it: a cold process, no credentials, no network."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT


def run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env["AWS_SHARED_CREDENTIALS_FILE"] = env["AWS_CONFIG_FILE"] = os.devnull  # prove no credentials are needed
    return subprocess.run([sys.executable, "-m", "gpucluster", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def test_plan_json_shape() -> None:
    out = run("plan", "team-a", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["stack"] == "team-a"
    types = {r["type"] for r in doc["resources"]}
    assert {"gpucluster:network:Network", "gpucluster:pool:GpuPool", "gpucluster:storage:Storage",
            "gpucluster:budget:Budget", "aws:ec2/launchTemplate:LaunchTemplate"} <= types
    for r in doc["resources"]:
        assert set(r) >= {"type", "name", "parent", "inputs"}
    lts = [r for r in doc["resources"] if r["type"] == "aws:ec2/launchTemplate:LaunchTemplate"]
    assert {r["parent"] for r in lts} == {"gpucluster:pool:GpuPool"}
    assert [r["parent"] for r in doc["resources"] if r["type"] == "gpucluster:pool:GpuPool"] == [None, None]
    cost = doc["cost"]
    assert cost["budget_monthly_usd"] == 250000
    assert 0 < cost["hourly_usd_min"] < cost["hourly_usd_max"]
    assert cost["monthly_usd_at_max"] == pytest.approx(cost["hourly_usd_max"] * 730, rel=1e-4)


def test_plan_by_path_and_text_output() -> None:
    out = run("plan", "stacks/Pulumi.dev.yaml")
    assert out.returncode == 0, out.stderr
    assert "gpucluster:pool:GpuPool  gpucluster-dev-g6-spot" in out.stdout
    assert "  aws:ec2/launchTemplate:LaunchTemplate  gpucluster-dev-g6-spot-lt" in out.stdout
    assert "g6-spot  g6.xlarge  spot" in out.stdout
    assert "WARNING: at full size the cluster crosses its budget" in out.stdout


@pytest.mark.parametrize("stack,message", [
    ("tests/bad_stacks/Pulumi.many-problems.yaml", "gpucluster:cluster.pools[0].min_nodes: must be <= max_nodes"),
    ("no-such-stack", "stacks/Pulumi.no-such-stack.yaml: 1 problem(s):\n  file: no such stack file"),
])
def test_bad_input_exits_2_without_traceback(stack: str, message: str) -> None:
    out = run("plan", stack, "--json")
    assert out.returncode == 2
    assert message in out.stderr
    assert "Traceback" not in out.stderr and out.stdout == ""


def test_plan_text_shows_what_the_node_images_cost() -> None:
    """team-a bakes the head's image and one NVIDIA compute image. By hand: 2 builds x 1 h of m7i.xlarge at $0.2016 =
    $0.40; snapshots of a 20 GiB and a 120 GiB root volume at $0.05 per GB-month = $7.00 a month."""
    out = run("plan", "team-a")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("Head node per month:"))
    assert lines[head + 1] == ("Node images:                     $0.40 per build (2 x 1 h of m7i.xlarge), "
                               "$7.00 per month of snapshots")


def test_no_node_images_line_without_images() -> None:
    import dataclasses

    from gpucluster import cli, cost
    from gpucluster.spec import load_stack

    stack = load_stack(ROOT / "stacks" / "Pulumi.team-a.yaml")
    estimate = cost.estimate(stack)
    assert any(line.startswith("Node images:") for line in cli.cost_table(stack, estimate))
    assert not any(line.startswith("Node images:")
                   for line in cli.cost_table(stack, dataclasses.replace(estimate, images=[])))
