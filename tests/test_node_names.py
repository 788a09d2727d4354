"""Node names that resolve (gpucluster/node/hosts.py): what the head publishes, and what a job's prolog puts
into a node's /etc/hosts before the job starts."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from gpucluster.contract.settings import ClusterSettings
from gpucluster.node import hosts
from slurm_samples import document, node

NODES = document("nodes", [
    node("p5-od-1", "ALLOCATED+CLOUD", address="10.0.0.11"),
    node("p5-od-2", "IDLE+CLOUD+POWERING_UP", hostname="i-0abc"),  # not registered yet
    node("p5-od-3", "IDLE+CLOUD+POWERING_DOWN", address="10.0.0.13"),  # on its way out
    node("p5-od-4", "IDLE+CLOUD+POWERED_DOWN"),
    node("p5-od-5", "MIXED+CLOUD", address="10.0.0.15"),
])


def test_only_registered_nodes_that_are_up_are_published() -> None:
    assert hosts.registered(NODES) == {"p5-od-1": "10.0.0.11", "p5-od-5": "10.0.0.15"}


def test_the_hosts_block_is_replaced_and_the_rest_kept(tmp_path: Path) -> None:
    etc_hosts = tmp_path / "hosts"
    etc_hosts.write_text("127.0.0.1 localhost\n10.0.0.2 head\n")
    assert hosts.update_hosts({"p5-od-1": "10.0.0.11"}, etc_hosts)
    assert hosts.update_hosts({"p5-od-5": "10.0.0.15"}, etc_hosts)  # p5-od-1 powered down: gone
    assert etc_hosts.read_text() == (f"127.0.0.1 localhost\n10.0.0.2 head\n{hosts.BEGIN}\n10.0.0.15 p5-od-5\n"
                                     f"{hosts.END}\n")
    assert not hosts.update_hosts({"p5-od-5": "10.0.0.15"}, etc_hosts)  # unchanged: not rewritten


def test_publish_writes_the_shared_file_and_the_heads_hosts(tmp_path: Path) -> None:
    shared, etc_hosts = tmp_path / "fsx" / ".gpucluster" / "hosts", tmp_path / "hosts"
    etc_hosts.write_text("127.0.0.1 localhost\n")
    (tmp_path / "fsx").mkdir(mode=0o1777)
    settings = ClusterSettings(cluster="gpucluster-t", region="us-east-1", pools={})
    hosts.publish_once(shared, etc_hosts, NODES, settings, tmp_path / "targets")
    assert hosts.parse(shared.read_text()) == {"p5-od-1": "10.0.0.11", "p5-od-5": "10.0.0.15"}
    assert "10.0.0.11 p5-od-1" in etc_hosts.read_text()


def test_the_prolog_waits_until_every_node_of_the_job_resolves(tmp_path: Path) -> None:
    shared, etc_hosts = tmp_path / "shared-hosts", tmp_path / "hosts"
    etc_hosts.write_text("127.0.0.1 localhost\n")
    shared.write_text("10.0.0.11 p5-od-1\n")
    # The head publishes p5-od-2 a moment later, when it registers.
    threading.Timer(0.3, lambda: shared.write_text("10.0.0.11 p5-od-1\n10.0.0.12 p5-od-2\n")).start()
    started = time.monotonic()
    assert hosts.prolog(["p5-od-1", "p5-od-2"], shared, etc_hosts, wait=10, sleep=lambda s: time.sleep(0.05)) == []
    assert time.monotonic() - started < 5
    assert "10.0.0.12 p5-od-2" in etc_hosts.read_text()


def test_the_prolog_gives_up_after_its_wait_and_never_fails_the_job(tmp_path: Path) -> None:
    shared, etc_hosts = tmp_path / "shared-hosts", tmp_path / "hosts"
    etc_hosts.write_text("127.0.0.1 localhost\n")
    assert hosts.prolog(["p5-od-9"], shared, etc_hosts, wait=0.2, sleep=lambda s: time.sleep(0.05)) == ["p5-od-9"]
