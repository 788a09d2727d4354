#!/bin/sh
# Slurm's TaskProlog (slurm.conf), run by slurmstepd as the job's user before each task: every job step gets the
# cluster's NCCL/EFA environment, batch scripts that read no profile included. slurmstepd adds what this prints as
# `export NAME=value` to the task's environment (the value up to the line's end, spaces and all). A variable the job
# already has (the user's own setting) is left as it is; LD_LIBRARY_PATH, a search path, gets the node's directory
# after the job's own (once: srun's tasks inherit the batch step's). The node's values are in the file the bootstrap
# wrote for its pool.
env_file=/etc/gpucluster/nccl.env
[ -r "$env_file" ] || exit 0
while IFS='=' read -r name value; do
    case "$name" in
        ''|'#'*) continue ;;
        LD_LIBRARY_PATH)
            case ":${LD_LIBRARY_PATH-}:" in
                *":$value:"*) ;;
                *) printf 'export LD_LIBRARY_PATH=%s\n' "${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$value" ;;
            esac
            continue ;;
    esac
    eval "already=\${$name+set}"
    [ -n "$already" ] || printf 'export %s=%s\n' "$name" "$value"
done < "$env_file"
exit 0
