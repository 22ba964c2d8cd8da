"""Cooperative cancellation: waiting runs, same-process and cross-process running runs, worker stop."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from runlane_local import local_lane

from runlane import (
    Actor,
    ActorType,
    ErrorCode,
    Retry,
    RunEventType,
    RunlaneError,
    RunlaneObservation,
    RunStatus,
    TaskContext,
    TaskDefinition,
    WorkerMode,
    create_runlane,
    task,
)
from runlane.core.store import ClaimRequest

from runtime_support import DEFAULT_QUEUE, event_types, make_runtime, shared_runtimes


@task("cancel.cooperative")
async def cooperative(payload: dict, ctx: TaskContext):
    started.set()
    await ctx.signal.wait()
    reasons.append(ctx.signal.reason)
    if payload.get("throw"):
        ctx.signal.raise_if_aborted()
    return "stopped cleanly"


started = asyncio.Event()
reasons: list[str | None] = []


@pytest.fixture(autouse=True)
def _reset():
    global started
    started = asyncio.Event()
    reasons.clear()


async def _start(runtime, payload):
    run = (await runtime.trigger(cooperative, payload)).run
    pending = asyncio.ensure_future(runtime.execute_next())
    await asyncio.wait_for(started.wait(), 2)
    return run, pending


async def test_waiting_runs_are_cancelled_immediately_with_audit_fields():
    @task("later")
    async def later(payload: dict, ctx: TaskContext):
        return ctx.release("1h")

    runtime, _ = make_runtime(later)
    async with runtime:
        queued = (await runtime.trigger(later, {})).run
        actor = Actor(type=ActorType.OPERATOR, id="ops@example.com")
        cancelled = await runtime.runs.cancel(
            queued.id, actor=actor, reason="operator_requested", meta={"ticket": 1}, trace_carrier={"traceparent": "x"}
        )
        assert cancelled.status is RunStatus.CANCELLED and cancelled.finished_at is not None
        event = (await runtime.runs.events(queued.id, types=["run.cancelled"])).data[0].event
        assert (event.actor, event.reason, event.meta, event.trace_carrier) == (
            actor,
            "operator_requested",
            {"ticket": 1},
            {"traceparent": "x"},
        )
        released = (await runtime.trigger(later, {})).run
        await runtime.execute_next()
        assert (await runtime.runs.cancel(released.id)).status is RunStatus.CANCELLED
        # Terminal runs cannot be cancelled again; unknown runs are not found.
        with pytest.raises(RunlaneError) as raised:
            await runtime.runs.cancel(queued.id)
        assert raised.value.code is ErrorCode.VALIDATION_FAILED
        with pytest.raises(RunlaneError) as raised:
            await runtime.runs.cancel("run_missing")
        assert raised.value.code is ErrorCode.RUN_NOT_FOUND


async def test_same_process_cancellation_aborts_the_signal_at_once_and_cancels():
    runtime, _ = make_runtime(cooperative)
    async with runtime:
        run, pending = await _start(runtime, {})
        requested = await runtime.runs.cancel(run.id, reason="stop")
        assert requested.status is RunStatus.CANCELLATION_REQUESTED
        done = await asyncio.wait_for(pending, 2)
        assert reasons == ["cancellation_requested"]
        assert done.status is RunStatus.CANCELLED and not done.has_output
        event = (await runtime.runs.events(run.id, types=["run.cancelled"])).data[0].event
        assert event.attempt == 1
        assert await event_types(runtime, run.id) == [
            "run.created",
            "run.delivery_requested",
            "run.lease_claimed",
            "run.started",
            "run.cancellation_requested",
            "run.cancelled",
        ]


def _held_after_its_claim() -> tuple[asyncio.Event, object, TaskDefinition]:
    """A slow observer of claims, which holds an attempt between its claim's commit and its start (a
    cancel written meanwhile finds no attempt to notify yet), and a handler that waits for its signal."""
    claimed = asyncio.Event()

    async def slow_observer(observation: RunlaneObservation) -> None:
        if observation.event_type is RunEventType.LEASE_CLAIMED:
            claimed.set()
            await asyncio.sleep(0.2)

    @task("cancel.waits")
    async def waits(payload: dict, ctx: TaskContext):
        try:
            await asyncio.wait_for(ctx.signal.wait(), 5)
        except TimeoutError:
            reasons.append("never told")
        else:
            reasons.append(ctx.signal.reason)

    return claimed, slow_observer, waits


async def test_a_cancellation_requested_between_the_claim_and_the_attempt_start_aborts_the_signal_at_once():
    claimed, slow_observer, waits = _held_after_its_claim()
    runtime, _ = make_runtime(waits, observers=[slow_observer])
    async with runtime:
        run = (await runtime.trigger(waits, {})).run
        pending = asyncio.ensure_future(runtime.execute_next())
        await asyncio.wait_for(claimed.wait(), 2)
        assert (await runtime.runs.cancel(run.id)).status is RunStatus.CANCELLATION_REQUESTED
        done = await asyncio.wait_for(pending, 3)
        assert reasons == ["cancellation_requested"]
        assert done.status is RunStatus.CANCELLED


async def test_another_process_cancellation_between_the_claim_and_the_attempt_start_reaches_a_poll_worker(
    postgres_url: str,
):
    from runlane_postgres import apply_postgres_migrations, postgres_polling_lane

    schema = f"cancel_claim_{uuid.uuid4().hex[:10]}"
    await apply_postgres_migrations(postgres_url, schema=schema)
    claimed, slow_observer, waits = _held_after_its_claim()
    worker_side = create_runlane(
        lane=postgres_polling_lane(postgres_url, schema=schema), queues=[DEFAULT_QUEUE], tasks=[waits],
        observers=[slow_observer],
    )  # fmt: skip
    operator = create_runlane(
        lane=postgres_polling_lane(postgres_url, schema=schema), queues=[DEFAULT_QUEUE], tasks=[waits]
    )
    async with worker_side, operator:
        worker = worker_side.worker(lease_duration="10m")  # heartbeats every 5 minutes: only the hint is in time
        try:
            run = (await operator.trigger(waits, {})).run
            await asyncio.wait_for(claimed.wait(), 10)
            await operator.runs.cancel(run.id)
            async with asyncio.timeout(3):
                while (await operator.runs.get(run.id)).status is not RunStatus.CANCELLED:
                    await asyncio.sleep(0.02)
        finally:
            await worker.stop()
        assert reasons == ["cancellation_requested"]


async def test_repeated_cancel_adds_no_events():
    runtime, _ = make_runtime(cooperative)
    async with runtime:
        run, pending = await _start(runtime, {})
        # Block the handler from finishing until both cancels are in.
        first = await runtime.runs.cancel(run.id)
        second = await runtime.runs.cancel(run.id)
        assert second.event_sequence in (first.event_sequence, first.event_sequence + 1)
        await asyncio.wait_for(pending, 2)
        assert (await event_types(runtime, run.id)).count("run.cancellation_requested") == 1


async def test_a_cancellation_too_large_to_store_says_what_to_shorten_and_changes_nothing():
    runtime, _ = make_runtime(cooperative)
    async with runtime:
        run = (await runtime.trigger(cooperative, {})).run
        with pytest.raises(RunlaneError) as raised:
            await runtime.runs.cancel(run.id, reason="r" * 10, meta={"note": "m" * 500_000})
        assert raised.value.code is ErrorCode.VALIDATION_FAILED
        expected = f"The cancellation of run {run.id} with its reason, meta and actor id is too large"
        assert raised.value.message.startswith(expected)
        assert "cancel with a shorter reason and actor id and smaller meta" in raised.value.message
        assert (await runtime.runs.get(run.id)).status is RunStatus.QUEUED
        assert await event_types(runtime, run.id) == ["run.created", "run.delivery_requested"]
        assert (await runtime.runs.cancel(run.id, reason="operator")).status is RunStatus.CANCELLED


async def test_throwing_after_cancellation_fails_without_retry():
    @task("cancel.throws", retry=Retry(5, backoff="1s"))
    async def throws(payload: dict, ctx: TaskContext):
        started.set()
        await ctx.signal.wait()
        raise RuntimeError("cleanup failed")

    runtime, _ = make_runtime(throws)
    async with runtime:
        run = (await runtime.trigger(throws, {})).run
        pending = asyncio.ensure_future(runtime.execute_next())
        await asyncio.wait_for(started.wait(), 2)
        await runtime.runs.cancel(run.id)
        done = await asyncio.wait_for(pending, 2)
        assert done.status is RunStatus.FAILED
        assert done.failure.code is ErrorCode.TASK_FAILED
        assert done.counters.retries == 0


async def test_raise_if_aborted_after_cancellation_records_a_cancelled_failure_message():
    runtime, _ = make_runtime(cooperative)
    async with runtime:
        run, pending = await _start(runtime, {"throw": True})
        await runtime.runs.cancel(run.id)
        done = await asyncio.wait_for(pending, 2)
        assert done.status is RunStatus.FAILED
        assert done.failure.code is ErrorCode.OPERATION_CANCELLED
        assert done.failure.message == "Task was cancelled."


async def test_cross_process_cancellation_is_observed_at_heartbeat_and_stops_extending_the_lease():
    (owner, operator), _ = shared_runtimes([cooperative], [cooperative])
    async with owner, operator:
        run = (await owner.trigger(cooperative, {})).run
        pending = asyncio.ensure_future(owner.execute_next(heartbeat_interval="5ms", lease_duration="1m"))
        await asyncio.wait_for(started.wait(), 2)
        requested = await operator.runs.cancel(run.id)
        assert requested.status is RunStatus.CANCELLATION_REQUESTED
        done = await asyncio.wait_for(pending, 2)
        assert reasons == ["cancellation_requested"]
        assert done.status is RunStatus.CANCELLED
        types = await event_types(owner, run.id)
        after_request = types[types.index("run.cancellation_requested") :]
        assert "run.lease_heartbeat" not in after_request


async def test_maintenance_finalizes_an_abandoned_cancellation_after_lease_expiry():
    runtime, clock = make_runtime(cooperative)
    async with runtime:
        run = (await runtime.trigger(cooperative, {})).run
        # A worker in another process claimed and started the run, then died.
        (claim,) = await runtime.store.claim([ClaimRequest(run.id, None, "dead-worker", "tok", 60_000, also_start=True)])
        assert claim.claimed
        assert (await runtime.runs.cancel(run.id)).status is RunStatus.CANCELLATION_REQUESTED
        assert (await runtime.tick()).cancellations_finalized == 0
        clock.advance("1m")
        result = await runtime.tick()
        assert result.cancellations_finalized == 1
        final = await runtime.runs.get(run.id)
        assert final.status is RunStatus.CANCELLED
        event = (await runtime.runs.events(run.id, types=["run.cancelled"])).data[0].event
        assert event.actor.type is ActorType.SYSTEM


async def test_worker_stop_aborts_the_signal_but_is_not_a_cancellation():
    runtime, _ = make_runtime(cooperative)
    async with runtime:
        run = (await runtime.trigger(cooperative, {})).run
        worker = runtime.worker(mode=WorkerMode.POLL, empty_poll_delay="10ms")
        await asyncio.wait_for(started.wait(), 2)
        await asyncio.wait_for(worker.stop(), 2)
        assert reasons == ["worker_stopped"]
        final = await runtime.runs.get(run.id)
        assert final.status is RunStatus.SUCCEEDED and final.output == "stopped cleanly"


async def test_a_handler_that_ignores_cancellation_is_cancelled_by_its_own_process_tick_once_the_lease_is_over():
    """On the system clock: the lease the attempt stopped extending runs out on steady time, and the same
    runtime's tick() finalizes the cancellation while the handler, blind to ``ctx.signal``, still runs."""
    started, release = asyncio.Event(), asyncio.Event()

    @task("cancel.blind")
    async def blind(payload: dict) -> str:
        started.set()
        await release.wait()
        return "late"

    runtime = create_runlane(lane=local_lane(), queues=[DEFAULT_QUEUE], tasks=[blind])
    async with runtime:
        run = (await runtime.trigger(blind, {})).run
        pending = asyncio.ensure_future(runtime.execute_next(lease_duration="200ms", heartbeat_interval="50ms"))
        await asyncio.wait_for(started.wait(), 2)
        await runtime.runs.cancel(run.id)
        assert (await runtime.tick()).cancellations_finalized == 0  # the lease still holds
        finalized = 0
        async with asyncio.timeout(5):
            while not finalized:
                await asyncio.sleep(0.02)
                finalized = (await runtime.tick()).cancellations_finalized
        assert (await runtime.runs.get(run.id)).status is RunStatus.CANCELLED
        release.set()
        done = await asyncio.wait_for(pending, 2)
        assert done is not None and done.status is RunStatus.CANCELLED
        types = await event_types(runtime, run.id)
        assert types[-2:] == ["run.cancellation_requested", "run.cancelled"]


async def test_cancellation_after_maintenance_finalized_reports_the_stored_cancellation():
    release = asyncio.Event()

    @task("cancel.slow")
    async def slow(payload: dict, ctx: TaskContext):
        started.set()
        await ctx.signal.wait()
        await release.wait()
        return "late"

    # The handler saw the signal but does not stop. Its attempt no longer extends the lease, and once that
    # has run out the process's own tick records the cancellation, as another process's would.
    runtime, clock = make_runtime(slow)
    async with runtime:
        run = (await runtime.trigger(slow, {})).run
        pending = asyncio.ensure_future(runtime.execute_next(lease_duration="1m"))
        await asyncio.wait_for(started.wait(), 2)
        await runtime.runs.cancel(run.id)
        clock.advance("59s")
        assert (await runtime.tick()).cancellations_finalized == 0
        clock.advance("2s")
        assert (await runtime.tick()).cancellations_finalized == 1
        assert (await runtime.runs.get(run.id)).status is RunStatus.CANCELLED
        release.set()
        done = await asyncio.wait_for(pending, 2)
        assert done is not None and done.status is RunStatus.CANCELLED
