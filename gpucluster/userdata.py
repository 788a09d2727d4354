"""The cloud-init user data handed to EC2, byte for byte, for the head node and for each pool's nodes.

User data holds no secret and nothing AWS assigns at `pulumi up`: a node learns the bucket, the file system and the
head node's address from the SSM parameter `config_parameter(stack)`, fetches the bundle (Slurm files, node programs,
bootstrap) from S3 and runs cloud-init/bootstrap.py in its role. So the bytes are known offline, and small: EC2 takes
16384 bytes at most.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from gpucluster.spec import Pool, Stack

EC2_USER_DATA_LIMIT = 16384
# python3-venv and python3-yaml: the head node's `gpucluster` command (pydantic 2 goes into a venv).
HEAD_PACKAGES = ["munge", "slurmctld", "slurmdbd", "slurm-client", "mariadb-server", "python3-boto3", "python3-venv",
                 "python3-yaml"]
NODE_PACKAGES = ["munge", "slurmd", "slurm-client", "python3-boto3"]
FETCHER = (Path(__file__).resolve().parent.parent / "cloud-init" / "fetch_bundle.py").read_text()


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


def _cloud_config(stack: Stack, role: str, packages: list[str], hostname: str | None, pool: Pool | None) -> str:
    env = {
        "GPUCLUSTER_CLUSTER": stack.cluster_name,
        "GPUCLUSTER_REGION": stack.region,
        "GPUCLUSTER_ROLE": role,
        "GPUCLUSTER_CONFIG_PARAMETER": config_parameter(stack),
    }
    if pool:
        env["GPUCLUSTER_POOL"] = pool.name
    doc: dict[str, object] = {}
    if hostname:
        doc |= {"hostname": hostname, "manage_etc_hosts": True}
    doc |= {
        "package_update": True,
        "packages": packages,
        "write_files": [
            {"path": "/etc/gpucluster/node.env", "permissions": "0644",
             "content": "".join(f"{k}={v}\n" for k, v in env.items())},
            {"path": "/opt/gpucluster/fetch_bundle.py", "permissions": "0755", "content": FETCHER},
        ],
        # The bootstrap is idempotent: a reboot runs it again and it converges.
        "runcmd": [["/usr/bin/python3", "/opt/gpucluster/fetch_bundle.py"]],
    }
    header = (f"#cloud-config\n# gpucluster {role} for stack {stack.name} ({stack.cluster_name}). "
              "Rendered from the stack file; holds no credentials.\n")
    return header + yaml.dump(doc, Dumper=_Dumper, sort_keys=False, width=120)


def head_node(stack: Stack) -> str:
    return _cloud_config(stack, "head", HEAD_PACKAGES, "head", None)


def pool_nodes(stack: Stack, pool: Pool) -> str:
    # The node takes its Slurm name (from its instance tag) as hostname in the bootstrap; nothing to set here.
    return _cloud_config(stack, "compute", NODE_PACKAGES, None, pool)


def all_user_data(stack: Stack) -> dict[str, str]:
    """File name -> user data, as `render` writes them."""
    out = {"head-node.user-data": head_node(stack)}
    out |= {f"{pool.name}.user-data": pool_nodes(stack, pool) for pool in stack.spec.pools}
    return out
