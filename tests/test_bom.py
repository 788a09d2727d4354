"""The bill of materials (gpucluster/spec/bom.py): what `render` writes, the Ubuntu lock and its command, the
parents the stack file pins and how a change of them shows, and the head node's image."""

from __future__ import annotations

import json
import lzma
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from conftest import ROOT, STACK_FILES, of_type, planned
from gpucluster import cli
from gpucluster.node import nccl_tests
from gpucluster.plan import Declared, planned_ami_id, run_program
from gpucluster.project import pulumi_program
from gpucluster.spec import bom, ubuntu_lock
from gpucluster.spec.model import Stack, load_stack, stack_config, validate

CONTRACT_KEYS = {"parent_image", "parent_images", "ubuntu_snapshot", "slurm_version", "packages", "sources", "roles",
                 "pip_hashes"}


def _config(stack: str) -> dict[str, Any]:
    return json.loads(json.dumps(stack_config(load_stack(ROOT / "stacks" / f"Pulumi.{stack}.yaml"))))


# --- bom.json ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", STACK_FILES, ids=lambda p: p.name)
def test_render_writes_the_stacks_bom_and_every_role_name_resolves(path: Path, tmp_path: Path) -> None:
    stack = load_stack(path)
    assert cli.main(["render", str(path), "--out", str(tmp_path)]) == 0
    text = (tmp_path / "image" / "bom.json").read_text()
    assert text == bom.render(stack)
    doc = json.loads(text)
    assert set(doc) == CONTRACT_KEYS
    assert re.fullmatch(ubuntu_lock.SNAPSHOT_RE, doc["ubuntu_snapshot"]) and doc["slurm_version"] == bom.SLURM_VERSION
    # Each parent the stack needs, exactly as its stack file names it; the GPU pools' one also as `parent_image`.
    assert doc["parent_image"] == stack.spec.image.parent_images.gpu.image.as_dict()
    assert set(doc["parent_images"]) == set(stack.spec.parent_roles)
    for role, parent in doc["parent_images"].items():
        assert parent == getattr(stack.spec.image.parent_images, role).model_dump()
    # Ubuntu's packages at the versions the snapshot's lock entry gives.
    locked = ubuntu_lock.load()[doc["ubuntu_snapshot"]]
    assert {name: doc["packages"][name] for name in bom.UBUNTU_PACKAGES} == {n: locked[n] for n in bom.UBUNTU_PACKAGES}
    for source in doc["sources"].values():
        assert {"url", "sha256", "version"} <= set(source)
        assert source["sha256"] is None and re.fullmatch(r"[0-9a-f]{40}", source["commit"]) \
            or re.fullmatch(r"[0-9a-f]{64}", source["sha256"]), source
    assert doc["sources"]["slurm"]["version"] == bom.SLURM_VERSION
    for role in doc["roles"].values():
        assert set(role["apt"]) | set(role["pip"]) <= set(doc["packages"]), role
        assert set(role["sources"]) <= set(doc["sources"]), role
        for name in role["pip"]:  # pip install --require-hashes: every distribution with its hash
            assert [re.fullmatch(r"sha256:[0-9a-f]{64}", h) is not None for h in doc["pip_hashes"][name]] == [True]
    assert doc["roles"]["head"]["apt"] != doc["roles"]["compute"]["apt"]


def test_nccl_tests_is_pinned_at_the_release_whose_output_verify_reads() -> None:
    """The compute image's nccl-tests is a full commit (the bake checks its clone's HEAD against it), and the one
    release gpucluster/node/nccl_tests.py's reader names as the format it reads: a bump of one without the other
    fails here."""
    source = bom.SOURCES["nccl-tests"]
    assert source.commit and re.fullmatch(r"[0-9a-f]{40}", source.commit) and source.sha256 is None
    assert "nccl-tests" in bom.ROLES["compute"].sources and "nccl-tests" not in bom.ROLES["head"].sources
    read = re.search(r"NVIDIA/nccl-tests ([0-9a-f]{7,40}), v(\S+?),", nccl_tests.__doc__ or "")
    assert read, "nccl_tests.py names no nccl-tests commit and release"
    assert source.commit.startswith(read[1]) and source.version == read[2]


def test_apt_and_pip_names_do_not_collide() -> None:
    """bom.json keeps both in one `packages` mapping."""
    apt = {*bom.UBUNTU_PACKAGES, *bom.THIRD_PARTY_APT}
    assert not apt & set(bom.PIP_PACKAGES)
    assert set(bom.ROLES["head"].pip) | set(bom.ROLES["compute"].pip) == set(bom.PIP_PACKAGES)


def test_the_default_parents_are_exact_dated_releases() -> None:
    for role, parent in bom.PARENT_IMAGES.items():
        assert bom.release_date(parent.name) is not None, role
    assert bom.PARENT_IMAGES["gpu"].name == "Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 24.04) 20260915"
    assert bom.PARENT_IMAGES["head"].owner == "099720109477"  # Canonical's account


def test_the_default_snapshot_is_the_locks_newest_and_resolves_every_ubuntu_package() -> None:
    stack = load_stack(ROOT / "stacks" / "Pulumi.team-a.yaml")
    assert stack.spec.image.ubuntu_snapshot == max(ubuntu_lock.load())
    assert set(bom.UBUNTU_PACKAGES) <= set(ubuntu_lock.load()[stack.spec.image.ubuntu_snapshot])


# --- Debian version ordering and the lock command ---------------------------------------------------------------------

VERSION_PAIRS = [
    ("1.0", "1.0"), ("1.0", "1.0-0"), ("1.0~rc1", "1.0"), ("1.0~~", "1.0~"), ("1.0", "1.0+b1"), ("1.0", "1.0a"),
    ("1.0a", "1.0+"), ("1:0.9", "2.0"), ("2.0", "1:0.9"), ("0:2.0", "2.0"), ("1.10", "1.9"), ("1.010", "1.10"),
    ("1.0-1ubuntu1", "1.0-1ubuntu0.24.04.1"), ("1:10.11.14-0ubuntu0.24.04.1", "1:10.11.13-0ubuntu0.24.04.1"),
    ("1:10.11.14-0ubuntu0.24.04.1", "1:10.11.7-2ubuntu2"), ("2.45.3+ds-2ubuntu0.3", "2.45.3+ds-2ubuntu0.10"),
    ("3.12.3-0ubuntu2", "3.12.3-0ubuntu2.1"), ("1.7.0-1ubuntu0.3", "1.7.0-1build1"), ("5.0.1-4.1build1", "5.0.1-4.1"),
    ("1.2-3-4", "1.2-3-5"), ("1.0.", "1.0"), ("20231122+ds-1", "20231122-1"),
]


def _dpkg_says(a: str, b: str) -> int:
    dpkg = shutil.which("dpkg")
    assert dpkg, "dpkg is missing (Debian's dpkg package): it is the oracle of the version ordering"
    for op, result in (("lt", -1), ("eq", 0), ("gt", 1)):
        if subprocess.run([dpkg, "--compare-versions", a, op, b], capture_output=True).returncode == 0:
            return result
    raise AssertionError(f"dpkg orders neither way: {a} {b}")


@pytest.mark.parametrize(("a", "b"), [p for p in VERSION_PAIRS if p[0][0].isdigit()], ids=lambda v: v)
def test_version_order_is_dpkgs(a: str, b: str) -> None:
    assert ubuntu_lock.compare_versions(a, b) == _dpkg_says(a, b)
    assert ubuntu_lock.compare_versions(b, a) == -_dpkg_says(a, b)


def _stanza(name: str, version: str) -> str:
    return (f"Package: {name}\nArchitecture: amd64\nVersion: {version}\nPriority: optional\nSection: database\n"
            f"Depends: libc6 (>= 2.34),\n mariadb-server-core (= {version})\nDescription: {name}\n"
            " multi-line\n .\n description\n")


# One Packages index per pocket and component, in the real format: noble ships the release's version, -updates and
# -security list only the newest of theirs, which may be older in -security than in -updates.
INDEXES = {
    "dists/noble/main/binary-amd64/Packages": [("mariadb-server", "1:10.11.7-2ubuntu2"), ("munge", "0.5.15-4build1"),
                                              ("python3-venv", "3.12.3-0ubuntu1")],
    "dists/noble/universe/binary-amd64/Packages": [("prometheus", "2.45.3+ds-2build1")],
    "dists/noble-updates/main/binary-amd64/Packages": [("mariadb-server", "1:10.11.14-0ubuntu0.24.04.1"),
                                                      ("python3-venv", "3.12.3-0ubuntu2.1")],
    "dists/noble-updates/universe/binary-amd64/Packages": [("prometheus", "2.45.3+ds-2ubuntu0.3")],
    "dists/noble-security/main/binary-amd64/Packages": [("mariadb-server", "1:10.11.13-0ubuntu0.24.04.1"),
                                                       ("munge", "0.5.15-4ubuntu0.1")],
    "dists/noble-security/universe/binary-amd64/Packages": [("prometheus", "2.45.3+ds-2ubuntu0.2")],
}
NEWEST = {"mariadb-server": "1:10.11.14-0ubuntu0.24.04.1", "munge": "0.5.15-4ubuntu0.1",
          "python3-venv": "3.12.3-0ubuntu2.1", "prometheus": "2.45.3+ds-2ubuntu0.3"}


def test_the_newest_version_across_the_pockets_is_locked() -> None:
    indexes = ["\n".join(_stanza(n, v) for n, v in stanzas) for stanzas in INDEXES.values()]
    assert list(ubuntu_lock.packages(indexes[0])) == INDEXES["dists/noble/main/binary-amd64/Packages"]
    assert ubuntu_lock.newest(indexes, NEWEST) == NEWEST
    with pytest.raises(KeyError, match="no index of the snapshot lists iptables, slurmctld"):
        ubuntu_lock.newest(indexes, [*NEWEST, "slurmctld", "iptables"])


def test_image_lock_reads_the_snapshots_indexes_and_adds_its_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """The command end to end against an archive on disk (the snapshot service is a URL away; urllib reads file://
    alike). The entry goes beside the lock's others."""
    archive = tmp_path / "archive"
    for index, stanzas in INDEXES.items():
        (archive / index).parent.mkdir(parents=True, exist_ok=True)
        (archive / f"{index}.xz").write_bytes(lzma.compress("\n".join(_stanza(n, v) for n, v in stanzas).encode()))
    assert sorted(str(p.relative_to(archive)) for p in archive.rglob("*.xz")) == sorted(ubuntu_lock.index_paths())
    lock = tmp_path / "lock.json"
    lock.write_text(json.dumps({"20250101T000000Z": {"munge": "0.5.15-4build1"}}))
    monkeypatch.setattr(bom, "UBUNTU_PACKAGES", tuple(NEWEST))
    argv = ["image-lock", "--snapshot", "20261201T000000Z", "--archive", archive.as_uri(), "--lock", str(lock)]
    assert cli.main(argv) == 0
    assert ubuntu_lock.load(lock) == {"20250101T000000Z": {"munge": "0.5.15-4build1"}, "20261201T000000Z": NEWEST}
    monkeypatch.setattr(bom, "UBUNTU_PACKAGES", (*NEWEST, "slurmctld"))
    assert cli.main([*argv[:2], "20261202T000000Z", *argv[3:]]) == 1
    assert "slurmctld" in capsys.readouterr().err and "20261202T000000Z" not in ubuntu_lock.load(lock)
    assert cli.main(["image-lock", "--snapshot", "2026-12-01", "--lock", str(lock)]) == cli.EXIT_BAD_INPUT


def test_by_default_the_command_reads_the_snapshot_service() -> None:
    assert ubuntu_lock.archive_url("20261201T171259Z") == "https://snapshot.ubuntu.com/ubuntu/20261201T171259Z"


# --- the parents in the program and the plan --------------------------------------------------------------------------

def _recipes(declared: list[Declared]) -> dict[str, Declared]:
    return {r.name: r for r in of_type(declared, "imagebuilder/imageRecipe:ImageRecipe")}


def test_moving_a_parent_changes_only_that_images_recipe() -> None:
    """A newer GPU parent in the stack file: the compute image's recipe takes another AMI (a rebake at `up`); the
    head's stays. An id given for the region is taken as is."""
    config = _config("team-a")
    before = _recipes(list(planned(ROOT / "stacks" / "Pulumi.team-a.yaml")[1]))  # the session's plan of the file
    newer = "Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 24.04) 20261020"
    config["gpucluster:cluster"]["image"] = {"parent_images": {"gpu": {"name": newer, "owner": "amazon"}}}
    stack = validate("team-a", config)
    after = _recipes(run_program(stack, pulumi_program()))
    compute, head = "gpucluster-team-a-compute-nvidia", "gpucluster-team-a-head"
    assert after[compute].inputs["parentImage"] == planned_ami_id(f"{stack.region}/amazon/{newer}")
    assert after[compute].inputs["parentImage"] != before[compute].inputs["parentImage"]
    assert after[head].inputs == before[head].inputs
    config["gpucluster:cluster"]["image"]["parent_images"]["gpu"]["region_ids"] = {
        "us-west-2": "ami-0aaaaaaaaaaaaaaaa", stack.region: "ami-0123456789abcdef0"}
    pinned = _recipes(run_program(validate("team-a", config), pulumi_program()))
    assert pinned[compute].inputs["parentImage"] == "ami-0123456789abcdef0"


def test_plan_names_the_snapshot_and_parents_and_shows_a_change_of_them() -> None:
    def plan_text(stack: Stack) -> list[str]:
        from gpucluster.cli import image_inputs, image_lines

        images = image_inputs(stack)
        assert images is not None
        return image_lines(images)

    config = _config("team-b")  # head, NVIDIA and Trainium pools
    stack = validate("team-b", config)
    lines = plan_text(stack)
    assert stack.spec.image.ubuntu_snapshot in lines[0] and bom.digest(bom.render(stack)) in lines[0]
    for role in ("head", "gpu", "neuron"):
        parent = stack.spec.image.parent_images.parent(role)
        assert any(line.split()[:1] == [role] and parent.name in line and parent.owner in line for line in lines[1:])
    config["gpucluster:cluster"]["image"] = {"parent_images": {"neuron": {
        "name": "Deep Learning AMI Neuron (Ubuntu 24.04) 20261104", "owner": "amazon"}}}
    moved = plan_text(validate("team-b", config))
    assert [line for line in moved if line not in lines] == [
        moved[0], "  neuron  Deep Learning AMI Neuron (Ubuntu 24.04) 20261104 (owner amazon)"]


def test_plan_json_carries_the_image_inputs(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["plan", "team-a", "--json"]) == 0
    images = json.loads(capsys.readouterr().out)["images"]
    stack = load_stack(ROOT / "stacks" / "Pulumi.team-a.yaml")
    assert images == {"ubuntu_snapshot": stack.spec.image.ubuntu_snapshot, "bom_sha256": bom.digest(bom.render(stack)),
                      "parent_images": {role: p.as_dict() for role, p in bom.parents(stack).items()}}
    assert set(images["parent_images"]) == {"head", "gpu"}


# --- the head node's image ---------------------------------------------------------------------------------------

def test_the_head_takes_every_new_head_image_as_a_replacement_shown_at_preview() -> None:
    """Every image the head can take is exact (the bake of the stack's BOM, an ami_id, or the pinned Ubuntu parent):
    nothing makes Pulumi keep an old one, so a rebaked head image replaces the head at that `up` (delete first)."""
    _, declared = planned(ROOT / "stacks" / "Pulumi.team-a.yaml")
    (head,) = of_type(list(declared), "ec2/instance:Instance")
    assert head.ignore_changes == () and head.delete_before_replace
    assert head.inputs["ami"] == planned_ami_id("gpucluster-team-a-head")  # the bake's output, so its change too


def test_without_a_bake_the_head_boots_the_pinned_ubuntu_release() -> None:
    config = _config("team-a")
    config["gpucluster:cluster"]["image"] = {"build": False, "parent_images": {"head": {
        "name": "ubuntu/images/hvm-ssd-gp3/ubuntu-noble-24.04-amd64-server-20261015", "owner": "099720109477"}}}
    stack = validate("team-a", config)
    (head,) = of_type(run_program(stack, pulumi_program()), "ec2/instance:Instance")
    name = "ubuntu/images/hvm-ssd-gp3/ubuntu-noble-24.04-amd64-server-20261015"
    assert head.inputs["ami"] == planned_ami_id(f"{stack.region}/099720109477/{name}")
