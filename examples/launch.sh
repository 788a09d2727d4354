#!/bin/bash
# Start a PyTorch script on every node of the job: one torchrun per node, one process per GPU.
# Used by the sbatch files here:  launch.sh SCRIPT [ARGS...]
set -euo pipefail
script=$1; shift
# Rendezvous on this host, the job's first node (where the batch script runs), by name: every node of the job
# resolves it (the cluster's prolog). `scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1` names it too.
first=$(hostname)
# A port of the job's own: two jobs sharing a node (or following each other onto it) never meet.
port=$((29500 + SLURM_JOB_ID % 1000))
gpus=${SLURM_GPUS_ON_NODE:-${SLURM_GPUS_PER_NODE:-1}}
gpus=${gpus##*:}  # --gpus-per-node may carry a type (h100:8)
# SIGUSR1 (the cluster's "checkpoint now", before a spot reclaim) would end torchrun, whose default it is: torchrun
# ignores it, and the workers it starts set their own handler (ddp_train.py). srun passes it on to the tasks.
exec srun --kill-on-bad-exit=1 bash -c "trap '' USR1; exec torchrun --nnodes=$SLURM_NNODES \
  --node-rank=\$SLURM_NODEID --nproc-per-node=$gpus --master-addr=$first --master-port=$port $script $*"
