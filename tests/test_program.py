"""The Pulumi program under Pulumi's mock runtime, for every stack in stacks/ and the fixtures in tests/stacks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import FIXTURES, ROOT, STACK_FILES, of_type, planned
from gpucluster.plan import Declared, planned_ami_id, planned_id
from gpucluster.project import pulumi_program
from gpucluster.spec import catalog
from gpucluster.spec.model import Stack

PROVIDER = "pulumi:providers:aws"


def _pool_templates(declared: tuple[Declared, ...]) -> dict[str, dict]:
    """Pool name -> launch-template inputs."""
    out = {}
    for lt in of_type(declared, "ec2/launchTemplate:LaunchTemplate"):
        (spec,) = lt.inputs["tagSpecifications"][:1]
        out[spec["tags"]["gpucluster:pool"]] = lt.inputs
    return out


def test_efa_layout_per_pool(shipped: tuple[Stack, tuple[Declared, ...]]) -> None:
    stack, declared = shipped
    templates = _pool_templates(declared)
    assert set(templates) == {p.name for p in stack.spec.pools}
    for pool in stack.spec.pools:
        nics = templates[pool.name]["networkInterfaces"]
        expected = pool.itype.efa_interfaces if pool.uses_efa else 1
        assert len(nics) == expected, pool.name
        assert [int(n["networkCardIndex"]) for n in nics] == list(range(expected))
        assert all(int(n["deviceIndex"]) == 0 for n in nics)
        assert nics[0]["interfaceType"] == ("efa" if pool.uses_efa else "interface")
        assert all(n["interfaceType"] == "efa-only" for n in nics[1:])
        assert all(n["subnetId"] and n["securityGroups"] for n in nics)


def test_efa_interface_counts_for_the_big_types() -> None:
    _, declared = planned(ROOT / "stacks" / "Pulumi.team-a.yaml")
    assert {len(t["networkInterfaces"]) for t in _pool_templates(declared).values()} == {32}  # p5
    _, declared = planned(ROOT / "stacks" / "Pulumi.team-b.yaml")
    assert len(_pool_templates(declared)["p4d-spot"]["networkInterfaces"]) == 4  # p4d
    _, declared = planned(FIXTURES / "Pulumi.existing.yaml")
    assert len(_pool_templates(declared)["p5en-cb"]["networkInterfaces"]) == 16  # p5en


def test_imdsv2_and_encrypted_root(shipped: tuple[Stack, tuple[Declared, ...]]) -> None:
    _, declared = shipped
    for lt in _pool_templates(declared).values():
        assert lt["metadataOptions"]["httpTokens"] == "required"
        (root,) = lt["blockDeviceMappings"]
        assert root["ebs"]["encrypted"] == "true" and root["ebs"]["volumeType"] == "gp3"
        assert root["ebs"]["volumeSize"] >= 120
        assert not any(n.get("associatePublicIpAddress") == "true" for n in lt["networkInterfaces"])


def test_placement_group_on_every_efa_pool(shipped: tuple[Stack, tuple[Declared, ...]]) -> None:
    stack, declared = shipped
    groups = {g.name: g.inputs for g in of_type(declared, "ec2/placementGroup:PlacementGroup")}
    assert all(g["strategy"] == "cluster" for g in groups.values())
    templates = _pool_templates(declared)
    for pool in stack.spec.pools:
        placement = templates[pool.name].get("placement")
        if pool.uses_efa:
            assert placement and placement["groupName"] in groups, pool.name
        else:
            assert not placement
    assert len(groups) == sum(p.uses_efa for p in stack.spec.pools)


def test_tags_come_from_the_one_provider(shipped: tuple[Stack, tuple[Declared, ...]]) -> None:
    stack, declared = shipped
    (provider,) = [d for d in declared if d.type == PROVIDER and d.name == "aws"]
    # Provider configuration reaches the engine JSON-encoded.
    assert json.loads(provider.inputs["defaultTags"]) == {"tags": stack.tags}
    assert provider.inputs["region"] == stack.region
    # The account's spot service-linked role is no stack's: on a provider of its own, without the stack's tags.
    account_wide = {d.urn for d in of_type(declared, "iam/serviceLinkedRole:ServiceLinkedRole")}
    for d in declared:
        if d.type.startswith("aws:") and d.urn not in account_wide:
            assert d.provider.startswith(provider.urn + "::"), f"{d.type} {d.name} is not on the tagged provider"
    for other in [d for d in declared if d.type == PROVIDER and d.name != "aws"]:
        assert "defaultTags" not in other.inputs
        on_it = {d.type for d in declared if d.provider.startswith(other.urn + "::")}
        assert on_it <= {"aws:iam/serviceLinkedRole:ServiceLinkedRole"}, on_it
    # Instances launched from a template are tagged by the template, not by the provider.
    for pool, lt in _pool_templates(declared).items():
        kinds = {s["resourceType"] for s in lt["tagSpecifications"]}
        assert kinds == {"instance", "volume", "network-interface"}
        for s in lt["tagSpecifications"]:
            assert s["tags"] == {**stack.tags, "gpucluster:pool": pool}


def test_no_inbound_from_the_internet(shipped: tuple[Stack, tuple[Declared, ...]]) -> None:
    _, declared = shipped
    for rule in of_type(declared, "vpc/securityGroupIngressRule:SecurityGroupIngressRule"):
        assert rule.inputs.get("cidrIpv4") != "0.0.0.0/0" and rule.inputs.get("cidrIpv6") != "::/0"
    for sg in of_type(declared, "ec2/securityGroup:SecurityGroup"):
        assert not sg.inputs.get("ingress")
    for subnet in of_type(declared, "ec2/subnet:Subnet"):
        assert subnet.inputs.get("mapPublicIpOnLaunch") is False


def test_cluster_group_talks_to_itself(shipped: tuple[Stack, tuple[Declared, ...]]) -> None:
    """EFA needs all traffic to and from the group itself; the same rule opens Lustre's 988 and 1018-1023."""
    stack, declared = shipped
    (cluster_sg,) = [s for s in of_type(declared, "ec2/securityGroup:SecurityGroup") if s.name.endswith("-cluster")]
    sg_id = planned_id(cluster_sg, stack.region)
    for kind in ("Ingress", "Egress"):
        rules = of_type(declared, f"vpc/securityGroup{kind}Rule:SecurityGroup{kind}Rule")
        assert any(r.inputs["securityGroupId"] == sg_id and r.inputs.get("referencedSecurityGroupId") == sg_id
                   and r.inputs["ipProtocol"] == "-1" for r in rules), kind
    if stack.spec.storage.lustre.file_system_id is None:
        (fs,) = of_type(declared, "fsx/lustreFileSystem:LustreFileSystem")
        assert fs.inputs["securityGroupIds"] == [sg_id]


def _cluster_group_rules(stack: Stack, declared: tuple[Declared, ...]) -> set[str]:
    """URNs of the cluster security group's rules."""
    (sg,) = [s for s in of_type(declared, "ec2/securityGroup:SecurityGroup") if s.name.endswith("-cluster")]
    rules = {r.urn for r in declared if r.type.startswith("aws:vpc/securityGroup")
             and r.inputs["securityGroupId"] == planned_id(sg, stack.region)}
    assert len(rules) == 3  # from and to itself, out to the internet
    return rules


def test_file_system_waits_for_the_group_rules(shipped: tuple[Stack, tuple[Declared, ...]]) -> None:
    """FSx checks the group's rules at CreateFileSystem (aws-parallelcluster#6181): the rules exist before it."""
    stack, declared = shipped
    (fs,) = of_type(declared, "fsx/lustreFileSystem:LustreFileSystem")
    assert _cluster_group_rules(stack, declared) <= set(fs.dependencies)


@pytest.mark.parametrize("path", [*STACK_FILES, FIXTURES / "Pulumi.existing.yaml"], ids=lambda p: p.name)
def test_head_node_waits_for_the_group_rules(path: Path) -> None:
    """The head's boot mounts /fsx and reaches S3 and SSM, also where the file system is not the stack's."""
    stack, declared = planned(path)
    (head,) = of_type(declared, "ec2/instance:Instance")
    assert _cluster_group_rules(stack, declared) <= set(head.dependencies)


def test_new_network_is_private_with_endpoints(shipped: tuple[Stack, tuple[Declared, ...]]) -> None:
    stack, declared = shipped
    (vpc,) = of_type(declared, "ec2/vpc:Vpc")
    assert vpc.inputs["cidrBlock"] == stack.spec.network.vpc_cidr
    subnets = of_type(declared, "ec2/subnet:Subnet")
    assert {s.inputs["availabilityZone"] for s in subnets} == {stack.spec.availability_zone}
    endpoints = {e.inputs["serviceName"].rsplit(".", 1)[1]: e.inputs
                 for e in of_type(declared, "ec2/vpcEndpoint:VpcEndpoint")}
    assert endpoints["s3"]["vpcEndpointType"] == "Gateway"
    for service in ("ssm", "ssmmessages", "ec2messages"):
        assert endpoints[service]["vpcEndpointType"] == "Interface" and endpoints[service]["privateDnsEnabled"]
    (nat,) = of_type(declared, "ec2/natGateway:NatGateway")
    (private_rt,) = [r for r in of_type(declared, "ec2/routeTable:RouteTable") if r.name.endswith("-private")]
    assert private_rt.inputs["routes"] == [{"cidrBlock": "0.0.0.0/0", "natGatewayId": planned_id(nat, stack.region)}]


def test_fsx_settings(shipped: tuple[Stack, tuple[Declared, ...]]) -> None:
    stack, declared = shipped
    lustre = stack.spec.storage.lustre
    (fs,) = of_type(declared, "fsx/lustreFileSystem:LustreFileSystem")
    assert fs.inputs["deploymentType"] == lustre.deployment_type
    assert fs.inputs["storageCapacity"] == lustre.storage_capacity_gib
    assert fs.inputs.get("perUnitStorageThroughput") == lustre.throughput_mb_per_tib
    assert fs.inputs["dataCompressionType"] == "LZ4"
    assert fs.inputs["fileSystemTypeVersion"] == "2.15"
    (dra,) = of_type(declared, "fsx/dataRepositoryAssociation:DataRepositoryAssociation")
    assert dra.inputs["fileSystemId"] == planned_id(fs, stack.region)
    assert dra.inputs["s3"]["autoImportPolicy"]["events"] == ["NEW", "CHANGED", "DELETED"]
    storage = tuple(d for d in declared if d.parent_type == "gpucluster:storage:Storage")
    buckets = of_type(storage, "s3/bucket:Bucket")
    if lustre.data_repository:
        assert dra.inputs["dataRepositoryPath"] == lustre.data_repository and not buckets
        # The team's own bucket: import only, so that deleting under /fsx never deletes their objects.
        assert "autoExportPolicy" not in dra.inputs["s3"]
    else:
        (bucket,) = buckets
        assert dra.inputs["dataRepositoryPath"].startswith("s3://")
        assert dra.inputs["s3"]["autoExportPolicy"]["events"] == ["NEW", "CHANGED", "DELETED"]
        (block,) = of_type(storage, "s3/bucketPublicAccessBlock:BucketPublicAccessBlock")
        assert all(block.inputs[k]
                   for k in ("blockPublicAcls", "blockPublicPolicy", "ignorePublicAcls", "restrictPublicBuckets"))
        (versioning,) = of_type(storage, "s3/bucketVersioning:BucketVersioning")
        assert versioning.inputs["versioningConfiguration"]["status"] == "Enabled"
        (sse,) = of_type(storage, "s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration")
        assert sse.inputs["rules"][0]["applyServerSideEncryptionByDefault"]["sseAlgorithm"] == "AES256"
        # The stack's bucket holds the data: kept at `pulumi destroy` (and never emptied by it) unless asked.
        assert lustre.keep_bucket_on_destroy and bucket.inputs["forceDestroy"] is False
        bucket_parts = [d for d in storage if d.name == bucket.name]
        assert len(bucket_parts) == 5 and all(d.retain_on_delete for d in bucket_parts)
    # The file system is a cache of S3 that bills monthly: deleted with the stack unless asked, with no final
    # backup left behind.
    assert fs.retain_on_delete is dra.retain_on_delete is lustre.keeps_file_system is False
    if lustre.deployment_type == "PERSISTENT_2":
        assert fs.inputs["skipFinalBackup"] is True


def test_only_the_stacks_own_bucket_takes_exports() -> None:
    """team-b names its existing dataset bucket: import only. team-a's bucket is the stack's: import and export."""
    events = ["NEW", "CHANGED", "DELETED"]
    stack, declared = planned(ROOT / "stacks" / "Pulumi.team-b.yaml")
    assert stack.spec.storage.lustre.data_repository
    (dra,) = of_type(declared, "fsx/dataRepositoryAssociation:DataRepositoryAssociation")
    assert dra.inputs["s3"] == {"autoImportPolicy": {"events": events}}
    stack, declared = planned(ROOT / "stacks" / "Pulumi.team-a.yaml")
    assert not stack.spec.storage.lustre.data_repository
    (dra,) = of_type(declared, "fsx/dataRepositoryAssociation:DataRepositoryAssociation")
    assert dra.inputs["s3"] == {"autoImportPolicy": {"events": events}, "autoExportPolicy": {"events": events}}


def test_budget_notifications(shipped: tuple[Stack, tuple[Declared, ...]]) -> None:
    stack, declared = shipped
    budget_spec = stack.spec.budget
    (budget,) = of_type(declared, "budgets/budget:Budget")
    (topic,) = of_type(declared, "sns/topic:Topic")
    assert budget.inputs["limitAmount"] == f"{budget_spec.monthly_usd:.2f}"
    assert budget.inputs["timeUnit"] == "MONTHLY" and budget.inputs["budgetType"] == "COST"
    assert budget.inputs["costFilters"] == [{"name": "TagKeyValue", "values": [f"user:gpucluster:stack${stack.name}"]}]
    got = {(n["threshold"], n["notificationType"]) for n in budget.inputs["notifications"]}
    act = set() if budget_spec.act_threshold_percent is None else {budget_spec.act_threshold_percent}
    assert got == {(float(t), "FORECASTED") for t in budget_spec.thresholds_percent} | {
        (float(t), "ACTUAL") for t in set(budget_spec.thresholds_percent) | act}
    topic_arn = f"arn:aws:sns:{stack.region}:123456789012:{topic.name}"
    assert all(n["subscriberSnsTopicArns"] == [topic_arn] for n in budget.inputs["notifications"])
    emails = sorted(s.inputs["endpoint"] for s in of_type(declared, "sns/topicSubscription:TopicSubscription")
                    if s.inputs["protocol"] == "email")
    assert emails == sorted(budget_spec.notify_emails)
    (policy,) = of_type(declared, "sns/topicPolicy:TopicPolicy")
    (statement,) = json.loads(policy.inputs["policy"])["Statement"]
    assert statement["Principal"]["Service"] == ["budgets.amazonaws.com", "cloudwatch.amazonaws.com"]
    assert statement["Condition"] == {"StringEquals": {"aws:SourceAccount": "123456789012"}}
    tags = of_type(declared, "costexplorer/costAllocationTag:CostAllocationTag")
    assert [t.inputs["tagKey"] for t in tags] \
        == (["gpucluster:stack"] if budget_spec.activate_cost_allocation_tag else [])
    assert all(t.retain_on_delete for t in tags)


def _arn(stack: Stack, service: str, resource: str) -> str:
    """An ARN in AWS's format for its service: IAM and Budgets have no region."""
    region = "" if service in ("iam", "budgets") else stack.region
    return f"arn:aws:{service}:{region}:123456789012:{resource}"


def test_budget_reaches_the_head_node_and_the_launch_deny(shipped: tuple[Stack, tuple[Declared, ...]]) -> None:
    stack, declared = shipped
    act = stack.spec.budget.act_threshold_percent
    assert act is not None  # every shipped stack acts on its budget
    name = stack.cluster_name
    topic, queue = _arn(stack, "sns", f"{name}-alerts"), _arn(stack, "sqs", f"{name}-guardrail")
    # Budget messages reach an encrypted queue that only this topic may write to.
    (q,) = [q for q in of_type(declared, "sqs/queue:Queue") if q.name.endswith("-guardrail")]
    assert q.inputs["sqsManagedSseEnabled"] is True
    (queue_policy,) = [p for p in of_type(declared, "sqs/queuePolicy:QueuePolicy") if p.name.endswith("-guardrail")]
    (allow,) = json.loads(queue_policy.inputs["policy"])["Statement"]
    assert (allow["Principal"], allow["Action"], allow["Resource"]) \
        == ({"Service": "sns.amazonaws.com"}, "sqs:SendMessage", queue)
    assert allow["Condition"] == {"ArnEquals": {"aws:SourceArn": topic}}
    (to_queue,) = [s for s in of_type(declared, "sns/topicSubscription:TopicSubscription")
                   if s.inputs["protocol"] == "sqs"]
    assert (to_queue.inputs["topic"], to_queue.inputs["endpoint"]) == (topic, queue)
    # The head node reads that queue and the budget, may tell the subscribers and reverse this budget's actions.
    role_policies = {p.name: json.loads(p.inputs["policy"]) for p in of_type(declared, "iam/rolePolicy:RolePolicy")}
    guard = role_policies[f"{name}-head-guardrail"]
    grants = {s["Sid"]: (s["Action"], s["Resource"]) for s in guard["Statement"]}
    budget_arn = _arn(stack, "budgets", f"budget/{stack.budget_name}")
    tell = {s["Sid"]: (s["Action"], s["Resource"]) for s in role_policies[f"{name}-head"]["Statement"]}
    assert grants["BudgetQueue"][1] == queue and tell["TellTheTeam"] == ("sns:Publish", topic)
    assert grants["ReadBudget"][1] == budget_arn and grants["ReverseBudgetActions"][1] == f"{budget_arn}/action/*"
    (config,) = [p for p in of_type(declared, "ssm/parameter:Parameter") if p.name == f"{name}-config"]
    settings = json.loads(config.inputs["insecureValue"])["budget"]
    assert settings["budget_name"] == stack.budget_name and settings["act_threshold_percent"] == act
    assert settings["topic_arn"] == topic and settings["queue_url"].startswith("https://sqs.")
    # The backstop: at the act threshold AWS Budgets attaches the launch deny to the head node's role.
    (action,) = of_type(declared, "budgets/budgetAction:BudgetAction")
    assert action.inputs["actionType"] == "APPLY_IAM_POLICY" and action.inputs["approvalModel"] == "AUTOMATIC"
    assert action.inputs["notificationType"] == "ACTUAL"
    assert action.inputs["actionThreshold"] == {"actionThresholdType": "PERCENTAGE", "actionThresholdValue": float(act)}
    deny_arn = _arn(stack, "iam", f"policy/{name}-launch-deny")
    assert action.inputs["definition"] == {"iamActionDefinition": {"policyArn": deny_arn, "roles": [f"{name}-head"]}}
    assert action.inputs["subscribers"] == [{"address": topic, "subscriptionType": "SNS"}]
    (deny,) = [p for p in of_type(declared, "iam/policy:Policy") if p.name == f"{name}-launch-deny"]
    (statement,) = json.loads(deny.inputs["policy"])["Statement"]
    assert statement["Effect"] == "Deny" and {"ec2:RunInstances", "ec2:CreateFleet"} <= set(statement["Action"])
    # Its execution role: assumed by Budgets only, may attach and detach exactly that policy on exactly that role.
    roles = {r.name: json.loads(r.inputs["assumeRolePolicy"]) for r in of_type(declared, "iam/role:Role")}
    assert roles[f"{name}-budget-action"]["Statement"][0]["Principal"] == {"Service": "budgets.amazonaws.com"}
    assert action.inputs["executionRoleArn"] == _arn(stack, "iam", f"role/{name}-budget-action")
    (attach,) = json.loads({p.name: p for p in of_type(declared, "iam/rolePolicy:RolePolicy")}[
        f"{name}-budget-action"].inputs["policy"])["Statement"]
    assert attach["Resource"] == _arn(stack, "iam", f"role/{name}-head")
    assert attach["Condition"] == {"ArnEquals": {"iam:PolicyARN": deny_arn}}


def test_a_budget_that_only_alerts_has_no_guardrail() -> None:
    _, declared = planned(FIXTURES / "Pulumi.existing.yaml")
    for kind in ("sqs/queue:Queue", "budgets/budgetAction:BudgetAction"):
        assert not of_type(declared, kind), kind
    assert not [p for p in of_type(declared, "iam/policy:Policy") if p.name.endswith("-launch-deny")]
    (config,) = [p for p in of_type(declared, "ssm/parameter:Parameter") if p.name.endswith("-config")]
    assert "budget" not in json.loads(config.inputs["insecureValue"])


def test_every_bucket_is_private_and_encrypted(shipped: tuple[Stack, tuple[Declared, ...]]) -> None:
    _, declared = shipped
    buckets = {b.name for b in of_type(declared, "s3/bucket:Bucket")}
    assert buckets  # the bundle bucket at least
    blocks = {b.name: b.inputs for b in of_type(declared, "s3/bucketPublicAccessBlock:BucketPublicAccessBlock")}
    sse = {b.name: b.inputs for b in of_type(
        declared, "s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration")}
    for name in buckets:
        assert all(blocks[name][k] for k in ("blockPublicAcls", "blockPublicPolicy", "ignorePublicAcls",
                                             "restrictPublicBuckets")), name
        assert sse[name]["rules"][0]["applyServerSideEncryptionByDefault"]["sseAlgorithm"] == "AES256", name


def test_every_resource_sits_in_a_component(shipped: tuple[Stack, tuple[Declared, ...]]) -> None:
    _, declared = shipped
    for d in declared:
        if d.type.startswith("aws:"):
            assert d.parent_type and d.parent_type.startswith("gpucluster:"), d.name


def test_existing_network_and_file_system_are_used_not_created() -> None:
    stack, declared = planned(FIXTURES / "Pulumi.existing.yaml")
    for kind in ("ec2/vpc:Vpc", "ec2/subnet:Subnet", "ec2/natGateway:NatGateway",
                 "fsx/lustreFileSystem:LustreFileSystem", "costexplorer/costAllocationTag:CostAllocationTag"):
        assert not of_type(declared, kind), kind
    assert [b.name for b in of_type(declared, "s3/bucket:Bucket")] == ["gpucluster-existing-bundle"]  # no data bucket
    (sg,) = of_type(declared, "ec2/securityGroup:SecurityGroup")
    assert sg.inputs["vpcId"] == stack.spec.network.vpc_id
    templates = _pool_templates(declared)
    assert {n["subnetId"] for n in templates["b200"]["networkInterfaces"]} == {stack.spec.network.subnet_id}
    # The capacity block pool targets its reservation and runs the AMI the stack pinned.
    cb = templates["p5en-cb"]
    assert cb["capacityReservationSpecification"]["capacityReservationTarget"]["capacityReservationId"] \
        == "cr-0a1b2c3d4e5f60718"
    assert cb["imageId"] == "ami-0a1b2c3d4e5f60718"
    assert cb["instanceMarketOptions"] == {"marketType": "capacity-block"}  # EC2 launches into a block only so
    assert not {"capacityReservationSpecification", "instanceMarketOptions"} & set(templates["b200"])
    # A pool without an AMI of its own boots the node image baked for its accelerator kind.
    assert templates["b200"]["imageId"] == planned_ami_id("gpucluster-existing-compute-nvidia")


def test_neuron_pools_boot_the_neuron_ami() -> None:
    _, declared = planned(ROOT / "stacks" / "Pulumi.team-b.yaml")
    templates = _pool_templates(declared)
    assert templates["trn1"]["imageId"] == planned_ami_id("gpucluster-team-b-compute-neuron")
    assert templates["g6e"]["imageId"] == planned_ami_id("gpucluster-team-b-compute-nvidia")


def test_catalog_drives_instance_types(shipped: tuple[Stack, tuple[Declared, ...]]) -> None:
    stack, declared = shipped
    templates = _pool_templates(declared)
    for pool in stack.spec.pools:
        assert templates[pool.name]["instanceType"] == pool.instance_type
        assert pool.instance_type in catalog.ACCELERATED


def test_the_program_itself_refuses_bad_config() -> None:
    """Under `pulumi up` the program validates again: a bad config stops it with the messages, no traceback."""
    import pulumi
    import pytest

    from gpucluster.plan import pulumi_config, run_program
    from gpucluster.spec.model import CONFIG_KEY, load_stack

    stack = load_stack(ROOT / "stacks" / "Pulumi.dev.yaml")
    config = pulumi_config(stack)
    cluster = json.loads(config[CONFIG_KEY])
    cluster["pools"][0]["min_nodes"] = 5
    with pytest.raises(pulumi.RunError,
                       match=r"gpucluster:cluster.pools\[0\].min_nodes: must be <= max_nodes \(2\), got 5"):
        run_program(stack, pulumi_program(), {**config, CONFIG_KEY: json.dumps(cluster)})


def test_pool_templates_carry_the_rendered_user_data(shipped: tuple[Stack, tuple[Declared, ...]]) -> None:
    import base64

    from gpucluster.render import userdata

    stack, declared = shipped
    templates = _pool_templates(declared)
    for pool in stack.spec.pools:
        assert base64.b64decode(templates[pool.name]["userData"]).decode() == userdata.pool_nodes(stack, pool)


# AWS's limits on the names Pulumi derives from logical names ("<logical>-<7 hex>", 8 characters more): IAM quotas,
# S3 bucket naming rules, the SQS, SNS, EC2, Image Builder and CloudWatch API references.
AUTO_NAME_LIMITS = {
    "aws:iam/role:Role": 64, "aws:iam/instanceProfile:InstanceProfile": 128, "aws:iam/policy:Policy": 128,
    "aws:iam/rolePolicy:RolePolicy": 128, "aws:s3/bucket:Bucket": 63, "aws:s3/bucketV2:BucketV2": 63,
    "aws:sqs/queue:Queue": 80, "aws:sns/topic:Topic": 256, "aws:ec2/securityGroup:SecurityGroup": 255,
    "aws:ec2/launchTemplate:LaunchTemplate": 128, "aws:ec2/placementGroup:PlacementGroup": 255,
    "aws:imagebuilder/component:Component": 128, "aws:imagebuilder/imageRecipe:ImageRecipe": 128,
    "aws:imagebuilder/infrastructureConfiguration:InfrastructureConfiguration": 128,
    "aws:imagebuilder/distributionConfiguration:DistributionConfiguration": 128,
    "aws:cloudwatch/metricAlarm:MetricAlarm": 255,
}


def test_longest_stack_name_fits_every_derived_aws_name() -> None:
    """spec.MAX_STACK_NAME against what the program really declares: team-b (NVIDIA and Neuron images, a budget
    action) renamed to the longest allowed stack name, every auto-named resource within AWS's limit, and the tightest
    exactly at it (so the limit is not looser than it needs to be)."""
    import dataclasses

    from gpucluster.plan import run_program
    from gpucluster.spec.model import AUTONAME_SUFFIX, MAX_STACK_NAME, load_stack

    stack = dataclasses.replace(load_stack(ROOT / "stacks" / "Pulumi.team-b.yaml"), name="s" * MAX_STACK_NAME)
    declared = run_program(stack, pulumi_program())
    slack = {}
    for d in declared:
        if d.type in AUTO_NAME_LIMITS:
            slack[(d.type, d.name)] = AUTO_NAME_LIMITS[d.type] - len(d.name) - AUTONAME_SUFFIX
    assert slack and min(slack.values()) == 0, sorted(slack.items(), key=lambda kv: kv[1])[:5]
    budgets = of_type(tuple(declared), "budgets/budget:Budget")
    assert budgets and all(len(b.inputs["name"]) <= 100 for b in budgets)
