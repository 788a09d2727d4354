from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import pickle
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpucluster.plan import NEW_ACCOUNT, AccountFacts, Declared, run_program  # noqa: E402
from gpucluster.project import pulumi_program  # noqa: E402
from gpucluster.spec.model import Stack, load_stack  # noqa: E402
from lanes import pytest_collection_modifyitems  # noqa: E402,F401  (every test in exactly one lane)

pytest_plugins = ("pytester",)  # tests/test_lanes.py runs pytest on suites of its own

if TYPE_CHECKING:
    from local_cluster import LocalCluster

ALL_STACK_FILES = sorted((ROOT / "stacks").glob("Pulumi.*.yaml"))
FIXTURES = ROOT / "tests" / "stacks"
# The Slurm flavour's stacks (what the Slurm tests take as "every shipped stack"), and the Kubernetes flavour's: the
# shipped ones and test-only variants (tests/stacks/Pulumi.k8s-*.yaml: Neuron and NVIDIA without EFA on a new VPC; an
# existing network with a capacity block and an alerts-only budget), so that the stack-driven tests derive every
# expectation from the stack rather than from team-k8s.
STACK_FILES = [p for p in ALL_STACK_FILES if load_stack(p).spec.scheduler == "slurm"]
K8S_STACK_FILES = [p for p in [*ALL_STACK_FILES, *sorted(FIXTURES.glob("Pulumi.k8s-*.yaml"))]
                   if load_stack(p).spec.scheduler == "kubernetes"]
# A boto3 client for a service name (boto3's clients are untyped: pyproject.toml says why).
ClientFactory = Callable[[str], Any]


# Where the session's xdist workers share their plans (planned); empty in a run without workers.
SHARED_PLANS: list[Path] = []


def xdist_session_dir(tmp_path_factory: pytest.TempPathFactory) -> Path | None:
    """The directory the session's xdist workers share (each one's base directory is in it); None without xdist."""
    return tmp_path_factory.getbasetemp().parent if os.environ.get("PYTEST_XDIST_WORKER") else None


@pytest.fixture(scope="session", autouse=True)
def plans_shared_by_workers(tmp_path_factory: pytest.TempPathFactory) -> None:
    if session := xdist_session_dir(tmp_path_factory):
        SHARED_PLANS.append(session / "plans")


@functools.cache
def planned(path: Path, facts: AccountFacts = NEW_ACCOUNT) -> tuple[Stack, tuple[Declared, ...]]:
    """The stack and what its Pulumi program declares under the mock runtime, in an account of these `facts` (once
    per file and facts per session: under xdist the first worker to need it makes it, under a lock, and the others
    read what it left in the session's directory)."""
    if not SHARED_PLANS:
        return _plan(path, facts)
    key = hashlib.sha256(repr((str(path), path.read_bytes(), facts)).encode()).hexdigest()
    saved = SHARED_PLANS[0] / f"{key}.pickle"
    saved.parent.mkdir(exist_ok=True)
    with open(saved.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not saved.exists():
            saved.write_bytes(pickle.dumps(_plan(path, facts)))
    plan: tuple[Stack, tuple[Declared, ...]] = pickle.loads(saved.read_bytes())
    return plan


def _plan(path: Path, facts: AccountFacts) -> tuple[Stack, tuple[Declared, ...]]:
    stack = load_stack(path)
    return stack, tuple(run_program(stack, pulumi_program(), facts=facts))


@pytest.fixture(params=STACK_FILES, ids=lambda p: p.name)
def shipped(request: pytest.FixtureRequest) -> tuple[Stack, tuple[Declared, ...]]:
    return planned(request.param)


def of_type(declared: Sequence[Declared], suffix: str) -> list[Declared]:
    return [d for d in declared if d.type.endswith(suffix)]


@pytest.fixture
def start_cluster() -> Iterator[Callable[..., LocalCluster]]:
    """Starts fresh local Slurm clusters of tests/stacks/Pulumi.local.yaml (or of the stack given), EC2 and the rest
    in moto (tests/integration), each in a network of its own; all are stopped after the test."""
    import shutil

    from local_cluster import LocalCluster, missing_tools, new_cluster_root

    assert not missing_tools(), f"make setup first (make test does): missing {missing_tools()}"
    started: list[LocalCluster] = []

    def start(stack: Stack | None = None) -> LocalCluster:
        root = new_cluster_root()
        stack = stack or load_stack(FIXTURES / "Pulumi.local.yaml")
        local = LocalCluster(stack, root).start()  # stopped itself if it failed
        started.append(local)
        return local

    yield start
    for local in started:
        local.stop()
        shutil.rmtree(local.root, ignore_errors=True)


@pytest.fixture
def cluster(start_cluster: Callable[[], LocalCluster]) -> LocalCluster:
    """A fresh local cluster (start_cluster)."""
    return start_cluster()


@pytest.fixture(autouse=True)
def moto_without_default_amis(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Unit tests run moto without its ~44,000 default AMIs, which it builds each time it makes or resets an EC2
    backend (every mock_aws start and stop, every moto-api/reset: 0.25 s of CPU each, a third of a test against
    in-process EC2). A test that looks up amazon's images sets MOTO_EC2_LOAD_DEFAULT_AMIS=true itself."""
    if request.node.get_closest_marker("unit"):
        monkeypatch.setenv("MOTO_EC2_LOAD_DEFAULT_AMIS", "false")


@functools.cache
def _moto_session() -> Any:
    import boto3

    return boto3.session.Session()


@contextlib.contextmanager
def in_process_moto() -> Iterator[None]:
    """moto's mock_aws with one boto3 default session for the whole run: mock_aws hides boto3's own, so each test's
    first boto3.client() made a new session and loaded botocore's models and endpoints again (a third of a short
    test's CPU). moto takes any credentials."""
    import boto3
    from moto import mock_aws

    with mock_aws():
        boto3.DEFAULT_SESSION = _moto_session()  # mock_aws puts boto3's own back at its end
        yield


@pytest.fixture(scope="module")
def moto_url() -> Iterator[str]:
    """A moto server on 127.0.0.1 for the module's boto3 code (AWS_ENDPOINT_URL or endpoint_url)."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


def reset_moto(url: str) -> None:
    """An empty account: moto's backends are shared by every server in the process."""
    import urllib.request

    urllib.request.urlopen(urllib.request.Request(f"{url}/moto-api/reset", method="POST"))
