"""The stack's people (`users:`): each rule on a person, the uid rule, and the people in the settings contract that the
nodes read. The bad stack files (tests/bad_stacks/Pulumi.users-*.yaml) show the rules together, with their paths."""

from __future__ import annotations

import copy
import functools
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from conftest import ROOT
from gpucluster.cli import people_lines
from gpucluster.contract import lockdown, people, settings
from gpucluster.contract.settings import ClusterSettings, PersonSettings, SettingsError
from gpucluster.spec import catalog
from gpucluster.spec.model import (
    CONFIG_KEY,
    SpecError,
    load_stack,
    principal_key,
    sso_role_warnings,
    stack_config,
    validate,
)
from rehearsal_image import REHEARSAL_ROOTFS

ROLE = "arn:aws:iam::123456789012:role/"


def _config(*users: dict[str, Any], **cluster: Any) -> dict[str, Any]:
    config = copy.deepcopy(stack_config(load_stack(ROOT / "stacks" / "Pulumi.dev.yaml")))
    config[CONFIG_KEY].pop("users", None)
    config[CONFIG_KEY].update(cluster)
    if users:
        config[CONFIG_KEY]["users"] = list(users)
    return config


def _person(name: str, **fields: Any) -> dict[str, Any]:
    return {"name": name, "principals": [ROLE + name], **fields}


def _problems(config: dict[str, Any]) -> list[str]:
    with pytest.raises(SpecError) as bad:
        validate("dev", config)
    return [f"{where}: {msg}" for where, msg in bad.value.problems]


# --- one person's fields ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["alice", "j_smith", "a", "bob-2", "x" * people.NAME_MAX])
def test_a_posix_name_is_taken(name: str) -> None:
    assert validate("dev", _config(_person(name))).spec.people[0].name == name


@pytest.mark.parametrize("name", ["Alice", "1bob", "_bob", "-bob", "carol.smith", "dave smith", "émile", "",
                                  "x" * (people.NAME_MAX + 1)])
def test_a_malformed_name_is_refused_with_what_is_allowed(name: str) -> None:
    assert _problems(_config({"name": name, "principals": [ROLE + "someone"]})) == [
        f"gpucluster:cluster.users[0].name: {name!r} is not allowed: use {people.NAME_RULE}"]


@pytest.mark.parametrize("name", sorted(n for n in people.RESERVED_NAMES if people.NAME_RE.fullmatch(n)))
def test_a_name_the_nodes_already_have_is_refused(name: str) -> None:
    problems = _problems(_config(_person(name)))
    assert problems == [f"gpucluster:cluster.users[0].name: {name!r} is an account or group the nodes already have "
                        "(a system, package or cluster account): choose another name"]


def test_reserved_names_a_person_could_not_take_anyway_are_malformed() -> None:
    """Package accounts such as _apt: no person's name starts with '_'."""
    odd = sorted(n for n in people.RESERVED_NAMES if not people.NAME_RE.fullmatch(n))
    assert odd and all(people.name_problem(n) == f"{n!r} is not allowed: use {people.NAME_RULE}" for n in odd)


def test_the_clusters_own_accounts_and_privileged_groups_are_reserved() -> None:
    """A person named like the login user, SlurmUser or Session Manager's user would be that account; one named like a
    privileged group would get a personal group of that name (sudo, docker: root)."""
    ours = {settings.LOGIN_USER, settings.SLURM_USER, lockdown.SSM_USER, *lockdown.PRIVILEGED_GROUPS,
            *(user for users in lockdown.IMDS_USERS.values() for user in users), *lockdown.ALERTS_USERS}
    assert ours - people.RESERVED_NAMES == set()


def _names(path: Path) -> set[str]:
    return {line.split(":", 1)[0] for line in path.read_text().splitlines() if line and not line.startswith("#")}


@pytest.mark.parametrize("files", [
    ("/usr/share/base-passwd/passwd.master", "/usr/share/base-passwd/group.master"),  # Debian's base-passwd, here
    (f"{REHEARSAL_ROOTFS}/etc/passwd", f"{REHEARSAL_ROOTFS}/etc/group"),  # Debian's packages of the image's software
], ids=["base-passwd", "rehearsal-image"])
def test_every_account_and_group_of_a_debian_system_is_reserved(files: tuple[str, str]) -> None:
    paths = [Path(f) for f in files]
    if not all(p.is_file() for p in paths):
        pytest.skip(f"not on this machine: {', '.join(files)}")
    assert set().union(*map(_names, paths)) - people.RESERVED_NAMES == set()


@pytest.mark.parametrize("uid", [people.UID_MIN, people.UID_MAX, (people.UID_MIN + people.UID_MAX) // 2])
def test_a_uid_in_the_range_is_taken_as_given(uid: int) -> None:
    person = validate("dev", _config(_person("alice", uid=uid))).spec.people[0]
    assert (person.uid, person.gid) == (uid, uid)


@pytest.mark.parametrize(("uid", "why"), [
    (bound, what) for low, high, what in people.UID_RANGES_TAKEN for bound in (low, high)
] + [(-1, None), (2**32, None)], ids=str)
def test_a_uid_outside_the_range_is_refused_with_the_range_it_is_in(uid: int, why: str | None) -> None:
    problems = _problems(_config(_person("alice", uid=uid)))
    reason = f"in the range of {why}" if why else "not a uid"
    assert problems == [f"gpucluster:cluster.users[0].uid: {uid} is {reason}: use {people.UID_MIN} to "
                        f"{people.UID_MAX}, or leave uid out to have one assigned"]


def test_the_taken_ranges_and_the_peoples_range_cover_every_uid_once() -> None:
    spans = sorted([(low, high) for low, high, _ in people.UID_RANGES_TAKEN] + [(people.UID_MIN, people.UID_MAX)])
    assert spans[0][0] == 0 and spans[-1][1] == 2**32 - 1
    assert all(after[0] == before[1] + 1 for before, after in zip(spans, spans[1:], strict=False))


@pytest.mark.parametrize("arn", [ROLE + "alice", ROLE + "researchers/vision/alice",
                                 "arn:aws:iam::123456789012:user/alice",
                                 "arn:aws:iam::123456789012:user/staff/alice.smith@example.com", ROLE + "A+=,.@_-z"])
def test_a_role_or_user_arn_with_or_without_a_path_is_a_principal(arn: str) -> None:
    users = validate("dev", _config({"name": "alice", "principals": [arn]})).spec.users
    assert users is not None and users[0].principals == [arn]


@pytest.mark.parametrize(("arn", "problem"), [
    ("arn:aws:sts::123456789012:assumed-role/alice/alice@example.com",
     "is a session of a role, not a principal (its session name is whatever the caller chose): list the role, "
     "arn:aws:iam::123456789012:role/alice (with its path, if any)"),
    ("arn:aws:iam::123456789012:group/researchers", "is an IAM group, which IAM never takes as a principal"),
    ("arn:aws-cn:iam::123456789012:role/alice", "is in partition aws-cn: the stack's region is in aws"),
    ("arn:aws:iam::123456789012:root", "is not allowed: use an IAM role or user ARN"),
    ("arn:aws:iam::12345678901:role/alice", "is not allowed"),
    ("arn:aws:iam::123456789012:role/" + "a" * 65, "is not allowed"),
    ("alice", "is not allowed"),
    (ROLE + "/alice", "is not allowed"),
    (ROLE + "team//alice", "is not allowed"),
    (ROLE + "émile", "is not allowed"),
])
def test_what_is_not_a_principal_is_refused_with_why(arn: str, problem: str) -> None:
    found = _problems(_config({"name": "alice", "principals": [ROLE + "alice", arn]}))
    assert len(found) == 1 and found[0].startswith(f"gpucluster:cluster.users[0].principals[1]: {arn!r} {problem}")


def test_a_person_has_at_least_one_principal() -> None:
    assert _problems(_config({"name": "alice", "principals": []})) == [
        "gpucluster:cluster.users[0].principals: List should have at least 1 item after validation, not 0"]


def test_max_gpus_is_at_least_one() -> None:
    assert _problems(_config(_person("alice", max_gpus=0))) == [
        "gpucluster:cluster.users[0].max_gpus: Input should be greater than or equal to 1"]


def _cluster_gpus(config: dict[str, Any]) -> int:
    total = 0
    for pool in config[CONFIG_KEY]["pools"]:
        accelerator = catalog.ACCELERATED[pool["instance_type"]].accelerator
        assert accelerator is not None and accelerator.kind == "nvidia"
        total += accelerator.count * pool["max_nodes"]
    return total


def test_max_gpus_is_at_most_the_clusters_gpus_at_max_size() -> None:
    config = _config()
    gpus = _cluster_gpus(config)
    assert validate("dev", _config(_person("alice", max_gpus=gpus))).spec.people[0].max_gpus == gpus
    assert _problems(_config(_person("alice", max_gpus=gpus + 1))) == [
        f"gpucluster:cluster.users[0].max_gpus: {gpus + 1} is more than the cluster's {gpus} GPUs at max_nodes "
        "(NVIDIA pools): it would never limit anything"]


def test_neuron_devices_are_no_gpus_for_max_gpus() -> None:
    trn = [{"name": "trn", "instance_type": "trn1.32xlarge", "max_nodes": 2}]
    assert _problems(_config(_person("alice", max_gpus=1), pools=trn)) == [
        "gpucluster:cluster.users[0].max_gpus: 1 is more than the cluster's 0 GPUs at max_nodes (NVIDIA pools): it "
        "would never limit anything"]


# --- the people together -----------------------------------------------------------------------------------------

def test_a_uid_left_out_is_assigned_from_the_name_alone() -> None:
    """The documented rule, and it never moves: another person added or removed, or the order changed, leaves it."""
    rule = people.UID_MIN + int.from_bytes(hashlib.sha256(b"alice").digest()[:8], "big") % (
        people.UID_MAX - people.UID_MIN + 1)
    alone = validate("dev", _config(_person("alice"))).spec.people
    crowd = validate("dev", _config(_person("bob"), _person("carol", uid=people.UID_MIN), _person("alice"))).spec.people
    assert alone[0].uid == rule == crowd[2].uid == alone[0].gid
    assert crowd[0].uid == people.assigned_uid("bob") != rule


@functools.cache
def _colliding_names() -> tuple[str, str]:
    """Two names whose assigned uids meet (found by search, not written down: the rule makes them)."""
    seen: dict[int, str] = {}
    for i in range(10**6):
        name = f"user{i}"
        uid = people.assigned_uid(name)
        if uid in seen:
            return seen[uid], name
        seen[uid] = name
    raise AssertionError("no two names met")


@pytest.mark.parametrize(("first", "second", "message"), [
    (_person("alice", uid=30000), _person("bob", uid=30000),
     "30000 (given) is also users[0]'s uid (given): set `uid` explicitly for one of them"),
    (_person("alice"), _person("bob", uid=people.assigned_uid("alice")),
     f"{people.assigned_uid('alice')} (given) is also users[0]'s uid (assigned from the name 'alice')"),
    (_person(_colliding_names()[0]), _person(_colliding_names()[1]),
     f"{people.assigned_uid(_colliding_names()[1])} (assigned from the name {_colliding_names()[1]!r}) is also "
     f"users[0]'s uid (assigned from the name {_colliding_names()[0]!r}): set `uid` explicitly for one of them"),
], ids=["given-given", "assigned-given", "assigned-assigned"])
def test_two_people_with_one_uid_are_refused_naming_both(first: dict[str, Any], second: dict[str, Any],
                                                         message: str) -> None:
    found = _problems(_config(first, second))
    assert len(found) == 1 and found[0].startswith(f"gpucluster:cluster.users[1].uid: {message}")


def test_two_people_with_one_name_are_refused() -> None:
    assert _problems(_config(_person("alice"), {"name": "alice", "uid": 30000, "principals": [ROLE + "other"]})) == [
        "gpucluster:cluster.users[1].name: 'alice' is also users[0]'s name"]


@pytest.mark.parametrize("again", [ROLE + "alice", ROLE + "ALICE", ROLE + "team/alice"],
                         ids=["same", "other-case", "other-path"])
def test_one_principal_for_two_people_is_refused(again: str) -> None:
    """IAM names are unique regardless of case, and a path is not part of a role's identity."""
    found = _problems(_config(_person("alice"), {"name": "bob", "principals": [ROLE + "bob", again]}))
    assert found == [f"gpucluster:cluster.users[1].principals[1]: {again!r} is also users[0].principals[0]: a "
                     "principal connects as one person only"]


SSO_ROLE = ROLE + "aws-reserved/sso.amazonaws.com/eu-west-2/AWSReservedSSO_Researchers_1234567890abcdef"


def test_a_permission_set_role_for_two_people_is_refused() -> None:
    """Every user a permission set is assigned to signs in as its one role: listed for two people, either could
    connect as both."""
    found = _problems(_config({"name": "alice", "principals": [SSO_ROLE]},
                              {"name": "bob", "principals": [ROLE + "bob", SSO_ROLE]}))
    assert found == [f"gpucluster:cluster.users[1].principals[1]: {SSO_ROLE!r} is also users[0].principals[0]: a "
                     "principal connects as one person only"]


def test_a_permission_set_role_is_warned_about_with_its_path_and_the_alternative() -> None:
    stack = validate("dev", _config({"name": "alice", "principals": [ROLE + "alice", SSO_ROLE]}, _person("bob")))
    ((where, why),) = sso_role_warnings(stack.spec)
    assert where == "gpucluster:cluster.users[0].principals[1]"
    assert "each of them may connect as alice" in why and "a role of their own" in why and "aws:userid" in why
    assert f"WARNING: {where}: {why}." in people_lines(stack)  # what `plan` prints
    assert sso_role_warnings(validate("dev", _config(_person("alice"), _person("bob"))).spec) == []


def test_one_principal_listed_twice_for_one_person_is_refused() -> None:
    found = _problems(_config({"name": "alice", "principals": [ROLE + "alice", ROLE + "Alice"]}))
    assert found == [f"gpucluster:cluster.users[0].principals[1]: {ROLE + 'Alice'!r} is listed twice (principals[0])"]


def test_principal_key_ignores_the_path_and_case_of_the_name() -> None:
    assert principal_key(ROLE + "a/b/Alice") == principal_key(ROLE + "alice") == (
        "aws", "123456789012", "role", "alice")
    assert principal_key("arn:aws:iam::123456789012:user/alice") != principal_key(ROLE + "alice")


def test_an_empty_users_list_is_refused_and_no_list_keeps_the_shared_login() -> None:
    assert _problems(_config(users=[])) == [
        "gpucluster:cluster.users: List should have at least 1 item after validation, not 0"]
    assert validate("dev", _config()).spec.people == ()


def test_the_kubernetes_flavour_takes_people_without_gpu_limits() -> None:
    config = stack_config(load_stack(ROOT / "stacks" / "Pulumi.team-k8s.yaml"))
    config[CONFIG_KEY]["users"] = [_person("alice", admin=True)]
    assert validate("team-k8s", config).spec.people == (
        PersonSettings("alice", people.assigned_uid("alice"), people.assigned_uid("alice"), admin=True),)
    config[CONFIG_KEY]["users"][0]["max_gpus"] = 1
    with pytest.raises(SpecError, match=r"users\[0\]\.max_gpus: not allowed with scheduler: kubernetes"):
        validate("team-k8s", config)


# --- the settings contract ----------------------------------------------------------------------------------------

def _settings(*persons: dict[str, Any]) -> dict[str, Any]:
    return {"cluster": "c1", "region": "us-east-1", "pools": {}, "people": list(persons)}


def _entry(name: str, uid: object, **fields: Any) -> dict[str, Any]:
    return {"name": name, "uid": uid, "gid": uid, **fields}


def test_the_settings_carry_the_people_and_no_principals() -> None:
    stack = validate("dev", _config(_person("alice", admin=True, max_gpus=1), _person("bob", uid=30001)))
    loaded = ClusterSettings.from_json(ClusterSettings(cluster="c1", region="us-east-1", pools={},
                                                       people=stack.spec.people).to_json())
    assert loaded.people == stack.spec.people
    assert [p.name for p in loaded.people] == ["alice", "bob"] and loaded.people[1].uid == 30001
    assert "principal" not in json.dumps(json.loads(loaded.to_json())["people"])


def test_the_nodes_make_the_peoples_accounts_or_else_the_shared_login_user() -> None:
    assert ClusterSettings.from_dict(_settings(_entry("alice", 30000), _entry("bob", 30001))).accounts == (
        "alice", "bob")
    assert ClusterSettings.from_dict(_settings()).accounts == (settings.LOGIN_USER,)
    assert ClusterSettings.from_dict({"cluster": "c1", "region": "us-east-1", "pools": {}}).accounts == (
        settings.LOGIN_USER,)


@pytest.mark.parametrize(("person", "problem"), [
    (_entry("root", 30000), "people[0].name: 'root' is an account or group the nodes already have"),
    (_entry("Alice", 30000), "people[0].name: 'Alice' is not allowed"),
    (_entry("alice", 500), "people[0].uid: 500 is in the range of system accounts"),
    ({**_entry("alice", 30000), "gid": 30001}, "people[0].gid: must equal the uid (30000)"),
    (_entry("alice", 30000, max_gpus=0), "people[0].max_gpus: an integer >= 1 or null expected, got 0"),
    (_entry("alice", "30000"), "people[0].uid: int expected, got '30000'"),
    (_entry("alice", 30000, admin="yes"), "people[0].admin: bool expected, got 'yes'"),
    ({"name": "alice", "uid": 30000}, "people[0]: PersonSettings.__init__() missing 1 required positional argument"),
    ({**_entry("alice", 30000), "principals": []}, "people[0]: unknown key(s) principals"),
    ("alice", "people[0]: a mapping expected, got str"),
], ids=["reserved", "malformed", "uid-range", "gid", "max-gpus", "uid-type", "admin-type", "missing", "unknown",
        "not-a-mapping"])
def test_the_loader_refuses_a_person_the_stack_would_have_refused(person: Any, problem: str) -> None:
    with pytest.raises(SettingsError) as bad:
        ClusterSettings.from_dict(_settings(person))
    assert str(bad.value).startswith(problem)


def test_the_loader_names_every_problem_at_once() -> None:
    with pytest.raises(SettingsError) as bad:
        ClusterSettings.from_dict(_settings(_entry("alice", 30000), _entry("alice", 30001), _entry("bob", 30000),
                                            _entry("slurm", 30002)))
    assert str(bad.value) == ("people[1].name: 'alice' is also people[0]'s; people[2].uid: 30000 is also people[0]'s; "
                              "people[3].name: 'slurm' is an account or group the nodes already have (a system, "
                              "package or cluster account): choose another name")


def test_the_loader_refuses_people_that_are_no_list() -> None:
    with pytest.raises(SettingsError, match="people: a list of people expected, got dict"):
        ClusterSettings.from_dict({**_settings(), "people": {"alice": {}}})


def test_the_reference_page_states_the_uid_rule_the_code_applies() -> None:
    """The documented range and rule are the constants', so a changed range cannot leave the docs behind."""
    row = next(line for line in (ROOT / "docs" / "reference" / "stack-file.md").read_text().splitlines()
               if line.startswith("| `uid` |") and "SHA-256" in line)
    size = people.UID_MAX - people.UID_MIN + 1
    assert f"{people.UID_MIN} to {people.UID_MAX}" in row
    assert f"{people.UID_MIN} + (the first 8 bytes of the SHA-256 of the name, big-endian, modulo {size})" in row
