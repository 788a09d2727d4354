"""Stack -> bytes, offline: Slurm's files, Prometheus and Grafana, user data, Kubernetes objects, the node bundle.
Imports the contract, the spec and the node programs' files (as data), never AWS or Pulumi."""
