"""The settings contract: what the Pulumi side and the node programs agree on (paths, ports, tags, the settings file,
Slurm's output, the reasons the programs give Slurm, the lockdown script). Standard library only: it runs in the nodes'
system Python; with gpucluster.node it is the part of the library a compute node receives (settings.NODE_LIBRARY)."""
