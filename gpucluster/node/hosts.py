#!/usr/bin/python3
"""Node names that resolve (settings.HOSTS_PROGRAM): every node's Slurm name in /etc/hosts on the head and on the
nodes of each job.

Slurm knows each node's address once the node registers (it takes it from the registration). Two modes:
- `hosts.py publish` (the head's gpucluster-hosts.service, every PUBLISH_SECONDS): the names and addresses
  of the registered nodes into a hosts file on the shared file system, written by rename, and into the head's own
  /etc/hosts; and Prometheus' target lists (settings.SCRAPE_JOBS), each node labelled with its name, pool, team and
  cluster. A node powered down leaves them all, so its name stops resolving and Prometheus stops scraping it.
- no argument (Slurm's Prolog on the compute nodes, as root, with PrologFlags=Alloc: on every node of a job before the
  job starts): the shared file into this node's /etc/hosts, waiting until every node of the job is in it, so a job
  script's `$(hostname)` rendezvous or `scontrol show hostnames` idiom resolves from its first line.
Containers that pyxis starts see the host's /etc/hosts (enroot mounts it). One writer, readers only at job starts:
it scales with the cluster, and a replaced head rebuilds the file from Slurm. Standard library only.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the library this program is part of (the bundle's lib/)
from gpucluster.contract import slurm_json
from gpucluster.contract.hostlist import compress_hostlist, expand_hostlist
from gpucluster.contract.settings import (
    HEAD_HOSTNAME,
    NODE_HOSTS_FILE,
    SCRAPE_JOBS,
    SCRAPE_TARGETS_DIR,
    ClusterSettings,
)
from gpucluster.node.safe_paths import own_directory

# The block's markers in /etc/hosts keep the program's former name: the files already written know only it.
BEGIN, END = "# gpucluster nodes: begin (written by gpucluster_hosts.py)", "# gpucluster nodes: end"
PUBLISH_SECONDS = 2.0
PROLOG_WAIT_SECONDS = 60  # a job starts anyway after this (its own tools may not need names), with a log line
SCONTROL_TIMEOUT = 30
IPV4 = re.compile(r"\d{1,3}(\.\d{1,3}){3}")
log = logging.getLogger("gpucluster-hosts")


def registered(scontrol_json: str) -> dict[str, str]:
    """Node -> address for the nodes that are up with an address of their own (not powered down or going down)."""
    return {n.name: n.address for n in slurm_json.nodes(scontrol_json)
            if IPV4.fullmatch(n.address) and not n.state & {"POWERED_DOWN", "POWERING_DOWN"}}


def render(entries: dict[str, str]) -> str:
    return "".join(f"{address} {name}\n" for name, address in sorted(entries.items()))


def parse(text: str) -> dict[str, str]:
    return {parts[1]: parts[0] for line in text.splitlines() if len(parts := line.split()) == 2}


def with_block(hosts_text: str, entries: dict[str, str]) -> str:
    """/etc/hosts with its gpucluster block replaced (the rest, the head's line included, kept as it is)."""
    lines, inside = [], False
    for line in hosts_text.splitlines():
        if line == BEGIN:
            inside = True
        elif line == END:
            inside = False
        elif not inside:
            lines.append(line)
    return "\n".join(lines + [BEGIN] + render(entries).splitlines() + [END]) + "\n"


def write_atomically(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(text)
    os.chmod(temporary, 0o644)
    os.replace(temporary, path)


def update_hosts(entries: dict[str, str], hosts: Path = Path("/etc/hosts")) -> bool:
    """/etc/hosts is replaced by rename where it is a file of its own; returns whether it changed."""
    current = hosts.read_text()
    new = with_block(current, entries)
    if new == current:
        return False
    write_atomically(hosts, new)
    return True


def scontrol_nodes() -> str:
    return subprocess.run(["scontrol", *slurm_json.SHOW_NODES], check=True, capture_output=True, text=True,
                          timeout=SCONTROL_TIMEOUT).stdout


def scrape_targets(entries: dict[str, str], settings: ClusterSettings) -> dict[str, str]:
    """file_sd list name -> its JSON: every registered node (and the head) for node_exporter, the nodes of NVIDIA or
    Neuron pools for their accelerator's exporter."""
    nodes = {HEAD_HOSTNAME: settings.head_address} if settings.head_address else {}
    nodes |= entries
    lists = {}
    for job in SCRAPE_JOBS:
        targets = []
        for name, address in sorted(nodes.items()):
            pool = settings.pool_of(name)
            if job.accelerator and not (pool and settings.pools[pool].accelerator == job.accelerator):
                continue
            labels = ({"node": name, "cluster": settings.cluster, "team": settings.team}
                      | ({"pool": pool} if pool else {}))
            targets.append({"targets": [f"{address}:{settings.exporter_port(job, name)}"], "labels": labels})
        lists[job.targets_file] = json.dumps(targets, indent=1, sort_keys=True) + "\n"
    return lists


def publish_once(shared: Path, hosts: Path, nodes: str, settings: ClusterSettings,
                 targets: Path = Path(SCRAPE_TARGETS_DIR)) -> dict[str, str]:
    entries = registered(nodes)
    own_directory(shared.parent)  # root's on world-writable /fsx: what a user made there first is set aside
    if not shared.exists() or shared.read_text() != render(entries):
        write_atomically(shared, render(entries))
    update_hosts(entries, hosts)
    targets.mkdir(parents=True, exist_ok=True)
    for name, text in scrape_targets(entries, settings).items():
        if not (targets / name).exists() or (targets / name).read_text() != text:
            write_atomically(targets / name, text)
    return entries


def publish(shared: Path = Path(NODE_HOSTS_FILE), hosts: Path = Path("/etc/hosts")) -> None:
    known: dict[str, str] = {}
    while True:
        try:  # the settings anew each round: a later `pulumi up` may add pools
            entries = publish_once(shared, hosts, scontrol_nodes(), ClusterSettings.load())
            if entries != known:
                log.info("%d node name(s) published: %s", len(entries), compress_hostlist(entries) or "none")
                known = entries
        except (OSError, subprocess.SubprocessError, ValueError) as exc:  # slurmctld restarting, /fsx slow: next round
            log.warning("publishing node names failed: %s", exc)
        time.sleep(PUBLISH_SECONDS)


def prolog(job_nodes: list[str], shared: Path = Path(NODE_HOSTS_FILE), hosts: Path = Path("/etc/hosts"),
           wait: float = PROLOG_WAIT_SECONDS, sleep: Callable[[float], None] = time.sleep) -> list[str]:
    """Returns the job's nodes still missing when it gave up waiting (none, normally)."""
    deadline = time.monotonic() + wait
    while True:
        entries = parse(shared.read_text()) if shared.exists() else {}
        update_hosts(entries, hosts)
        missing = [n for n in job_nodes if n not in entries]
        if not missing or time.monotonic() >= deadline:
            return missing
        sleep(0.5)


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(levelname)s %(message)s", stream=sys.stderr)
    if argv[1:] == ["publish"]:
        publish()
        return 0
    job = os.environ.get("SLURM_JOB_ID", "?")
    missing = prolog(expand_hostlist(os.environ.get("SLURM_JOB_NODELIST", "")))
    if missing:  # never fail a prolog for it: Slurm would drain the node
        log.warning("job %s starts with no address yet for %s", job, compress_hostlist(missing))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
