"""`python -m gpucluster plan` as a user runs it: no credentials, no network; `cold` proves it in a fresh process
(the entry point, the imports), the rest run the command line in this process over the session's shared plans."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import re
import subprocess
import sys
from datetime import date
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from conftest import ROOT, planned
from gpucluster import cli, cli_errors, completion, project
from gpucluster.plan import Declared
from gpucluster.render import slurm
from gpucluster.spec import cost
from gpucluster.spec.model import Stack, load_stack

# The module on one xdist worker, so that the command lines its tests share are run once (run below).
pytestmark = pytest.mark.xdist_group("cli")


def cold(*args: str) -> subprocess.CompletedProcess[str]:
    """`python -m gpucluster ARGS` in a fresh process, without AWS credentials."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env["AWS_SHARED_CREDENTIALS_FILE"] = env["AWS_CONFIG_FILE"] = os.devnull  # prove no credentials are needed
    return subprocess.run([sys.executable, "-m", "gpucluster", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def main_here(*args: str) -> subprocess.CompletedProcess[str]:
    """The command line's main() here, its output captured; `plan` takes the program's run under the mock runtime from
    the session's shared plans (conftest.planned: the same program, stack file and account), which a cold process
    would make anew each time (tests/test_cli.py's `cold` proves that path once)."""
    def shared_run(stack: Stack, program: Any, **_: Any) -> list[Declared]:
        stack_arg = args[1] if len(args) > 1 and not args[1].startswith("-") else "dev"
        return list(planned(project.find_stack(stack_arg).resolve())[1])

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), mock.patch.object(
            cli, "run_program", shared_run), contextlib.chdir(ROOT):
        code = cli.main(list(args))
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


@functools.cache  # once per distinct command line a session: several tests read the same plan
def run(*args: str) -> subprocess.CompletedProcess[str]:
    """main_here, once per command line (for those whose answer does not depend on the environment)."""
    return main_here(*args)


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
    # The rows and fixed costs the text's table shows add up to its totals, the budget beside them.
    stack = load_stack(ROOT / "stacks" / "Pulumi.team-a.yaml")
    assert [row["pool"] for row in cost["pools"]] == [pool.name for pool in stack.spec.pools]
    fixed_hourly = sum(cost["fixed_monthly_usd"].values()) / 730
    for end in ("min", "max"):
        assert cost[f"hourly_usd_{end}"] == pytest.approx(
            fixed_hourly + sum(row[f"hourly_usd_{end}"] for row in cost["pools"]), abs=0.01)
    assert cost["over_budget"] == (cost["monthly_usd_at_max"] > cost["budget_monthly_usd"])


def test_plan_shows_the_people_as_the_nodes_will_have_them() -> None:
    """team-a lists a researcher and an admin: each one's uid (given or assigned), admin, GPU limit and how many
    principals connect as them, in the text and in --json; dev lists none and keeps the shared login user."""
    stack = load_stack(ROOT / "stacks" / "Pulumi.team-a.yaml")
    users, persons = stack.spec.users or [], stack.spec.people
    assert [p.admin for p in persons] == [False, True]  # the example shows both kinds
    doc = json.loads(run("plan", "team-a", "--json").stdout)
    assert doc["people"] == [{"name": p.name, "uid": p.uid, "admin": p.admin, "max_gpus": p.max_gpus,
                              "principal_count": len(u.principals)} for u, p in zip(users, persons, strict=True)]
    text = run("plan", "team-a").stdout
    assert f"People: {len(persons)}, each with an account of their own (uid = gid) on every node:" in text
    for user, person in zip(users, persons, strict=True):
        row = [person.name, str(person.uid), "yes" if person.admin else "no",
               str(person.max_gpus or "-"), str(len(user.principals))]
        assert any(line.split() == row for line in text.splitlines()), row
    dev = run("plan", "dev")
    assert json.loads(run("plan", "dev", "--json").stdout)["people"] == []
    assert "People: none listed (users:): everyone connects as the shared login user ubuntu." in dev.stdout


def test_plan_shows_the_money_quota_per_pool_and_the_default_partition() -> None:
    """team-b: the quota in dollars and what it buys in each pool (its GPU- or Neuron device-hours), and which
    partition takes a job without -p and why; --json carries the same figures."""
    stack = load_stack(ROOT / "stacks" / "Pulumi.team-b.yaml")
    quota, (partition, why) = cost.quota(stack), cost.default_partition(stack)
    doc = json.loads(run("plan", "team-b", "--json").stdout)
    assert doc["quota"]["usd_per_month"] == pytest.approx(quota.usd, abs=0.01)
    assert {p["pool"]: p["accelerator_hours"] for p in doc["quota"]["pools"]} == {
        p.pool: pytest.approx(p.accelerator_hours, abs=0.1) for p in quota.pools}
    assert doc["default_partition"] == {"name": partition, "why": why}
    text = run("plan", "team-b").stdout.splitlines()
    assert any(line.startswith(f"Quota for jobs per month:        {cost.money(quota.usd)} (") for line in text)
    for p in quota.pools:
        assert any(line.split()[:3] == [p.pool, f"{cost.money(p.usd_per_accelerator_hour)}/{p.accelerator}-h",
                                        f"{p.accelerator_hours:,.0f}"] for line in text), p
    assert f"Default partition (sbatch without -p): {partition}, {why}." in text
    assert doc["quota"]["longest_whole_node_job_hours"] == pytest.approx(slurm.job_time(stack).longest_hours, abs=0.1)
    assert "quota" not in json.loads(run("plan", "team-k8s", "--json").stdout)  # Kueue has no money quota


def test_a_budget_that_leaves_no_quota_exits_2(tmp_path: Path) -> None:
    """dev with a budget below its fixed costs: its quota would be $0 and hold every job, so plan refuses it."""
    import yaml

    fixed = cost.estimate(load_stack(ROOT / "stacks" / "Pulumi.dev.yaml")).fixed_hourly * cost.HOURS_PER_MONTH
    doc = yaml.safe_load((ROOT / "stacks" / "Pulumi.dev.yaml").read_text())
    doc["config"]["gpucluster:cluster"]["budget"]["monthly_usd"] = int(fixed)
    (tmp_path / "Pulumi.dev.yaml").write_text(yaml.safe_dump(doc))
    out = main_here("plan", str(tmp_path / "Pulumi.dev.yaml"), "--json")
    assert out.returncode == 2, out.stderr
    (error,) = json.loads(out.stdout)["errors"]
    assert error["path"] == "gpucluster:cluster.budget.monthly_usd" and cost.money(fixed) in error["message"]


def test_plan_by_path_and_text_output() -> None:
    out = cold("plan", "stacks/Pulumi.dev.yaml")
    assert out.returncode == 0, out.stderr
    assert "gpucluster:pool:GpuPool  gpucluster-dev-g6-spot" in out.stdout
    assert "  aws:ec2/launchTemplate:LaunchTemplate  gpucluster-dev-g6-spot-lt" in out.stdout
    assert "g6-spot  g6.xlarge  spot" in out.stdout
    assert "WARNING: at full size the cluster crosses its budget" in out.stdout
    # What the program looked up in the account, as the plan assumed it, and what it then declares (a new account).
    assert "Assumed, as a plan cannot ask AWS (`preflight` reads the account): the account has no spot " \
        "service-linked role yet; its default EBS key is AWS managed (aws/ebs)." in out.stdout
    assert "aws:iam/serviceLinkedRole:ServiceLinkedRole  gpucluster-dev-spot-role" in out.stdout


@pytest.mark.parametrize("stack,path,message", [
    ("tests/bad_stacks/Pulumi.many-problems.yaml", "gpucluster:cluster.pools[0].min_nodes", "must be <= max_nodes"),
    ("no-such-stack", "", "no such stack file: Pulumi.no-such-stack.yaml is not in stacks"),
    ("stacks/Pulumi.no-such-stack.yaml", "file", "no such stack file"),
])
def test_bad_input_exits_2_without_traceback(stack: str, path: str, message: str) -> None:
    """As text on stderr; with --json, as {"errors": [{"path", "message"}]} on stdout, nothing on stderr."""
    text = run("plan", stack)
    assert text.returncode == 2 and text.stdout == ""
    assert (f"{path}: {message}" if path else message) in text.stderr
    assert "Traceback" not in text.stderr
    as_json = run("plan", stack, "--json")
    assert as_json.returncode == 2 and as_json.stderr == ""
    errors = json.loads(as_json.stdout)["errors"]
    assert any(e["path"] == path and e["message"].startswith(message) for e in errors), errors


def test_plan_text_shows_what_the_node_images_cost() -> None:
    """team-a bakes the head's image and one NVIDIA compute image. By hand: 2 builds x 1 h of m7i.xlarge at $0.2016 =
    $0.40; snapshots of a 20 GiB and a 120 GiB root volume at $0.05 per GB-month = $7.00 a month."""
    out = run("plan", "team-a")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("Head node per month:"))
    assert lines[head + 1] == ("Node images:                     $0.40 per build (2 x 1 h of m7i.xlarge or "
                               "m6i.xlarge or m5.xlarge), $7.00 per month of snapshots")


def test_no_node_images_line_without_images() -> None:
    import dataclasses

    from gpucluster import cli
    from gpucluster.spec import cost
    from gpucluster.spec.model import load_stack

    stack = load_stack(ROOT / "stacks" / "Pulumi.team-a.yaml")
    estimate = cost.estimate(stack)
    assert any(line.startswith("Node images:") for line in cli.cost_table(stack, estimate, date(2025, 7, 1)))
    assert not any(line.startswith("Node images:")
                   for line in cli.cost_table(stack, dataclasses.replace(estimate, images=[]), date(2025, 7, 1)))


def test_every_class_of_problem_at_once_exit_2(tmp_path) -> None:
    """One file with a duplicate key, a YAML 1.1 boolean, an unknown region, a reserved pool name, a bad e-mail
    address, a non-finite number, a field error beside a cross-field one, and a stack name too long for AWS."""
    path = tmp_path / "Pulumi.vision-research-platform1.yaml"
    path.write_text(
        "config:\n"
        "  aws:region: us-moon-1\n"
        "  gpucluster:cluster:\n"
        "    team: vision\n"
        "    availability_zone: us-moon-1a\n"
        "    network: {vpc_cidr: 10.42.0.0/16}\n"
        "    pools:\n"
        "      - {name: default, instance_type: p9.huge, max_nodes: 2}\n"
        "      - {name: default, instance_type: p5.48xlarge, max_nodes: 2, efa: yes}\n"
        "    storage: {lustre: {deployment_type: SCRATCH_2, storage_capacity_gib: 1200}}\n"
        "    budget:\n"
        "      monthly_usd: .inf\n"
        "      monthly_usd: .nan\n"
        "      notify_emails: [ops@@example.com]\n"
    )
    out = run("plan", str(path), "--json")
    assert out.returncode == 2, out.stderr
    assert out.stderr == ""
    said = "\n".join(f"{e['path']}: {e['message']}" for e in json.loads(out.stdout)["errors"])
    for line in [
        "gpucluster:cluster.budget.monthly_usd: duplicate key",
        "gpucluster:cluster.pools[1].efa: 'yes' is a boolean in YAML 1.1",
        "aws:region: 'us-moon-1' is not an AWS region",
        "stack: stack name 'vision-research-platform1' is 25 characters",
        "gpucluster:cluster.pools[0].name: 'default' is reserved by Slurm",
        "gpucluster:cluster.pools[0].instance_type: unsupported instance type 'p9.huge'",
        "gpucluster:cluster.pools[1].name: duplicate pool name 'default'",
        "gpucluster:cluster.budget.monthly_usd: Input should be a finite number",
        "gpucluster:cluster.budget.notify_emails[0]: not an email address: 'ops@@example.com'",
    ]:
        assert line in said, said


def test_not_utf8_exits_2_without_traceback() -> None:
    out = run("plan", "tests/bad_stacks/Pulumi.not-utf8.yaml")
    assert out.returncode == 2
    assert "file: not UTF-8 text" in out.stderr and "Traceback" not in out.stderr


def test_plan_says_what_destroy_keeps_and_what_it_costs(tmp_path: Path) -> None:
    """team-a keeps its bucket (priced by what it holds); with the file system kept too, its month by hand: 4800 GiB
    of PERSISTENT_2 at 250 MB/s/TiB, $0.210 per GiB-month = $1,008.00. team-b's bucket is the team's, import only."""
    import yaml

    out = run("plan", "team-a")
    assert "Kept after `pulumi destroy`:     the stack's S3 bucket (the data written under /fsx, exported), S3 " \
           "Standard $0.023/GB-month of what it holds" in out.stdout, out.stdout[-1500:]
    doc = yaml.safe_load((ROOT / "stacks" / "Pulumi.team-a.yaml").read_text())
    doc["config"]["gpucluster:cluster"]["storage"]["lustre"]["keep_file_system_on_destroy"] = True
    (tmp_path / "Pulumi.team-a.yaml").write_text(yaml.safe_dump(doc))
    kept = run("plan", str(tmp_path / "Pulumi.team-a.yaml"))
    assert "; the FSx for Lustre file system (PERSISTENT_2, 4800 GiB), $1,008.00 per month" in kept.stdout
    team_b = run("plan", "team-b")
    assert "Kept after `pulumi destroy`:     nothing" in team_b.stdout
    assert "Files written under /fsx are not exported (the team's bucket is imported only)" in team_b.stdout


def test_events_lists_what_happened_to_nodes_and_jobs(tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    log.write_text('{"event": "spot interruption warning", "instance": "i-0abc", "jobs": ["41", "42"], '
                   '"node": "p5-spot-1", "time": "2026-11-30T16:00:00Z"}\n'
                   '{"event": "requeued", "job": "41", "time": "2026-11-30T16:01:00Z", "why": "spot"}\n')
    out = run("events", "--log", str(log), "--last", "1")
    assert out.returncode == 0 and out.stdout == "2026-11-30T16:01:00Z  requeued  job=41 why=spot\n", out.stdout
    out = run("events", "--log", str(log))
    assert out.stdout.splitlines()[0] == ("2026-11-30T16:00:00Z  spot interruption warning  instance=i-0abc "
                                          "jobs=41,42 node=p5-spot-1")
    assert run("events", "--log", str(tmp_path / "none")).returncode == 1


# The exit-code convention (README "Exit codes", gpucluster/cli_errors.py) for every command the parser has: a
# command added later is run here without being named.
COMMANDS = completion.commands(cli.parser())
WITH_STACK = sorted(name for name, command in COMMANDS.items()
                    if any(action.dest in ("stack", "stacks") for action in command._actions))
# Commands that read the account: without credentials they cannot do anything, and say so (exit 2).
NEED_AWS = {"preflight", "cost", "leftovers", "dashboard", "verify", "connect", "ssh-config", "ssh-proxy", "status"}


def no_credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Nothing for botocore to find: no AWS_* variable, empty config and credentials files, no instance metadata."""
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    for name in ("AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
        (tmp_path / name).write_text("")
        monkeypatch.setenv(name, str(tmp_path / name))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def test_every_command_is_in_the_convention() -> None:
    assert {"plan", "render", "preflight", "cost", "leftovers", "verify", "events"} <= set(COMMANDS)
    assert NEED_AWS <= set(WITH_STACK)
    for name, command in COMMANDS.items():
        assert "--json" in completion.options(command), f"{name} takes no --json"


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_a_usage_error_exits_2_as_text_or_json(name: str) -> None:
    """argparse's own errors (a required argument missing comes first for some), through the convention."""
    text = main_here(name, "--no-such-option")
    assert text.returncode == 2 and text.stdout == "" and "Traceback" not in text.stderr
    assert text.stderr.startswith("usage: gpucluster ")  # the command's usage, or the top's for an unknown option
    assert re.match(rf"gpucluster( {name})?: error: ", text.stderr.splitlines()[-1]), text.stderr
    as_json = main_here(name, "--no-such-option", "--json")
    assert as_json.returncode == 2 and as_json.stderr == ""
    (error,) = json.loads(as_json.stdout)["errors"]
    assert error["path"] == "" and error["message"] == text.stderr.splitlines()[-1].split(": error: ", 1)[1]


@pytest.mark.parametrize("name", WITH_STACK)
@pytest.mark.parametrize("stack,path", [("no-such-stack", ""),
                                        ("tests/bad_stacks/Pulumi.many-problems.yaml",
                                         "gpucluster:cluster.pools[0].min_nodes")])
def test_a_bad_stack_exits_2_for_every_command(name: str, stack: str, path: str, tmp_path: Path) -> None:
    args = [name, stack, *(["--out", str(tmp_path)] if name == "render" else []),
            *(["--user", "alice"] if name == "ssh-proxy" else [])]
    text = main_here(*args)
    assert (text.returncode, text.stdout) == (2, ""), text.stderr
    assert "Traceback" not in text.stderr
    as_json = main_here(*args, "--json")
    assert as_json.returncode == 2 and as_json.stderr == ""
    errors = json.loads(as_json.stdout)["errors"]
    assert path in {e["path"] for e in errors}, errors


@pytest.mark.parametrize("name", WITH_STACK)
def test_without_credentials_an_aws_command_exits_2_saying_so(name: str, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    no_credentials(monkeypatch, tmp_path)
    monkeypatch.setattr(cli, "SETTINGS_FILE", str(tmp_path / "absent.json"))  # not on a head node
    args = [name, "dev", *(["--out", str(tmp_path / "out")] if name == "render" else []),
            *(["--user", "alice"] if name == "ssh-proxy" else [])]
    done = main_here(*args, "--json")
    assert "Traceback" not in done.stderr
    if name not in NEED_AWS:
        assert done.returncode == 0, done.stdout  # offline: credentials play no part
        return
    assert done.returncode == 2 and done.stderr == "", done.stdout
    assert json.loads(done.stdout) == {"errors": [{"path": "", "message": cli_errors.NO_CREDENTIALS}]}


EXPIRED = "the AWS credentials are not valid (ExpiredToken): renew them (aws sso login, or new keys)"


def expired_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    """Credentials botocore finds, that every AWS call refuses as expired."""
    from botocore.exceptions import ClientError

    def expired(*args: Any, **kwargs: Any) -> Any:
        raise ClientError({"Error": {"Code": "ExpiredToken", "Message": "The security token included in the request "
                                                                        "is expired"}}, "GetRole")

    for name, value in (("AWS_ACCESS_KEY_ID", "t"), ("AWS_SECRET_ACCESS_KEY", "t"), ("AWS_SESSION_TOKEN", "t")):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr("botocore.client.BaseClient._make_api_call", expired)


def test_preflight_with_expired_credentials_exits_2(monkeypatch: pytest.MonkeyPatch) -> None:
    """An expired token makes every AWS call fail: preflight says so once instead of passing on warnings."""
    expired_credentials(monkeypatch)
    done = main_here("preflight", "dev")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == f"gpucluster: {EXPIRED}\n"


@pytest.mark.parametrize("name", sorted(NEED_AWS))
def test_with_expired_credentials_an_aws_command_exits_2_saying_so(name: str, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Expired (or revoked) credentials are the caller's to renew, like missing ones: exit 2, not a failed check.
    team-a lists people, so connect and ssh-config ask AWS who the caller is; ssh-proxy gets as far as the head."""
    expired_credentials(monkeypatch)
    monkeypatch.setattr(cli, "SETTINGS_FILE", str(tmp_path / "absent.json"))  # not on a head node
    monkeypatch.setenv("HOME", str(tmp_path))
    key = tmp_path / ".ssh" / f"gpucluster-{load_stack(ROOT / 'stacks/Pulumi.team-a.yaml').cluster_name}.pub"
    key.parent.mkdir()
    key.write_text("ssh-ed25519 AAAA test\n")
    # The Session Manager plugin is not installed here; nothing is started, the head is looked up first.
    monkeypatch.setattr("gpucluster.aws.connect.missing_tools", lambda: None)
    args = [name, "team-a", *(["--user", "alice"] if name == "ssh-proxy" else [])]
    done = main_here(*args, "--json")
    assert "Traceback" not in done.stderr
    assert done.returncode == 2 and done.stderr == "", done.stdout
    assert json.loads(done.stdout) == {"errors": [{"path": "", "message": EXPIRED}]}


def test_the_entry_point_without_credentials(tmp_path: Path) -> None:
    """One cold process: the console entry's path (gpucluster.__main__), botocore's own search for credentials."""
    for name in ("config", "credentials"):
        (tmp_path / name).write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")} | {
        "AWS_CONFIG_FILE": str(tmp_path / "config"), "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "credentials"),
        "AWS_EC2_METADATA_DISABLED": "true"}
    done = subprocess.run([sys.executable, "-m", "gpucluster", "preflight", "dev"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (2, ""), done.stderr
    assert done.stderr == f"gpucluster: {cli_errors.NO_CREDENTIALS}\n"


def test_a_reader_that_goes_away_ends_it_quietly() -> None:
    """`gpucluster ... | head`: the pipe's reader is gone before the command writes (its end closed first, so the
    write fails every time): no BrokenPipeError traceback, the status a shell gives a program SIGPIPE ended."""
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run([sys.executable, "-m", "gpucluster", "completion", "bash"], cwd=ROOT, stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (141, "")


def test_render_onto_a_file_and_events_last_0_are_bad_input(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    done = main_here("render", "dev", "--out", str(tmp_path / "file"))
    assert done.returncode == 2 and done.stderr == f"gpucluster: --out: {tmp_path / 'file'} is a file: name a " \
                                                   "directory to write into\n"
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "slurm").write_text("")  # a file where render makes a directory
    done = main_here("render", "dev", "--out", str(tmp_path / "dir"), "--json")
    assert done.returncode == 2 and json.loads(done.stdout)["errors"][0]["path"] == "--out"
    for last in ("0", "-1", "x"):
        done = main_here("events", "--last", last)
        assert done.returncode == 2 and "N must be a whole number >= 1" in done.stderr


def test_an_unsupported_python_is_told_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpucluster import __main__ as entry_point

    monkeypatch.setattr(sys, "version_info", (3, 10, 12, "final", 0))
    with pytest.raises(SystemExit) as exited:
        entry_point.entry()
    assert exited.value.code == f"gpucluster needs Python 3.11 or newer; {sys.executable} is 3.10.12"


def test_bash_completion_offers_the_parsers_commands_options_and_stacks() -> None:
    script = run("completion", "bash").stdout

    def complete(*words: str) -> set[str]:
        line = " ".join(f"'{w}'" for w in words)
        done = subprocess.run(["bash", "-c", f'{script}\nCOMP_WORDS=(gpucluster {line}); '
                               f'COMP_CWORD={len(words)}; _gpucluster; printf "%s\\n" "${{COMPREPLY[@]}}"'],
                              cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return set(done.stdout.split())

    assert complete("") == {*COMMANDS, "-h", "--help", "--version"}
    assert complete("plan", "--") == {"--help", "--json", "--against", "--markdown"}
    assert complete("render", "--") == {"--help", "--json", "--out"}
    assert {p.name.removeprefix("Pulumi.").removesuffix(".yaml")
            for p in (ROOT / "stacks").glob("Pulumi.*.yaml")} <= complete("plan", "")
    assert complete("plan", "te") >= {"team-a", "team-b"}


@pytest.mark.parametrize("command", ["status", "verify"])
def test_a_settings_file_that_is_not_settings_is_no_head_said_in_one_line(command: str, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """/etc/gpucluster/cluster.json present but truncated: not this machine's head (the one rule of
    gpucluster.node.usage.here): without STACK, one error line with the file and why, exit 2; no traceback."""
    broken = tmp_path / "cluster.json"
    broken.write_text("{")
    monkeypatch.setattr(cli, "SETTINGS_FILE", str(broken))
    done = main_here(command)
    assert done.returncode == 2 and done.stdout == "", done.stdout
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"gpucluster: {'verify: ' if command == 'verify' else ''}STACK is needed off the head node "
                           f"({broken} cannot be read as the cluster's settings: "), line
    as_json = main_here(command, "--json")
    assert as_json.returncode == 2 and as_json.stderr == ""
    assert [e["path"] for e in json.loads(as_json.stdout)["errors"]] == [""]


def test_status_with_a_stack_where_the_settings_are_not_settings_asks_the_head(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Not a head by the same rule: with STACK, the stack's head answers through Run Command."""
    from gpucluster.aws import status_remote

    broken = tmp_path / "cluster.json"
    broken.write_bytes(b"\xff")
    monkeypatch.setattr(cli, "SETTINGS_FILE", str(broken))
    asked: list[str] = []

    def run(stack: Stack, as_json: bool, session: Any) -> int:
        asked.append(stack.name)
        return 0

    monkeypatch.setattr(status_remote, "run", run)
    monkeypatch.setattr(cli, "aws_session", lambda region=None: None)
    assert main_here("status", "team-a").returncode == 0 and asked == ["team-a"]
