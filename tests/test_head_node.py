"""The head node, node access and their IAM under the mock runtime, for every shipped stack."""

from __future__ import annotations

import base64
import gzip
import io
import json
import tarfile

from conftest import ROOT, of_type
from gpucluster import bundle, userdata
from gpucluster.plan import Declared
from gpucluster.spec import Stack

Shipped = tuple[Stack, tuple[Declared, ...]]


def _one(declared: tuple[Declared, ...], suffix: str, name_end: str = "") -> Declared:
    (found,) = [d for d in of_type(declared, suffix) if d.name.endswith(name_end)]
    return found


def test_head_instance_is_private_imdsv2_encrypted_and_runs_the_rendered_user_data(shipped: Shipped) -> None:
    stack, declared = shipped
    head = _one(declared, "ec2/instance:Instance")
    assert head.inputs["instanceType"] == stack.spec.head_node.instance_type
    assert head.inputs["metadataOptions"]["httpTokens"] == "required"
    assert head.inputs["associatePublicIpAddress"] is False
    assert head.inputs["rootBlockDevice"]["encrypted"] is True
    assert head.inputs["userData"] == userdata.head_node(stack)
    assert head.inputs["subnetId"].endswith("-private-id") or head.inputs["subnetId"] == stack.spec.network.subnet_id
    assert head.inputs["vpcSecurityGroupIds"] == [f"{_one(declared, 'ec2/securityGroup:SecurityGroup', '-cluster').name}-id"]
    from gpucluster import cost

    assert head.inputs["rootBlockDevice"]["volumeSize"] == cost.HEAD_ROOT_GIB
    volume = _one(declared, "ebs/volume:Volume")
    assert volume.inputs["size"] == cost.HEAD_STATE_GIB
    assert volume.inputs["encrypted"] is True and volume.inputs["availabilityZone"] == stack.spec.availability_zone
    attachment = _one(declared, "ec2/volumeAttachment:VolumeAttachment")
    assert attachment.inputs["volumeId"] == f"{volume.name}-id" and attachment.inputs["instanceId"] == f"{head.name}-id"


def _statements(policy: Declared) -> dict[str, dict]:
    return {s["Sid"]: s for s in json.loads(policy.inputs["policy"])["Statement"]}


def test_head_role_is_scoped_to_this_cluster(shipped: Shipped) -> None:
    stack, declared = shipped
    head = _statements(_one(declared, "iam/rolePolicy:RolePolicy", "-head"))
    templates = sorted(f"arn:aws:ec2:{stack.region}:123456789012:launch-template/{lt.name}-id"
                       for lt in of_type(declared, "ec2/launchTemplate:LaunchTemplate"))
    launch = head["LaunchFromClusterTemplatesOnly"]
    assert sorted(launch["Condition"]["ArnLike"]["ec2:LaunchTemplate"]) == templates
    terminate = head["TagAndTerminateClusterInstancesOnly"]
    assert "ec2:TerminateInstances" in terminate["Action"]
    assert terminate["Condition"] == {"StringEquals": {"aws:ResourceTag/gpucluster:cluster": stack.cluster_name}}
    compute_role = _one(declared, "iam/role:Role", "-compute")
    assert head["PassComputeRoleOnly"]["Resource"] == f"arn:aws:plan:{stack.region}:123456789012:{compute_role.name}"
    munge = f"arn:aws:ssm:{stack.region}:123456789012:parameter{userdata.munge_key_parameter(stack)}"
    assert head["CreateMungeKeyOnce"] == {"Sid": "CreateMungeKeyOnce", "Effect": "Allow", "Action": "ssm:PutParameter",
                                          "Resource": munge}
    # Nothing but Describe* is granted on every resource without a condition.
    for sid, statement in head.items():
        if statement["Resource"] == "*" and "Condition" not in statement:
            assert all(a.startswith("ec2:Describe") for a in statement["Action"]), sid


def test_compute_role_reads_settings_key_bundle_and_writes_gpu_metrics_only(shipped: Shipped) -> None:
    stack, declared = shipped
    compute = _statements(_one(declared, "iam/rolePolicy:RolePolicy", "-compute"))
    assert set(compute) == {"ClusterSettings", "Bundle", "GpuMetrics"}
    assert compute["ClusterSettings"]["Action"] == "ssm:GetParameter"
    bucket = _one(declared, "s3/bucket:Bucket", "-bundle")
    assert compute["Bundle"] == {"Sid": "Bundle", "Effect": "Allow", "Action": "s3:GetObject", "Resource":
                                 f"arn:aws:s3:::{bucket.name}-<suffix at up>/{bundle.key(bundle.build(stack))}"}
    profile = _one(declared, "iam/instanceProfile:InstanceProfile", "-compute")
    for lt in of_type(declared, "ec2/launchTemplate:LaunchTemplate"):
        assert lt.inputs["iamInstanceProfile"] == {"arn": f"arn:aws:plan:{stack.region}:123456789012:{profile.name}"}


def test_settings_parameter_tells_nodes_what_up_learned(shipped: Shipped) -> None:
    stack, declared = shipped
    param = _one(declared, "ssm/parameter:Parameter")
    assert param.inputs["name"] == userdata.config_parameter(stack) and param.inputs["type"] == "String"
    settings = json.loads(param.inputs["insecureValue"])
    assert settings["cluster"] == stack.cluster_name and settings["team"] == stack.spec.team
    assert settings["head_address"] == "<private IP at up>"
    assert settings["all_or_nothing"] is stack.spec.slurm.all_or_nothing
    assert settings["capacity_retry_seconds"] == stack.spec.slurm.capacity_retry_seconds
    assert set(settings["pools"]) == {p.name for p in stack.spec.pools}
    for pool in stack.spec.pools:
        assert settings["pools"][pool.name]["market"] == pool.capacity
        assert settings["pools"][pool.name]["launch_template_id"].endswith("-lt-id")
    # The munge key is never declared: the head node creates it in SSM at first boot.
    assert not [d for d in of_type(declared, "ssm/parameter:Parameter") if d.inputs.get("type") == "SecureString"]


def test_bundle_object_holds_the_rendered_files(shipped: Shipped) -> None:
    stack, declared = shipped
    obj = _one(declared, "s3/bucketObjectv2:BucketObjectv2")
    data = base64.b64decode(obj.inputs["contentBase64"])
    assert data == bundle.build(stack) and obj.inputs["key"] == bundle.key(data)
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(data))) as tar:
        names = set(tar.getnames())
    programs = {"bootstrap.py", "gpucluster_node.py", "gpucluster_budget.py", "gpucluster_neuron_metrics.py"}
    metrics = {f"{'cloudwatch-agent' if p.itype.accelerator.kind == 'nvidia' else 'neuron-metrics'}/{p.name}.json"
               for p in stack.spec.pools}
    assert programs | {"accounting.sql", "accounting.sh", "slurm/slurm.conf", "slurm/gres.conf", "slurm/slurmdbd.conf",
                       "slurm/plugstack.conf"} | {f"examples/{n}" for n in bundle.EXAMPLES} | metrics | {
        f"lib/gpucluster/{source.name}" for source in (ROOT / "gpucluster").glob("*.py")} | {
        f"lib/stacks/Pulumi.{stack.name}.yaml"} == names


def test_bundle_is_deterministic(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Same content, same bytes, whenever it is built: its S3 key changes only with its content."""
    import time

    from conftest import STACK_FILES
    from gpucluster.spec import load_stack

    stack = load_stack(STACK_FILES[0])
    first = bundle.build(stack)
    monkeypatch.setattr(time, "time", lambda: 2_000_000_000.0)  # another day, as far as tar and gzip can tell
    assert bundle.build(stack) == first
    assert first[4:8] == b"\0\0\0\0"  # gzip header mtime
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(first))) as tar:
        assert {m.mtime for m in tar.getmembers()} == {0}


def test_node_program_reads_the_published_settings(shipped: Shipped, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The settings document the head node gets is one the node program loads."""
    import sys

    from conftest import ROOT

    sys.path.insert(0, str(ROOT / "cloud-init"))
    import gpucluster_node

    stack, declared = shipped
    path = tmp_path / "cluster.json"
    path.write_text(_one(declared, "ssm/parameter:Parameter").inputs["insecureValue"])
    config = gpucluster_node.ClusterSettings.load(path)
    assert config.cluster == stack.cluster_name and set(config.pools) == {p.name for p in stack.spec.pools}
    assert config.all_or_nothing is stack.spec.slurm.all_or_nothing
