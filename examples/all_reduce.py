"""all_reduce bus bandwidth, the way nccl-tests reports it (busbw = algbw * 2(n-1)/n), and a correctness check.

Started by torchrun (see all_reduce.sbatch). NCCL on GPUs, gloo on the CPU.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-bytes", type=int, default=None,
                        help="largest message (default 16 GiB on GPU, 64 MiB on CPU)")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    sync = torch.cuda.synchronize if use_cuda else (lambda: None)

    # Correctness first: every rank contributes rank+1, so every element must end as world*(world+1)/2.
    check = torch.full((1024,), float(rank + 1), device=device)
    dist.all_reduce(check)
    expected = world * (world + 1) / 2
    correct = bool(torch.all(check == expected))
    if rank == 0:
        print(f"all_reduce correct: {correct} (world {world}, backend {dist.get_backend()})", flush=True)
        print(f"{'bytes':>14} {'time us':>10} {'algbw GB/s':>11} {'busbw GB/s':>11}", flush=True)

    max_bytes = args.max_bytes or (16 << 30 if use_cuda else 64 << 20)
    size = 1 << 20
    while size <= max_bytes:
        tensor = torch.ones(size // 4, dtype=torch.float32, device=device)
        for _ in range(3):
            dist.all_reduce(tensor)
        sync()
        start = time.perf_counter()
        for _ in range(args.iters):
            dist.all_reduce(tensor)
        sync()
        seconds = (time.perf_counter() - start) / args.iters
        algbw = size / seconds / 1e9
        if rank == 0:
            print(f"{size:14d} {seconds * 1e6:10.1f} {algbw:11.2f} {algbw * 2 * (world - 1) / world:11.2f}", flush=True)
        size *= 4
    dist.destroy_process_group()
    if not correct:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
