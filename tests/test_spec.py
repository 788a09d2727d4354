"""The stack-file spec: every bad file in tests/bad_stacks gives exactly the messages it lists, at once."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import ALL_STACK_FILES, ROOT
from gpucluster.spec.model import SpecError, load_stack, validate

BAD = sorted((ROOT / "tests" / "bad_stacks").glob("Pulumi.*.yaml"))


def expectations(path: Path) -> list[str]:
    # Read leniently: one file of the corpus is not UTF-8 on purpose (its expectations are ASCII).
    return re.findall(r"^# expect: (.+)$", path.read_bytes().decode("utf-8", "replace"), flags=re.M)


@pytest.mark.parametrize("path", BAD, ids=lambda p: p.name)
def test_bad_stack_reports_each_expected_problem(path: Path) -> None:
    expected = expectations(path)
    assert expected, f"{path.name} lists no '# expect:' line"
    with pytest.raises(SpecError) as caught:
        load_stack(path)
    found = [f"{where}: {msg}" for where, msg in caught.value.problems]
    for line in expected:
        assert any(f.startswith(line) for f in found), f"missing {line!r} in {found}"
    # Nothing beyond what the file announces: a rule that fires wrongly is a bug too.
    assert len(found) == len(expected), found


def test_all_problems_at_once() -> None:
    with pytest.raises(SpecError) as caught:
        load_stack(ROOT / "tests" / "bad_stacks" / "Pulumi.many-problems.yaml")
    paths = {p for p, _ in caught.value.problems}
    assert {"gpucluster:cluster.team", "gpucluster:cluster.pools[0].min_nodes", "gpucluster:cluster.pools[1].efa",
            "gpucluster:cluster.storage.lustre.storage_capacity_gib", "gpucluster:cluster.budget.monthly_usd"} == paths


@pytest.mark.parametrize("path", ALL_STACK_FILES, ids=lambda p: p.name)
def test_shipped_stacks_are_valid(path: Path) -> None:
    stack = load_stack(path)
    assert stack.name == path.name.split(".")[1]
    assert stack.tags == {"gpucluster:cluster": f"gpucluster-{stack.name}", "gpucluster:team": stack.spec.team,
                          "gpucluster:stack": stack.name}


def _config(**pool: object) -> dict:
    return {
        "aws:region": "us-east-1",
        "gpucluster:cluster": {
            "team": "t1",
            "availability_zone": "us-east-1a",
            "network": {"vpc_cidr": "10.0.0.0/16"},
            "pools": [{"name": "gpu", "instance_type": "p5.48xlarge", "max_nodes": 2, **pool}],
            "storage": {"lustre": {"deployment_type": "PERSISTENT_2", "storage_capacity_gib": 2400,
                                   "throughput_mb_per_tib": 125}},
            "budget": {"monthly_usd": 20000, "notify_emails": ["x@example.com"]},
        },
    }


def test_efa_defaults_to_what_the_type_supports() -> None:
    assert validate("s1", _config()).spec.pools[0].uses_efa is True
    assert validate("s1", _config(instance_type="g6.xlarge")).spec.pools[0].uses_efa is False
    assert validate("s1", _config(efa=False)).spec.pools[0].uses_efa is False


def test_destroy_keeps_the_bucket_and_deletes_the_file_system_unless_asked() -> None:
    lustre = validate("s1", _config()).spec.storage.lustre
    assert lustre.keep_bucket_on_destroy is True and lustre.keeps_file_system is False and lustre.exports
    cfg = _config()
    cfg["gpucluster:cluster"]["storage"]["lustre"].update(keep_file_system_on_destroy=True)
    kept = validate("s1", cfg).spec.storage.lustre
    assert kept.keeps_file_system is True and kept.keep_bucket_on_destroy is True


@pytest.mark.parametrize(("lustre", "key", "reason"), [
    ({"data_repository": "s3://team-data/set", "keep_bucket_on_destroy": False, "keep_file_system_on_destroy": False},
     "keep_bucket_on_destroy",
     "not allowed with data_repository (the stack never deletes the team's bucket)"),
    ({"data_repository": "s3://team-data/set"}, "keep_file_system_on_destroy",
     "required with data_repository: nothing written under /fsx (homes, checkpoints) is exported to the team's "
     "bucket, so say true to keep the file system at `pulumi destroy` (it bills monthly) or false to lose it"),
    ({"keep_file_system_on_destroy": True, "keep_bucket_on_destroy": False}, "keep_bucket_on_destroy",
     "must be true when the file system is kept: its association would name a deleted bucket"),
    ({"keep_on_destroy": True}, "keep_on_destroy",
     "renamed: keep_file_system_on_destroy (default false) and keep_bucket_on_destroy (default true)"),
    ({"file_system_id": "fs-0123456789abcdef0", "dns_name": "d", "mount_name": "m", "deployment_type": None,
      "storage_capacity_gib": None, "throughput_mb_per_tib": None, "keep_file_system_on_destroy": True},
     "keep_file_system_on_destroy", "not allowed with file_system_id (the stack never deletes it)"),
])
def test_keep_keys_only_where_the_stack_owns_what_they_keep(lustre: dict[str, object], key: str, reason: str) -> None:
    cfg = _config()
    given = {**cfg["gpucluster:cluster"]["storage"]["lustre"], **lustre}
    cfg["gpucluster:cluster"]["storage"]["lustre"] = {k: v for k, v in given.items() if v is not None}
    with pytest.raises(SpecError) as bad:
        validate("s1", cfg)
    assert f"gpucluster:cluster.storage.lustre.{key}: {reason}" in bad.value.render()


def test_valid_capacity_block_pool() -> None:
    stack = validate("s1", _config(capacity="capacity-block", capacity_reservation_id="cr-0123456789abcdef0",
                                   min_nodes=2))
    assert stack.spec.pools[0].capacity == "capacity-block"


@pytest.mark.parametrize("capacity", [1200, 2400, 4800, 9600])
def test_lustre_capacity_steps_accepted(capacity: int) -> None:
    cfg = _config()
    cfg["gpucluster:cluster"]["storage"]["lustre"]["storage_capacity_gib"] = capacity
    assert validate("s1", cfg).spec.storage.lustre.storage_capacity_gib == capacity


@pytest.mark.parametrize("text,what", [
    ("on", "is a boolean in YAML 1.1"), ("n", "is a boolean in YAML 1.1"), ("Off", "is a boolean in YAML 1.1"),
    ("0777", "is octal in YAML 1.1"), ("1:30", "is a base-60 number"), ("1:30.5", "is a base-60 number"),
    ("1_000", "is an integer in YAML 1.1 but a string"), ("1e3", "is a string in YAML 1.1 but a float"),
    ("0o17", "is a string in YAML 1.1 but an integer"), ("2025-01-01", "is a timestamp in YAML 1.1 but a string"),
])
def test_yaml_1_1_only_forms_are_refused(tmp_path: Path, text: str, what: str) -> None:
    path = tmp_path / "Pulumi.s1.yaml"
    path.write_text(f"config:\n  aws:region: us-east-1\n  gpucluster:cluster:\n    team: {text}\n")
    with pytest.raises(SpecError) as caught:
        load_stack(path)
    assert any(p == "gpucluster:cluster.team" and what in m for p, m in caught.value.problems), caught.value.problems


@pytest.mark.parametrize("text", ["true", "false", "12", "'yes'", '"0777"', "1.5", "0x1f", "null", "us-east-1",
                                  "10.42.0.0/16", "p5.48xlarge"])
def test_forms_both_readers_agree_on_pass(tmp_path: Path, text: str) -> None:
    path = tmp_path / "Pulumi.s1.yaml"
    path.write_text(f"config:\n  aws:region: us-east-1\n  gpucluster:cluster:\n    team: {text}\n")
    with pytest.raises(SpecError) as caught:
        load_stack(path)
    assert not any("YAML 1.1" in m for _, m in caught.value.problems), caught.value.problems


def test_stack_name_limit_is_the_iam_build_role() -> None:
    from gpucluster.spec.model import AUTONAME_SUFFIX, MAX_STACK_NAME

    assert MAX_STACK_NAME == 24
    assert len(f"gpucluster-{'s' * MAX_STACK_NAME}-compute-nvidia-build") + AUTONAME_SUFFIX == 64
    validate("s" * MAX_STACK_NAME, _config())
    with pytest.raises(SpecError):
        validate("s" * (MAX_STACK_NAME + 1), _config())


def test_availability_zone_must_be_of_the_region() -> None:
    cfg = _config()
    cfg["gpucluster:cluster"]["availability_zone"] = "us-east-2a"
    cfg["gpucluster:cluster"]["pools"][0]["instance_type"] = "p9.huge"  # a field error does not hide it
    with pytest.raises(SpecError) as caught:
        validate("s1", cfg)
    assert ("gpucluster:cluster.availability_zone", "us-east-2a is not in region us-east-1") in caught.value.problems


def test_yaml_1_1_boolean_key_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "Pulumi.s1.yaml"
    path.write_text("config:\n  aws:region: us-east-1\n  gpucluster:cluster:\n    on: 1\n")
    with pytest.raises(SpecError) as caught:
        load_stack(path)
    assert any(p == "gpucluster:cluster.on" and m.startswith("key 'on' is a boolean in YAML 1.1")
               for p, m in caught.value.problems), caught.value.problems


@pytest.mark.parametrize("section", ["network", "head_node", "pools", "storage", "budget", "slurm", "image"])
def test_a_section_that_is_not_a_mapping_is_told_without_python_names(section: str) -> None:
    """pydantic would add "or instance of NetworkSpec": the file's reader sees the key's path, never a class name."""
    cfg = _config()
    cluster = cfg["gpucluster:cluster"]
    cluster[section] = [5] if section == "pools" else 5
    where = "gpucluster:cluster.pools[0]" if section == "pools" else f"gpucluster:cluster.{section}"
    with pytest.raises(SpecError) as caught:
        validate("s1", cfg)
    assert caught.value.problems == [(where, "Input should be a valid dictionary")]


def test_the_gpu_hour_quota_key_names_the_money_quota_that_replaced_it() -> None:
    cfg = _config()
    cfg["gpucluster:cluster"]["budget"]["gpu_hours_per_month"] = 4024
    with pytest.raises(SpecError) as bad:
        validate("s1", cfg)
    assert ("gpucluster:cluster.budget.gpu_hours_per_month: renamed: quota_usd_per_month (the quota in US dollars, "
            "which a mix of pools cannot overshoot; default: the budget less the fixed costs)") in bad.value.render()
