"""The SQS Lambda handler (``create_sqs_lambda_handler``): partial batch failures, FIFO order and the
synchronous ``handler(event, context)`` form.

Events are built from messages really received from an SQS-compatible server, carrying wakeups that a
transport-mode runtime over in-memory storage published.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import pytest

from runlane import (
    DeliveryMessage,
    ErrorCode,
    LaneDelivery,
    LaneDeliveryMode,
    Runlane,
    RunlaneError,
    RunStatus,
    create_lane,
    create_runlane,
    queue,
    task,
)
from runlane_local import LocalStorageStore, local_storage_driver
from runlane_sqs import (
    SqsDeliveryFailure,
    SqsDeliveryFailurePhase,
    create_sqs_lambda_handler,
    parse_sqs_wakeup_body,
    sqs_queue,
    sqs_transport,
)

DEFAULT_QUEUE = queue("default", default=True)


@task("sqs_lambda.echo")
async def echo(payload: dict) -> dict:
    return payload


# ---------------------------------------------------------------------------------------------
# helpers


def _queue_name() -> str:
    return f"runlane-lambda-{uuid.uuid4().hex[:12]}"


def _runtime(client: Any, url: str, store: LocalStorageStore | None = None) -> Runlane:
    transport = sqs_transport(client=client, queues=[sqs_queue(DEFAULT_QUEUE, queue_url=url)])
    lane = create_lane(
        storage=local_storage_driver(store=store),
        delivery=LaneDelivery(mode=LaneDeliveryMode.TRANSPORT, transport=transport),
    )
    return create_runlane(lane=lane, queues=[DEFAULT_QUEUE], tasks=[echo])


def _receive(client: Any, url: str, count: int, timeout: float = 10.0) -> list[dict[str, Any]]:
    """Exactly ``count`` messages received from the queue (each once), within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    messages: dict[str, dict[str, Any]] = {}
    while len(messages) < count:
        if time.monotonic() > deadline:
            raise AssertionError(f"received {len(messages)} of {count} messages within {timeout:g}s")
        response = client.receive_message(
            QueueUrl=url, MaxNumberOfMessages=min(10, count - len(messages)), WaitTimeSeconds=1, VisibilityTimeout=60
        )
        for message in response.get("Messages", []):
            messages[message["MessageId"]] = message
    return list(messages.values())


def _record(message: dict[str, Any], url: str) -> dict[str, Any]:
    """The Lambda SQS event record of a received message."""
    name = url.rsplit("/", 1)[-1]
    return {
        "messageId": message["MessageId"],
        "receiptHandle": message["ReceiptHandle"],
        "body": message["Body"],
        "attributes": {},
        "messageAttributes": {},
        "eventSource": "aws:sqs",
        "eventSourceARN": f"arn:aws:sqs:us-east-1:123456789012:{name}",
        "awsRegion": "us-east-1",
    }


def _run_id(record: dict[str, Any]) -> str:
    return parse_sqs_wakeup_body(record["body"]).run_id


async def _records_by_run(client: Any, url: str, run_ids: list[str]) -> list[dict[str, Any]]:
    """The records of the wakeups of ``run_ids``, in that order."""
    messages = await asyncio.to_thread(_receive, client, url, len(run_ids))
    by_run = {_run_id(_record(message, url)): _record(message, url) for message in messages}
    return [by_run[run_id] for run_id in run_ids]


async def _statuses(runtime: Runlane, run_ids: list[str]) -> list[RunStatus]:
    return [(await runtime.runs.get(run_id)).status for run_id in run_ids]


def _failing_for(runtime: Runlane, failing_run_id: str, calls: list[str]) -> Any:
    """``runtime.execute_delivery``, except that the delivery of ``failing_run_id`` raises."""

    async def execute_delivery(message: DeliveryMessage, **options: Any) -> Any:
        calls.append(message.run_id)
        if message.run_id == failing_run_id:
            raise RunlaneError(ErrorCode.STORAGE_UNAVAILABLE, "The database is down.", retryable=True)
        return await runtime.execute_delivery(message, **options)

    return execute_delivery


# ---------------------------------------------------------------------------------------------
# batches


async def test_an_all_good_batch_reports_no_failures_and_executes_every_run(sqs_server):
    client = sqs_server.client()
    url = sqs_server.create_queue(_queue_name())
    async with _runtime(client, url) as runtime:
        run_ids = [(await runtime.trigger(echo, {"n": n})).run.id for n in range(3)]
        records = await _records_by_run(client, url, run_ids)
        failures: list[SqsDeliveryFailure] = []
        handler = create_sqs_lambda_handler(
            execute_delivery=runtime.execute_delivery,
            delivery_options={"lease_duration": "2m", "worker_id": "lambda-1"},
            on_delivery_failure=failures.append,
        )

        assert await handler.handle({"Records": records}) == {"batchItemFailures": []}
        assert await _statuses(runtime, run_ids) == [RunStatus.SUCCEEDED] * 3
        assert [(await runtime.runs.get(run_id)).output for run_id in run_ids] == [{"n": n} for n in range(3)]
        assert failures == []


# A body nested deeper than JSON can be read, well within the size cap: anyone who may send to the queue
# can write one, and it must fail its record alone, as any other junk does.
NESTED = "[" * 20_000 + "]" * 20_000


@pytest.mark.parametrize("body", ["not a wakeup", NESTED], ids=["text", "nested"])
async def test_a_junk_record_and_a_failed_execution_are_reported_while_the_others_are_handled(sqs_server, body):
    client = sqs_server.client()
    url = sqs_server.create_queue(_queue_name())
    async with _runtime(client, url) as runtime:
        run_ids = [(await runtime.trigger(echo, {"n": n})).run.id for n in range(3)]
        records = await _records_by_run(client, url, run_ids)
        junk_id = (await asyncio.to_thread(client.send_message, QueueUrl=url, MessageBody=body))["MessageId"]
        junk = _record((await asyncio.to_thread(_receive, client, url, 1))[0], url)
        assert junk["messageId"] == junk_id
        calls: list[str] = []
        failures: list[SqsDeliveryFailure] = []
        handler = create_sqs_lambda_handler(
            execute_delivery=_failing_for(runtime, run_ids[1], calls), on_delivery_failure=failures.append
        )

        event = {"Records": [records[0], junk, records[1], records[2]]}
        answer = await handler.handle(event)

        reported = [junk_id, records[1]["messageId"]]
        assert answer == {"batchItemFailures": [{"itemIdentifier": message_id} for message_id in reported]}
        assert calls == run_ids  # a standard-queue batch goes on after a failure
        assert await _statuses(runtime, run_ids) == [RunStatus.SUCCEEDED, RunStatus.QUEUED, RunStatus.SUCCEEDED]
        assert [(failure.phase, failure.provider_message_id) for failure in failures] == [
            (SqsDeliveryFailurePhase.PARSE, junk_id),
            (SqsDeliveryFailurePhase.EXECUTE, records[1]["messageId"]),
        ]
        assert failures[0].delivery_message is None
        assert failures[1].delivery_message.run_id == run_ids[1]
        assert isinstance(failures[1].cause, RunlaneError) and failures[1].cause.code is ErrorCode.STORAGE_UNAVAILABLE


async def test_a_fifo_handler_stops_at_the_first_failure_and_reports_every_later_record(sqs_server):
    client = sqs_server.client()
    url = sqs_server.create_queue(_queue_name())
    async with _runtime(client, url) as runtime:
        run_ids = [(await runtime.trigger(echo, {"n": n})).run.id for n in range(4)]
        records = await _records_by_run(client, url, run_ids)
        calls: list[str] = []
        failures: list[SqsDeliveryFailure] = []
        handler = create_sqs_lambda_handler(
            execute_delivery=_failing_for(runtime, run_ids[1], calls), fifo=True, on_delivery_failure=failures.append
        )

        answer = await handler.handle({"Records": records})

        assert answer == {"batchItemFailures": [{"itemIdentifier": record["messageId"]} for record in records[1:]]}
        assert calls == run_ids[:2]  # nothing after the failure was delivered
        assert await _statuses(runtime, run_ids) == [RunStatus.SUCCEEDED] + [RunStatus.QUEUED] * 3
        assert [failure.phase for failure in failures] == [SqsDeliveryFailurePhase.EXECUTE]


@pytest.mark.parametrize("fifo", [False, True], ids=["standard", "fifo"])
async def test_a_record_without_a_message_id_fails_the_whole_batch(sqs_server, fifo):
    client = sqs_server.client()
    url = sqs_server.create_queue(_queue_name())
    async with _runtime(client, url) as runtime:
        run_ids = [(await runtime.trigger(echo, {"n": n})).run.id for n in range(3)]
        records = await _records_by_run(client, url, run_ids)
        del records[2]["messageId"]
        calls: list[str] = []
        # The first record's delivery fails: on a FIFO batch the id-less record after it is then never
        # delivered, and it cannot be reported on its own either, so it must not end up acknowledged.
        handler = create_sqs_lambda_handler(execute_delivery=_failing_for(runtime, run_ids[0], calls), fifo=fifo)

        with pytest.raises(RunlaneError) as failed:
            await handler.handle({"Records": records})
        assert failed.value.code is ErrorCode.VALIDATION_FAILED
        assert failed.value.meta == {"record": 2}
        assert calls == []  # the batch fails before any record is delivered: all of it comes again
        assert await _statuses(runtime, run_ids) == [RunStatus.QUEUED] * 3


async def test_an_on_delivery_failure_that_raises_makes_the_handler_raise(sqs_server):
    client = sqs_server.client()
    url = sqs_server.create_queue(_queue_name())
    async with _runtime(client, url) as runtime:
        run_id = (await runtime.trigger(echo, {"n": 1})).run.id
        (record,) = await _records_by_run(client, url, [run_id])
        junk = dict(record, messageId=str(uuid.uuid4()), body='{"type": "something.else"}')

        class ObserverBroke(Exception):
            pass

        async def observe(failure: SqsDeliveryFailure) -> None:
            raise ObserverBroke(failure.phase, failure.provider_message_id)

        handler = create_sqs_lambda_handler(execute_delivery=runtime.execute_delivery, on_delivery_failure=observe)
        with pytest.raises(ObserverBroke) as failed:
            await handler.handle({"Records": [junk, record]})
        assert failed.value.args == (SqsDeliveryFailurePhase.PARSE, junk["messageId"])
        assert (await runtime.runs.get(run_id)).status is RunStatus.QUEUED


# ---------------------------------------------------------------------------------------------
# the synchronous form


def test_the_synchronous_handler_keeps_one_event_loop_and_runtime_across_invocations(sqs_server):
    client = sqs_server.client()
    url = sqs_server.create_queue(_queue_name())
    store = LocalStorageStore()  # the producer and the Lambda's runtime share storage, like a database

    async def produce() -> list[str]:
        async with _runtime(client, url, store) as producer:
            return [(await producer.trigger(echo, {"n": n})).run.id for n in range(2)]

    run_ids = asyncio.run(produce())
    messages = _receive(client, url, 2)
    records = {_run_id(_record(message, url)): _record(message, url) for message in messages}

    runtimes: list[Runlane] = []
    loops: list[asyncio.AbstractEventLoop] = []

    async def execute_delivery(message: DeliveryMessage, **options: Any) -> Any:
        if not runtimes:  # created on the first invocation, as a Lambda module would
            runtimes.append(_runtime(client, url, store))
        loops.append(asyncio.get_running_loop())
        return await runtimes[0].execute_delivery(message, **options)

    handler = create_sqs_lambda_handler(execute_delivery=execute_delivery)
    try:
        assert handler({"Records": [records[run_ids[0]]]}, None) == {"batchItemFailures": []}
        assert handler({"Records": [records[run_ids[1]]]}, None) == {"batchItemFailures": []}
        assert len(runtimes) == 1
        assert len(loops) == 2 and loops[0] is loops[1]
        runtime = runtimes[0]
        statuses = [handler._loop.run_until_complete(runtime.runs.get(run_id)).status for run_id in run_ids]
        assert statuses == [RunStatus.SUCCEEDED, RunStatus.SUCCEEDED]
    finally:
        loop = handler._loop
        if loop is not None:
            if runtimes:
                loop.run_until_complete(runtimes[0].close())
            loop.close()


async def test_the_synchronous_handler_refuses_to_run_inside_an_event_loop(sqs_server):
    client = sqs_server.client()
    url = sqs_server.create_queue(_queue_name())
    async with _runtime(client, url) as runtime:
        run_id = (await runtime.trigger(echo, {"n": 1})).run.id
        records = await _records_by_run(client, url, [run_id])
        calls: list[str] = []
        handler = create_sqs_lambda_handler(execute_delivery=_failing_for(runtime, "none", calls))

        with pytest.raises(RunlaneError) as refused:
            handler({"Records": records}, None)
        assert refused.value.code is ErrorCode.CONFIGURATION_INVALID
        assert "await handler.handle(event)" in refused.value.message
        assert calls == []
        assert (await runtime.runs.get(run_id)).status is RunStatus.QUEUED

        assert await handler.handle({"Records": records}) == {"batchItemFailures": []}
        assert (await runtime.runs.get(run_id)).status is RunStatus.SUCCEEDED


@pytest.mark.parametrize("wrapped", [False, True], ids=["bound-method", "wrapper"])
def test_close_closes_the_runtime_and_the_event_loop_the_synchronous_handler_kept(sqs_server, wrapped):
    client = sqs_server.client()
    url = sqs_server.create_queue(_queue_name())
    store = LocalStorageStore()

    async def produce() -> str:
        async with _runtime(client, url, store) as producer:
            return (await producer.trigger(echo, {"n": 1})).run.id

    run_id = asyncio.run(produce())
    (message,) = _receive(client, url, 1)
    runtime = _runtime(client, url, store)  # started by the handler's first invocation, on its loop
    execute = (lambda message, **options: runtime.execute_delivery(message, **options)) if wrapped else None
    handler = create_sqs_lambda_handler(execute_delivery=execute or runtime.execute_delivery)
    assert handler({"Records": [_record(message, url)]}, None) == {"batchItemFailures": []}
    loop = handler._loop
    assert loop is not None and not runtime.closed
    handler.close()
    assert runtime.closed and loop.is_closed()
    handler.close()  # again (as at interpreter exit): nothing to do

    async def status() -> RunStatus:
        async with _runtime(client, url, store) as reader:
            return (await reader.runs.get(run_id)).status

    assert asyncio.run(status()) is RunStatus.SUCCEEDED
