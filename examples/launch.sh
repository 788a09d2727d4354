#!/bin/bash
# Start a PyTorch script on every node of the job: one torchrun per node, one process per GPU.
# Used by the sbatch files here:  launch.sh SCRIPT [ARGS...]
set -euo pipefail
script=$1; shift
# Node names resolve nowhere in the VPC: rendezvous on the first node's address, as Slurm knows it.
first=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
first_addr=$(scontrol show node "$first" | sed -n 's/.*NodeAddr=\([^ ]*\).*/\1/p')
gpus=${SLURM_GPUS_ON_NODE:-${SLURM_GPUS_PER_NODE:-1}}
gpus=${gpus##*:}  # --gpus-per-node may carry a type (h100:8)
exec srun --kill-on-bad-exit=1 bash -c "exec torchrun --nnodes=$SLURM_NNODES --node-rank=\$SLURM_NODEID \
  --nproc-per-node=$gpus --master-addr=$first_addr --master-port=29500 $script $*"
