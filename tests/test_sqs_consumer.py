"""The long-running SQS consumer (``create_sqs_delivery_consumer``) against a real SQS-compatible server.

Wakeups are published by a transport-mode runtime over in-memory storage, received by the consumer and
executed through ``runtime.execute_delivery``; what stays on the queue is read back from the server.
"""

from __future__ import annotations

import asyncio
import inspect
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import boto3
import pytest
from botocore.config import Config

from runlane import (
    CancellationController,
    DeliveryMessage,
    ErrorCode,
    ExecuteDeliveryIgnoredReason,
    ExecuteDeliveryStatus,
    LaneDelivery,
    LaneDeliveryMode,
    Retry,
    Runlane,
    RunlaneError,
    RunStatus,
    TaskContext,
    create_lane,
    create_runlane,
    queue,
    task,
)
from runlane_local import local_storage_driver
from runlane_sqs import (
    SqsDeliveryConsumer,
    SqsDeliveryFailure,
    SqsDeliveryFailurePhase,
    create_sqs_delivery_consumer,
    encode_sqs_wakeup_body,
    parse_sqs_wakeup_body,
    sqs_queue,
    sqs_transport,
)
from runlane_sqs.testing import TEST_CREDENTIALS, TEST_REGION

DEFAULT_QUEUE = queue("default", default=True)
WAIT = 15.0  # upper bound of every wait for something the consumer does


@task("sqs_consumer.echo")
async def echo(payload: dict) -> dict:
    return payload


@task("sqs_consumer.slow")
async def slow(payload: dict) -> dict:
    await asyncio.sleep(payload["seconds"])
    return payload


@task("sqs_consumer.broken", retry=Retry(1))
async def broken(payload: dict) -> None:
    raise ValueError("the task itself failed")


_STARTED: dict[str, asyncio.Event] = {}


@task("sqs_consumer.cooperative")
async def cooperative(payload: dict, ctx: TaskContext) -> str | None:
    """Waits for its signal and returns the abort reason."""
    _STARTED[payload["started"]].set()
    await asyncio.wait_for(ctx.signal.wait(), timeout=WAIT)
    return ctx.signal.reason


@task("sqs_consumer.handed_back")
async def handed_back(payload: dict, ctx: TaskContext) -> str:
    """Stops with its worker on the first attempt, as the docs show (``raise_if_aborted``)."""
    if ctx.attempt == 1:
        _STARTED[payload["started"]].set()
        await asyncio.wait_for(ctx.signal.wait(), timeout=WAIT)
        ctx.signal.raise_if_aborted()
    return f"attempt {ctx.attempt}"


# ---------------------------------------------------------------------------------------------
# helpers


def _queue_name(prefix: str = "runlane-consumer") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def _runtime(client: Any, url: str, *, fifo: object = None) -> Runlane:
    transport = sqs_transport(client=client, queues=[sqs_queue(DEFAULT_QUEUE, queue_url=url, fifo=fifo)])
    lane = create_lane(
        storage=local_storage_driver(), delivery=LaneDelivery(mode=LaneDeliveryMode.TRANSPORT, transport=transport)
    )
    return create_runlane(lane=lane, queues=[DEFAULT_QUEUE], tasks=[echo, slow, broken, cooperative, handed_back])


async def _depth(client: Any, url: str) -> int:
    """Messages on the queue, visible or in flight."""
    response = await asyncio.to_thread(
        client.get_queue_attributes,
        QueueUrl=url,
        AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"],
    )
    attributes = response["Attributes"]
    return int(attributes["ApproximateNumberOfMessages"]) + int(attributes["ApproximateNumberOfMessagesNotVisible"])


async def _eventually(check: Callable[[], Any], what: str, timeout: float = WAIT) -> Any:
    """Poll ``check`` (sync or async) until it returns something truthy, for at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        await asyncio.sleep(0.05)


async def _status(runtime: Runlane, run_id: str) -> RunStatus:
    run = await runtime.runs.get(run_id)
    assert run is not None
    return run.status


async def _trigger_watched(runtime: Runlane, definition: Any) -> tuple[str, str]:
    """Trigger ``definition`` with a fresh ``started`` key, whose event in ``_STARTED`` its handler sets."""
    key = uuid.uuid4().hex
    _STARTED[key] = asyncio.Event()
    return (await runtime.trigger(definition, {"started": key})).run.id, key


def _failing_with(error: BaseException) -> Callable[..., Any]:
    async def execute_delivery(message: DeliveryMessage, **options: Any) -> None:
        raise error

    return execute_delivery


def _unused_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
async def consumers() -> AsyncIterator[list[SqsDeliveryConsumer]]:
    """Consumers a test started; stopped at teardown even when the test failed half-way."""
    started: list[SqsDeliveryConsumer] = []
    yield started
    for consumer in started:
        await asyncio.wait_for(consumer.stop(), timeout=WAIT)


async def _start(consumers: list[SqsDeliveryConsumer], **options: Any) -> SqsDeliveryConsumer:
    consumer = create_sqs_delivery_consumer(**{"wait_time_seconds": 1, **options})
    consumers.append(consumer)
    await consumer.start()
    return consumer


# ---------------------------------------------------------------------------------------------
# delivery and acknowledgement


async def test_a_triggered_run_is_executed_and_its_message_deleted(sqs_server, consumers):
    client = sqs_server.client()
    url = sqs_server.create_queue(_queue_name())
    async with _runtime(client, url) as runtime:
        run_id = (await runtime.trigger(echo, {"a": 1})).run.id
        assert await _depth(client, url) == 1  # eager dispatch published one wakeup
        consumer = await _start(consumers, client=client, queue_url=url, execute_delivery=runtime.execute_delivery)

        await _eventually(lambda: consumer.counts.deleted == 1, "the message to be deleted")
        assert await _status(runtime, run_id) is RunStatus.SUCCEEDED
        assert (await runtime.runs.get(run_id)).output == {"a": 1}
        assert await _depth(client, url) == 0
        assert (consumer.counts.received, consumer.counts.delivered, consumer.counts.failed) == (1, 1, 0)


async def test_a_message_whose_body_is_not_a_wakeup_stays_on_the_queue(sqs_server, consumers):
    client = sqs_server.client()
    url = sqs_server.create_queue(_queue_name(), VisibilityTimeout="1")
    sent = await asyncio.to_thread(client.send_message, QueueUrl=url, MessageBody='{"hello": "not a wakeup"}')
    failures: list[SqsDeliveryFailure] = []
    executed: list[DeliveryMessage] = []
    consumer = await _start(
        consumers,
        client=client,
        queue_url=url,
        execute_delivery=lambda message, **options: executed.append(message),
        on_delivery_failure=failures.append,
    )

    # Not deleted: the visibility timeout hands the same message back, and it fails the same way again.
    await _eventually(lambda: len(failures) >= 2, "the junk message to be received twice")
    await consumer.stop()
    for failure in failures:
        assert failure.phase is SqsDeliveryFailurePhase.PARSE
        assert failure.provider_message_id == sent["MessageId"]
        assert failure.queue_url == url
        assert failure.delivery_message is None
        assert isinstance(failure.cause, RunlaneError) and failure.cause.code is ErrorCode.VALIDATION_FAILED
    assert executed == []
    assert consumer.counts.deleted == 0
    assert await _depth(client, url) == 1


async def test_a_delivery_whose_execution_raises_is_not_deleted_and_reported_as_execute(sqs_server, consumers):
    client = sqs_server.client()
    url = sqs_server.create_queue(_queue_name(), VisibilityTimeout="1")
    async with _runtime(client, url) as runtime:
        run_id = (await runtime.trigger(echo, {"a": 1})).run.id
        outage = RunlaneError(ErrorCode.INTERNAL_ERROR, "Something broke.")
        failures: list[SqsDeliveryFailure] = []
        consumer = await _start(
            consumers,
            client=client,
            queue_url=url,
            execute_delivery=_failing_with(outage),
            on_delivery_failure=failures.append,
        )
        await _eventually(lambda: len(failures) >= 2, "the failed delivery to be received twice")
        await consumer.stop()
        for failure in failures:
            assert failure.phase is SqsDeliveryFailurePhase.EXECUTE
            assert failure.cause is outage
            assert failure.delivery_message is not None and failure.delivery_message.run_id == run_id
            assert failure.provider_message_id == failures[0].provider_message_id
        assert consumer.counts.deleted == 0
        assert await _depth(client, url) == 1

        # The wakeup is still there for a consumer that can deliver it.
        recovered = await _start(consumers, client=client, queue_url=url, execute_delivery=runtime.execute_delivery)
        await _eventually(lambda: recovered.counts.deleted == 1, "the recovered consumer to delete the message")
        assert await _status(runtime, run_id) is RunStatus.SUCCEEDED
        assert await _depth(client, url) == 0


async def test_a_consumer_holds_wakeups_it_cannot_deliver_for_storage_and_hands_them_back_when_stopped(
    sqs_server, consumers
):
    client = sqs_server.client()
    url = sqs_server.create_queue(_queue_name(), VisibilityTimeout="1")
    async with _runtime(client, url) as runtime:
        for n in range(2):
            await runtime.trigger(echo, {"n": n})
        outage = RunlaneError(ErrorCode.STORAGE_UNAVAILABLE, "The database is down.", retryable=True)
        calls: list[str] = []

        async def storage_down(message: DeliveryMessage, **options: Any) -> Any:
            calls.append(message.run_id)
            raise outage

        failures: list[SqsDeliveryFailure] = []
        consumer = await _start(
            consumers, client=client, queue_url=url, execute_delivery=storage_down, on_delivery_failure=failures.append
        )
        # Held, the messages are delivered again with backoff (0.5 s, then 1 s) and never received again,
        # although the queue's visibility timeout (1 s) has long passed.
        await _eventually(lambda: len(calls) >= 6, "three rounds of deliveries")
        assert consumer.counts.received == 2
        assert len(failures) == 2  # each held message is reported once
        assert await _depth(client, url) == 2
        await asyncio.wait_for(consumer.stop(), timeout=WAIT)
        # Stopping hands them back at once, for a consumer whose storage answers.
        recovered = await _start(consumers, client=client, queue_url=url, execute_delivery=runtime.execute_delivery)
        await _eventually(lambda: recovered.counts.deleted == 2, "the other consumer to run both")


async def test_a_fifo_consumer_delivers_the_messages_it_held_for_storage_in_order_once_storage_answers(
    sqs_server, consumers
):
    client = sqs_server.client()
    url = sqs_server.create_queue(_queue_name() + ".fifo", fifo=True)
    async with _runtime(client, url, fifo={"message_group": "queue"}) as runtime:
        run_ids = [(await runtime.trigger(echo, {"n": n})).run.id for n in range(4)]
        calls: list[str] = []
        outages = 2

        async def storage_back_later(message: DeliveryMessage, **options: Any) -> Any:
            nonlocal outages
            calls.append(message.run_id)
            if message.run_id == run_ids[1] and outages:
                outages -= 1
                raise RunlaneError(ErrorCode.STORAGE_UNAVAILABLE, "The database is down.", retryable=True)
            return await runtime.execute_delivery(message, **options)

        failures: list[SqsDeliveryFailure] = []
        consumer = await _start(
            consumers,
            client=client,
            queue_url=url,
            fifo=True,
            execute_delivery=storage_back_later,
            on_delivery_failure=failures.append,
        )
        await _eventually(lambda: consumer.counts.deleted == 4, "every message to be deleted")
        assert calls == [run_ids[0], run_ids[1], run_ids[1], run_ids[1], run_ids[2], run_ids[3]]
        assert consumer.counts.received == 4 and len(failures) == 1
        assert [await _status(runtime, run_id) for run_id in run_ids] == [RunStatus.SUCCEEDED] * 4


async def test_a_task_that_fails_still_has_its_message_deleted(sqs_server, consumers):
    client = sqs_server.client()
    url = sqs_server.create_queue(_queue_name())
    async with _runtime(client, url) as runtime:
        run_id = (await runtime.trigger(broken, {"a": 1})).run.id
        failures: list[SqsDeliveryFailure] = []
        consumer = await _start(
            consumers,
            client=client,
            queue_url=url,
            execute_delivery=runtime.execute_delivery,
            on_delivery_failure=failures.append,
        )
        await _eventually(lambda: consumer.counts.deleted == 1, "the failed run's message to be deleted")
        assert await _status(runtime, run_id) is RunStatus.FAILED
        assert failures == []
        assert await _depth(client, url) == 0


async def test_a_stale_wakeup_for_a_finished_run_is_ignored_and_deleted(sqs_server, consumers):
    client = sqs_server.client()
    url = sqs_server.create_queue(_queue_name())
    async with _runtime(client, url) as runtime:
        results = []

        async def recording(message: DeliveryMessage, **options: Any) -> Any:
            result = await runtime.execute_delivery(message, **options)
            results.append(result)
            return result

        run = (await runtime.trigger(echo, {"a": 1})).run
        consumer = await _start(consumers, client=client, queue_url=url, execute_delivery=recording)
        await _eventually(lambda: consumer.counts.deleted == 1, "the first wakeup to be handled")
        assert await _status(runtime, run.id) is RunStatus.SUCCEEDED

        again = DeliveryMessage(
            environment=run.environment, run_id=run.id, queue=run.queue, requested_at=run.created_at
        )
        await asyncio.to_thread(client.send_message, QueueUrl=url, MessageBody=encode_sqs_wakeup_body(again))
        await _eventually(lambda: consumer.counts.deleted == 2, "the stale wakeup to be deleted")
        assert [result.status for result in results] == [ExecuteDeliveryStatus.EXECUTED, ExecuteDeliveryStatus.IGNORED]
        assert results[1].reason is ExecuteDeliveryIgnoredReason.TERMINAL
        assert await _status(runtime, run.id) is RunStatus.SUCCEEDED
        assert await _depth(client, url) == 0


async def test_a_fifo_consumer_delivers_in_order_and_leaves_the_rest_of_the_batch_after_a_failure(
    sqs_server, consumers
):
    client = sqs_server.client()
    url = sqs_server.create_queue(_queue_name() + ".fifo", fifo=True)
    async with _runtime(client, url, fifo={"message_group": "queue"}) as runtime:
        run_ids = [(await runtime.trigger(echo, {"n": n})).run.id for n in range(5)]
        assert await _depth(client, url) == 5
        calls: list[str] = []
        stop = CancellationController()
        failures: list[SqsDeliveryFailure] = []
        received_at_failure: list[int] = []

        async def third_fails(message: DeliveryMessage, **options: Any) -> Any:
            calls.append(message.run_id)
            if message.run_id == run_ids[2]:
                raise RunlaneError(ErrorCode.INTERNAL_ERROR, "Something broke.")
            return await runtime.execute_delivery(message, **options)

        def observe(failure: SqsDeliveryFailure) -> None:
            failures.append(failure)
            received_at_failure.append(consumer.counts.received)
            stop.abort("seen the failure")  # the loop finishes this batch, then ends

        consumer = await _start(
            consumers,
            client=client,
            queue_url=url,
            fifo=True,
            execute_delivery=third_fails,
            signal=stop.signal,
            on_delivery_failure=observe,
        )
        await asyncio.wait_for(consumer.closed, timeout=WAIT)

        assert received_at_failure == [5]  # all five came in the one batch
        assert calls == run_ids[:3]  # in order, and nothing after the failure
        assert [failure.phase for failure in failures] == [SqsDeliveryFailurePhase.EXECUTE]
        assert [await _status(runtime, run_id) for run_id in run_ids] == [RunStatus.SUCCEEDED] * 2 + [
            RunStatus.QUEUED
        ] * 3
        assert consumer.counts.deleted == 2
        assert await _depth(client, url) == 3  # the failed message and the two after it


async def test_stopping_a_fifo_consumer_hands_the_rest_of_its_batch_back_in_order(sqs_server, consumers):
    client = sqs_server.client()
    url = sqs_server.create_queue(_queue_name() + ".fifo", fifo=True, VisibilityTimeout="300")
    async with _runtime(client, url, fifo={"message_group": "queue"}) as runtime:
        key = uuid.uuid4().hex
        _STARTED[key] = asyncio.Event()
        first = (await runtime.trigger(cooperative, {"started": key})).run.id
        rest = [(await runtime.trigger(echo, {"n": n})).run.id for n in range(2)]
        failures: list[SqsDeliveryFailure] = []
        consumer = await _start(
            consumers,
            client=client,
            queue_url=url,
            fifo=True,
            execute_delivery=runtime.execute_delivery,
            on_delivery_failure=failures.append,
        )
        await asyncio.wait_for(_STARTED[key].wait(), timeout=WAIT)
        await asyncio.wait_for(consumer.stop(), timeout=WAIT)
        del _STARTED[key]

        assert failures == []  # the rest were not run under the aborted signal
        assert await _status(runtime, first) is RunStatus.SUCCEEDED
        assert [await _status(runtime, run_id) for run_id in rest] == [RunStatus.QUEUED] * 2
        # Visible again at once (not after the 300 s visibility timeout), still in order.
        response = await asyncio.to_thread(
            client.receive_message, QueueUrl=url, MaxNumberOfMessages=10, WaitTimeSeconds=0
        )
        bodies = [parse_sqs_wakeup_body(message["Body"]).run_id for message in response.get("Messages", [])]
        assert bodies == rest


# ---------------------------------------------------------------------------------------------
# lifecycle


async def test_stop_during_a_long_poll_returns_without_waiting_for_the_poll(sqs_server, consumers):
    client = sqs_server.client()
    url = sqs_server.create_queue(_queue_name())
    consumer = await _start(
        consumers, client=client, queue_url=url, execute_delivery=_failing_with(AssertionError), wait_time_seconds=20
    )
    await asyncio.sleep(0.3)  # the 20-second receive is in flight
    assert consumer.running

    started = time.monotonic()
    await asyncio.wait_for(consumer.stop(), timeout=WAIT)
    assert time.monotonic() - started < 10
    assert await consumer.closed is None
    assert not consumer.running


async def test_a_wakeup_the_abandoned_long_poll_receives_is_handed_back_once_it_returns(sqs_server, consumers):
    # SQS hands a message that arrives during a long poll to that poll even after its consumer stopped;
    # waiting for the poll to return makes the message visible again at once, not after its timeout.
    client = sqs_server.client()
    url = sqs_server.create_queue(_queue_name(), VisibilityTimeout="60")
    consumer = await _start(
        consumers, client=client, queue_url=url, execute_delivery=_failing_with(AssertionError), wait_time_seconds=3
    )
    await asyncio.sleep(0.3)  # the receive is in flight
    await asyncio.wait_for(consumer.stop(), timeout=WAIT)
    assert not await consumer.wait_for_abandoned_receive(0)  # the poll is still out
    client.send_message(QueueUrl=url, MessageBody="wakeup sent after the stop")
    assert await consumer.wait_for_abandoned_receive(timeout=WAIT)
    names = ["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"]
    counts = client.get_queue_attributes(QueueUrl=url, AttributeNames=names)["Attributes"]
    assert (counts["ApproximateNumberOfMessages"], counts["ApproximateNumberOfMessagesNotVisible"]) == ("1", "0")


async def test_waiting_for_the_abandoned_receive_of_a_consumer_never_started_or_idle_returns_at_once(
    sqs_server, consumers
):
    client = sqs_server.client()
    url = sqs_server.create_queue(_queue_name())
    consumer = create_sqs_delivery_consumer(
        client=client, queue_url=url, execute_delivery=_failing_with(AssertionError), wait_time_seconds=0
    )
    assert await consumer.wait_for_abandoned_receive(0)
    consumers.append(consumer)
    await consumer.start()
    await asyncio.sleep(0.2)
    await consumer.stop()
    assert await asyncio.wait_for(consumer.wait_for_abandoned_receive(timeout=WAIT), WAIT)


async def test_start_twice_is_a_no_op_and_start_after_stop_is_refused(sqs_server, consumers):
    client = sqs_server.client()
    url = sqs_server.create_queue(_queue_name())
    consumer = create_sqs_delivery_consumer(
        client=client, queue_url=url, execute_delivery=_failing_with(AssertionError), wait_time_seconds=1
    )
    consumers.append(consumer)
    with pytest.raises(RunlaneError) as not_started:
        consumer.closed
    assert not_started.value.code is ErrorCode.CONFIGURATION_INVALID

    await consumer.start()
    loop = consumer.closed
    await consumer.start()
    assert consumer.closed is loop
    assert consumer.running

    await consumer.stop()
    with pytest.raises(RunlaneError) as restarted:
        await consumer.start()
    assert restarted.value.code is ErrorCode.CONFIGURATION_INVALID
    assert "create a new one" in restarted.value.message
    assert consumer.closed is loop and not consumer.running


async def test_a_receive_that_fails_as_a_whole_ends_the_loop_with_transport_unavailable():
    port = _unused_port()  # nothing listens there
    client = boto3.client(
        "sqs",
        endpoint_url=f"http://127.0.0.1:{port}",
        region_name=TEST_REGION,
        aws_access_key_id=TEST_CREDENTIALS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=TEST_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        config=Config(connect_timeout=2, read_timeout=5, retries={"max_attempts": 1}),
    )
    executed: list[DeliveryMessage] = []
    consumer = create_sqs_delivery_consumer(
        client=client,
        queue_url=f"http://127.0.0.1:{port}/123456789012/{_queue_name()}",
        execute_delivery=lambda message, **options: executed.append(message),
        wait_time_seconds=1,
    )
    await consumer.start()

    with pytest.raises(RunlaneError) as ended:
        await asyncio.wait_for(consumer.closed, timeout=WAIT)
    assert ended.value.code is ErrorCode.TRANSPORT_UNAVAILABLE
    assert ended.value.retryable is True
    assert ended.value.meta["operation"] == "ReceiveMessage"
    assert not consumer.running
    assert executed == []
    await consumer.stop()  # stopping a consumer that already ended is harmless


@pytest.mark.parametrize(
    ("status", "shape", "query_code"),
    [
        pytest.param(403, "OverLimit", "OverLimit", id="too-many-messages-in-flight"),
        pytest.param(400, "KmsThrottled", "KMS.ThrottlingException", id="kms-throttled"),
        pytest.param(403, "ExpiredTokenException", "ExpiredToken", id="expired-session-token"),
    ],
)
async def test_a_receive_sqs_holds_back_for_a_while_ends_the_loop_as_retryable(sqs_refusing, status, shape, query_code):
    # OverLimit: the queue holds the most in-flight messages SQS allows until some are deleted or come back;
    # a consumer started again later receives again, so `runlane sqs consume` must restart it, not exit. So
    # must an expired session token: the role's next one is valid.
    endpoint = sqs_refusing(status, shape, query_code)
    client = boto3.client(
        "sqs",
        endpoint_url=endpoint,
        region_name=TEST_REGION,
        aws_access_key_id=TEST_CREDENTIALS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=TEST_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        config=Config(retries={"total_max_attempts": 1}),
    )
    consumer = create_sqs_delivery_consumer(
        client=client,
        queue_url=f"{endpoint}/123456789012/{_queue_name()}",
        execute_delivery=_noop,
        wait_time_seconds=1,
    )
    await consumer.start()

    with pytest.raises(RunlaneError) as ended:
        await asyncio.wait_for(consumer.closed, timeout=WAIT)
    assert ended.value.code is ErrorCode.TRANSPORT_UNAVAILABLE and ended.value.retryable is True
    assert ended.value.meta["provider_code"] == query_code


async def test_an_on_delivery_failure_that_raises_ends_the_loop_with_that_error(sqs_server, consumers):
    client = sqs_server.client()
    url = sqs_server.create_queue(_queue_name())
    async with _runtime(client, url) as runtime:
        # One batch: a junk message, and a wakeup whose run is still executing when the junk fails.
        run_id = (await runtime.trigger(slow, {"seconds": 0.5})).run.id
        await asyncio.to_thread(client.send_message, QueueUrl=url, MessageBody="not json")

        class ObserverBroke(Exception):
            pass

        def observe(failure: SqsDeliveryFailure) -> None:
            raise ObserverBroke(failure.phase)

        consumer = await _start(
            consumers,
            client=client,
            queue_url=url,
            execute_delivery=runtime.execute_delivery,
            on_delivery_failure=observe,
        )
        with pytest.raises(ObserverBroke) as ended:
            await asyncio.wait_for(consumer.closed, timeout=WAIT)
        assert ended.value.args == (SqsDeliveryFailurePhase.PARSE,)
        assert not consumer.running
        assert consumer.counts.received == 2
        # The loop ended only once the other delivery of its batch had resolved, and acknowledged it.
        assert await _status(runtime, run_id) is RunStatus.SUCCEEDED
        assert consumer.counts.deleted == 1
        assert await _depth(client, url) == 1  # the junk message


@pytest.mark.parametrize("stopped_by", ["stop()", "the consumer signal", "the delivery_options signal"])
async def test_stopping_the_consumer_aborts_the_signal_the_task_sees(sqs_server, consumers, stopped_by):
    client = sqs_server.client()
    url = sqs_server.create_queue(_queue_name())
    async with _runtime(client, url) as runtime:
        run_id, key = await _trigger_watched(runtime, cooperative)
        controller = CancellationController()
        options: dict[str, Any] = {}
        if stopped_by == "the consumer signal":
            options["signal"] = controller.signal
        elif stopped_by == "the delivery_options signal":
            options["delivery_options"] = {"signal": controller.signal, "lease_duration": "1m"}
        consumer = await _start(
            consumers, client=client, queue_url=url, execute_delivery=runtime.execute_delivery, **options
        )
        await asyncio.wait_for(_STARTED[key].wait(), timeout=WAIT)
        assert await _status(runtime, run_id) is RunStatus.RUNNING

        if stopped_by == "stop()":
            await asyncio.wait_for(consumer.stop(), timeout=WAIT)
        else:
            controller.abort("shutting down")
            await asyncio.wait_for(consumer.closed, timeout=WAIT)
        # The handler returned once its signal aborted; its outcome is persisted and the message deleted.
        run = await runtime.runs.get(run_id)
        assert run.status is RunStatus.SUCCEEDED
        # Every stop says what a worker's stop says (``worker_stopped``, whatever reason the signal was
        # aborted with), so a handler checks one reason.
        assert run.output == "worker_stopped"
        assert not consumer.running
        assert consumer.counts.deleted == 1
        assert await _depth(client, url) == 0
        del _STARTED[key]


@pytest.mark.parametrize("stopped_by", ["stop()", "the consumer signal", "the delivery_options signal"])
async def test_a_run_handed_back_on_the_consumers_stop_keeps_its_wakeup_for_the_next_consumer(
    sqs_server, consumers, stopped_by
):
    """A rolling deploy: the handler stops with its consumer and the run is released (``worker_stopped``).
    Its wakeup is made visible again instead of deleted, so the next consumer runs it at once, without
    waiting for a ``tick()`` to publish a new one. A process's shutdown wired to the consumer's signal
    (with a reason of its own) is such a stop too, not a failure of the run."""
    client = sqs_server.client()
    url = sqs_server.create_queue(_queue_name())
    async with _runtime(client, url) as runtime:
        run_id, key = await _trigger_watched(runtime, handed_back)
        controller = CancellationController()
        options: dict[str, Any] = {}
        if stopped_by == "the consumer signal":
            options["signal"] = controller.signal
        elif stopped_by == "the delivery_options signal":
            options["delivery_options"] = {"signal": controller.signal}
        first = await _start(
            consumers, client=client, queue_url=url, execute_delivery=runtime.execute_delivery, **options
        )
        await asyncio.wait_for(_STARTED[key].wait(), timeout=WAIT)
        if stopped_by == "stop()":
            await asyncio.wait_for(first.stop(), timeout=WAIT)
        else:
            controller.abort("deploy")
            await asyncio.wait_for(first.closed, timeout=WAIT)
        stopped = await runtime.runs.get(run_id)
        assert stopped.status is RunStatus.RELEASED and stopped.counters.failures == 0
        assert (first.counts.delivered, first.counts.deleted) == (1, 0)
        assert await _depth(client, url) == 1  # the wakeup stays, visible again

        second = await _start(consumers, client=client, queue_url=url, execute_delivery=runtime.execute_delivery)
        await _eventually(lambda: second.counts.deleted == 1, "the next consumer to run the run")
        done = await runtime.runs.get(run_id)
        assert done.status is RunStatus.SUCCEEDED and done.output == "attempt 2"
        assert await _depth(client, url) == 0
        del _STARTED[key]


# ---------------------------------------------------------------------------------------------
# options


def _noop(message: DeliveryMessage, **options: Any) -> None:
    raise AssertionError("nothing may be delivered by a consumer that was refused")


@pytest.mark.parametrize(
    ("options", "field"),
    [
        pytest.param({"fifo": False, "fifo_queue": True}, "fifo", id="standard-consumer-on-a-fifo-queue"),
        pytest.param({"fifo": True}, "fifo", id="fifo-consumer-on-a-standard-queue"),
        pytest.param({"max_number_of_messages": 11}, "max_number_of_messages", id="eleven-messages"),
        pytest.param({"max_number_of_messages": 0}, "max_number_of_messages", id="zero-messages"),
        pytest.param({"wait_time_seconds": 21}, "wait_time_seconds", id="wait-21-seconds"),
        pytest.param({"visibility_timeout_seconds": 43201}, "visibility_timeout_seconds", id="visibility-over-12h"),
        pytest.param({"delivery_options": {"lease": "1m"}}, "delivery_options", id="unknown-delivery-option"),
        pytest.param({"delivery_options": {"lease_duration": "bogus"}}, "lease_duration", id="bad-lease-duration"),
        pytest.param(
            {"delivery_options": {"lease_duration": "1m", "heartbeat_interval": "2m"}},
            "heartbeat_interval",
            id="heartbeat-longer-than-the-lease",
        ),
        pytest.param({"delivery_options": {"worker_id": "a:b"}}, "worker id", id="bad-worker-id"),
        pytest.param({"execute_delivery": "runtime.execute_delivery"}, "execute_delivery", id="not-callable"),
        pytest.param({"on_delivery_failure": 42}, "on_delivery_failure", id="observer-not-callable"),
        pytest.param({"queue_url": "sqs://queue"}, "queue_url", id="not-an-http-url"),
    ],
)
async def test_invalid_consumer_options_are_refused_when_the_consumer_is_created(sqs_server, options, field):
    client = sqs_server.client()
    options = dict(options)
    name = _queue_name() + (".fifo" if options.pop("fifo_queue", False) else "")
    url = sqs_server.create_queue(name, fifo=name.endswith(".fifo"))
    arguments = {"client": client, "queue_url": url, "execute_delivery": _noop, **options}

    with pytest.raises(RunlaneError) as refused:
        create_sqs_delivery_consumer(**arguments)
    assert refused.value.code is ErrorCode.CONFIGURATION_INVALID
    assert refused.value.meta.get("field") == field


async def test_a_run_whose_trace_carrier_is_as_long_as_a_trigger_allows_is_executed(sqs_server, consumers):
    # Control characters are written as \u escapes of six characters each: the largest carrier trigger()
    # accepts makes a wakeup body many times its size, which a consumer must still take as a wakeup.
    import itertools

    from runlane.core.runtime import MAX_TRACE_CARRIER_BYTES

    controls = [chr(code) for code in range(1, 32)]
    keys = ("".join(letters) for letters in itertools.product(controls, repeat=3))
    carrier = {key: "" for key in itertools.islice(keys, MAX_TRACE_CARRIER_BYTES // 3)}
    client = sqs_server.client()
    url = sqs_server.create_queue(_queue_name())
    async with _runtime(client, url) as runtime:
        run_id = (await runtime.trigger(echo, {"a": 1}, trace_carrier=carrier)).run.id
        failures: list[SqsDeliveryFailure] = []
        consumer = await _start(
            consumers, client=client, queue_url=url, execute_delivery=runtime.execute_delivery,
            on_delivery_failure=failures.append,
        )  # fmt: skip
        await _eventually(lambda: consumer.counts.deleted == 1 or failures, "the wakeup to be handled")
        assert failures == []
        assert await _status(runtime, run_id) is RunStatus.SUCCEEDED
