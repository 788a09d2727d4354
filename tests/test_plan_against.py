"""`gpucluster plan STACK --against OLD`: a stack-file change's resources and price, both versions planned under the
mock runtime (the command line in this process; each distinct stack version is planned once per module)."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import subprocess
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import yaml

from conftest import ROOT
from gpucluster import cli, plan_diff
from gpucluster.plan import Declared, run_program
from gpucluster.project import pulumi_program
from gpucluster.spec.model import MAX_STACK_BYTES, Stack, stack_config

DEV = ROOT / "stacks" / "Pulumi.dev.yaml"
NEW_POOL = {"name": "g6-od", "instance_type": "g6.xlarge", "capacity": "on-demand", "min_nodes": 0, "max_nodes": 1}


@functools.cache
def _planned(key: str) -> tuple[Declared, ...]:
    stack = _STACKS[key]
    return tuple(run_program(stack, pulumi_program()))


_STACKS: dict[str, Stack] = {}


def cached_run(stack: Stack, program: Any, **_: Any) -> list[Declared]:
    """run_program once per distinct stack version (its name and config) in this module."""
    key = json.dumps([stack.name, stack_config(stack)], sort_keys=True)
    _STACKS[key] = stack
    return list(_planned(key))


def run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
            mock.patch.object(cli, "run_program", cached_run), contextlib.chdir(cwd):
        code = cli.main(list(args))
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def changed_dev(folder: Path) -> Path:
    """dev with its pool's max_nodes raised and a pool added, as Pulumi.dev.yaml in `folder`."""
    doc = yaml.safe_load(DEV.read_text())
    cluster = doc["config"]["gpucluster:cluster"]
    cluster["pools"][0]["max_nodes"] += 3
    cluster["pools"].append(NEW_POOL)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "Pulumi.dev.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def plan_cost(path: Path) -> dict[str, float]:
    out = run("plan", str(path), "--json")
    assert out.returncode == 0, out.stderr
    cost: dict[str, float] = json.loads(out.stdout)["cost"]
    return cost


def test_the_price_of_a_change_is_the_difference_of_the_two_plans_totals(tmp_path: Path) -> None:
    new = changed_dev(tmp_path / "new")
    out = run("plan", str(new), "--against", str(DEV), "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    before, after = plan_cost(DEV), plan_cost(new)
    for key in ("hourly_usd_min", "hourly_usd_max", "monthly_usd_at_max"):
        assert doc["cost"]["old"][key] == before[key] and doc["cost"]["new"][key] == after[key]
        assert doc["cost"]["delta"][key] == pytest.approx(after[key] - before[key], abs=1e-6)
    # More nodes at max cost more; the new pool starts from zero, so the price at min size stays.
    assert doc["cost"]["delta"]["hourly_usd_max"] > 0 and doc["cost"]["delta"]["hourly_usd_min"] == 0
    added = {(r["type"], r["name"]) for r in doc["added"]}
    assert ("gpucluster:pool:GpuPool", "gpucluster-dev-g6-od") in added
    pool = "gpucluster:pool:GpuPool gpucluster-dev-g6-od"
    # The pool's resources are in its component, but for its idle alarm, which is in the cluster's alarms.
    assert {r["component"] for r in doc["added"]} == {pool, "gpucluster:monitoring:IdleGpuAlarms gpucluster-dev"}
    assert any(r["type"] == "aws:ec2/launchTemplate:LaunchTemplate" and r["component"] == pool for r in doc["added"])
    assert doc["removed"] == []
    # The head's settings name the pools: changed, by key, never by value.
    config = next(r for r in doc["changed"] if r["type"] == "aws:ssm/parameter:Parameter")
    assert config["keys"] == ["insecureValue"] and config["component"].startswith("gpucluster:head:HeadNode")
    assert all(set(r) == {"type", "name", "component", "keys"} for r in doc["changed"])


def test_the_other_way_round_the_pool_is_removed_and_the_price_falls(tmp_path: Path) -> None:
    new = changed_dev(tmp_path / "new")
    forward = json.loads(run("plan", str(new), "--against", str(DEV), "--json").stdout)
    back = json.loads(run("plan", str(DEV), "--against", str(new), "--json").stdout)
    assert back["removed"] == forward["added"] and back["added"] == []
    assert {r["name"] for r in back["changed"]} == {r["name"] for r in forward["changed"]}
    assert back["cost"]["delta"] == {k: -v for k, v in forward["cost"]["delta"].items()}


def test_the_text_and_the_markdown_say_the_same_change(tmp_path: Path) -> None:
    new = changed_dev(tmp_path / "new")
    doc = json.loads(run("plan", str(new), "--against", str(DEV), "--json").stdout)
    delta = doc["cost"]["delta"]["monthly_usd_at_max"]
    text = run("plan", str(new), "--against", str(DEV)).stdout
    assert f"{len(doc['added'])} added, {len(doc['changed'])} changed, 0 removed" in text
    assert any(line.startswith("month at max size") and line.endswith(f"+${delta:,.2f}")
               for line in text.splitlines())
    md = run("plan", str(new), "--against", str(DEV), "--markdown").stdout
    assert f"| month at max size | ${doc['cost']['old']['monthly_usd_at_max']:,.2f} | " \
           f"${doc['cost']['new']['monthly_usd_at_max']:,.2f} | **+${delta:,.2f}** |" in md
    assert "- `gpucluster:pool:GpuPool gpucluster-dev-g6-od`" in md


def git(repo: Path, *args: str) -> None:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@example.com"}
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, env=env)


def test_against_a_git_revision_of_the_same_file(tmp_path: Path) -> None:
    """A repository made here: a first commit without the stack file, a second with dev as shipped; the working file
    then gains a pool. git:HEAD is the shipped dev; git:HEAD~1 had no file, so everything is added."""
    repo = tmp_path / "repo"
    (repo / "stacks").mkdir(parents=True)
    git(repo, "init", "-q")
    (repo / "README").write_text("a team's stacks\n")
    git(repo, "add", "README")
    git(repo, "commit", "-q", "-m", "first")
    path = repo / "stacks" / "Pulumi.dev.yaml"
    path.write_text(DEV.read_text())
    git(repo, "add", "stacks")
    git(repo, "commit", "-q", "-m", "dev")
    changed_dev(repo / "stacks")

    against_head = json.loads(run("plan", str(path), "--against", "git:HEAD", "--json").stdout)
    against_file = json.loads(run("plan", str(path), "--against", str(DEV), "--json").stdout)
    assert against_head == against_file | {"against": "git:HEAD"}

    # Run from inside the repository with a relative path: the same file.
    assert json.loads(run("plan", "stacks/Pulumi.dev.yaml", "--against", "git:HEAD", "--json", cwd=repo).stdout) \
        == against_head

    new_stack = json.loads(run("plan", str(path), "--against", "git:HEAD~1", "--json").stdout)
    whole = json.loads(run("plan", str(path), "--json").stdout)
    assert sorted((r["type"], r["name"]) for r in new_stack["added"]) == \
        sorted((r["type"], r["name"]) for r in whole["resources"])
    assert new_stack["changed"] == new_stack["removed"] == []
    assert set(new_stack["cost"]["old"].values()) == {0.0}
    assert new_stack["cost"]["delta"]["monthly_usd_at_max"] == whole["cost"]["monthly_usd_at_max"]


def test_a_revision_that_cannot_be_read_is_bad_input(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    path = changed_dev(repo)
    unknown = run("plan", str(path), "--against", "git:no-such-branch", "--json")
    assert unknown.returncode == 2
    (error,) = json.loads(unknown.stdout)["errors"]
    assert error["path"] == "--against" and "no revision 'no-such-branch'" in error["message"]

    outside = changed_dev(tmp_path / "not-a-checkout")
    no_git = run("plan", str(outside), "--against", "git:HEAD")
    assert no_git.returncode == 2 and "is not in a git checkout" in no_git.stderr and not no_git.stdout
    markdown_alone = run("plan", str(outside), "--markdown")
    assert markdown_alone.returncode == 2 and "--markdown: needs --against OLD" in markdown_alone.stderr
    both = run("plan", str(outside), "--against", str(DEV), "--markdown", "--json")
    assert both.returncode == 2 and json.loads(both.stdout) == {"errors": [{
        "path": "--markdown", "message": "or --json: the change is printed one way, give one of them"}]}
    for missing in ("nosuch", str(tmp_path / "Pulumi.gone.yaml")):
        nothing = run("plan", str(outside), "--against", missing, "--json")
        assert nothing.returncode == 2 and json.loads(nothing.stdout) == {"errors": [{
            "path": "--against", "message": f"no such stack file: {missing} (OLD is a stack file's path, or git:REV)"}]}


def test_an_old_version_with_problems_is_named_by_its_revision(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    path = changed_dev(repo)
    git(repo, "init", "-q")
    path.write_text(DEV.read_text().replace("max_nodes: 2", "max_nodes: -1"))
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "broken")
    changed_dev(repo)
    out = run("plan", str(path), "--against", "git:HEAD", "--json")
    assert out.returncode == 2
    doc = json.loads(out.stdout)
    assert "gpucluster:cluster.pools[0].max_nodes" in [e["path"] for e in doc["errors"]]
    assert doc["source"] == "HEAD:Pulumi.dev.yaml"


def test_a_version_the_program_refuses_is_bad_input_naming_the_key(tmp_path: Path) -> None:
    """The Pulumi program's own refusal (a team too large for its users' IAM policy, which only the program checks)
    is exit 2 with the key, as `plan` says it, not a traceback."""
    doc = yaml.safe_load(DEV.read_text())
    doc["config"]["gpucluster:cluster"]["users"] = [{"name": f"researcher{i:02d}", "principals": [
        f"arn:aws:iam::123456789012:role/researchers/researcher{i:02d}",
        f"arn:aws:iam::123456789012:user/researcher{i:02d}"]} for i in range(30)]
    crowded = tmp_path / "Pulumi.dev.yaml"
    crowded.write_text(yaml.safe_dump(doc))
    out = run("plan", str(crowded), "--against", str(DEV), "--json")
    assert out.returncode == 2, out
    (error,) = json.loads(out.stdout)["errors"]
    assert error["path"] == "gpucluster:cluster.users" and "access policy would be" in error["message"]


@pytest.mark.parametrize("old,problem", [
    (DEV.read_bytes().replace(b"platform", b"plat\xe9form"), "not UTF-8 text (byte 0xe9 at offset"),
    (DEV.read_bytes() + b"#" + b"x" * (2 * 1024 * 1024) + b"\n", "larger than 1024 KiB"),
], ids=["latin-1", "2-mib"])
def test_an_old_revision_goes_through_the_readers_checks(tmp_path: Path, old: bytes, problem: str) -> None:
    """The revision's bytes, read at most to the reader's cap, refused as the same file on disk would be."""
    repo = tmp_path / "repo"
    path = changed_dev(repo)
    git(repo, "init", "-q")
    path.write_bytes(old)
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "hostile")
    changed_dev(repo)
    out = run("plan", str(path), "--against", "git:HEAD", "--json")
    assert out.returncode == 2 and out.stderr == "", out.stderr
    doc = json.loads(out.stdout)
    assert doc["source"] == "HEAD:Pulumi.dev.yaml"
    (error,) = doc["errors"]
    assert error["path"] == "file" and error["message"].startswith(problem), error
    # Of a blob past the cap, no more than the reader needs to refuse it is read.
    assert len(plan_diff._blob_head(repo, "HEAD:Pulumi.dev.yaml")) == min(len(old), MAX_STACK_BYTES + 1)
