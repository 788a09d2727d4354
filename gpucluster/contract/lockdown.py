"""What keeps a cluster's users from becoming the cluster: the script every node runs early at every boot.

- Instance metadata, which hands out the instance role's credentials, answers root and the daemon users that call
  AWS, nobody else: a job or a login shell gets no credentials (so neither the munge key parameter nor the head's
  launch and terminate rights). iptables' owner match on the OUTPUT chain, as ParallelCluster secures its head node.
- DCGM's host engine on compute nodes answers root only: its health verdict drains nodes (DCGM_CHAIN).
- The images' login user has no way to root: no sudo rule, no privileged group (docker and lxd start root
  containers; sudo and admin grant sudo; adm reads the system logs). cloud-init's own user set-up, which runs after
  bootcmd, gives it none either (userdata: `users`).
- Session Manager's ssm-user (the admins') exists with its home off the shared file system.
- Re-run over its own rules (the bootstrap's run, every boot after bootcmd's), it only adds: the chain ends in its
  REJECT before any packet is sent to it and keeps it, so no moment lets a user's packet through (a flush and
  rebuild would, for as long as the rebuild takes).

cloud-init runs the script as `bootcmd` (every boot, before the network is online, so before Session Manager's agent
can start a session and before slurmd can start a job); the bootstrap runs it again once the node's packages are
there (on a stock AMI the slurm user exists only then). Idempotent. Standard library only: the bootstrap imports it
from the bundle with the system python3.
"""

from __future__ import annotations

from gpucluster.contract.settings import ALERTMANAGER_PORT, DCGM_HOSTENGINE_PORT, LOGIN_USER, ROLES, SLURM_USER

IMDS_ADDRESSES = {"iptables": "169.254.169.254", "ip6tables": "fd00:ec2::254"}  # IPv4, and IPv6 where enabled
IMDS_CHAIN = "GPUCLUSTER-IMDS"
# Who may reach instance metadata, per node role. The head's resume, suspend and reconciler programs run as the
# slurm user (Slurm's SlurmUser) and launch and terminate instances; everything else that calls AWS runs as root
# (the boot unit, the SSM and CloudWatch agents, the budget guardrail). On the head, Alertmanager (the packaged
# `prometheus` user) sends alerts to the stack's topic with the role's credentials. No login user runs as any of them.
IMDS_USERS = {"head": ("root", SLURM_USER, "prometheus"), "compute": ("root",)}
# sshd's key lookup for `gpucluster ssh-proxy` on the head. Ubuntu's ec2-instance-connect package (Canonical's AWS
# images carry it; aws/aws-ec2-instance-connect-config 1.1.17+) makes this system user (debian/preinst: adduser
# --system --disabled-login --shell /usr/sbin/nologin --home /nonexistent) and has sshd run its
# AuthorizedKeysCommand, /usr/share/ec2-instance-connect/eic_run_authorized_keys %u %f, as that user
# (AuthorizedKeysCommandUser; debian/postinst's ssh.service drop-in). The command (eic_curl_authorized_keys) asks
# instance metadata, IMDSv2, for the keys pushed for %u in the last 60 s (managed-ssh-keys/active-keys/<user>/) and
# checks their signature. Only sshd starts processes as this user. Let through by the bootstrap's run only: until
# then the head takes no SSH connection it needs, and bootcmd's script stays within the user data's bytes.
EIC_USER = "ec2-instance-connect"
BOOTSTRAP_IMDS_USERS = {"head": (EIC_USER,), "compute": ()}
# Alertmanager's API on the head (127.0.0.1, no authentication): whoever posts there publishes to the stack's topic
# with the head's role, and may silence alerts. Prometheus sends the alerts; root administers.
ALERTS_CHAIN = "GPUCLUSTER-ALERTS"
ALERTS_USERS = ("root", "prometheus")
# DCGM's host engine on compute nodes (127.0.0.1, no authentication): whoever talks to it can inject a field value
# into its cache (a fake XID, which its health check would fail the GPU for, and the node would be drained and
# replaced), clear its health watches or pause it. The health check (root) and dcgm-exporter (a root container on the
# host's network) use it.
DCGM_CHAIN = "GPUCLUSTER-DCGM"
# The groups Ubuntu's default user gets that reach root (sudo, admin, wheel: sudo; lxd, docker: root containers) or
# other users' secrets (adm: the system logs, auth.log among them).
PRIVILEGED_GROUPS = ("sudo", "admin", "wheel", "lxd", "docker", "adm")
# Session Manager's own user, the admins' (it has sudo). Made here before the SSM agent would make it, with its home
# on the node's own disk: under /home (the shared file system, which S3 imports write into) anyone who may write the
# bucket could plant its shell profile.
SSM_USER = "ssm-user"
SSM_USER_HOME = "/var/lib/ssm-user"


def script(role: str, packages: bool = True) -> str:
    """The POSIX shell script for a node of `role` (head or compute). `packages`: the bootstrap's run, once the
    image's packages are there, which also guards the daemons they bring (DCGM's host engine) before slurmd starts
    any job; cloud-init's bootcmd runs it without (the user data's 16 KiB are counted)."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    chain, v4, v6 = IMDS_CHAIN, IMDS_ADDRESSES["iptables"], IMDS_ADDRESSES["ip6tables"]
    users = " ".join(IMDS_USERS[role] + (BOOTSTRAP_IMDS_USERS[role] if packages else ()))
    return "\n".join([
        "set -eu",
        # guard TOOL CHAIN PACKETS USERS: the packets go to the chain, which lets the users' through and rejects the
        # rest. Its REJECT comes first and stays last; each user's ACCEPT goes above it, once.
        "guard() {",
        '  t="$1 -w" c=$2',
        "  $t -N $c 2>/dev/null || :",
        "  $t -C $c -j REJECT 2>/dev/null || $t -A $c -j REJECT",
        "  $t -C OUTPUT $3 -j $c 2>/dev/null || $t -I OUTPUT $3 -j $c",
        "  for user in $4; do",
        '    rule="$c -m owner --uid-owner $user -j ACCEPT"',
        "    if id -u $user >/dev/null 2>&1; then $t -C $rule 2>/dev/null || $t -I $rule; fi",
        "  done",
        "}",
        f'guard iptables {chain} "-d {v4}" "{users}"',
        *([f'guard iptables {ALERTS_CHAIN} "-o lo -p tcp --dport {ALERTMANAGER_PORT}" "{" ".join(ALERTS_USERS)}"']
          if role == "head" else []),
        # The host engine listens on 127.0.0.1 only (nv-hostengine's default).
        *([f'guard iptables {DCGM_CHAIN} "-o lo -p tcp --dport {DCGM_HOSTENGINE_PORT}" root']
          if role == "compute" and packages else []),
        # IPv6 metadata answers only where a launch template enables it; a kernel without IPv6 tables is no failure.
        f'guard ip6tables {chain} "-d {v6}" "{users}" 2>/dev/null || true',
        f"if id -u {LOGIN_USER} >/dev/null 2>&1; then",
        f"  for group in {' '.join(PRIVILEGED_GROUPS)}; do",
        f'    if id -nG {LOGIN_USER} | tr " " "\\n" | grep -qx "$group"; then'
        f' gpasswd -d {LOGIN_USER} "$group" >/dev/null; fi',
        "  done",
        "  for rules in /etc/sudoers.d/*; do",
        f'    if [ -f "$rules" ] && grep -q "^{LOGIN_USER}[[:space:]]" "$rules"; then'
        f' sed -i "/^{LOGIN_USER}[[:space:]]/d" "$rules"; fi',
        "  done",
        "fi",
        # What the SSM agent would do for its user (useradd, a sudo rule), with the home off the shared file system.
        f"if ! id -u {SSM_USER} >/dev/null 2>&1; then",
        f"  useradd --create-home --home-dir {SSM_USER_HOME} --shell /bin/bash {SSM_USER}",
        f'elif [ "$(getent passwd {SSM_USER} | cut -d: -f6)" != {SSM_USER_HOME} ]; then',
        # Made under /home by the agent on the image's build instance.
        f"  usermod --home {SSM_USER_HOME} {SSM_USER}",
        "fi",
        f'mkdir -p {SSM_USER_HOME} && chown "{SSM_USER}:" {SSM_USER_HOME} && chmod 0750 {SSM_USER_HOME}',
        "if [ -d /etc/sudoers.d ]; then",
        f'  echo "{SSM_USER} ALL=(ALL) NOPASSWD:ALL" > /etc/sudoers.d/ssm-agent-users',
        "  chmod 0440 /etc/sudoers.d/ssm-agent-users",
        "fi",
        # The checks that matter: the IPv4 rule is in force (iptables must be on the node's image), and sudo (where
        # installed) grants the login user nothing, whatever rule or group it came by.
        f"iptables -w -C OUTPUT -d {v4} -j {chain}",
        f"if command -v sudo >/dev/null 2>&1 && sudo -n -l -U {LOGIN_USER} 2>/dev/null | grep -q 'may run'; then",
        f'  echo "{LOGIN_USER} can still use sudo" >&2',
        "  exit 1",
        "fi",
        "",
    ])
