"""The cluster's network: one private subnet in one AZ (EFA and cluster placement groups need it), egress through NAT,
S3 and Session Manager through VPC endpoints, and a security group that lets cluster members talk freely to each other
and nothing in from outside."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from components import child
from gpucluster.spec.cost import SSM_ENDPOINTS


@dataclass(frozen=True)
class NetworkArgs:
    region: str
    availability_zone: str
    vpc_cidr: str | None = None  # a new VPC ...
    vpc_id: str | None = None  # ... or an existing VPC and private subnet with their own egress
    subnet_id: str | None = None


def split_cidr(vpc_cidr: str) -> tuple[str, str]:
    """The private subnet takes the first half of the VPC (GPU nodes, FSx); the public subnet (NAT only) a /24-sized
    slice of the second half."""
    vpc = ipaddress.IPv4Network(vpc_cidr)
    private, rest = vpc.subnets(prefixlen_diff=1)
    public = next(rest.subnets(new_prefix=max(rest.prefixlen, 24)))
    return str(private), str(public)


def control_plane_cidr(vpc_cidr: str) -> str:
    """The EKS control plane's small subnet in a second AZ: the /24-sized slice after the public subnet's."""
    rest = list(ipaddress.IPv4Network(vpc_cidr).subnets(prefixlen_diff=1))[1]
    return str(list(rest.subnets(new_prefix=max(rest.prefixlen, 24)))[1])


class Network(pulumi.ComponentResource):
    vpc_id: pulumi.Output[str]
    subnet_id: pulumi.Output[str]
    security_group_id: pulumi.Output[str]
    # The group's rules are resources of their own, created beside the group: whatever needs them in force at create
    # (FSx checks them synchronously) depends on these, not only on the group's id.
    security_group_rules: list[pulumi.Resource]

    def __init__(self, name: str, args: NetworkArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpucluster:network:Network", name, None, opts)
        if args.vpc_cidr:
            self.vpc_id, self.subnet_id = self._new_vpc(name, args, args.vpc_cidr)
        elif args.vpc_id and args.subnet_id:
            self.vpc_id = pulumi.Output.from_input(args.vpc_id)
            self.subnet_id = pulumi.Output.from_input(args.subnet_id)
        else:
            raise ValueError("a network needs vpc_cidr (a new VPC) or both vpc_id and subnet_id (an existing VPC and "
                             f"its private subnet); got vpc_id={args.vpc_id!r}, subnet_id={args.subnet_id!r}")

        sg = aws.ec2.SecurityGroup(
            f"{name}-cluster",
            vpc_id=self.vpc_id,
            description="gpucluster members: all traffic among themselves (EFA, NCCL, Slurm, Lustre); "
                        "no inbound from outside",
            opts=child(self),
        )
        # EFA's SRD traffic needs an all-protocol rule to and from the group itself. It also covers Lustre (TCP 988,
        # 1018-1023) and Slurm (6817-6819) between nodes, head node and FSx, which all sit in this group.
        self_in = aws.vpc.SecurityGroupIngressRule(
            f"{name}-self-in", security_group_id=sg.id, referenced_security_group_id=sg.id, ip_protocol="-1",
            description="all traffic from cluster members", opts=child(self),
        )
        self_out = aws.vpc.SecurityGroupEgressRule(
            f"{name}-self-out", security_group_id=sg.id, referenced_security_group_id=sg.id, ip_protocol="-1",
            description="all traffic to cluster members (EFA needs it explicitly)", opts=child(self),
        )
        egress = aws.vpc.SecurityGroupEgressRule(
            f"{name}-egress", security_group_id=sg.id, cidr_ipv4="0.0.0.0/0", ip_protocol="-1",
            description="outbound through NAT: packages, container registries, AWS APIs", opts=child(self),
        )
        self.security_group_id = sg.id
        self.security_group_rules = [self_in, self_out, egress]
        self.register_outputs(
            {"vpc_id": self.vpc_id, "subnet_id": self.subnet_id, "security_group_id": self.security_group_id}
        )

    def _new_vpc(self, name: str, args: NetworkArgs, vpc_cidr: str) -> tuple[pulumi.Output[str], pulumi.Output[str]]:
        private_cidr, public_cidr = split_cidr(vpc_cidr)
        vpc = aws.ec2.Vpc(
            name, cidr_block=vpc_cidr, enable_dns_hostnames=True, enable_dns_support=True, opts=child(self)
        )
        private = aws.ec2.Subnet(
            f"{name}-private", vpc_id=vpc.id, cidr_block=private_cidr, availability_zone=args.availability_zone,
            map_public_ip_on_launch=False, tags={"Name": f"{name}-private"}, opts=child(self),
        )
        public = aws.ec2.Subnet(
            f"{name}-public", vpc_id=vpc.id, cidr_block=public_cidr, availability_zone=args.availability_zone,
            map_public_ip_on_launch=False, tags={"Name": f"{name}-public"}, opts=child(self),
        )
        igw = aws.ec2.InternetGateway(f"{name}-igw", vpc_id=vpc.id, opts=child(self))
        eip = aws.ec2.Eip(f"{name}-nat", domain="vpc", opts=child(self))
        nat = aws.ec2.NatGateway(f"{name}-nat", subnet_id=public.id, allocation_id=eip.id, opts=child(self))

        public_rt = aws.ec2.RouteTable(
            f"{name}-public", vpc_id=vpc.id, routes=[{"cidr_block": "0.0.0.0/0", "gateway_id": igw.id}],
            opts=child(self),
        )
        aws.ec2.RouteTableAssociation(f"{name}-public", subnet_id=public.id, route_table_id=public_rt.id,
                                      opts=child(self))
        private_rt = aws.ec2.RouteTable(
            f"{name}-private", vpc_id=vpc.id, routes=[{"cidr_block": "0.0.0.0/0", "nat_gateway_id": nat.id}],
            opts=child(self),
        )
        aws.ec2.RouteTableAssociation(
            f"{name}-private", subnet_id=private.id, route_table_id=private_rt.id, opts=child(self)
        )

        # S3 through a gateway endpoint: free, and checkpoint/dataset traffic does not pay NAT processing.
        aws.ec2.VpcEndpoint(
            f"{name}-s3", vpc_id=vpc.id, service_name=f"com.amazonaws.{args.region}.s3", vpc_endpoint_type="Gateway",
            route_table_ids=[private_rt.id], opts=child(self),
        )
        endpoint_sg = aws.ec2.SecurityGroup(
            f"{name}-endpoints", vpc_id=vpc.id,
            description="HTTPS from inside the VPC to the Session Manager endpoints",
            opts=child(self),
        )
        aws.vpc.SecurityGroupIngressRule(
            f"{name}-endpoints-https", security_group_id=endpoint_sg.id, cidr_ipv4=vpc_cidr, ip_protocol="tcp",
            from_port=443, to_port=443, description="HTTPS from the VPC", opts=child(self),
        )
        for service in SSM_ENDPOINTS:
            aws.ec2.VpcEndpoint(
                f"{name}-{service}", vpc_id=vpc.id, service_name=f"com.amazonaws.{args.region}.{service}",
                vpc_endpoint_type="Interface", private_dns_enabled=True, subnet_ids=[private.id],
                security_group_ids=[endpoint_sg.id], opts=child(self),
            )
        return vpc.id, private.id
