"""The settings contract: what the Pulumi side and the node programs agree on (paths, ports, tags, the settings file,
Slurm's output, reason prefixes, the lockdown script). Standard library only: it runs in the nodes' system Python and is
the only part of the library a compute node receives."""
