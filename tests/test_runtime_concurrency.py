"""Racing execution paths: exactly one attempt per claim, capacity and singleton limits hold."""

from __future__ import annotations

import asyncio
import collections
import threading
import time

import pytest

from runlane import (
    ErrorCode,
    Lane,
    LaneDelivery,
    LaneDeliveryMode,
    Runlane,
    RunlaneError,
    RunStatus,
    StorageConflictKind,
    TriggerOutcomeType,
    WorkerMode,
    create_lane,
    create_runlane,
    get_storage_conflict_kind,
    queue,
    task,
)
from runlane.storage import StorageLimits
from runlane_local import LocalStorageDriver, LocalStorageStore, local_storage_driver

from runtime_support import DEFAULT_QUEUE, make_runtime, shared_runtimes

calls: collections.Counter[str] = collections.Counter()


@task("race.work")
async def work(payload: dict, ctx) -> None:
    calls[ctx.run_id] += 1
    await asyncio.sleep(0)


@task("race.sync")
def sync_work(payload: dict, ctx) -> None:
    with lock:
        calls[ctx.run_id] += 1


lock = threading.Lock()


@pytest.fixture(autouse=True)
def _reset():
    calls.clear()


async def test_worker_slots_and_execute_next_callers_execute_each_run_exactly_once():
    runtime, _ = make_runtime(work, sync_work)
    async with runtime:
        ids = [(await runtime.trigger(work if n % 3 else sync_work, {"n": n})).run.id for n in range(150)]
        workers = [runtime.worker(mode=WorkerMode.DRAIN, concurrency=6) for _ in range(2)]

        async def caller() -> None:
            while True:
                run = await runtime.execute_next()
                if run is None and all(w.closed.done() for w in workers):
                    return
                await asyncio.sleep(0)

        await asyncio.wait_for(asyncio.gather(*(w.closed for w in workers), *(caller() for _ in range(6))), 20)
        assert sorted(calls) == sorted(ids)
        assert set(calls.values()) == {1}
        for run_id in ids:
            run = await runtime.runs.get(run_id)
            assert run.status is RunStatus.SUCCEEDED and run.counters.attempts == 1


async def test_runtimes_in_different_processes_never_execute_a_run_twice():
    runtimes, _ = shared_runtimes([work], [work], [work])
    for runtime in runtimes:
        await runtime.start()
    ids = [(await runtimes[0].trigger(work, {"n": n})).run.id for n in range(90)]
    workers = [runtime.worker(mode=WorkerMode.DRAIN, concurrency=4) for runtime in runtimes]
    await asyncio.wait_for(asyncio.gather(*(w.closed for w in workers)), 20)
    assert sum(w.executed for w in workers) == 90
    assert sorted(calls) == sorted(ids) and set(calls.values()) == {1}


@pytest.mark.parametrize("concurrency_key", [None, "tenant"])
async def test_bounded_queue_capacity_is_never_exceeded(concurrency_key):
    limited = queue("limited", concurrency_limit=2)
    active: collections.Counter[str] = collections.Counter()
    peaks: collections.Counter[str] = collections.Counter()

    @task("limited.work", queue=limited, concurrency_key=(lambda p: p["tenant"]) if concurrency_key else None)
    async def limited_work(payload: dict) -> None:
        partition = payload["tenant"] if concurrency_key else "all"
        active[partition] += 1
        peaks[partition] = max(peaks[partition], active[partition])
        await asyncio.sleep(0.001)
        active[partition] -= 1

    runtimes, _ = shared_runtimes([limited_work], [limited_work], queues=[DEFAULT_QUEUE, limited])
    for runtime in runtimes:
        await runtime.start()
    for n in range(24):
        await runtimes[0].trigger(limited_work, {"tenant": f"t{n % 2}"})
    workers = [runtime.worker(mode=WorkerMode.DRAIN, concurrency=5) for runtime in runtimes]
    await asyncio.wait_for(asyncio.gather(*(w.closed for w in workers)), 20)
    assert sum(w.executed for w in workers) == 24
    assert max(peaks.values()) <= 2
    if concurrency_key:
        assert set(peaks) == {"t0", "t1"}


async def test_racing_singleton_triggers_create_exactly_one_run():
    @task("race.singleton", singleton_key="resource")
    async def guarded(payload: dict) -> None:
        return None

    runtimes, _ = shared_runtimes([guarded], [guarded])
    results = await asyncio.gather(
        *(runtimes[n % 2].trigger(guarded, {"n": n}) for n in range(20)), return_exceptions=True
    )
    created = [r for r in results if not isinstance(r, BaseException)]
    rejected = [r for r in results if isinstance(r, BaseException)]
    assert len(created) == 1
    assert all(isinstance(r, RunlaneError) and get_storage_conflict_kind(r) is StorageConflictKind.SINGLETON_KEY for r in rejected)


async def test_racing_duplicate_triggers_with_one_idempotency_key_create_one_run():
    @task("race.idempotent", idempotency_key="same-request")
    async def idempotent(payload: dict) -> None:
        return None

    runtimes, _ = shared_runtimes([idempotent], [idempotent])
    results = await asyncio.gather(*(runtimes[n % 2].trigger(idempotent, {"n": n}) for n in range(20)))
    assert len({r.run.id for r in results}) == 1
    assert [r.outcome for r in results].count(TriggerOutcomeType.CREATED) == 1
    page = await runtimes[0].runs.list()
    assert len(page.data) == 1


async def test_threads_triggering_through_the_sync_facade_while_workers_drain():
    runtime, _ = make_runtime(work)
    await runtime.start()
    worker = runtime.worker(concurrency=4, empty_poll_delay="2ms")

    def produce(offset: int) -> None:
        for n in range(20):
            runtime.sync.trigger(work, {"n": offset + n})

    threads = [threading.Thread(target=produce, args=(k * 100,)) for k in range(3)]
    for thread in threads:
        thread.start()
    while any(thread.is_alive() for thread in threads):
        await asyncio.sleep(0.005)
    while worker.executed < 60:
        await asyncio.sleep(0.002)
    await worker.stop()
    await runtime.close()
    assert len(calls) == 60 and set(calls.values()) == {1}


class HeldStart(LocalStorageDriver):
    """The in-memory driver, whose start waits until the test lets it through."""

    def __init__(self) -> None:
        super().__init__(store=LocalStorageStore())
        self.entered = threading.Event()
        self.go = threading.Event()
        self.starts = 0

    async def start(self) -> None:
        self.starts += 1
        self.entered.set()
        await asyncio.to_thread(self.go.wait, 10)
        await super().start()


def test_threads_first_using_a_runtime_at_once_from_their_own_event_loops_start_it_once():
    """An application loop, threads' asyncio.run() and the sync facade using a runtime not started yet, at
    once: the start lock, an asyncio lock, belonged to the first loop waiting on it, so callers on the other
    loops failed ('bound to a different event loop') or waited for ever. They wait for the one start."""
    storage = HeldStart()
    lane = create_lane(storage=storage, delivery=LaneDelivery(mode=LaneDeliveryMode.STORAGE_POLLING))
    runtime = create_runlane(lane=lane, queues=[DEFAULT_QUEUE], tasks=[work])
    outcomes: list[object] = []

    def trigger(through_the_facade: bool) -> None:
        try:
            if through_the_facade:
                result = runtime.sync.trigger(work, {})
            else:
                result = asyncio.run(runtime.trigger(work, {}))
            outcomes.append(result.outcome)
        except Exception as error:  # noqa: BLE001 - reported by the assertion below
            outcomes.append(error)

    threads = [threading.Thread(target=trigger, args=(n % 2 == 0,), daemon=True) for n in range(6)]
    try:
        for thread in threads:
            thread.start()
        assert storage.entered.wait(10)
        time.sleep(0.005)  # the other callers reach the start in progress
        storage.go.set()
        for thread in threads:
            thread.join(10)
        assert not any(thread.is_alive() for thread in threads), "a caller waited for ever"
        assert outcomes == [TriggerOutcomeType.CREATED] * 6
        assert storage.starts == 1
    finally:
        storage.go.set()
        runtime.sync.close()


async def test_a_bounded_queue_is_refused_a_concurrency_limit_its_capacity_record_could_never_hold():
    """A capacity partition's running and reserved runs share one record: a limit past what it holds
    would stall the queue below its limit, every further reservation refused as too large."""
    limits = StorageLimits(max_record_bytes=12 * 1024, max_transaction_bytes=100 * 12 * 1024)

    def lane() -> Lane:
        storage = local_storage_driver(limits=limits)
        return create_lane(storage=storage, delivery=LaneDelivery(mode=LaneDeliveryMode.STORAGE_POLLING))

    room = next(limit for limit in range(1, 10_000) if not _accepts(lane(), limit + 1))
    assert 130 < room < 180  # 12 KiB of generated run ids and lease expiries
    with pytest.raises(RunlaneError) as refused:
        _runtime(lane(), room + 1)
    assert refused.value.code is ErrorCode.CONFIGURATION_INVALID
    assert f"concurrency_limit {room + 1:,} is more runs than one capacity partition can hold" in str(refused.value)
    assert f"at most {room:,}" in str(refused.value)

    # The largest limit accepted is one the queue reaches: every slot is taken at once, by scheduled runs too.
    started = asyncio.Event()
    release = asyncio.Event()
    running = 0

    @task("wide.hold", queue=queue("wide", concurrency_limit=room))
    async def hold(payload: dict) -> None:
        nonlocal running
        running += 1
        if running == room:
            started.set()
        await release.wait()

    runtime = _runtime(lane(), room, hold)
    async with runtime:
        for n in range(room):
            await runtime.trigger(hold, {"n": n}, run_id=f"run_sched_{n:032x}")
        await runtime.tick()
        worker = runtime.worker(mode=WorkerMode.POLL, concurrency=room)
        await asyncio.wait_for(started.wait(), 20)
        release.set()
        await worker.stop()
    assert running == room


def _runtime(lane: Lane, limit: int, *tasks) -> Runlane:
    return create_runlane(lane=lane, queues=[DEFAULT_QUEUE, queue("wide", concurrency_limit=limit)], tasks=list(tasks))


def _accepts(lane: Lane, limit: int) -> bool:
    try:
        _runtime(lane, limit)
    except RunlaneError:
        return False
    return True
