"""A minimal PyTorch DDP training job: the first thing to run on a new gpucluster.

Started by torchrun (see ddp.sbatch): one process per GPU on every node. On GPUs it uses NCCL (over EFA where the
nodes have it); without a GPU it falls back to gloo on the CPU, so the same script runs anywhere.
It fits a small regression on synthetic data, so that the result is known: every rank must end with the same
weights (DDP keeps the replicas in sync) and the loss must fall.

Checkpoints: every --checkpoint-every steps, and at the next step after SIGUSR1 (what the cluster sends a job whose
node got a spot interruption warning, before it requeues it), each rank writes model, optimizer, its RNG states and
the step into a new directory, which rank 0 renames into place once all have written: a half-written checkpoint is
never found. On start every rank resumes from the newest complete one. The default directory is per job
(checkpoints/<job name>-<job id> beside the submit directory): a requeued job keeps its id, so it resumes its own
run.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def default_checkpoint_dir() -> str:
    base = os.environ.get("SLURM_SUBMIT_DIR", os.getcwd())
    return f"{base}/checkpoints/{os.environ.get('SLURM_JOB_NAME', 'ddp')}-{os.environ.get('SLURM_JOB_ID', 'local')}"


def newest_checkpoint(directory: Path) -> Path | None:
    """The complete checkpoint of the highest step: `step-N` directories only (a `.tmp` one is half written)."""
    steps = [(int(m.group(1)), d) for d in directory.glob("step-*") if (m := re.fullmatch(r"step-(\d+)", d.name))]
    return max(steps)[1] if steps else None


def save(directory: Path, step: int, rank: int, state: dict) -> None:
    """Every rank writes its file into step-N.tmp; once all have, rank 0 renames it to step-N (atomic)."""
    tmp, final = directory / f"step-{step}.tmp", directory / f"step-{step}"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed while writing
        tmp.mkdir(parents=True)
    dist.barrier()
    torch.save(state, tmp / f"rank-{rank}.pt")
    dist.barrier()
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)  # the same step again (signalled right after a resume)
        os.replace(tmp, final)
        complete = sorted((int(d.name.split("-")[1]), d) for d in directory.glob("step-*")
                          if re.fullmatch(r"step-\d+", d.name))
        for _, old in complete[:-2]:  # the newest two are enough to resume from
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


def nccl_network_plugin() -> str:
    """Where this process's NCCL finds its network plugin (on the cluster's GPU nodes EFA's aws-ofi-nccl, which the
    node's settings put on LD_LIBRARY_PATH and name in NCCL_NET_PLUGIN): a rank without it would fall back to TCP
    sockets, unseen but for this line. NCCL opens libnccl-net-<NCCL_NET_PLUGIN>.so, or libnccl-net.so unnamed."""
    name = os.environ.get("NCCL_NET_PLUGIN", "")
    library = f"libnccl-net-{name}.so" if name else "libnccl-net.so"
    path = os.environ.get("LD_LIBRARY_PATH", "")
    found = next((d for d in path.split(":") if d and os.path.exists(os.path.join(d, library))), "")
    return f"nccl-net {library} {'in ' + found if found else 'not found'} LD_LIBRARY_PATH={path}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--checkpoint-dir", default=os.environ.get("CHECKPOINT_DIR") or default_checkpoint_dir())
    parser.add_argument("--checkpoint-every", type=int, default=50)
    args = parser.parse_args()

    # Set before the process group exists: the cluster may signal while a rank is still starting.
    requested = {"checkpoint": False}
    signal.signal(signal.SIGUSR1, lambda *_: requested.update(checkpoint=True))

    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)

    torch.manual_seed(0)  # same initial weights everywhere; DDP also broadcasts rank 0's
    true_w = torch.arange(1.0, 17.0).unsqueeze(1)
    model = DistributedDataParallel(nn.Linear(16, 1).to(device), device_ids=[local_rank] if use_cuda else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(1000 + rank)  # each rank sees its own shard of the data

    directory = Path(args.checkpoint_dir)
    start = 0
    found = newest_checkpoint(directory)
    if found is not None:
        state = torch.load(found / f"rank-{rank}.pt", map_location=device, weights_only=False)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
        data.set_state(state["data_rng"])
        start = state["step"]
        if rank == 0:
            print(f"resumed from {found} at step {start}", flush=True)

    def checkpoint(step: int, why: str) -> None:
        save(directory, step, rank, {"step": step, "model": model.module.state_dict(),
                                     "optimizer": optimizer.state_dict(), "torch_rng": torch.get_rng_state(),
                                     "data_rng": data.get_state()})
        if rank == 0:
            print(f"checkpoint at step {step} ({why}) in {directory}", flush=True)

    first = last = 0.0
    for step in range(start, args.steps):
        # Any rank signalled: all checkpoint together (a collective), then train on until the cluster requeues us.
        flag = torch.tensor([1.0 if requested["checkpoint"] else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            requested["checkpoint"] = False
            checkpoint(step, "signalled")
        elif step > start and step % args.checkpoint_every == 0:
            checkpoint(step, "interval")
        x = torch.randn(args.batch, 16, generator=data).to(device)
        y = x @ true_w.to(device)
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()  # gradients are averaged across all ranks here
        optimizer.step()
        if step == start:
            first = loss.item()
        last = loss.item()
        if rank == 0 and step % 50 == 0:
            print(f"step {step} loss {last:.4f}", flush=True)

    weights = torch.cat([p.detach().flatten().cpu() for p in model.parameters()])
    digest = hashlib.sha256(repr(weights.double().tolist()).encode()).hexdigest()[:16]
    host = os.environ.get("SLURMD_NODENAME", os.uname().nodename)
    print(f"rank {rank}/{world} on {host} backend {dist.get_backend()} loss {first:.4f} -> {last:.4f} weights {digest} "
          f"{nccl_network_plugin()}", flush=True)
    # Every rank done with the group before any tears it down: gloo aborts a process whose peer closed first
    # ("terminate called without an active exception", seen on the rehearsal once in a few runs).
    dist.barrier()
    dist.destroy_process_group()
    # gloo's threads can still abort the process in the interpreter's own shutdown (the same message, seen after the
    # barrier too): the work is done and said, so leave without running those destructors.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
