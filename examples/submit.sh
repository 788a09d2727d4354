#!/bin/bash
# Submit a batch script with every accelerator of each node it gets, as many as its partition's nodes have, read from
# Slurm: the same example runs on an 8-GPU p5, a 4-GPU g6.12xlarge or a 1-GPU g6.xlarge pool. From the directory that
# holds examples/ (on the cluster: /fsx, or your copy of it):
#   examples/submit.sh [SBATCH OPTIONS] FILE.sbatch [ARGS...]
#   examples/submit.sh -p g6 -N 4 examples/ddp.sbatch --steps 2000
# Without -p (or --partition=) the job goes to the cluster's default partition (sinfo marks it with *).
set -euo pipefail
options=()
partition=
while [ $# -gt 0 ] && [[ $1 != *.sbatch ]]; do
  case $1 in
    -p | --partition) partition=${2:?-p needs a partition}; options+=("$1" "$2"); shift 2; continue ;;
    -p*) partition=${1#-p} ;;
    --partition=*) partition=${1#--partition=} ;;
  esac
  options+=("$1")
  shift
done
file=${1:?usage: examples/submit.sh [SBATCH OPTIONS] FILE.sbatch [ARGS...]}
shift
if [ -z "$partition" ]; then
  partition=$(sinfo -h -o '%P' | sed -n 's/\*$//p')
fi
# The nodes' generic resources, one line per kind of node: gpu:h100:8, gpu:l4:4, neuron:16 (sinfo's %G). A partition
# whose fallback pool has fewer takes the smaller count, which every node of it has.
best=
for gres in $(sinfo -h -p "$partition" -o '%G' | tr ',' ' '); do
  gres=${gres%%(*}
  name=${gres%%:*} count=${gres##*:}
  case $name in gpu | neuron) ;; *) continue ;; esac
  if [ -z "$best" ] || [ "$count" -lt "${best##*:}" ]; then best=$name:$count; fi
done
if [ -z "$best" ]; then
  echo "submit.sh: partition '$partition' has no GPUs or Neuron devices (sinfo -p $partition -o %G)" >&2
  exit 2
fi
if [ "${best%%:*}" = gpu ]; then request=--gpus-per-node=${best##*:}; else request=--gres=$best; fi
exec sbatch -p "$partition" "$request" "${options[@]}" "$file" "$@"
