"""The head node, node access and their IAM under the mock runtime, for every shipped stack."""

from __future__ import annotations

import base64
import gzip
import io
import json
import re
import tarfile
from pathlib import Path
from typing import Any

import pytest

from conftest import ALL_STACK_FILES, FIXTURES, ROOT, of_type, planned
from gpucluster.contract import settings as contract
from gpucluster.contract.settings import CLUSTER_TAG, POOL_TAG, STACK_TAG, TEAM_TAG, ClusterSettings
from gpucluster.plan import Declared, planned_id, planned_outputs
from gpucluster.project import EXAMPLES_DIR
from gpucluster.render import bundle, dashboards, prometheus, userdata
from gpucluster.spec.model import Stack, load_stack

Shipped = tuple[Stack, tuple[Declared, ...]]


def _one(declared: tuple[Declared, ...], suffix: str, name_end: str = "") -> Declared:
    (found,) = [d for d in of_type(declared, suffix) if d.name.endswith(name_end)]
    return found


def test_head_instance_is_private_imdsv2_encrypted_and_runs_the_rendered_user_data(shipped: Shipped) -> None:
    stack, declared = shipped
    head = _one(declared, "ec2/instance:Instance")
    assert head.inputs["instanceType"] == stack.spec.head_node.instance_type
    assert head.inputs["metadataOptions"]["httpTokens"] == "required"
    assert head.inputs["rootBlockDevice"]["encrypted"] is True
    assert head.inputs["userData"] == userdata.head_node(stack)
    from gpucluster.spec import cost

    assert head.inputs["rootBlockDevice"]["volumeSize"] == cost.HEAD_ROOT_GIB
    volume = _one(declared, "ebs/volume:Volume")
    assert volume.inputs["size"] == cost.HEAD_STATE_GIB
    assert volume.inputs["encrypted"] is True and volume.inputs["availabilityZone"] == stack.spec.availability_zone
    attachment = _one(declared, "ec2/volumeAttachment:VolumeAttachment")
    assert attachment.inputs["volumeId"] == planned_id(volume, stack.region)
    assert attachment.inputs["instanceId"] == planned_id(head, stack.region)


def test_head_instance_boots_on_its_fixed_private_interface(shipped: Shipped) -> None:
    """Device 0 of the head is an interface of its own in the private subnet with the cluster group: the head's
    address outlives the instance. The instance sets no network of its own (EC2 refuses both at once)."""
    stack, declared = shipped
    head = _one(declared, "ec2/instance:Instance")
    interface = _one(declared, "ec2/networkInterface:NetworkInterface")
    # primary_network_interface is device index 0 (pulumi-aws v7's successor of the deprecated network_interfaces).
    assert head.inputs["primaryNetworkInterface"] == {"networkInterfaceId": planned_id(interface, stack.region)}
    for own in ("subnetId", "vpcSecurityGroupIds", "securityGroups", "associatePublicIpAddress", "networkInterfaces",
                "privateIp", "sourceDestCheck"):
        assert own not in head.inputs, own
    private = stack.spec.network.subnet_id or planned_id(_one(declared, "ec2/subnet:Subnet", "-private"), stack.region)
    assert interface.inputs["subnetId"] == private
    assert interface.inputs["securityGroups"] == [
        planned_id(_one(declared, "ec2/securityGroup:SecurityGroup", "-cluster"), stack.region)]
    assert interface.inputs["tags"] == {"Name": f"{stack.cluster_name}-head"}
    assert "sourceDestCheck" not in interface.inputs  # EC2's default: checked
    for eip in of_type(declared, "ec2/eip:Eip"):  # no public address reaches the head (the NAT has its own)
        assert {eip.inputs.get("networkInterface"), eip.inputs.get("instance")} == {None}, eip.name


def test_head_is_replaced_delete_first_and_keeps_its_address_and_state(shipped: Shipped) -> None:
    """Two slurmctld never run at once, the state volume never attaches to two instances (VolumeInUse); the
    interface and the volume take nothing from the instance, so a new instance replaces neither."""
    stack, declared = shipped
    head = _one(declared, "ec2/instance:Instance")
    attachment = _one(declared, "ec2/volumeAttachment:VolumeAttachment")
    assert head.delete_before_replace and attachment.delete_before_replace
    assert head.ignore_changes == ()  # its images are exact: a new one replaces it, as the preview shows
    assert attachment.inputs["stopInstanceBeforeDetaching"] is True  # slurmctld and MariaDB stop cleanly first
    for keeper in (_one(declared, "ebs/volume:Volume"), _one(declared, "ec2/networkInterface:NetworkInterface")):
        assert planned_id(head, stack.region) not in json.dumps(keeper.inputs), keeper.name
        assert keeper.parent_urn == head.parent_urn and not keeper.retain_on_delete  # `pulumi destroy` deletes it


def _statements(policy: Declared) -> dict[str, dict]:
    return {s["Sid"]: s for s in json.loads(policy.inputs["policy"])["Statement"]}


def test_head_role_is_scoped_to_this_cluster(shipped: Shipped) -> None:
    stack, declared = shipped
    region, ec2 = stack.region, f"arn:aws:ec2:{stack.region}:123456789012"
    head = _statements(_one(declared, "iam/rolePolicy:RolePolicy", "-head"))
    launch_actions = ["ec2:RunInstances", "ec2:CreateFleet"]
    # Instances only with this cluster's tag in the request (the resume program's CreateFleet TagSpecifications).
    assert head["LaunchClusterInstancesOnly"] == {
        "Sid": "LaunchClusterInstancesOnly", "Effect": "Allow", "Action": launch_actions,
        "Resource": f"{ec2}:instance/*",
        "Condition": {"StringEquals": {"aws:RequestTag/gpucluster:cluster": stack.cluster_name}}}
    # Everything else a launch touches, named: this cluster's templates, subnet, group, images, placement groups
    # and reservations; interfaces, volumes and the fleet it creates. No ec2:LaunchTemplate condition key.
    launch = head["LaunchFromClusterResourcesOnly"]
    assert launch["Action"] == launch_actions and "Condition" not in launch
    launch_templates = of_type(declared, "ec2/launchTemplate:LaunchTemplate")
    templates = {f"{ec2}:launch-template/{planned_id(lt, region)}" for lt in launch_templates}
    subnet = stack.spec.network.subnet_id or planned_id(_one(declared, "ec2/subnet:Subnet", "-private"), region)
    group = planned_id(_one(declared, "ec2/securityGroup:SecurityGroup", "-cluster"), region)
    images = {f"arn:aws:ec2:{region}::image/{lt.inputs['imageId']}" for lt in launch_templates}
    groups = {f"{ec2}:placement-group/{pg.name}" for pg in of_type(declared, "ec2/placementGroup:PlacementGroup")}
    reservations = {f"{ec2}:capacity-reservation/{p.capacity_reservation_id}" for p in stack.spec.pools
                    if p.capacity_reservation_id}
    created = {f"{ec2}:{kind}/*" for kind in ("fleet", "network-interface", "volume")}
    assert set(launch["Resource"]) == templates | {f"{ec2}:subnet/{subnet}", f"{ec2}:security-group/{group}"} | \
        images | groups | reservations | created
    assert len(templates) == len(stack.spec.pools) and all(t.split("/")[1].startswith("lt-") for t in templates)
    assert head["TagAtLaunch"]["Resource"] == [f"{ec2}:instance/*", *sorted(created)]
    assert head["TagAtLaunch"]["Condition"] == {"StringEquals": {"ec2:CreateAction": ["RunInstances", "CreateFleet"]}}
    terminate = head["TerminateClusterInstancesOnly"]
    assert terminate["Action"] == "ec2:TerminateInstances" and terminate["Resource"] == f"{ec2}:instance/*"
    assert terminate["Condition"] == {"StringEquals": {"aws:ResourceTag/gpucluster:cluster": stack.cluster_name}}
    assert head["DecodeLaunchErrors"]["Action"] == "sts:DecodeAuthorizationMessage"
    compute_role = _one(declared, "iam/role:Role", "-compute")
    assert head["PassComputeRoleOnly"]["Resource"] == f"arn:aws:iam::123456789012:role/{compute_role.name}"
    munge = f"arn:aws:ssm:{region}:123456789012:parameter{userdata.munge_key_parameter(stack)}"
    assert head["CreateMungeKeyOnce"] == {"Sid": "CreateMungeKeyOnce", "Effect": "Allow", "Action": "ssm:PutParameter",
                                          "Resource": munge,  # created, never replaced
                                          "Condition": {"StringEquals": {"ssm:Overwrite": "false"}}}
    # On every resource without a condition: Describe*, decoding an authorization message and the SSM agent's
    # channels (none of which has a resource type).
    for sid, statement in head.items():
        if statement["Resource"] == "*" and "Condition" not in statement:
            actions = [statement["Action"]] if isinstance(statement["Action"], str) else statement["Action"]
            assert all(a.startswith("ec2:Describe") or a == "sts:DecodeAuthorizationMessage" or a in SSM_AGENT_ACTIONS
                       for a in actions), sid


def test_compute_role_reads_settings_key_bundle_and_writes_gpu_metrics_only(shipped: Shipped) -> None:
    stack, declared = shipped
    compute = _statements(_one(declared, "iam/rolePolicy:RolePolicy", "-compute"))
    assert set(compute) == {"ClusterSettings", "Bundle", "GpuMetrics", "SessionManagerAndRunCommand"}
    bucket = planned_id(_one(declared, "s3/bucket:Bucket", "-bundle"), stack.region)
    assert compute["Bundle"] == {"Sid": "Bundle", "Effect": "Allow", "Action": "s3:GetObject", "Resource":
                                 f"arn:aws:s3:::{bucket}/{bundle.key(bundle.build(stack, EXAMPLES_DIR))}"}
    profile = _one(declared, "iam/instanceProfile:InstanceProfile", "-compute")
    for lt in of_type(declared, "ec2/launchTemplate:LaunchTemplate"):
        assert lt.inputs["iamInstanceProfile"] == {"arn": f"arn:aws:iam::123456789012:instance-profile/{profile.name}"}


def test_settings_parameter_tells_nodes_what_up_learned(shipped: Shipped) -> None:
    stack, declared = shipped
    param = _one(declared, "ssm/parameter:Parameter")
    assert param.inputs["name"] == userdata.config_parameter(stack) and param.inputs["type"] == "String"
    settings = json.loads(param.inputs["insecureValue"])
    assert settings["cluster"] == stack.cluster_name and settings["team"] == stack.spec.team
    assert settings["all_or_nothing"] is stack.spec.slurm.all_or_nothing
    assert settings["capacity_retry_seconds"] == stack.spec.slurm.capacity_retry_seconds
    assert set(settings["pools"]) == {p.name for p in stack.spec.pools}
    for pool in stack.spec.pools:
        assert settings["pools"][pool.name]["market"] == pool.capacity
        assert settings["pools"][pool.name]["launch_template_id"].startswith("lt-")
    # The munge key is never declared: the head node creates it in SSM at first boot.
    assert not [d for d in of_type(declared, "ssm/parameter:Parameter") if d.inputs.get("type") == "SecureString"]


def test_head_address_is_the_fixed_interface_ip(shipped: Shipped) -> None:
    """Nodes reach the head at its interface's address (what AWS gives the interface), not the instance's own."""
    import ipaddress

    stack, declared = shipped
    interface = _one(declared, "ec2/networkInterface:NetworkInterface")
    given = planned_outputs(interface, stack.region)["privateIp"]
    settings = json.loads(_one(declared, "ssm/parameter:Parameter").inputs["insecureValue"])
    assert settings["head_address"] == given and ipaddress.IPv4Address(given).is_private


def test_settings_document_is_the_contract(shipped: Shipped, tmp_path: Path) -> None:
    """The parameter's JSON loads through ClusterSettings and is exactly what the contract writes back."""
    stack, declared = shipped
    text = _one(declared, "ssm/parameter:Parameter").inputs["insecureValue"]
    (tmp_path / "cluster.json").write_text(text)
    settings = ClusterSettings.load(tmp_path / "cluster.json")
    assert settings.to_json() == text
    assert settings.munge_key_parameter == userdata.munge_key_parameter(stack)
    assert settings.state_volume_id == planned_id(_one(declared, "ebs/volume:Volume"), stack.region)
    for pool in stack.spec.pools:
        spec = settings.pools[pool.name]
        assert (spec.name, spec.instance_type, spec.max_nodes) == (pool.name, pool.instance_type, pool.max_nodes)
        assert isinstance(spec.launch_template_version, str)
    assert settings.people == stack.spec.people  # the stack's people reach the nodes (none: the shared login user)


def test_a_launch_spec_key_the_contract_does_not_know_fails_up() -> None:
    """The document is built through ClusterSettings.from_dict: drift between pools and contract stops `pulumi up`."""
    from types import SimpleNamespace

    import pytest

    from components.head_node import NodeProgramSettings, settings_document
    from gpucluster.contract.settings import SettingsError

    # The fields of HeadNodeArgs that settings_document reads.
    args = SimpleNamespace(cluster_name="c", team="t", region="us-east-1", bundle_key="k", munge_key_parameter="/m",
                           node_program_settings=NodeProgramSettings(all_or_nothing=True, capacity_retry_seconds=600,
                                                                     checkpoint_grace_seconds=60,
                                                                     drain_on_rebalance=True), people=())
    pool = {"launch_template_id": "lt-1", "launch_template_version": 3, "subnet_id": "subnet-1",
            "instance_type": "p5.48xlarge", "market": "spot"}
    learned = {"bundle_bucket": "b", "head_address": "10.0.0.5", "state_volume_id": "vol-1", "fsx_dns_name": "d",
               "fsx_mount_name": "m", "budget": None}

    def document(pools: dict[str, Any]) -> str:
        return settings_document(args, {**learned, "pools": pools})  # type: ignore[arg-type]  # args: the stand-in

    doc = json.loads(document({"p5": pool}))
    assert doc["pools"]["p5"]["launch_template_version"] == "3" and "budget" not in doc
    with pytest.raises(SettingsError, match="pools.p5: unknown key"):
        document({"p5": {**pool, "spot_max_price": 9}})


def test_nodes_read_settings_and_munge_key_in_one_call_on_those_two_parameters_only(shipped: Shipped) -> None:
    """GetParameters (one call for both) and GetParameter, on the config and the munge key, for head and compute
    roles; no other statement of the stack grants an SSM parameter read."""
    stack, declared = shipped
    arn = f"arn:aws:ssm:{stack.region}:123456789012:parameter"
    two = [f"{arn}{userdata.config_parameter(stack)}", f"{arn}{userdata.munge_key_parameter(stack)}"]
    reads = {}
    for role_policy in of_type(declared, "iam/rolePolicy:RolePolicy"):
        for statement in json.loads(role_policy.inputs["policy"])["Statement"]:
            actions = [statement["Action"]] if isinstance(statement["Action"], str) else statement["Action"]
            assert not [a for a in actions if a.startswith("ssm:") and "*" in a], role_policy.name
            if any(a.startswith("ssm:Get") for a in actions):
                reads[role_policy.name] = (sorted(actions), statement["Resource"])
    assert reads == {f"{stack.cluster_name}-{role}": (["ssm:GetParameter", "ssm:GetParameters"], two)
                     for role in ("head", "compute")}


def test_bundle_object_holds_the_rendered_files(shipped: Shipped) -> None:
    stack, declared = shipped
    obj = _one(declared, "s3/bucketObjectv2:BucketObjectv2")
    data = base64.b64decode(obj.inputs["contentBase64"])
    assert data == bundle.build(stack, EXAMPLES_DIR) and obj.inputs["key"] == bundle.key(data)
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(data))) as tar:
        names = set(tar.getnames())
        modes = {member.name: member.mode for member in tar.getmembers()}
    # The node programs, which Slurm, systemd and the boot run by their paths in the library: executable, and only they.
    programs = {f"lib/gpucluster/node/{name}" for name in (
        "bootstrap.py", "fetch_bundle.py", "build_image.sh", "resume.py", "suspend.py", "resume_fail.py",
        "reconcile.py", "interruptions.py", "budget_guardrail.py", "neuron_metrics.py", "task_prolog.sh", "hosts.py",
        "health.py", "metrics.py")}
    # Prometheus' configuration, rules and flags; dcgm-exporter's counters; Grafana's dashboards.
    metrics = set(prometheus.files(stack)) | set(dashboards.files(stack))
    metrics |= {f"{'cloudwatch-agent' if p.accelerator.kind == 'nvidia' else 'neuron-metrics'}/{p.name}.json"
               for p in stack.spec.pools}
    slurm_files = {f"slurm/{n}" for n in ("slurm.conf", "gres.conf", "slurmdbd.conf", "plugstack.conf", "cgroup.conf",
                                          "job_container.conf", "mpi.conf", "job_submit.lua")}
    library = {f"lib/{source.relative_to(ROOT).as_posix()}" for source in (ROOT / "gpucluster").rglob("*.py")
               if "__pycache__" not in source.parts}
    # lib/ mirrors the repository for what `gpucluster render` reads there: the stack's file beside the library, and
    # the Ubuntu lock its stack file is checked against.
    library |= {f"lib/stacks/Pulumi.{stack.name}.yaml", "lib/gpucluster/spec/ubuntu-lock.json"}
    # The images' bill of materials, for a node booted on a stock AMI (image.build false): outside lib/, so a compute
    # node unpacks it.
    image = {str(Path(contract.BUNDLE_BOM).relative_to(contract.BUNDLE_DIR))}
    assert image == {"image/bom.json"}
    verify_plan = {str(Path(contract.VERIFY_PLAN).relative_to(contract.BUNDLE_DIR))}  # `gpucluster verify`'s figures
    leavers = {str(Path(contract.PEOPLE_LEAVERS_SCRIPT).relative_to(contract.BUNDLE_DIR))}  # the update timer's
    assert programs | {"accounting.sql", "accounting.sh"} | leavers | slurm_files | \
        {f"examples/{n}" for n in bundle.EXAMPLES} | metrics | library | image | verify_plan == names
    assert {name for name in names if name.startswith("lib/") and modes[name] == 0o755} == programs


def test_bundle_is_deterministic(monkeypatch: pytest.MonkeyPatch) -> None:
    """Same content, same bytes, whenever it is built: its S3 key changes only with its content."""
    import time

    from conftest import STACK_FILES
    from gpucluster.spec.model import load_stack

    stack = load_stack(STACK_FILES[0])
    first = bundle.build(stack, EXAMPLES_DIR)
    monkeypatch.setattr(time, "time", lambda: 2_000_000_000.0)  # another day, as far as tar and gzip can tell
    assert bundle.build(stack, EXAMPLES_DIR) == first
    assert first[4:8] == b"\0\0\0\0"  # gzip header mtime
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(first))) as tar:
        assert {m.mtime for m in tar.getmembers()} == {0}


def test_node_program_reads_the_published_settings(shipped: Shipped, tmp_path: Path) -> None:
    """The settings document the head node gets is one the node programs load."""
    from gpucluster.contract.settings import ClusterSettings

    stack, declared = shipped
    path = tmp_path / "cluster.json"
    path.write_text(_one(declared, "ssm/parameter:Parameter").inputs["insecureValue"])
    config = ClusterSettings.load(path)
    assert config.cluster == stack.cluster_name and set(config.pools) == {p.name for p in stack.spec.pools}
    assert config.all_or_nothing is stack.spec.slurm.all_or_nothing


SSM_AGENT_ACTIONS = {
    "ssm:UpdateInstanceInformation", "ssmmessages:CreateControlChannel", "ssmmessages:CreateDataChannel",
    "ssmmessages:OpenControlChannel", "ssmmessages:OpenDataChannel", "ec2messages:AcknowledgeMessage",
    "ec2messages:DeleteMessage", "ec2messages:FailMessage", "ec2messages:GetEndpoint", "ec2messages:GetMessages",
    "ec2messages:SendReply"}
# Per role, every action it holds (inline policies) and every managed policy attached to it: a permission added or
# widened fails here, to be reviewed as an attacker would (see the comments at each statement).
ROLE_ACTIONS = {
    "-head": SSM_AGENT_ACTIONS | {
        "ec2:RunInstances", "ec2:CreateFleet", "ec2:CreateTags", "ec2:TerminateInstances", "ec2:DescribeInstances",
        "ec2:DescribeInstanceStatus", "ec2:DescribeLaunchTemplates", "ec2:DescribeLaunchTemplateVersions",
        "sts:DecodeAuthorizationMessage", "iam:PassRole", "ssm:GetParameter", "ssm:GetParameters", "ssm:PutParameter",
        "s3:GetObject", "sns:Publish", "sns:GetTopicAttributes"},
    "-compute": SSM_AGENT_ACTIONS | {"ssm:GetParameter", "ssm:GetParameters", "s3:GetObject",
                                     "cloudwatch:PutMetricData"},
    "-budget-action": {"iam:AttachRolePolicy", "iam:DetachRolePolicy"},
}
INTERRUPTION_ACTIONS = {"sqs:ReceiveMessage", "sqs:DeleteMessage", "sqs:GetQueueAttributes"}
GUARDRAIL_ACTIONS = {"sqs:ReceiveMessage", "sqs:DeleteMessage", "sqs:GetQueueAttributes",
                     "budgets:ViewBudget", "budgets:DescribeBudgetActionsForBudget", "budgets:ExecuteBudgetAction"}
IMAGE_BUILD_MANAGED = {"arn:aws:iam::aws:policy/AmazonSSMManagedInstanceCore",
                       "arn:aws:iam::aws:policy/EC2InstanceProfileForImageBuilder"}


def _actions(document: str) -> set[str]:
    found: set[str] = set()
    for statement in json.loads(document)["Statement"]:
        found |= {statement["Action"]} if isinstance(statement["Action"], str) else set(statement["Action"])
    return found


def test_each_role_holds_exactly_its_actions(shipped: Shipped) -> None:
    stack, declared = shipped
    roles = {d.name: d for d in of_type(declared, "iam/role:Role")}
    inline: dict[str, set[str]] = {name: set() for name in roles}
    managed: dict[str, set[str]] = {name: set() for name in roles}
    for rp in of_type(declared, "iam/rolePolicy:RolePolicy"):
        owner = next(name for name in roles if planned_id(roles[name], stack.region) == rp.inputs["role"])
        inline[owner] |= _actions(rp.inputs["policy"])
    for attachment in of_type(declared, "iam/rolePolicyAttachment:RolePolicyAttachment"):
        owner = next(name for name in roles if roles[name].name == attachment.inputs["role"]
                     or planned_outputs(roles[name], stack.region).get("name") == attachment.inputs["role"])
        managed[owner].add(attachment.inputs["policyArn"])
    guardrail = stack.spec.budget.act_threshold_percent is not None
    for name in roles:
        suffix = name.removeprefix(stack.cluster_name)
        if suffix in ROLE_ACTIONS:
            spot = any(pool.capacity == "spot" for pool in stack.spec.pools)
            expected = ROLE_ACTIONS[suffix] | (GUARDRAIL_ACTIONS if suffix == "-head" and guardrail else set()) | \
                (INTERRUPTION_ACTIONS if suffix == "-head" and spot else set())
            assert inline[name] == expected, (name, inline[name] ^ expected)
            # No managed policy on a node role: AmazonSSMManagedInstanceCore would read every parameter of the
            # account (another stack's munge key).
            assert not managed[name], (name, managed[name])
        else:  # an image build role: Image Builder's documented pair, nothing inline
            assert suffix.endswith("-build") and managed[name] == IMAGE_BUILD_MANAGED and not inline[name], name


def test_a_failed_host_brings_the_head_back_by_ec2_recovery(shipped: Shipped) -> None:
    stack, declared = shipped
    (alarm,) = [a for a in of_type(declared, "cloudwatch/metricAlarm:MetricAlarm") if a.name.endswith("-head-recover")]
    (head,) = of_type(declared, "ec2/instance:Instance")
    assert (alarm.inputs["namespace"], alarm.inputs["metricName"]) == ("AWS/EC2", "StatusCheckFailed_System")
    assert alarm.inputs["dimensions"] == {"InstanceId": planned_id(head, stack.region)}
    assert alarm.inputs["alarmActions"][0] == f"arn:aws:automate:{stack.region}:ec2:recover"
    assert alarm.inputs["alarmActions"][1].startswith("arn:aws:sns:")  # and the team hears of it


EVERY_SLURM_STACK = [p for p in sorted([*ALL_STACK_FILES, *FIXTURES.glob("Pulumi.*.yaml")])
                     if load_stack(p).spec.scheduler == "slurm"]


@pytest.mark.parametrize("path", EVERY_SLURM_STACK, ids=lambda p: p.name)
def test_the_head_may_publish_to_the_alerts_topic_whatever_the_stack(path: Path) -> None:
    """Alertmanager on the head sends GpuIdle and XID alerts with the head role: every stack shape (on-demand only,
    no act threshold, capacity blocks) lets it publish to the stack's topic, and to that topic only."""
    stack, declared = planned(path)
    topic = planned_outputs(_one(declared, "sns/topic:Topic", "-alerts"), stack.region)["arn"]
    head = _statements(_one(declared, "iam/rolePolicy:RolePolicy", "-head"))
    assert head["TellTheTeam"] == {"Sid": "TellTheTeam", "Effect": "Allow", "Action": "sns:Publish",
                                   "Resource": topic}
    # verify's budget_topic check reads the topic with the head's role; the topic's policy grants services only.
    assert head["VerifyTheTeamTopic"] == {"Sid": "VerifyTheTeamTopic", "Effect": "Allow",
                                          "Action": "sns:GetTopicAttributes", "Resource": topic}
    settings = json.loads(_one(declared, "ssm/parameter:Parameter", "-config").inputs["insecureValue"])
    assert settings["alerts_topic_arn"] == topic  # where Alertmanager's receiver sends (bootstrap.alertmanager_config)
    # One grant (the interruptions service and the guardrail use it too), on the head role only.
    publishing = [(rp.name, statement["Resource"]) for rp in of_type(declared, "iam/rolePolicy:RolePolicy")
                  for statement in json.loads(rp.inputs["policy"])["Statement"]
                  if "sns:Publish" in (statement["Action"] if isinstance(statement["Action"], list)
                                       else [statement["Action"]])]
    assert publishing == [(f"{stack.cluster_name}-head", topic)]


# EC2's rule for tag keys once an instance's tags are in its metadata (EC2 User Guide, "View tags for your EC2
# instances using instance metadata"): any other key fails the launch.
METADATA_TAG_KEY = re.compile(r"(?!\.{1,2}$|_index$)[A-Za-z0-9+\-=.,_:@]+")


def test_pool_instances_carry_their_tags_in_metadata_under_keys_ec2_allows_there(shipped: Shipped) -> None:
    """A node's first boot reads its pool tag from its metadata (health.pool_tag): every pool's template turns tags
    in metadata on, and then every key EC2 puts on the instance must be one EC2 accepts there, ours included."""
    stack, declared = shipped
    pools = [lt for lt in of_type(declared, "ec2/launchTemplate:LaunchTemplate")
             if any(POOL_TAG in spec["tags"] for spec in lt.inputs.get("tagSpecifications", []))]
    assert len(pools) == len(stack.spec.pools)
    for lt in pools:
        assert lt.inputs["metadataOptions"]["instanceMetadataTags"] == "enabled"
        for spec in lt.inputs["tagSpecifications"]:
            assert all(METADATA_TAG_KEY.fullmatch(key) for key in spec["tags"]), spec["tags"]
    for key in (CLUSTER_TAG, TEAM_TAG, STACK_TAG, POOL_TAG):  # what the resume program adds in its request too
        assert METADATA_TAG_KEY.fullmatch(key), key
    assert not METADATA_TAG_KEY.fullmatch("kubernetes.io/cluster/x") and not METADATA_TAG_KEY.fullmatch("..")
