"""Prometheus' memory and disk for 100 GPU nodes at our scrape interval, from measured series counts.

    python benchmarks/prometheus_scale.py

Series per node, measured: a real node_exporter (Debian's, with our flags) scraped once, its per-CPU and
per-interface series scaled from this machine's CPUs and interfaces to a p5's (192 vCPUs, 33 interfaces), plus
dcgm-exporter's series
(one per counter we ship per GPU, as dcgm-exporter exports them: 8 GPUs on a p5) and our textfile figures for a p5
(32 EFA devices, one Lustre file system). Memory, measured: a real Prometheus scraping 100 such nodes (a stand-in
server answering for each with those series) until its head holds them all; its resident memory with and without the
load. Disk: samples per day at SCRAPE_SECONDS times 1.5 bytes per sample (Prometheus' documented 1-2 bytes per
compressed sample), against the retention the head keeps. No GPU and no EFA here: the dcgm and EFA counts are the
exporters' layout, not a scrape of them.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TypeVar

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from gpucluster.contract.settings import NODE_EXPORTER_FLAGS  # noqa: E402
from gpucluster.render import prometheus  # noqa: E402

NODES = 100
GPUS_PER_NODE = 8
EFA_DEVICES = 32
P5_CPUS = 192
P5_NETWORK_INTERFACES = 33  # 32 EFA-capable interfaces and the primary ENA one
BYTES_PER_SAMPLE = 1.5
TARGET_MEMORY_GIB = 4.0  # the head (m7i.2xlarge, 32 GiB) runs slurmctld, slurmdbd and MariaDB too
STARTUP_SECONDS = 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


T = TypeVar("T")

def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as answer:
        return answer.read().decode()


def wait(what: str, ready: Callable[[], T], seconds: float) -> T:
    """The first truthy answer of `ready` within `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            value = ready()
            if value:
                return value
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"timed out waiting for {what}")


def node_exporter_text(work: Path) -> str:
    port = free_port()
    proc = subprocess.Popen([shutil.which("prometheus-node-exporter") or "prometheus-node-exporter",
                             f"--web.listen-address=127.0.0.1:{port}", f"--collector.textfile.directory={work}",
                             *NODE_EXPORTER_FLAGS],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        return wait("node_exporter", lambda: get(f"http://127.0.0.1:{port}/metrics"), 30)
    finally:
        proc.kill()


def scaled_to_p5(node_text: str) -> list[str]:
    """node_exporter's samples as a p5 would export them: the per-CPU and per-interface ones repeated."""
    samples = [line for line in node_text.splitlines() if line and not line.startswith("#")]
    cpus = sorted({line.split('cpu="')[1].split('"')[0] for line in samples if 'cpu="' in line})
    devices = sorted({line.split('device="')[1].split('"')[0] for line in samples
                      if line.startswith("node_network_") and 'device="' in line})
    scaled = [line for line in samples
              if 'cpu="' not in line and not (line.startswith("node_network_") and 'device="' in line)]
    per_cpu = [line for line in samples if f'cpu="{cpus[0]}"' in line] if cpus else []
    per_device = [line for line in samples if line.startswith("node_network_") and f'device="{devices[0]}"' in line] \
        if devices else []
    scaled += [line.replace(f'cpu="{cpus[0]}"', f'cpu="{c}"') for c in range(P5_CPUS) for line in per_cpu]
    scaled += [line.replace(f'device="{devices[0]}"', f'device="eth{d}"') for d in range(P5_NETWORK_INTERFACES)
               for line in per_device]
    return scaled


def our_series(node: int) -> list[str]:
    gpu = [f'{name}{{gpu="{g}",UUID="GPU-{node}-{g}",device="nvidia{g}",modelName="NVIDIA H100 80GB HBM3",'
           f'Hostname="p5-{node}"}} 1' for name, _, _ in prometheus.DCGM_COUNTERS for g in range(GPUS_PER_NODE)]
    efa = [f'gpucluster_efa_{d}_bytes_total{{device="rdmap{i}",port="1"}} 1' for d in ("rx", "tx")
           for i in range(EFA_DEVICES)]
    lustre = ['gpucluster_lustre_read_bytes_total{fs="fsx"} 1', 'gpucluster_lustre_write_bytes_total{fs="fsx"} 1']
    return gpu + efa + lustre


def serve(samples: list[str]) -> tuple[ThreadingHTTPServer, int]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            node = int(self.path.rsplit("=", 1)[1])
            body = ("\n".join(samples + our_series(node)) + "\n").encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, server.server_address[1]


def resident_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    return 0


def prometheus_under_load(work: Path, stand_in_port: int, targets: int) -> tuple[int, int]:
    """(head series, resident bytes) of a real Prometheus scraping `targets` nodes."""
    port = free_port()
    (work / "targets.json").write_text(json.dumps([
        {"targets": [f"127.0.0.1:{stand_in_port}"], "labels": {"__param_node": str(n), "node": f"p5-{n}", "pool": "p5"}}
        for n in range(targets)]))
    (work / "prometheus.yml").write_text(
        f"global: {{scrape_interval: {prometheus.SCRAPE_SECONDS}s}}\n"
        f"scrape_configs:\n- job_name: node\n  file_sd_configs: [{{files: ['{work}/targets.json']}}]\n")
    data = work / f"data-{targets}"
    proc = subprocess.Popen([shutil.which("prometheus") or "prometheus", f"--config.file={work}/prometheus.yml",
                             f"--storage.tsdb.path={data}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def up() -> int:
            result = json.loads(get(f"http://127.0.0.1:{port}/api/v1/query?query=count(up%3D%3D1)"))["data"]["result"]
            return int(result[0]["value"][1]) == targets if result else 0
        wait("every target scraped", up, prometheus.SCRAPE_SECONDS * 3 + STARTUP_SECONDS)
        time.sleep(prometheus.SCRAPE_SECONDS)  # a second round: the head settles
        status = json.loads(get(f"http://127.0.0.1:{port}/api/v1/status/tsdb"))["data"]
        return int(status["headStats"]["numSeries"]), resident_bytes(proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        node_samples = scaled_to_p5(node_exporter_text(work))
        node_series = len(node_samples)
        per_node = node_series + len(our_series(0))
        server, port = serve(node_samples)
        try:
            _, idle = prometheus_under_load(work, port, 1)
            series, loaded = prometheus_under_load(work, port, NODES)
        finally:
            server.shutdown()
    per_day = series * 86400 / prometheus.SCRAPE_SECONDS
    disk_day = per_day * BYTES_PER_SAMPLE
    retention = prometheus.retention_bytes()
    dcgm_series = len(prometheus.DCGM_COUNTERS) * GPUS_PER_NODE
    print(f"series per p5 node: {per_node} (node_exporter {node_series}, dcgm-exporter {dcgm_series}, "
          f"EFA and Lustre {len(our_series(0)) - dcgm_series})")
    print(f"{NODES} nodes: {series} head series, Prometheus resident {loaded / 2**20:.0f} MiB "
          f"({(loaded - idle) / 2**10 / max(series, 1):.1f} KiB per series over an idle {idle / 2**20:.0f} MiB; "
          f"target under {TARGET_MEMORY_GIB:g} GiB)")
    print(f"disk: {per_day / 1e6:.1f} M samples a day at {prometheus.SCRAPE_SECONDS} s, "
          f"about {disk_day / 2**30:.2f} GiB a day; "
          f"the head's {retention >> 30} GiB hold {retention / disk_day:.0f} days "
          f"(time retention {prometheus.RETENTION_DAYS} days)")
    return 0 if loaded < TARGET_MEMORY_GIB * 2**30 else 1


if __name__ == "__main__":
    sys.exit(main())
