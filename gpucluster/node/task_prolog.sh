#!/bin/sh
# Slurm's TaskProlog (slurm.conf), run by slurmstepd as the job's user before each task: every job step gets the
# cluster's NCCL/EFA environment, batch scripts that read no profile included. slurmstepd adds what this prints as
# `export NAME=value` to the task's environment. A variable the job already has (the user's own setting) is left as
# it is. The node's values are in the file the bootstrap wrote for its pool.
env_file=/etc/gpucluster/nccl.env
[ -r "$env_file" ] || exit 0
while IFS='=' read -r name value; do
    case "$name" in
        ''|'#'*) continue ;;
    esac
    eval "already=\${$name+set}"
    [ -n "$already" ] || printf 'export %s=%s\n' "$name" "$value"
done < "$env_file"
exit 0
