"""The bundle the head node and compute nodes fetch from S3 at boot: Slurm files, node programs, bootstrap, examples,
and the gpucluster library with the stack's file for the head node's command line.

Deterministic bytes (sorted entries, fixed times and owners), so that its S3 key, named after its digest, changes only
when its content does.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import tarfile
from pathlib import Path

from gpucluster import node
from gpucluster.contract import settings
from gpucluster.render import dashboards, monitoring, prometheus, slurm
from gpucluster.spec.model import Stack, stack_file

PROGRAMS = ("bootstrap.py", "build_image.sh", "gpucluster_node.py", "gpucluster_budget.py",
            "gpucluster_neuron_metrics.py", "task_prolog.sh", "gpucluster_hosts.py", "gpucluster_health.py",
            "gpucluster_metrics.py")
# Who submits jobs on the head node: the image's login user (Ubuntu). Add others with `sacctmgr add user`.
CLUSTER_USERS = (settings.LOGIN_USER,)
EXAMPLES = ("launch.sh", "ddp_train.py", "ddp.sbatch", "all_reduce.py", "all_reduce.sbatch", "ddp_container.sbatch")


LIBRARY = Path(__file__).resolve().parent.parent  # the gpucluster package, shipped whole to lib/gpucluster
STACKS_IN_LIB = "lib/stacks"  # gpucluster.project.STACKS_DIR on the head node


def contents(stack: Stack, examples_dir: Path,
             layout: slurm.SlurmLayout = slurm.SlurmLayout()) -> dict[str, tuple[bytes, int]]:
    """Path in the bundle -> (bytes, mode). `examples_dir`: the first-job files copied to the shared file system;
    `layout`: the Slurm paths and ports (the boot rehearsal's differ)."""
    files = {f"slurm/{name}": (text.encode(), 0o644) for name, text in slurm.all_files(stack, layout).items()}
    files |= {name: (node.source(name), 0o755) for name in PROGRAMS}
    files |= {f"examples/{name}": ((examples_dir / name).read_bytes(), 0o755 if name.endswith(".sh") else 0o644)
              for name in EXAMPLES}
    # The library: the settings contract the node programs import, and the command line for the admins on the head
    # node (`gpucluster cost|render|preflight`) with this stack's file beside it, as gpucluster.project expects.
    files |= {f"lib/gpucluster/{source.relative_to(LIBRARY).as_posix()}": (source.read_bytes(), 0o644)
              for source in sorted(LIBRARY.rglob("*.py")) if "__pycache__" not in source.parts}
    files[f"{STACKS_IN_LIB}/Pulumi.{stack.name}.yaml"] = (stack_file(stack).encode(), 0o644)
    files["accounting.sql"] = (slurm.ACCOUNTING_DB_SQL.encode(), 0o644)
    files["accounting.sh"] = (slurm.accounting_script(stack, CLUSTER_USERS).encode(), 0o755)
    files |= {name: (text.encode(), 0o644)
              for name, text in (monitoring.node_config(stack, pool) for pool in monitoring.watched_pools(stack))}
    files |= {name: (text.encode(), 0o644)
              for name, text in (prometheus.files(stack) | dashboards.files(stack)).items()}
    return files


def build(stack: Stack, examples_dir: Path, layout: slurm.SlurmLayout = slurm.SlurmLayout()) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, (data, mode) in sorted(contents(stack, examples_dir, layout).items()):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), mode, 0
            tar.addfile(info, io.BytesIO(data))
    return gzip.compress(raw.getvalue(), mtime=0)


def key(data: bytes) -> str:
    return f"gpucluster/bundle-{hashlib.sha256(data).hexdigest()[:16]}.tar.gz"
