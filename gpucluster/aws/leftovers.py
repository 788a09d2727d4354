"""What is still tagged with a stack, and what it bills: `gpucluster leftovers STACK`, after a destroy.

The Resource Groups Tagging API lists every resource of the region that carries the stack's tag; each is priced from
the same reference rates as the plan, where its size or type can be read. The API also lists a resource for a while
after it is deleted: those found gone (a terminated instance, a deleted NAT gateway) are left out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpucluster.contract.settings import STACK_TAG
from gpucluster.spec import catalog, cost

BUCKET_PAGES = 20  # ListObjectsV2 pages read to size a bucket (1000 objects each); beyond that the figure is a floor


@dataclass(frozen=True)
class Leftover:
    arn: str
    kind: str  # service:resource-type, e.g. ec2:instance, s3:bucket
    monthly_usd: float | None  # None: not priced (free, billed by use, or unknown)
    detail: str


def kind_of(arn: str) -> tuple[str, str]:
    """(kind, resource id) of an ARN: arn:aws:ec2:us-east-1:123:instance/i-1 -> ("ec2:instance", "i-1");
    arn:aws:s3:::bucket -> ("s3:bucket", "bucket"); arn:aws:sns:us-east-1:123:topic -> ("sns", "topic")."""
    parts = arn.split(":", 5)
    service, resource = parts[2], parts[5]
    if service == "s3":
        return "s3:bucket", resource
    for separator in ("/", ":"):
        if separator in resource:
            kind, _, ident = resource.partition(separator)
            return f"{service}:{kind}", ident
    return service, resource  # a topic or a queue: the ARN ends with its name


def find(clients: dict[str, Any], stack_name: str) -> list[Leftover]:
    """Every resource tagged `gpucluster:stack=<stack_name>` in the clients' region, priced."""
    found = []
    pages = clients["resourcegroupstaggingapi"].get_paginator("get_resources").paginate(
        TagFilters=[{"Key": STACK_TAG, "Values": [stack_name]}])
    for page in pages:
        for mapping in page["ResourceTagMappingList"]:
            leftover = _priced(clients, mapping["ResourceARN"])
            if leftover is not None:
                found.append(leftover)
    return sorted(found, key=lambda item: (item.kind, item.arn))


def _priced(clients: dict[str, Any], arn: str) -> Leftover | None:
    """The resource with its monthly cost; None when it turns out to be gone."""
    from botocore.exceptions import ClientError

    kind, ident = kind_of(arn)
    try:
        price = PRICERS.get(kind)
        if price is None:
            return Leftover(arn, kind, None, "not priced here (free or billed by use)")
        priced = price(clients, ident)
    except ClientError as exc:
        if "NotFound" in exc.response["Error"]["Code"] or exc.response["Error"]["Code"] == "NoSuchBucket":
            return None
        return Leftover(arn, kind, None, f"could not be read: {exc.response['Error']['Code']}")
    return None if priced is None else Leftover(arn, kind, priced[0], priced[1])


def _instance(clients: dict[str, Any], ident: str) -> tuple[float | None, str] | None:
    reservations = clients["ec2"].describe_instances(InstanceIds=[ident])["Reservations"]
    instance = next((i for r in reservations for i in r["Instances"]), None)
    if instance is None or instance["State"]["Name"] == "terminated":
        return None
    state, itype = instance["State"]["Name"], instance["InstanceType"]
    if state != "running" and state != "pending":
        return 0.0, f"{itype}, {state} (its volumes bill)"
    try:
        hourly = catalog.lookup(itype).on_demand_usd_per_hour
    except KeyError:  # a type the catalog does not carry
        hourly = None
    return (None if hourly is None else hourly * cost.HOURS_PER_MONTH), f"{itype}, {state}"


def _volume(clients: dict[str, Any], ident: str) -> tuple[float, str]:
    volume = clients["ec2"].describe_volumes(VolumeIds=[ident])["Volumes"][0]
    detail = f"{volume['Size']} GiB {volume.get('VolumeType', '')}, {volume['State']}"
    return volume["Size"] * cost.GP3_USD_PER_GIB_MONTH, detail


def _snapshot(clients: dict[str, Any], ident: str) -> tuple[float, str]:
    snapshot = clients["ec2"].describe_snapshots(SnapshotIds=[ident])["Snapshots"][0]
    size = snapshot["VolumeSize"]
    return size * catalog.EBS_SNAPSHOT_USD_PER_GB_MONTH, f"{size} GiB (priced at the full volume: an upper bound)"


def _image(clients: dict[str, Any], ident: str) -> tuple[float, str] | None:
    images = clients["ec2"].describe_images(ImageIds=[ident])["Images"]
    if not images:
        return None
    return 0.0, f"{images[0].get('Name', '')} (its snapshots bill, listed on their own when tagged)"


def _nat_gateway(clients: dict[str, Any], ident: str) -> tuple[float, str] | None:
    gateway = clients["ec2"].describe_nat_gateways(NatGatewayIds=[ident])["NatGateways"][0]
    if gateway["State"] in ("deleted", "deleting"):
        return None
    return cost.NAT_GATEWAY_USD_PER_HOUR * cost.HOURS_PER_MONTH, f"{gateway['State']}, plus its data processed"


def _elastic_ip(clients: dict[str, Any], ident: str) -> tuple[float, str]:
    clients["ec2"].describe_addresses(AllocationIds=[ident])
    return cost.PUBLIC_IPV4_USD_PER_HOUR * cost.HOURS_PER_MONTH, "a public IPv4 address"


def _vpc_endpoint(clients: dict[str, Any], ident: str) -> tuple[float, str] | None:
    endpoint = clients["ec2"].describe_vpc_endpoints(VpcEndpointIds=[ident])["VpcEndpoints"][0]
    if endpoint["State"].lower() in ("deleted", "deleting"):
        return None
    if endpoint["VpcEndpointType"] != "Interface":
        return 0.0, f"{endpoint['ServiceName']} ({endpoint['VpcEndpointType']}: free)"
    return cost.INTERFACE_ENDPOINT_USD_PER_HOUR * cost.HOURS_PER_MONTH, endpoint["ServiceName"]


def _file_system(clients: dict[str, Any], ident: str) -> tuple[float | None, str] | None:
    fs = clients["fsx"].describe_file_systems(FileSystemIds=[ident])["FileSystems"][0]
    if fs.get("Lifecycle") == "DELETING":
        return None
    lustre = fs.get("LustreConfiguration", {})
    deployment, throughput = lustre.get("DeploymentType", ""), lustre.get("PerUnitStorageThroughput")
    what = f"{fs['FileSystemType']} {deployment} {fs['StorageCapacity']} GiB"
    if (deployment, throughput if deployment != "SCRATCH_2" else None) not in cost.LUSTRE_USD_PER_GIB_MONTH:
        return None, f"{what} (no reference price)"
    return cost.lustre_usd_per_month(deployment, throughput if deployment != "SCRATCH_2" else None,
                                     fs["StorageCapacity"]), what


def _bucket(clients: dict[str, Any], ident: str) -> tuple[float, str]:
    size = objects = 0
    pages = clients["s3"].get_paginator("list_object_versions").paginate(Bucket=ident)
    complete = True
    for number, page in enumerate(pages):
        if number == BUCKET_PAGES:
            complete = False
            break
        for version in page.get("Versions", []):
            size += version["Size"]
            objects += 1
    gb = size / 1e9
    floor = "" if complete else "at least "
    return gb * cost.S3_STANDARD_USD_PER_GB_MONTH, f"{floor}{objects} object version(s), {floor}{gb:,.2f} GB"


PRICERS = {
    "ec2:instance": _instance,
    "ec2:volume": _volume,
    "ec2:snapshot": _snapshot,
    "ec2:image": _image,
    "ec2:natgateway": _nat_gateway,
    "ec2:elastic-ip": _elastic_ip,
    "ec2:vpc-endpoint": _vpc_endpoint,
    "fsx:file-system": _file_system,
    "s3:bucket": _bucket,
}


def monthly_total(leftovers: list[Leftover]) -> float:
    """What the priced ones bill per month (the unpriced are free, billed by use, or unknown)."""
    return round(sum(item.monthly_usd or 0.0 for item in leftovers), 2)


def still_bills(leftovers: list[Leftover]) -> bool:
    """Something left bills every month: `leftovers` exits 1, so a teardown's check cannot pass over it."""
    return monthly_total(leftovers) > 0


def report(stack_name: str, region: str, leftovers: list[Leftover]) -> list[str]:
    if not leftovers:
        return [f"Nothing in {region} is tagged {STACK_TAG}={stack_name}."]
    lines = [f"{len(leftovers)} resource(s) in {region} still tagged {STACK_TAG}={stack_name}:"]
    width = max(len(item.kind) for item in leftovers)
    for item in leftovers:
        monthly = cost.money(item.monthly_usd) if item.monthly_usd is not None else "not priced"
        lines.append(f"  {item.kind.ljust(width)}  {monthly.rjust(11)}/month  {item.arn}  {item.detail}")
    lines.append(f"Per month, priced ones: {cost.money(monthly_total(leftovers))} (reference rates of "
                 f"{catalog.PRICE_DATE}). Delete what you no longer want in the console or with the AWS CLI; the "
                 "API lists deleted resources for a while after.")
    return lines
