"""The SQS transport against a real SQS-compatible server (moto's server mode, through boto3).

It runs the transport conformance suite, then checks what SQS receives: one message per wakeup with
the versioned envelope, FIFO group and deduplication ids, queue-name resolution, batching, the error
mapping of a refused or unreachable provider, and an outbox that survives an SQS outage. Two answers
a real server cannot be made to give (per-entry failures and entry ids that do not match the request)
come from a client that returns them, since those are what the transport must map.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import boto3
import pytest
from botocore.config import Config
from runlane_local import local_storage_driver
from runlane_sqs import (
    SqsFifoDeduplication,
    SqsFifoMessageGroup,
    SqsTransport,
    encode_sqs_wakeup_body,
    parse_sqs_wakeup_body,
    sqs_queue,
    sqs_transport,
)
from runlane_sqs.testing import SqsTestServer

from runlane import (
    DeliveryMessage,
    Environment,
    ErrorCode,
    LaneDelivery,
    LaneDeliveryMode,
    OutboxMessageStatus,
    RunlaneError,
    create_lane,
    create_runlane,
    queue,
    task,
)
from runlane.core.transport import PublishWakeupsCommand, WakeupPublishAttempt
from runlane.testing import ControlledClock, TransportConformance
from runlane.vocabulary import WakeupPublishOutcomeType

PUBLISHED, FAILED = WakeupPublishOutcomeType.PUBLISHED, WakeupPublishOutcomeType.FAILED
T0 = datetime(2026, 11, 30, 8, 0, tzinfo=UTC)


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def wakeup(run_id: str, queue_name: str = "default", *, trace: dict[str, str] | None = None) -> DeliveryMessage:
    return DeliveryMessage(
        environment=Environment(name="test"), run_id=run_id, queue=queue_name, requested_at=T0, trace_carrier=trace
    )


def command(*messages: DeliveryMessage) -> PublishWakeupsCommand:
    return PublishWakeupsCommand(
        WakeupPublishAttempt(f"outbox_{message.run_id}", f"claim_{message.run_id}", message) for message in messages
    )


def drain(client: Any, url: str, *, attribute_names: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Every message now on the queue, received and deleted."""
    messages: list[dict[str, Any]] = []
    while True:
        response = client.receive_message(
            QueueUrl=url,
            MaxNumberOfMessages=10,
            WaitTimeSeconds=0,
            MessageSystemAttributeNames=list(attribute_names) or ["All"],
        )
        batch = response.get("Messages", [])
        if not batch:
            return messages
        messages.extend(batch)
        client.delete_message_batch(
            QueueUrl=url,
            Entries=[{"Id": str(index), "ReceiptHandle": item["ReceiptHandle"]} for index, item in enumerate(batch)],
        )


# ---------------------------------------------------------------------------------------------
# Conformance


class TestSqsTransportConformance(TransportConformance):
    wakeup_queues = ("conformance.default", "conformance.other")

    @pytest.fixture
    def transport(self, sqs_server: SqsTestServer) -> Iterator[SqsTransport]:
        client = sqs_server.client()
        bindings = [sqs_queue(name, queue_url=sqs_server.create_queue(unique("conf"))) for name in self.wakeup_queues]
        transport = sqs_transport(client=client, queues=bindings)
        transport._test_received = []  # type: ignore[attr-defined]
        yield transport

    def published_messages(self, transport: Any) -> list[DeliveryMessage]:
        for binding in transport.bindings:
            for message in drain(transport.client, binding.source):
                transport._test_received.append(parse_sqs_wakeup_body(message["Body"]))
        return list(transport._test_received)

    def fail_next_operation(self, transport: Any) -> bool:
        # The next publish (one SendMessageBatch per bound queue) goes to a port nothing listens on:
        # a real connection failure. Later calls reach SQS again.
        transport.client = _FirstCallsTo(SqsTestServer().client(), transport.client, len(transport.bindings))
        return True


class _FirstCallsTo:
    """A client that sends its first ``count`` SendMessageBatch calls to ``first``, the rest to ``rest``."""

    def __init__(self, first: Any, rest: Any, count: int) -> None:
        self._first, self._rest, self._count = first, rest, count

    def send_message_batch(self, **params: Any) -> Any:
        self._count -= 1
        return (self._first if self._count >= 0 else self._rest).send_message_batch(**params)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._rest, name)


# ---------------------------------------------------------------------------------------------
# What SQS receives


async def test_each_wakeup_is_one_message_carrying_the_versioned_envelope(sqs_server: SqsTestServer) -> None:
    client = sqs_server.client()
    url = sqs_server.create_queue(unique("std"))
    transport = sqs_transport(client=client, queues=[sqs_queue("default", queue_url=url)])
    trace = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
    messages = [wakeup("run_a", trace=trace), wakeup("run_b")]

    result = await transport.publish_wakeups(command(*messages))

    assert [outcome.type for outcome in result.outcomes] == [PUBLISHED, PUBLISHED]
    received = drain(client, url)
    assert sorted(item["MessageId"] for item in received) == sorted(o.provider_message_id for o in result.outcomes)
    assert sorted((parse_sqs_wakeup_body(item["Body"]) for item in received), key=lambda m: m.run_id) == messages
    body = json.loads(next(item["Body"] for item in received if "run_a" in item["Body"]))
    assert body == {
        "type": "runlane.wakeup",
        "version": 1,
        "message": {
            "environment": {"name": "test"},
            "run_id": "run_a",
            "queue": "default",
            "requested_at": "2026-11-30T08:00:00Z",
            "trace_carrier": trace,
        },
    }


async def test_wakeups_are_sent_in_batches_of_batch_size_to_the_queue_of_their_binding(
    sqs_server: SqsTestServer,
) -> None:
    client = sqs_server.client()
    urls = {"default": sqs_server.create_queue(unique("a")), "emails": sqs_server.create_queue(unique("b"))}
    transport = sqs_transport(
        client=client, queues=[sqs_queue(name, queue_url=url) for name, url in urls.items()], batch_size=3
    )
    messages = [wakeup(f"run_{index}", "emails" if index % 4 == 0 else "default") for index in range(23)]

    result = await transport.publish_wakeups(command(*messages))

    assert [outcome.type for outcome in result.outcomes] == [PUBLISHED] * 23
    for name, url in urls.items():
        got = sorted(parse_sqs_wakeup_body(item["Body"]).run_id for item in drain(client, url))
        assert got == sorted(message.run_id for message in messages if message.queue == name)


async def test_fifo_wakeups_carry_a_group_per_run_and_a_deduplication_id_per_outbox_row(
    sqs_server: SqsTestServer,
) -> None:
    client = sqs_server.client()
    url = sqs_server.create_queue(unique("per-run") + ".fifo", fifo=True)
    transport = sqs_transport(client=client, queues=[sqs_queue("default", queue_url=url, fifo=True)])
    assert transport.capabilities.message_grouping and transport.capabilities.ordered_delivery

    first = await transport.publish_wakeups(command(wakeup("run_1"), wakeup("run_2")))
    again = await transport.publish_wakeups(command(wakeup("run_1")))  # the same outbox row, published again

    assert [o.type for o in (*first.outcomes, *again.outcomes)] == [PUBLISHED] * 3
    received = drain(client, url)
    # SQS drops the second send of an outbox row within its deduplication window.
    assert sorted(item["Attributes"]["MessageGroupId"] for item in received) == ["run_1", "run_2"]
    assert len({item["Attributes"]["MessageDeduplicationId"] for item in received}) == 2


async def test_a_run_id_sqs_refuses_as_a_group_id_is_grouped_by_its_hash(sqs_server: SqsTestServer) -> None:
    """SQS takes 1-128 ASCII letters, digits and punctuation as a MessageGroupId; a run id may hold spaces,
    other scripts and 512 characters. Those go out as their sha256, one group per run still."""
    client = sqs_server.client()
    url = sqs_server.create_queue(unique("group-ids") + ".fifo", fifo=True)
    transport = sqs_transport(client=client, queues=[sqs_queue("default", queue_url=url, fifo=True)])
    plain, spaced, accented, long = "order-42.v1", "order 42", "commande-é", "sync." + "x" * 200

    result = await transport.publish_wakeups(command(*(wakeup(run_id) for run_id in (plain, spaced, accented, long))))

    assert [outcome.type for outcome in result.outcomes] == [PUBLISHED] * 4
    groups = {
        parse_sqs_wakeup_body(item["Body"]).run_id: item["Attributes"]["MessageGroupId"] for item in drain(client, url)
    }
    hashed = {run_id: hashlib.sha256(run_id.encode("utf-8")).hexdigest() for run_id in (spaced, accented, long)}
    assert groups == {plain: plain, **hashed}


async def test_fifo_queue_grouping_puts_every_wakeup_of_a_queue_in_one_group(sqs_server: SqsTestServer) -> None:
    client = sqs_server.client()
    url = sqs_server.create_queue(unique("per-queue") + ".fifo", fifo=True, ContentBasedDeduplication="true")
    binding = sqs_queue(
        "default",
        queue_url=url,
        fifo={"message_group": SqsFifoMessageGroup.QUEUE, "deduplication": SqsFifoDeduplication.CONTENT_BASED},
    )
    transport = sqs_transport(client=client, queues=[binding])

    await transport.publish_wakeups(command(wakeup("run_1"), wakeup("run_2"), wakeup("run_3")))

    received = drain(client, url)
    assert [parse_sqs_wakeup_body(item["Body"]).run_id for item in received] == ["run_1", "run_2", "run_3"]
    assert {item["Attributes"]["MessageGroupId"] for item in received} == {"default"}


async def test_content_based_deduplication_on_a_queue_without_it_is_refused_not_retried(
    sqs_server: SqsTestServer,
) -> None:
    url = sqs_server.create_queue(unique("no-cbd") + ".fifo", fifo=True)
    binding = sqs_queue("default", queue_url=url, fifo={"deduplication": "content_based"})
    transport = sqs_transport(client=sqs_server.client(), queues=[binding])

    with pytest.raises(RunlaneError) as raised:
        await transport.publish_wakeups(command(wakeup("run_1")))

    assert raised.value.code is ErrorCode.TRANSPORT_PUBLISH_FAILED
    assert raised.value.retryable is False
    assert raised.value.meta["provider_code"] == "InvalidParameterValue"
    assert "deduplication='outbox'" in raised.value.message


async def test_a_queue_name_is_resolved_once_and_cached(sqs_server: SqsTestServer) -> None:
    client = sqs_server.client()
    name = unique("named")
    url = sqs_server.create_queue(name)
    calls: list[str] = []

    class Counting:
        def __getattr__(self, attribute: str) -> Any:
            method = getattr(client, attribute)

            def counted(**params: Any) -> Any:
                calls.append(attribute)
                return method(**params)

            return counted

    transport = sqs_transport(client=Counting(), queues=[sqs_queue("default", queue_name=name)])
    await transport.publish_wakeups(command(wakeup("run_1")))
    await transport.publish_wakeups(command(wakeup("run_2")))

    assert calls.count("get_queue_url") == 1
    assert await transport.queue_url("default") == url
    assert len(drain(client, url)) == 2


async def test_a_queue_name_that_does_not_resolve_refuses_the_publish(sqs_server: SqsTestServer) -> None:
    client = sqs_server.client()
    healthy = sqs_server.create_queue(unique("healthy"))
    missing = unique("nowhere")
    transport = sqs_transport(
        client=client, queues=[sqs_queue("default", queue_name=missing), sqs_queue("other", queue_url=healthy)]
    )

    with pytest.raises(RunlaneError) as raised:
        await transport.publish_wakeups(command(wakeup("run_1", "other"), wakeup("run_2")))

    # The configuration is wrong: the whole call is refused before anything is sent.
    assert raised.value.code is ErrorCode.CONFIGURATION_INVALID and not raised.value.retryable
    assert "does not exist" in raised.value.message and missing in raised.value.message
    assert drain(client, healthy) == []


async def test_a_missing_queue_url_fails_only_its_own_wakeups(sqs_server: SqsTestServer) -> None:
    client = sqs_server.client()
    healthy = sqs_server.create_queue(unique("healthy"))
    missing = {"queue_url": f"{sqs_server.endpoint_url}/123456789012/{unique('gone')}"}
    transport = sqs_transport(
        client=client, queues=[sqs_queue("default", **missing), sqs_queue("other", queue_url=healthy)]
    )

    result = await transport.publish_wakeups(command(wakeup("run_1"), wakeup("run_2", "other")))

    lost, sent = result.outcomes
    assert lost.type is WakeupPublishOutcomeType.FAILED
    assert lost.failure.code is ErrorCode.TRANSPORT_PUBLISH_FAILED and lost.failure.retryable
    assert "does not exist" in lost.failure.message
    assert sent.type is WakeupPublishOutcomeType.PUBLISHED
    assert [parse_sqs_wakeup_body(m["Body"]).run_id for m in drain(client, healthy)] == ["run_2"]


async def test_an_unreachable_endpoint_is_a_retryable_transport_outage() -> None:
    dead = SqsTestServer()  # a free port nothing listens on: never started
    url = f"{dead.endpoint_url}/123456789012/gone"
    transport = sqs_transport(client=dead.client(), queues=[sqs_queue("default", queue_url=url)])

    with pytest.raises(RunlaneError) as raised:
        await transport.publish_wakeups(command(wakeup("run_1")))

    assert raised.value.code is ErrorCode.TRANSPORT_UNAVAILABLE
    assert raised.value.retryable is True
    assert raised.value.meta["queue_url"] == url


@pytest.mark.parametrize(
    ("status", "shape", "query_code"),
    [
        pytest.param(400, "KmsThrottled", "KMS.ThrottlingException", id="kms-throttled-as-sqs-writes-it"),
        pytest.param(400, "KmsThrottled", None, id="kms-throttled-json-only"),
        pytest.param(403, "RequestThrottled", "RequestThrottled", id="request-throttled"),
        pytest.param(403, "ExpiredTokenException", "ExpiredToken", id="expired-session-token"),
        pytest.param(403, "InvalidClientTokenId", None, id="rotated-access-key"),
    ],
)
async def test_a_throttled_or_credential_refused_publish_is_a_retryable_outage_not_a_refusal(
    sqs_refusing: Any, status: int, shape: str, query_code: str | None
) -> None:
    # Real SQS names its errors by their query code (x-amzn-query-error), which botocore reports: KMS
    # throttling of an encrypted queue is KMS.ThrottlingException. A refusal would dead-letter the wakeups,
    # and so it did for every wakeup published while the process's credentials had expired.
    endpoint = sqs_refusing(status, shape, query_code)
    client = boto3.client(
        "sqs",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        config=Config(retries={"total_max_attempts": 1}),
    )
    transport = sqs_transport(client=client, queues=[sqs_queue("default", queue_url=f"{endpoint}/123456789012/q")])

    with pytest.raises(RunlaneError) as raised:
        await transport.publish_wakeups(command(wakeup("run_1")))

    assert raised.value.code is ErrorCode.TRANSPORT_UNAVAILABLE and raised.value.retryable is True
    assert raised.value.meta["provider_code"] == (query_code or shape)


async def test_a_wakeup_for_a_queue_without_a_binding_fails_alone(sqs_server: SqsTestServer) -> None:
    client = sqs_server.client()
    url = sqs_server.create_queue(unique("bound"))
    transport = sqs_transport(client=client, queues=[sqs_queue("default", queue_url=url)])

    result = await transport.publish_wakeups(command(wakeup("run_1"), wakeup("run_2", "retired"), wakeup("run_3")))

    assert [o.type for o in result.outcomes] == [PUBLISHED, FAILED, PUBLISHED]
    failure = result.outcomes[1].failure
    assert failure is not None and failure.retryable is False and "'retired'" in failure.message
    assert len(drain(client, url)) == 2


# ---------------------------------------------------------------------------------------------
# Answers a real server cannot be made to give


class _Answering:
    """A client whose SendMessageBatch answer is built from the request by ``answer``."""

    def __init__(self, answer: Any) -> None:
        self.answer = answer

    def send_message_batch(self, *, QueueUrl: str, Entries: list[dict[str, Any]]) -> dict[str, Any]:  # noqa: N803
        return self.answer(Entries)

    def get_queue_url(self, **params: Any) -> dict[str, Any]:
        raise AssertionError("not used: the binding has a URL")


async def test_per_entry_failures_become_failed_outcomes_by_index() -> None:
    def answer(entries: list[dict[str, Any]]) -> dict[str, Any]:
        ids = [entry["Id"] for entry in entries]
        return {
            "Successful": [{"Id": ids[0], "MessageId": "m-0"}, {"Id": ids[3], "MessageId": "m-3"}],
            "Failed": [
                {"Id": ids[2], "Code": "InternalError", "SenderFault": False, "Message": "raw provider text"},
                {"Id": ids[1], "Code": "InvalidMessageContents", "SenderFault": True, "Message": "raw text"},
            ],
            "ResponseMetadata": {"RequestId": "req-1"},
        }

    transport = sqs_transport(
        client=_Answering(answer), queues=[sqs_queue("default", queue_url="http://127.0.0.1:9/1/q")]
    )
    result = await transport.publish_wakeups(command(*(wakeup(f"run_{index}") for index in range(4))))

    assert [o.type for o in result.outcomes] == [PUBLISHED, FAILED, FAILED, PUBLISHED]
    assert [result.outcomes[0].provider_message_id, result.outcomes[3].provider_message_id] == ["m-0", "m-3"]
    sender_fault, throttled = result.outcomes[1].failure, result.outcomes[2].failure
    assert sender_fault is not None and throttled is not None
    assert (sender_fault.code, sender_fault.retryable) == (ErrorCode.TRANSPORT_PUBLISH_FAILED, False)
    assert (throttled.code, throttled.retryable) == (ErrorCode.TRANSPORT_PUBLISH_FAILED, True)
    assert throttled.meta == {
        "provider_code": "InternalError",
        "sender_fault": False,
        "request_id": "req-1",
        "queue_url": "http://127.0.0.1:9/1/q",
        "queue": "default",
    }
    assert "raw" not in sender_fault.message and "raw" not in throttled.message


@pytest.mark.parametrize(
    "answer",
    [
        pytest.param(lambda ids: {"Successful": [{"Id": ids[0], "MessageId": "m"}], "Failed": []}, id="missing"),
        pytest.param(
            lambda ids: {"Successful": [{"Id": i, "MessageId": "m"} for i in [*ids, ids[0]]], "Failed": []},
            id="duplicated",
        ),
        pytest.param(
            lambda ids: {"Successful": [{"Id": i, "MessageId": "m"} for i in [*ids, "x"]], "Failed": []},
            id="unknown",
        ),
    ],
)
async def test_an_answer_that_does_not_match_the_request_raises(answer: Any) -> None:
    client = _Answering(lambda entries: answer([entry["Id"] for entry in entries]))
    transport = sqs_transport(client=client, queues=[sqs_queue("default", queue_url="http://127.0.0.1:9/1/q")])

    with pytest.raises(RunlaneError) as raised:
        await transport.publish_wakeups(command(wakeup("run_1"), wakeup("run_2")))

    assert raised.value.code is ErrorCode.TRANSPORT_PUBLISH_FAILED
    assert raised.value.retryable is True
    assert "published again" in raised.value.message


# ---------------------------------------------------------------------------------------------
# Through the runtime: the outbox survives an SQS outage


default = queue("default", default=True)


@task("sqs.noop")
async def noop(payload: dict[str, Any]) -> None:
    return None


async def test_a_trigger_during_an_sqs_outage_keeps_its_run_and_tick_publishes_it_later() -> None:
    with SqsTestServer() as server:
        name = unique("outage")
        url = server.create_queue(name)
        transport = sqs_transport(client=server.client(), queues=[sqs_queue(default, queue_url=url)])
        lane = create_lane(
            storage=local_storage_driver(), delivery=LaneDelivery(mode=LaneDeliveryMode.TRANSPORT, transport=transport)
        )
        clock = ControlledClock(T0)
        runtime = create_runlane(lane=lane, queues=[default], tasks=[noop], clock=clock)
        async with runtime:
            server.stop()
            result = await runtime.trigger(noop, {"n": 1})  # the run is durable even though SQS is down
            assert result.run.status.value == "queued"
            (row,) = await runtime.store.list_run_outbox(result.run.id)
            assert row.status is OutboxMessageStatus.FAILED and row.last_failure is not None
            assert (row.last_failure.code, row.last_failure.retryable) == (ErrorCode.TRANSPORT_UNAVAILABLE, True)

            server.start()  # same port; its queues were in memory, so create the queue again
            assert server.create_queue(name) == url
            clock.advance(timedelta(minutes=5))
            ticked = await runtime.tick()

            assert ticked.outbox_published == 1
            received = drain(server.client(), url)
            assert [parse_sqs_wakeup_body(item["Body"]).run_id for item in received] == [result.run.id]


def test_the_wakeup_body_round_trips_and_is_canonical() -> None:
    message = wakeup("run_1", trace={"b": "2", "a": "1"})
    body = encode_sqs_wakeup_body(message)
    assert parse_sqs_wakeup_body(body) == message
    assert parse_sqs_wakeup_body(body.encode()) == message
    assert body == json.dumps(json.loads(body), sort_keys=True, separators=(",", ":"))


def test_a_wakeup_body_holds_only_characters_sqs_accepts() -> None:
    # SQS refuses (or replaces with U+FFFD) what XML cannot hold; ids and trace carriers may hold U+FFFE/U+FFFF.
    message = wakeup("run_\uffff\u00e9", trace={"\ufffe": "v\uffff\x01"})
    body = encode_sqs_wakeup_body(message)
    allowed = re.compile("[\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]*")
    assert allowed.fullmatch(body) and "run_\\uffff\u00e9" in body  # other text is kept as it is
    assert parse_sqs_wakeup_body(body) == message




@pytest.mark.parametrize(
    ("code", "queue_url", "hint", "not_hinted"),
    [
        ("AccessDenied", "https://sqs.example/1/q", "Grant this process's AWS identity", "deduplication"),
        ("InvalidParameterValue", "https://sqs.example/1/q.fifo", "deduplication='outbox'", "Grant"),
        ("InvalidParameterValue", "https://sqs.example/1/q", "Check the queue's settings", "deduplication"),
        ("KmsAccessDenied", "https://sqs.example/1/q.fifo", "Grant this process's AWS identity", "deduplication"),
    ],
)
def test_a_refusal_says_what_to_check_for_its_cause_only(
    code: str, queue_url: str, hint: str, not_hinted: str
) -> None:
    from botocore.exceptions import ClientError

    from runlane_sqs.aws import classify_provider_error

    refusal = ClientError(
        {"Error": {"Code": code, "Message": "no"}, "ResponseMetadata": {"HTTPStatusCode": 400}}, "SendMessageBatch"
    )
    error = classify_provider_error(refusal, operation="SendMessageBatch", queue_url=queue_url)
    assert error.code is ErrorCode.TRANSPORT_PUBLISH_FAILED and error.retryable is False
    assert hint in error.message and not_hinted not in error.message
    assert error.meta["provider_code"] == code


@pytest.mark.parametrize(
    ("code", "hint", "not_hinted"),
    [
        ("InvalidClientTokenId", "refused this process's credentials", "permissions"),
        ("ExpiredToken", "configure valid ones", "deduplication"),
        ("SignatureDoesNotMatch", "AWS_SESSION_TOKEN", "Grant"),
    ],
)
def test_credentials_aws_refuses_are_an_outage_to_retry_not_a_refusal_for_good(
    code: str, hint: str, not_hinted: str
) -> None:
    # Refused for good, every wakeup published while a session token had expired was dead-lettered, and its
    # run stayed queued with no wakeup until an operator cancelled and reran it.
    from botocore.exceptions import ClientError

    from runlane_sqs.aws import classify_provider_error

    refusal = ClientError(
        {"Error": {"Code": code, "Message": "no"}, "ResponseMetadata": {"HTTPStatusCode": 403}}, "SendMessageBatch"
    )
    error = classify_provider_error(refusal, operation="SendMessageBatch", queue_url="https://sqs.example/1/q.fifo")
    assert error.code is ErrorCode.TRANSPORT_UNAVAILABLE and error.retryable is True
    assert hint in error.message and not_hinted not in error.message and "nothing is lost" in error.message
    assert error.meta["provider_code"] == code


def test_the_test_server_without_the_testing_extra_says_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *args: None if name == "moto" else find_spec(name, *args)
    )
    server = SqsTestServer()
    try:
        with pytest.raises(RuntimeError, match=r"needs moto: install .*pip install 'runlane-sqs\[testing\]'"):
            server.start()
        assert not server.running
    finally:
        server.stop()


_OWNER = """
import sys, time
from runlane_sqs.testing import SqsTestServer
server = SqsTestServer().start()
print(server.port, flush=True)
if sys.argv[1] == "linger":
    time.sleep(60)
"""


def _serving(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.settimeout(1)
        return probe.connect_ex(("127.0.0.1", port)) == 0


def _closes_within(port: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _serving(port):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.parametrize("ending", ["exit", "sigkill"])
def test_a_test_server_never_outlives_the_process_that_started_it(ending: str) -> None:
    """A server left running when its owner exits without stop(), or is killed outright, does not stay
    behind holding its port (it runs in a session of its own, so nothing else would stop it)."""
    owner = subprocess.Popen(
        [sys.executable, "-c", _OWNER, "exit" if ending == "exit" else "linger"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert owner.stdout is not None
        port = int(owner.stdout.readline())
        if ending == "sigkill":
            assert _serving(port)
            owner.kill()
        owner.wait(timeout=30)
        assert _closes_within(port, 15), f"the SQS test server on port {port} outlived its owner"
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait(timeout=10)
