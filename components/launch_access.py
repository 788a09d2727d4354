"""What EC2 needs of the account to launch a Slurm stack's nodes (gpucluster.spec.account says why): the spot
service-linked role, made when the account has none and never deleted, and a grant on the account's default EBS key
for it when that key is customer managed.

The role is one per account, so no stack owns it. A stack with spot pools declares it only when the account has none
(looked up at `up`), retained on delete: the next `up` finds it and drops it from the stack's state without deleting
it, and no `destroy` deletes it (every stack of the account launches spot through it). It is declared through a
provider without the stack's default tags: an account's role carries no stack's tags, so `leftovers` never lists it.
The head role is not given iam:CreateServiceLinkedRole instead: it would hold an IAM write for a one-time step that
`up` takes, and the key grant needs the role to exist before any node launches.
"""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from components import child
from gpucluster.spec import account


def default_ebs_key(opts: pulumi.ResourceOptions) -> str | None:
    """The ARN of the account's default EBS key when it is customer managed; None when it is AWS's own (aws/ebs),
    which needs no grant. Looked up at `up` (and at every preview): a plain value, since what the stack declares
    depends on it."""
    invoke = pulumi.InvokeOptions(provider=opts.provider)
    default = aws.ebs.get_default_kms_key(opts=invoke)
    key = aws.kms.get_key(key_id=default.key_arn, opts=invoke)
    return key.arn if key.key_manager == "CUSTOMER" else None


def spot_role_present(parent: pulumi.Resource) -> bool:
    """Whether the account has the spot service-linked role (ListRoles on its path: an empty answer, not an error,
    when it has none), asked through the provider of `parent`."""
    found = aws.iam.get_roles(path_prefix=account.service_role_path(account.SPOT_SERVICE),
                              opts=pulumi.InvokeOptions(parent=parent))
    return account.SPOT_ROLE in (found.names or [])


@dataclass(frozen=True)
class SpotLaunchAccessArgs:
    region: str
    account_id: pulumi.Input[str]  # components.iam.account_id
    ebs_key_arn: str | None  # default_ebs_key


class SpotLaunchAccess(pulumi.ComponentResource):
    """The spot service-linked role of the account and, with a customer managed default EBS key, its grant on it."""

    role_arn: pulumi.Output[str]

    def __init__(self, name: str, args: SpotLaunchAccessArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpucluster:launch_access:SpotLaunchAccess", name, None, opts)
        made: list[pulumi.Resource] = []
        if not spot_role_present(self):
            untagged = aws.Provider(f"{name}-account", region=args.region, opts=child(self))
            made.append(aws.iam.ServiceLinkedRole(
                f"{name}-spot-role", aws_service_name=account.SPOT_SERVICE,
                opts=child(self, provider=untagged, retain_on_delete=True)))
        self.role_arn = pulumi.Output.from_input(args.account_id).apply(
            lambda acct: account.service_role_arn(acct, account.SPOT_SERVICE, account.SPOT_ROLE))
        if args.ebs_key_arn is not None:
            # Spot instances are launched by this role: without the grant EC2 refuses every spot launch ("an EBS
            # volume cannot be encrypted"). Revoked on destroy; each stack holds its own grant.
            aws.kms.Grant(f"{name}-spot-ebs-key", key_id=args.ebs_key_arn, grantee_principal=self.role_arn,
                          operations=list(account.SERVICE_GRANT_OPERATIONS), opts=child(self, depends_on=made))
        self.register_outputs({"role_arn": self.role_arn})
