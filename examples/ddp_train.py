"""A minimal PyTorch DDP training job: the first thing to run on a new gpucluster.

Started by torchrun (see ddp.sbatch): one process per GPU on every node. On GPUs it uses NCCL (over EFA where the
nodes have it); without a GPU it falls back to gloo on the CPU, so the same script runs anywhere.
It fits a small regression on synthetic data, so that the result is known: every rank must end with the same
weights (DDP keeps the replicas in sync) and the loss must fall.
"""

from __future__ import annotations

import argparse
import hashlib
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()

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

    first = last = 0.0
    for step in range(args.steps):
        x = torch.randn(args.batch, 16, generator=data).to(device)
        y = x @ true_w.to(device)
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()  # gradients are averaged across all ranks here
        optimizer.step()
        if step == 0:
            first = loss.item()
        last = loss.item()
        if rank == 0 and step % 50 == 0:
            print(f"step {step} loss {last:.4f}", flush=True)

    weights = torch.cat([p.detach().flatten().cpu() for p in model.parameters()])
    digest = hashlib.sha256(repr(weights.double().tolist()).encode()).hexdigest()[:16]
    host = os.environ.get("SLURMD_NODENAME", os.uname().nodename)
    print(f"rank {rank}/{world} on {host} backend {dist.get_backend()} loss {first:.4f} -> {last:.4f} weights {digest}",
          flush=True)
    # Every rank done with the group before any tears it down: gloo aborts a process whose peer closed first
    # ("terminate called without an active exception", seen on the rehearsal once in a few runs).
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
