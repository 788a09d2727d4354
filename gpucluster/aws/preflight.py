"""`gpucluster preflight STACK`: can this account run this stack, before `pulumi up`?

Uses the caller's AWS credentials (boto3's usual chain: AWS_PROFILE, environment, SSO; AWS_ENDPOINT_URL is honoured).
Per pool: offered in the AZ, EFA, the vCPU quota of its family and market, its capacity reservation, the spot
placement score, the AMI parameter, and live spot prices, which then update the cost table. Every check says pass, warn
or fail, and how to fix a failure. Per account: the spot service-linked role (a stack with a spot pool) and the default
EBS key (gpucluster.spec.account says why both matter). Per region: the VPC-level quotas a new VPC consumes (VPCs,
internet and NAT gateways, Elastic IPs, endpoints) against what the account already uses. Per Kubernetes stack: the
EKS version, its add-ons, and the way into the cluster's API from this machine. An API that is denied or unavailable
is a warning naming the permission.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from collections import defaultdict
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Literal

from gpucluster.aws import checkip
from gpucluster.cli_errors import credentials_problem
from gpucluster.spec import account, bom, cost, eks
from gpucluster.spec.model import OPERATOR, PoolSpec, Stack, way_in_warning

Status = Literal["pass", "warn", "fail"]
# vCPU service quotas by instance family letter and market (Service Quotas, service code ec2).
QUOTAS = {
    ("p", "on-demand"): ("L-417A185B", "Running On-Demand P instances"),
    ("p", "spot"): ("L-7212CCBC", "All P Spot Instance Requests"),
    ("g", "on-demand"): ("L-DB2E81BA", "Running On-Demand G and VT instances"),
    ("g", "spot"): ("L-3819A6DF", "All G and VT Spot Instance Requests"),
    ("trn", "on-demand"): ("L-2C3B7624", "Running On-Demand Trn instances"),
    ("trn", "spot"): ("L-6B0D517C", "All Trn Spot Instance Requests"),
}
SPOT_ROLE = account.SPOT_ROLE
DENIED = {"AccessDenied", "AccessDeniedException", "UnauthorizedOperation", "UnauthorizedException"}
LOW_SPOT_SCORE = 3  # of 10: "unlikely to succeed" in AWS's own scale


@dataclass(frozen=True)
class Check:
    pool: str | None
    name: str
    status: Status
    detail: str
    fix: str = ""


def family_letter(instance_type: str) -> str:
    family = instance_type.split(".")[0]
    return "trn" if family.startswith("trn") else family[0]


def guarded(pool: str | None, name: str, permission: str, probe: Callable[[], Check | list[Check]]) -> list[Check]:
    """Run one check; an AWS error becomes a warning that names what was missing, never a crash. Credentials that are
    missing or no longer valid are raised instead: every check would warn, and a preflight that checked nothing is
    not a pass (the command line says what is missing, exit 2)."""
    from botocore.exceptions import BotoCoreError, ClientError
    from botocore.parsers import ResponseParserError

    try:
        result = probe()
    except (ClientError, BotoCoreError) as exc:
        if credentials_problem(exc):
            raise
        return _warning(pool, name, permission, exc)
    except ResponseParserError:
        return [Check(pool, name, "warn", f"not checked, {permission} unavailable: the endpoint gave no valid answer")]
    return result if isinstance(result, list) else [result]


def _warning(pool: str | None, name: str, permission: str, exc: Exception) -> list[Check]:
    from botocore.exceptions import ClientError

    if isinstance(exc, ClientError):
        code = exc.response.get("Error", {}).get("Code", "Error")
        why = f"denied ({code}): grant {permission}" if code in DENIED else f"unavailable ({code}): {permission}"
        return [Check(pool, name, "warn", f"not checked, {why}")]
    return [Check(pool, name, "warn", f"not checked, {permission} unreachable: {exc}")]


def check_offered(ec2: Any, pool: PoolSpec, az: str) -> Check:
    reply = ec2.describe_instance_type_offerings(
        LocationType="availability-zone",
        Filters=[{"Name": "instance-type", "Values": [pool.instance_type]}])
    zones = sorted(o["Location"] for o in reply["InstanceTypeOfferings"])
    if az in zones:
        return Check(pool.name, "offered", "pass", f"{pool.instance_type} is offered in {az}")
    elsewhere = ", ".join(zones) or "no AZ of this region"
    return Check(pool.name, "offered", "fail", f"{pool.instance_type} is not offered in {az}",
                 f"set availability_zone to one of: {elsewhere}")


def check_efa(ec2: Any, pool: PoolSpec) -> Check:
    if not pool.uses_efa:
        return Check(pool.name, "efa", "pass", "EFA not used by this pool")
    (info,) = ec2.describe_instance_types(InstanceTypes=[pool.instance_type])["InstanceTypes"]
    net = info["NetworkInfo"]
    live = (net.get("EfaInfo") or {}).get("MaximumEfaInterfaces", 0) if net.get("EfaSupported") else 0
    if live == pool.itype.efa_interfaces:
        return Check(pool.name, "efa", "pass", f"{live} EFA interface(s), as the launch template lays out")
    if live == 0:
        return Check(pool.name, "efa", "fail", f"EC2 says {pool.instance_type} has no EFA here", "set efa: false")
    return Check(pool.name, "efa", "warn",
                 f"EC2 reports {live} EFA interfaces, the catalog {pool.itype.efa_interfaces}",
                 "update gpucluster/spec/catalog.py")


def check_quotas(quotas: Any, stack: Stack, region: str) -> list[Check]:
    """One vCPU quota may serve several pools: compare it with the sum of their max_nodes x vCPUs."""
    need: dict[tuple[str, str], list[PoolSpec]] = defaultdict(list)
    checks = []
    for pool in stack.spec.pools:
        if pool.capacity == "capacity-block":
            checks.append(Check(pool.name, "quota", "warn", "vCPU quota not checked for a capacity-block pool"))
            continue
        need[(family_letter(pool.instance_type), pool.capacity)].append(pool)
    for key, pools in need.items():
        code, title = QUOTAS[key]
        vcpus = sum(p.max_nodes * p.itype.vcpus for p in pools)
        names = [p.name for p in pools]
        for check in guarded(pools[0].name, "quota", "servicequotas:GetServiceQuota",
                             partial(_quota, quotas, code, title, vcpus, names, region)):
            checks += [Check(p.name, check.name, check.status, check.detail, check.fix) for p in pools]
    return checks


def _quota(quotas: Any, code: str, title: str, vcpus: int, pools: list[str], region: str) -> Check:
    value = quotas.get_service_quota(ServiceCode="ec2", QuotaCode=code)["Quota"]["Value"]
    who = " + ".join(pools)
    if value >= vcpus:
        return Check(None, "quota", "pass", f"{code} {title}: {value:.0f} vCPUs cover {vcpus} ({who} at max_nodes)")
    return Check(None, "quota", "fail", f"{code} {title}: {value:.0f} vCPUs, {vcpus} needed ({who} at max_nodes)",
                 f"aws service-quotas request-service-quota-increase --region {region} --service-code ec2 "
                 f"--quota-code {code} --desired-value {vcpus}")


def check_reservation(ec2: Any, pool: PoolSpec, az: str) -> Check:
    (res,) = ec2.describe_capacity_reservations(CapacityReservationIds=[pool.capacity_reservation_id])[
        "CapacityReservations"]
    problems = []
    if res["State"] not in ("active", "scheduled"):
        problems.append(f"state is {res['State']}")
    if res["AvailabilityZone"] != az:
        problems.append(f"it is in {res['AvailabilityZone']}, the stack in {az}")
    if res["InstanceType"] != pool.instance_type:
        problems.append(f"it holds {res['InstanceType']}, the pool asks {pool.instance_type}")
    if res["TotalInstanceCount"] < pool.max_nodes:
        problems.append(f"it holds {res['TotalInstanceCount']} instances, the pool needs {pool.max_nodes}")
    if problems:
        return Check(pool.name, "reservation", "fail", f"{pool.capacity_reservation_id}: " + "; ".join(problems),
                     "match the pool to the reservation (type, AZ, max_nodes) or buy a matching capacity block")
    window = f"{res.get('StartDate', '')} to {res.get('EndDate', '')}".strip()
    return Check(pool.name, "reservation", "pass",
                 f"{pool.capacity_reservation_id} {res['State']}, {res['TotalInstanceCount']} x {pool.instance_type} "
                 f"in {az} {window}".rstrip())


def check_spot_score(ec2: Any, pool: PoolSpec, region: str, az_id: str) -> Check:
    scores = ec2.get_spot_placement_scores(InstanceTypes=[pool.instance_type], TargetCapacity=pool.max_nodes,
                                           SingleAvailabilityZone=True, RegionNames=[region])["SpotPlacementScores"]
    score = max((s["Score"] for s in scores if s.get("AvailabilityZoneId") == az_id), default=0)
    if score >= LOW_SPOT_SCORE:
        return Check(pool.name, "spot score", "pass",
                     f"placement score {score}/10 for {pool.max_nodes} nodes in {az_id}")
    best = max(scores, key=lambda s: s["Score"], default=None)
    hint = f"; best here: {best['AvailabilityZoneId']} scores {best['Score']}" if best else ""
    return Check(pool.name, "spot score", "warn", f"placement score {score}/10 for {pool.max_nodes} nodes in {az_id}"
                 f"{hint}", "expect interruptions and fallbacks; give the pool a fallback or fewer max_nodes")


def ami_parameter(stack: Stack, pool: PoolSpec) -> str:
    """The public parameter naming the image a Kubernetes pool boots: EKS's accelerated AL2023 AMI of the cluster's
    version. (A Slurm pool boots its image baked on, or with image.build false, its pinned parent: check_parent.)"""
    return eks.ami_parameter(stack.spec.eks.version, pool.accelerator.kind)


def check_eks_version(client: Any, version: str) -> Check:
    """The stack's Kubernetes version is offered here, in standard support (extended support bills 6x)."""
    offered = client.describe_cluster_versions(clusterVersions=[version], includeAll=True)["clusterVersions"]
    if not offered:
        return Check(None, "k8s version", "fail", f"EKS does not offer Kubernetes {version} in this region",
                     f"set kubernetes.version to one of: {', '.join(eks.VERSIONS)}")
    info = offered[0]
    status = info.get("versionStatus") or info.get("status", "")
    end = info.get("endOfStandardSupportDate")
    until = f" until {end:%Y-%m-%d}" if isinstance(end, dt.datetime) else ""
    if status.upper().replace("-", "_") == "STANDARD_SUPPORT":
        return Check(None, "k8s version", "pass", f"Kubernetes {version} in standard support{until}")
    return Check(None, "k8s version", "fail", f"Kubernetes {version} is in {status.lower().replace('_', ' ')} on EKS",
                 "set kubernetes.version to a version in standard support")


def check_way_in(stack: Stack, checkip_url: str) -> Check:
    """`pulumi up` reaches the cluster's API from this machine: `operator` listed (and checkip answering, as `up` will
    ask it), this machine's public address inside a listed network, or private_access_cidrs (a VPN or Direct
    Connect into the VPC, which only that network can tell)."""
    spec = stack.spec.eks
    warning = way_in_warning(stack.spec)
    if warning:
        return Check(None, "api access", "fail", warning, "name the way in (docs/how-to/kubernetes.md, \"Choosing "
                     "the way in\")")
    if not spec.public_access_cidrs:  # then private_access_cidrs
        return Check(None, "api access", "pass", "the private endpoint admits "
                     f"{', '.join(spec.private_access_cidrs)}: run `up` and kubectl from there (VPN, Direct Connect, "
                     "peered VPC)")
    cidrs = [c for c in spec.public_access_cidrs if c != OPERATOR]
    try:
        address = checkip.public_address(checkip_url)
    except checkip.LookupFailed as exc:
        if OPERATOR in spec.public_access_cidrs:
            return Check(None, "api access", "fail", f"`operator` needs this machine's public address: {exc}",
                         "let this machine reach https://checkip.amazonaws.com, or list its network's CIDRs in "
                         "kubernetes.public_access_cidrs instead of operator")
        return Check(None, "api access", "warn", f"not checked, this machine's public address is unknown: {exc}")
    if OPERATOR in spec.public_access_cidrs:
        return Check(None, "api access", "pass", f"`operator`: this machine's {address}/32 reaches the public "
                     "endpoint (it follows whoever runs `up`)")
    inside = next((c for c in cidrs if address in ipaddress.IPv4Network(c)), None)
    if inside:
        return Check(None, "api access", "pass", f"this machine ({address}) is inside {inside}")
    if spec.private_access_cidrs:
        return Check(None, "api access", "pass", f"this machine ({address}) is outside public_access_cidrs: `up` "
                     f"goes through the private endpoint from {', '.join(spec.private_access_cidrs)} (a VPN or "
                     "Direct Connect session must be up)")
    listed = ", ".join(cidrs)
    return Check(None, "api access", "fail", f"this machine ({address}) is outside public_access_cidrs ({listed}): "
                 "`up` cannot reach the cluster's API", f"add `operator` or {address}/32 (or its network) to "
                 "kubernetes.public_access_cidrs, or run `up` from a listed network")


def check_addons(client: Any, version: str) -> list[Check]:
    """Each managed add-on has a default version for the cluster's Kubernetes version."""
    checks = []
    for name in eks.ADDONS:
        addons = client.describe_addon_versions(kubernetesVersion=version, addonName=name)["addons"]
        defaults = [v["addonVersion"] for a in addons for v in a["addonVersions"]
                    if any(c.get("clusterVersion") == version and c.get("defaultVersion")
                           for c in v.get("compatibilities", []))]
        if defaults:
            checks.append(Check(None, "add-on", "pass", f"{name} {defaults[0]} (default for {version})"))
        else:
            checks.append(Check(None, "add-on", "fail", f"{name} has no version for Kubernetes {version} here",
                                "choose another kubernetes.version"))
    return checks


def check_ami(ssm: Any, ec2: Any, pool: PoolSpec, parameter: str) -> Check:
    if pool.ami_id:
        from botocore.exceptions import ClientError

        try:
            images = ec2.describe_images(ImageIds=[pool.ami_id])["Images"]
        except ClientError as exc:
            if not exc.response.get("Error", {}).get("Code", "").startswith("InvalidAMIID"):
                raise
            images = []
        if images:
            return Check(pool.name, "ami", "pass", f"{pool.ami_id} exists")
        return Check(pool.name, "ami", "fail", f"{pool.ami_id} not found in this region",
                     "fix ami_id, or remove it to boot the stack's own image")
    name = parameter
    try:
        value = ssm.get_parameter(Name=name)["Parameter"]["Value"]
    except ssm.exceptions.ParameterNotFound:
        return Check(pool.name, "ami", "fail", f"{name} does not resolve in this region",
                     "set the pool's ami_id to a Deep Learning AMI of this region")
    return Check(pool.name, "ami", "pass", f"{name} -> {value}")


def check_parent(ec2: Any, pool: str | None, role: bom.ParentRole, parent: bom.ParentImage, region: str) -> Check:
    """A pinned parent release (image.parent_images) is in the region, as the Pulumi program looks it up
    (components/image.py parent_ami): its region_ids entry, else the one x86_64 image of that exact name and owner,
    deprecated ones included (AWS and Canonical deprecate releases after a time; a pinned one must keep resolving).
    The bake starts from it, and with image.build false the nodes boot it."""
    from botocore.exceptions import ClientError

    what = "ami" if pool else "head ami"
    fix = (f"set image.parent_images.{role} to a release this region has (or its id here in region_ids): "
           f"aws ec2 describe-images --region {region} --owners {parent.owner} --filters 'Name=name,Values=...'")
    if region in parent.region_ids:
        image_id = parent.region_ids[region]
        try:
            found = ec2.describe_images(ImageIds=[image_id])["Images"]
        except ClientError as exc:
            if not exc.response.get("Error", {}).get("Code", "").startswith("InvalidAMIID"):
                raise
            found = []
        if found:
            return Check(pool, what, "pass", f"{parent.name}: {image_id} (region_ids) exists")
        return Check(pool, what, "fail", f"{parent.name}: {image_id} (region_ids) not found in this region", fix)
    images = ec2.describe_images(Owners=[parent.owner], IncludeDeprecated=True, Filters=[
        {"Name": "name", "Values": [parent.name]}, {"Name": "architecture", "Values": ["x86_64"]}])["Images"]
    if len(images) == 1:
        return Check(pool, what, "pass", f"{parent.name} ({parent.owner}): {images[0]['ImageId']}")
    if not images:
        return Check(pool, what, "fail", f"no x86_64 image {parent.name!r} of owner {parent.owner} in this region",
                     fix)
    ids = ", ".join(sorted(i["ImageId"] for i in images))
    return Check(pool, what, "fail", f"{len(images)} images {parent.name!r} of owner {parent.owner}: {ids}",
                 f"name the one in image.parent_images.{role}.region_ids")


def check_spot_role(iam: Any, stack: Stack) -> Check:
    """One per account, so one check for the stack, naming the pools that need it. A Slurm stack makes the role when
    the account has none (components/launch_access.py); the Kubernetes flavour's node groups do not."""
    pools = ", ".join(p.name for p in stack.spec.pools if p.capacity == "spot")
    try:
        role = iam.get_role(RoleName=SPOT_ROLE)["Role"]
    except iam.exceptions.NoSuchEntityException:
        if stack.spec.scheduler == "slurm":
            return Check(None, "spot role", "pass",
                         f"no {SPOT_ROLE} in this account yet: `pulumi up` creates it for the spot pools ({pools}) "
                         "and never deletes it (other stacks of the account launch spot through it); the caller "
                         f"needs iam:CreateServiceLinkedRole for {account.SPOT_SERVICE}")
        return Check(None, "spot role", "fail",
                     f"no {SPOT_ROLE} in this account: spot launches ({pools}) fail with "
                     "AuthFailure.ServiceLinkedRoleCreationNotPermitted", f"once per account: {account.SPOT_ROLE_FIX}")
    return Check(None, "spot role", "pass", f"{role['Arn']} exists (spot pools: {pools})")


def check_ebs_key(ec2: Any, kms: Any, stack: Stack) -> Check:
    """The key EBS encrypts the stack's volumes with: none of them names one, so the account's default EBS key, whether
    encryption by default is on or not. A customer managed key serves only whom its policy or a grant lets in."""
    by_default = ec2.get_ebs_encryption_by_default()["EbsEncryptionByDefault"]
    key_id = ec2.get_ebs_default_kms_key_id()["KmsKeyId"]
    key = kms.describe_key(KeyId=key_id)["KeyMetadata"]
    default = f"encryption by default {'on' if by_default else 'off'}"
    if key["KeyState"] != "Enabled":
        return Check(None, "ebs key", "fail",
                     f"the default EBS key {key['Arn']} is {key['KeyState']}: no volume of the stack can be made",
                     "enable the key, or point EBS at another: aws ec2 modify-ebs-default-kms-key-id --kms-key-id KEY")
    if key["KeyManager"] == "AWS":
        return Check(None, "ebs key", "pass", f"the default EBS key is AWS managed ({default}): nothing to grant")
    if stack.spec.scheduler == "kubernetes":
        return Check(None, "ebs key", "fail",
                     f"the default EBS key {key['Arn']} is customer managed ({default}) and the Kubernetes flavour "
                     "grants it to no one: managed node groups cannot launch",
                     "let AWSServiceRoleForAutoScaling use the key and create grants for AWS resources in its key "
                     "policy (EC2 Auto Scaling User Guide, \"Required AWS KMS key policy for use with encrypted "
                     "volumes\")")
    return Check(None, "ebs key", "warn",
                 f"the default EBS key {key['Arn']} is customer managed ({default}): `pulumi up` grants it to "
                 f"{account.IMAGE_BUILDER_ROLE} (image builds)"
                 + (f" and {SPOT_ROLE} (spot nodes)" if any(p.capacity == "spot" for p in stack.spec.pools) else "")
                 + " and lets the head role use it through EC2 (on-demand nodes); the head node's volumes are made "
                 "with your credentials",
                 "the key policy must let IAM policies grant its use (the default key policy's account statement), "
                 "and the caller of `pulumi up` needs kms:CreateGrant and kms:DescribeKey on it")


def spot_price(ec2: Any, pool: PoolSpec, az: str) -> tuple[Check, float | None]:
    history = ec2.describe_spot_price_history(
        InstanceTypes=[pool.instance_type], AvailabilityZone=az, ProductDescriptions=["Linux/UNIX"],
        StartTime=dt.datetime.now(dt.timezone.utc))["SpotPriceHistory"]
    if not history:
        return Check(pool.name, "spot price", "warn", f"no spot price for {pool.instance_type} in {az}"), None
    price = float(max(history, key=lambda h: h["Timestamp"])["SpotPrice"])
    if price <= 0:
        return Check(pool.name, "spot price", "warn",
                     f"EC2 gave a spot price of {price} for {pool.instance_type}"), None
    ref = pool.itype.on_demand_usd_per_hour
    saving = f" ({100 * (1 - price / ref):.0f}% under the reference on-demand rate)" if ref else ""
    return Check(pool.name, "spot price", "pass", f"${price:.4f}/h now in {az}{saving}"), price


@dataclass(frozen=True)
class Limit:
    """A per-region (per-AZ, per-VPC) quota the new VPC of components/network.py consumes: the quota's code, what the
    stack adds, and the EC2 call that counts what the account already has."""

    service: str  # Service Quotas' service code
    code: str
    title: str
    need: int
    describe: str  # the EC2 permission that counts the usage ("" when the usage is the new VPC's own: none yet)


# Quota codes from AWS's Amazon VPC and Amazon EC2 quota pages (Service Quotas: vpc and ec2), as the quota-checking
# tools of others use them (aws-samples' quota monitors and OpenShift's installer, read with the search tools). Each is
# what Network._new_vpc creates: the VPC, its internet gateway, one NAT gateway in the stack's AZ with its Elastic IP,
# the S3 gateway endpoint, and the Session Manager interface endpoints inside the new VPC.
NETWORK_LIMITS = (
    Limit("vpc", "L-F678F1CE", "VPCs per Region", 1, "DescribeVpcs"),
    Limit("vpc", "L-A4707A72", "Internet gateways per Region", 1, "DescribeInternetGateways"),
    Limit("vpc", "L-FE5A380F", "NAT gateways per Availability Zone", 1, "DescribeNatGateways, ec2:DescribeSubnets"),
    Limit("ec2", "L-0263D0A3", "EC2-VPC Elastic IPs", 1, "DescribeAddresses"),
    Limit("vpc", "L-1B52E74A", "Gateway VPC endpoints per Region", 1, "DescribeVpcEndpoints"),
    Limit("vpc", "L-29B6F2EB", "Interface VPC endpoints per VPC", len(cost.SSM_ENDPOINTS), ""),
)
# What no longer counts against a quota.
GONE_STATES = {"deleted", "deleting", "failed", "rejected", "expired"}


def _every(ec2: Any, operation: str, key: str, **kwargs: Any) -> list[dict[str, Any]]:
    if ec2.can_paginate(operation):
        return [item for page in ec2.get_paginator(operation).paginate(**kwargs) for item in page[key]]
    return list(getattr(ec2, operation)(**kwargs)[key])


def network_usage(ec2: Any, code: str, az: str) -> int:
    """What the account already holds against quota `code` in this region (the stack's AZ for NAT gateways)."""
    if code == "L-F678F1CE":
        return len(_every(ec2, "describe_vpcs", "Vpcs"))
    if code == "L-A4707A72":
        return len(_every(ec2, "describe_internet_gateways", "InternetGateways"))
    if code == "L-FE5A380F":
        live = [g["SubnetId"] for g in _every(ec2, "describe_nat_gateways", "NatGateways",
                                               Filter=[{"Name": "state", "Values": ["pending", "available"]}])]
        zones = {s["SubnetId"]: s["AvailabilityZone"]
                 for s in _every(ec2, "describe_subnets", "Subnets", SubnetIds=sorted(set(live)))} if live else {}
        return sum(zones.get(subnet) == az for subnet in live)
    if code == "L-0263D0A3":
        return len(_every(ec2, "describe_addresses", "Addresses", Filters=[{"Name": "domain", "Values": ["vpc"]}]))
    if code == "L-1B52E74A":
        return sum(e.get("State", "").lower() not in GONE_STATES for e in _every(
            ec2, "describe_vpc_endpoints", "VpcEndpoints",
            Filters=[{"Name": "vpc-endpoint-type", "Values": ["Gateway"]}]))
    return 0  # per VPC: the new VPC holds nothing yet


def _limit(ec2: Any, quotas: Any, limit: Limit, stack: Stack) -> Check:
    value = quotas.get_service_quota(ServiceCode=limit.service, QuotaCode=limit.code)["Quota"]["Value"]
    used = network_usage(ec2, limit.code, stack.spec.availability_zone)
    where = f" in {stack.spec.availability_zone}" if limit.code == "L-FE5A380F" else ""
    figures = f"{limit.code} {limit.title}: {value:.0f}, {used} used{where}, {limit.need} more for this stack"
    if used + limit.need <= value:
        return Check(None, "limit", "pass", figures)
    return Check(None, "limit", "fail", figures,
                 f"free {used + limit.need - value:.0f}, or aws service-quotas request-service-quota-increase "
                 f"--region {stack.region} --service-code {limit.service} --quota-code {limit.code} "
                 f"--desired-value {used + limit.need}")


def check_network_limits(ec2: Any, quotas: Any, stack: Stack) -> list[Check]:
    """Each per-region limit the stack's new VPC consumes, against the account's quota and current usage (the fifth
    team's VPC in a region fails here, not halfway through `pulumi up`)."""
    if not stack.spec.network.creates_vpc:
        return [Check(None, "limit", "pass", "an existing network: the stack adds no VPC, gateway, address or "
                                             "endpoint")]
    checks = []
    for limit in NETWORK_LIMITS:
        permission = "servicequotas:GetServiceQuota" + (f", ec2:{limit.describe}" if limit.describe else "")
        checks += guarded(None, "limit", permission, partial(_limit, ec2, quotas, limit, stack))
    return checks


@dataclass
class Report:
    checks: list[Check]
    spot_prices: dict[str, float]

    @property
    def failed(self) -> bool:
        return any(c.status == "fail" for c in self.checks)


def run(stack: Stack, session: Any, checkip_url: str = checkip.CHECKIP_URL) -> Report:
    """Every check for `stack` with clients from `session` (a boto3.Session); this machine's public address from
    `checkip_url`."""
    region, az = stack.region, stack.spec.availability_zone
    ec2, ssm = session.client("ec2", region_name=region), session.client("ssm", region_name=region)
    quotas = session.client("service-quotas", region_name=region)
    checks: list[Check] = []
    if any(p.capacity == "spot" for p in stack.spec.pools):
        iam = session.client("iam", region_name=region)
        checks += guarded(None, "spot role", "iam:GetRole", lambda: check_spot_role(iam, stack))
    kms = session.client("kms", region_name=region)
    checks += guarded(None, "ebs key", "ec2:GetEbsEncryptionByDefault, ec2:GetEbsDefaultKmsKeyId, kms:DescribeKey",
                      lambda: check_ebs_key(ec2, kms, stack))
    prices: dict[str, float] = {}
    zone_ids: dict[str, str] = {}
    checks += guarded(None, "zone", "ec2:DescribeAvailabilityZones", lambda: _zone(ec2, az, zone_ids))
    if stack.spec.scheduler == "slurm" and not stack.spec.head_node.ami_id:
        head = stack.spec.image.parent_images.parent("head")
        checks += guarded(None, "head ami", "ec2:DescribeImages", lambda: check_parent(ec2, None, "head", head, region))
    for pool in stack.spec.pools:
        checks += _pool_checks(stack, pool, ec2, ssm, zone_ids, prices)
    checks += check_quotas(quotas, stack, region)
    checks += check_network_limits(ec2, quotas, stack)
    if stack.spec.scheduler == "kubernetes":
        client, version = session.client("eks", region_name=region), stack.spec.eks.version
        checks += guarded(None, "k8s version", "eks:DescribeClusterVersions",
                          lambda: check_eks_version(client, version))
        checks += guarded(None, "add-on", "eks:DescribeAddonVersions", lambda: check_addons(client, version))
        checks.append(check_way_in(stack, checkip_url))
    order = {p.name: i for i, p in enumerate(stack.spec.pools)}
    checks.sort(key=lambda c: order.get(c.pool or "", -1))
    return Report(checks, prices)


def _pool_checks(stack: Stack, pool: PoolSpec, ec2: Any, ssm: Any, zone_ids: dict[str, str],
                 prices: dict[str, float]) -> list[Check]:
    """One pool's checks; its spot price, when EC2 gives one, goes into `prices`."""
    region, az = stack.region, stack.spec.availability_zone
    checks = guarded(pool.name, "offered", "ec2:DescribeInstanceTypeOfferings", lambda: check_offered(ec2, pool, az))
    checks += guarded(pool.name, "efa", "ec2:DescribeInstanceTypes", lambda: check_efa(ec2, pool))
    if pool.capacity == "capacity-block":
        checks += guarded(pool.name, "reservation", "ec2:DescribeCapacityReservations",
                          lambda: check_reservation(ec2, pool, az))
    if pool.capacity == "spot":
        if az in zone_ids:
            checks += guarded(pool.name, "spot score", "ec2:GetSpotPlacementScores",
                              lambda: check_spot_score(ec2, pool, region, zone_ids[az]))
        found: list[float | None] = []
        checks += guarded(pool.name, "spot price", "ec2:DescribeSpotPriceHistory",
                          lambda: _record(spot_price(ec2, pool, az), found))
        if found and found[0] is not None:
            prices[pool.name] = found[0]
    if stack.spec.scheduler == "slurm" and not pool.ami_id:
        role = bom.parent_role(pool.accelerator.kind)
        parent = stack.spec.image.parent_images.parent(role)
        checks += guarded(pool.name, "ami", "ec2:DescribeImages",
                          lambda: check_parent(ec2, pool.name, role, parent, region))
    else:
        checks += guarded(pool.name, "ami", "ssm:GetParameter / ec2:DescribeImages",
                          lambda: check_ami(ssm, ec2, pool, ami_parameter(stack, pool)))
    return checks


def _zone(ec2: Any, az: str, zone_ids: dict[str, str]) -> Check:
    """Spot placement scores speak of zone ids (use1-az4), stack files of zone names (us-east-1a)."""
    zone_ids.update({z["ZoneName"]: z["ZoneId"] for z in ec2.describe_availability_zones()["AvailabilityZones"]})
    if az not in zone_ids:
        return Check(None, "zone", "fail", f"{az} is not a zone of this region",
                     f"one of: {', '.join(sorted(zone_ids))}")
    return Check(None, "zone", "pass", f"{az} is {zone_ids[az]} in this account")


def _record(result: tuple[Check, float | None], sink: list[float | None]) -> Check:
    check, price = result
    sink.append(price)
    return check


def render(stack: Stack, report: Report) -> list[str]:
    lines = [f"Preflight for stack {stack.name} ({stack.region} / {stack.spec.availability_zone})"]
    current = object()
    for c in report.checks:
        if c.pool != current:
            current = c.pool
            pool = next((p for p in stack.spec.pools if p.name == c.pool), None)
            if pool:
                lines.append(f"pool {pool.name} ({pool.instance_type}, {pool.capacity}, up to {pool.max_nodes} nodes)")
        lines.append(f"  {c.status.upper():4} {c.name:11} {c.detail}")
        if c.fix:
            lines.append(f"       fix: {c.fix}")
    counts = {s: sum(c.status == s for c in report.checks) for s in ("pass", "warn", "fail")}
    lines.append(f"Summary: {counts['pass']} pass, {counts['warn']} warn, {counts['fail']} fail")
    return lines
