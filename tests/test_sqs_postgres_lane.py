"""``postgres_sqs_lane()`` against a real PostgreSQL server and a real SQS-compatible server (moto).

Every test works in a freshly migrated schema and on SQS queues with unique names, so tests never see
each other's runs or messages. Waits are bounded by deadlines.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from runlane import ErrorCode, Retry, RunlaneError, RunStatus, TaskContext, create_runlane, queue, task
from runlane.testing import LaneCompositionConformance
from runlane.testing.clock import ControlledClock
from runlane.vocabulary import ExecuteDeliveryStatus, LaneDeliveryMode, OutboxMessageStatus
from runlane_sqs import (
    SqsQueueBinding,
    create_sqs_delivery_consumer,
    parse_sqs_wakeup_body,
    postgres_sqs_lane,
    sqs_queue,
)
from runlane_sqs.testing import SqsTestServer

DEFAULT = queue("default", default=True)
BOUNDED = queue("b", concurrency_limit=1)


@task("sqs.echo", queue=DEFAULT)
async def echo(payload: dict) -> dict:
    return {"echo": payload.get("value")}


@task("sqs.bounded", queue=BOUNDED)
async def bounded(payload: dict) -> dict:
    return {"bounded": True}


@pytest.fixture
def schema(postgres_url: str) -> str:
    from postgres_support import migrated_schema

    return migrated_schema(postgres_url, "sqs_lane")


def unique_queue_name(prefix: str = "runlane") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


def lane_for(url: str, schema: str, client: Any, bindings: list[SqsQueueBinding], **options: Any) -> Any:
    return postgres_sqs_lane(
        postgres={"connection_string": url, "schema": schema}, sqs={"client": client, "queues": bindings}, **options
    )


def visible_messages(client: Any, queue_url: str) -> int:
    attributes = client.get_queue_attributes(QueueUrl=queue_url, AttributeNames=["ApproximateNumberOfMessages"])
    return int(attributes["Attributes"]["ApproximateNumberOfMessages"])


def in_flight_messages(client: Any, queue_url: str) -> int:
    attributes = client.get_queue_attributes(
        QueueUrl=queue_url, AttributeNames=["ApproximateNumberOfMessagesNotVisible"]
    )
    return int(attributes["Attributes"]["ApproximateNumberOfMessagesNotVisible"])


def peek_bodies(client: Any, queue_url: str) -> list[str]:
    """The bodies of the visible messages, left visible (a zero visibility timeout)."""
    response = client.receive_message(
        QueueUrl=queue_url, MaxNumberOfMessages=10, WaitTimeSeconds=0, VisibilityTimeout=0
    )
    return [message["Body"] for message in response.get("Messages", [])]


async def eventually(check: Callable[[], bool], *, timeout: float = 20.0, what: str) -> None:
    """Yield to the event loop until ``check()`` holds, failing after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.05)


# -- construction ---------------------------------------------------------------------------------


def test_the_lane_reports_its_name_durability_and_sqs_capabilities(postgres_url: str, sqs_server: Any) -> None:
    client = sqs_server.client()
    standard = sqs_queue(DEFAULT, queue_url=sqs_server.create_queue(unique_queue_name()))
    lane = lane_for(postgres_url, "public", client, [standard])
    assert lane.name == "postgres-sqs"
    assert lane.capabilities.production_durable is True
    assert lane.capabilities.operator_reads is True
    assert lane.delivery.mode is LaneDeliveryMode.TRANSPORT
    capabilities = lane.delivery.transport.capabilities
    assert capabilities.durable_delivery is True and capabilities.native_delay is False
    assert capabilities.message_grouping is False and capabilities.ordered_delivery is False

    fifo_url = sqs_server.create_queue(unique_queue_name() + ".fifo", fifo=True)
    fifo_lane = lane_for(postgres_url, "public", client, [sqs_queue(DEFAULT, queue_url=fifo_url, fifo=True)])
    fifo_capabilities = fifo_lane.delivery.transport.capabilities
    assert fifo_capabilities.message_grouping is True and fifo_capabilities.ordered_delivery is True

    mixed = lane_for(
        postgres_url,
        "public",
        client,
        [standard, sqs_queue(BOUNDED, queue_url=fifo_url, fifo=True)],
        name="orders-production",
    )
    assert mixed.name == "orders-production"
    assert mixed.delivery.transport.capabilities.message_grouping is False


def test_unknown_nested_options_and_missing_sqs_keys_are_configuration_errors_naming_the_key(
    postgres_url: str, sqs_server: Any
) -> None:
    client = sqs_server.client()
    binding = sqs_queue(DEFAULT, queue_url=sqs_server.create_queue(unique_queue_name()))
    sqs = {"client": client, "queues": [binding]}

    with pytest.raises(RunlaneError) as unknown_postgres:
        postgres_sqs_lane(postgres={"connection_string": postgres_url, "nope": 1}, sqs=sqs)
    assert unknown_postgres.value.code is ErrorCode.CONFIGURATION_INVALID
    assert "'nope'" in unknown_postgres.value.message

    with pytest.raises(RunlaneError) as unknown_sqs:
        postgres_sqs_lane(postgres={"connection_string": postgres_url}, sqs={**sqs, "region": "us-east-1"})
    assert unknown_sqs.value.code is ErrorCode.CONFIGURATION_INVALID
    assert "'region'" in unknown_sqs.value.message

    for missing in ("client", "queues"):
        options = {key: value for key, value in sqs.items() if key != missing}
        with pytest.raises(RunlaneError) as error:
            postgres_sqs_lane(postgres={"connection_string": postgres_url}, sqs=options)
        assert error.value.code is ErrorCode.CONFIGURATION_INVALID
        assert repr(missing) in error.value.message, error.value.message

    with pytest.raises(RunlaneError) as no_connection_string:
        postgres_sqs_lane(postgres={"schema": "runlane"}, sqs=sqs)
    assert no_connection_string.value.code is ErrorCode.CONFIGURATION_INVALID
    assert "'connection_string'" in no_connection_string.value.message


def test_create_runlane_requires_the_transport_to_bind_exactly_the_registered_queues(
    postgres_url: str, sqs_server: Any
) -> None:
    client = sqs_server.client()
    default_binding = sqs_queue(DEFAULT, queue_url=sqs_server.create_queue(unique_queue_name()))

    missing = lane_for(postgres_url, "public", client, [default_binding])
    with pytest.raises(RunlaneError) as unbound:
        create_runlane(lane=missing, queues=[DEFAULT, BOUNDED], tasks=[echo, bounded])
    assert unbound.value.code is ErrorCode.CONFIGURATION_INVALID
    assert "'b'" in unbound.value.message, unbound.value.message

    extra = sqs_queue("emails", queue_url=sqs_server.create_queue(unique_queue_name()))
    too_many = lane_for(postgres_url, "public", client, [default_binding, extra])
    with pytest.raises(RunlaneError) as unregistered:
        create_runlane(lane=too_many, queues=[DEFAULT], tasks=[echo])
    assert unregistered.value.code is ErrorCode.CONFIGURATION_INVALID
    assert "'emails'" in unregistered.value.message, unregistered.value.message


# -- publishing and consuming ---------------------------------------------------------------------


def two_queue_runtime(postgres_url: str, schema: str, sqs_server: Any, **options: Any) -> tuple[Any, Any, str, str]:
    """A runtime over the default and the bounded queue, each bound to a new SQS queue: (runtime, client,
    default queue URL, bounded queue URL)."""
    client = sqs_server.client()
    default_url = sqs_server.create_queue(unique_queue_name())
    bounded_url = sqs_server.create_queue(unique_queue_name())
    lane = lane_for(
        postgres_url,
        schema,
        client,
        [sqs_queue(DEFAULT, queue_url=default_url), sqs_queue(BOUNDED, queue_url=bounded_url)],
    )
    runtime = create_runlane(lane=lane, queues=[DEFAULT, BOUNDED], tasks=[echo, bounded], **options)
    return runtime, client, default_url, bounded_url


async def test_a_trigger_publishes_one_wakeup_that_a_consumer_executes_and_deletes(
    postgres_url: str, schema: str, sqs_server: Any
) -> None:
    runtime, client, default_url, bounded_url = two_queue_runtime(postgres_url, schema, sqs_server)
    async with runtime:
        triggered = await runtime.trigger(echo, {"value": 7}, idempotency_key="once")
        run = triggered.run
        assert run.status is RunStatus.QUEUED
        assert visible_messages(client, default_url) == 1 and visible_messages(client, bounded_url) == 0
        (body,) = peek_bodies(client, default_url)
        message = parse_sqs_wakeup_body(body)
        assert message.run_id == run.id and message.queue == "default"
        (row,) = await runtime.store.list_run_outbox(run.id)
        assert row.status is OutboxMessageStatus.PUBLISHED and row.provider_message_id

        # The idempotency owner is returned; no second wakeup is published for it.
        duplicate = await runtime.trigger(echo, {"value": 7}, idempotency_key="once")
        assert duplicate.run.id == run.id
        assert visible_messages(client, default_url) == 1
        assert len(await runtime.store.list_run_outbox(run.id)) == 1

        delivered: list[Any] = []

        async def execute(delivery: Any, **options: Any) -> Any:
            result = await runtime.execute_delivery(delivery, **options)
            delivered.append(result)
            return result

        consumer = create_sqs_delivery_consumer(
            client=client, queue_url=default_url, execute_delivery=execute, wait_time_seconds=1
        )
        await consumer.start()
        try:
            await eventually(lambda: consumer.counts.deleted >= 1, what="the message's deletion")
        finally:
            await consumer.stop()
        await consumer.closed
        assert [result.status for result in delivered] == [ExecuteDeliveryStatus.EXECUTED]
        finished = await runtime.runs.get(run.id)
        assert finished is not None and finished.status is RunStatus.SUCCEEDED
        assert finished.output == {"echo": 7}
        assert consumer.counts.received == 1 and consumer.counts.failed == 0
        assert visible_messages(client, default_url) == 0 and in_flight_messages(client, default_url) == 0


async def test_a_bounded_queue_publishes_nothing_on_trigger_and_tick_publishes_its_wakeup(
    postgres_url: str, schema: str, sqs_server: Any
) -> None:
    # A frozen clock: the pass that reserves capacity sees the row it wrote as due (see the next test).
    clock = ControlledClock(datetime.now(UTC))
    runtime, client, default_url, bounded_url = two_queue_runtime(postgres_url, schema, sqs_server, clock=clock)
    async with runtime:
        run = (await runtime.trigger(bounded, {})).run
        assert run.queue == "b" and run.status is RunStatus.QUEUED
        assert await runtime.store.list_run_outbox(run.id) == []
        assert visible_messages(client, bounded_url) == 0

        result = await runtime.tick()
        assert result.dispatch_reserved == 1 and result.outbox_published == 1
        assert visible_messages(client, bounded_url) == 1 and visible_messages(client, default_url) == 0
        (body,) = peek_bodies(client, bounded_url)
        message = parse_sqs_wakeup_body(body)
        assert message.run_id == run.id and message.queue == "b"

        # Nothing is left for the next pass: the capacity is taken and the row was published once.
        again = await runtime.tick()
        assert again.outbox_published == 0 and again.dispatch_reserved == 0
        assert visible_messages(client, bounded_url) == 1


async def test_the_tick_that_reserves_a_bounded_run_publishes_its_wakeup_under_a_running_clock(
    postgres_url: str, schema: str, sqs_server: Any
) -> None:
    runtime, client, _, bounded_url = two_queue_runtime(postgres_url, schema, sqs_server)
    async with runtime:
        await runtime.trigger(bounded, {})
        result = await runtime.tick()
        assert result.dispatch_reserved == 1
        assert result.outbox_published == 1 and visible_messages(client, bounded_url) == 1


async def test_a_trigger_while_sqs_is_down_keeps_the_run_and_tick_publishes_it_once_sqs_is_back(
    postgres_url: str, schema: str
) -> None:
    server = SqsTestServer()
    server.start()
    try:
        name = unique_queue_name()
        queue_url = server.create_queue(name)
        client = server.client()
        clock = ControlledClock(datetime.now(UTC))
        lane = lane_for(postgres_url, schema, client, [sqs_queue(DEFAULT, queue_url=queue_url)])
        runtime = create_runlane(lane=lane, queues=[DEFAULT], tasks=[echo], clock=clock)
        async with runtime:
            server.stop()
            run = (await runtime.trigger(echo, {"value": 1})).run
            assert run.status is RunStatus.QUEUED
            assert (await runtime.runs.get(run.id)) is not None
            (row,) = await runtime.store.list_run_outbox(run.id)
            assert row.status is OutboxMessageStatus.FAILED and row.attempts == 1
            assert row.last_failure is not None and row.last_failure.code is ErrorCode.TRANSPORT_UNAVAILABLE
            assert row.last_failure.retryable is True and row.available_at > clock.now()

            server.start()  # the same port; moto keeps queues in memory, so the queue is created again
            assert server.create_queue(name) == queue_url
            early = await runtime.tick()
            assert early.outbox_published == 0 and early.outbox_failed == 0  # still inside the retry delay
            assert visible_messages(client, queue_url) == 0

            clock.advance(timedelta(seconds=2))
            result = await runtime.tick()
            assert result.outbox_published == 1 and result.outbox_failed == 0
            assert visible_messages(client, queue_url) == 1
            (body,) = peek_bodies(client, queue_url)
            assert parse_sqs_wakeup_body(body).run_id == run.id
            (row,) = await runtime.store.list_run_outbox(run.id)
            assert row.status is OutboxMessageStatus.PUBLISHED and row.attempts == 2
    finally:
        server.stop()


async def test_a_consumer_holds_its_wakeups_while_the_database_is_down_and_runs_them_once_it_is_back(
    sqs_server: Any,
) -> None:
    """A wakeup whose delivery fails because the database is down is held (kept invisible) and delivered
    again once the database answers: the consumer receives nothing meanwhile, so an outage longer than
    the visibility timeout does not send the wakeups round the queue towards its dead-letter queue."""
    from postgres_support import restartable_postgres_server

    server, schema = await asyncio.to_thread(restartable_postgres_server, "sqs_outage")  # it runs a migration
    client = sqs_server.client()
    queue_url = sqs_server.create_queue(unique_queue_name(), VisibilityTimeout="1")
    lane = lane_for(server.url, schema, client, [sqs_queue(DEFAULT, queue_url=queue_url)])
    runtime = create_runlane(lane=lane, queues=[DEFAULT], tasks=[echo])
    failures: list[Any] = []
    async with runtime:
        run_ids = [(await runtime.trigger(echo, {"value": value})).run.id for value in range(3)]
        consumer = create_sqs_delivery_consumer(
            client=client,
            queue_url=queue_url,
            execute_delivery=runtime.execute_delivery,
            wait_time_seconds=1,
            on_delivery_failure=failures.append,
        )
        server.stop_server()
        try:
            try:
                await consumer.start()
                await eventually(lambda: len(failures) == 3, what="the three deliveries to fail")
                await asyncio.sleep(2.5)  # past the queue's visibility timeout of 1 s, twice
                assert consumer.counts.received == 3 and len(failures) == 3  # reported once, not received again
                assert {failure.cause.code for failure in failures} == {ErrorCode.STORAGE_UNAVAILABLE}
                assert in_flight_messages(client, queue_url) == 3 and visible_messages(client, queue_url) == 0
            finally:
                server.start_server()

            async def statuses() -> set[RunStatus | None]:
                try:
                    return {getattr(await runtime.runs.get(run_id), "status", None) for run_id in run_ids}
                except RunlaneError:
                    return set()  # the pool is still reconnecting

            deadline = time.monotonic() + 20.0
            while await statuses() != {RunStatus.SUCCEEDED}:
                assert time.monotonic() < deadline, "the held wakeups were not delivered once the database was back"
                await asyncio.sleep(0.1)
            await eventually(lambda: consumer.counts.deleted == 3, what="the held messages' deletion")
            assert consumer.counts.received == 3 and len(failures) == 3
        finally:
            await asyncio.wait_for(consumer.stop(), timeout=20.0)


@task("sqs.parent", queue=DEFAULT)
async def parent(payload: dict, ctx: TaskContext) -> Any:
    if ctx.attempt == 1:
        return ctx.wait_for_signal("sqs.approved")
    if ctx.attempt == 2:
        spawned = await ctx.trigger(echo, {"value": "child"})
        return ctx.wait_for_run(spawned.run.id)
    return "parent-done"


@task("sqs.later", queue=DEFAULT, retry=Retry(2, backoff="1ms"))
async def later(payload: dict, ctx: TaskContext) -> Any:
    if ctx.attempt == 1:
        if payload["how"] == "release":
            return ctx.release("1ms")
        if payload["how"] == "wait":
            return ctx.wait_for_signal("sqs.never", timeout="1ms")
        raise RuntimeError("the first attempt fails")
    return payload["how"]


def take_wakeups(client: Any, queue_url: str) -> list[Any]:
    """Receive and delete every visible message of ``queue_url``; their wakeups, in no particular order."""
    wakeups = []
    while True:
        response = client.receive_message(QueueUrl=queue_url, MaxNumberOfMessages=10, WaitTimeSeconds=0)
        messages = response.get("Messages", [])
        if not messages:
            return wakeups
        for message in messages:
            wakeups.append(parse_sqs_wakeup_body(message["Body"]))
            client.delete_message(QueueUrl=queue_url, ReceiptHandle=message["ReceiptHandle"])


async def test_a_signal_and_a_finished_run_publish_their_waiters_wakeups_once_at_once(
    postgres_url: str, schema: str, sqs_server: Any
) -> None:
    client = sqs_server.client()
    url = sqs_server.create_queue(unique_queue_name())
    lane = lane_for(postgres_url, schema, client, [sqs_queue(DEFAULT, queue_url=url)])
    async with create_runlane(lane=lane, queues=[DEFAULT], tasks=[parent, echo]) as runtime:
        run = (await runtime.trigger(parent, {})).run
        (wakeup,) = take_wakeups(client, url)
        assert (await runtime.execute_delivery(wakeup)).run.status is RunStatus.RELEASED
        assert take_wakeups(client, url) == []

        assert [resumed.id for resumed in await runtime.signals.send("sqs.approved")] == [run.id]
        (wakeup,) = take_wakeups(client, url)
        assert wakeup.run_id == run.id
        assert (await runtime.execute_delivery(wakeup)).run.status is RunStatus.RELEASED  # waits for its child
        (child_wakeup,) = take_wakeups(client, url)
        assert (await runtime.execute_delivery(child_wakeup)).run.status is RunStatus.SUCCEEDED

        (wakeup,) = take_wakeups(client, url)  # the child's end resumed its parent
        assert wakeup.run_id == run.id
        finished = (await runtime.execute_delivery(wakeup)).run
        assert finished.status is RunStatus.SUCCEEDED and finished.output == "parent-done"
        result = await runtime.tick()
        assert result.outbox_published == 0 and result.delivery_requested == 0
        assert take_wakeups(client, url) == []
        rows = await runtime.store.list_run_outbox(run.id)
        assert [row.status for row in rows] == [OutboxMessageStatus.PUBLISHED] * 3


@pytest.mark.parametrize("how", ["release", "wait", "retry"])
async def test_a_due_release_wait_timeout_or_retry_gets_one_wakeup_from_tick(
    postgres_url: str, schema: str, sqs_server: Any, how: str
) -> None:
    client = sqs_server.client()
    url = sqs_server.create_queue(unique_queue_name())
    lane = lane_for(postgres_url, schema, client, [sqs_queue(DEFAULT, queue_url=url)])
    async with create_runlane(lane=lane, queues=[DEFAULT], tasks=[later]) as runtime:
        run = (await runtime.trigger(later, {"how": how})).run
        (wakeup,) = take_wakeups(client, url)
        waiting = (await runtime.execute_delivery(wakeup)).run
        assert waiting.status is (RunStatus.RETRYING if how == "retry" else RunStatus.RELEASED)
        assert take_wakeups(client, url) == []  # not due when it was recorded: tick() wakes it
        deadline = time.monotonic() + 20.0
        while (result := await runtime.tick()).delivery_requested == 0:
            assert time.monotonic() < deadline, "tick() never found the run due"
            await asyncio.sleep(0.005)
        assert result.outbox_published == 1
        (wakeup,) = take_wakeups(client, url)
        assert wakeup.run_id == run.id
        finished = (await runtime.execute_delivery(wakeup)).run
        assert finished.status is RunStatus.SUCCEEDED and finished.output == how
        assert (await runtime.tick()).outbox_published == 0 and take_wakeups(client, url) == []


async def test_a_consumer_without_the_task_fails_its_run_task_not_found_and_deletes_the_wakeup(
    postgres_url: str, schema: str, sqs_server: Any
) -> None:
    """A rolling deploy: a consumer of an older release meets a run of a task it does not register."""
    client = sqs_server.client()
    url = sqs_server.create_queue(unique_queue_name(), VisibilityTimeout="1")
    bindings = [sqs_queue(DEFAULT, queue_url=url)]
    producer = create_runlane(lane=lane_for(postgres_url, schema, client, bindings), queues=[DEFAULT], tasks=[later])
    older = create_runlane(lane=lane_for(postgres_url, schema, client, bindings), queues=[DEFAULT], tasks=[echo])
    async with producer, older:
        run = (await producer.trigger(later, {"how": "new"})).run
        failures: list[Any] = []
        consumer = create_sqs_delivery_consumer(
            client=client,
            queue_url=url,
            execute_delivery=older.execute_delivery,
            wait_time_seconds=1,
            on_delivery_failure=failures.append,
        )
        await consumer.start()
        try:
            await eventually(lambda: consumer.counts.deleted >= 1, what="the wakeup's deletion")
        finally:
            await consumer.stop()
        await consumer.closed
        failed = await producer.runs.get(run.id)
        assert failed is not None and failed.status is RunStatus.FAILED
        assert failed.failure is not None and failed.failure.code is ErrorCode.TASK_NOT_FOUND
        assert failures == [] and consumer.counts.received == 1
        assert visible_messages(client, url) == 0 and in_flight_messages(client, url) == 0


class TestPostgresSqsLaneComposition(LaneCompositionConformance):
    """The lane composition contract over a real PostgreSQL schema and a real SQS queue: the wakeup
    tick() publishes must arrive on the queue."""

    @pytest.fixture
    def lane(self, postgres_url: str, sqs_server: SqsTestServer) -> Any:
        from postgres_support import migrated_schema

        client = sqs_server.client()
        queue_url = sqs_server.create_queue(unique_queue_name("lane-conformance"))
        self.received = (client, queue_url)
        return lane_for(
            postgres_url,
            migrated_schema(postgres_url, "sqs_lane_conformance"),
            client,
            [sqs_queue(self.queue_name, queue_url=queue_url)],
        )

    def test_a_triggered_run_is_woken_by_the_lane_delivery_mode_and_executes(self, lane: Any) -> None:
        super().test_a_triggered_run_is_woken_by_the_lane_delivery_mode_and_executes(lane)
        client, queue_url = self.received
        (body,) = peek_bodies(client, queue_url)
        assert parse_sqs_wakeup_body(body).queue == self.queue_name
