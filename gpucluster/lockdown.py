"""What keeps a cluster's users from becoming the cluster: the script every node runs early at every boot.

- Instance metadata, which hands out the instance role's credentials, answers root and the daemon users that call
  AWS, nobody else: a job or a login shell gets no credentials (so neither the munge key parameter nor the head's
  launch and terminate rights). iptables' owner match on the OUTPUT chain, as ParallelCluster secures its head node.
- The images' login user has no way to root: no sudo rule, no root-equivalent group (docker and lxd start root
  containers; sudo and admin grant sudo).

cloud-init runs the script as `bootcmd` (every boot, before the network is online, so before Session Manager's agent
can start a session and before slurmd can start a job); the bootstrap runs it again once the node's packages are
there (on a stock AMI the slurm user exists only then). Idempotent. Standard library only: the bootstrap imports it
from the bundle with the system python3.
"""

from __future__ import annotations

from gpucluster.settings import LOGIN_USER, ROLES, SLURM_USER

IMDS_ADDRESSES = {"iptables": "169.254.169.254", "ip6tables": "fd00:ec2::254"}  # IPv4, and IPv6 where enabled
IMDS_CHAIN = "GPUCLUSTER-IMDS"
# Who may reach instance metadata, per node role. The head's resume, suspend and reconciler programs run as the
# slurm user (Slurm's SlurmUser) and launch and terminate instances; everything else that calls AWS runs as root
# (the boot unit, the SSM and CloudWatch agents, the budget guardrail). No login user runs as either.
IMDS_USERS = {"head": ("root", SLURM_USER), "compute": ("root",)}
ROOT_EQUIVALENT_GROUPS = ("sudo", "admin", "wheel", "lxd", "docker")


def script(role: str) -> str:
    """The POSIX shell script for a node of `role` (head or compute)."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    chain, v4, v6 = IMDS_CHAIN, IMDS_ADDRESSES["iptables"], IMDS_ADDRESSES["ip6tables"]
    return "\n".join([
        "set -eu",
        "guard() {  # $1: iptables or ip6tables, $2: the metadata address",
        f'  "$1" -w -N {chain} 2>/dev/null || "$1" -w -F {chain}',
        f'  "$1" -w -C OUTPUT -d "$2" -j {chain} 2>/dev/null || "$1" -w -I OUTPUT 1 -d "$2" -j {chain}',
        f"  for user in {' '.join(IMDS_USERS[role])}; do",
        f'    if id -u "$user" >/dev/null 2>&1; then "$1" -w -A {chain} -m owner --uid-owner "$user" -j ACCEPT; fi',
        "  done",
        f'  "$1" -w -A {chain} -j REJECT',
        "}",
        f"guard iptables {v4}",
        # IPv6 metadata answers only where a launch template enables it; a kernel without IPv6 tables is no failure.
        f"guard ip6tables {v6} 2>/dev/null || true",
        f"if id -u {LOGIN_USER} >/dev/null 2>&1; then",
        f"  for group in {' '.join(ROOT_EQUIVALENT_GROUPS)}; do",
        f'    if id -nG {LOGIN_USER} | tr " " "\\n" | grep -qx "$group"; then gpasswd -d {LOGIN_USER} "$group" >/dev/null; fi',
        "  done",
        "  for rules in /etc/sudoers.d/*; do",
        f'    if [ -f "$rules" ] && grep -q "^{LOGIN_USER}[[:space:]]" "$rules"; then sed -i "/^{LOGIN_USER}[[:space:]]/d" "$rules"; fi',
        "  done",
        "fi",
        # The one check that matters: the IPv4 rule is in force (iptables must be on the node's image).
        f"iptables -w -C OUTPUT -d {v4} -j {chain}",
        "",
    ])
