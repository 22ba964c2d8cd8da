"""``tick()`` recovery phases, attempt deadlines and heartbeats."""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import fields
from datetime import UTC, datetime, timedelta

import pytest
from runlane_local import local_lane

from runlane import ErrorCode, Retry, RunlaneError, RunStatus, TaskContext, TickResult, create_runlane, task
from runlane.core.store import ClaimRequest
from runlane.testing import wait_for_run_status
from runtime_support import DEFAULT_QUEUE, event_types, make_runtime, shared_runtimes


@task("noop")
async def noop(payload: dict) -> None:
    return None


@task("timed", retry=Retry(2, backoff="1m"), max_attempt_duration="10m")
async def timed(payload: dict) -> None:
    return None


async def _claim(runtime, run_id, *, lease_ms=60_000, start=True, deadline_ms=None):
    (claim,) = await runtime.store.claim(
        [ClaimRequest(run_id, None, "crashed-worker", f"tok-{run_id}", lease_ms, deadline_ms, also_start=start)]
    )
    assert claim.claimed
    return claim.run


async def test_tick_result_reports_all_eight_counts():
    runtime, _ = make_runtime(noop)
    async with runtime:
        result = await runtime.tick()
    assert [f.name for f in fields(TickResult)] == [
        "materialized",
        "delivery_requested",
        "cancellations_finalized",
        "timeouts_finalized",
        "dispatch_reserved",
        "outbox_published",
        "outbox_failed",
        "outbox_dead_lettered",
    ]
    assert result == TickResult()


async def test_expired_running_leases_are_recovered_through_delivery_requests():
    runtime, clock = make_runtime(noop)
    async with runtime:
        run = (await runtime.trigger(noop, {})).run
        await _claim(runtime, run.id)
        assert (await runtime.tick()).delivery_requested == 0
        clock.advance("1m")
        assert (await runtime.tick()).delivery_requested == 1
        recovered = await runtime.runs.get(run.id)
        assert recovered.status is RunStatus.QUEUED and recovered.lease is None
        done = await runtime.execute_next()
        assert done.status is RunStatus.SUCCEEDED and done.counters.attempts == 2


async def test_timed_out_attempts_are_finalized_by_the_retry_policy():
    runtime, clock = make_runtime(timed)
    async with runtime:
        run = (await runtime.trigger(timed, {})).run
        await _claim(runtime, run.id, lease_ms=3_600_000, deadline_ms=600_000)
        clock.advance("10m")
        result = await runtime.tick()
        assert result.timeouts_finalized == 1
        retrying = await runtime.runs.get(run.id)
        assert retrying.status is RunStatus.RETRYING
        assert retrying.failure.code is ErrorCode.TASK_TIMED_OUT
        clock.advance("1m")
        assert (await runtime.tick()).delivery_requested == 1
        await _claim(runtime, run.id, lease_ms=3_600_000, deadline_ms=600_000)
        clock.advance("10m")
        assert (await runtime.tick()).timeouts_finalized == 1
        failed = await runtime.runs.get(run.id)
        assert failed.status is RunStatus.FAILED and failed.failure.code is ErrorCode.TASK_TIMED_OUT


async def test_a_timeout_tick_records_for_a_dead_worker_is_logged_like_any_failed_attempt(caplog):
    # The worker that ran the attempt is gone and cannot say so: the tick that records its outcome does.
    runtime, clock = make_runtime(timed)
    caplog.set_level(logging.WARNING, logger="runlane.task")
    async with runtime:
        run = (await runtime.trigger(timed, {})).run
        for attempt, level, then in ((1, logging.WARNING, "retry at"), (2, logging.ERROR, "the run has failed")):
            caplog.clear()
            await _claim(runtime, run.id, lease_ms=3_600_000, deadline_ms=600_000)
            clock.advance("10m")
            assert (await runtime.tick()).timeouts_finalized == 1
            (record,) = [record for record in caplog.records if record.name == "runlane.task"]
            assert record.levelno == level and record.run_id == run.id and record.error_code == "task_timed_out"
            assert f"attempt {attempt} failed with task_timed_out" in record.getMessage()
            assert then in record.getMessage()
            clock.advance("1m")
            await runtime.tick()


async def test_a_claim_that_never_started_is_lease_recovered_not_timed_out():
    runtime, clock = make_runtime(timed)
    async with runtime:
        run = (await runtime.trigger(timed, {})).run
        await _claim(runtime, run.id, lease_ms=60_000, deadline_ms=30_000, start=False)
        clock.advance("1m")
        result = await runtime.tick()
        assert (result.timeouts_finalized, result.delivery_requested) == (0, 1)


async def test_due_retrying_released_and_scheduled_runs_get_delivery_requests_within_limits():
    @task("later")
    async def later(payload: dict, ctx: TaskContext):
        return ctx.release("1m")

    runtime, clock = make_runtime(later)
    async with runtime:
        runs = [(await runtime.trigger(later, {})).run for _ in range(3)]
        for _ in runs:
            await runtime.execute_next()
        clock.advance("1m")
        assert (await runtime.tick(delivery_request_limit=2)).delivery_requested == 2
        assert (await runtime.tick(delivery_request_limit=2)).delivery_requested == 1
        assert (await runtime.tick()).delivery_requested == 0
        for run in runs:
            assert (await runtime.runs.get(run.id)).status is RunStatus.QUEUED
            assert (await event_types(runtime, run.id))[-1] == "run.delivery_requested"


async def test_cancellation_and_timeout_phases_respect_their_limits():
    runtime, clock = make_runtime(timed, noop)
    async with runtime:
        cancel_runs = [(await runtime.trigger(noop, {})).run for _ in range(3)]
        for run in cancel_runs:
            await _claim(runtime, run.id)
            await runtime.runs.cancel(run.id)
        timeout_runs = [(await runtime.trigger(timed, {})).run for _ in range(3)]
        for run in timeout_runs:
            await _claim(runtime, run.id, lease_ms=3_600_000, deadline_ms=60_000)
        clock.advance("1m")
        first = await runtime.tick(cancellation_finalization_limit=2, timeout_finalization_limit=1)
        assert (first.cancellations_finalized, first.timeouts_finalized) == (2, 1)
        second = await runtime.tick()
        assert (second.cancellations_finalized, second.timeouts_finalized) == (1, 2)


@pytest.mark.parametrize(
    "option", ["delivery_request_limit", "cancellation_finalization_limit", "timeout_finalization_limit", "outbox_claim_limit"]
)
async def test_tick_limits_must_be_positive(option):
    runtime, _ = make_runtime(noop)
    async with runtime:
        for bad in (0, -1, 1.5, True):
            with pytest.raises(RunlaneError) as raised:
                await runtime.tick(**{option: bad})
            assert raised.value.code is ErrorCode.CONFIGURATION_INVALID


async def test_the_attempt_deadline_aborts_the_signal_and_times_out():
    reasons: list[str | None] = []

    @task("deadline")
    async def deadline(payload: dict, ctx: TaskContext):
        await ctx.signal.wait()
        reasons.append(ctx.signal.reason)
        return "finished anyway"

    # On the system clock: the deadline passes in real time (a ControlledClock reaches it only when moved).
    runtime = create_runlane(lane=local_lane(), queues=[DEFAULT_QUEUE], tasks=[deadline])
    async with runtime:
        run = (await runtime.trigger(deadline, {})).run
        done = await asyncio.wait_for(runtime.execute_next(max_attempt_duration="5ms"), 2)
        assert reasons == ["attempt_timed_out"]
        assert done.status is RunStatus.FAILED and done.failure.code is ErrorCode.TASK_TIMED_OUT
        assert done.failure.message == "Task timed out."
        claimed = (await runtime.runs.events(run.id, types=["run.lease_claimed"])).data[0].event
        assert claimed.attempt_deadline_at == claimed.occurred_at + timedelta(milliseconds=5)


async def test_an_async_handler_that_ignores_its_deadline_is_cancelled_after_the_grace(monkeypatch, caplog):
    from runlane.core import attempt

    monkeypatch.setattr(attempt, "TIMEOUT_GRACE_S", 0.05)
    steps: list[str] = []

    @task("ignores.deadline", retry=Retry(2, backoff="1m"))
    async def ignores(payload: dict) -> str:
        try:
            await asyncio.Event().wait()  # a hung call with no timeout of its own, blind to ctx.signal
        finally:
            steps.append("cleanup ran")
        return "never"

    # On the system clock: the deadline and the grace pass in real time.
    runtime = create_runlane(lane=local_lane(), queues=[DEFAULT_QUEUE], tasks=[ignores])
    caplog.set_level(logging.WARNING, logger="runlane")
    async with runtime:
        await runtime.trigger(ignores, {})
        done = await asyncio.wait_for(runtime.execute_next(max_attempt_duration="5ms"), 5)
        assert done.status is RunStatus.RETRYING and done.failure.code is ErrorCode.TASK_TIMED_OUT
        assert steps == ["cleanup ran"]
        [logged] = [record for record in caplog.records if record.name == "runlane.task"]
        assert "failed with task_timed_out (Task timed out.)" in logged.getMessage()
        assert logged.exc_info is None  # the cancellation is the runtime's own doing, not the handler's error


async def test_finishing_past_the_deadline_on_the_runtime_clock_times_out():
    @task("slow.clock", max_attempt_duration="1s", retry=Retry(2, backoff="5s"))
    async def slow(payload: dict) -> str:
        clock.advance("2s")
        return "too late"

    runtime, clock = make_runtime(slow)
    async with runtime:
        await runtime.trigger(slow, {})
        done = await runtime.execute_next()
        assert done.status is RunStatus.RETRYING and done.failure.code is ErrorCode.TASK_TIMED_OUT


async def test_moving_a_controlled_clock_past_the_deadline_aborts_the_attempt_at_once():
    started = asyncio.Event()
    reasons: list[str | None] = []

    @task("waits.for.abort", max_attempt_duration="10m", retry=Retry(2, backoff="1m"))
    async def waits(payload: dict, ctx: TaskContext) -> None:
        started.set()
        await ctx.signal.wait()  # only the deadline ends this attempt
        reasons.append(ctx.signal.reason)

    runtime, clock = make_runtime(waits)
    async with runtime:
        await runtime.trigger(waits, {})
        pending = asyncio.ensure_future(runtime.execute_next())
        await asyncio.wait_for(started.wait(), 2)
        clock.advance("9m")
        await asyncio.sleep(0.02)
        assert not pending.done()  # not due yet
        clock.advance("1m")  # the deadline, ten minutes after the claim on the runtime's clock
        done = await asyncio.wait_for(pending, 2)
        assert done.status is RunStatus.RETRYING and done.failure.code is ErrorCode.TASK_TIMED_OUT
        assert reasons == ["attempt_timed_out"]


async def test_heartbeats_extend_the_lease_but_not_the_deadline():
    @task("long")
    async def long(payload: dict, ctx: TaskContext) -> None:
        for _ in range(3):
            clock.advance("10s")
            await asyncio.sleep(0.01)

    runtime, clock = make_runtime(long)
    async with runtime:
        run = (await runtime.trigger(long, {})).run
        done = await runtime.execute_next(
            lease_duration="30s", heartbeat_interval="4ms", max_attempt_duration="1h"
        )
        assert done.status is RunStatus.SUCCEEDED
        page = await runtime.runs.events(run.id, types=["run.lease_heartbeat"])
        assert len(page.data) >= 2
        claimed = (await runtime.runs.events(run.id, types=["run.lease_claimed"])).data[0].event
        for record in page.data:
            lease = record.event.lease
            assert lease.token == claimed.lease.token and lease.claimed_at == claimed.lease.claimed_at
            assert lease.expires_at == record.event.occurred_at + timedelta(seconds=30)


async def test_a_handler_still_running_keeps_its_lease_while_a_controlled_clock_moves_past_it():
    started: list[int] = []
    release = asyncio.Event()

    @task("still.running")
    async def still_running(payload: dict, ctx: TaskContext) -> str:
        started.append(ctx.attempt)
        await release.wait()
        return "done"

    runtime, clock = make_runtime(still_running)
    async with runtime:
        run = (await runtime.trigger(still_running, {})).run
        pending = asyncio.ensure_future(runtime.execute_next(lease_duration="1m"))  # heartbeats every 30 s
        while not started:
            await asyncio.sleep(0.001)
        for _ in range(3):
            clock.advance("90s")  # past the lease in one move: the heartbeat is due on the clock, not in real time
            assert (await runtime.tick()).delivery_requested == 0
            lease = (await runtime.runs.get(run.id)).lease
            assert lease is not None and lease.expires_at == clock.now() + timedelta(minutes=1)
        release.set()
        done = await asyncio.wait_for(pending, 2)
        assert done is not None and done.status is RunStatus.SUCCEEDED and done.output == "done"
        assert started == [1]
        heartbeats = (await runtime.runs.events(run.id, types=["run.lease_heartbeat"])).data
        assert len(heartbeats) == 3


@pytest.mark.parametrize(
    "options",
    [
        {"heartbeat_interval": "1m", "lease_duration": "1m"},
        {"heartbeat_interval": "2m", "lease_duration": "1m"},
        {"lease_duration": "soon"},
        {"max_attempt_duration": 0},
        {"worker_id": "a:b"},
        {"signal": "stop"},
    ],
)
async def test_execution_options_are_validated(options):
    runtime, _ = make_runtime(noop)
    async with runtime:
        with pytest.raises(RunlaneError) as raised:
            await runtime.execute_next(**options)
        assert raised.value.code is ErrorCode.CONFIGURATION_INVALID


async def test_a_lease_shorter_than_a_second_is_taken_and_logged_once(caplog):
    caplog.set_level(logging.WARNING, logger="runlane.worker")
    runtime, _ = make_runtime(noop)
    async with runtime:
        for _ in range(2):
            await runtime.trigger(noop, {})
            done = await runtime.execute_next(lease_duration="743ms", heartbeat_interval="200ms")
            assert done is not None and done.status is RunStatus.SUCCEEDED
            assert done.lease is None
    warned = [record.getMessage() for record in caplog.records if "lease_duration is 743ms" in record.getMessage()]
    assert len(warned) == 1 and "can expire while its heartbeat is being written" in warned[0]


async def test_a_heartbeat_storage_failure_rejects_the_execution_call(caplog):
    reasons: list[str | None] = []
    failing = False

    @task("hb.fail")
    async def waits(payload: dict, ctx: TaskContext) -> None:
        nonlocal failing
        failing = True
        await ctx.signal.wait()
        reasons.append(ctx.signal.reason)

    runtime, _ = make_runtime(waits)
    original = runtime.store.complete

    async def complete(requests):
        if failing:
            raise RunlaneError(ErrorCode.STORAGE_UNAVAILABLE, "storage is down", retryable=True)
        return await original(requests)

    runtime.store.complete = complete  # type: ignore[method-assign]
    async with runtime:
        await runtime.trigger(waits, {})
        with pytest.raises(RunlaneError) as raised:
            await asyncio.wait_for(runtime.execute_next(heartbeat_interval="3ms"), 2)
        assert raised.value.code is ErrorCode.STORAGE_UNAVAILABLE
        assert reasons == ["heartbeat_failed"]
    # The run will run again: the log of the run says why (not only the worker's storage warning).
    (logged,) = [record for record in caplog.records if record.name == "runlane.task"]
    assert "could not renew its lease (storage_unavailable: storage is down)" in logged.getMessage()
    assert "is not recorded: the run runs again once its lease expires" in logged.getMessage()


async def test_a_handler_still_running_when_tick_records_its_timeout_reports_that_outcome(caplog):
    # Another process's tick() finalizes an attempt past its deadline even while its worker still runs
    # the handler: the attempt's caller gets the stored timeout, and the log says the handler came too
    # late, not that a lease was lost to someone else.
    started, finish = asyncio.Event(), asyncio.Event()

    @task("stubborn", max_attempt_duration="1m", retry=Retry(2, backoff="1h"))
    async def stubborn(payload: dict) -> str:
        started.set()
        await finish.wait()  # blind to ctx.signal
        return "too late"

    (runtime, maintenance), clock = shared_runtimes([stubborn], [stubborn])
    caplog.set_level(logging.WARNING, logger="runlane")
    async with runtime, maintenance:
        run = (await runtime.trigger(stubborn, {})).run
        pending = asyncio.ensure_future(runtime.execute_next())
        await asyncio.wait_for(started.wait(), 2)
        clock.advance("1m")
        assert (await maintenance.tick()).timeouts_finalized == 1
        finish.set()  # returns within the grace the deadline gives it, after maintenance wrote the outcome
        done = await asyncio.wait_for(pending, 5)
        assert done is not None and done.id == run.id
        assert done.status is RunStatus.RETRYING and done.failure.code is ErrorCode.TASK_TIMED_OUT
        assert done.counters.attempts == 1
        outcome = (await runtime.runs.events(run.id, types=["run.retry_scheduled"])).data[0].event
        assert outcome.actor.type == "system"
        messages = [record.getMessage() for record in caplog.records if record.name == "runlane.task"]
        late = "ran past its max_attempt_duration deadline and maintenance recorded its timeout"
        assert any(late in message for message in messages)
        assert not any("lost its lease" in message for message in messages)


async def test_a_def_handler_stuck_past_its_deadline_is_timed_out_by_its_own_process_tick(caplog):
    # A def handler's thread cannot be interrupted. Once the grace after its deadline is over, the tick of
    # the very process running it records the timeout (the retry may then start beside it), as another
    # process's tick would: no run stays running for as long as a stuck thread.
    started, finish = threading.Event(), threading.Event()

    @task("stuck.def", max_attempt_duration="1m", retry=Retry(2, backoff="1h"))
    def stuck(payload: dict) -> str:
        started.set()
        finish.wait(10)  # blind to ctx.signal
        return "too late"

    runtime, clock = make_runtime(stuck)
    caplog.set_level(logging.WARNING, logger="runlane")
    async with runtime:
        run = (await runtime.trigger(stuck, {})).run
        pending = asyncio.ensure_future(runtime.execute_next())
        assert await asyncio.to_thread(started.wait, 2)
        clock.advance("1m")
        assert (await runtime.tick()).timeouts_finalized == 0  # within the grace: the handler may still stop
        clock.advance("2s")
        assert (await runtime.tick()).timeouts_finalized == 1
        stored = await runtime.runs.get(run.id)
        assert stored.status is RunStatus.RETRYING and stored.failure.code is ErrorCode.TASK_TIMED_OUT
        finish.set()
        done = await asyncio.wait_for(pending, 5)
        assert done is not None and done.status is RunStatus.RETRYING and done.counters.attempts == 1
        messages = [record.getMessage() for record in caplog.records if record.name == "runlane.task"]
        assert any("maintenance recorded its timeout" in message for message in messages)


class SteppingClock:
    """The wall clock plus an offset that can step, as NTP or a resumed virtual machine steps it (no
    ``watch()``: the runtime learns of the step only by reading the time)."""

    def __init__(self) -> None:
        self.offset = timedelta(0)

    def now(self) -> datetime:
        return datetime.now(UTC) + self.offset


async def test_a_clock_step_past_the_lease_never_hands_a_live_attempt_to_its_own_process(caplog):
    starts: list[int] = []
    started, finish = asyncio.Event(), asyncio.Event()

    @task("long.running")
    async def long_running(payload: dict, ctx: TaskContext) -> str:
        starts.append(ctx.attempt)
        started.set()
        await finish.wait()
        return "done"

    clock = SteppingClock()
    runtime = create_runlane(lane=local_lane(), queues=[DEFAULT_QUEUE], tasks=[long_running], clock=clock)
    caplog.set_level(logging.WARNING, logger="runlane")
    async with runtime:
        run = (await runtime.trigger(long_running, {})).run
        worker = runtime.worker(concurrency=2, empty_poll_delay="10ms", lease_duration="1m")
        await asyncio.wait_for(started.wait(), 5)
        clock.offset = timedelta(minutes=2)  # past the lease: to this process's clock the lease has expired
        await asyncio.sleep(0.2)  # the idle slot polls meanwhile
        result = await runtime.tick()
        assert (result.delivery_requested, result.cancellations_finalized) == (0, 0)
        assert await runtime.execute_next() is None
        renewed = await runtime.runs.get(run.id)
        assert renewed.lease is not None and renewed.lease.expires_at > clock.now()  # heartbeat on the new time
        finish.set()
        done = await wait_for_run_status(runtime, run.id, RunStatus.SUCCEEDED)
        await worker.stop()
    assert starts == [1] and done.counters.attempts == 1
    assert not [record for record in caplog.records if "lost its lease" in record.getMessage()]


@pytest.mark.parametrize("cancel", [False, True], ids=["deadline", "cancellation"])
async def test_a_clock_step_never_finalizes_a_live_attempt_of_this_process(cancel: bool):
    """After a forward step of the wall clock, this process's tick must not record a timeout (or a
    cancellation) of an attempt it is running, which would start attempt 2 beside attempt 1. The attempt
    itself reaches its (wall-clock) deadline, aborting its signal, and records the timeout; a cancelled
    one cleans up and reports."""
    seen: list[tuple[str, int, bool]] = []
    started, finish = asyncio.Event(), asyncio.Event()

    @task("report.build", max_attempt_duration="10s", retry=Retry(3, backoff="1ms"))
    async def build(payload: dict, ctx: TaskContext) -> str:
        seen.append(("start", ctx.attempt, ctx.signal.aborted))
        started.set()
        await finish.wait()  # work, or the clean-up after a cancellation
        seen.append(("end", ctx.attempt, ctx.signal.aborted))
        return "built"

    clock = SteppingClock()
    runtime = create_runlane(lane=local_lane(), queues=[DEFAULT_QUEUE], tasks=[build], clock=clock)
    async with runtime:
        run = (await runtime.trigger(build, {})).run
        worker = runtime.worker(concurrency=2, empty_poll_delay="10ms", lease_duration="1m")
        try:
            await asyncio.wait_for(started.wait(), 5)
            if cancel:
                await runtime.runs.cancel(run.id)
            clock.offset = timedelta(minutes=6)  # past the deadline, the lease and the cancellation grace
            result = await runtime.tick()
            assert (result.timeouts_finalized, result.cancellations_finalized) == (0, 0)
            await asyncio.sleep(0.1)  # the idle slot polls meanwhile
            finish.set()
            done = await wait_for_run_status(runtime, run.id, RunStatus.CANCELLED if cancel else RunStatus.SUCCEEDED)
            retries = (await runtime.runs.events(run.id, types=["run.retry_scheduled"])).data
        finally:
            finish.set()
            await worker.stop()
    if cancel:
        assert seen == [("start", 1, False), ("end", 1, True)] and done.counters.attempts == 1
    else:  # attempt 2 only once attempt 1, told of its deadline, has ended
        assert seen == [("start", 1, False), ("end", 1, True), ("start", 2, False), ("end", 2, False)]
        assert done.counters.attempts == 2 and done.counters.failures == 1
        timed_out = retries[0].event
        assert timed_out.failure.code is ErrorCode.TASK_TIMED_OUT and timed_out.actor.type == "worker"
