"""Closing a runtime stops the attempts it is running, as a worker stop does, and waits for their outcomes."""

from __future__ import annotations

import asyncio
import threading

import pytest

from runlane import (
    DeliveryMessage,
    ErrorCode,
    Retry,
    RunlaneError,
    RunStatus,
    TaskContext,
    WorkerMode,
    create_runlane,
    task,
)
from runlane_local import sqlite_lane

from runtime_support import DEFAULT_QUEUE, make_runtime

started = asyncio.Event()
reasons: list[str | None] = []


@pytest.fixture(autouse=True)
def _fresh() -> None:
    global started
    started = asyncio.Event()
    reasons.clear()


@task("close.raises", retry=Retry(3, backoff="1m"))
async def raises(payload: dict, ctx: TaskContext) -> str:
    started.set()
    await ctx.signal.wait()
    reasons.append(ctx.signal.reason)
    await asyncio.sleep(0.02)  # cleanup that takes a moment, still before the lane closes
    ctx.signal.raise_if_aborted()
    return "unreachable"


@task("close.returns")
async def returns(payload: dict, ctx: TaskContext) -> dict:
    started.set()
    await ctx.signal.wait()
    reasons.append(ctx.signal.reason)
    return {"stopped_early": True}


thread_started = threading.Event()


@task("close.thread")
def in_thread(payload: dict, ctx: TaskContext) -> str:
    thread_started.set()
    ctx.signal.wait_sync(10)
    reasons.append(ctx.signal.reason)
    return "saved"


async def _execute(runtime, how: str, definition, queued):
    """One attempt through ``how``; the run it leaves."""
    if how == "execute_next":
        return await runtime.execute_next()
    if how == "run_now":
        return await runtime.run_now(definition, {})
    message = DeliveryMessage(
        environment=queued.environment, run_id=queued.id, queue=queued.queue, requested_at=queued.created_at
    )
    return (await runtime.execute_delivery(message)).run


@pytest.mark.parametrize("how", ["execute_next", "run_now", "execute_delivery"])
async def test_close_stops_a_running_attempt_and_hands_its_run_back_when_its_handler_raises(tmp_path, how):
    """The run is not at fault: it is released to run again at once, spending no attempt of its retry
    budget (the task has none), as a process that crashed would have it run again."""
    path = tmp_path / "close.db"
    runtime = create_runlane(lane=sqlite_lane(path), queues=[DEFAULT_QUEUE], tasks=[raises])
    async with runtime:
        queued = None if how == "run_now" else (await runtime.trigger(raises, {})).run
        pending = asyncio.ensure_future(_execute(runtime, how, raises, queued))
        await asyncio.wait_for(started.wait(), 2)
    assert pending.done()  # close() waited for the attempt
    run = pending.result()
    assert reasons == ["worker_stopped"]
    assert run.status is RunStatus.RELEASED and run.failure is None
    assert (run.counters.failures, run.counters.releases) == (0, 1)
    async with create_runlane(lane=sqlite_lane(path), queues=[DEFAULT_QUEUE], tasks=[raises]) as reopened:
        stored = await reopened.runs.get(run.id)
        assert stored.status is RunStatus.RELEASED and stored.lease is None
        (released,) = (await reopened.runs.events(run.id, types=["run.released"])).data
        assert released.event.reason == "worker_stopped"
        await asyncio.sleep(0.01)  # due 1 ms after it was released
        started.clear()
        rerun = asyncio.ensure_future(reopened.execute_next())
        await asyncio.wait_for(started.wait(), 2)  # the next process runs it again
    assert (await rerun).status is RunStatus.RELEASED  # stopped again by closing that runtime


async def test_a_handler_that_returns_after_close_stopped_it_succeeds(tmp_path):
    path = tmp_path / "close.db"
    runtime = create_runlane(lane=sqlite_lane(path), queues=[DEFAULT_QUEUE], tasks=[returns])
    async with runtime:
        run = (await runtime.trigger(returns, {})).run
        pending = asyncio.ensure_future(runtime.execute_next())
        await asyncio.wait_for(started.wait(), 2)
    done = pending.result()
    assert reasons == ["worker_stopped"]  # a stop, not a cancellation: the handler's outcome stands
    assert done.status is RunStatus.SUCCEEDED and done.output == {"stopped_early": True}
    async with create_runlane(lane=sqlite_lane(path), queues=[DEFAULT_QUEUE], tasks=[returns]) as reopened:
        assert (await reopened.runs.get(run.id)).status is RunStatus.SUCCEEDED


async def test_close_stops_a_def_handler_and_an_attempt_of_a_worker_alike():
    thread_started.clear()
    runtime, _ = make_runtime(in_thread, returns)
    async with runtime:
        await runtime.trigger(returns, {})
        worker = runtime.worker(empty_poll_delay="5ms")
        await asyncio.wait_for(started.wait(), 2)
        pending = asyncio.ensure_future(runtime.run_now(in_thread, {}))
        for _ in range(2000):
            if thread_started.is_set():
                break
            await asyncio.sleep(0.001)
    assert pending.done() and worker.closed.done()
    assert reasons == ["worker_stopped", "worker_stopped"]
    assert pending.result().status is RunStatus.SUCCEEDED and pending.result().output == "saved"
    assert worker.executed == 1


async def test_close_waits_for_an_attempt_of_the_sync_facade():
    runtime, _ = make_runtime(in_thread)
    thread_started.clear()
    results: list = []
    async with runtime:
        await runtime.trigger(in_thread, {})
        caller = threading.Thread(target=lambda: results.append(runtime.sync.execute_next()))
        caller.start()
        for _ in range(2000):
            if thread_started.is_set():
                break
            await asyncio.sleep(0.001)
    await asyncio.to_thread(caller.join, 5)
    assert reasons == ["worker_stopped"]
    assert [run.status for run in results] == [RunStatus.SUCCEEDED]


@pytest.mark.parametrize("how", ["execute_next", "worker", "sync"])
async def test_close_called_by_its_own_handler_is_refused_instead_of_waiting_for_that_handler(how):
    """close() waits for the runtime's attempts: called by one of their handlers it would wait for itself
    (a worker's never ended). It is refused, saying what to do; a task the handler starts may close it."""
    background: list[asyncio.Task] = []

    @task("closes.its.runtime")
    async def closes(payload: dict, ctx: TaskContext) -> str:
        if ctx.source is None:  # the first run; its rerun closes the runtime from a task of its own
            await runtime.close()
        background.append(asyncio.create_task(runtime.close()))  # goes on once the handler returns
        await ctx.signal.wait()
        return "closed in the background"

    @task("closes.sync")
    def closes_sync(payload: dict, ctx: TaskContext) -> str:
        runtime.sync.close()
        return "unreachable"

    runtime, _ = make_runtime(closes, closes_sync)
    await runtime.start()
    run = (await runtime.trigger(closes_sync if how == "sync" else closes, {})).run
    if how == "worker":
        worker = runtime.worker(mode=WorkerMode.DRAIN, max_runs=1)
        await asyncio.wait_for(worker.closed, 10)
        done = await runtime.runs.get(run.id)
    else:
        done = await asyncio.wait_for(runtime.execute_next(), 10)
    assert done.status is RunStatus.FAILED and done.failure.code is ErrorCode.CONFIGURATION_INVALID
    assert not runtime.closed
    if how == "sync":
        await runtime.close()
        return
    again = await runtime.runs.rerun(run.id)
    assert (await asyncio.wait_for(runtime.execute_next(), 10)).output == "closed in the background"
    await asyncio.wait_for(background[0], 10)
    assert runtime.closed and again.source.source_run_id == run.id


@task("close.quick")
async def quick(payload: dict) -> str:
    return "ok"


@pytest.mark.parametrize("how", ["execute_next", "run_now", "execute_delivery"])
async def test_close_waits_for_an_attempt_whose_claim_is_still_being_written(tmp_path, how):
    # close() starts while the call's claim is in flight, at several points of it: the attempt that
    # claim begins is stopped and waited for, never left to write its outcome to a closed lane.
    for spins in range(0, 24, 2):
        path = tmp_path / f"claim_{spins}.db"
        runtime = create_runlane(lane=sqlite_lane(path), queues=[DEFAULT_QUEUE], tasks=[quick])
        await runtime.start()
        queued = None if how == "run_now" else (await runtime.trigger(quick, {})).run
        call = asyncio.ensure_future(_execute(runtime, how, quick, queued))
        for _ in range(spins):
            await asyncio.sleep(0)
        await runtime.close()
        try:
            run = await call
        except RunlaneError as error:  # refused before it claimed anything: the runtime was closing
            assert error.code is ErrorCode.CONFIGURATION_INVALID, (spins, error)
            continue
        if run is None:
            continue
        async with create_runlane(lane=sqlite_lane(path), queues=[DEFAULT_QUEUE], tasks=[quick]) as reader:
            stored = await reader.runs.get(run.id)
        assert stored is not None and stored.status is RunStatus.SUCCEEDED, (spins, stored)


async def test_a_worker_stopped_by_the_handler_it_runs_is_refused_instead_of_waiting_for_that_handler():
    handles: list = []

    @task("stops.its.worker")
    async def stops(payload: dict) -> None:
        await handles[0].stop()

    runtime, _ = make_runtime(stops)
    async with runtime:
        run = (await runtime.trigger(stops, {})).run
        handles.append(runtime.worker(mode=WorkerMode.DRAIN, max_runs=1))
        await asyncio.wait_for(handles[0].closed, 10)
        done = await runtime.runs.get(run.id)
    assert done.status is RunStatus.FAILED and done.failure.code is ErrorCode.CONFIGURATION_INVALID
