"""gpucluster's command line.

    python -m gpucluster plan [STACK] [--json]   what a stack creates and costs, offline (default stack: dev)
    python -m gpucluster render STACK --out DIR  the user data EC2 gets, the head's Slurm, Prometheus and Grafana files,
                                                 the node images' bill of materials (image/bom.json)
    python -m gpucluster preflight STACK         the account's quotas, capacity and prices for the stack (0 ok, 1 fail)
    python -m gpucluster cost STACK              this month's spend by the stack's tag, forecast, GPU-hours
    python -m gpucluster leftovers STACK         what is still tagged with the stack (after a destroy), per month
    python -m gpucluster dashboard STACK [--run] [--local-port N]   Grafana through a Session Manager port forward
    python -m gpucluster verify STACK --plan [--json] [--pool NAME ...] [--nodes N] [--deep]   the checks a verify
                                                 run makes and the figures each must reach, offline
    python -m gpucluster verify STACK [--json] [--pool NAME ...] [--nodes N] [--deep]   a verify run on the stack's
                                                 head node (through Session Manager; `--last`: its latest run)
    gpucluster verify [--json] [--last] [--pool NAME ...] [--nodes N] [--deep]   on the head node, as root: the run
    python -m gpucluster connect STACK [--admin] [--user NAME]   a shell on the head node (Session Manager)
    python -m gpucluster ssh-config STACK [--user NAME]   a Host block for ~/.ssh/config: ssh, scp, rsync through
                                                 Session Manager
    python -m gpucluster status STACK [--json]   partitions open or closed and why, nodes, jobs, spend, GPU-hours
                                                 (read on the head node through Run Command)
    gpucluster events [--last N]                 on the head node: recent interruptions, drains, requeues, replacements
    python -m gpucluster image-lock --snapshot ID [--archive URL]   (maintainers, internet) lock the image's Ubuntu
                                                 packages to what the Ubuntu snapshot ID serves
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from gpucluster import project
from gpucluster.aws import checkip
from gpucluster.contract.settings import GRAFANA_PORT, LOGIN_USER, SETTINGS_FILE, VERIFY_PLAN, ClusterSettings
from gpucluster.contract.verify import CLUSTER, Check, VerifyFormatError, plan_from_json, plan_json
from gpucluster.plan import NEW_ACCOUNT, Declared, run_program
from gpucluster.render import verify as planning
from gpucluster.spec import catalog, cost, eks
from gpucluster.spec.model import OPERATOR, SpecError, Stack, load_stack, resolve_stack_file, way_in_warning
from gpucluster.spec.ubuntu_lock import LOCK_FILE

EXIT_BAD_INPUT = 2
BOM_PATH = "image/bom.json"  # under render's --out


def _load(stack_arg: str) -> Stack:
    return load_stack(resolve_stack_file(stack_arg, project.STACKS_DIR))


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
        for row in table]


def cost_table(stack: Stack, estimate: cost.CostEstimate) -> list[str]:
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
    return lines


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
    stack = _load(args.stack)
    if not project.PROGRAM.exists():  # the head node's bundle carries the library, not the Pulumi program
        print(f"plan runs the Pulumi program ({project.PROGRAM.name} and components/), which is not here: run it from "
              "a checkout of the repository. Here: render, preflight, cost.", file=sys.stderr)
        return EXIT_BAD_INPUT
    from pulumi import RunError

    try:
        declared = run_program(stack, project.pulumi_program())
    except RunError as exc:  # what the program refuses in the stack's own terms, naming the key (as `pulumi up` would)
        print(exc, file=sys.stderr)
        return EXIT_BAD_INPUT
    estimate = cost.estimate(stack)
    images = image_inputs(stack)
    if args.json:
        doc = {
            "stack": stack.name,
            "region": stack.region,
            "images": images,
            "resources": [
                {"type": d.type, "name": d.name, "parent": d.parent_type, "inputs": d.inputs,
                 "retain_on_delete": d.retain_on_delete}
                for d in declared
            ],
            "cost": estimate.summary(),
            "people": people(stack),
        }
        json.dump(doc, sys.stdout, indent=1, sort_keys=True)
        print()
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
    print("\n".join(cost_table(stack, estimate)))
    return 0


def render(args: argparse.Namespace) -> int:
    """The exact user data EC2 gets, the files the head node writes, and the images' bill of materials."""
    from gpucluster.render import dashboards, prometheus, slurm, userdata
    from gpucluster.spec import bom

    stack = _load(args.stack)
    out = Path(args.out)
    if stack.spec.scheduler == "kubernetes":
        return _render_kubernetes(stack, out)
    files = dict(userdata.all_user_data(stack))
    files |= {f"slurm/{name}": text for name, text in slurm.all_files(stack).items()}
    files |= prometheus.files(stack) | dashboards.files(stack)  # byte for byte what the head's bundle carries
    files[BOM_PATH] = bom.render(stack)  # byte for byte what the image builds get
    for name, text in files.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)
    for name in sorted(files):
        size = len(files[name].encode())
        limit = f"  ({size} of {userdata.EC2_USER_DATA_LIMIT} bytes)" if name.endswith(".user-data") else ""
        print(f"{out / name}{limit}")
    return 0


def _render_kubernetes(stack: Stack, out: Path) -> int:
    """The Kubernetes objects of the stack (for reference) and its first job (for `kubectl apply -f`), as YAML."""
    import yaml

    from gpucluster.render import kube

    (out / "kubernetes").mkdir(parents=True, exist_ok=True)
    for name, manifests in kube.render_files(stack, project.EXAMPLES_DIR).items():
        path = out / "kubernetes" / name
        path.write_text(kube.render_header(name) + yaml.safe_dump_all(manifests, sort_keys=False))
        print(path)
    return 0


def preflight(args: argparse.Namespace) -> int:
    """Checks against the caller's account; exit 0 when nothing fails, 1 when a check fails."""
    import boto3

    from gpucluster.aws import preflight as checks

    stack = _load(args.stack)
    report = checks.run(stack, boto3.Session())
    print("\n".join(checks.render(stack, report)))
    print()
    print("\n".join(cost_table(stack, cost.estimate(stack, hourly_overrides=report.spot_prices))))
    return 1 if report.failed else 0


def spend(args: argparse.Namespace) -> int:
    """This month's spend, forecast and GPU-hours; Cost Explorer lives in us-east-1 whatever the stack's region."""
    import datetime as dt

    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    from gpucluster.aws import spend as money

    stack = _load(args.stack)
    session = boto3.Session()
    try:
        account = session.client("sts", region_name=stack.region).get_caller_identity()["Account"]
    except (BotoCoreError, ClientError):  # said by the Cost Explorer call below, with the same cause
        account = None
    result = money.spend(session.client("ce", region_name="us-east-1"), stack, dt.date.today(),
                         budgets=session.client("budgets", region_name="us-east-1"), account=account)
    print("\n".join(money.report(stack, result, money.slurm_gpu_hours())))
    return 0


def leftovers(args: argparse.Namespace) -> int:
    """Resources still tagged with the stack, with what each bills per month."""
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    from gpucluster.aws import leftovers as left

    stack = _load(args.stack)
    session = boto3.Session(region_name=stack.region)
    clients = {name: session.client(name) for name in ("resourcegroupstaggingapi", "ec2", "fsx", "s3")}
    try:
        found = left.find(clients, stack.name)
    except (BotoCoreError, ClientError) as exc:
        print(f"leftovers: AWS answered: {exc}", file=sys.stderr)
        return 1
    print("\n".join(left.report(stack.name, stack.region, found)))
    return 0


def dashboard(args: argparse.Namespace) -> int:
    """The command that forwards a local port to Grafana on the stack's running head node, and the URL to open; with
    --run, that command replaces this process (os.execvp), so the user's terminal holds the forward until Ctrl-C. The
    forward itself is the AWS CLI's and its Session Manager plugin's: the document fixes the head's end to Grafana."""
    import os
    import shlex

    import boto3

    from gpucluster.aws.head import HeadNotFound, running_head
    from gpucluster.contract.settings import session_document_name

    stack = _load(args.stack)
    try:
        head = running_head(boto3.Session(region_name=stack.region).client("ec2"), stack)
    except HeadNotFound as exc:
        print(f"dashboard: {exc}", file=sys.stderr)
        return 1
    command = ["aws", "ssm", "start-session", "--region", stack.region, "--target", head, "--document-name",
               session_document_name(stack.cluster_name, "dashboard"), "--parameters",
               f"localPortNumber={args.local_port}"]
    print(shlex.join(command))
    print(f"Grafana: http://localhost:{args.local_port}/ (while the command runs)")
    if args.run:
        sys.stdout.flush()  # execvp drops this process's buffers
        try:
            os.execvp(command[0], command)
        except FileNotFoundError:
            print("dashboard: the AWS CLI (aws) is not on PATH; it needs AWS's Session Manager plugin too",
                  file=sys.stderr)
            return 1
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
        return _bad_input(problems)
    stack = _load(args.stack) if args.stack else None
    if args.plan and stack is not None:
        try:
            planned = planning.plan(stack, _plan_options(args))
        except planning.PlanError as exc:
            return _bad_input(exc.problems)
        print(plan_json(planned) if args.json else "\n".join(planning.table(planned)))
        return 0
    here = ClusterSettings.load(SETTINGS_FILE) if Path(SETTINGS_FILE).exists() else None
    if stack is not None and (here is None or here.cluster != stack.cluster_name):
        import boto3

        from gpucluster.aws import verify_remote

        return verify_remote.run(stack, head_arguments(args), boto3.Session())
    if here is None:
        return _bad_input([f"STACK is needed off the head node (no {SETTINGS_FILE} here)"])
    if os.geteuid() != 0:
        return _bad_input(["a run submits the login user's jobs and DCGM's diagnostic as root: run it as root "
                           "(sudo gpucluster verify)"])
    from gpucluster.node import verify_run

    if args.last:
        return verify_run.last(args.json)
    try:
        checks = head_plan(args, stack or head_stack(here.cluster))
    except (planning.PlanError, VerifyFormatError) as exc:
        return _bad_input(getattr(exc, "problems", [str(exc)]))
    setup = verify_run.Setup(here, probe=verify_run.ProbeOptions(args.fsx_mib, args.fsx_type))
    return verify_run.run(checks, args.json, setup)


def connect(args: argparse.Namespace) -> int:
    import boto3

    from gpucluster.aws import connect as session_manager

    return session_manager.connect(_load(args.stack), args.admin, args.user, boto3.Session())


def ssh_config(args: argparse.Namespace) -> int:
    import boto3

    from gpucluster.aws import connect as session_manager

    stack_file = resolve_stack_file(args.stack, project.STACKS_DIR)
    return session_manager.ssh_config(load_stack(stack_file), stack_file, args.user, boto3.Session())


def ssh_proxy(args: argparse.Namespace) -> int:
    import boto3

    from gpucluster.aws import connect as session_manager

    return session_manager.ssh_proxy(_load(args.stack), args.user, boto3.Session())


def status(args: argparse.Namespace) -> int:
    """On the head node: read here (gpucluster.node.status_run). Elsewhere, with STACK: through Run Command."""
    here = ClusterSettings.load(SETTINGS_FILE) if Path(SETTINGS_FILE).exists() else None
    stack = _load(args.stack) if args.stack else None
    if stack is not None and (here is None or here.cluster != stack.cluster_name):
        import boto3

        from gpucluster.aws import status_remote

        return status_remote.run(stack, args.json, boto3.Session())
    if here is None:
        message = f"STACK is needed off the head node (no {SETTINGS_FILE} here)"
        print(json.dumps({"errors": [{"path": "", "message": message}]}) if args.json else f"status: {message}",
              file=sys.stdout if args.json else sys.stderr)
        return EXIT_BAD_INPUT
    from gpucluster.node import status_run

    return status_run.run(args.json, here)


def _bad_input(problems: list[str]) -> int:
    for problem in problems:
        print(f"verify: {problem}", file=sys.stderr)
    return EXIT_BAD_INPUT


def _plan_options(args: argparse.Namespace) -> planning.Options:
    return planning.Options(tuple(args.pool or ()), args.nodes, args.deep)


def head_arguments(args: argparse.Namespace) -> list[str]:
    """What `gpucluster verify` on the stack's head node is given: this call's options, without STACK."""
    return ([*(["--last"] if args.last else []), *(["--json"] if args.json else [])]
            + [a for pool in args.pool or () for a in ("--pool", pool)]
            + ([f"--nodes={args.nodes}"] if args.nodes is not None else []) + (["--deep"] if args.deep else []))


def head_stack(cluster: str) -> Stack:
    """The head node's own stack file, in the bundle (project.STACKS_DIR there)."""
    found = [stack for stack in map(load_stack, sorted(project.STACKS_DIR.glob("Pulumi.*.yaml")))
             if stack.cluster_name == cluster]
    if not found:
        raise VerifyFormatError(f"no stack file of cluster {cluster} in {project.STACKS_DIR}")
    return found[0]


def head_plan(args: argparse.Namespace, stack: Stack) -> list[Check]:
    """The run's checks: the bundle's plan (settings.VERIFY_PLAN, the default options) for the chosen pools and the
    cluster's checks; a plan computed anew from the stack file when --nodes or --deep change its figures."""
    options = _plan_options(args)
    if args.nodes is not None or args.deep:
        return planning.plan(stack, options)
    planning.plan(stack, options)  # the same problems as --plan for unknown pools
    bundled = plan_from_json(Path(VERIFY_PLAN).read_text())
    return [c for c in bundled if not args.pool or c.pool in args.pool or c.pool == CLUSTER]


def events(args: argparse.Namespace) -> int:
    """The head node's events log, newest last: what happened to nodes and jobs, and when."""
    from gpucluster.contract.settings import EVENTS_LOG

    path = Path(args.log or EVENTS_LOG)
    if not path.exists():
        print(f"no events yet ({path} does not exist; it is on the head node)", file=sys.stderr)
        return 1
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()][-args.last:]
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
        print(f"image-lock: {args.snapshot!r} is not a snapshot id (UTC YYYYMMDDTHHMMSSZ)", file=sys.stderr)
        return EXIT_BAD_INPUT
    archive = (args.archive or ubuntu_lock.archive_url(args.snapshot)).rstrip("/")
    indexes = []
    for path in ubuntu_lock.index_paths():
        with urllib.request.urlopen(f"{archive}/{path}", timeout=120) as answer:
            indexes.append(lzma.decompress(answer.read()).decode())
        print(f"read {archive}/{path}")
    try:
        versions = ubuntu_lock.newest(indexes, bom.UBUNTU_PACKAGES)
    except KeyError as exc:
        print(f"image-lock: {exc.args[0]}", file=sys.stderr)
        return 1
    lock = Path(args.lock)
    lock.write_text(ubuntu_lock.with_entry(ubuntu_lock.load(lock) if lock.exists() else {}, args.snapshot, versions))
    print(f"{lock}: {len(versions)} packages under {args.snapshot}")
    return 0


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="python -m gpucluster", description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)  # the docstring's table
    sub = top.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="show what a stack creates and costs, offline")
    p.add_argument("stack", nargs="?", default="dev",
                   help="a stack name under stacks/ or a path to a stack file (default: dev)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=plan)
    r = sub.add_parser("render", help="write the user data, Slurm files and image BOM of a stack")
    r.add_argument("stack", help="a stack name under stacks/ or a path to a stack file")
    r.add_argument("--out", required=True, help="directory to write into")
    r.set_defaults(func=render)
    f = sub.add_parser("preflight", help="check the AWS account (quotas, capacity, offers, prices) for a stack")
    f.add_argument("stack", help="a stack name under stacks/ or a path to a stack file")
    f.set_defaults(func=preflight)
    c = sub.add_parser("cost", help="this month's spend, forecast and GPU-hours of a stack (AWS credentials)")
    c.add_argument("stack", help="a stack name under stacks/ or a path to a stack file")
    c.set_defaults(func=spend)
    left = sub.add_parser("leftovers", help="what is still tagged with a stack, and its monthly cost (AWS credentials)")
    left.add_argument("stack", help="a stack name under stacks/ or a path to a stack file")
    left.set_defaults(func=leftovers)
    d = sub.add_parser("dashboard", help="Grafana on the head node through a Session Manager port forward "
                                         "(AWS credentials, the AWS CLI and its Session Manager plugin)")
    d.add_argument("stack", help="a stack name under stacks/ or a path to a stack file")
    d.add_argument("--run", action="store_true", help="run the forward here (until Ctrl-C) instead of printing it")
    d.add_argument("--local-port", type=_tcp_port, default=GRAFANA_PORT,
                   help=f"the port on this machine to open Grafana at (default {GRAFANA_PORT})")
    d.set_defaults(func=dashboard)
    ver = sub.add_parser("verify", help="prove a cluster through Slurm: devices, DCGM, EFA, NCCL, /fsx, monitoring "
                                        "(on its head node, or from here with STACK); --plan: the checks, offline")
    ver.add_argument("stack", nargs="?", help="a stack name under stacks/ or a path to a stack file (not needed on "
                                              "the head node)")
    ver.add_argument("--plan", action="store_true", help="print the checks and thresholds, run nothing")
    ver.add_argument("--last", action="store_true", help="print the latest run kept on the head node")
    ver.add_argument("--json", action="store_true", help='print {"checks": [{"pool", "check", "expect", ...}, ...]}')
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
    con.add_argument("stack", help="a stack name under stacks/ or a path to a stack file")
    who = con.add_mutually_exclusive_group()
    who.add_argument("--admin", action="store_true", help="the admins' shell (ssm-user, sudo)")
    who.add_argument("--user", metavar="NAME", help="the person to connect as (default: the one whose principal "
                                                    "you are signed in with)")
    con.set_defaults(func=connect)
    ssh = sub.add_parser("ssh-config", help="print a Host block for ~/.ssh/config: ssh, scp and rsync to the head "
                                            "node through Session Manager")
    ssh.add_argument("stack", help="a stack name under stacks/ or a path to a stack file")
    ssh.add_argument("--user", metavar="NAME", help="the person to log in as (default: yours, by your principal)")
    ssh.set_defaults(func=ssh_config)
    proxy = sub.add_parser("ssh-proxy", help="(ssh's ProxyCommand, written by ssh-config) push the key for 60 s, "
                                             "then stream to the head's port 22")
    proxy.add_argument("stack", help="a stack name under stacks/ or a path to a stack file")
    proxy.add_argument("--user", required=True, metavar="NAME", help="the OS user ssh logs in as")
    proxy.set_defaults(func=ssh_proxy)
    st = sub.add_parser("status", help="partitions open or closed and why, nodes per pool, jobs, spend against "
                                       "budget, GPU-hours against quota (on the head node, or from here with STACK)")
    st.add_argument("stack", nargs="?", help="a stack name under stacks/ or a path to a stack file (not needed on "
                                             "the head node)")
    st.add_argument("--json", action="store_true", help="print one JSON object")
    st.set_defaults(func=status)
    e = sub.add_parser("events", help="on the head node: recent spot warnings, drains, requeues and replacements")
    e.add_argument("--last", type=int, default=50, help="how many (default 50)")
    e.add_argument("--log", help=argparse.SUPPRESS)  # another events log (tests)
    e.set_defaults(func=events)
    lock = sub.add_parser("image-lock", help="(maintainers; internet, no AWS) lock the image's Ubuntu packages to the "
                                             "versions an Ubuntu snapshot serves")
    lock.add_argument("--snapshot", required=True, help="the snapshot's id: a UTC time, YYYYMMDDTHHMMSSZ")
    lock.add_argument("--archive", help="read the indexes here instead of https://snapshot.ubuntu.com/ubuntu/ID (an "
                                        "archive that served the same indexes at that time)")
    lock.add_argument("--lock", default=str(LOCK_FILE), help=argparse.SUPPRESS)  # another lock file (tests)
    lock.set_defaults(func=image_lock)
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return int(args.func(args))
    except SpecError as exc:
        print(exc.render(), file=sys.stderr)
        return EXIT_BAD_INPUT
