"""The cluster's people (the stack file's `users:`): the rules on their names and uids, which the stack's check
(gpucluster/spec/model.py) and the settings loader on the nodes (settings.ClusterSettings) both apply.

A person is a POSIX account on every node with the same uid everywhere, and a personal group of the same name whose
gid is the uid. Standard library only: the nodes import this file from the bundle.
"""

from __future__ import annotations

import hashlib
import re

# A login name: a lowercase letter, then lowercase letters, digits, '-' and '_' (POSIX's portable user names, lowercase,
# as Debian's adduser takes them without --allow-bad-names); at most 32 characters, the user name field of utmp
# (UT_NAMESIZE in glibc's bits/utmp.h) that `who`, `last` and sshd's records keep.
NAME_MAX = 32
NAME_RE = re.compile(rf"[a-z][a-z0-9_-]{{0,{NAME_MAX - 1}}}")
NAME_RULE = (f"a lowercase letter, then lowercase letters, digits, '-' and '_', at most {NAME_MAX} characters "
             "(such as alice or j_smith)")

# The people's uids and gids. Inside the regular users' range of the images' login.defs (UID_MIN 1000 .. UID_MAX
# 60000, as on Ubuntu and Debian), clear of every range the images or their software take:
UID_MIN = 20000
UID_MAX = 59999
# What each range outside UID_MIN..UID_MAX holds, lowest first (inclusive bounds): a uid there is refused with why.
# Ranges: Ubuntu's and Debian's login.defs, Debian Policy 9.2.2 (60000-64999) and https://systemd.io/UIDS-GIDS/.
UID_RANGES_TAKEN: tuple[tuple[int, int, str], ...] = (
    (0, 999, "system accounts (login.defs SYS_UID_MAX 999: root, the packages' daemon users)"),
    (1000, UID_MIN - 1, "the images' own login accounts: ubuntu (1000), ssm-user and any account useradd makes on a "
                        "node, numbered upwards from login.defs UID_MIN 1000"),
    (UID_MAX + 1, 61183, "the top of login.defs' range (UID_MAX 60000), systemd-homed (60001-60513) and Debian's "
                         "globally allocated ids (60000-64999)"),
    (61184, 65519, "systemd's DynamicUser= services (61184-65519)"),
    (65520, 65535, "nobody (65534) and the 16-bit -1 (65535)"),
    (65536, 2**32 - 1, "the subordinate ids of user namespaces (login.defs SUB_UID_MIN 100000, /etc/subuid) and the "
                       "container ranges of snapd and systemd (from 524288)"),
)

# Names no person may take: each is an account or a group on the nodes already, and a person's personal group has the
# person's name.
# - Debian's base-passwd 3.6 (usr/share/base-passwd/passwd.master and group.master, as the images' Ubuntu 24.04 and
#   the rehearsal's Debian 13 ship them): the static users and groups.
BASE_PASSWD = (
    "root", "daemon", "bin", "sys", "sync", "games", "man", "lp", "mail", "news", "uucp", "proxy", "www-data",
    "backup", "list", "irc", "_apt", "nobody",
    "adm", "tty", "disk", "kmem", "dialout", "fax", "voice", "cdrom", "floppy", "tape", "sudo", "audio", "dip",
    "operator", "src", "shadow", "utmp", "video", "sasl", "plugdev", "staff", "users", "nogroup",
)
# - The system accounts and groups of Ubuntu 24.04's server and EC2 images beyond base-passwd (systemd's sysusers, dbus,
#   rsyslog, the cloud image's packages, sudo's admin and wheel), and gnats, which older base-passwd releases had.
UBUNTU_SYSTEM = (
    "systemd-network", "systemd-resolve", "systemd-timesync", "systemd-coredump", "systemd-journal", "systemd-oom",
    "messagebus", "syslog", "uuidd", "tcpdump", "tss", "landscape", "pollinate", "fwupd-refresh", "usbmux", "sshd",
    "_ssh", "polkitd", "dhcpcd", "dnsmasq", "lxd", "snap_daemon", "ec2-instance-connect", "gnats", "admin", "wheel",
    "input", "kvm", "render", "sgx", "netdev", "crontab", "rdma", "_chrony",
)
# - What the images install on top (gpucluster/spec/bom.py and build_image.sh): munge, MariaDB's mysql, the
#   Prometheus packages' prometheus, grafana, the CloudWatch agent's cwagent, Slurm's slurm (SlurmUser), the Deep
#   Learning AMIs' docker group; the images' login user (ubuntu) and Session Manager's ssm-user (contract/lockdown.py).
IMAGE_ACCOUNTS = ("munge", "mysql", "prometheus", "grafana", "cwagent", "slurm", "docker", "ubuntu", "ssm-user")
RESERVED_NAMES = frozenset((*BASE_PASSWD, *UBUNTU_SYSTEM, *IMAGE_ACCOUNTS))

# The GECOS field of every person's account the nodes make (gpucluster/node/accounts.py): a hint for whoever reads
# /etc/passwd. Never how the cluster tells its accounts from others (anyone making an account can write it): that is
# the root-owned list settings.PEOPLE_ACCOUNTS_FILE.
ACCOUNT_MARK = "gpucluster person"


def assigned_uid(name: str) -> int:
    """The uid of a person whose stack entry gives none: the first 8 bytes of the SHA-256 of the name (UTF-8), read
    big-endian, modulo the range's size, from UID_MIN. It depends on the name alone: adding or removing anyone else
    never changes it."""
    digest = hashlib.sha256(name.encode()).digest()
    return UID_MIN + int.from_bytes(digest[:8], "big") % (UID_MAX - UID_MIN + 1)


def name_problem(name: str) -> str | None:
    """Why `name` cannot be a person's, or None."""
    if not NAME_RE.fullmatch(name):
        return f"{name!r} is not allowed: use {NAME_RULE}"
    if name in RESERVED_NAMES:
        return (f"{name!r} is an account or group the nodes already have (a system, package or cluster account): "
                "choose another name")
    return None


def uid_problem(uid: int) -> str | None:
    """Why `uid` cannot be a person's, or None."""
    if UID_MIN <= uid <= UID_MAX:
        return None
    allowed = f"use {UID_MIN} to {UID_MAX}, or leave uid out to have one assigned"
    why = next((what for low, high, what in UID_RANGES_TAKEN if low <= uid <= high), None)
    return f"{uid} is {'in the range of ' + why if why else 'not a uid'}: {allowed}"
