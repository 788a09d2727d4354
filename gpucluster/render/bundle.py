"""The bundle the head node and compute nodes fetch from S3 at boot: under lib/ the gpucluster library, whose
gpucluster/node holds the node programs (the bootstrap among them) and which serves the head node's command line with
the stack's file beside it; Slurm files, monitoring configuration, examples. A compute node unpacks only the part of
lib/ its programs import (settings.NODE_LIBRARY).

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
from gpucluster.contract.verify import plan_json
from gpucluster.render import dashboards, monitoring, prometheus, slurm, verify
from gpucluster.spec import bom
from gpucluster.spec.model import Stack, stack_file

EXAMPLES = ("submit.sh", "launch.sh", "ddp_train.py", "ddp.sbatch", "all_reduce.py", "all_reduce.sbatch",
            "ddp_container.sbatch")


LIB = Path(settings.LIB_DIR).relative_to(settings.BUNDLE_DIR)  # the library's place in the bundle
STACKS_IN_LIB = f"{LIB}/stacks"  # $GPUCLUSTER_STACKS on the head node (node/bootstrap.py command_line)


def contents(stack: Stack, examples_dir: Path,
             layout: slurm.SlurmLayout = slurm.SlurmLayout()) -> dict[str, tuple[bytes, int]]:
    """Path in the bundle -> (bytes, mode). `examples_dir`: the first-job files copied to the shared file system;
    `layout`: the Slurm paths and ports (the boot rehearsal's differ)."""
    files = {f"slurm/{name}": (text.encode(), 0o644) for name, text in slurm.all_files(stack, layout).items()}
    files |= {f"examples/{name}": ((examples_dir / name).read_bytes(), 0o755 if name.endswith(".sh") else 0o644)
              for name in EXAMPLES}
    # The library: the node programs (executable) and what they import, and the command line for the admins on the
    # head node (`gpucluster cost|render|preflight`) with this stack's file beside it, as gpucluster.project expects.
    programs = {Path(program).relative_to(settings.LIB_DIR) for program in settings.NODE_PROGRAMS}
    # Its data too: the spec reads the Ubuntu lock (ubuntu-lock.json) to check a stack file. Not the examples an
    # installed package carries (pyproject.toml): they are the bundle's examples/, the same bytes from a checkout.
    modules = {source.relative_to(node.LIBRARY_DIR) for pattern in ("*.py", "*.json")
               for source in node.LIBRARY_DIR.joinpath("gpucluster").rglob(pattern)
               if "__pycache__" not in source.parts and source.parent != node.LIBRARY_DIR / "gpucluster" / "examples"}
    files |= {f"{LIB}/{name.as_posix()}": ((node.LIBRARY_DIR / name).read_bytes(), 0o755 if name in programs else 0o644)
              for name in sorted(modules | programs)}
    files[f"{STACKS_IN_LIB}/Pulumi.{stack.name}.yaml"] = (stack_file(stack).encode(), 0o644)
    # The node images' bill of materials, byte for byte what a bake gets: a node booted on a stock AMI builds from it.
    files[str(Path(settings.BUNDLE_BOM).relative_to(settings.BUNDLE_DIR))] = (bom.render(stack).encode(), 0o644)
    # What `gpucluster verify` on the head expects at its default options: it judges without the catalog.
    files[str(Path(settings.VERIFY_PLAN).relative_to(settings.BUNDLE_DIR))] = (
        plan_json(verify.plan(stack)).encode(), 0o644)
    files["accounting.sql"] = (slurm.ACCOUNTING_DB_SQL.encode(), 0o644)
    files["accounting.sh"] = (slurm.accounting_script(stack).encode(), 0o755)
    files[str(Path(settings.PEOPLE_LEAVERS_SCRIPT).relative_to(settings.BUNDLE_DIR))] = (
        slurm.leavers_script(stack).encode(), 0o755)
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
