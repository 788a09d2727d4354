"""gpucluster/node/fetch_bundle.py, the first step of every node boot, against moto: the settings and the munge key in
one SSM call, the bundle from S3 once per bundle key, the head's key creation and its race, and the retries that let
hundreds of nodes boot at once (Parameter Store throttles) without retrying what can never succeed."""

from __future__ import annotations

import base64
import importlib.util
import io
import json
import stat
import tarfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import botocore.retries.bucket
import botocore.retries.standard
import pytest
from botocore.awsrequest import AWSResponse
from botocore.exceptions import ClientError, NoCredentialsError

from conftest import ROOT, in_process_moto
from gpucluster.contract import settings as contract
from gpucluster.contract.settings import ClusterSettings
from gpucluster.project import EXAMPLES_DIR
from gpucluster.render import bundle, userdata
from gpucluster.spec.model import load_stack

spec = importlib.util.spec_from_file_location("fetch_bundle", ROOT / "gpucluster" / "node" / "fetch_bundle.py")
assert spec and spec.loader
fetcher = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fetcher)

STACK = load_stack(ROOT / "stacks" / "Pulumi.dev.yaml")
KEY = bytes(range(256)) * 4  # a 1024-byte munge key
BUNDLE = bundle.build(STACK, EXAMPLES_DIR)  # once: the repository may change while the tests run
BOOTSTRAP = Path(contract.BOOTSTRAP_PROGRAM).relative_to(contract.BUNDLE_DIR)  # its place in the bundle


class Boto3:
    """boto3 as fetch() uses it, with every API call and every HTTP attempt counted, and faults injected in front of
    moto: `faults[operation]` lists error codes the next attempts get instead of an answer; the next client of a
    service in `no_credentials` has none (as when instance metadata did not answer in time while it was made)."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()  # operations, as the program calls them
        self.sends: Counter[str] = Counter()  # HTTP attempts, botocore's own retries included
        self.faults: dict[str, list[str]] = {}
        self.clients: list[Any] = []
        self.no_credentials: set[str] = set()
        self.wrap = lambda client: client

    def client(self, service: str, config: Any = None) -> Any:
        client = boto3.client(service, config=config)
        client.meta.events.register("before-call", self._call)
        client.meta.events.register_first("before-send", self._send)
        if service in self.no_credentials:
            self.no_credentials.discard(service)
            client.meta.events.register("before-call", self._no_credentials)
        self.clients.append(client)
        return self.wrap(client)

    @staticmethod
    def _no_credentials(**kwargs: Any) -> None:
        raise NoCredentialsError()

    def _call(self, event_name: str, **kwargs: Any) -> None:
        self.calls[event_name.split(".")[-1]] += 1

    def _send(self, request: Any, event_name: str, **kwargs: Any) -> AWSResponse | None:
        operation = event_name.split(".")[-1]
        self.sends[operation] += 1
        faults = self.faults.get(operation)
        if not faults:
            return None  # on to moto
        code = faults.pop(0)
        body = json.dumps({"__type": code, "message": f"injected {code}"}).encode()
        return AWSResponse(request.url, 400, {"x-amzn-RequestId": "injected"}, _Raw(body))


class _Raw:
    def __init__(self, body: bytes) -> None:
        self.body = body

    def stream(self, **kwargs: Any) -> Any:
        yield self.body


@pytest.fixture
def aws(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """moto with the config parameter `pulumi up` writes and the bundle it uploads; time stands still for retries."""
    # botocore's backoff and its adaptive rate limiter would wait for real: let its clock run fast instead.
    monkeypatch.setattr(botocore.retries.standard.ExponentialBackoff, "delay_amount", lambda self, context: 0)
    ticks = iter(range(0, 10**9, 100))
    monkeypatch.setattr(botocore.retries.bucket.Clock, "current_time", lambda self: next(ticks))
    with in_process_moto():
        data = BUNDLE
        s3 = boto3.client("s3", region_name=STACK.region)
        s3.create_bucket(Bucket="gpucluster-dev-bundle")
        s3.put_object(Bucket="gpucluster-dev-bundle", Key=bundle.key(data), Body=data)
        settings = ClusterSettings(cluster=STACK.cluster_name, region=STACK.region, pools={},
                                   bundle_bucket="gpucluster-dev-bundle", bundle_key=bundle.key(data),
                                   munge_key_parameter=userdata.munge_key_parameter(STACK))
        ssm = boto3.client("ssm", region_name=STACK.region)
        ssm.put_parameter(Name=userdata.config_parameter(STACK), Type="String", Value=settings.to_json())
        yield ssm


def node_env(tmp_path: Path, role: str) -> dict[str, str]:
    """What user data gives the node, with its files under tmp_path."""
    env = userdata.node_env(STACK, role, None if role == "head" else STACK.spec.pools[0])
    return env | {"GPUCLUSTER_BUNDLE_DIR": str(tmp_path / "opt"),
                  "GPUCLUSTER_SETTINGS_FILE": str(tmp_path / "cluster.json"),
                  "GPUCLUSTER_MUNGE_KEY_FILE": str(tmp_path / "munge.key"),
                  "GPUCLUSTER_BOOT_LOG": str(tmp_path / "boot.log")}


def put_key(ssm: Any, key: bytes = KEY) -> None:
    ssm.put_parameter(Name=userdata.munge_key_parameter(STACK), Type="SecureString",
                      Value=base64.b64encode(key).decode())


def no_sleep(seconds: float) -> None:
    raise AssertionError(f"slept {seconds} s without a reason")


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# --- (i) a compute node ---------------------------------------------------------------------------------------------

def test_compute_node_reads_both_in_one_call_and_fetches_the_bundle_once(aws: Any, tmp_path: Path) -> None:
    put_key(aws)
    env, api = node_env(tmp_path, "compute"), Boto3()
    fetcher.fetch(env, api, sleep=no_sleep)

    assert api.calls == Counter({"GetParameters": 1, "GetObject": 1})  # one SSM call for settings and key
    assert api.sends == api.calls  # and no retry
    for client in api.clients:  # adaptive retries: client-side rate limiting when hundreds of nodes boot
        # botocore reads max_attempts=10 as ten retries: eleven attempts in all.
        assert client.meta.config.retries == {"mode": "adaptive", "total_max_attempts": 11}
    settings_file, key_file = Path(env["GPUCLUSTER_SETTINGS_FILE"]), Path(env["GPUCLUSTER_MUNGE_KEY_FILE"])
    assert ClusterSettings.load(settings_file).bundle_key == bundle.key(BUNDLE)
    assert key_file.read_bytes() == KEY
    assert (mode(settings_file), mode(key_file)) == (0o644, 0o400)
    target = Path(env["GPUCLUSTER_BUNDLE_DIR"])
    unpacked = {str(p.relative_to(target)) for p in target.rglob("*") if p.is_file()}
    with tarfile.open(fileobj=io.BytesIO(BUNDLE)) as tar:
        shipped = set(tar.getnames())
    # All of the bundle but the library's head-only parts (spec, render, aws, the command line, the stack's file):
    # of lib/ only the contract and the node programs, which need nothing else.
    library = {name for name in shipped if name.startswith(("lib/gpucluster/contract/", "lib/gpucluster/node/"))}
    rest = {name for name in shipped if not name.startswith("lib/")}
    assert unpacked == rest | library | {"lib/gpucluster/__init__.py", ".bundle-key", ".bundle-files"}
    assert str(BOOTSTRAP) in unpacked and "lib/gpucluster/spec/model.py" in shipped - unpacked
    assert (target / ".bundle-key").read_text() == bundle.key(BUNDLE)
    assert not list(tmp_path.rglob("*.tmp"))  # written atomically, nothing half-written left behind

    again = Boto3()  # a reboot: same bundle key, nothing to download
    fetcher.fetch(env, again, sleep=no_sleep)
    assert again.calls == Counter({"GetParameters": 1})
    assert key_file.read_bytes() == KEY and mode(key_file) == 0o400


def test_a_new_bundle_key_is_fetched(aws: Any, tmp_path: Path) -> None:
    put_key(aws)
    env = node_env(tmp_path, "compute")
    fetcher.fetch(env, Boto3(), sleep=no_sleep)
    target = Path(env["GPUCLUSTER_BUNDLE_DIR"])
    (target / ".bundle-key").write_text("gpucluster/bundle-0000000000000000.tar.gz")
    # The last bundle had a program this one dropped; a file the node made itself is not the bundle's to remove.
    (target / "retired_program.py").write_text("old")
    (target / ".bundle-files").write_text((target / ".bundle-files").read_text() + "\nretired_program.py")
    (target / "fetch_bundle.py").write_text("written by cloud-init")
    api = Boto3()
    fetcher.fetch(env, api, sleep=no_sleep)
    assert api.calls["GetObject"] == 1
    assert not (target / "retired_program.py").exists()
    assert (target / "fetch_bundle.py").exists() and (target / BOOTSTRAP).exists()


def test_the_head_unpacks_the_whole_bundle(aws: Any, tmp_path: Path) -> None:
    """The head's admins run `gpucluster cost|render|preflight` from the bundle's library and stack file."""
    put_key(aws)
    env = node_env(tmp_path, "head")
    fetcher.fetch(env, Boto3(), sleep=no_sleep)
    target = Path(env["GPUCLUSTER_BUNDLE_DIR"])
    with tarfile.open(fileobj=io.BytesIO(BUNDLE)) as tar:
        assert {str(p.relative_to(target)) for p in target.rglob("*") if p.is_file()} == \
            set(tar.getnames()) | {".bundle-key", ".bundle-files"}


# --- (ii) the munge key: the head creates it, compute nodes wait for it ----------------------------------------------

def test_first_head_creates_the_key(aws: Any, tmp_path: Path) -> None:
    env = node_env(tmp_path, "head")
    fetcher.fetch(env, Boto3(), sleep=no_sleep)
    stored = aws.get_parameter(Name=userdata.munge_key_parameter(STACK), WithDecryption=True)["Parameter"]
    assert stored["Type"] == "SecureString"
    key = Path(env["GPUCLUSTER_MUNGE_KEY_FILE"]).read_bytes()
    assert len(key) == 1024 and base64.b64decode(stored["Value"]) == key

    again = Boto3()  # its reboot reads the key it made, creates none
    fetcher.fetch(env, again, sleep=no_sleep)
    assert "PutParameter" not in again.calls and Path(env["GPUCLUSTER_MUNGE_KEY_FILE"]).read_bytes() == key


def test_a_racing_head_takes_the_winners_key(aws: Any, tmp_path: Path) -> None:
    """Two heads (a replacement started before the old one is gone): both read no key, the other one writes first."""
    winner = bytes(reversed(KEY))

    class Raced:
        def __init__(self, client: Any) -> None:
            self.client = client

        def __getattr__(self, name: str) -> Any:
            return getattr(self.client, name)

        def get_parameters(self, **kwargs: Any) -> Any:
            answer = self.client.get_parameters(**kwargs)
            put_key(aws, winner)  # the other head, between our read and our create
            return answer

    api = Boto3()
    api.wrap = lambda client: Raced(client) if client.meta.service_model.service_name == "ssm" else client
    env = node_env(tmp_path, "head")
    fetcher.fetch(env, api, sleep=no_sleep)
    assert api.calls["PutParameter"] == 1  # it tried, and lost
    assert Path(env["GPUCLUSTER_MUNGE_KEY_FILE"]).read_bytes() == winner
    stored = aws.get_parameter(Name=userdata.munge_key_parameter(STACK), WithDecryption=True)["Parameter"]["Value"]
    assert base64.b64decode(stored) == winner  # not overwritten


def test_compute_node_waits_for_the_heads_key(aws: Any, tmp_path: Path) -> None:
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        if len(slept) == 3:
            put_key(aws)  # the head node is up

    env, api = node_env(tmp_path, "compute"), Boto3()
    fetcher.fetch(env, api, sleep=sleep)
    assert len(slept) == 3 and api.calls["GetParameters"] == 4 and "PutParameter" not in api.calls
    assert all(0 <= s <= min(60, 2 ** attempt) for attempt, s in enumerate(slept))  # jittered, capped backoff
    assert Path(env["GPUCLUSTER_MUNGE_KEY_FILE"]).read_bytes() == KEY


def test_compute_node_gives_up_at_the_deadline(aws: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fetcher, "DEADLINE_SECONDS", 0.3)
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        assert len(slept) < 2000, "still waiting long after the deadline"

    env, api = node_env(tmp_path, "compute"), Boto3()
    with pytest.raises(RuntimeError, match="gave up after 0.3 s: no munge key"):
        fetcher.fetch(env, api, sleep=sleep)
    assert slept and "PutParameter" not in api.calls  # it waited, and created nothing
    with pytest.raises(aws.exceptions.ParameterNotFound):
        aws.get_parameter(Name=userdata.munge_key_parameter(STACK))
    assert not Path(env["GPUCLUSTER_MUNGE_KEY_FILE"]).exists()
    assert not Path(env["GPUCLUSTER_SETTINGS_FILE"]).exists()


def test_no_settings_yet_is_waited_for(aws: Any, tmp_path: Path) -> None:
    """A node that boots before `pulumi up` has written the config parameter."""
    put_key(aws)
    config = aws.get_parameter(Name=userdata.config_parameter(STACK))["Parameter"]["Value"]
    aws.delete_parameter(Name=userdata.config_parameter(STACK))
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        aws.put_parameter(Name=userdata.config_parameter(STACK), Type="String", Value=config)

    env = node_env(tmp_path, "compute")
    fetcher.fetch(env, Boto3(), sleep=sleep)
    assert len(slept) == 1 and Path(env["GPUCLUSTER_SETTINGS_FILE"]).read_text() == config


# --- (iii) throttling is retried past botocore's own retries; a refusal is not --------------------------------------

def test_throttling_past_botocores_retries_is_retried_and_the_boot_completes(aws: Any, tmp_path: Path) -> None:
    put_key(aws)
    api = Boto3()
    slept: list[float] = []
    api.faults["GetParameters"] = ["ThrottlingException"] * 25  # botocore gives up after 11 attempts, twice
    env = node_env(tmp_path, "compute")
    fetcher.fetch(env, api, sleep=slept.append)
    assert api.sends["GetParameters"] == 26  # 11 + 11 + (3 throttled and the answer)
    assert api.calls["GetParameters"] == 3 and len(slept) == 2  # fetch()'s own loop: two more tries
    assert Path(env["GPUCLUSTER_MUNGE_KEY_FILE"]).read_bytes() == KEY
    assert (Path(env["GPUCLUSTER_BUNDLE_DIR"]) / BOOTSTRAP).exists()


def test_a_client_made_without_credentials_is_made_anew(aws: Any, tmp_path: Path) -> None:
    """Instance metadata slow to answer while the S3 client was made (a busy boot): the next attempt's client has
    credentials, and the boot completes instead of failing every attempt until the deadline."""
    put_key(aws)
    api = Boto3()
    api.no_credentials.add("s3")
    slept: list[float] = []

    def once(seconds: float) -> None:
        assert not slept, "a second wait: the attempt after the first had no credentials either"
        slept.append(seconds)

    env = node_env(tmp_path, "compute")
    fetcher.fetch(env, api, sleep=once)
    assert len(slept) == 1
    assert (Path(env["GPUCLUSTER_BUNDLE_DIR"]) / BOOTSTRAP).exists()


def test_access_denied_is_not_retried(aws: Any, tmp_path: Path) -> None:
    """A node role without ssm:GetParameters: retrying for 15 minutes would only hide it. The unit fails at once."""
    put_key(aws)
    api = Boto3()
    api.faults["GetParameters"] = ["AccessDeniedException"]
    with pytest.raises(ClientError, match="AccessDeniedException"):
        fetcher.fetch(node_env(tmp_path, "compute"), api, sleep=no_sleep)
    assert api.sends["GetParameters"] == 1 and "GetObject" not in api.calls
    assert not Path(tmp_path / "munge.key").exists()


def test_a_bundle_not_yet_uploaded_is_waited_for(aws: Any, tmp_path: Path) -> None:
    """`pulumi up` writes the settings, then the object they name may still be on its way: wait, don't fail."""
    put_key(aws)
    s3 = boto3.client("s3", region_name=STACK.region)
    s3.delete_object(Bucket="gpucluster-dev-bundle", Key=bundle.key(BUNDLE))
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        if len(slept) == 2:
            s3.put_object(Bucket="gpucluster-dev-bundle", Key=bundle.key(BUNDLE), Body=BUNDLE)  # it arrives

    env, api = node_env(tmp_path, "compute"), Boto3()
    fetcher.fetch(env, api, sleep=sleep)
    assert len(slept) == 2 and api.calls["GetObject"] == 3
    assert (Path(env["GPUCLUSTER_BUNDLE_DIR"]) / BOOTSTRAP).exists()
