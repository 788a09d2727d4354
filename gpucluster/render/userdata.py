"""The cloud-init user data handed to EC2, byte for byte, for the head node and for each pool's nodes.

User data holds no secret and nothing AWS assigns at `pulumi up`, and installs nothing (the node image holds the
software). At every boot, before the network is online, it runs the lockdown (gpucluster.contract.lockdown: instance
metadata for root and the daemons only, no root for the login user). It writes three files: node.env (cluster, region,
role, pool, the parameters to read), fetch_bundle.py, and the unit gpucluster-boot.service, which runs fetch_bundle.py
at every boot, not only the first: it reads the settings and the munge key from SSM, fetches the bundle from S3 and
runs bootstrap.py in the node's role. So the bytes are known offline, and small: EC2 takes 16384 bytes at most.
"""

from __future__ import annotations

import yaml

from gpucluster import node
from gpucluster.contract import lockdown, settings
from gpucluster.spec.model import PoolSpec, Stack

EC2_USER_DATA_LIMIT = 16384
FETCHER = "fetch_bundle.py"


class _Dumper(yaml.SafeDumper):
    """Multi-line strings as literal blocks, so that a reviewer reads the files as they land on disk."""


_Dumper.add_representer(
    str, lambda d, v: d.represent_scalar("tag:yaml.org,2002:str", v, style="|" if "\n" in v else None)
)


def config_parameter(stack: Stack) -> str:
    """SSM parameter (String) with what `pulumi up` learned: bucket, FSx DNS and mount name, head address."""
    return f"/gpucluster/{stack.cluster_name}/config"


def munge_key_parameter(stack: Stack) -> str:
    """SSM parameter (SecureString) with the munge key: created by the head node on first boot, never in state."""
    return f"/gpucluster/{stack.cluster_name}/munge-key"


def boot_unit() -> str:
    """gpucluster-boot.service: configure the node at every boot. A failed boot is retried, never left half done."""
    return "\n".join([
        "[Unit]",
        "Description=gpucluster: fetch this node's settings and bundle, then configure it in its role",
        "Wants=network-online.target",
        # dlami-nvme.service mounts the instance store that enroot's cache goes on (Deep Learning AMIs).
        "After=network-online.target dlami-nvme.service",
        "StartLimitIntervalSec=0",
        "",
        "[Service]",
        "Type=oneshot",
        "RemainAfterExit=yes",
        f"ExecStart=/usr/bin/python3 {settings.FETCHER} {settings.NODE_ENV_FILE}",
        "Restart=on-failure",
        "RestartSec=30",
        # A node on a stock AMI builds its software first (build_image.sh): that takes minutes, not seconds.
        "TimeoutStartSec=90min",
        "",
        "[Install]",
        "WantedBy=multi-user.target",
        "",
    ])


def node_env(stack: Stack, role: str, pool: PoolSpec | None) -> dict[str, str]:
    """What a node knows before it has read anything: written by cloud-init to settings.NODE_ENV_FILE."""
    env = {
        "GPUCLUSTER_CLUSTER": stack.cluster_name,
        "GPUCLUSTER_REGION": stack.region,
        "GPUCLUSTER_ROLE": role,
        "GPUCLUSTER_CONFIG_PARAMETER": config_parameter(stack),
        "GPUCLUSTER_MUNGE_KEY_PARAMETER": munge_key_parameter(stack),
        "GPUCLUSTER_BUNDLE_DIR": settings.BUNDLE_DIR,
        "GPUCLUSTER_BOOTSTRAP": settings.BOOTSTRAP_PROGRAM,
        "GPUCLUSTER_SETTINGS_FILE": settings.SETTINGS_FILE,
        "GPUCLUSTER_MUNGE_KEY_FILE": settings.MUNGE_KEY_STAGED,
        "GPUCLUSTER_BOOT_LOG": settings.BOOT_LOG,
    }
    if pool:
        env["GPUCLUSTER_POOL"] = pool.name
        env["GPUCLUSTER_LIBRARY"] = ":".join(settings.NODE_LIBRARY)
    return env


def _cloud_config(stack: Stack, role: str, hostname: str | None, pool: PoolSpec | None) -> str:
    doc: dict[str, object] = {}
    if hostname:
        doc |= {"hostname": hostname, "manage_etc_hosts": True}
    else:
        doc["preserve_hostname"] = True  # the bootstrap names the node after its Slurm node; a reboot keeps it
    doc |= {
        # bootcmd runs at every boot, early (cloud-init's init stage, before network-online.target): before Session
        # Manager's agent or slurmd can start anything a user asked for. A string item: cloud-init writes it as it is
        # into the script it runs with /bin/sh (cc_bootcmd, util.shellify), as `sh -c` would, in fewer bytes.
        "bootcmd": [lockdown.script(role, packages=False)],
        # cloud-init sets users up after bootcmd: the login user as Ubuntu's default would be, but without sudo or
        # groups (Ubuntu's default user has sudo, adm, lxd...), so its first boot does not give back what the lockdown
        # took. Password login stays locked (Session Manager only).
        "users": [{"name": settings.LOGIN_USER, "shell": "/bin/bash", "lock_passwd": True}],
        "write_files": [
            {"path": settings.NODE_ENV_FILE, "permissions": "0644",
             "content": "".join(f"{k}={v}\n" for k, v in node_env(stack, role, pool).items())},
            {"path": settings.FETCHER, "permissions": "0755", "content": node.source(FETCHER).decode()},
            {"path": f"/etc/systemd/system/{settings.BOOT_UNIT}", "permissions": "0644", "content": boot_unit()},
        ],
        # runcmd runs once per instance; the unit it enables runs at every boot. --no-block: cloud-init is itself
        # part of the boot that the unit's start would wait for.
        "runcmd": [["systemctl", "daemon-reload"], ["systemctl", "enable", "--now", "--no-block", settings.BOOT_UNIT]],
    }
    header = (f"#cloud-config\n# gpucluster {role} for stack {stack.name} ({stack.cluster_name}). "
              "Rendered from the stack file; holds no credentials.\n")
    return header + yaml.dump(doc, Dumper=_Dumper, sort_keys=False, width=120)


def head_node(stack: Stack) -> str:
    return _cloud_config(stack, "head", settings.HEAD_HOSTNAME, None)


def pool_nodes(stack: Stack, pool: PoolSpec) -> str:
    # The node takes its Slurm name (found by its instance id) as hostname in the bootstrap; nothing to set here.
    return _cloud_config(stack, "compute", None, pool)


def all_user_data(stack: Stack) -> dict[str, str]:
    """File name -> user data, as `render` writes them."""
    out = {"head-node.user-data": head_node(stack)}
    out |= {f"{pool.name}.user-data": pool_nodes(stack, pool) for pool in stack.spec.pools}
    return out
