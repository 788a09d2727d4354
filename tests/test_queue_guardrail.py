"""The Kubernetes flavour's budget guardrail (gpucluster/node/queue_guardrail.py): its decision on each of the team's
ClusterQueues (the accelerator queue and the CPU queue, each decided on its own), the merge patches it sends, its checks
against Budgets (botocore's Stubber: the real request and response shapes, including a new budget's, and the Budgets
actions moto does not serve) and a stand-in Kubernetes API over TLS, the fault path through the SQS loop (moto), and the
Deployment's wait for its Pod Identity association."""

from __future__ import annotations

import copy
import json
import logging
import ssl
import subprocess
import threading
import urllib.error
from collections.abc import Iterator
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable

import boto3
import pytest
from botocore.stub import Stubber

from conftest import K8S_STACK_FILES, ROOT, in_process_moto, of_type, planned
from gpucluster.node import budget_guardrail, queue_guardrail, sqs_poll
from gpucluster.node.budget import BudgetSpend, read_spend
from gpucluster.node.kube_api import KubeApi
from gpucluster.node.queue_guardrail import HELD_BY, Action, ClusterQueueApi, Guardrail, Settings, decide
from gpucluster.render import kube
from gpucluster.spec.model import load_stack
from test_kubernetes import CRDS, check  # the strict schema check every declared object passes

ACCOUNT = "123456789012"
BUDGET = "b"
TEAM = "vision"
QUEUES = (TEAM, f"{TEAM}-cpu")  # the team's accelerator and CPU ClusterQueues, as kube.cluster_queue_names names them
ACTION_ID = "0a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9"
IDS = {"AccountId": ACCOUNT, "BudgetName": BUDGET}
K8S_STACK = ROOT / "stacks" / "Pulumi.team-k8s.yaml"
VERSION = load_stack(K8S_STACK).spec.eks.version


def budget(actual: float | None, limit: float = 100.0) -> dict[str, Any]:
    """DescribeBudget's answer; `actual` None is a new budget's, before AWS has computed a spend (no CalculatedSpend:
    optional in botocore's model, which the Stubber checks this shape against)."""
    answer: dict[str, Any] = {"BudgetName": BUDGET, "BudgetLimit": {"Amount": str(limit), "Unit": "USD"},
                              "TimeUnit": "MONTHLY", "BudgetType": "COST"}
    if actual is not None:
        answer["CalculatedSpend"] = {"ActualSpend": {"Amount": str(actual), "Unit": "USD"}}
    return {"Budget": answer}


def budget_action(status: str) -> dict[str, Any]:
    return {**IDS, "Action": {
        "ActionId": ACTION_ID, "BudgetName": BUDGET, "NotificationType": "ACTUAL", "ActionType": "APPLY_IAM_POLICY",
        "ActionThreshold": {"ActionThresholdValue": 100.0, "ActionThresholdType": "PERCENTAGE"},
        "Definition": {"IamActionDefinition": {"PolicyArn": "arn:aws:iam::123456789012:policy/deny", "Roles": ["r"]}},
        "ExecutionRoleArn": "arn:aws:iam::123456789012:role/x", "ApprovalModel": "AUTOMATIC", "Status": status,
        "Subscribers": [{"SubscriptionType": "SNS", "Address": "arn:aws:sns:us-east-1:123456789012:t"}]}}


def client(service: str) -> Any:
    return boto3.client(service, region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")


def spend(actual: float, limit: float = 100.0) -> BudgetSpend:
    return BudgetSpend(actual=actual, limit=limit, act_at=limit)


# --- A new budget -------------------------------------------------------------------------------------------------

def test_a_new_budget_reads_as_no_spend_and_keeps_the_queue_open() -> None:
    budgets = client("budgets")
    with Stubber(budgets) as stub:
        stub.add_response("describe_budget", budget(None), IDS)
        stub.add_response("describe_budget", budget(0.0), IDS)
        new, computed = (read_spend(budgets, ACCOUNT, BUDGET, 100) for _ in range(2))
    assert (new.actual, new.forecast, new.computed, new.over) == (0.0, None, False, False)
    assert "computed no spend yet" in new.describe(TEAM) and computed.computed
    assert "computed no spend yet" not in computed.describe(TEAM)
    assert decide(new, queue_guardrail.OPEN, held_by_guardrail=False).action is Action.LEAVE


def test_the_slurm_heads_guardrail_stays_open_on_a_new_budget(tmp_path: Path) -> None:
    """The head's guardrail reads the spend the same way: a new budget is no reason to close the partitions."""
    from gpucluster.contract.settings import BudgetSettings, ClusterSettings
    from gpucluster.node.slurm_control import SlurmControl

    class NoSlurm(SlurmControl):
        """An open cluster under budget calls no scontrol: any call fails the test."""

        def _run(self, *args: str) -> str:
            raise AssertionError(f"scontrol {args} on an open cluster under budget")

    config = ClusterSettings(cluster="gpucluster-t", region="us-east-1", pools={}, log_file="/dev/null",
                             budget_state_file=str(tmp_path / "budget.json"))
    guard = BudgetSettings(budget_name=BUDGET, account_id=ACCOUNT, act_threshold_percent=100, queue_url="q",
                           topic_arn="t", launch_deny_action=False)
    budgets = client("budgets")
    with Stubber(budgets) as stub:
        stub.add_response("describe_budget", budget(None), IDS)
        assert budget_guardrail.Guardrail(config, guard, NoSlurm(), budgets, None, team=TEAM).check() == "open"


# --- The decision -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("actual", "stop_policy", "annotated", "expected"), [
    (99.99, "None", False, Action.LEAVE),  # open and under: nothing to do
    (100.0, "None", False, Action.HOLD),  # at the threshold: held, and marked as the guardrail's
    (250.0, "Hold", True, Action.LEAVE),  # its own hold, still over
    (50.0, "Hold", True, Action.REOPEN),  # its own hold, back under (a new month, a raised limit)
    (50.0, "Hold", False, Action.LEAVE),  # a person's hold: only a person reopens it
    (50.0, "HoldAndDrain", False, Action.LEAVE),
    (250.0, "Hold", False, Action.LEAVE),  # a person's hold past the threshold: still theirs
    (50.0, "None", True, Action.REOPEN),  # a person reopened its hold: the claim goes, so a later hold stays theirs
    (250.0, "None", True, Action.HOLD),  # a person reopened it past the threshold: the budget's promise, held again
    (50.0, "HoldAndDrain", True, Action.LEAVE),  # a person made its hold a drain: theirs now
])
def test_the_guardrail_reopens_only_what_it_held(actual: float, stop_policy: str, annotated: bool,
                                                 expected: Action) -> None:
    assert decide(spend(actual), stop_policy, annotated).action is expected


# --- The patches --------------------------------------------------------------------------------------------------

def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch, as the API server applies `application/merge-patch+json` (null removes a key)."""
    if not isinstance(patch, dict):
        return patch
    merged = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = merge_patch(merged.get(key), value)
    return merged


def cluster_queue(stop_policy: str | None = None, annotations: dict[str, str] | None = None,
                  version: str = "1", cpu: bool = False) -> dict[str, Any]:
    """One of the team's ClusterQueues (the accelerator one, or with `cpu` the CPU one) as the shipped Kubernetes stack
    declares it, as the API server would hold it."""
    stack, declared = planned(K8S_STACK)
    name = kube.cpu_cluster_queue_name(stack) if cpu else kube.cluster_queue_name(stack)
    (declared_queue,) = [q for q in of_type(declared, "kueue.x-k8s.io/v1beta2:ClusterQueue")
                         if q.inputs["metadata"]["name"] == name]
    obj = copy.deepcopy(declared_queue.inputs)
    obj["metadata"]["resourceVersion"] = version
    if annotations is not None:
        obj["metadata"]["annotations"] = annotations
    if stop_policy is not None:
        obj["spec"]["stopPolicy"] = stop_policy
    return obj


@pytest.mark.parametrize("cpu", [False, True], ids=["accelerator-queue", "cpu-queue"])
def test_a_hold_and_its_mark_go_in_one_patch_and_come_off_in_one(cpu: bool) -> None:
    other = {"owner": "ml-platform"}  # a person's annotation: the patches leave it
    opened = cluster_queue(annotations=dict(other), version="7", cpu=cpu)
    held = merge_patch(opened, queue_guardrail.patch_body(Action.HOLD, "7", "over budget"))
    check(held, VERSION)
    assert held["spec"]["stopPolicy"] == "Hold" and held["metadata"]["annotations"] == {**other, HELD_BY: "over budget"}
    assert queue_guardrail.ClusterQueue.from_object(held).held_by_guardrail
    reopened = merge_patch(held, queue_guardrail.patch_body(Action.REOPEN, "7"))
    check(reopened, VERSION)
    assert reopened["spec"]["stopPolicy"] == "None" and reopened["metadata"]["annotations"] == other
    assert not queue_guardrail.ClusterQueue.from_object(reopened).held_by_guardrail
    # Each patch carries the version its decision read: the API server refuses it if the queue changed since.
    for action in (Action.HOLD, Action.REOPEN):
        assert queue_guardrail.patch_body(action, "7")["metadata"]["resourceVersion"] == "7"
    # An unset stopPolicy is Kueue's default (the CRD's), open; the shipped stack leaves it unset.
    default = CRDS[(kube.KUEUE_API, "ClusterQueue")]["properties"]["spec"]["properties"]["stopPolicy"]["default"]
    assert queue_guardrail.ClusterQueue.from_object(cluster_queue(cpu=cpu)).stop_policy == default == \
        queue_guardrail.OPEN


# --- Against a Kubernetes API ---------------------------------------------------------------------------------------

class ApiServer:
    """A stand-in for the API server's clusterqueues endpoint, for the team's queues (by name), over TLS: this machine
    has no kube-apiserver (no envtest binaries in any registry here). It does what the guardrail relies on: bearer
    token, GET, PATCH with application/merge-patch+json (RFC 7386) under the resourceVersion precondition (409 Conflict,
    the API server's Status body), a new resourceVersion on each change; `fail_next` answers the next request with an
    error, `after_get` changes the object as a person would between the guardrail's GET and its PATCH."""

    TOKEN = "projected-token"

    def __init__(self, tls: tuple[Path, Path], objs: dict[str, dict[str, Any]]) -> None:
        self.objs = objs
        self.requests: list[tuple[str, str, dict[str, str], bytes]] = []
        self.fail_next: tuple[int, str] | None = None
        self.after_get: Callable[[dict[str, Any]], None] | None = None
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def answer(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def status(self, code: int, reason: str, message: str) -> None:
                self.answer(code, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message,
                                   "reason": reason, "code": code})

            def handle_one(self, method: str) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                server.requests.append((method, self.path, dict(self.headers), body))
                if self.headers["Authorization"] != f"Bearer {server.TOKEN}":
                    return self.status(401, "Unauthorized", "Unauthorized")
                name = self.path.removeprefix(queue_guardrail.KUEUE_PATH)
                if name not in server.objs:
                    return self.status(403, "Forbidden", f"no access to {self.path}")  # the RBAC's queues only
                if server.fail_next:
                    (code, message), server.fail_next = server.fail_next, None
                    return self.status(code, "InternalError", message)
                obj = server.objs[name]
                if method == "GET":
                    self.answer(200, obj)
                    if server.after_get:
                        server.after_get(obj)
                        obj["metadata"]["resourceVersion"] += "+"
                    return None
                if self.headers["Content-Type"] != "application/merge-patch+json":
                    return self.status(415, "UnsupportedMediaType", self.headers["Content-Type"])
                patch = json.loads(body)
                version = str(obj["metadata"]["resourceVersion"])
                if patch["metadata"].get("resourceVersion", version) != version:
                    return self.status(409, "Conflict", "Operation cannot be fulfilled on clusterqueues.kueue.x-k8s.io"
                                       f' "{name}": the object has been modified; please apply your changes to the'
                                       " latest version and try again")
                patch["metadata"].pop("resourceVersion", None)
                server.objs[name] = merge_patch(obj, patch)
                server.objs[name]["metadata"]["resourceVersion"] = version + "+"
                return self.answer(200, server.objs[name])

            def do_GET(self) -> None:
                self.handle_one("GET")

            def do_PATCH(self) -> None:
                self.handle_one("PATCH")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(*tls)
        self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True)

    def url(self) -> str:
        return f"https://127.0.0.1:{self.httpd.server_address[1]}"

    def stop_policies(self) -> dict[str, str]:
        return {name: obj["spec"].get("stopPolicy", queue_guardrail.OPEN) for name, obj in self.objs.items()}


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1, the cluster's CA as the pod sees it (ca.crt)."""
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=apiserver",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(d / "key.pem"),
                    "-out", str(d / "ca.crt")], check=True, capture_output=True)
    return d / "ca.crt", d / "key.pem"


@pytest.fixture
def api(tls: tuple[Path, Path], tmp_path: Path) -> Iterator[tuple[ApiServer, dict[str, ClusterQueueApi]]]:
    server = ApiServer(tls, {name: cluster_queue("None", cpu=name != TEAM) for name in QUEUES})
    # A short poll: shutdown() waits for the loop's next look (0.5 s by default, at every test's teardown).
    thread = threading.Thread(target=server.httpd.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    (tmp_path / "token").write_text(ApiServer.TOKEN + "\n")
    api = KubeApi(server.url(), tmp_path / "token", tls[0])
    yield server, {name: ClusterQueueApi(api, name) for name in QUEUES}
    server.httpd.shutdown()
    server.httpd.server_close()
    thread.join()


def test_the_token_is_read_again_at_every_call(api: tuple[ApiServer, dict[str, ClusterQueueApi]],
                                               tmp_path: Path) -> None:
    """The kubelet rotates the projected token in place: a client made before the rotation uses the new one."""
    _, queues = api
    queue = queues[TEAM]
    (tmp_path / "token").write_text("expired-token\n")
    with pytest.raises(urllib.error.HTTPError) as refused:
        queue.get()
    assert refused.value.code == 401
    (tmp_path / "token").write_text(ApiServer.TOKEN + "\n")
    assert queue.get().stop_policy == queue_guardrail.OPEN


SETTINGS = Settings(queue_url="q", budget_name=BUDGET, team=TEAM, cluster_queues=QUEUES, act_threshold_percent=100,
                    launch_deny_action_id=ACTION_ID)


class Aws:
    """Budgets and STS under Stubber: each check's calls are queued before it, and the test asserts all were made."""

    def __init__(self) -> None:
        self.budgets, self.sts = client("budgets"), client("sts")
        self.stubs = [Stubber(self.budgets), Stubber(self.sts)]
        for stub in self.stubs:
            stub.activate()
        self.stubs[1].add_response("get_caller_identity", {"Account": ACCOUNT, "UserId": "u",
                                                           "Arn": f"arn:aws:sts::{ACCOUNT}:assumed-role/r/s"})

    def spend(self, actual: float | None, deny: str | None = None) -> None:
        """The next check's Budgets answers: the spend, and below the threshold the deny's status (and its
        reversal if it ran)."""
        budgets = self.stubs[0]
        budgets.add_response("describe_budget", budget(actual), IDS)
        if deny is not None:
            action = {**IDS, "ActionId": ACTION_ID}
            budgets.add_response("describe_budget_action", budget_action(deny), action)
            if deny == "EXECUTION_SUCCESS":
                reverse = {**action, "ExecutionType": "REVERSE_BUDGET_ACTION"}
                budgets.add_response("execute_budget_action", reverse, reverse)

    def done(self) -> None:
        for stub in self.stubs:
            stub.assert_no_pending_responses()


def test_it_holds_reopens_and_leaves_a_persons_hold_alone(api: tuple[ApiServer, dict[str, ClusterQueueApi]]) -> None:
    server, queues = api
    aws = Aws()
    guardrail = Guardrail(SETTINGS, aws.budgets, aws.sts, queues)
    aws.spend(120.0)  # over: both queues held (CPU work spends too), each marked
    outcome = guardrail.check()
    assert {name: q["action"] for name, q in outcome["queues"].items()} == {name: "hold" for name in QUEUES}
    for obj in server.objs.values():
        assert obj["spec"]["stopPolicy"] == "Hold"
        assert f"team {TEAM} spent $120.00" in obj["metadata"]["annotations"][HELD_BY]
    aws.spend(130.0)  # still over: nothing sent
    patches = sum(method == "PATCH" for method, *_ in server.requests)
    assert {q["action"] for q in guardrail.check()["queues"].values()} == {"leave"}
    assert sum(method == "PATCH" for method, *_ in server.requests) == patches
    cpu = QUEUES[1]
    server.objs[cpu]["metadata"]["annotations"].pop(HELD_BY)  # an admin takes the CPU queue's hold over
    aws.spend(10.0, deny="EXECUTION_SUCCESS")  # a new month: its own hold reopened, mark removed, the deny reversed
    outcome = guardrail.check()
    assert (outcome["queues"][TEAM]["action"], outcome["queues"][cpu]["action"]) == ("reopen", "leave")
    assert outcome["launch_deny_reversed"] is True
    assert server.stop_policies() == {TEAM: "None", cpu: "Hold"}
    assert HELD_BY not in server.objs[TEAM]["metadata"].get("annotations", {})
    server.objs[TEAM]["spec"]["stopPolicy"] = "Hold"  # an admin holds it by hand (kubectl patch)
    aws.spend(10.0, deny="STANDBY")  # the deny never ran this month: nothing to reverse
    outcome = guardrail.check()
    assert {q["action"] for q in outcome["queues"].values()} == {"leave"} and outcome["launch_deny_reversed"] is False
    assert server.stop_policies() == {TEAM: "Hold", cpu: "Hold"}
    aws.done()
    # Every call carried the projected token, and the patches the merge-patch type.
    assert all(h["Authorization"] == f"Bearer {ApiServer.TOKEN}" for _, _, h, _ in server.requests)
    assert {h["Content-Type"] for m, _, h, _ in server.requests if m == "PATCH"} == {"application/merge-patch+json"}


def test_a_persons_change_between_read_and_patch_wins(api: tuple[ApiServer, dict[str, ClusterQueueApi]],
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """The guardrail read open queues over budget; before its patches land, an admin holds each by hand. The patches
    are refused (409), logged, and the next check leaves the admin's holds alone: its mark never lands on them."""
    server, queues = api
    aws = Aws()
    guardrail = Guardrail(SETTINGS, aws.budgets, aws.sts, queues)
    server.after_get = lambda obj: obj["spec"].update(stopPolicy="HoldAndDrain")
    aws.spend(150.0)
    with caplog.at_level(logging.ERROR, logger=queue_guardrail.log.name):
        assert guardrail.on_messages([], now=0) == []
    for name in QUEUES:
        assert f'{name}: HTTP 409 Conflict: Operation cannot be fulfilled on clusterqueues.kueue.x-k8s.io "{name}"' \
            in caplog.text
    server.after_get = None
    aws.spend(150.0)
    assert guardrail.on_messages([], now=1) == []
    assert server.stop_policies() == {name: "HoldAndDrain" for name in QUEUES}
    assert not any("annotations" in obj["metadata"] for obj in server.objs.values())
    aws.done()


# --- Faults -------------------------------------------------------------------------------------------------------

@pytest.fixture
def sqs() -> Iterator[tuple[Any, str]]:
    with in_process_moto():
        sqs = boto3.client("sqs", region_name="us-east-1")
        # No visibility timeout: a message kept after a failed check is received again at the next turn.
        yield sqs, sqs.create_queue(QueueName="guardrail", Attributes={"VisibilityTimeout": "0"})["QueueUrl"]


def waiting(sqs: Any, url: str) -> int:
    attributes = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["All"])["Attributes"]
    return int(attributes["ApproximateNumberOfMessages"]) + int(attributes["ApproximateNumberOfMessagesNotVisible"])


@pytest.mark.parametrize("fault", ["budgets", "kubernetes"])
def test_a_failed_call_is_logged_kept_and_checked_again(fault: str, sqs: tuple[Any, str],
                                                        api: tuple[ApiServer, dict[str, ClusterQueueApi]],
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """A Budgets notification arrives; the check fails (Budgets throttles, or the API server errs on the first
    queue): the cause is logged, the service keeps going, the message stays; a queue the API answered for is held all
    the same. The next turn checks again, holds the rest, and deletes the message."""
    client_sqs, url = sqs
    server, queues = api
    aws = Aws()
    guardrail = Guardrail(SETTINGS, aws.budgets, aws.sts, queues)
    client_sqs.send_message(QueueUrl=url, MessageBody=json.dumps({"Type": "Notification", "Subject": "AWS Budgets"}))
    if fault == "budgets":
        aws.stubs[0].add_client_error("describe_budget", "ThrottlingException", "Rate exceeded", 400,
                                      expected_params=IDS)
        expected, held_anyway = "ThrottlingException", {name: "None" for name in QUEUES}
    else:
        aws.spend(150.0)
        server.fail_next = (500, "etcdserver: request timed out")  # the first queue's GET
        expected = f"{QUEUES[0]}: HTTP 500 Internal Server Error: etcdserver: request timed out"
        held_anyway = {QUEUES[0]: "None", QUEUES[1]: "Hold"}
    turns = iter([False, True])
    with caplog.at_level(logging.ERROR, logger=queue_guardrail.log.name):
        sqs_poll.serve(client_sqs, url, lambda m: guardrail.on_messages(m, now=0), stop=lambda: next(turns),
                       wait_seconds=lambda: 0)
    assert expected in caplog.text and "trying again at the next check" in caplog.text
    assert waiting(client_sqs, url) == 1 and server.stop_policies() == held_anyway
    aws.spend(150.0)
    turns = iter([False, True])
    sqs_poll.serve(client_sqs, url, lambda m: guardrail.on_messages(m, now=0), stop=lambda: next(turns),
                   wait_seconds=lambda: 0)
    assert waiting(client_sqs, url) == 0 and server.stop_policies() == {name: "Hold" for name in QUEUES}
    aws.done()


def test_without_a_message_it_checks_when_due(api: tuple[ApiServer, dict[str, ClusterQueueApi]]) -> None:
    """Spend falls back at the month's turn with no notification: the timer checks on its own, every
    RECHECK_SECONDS."""
    server, queues = api
    aws = Aws()
    guardrail = Guardrail(SETTINGS, aws.budgets, aws.sts, queues)
    checks = lambda: sum(method == "GET" for method, *_ in server.requests) / len(QUEUES)  # noqa: E731
    aws.spend(150.0)
    guardrail.on_messages([], now=1000)
    assert checks() == 1
    guardrail.on_messages([], now=1000 + queue_guardrail.RECHECK_SECONDS - 1)
    assert checks() == 1
    aws.spend(150.0)
    guardrail.on_messages([], now=1000 + queue_guardrail.RECHECK_SECONDS)
    assert checks() == 2
    aws.done()


def test_one_turn_of_the_service_holds_both_queues_over_budget(sqs: tuple[Any, str],
                                                               api: tuple[ApiServer, dict[str, ClusterQueueApi]],
                                                               tls: tuple[Path, Path], tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """The service as main() starts it, for one turn of its loop: a Budgets notification on the queue, spend past the
    act threshold. Both ClusterQueues are held and marked, the deny is left alone (no Budgets action call queued:
    the Stubber would refuse one, the check fail and the message stay), the outcome logged and the message deleted."""
    client_sqs, url = sqs
    server, _ = api
    aws = Aws()
    aws.spend(150.0)
    clients = {"budgets": aws.budgets, "sts": aws.sts, "sqs": client_sqs}
    client_sqs.send_message(QueueUrl=url, MessageBody=json.dumps({"Type": "Notification", "Subject": "AWS Budgets"}))
    turns = iter([False, True])
    with caplog.at_level(logging.INFO, logger=queue_guardrail.log.name):
        queue_guardrail.serve(replace(SETTINGS, queue_url=url), clients.__getitem__,
                              KubeApi(server.url(), tmp_path / "token", tls[0]), stop=lambda: next(turns))
    aws.done()
    assert server.stop_policies() == {name: "Hold" for name in QUEUES}
    assert all(HELD_BY in obj["metadata"]["annotations"] for obj in server.objs.values())
    assert waiting(client_sqs, url) == 0
    (outcome,) = [json.loads(r.getMessage()) for r in caplog.records if r.levelno == logging.INFO]
    assert outcome["actual_usd"] == 150.0 and "launch_deny_reversed" not in outcome


def test_the_deployments_environment_names_every_queue_its_role_may_patch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The program reads the rendered environment: the queues it holds are the stack's ClusterQueues, every one, and
    exactly those its ClusterRole may get and patch."""
    for path in K8S_STACK_FILES:
        stack, declared = planned(path)
        if stack.spec.budget.act_threshold_percent is None:
            continue
        (deployment,) = [d.inputs for d in of_type(declared, "apps/v1:Deployment")
                         if d.inputs["metadata"]["name"] == kube.GUARDRAIL]
        for variable in deployment["spec"]["template"]["spec"]["containers"][0]["env"]:
            monkeypatch.setenv(variable["name"], str(variable["value"]))
        settings = Settings.from_environment()
        declared_queues = [q.inputs["metadata"]["name"] for q in of_type(declared, "ClusterQueue")]
        assert sorted(settings.cluster_queues) == sorted(declared_queues) and len(declared_queues) == 2
        (role,) = [r.inputs for r in of_type(declared, "rbac.authorization.k8s.io/v1:ClusterRole")
                   if r.inputs["metadata"]["name"] == kube.GUARDRAIL]
        (rule,) = role["rules"]
        assert sorted(rule["resourceNames"]) == sorted(declared_queues) and rule["verbs"] == ["get", "patch"]
        assert settings.team == stack.spec.team


# --- The Deployment waits for its credentials -------------------------------------------------------------------

@pytest.mark.parametrize("path", K8S_STACK_FILES, ids=lambda p: p.name)
def test_the_guardrail_starts_after_its_pod_identity_association(path: Path) -> None:
    stack, declared = planned(path)
    if stack.spec.budget.act_threshold_percent is None:  # alerts only: no guardrail, no association for one
        assert not [a for a in of_type(declared, "eks/podIdentityAssociation:PodIdentityAssociation")
                    if a.inputs["serviceAccount"] == kube.GUARDRAIL]
        return
    (association,) = [a for a in of_type(declared, "eks/podIdentityAssociation:PodIdentityAssociation")
                      if a.inputs["serviceAccount"] == kube.GUARDRAIL]
    (deployment,) = [d for d in of_type(declared, "apps/v1:Deployment")
                     if d.inputs["metadata"]["name"] == kube.GUARDRAIL]
    assert association.urn in deployment.dependencies
