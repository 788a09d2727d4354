"""The in-cluster controllers' boto3 (gpucluster/spec/wheels.py, gpucluster/render/kube.py boto3_install): every
container that pip-installs anything installs exactly the table's wheels, hash-checked, none of their dependencies
resolved by pip; the table is boto3's whole dependency closure at versions that satisfy each other; and each such
container gives botocore a region it reads."""

from __future__ import annotations

import importlib.metadata
import re
import shlex
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from conftest import K8S_STACK_FILES
from gpucluster.project import EXAMPLES_DIR
from gpucluster.render import kube
from gpucluster.spec import wheels
from gpucluster.spec.model import load_stack

HASH = re.compile(r"--hash=sha256:[0-9a-f]{64}")


def requirements_of(name: str) -> list[Requirement]:
    """A distribution's own requirements as installed here, those of extras left out (nobody installs them)."""
    return [r for r in map(Requirement, importlib.metadata.requires(name) or [])
            if r.marker is None or r.marker.evaluate({"extra": ""})]  # this interpreter's environment, no extra


def closure(name: str) -> set[str]:
    seen: set[str] = set()
    todo = [name]
    while todo:
        current = canonicalize_name(todo.pop())
        if current not in seen:
            seen.add(current)
            todo += [r.name for r in requirements_of(current)]
    return seen


def test_the_table_is_boto3s_whole_closure() -> None:
    """With --no-deps pip installs nothing the table leaves out: a missing distribution is an ImportError in the pod."""
    assert {canonicalize_name(w.name) for w in wheels.BOTO3} == closure("boto3")
    assert len({w.name for w in wheels.BOTO3}) == len(wheels.BOTO3)


def test_the_pins_satisfy_each_other_and_are_what_the_tests_ran() -> None:
    """Every requirement inside the closure holds for the pinned versions (pip checks none of them with --no-deps),
    and the pins are the versions installed here, which the suite's boto3 tests ran against."""
    pinned = {canonicalize_name(w.name): w.version for w in wheels.BOTO3}
    for wheel in wheels.BOTO3:
        for requirement in requirements_of(wheel.name):
            assert requirement.specifier.contains(pinned[canonicalize_name(requirement.name)], prereleases=True), (
                f"{wheel.name} requires {requirement}; the table pins {pinned[canonicalize_name(requirement.name)]}")
        assert importlib.metadata.version(wheel.name) == wheel.version, wheel.name


def containers() -> Iterator[tuple[str, str, dict[str, Any]]]:
    """Every container of every object rendered for every shipped Kubernetes stack (the guardrail where the stack's
    budget acts, the burn-in DaemonSets, the first job), with the stack's region."""
    for path in K8S_STACK_FILES:
        stack = load_stack(path)
        for file, manifests in kube.render_files(stack, EXAMPLES_DIR).items():
            for manifest in manifests:
                pod = manifest.get("spec", {}).get("template", {}).get("spec", {})
                for container in [*pod.get("initContainers", []), *pod.get("containers", [])]:
                    yield (f"{path.name} {file} {manifest['metadata']['name']}/{container['name']}", stack.region,
                           container)


def install_command(container: dict[str, Any]) -> str | None:
    """The container's pip install, as a command or in the environment it hands its program."""
    texts = [*container.get("command", []), *(e.get("value", "") for e in container.get("env", []))]
    found = [t for t in texts if "pip install" in t]
    assert len(found) <= 1
    return found[0] if found else None


def test_every_container_that_installs_boto3_installs_the_tables_wheels_hash_checked() -> None:
    installing = {}
    for where, _, container in containers():
        command = install_command(container)
        if command is None:
            continue
        installing[where] = container
        words = shlex.split(command)
        pip = words[words.index("pip"):]
        pip = pip[:pip.index("&&")] if "&&" in pip else pip
        assert {"--no-deps", "--require-hashes", "--only-binary=:all:"} <= set(pip), where
        assert not [w for w in pip[2:] if not w.startswith("-") and pip[pip.index(w) - 1] not in ("--target", "-r")], (
            f"{where}: a requirement on pip's command line, outside the hash-checked file")
        requirements = pip[pip.index("-r") + 1]
        # The file pip reads is the one the command writes, line by line: a requirement and its hash each.
        written = words[words.index("printf") + 2:words.index(">")]
        assert words[words.index(">") + 1] == requirements, where
        assert written == [w.requirement() for w in wheels.BOTO3], where
        assert all(HASH.search(line) for line in written)
        # The region botocore reads, beside it (Pod Identity sets only the credentials' variables).
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        assert env.get("AWS_DEFAULT_REGION"), where
    assert any("guardrail" in w for w in installing) and any("burn-in" in w for w in installing), list(installing)


def test_the_controllers_environment_gives_botocore_its_region(monkeypatch: pytest.MonkeyPatch) -> None:
    """Clients built from the rendered environment alone (the stack's region, whatever this machine's is)."""
    for variable in ("AWS_DEFAULT_REGION", "AWS_REGION", "AWS_PROFILE", "AWS_CONFIG_FILE"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    regions: set[str] = set()
    for where, region, container in containers():
        if install_command(container) is None:
            continue
        regions.add(region)
        env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
        with monkeypatch.context() as scoped:
            for name in ("AWS_DEFAULT_REGION", "AWS_REGION"):
                if name in env:
                    scoped.setenv(name, env[name])
            for service in ("sqs", "autoscaling"):
                assert boto3.session.Session().client(service).meta.region_name == region, where
    assert len(regions) > 1, "the shipped Kubernetes stacks no longer span regions: the check could pass by chance"
