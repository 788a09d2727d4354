"""gpucluster's command line.

  gpucluster plan [STACK] [--json]      what a stack creates and costs, offline (default stack: dev)
  gpucluster plan STACK --against OLD [--markdown]   what changes from OLD (a stack file or git:REV) and what it
                                        does to the price, offline
  gpucluster render STACK --out DIR     the user data EC2 gets, the head's Slurm, Prometheus and Grafana files,
                                        the node images' bill of materials (image/bom.json)
  gpucluster preflight STACK            the account's quotas, capacity and prices for the stack
  gpucluster cost STACK                 this month's spend by the stack's tag, forecast, GPU-hours
  gpucluster cost --all [STACK ...]     the cost board across teams: spend, forecast, budget, GPU-hours, idle
                                        GPU-hours (exit 1: a team over its budget or forecast to be)
  gpucluster leftovers STACK            what is still tagged with the stack (after a destroy), per month
  gpucluster dashboard STACK [--run] [--local-port N]   Grafana through a Session Manager port forward
  gpucluster verify STACK --plan [--pool NAME ...] [--nodes N] [--deep]   the checks a verify run makes and the
                                        figures each must reach, offline
  gpucluster verify STACK [--pool NAME ...] [--nodes N] [--deep] [--last]   a verify run on the stack's head node
                                        (through Session Manager; --last: its latest run)
  gpucluster verify [--last] [--pool NAME ...] [--nodes N] [--deep]   on the head node, as root: the run
  gpucluster connect STACK [--admin] [--user NAME]   a shell on the head node (Session Manager)
  gpucluster ssh-config STACK [--user NAME]   a Host block for ~/.ssh/config: ssh, scp, rsync through Session Manager
  gpucluster status STACK               partitions open or closed and why, nodes, jobs, spend, the quota (read on the
                                        head node through Run Command)
  gpucluster events [--last N]          on the head node: recent interruptions, drains, requeues, replacements
  gpucluster image-lock --snapshot ID [--archive URL]   (maintainers, internet) lock the image's Ubuntu packages to
                                        what the Ubuntu snapshot ID serves
  gpucluster completion bash|zsh        a shell completion script: eval "$(gpucluster completion bash)"

Every command takes --json (one JSON object on stdout, errors included).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
from collections import defaultdict
from datetime import date
from pathlib import Path
from typing import Any, NoReturn

from gpucluster import __version__, completion, project
from gpucluster.aws import checkip
from gpucluster.cli_errors import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    NO_CREDENTIALS,
    UserError,
    credentials_problem,
    print_errors,
)
from gpucluster.contract.settings import GRAFANA_PORT, LOGIN_USER, SETTINGS_FILE, VERIFY_PLAN
from gpucluster.contract.verify import CLUSTER, Check, VerifyFormatError, plan_from_json, plan_json
from gpucluster.node import usage
from gpucluster.plan import NEW_ACCOUNT, Declared, run_program
from gpucluster.render import verify as planning
from gpucluster.spec import catalog, cost, eks, model
from gpucluster.spec.model import (
    CONFIG_KEY,
    OPERATOR,
    REGION_KEY,
    SpecError,
    Stack,
    load_stack,
    sso_role_warnings,
    way_in_warning,
)
from gpucluster.spec.ubuntu_lock import LOCK_FILE

PROG = "gpucluster"
BOM_PATH = "image/bom.json"  # under render's --out


def _stack_path(stack_arg: str) -> Path:
    try:
        return project.find_stack(stack_arg)
    except project.StackNotFound as exc:
        raise UserError([("", str(exc))]) from None


def _load(stack_arg: str) -> Stack:
    return load_stack(_stack_path(stack_arg))


def _load_among_siblings(stack_arg: str) -> Stack:
    """The stack, refused when its VPC range overlaps another stack file's of its directory and region."""
    return model.load_stack_among_siblings(_stack_path(stack_arg),
                                           lambda line: print(f"{PROG}: note: {line}", file=sys.stderr))


def people(stack: Stack) -> list[dict[str, object]]:
    """The stack's people as the nodes will have them (the uid given or assigned), with how many principals each
    connects with (the principals themselves are in the stack file)."""
    return [{"name": person.name, "uid": person.uid, "admin": person.admin, "max_gpus": person.max_gpus,
             "principal_count": len(user.principals)}
            for user, person in zip(stack.spec.users or (), stack.spec.people, strict=True)]


def people_lines(stack: Stack) -> list[str]:
    rows = people(stack)
    slurm = stack.spec.scheduler == "slurm"
    if not rows:
        return [f"People: none listed (users:){f': everyone connects as the shared login user {LOGIN_USER}' * slurm}."]
    table = [("name", "uid", "admin", "max_gpus", "principals")] + [
        (str(r["name"]), str(r["uid"]), "yes" if r["admin"] else "no",
         "-" if r["max_gpus"] is None else str(r["max_gpus"]), str(r["principal_count"])) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    accounts = ", each with an account of their own (uid = gid) on every node" if slurm else " (users:)"
    return [f"People: {len(rows)}{accounts}:"] + [
        "  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in table] + [f"WARNING: {where}: {why}." for where, why in sso_role_warnings(stack.spec)]


def cost_table(stack: Stack, estimate: cost.CostEstimate, today: date) -> list[str]:
    rows = [("pool", "type", "capacity", "$/node-h", "nodes", "$/h at min", "$/h at max", "priced as")]
    for p in estimate.pools:
        rows.append(
            (p.name, p.instance_type, p.capacity, cost.money(p.usd_per_node_hour), f"{p.min_nodes}-{p.max_nodes}",
             cost.money(p.hourly_min), cost.money(p.hourly_max), p.priced_as)
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines += [
        "",
        f"FSx for Lustre per month:        {cost.money(estimate.lustre_monthly)}",
        (f"EKS and system nodes per month:  {cost.money(estimate.kubernetes_monthly)} (control plane "
         f"{cost.money(eks.CONTROL_PLANE_USD_PER_HOUR)}/h, {eks.SYSTEM_NODES} x {eks.SYSTEM_INSTANCE_TYPE})"
         if stack.spec.scheduler == "kubernetes" else
         f"Head node per month:             {cost.money(estimate.head_node_monthly)} "
         f"({stack.spec.head_node.instance_type}, EBS)"),
        *([f"Node images:                     {cost.money(estimate.image_build_usd)} per build "
           f"({len(estimate.images)} x "
           f"{catalog.IMAGE_BUILD_HOURS:g} h of {' or '.join(catalog.IMAGE_BUILD_INSTANCE_TYPES)}), "
           f"{cost.money(estimate.image_snapshots_monthly)} per month of snapshots"] if estimate.images else []),
        f"NAT and VPC endpoints per month: {cost.money(estimate.network_monthly)}",
        f"Cluster per hour:                {cost.money(estimate.hourly_min)} at min size, "
        f"{cost.money(estimate.hourly_max)} at max size",
        f"Month at max size:               {cost.money(estimate.monthly_at_max)} against a budget of "
        f"{cost.money(estimate.budget_monthly)}",
        *spot_lines(stack, estimate),
    ]
    kept = cost.kept_on_destroy(stack)
    lines.append("Kept after `pulumi destroy`:     " + ("; ".join(
        f"{k.what}, {cost.money(k.monthly_usd) + ' per month' if k.monthly_usd is not None else k.note}"
        for k in kept) if kept else "nothing"))
    lustre = stack.spec.storage.lustre
    if not lustre.exports and not lustre.file_system_id and not lustre.keeps_file_system:
        lines.append("Files written under /fsx are not exported (the team's bucket is imported only): they go with "
                     "the file system.")
    if estimate.over_budget:
        lines.append(
            f"WARNING: at full size the cluster crosses its budget after {estimate.hours_at_max_within_budget:,.0f} "
            f"hours ({estimate.hours_at_max_within_budget / 24:,.1f} days) of the month."
        )
    if estimate.unpriced:
        lines.append(
            f"WARNING: no reference price for pool(s) {', '.join(estimate.unpriced)}: totals above leave them out "
            "(run `preflight` for live prices)."
        )
    lines.append(f"Reference prices: {catalog.PRICE_SOURCE}, recorded {catalog.PRICE_DATE}; 'priced as' says which "
                 "rate each pool uses.")
    stale = cost.stale_price_warning(today)
    if stale:
        lines.append(f"WARNING: {stale}.")
    return lines


def spot_lines(stack: Stack, estimate: cost.CostEstimate) -> list[str]:
    """Each spot pool priced at its on-demand ceiling: its typical price beside it, or why there is none."""
    ceiling = [p for p in estimate.pools if p.priced_as == "on-demand (spot upper bound)"]
    lines = []
    for p in ceiling:
        typical = p.typical_usd_per_node_hour
        if p.spot is None or typical is None:
            lines.append(f"Spot pool {p.name}: the Spot Instance Advisor published no savings for {p.instance_type} in "
                         f"{stack.region}: priced at the on-demand ceiling only.")
        else:
            lines.append(f"Spot pool {p.name}: typically {cost.money(typical)}/node-h ({p.spot.savings_percent}% under "
                         f"on-demand in {stack.region} over 30 days, interruption frequency {p.spot.interruptions}; "
                         f"Spot Instance Advisor, recorded {catalog.SPOT_DATE}); the rows above are its ceiling.")
    if any(p.spot for p in ceiling):
        lines.append(f"Cluster per hour at max size with spot at typical prices: "
                     f"{cost.money(estimate.typical_hourly_max)}")
    return lines


def config_problem(text: str) -> tuple[str, str]:
    """(path, message) of a refusal that begins with the config key it is about ("gpucluster:cluster.users: ...")."""
    path, _, message = text.partition(": ")
    return (path, message) if path.startswith((CONFIG_KEY, REGION_KEY)) and " " not in path else ("", text)


def print_json(doc: object) -> None:
    json.dump(doc, sys.stdout, indent=1, sort_keys=True)
    print()


def resource_tree(declared: list[Declared]) -> list[str]:
    """Resources grouped under the component that owns them."""
    children: dict[str, list[Declared]] = defaultdict(list)
    for d in declared:
        children[d.parent_urn].append(d)
    lines: list[str] = []

    def walk(urn: str, depth: int) -> None:
        for d in sorted(children.get(urn, []), key=lambda r: (r.type.startswith("gpucluster:"), r.type, r.name)):
            kept = "  [kept on destroy]" if d.retain_on_delete else ""
            lines.append(f"{'  ' * depth}{d.type}  {d.name}{kept}")
            walk(d.urn, depth + 1)

    roots = {d.parent_urn for d in declared if d.parent_type is None}
    for root in sorted(roots):
        walk(root, 0)
    return lines


def image_inputs(stack: Stack) -> dict[str, object] | None:
    """What the stack's node images are made of (a change here rebakes them); None for a stack that bakes none."""
    from gpucluster.spec import bom

    if not stack.spec.image_builds:
        return None
    text = bom.render(stack)
    return {"ubuntu_snapshot": stack.spec.image.ubuntu_snapshot, "bom_sha256": bom.digest(text),
            "parent_images": {role: parent.as_dict() for role, parent in bom.parents(stack).items()}}


def image_lines(images: dict[str, Any]) -> list[str]:
    lines = [f"Image inputs: Ubuntu snapshot {images['ubuntu_snapshot']}, BOM sha256 {images['bom_sha256']} "
             "(`render --out DIR` writes DIR/image/bom.json); baked on:"]
    for role, parent in images["parent_images"].items():
        ids = ", ".join(f"{region} {ami}" for region, ami in parent["region_ids"].items())
        lines.append(f"  {role:<7} {parent['name']} (owner {parent['owner']}{'; ' + ids if ids else ''})")
    return lines


def plan(args: argparse.Namespace) -> int:
    if args.markdown and not args.against:
        raise UserError([("--markdown", "needs --against OLD (it prints the change, for a pull request)")])
    if args.markdown and args.json:
        raise UserError([("--markdown", "or --json: the change is printed one way, give one of them")])
    stack = _load_among_siblings(args.stack)
    if not project.has_program():  # the head node's bundle carries the library, not the Pulumi program
        raise UserError([("", "plan runs the Pulumi program (components/), which is not installed here: run it "
                              "where gpucluster is installed (pip install) or from a checkout. Here: render, "
                              "preflight, cost.")])
    from gpucluster.render.slurm import job_time

    if args.against:
        return plan_against(args, stack)
    declared = planned(stack)
    estimate = cost.estimate(stack)
    images = image_inputs(stack)
    if args.json:
        doc: dict[str, object] = {
            "stack": stack.name,
            "region": stack.region,
            "images": images,
            "resources": [
                {"type": d.type, "name": d.name, "parent": d.parent_type, "inputs": d.inputs,
                 "retain_on_delete": d.retain_on_delete}
                for d in declared
            ],
            "cost": estimate.summary(),
            "price_warning": cost.stale_price_warning(date.today()),
            "people": people(stack),
        }
        if stack.spec.scheduler == "slurm":
            partition, why = cost.default_partition(stack)
            doc["quota"] = cost.quota(stack).as_dict() | job_time(stack).as_dict()
            doc["default_partition"] = {"name": partition, "why": why}
        print_json(doc)
        return 0
    print(f"Stack {stack.name}: team {stack.spec.team}, {stack.region} / {stack.spec.availability_zone}, "
          f"{len(declared)} resources (offline plan, mock runtime; '<... at up>' marks values AWS computes)")
    print(f"Assumed, as a plan cannot ask AWS (`preflight` reads the account): {NEW_ACCOUNT.describe()}.")
    if stack.spec.scheduler == "kubernetes" and OPERATOR in stack.spec.eks.public_access_cidrs:
        print(f"`operator` (kubernetes.public_access_cidrs) is {NEW_ACCOUNT.operator_ip}/32 here, a documentation "
              f"address: `up` asks {checkip.CHECKIP_URL} for the address of the machine running it.")
    warning = way_in_warning(stack.spec)
    if warning:
        print(f"WARNING: {warning}.")
    print()
    print("\n".join(resource_tree(declared)))
    print()
    print("\n".join(people_lines(stack)))
    print()
    if images:
        print("\n".join(image_lines(images)))
        print()
    print("\n".join(cost_table(stack, estimate, date.today())))
    if stack.spec.scheduler == "slurm":
        print("\n".join(cost.quota_lines(stack, job_time(stack))))
    return 0


def planned(stack: Stack) -> list[Declared]:
    """What the project's Pulumi program declares for the stack, offline; what it refuses in the stack's own terms is
    bad input naming the key (as `pulumi up` would say it)."""
    from pulumi import RunError

    try:
        return run_program(stack, project.pulumi_program())
    except RunError as exc:
        raise UserError([config_problem(str(exc))]) from None


def plan_against(args: argparse.Namespace, stack: Stack) -> int:
    """What changes between OLD and STACK, and its price (gpucluster/plan_diff.py)."""
    from gpucluster import plan_diff

    try:
        old = plan_diff.old_stack(_stack_path(args.stack), args.against)
        result = plan_diff.diff(stack, old, args.against, planned)
    except plan_diff.AgainstError as exc:
        raise UserError([("--against", str(exc))]) from None
    if args.json:
        print_json(result.as_json())
    else:
        print("\n".join(plan_diff.markdown(result) if args.markdown else plan_diff.text(result)))
    return 0


def render(args: argparse.Namespace) -> int:
    """The exact user data EC2 gets, the files the head node writes, and the images' bill of materials."""
    stack = _load(args.stack)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UserError([("--out", f"{out} is a file: name a directory to write into")])
    try:
        if stack.spec.scheduler == "kubernetes":
            return _render_kubernetes(stack, out, args.json)
        return _render_slurm(stack, out, args.json)
    except OSError as exc:  # a file in the way of a directory, no permission, a full disk
        raise UserError([("--out", f"cannot write under {out}: {exc.strerror}: {exc.filename}")]) from None


def _render_slurm(stack: Stack, out: Path, as_json: bool) -> int:
    from gpucluster.render import dashboards, prometheus, slurm, userdata
    from gpucluster.spec import bom

    files = dict(userdata.all_user_data(stack))
    files |= {f"slurm/{name}": text for name, text in slurm.all_files(stack).items()}
    files |= prometheus.files(stack) | dashboards.files(stack)  # byte for byte what the head's bundle carries
    files[BOM_PATH] = bom.render(stack)  # byte for byte what the image builds get
    for name, text in files.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)
    if as_json:
        print_json({"files": [{"path": str(out / name), "bytes": len(files[name].encode())} for name in sorted(files)],
                    "user_data_limit": userdata.EC2_USER_DATA_LIMIT})
        return 0
    for name in sorted(files):
        size = len(files[name].encode())
        limit = f"  ({size} of {userdata.EC2_USER_DATA_LIMIT} bytes)" if name.endswith(".user-data") else ""
        print(f"{out / name}{limit}")
    return 0


def _render_kubernetes(stack: Stack, out: Path, as_json: bool) -> int:
    """The Kubernetes objects of the stack (for reference) and its first job (for `kubectl apply -f`), as YAML."""
    import yaml

    from gpucluster.render import kube

    (out / "kubernetes").mkdir(parents=True, exist_ok=True)
    written = []
    for name, manifests in kube.render_files(stack, project.EXAMPLES_DIR).items():
        path = out / "kubernetes" / name
        path.write_text(kube.render_header(name) + yaml.safe_dump_all(manifests, sort_keys=False))
        written.append(path)
    if as_json:
        print_json({"files": [{"path": str(path), "bytes": path.stat().st_size} for path in written]})
    else:
        print("\n".join(map(str, written)))
    return 0


def preflight(args: argparse.Namespace) -> int:
    """Checks against the caller's account; exit 0 when nothing fails, 1 when a check fails, 2 without credentials."""
    from gpucluster.aws import preflight as checks

    stack = _load_among_siblings(args.stack)
    session = aws_session()
    report = checks.run(stack, session)
    estimate = cost.estimate(stack, hourly_overrides=report.spot_prices)
    if args.json:
        print_json({"stack": stack.name, "region": stack.region, "failed": report.failed,
                    "checks": [dataclasses.asdict(check) for check in report.checks],
                    "cost": estimate.summary()})
    else:
        print("\n".join(checks.render(stack, report)))
        print()
        print("\n".join(cost_table(stack, estimate, date.today())))
    return EXIT_FAILED if report.failed else 0


def aws_session(region: str | None = None) -> Any:
    """The caller's boto3 session; no credentials anywhere (environment, profile, SSO, instance role) is bad input
    (exit 2) here, before a command that reads many APIs could take each refusal for a finding."""
    import boto3

    session = boto3.Session(region_name=region)
    if session.get_credentials() is None:
        raise UserError([("", NO_CREDENTIALS)])
    return session


def spend(args: argparse.Namespace) -> int:
    """This month's spend, forecast and GPU-hours; Cost Explorer lives in us-east-1 whatever the stack's region.
    `--all` or several stacks: the cost board (gpucluster/aws/cost_board.py). Exit 1 as the board's: over the budget
    or forecast to be, or the spend unread."""
    import datetime as dt

    from gpucluster.aws import spend as money

    if args.all or len(args.stacks) != 1:
        return cost_board(args)
    stack = _load(args.stacks[0])
    session = aws_session()
    result = money.spend(session.client("ce", region_name="us-east-1"), stack, dt.date.today(),
                         budgets=session.client("budgets", region_name="us-east-1"),
                         account=money.account_id(session, stack.region))
    gpu_hours = usage.head_gpu_hours(stack.cluster_name)
    if args.json:
        print_json(money.as_json(stack, result, gpu_hours))
    else:
        print("\n".join(money.report(stack, result, gpu_hours)))
    return EXIT_FAILED if result.fails(stack.spec.budget.monthly_usd) else 0


def cost_board(args: argparse.Namespace) -> int:
    """One row per stack (the files given, or every stack under stacks/ with --all) and a total; exit 1 when a team
    is over its budget or forecast to be, or its spend could not be read."""
    import datetime as dt

    from gpucluster.aws import cost_board as board
    from gpucluster.aws.spend import account_id
    from gpucluster.render import prometheus

    if not args.stacks and not args.all:
        raise UserError([("", "say which stacks: STACK ..., or --all for every stack under ./stacks")])
    paths = [_stack_path(s) for s in args.stacks] or next(
        (found for directory in project.stack_dirs() if (found := sorted(directory.glob("Pulumi.*.yaml")))), [])
    stacks, problems = [], []
    for path in paths:
        try:
            stacks.append(load_stack(path))
        except SpecError as exc:
            problems += [(p, f"{exc.source}: {message}") for p, message in exc.problems]
    if problems or not stacks:
        raise UserError(problems or [("", f"no stack files in {project.looked_in()}")])
    session = aws_session()
    now = dt.datetime.now(dt.timezone.utc)
    rows, notes = board.board(stacks, session.client("ce", region_name="us-east-1"),
                              session.client("budgets", region_name="us-east-1"),
                              account_id(session, stacks[0].region), now.date(),
                              lambda s: board.usage(usage.head_usage(s.cluster_name, s.spec.team,
                                                                     prometheus.idle_gpu_hours_query, now)))
    if args.json:
        print_json(board.as_json(rows, notes))
    else:
        print("\n".join(board.text(rows, notes, now.date())))
    return board.exit_code(rows)


def leftovers(args: argparse.Namespace) -> int:
    """Resources still tagged with the stack, with what each bills per month: exit 1 while any of them bills."""
    from botocore.exceptions import BotoCoreError, ClientError

    from gpucluster.aws import leftovers as left

    stack = _load(args.stack)
    session = aws_session(stack.region)
    clients = {name: session.client(name) for name in ("resourcegroupstaggingapi", "ec2", "fsx", "s3")}
    try:
        found = left.find(clients, stack.name)
    except (BotoCoreError, ClientError) as exc:
        if credentials_problem(exc):
            raise
        raise UserError([("", f"AWS answered: {exc}")], EXIT_FAILED) from None
    if args.json:
        print_json({"stack": stack.name, "region": stack.region, "monthly_usd": left.monthly_total(found),
                    "still_bills": left.still_bills(found), "resources": [dataclasses.asdict(f) for f in found]})
    else:
        print("\n".join(left.report(stack.name, stack.region, found)))
    return EXIT_FAILED if left.still_bills(found) else 0


def dashboard(args: argparse.Namespace) -> int:
    """The command that forwards a local port to Grafana on the stack's running head node, and the URL to open; with
    --run, that command replaces this process (os.execvp), so the user's terminal holds the forward until Ctrl-C. The
    forward itself is the AWS CLI's and its Session Manager plugin's: the document fixes the head's end to Grafana."""
    import shlex

    from gpucluster.aws.head import HeadNotFound, running_head
    from gpucluster.contract.settings import DASHBOARD_SESSION, session_document_name, start_session_command

    stack = _load(args.stack)
    try:
        head = running_head(aws_session(stack.region).client("ec2"), stack)
    except HeadNotFound as exc:
        raise UserError([("", f"dashboard: {exc}")], EXIT_FAILED) from None
    command = start_session_command(stack.region, head, session_document_name(stack.cluster_name, DASHBOARD_SESSION),
                                    {"localPortNumber": str(args.local_port)})
    url = f"http://localhost:{args.local_port}/"
    if args.json and not args.run:
        print_json({"command": command, "url": url})
        return 0
    print(shlex.join(command))
    print(f"Grafana: {url} (while the command runs)")
    if args.run:
        sys.stdout.flush()  # execvp drops this process's buffers
        try:
            os.execvp(command[0], command)
        except FileNotFoundError:
            raise UserError([("", "dashboard: the AWS CLI (aws) is not on PATH; it needs AWS's Session Manager "
                                  "plugin too")], EXIT_FAILED) from None
    return 0


def _tcp_port(text: str) -> int:
    port = int(text)
    if not 1 <= port <= 65535:  # the dashboard document's allowedPattern
        raise argparse.ArgumentTypeError(f"{text} is not a TCP port (1-65535)")
    return port


def verify(args: argparse.Namespace) -> int:
    """--plan: the checks and thresholds, offline. Otherwise a run: here on the head node (root), or on the stack's
    head through Session Manager (gpucluster.aws.verify_remote)."""
    problems = []
    if args.plan and not args.stack:
        problems.append("--plan needs STACK (it reads the stack file, offline)")
    if args.last and (args.plan or args.pool or args.nodes is not None or args.deep):
        problems.append("--last prints the latest run as it was: it takes no --plan, --pool, --nodes or --deep")
    if problems:
        _bad_input(problems)
    stack = _load(args.stack) if args.stack else None
    planned: list[Check] | None = None
    if stack is not None and not args.last:  # the options against the stack file, before any AWS call
        try:
            planned = planning.plan(stack, _plan_options(args))
        except planning.PlanError as exc:
            _bad_input(exc.problems)
        if args.plan:
            print(plan_json(planned) if args.json else "\n".join(planning.table(planned)))
            return 0
    here = usage.here(stack.cluster_name if stack else None, SETTINGS_FILE)
    if isinstance(here, str) and stack is not None:
        from gpucluster.aws import verify_remote

        return verify_remote.run(stack, head_arguments(args), aws_session())
    if isinstance(here, str):
        _bad_input([f"STACK is needed off the head node ({here})"])
    from gpucluster.node import verify_run

    if args.last:  # the kept runs are 0644: anyone on the head may read the latest
        return verify_run.last(args.json)
    if os.geteuid() != 0:
        _bad_input(["a run submits the login user's jobs and DCGM's diagnostic as root: run it as root "
                           "(sudo gpucluster verify)"])
    try:
        if planned is None:  # no STACK given on the head: its own stack file, from the bundle
            planned = planning.plan(head_stack(here.cluster), _plan_options(args))
        checks = head_plan(args, planned)
    except (planning.PlanError, VerifyFormatError) as exc:
        _bad_input(getattr(exc, "problems", [str(exc)]))
    setup = verify_run.Setup(here, probe=verify_run.ProbeOptions(args.fsx_mib, args.fsx_type))
    return verify_run.run(checks, args.json, setup)


def _bad_input(problems: list[str]) -> NoReturn:
    raise UserError([("", f"verify: {problem}") for problem in problems])


def connect(args: argparse.Namespace) -> int:
    from gpucluster.aws import connect as session_manager

    return session_manager.connect(_load(args.stack), args.admin, args.user, aws_session())


def ssh_config(args: argparse.Namespace) -> int:
    from gpucluster.aws import connect as session_manager

    stack_file = _stack_path(args.stack)
    return session_manager.ssh_config(load_stack(stack_file), stack_file, args.user, aws_session())


def ssh_proxy(args: argparse.Namespace) -> int:
    from gpucluster.aws import connect as session_manager

    return session_manager.ssh_proxy(_load(args.stack), args.user, aws_session())


def status(args: argparse.Namespace) -> int:
    """On the head node: read here (gpucluster.node.status_run). Elsewhere, with STACK: through Run Command."""
    stack = _load(args.stack) if args.stack else None
    here = usage.here(stack.cluster_name if stack else None, SETTINGS_FILE)
    if isinstance(here, str) and stack is not None:
        from gpucluster.aws import status_remote

        return status_remote.run(stack, args.json, aws_session())
    if isinstance(here, str):
        raise UserError([("", f"STACK is needed off the head node ({here})")])
    from gpucluster.node import status_run

    return status_run.run(args.json, here)


def _plan_options(args: argparse.Namespace) -> planning.Options:
    return planning.Options(tuple(args.pool or ()), args.nodes, args.deep)


def head_arguments(args: argparse.Namespace) -> list[str]:
    """What `gpucluster verify` on the stack's head node is given: this call's options, without STACK."""
    return ([*(["--last"] if args.last else []), *(["--json"] if args.json else [])]
            + [a for pool in args.pool or () for a in ("--pool", pool)]
            + ([f"--nodes={args.nodes}"] if args.nodes is not None else []) + (["--deep"] if args.deep else []))


def head_stack(cluster: str) -> Stack:
    """The head node's own stack file, in the bundle ($GPUCLUSTER_STACKS there: the head's `gpucluster` wrapper)."""
    files = [path for directory in project.stack_dirs() for path in sorted(directory.glob("Pulumi.*.yaml"))]
    found = [stack for stack in map(load_stack, files) if stack.cluster_name == cluster]
    if not found:
        raise VerifyFormatError(f"no stack file of cluster {cluster} in {project.looked_in()}")
    return found[0]


def head_plan(args: argparse.Namespace, planned: list[Check]) -> list[Check]:
    """The run's checks: the bundle's plan (settings.VERIFY_PLAN, the default options) for the chosen pools and the
    cluster's checks; `planned` (the stack file's plan for this call's options) when --nodes or --deep change its
    figures."""
    if args.nodes is not None or args.deep:
        return planned
    bundled = plan_from_json(Path(VERIFY_PLAN).read_text())
    return [c for c in bundled if not args.pool or c.pool in args.pool or c.pool == CLUSTER]


def events(args: argparse.Namespace) -> int:
    """The head node's events log, newest last: what happened to nodes and jobs, and when."""
    from gpucluster.contract.settings import EVENTS_LOG

    path = Path(args.log or EVENTS_LOG)
    if not path.exists():
        raise UserError([("", f"no events yet ({path} does not exist; it is on the head node)")], EXIT_FAILED)
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()][-args.last:]
    if args.json:
        print_json({"events": rows})
        return 0
    for row in rows:
        details = " ".join(f"{k}={','.join(v) if isinstance(v, list) else v}" for k, v in sorted(row.items())
                           if k not in ("time", "event"))
        print(f"{row['time']}  {row['event']}  {details}".rstrip())
    return 0


def image_lock(args: argparse.Namespace) -> int:
    """Read the snapshot's Packages indexes (noble, -updates, -security) and write the newest version of every Ubuntu
    package of the BOM under the snapshot's id in the committed lock file. Internet, no AWS."""
    import lzma
    import re
    import urllib.request

    from gpucluster.spec import bom, ubuntu_lock

    if not re.fullmatch(ubuntu_lock.SNAPSHOT_RE, args.snapshot):
        raise UserError([("--snapshot", f"{args.snapshot!r} is not a snapshot id (UTC YYYYMMDDTHHMMSSZ)")])
    archive = (args.archive or ubuntu_lock.archive_url(args.snapshot)).rstrip("/")
    indexes = []
    for path in ubuntu_lock.index_paths():
        try:
            with urllib.request.urlopen(f"{archive}/{path}", timeout=120) as answer:
                indexes.append(lzma.decompress(answer.read()).decode())
        except (OSError, lzma.LZMAError) as exc:  # URLError is an OSError: no network, a 404, a timeout
            raise UserError([("", f"image-lock: cannot read {archive}/{path}: {exc}")], EXIT_FAILED) from None
        print(f"read {archive}/{path}", file=sys.stderr if args.json else sys.stdout)
    try:
        versions = ubuntu_lock.newest(indexes, bom.UBUNTU_PACKAGES)
    except KeyError as exc:
        raise UserError([("", f"image-lock: {exc.args[0]}")], EXIT_FAILED) from None
    lock = Path(args.lock)
    lock.write_text(ubuntu_lock.with_entry(ubuntu_lock.load(lock) if lock.exists() else {}, args.snapshot, versions))
    if args.json:
        print_json({"lock": str(lock), "snapshot": args.snapshot, "packages": versions})
    else:
        print(f"{lock}: {len(versions)} packages under {args.snapshot}")
    return 0


def parser() -> argparse.ArgumentParser:
    top = Parser(prog=PROG, description=__doc__, epilog=EPILOG,
                 formatter_class=argparse.RawDescriptionHelpFormatter)  # the docstring's table, line by line
    top.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("plan", help="show what a stack creates and costs, offline")
    p.add_argument("stack", nargs="?", default="dev", help=f"{project.STACK_HELP} (default: dev)")
    _json_flag(p)
    p.add_argument("--against", metavar="OLD",
                   help="compare with OLD: another stack file, or git:REV (this stack's file at that revision; "
                        "a file missing there: everything is added). Prints the resources added, changed and removed "
                        "by component and the change in $/h at min and max size and in the month at max")
    p.add_argument("--markdown", action="store_true",
                   help="with --against, not --json: a block for a pull request's comment")
    p.set_defaults(func=plan)
    r = sub.add_parser("render", help="write the user data, Slurm files and image BOM of a stack")
    r.add_argument("stack", help=project.STACK_HELP)
    r.add_argument("--out", required=True, help="directory to write into (made if missing; files in it replaced)")
    _json_flag(r, 'print {"files": [{"path", "bytes"}, ...]} instead of the paths')
    r.set_defaults(func=render)
    f = sub.add_parser("preflight", help="check the AWS account (quotas, capacity, offers, prices) for a stack")
    f.add_argument("stack", help=project.STACK_HELP)
    _json_flag(f)
    f.set_defaults(func=preflight)
    c = sub.add_parser("cost", help="this month's spend, forecast and GPU-hours of a stack, or the cost board across "
                                    "teams (AWS credentials)",
                       description="STACK: one stack's spend, forecast, budget and (on its head node) what the "
                                   "jobs billed against the quota, and GPU-hours. --all or several stacks: the "
                                   "cost board, one row per team (spend, forecast, budget, GPU-hours, idle "
                                   "GPU-hours) and a total. Either way, "
                                   "--json prints the same as one JSON object; exit 0 "
                                   "ok; 1 when a team is over its budget or forecast to be, or its spend could not "
                                   "be read; 2 bad input.")
    c.add_argument("stacks", nargs="*", metavar="STACK",
                   help=f"{project.STACK_HELP}; several: the board (--all without any: every stack under ./stacks)")
    c.add_argument("--all", action="store_true", help="the board across teams (every stack under stacks/ unless "
                                                      "stacks are given)")
    _json_flag(c, "the report as one JSON object: one stack's, or the board's")
    c.set_defaults(func=spend)
    left = sub.add_parser("leftovers", help="what is still tagged with a stack, and its monthly cost (AWS credentials)")
    left.add_argument("stack", help=project.STACK_HELP)
    _json_flag(left)
    left.set_defaults(func=leftovers)
    d = sub.add_parser("dashboard", help="Grafana on the head node through a Session Manager port forward "
                                         "(AWS credentials, the AWS CLI and its Session Manager plugin)")
    d.add_argument("stack", help=project.STACK_HELP)
    d.add_argument("--run", action="store_true", help="run the forward here (until Ctrl-C) instead of printing it")
    d.add_argument("--local-port", type=_tcp_port, default=GRAFANA_PORT,
                   help=f"the port on this machine to open Grafana at (default {GRAFANA_PORT})")
    _json_flag(d, 'print {"command": [...], "url": ...} (without --run)')
    d.set_defaults(func=dashboard)
    ver = sub.add_parser("verify", help="prove a cluster through Slurm: devices, DCGM, EFA, NCCL, /fsx, monitoring "
                                        "(on its head node, or from here with STACK); --plan: the checks, offline")
    ver.add_argument("stack", nargs="?", help=f"{project.STACK_HELP} (not needed on the head node)")
    ver.add_argument("--plan", action="store_true", help="print the checks and thresholds, run nothing")
    ver.add_argument("--last", action="store_true", help="print the latest run kept on the head node")
    _json_flag(ver, 'print {"checks": [{"pool", "check", "expect", ...}, ...]}')
    ver.add_argument("--pool", action="append", metavar="NAME",
                     help="a pool to verify (repeatable; default: every pool)")
    ver.add_argument("--nodes", type=int, metavar="N",
                     help=f"nodes per pool (default: {planning.DEFAULT_NODES} where a pool allows, else its max_nodes)")
    ver.add_argument("--deep", action="store_true", help="the longer diagnostics (DCGM level 3 instead of 1)")
    # The boot rehearsal's run (tests): less to write on /fsx, and the type its /fsx has (verify_probe.Sources).
    ver.add_argument("--fsx-mib", type=int, help=argparse.SUPPRESS)
    ver.add_argument("--fsx-type", help=argparse.SUPPRESS)
    ver.set_defaults(func=verify)
    con = sub.add_parser("connect", help="a shell on the head node through Session Manager, as yourself (AWS "
                                         "credentials, the AWS CLI and its Session Manager plugin)")
    con.add_argument("stack", help=project.STACK_HELP)
    who = con.add_mutually_exclusive_group()
    who.add_argument("--admin", action="store_true", help="the admins' shell (ssm-user, sudo)")
    who.add_argument("--user", metavar="NAME", help="the person to connect as (default: the one whose principal "
                                                    "you are signed in with)")
    _json_flag(con, "problems as one JSON object (the shell itself is interactive)")
    con.set_defaults(func=connect)
    ssh = sub.add_parser("ssh-config", help="print a Host block for ~/.ssh/config: ssh, scp and rsync to the head "
                                            "node through Session Manager")
    ssh.add_argument("stack", help=project.STACK_HELP)
    ssh.add_argument("--user", metavar="NAME", help="the person to log in as (default: yours, by your principal)")
    _json_flag(ssh, "problems as one JSON object (the Host block is ssh's text)")
    ssh.set_defaults(func=ssh_config)
    proxy = sub.add_parser("ssh-proxy", help="(ssh's ProxyCommand, written by ssh-config) push the key for 60 s, "
                                             "then stream to the head's port 22")
    proxy.add_argument("stack", help=project.STACK_HELP)
    proxy.add_argument("--user", required=True, metavar="NAME", help="the OS user ssh logs in as")
    _json_flag(proxy, "problems as one JSON object (the stream itself is ssh's)")
    proxy.set_defaults(func=ssh_proxy)
    st = sub.add_parser("status", help="partitions open or closed and why, nodes per pool, jobs, spend against "
                                       "budget, what jobs billed against the quota (on the head node, or from here "
                                       "with STACK)")
    st.add_argument("stack", nargs="?", help=f"{project.STACK_HELP} (not needed on the head node)")
    _json_flag(st)
    st.set_defaults(func=status)
    e = sub.add_parser("events", help="on the head node: recent spot warnings, drains, requeues and replacements")
    e.add_argument("--last", type=_at_least_one, default=50, metavar="N", help="how many, N >= 1 (default 50)")
    _json_flag(e, 'print {"events": [...]}, each as the log has it')
    e.add_argument("--log", help=argparse.SUPPRESS)  # another events log (tests)
    e.set_defaults(func=events)
    lock = sub.add_parser("image-lock", help="(maintainers; internet, no AWS) lock the image's Ubuntu packages to the "
                                             "versions an Ubuntu snapshot serves")
    lock.add_argument("--snapshot", required=True, help="the snapshot's id: a UTC time, YYYYMMDDTHHMMSSZ")
    lock.add_argument("--archive", help="read the indexes here instead of https://snapshot.ubuntu.com/ubuntu/ID (an "
                                        "archive that served the same indexes at that time)")
    lock.add_argument("--lock", default=str(LOCK_FILE), help=argparse.SUPPRESS)  # another lock file (tests)
    _json_flag(lock, 'print {"lock", "snapshot", "packages"}; the indexes read go to stderr')
    lock.set_defaults(func=image_lock)
    comp = sub.add_parser("completion", help="print a shell completion script: eval \"$(gpucluster completion bash)\"")
    comp.add_argument("shell", choices=completion.SHELLS)
    _json_flag(comp, 'print {"shell", "script"}')
    comp.set_defaults(func=shell_completion)
    return top


def _json_flag(command: argparse.ArgumentParser, what: str = "print one JSON object") -> None:
    """Every command takes --json; its errors then print as {"errors": [...]} too (gpucluster.cli_errors)."""
    command.add_argument("--json", action="store_true", help=what)


def _at_least_one(text: str) -> int:
    count = int(text) if text.lstrip("-").isdigit() else 0
    if count < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: N must be a whole number >= 1")
    return count


def shell_completion(args: argparse.Namespace) -> int:
    script = completion.script(parser(), args.shell, project.STACKS_ENV)
    if args.json:
        print_json({"shell": args.shell, "script": script})
    else:
        print(script, end="")
    return 0


class UsageError(Exception):
    def __init__(self, command: argparse.ArgumentParser, message: str):
        super().__init__(message)
        self.command, self.message = command, message


class Parser(argparse.ArgumentParser):
    """argparse's usage errors raised rather than exited on, so that main() prints them as every other error (as
    JSON with --json); their exit code stays argparse's, 2."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(self, message)


EPILOG = f"""\
STACK: {project.STACK_HELP}.
Exit codes: 0 ok; 1 a check failed or something still bills; 2 bad input or usage (a stack's problems, a bad option,
no or expired AWS credentials). With --json, errors print as {{"errors": [{{"path": ..., "message": ...}}]}}."""


def main(argv: list[str] | None = None) -> int:
    """One command line; every user error ends here, printed once as the convention says (gpucluster.cli_errors)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    as_json = "--json" in argv
    try:
        args = parser().parse_args(argv)
        return int(args.func(args))
    except UsageError as exc:
        if as_json:
            print_errors([("", exc.message)], as_json, PROG)
        else:  # as argparse says it
            exc.command.print_usage(sys.stderr)
            print(f"{exc.command.prog}: error: {exc.message}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except UserError as exc:
        print_errors(exc.problems, as_json, PROG, exc.source)
        return exc.code
    except SpecError as exc:
        print_errors(exc.problems, as_json, PROG, exc.source)
        return EXIT_BAD_INPUT
    except Exception as exc:
        problem = credentials_problem(exc)  # from wherever in a command botocore found them missing or expired
        if problem is None:
            raise
        print_errors([("", problem)], as_json, PROG)
        return EXIT_BAD_INPUT


def run() -> int:
    """The process's entry (`python -m gpucluster`, the `gpucluster` command): main(); a reader that goes away
    (`gpucluster plan | head`) ends it quietly, with the status a shell gives a program SIGPIPE ended (141)."""
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:
        # Python's advice (the signal module's docs, "Note on SIGPIPE"): point stdout at /dev/null, so that the
        # interpreter's own flush at exit cannot raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    return code
