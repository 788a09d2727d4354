"""Sections of one stack agree on its region, and the stacks of one directory and region keep their VPCs apart."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from conftest import ROOT
from gpucluster import cli
from gpucluster.spec import model
from gpucluster.spec.model import ZONE_KEYS, ClusterSpec, SpecError, load_stack_among_siblings, validate


def zone_fields(cls: type[BaseModel], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """The paths of every field named *availability_zone in the spec's models, however deep."""
    found = []
    for name, info in cls.model_fields.items():
        if name.endswith("availability_zone"):
            found.append((*prefix, name))
        for arg in (info.annotation, *getattr(info.annotation, "__args__", ())):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                found += zone_fields(arg, (*prefix, name))
    return found


def test_every_zone_key_of_the_spec_is_checked_against_the_region() -> None:
    assert sorted(zone_fields(ClusterSpec)) == sorted(ZONE_KEYS)


def kubernetes_stack(region: str, zone: str, control_plane_zone: str) -> dict[str, Any]:
    return {model.REGION_KEY: region, model.CONFIG_KEY: {
        "team": "vision", "availability_zone": zone, "scheduler": "kubernetes",
        "kubernetes": {"public_access_cidrs": ["operator"], "control_plane_availability_zone": control_plane_zone},
        "network": {"vpc_cidr": "10.42.0.0/16"},
        "pools": [{"name": "gpu", "instance_type": "g6.xlarge", "max_nodes": 1}],
        "storage": {"lustre": {"deployment_type": "SCRATCH_2", "storage_capacity_gib": 1200}},
        "budget": {"monthly_usd": 1000, "notify_emails": ["a@example.com"]}}}


@pytest.mark.parametrize(("zone", "control_plane_zone", "wrong"), [
    ("eu-west-1a", "us-east-1b", ["availability_zone"]),
    ("us-east-1a", "eu-west-1b", ["kubernetes.control_plane_availability_zone"]),
    ("eu-west-1a", "eu-west-1b", ["availability_zone", "kubernetes.control_plane_availability_zone"]),
])
def test_each_zone_in_another_region_is_named(zone: str, control_plane_zone: str, wrong: list[str]) -> None:
    with pytest.raises(SpecError) as err:
        validate("vision", kubernetes_stack("us-east-1", zone, control_plane_zone))
    named = [path.removeprefix(f"{model.CONFIG_KEY}.") for path, message in err.value.problems
             if "is not in region us-east-1" in message]
    assert named == wrong


def test_zones_of_the_region_pass() -> None:
    assert validate("vision", kubernetes_stack("us-east-1", "us-east-1a", "us-east-1b")).region == "us-east-1"


@contextlib.contextmanager
def bounded(seconds: float) -> Iterator[None]:
    """A regression that reads a FIFO blocks in read(2) for good: SIGALRM's handler raises out of it (PEP 475 retries
    a read only when the handler returns), so the test fails instead of hanging."""
    def expire(*_: Any) -> None:
        raise TimeoutError(f"still reading after {seconds} s: a FIFO was read")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def write_stack(folder: Path, name: str, region: str, cidr: str) -> Path:
    text = (ROOT / "stacks" / "Pulumi.dev.yaml").read_text()
    text = text.replace("aws:region: us-east-1", f"aws:region: {region}").replace("us-east-1a", f"{region}a")
    path = folder / f"Pulumi.{name}.yaml"
    path.write_text(text.replace("vpc_cidr: 10.40.0.0/16", f"vpc_cidr: {cidr}"))
    return path


def test_overlapping_vpcs_of_one_region_are_refused_naming_both_files(tmp_path: Path) -> None:
    mine = write_stack(tmp_path, "vision", "us-east-1", "10.40.0.0/16")
    other = write_stack(tmp_path, "speech", "us-east-1", "10.40.16.0/20")
    write_stack(tmp_path, "apart", "us-east-1", "10.41.0.0/16")
    with pytest.raises(SpecError) as err:
        load_stack_among_siblings(mine, pytest.fail)
    assert err.value.source == str(mine)
    assert err.value.problems == [(f"{model.CONFIG_KEY}.network.vpc_cidr",
                                   f"10.40.0.0/16 overlaps 10.40.16.0/20 of {other} (network.vpc_cidr, also in "
                                   "us-east-1): give each stack of a region a range of its own")]


def test_plan_refuses_the_overlap_as_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A FIFO among the siblings is skipped (a read would wait for a writer forever), said in a note."""
    mine = write_stack(tmp_path, "vision", "us-east-1", "10.40.0.0/16")
    other = write_stack(tmp_path, "speech", "us-east-1", "10.40.0.0/16")
    os.mkfifo(tmp_path / "Pulumi.pipe.yaml")
    with bounded(30):
        assert cli.main(["plan", str(mine)]) == 2
    err = capsys.readouterr().err
    assert str(mine) in err and str(other) in err and "network.vpc_cidr" in err and "Traceback" not in err
    assert f"gpucluster: note: {tmp_path / 'Pulumi.pipe.yaml'} skipped in the check of VPC ranges: not a regular " \
           "file (a FIFO)" in err.splitlines()[0]


def test_the_same_range_in_other_regions_or_unreadable_siblings_pass(tmp_path: Path) -> None:
    mine = write_stack(tmp_path, "vision", "us-east-1", "10.40.0.0/16")
    write_stack(tmp_path, "west", "us-west-2", "10.40.0.0/16")
    (tmp_path / "Pulumi.broken.yaml").write_text("config: [10.40.0.0/16\n")
    (tmp_path / "Pulumi.alias.yaml").write_text("config: &a {aws:region: us-east-1, x: *a}\n")
    os.mkfifo(tmp_path / "Pulumi.pipe.yaml")  # nobody writes to it: reading it would wait forever
    (tmp_path / "Pulumi.folder.yaml").mkdir()
    notes: list[str] = []
    with bounded(30):
        assert load_stack_among_siblings(mine, notes.append).name == "vision"
    assert notes == [f"{tmp_path / name} skipped in the check of VPC ranges: not a regular file ({kind}): a stack "
                     "file is a file of text" for name, kind in (("Pulumi.folder.yaml", "a directory"),
                                                                 ("Pulumi.pipe.yaml", "a FIFO"))]


def test_the_shipped_stacks_keep_apart() -> None:
    for path in sorted((ROOT / "stacks").glob("Pulumi.*.yaml")):
        assert load_stack_among_siblings(path, pytest.fail).name == path.name.split(".")[1]
