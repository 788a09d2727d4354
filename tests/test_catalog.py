"""The instance catalog against the real DescribeInstanceTypes answers that moto bundles, and the EFA layouts."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import moto
import pytest

from gpucluster.spec import catalog

EC2_FACTS = json.load(gzip.open(Path(moto.__file__).parent / "ec2" / "resources" / "instance_types.json.gz"))
ALL = {**catalog.ACCELERATED, **catalog.HEAD_NODE}
# Where EC2's answer and AWS's product documentation disagree, the catalog follows the documentation, and says so here.
MEMORY_DISAGREEMENTS = {
    # DescribeInstanceTypes reports 524288 MiB per Trainium2 device (8 TiB per instance); the trn2 product page
    # lists 1.5 TB of HBM for 16 chips, i.e. 96 GiB each.
    "trn2.48xlarge",
}


@pytest.mark.parametrize("name", sorted(ALL))
def test_hardware_facts_match_ec2(name: str) -> None:
    ours, ec2 = ALL[name], EC2_FACTS[name]
    net = ec2["NetworkInfo"]
    assert ours.vcpus == ec2["VCpuInfo"]["DefaultVCpus"]
    assert ours.memory_mib == ec2["MemoryInfo"]["SizeInMiB"]
    assert ours.network_cards == net["MaximumNetworkCards"]
    assert ours.efa_interfaces == (net.get("EfaInfo") or {}).get("MaximumEfaInterfaces", 0)
    assert ours.efa_supported == net["EfaSupported"]
    supports_efa_only = all("efa-only" in card.get("InterfaceTypes", []) for card in net["NetworkCards"])
    assert ours.efa_only == (supports_efa_only and ours.network_cards > 1)
    if name in catalog.ACCELERATED:
        assert ours.primary_network_gbps == net["NetworkCards"][0]["BaselineBandwidthInGbps"]
    devices = (ec2.get("GpuInfo") or {}).get("Gpus") or (ec2.get("NeuronInfo") or {}).get("NeuronDevices")
    if ours.accelerator is None:
        assert not devices
        return
    assert devices, f"EC2 reports no accelerator for {name}"
    (device,) = devices
    assert ours.accelerator.count == device["Count"]
    assert ours.accelerator.model == device["Name"]
    if name in MEMORY_DISAGREEMENTS:
        return
    # EC2 reports usable memory in MiB (an 80 GB H100 shows 81920, a 24 GB A10G 22888): within 10% of the nominal size.
    reported_mib = device["MemoryInfo"]["SizeInMiB"]
    assert abs(ours.accelerator.memory_gib_each * 1024 - reported_mib) <= 0.1 * reported_mib


def test_catalog_covers_the_supported_families() -> None:
    families = {t.family for t in catalog.ACCELERATED.values()}
    assert {"g5", "g6", "g6e", "p4d", "p4de", "p5", "p5e", "p5en", "p6-b200", "trn1", "trn2"} <= families


def test_prices_are_positive_and_dated() -> None:
    assert catalog.PRICE_DATE and catalog.PRICE_SOURCE and catalog.PRICE_REGION == "us-east-1"
    for t in ALL.values():
        assert t.on_demand_usd_per_hour is None or t.on_demand_usd_per_hour > 0


@pytest.mark.parametrize("name,interfaces", [("p4d.24xlarge", 4), ("p5.48xlarge", 32), ("p5en.48xlarge", 16),
                                             ("p6-b200.48xlarge", 8), ("trn1.32xlarge", 8), ("g6e.12xlarge", 1)])
def test_efa_layout(name: str, interfaces: int) -> None:
    layout = catalog.interface_layout(catalog.ACCELERATED[name], efa=True)
    assert len(layout) == interfaces
    assert (layout[0].network_card_index, layout[0].device_index, layout[0].interface_type) == (0, 0, "efa")
    assert [n.network_card_index for n in layout] == list(range(interfaces))
    assert all(n.device_index == 0 and n.interface_type == "efa-only" for n in layout[1:])


def test_no_efa_gives_one_plain_interface() -> None:
    layout = catalog.interface_layout(catalog.ACCELERATED["p5.48xlarge"], efa=False)
    assert [(n.network_card_index, n.device_index, n.interface_type) for n in layout] == [(0, 0, "interface")]
