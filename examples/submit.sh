#!/bin/bash
# Submit a batch script with every accelerator of each node it gets, as many as its partition's nodes have, read from
# Slurm: the same example runs on an 8-GPU p5, a 4-GPU g6.12xlarge or a 1-GPU g6.xlarge pool. From the directory that
# holds examples/ (on the cluster: /fsx, or your copy of it):
#   examples/submit.sh [SBATCH OPTIONS] [--] SCRIPT [ARGS...]
#   examples/submit.sh -p g6 -N 4 examples/ddp.sbatch --steps 2000
#   examples/submit.sh -N 2 train.sh                  (any batch script: a file whose first line starts with #!)
# The script is the first argument that is a file beginning with #!, which sbatch requires of a batch script; what
# comes before it goes to sbatch, what follows to the script. `--` marks it outright: the argument after it is the
# script. Without -p (or --partition=) the job goes to the cluster's default partition (sinfo marks it with *).
set -euo pipefail
usage="usage: examples/submit.sh [SBATCH OPTIONS] [--] SCRIPT [ARGS...]"
options=()
partition=
script=
while [ $# -gt 0 ]; do
  case $1 in
    --) script=${2:-}; shift $(($# < 2 ? 1 : 2)); break ;;
    -p | --partition) partition=${2:?-p needs a partition}; options+=("$1" "$2"); shift 2; continue ;;
    -p*) partition=${1#-p} ;;
    --partition=*) partition=${1#--partition=} ;;
    -*) ;;
    *) # an option's value (-J name, -o out.log) unless it is a batch script
      if [ -f "$1" ] && [ "$(head -c 2 -- "$1")" = '#!' ]; then script=$1; shift; break; fi ;;
  esac
  options+=("$1")
  shift
done
if [ -z "$script" ]; then
  echo "$usage" >&2
  echo "submit.sh: no batch script among the arguments: a file whose first line starts with #! (put -- before it" \
    "to name it outright)" >&2
  exit 2
fi
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
exec sbatch -p "$partition" "$request" "${options[@]}" "$script" "$@"
