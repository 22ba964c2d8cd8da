"""Workers: drain and poll loops, concurrency slots, ``max_runs``, wake-ups, stop and failures."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest

from runlane import (
    CancellationController,
    ErrorCode,
    RunlaneError,
    RunEventType,
    RunStatus,
    TaskContext,
    TaskDefinition,
    WorkerMode,
    queue,
    task,
)

import runlane.core.store as core_store
from runlane.testing import wait_for_run_status
from runtime_support import DEFAULT_QUEUE, make_runtime

executed: list[int] = []


@task("count")
async def count(payload: dict) -> int:
    executed.append(payload["n"])
    return payload["n"]


@pytest.fixture(autouse=True)
def _reset():
    executed.clear()


async def test_drain_executes_due_work_and_exits():
    runtime, _ = make_runtime(count)
    async with runtime:
        for n in range(10):
            await runtime.trigger(count, {"n": n})
        seen = []
        worker = runtime.worker(mode=WorkerMode.DRAIN, concurrency=3, on_run_executed=seen.append)
        assert worker.closed is worker.closed
        await asyncio.wait_for(worker.closed, 5)
        assert sorted(executed) == list(range(10))
        assert worker.executed == 10 and len(seen) == 10
        assert all(run.status is RunStatus.SUCCEEDED for run in seen)
        # An empty drain returns at once.
        await asyncio.wait_for(runtime.worker(mode=WorkerMode.DRAIN).closed, 1)


async def _trigger_due_before_the_backlog(runtime, clock) -> None:
    """Two runs due now, the first executed (the next scans of the queue start at it), then one run
    due a minute earlier, as a producer whose clock is behind would trigger it."""
    for n in (1, 2):
        await runtime.trigger(count, {"n": n})
        clock.advance(timedelta(milliseconds=1))
    assert (await runtime.execute_next()).payload == {"n": 1}
    now = clock.now()
    clock.set(now - timedelta(minutes=1))
    await runtime.trigger(count, {"n": 0})
    clock.set(now)


async def test_a_run_due_before_the_scanned_backlog_is_executed_before_the_queue_is_idle():
    runtime, clock = make_runtime(count)
    async with runtime:
        await _trigger_due_before_the_backlog(runtime, clock)
        assert (await runtime.execute_next()).payload == {"n": 2}
        # Nothing is left at or after where the scans start: the queue is read from its start.
        assert (await runtime.execute_next()).payload == {"n": 0}
        assert await runtime.execute_next() is None

        await _trigger_due_before_the_backlog(runtime, clock)
        worker = runtime.worker(mode=WorkerMode.DRAIN)
        await asyncio.wait_for(worker.closed, 5)
        assert worker.executed == 2 and executed == [1, 2, 0, 1, 2, 0]


async def test_after_an_idle_scan_scans_start_a_second_before_it():
    runtime, clock = make_runtime(count)
    async with runtime:
        assert await runtime.execute_next() is None  # the whole queue read: nothing due
        now = clock.now()
        clock.set(now - timedelta(milliseconds=900))  # a producer's clock a little behind: still in order
        await runtime.trigger(count, {"n": 1})
        clock.set(now - timedelta(minutes=1))  # one far behind: below where the scans start
        await runtime.trigger(count, {"n": 0})
        clock.set(now)
        await runtime.trigger(count, {"n": 2})
        assert [(await runtime.execute_next()).payload["n"] for _ in range(3)] == [1, 2, 0]
        assert await runtime.execute_next() is None


async def test_scans_read_the_whole_queue_again_after_a_second(monkeypatch):
    runtime, clock = make_runtime(count)
    async with runtime:
        await _trigger_due_before_the_backlog(runtime, clock)
        monkeypatch.setattr(core_store._RunnableFloors, "FULL_SCAN_AFTER", 0.0)  # the second has passed
        assert (await runtime.execute_next()).payload == {"n": 0}  # the oldest due run first again
        assert (await runtime.execute_next()).payload == {"n": 2}


async def _until(condition, timeout: float = 5.0) -> None:
    deadline = time.perf_counter() + timeout
    while not condition():
        assert time.perf_counter() < deadline, "timed out waiting"
        await asyncio.sleep(0.002)


async def test_an_idle_poll_worker_reads_the_whole_queue_once_a_second(monkeypatch):
    """An idle poll worker looks at its queue from where its last scan found a run (every look at the
    whole queue would step over every claimed row not yet vacuumed); a run due before that point is
    found by the full scan a second after the last one."""
    monkeypatch.setattr(core_store._RunnableFloors, "FULL_SCAN_AFTER", 3600.0)
    runtime, clock = make_runtime(count)
    async with runtime:
        worker = runtime.worker(empty_poll_delay="5ms")
        await runtime.trigger(count, {"n": 1})
        await _until(lambda: executed == [1])
        now = clock.now()
        clock.set(now - timedelta(minutes=1))
        await runtime.trigger(count, {"n": 0})
        clock.set(now)
        await asyncio.sleep(0.05)  # about ten looks, each from the floor
        assert executed == [1]
        monkeypatch.setattr(core_store._RunnableFloors, "FULL_SCAN_AFTER", 0.0)
        await _until(lambda: executed == [1, 0])
        await asyncio.wait_for(worker.stop(), 2)


@pytest.mark.parametrize("concurrency", [1, 4])
async def test_max_runs_counts_only_executed_runs_and_is_never_exceeded(concurrency):
    runtime, _ = make_runtime(count)
    async with runtime:
        for n in range(10):
            await runtime.trigger(count, {"n": n})
        worker = runtime.worker(mode=WorkerMode.DRAIN, concurrency=concurrency, max_runs=3)
        await asyncio.wait_for(worker.closed, 5)
        assert worker.executed == 3 and len(executed) == 3


async def test_slots_run_attempts_concurrently():
    active = 0
    peak = 0
    gate = asyncio.Event()

    @task("overlap")
    async def overlap(payload: dict) -> None:
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        if peak == 4:
            gate.set()
        await asyncio.wait_for(gate.wait(), 2)
        active -= 1

    runtime, _ = make_runtime(overlap)
    async with runtime:
        for _ in range(8):
            await runtime.trigger(overlap, {})
        await asyncio.wait_for(runtime.worker(mode=WorkerMode.DRAIN, concurrency=4).closed, 5)
        assert peak == 4


async def test_every_slot_runs_a_sync_handler_at_once_beyond_the_default_executor_size():
    # The loop's default executor stops at min(32, CPUs + 4) threads: 6 on a 2-core machine.
    slots = (os.cpu_count() or 1) + 8
    together = threading.Barrier(slots, timeout=5)
    threads: set[str] = set()

    @task("sync.together")
    def meet(payload: dict) -> None:
        threads.add(threading.current_thread().name)
        together.wait()  # breaks (and the run fails) unless every slot's handler runs at the same time

    runtime, _ = make_runtime(meet)
    async with runtime:
        for _ in range(slots):
            await runtime.trigger(meet, {})
        await asyncio.wait_for(runtime.worker(mode=WorkerMode.DRAIN, concurrency=slots).closed, 10)
        runs = (await runtime.runs.list(limit=100)).data
        assert [run.status for run in runs] == [RunStatus.SUCCEEDED] * slots
    assert len(threads) == slots and all(name.startswith("runlane-handler") for name in threads)


async def test_a_handler_that_blocks_the_event_loop_is_reported(caplog):
    @task("blocks.loop")
    async def blocks(payload: dict) -> None:
        time.sleep(0.15)  # a blocking call in an async handler: nothing else on the loop runs meanwhile
        await asyncio.sleep(0)

    @task("awaits")
    async def awaits(payload: dict) -> None:
        await asyncio.sleep(0.15)  # the same wait, but the loop keeps running

    runtime, _ = make_runtime(blocks, awaits)
    caplog.set_level(logging.WARNING, logger="runlane")
    async with runtime:
        blocked = (await runtime.trigger(blocks, {})).run.id
        await runtime.execute_next(heartbeat_interval="60ms")  # so a heartbeat 30 ms late is reported
        [record] = [item for item in caplog.records if item.name == "runlane.worker"]
        assert record.run_id == blocked and record.blocked_seconds >= 0.06
        assert record.getMessage().startswith("The event loop was blocked for about ")
        assert "asyncio.to_thread()" in record.getMessage()

        caplog.clear()
        await runtime.trigger(awaits, {})
        await runtime.execute_next(heartbeat_interval="60ms")
        assert [item for item in caplog.records if item.name == "runlane.worker"] == []


async def test_one_blocked_loop_is_reported_once_naming_the_async_handlers_running_not_per_attempt(caplog):
    started = threading.Semaphore(0)
    released = threading.Event()

    @task("blocks.loop")
    async def blocks(payload: dict) -> None:
        for _ in range(2):  # the other two attempts are running (and heartbeating) before the loop is held
            assert started.acquire(timeout=5)
        time.sleep(0.15)  # a blocking call in an async handler: every heartbeat due meanwhile is delayed
        released.set()

    @task("awaits")
    async def awaits(payload: dict) -> None:
        started.release()
        await asyncio.wait_for(asyncio.to_thread(released.wait, 5), 10)

    @task("sync.waits")
    def sync_waits(payload: dict) -> None:  # runs on a thread: it cannot block the loop
        started.release()
        released.wait(5)

    runtime, _ = make_runtime(blocks, awaits, sync_waits)
    caplog.set_level(logging.WARNING, logger="runlane")
    async with runtime:
        for handler in (awaits, sync_waits, blocks):
            await runtime.trigger(handler, {})
        worker = runtime.worker(mode=WorkerMode.DRAIN, concurrency=3, heartbeat_interval="60ms")
        await asyncio.wait_for(worker.closed, 10)
        assert [run.status for run in (await runtime.runs.list()).data] == [RunStatus.SUCCEEDED] * 3
    [record] = [item for item in caplog.records if item.name == "runlane.worker"]
    message = record.getMessage()
    assert message.startswith("The event loop was blocked for about ") and "logged once for all of them" in message
    running = message.split("The async def handlers running in this process then: ")[1].split(";")[0]
    assert re.fullmatch(r"awaits \(run \w+\), blocks\.loop \(run \w+\)", running)  # not sync.waits


async def test_a_loop_blocked_by_other_code_than_a_handler_is_not_blamed_on_a_handler(caplog):
    started = threading.Event()
    released = threading.Event()

    @task("sync.waits")
    def sync_waits(payload: dict) -> None:  # runs on a thread: it cannot block the loop
        started.set()
        released.wait(5)

    runtime, _ = make_runtime(sync_waits)
    caplog.set_level(logging.WARNING, logger="runlane")
    async with runtime:
        await runtime.trigger(sync_waits, {})
        attempt = asyncio.ensure_future(runtime.execute_next(heartbeat_interval="60ms"))
        assert await asyncio.to_thread(started.wait, 5)
        time.sleep(0.15)  # the application's own blocking call on the loop
        released.set()
        assert (await asyncio.wait_for(attempt, 10)).status is RunStatus.SUCCEEDED
    [record] = [item for item in caplog.records if item.name == "runlane.worker"]
    assert "No async def handler was running: other code on the loop blocked it" in record.getMessage()


async def test_poll_worker_is_woken_by_a_trigger_in_this_process():
    runtime, _ = make_runtime(count)
    async with runtime:
        worker = runtime.worker(empty_poll_delay="10s")
        await asyncio.sleep(0.01)  # the slot is idle, waiting
        started = time.perf_counter()
        await runtime.trigger(count, {"n": 1})
        while not executed:
            await asyncio.sleep(0.001)
            assert time.perf_counter() - started < 1, "the trigger did not wake the idle poll slot"
        await asyncio.wait_for(worker.stop(), 2)
        assert worker.closed.done()


async def test_poll_worker_finds_work_that_became_due_without_a_wake_up():
    @task("release.once")
    async def once(payload: dict, ctx: TaskContext):
        if ctx.attempt == 1:
            return ctx.release("1s")
        return "again"

    runtime, clock = make_runtime(once)
    async with runtime:
        run = await runtime.run_now(once, {})
        assert run.status is RunStatus.RELEASED
        worker = runtime.worker(empty_poll_delay="5ms", concurrency=2)
        await asyncio.sleep(0.02)
        assert worker.executed == 0
        clock.advance("1s")  # due now, with no trigger to wake the slots: the next poll finds it
        deadline = time.perf_counter() + 1
        while (await runtime.runs.get(run.id)).status is not RunStatus.SUCCEEDED:
            assert time.perf_counter() < deadline
            await asyncio.sleep(0.002)
        await worker.stop()
        assert worker.executed == 1


async def test_stopping_with_the_worker_signal():
    runtime, _ = make_runtime(count)
    async with runtime:
        controller = CancellationController()
        worker = runtime.worker(signal=controller.signal, empty_poll_delay="1s")
        await asyncio.sleep(0.005)
        controller.abort("deploy")
        await asyncio.wait_for(worker.closed, 2)
        # An already aborted signal starts a worker that exits at once.
        stopped = runtime.worker(signal=controller.signal)
        await asyncio.wait_for(stopped.closed, 2)


async def test_a_run_whose_handler_raises_on_the_worker_signal_is_handed_back_as_on_stop():
    reasons: list[str | None] = []

    @task("waits.for.stop")
    async def waits(payload: dict, ctx: TaskContext) -> None:
        await ctx.signal.wait()
        reasons.append(ctx.signal.reason)
        ctx.signal.raise_if_aborted()

    runtime, _ = make_runtime(waits)
    async with runtime:
        run = (await runtime.trigger(waits, {})).run
        controller = CancellationController()
        worker = runtime.worker(signal=controller.signal)
        await wait_for_run_status(runtime, run.id, RunStatus.RUNNING, timeout="10s", interval="1ms")
        controller.abort("deploy")  # a process's shutdown wired to the worker's signal
        await asyncio.wait_for(worker.closed, 2)
        stored = await runtime.runs.get(run.id)
        # Not failed (its one attempt spent): released to run again at once, as worker.stop() has it.
        assert (stored.status, stored.failure, stored.counters.failures) == (RunStatus.RELEASED, None, 0)
        assert reasons == ["worker_stopped"]


async def test_a_failing_callback_fails_the_worker_through_closed():
    runtime, _ = make_runtime(count)
    async with runtime:
        await runtime.trigger(count, {"n": 1})

        def explode(run):
            raise ValueError("callback bug")

        worker = runtime.worker(mode=WorkerMode.DRAIN, on_run_executed=explode)
        with pytest.raises(ValueError, match="callback bug"):
            await asyncio.wait_for(worker.closed, 2)
        with pytest.raises(ValueError):
            await worker.stop()


@pytest.mark.parametrize("stop_how", ["worker.stop()", "runlane.close()"])
async def test_stopping_from_the_workers_own_callback_is_refused_instead_of_hanging(stop_how):
    runtime, _ = make_runtime(count)
    async with runtime:
        await runtime.trigger(count, {"n": 1})
        worker: Any = None

        async def stop_after_one(run):
            await (worker.stop() if stop_how == "worker.stop()" else runtime.close())

        worker = runtime.worker(on_run_executed=stop_after_one)
        with pytest.raises(RunlaneError, match=re.escape(f"{stop_how} was called by the")):
            await asyncio.wait_for(worker.closed, 2)
        assert worker.executed == 1

        # Started in a task of its own, the stop goes on once the callback has returned.
        stops: list[asyncio.Task[None]] = []
        second = runtime.worker(on_run_executed=lambda run: stops.append(asyncio.create_task(second.stop())))
        await runtime.trigger(count, {"n": 2})
        await asyncio.wait_for(second.closed, 2)
        await asyncio.wait_for(stops[0], 2)


async def test_a_wait_for_closed_that_times_out_leaves_the_worker_running_and_stoppable():
    entered = asyncio.Event()

    @task("slow.once")
    async def slow_once(payload: dict) -> str:
        entered.set()
        await asyncio.sleep(0.05)
        return "done"

    runtime, _ = make_runtime(slow_once)
    await runtime.start()
    run = (await runtime.trigger(slow_once, {})).run
    worker = runtime.worker()
    closed = worker.closed
    assert worker.closed is closed  # the same future on every read
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(worker.closed, 0.001)  # cancels the future it waited for
    await asyncio.wait_for(entered.wait(), 2)
    assert "running" in repr(worker) and not worker.closed.done()
    # stop() still waits for the attempt, and closing the runtime neither raises nor leaves the lane open.
    await asyncio.wait_for(worker.stop(), 2)
    assert (await runtime.runs.get(run.id)).status is RunStatus.SUCCEEDED
    assert worker.closed.done() and worker.closed.exception() is None
    await asyncio.wait_for(runtime.close(), 2)


async def test_closing_the_runtime_stops_its_workers():
    runtime, _ = make_runtime(count)
    await runtime.start()
    worker = runtime.worker(concurrency=2)
    await asyncio.sleep(0.005)
    await asyncio.wait_for(runtime.close(), 2)
    assert worker.closed.done() and worker.closed.exception() is None


async def test_drain_waits_for_capacity_held_by_its_own_slots():
    limited = queue("limited", concurrency_limit=1)
    active = 0
    peak = 0

    @task("limited.work", queue=limited)
    async def limited_work(payload: dict) -> None:
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        await asyncio.sleep(0.002)
        active -= 1

    runtime, _ = make_runtime(limited_work, queues=[DEFAULT_QUEUE, limited])
    async with runtime:
        for _ in range(5):
            await runtime.trigger(limited_work, {})
        worker = runtime.worker(mode=WorkerMode.DRAIN, concurrency=3)
        await asyncio.wait_for(worker.closed, 5)
        assert worker.executed == 5 and peak == 1


@pytest.mark.parametrize(
    "options",
    [
        {"concurrency": 0},
        {"concurrency": True},
        {"mode": "sometimes"},
        {"mode": WorkerMode.DRAIN, "empty_poll_delay": "1s"},
        {"mode": WorkerMode.POLL, "max_runs": 3},
        {"mode": WorkerMode.DRAIN, "max_runs": 0},
        {"queues": ["unknown"]},
        {"queues": []},
        {"on_run_executed": "print"},
        {"empty_poll_delay": "later"},
    ],
)
async def test_worker_options_are_validated(options):
    runtime, _ = make_runtime(count)
    async with runtime:
        with pytest.raises(RunlaneError) as raised:
            runtime.worker(**options)
        assert raised.value.code is ErrorCode.CONFIGURATION_INVALID


def test_worker_needs_a_running_loop():
    runtime, _ = make_runtime(count)
    with pytest.raises(RunlaneError, match="sync.worker"):
        runtime.worker()


class _HintingDriver:
    """Wraps a storage driver with wake hints recorded in memory (as another process would see them)."""

    def __init__(self, storage):
        self._storage = storage
        self.published: list[str] = []
        self.subscribers: list = []

    def __getattr__(self, name):
        return getattr(self._storage, name)

    def publish_wake_hint(self, queue: str) -> None:
        self.published.append(queue)

    def subscribe_wake_hints(self, callback):
        self.subscribers.append(callback)
        return lambda: self.subscribers.remove(callback)


async def test_wake_hints_are_published_on_trigger_and_wake_an_idle_poll_worker():
    from runlane import create_lane
    from runlane.core.lanes import LaneDelivery
    from runlane.vocabulary import LaneDeliveryMode
    from runlane_local import local_storage_driver
    from runlane import create_runlane

    driver = _HintingDriver(local_storage_driver())
    lane = create_lane(storage=driver, delivery=LaneDelivery(mode=LaneDeliveryMode.STORAGE_POLLING), name="hinted")
    producer = create_runlane(lane=lane, queues=[DEFAULT_QUEUE], tasks=[count])
    async with producer:
        worker = producer.worker(mode=WorkerMode.POLL, empty_poll_delay="1h")
        await asyncio.sleep(0.05)
        assert len(driver.subscribers) == 1
        # A trigger elsewhere: the record lands in storage without this process's local signal.
        await producer.trigger(count, {"n": 1})
        assert driver.published == ["default"]
        for _ in range(200):
            if executed:
                break
            await asyncio.sleep(0.01)
        assert executed == [1]
        await worker.stop()
    assert driver.subscribers == []


async def test_hint_from_another_process_wakes_an_idle_poll_worker_before_its_delay():
    from runlane import create_lane, create_runlane
    from runlane.core.lanes import LaneDelivery
    from runlane.vocabulary import LaneDeliveryMode
    from runlane_local import LocalStorageStore, local_storage_driver

    store = LocalStorageStore()
    worker_driver = _HintingDriver(local_storage_driver(store=store))
    polling = LaneDelivery(mode=LaneDeliveryMode.STORAGE_POLLING)
    worker_side = create_runlane(
        lane=create_lane(storage=worker_driver, delivery=polling, name="w"), queues=[DEFAULT_QUEUE], tasks=[count]
    )
    producer = create_runlane(
        lane=create_lane(storage=local_storage_driver(store=store), delivery=polling, name="p"),
        queues=[DEFAULT_QUEUE],
        tasks=[count],
    )
    async with worker_side, producer:
        worker = worker_side.worker(mode=WorkerMode.POLL, empty_poll_delay="1h")
        await asyncio.sleep(0.05)  # the slot scanned once and now sleeps for an hour
        await producer.trigger(count, {"n": 7})
        await asyncio.sleep(0.1)
        assert executed == []  # nothing tells this process yet
        for callback in worker_driver.subscribers:
            callback("default")  # the hint another process published
        for _ in range(200):
            if executed:
                break
            await asyncio.sleep(0.01)
        assert executed == [7]
        await worker.stop()


async def test_poll_worker_rides_out_storage_outage_and_continues(caplog):
    runtime, _ = make_runtime(count)
    async with runtime:
        worker = runtime.worker(mode=WorkerMode.POLL, empty_poll_delay="10ms")
        await asyncio.sleep(0.03)
        storage = runtime.lane.storage
        with caplog.at_level("WARNING", logger="runlane.worker"):
            await storage.close()  # every storage call now fails with storage_unavailable
            for _ in range(200):
                if worker.storage_errors >= 2:
                    break
                await asyncio.sleep(0.01)
            assert worker.storage_errors >= 2
            assert worker.last_error is not None and worker.last_error.code is ErrorCode.STORAGE_UNAVAILABLE
            assert not worker.closed.done()
            await storage.start()
            await runtime.trigger(count, {"n": 3})
            for _ in range(300):
                if executed:
                    break
                await asyncio.sleep(0.01)
        assert executed == [3]
        messages = [record.getMessage() for record in caplog.records]
        assert any("storage failed (storage_unavailable" in message for message in messages)
        assert any("reachable again" in message for message in messages)
        await worker.stop()


async def test_a_drain_worker_fails_once_storage_stays_unavailable(monkeypatch, caplog):
    import runlane.core.runtime as runtime_module

    monkeypatch.setattr(runtime_module, "DRAIN_OUTAGE_LIMIT_S", 0.3)
    runtime, _ = make_runtime(count)
    async with runtime:
        await runtime.lane.storage.close()  # every storage call now fails with storage_unavailable
        drain = runtime.worker(mode=WorkerMode.DRAIN)
        with caplog.at_level("WARNING", logger="runlane.worker"), pytest.raises(RunlaneError) as raised:
            await asyncio.wait_for(drain.closed, 5)  # a drain is a job meant to end: it does not wait forever
        assert raised.value.code is ErrorCode.STORAGE_UNAVAILABLE and drain.storage_errors > 1
        assert "a drain gives up after 0.3s without storage" in caplog.text
        # A poll worker keeps waiting it out (covered above); storage back, a drain works again.
        await runtime.lane.storage.start()
        await asyncio.wait_for(runtime.worker(mode=WorkerMode.DRAIN).closed, 5)


@dataclass
class Held:
    """A task whose handler says it ``started``, waits for ``finish``, records ``ctx.signal.reason`` (``None``
    when it was never aborted) in ``calls`` and returns ``"done"``: an attempt held open while a test
    takes storage away."""

    task: TaskDefinition
    started: asyncio.Event
    finish: asyncio.Event
    calls: list[str | None]


def held_task(task_id: str) -> Held:
    started, finish, calls = asyncio.Event(), asyncio.Event(), []

    @task(task_id)
    async def held(payload: dict, ctx: TaskContext) -> str:
        started.set()
        await finish.wait()
        calls.append(ctx.signal.reason)
        return "done"

    return Held(held, started, finish, calls)


async def start_held(runtime, held: Held, **worker_options):
    """Trigger ``held``'s task and start a worker; returns the run and the worker once the handler runs."""
    run = (await runtime.trigger(held.task, {})).run
    worker = runtime.worker(**worker_options)
    await asyncio.wait_for(held.started.wait(), 2)
    return run, worker


async def start_held_in_poll_worker(runtime, held: Held):
    """``start_held`` in a poll worker that heartbeats every 10 ms under a one-minute lease."""
    return await start_held(runtime, held, mode=WorkerMode.POLL, heartbeat_interval="10ms", lease_duration="1m")


async def test_an_outage_during_an_attempt_neither_aborts_it_nor_loses_its_outcome(caplog):
    # Storage goes away while the handler runs (heartbeats fail) and is still away when it returns
    # (the outcome write fails). The worker's attempt keeps going and writes its outcome once storage
    # is back, within its lease: the handler ran once and its result is recorded.
    held = held_task("outlives.outage")
    runtime, _ = make_runtime(held.task)
    async with runtime:
        run, worker = await start_held_in_poll_worker(runtime, held)
        storage = runtime.lane.storage
        with caplog.at_level("WARNING", logger="runlane.worker"):
            await storage.close()  # every storage call now fails with storage_unavailable
            await asyncio.sleep(0.1)  # several heartbeats fail meanwhile
            held.finish.set()
            await asyncio.sleep(0.1)  # the outcome write fails too
            await storage.start()
            # The outcome write's next retry comes within its backoff (at most 2 s).
            done = await wait_for_run_status(runtime, run.id, RunStatus.SUCCEEDED, timeout="10s")
        assert done.output == "done"
        assert held.calls == [None]  # never aborted, and executed once
        assert worker.executed == 1
        messages = [record.getMessage() for record in caplog.records]
        assert any("writing the heartbeat of attempt 1; retrying while its lease holds" in m for m in messages)
        assert any("the outcome of attempt 1 was written" in m for m in messages)
        await worker.stop()


async def test_a_drain_gives_up_an_outcome_write_after_its_outage_limit_not_after_the_lease(monkeypatch, caplog):
    # A scheduled drain must end soon after storage goes away, also when that happens mid-attempt: its
    # outcome write used to be retried for the whole lease (5 minutes by default).
    import runlane.core.runtime as runtime_module

    monkeypatch.setattr(runtime_module, "DRAIN_OUTAGE_LIMIT_S", 0.3)
    held = held_task("drain.outage")
    runtime, _ = make_runtime(held.task)
    async with runtime:
        run, drain = await start_held(runtime, held, mode=WorkerMode.DRAIN, lease_duration="1h")
        storage = runtime.lane.storage
        with caplog.at_level("WARNING", logger="runlane"):
            await storage.close()  # every storage call now fails with storage_unavailable
            held.finish.set()
            with pytest.raises(RunlaneError) as raised:
                await asyncio.wait_for(drain.closed, 10)
        assert raised.value.code is ErrorCode.STORAGE_UNAVAILABLE
        gave_up = [
            record
            for record in caplog.records
            if record.name == "runlane.task" and "gave up writing the outcome" in record.getMessage()
        ]
        assert len(gave_up) == 1 and gave_up[0].run_id == run.id
        assert "the run stays running until its lease expires" in gave_up[0].getMessage()
        await storage.start()
        assert (await runtime.runs.get(run.id)).status is RunStatus.RUNNING  # lease recovery runs it again


async def test_a_drain_that_loses_storage_mid_attempt_gives_up_after_one_outage_limit_not_two(monkeypatch):
    # The outcome write and the claim loop wait out one outage between them: the loop's clock starts
    # when the attempt first found storage gone, not when the attempt gave up its outcome write.
    import runlane.core.runtime as runtime_module

    limit = 2.0
    monkeypatch.setattr(runtime_module, "DRAIN_OUTAGE_LIMIT_S", limit)
    held = held_task("drain.one.limit")
    runtime, _ = make_runtime(held.task)
    async with runtime:
        run, drain = await start_held(runtime, held, mode=WorkerMode.DRAIN, lease_duration="1h")
        storage = runtime.lane.storage
        await storage.close()  # every storage call now fails with storage_unavailable
        lost_at = time.monotonic()
        held.finish.set()
        with pytest.raises(RunlaneError) as raised:
            await asyncio.wait_for(drain.closed, 4 * limit)
        elapsed = time.monotonic() - lost_at
        assert raised.value.code is ErrorCode.STORAGE_UNAVAILABLE
        # Its outcome write alone gives up before the limit; the drain itself ends once it has passed.
        assert limit <= elapsed < 1.5 * limit, elapsed
        await storage.start()
        assert (await runtime.runs.get(run.id)).status is RunStatus.RUNNING  # lease recovery runs it again


async def test_a_drain_does_not_give_up_on_an_outage_that_ended_while_a_handler_ran_on(monkeypatch):
    # The heartbeats give up after the limit, but the handler ignores its signal and returns only once
    # storage is back: the drain looks at storage itself before ending on that old outage, and goes on.
    import runlane.core.runtime as runtime_module

    monkeypatch.setattr(runtime_module, "DRAIN_OUTAGE_LIMIT_S", 0.3)
    held = held_task("drain.old.outage")
    runtime, _ = make_runtime(held.task)
    async with runtime:
        run, drain = await start_held(
            runtime, held, mode=WorkerMode.DRAIN, heartbeat_interval="10ms", lease_duration="1h"
        )
        storage = runtime.lane.storage
        await storage.close()
        await asyncio.sleep(0.6)  # the heartbeats fail for longer than the limit, and give up
        await storage.start()
        held.finish.set()
        await asyncio.wait_for(drain.closed, 5)
        assert held.calls == ["heartbeat_failed"] and drain.storage_errors == 1
        assert (await runtime.runs.get(run.id)).status is RunStatus.RUNNING  # lease recovery runs it again


async def test_a_worker_stopped_during_a_short_outage_still_writes_the_outcome_of_a_finished_handler(caplog):
    # A rolling deploy stops the worker while storage is briefly away and a handler has just returned:
    # the outcome is written once storage answers, instead of being dropped and the handler run again.
    held = held_task("stop.outage")
    runtime, _ = make_runtime(held.task)
    async with runtime:
        run, worker = await start_held_in_poll_worker(runtime, held)
        storage = runtime.lane.storage
        await storage.close()
        held.finish.set()
        await asyncio.sleep(0.1)  # the outcome write fails and is retried
        stopped = asyncio.ensure_future(worker.stop())
        await asyncio.sleep(0.1)
        await storage.start()
        await asyncio.wait_for(stopped, 10)
        done = await runtime.runs.get(run.id)
        assert done.status is RunStatus.SUCCEEDED and done.output == "done"
        assert held.calls == [None]  # returned before the stop, and ran once


async def test_execute_next_still_reports_an_outage_to_its_caller():
    held = held_task("reports.outage")
    runtime, _ = make_runtime(held.task)
    async with runtime:
        await runtime.trigger(held.task, {})
        pending = asyncio.ensure_future(runtime.execute_next(heartbeat_interval="1h", lease_duration="2h"))
        await asyncio.wait_for(held.started.wait(), 2)
        await runtime.lane.storage.close()
        held.finish.set()
        with pytest.raises(RunlaneError) as raised:
            await asyncio.wait_for(pending, 2)
        assert raised.value.code is ErrorCode.STORAGE_UNAVAILABLE
        await runtime.lane.storage.start()


async def test_poll_worker_still_stops_on_a_non_transient_error():
    runtime, _ = make_runtime(count)
    async with runtime:
        async def broken(*args, **kwargs):
            raise RunlaneError(ErrorCode.INVARIANT_VIOLATION, "corrupt")

        runtime.execute_one = broken  # type: ignore[method-assign]
        worker = runtime.worker(mode=WorkerMode.POLL, empty_poll_delay="10ms")
        with pytest.raises(RunlaneError) as raised:
            await asyncio.wait_for(worker.closed, 5)
        assert raised.value.code is ErrorCode.INVARIANT_VIOLATION


async def test_a_worker_as_the_first_call_starts_the_lane(tmp_path):
    # On a durable lane nothing else may have started the runtime: the worker must, as every other
    # call does, instead of retrying against a driver that was never started.
    from runlane import create_runlane
    from runlane_local import sqlite_lane

    path = tmp_path / "runlane.db"
    async with create_runlane(lane=sqlite_lane(path), queues=[DEFAULT_QUEUE], tasks=[count]) as producer:
        await producer.trigger(count, {"n": 7})
    runtime = create_runlane(lane=sqlite_lane(path), queues=[DEFAULT_QUEUE], tasks=[count])
    try:
        worker = runtime.worker(mode=WorkerMode.DRAIN)
        await asyncio.wait_for(worker.closed, 10)
        assert worker.executed == 1 and worker.storage_errors == 0 and executed == [7]
    finally:
        await runtime.close()


async def test_the_idle_slots_of_a_poll_worker_share_one_scan_per_poll_delay(monkeypatch):
    # A bounded queue takes the scan-then-claim path: idle slots scanned once each per poll delay, so an
    # idle worker of 16 slots cost storage 16 scans per delay (thousands of transactions a minute).
    gateway = queue("idle.gateway", concurrency_limit=4)

    @task("idle.call", queue=gateway)
    async def call(payload: dict) -> None:
        return None

    @task("idle.stagger")
    async def stagger(payload: dict) -> None:
        await asyncio.sleep(payload["ms"] / 1000)  # slots go idle at different moments, as in production

    runtime, _ = make_runtime(call, stagger, queues=[DEFAULT_QUEUE, gateway])
    scans = 0
    original = core_store.CoreStore.list_runnable

    async def counting(self, *args, **kwargs):
        nonlocal scans
        scans += 1
        return await original(self, *args, **kwargs)

    monkeypatch.setattr(core_store.CoreStore, "list_runnable", counting)
    async with runtime:
        for n in range(8):
            await runtime.trigger(stagger, {"ms": 2.5 * n})
        worker = runtime.worker(mode=WorkerMode.POLL, concurrency=8, empty_poll_delay="20ms")
        await asyncio.sleep(0.1)  # every slot has run one and polled since, finding nothing
        scans = 0
        started = time.monotonic()
        await asyncio.sleep(0.5)
        idle_scans, elapsed = scans, time.monotonic() - started
        run = (await runtime.trigger(call, {})).run  # a wake-up still reaches an idle worker at once
        await wait_for_run_status(runtime, run.id, RunStatus.SUCCEEDED, timeout="5s")
        await worker.stop()
    # About one scan per 20 ms between the eight slots (eight per 20 ms before).
    assert idle_scans <= 2 * elapsed / 0.02 + 4, (idle_scans, elapsed)


async def test_a_run_whose_handler_raises_on_the_workers_stop_runs_again_and_is_not_failed():
    """A deploy's SIGTERM, a reload: the handler stops as the docs show (raise_if_aborted). The run is
    not at fault, so even without a retry policy it runs again on the next worker instead of failing,
    as it would after the process crashed."""
    attempts: list[int] = []
    started = asyncio.Event()

    @task("exports.nightly")  # no retry policy
    async def nightly(payload: dict, ctx: TaskContext) -> str:
        attempts.append(ctx.attempt)
        started.set()
        if ctx.attempt == 1:
            await ctx.signal.wait()
            ctx.signal.raise_if_aborted()
        return "exported"

    runtime, clock = make_runtime(nightly)
    async with runtime:
        run = (await runtime.trigger(nightly, {})).run
        worker = runtime.worker(mode=WorkerMode.POLL, empty_poll_delay="10ms")
        await asyncio.wait_for(started.wait(), 5)
        await asyncio.wait_for(worker.stop(), 5)
        stopped = await runtime.runs.get(run.id)
        assert stopped.status is RunStatus.RELEASED and stopped.failure is None
        clock.advance("1ms")
        done = await runtime.execute_next()
        assert done.status is RunStatus.SUCCEEDED and done.output == "exported"
        assert attempts == [1, 2] and (done.counters.failures, done.counters.releases) == (0, 1)


async def test_a_run_claimed_after_the_workers_stop_is_handed_back_without_starting_its_handler(tmp_path):
    """SIGTERM while a claim waits for a busy SQLite file: the claim commits after the stop. The worker
    has stopped claiming, so the run goes back at once (released: worker_stopped) for a worker still up,
    instead of starting a handler that may outlast the process manager's stop timeout."""
    import sqlite3

    from runlane import create_runlane
    from runlane_local import sqlite_lane

    path = tmp_path / "runlane.db"
    runtime = create_runlane(lane=sqlite_lane(path, busy_timeout="30s"), queues=[DEFAULT_QUEUE], tasks=[count])
    async with runtime:
        run = (await runtime.trigger(count, {"n": 1})).run
        locker = sqlite3.connect(path, isolation_level=None)
        try:
            locker.execute("BEGIN IMMEDIATE")  # another process's long write: every claim waits for it
            worker = runtime.worker(mode=WorkerMode.POLL, empty_poll_delay="10ms")
            await asyncio.sleep(2.0)  # the worker found the run and its claim waits for the lock
            worker.request_stop()
            locker.execute("ROLLBACK")
        finally:
            locker.close()
        await asyncio.wait_for(worker.closed, 10)
        handed_back = await runtime.runs.get(run.id)
        (released,) = (await runtime.runs.events(run.id, types=["run.released"])).data
    assert executed == []
    assert handed_back.status is RunStatus.RELEASED and handed_back.failure is None
    assert (handed_back.counters.attempts, handed_back.counters.failures) == (1, 0)
    assert released.event.reason == "worker_stopped"


@pytest.mark.parametrize("kind", ["async", "def"])
async def test_a_durable_step_rides_out_a_short_outage_instead_of_running_its_side_effect_again(kind: str):
    """The step's read and its stored output are retried through an outage while the lease holds, as the
    heartbeats and the outcome are: failing the attempt would run the one-time side effect again on the
    retry (or fail a task without retries outright)."""
    charged: list[int] = []
    storage_down = asyncio.Event()

    def charge(token: str) -> dict:
        charged.append(len(charged) + 1)
        storage_down.set()  # the database goes away while the provider call runs
        time.sleep(0.05)
        return {"charge": token[:12]}

    async def charge_async(token: str) -> dict:
        charged.append(len(charged) + 1)
        storage_down.set()
        await asyncio.sleep(0.05)
        return {"charge": token[:12]}

    if kind == "async":

        @task("payments.charge.async")
        async def pay(payload: dict, ctx: TaskContext) -> dict:
            return await ctx.step.run("charge", charge_async)

    else:

        @task("payments.charge.def")
        def pay(payload: dict, ctx: TaskContext) -> dict:
            return ctx.step.run("charge", charge)

    runtime, _ = make_runtime(pay)
    async with runtime:
        done = await _run_through_an_outage(runtime, pay, storage_down)
        assert done.status is RunStatus.SUCCEEDED and done.counters.attempts == 1
        assert charged == [1] and (await runtime.runs.step(done.id, "charge")).output == done.output


async def _run_through_an_outage(runtime: Any, definition: Any, storage_down: asyncio.Event) -> Any:
    """Trigger ``definition`` and run it on a poll worker; once its handler sets ``storage_down``, storage
    goes away for 0.3 s (the handler's storage calls fail and are retried meanwhile). The run as it ends."""
    run = (await runtime.trigger(definition, {})).run
    storage = runtime.lane.storage
    worker = runtime.worker(mode=WorkerMode.POLL, empty_poll_delay="10ms", heartbeat_interval="50ms")
    try:
        await asyncio.wait_for(storage_down.wait(), 5)
        await storage.close()
        await asyncio.sleep(0.3)
        await storage.start()
        return await wait_for_run_status(runtime, run.id, [RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.RETRYING])
    finally:
        await worker.stop()


async def test_a_worker_serving_several_queues_gives_each_a_turn_behind_anothers_backlog():
    """A queue's new runs start behind another queue's backlog in turns, not after all of it."""
    bulk_queue, urgent_queue = queue("bulk"), queue("urgent")
    order: list[str] = []

    @task("work.bulk", queue=bulk_queue)
    async def bulk(payload: dict) -> None:
        order.append("bulk")

    @task("work.urgent", queue=urgent_queue)
    async def urgent(payload: dict) -> None:
        order.append("urgent")

    runtime, clock = make_runtime(bulk, urgent, queues=[DEFAULT_QUEUE, bulk_queue, urgent_queue])
    async with runtime:
        for n in range(200):
            await runtime.trigger(bulk, {"n": n})
        clock.advance("1s")  # the urgent runs come later than the whole backlog
        for n in range(3):
            await runtime.trigger(urgent, {"n": n})
        clock.advance("1s")
        for _ in range(6):
            await runtime.execute_next(queues=[bulk_queue, urgent_queue])
    assert order == ["bulk", "urgent"] * 3


async def test_a_child_trigger_and_a_run_read_ride_out_a_short_outage():
    """As for steps: failing the attempt over a second without storage would run the handler again,
    triggering its child a second time."""
    storage_down = asyncio.Event()

    @task("orders.child")
    async def child(payload: dict) -> None:
        return None

    @task("orders.parent")
    async def parent(payload: dict, ctx: TaskContext) -> str:
        storage_down.set()
        await asyncio.sleep(0.05)  # the database goes away meanwhile
        triggered = await ctx.trigger(child, {})
        read = await ctx.get_run(triggered.run.id)
        return read.id

    runtime, _ = make_runtime(parent, child)
    async with runtime:
        done = await _run_through_an_outage(runtime, parent, storage_down)
        assert done.status is RunStatus.SUCCEEDED and done.counters.attempts == 1
        children = (await runtime.runs.list(task_ids=["orders.child"])).data
        assert [summary.id for summary in children] == [done.output]


class _CommitThenLoseDriver:
    """Wraps a storage driver: once armed, its next transaction commits and then fails with a retryable
    ``storage_unavailable``, as a connection lost while its commit was under way reports a commit whose
    outcome is unknown."""

    def __init__(self, storage):
        self._storage = storage
        self.armed = False

    def __getattr__(self, name):
        return getattr(self._storage, name)

    async def with_transaction(self, callback, *args, **kwargs):
        result = await self._storage.with_transaction(callback, *args, **kwargs)
        if self.armed:
            self.armed = False
            raise RunlaneError(
                ErrorCode.STORAGE_UNAVAILABLE,
                "Lost the connection while committing; the transaction's outcome is unknown.",
                retryable=True,
            )
        return result


async def test_an_outcome_whose_commit_was_reported_unknown_but_landed_is_reported_as_written(caplog):
    # The outcome's commit went through but the driver could not tell (the connection died under it). The
    # retry finds the run finished by this very attempt: its outcome is recorded, once, and the worker says
    # so, rather than that the attempt lost its lease and its outcome is not recorded.
    from runlane import create_lane, create_runlane
    from runlane.core.lanes import LaneDelivery
    from runlane.vocabulary import LaneDeliveryMode
    from runlane_local import local_storage_driver

    driver = _CommitThenLoseDriver(local_storage_driver())
    calls: list[int] = []

    @task("lands.unknowingly")
    async def lands(payload: dict) -> str:
        calls.append(1)
        driver.armed = True  # the next commit is this attempt's outcome
        return "done"

    lane = create_lane(storage=driver, delivery=LaneDelivery(mode=LaneDeliveryMode.STORAGE_POLLING), name="unknown")
    runtime = create_runlane(lane=lane, queues=[DEFAULT_QUEUE], tasks=[lands])
    async with runtime:
        run = (await runtime.trigger(lands, {})).run
        with caplog.at_level("WARNING", logger="runlane"):
            worker = runtime.worker(mode=WorkerMode.POLL, empty_poll_delay="10ms")
            done = await wait_for_run_status(runtime, run.id, RunStatus.SUCCEEDED, timeout="10s")
            for _ in range(500):
                if worker.executed:
                    break
                await asyncio.sleep(0.01)
            await worker.stop()
        assert done.output == "done" and done.counters.attempts == 1 and calls == [1]
        events = await runtime.runs.events(run.id)
        assert [item.event.type for item in events.data].count(RunEventType.SUCCEEDED) == 1
        assert worker.executed == 1
        messages = [record.getMessage() for record in caplog.records]
        assert not any("lost its lease" in m for m in messages), messages
        assert any("the outcome of attempt 1 was written" in m for m in messages), messages
