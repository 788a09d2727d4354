"""The words gpucluster's programs leave in Slurm: a node's DOWN or DRAIN reason (`sinfo -R -o '%200E %N'`), a held
job's AdminComment. Said once here: the programs that set them and those that read them back (the reconciler, the
budget guardrail) go by these prefixes. Standard library only: the nodes import it from the bundle."""

from __future__ import annotations

PREFIX = "gpucluster:"  # every reason the cluster sets; one without it is a person's or Slurm's own
CAPACITY = f"{PREFIX} capacity"  # EC2 had no room or no quota: retried with backoff
LAUNCH_FAILED = f"{PREFIX} launch failed"  # any other failed launch: retried with backoff
# The resume program's reason for a launch the Budgets action's deny refused (UnauthorizedOperation): the budget
# guardrail makes those nodes schedulable again when it lifts the deny.
LAUNCH_DENIED = f"{LAUNCH_FAILED}: UnauthorizedOperation"
# Reasons that a retry cannot cure: the reconciler leaves the node DOWN until someone fixes the stack.
CONFIGURATION = f"{PREFIX} configuration"
# A node that a changed stack no longer has (the head's in-place update): left DOWN, under CONFIGURATION.
REMOVED = f"{CONFIGURATION}: removed from the stack by pulumi up"
# Drained by the cluster for a fresh instance (a spot warning, a rebalance recommendation, a failed health check): the
# reconciler replaces the node's instance once it is idle.
REPLACE = f"{PREFIX} replace"
# A node's own health check (as root) drains it so: a fault of this instance, cured by a fresh one.
HEALTH = f"{REPLACE}: health"
# The reconciler's word for a pool whose fresh instances keep failing their health check: no more replacements (a
# fault that follows fresh instances is the image's, the driver's or a job's); under CONFIGURATION, no relaunch.
HEALTH_REPEATS = f"{CONFIGURATION}: health faults repeat"
# The AdminComment the budget guardrail gives the pending jobs of the partitions it closed.
BUDGET = f"{PREFIX} budget"
