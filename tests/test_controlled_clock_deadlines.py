"""Attempt deadlines, and the grace after them, on a ``ControlledClock`` follow the clock, not wall time."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from runlane import ErrorCode, Retry, RunStatus, TaskContext, create_runlane, task
from runlane_local import local_lane

from runtime_support import DEFAULT_QUEUE, make_runtime


async def _attempt_started(runtime: Any, definition: Any, flag: asyncio.Event | threading.Event) -> asyncio.Future:
    """Trigger ``definition`` and start executing it; the pending ``execute_next()``, once ``flag`` is set."""
    await runtime.trigger(definition, {})
    pending = asyncio.ensure_future(runtime.execute_next())
    await _started(flag)
    return pending


async def _started(flag: asyncio.Event | threading.Event) -> None:
    for _ in range(2000):
        if flag.is_set():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("the handler did not start")


async def test_an_async_handler_slower_in_wall_time_than_its_deadline_succeeds_while_the_clock_stands_still():
    @task("slow.async", max_attempt_duration="50ms")
    async def slow(payload: dict, ctx: TaskContext) -> dict:
        await asyncio.sleep(0.3)
        return {"aborted": ctx.signal.aborted}

    runtime, _ = make_runtime(slow)
    async with runtime:
        await runtime.trigger(slow, {})
        done = await runtime.execute_next()
        assert done.status is RunStatus.SUCCEEDED and done.output == {"aborted": False}


async def test_a_def_handler_slower_in_wall_time_than_its_deadline_succeeds_while_the_clock_stands_still():
    @task("slow.thread", max_attempt_duration="50ms")
    def slow(payload: dict, ctx: TaskContext) -> dict:
        time.sleep(0.3)
        return {"aborted": ctx.signal.aborted}

    runtime, _ = make_runtime(slow)
    async with runtime:
        await runtime.trigger(slow, {})
        done = await runtime.execute_next()
        assert done.status is RunStatus.SUCCEEDED and done.output == {"aborted": False}


async def test_moving_the_clock_past_the_deadline_aborts_a_def_handler_at_once():
    started = threading.Event()
    reasons: list[str | None] = []

    @task("waits.thread", max_attempt_duration="10m", retry=Retry(2, backoff="1m"))
    def waits(payload: dict, ctx: TaskContext) -> None:
        started.set()
        ctx.signal.wait_sync(30)
        reasons.append(ctx.signal.reason)

    runtime, clock = make_runtime(waits)
    async with runtime:
        pending = await _attempt_started(runtime, waits, started)
        clock.advance("9m")
        await asyncio.sleep(0.05)
        assert not pending.done()
        clock.advance("1m")
        done = await asyncio.wait_for(pending, 2)
        assert reasons == ["attempt_timed_out"]
        assert done.status is RunStatus.RETRYING and done.failure.code is ErrorCode.TASK_TIMED_OUT


async def test_moving_the_clock_far_past_the_deadline_cancels_a_hung_handler_without_waiting_out_the_grace():
    started = asyncio.Event()
    steps: list[str] = []

    @task("hung", max_attempt_duration="1m")
    async def hung(payload: dict) -> None:
        started.set()
        try:
            await asyncio.Event().wait()  # blind to ctx.signal
        finally:
            steps.append("cleanup ran")

    runtime, clock = make_runtime(hung)
    async with runtime:
        pending = await _attempt_started(runtime, hung, started)
        began = time.monotonic()
        clock.advance("1h")
        done = await asyncio.wait_for(pending, 2)
        assert time.monotonic() - began < 0.5  # the grace (1 s) passed on the clock, not in real time
        assert done.status is RunStatus.FAILED and done.failure.code is ErrorCode.TASK_TIMED_OUT
        assert steps == ["cleanup ran"]


async def test_the_grace_after_the_deadline_ends_when_the_clock_passes_it(monkeypatch):
    from runlane.core import attempt

    monkeypatch.setattr(attempt, "TIMEOUT_GRACE_S", 0.05)
    started = asyncio.Event()
    seen: list[str | None] = []

    @task("hung.grace", max_attempt_duration="1m")
    async def hung(payload: dict, ctx: TaskContext) -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        finally:
            seen.append(ctx.signal.reason)

    runtime, clock = make_runtime(hung)
    async with runtime:
        pending = await _attempt_started(runtime, hung, started)
        clock.advance("1m")  # the deadline: the signal is aborted, the grace has begun
        await asyncio.sleep(0.3)  # six graces of wall time, while the clock stands at the deadline
        assert not pending.done() and seen == []
        clock.advance("50ms")
        done = await asyncio.wait_for(pending, 2)
        assert seen == ["attempt_timed_out"]
        assert done.status is RunStatus.FAILED and done.failure.code is ErrorCode.TASK_TIMED_OUT


async def test_a_cooperative_handler_returns_within_the_grace_when_the_clock_reaches_the_deadline():
    started = asyncio.Event()
    steps: list[str] = []

    @task("cooperative", max_attempt_duration="1m")
    async def cooperative(payload: dict, ctx: TaskContext) -> str:
        started.set()
        await ctx.signal.wait()
        await asyncio.sleep(0.05)  # cleanup that takes a little wall time
        steps.append("cleaned up")
        return "stopped"

    runtime, clock = make_runtime(cooperative)
    async with runtime:
        pending = await _attempt_started(runtime, cooperative, started)
        clock.advance("1m")
        done = await asyncio.wait_for(pending, 2)
        assert steps == ["cleaned up"]
        assert done.status is RunStatus.FAILED and done.failure.code is ErrorCode.TASK_TIMED_OUT


async def test_on_the_system_clock_the_deadline_and_the_grace_run_in_real_time(monkeypatch):
    from runlane.core import attempt

    monkeypatch.setattr(attempt, "TIMEOUT_GRACE_S", 0.05)
    reasons: list[str | None] = []

    @task("real.cooperative", max_attempt_duration="50ms")
    async def cooperative(payload: dict, ctx: TaskContext) -> None:
        await ctx.signal.wait()
        reasons.append(ctx.signal.reason)

    @task("real.hung", max_attempt_duration="50ms")
    async def hung(payload: dict) -> None:
        await asyncio.Event().wait()

    @task("real.thread", max_attempt_duration="50ms")
    def thread(payload: dict, ctx: TaskContext) -> None:
        ctx.signal.wait_sync(5)
        reasons.append(ctx.signal.reason)

    runtime = create_runlane(lane=local_lane(), queues=[DEFAULT_QUEUE], tasks=[cooperative, hung, thread])
    async with runtime:
        for definition in (cooperative, hung, thread):
            await runtime.trigger(definition, {})
            done = await asyncio.wait_for(runtime.execute_next(), 5)
            assert done.status is RunStatus.FAILED and done.failure.code is ErrorCode.TASK_TIMED_OUT
        assert reasons == ["attempt_timed_out", "attempt_timed_out"]
