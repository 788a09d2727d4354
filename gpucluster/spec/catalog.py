"""Facts about the EC2 instance types gpucluster supports.

Hardware facts come from EC2 DescribeInstanceTypes (tests cross-check them against the snapshot of real answers that
moto bundles). Prices are Linux on-demand rates in the reference region, recorded by hand from the public EC2 pricing
page on PRICE_DATE; `preflight` replaces them with live prices for the stack's region. A type whose on-demand price is
not published for the reference region carries no price, and the plan says so instead of guessing.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Literal

PRICE_REGION = "us-east-1"
PRICE_DATE = "2025-06-01"
PRICE_SOURCE = "AWS EC2 On-Demand pricing page, Linux, us-east-1 (rates after the June 2025 GPU price change)"

AcceleratorKind = Literal["nvidia", "neuron"]

# EC2 Image Builder (components/image.py). Nothing in the build uses an accelerator (packages, Slurm's and pyxis's
# compiles, pip downloads), so a general-purpose x86_64 type boots the DLAMIs and Ubuntu alike: 4 vCPUs for the
# compiles and the unpacking of the torch wheels, 16 GiB for pip. Three generations of the same shape, so that an AZ
# out of one (or without it) does not fail the bake: Image Builder launches whichever of them has capacity. The first
# is the dearest of the three (m6i.xlarge and m5.xlarge are $0.192/h in the reference region): the estimates use it.
IMAGE_BUILD_INSTANCE_TYPES = ("m7i.xlarge", "m6i.xlarge", "m5.xlarge")
# Expected build-instance time per image: launch, apt, enroot, pyxis, the torch wheels (~3 GB), then Image Builder
# stops the instance to snapshot it. An estimate, rounded up; EC2 bills by the second.
IMAGE_BUILD_HOURS = 1.0
# Amazon EBS snapshots, standard tier, $/GB-month: the EBS pricing page's us-east-1 rate, long unchanged, taken as of
# PRICE_DATE (not re-read from the page then). Image Builder itself is free: a build costs its instance time and the
# AMI's snapshot.
EBS_SNAPSHOT_USD_PER_GB_MONTH = 0.05


@dataclass(frozen=True)
class Accelerator:
    kind: AcceleratorKind
    model: str
    count: int
    memory_gib_each: int

    @property
    def memory_gib_total(self) -> int:
        return self.count * self.memory_gib_each


@dataclass(frozen=True)
class InstanceType:
    name: str
    vcpus: int
    memory_mib: int
    accelerator: Accelerator | None
    network_cards: int
    efa_interfaces: int  # 0: no EFA
    # Whether the type takes `efa-only` interfaces (EFA device, no IP address) beside the primary interface.
    efa_only: bool
    on_demand_usd_per_hour: float | None

    @property
    def family(self) -> str:
        return self.name.split(".", 1)[0]

    @property
    def efa_supported(self) -> bool:
        return self.efa_interfaces > 0

    @property
    def instance_store(self) -> InstanceStore | None:
        """The type's NVMe instance store; None when it has none."""
        return INSTANCE_STORE.get(self.name)

    @property
    def all_reduce(self) -> AllReduceFigure | None:
        """The type's published nccl-tests all_reduce bus bandwidth across nodes; None when none is sourced."""
        return ALL_REDUCE_BUSBW.get(self.name)

    @property
    def primary_network_gbps(self) -> float:
        """The baseline bandwidth of network card 0, which carries the node's TCP traffic (Lustre's among it)."""
        return PRIMARY_NETWORK_GBPS[self.name]

    @property
    def provision_minutes(self) -> int:
        """How long a new node of this type may take from launch to Ready with its accelerators advertised."""
        return NODE_PROVISION_MINUTES[self.family]


@dataclass(frozen=True)
class InstanceStore:
    """NVMe instance store volumes: `count` disks of `size_gb` GB (10^9 bytes) each, as EC2 states them."""

    count: int
    size_gb: int

    @property
    def total_gb(self) -> int:
        return self.count * self.size_gb


# model, count, GiB of memory each
_gpu = partial(Accelerator, "nvidia")
_neuron = partial(Accelerator, "neuron")


# name, vCPUs, memory MiB, accelerator, network cards, EFA interfaces, efa-only, $/h on demand
_TYPES = [
    # NVIDIA A10G
    InstanceType("g5.xlarge", 4, 16384, _gpu("A10G", 1, 24), 1, 0, False, 1.006),
    InstanceType("g5.12xlarge", 48, 196608, _gpu("A10G", 4, 24), 1, 1, False, 5.672),
    InstanceType("g5.48xlarge", 192, 786432, _gpu("A10G", 8, 24), 1, 1, False, 16.288),
    # NVIDIA L4
    InstanceType("g6.xlarge", 4, 16384, _gpu("L4", 1, 24), 1, 0, False, 0.8048),
    InstanceType("g6.12xlarge", 48, 196608, _gpu("L4", 4, 24), 1, 1, False, 4.6016),
    InstanceType("g6.48xlarge", 192, 786432, _gpu("L4", 8, 24), 1, 1, False, 13.3504),
    # NVIDIA L40S
    InstanceType("g6e.xlarge", 4, 32768, _gpu("L40S", 1, 48), 1, 0, False, 1.861),
    InstanceType("g6e.12xlarge", 48, 393216, _gpu("L40S", 4, 48), 1, 1, False, 10.49264),
    InstanceType("g6e.48xlarge", 192, 1572864, _gpu("L40S", 8, 48), 4, 4, True, 30.13118),
    # NVIDIA A100
    InstanceType("p4d.24xlarge", 96, 1179648, _gpu("A100", 8, 40), 4, 4, True, 21.96),
    InstanceType("p4de.24xlarge", 96, 1179648, _gpu("A100", 8, 80), 4, 4, True, 27.45),
    # NVIDIA H100 / H200
    InstanceType("p5.48xlarge", 192, 2097152, _gpu("H100", 8, 80), 32, 32, True, 55.04),
    InstanceType("p5e.48xlarge", 192, 2097152, _gpu("H200", 8, 141), 32, 32, True, None),
    InstanceType("p5en.48xlarge", 192, 2097152, _gpu("H200", 8, 141), 16, 16, True, 63.296),
    # NVIDIA B200
    InstanceType("p6-b200.48xlarge", 192, 2097152, _gpu("B200", 8, 179), 8, 8, True, 113.9328),
    # AWS Trainium
    InstanceType("trn1.2xlarge", 8, 32768, _neuron("Trainium", 1, 32), 1, 0, False, 1.34375),
    InstanceType("trn1.32xlarge", 128, 524288, _neuron("Trainium", 16, 32), 8, 8, True, 21.50),
    InstanceType("trn2.48xlarge", 192, 2097152, _neuron("Trainium2", 16, 96), 16, 16, True, None),
]

# Types for the head node (no accelerator): Slurm controller, slurmdbd and MariaDB.
_HEAD_TYPES = [
    InstanceType("m7i.large", 2, 8192, None, 1, 0, False, 0.1008),
    InstanceType("m7i.xlarge", 4, 16384, None, 1, 0, False, 0.2016),
    InstanceType("m7i.2xlarge", 8, 32768, None, 1, 0, False, 0.4032),
    InstanceType("m7i.4xlarge", 16, 65536, None, 1, 0, False, 0.8064),
    InstanceType("c7i.2xlarge", 8, 16384, None, 1, 0, False, 0.357),
    InstanceType("r7i.2xlarge", 8, 65536, None, 1, 0, False, 0.5292),
]

# NVMe instance store per type: DescribeInstanceTypes' InstanceStorageInfo.Disks (the snapshot moto bundles, which the
# tests compare with this table; the EC2 instance type pages list the same disks). The head-node types have none.
INSTANCE_STORE = {
    "g5.xlarge": InstanceStore(1, 250), "g5.12xlarge": InstanceStore(1, 3800), "g5.48xlarge": InstanceStore(2, 3800),
    "g6.xlarge": InstanceStore(1, 250), "g6.12xlarge": InstanceStore(4, 940), "g6.48xlarge": InstanceStore(8, 940),
    "g6e.xlarge": InstanceStore(1, 250), "g6e.12xlarge": InstanceStore(2, 1900),
    "g6e.48xlarge": InstanceStore(4, 1900),
    "p4d.24xlarge": InstanceStore(8, 1000), "p4de.24xlarge": InstanceStore(8, 1000),
    "p5.48xlarge": InstanceStore(8, 3800), "p5e.48xlarge": InstanceStore(8, 3800),
    "p5en.48xlarge": InstanceStore(8, 3800), "p6-b200.48xlarge": InstanceStore(8, 3800),
    "trn1.2xlarge": InstanceStore(1, 474), "trn1.32xlarge": InstanceStore(4, 1900),
    "trn2.48xlarge": InstanceStore(4, 1900),
}

@dataclass(frozen=True)
class AllReduceFigure:
    """nccl-tests' all_reduce_perf across two nodes of a type, as published: the bus bandwidth (GB/s, out-of-place) at
    the largest message size of the published sweep, and where it was published."""

    published_gbps: float
    message_bytes: int  # the sweep's largest size; busbw does not fall at larger sizes, so a sweep must reach it
    source: str

    @property
    def floor_gbps(self) -> float:
        """What `gpucluster verify` requires (ALL_REDUCE_FLOOR_FRACTION of the published figure)."""
        return round(self.published_gbps * ALL_REDUCE_FLOOR_FRACTION, 1)


# `verify` fails a pool below 90% of the published figure. The published runs are one pair of nodes each, on the
# software of their day (NCCL, aws-ofi-nccl, EFA installer), and a cluster placement group does not promise the same
# spine hops: 10% leaves room for that spread, and a real fault stays far below it (NCCL over TCP sockets instead of
# EFA reaches a small fraction of these figures).
ALL_REDUCE_FLOOR_FRACTION = 0.9
_NCCL_TESTS_README = ("aws-samples/awsome-distributed-training micro-benchmarks/nccl-tests/README.md (commit 0162aac), "
                      "'Results', 2 nodes, all_reduce_perf out-of-place busbw at the largest size")
# Types without a published figure here get none: `verify` then warns instead of judging the bandwidth.
ALL_REDUCE_BUSBW: dict[str, AllReduceFigure] = {
    "p5.48xlarge": AllReduceFigure(487.09, 16 * 2**30, _NCCL_TESTS_README),
    "p4de.24xlarge": AllReduceFigure(78.33, 2 * 2**30, _NCCL_TESTS_README),
    # p4d's own run is not published; it has p4de's network (4 x 100 Gbps EFA, DescribeInstanceTypes) and its A100
    # NVSwitch board, and the two-node all_reduce is bound by the network: p4de's figure.
    "p4d.24xlarge": AllReduceFigure(78.33, 2 * 2**30, f"{_NCCL_TESTS_README} (p4de.24xlarge's run)"),
}

# Baseline bandwidth of network card 0 in Gbps: DescribeInstanceTypes' NetworkInfo.NetworkCards[0]
# .BaselineBandwidthInGbps (the snapshot moto bundles; the tests compare). A Lustre client's TCP traffic goes through
# the primary interface on card 0, so this bounds what one node reads from or writes to /fsx; an "up to" type's
# baseline is far below its burst (g6.xlarge: 2.5 of "up to 10" Gbps).
PRIMARY_NETWORK_GBPS = {
    "g5.xlarge": 2.5, "g5.12xlarge": 40.0, "g5.48xlarge": 100.0,
    "g6.xlarge": 2.5, "g6.12xlarge": 40.0, "g6.48xlarge": 100.0,
    "g6e.xlarge": 2.5, "g6e.12xlarge": 100.0, "g6e.48xlarge": 400.0,
    "p4d.24xlarge": 100.0, "p4de.24xlarge": 100.0,
    "p5.48xlarge": 100.0, "p5e.48xlarge": 100.0, "p5en.48xlarge": 200.0, "p6-b200.48xlarge": 200.0,
    "trn1.2xlarge": 3.125, "trn1.32xlarge": 100.0, "trn2.48xlarge": 200.0,
}

# Minutes from launch to a Ready node whose device plugin advertises its accelerators, per family: the Cluster
# Autoscaler's --max-node-provision-time must cover it, or it gives a booting node up and its instance may stay
# behind, running and billed, outside the autoscaler's count (kubernetes/autoscaler#6810: a g4dn instance orphaned
# more than 8 hours with 5m). Sources: an EKS user's GPU nodes joined and ran pods within 4 to 6 minutes
# (kubernetes/autoscaler#3464): 10 minutes leaves room for the driver and device plugin. No published join time for
# P and Trn types was found; AWS says GPU types and types with instance store boot slower
# (awslabs/amazon-eks-ami#1099), and these add NVSwitch fabric training (Fabric Manager), up to 32 EFA interfaces and
# the NVMe RAID at boot: 20 minutes, above the autoscaler's own 15-minute default (its FAQ) and Karpenter's 15-minute
# registration timeout (aws/karpenter-provider-aws#4102). The real figure is for a real account to measure
# (docs/explanation/kubernetes.md, what only AWS can prove).
NODE_PROVISION_MINUTES = {"g5": 10, "g6": 10, "g6e": 10, "trn1": 20,
                          "p4d": 20, "p4de": 20, "p5": 20, "p5e": 20, "p5en": 20, "p6-b200": 20, "trn2": 20}

ACCELERATED: dict[str, InstanceType] = {t.name: t for t in _TYPES}
HEAD_NODE: dict[str, InstanceType] = {t.name: t for t in _HEAD_TYPES}


def lookup(name: str) -> InstanceType:
    """The catalog entry for `name`, accelerated or head-node type. KeyError when unknown."""
    return ACCELERATED.get(name) or HEAD_NODE[name]


@dataclass(frozen=True)
class NetworkInterface:
    """One interface of a launch template: where it sits and what kind it is."""

    network_card_index: int
    device_index: int
    interface_type: Literal["interface", "efa", "efa-only"]


def interface_layout(itype: InstanceType, efa: bool) -> list[NetworkInterface]:
    """The network interfaces a node of this type gets.

    Card 0 device 0 is the primary interface (ENA, plus an EFA device when EFA is on). Each further EFA interface goes
    on its own network card at device 0, as `efa-only` where the type supports it: it carries EFA traffic without
    taking an IP address, which is the layout current EC2 guidance gives for multi-card types.
    """
    if not efa:
        return [NetworkInterface(0, 0, "interface")]
    extra: Literal["efa", "efa-only"] = "efa-only" if itype.efa_only else "efa"
    return [NetworkInterface(0, 0, "efa")] + [
        NetworkInterface(card, 0, extra) for card in range(1, itype.efa_interfaces)
    ]


# The AWS regions of the commercial partition (`aws`) a stack may name in `aws:region`: the partition's region list in
# botocore 1.44.8's data/endpoints.json, recorded 2026-11-30. The program writes `arn:aws:` ARNs, so the China and
# GovCloud partitions are left out on purpose. A region AWS opened later is refused until it is added here.
REGIONS_SOURCE = "botocore 1.44.8 data/endpoints.json, partition aws, recorded 2026-11-30"
AWS_REGIONS = frozenset({
    "af-south-1", "ap-east-1", "ap-east-2", "ap-northeast-1", "ap-northeast-2", "ap-northeast-3", "ap-south-1",
    "ap-south-2", "ap-southeast-1", "ap-southeast-2", "ap-southeast-3", "ap-southeast-4", "ap-southeast-5",
    "ap-southeast-6", "ap-southeast-7", "ca-central-1", "ca-west-1", "eu-central-1", "eu-central-2", "eu-north-1",
    "eu-south-1", "eu-south-2", "eu-west-1", "eu-west-2", "eu-west-3", "il-central-1", "me-central-1", "me-south-1",
    "mx-central-1", "sa-east-1", "us-east-1", "us-east-2", "us-west-1", "us-west-2",
})


# Spot: what AWS's Spot Instance Advisor published for Linux, per region: the savings over On-Demand in percent
# ("Savings compared to On-Demand are calculated over the last 30 days", averaged across the region's AZs) and the
# frequency of interruption, the band of the rate at which Spot reclaimed capacity in the trailing month. Read from the
# advisor's feed (https://spot-bid-advisor.s3.amazonaws.com/spot-advisor-data.json, "s" and "r" of spot_advisor.<region>
# .Linux.<type>) as copied into alexei-led/spotinfo's internal/spot/data/spot-advisor-data.json at commit 5bdc33c
# (SPOT_DATE). A type the feed has no figure for in a region (p5e, p6-b200 and trn2 anywhere) gets no typical price
# there: the plan shows the on-demand ceiling alone and says so. `preflight` reads the live spot price instead. Left out
# on purpose: p5.48xlarge in ca-central-1, where the feed gives -62% (a typical price above the on-demand ceiling: the
# figure cannot be read as a discount on the catalog's rate).
SPOT_DATE = "2025-06-28"
SPOT_SOURCE = "AWS Spot Instance Advisor feed (spot-advisor-data.json), Linux, savings over the last 30 days"
INTERRUPTION_BANDS = ("<5%", "5-10%", "10-15%", "15-20%", ">20%")
# type: {region: (savings over on-demand %, interruption band index)}
SPOT_ADVISOR: dict[str, dict[str, tuple[int, int]]] = {
    "g5.xlarge": {"ap-northeast-1": (51, 2), "ap-northeast-2": (48, 4), "ap-south-1": (69, 4),
        "ap-southeast-2": (71, 3), "ap-southeast-3": (76, 4), "ca-central-1": (61, 4), "eu-central-1": (59, 4),
        "eu-north-1": (72, 1), "eu-west-1": (56, 2), "eu-west-2": (66, 1), "il-central-1": (61, 3),
        "me-central-1": (62, 1), "sa-east-1": (82, 4), "us-east-1": (59, 4), "us-east-2": (58, 2),
        "us-west-2": (63, 4)},
    "g5.12xlarge": {"ap-northeast-1": (69, 4), "ap-northeast-2": (56, 0), "ap-south-1": (68, 4),
        "ap-southeast-2": (83, 4), "ap-southeast-3": (89, 1), "ca-central-1": (64, 3), "eu-central-1": (80, 4),
        "eu-north-1": (76, 4), "eu-west-1": (56, 4), "eu-west-2": (67, 4), "il-central-1": (62, 4),
        "me-central-1": (76, 0), "sa-east-1": (82, 0), "us-east-1": (58, 4), "us-east-2": (63, 4),
        "us-west-2": (70, 4)},
    "g5.48xlarge": {"ap-northeast-1": (67, 0), "ap-northeast-2": (16, 0), "ap-south-1": (89, 1),
        "ap-southeast-2": (80, 0), "ap-southeast-3": (89, 0), "ca-central-1": (44, 1), "eu-central-1": (54, 0),
        "eu-north-1": (87, 2), "eu-west-1": (57, 0), "eu-west-2": (64, 0), "il-central-1": (16, 0),
        "me-central-1": (9, 0), "sa-east-1": (43, 0), "us-east-1": (71, 4), "us-east-2": (77, 4),
        "us-west-2": (72, 4)},
    "g6.xlarge": {"ap-northeast-1": (56, 4), "ap-northeast-2": (71, 4), "ap-south-1": (76, 2),
        "ap-southeast-2": (68, 0), "ap-southeast-5": (51, 2), "ca-central-1": (61, 1), "eu-central-1": (64, 2),
        "eu-central-2": (69, 3), "eu-north-1": (69, 1), "eu-south-2": (60, 2), "eu-west-2": (64, 3),
        "eu-west-3": (59, 4), "sa-east-1": (86, 3), "us-east-1": (49, 4), "us-east-2": (58, 4), "us-west-2": (47, 4)},
    "g6.12xlarge": {"ap-northeast-1": (62, 4), "ap-northeast-2": (76, 3), "ap-south-1": (89, 1),
        "ap-southeast-2": (71, 1), "ap-southeast-5": (35, 2), "ca-central-1": (65, 0), "eu-central-1": (65, 0),
        "eu-central-2": (68, 3), "eu-north-1": (74, 1), "eu-south-2": (66, 4), "eu-west-2": (65, 3),
        "eu-west-3": (56, 4), "sa-east-1": (89, 2), "us-east-1": (59, 4), "us-east-2": (60, 4), "us-west-2": (62, 4)},
    "g6.48xlarge": {"ap-northeast-1": (69, 2), "ap-northeast-2": (69, 0), "ap-south-1": (89, 1),
        "ap-southeast-2": (88, 1), "ap-southeast-5": (38, 4), "ca-central-1": (64, 1), "eu-central-1": (89, 0),
        "eu-central-2": (69, 2), "eu-north-1": (88, 4), "eu-south-2": (48, 3), "eu-west-2": (65, 2),
        "eu-west-3": (72, 2), "sa-east-1": (89, 1), "us-east-1": (69, 4), "us-east-2": (78, 4), "us-west-2": (72, 4)},
    "g6e.xlarge": {"ap-northeast-1": (65, 0), "ap-northeast-2": (55, 1), "eu-central-1": (68, 4),
        "eu-north-1": (63, 4), "eu-south-2": (77, 2), "us-east-1": (58, 1), "us-east-2": (65, 4),
        "us-west-2": (50, 4)},
    "g6e.12xlarge": {"ap-northeast-1": (60, 0), "ap-northeast-2": (61, 0), "eu-central-1": (59, 2),
        "eu-north-1": (70, 4), "eu-south-2": (62, 0), "us-east-1": (56, 4), "us-east-2": (57, 2),
        "us-west-2": (54, 4)},
    "g6e.48xlarge": {"ap-northeast-1": (69, 0), "ap-northeast-2": (71, 0), "eu-central-1": (78, 0),
        "eu-north-1": (79, 0), "eu-south-2": (62, 4), "us-east-1": (68, 4), "us-east-2": (79, 4),
        "us-west-2": (66, 2)},
    "p4d.24xlarge": {"ap-northeast-1": (54, 0), "ap-northeast-2": (57, 0), "ap-south-1": (90, 0),
        "ap-southeast-2": (79, 0), "eu-central-1": (47, 4), "eu-west-1": (34, 4), "sa-east-1": (90, 0),
        "us-east-1": (67, 2), "us-east-2": (66, 1), "us-west-2": (53, 4)},
    "p4de.24xlarge": {"ap-northeast-1": (90, 0), "ap-southeast-1": (90, 0), "eu-central-1": (90, 0),
        "il-central-1": (90, 0), "us-east-1": (65, 0), "us-west-2": (67, 3)},
    "p5.48xlarge": {"ap-northeast-1": (44, 2), "ap-south-1": (81, 1), "ap-southeast-2": (27, 3),
        "eu-north-1": (55, 0), "eu-west-2": (39, 2), "sa-east-1": (83, 1),
        "us-east-1": (52, 4), "us-east-2": (61, 1), "us-west-1": (73, 1), "us-west-2": (46, 1)},
    "p5en.48xlarge": {"ap-northeast-1": (58, 1), "ap-northeast-2": (68, 1), "ap-south-1": (85, 0),
        "ap-southeast-3": (85, 1), "eu-south-2": (70, 4), "us-east-1": (64, 0), "us-east-2": (65, 4),
        "us-west-1": (90, 0), "us-west-2": (63, 0)},
    "trn1.2xlarge": {"us-east-1": (74, 0), "us-east-2": (87, 0), "us-west-2": (72, 1)},
    "trn1.32xlarge": {"us-east-1": (79, 0), "us-east-2": (90, 2), "us-west-2": (69, 0)},
}


@dataclass(frozen=True)
class SpotFigure:
    """The advisor's figures for a type in a region."""

    savings_percent: int
    interruption_band: int

    @property
    def interruptions(self) -> str:
        return INTERRUPTION_BANDS[self.interruption_band]


def spot_figure(instance_type: str, region: str) -> SpotFigure | None:
    """The advisor's savings and interruption band for the type in the region; None when it published none."""
    figure = SPOT_ADVISOR.get(instance_type, {}).get(region)
    return SpotFigure(*figure) if figure else None


# The Lustre version of the file systems the stacks create (components/storage.py); `gpucluster verify` holds a node's
# client to it. Data repository associations need 2.12+; 2.15 is the newest client the DLAMIs ship.
LUSTRE_VERSION = "2.15"

# FSx for Lustre's disk throughput per TiB of SSD storage, MB/s, (read, write): the FSx for Lustre User Guide,
# "Performance characteristics of SSD and HDD storage classes" (ssd-storage.html), the baseline column of disk
# throughput. SCRATCH_2: 200 read, 100 write; PERSISTENT_2: its throughput tier both ways (125 and 250 burst to 500,
# not counted). Sustained sequential I/O meets the disk, not the network's higher figures (SCRATCH_2: 200 baseline,
# 1300 burst) nor the servers' RAM cache: the baseline is what a file system promises for a long write or read.
LUSTRE_DISK_MBPS_PER_TIB: dict[tuple[str, int | None], tuple[int, int]] = {
    ("SCRATCH_2", None): (200, 100),
    ("PERSISTENT_2", 125): (125, 125),
    ("PERSISTENT_2", 250): (250, 250),
    ("PERSISTENT_2", 500): (500, 500),
    ("PERSISTENT_2", 1000): (1000, 1000),
}
