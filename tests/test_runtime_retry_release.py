"""Retry (failure pressure with a budget) versus release (business waiting), end to end."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest

from runlane import (
    Backoff,
    CancellationController,
    ErrorCode,
    Retry,
    RetryBackoffType,
    RunlaneError,
    RunStatus,
    RunWaitConditionType,
    TaskContext,
    TaskRelease,
    TimeWaitCondition,
    task,
)

from runtime_support import event_types, make_runtime


async def test_retryable_failures_retry_with_fixed_backoff_until_the_budget_is_spent():
    attempts: list[int] = []

    @task("flaky", retry=Retry(max_attempts=3, backoff="30s"))
    async def flaky(payload: dict, ctx: TaskContext) -> None:
        attempts.append(ctx.attempt)
        raise RunlaneError(ErrorCode.TASK_FAILED, "provider down", retryable=True, meta={"provider": "p"})

    runtime, clock = make_runtime(flaky)
    async with runtime:
        run = (await runtime.trigger(flaky, {})).run
        first = await runtime.execute_next()
        assert first.status is RunStatus.RETRYING
        assert first.run_at == clock.now() + timedelta(seconds=30)
        assert first.failure.code is ErrorCode.TASK_FAILED and first.failure.meta == {"provider": "p"}
        assert (first.counters.attempts, first.counters.failures, first.counters.retries) == (1, 1, 1)
        assert first.lease is None
        # Not due yet: neither maintenance nor a worker touches it.
        assert (await runtime.tick()).delivery_requested == 0
        assert await runtime.execute_next() is None
        clock.advance("30s")
        assert (await runtime.tick()).delivery_requested == 1
        second = await runtime.execute_next()
        assert second.status is RunStatus.RETRYING and second.counters.attempts == 2
        clock.advance("30s")
        # Workers also pick up due retries directly from storage.
        last = await runtime.execute_next()
        assert last.status is RunStatus.FAILED
        assert (last.counters.attempts, last.counters.failures, last.counters.retries) == (3, 3, 2)
        assert attempts == [1, 2, 3]
        types = await event_types(runtime, run.id)
        assert types.count("run.retry_scheduled") == 2 and types[-1] == "run.failed"


async def test_exponential_backoff_doubles_and_respects_the_cap():
    @task(
        "expo",
        retry=Retry(5, backoff=Backoff(type=RetryBackoffType.EXPONENTIAL, delay="5s", max_delay="15s")),
    )
    async def expo() -> None:
        raise RuntimeError("again")

    runtime, clock = make_runtime(expo)
    async with runtime:
        await runtime.trigger(expo)
        delays = []
        for _ in range(4):
            run = await runtime.execute_next()
            delays.append(run.run_at - clock.now())
            clock.set(run.run_at)
        assert delays == [timedelta(seconds=5), timedelta(seconds=10), timedelta(seconds=15), timedelta(seconds=15)]
        assert (await runtime.execute_next()).status is RunStatus.FAILED


async def test_unknown_exceptions_retry_and_non_retryable_errors_fail_at_once():
    @task("unknown", retry=Retry(2, backoff="1s"))
    async def unknown() -> None:
        raise ValueError("boom")

    @task("structured", retry=Retry(5, backoff="1s"))
    async def structured() -> None:
        raise RunlaneError(ErrorCode.VALIDATION_FAILED, "bad input")

    runtime, clock = make_runtime(unknown, structured)
    async with runtime:
        await runtime.trigger(unknown)
        assert (await runtime.execute_next()).status is RunStatus.RETRYING
        await runtime.trigger(structured)
        run = await runtime.execute_next()
        assert run.task_id == "structured" and run.status is RunStatus.FAILED
        assert run.counters.retries == 0


async def test_release_waits_without_counting_a_failure():
    polls: list[int] = []

    @task("poll.report", retry=Retry(1))
    async def poll(payload: dict, ctx: TaskContext):
        polls.append(ctx.attempt)
        if len(polls) < 2:
            return ctx.release("5m", reason="provider_not_ready", meta={"report": "r1"})
        return {"ready": True}

    runtime, clock = make_runtime(poll)
    async with runtime:
        run = (await runtime.trigger(poll, {})).run
        released = await runtime.execute_next()
        assert released.status is RunStatus.RELEASED
        assert released.wait == TimeWaitCondition(resume_at=clock.now() + timedelta(minutes=5))
        assert (released.counters.releases, released.counters.failures) == (1, 0)
        page = await runtime.runs.events(run.id, types=["run.released"])
        event = page.data[0].event
        assert (event.delay, event.reason, event.meta) == ("5m", "provider_not_ready", {"report": "r1"})
        clock.advance("4m")
        assert (await runtime.tick()).delivery_requested == 0
        clock.advance("1m")
        assert (await runtime.tick()).delivery_requested == 1
        assert (await runtime.runs.get(run.id)).status is RunStatus.QUEUED
        done = await runtime.execute_next()
        assert done.status is RunStatus.SUCCEEDED and done.output == {"ready": True}
        assert done.counters.attempts == 2 and done.counters.failures == 0
        attempts = await runtime.runs.attempts(run.id)
        assert [a.status.value for a in attempts] == ["released", "succeeded"]
        assert attempts[0].release_reason == "provider_not_ready"


async def test_releases_and_wait_timeouts_spend_none_of_the_retry_budget():
    """A polling task that waits several times, then fails transiently, still has its retries, and
    its backoff starts from the first failure."""

    @task(
        "poll.then.fail",
        retry=Retry(2, backoff=Backoff(type=RetryBackoffType.EXPONENTIAL, delay="10s", max_delay="1h")),
    )
    async def poll_then_fail(payload: dict, ctx: TaskContext):
        if ctx.attempt == 1:
            return ctx.release("1m")
        if ctx.attempt == 2:
            return ctx.wait_for_signal("report_ready", timeout="1m")  # the timeout fallback fires
        raise RuntimeError("provider down")

    runtime, clock = make_runtime(poll_then_fail)
    async with runtime:
        run = (await runtime.trigger(poll_then_fail, {})).run
        for _ in range(2):
            assert (await runtime.execute_next()).status is RunStatus.RELEASED
            clock.advance("1m")
            assert (await runtime.tick()).delivery_requested == 1
        retrying = await runtime.execute_next()
        assert retrying.status is RunStatus.RETRYING, retrying.failure
        assert retrying.run_at == clock.now() + timedelta(seconds=10)  # the first retry's delay
        counters = retrying.counters
        assert (counters.attempts, counters.releases, counters.failures, counters.retries) == (3, 2, 1, 1)
        clock.advance("10s")
        failed = await runtime.execute_next()
        assert failed.status is RunStatus.FAILED and failed.counters.attempts == 4 and failed.counters.retries == 1
        types = await event_types(runtime, run.id)
        assert [t for t in types if t in ("run.released", "run.retry_scheduled", "run.failed")] == [
            "run.released",
            "run.released",
            "run.retry_scheduled",
            "run.failed",
        ]


@pytest.mark.parametrize(
    "make_release",
    [
        lambda ctx: ctx.release("soon"),
        lambda ctx: ctx.release("0s"),
        lambda ctx: ctx.wait_for_signal("bad:key"),
        lambda ctx: ctx.wait_for_run(ctx.run_id),
        # Built without ctx, a release waiting for its own run is refused too (it would wait for ever).
        lambda ctx: TaskRelease(wait_type=RunWaitConditionType.RUN_COMPLETION, run_id=ctx.run_id),
        lambda ctx: ctx.release("1m", meta={"x": object()}),
    ],
)
async def test_invalid_release_values_fail_the_attempt_with_configuration_invalid(make_release):
    @task("bad.release")
    async def bad(payload: dict, ctx: TaskContext):
        return make_release(ctx)

    runtime, _ = make_runtime(bad)
    async with runtime:
        await runtime.trigger(bad, {})
        run = await runtime.execute_next()
        assert run.status is RunStatus.FAILED
        assert run.failure.code is ErrorCode.CONFIGURATION_INVALID


async def test_a_handler_giving_up_with_a_non_retryable_operation_cancelled_fails_without_retry():
    @task("gives.up", retry=Retry(max_attempts=3, backoff="1s"))
    async def gives_up(payload: dict, ctx: TaskContext) -> None:
        raise RunlaneError(ErrorCode.OPERATION_CANCELLED, "the export was withdrawn", retryable=False)

    runtime, _ = make_runtime(gives_up)
    async with runtime:
        run = (await runtime.trigger(gives_up, {})).run
        done = await runtime.execute_next()
        assert done.status is RunStatus.FAILED and done.counters.retries == 0
        assert done.failure.code is ErrorCode.OPERATION_CANCELLED and done.failure.retryable is False
        assert (await event_types(runtime, run.id))[-1] == "run.failed"


async def _watch_the_signal(ctx: TaskContext) -> None:
    while True:
        ctx.signal.raise_if_aborted()
        await asyncio.sleep(0.005)


@pytest.mark.parametrize("grouped", [False, True], ids=["plain", "task-group"])
async def test_an_operation_cancelled_after_a_worker_stop_releases_the_run_without_spending_a_retry(grouped):
    # In a task group each task raises the signal's operation_cancelled: the group's is a worker stop too.
    started = asyncio.Event()

    @task("stopped", retry=Retry(max_attempts=3, backoff="1s"))
    async def stopped(payload: dict, ctx: TaskContext) -> None:
        started.set()
        if not grouped:
            await ctx.signal.wait()
            ctx.signal.raise_if_aborted()
        async with asyncio.TaskGroup() as group:
            group.create_task(_watch_the_signal(ctx))
            group.create_task(_watch_the_signal(ctx))

    runtime, _ = make_runtime(stopped)
    async with runtime:
        run = (await runtime.trigger(stopped, {})).run
        worker = runtime.worker(empty_poll_delay="1s")
        await asyncio.wait_for(started.wait(), 2)
        await asyncio.wait_for(worker.stop(), 2)
        done = await runtime.runs.get(run.id)
        assert done.status is RunStatus.RELEASED and done.failure is None
        assert (done.counters.failures, done.counters.retries, done.counters.releases) == (0, 0, 1)


async def test_a_task_group_stopped_by_a_callers_signal_follows_the_retry_policy():
    @task("grouped.aborted", retry=Retry(max_attempts=3, backoff="1s"))
    async def grouped(payload: dict, ctx: TaskContext) -> None:
        async with asyncio.TaskGroup() as group:
            group.create_task(_watch_the_signal(ctx))
            group.create_task(_watch_the_signal(ctx))

    runtime, _ = make_runtime(grouped)
    async with runtime:
        controller = CancellationController()
        attempt = asyncio.ensure_future(runtime.run_now(grouped, {}, signal=controller.signal))
        await asyncio.sleep(0.05)
        controller.abort("caller_gone")
        run = await asyncio.wait_for(attempt, 2)
        assert run.status is RunStatus.RETRYING and run.counters.retries == 1
        assert run.failure.code is ErrorCode.OPERATION_CANCELLED and run.failure.retryable is True
        assert run.failure.meta == {"reason": "caller_gone"}


async def test_an_attempt_past_its_deadline_is_retried_by_the_budget_whatever_its_handler_raised():
    # At the deadline the timeout ended the attempt: retry_on / no_retry_on and a non-retryable error
    # raised afterwards judge nothing, as for a timeout tick() records for a handler that never returned.
    started = asyncio.Event()

    @task("timeout.raises", retry=Retry(2, backoff="1m", no_retry_on=TimeoutError), max_attempt_duration="1m")
    async def raises(payload: dict, ctx: TaskContext) -> None:
        started.set()
        await ctx.signal.wait()
        if payload["raise"] == "timeout":
            raise TimeoutError("the provider call gave up too")
        raise RunlaneError(ErrorCode.TASK_FAILED, "stopped", retryable=False)

    runtime, clock = make_runtime(raises)
    async with runtime:
        for kind in ("timeout", "runlane_error"):
            started.clear()
            run = (await runtime.trigger(raises, {"raise": kind})).run
            pending = asyncio.ensure_future(runtime.execute_next())
            await asyncio.wait_for(started.wait(), 2)
            clock.advance("1m")
            done = await asyncio.wait_for(pending, 5)
            assert done.id == run.id and done.status is RunStatus.RETRYING
            assert (done.failure.code, done.failure.retryable) == (ErrorCode.TASK_TIMED_OUT, True)
