"""The node image's bill of materials: every version a node runs, named once. The image bake installs exactly this
(gpucluster/node/build_image.sh reads the rendered bom.json) and the tests run the same Slurm (tests/local_cluster.py).

What pins what:
- the parent images, by exact dated name (AMI names are the same in every region, ids are not);
- Ubuntu's own packages, by the archive snapshot the stack names (`image.ubuntu_snapshot`): their versions are what
  that snapshot serves, resolved into ubuntu-lock.json by `gpucluster image-lock`;
- third-party apt repositories (Grafana's, AWS's CloudWatch agent and FSx Lustre client), which no Ubuntu snapshot
  freezes, by exact version here;
- pip distributions, by version and the sha256 of the one wheel pip installs on the images' Python 3.12 x86_64
  (`pip install --require-hashes`), dependencies included;
- what is built from source, by the sha256 of its archive or, where no archive's bytes could be hashed, the commit.

Resolved 2026-12-01 (pip: `pip install --dry-run --report` for cp312 manylinux_2_39_x86_64 against PyPI, hashes from
PyPI's index).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import date
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from gpucluster.spec.model import Stack

# Slurm, built into the image from SchedMD's release tag, and Debian 13's package of the same release in the tests.
SLURM_VERSION = "24.11.5"

ParentRole = Literal["head", "gpu", "neuron"]
PARENT_ROLES: tuple[ParentRole, ...] = ("head", "gpu", "neuron")
# AWS's and Canonical's image names end in the release's date (Canonical's sometimes with a .N respin).
DATED_NAME_RE = r"(\d{8})(\.\d+)?$"


def release_date(name: str) -> date | None:
    """The release date a dated image name carries; None when the name carries none."""
    match = re.search(DATED_NAME_RE, name)
    if not match:
        return None
    try:
        return date(int(match[1][:4]), int(match[1][4:6]), int(match[1][6:]))
    except ValueError:
        return None


@dataclass(frozen=True)
class ParentImage:
    """An image a node image is baked on: its exact name and owner, and optionally its id in given regions."""

    name: str
    owner: str
    region_ids: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def released(self) -> date:
        released = release_date(self.name)
        if released is None:
            raise ValueError(f"{self.name!r} carries no release date (YYYYMMDD)")
        return released

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "owner": self.owner, "region_ids": dict(sorted(self.region_ids.items()))}


# The parents the stacks bake on unless their stack file names others (image.parent_images).
PARENT_IMAGES: Mapping[ParentRole, ParentImage] = MappingProxyType({
    # Canonical's Ubuntu 24.04 server image (gp3 root), owner Canonical's account. The 20260904 release ran kernel
    # 7.0.0-1012-aws, the DLAMI's below (a third party's record; the name's form is Canonical's).
    "head": ParentImage("ubuntu/images/hvm-ssd-gp3/ubuntu-noble-24.04-amd64-server-20260904", "099720109477"),
    # AWS's Deep Learning Base OSS Nvidia Driver GPU AMI: kernel 7.0.0-1012-aws, driver 595.91.07, CUDA 12.8-13.2,
    # DCGM 4.7.0, EFA 1.50.0, aws-ofi-nccl 1.21.1 (its release notes).
    "gpu": ParentImage("Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 24.04) 20260915", "amazon"),
    # AWS's Neuron multi-framework DLAMI, the one /aws/service/neuron/dlami/multi-framework/ubuntu-24.04 names. The
    # name's form is the Neuron documentation's; this release's name is read in third parties' records only.
    "neuron": ParentImage("Deep Learning AMI Neuron (Ubuntu 24.04) 20260818", "amazon"),
})


def parent_role(accelerator: str | None) -> ParentRole:
    """The parent role of an image: the head's (no accelerator), or the compute image's of an accelerator kind."""
    roles: dict[str | None, ParentRole] = {None: "head", "nvidia": "gpu", "neuron": "neuron"}
    return roles[accelerator]


# --- apt --------------------------------------------------------------------------------------------------------------
# Slurm's own build (from source, configure's optional features the cluster uses): munge authentication, PMIx for
# `srun --mpi=pmix`, hwloc, cgroup v2 (dbus), NUMA, job_submit/lua, JSON output (scontrol --json), readline for the
# interactive tools, PAM, lz4 and zlib; MariaDB's client library for slurmdbd's accounting on the head.
SLURM_BUILD = ("build-essential", "pkgconf", "libmunge-dev", "libpmix-dev", "libhwloc-dev", "libdbus-1-dev",
               "libnuma-dev", "liblua5.4-dev", "libjson-c-dev", "libreadline-dev", "libpam0g-dev", "liblz4-dev",
               "zlib1g-dev")
# enroot, built from its pinned commit (doc/installation.md): git, patch and setcap beside the compiler; at run time
# what its .deb depends on.
ENROOT_BUILD = ("git", "patch", "libcap2-bin")
ENROOT_RUNTIME = ("curl", "gawk", "jq", "parallel", "squashfs-tools", "zstd", "bsdmainutils")
# iptables: every boot's lockdown keeps instance metadata from users with it (gpucluster/contract/lockdown.py).
# sshd and EC2 Instance Connect's key lookup (`gpucluster ssh-proxy`) are the head's parent's own: Canonical's
# Ubuntu server images for AWS carry openssh-server and ec2-instance-connect (noble's 1.1.17-0ubuntu1 in main), and
# the bake removes neither. Not named here, so the snapshot's lock does not pin them; the head's bootstrap checks
# both and boots without SSH, with a warning, where they lack (node/bootstrap.py ssh_server).
HEAD_APT = ("munge", *SLURM_BUILD, "libmariadb-dev", "mariadb-server", "python3-boto3", "python3-yaml",
            "iptables", "prometheus", "prometheus-alertmanager", "prometheus-node-exporter")
COMPUTE_APT = ("munge", *SLURM_BUILD, *ENROOT_BUILD, *ENROOT_RUNTIME, "python3-boto3", "iptables",
               "prometheus-node-exporter")
# Every Ubuntu package the bake names: their versions come from the stack's snapshot (ubuntu-lock.json).
UBUNTU_PACKAGES = tuple(sorted({*HEAD_APT, *COMPUTE_APT}))

# Third-party repositories, not frozen by an Ubuntu snapshot: exact versions. The FSx Lustre client's module package
# is named after the parent image's kernel (lustre-client-modules-<uname -r>) and its version is the FSx repository's
# for that kernel: the parent's pin fixes the kernel, and the bake records the version it installed.
THIRD_PARTY_APT: Mapping[str, str] = MappingProxyType({
    "grafana": "11.6.14",  # https://apt.grafana.com stable
    "amazon-cloudwatch-agent": "1.300072.0b1766",  # AWS's signed .deb (S3), its signature checked at the bake
})
HEAD_THIRD_PARTY = ("grafana",)
COMPUTE_THIRD_PARTY = ("amazon-cloudwatch-agent",)


# --- pip --------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PipPackage:
    version: str
    sha256: str  # of the one wheel pip takes on CPython 3.12, manylinux x86_64


PIP_PACKAGES: Mapping[str, PipPackage] = MappingProxyType({
    # The head's `gpucluster` command (pydantic 2) and `render`'s dashboards.
    "pydantic": PipPackage("2.14.4", "653a2ad9f6d8858529c77c72717d0ea991d6c6837fe683246b2f4b2bbfc3fadc"),
    "pydantic-core": PipPackage("2.50.5", "470bbc2495367f60d3ca849a8039e4c164701d10637e7743f4427d92651bdb6d"),
    "annotated-types": PipPackage("0.8.0", "f072f4d804ea359e4eaf198b1af7a8b0943881a87f31bb764f8bf219bb9419e0"),
    "typing-extensions": PipPackage("4.16.0", "481caa481374e813c1b176ada14e97f1f67a4539ce9cfeb3f350d78d6370c2e8"),
    "typing-inspection": PipPackage("0.4.5", "bc210535442b39e1bf2805e0c7a17dfd6a4ace760c84c7f7d16245d23a6b1c39"),
    # Its PyPI versions carry an epoch.
    "grafana-foundation-sdk": PipPackage("1769699379!11.6.0",
                                         "92d7a8144eba0fa802e728fb70e63d74b056fb1195ff116d812ad7a4ccfa5eca"),
    # The compute nodes' torch (the examples' version, requirements-dev.txt) and what it pins or needs.
    "torch": PipPackage("2.13.0", "796633c4cdf0fe2cdced72d8f88f22e73dbcfce83132763162f6d4bff13b820b"),
    "triton": PipPackage("3.7.1", "7e40869937a68206ec70d7f25bb7ec6433cb083f9135e1f36dbd318dc449a728"),
    "nvidia-cudnn-cu13": PipPackage("9.20.0.48", "0c45dd8eeb50b603f07995b1b300c62ffe6a1980482b82b3bcf94a4ca9d49304"),
    "nvidia-cusparselt-cu13": PipPackage("0.8.1", "786ce87568c303fadb5afcc7102d454cd3040d75f6f8626f5db460d1871f4dd0"),
    "nvidia-nccl-cu13": PipPackage("2.29.7", "edd81538446786ec3b73972543e53bb43bcaf0bfc8ef76cb679fcc390ffe136d"),
    "nvidia-nvshmem-cu13": PipPackage("3.4.5", "290f0a2ee94c9f3687a02502f3b9299a9f9fe826e6d0287ee18482e78d495b80"),
    "nvidia-cublas": PipPackage("13.1.1.3", "37936a16db8fe4ac1f065c2139360608a543a09275cb1a1af612e08cfa065436"),
    "nvidia-cuda-cupti": PipPackage("13.0.85", "4eb01c08e859bf924d222250d2e8f8b8ff6d3db4721288cf35d14252a4d933c8"),
    "nvidia-cuda-nvrtc": PipPackage("13.0.88", "ad9b6d2ead2435f11cbb6868809d2adeeee302e9bb94bcf0539c7a40d80e8575"),
    "nvidia-cuda-runtime": PipPackage("13.0.96", "7f82250d7782aa23b6cfe765ecc7db554bd3c2870c43f3d1821f1d18aebf0548"),
    "nvidia-cufft": PipPackage("12.0.0.61", "6c44f692dce8fd5ffd3e3df134b6cdb9c2f72d99cf40b62c32dde45eea9ddad3"),
    "nvidia-cufile": PipPackage("1.15.1.6", "08a3ecefae5a01c7f5117351c64f17c7c62efa5fffdbe24fc7d298da19cd0b44"),
    "nvidia-curand": PipPackage("10.4.0.35", "1aee33a5da6e1db083fe2b90082def8915f30f3248d5896bcec36a579d941bfc"),
    "nvidia-cusolver": PipPackage("12.0.4.66", "0a759da5dea5c0ea10fd307de75cdeb59e7ea4fcb8add0924859b944babf1112"),
    "nvidia-cusparse": PipPackage("12.6.3.3", "2b3c89c88d01ee0e477cb7f82ef60a11a4bcd57b6b87c33f789350b59759360b"),
    "nvidia-nvtx": PipPackage("13.0.85", "4936d1d6780fbe68db454f5e72a42ff64d1fd6397df9f363ae786930fd5c1cd4"),
    "nvidia-nvjitlink": PipPackage("13.5.37", "280d7cb9649704145f074b8dbde500de04ce02d0872e066e20a83c17bcaa93eb"),
    "cuda-bindings": PipPackage("13.5.0", "a46a8cc84112d769d0f57bf3ae3fedc115cf09348f14da85a1a8200968b6f262"),
    "cuda-pathfinder": PipPackage("1.9.1", "b743c132f90ad2d1e71d43fd28f31ebcde518f943e50fd44aca62b2a80d5230d"),
    "cuda-toolkit": PipPackage("13.0.3.0", "d693caaa261214ddd7dbb60d68e71cbed884e68c2be7509778f3051da0b91c3f"),
    "filelock": PipPackage("4.3.1", "79e43df8e9fe509cd83a3899a7c186c8077cbbe4d200a1ed3705c2f3bb6bc487"),
    "fsspec": PipPackage("2026.9.0", "8dd6e646e99ea382bd85f97a45e6b526a442d79423a7dc673f1e2756d05fcb5f"),
    "jinja2": PipPackage("3.1.6", "85ece4451f492d0c13c5dd7c13a64681a86afae63a5f347908daf103ce6d2f67"),
    "markupsafe": PipPackage("3.0.4", "8e124f974786f831d6043728e38296969d3579db8896fe004682f5758e613581"),
    "mpmath": PipPackage("1.3.0", "a0b2b9fe80bbcd81a6647ff13108738cfb482d481d826cc0e02f5b35e5c88d2c"),
    "networkx": PipPackage("3.6.1", "d47fbf302e7d9cbbb9e2555a0d267983d2aa476bac30e90dfbe5669bd57f3762"),
    "setuptools": PipPackage("84.2.1", "ca140b45d5325a9478f880e351484f62fef15f336462e449ca0c03c873d589c2"),
    "sympy": PipPackage("1.14.0", "e091cc3e99d2141a0ba2847328f5479b05d94a6635cb96148ccb3f34671bd8f5"),
})
HEAD_PIP = ("pydantic", "pydantic-core", "annotated-types", "typing-extensions", "typing-inspection",
            "grafana-foundation-sdk")
COMPUTE_PIP = ("torch", "triton", "nvidia-cudnn-cu13", "nvidia-cusparselt-cu13", "nvidia-nccl-cu13",
               "nvidia-nvshmem-cu13", "nvidia-cublas", "nvidia-cuda-cupti", "nvidia-cuda-nvrtc", "nvidia-cuda-runtime",
               "nvidia-cufft", "nvidia-cufile", "nvidia-curand", "nvidia-cusolver", "nvidia-cusparse", "nvidia-nvtx",
               "nvidia-nvjitlink", "cuda-bindings", "cuda-pathfinder", "cuda-toolkit", "filelock", "fsspec", "jinja2",
               "markupsafe", "mpmath", "networkx", "setuptools", "sympy", "typing-extensions")


# --- built from source ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Source:
    url: str
    version: str
    sha256: str | None  # of the bytes at url; None where only a commit pins it
    commit: str | None = None  # a git repository's commit (url is the repository)

    def as_dict(self) -> dict[str, str | None]:
        return {"url": self.url, "version": self.version, "sha256": self.sha256,
                **({"commit": self.commit} if self.commit else {})}


SOURCES: Mapping[str, Source] = MappingProxyType({
    # SchedMD's release tag as GitHub archives it: the same bytes as Debian 13's slurm-wlm_24.11.5.orig.tar.gz, and
    # ParallelCluster's pin of this release.
    "slurm": Source("https://github.com/SchedMD/slurm/archive/refs/tags/slurm-24-11-5-1.tar.gz", SLURM_VERSION,
                    "e1a5547edd212c38b5e3230a284133f777b32746551f094aaa81cc4af375e332"),
    # Tag v0.24.0 = commit 107519944221822ea1dace4db8e7234b2eaa4cd5; the hash is of `git archive` of that commit as
    # GitHub packs it, and equals a third party's pin of GitHub's archive.
    "pyxis": Source("https://github.com/NVIDIA/pyxis/archive/refs/tags/v0.24.0.tar.gz", "0.24.0",
                    "9c4cdb79a67301d8ea05951aa4d2c205f40cf6145e338214b0191add8b36d6c4"),
    # No published digest, and GitHub's release assets could not be read where this was pinned: the commit the v4.2.1
    # tag names (read in third parties' records, not in a clone), with its submodules as that commit's tree pins them.
    # The bake checks the clone's HEAD against it, so a wrong commit fails the bake.
    "enroot": Source("https://github.com/NVIDIA/enroot.git", "4.2.1", None,
                     commit="ead3a25ed974948235d28f99fc387ac82435ce62"),
    # NVIDIA's nccl-tests for `gpucluster verify`'s all_reduce_perf (NVIDIA images only): tag v2.19.6, its newest
    # release, is commit a0b82b2260cf5152b9f8c061bbf7eaf0ba096432 (read in a clone of github.com/NVIDIA/nccl-tests).
    # GitHub's archives of it were not at hand to hash: cloned at the tag, HEAD checked against the commit, as enroot.
    "nccl-tests": Source("https://github.com/NVIDIA/nccl-tests.git", "2.19.6", None,
                         commit="a0b82b2260cf5152b9f8c061bbf7eaf0ba096432"),
    # NVIDIA's dcgm-exporter image by its linux/amd64 digest, pulled into the compute image (a tag can move).
    "dcgm-exporter": Source("nvcr.io/nvidia/k8s/dcgm-exporter:4.5.2-4.8.1-ubuntu22.04", "4.5.2-4.8.1",
                            "a7ad6547d4546eaf4dd5d6b4c0b4db4101e63ef7dc3cdff7f42b767d2c60b706"),
    # pip itself, for the venvs: the bake runs it from its wheel to install itself (no ensurepip, which is Ubuntu's
    # python3-venv and depends on exactly one python3). PyPI's wheel and its sha256 as PyPI's index lists them.
    "pip": Source("https://files.pythonhosted.org/packages/07/25/"
                  "ee8c38ae72d66b844ce8eb9711ba905dba21ca1a8a0c960057c41cd23337/pip-26.3-py3-none-any.whl", "26.3",
                  "f3b60b20ffaadd4415ed7957212a38ac63fa4c5fa375bd0f4a797777940fad13"),
})
# pyxis on the head too: srun reads its options (--container-image) from a login shell there.
HEAD_SOURCES = ("slurm", "pyxis", "pip")
COMPUTE_SOURCES = ("slurm", "pyxis", "enroot", "dcgm-exporter", "nccl-tests", "pip")


@dataclass(frozen=True)
class Role:
    """What one image role installs, by name: keys of bom.json's packages (apt, pip) and sources."""

    apt: tuple[str, ...]
    pip: tuple[str, ...]
    sources: tuple[str, ...]

    def as_dict(self) -> dict[str, list[str]]:
        return {"apt": sorted(self.apt), "pip": sorted(self.pip), "sources": sorted(self.sources)}


ROLES: Mapping[str, Role] = MappingProxyType({
    "head": Role((*HEAD_APT, *HEAD_THIRD_PARTY), HEAD_PIP, HEAD_SOURCES),
    "compute": Role((*COMPUTE_APT, *COMPUTE_THIRD_PARTY), COMPUTE_PIP, COMPUTE_SOURCES),
})


# --- a stack's BOM ----------------------------------------------------------------------------------------------------

def parents(stack: Stack) -> dict[ParentRole, ParentImage]:
    """The parent of each role the stack needs (ClusterSpec.parent_roles), as its stack file names it."""
    return {role: stack.spec.image.parent_images.parent(role) for role in stack.spec.parent_roles}


def document(stack: Stack) -> dict[str, Any]:
    """The stack's bom.json (/tmp/work/bom-format.md's contract with build_image.sh)."""
    from gpucluster.spec import ubuntu_lock

    snapshot = stack.spec.image.ubuntu_snapshot
    ubuntu = ubuntu_lock.load()[snapshot]
    return {
        "parent_image": stack.spec.image.parent_images.parent("gpu").as_dict(),
        "parent_images": {role: parent.as_dict() for role, parent in parents(stack).items()},
        "ubuntu_snapshot": snapshot,
        "slurm_version": SLURM_VERSION,
        "packages": {**{name: ubuntu[name] for name in UBUNTU_PACKAGES}, **THIRD_PARTY_APT,
                     **{name: p.version for name, p in PIP_PACKAGES.items()}},
        "pip_hashes": {name: [f"sha256:{p.sha256}"] for name, p in PIP_PACKAGES.items()},
        "sources": {name: source.as_dict() for name, source in SOURCES.items()},
        "roles": {name: role.as_dict() for name, role in ROLES.items()},
    }


def render(stack: Stack) -> str:
    """bom.json's text: the bytes `render` writes, the bake reads and the image's `gpucluster:bom` tag hashes."""
    return json.dumps(document(stack), indent=1, sort_keys=True) + "\n"


def digest(text: str) -> str:
    """The `gpucluster:bom` tag of an image baked from bom.json's text."""
    return hashlib.sha256(text.encode()).hexdigest()
