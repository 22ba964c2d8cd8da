"""Outbox publishing on transport lanes: eager and deferred trigger dispatch, tick flushes, failures."""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import pytest

from runlane import (
    ErrorCode,
    Retry,
    RunlaneError,
    RunStatus,
    StorageConflictKind,
    TaskContext,
    TriggerDispatchMode,
    create_lane,
    create_runlane,
    get_storage_conflict_kind,
    queue,
    schedule,
    task,
)
from runlane.core.lanes import LaneDelivery
from runlane.core.store import OutboxMark, _run_key
from runlane.storage.tables import decode_run_document
from runlane.testing import ControlledClock, RecordingTransport
from runlane.vocabulary import ExecuteDeliveryIgnoredReason, LaneDeliveryMode, OutboxMessageStatus
from runlane_local import LocalStorageStore, local_storage_driver

from runtime_support import DEFAULT_QUEUE, make_runtime

LIMITED = queue("limited", concurrency_limit=1)


@task("outbox.work")
async def work(payload: dict) -> None:
    return None


@task("outbox.limited", queue=LIMITED)
async def limited_work(payload: dict) -> None:
    return None


@task("outbox.wait")
async def wait_work(payload: dict, ctx: TaskContext):
    if ctx.attempt == 1:
        return ctx.wait_for_signal("outbox-go")
    return None


def transport_runtime(transport_type=RecordingTransport, tasks=(work, limited_work, wait_work), **options):
    clock = ControlledClock()
    transport = transport_type(clock=clock)
    lane = create_lane(
        storage=local_storage_driver(clock=clock),
        delivery=LaneDelivery(mode=LaneDeliveryMode.TRANSPORT, transport=transport),
    )
    runtime = create_runlane(lane=lane, queues=[DEFAULT_QUEUE, LIMITED], tasks=list(tasks), clock=clock, **options)
    return runtime, transport, clock


async def outbox_count(runtime, run_id: str) -> int:
    (record,) = await runtime.store.driver.get([_run_key(runtime.store.env_key, run_id)])
    return decode_run_document(record.document)[1].outbox


async def test_eager_trigger_publishes_the_rows_it_created():
    runtime, transport, clock = transport_runtime()
    async with runtime:
        run = (await runtime.trigger(work, {})).run
        assert [message.run_id for message in transport.published] == [run.id]
        assert transport.published[0].queue == "default"
        (row,) = await runtime.store.list_run_outbox(run.id)
        assert row.status is OutboxMessageStatus.PUBLISHED and row.attempts == 1 and row.claim is None
        assert row.provider_message_id is not None and row.published_at == clock.now()
        assert await outbox_count(runtime, run.id) == 1
        assert (await runtime.store.get_run(run.id)).status is RunStatus.QUEUED
        result = await runtime.tick()
        assert (result.outbox_published, result.outbox_failed, result.outbox_dead_lettered) == (0, 0, 0)
        assert len(transport.published) == 1


async def test_a_delayed_trigger_publishes_its_wakeup_when_the_run_is_due_not_before():
    """An eager trigger publishes at once only what a consumer can run now: a wakeup sent early would be
    ignored as not due and acknowledged, and the run would wait for nothing."""
    runtime, transport, clock = transport_runtime()
    async with runtime:
        run = (await runtime.trigger(work, {}, delay="10m")).run
        assert run.status is RunStatus.QUEUED and run.run_at == clock.now() + timedelta(minutes=10)
        assert transport.published == []
        assert await runtime.store.list_run_outbox(run.id) == []
        assert (await runtime.tick()).outbox_published == 0
        clock.advance("10m")
        assert (await runtime.tick()).outbox_published == 1
        (message,) = transport.published
        result = await runtime.execute_delivery(message)
        assert result.run.status is RunStatus.SUCCEEDED


async def test_deferred_trigger_leaves_publishing_to_tick():
    runtime, transport, _ = transport_runtime(dispatch=TriggerDispatchMode.DEFERRED)
    async with runtime:
        first = (await runtime.trigger(work, {"n": 1})).run
        second = (await runtime.trigger(work, {"n": 2})).run
        assert transport.published == []
        (row,) = await runtime.store.list_run_outbox(first.id)
        assert row.status is OutboxMessageStatus.PENDING
        assert (await runtime.tick(outbox_claim_limit=1)).outbox_published == 1
        assert (await runtime.tick()).outbox_published == 1
        assert {message.run_id for message in transport.published} == {first.id, second.id}
        assert (await runtime.tick()).outbox_published == 0


async def test_the_tick_that_materializes_scheduled_runs_publishes_and_counts_their_wakeups():
    @task("outbox.scheduled", schedule=[schedule("outbox.every", every="1m"), schedule("outbox.other", every="1m")])
    async def scheduled() -> None:
        return None

    runtime, transport, _ = transport_runtime(tasks=[scheduled])  # eager dispatch
    async with runtime:
        result = await runtime.tick()
        assert (result.materialized, result.outbox_published) == (2, 2)
        assert len(transport.published) == 2
        assert (await runtime.tick()).outbox_published == 0


async def test_every_wakeup_of_a_run_carries_the_trace_it_was_triggered_with():
    # The first delivery request and the ones after it (a signal resume, a recovered delivery) all
    # carry the trigger's traceparent, so a consumer's attempt joins the trace however it was woken.
    runtime, transport, clock = transport_runtime()
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    async with runtime:
        run = (await runtime.trigger(wait_work, {}, trace_carrier={"traceparent": traceparent})).run
        assert (await runtime.execute_next()).status is RunStatus.RELEASED
        await runtime.signals.send("outbox-go")  # resumes it: a second wakeup
        await runtime.tick()
        assert [message.run_id for message in transport.published] == [run.id, run.id]
        assert [message.trace_carrier for message in transport.published] == [{"traceparent": traceparent}] * 2
        untraced = (await runtime.trigger(work, {})).run
        assert transport.published[-1].run_id == untraced.id and transport.published[-1].trace_carrier is None


@task("outbox.limited_wait", queue=LIMITED)
async def limited_wait(payload: dict, ctx: TaskContext):
    if payload.get("wait") and ctx.attempt == 1:
        return ctx.wait_for_signal("limited-go")
    return None


async def test_a_run_resumed_on_a_full_bounded_queue_is_woken_once_through_a_reservation():
    # A resume on a bounded queue leaves the run to the capacity-reserving dispatch: a wakeup published at
    # once would find the queue full (acknowledged as claim_lost), and dispatch would publish a second one.
    runtime, transport, clock = transport_runtime(tasks=(limited_wait,))
    async with runtime:
        waiting = (await runtime.trigger(limited_wait, {"wait": True})).run
        assert (await runtime.tick()).dispatch_reserved == 1
        assert (await runtime.execute_delivery(transport.published[-1])).run.status is RunStatus.RELEASED
        blocker = (await runtime.trigger(limited_wait, {})).run
        assert (await runtime.tick()).dispatch_reserved == 1  # the blocker holds the only slot
        before = len(transport.published)
        assert [run.id for run in await runtime.signals.send("limited-go")] == [waiting.id]
        assert len(transport.published) == before  # no wakeup without a slot
        assert (await runtime.tick()).dispatch_reserved == 0
        assert (await runtime.execute_delivery(transport.published[-1])).run.id == blocker.id
        result = await runtime.tick()
        assert (result.dispatch_reserved, result.outbox_published) == (1, 1)
        assert [message.run_id for message in transport.published[before:]] == [waiting.id]
        assert (await runtime.execute_delivery(transport.published[-1])).run.status is RunStatus.SUCCEEDED
        assert await outbox_count(runtime, waiting.id) == 2  # its trigger's reservation and its resume's


async def test_retryable_failure_is_retried_after_a_delay():
    runtime, transport, clock = transport_runtime()
    async with runtime:
        transport.fail_next(1)
        run = (await runtime.trigger(work, {})).run
        assert (await runtime.store.get_run(run.id)).status is RunStatus.QUEUED
        (row,) = await runtime.store.list_run_outbox(run.id)
        assert row.status is OutboxMessageStatus.FAILED and row.attempts == 1
        assert row.last_failure.code is ErrorCode.TRANSPORT_PUBLISH_FAILED and row.available_at > clock.now()
        assert (await runtime.tick()).outbox_published == 0  # not due yet
        clock.advance(timedelta(seconds=2))
        assert (await runtime.tick()).outbox_published == 1
        (row,) = await runtime.store.list_run_outbox(run.id)
        assert row.status is OutboxMessageStatus.PUBLISHED and row.attempts == 2
        assert await outbox_count(runtime, run.id) == 1


async def test_non_retryable_failure_dead_letters_the_row(caplog):
    runtime, transport, _ = transport_runtime(dispatch=TriggerDispatchMode.DEFERRED)
    async with runtime:
        run = (await runtime.trigger(work, {})).run
        transport.fail_next(1, retryable=False)
        with caplog.at_level("WARNING", logger="runlane.transport"):
            assert (await runtime.tick()).outbox_dead_lettered == 1
        (row,) = await runtime.store.list_run_outbox(run.id)
        assert row.status is OutboxMessageStatus.DEAD_LETTERED and row.last_failure.retryable is False
        assert (await runtime.tick()).outbox_dead_lettered == 0
    [logged] = [record for record in caplog.records if record.name == "runlane.transport"]
    assert f"The wakeup of run {run.id} (queue default) was dead-lettered after 1 attempt(s)" in logged.getMessage()
    assert "cancel and rerun it" in logged.getMessage() and logged.run_id == run.id


async def test_a_dead_lettered_wakeup_of_a_bounded_queue_says_tick_reserves_it_again(caplog):
    runtime, transport, clock = transport_runtime(dispatch=TriggerDispatchMode.DEFERRED)
    async with runtime:
        run = (await runtime.trigger(limited_work, {})).run
        transport.fail_next(1, retryable=False)
        with caplog.at_level("WARNING", logger="runlane.transport"):
            result = await runtime.tick()
        assert (result.dispatch_reserved, result.outbox_dead_lettered) == (1, 1)
        [logged] = [record for record in caplog.records if record.name == "runlane.transport"]
        assert "tick() reserves it again, with a new wakeup, once its reservation expires" in logged.getMessage()
        assert "cancel and rerun" not in logged.getMessage()
        clock.advance("10m")  # past the reservation
        again = await runtime.tick()
        assert (again.dispatch_reserved, again.outbox_published) == (1, 1)  # as the warning said
        assert (await runtime.execute_delivery(transport.published[-1])).run.id == run.id


async def test_an_eager_trigger_whose_wakeup_is_dead_lettered_says_so(caplog):
    runtime, transport, _ = transport_runtime()
    async with runtime:
        transport.fail_next(1, retryable=False)
        with caplog.at_level("WARNING", logger="runlane.transport"):
            run = (await runtime.trigger(work, {})).run  # the run is durable; its wakeup is not
        assert run.status is RunStatus.QUEUED
    assert any(run.id in record.getMessage() and "dead-lettered" in record.getMessage() for record in caplog.records)


async def test_operation_outage_marks_every_claimed_row_failed():
    runtime, transport, clock = transport_runtime(dispatch=TriggerDispatchMode.DEFERRED)
    async with runtime:
        ids = [(await runtime.trigger(work, {"n": n})).run.id for n in range(2)]
        transport.fail_operation_next(1)
        result = await runtime.tick()
        assert (result.outbox_published, result.outbox_failed) == (0, 2)
        for run_id in ids:
            (row,) = await runtime.store.list_run_outbox(run_id)
            assert row.status is OutboxMessageStatus.FAILED
            assert row.last_failure.code is ErrorCode.TRANSPORT_UNAVAILABLE
        clock.advance(timedelta(seconds=2))
        assert (await runtime.tick()).outbox_published == 2


async def test_eager_publish_outage_does_not_reject_the_trigger():
    runtime, transport, _ = transport_runtime()
    async with runtime:
        transport.fail_operation_next(1)
        run = (await runtime.trigger(work, {})).run
        (row,) = await runtime.store.list_run_outbox(run.id)
        assert row.status is OutboxMessageStatus.FAILED


async def test_a_refused_eager_publish_rejects_the_trigger_and_says_the_run_exists():
    runtime, transport, clock = transport_runtime()
    async with runtime:
        transport.fail_operation_next(1, ErrorCode.CONFIGURATION_INVALID, retryable=False)
        with pytest.raises(RunlaneError) as raised:
            await runtime.trigger(work, {})
        error = raised.value
        assert error.code is ErrorCode.CONFIGURATION_INVALID and not error.retryable
        run_id = error.meta["run_id"]
        assert f"Run {run_id} was created" in error.message and "tick()" in error.message
        assert (await runtime.runs.get(run_id)).status is RunStatus.QUEUED

        # The row stays claimed by the refused call until its claim expires; then tick() publishes it.
        assert (await runtime.tick()).outbox_published == 0
        clock.advance(timedelta(minutes=5))
        assert (await runtime.tick()).outbox_published == 1
        assert [attempt.message.run_id for attempt in transport.commands[-1].attempts] == [run_id]


async def test_a_queue_the_transport_refuses_holds_back_only_its_own_wakeups(caplog):
    class RefusingLimited(RecordingTransport):
        async def publish_wakeups(self, command):
            if any(attempt.message.queue == LIMITED.name for attempt in command.attempts):
                raise RunlaneError(ErrorCode.CONFIGURATION_INVALID, "The queue name 'limited' does not resolve.")
            return await super().publish_wakeups(command)

    runtime, transport, _ = transport_runtime(RefusingLimited, dispatch=TriggerDispatchMode.DEFERRED)
    async with runtime:
        await runtime.trigger(limited_work, {})
        healthy = (await runtime.trigger(work, {})).run
        other = (await runtime.trigger(work, {})).run
        transport.fail_next(1, retryable=False)  # one of the other queue's wakeups is refused for good
        with caplog.at_level(logging.WARNING, logger="runlane.transport"), pytest.raises(RunlaneError) as raised:
            await runtime.tick()  # reserves the limited run, then publishes both queues' rows
        assert raised.value.code is ErrorCode.CONFIGURATION_INVALID
        # The other queue's outcomes are recorded, and its dead letter reported, before the error is raised.
        statuses = [(await runtime.store.list_run_outbox(run.id))[0].status for run in (healthy, other)]
        assert sorted(statuses) == sorted([OutboxMessageStatus.DEAD_LETTERED, OutboxMessageStatus.PUBLISHED])
        assert any("was dead-lettered" in record.getMessage() for record in caplog.records)


async def test_stale_claim_is_rejected():
    runtime, _, clock = transport_runtime(dispatch=TriggerDispatchMode.DEFERRED)
    async with runtime:
        run = (await runtime.trigger(work, {})).run
        (row,) = await runtime.store.list_run_outbox(run.id)
        store = runtime.store
        assert [m.id for m in await store.claim_outbox([row.id], claim_token="first", claim_ms=1_000)] == [row.id]
        # An active claim cannot be taken over.
        assert await store.claim_outbox([row.id], claim_token="second", claim_ms=1_000) == []
        clock.advance(timedelta(seconds=2))
        (taken,) = await store.claim_outbox([row.id], claim_token="second", claim_ms=1_000)
        assert taken.claim.token == "second"
        with pytest.raises(RunlaneError) as caught:
            await store.mark_outbox("first", [OutboxMark(row.id, OutboxMessageStatus.PUBLISHED)])
        assert get_storage_conflict_kind(caught.value) is StorageConflictKind.OUTBOX_CLAIM
        (marked,) = await store.mark_outbox("second", [OutboxMark(row.id, OutboxMessageStatus.PUBLISHED)])
        assert marked.status is OutboxMessageStatus.PUBLISHED
        with pytest.raises(RunlaneError):
            await store.mark_outbox("second", [OutboxMark(row.id, OutboxMessageStatus.PUBLISHED)])


async def test_storage_polling_lanes_write_no_outbox_rows():
    runtime, _ = make_runtime(work)
    async with runtime:
        run = (await runtime.trigger(work, {})).run
        assert await runtime.store.list_run_outbox(run.id) == []
        assert await outbox_count(runtime, run.id) == 0
        result = await runtime.tick()
        assert (result.outbox_published, result.outbox_failed, result.outbox_dead_lettered) == (0, 0, 0)


async def test_bounded_queue_rows_are_written_by_dispatch_and_published_by_tick():
    runtime, transport, _ = transport_runtime()
    async with runtime:
        run = (await runtime.trigger(limited_work, {})).run
        assert await runtime.store.list_run_outbox(run.id) == [] and transport.published == []
        result = await runtime.tick()
        assert result.dispatch_reserved == 1 and result.outbox_published == 1
        assert [message.run_id for message in transport.published] == [run.id]
        assert await outbox_count(runtime, run.id) == 1


class AdvancingClock(ControlledClock):
    """Moves one millisecond on every read, as a real clock does between the phases of a tick."""

    def now(self):
        self.advance(timedelta(milliseconds=1))
        return super().now()


async def test_the_tick_that_reserves_a_bounded_run_publishes_its_row_under_a_moving_clock():
    clock = AdvancingClock()
    transport = RecordingTransport(clock=clock)
    lane = create_lane(
        storage=local_storage_driver(clock=clock),
        delivery=LaneDelivery(mode=LaneDeliveryMode.TRANSPORT, transport=transport),
    )
    runtime = create_runlane(lane=lane, queues=[DEFAULT_QUEUE, LIMITED], tasks=[limited_work], clock=clock)
    async with runtime:
        run = (await runtime.trigger(limited_work, {})).run
        result = await runtime.tick()
        assert result.dispatch_reserved == 1 and result.outbox_published == 1
        assert [message.run_id for message in transport.published] == [run.id]


@pytest.mark.parametrize("dispatch", [TriggerDispatchMode.EAGER, TriggerDispatchMode.DEFERRED])
async def test_a_signal_resume_publishes_its_wakeup_as_trigger_does(dispatch):
    # Resumes are event-driven: under eager dispatch the wakeup goes out with the resume, not a tick later.
    runtime, transport, _ = transport_runtime(dispatch=dispatch)
    async with runtime:
        run = (await runtime.trigger(wait_work, {})).run
        await runtime.tick()  # deferred: the trigger's own wakeup
        released = await runtime.execute_next()
        assert released.status is RunStatus.RELEASED
        await runtime.signals.send("outbox-go")
        assert await outbox_count(runtime, run.id) == 2
        eager = dispatch is TriggerDispatchMode.EAGER
        assert len(transport.published) == (2 if eager else 1)
        assert (await runtime.tick()).outbox_published == (0 if eager else 1)
        assert [message.run_id for message in transport.published] == [run.id, run.id]


async def test_a_run_resumed_by_the_run_it_waited_for_gets_its_wakeup_at_once():
    @task("outbox.child")
    async def child(payload: dict) -> int:
        return 7

    @task("outbox.parent")
    async def parent(payload: dict, ctx: TaskContext):
        spawned = (await ctx.trigger(child, {}, idempotency_key=f"{ctx.run_id}.child")).run
        if spawned.status is not RunStatus.SUCCEEDED:
            return ctx.wait_for_run(spawned.id, timeout="1h")
        return spawned.output

    runtime, transport, _ = transport_runtime(tasks=[child, parent])
    async with runtime:
        waiting = (await runtime.trigger(parent, {})).run
        assert (await runtime.execute_delivery(transport.published[-1])).run.status is RunStatus.RELEASED
        assert (await runtime.execute_delivery(transport.published[-1])).run.status is RunStatus.SUCCEEDED
        assert transport.published[-1].run_id == waiting.id  # published when the child finished
        finished = await runtime.execute_delivery(transport.published[-1])
        assert (finished.run.status, finished.run.output) == (RunStatus.SUCCEEDED, 7)
        assert (await runtime.tick()).outbox_published == 0


async def test_prune_removes_a_transport_run_with_its_outbox_rows():
    runtime, transport, clock = transport_runtime()
    async with runtime:
        run = (await runtime.trigger(work, {})).run
        done = await runtime.execute_next()
        assert done.id == run.id and done.status is RunStatus.SUCCEEDED
        assert await outbox_count(runtime, run.id) == 1
        clock.advance(timedelta(days=2))
        assert (await runtime.runs.prune(older_than="1d")).pruned == 1
        assert await runtime.store.get_run(run.id) is None
        assert await runtime.store.list_run_outbox(run.id) == []


async def test_a_release_waiting_for_a_run_that_already_finished_publishes_its_wakeup_at_once():
    @task("outbox.done_first")
    async def done_first(payload: dict) -> None:
        return None

    @task("outbox.late_waiter")
    async def late_waiter(payload: dict, ctx: TaskContext):
        if ctx.attempt == 1:
            return ctx.wait_for_run(payload["source"])  # already terminal: resumed in the same commit
        return "resumed"

    runtime, transport, _ = transport_runtime(tasks=[done_first, late_waiter])
    async with runtime:
        source = (await runtime.trigger(done_first, {})).run
        assert (await runtime.execute_delivery(transport.published[-1])).run.status is RunStatus.SUCCEEDED
        waiter = (await runtime.trigger(late_waiter, {"source": source.id})).run
        released = await runtime.execute_delivery(transport.published[-1])
        assert released.run.status is RunStatus.QUEUED
        assert transport.published[-1].run_id == waiter.id and len(transport.published) == 3
        assert (await runtime.execute_delivery(transport.published[-1])).run.output == "resumed"


# ---------------------------------------------------------------------------------------------
# A release that changes whether a queue is bounded


@task("outbox.limited", queue=queue("limited"), retry=Retry(max_attempts=3, backoff="1m"))
async def unlimited_work(payload: dict) -> None:
    if payload.get("fail"):
        raise RunlaneError(ErrorCode.TASK_FAILED, "provider down", retryable=True)


@task("outbox.limited", queue=LIMITED, retry=Retry(max_attempts=3, backoff="1m"))
async def limited_flaky(payload: dict) -> None:
    raise RunlaneError(ErrorCode.TASK_FAILED, "provider down", retryable=True)


def releases(store: LocalStorageStore, transport: RecordingTransport, clock: ControlledClock) -> Any:
    """``release(queues, tasks)``: a runtime of one release of an application over the same stored state."""

    def release(queues: list[Any], tasks: list[Any]) -> Any:
        lane = create_lane(
            storage=local_storage_driver(store=store, clock=clock),
            delivery=LaneDelivery(mode=LaneDeliveryMode.TRANSPORT, transport=transport),
        )
        return create_runlane(lane=lane, queues=queues, tasks=tasks, clock=clock)

    return release


async def test_runs_of_a_queue_that_is_no_longer_bounded_are_woken_by_the_next_release():
    """A release drops a queue's concurrency limit while its runs wait for dispatch (queued, or
    retrying after a failure): the new release's tick requests their delivery, so a transport
    consumer runs every one of them, the one the old release reserved included."""
    clock = ControlledClock()
    transport = RecordingTransport(clock=clock)
    release = releases(LocalStorageStore(), transport, clock)

    old = release([DEFAULT_QUEUE, LIMITED], [limited_flaky])
    async with old:
        flaky = (await old.trigger(limited_flaky, {})).run
        assert (await old.tick()).dispatch_reserved == 1
        failed = await old.execute_delivery(transport.published[-1])
        assert failed.run.status is RunStatus.RETRYING
        queued = [(await old.trigger(limited_flaky, {"n": n})).run for n in range(3)]
        assert (await old.tick()).dispatch_reserved == 1  # the limit: one reserved, two wait
    published = len(transport.published)

    new = release([DEFAULT_QUEUE, queue("limited")], [unlimited_work])
    async with new:
        clock.advance("1m")  # the failed run's backoff
        await new.tick()
        woken = {message.run_id for message in transport.published[published:]}
        assert woken >= {flaky.id, queued[1].id, queued[2].id}
        clock.advance("10m")  # past the old release's reservation: its wakeup is sent again
        await new.tick()
        for message in transport.published[published:]:
            await new.execute_delivery(message)
        for run in (flaky, *queued):
            assert (await new.runs.get(run.id)).status is RunStatus.SUCCEEDED, run.id
        assert (await new.tick()).delivery_requested == 0


@task("outbox.limited", queue=queue("limited"))
async def unlimited_before(payload: dict, ctx: TaskContext) -> None:
    if payload.get("hold"):
        await ctx.signal.wait()


@task("outbox.limited", queue=LIMITED)
async def limited_now(payload: dict) -> str:
    return "ran"


async def test_runs_queued_before_their_queue_was_bounded_are_reserved_and_woken_by_tick():
    """The mirror of the release above: a release adds a concurrency limit to a queue whose runs the
    earlier release triggered (and sent wakeups for). A wakeup that arrives while the queue is full is
    refused; tick() then reserves the run once a slot frees and publishes a new wakeup."""
    clock = ControlledClock()
    transport = RecordingTransport(clock=clock)
    release = releases(LocalStorageStore(), transport, clock)

    old = release([DEFAULT_QUEUE, queue("limited")], [unlimited_before])
    async with old:
        waiting = [(await old.trigger(unlimited_before, {"n": n})).run for n in range(2)]
    old_wakeups = list(transport.published)

    new = release([DEFAULT_QUEUE, LIMITED], [limited_now])
    async with new:
        busy = (await new.trigger(limited_now, {"busy": True})).run
        assert (await new.tick()).dispatch_reserved == 1
        slot = transport.published[-1]
        assert slot.run_id == busy.id
        for wakeup in old_wakeups:  # the queue is full: refused, and the consumer drops them
            assert (await new.execute_delivery(wakeup)).reason is ExecuteDeliveryIgnoredReason.CLAIM_LOST
        assert (await new.execute_delivery(slot)).run.status is RunStatus.SUCCEEDED
        for _ in waiting:
            before = len(transport.published)
            assert (await new.tick()).dispatch_reserved == 1  # the slot is free again: one of them
            (fresh,) = transport.published[before:]
            assert (await new.execute_delivery(fresh)).run.status is RunStatus.SUCCEEDED
        for run in waiting:
            assert (await new.runs.get(run.id)).status is RunStatus.SUCCEEDED, run.id


async def test_a_long_transport_outage_never_costs_a_run_its_wakeup(caplog):
    # Retryable failures are retried for as long as they last, the delay doubling up to 5 minutes:
    # an outage of hours leaves the run queued with its wakeup pending, never dead-lettered.
    runtime, transport, clock = transport_runtime(dispatch=TriggerDispatchMode.DEFERRED)
    async with runtime:
        run = (await runtime.trigger(work, {})).run
        transport.fail_next(40)
        delays = []
        with caplog.at_level("WARNING", logger="runlane.transport"):
            for _ in range(40):
                result = await runtime.tick()
                assert (result.outbox_failed, result.outbox_dead_lettered) == (1, 0)
                (row,) = await runtime.store.list_run_outbox(run.id)
                assert row.status is OutboxMessageStatus.FAILED
                delays.append(row.available_at - clock.now())
                clock.set(row.available_at)
        assert delays[:4] == [timedelta(seconds=1), timedelta(seconds=2), timedelta(seconds=4), timedelta(seconds=8)]
        assert max(delays) == delays[-1] == timedelta(minutes=5)
        assert (await runtime.tick()).outbox_published == 1
        (row,) = await runtime.store.list_run_outbox(run.id)
        assert row.status is OutboxMessageStatus.PUBLISHED and row.attempts == 41
        assert (await runtime.execute_delivery(transport.published[-1])).run.status is RunStatus.SUCCEEDED
    # Reported at most once a minute: the first failure, then one report per 5-minute retry once the
    # delay passes a minute, each counting the failures it stands for.
    logged = [record for record in caplog.records if record.name == "runlane.transport"]
    assert all(record.levelname == "WARNING" for record in logged)
    first = logged[0].getMessage()
    assert first.startswith("1 wakeup(s) of queue default not published (attempt 1): transport_publish_failed")
    assert "tick() publishes them again from" in first and logged[0].run_ids == [run.id]
    assert "(attempt 2)" not in "".join(record.getMessage() for record in logged)  # 1 s later: held back
    assert "not published (attempt 40): " in logged[-1].getMessage()  # 5 minutes after the one before
    held_back = [record.getMessage() for record in logged if "more since the last report" in record.getMessage()]
    assert held_back == [held_back[0]] and "(attempt 7) (and 5 more since the last report)" in held_back[0]
    assert len(logged) == 40 - 5  # attempts 2 to 6 came within a minute of the first


async def test_a_burst_of_triggers_during_an_outage_is_reported_once_not_per_trigger(caplog):
    runtime, transport, clock = transport_runtime()  # eager: each trigger publishes its own wakeup
    async with runtime:
        transport.fail_next(20)
        with caplog.at_level("WARNING", logger="runlane.transport"):
            runs = [(await runtime.trigger(work, {"n": n})).run for n in range(20)]
            clock.advance("61s")
            assert (await runtime.tick()).outbox_published == 20  # the transport is back
            transport.fail_next(1)
            await runtime.trigger(work, {"n": 20})
        assert all(run.status is RunStatus.QUEUED for run in runs)
    logged = [record.getMessage() for record in caplog.records if record.name == "runlane.transport"]
    assert len(logged) == 2, logged
    assert logged[0].startswith("1 wakeup(s) of queue default not published (attempt 1): ")
    assert "(and 19 more since the last report)" in logged[1]
