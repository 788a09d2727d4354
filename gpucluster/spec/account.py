"""What EC2 needs of the account, beyond the stack's own resources, to launch a Slurm stack's nodes and bake its
images: named once for the Pulumi program (components/launch_access.py) and `preflight`, which checks them first.

- The spot service-linked role, one per account: EC2 launches spot instances (CreateFleet's too) through it, and makes
  it on first use only for a caller allowed iam:CreateServiceLinkedRole (EC2 User Guide, "Service-linked role for Spot
  Instance requests").
- The account's default EBS key. Every volume the stack makes is encrypted without naming a key (launch templates,
  the head's volumes, the image recipes), so EBS uses this key. AWS's own key (alias/aws/ebs) serves any principal of
  the account through EC2; a customer managed key serves only those its policy or a grant lets in (EC2 User Guide,
  "EC2 Fleet prerequisites"; EC2 Auto Scaling User Guide, "Required AWS KMS key policy for use with encrypted
  volumes").
"""

from __future__ import annotations

SPOT_SERVICE = "spot.amazonaws.com"
SPOT_ROLE = "AWSServiceRoleForEC2Spot"
SPOT_ROLE_FIX = f"aws iam create-service-linked-role --aws-service-name {SPOT_SERVICE}"
# EC2 Image Builder launches the build instances and snapshots their volumes through its own service-linked role,
# which it makes itself when the account's first Image Builder resource is created.
IMAGE_BUILDER_SERVICE = "imagebuilder.amazonaws.com"
IMAGE_BUILDER_ROLE = "AWSServiceRoleForImageBuilder"
AWS_EBS_KEY_ALIAS = "alias/aws/ebs"

# What a service that launches instances with volumes under a customer managed key is granted on it: the list the EC2
# Fleet prerequisites give for AWSServiceRoleForEC2Fleet (`aws kms create-grant ... --operations`).
SERVICE_GRANT_OPERATIONS = ("Decrypt", "Encrypt", "GenerateDataKey", "GenerateDataKeyWithoutPlaintext",
                            "CreateGrant", "DescribeKey", "ReEncryptFrom", "ReEncryptTo")
# What the head role needs on that key to launch on-demand and capacity-block nodes (an instant fleet launches as its
# caller): EC2 creates a grant for each volume, and decrypts and re-encrypts its data key through it. AWS documents no
# exact list for instant fleets; this is the use EC2 makes of the key for an encrypted volume (its CreateGrant only
# for an AWS resource).
CALLER_KEY_ACTIONS = ("kms:Decrypt", "kms:DescribeKey", "kms:GenerateDataKeyWithoutPlaintext", "kms:ReEncryptFrom",
                      "kms:ReEncryptTo")


def service_role_path(service: str) -> str:
    """The IAM path of a service's service-linked roles."""
    return f"/aws-service-role/{service}/"


def service_role_arn(account: str, service: str, role: str) -> str:
    return f"arn:aws:iam::{account}:role{service_role_path(service)}{role}"
