"""Bounded-queue dispatch: tick() reserves durable capacity per (environment, queue, concurrency key)."""

from __future__ import annotations

import asyncio
import collections
from datetime import datetime, timedelta

import pytest
from runlane_local import local_lane

from runlane import Retry, RunStatus, TaskContext, WorkerMode, create_runlane, queue, task
from runlane.core.store import ClaimRequest, RunnableRef
from runlane.storage import StorageIndexName
from runlane.vocabulary import ExecuteDeliveryIgnoredReason

from runtime_support import DEFAULT_QUEUE, event_types, shared_runtimes


def _occupied(runs, now: datetime) -> collections.Counter:
    """Capacity in use per (queue, concurrency key): live leases plus unexpired reservations."""
    used: collections.Counter = collections.Counter()
    for run in runs:
        if run is None:
            continue
        if run.status in (RunStatus.RUNNING, RunStatus.CANCELLATION_REQUESTED):
            if run.lease is not None and run.lease.expires_at > now:
                used[(run.queue, run.concurrency_key)] += 1
        elif run.status is RunStatus.QUEUED and run.dispatch_expires_at is not None and run.dispatch_expires_at > now:
            used[(run.queue, run.concurrency_key)] += 1
    return used


def _reserved(runs, now: datetime) -> list:
    return [
        run
        for run in runs
        if run.status is RunStatus.QUEUED and run.dispatch_expires_at is not None and run.dispatch_expires_at > now
    ]


async def test_tick_reserves_bounded_capacity_with_a_delivery_request():
    limited = queue("limited", concurrency_limit=2, dispatch_timeout="30s")

    @task("dispatch.basic", queue=limited)
    async def basic(payload: dict) -> None:
        return None

    (runtime,), clock = shared_runtimes([basic], queues=[DEFAULT_QUEUE, limited])
    async with runtime:
        ids = [(await runtime.trigger(basic, {"n": n})).run.id for n in range(5)]
        first = await runtime.tick()
        assert first.dispatch_reserved == 2
        runs = await runtime.store.get_runs(ids)
        reserved = _reserved(runs, clock.now())
        assert len(reserved) == 2
        for run in reserved:
            assert run.dispatch_expires_at == clock.now() + timedelta(seconds=30)
            assert (await event_types(runtime, run.id))[-1] == "run.delivery_requested"
        # Full: nothing more is reserved, and the unreserved runs stay findable for dispatch.
        assert (await runtime.tick()).dispatch_reserved == 0
        waiting = await runtime.store.query_index(StorageIndexName.RUNS_NEEDING_DISPATCH, ("limited",), until=clock.now())
        assert sorted(waiting) == sorted(run.id for run in runs if run not in reserved)
        # A claim of a reserved run turns its reservation into the lease occupant.
        claimed = (await runtime.store.claim([ClaimRequest(reserved[0].id, None, "w", "tok", 60_000)]))[0]
        assert claimed.claimed and claimed.run.dispatch_expires_at is None
        assert _occupied(await runtime.store.get_runs(ids), clock.now())[("limited", None)] == 2
        assert (await runtime.tick()).dispatch_reserved == 0


async def test_unreserved_runs_cannot_claim_capacity_held_by_reservations():
    limited = queue("limited", concurrency_limit=1)

    @task("dispatch.hold", queue=limited)
    async def hold(payload: dict) -> None:
        return None

    (runtime,), clock = shared_runtimes([hold], queues=[DEFAULT_QUEUE, limited])
    async with runtime:
        a = (await runtime.trigger(hold, {"n": 1})).run
        b = (await runtime.trigger(hold, {"n": 2})).run
        assert (await runtime.tick()).dispatch_reserved == 1
        held, other = await runtime.store.get_runs([a.id, b.id])
        if other.dispatch_expires_at is not None:
            held, other = other, held
        lost = (await runtime.store.claim([ClaimRequest(other.id, None, "w", "tok", 60_000)]))[0]
        assert not lost.claimed and lost.reason is ExecuteDeliveryIgnoredReason.CLAIM_LOST
        done = await runtime.execute_next()
        assert done.id == held.id and done.status is RunStatus.SUCCEEDED
        assert (await runtime.tick()).dispatch_reserved == 1
        assert (await runtime.store.get_run(other.id)).dispatch_expires_at is not None


async def test_expired_reservations_free_capacity_and_runs_are_reserved_again():
    limited = queue("limited", concurrency_limit=2, dispatch_timeout="10s")

    @task("dispatch.expire", queue=limited)
    async def expire(payload: dict) -> None:
        return None

    (runtime,), clock = shared_runtimes([expire], queues=[DEFAULT_QUEUE, limited])
    async with runtime:
        ids = [(await runtime.trigger(expire, {"n": n})).run.id for n in range(3)]
        assert (await runtime.tick()).dispatch_reserved == 2
        first = {run.id for run in _reserved(await runtime.store.get_runs(ids), clock.now())}
        clock.advance(timedelta(seconds=11))
        # Both reservations expired: capacity is free again, and never more than two are held.
        assert (await runtime.tick()).dispatch_reserved == 2
        runs = await runtime.store.get_runs(ids)
        assert _occupied(runs, clock.now())[("limited", None)] == 2
        second = {run.id for run in _reserved(runs, clock.now())}
        assert len(first | second) == 3  # the unreserved run got a slot
        clock.advance(timedelta(seconds=11))
        assert (await runtime.tick()).dispatch_reserved == 2
        # Every run still executes exactly once.
        for _ in range(3):
            done = await runtime.execute_next()
            assert done is not None and done.status is RunStatus.SUCCEEDED
        assert await runtime.execute_next() is None


async def test_default_dispatch_timeout_is_the_contract_lease_duration():
    limited = queue("limited", concurrency_limit=1)

    @task("dispatch.default", queue=limited)
    async def default(payload: dict) -> None:
        return None

    (runtime,), clock = shared_runtimes([default], queues=[DEFAULT_QUEUE, limited])
    async with runtime:
        run = (await runtime.trigger(default, {})).run
        assert (await runtime.tick()).dispatch_reserved == 1
        reserved = await runtime.store.get_run(run.id)
        assert reserved.dispatch_expires_at > clock.now()


async def test_concurrency_keys_are_separate_capacity_partitions():
    limited = queue("limited", concurrency_limit=1)

    @task("dispatch.keyed", queue=limited, concurrency_key=lambda p: p["tenant"])
    async def keyed(payload: dict) -> None:
        return None

    (runtime,), clock = shared_runtimes([keyed], queues=[DEFAULT_QUEUE, limited])
    async with runtime:
        ids = [(await runtime.trigger(keyed, {"tenant": tenant, "n": n})).run.id for n in range(2) for tenant in "ab"]
        assert (await runtime.tick()).dispatch_reserved == 2
        runs = await runtime.store.get_runs(ids)
        assert sorted(run.concurrency_key for run in _reserved(runs, clock.now())) == ["a", "b"]
        assert (await runtime.tick(dispatch_reservation_limit=5)).dispatch_reserved == 0


async def test_dispatch_reservation_limit_bounds_one_tick():
    limited = queue("limited", concurrency_limit=5)

    @task("dispatch.limit", queue=limited)
    async def limit(payload: dict) -> None:
        return None

    (runtime,), _ = shared_runtimes([limit], queues=[DEFAULT_QUEUE, limited])
    async with runtime:
        for n in range(4):
            await runtime.trigger(limit, {"n": n})
        assert (await runtime.tick(dispatch_reservation_limit=3)).dispatch_reserved == 3
        assert (await runtime.tick()).dispatch_reserved == 1


async def test_one_bounded_queues_backlog_does_not_take_every_reservation_of_a_pass():
    # Every busy run has its own partition, so its backlog can always use the whole limit of a pass.
    busy = queue("busy", concurrency_limit=1)
    quiet = queue("quiet", concurrency_limit=1)

    @task("dispatch.busy", queue=busy, concurrency_key=lambda p: f"key{p['n']}")
    async def busy_work(payload: dict) -> None:
        return None

    @task("dispatch.quiet", queue=quiet)
    async def quiet_work(payload: dict) -> None:
        return None

    (runtime,), clock = shared_runtimes([busy_work, quiet_work], queues=[DEFAULT_QUEUE, busy, quiet])
    async with runtime:
        busy_ids = [(await runtime.trigger(busy_work, {"n": n})).run.id for n in range(12)]
        waiting = (await runtime.trigger(quiet_work, {})).run
        # The quiet queue gets its run reserved; the share it leaves goes to the busy queue.
        assert (await runtime.tick(dispatch_reservation_limit=4)).dispatch_reserved == 4
        assert (await runtime.runs.get(waiting.id)).dispatch_expires_at is not None
        assert len(_reserved(await runtime.store.get_runs(busy_ids), clock.now())) == 3
        # A limit smaller than the number of bounded queues serves them in turns.
        second = (await runtime.trigger(quiet_work, {"n": 2})).run
        await runtime.execute_next(queues=[quiet])  # frees the quiet queue's slot
        served = []
        for _ in range(2):
            before = (await runtime.runs.get(second.id)).dispatch_expires_at
            assert (await runtime.tick(dispatch_reservation_limit=1)).dispatch_reserved == 1
            after = (await runtime.runs.get(second.id)).dispatch_expires_at
            served.append("busy" if after == before else "quiet")
        assert sorted(served) == ["busy", "quiet"]


async def test_signal_resume_on_a_bounded_queue_waits_for_dispatch():
    limited = queue("limited", concurrency_limit=1)

    @task("dispatch.waiter", queue=limited)
    async def waiter(payload: dict, ctx: TaskContext):
        if payload.get("wait") and ctx.attempt == 1:
            return ctx.wait_for_signal("go")
        return {"attempt": ctx.attempt}

    (runtime,), clock = shared_runtimes([waiter], queues=[DEFAULT_QUEUE, limited])
    async with runtime:
        waiting = (await runtime.trigger(waiter, {"wait": True})).run
        released = await runtime.execute_next()
        assert released.id == waiting.id and released.status is RunStatus.RELEASED
        blocker = (await runtime.trigger(waiter, {})).run
        assert (await runtime.tick()).dispatch_reserved == 1
        assert (await runtime.store.get_run(blocker.id)).dispatch_expires_at is not None
        resumed = await runtime.signals.send("go")
        assert [run.id for run in resumed] == [waiting.id]
        assert resumed[0].status is RunStatus.QUEUED and resumed[0].dispatch_expires_at is None
        # The resumed run cannot take the slot the blocker's reservation holds.
        lost = (await runtime.store.claim([ClaimRequest(waiting.id, None, "w", "tok", 60_000)]))[0]
        assert lost.reason is ExecuteDeliveryIgnoredReason.CLAIM_LOST
        assert (await runtime.tick()).dispatch_reserved == 0
        done = await runtime.execute_next()
        assert done.id == blocker.id and done.status is RunStatus.SUCCEEDED
        # Capacity is free again: the resumed run is dispatched and then runs.
        assert (await runtime.tick()).dispatch_reserved == 1
        assert (await runtime.store.get_run(waiting.id)).dispatch_expires_at is not None
        finished = await runtime.execute_next()
        assert finished.id == waiting.id and finished.output == {"attempt": 2}


async def test_capacity_is_never_exceeded_under_racing_ticks_and_workers():
    limited = queue("limited", concurrency_limit=2, dispatch_timeout="1m")
    active: collections.Counter[str] = collections.Counter()
    peaks: collections.Counter[str] = collections.Counter()

    @task("dispatch.race", queue=limited, concurrency_key=lambda p: p["tenant"])
    async def race(payload: dict) -> None:
        active[payload["tenant"]] += 1
        peaks[payload["tenant"]] = max(peaks[payload["tenant"]], active[payload["tenant"]])
        await asyncio.sleep(0.001)
        active[payload["tenant"]] -= 1

    runtimes, clock = shared_runtimes([race], [race], queues=[DEFAULT_QUEUE, limited])
    for runtime in runtimes:
        await runtime.start()
    ids = [(await runtimes[n % 2].trigger(race, {"tenant": f"t{n % 2}", "n": n})).run.id for n in range(30)]
    samples: list[collections.Counter] = []
    stop = asyncio.Event()

    async def ticker(runtime) -> None:
        while not stop.is_set():
            await runtime.tick()
            await asyncio.sleep(0)

    async def sampler() -> None:
        while not stop.is_set():
            samples.append(_occupied(await runtimes[0].store.get_runs(ids), clock.now()))
            await asyncio.sleep(0)

    background = [asyncio.ensure_future(ticker(runtime)) for runtime in runtimes] + [asyncio.ensure_future(sampler())]
    try:
        workers = [runtime.worker(mode=WorkerMode.DRAIN, concurrency=4) for runtime in runtimes]
        await asyncio.wait_for(asyncio.gather(*(w.closed for w in workers)), 20)
        # A drain worker exits when every due run is blocked by capacity or claimed elsewhere, so
        # finish the backlog with bounded execute_next passes (the tickers keep dispatching).
        deadline = asyncio.get_running_loop().time() + 20
        while not all(run.status is RunStatus.SUCCEEDED for run in await runtimes[0].store.get_runs(ids)):
            assert asyncio.get_running_loop().time() < deadline, "runs were left unexecuted"
            for runtime in runtimes:
                run = await runtime.execute_next()
                assert run is None or run.status is RunStatus.SUCCEEDED
            await asyncio.sleep(0.001)
    finally:
        stop.set()
        await asyncio.gather(*background)
    runs = await runtimes[0].store.get_runs(ids)
    assert all(run.status is RunStatus.SUCCEEDED for run in runs)
    assert samples and all(value <= 2 for sample in samples for value in sample.values())
    assert max(peaks.values()) <= 2
    for runtime in runtimes:
        await runtime.close()


async def test_a_due_retry_or_release_on_a_full_bounded_queue_waits_for_a_reservation():
    single = queue("single", concurrency_limit=1, dispatch_timeout="30s")
    gate = asyncio.Event()
    attempts: collections.Counter = collections.Counter()

    @task("dispatch.blocker", queue=single)
    async def blocker(payload: dict) -> None:
        await gate.wait()

    @task("dispatch.comeback", queue=single, retry=Retry(2, backoff="1m"))
    async def comeback(payload: dict, ctx: TaskContext):
        attempts[payload["mode"]] += 1
        if attempts[payload["mode"]] > 1:
            return None
        if payload["mode"] == "retry":
            raise RuntimeError("again in a minute")
        return ctx.release("1m")

    (runtime,), clock = shared_runtimes([blocker, comeback], queues=[DEFAULT_QUEUE, single])
    async with runtime:
        waiting = []
        for mode in ("retry", "release"):
            run = await runtime.run_now(comeback, {"mode": mode})
            assert run.status in (RunStatus.RETRYING, RunStatus.RELEASED)
            waiting.append(run.id)
        pending = asyncio.ensure_future(runtime.run_now(blocker, {}))
        await asyncio.sleep(0.01)  # the blocker holds the only slot
        clock.advance("1m")
        tick = await runtime.tick()
        # Due, but the partition is full: no bare delivery request, no reservation.
        assert (tick.delivery_requested, tick.dispatch_reserved) == (0, 0)
        for run_id in waiting:
            assert (await event_types(runtime, run_id))[-1] in ("run.retry_scheduled", "run.released")
        gate.set()
        assert (await asyncio.wait_for(pending, 2)).status is RunStatus.SUCCEEDED
        assert (await runtime.tick()).dispatch_reserved == 1  # one slot, one reservation
        runs = [await runtime.runs.get(run_id) for run_id in waiting]
        (reserved,) = [run for run in runs if run.status is RunStatus.QUEUED]
        assert reserved.dispatch_expires_at == clock.now() + timedelta(seconds=30)
        assert [run.status for run in runs].count(RunStatus.QUEUED) == 1


async def test_a_run_recorded_before_its_queue_became_bounded_is_recovered_through_a_reservation():
    from runlane import create_lane, create_runlane
    from runlane.core.lanes import LaneDelivery, LaneDeliveryMode
    from runlane.testing import ControlledClock
    from runlane_local import LocalStorageStore, local_storage_driver

    store, clock = LocalStorageStore(), ControlledClock()

    def runtime_with(work_queue):
        @task("dispatch.upgraded", queue=work_queue, retry=Retry(2, backoff="1m"))
        async def upgraded(payload: dict, ctx: TaskContext) -> None:
            if ctx.attempt == 1:
                raise RuntimeError("again in a minute")

        lane = create_lane(
            storage=local_storage_driver(store=store, clock=clock),
            delivery=LaneDelivery(mode=LaneDeliveryMode.STORAGE_POLLING),
        )
        return create_runlane(lane=lane, queues=[DEFAULT_QUEUE, work_queue], tasks=[upgraded], clock=clock), upgraded

    before, upgraded = runtime_with(queue("work"))
    async with before:
        run = await before.run_now(upgraded, {})  # retrying, recorded as a plain delivery-recovery candidate
        assert run.status is RunStatus.RETRYING
    after, _ = runtime_with(queue("work", concurrency_limit=1, dispatch_timeout="30s"))
    async with after:
        clock.advance("1m")
        tick = await after.tick()
        assert (tick.delivery_requested, tick.dispatch_reserved) == (1, 0)
        recovered = await after.runs.get(run.id)
        assert recovered.status is RunStatus.QUEUED
        assert recovered.dispatch_expires_at == clock.now() + timedelta(seconds=30)


async def test_a_worker_blocked_by_a_full_partition_claims_the_run_holding_its_reservation():
    # tick() reserves the only slot for the oldest run, which moves it behind the others in the runnable
    # order: a worker's scan finds only runs the full partition refuses. It must claim the reserved run
    # (its reservation becomes the lease) rather than wait for the reservation to expire.
    single = queue("single", concurrency_limit=1, dispatch_timeout="5m")
    executed: list[int] = []

    @task("dispatch.ordered", queue=single)
    async def ordered(payload: dict) -> None:
        executed.append(payload["n"])

    # The real clock: the reservation is stamped after the runs were created, as in production.
    runtime = create_runlane(lane=local_lane(), queues=[DEFAULT_QUEUE, single], tasks=[ordered])
    async with runtime:
        ids = [(await runtime.trigger(ordered, {"n": n})).run.id for n in range(40)]
        assert (await runtime.tick()).dispatch_reserved == 1
        assert (await runtime.runs.get(ids[0])).dispatch_expires_at is not None
        worker = runtime.worker(mode=WorkerMode.POLL, queues=["single"], empty_poll_delay="10ms")
        try:
            for _ in range(500):
                if len(executed) >= 5:
                    break
                await asyncio.sleep(0.01)
        finally:
            await worker.stop()
        assert executed[:1] == [0], executed  # the reserved run went first
        assert len(executed) >= 5, f"the queue stalled behind its reservation: {executed}"


class _Tenants:
    """A bounded queue with one slot per tenant key, whose tenant A slot a held run takes: the runs
    triggered next for A wait behind it (``backlog``), older than tenant B's one run."""

    def __init__(self) -> None:
        self.queue = queue("tenants", concurrency_limit=1)
        self.executed: list[str] = []
        self.release_a = asyncio.Event()

        @task("dispatch.tenant", queue=self.queue, concurrency_key=lambda payload: payload["tenant"])
        async def tenant_work(payload: dict) -> None:
            self.executed.append(payload["tenant"])
            if payload.get("hold"):
                await self.release_a.wait()

        self.task = tenant_work
        (self.runtime,), self.clock = shared_runtimes([tenant_work], queues=[DEFAULT_QUEUE, self.queue])
        self.holder: asyncio.Future | None = None

    async def hold_a_then_queue(self, backlog: int) -> tuple[list[str], str]:
        """Hold A's slot, queue ``backlog`` more A runs, then one B run a second later; their ids."""
        runtime = self.runtime
        await runtime.trigger(self.task, {"tenant": "a", "hold": True})
        self.holder = asyncio.ensure_future(runtime.execute_next())
        while self.executed != ["a"]:
            await asyncio.sleep(0.001)
        waiting = [(await runtime.trigger(self.task, {"tenant": "a", "n": n})).run.id for n in range(backlog)]
        self.clock.advance("1s")
        return waiting, (await runtime.trigger(self.task, {"tenant": "b"})).run.id

    async def release(self) -> None:
        self.release_a.set()
        assert self.holder is not None
        await self.holder


async def test_one_concurrency_keys_backlog_does_not_hide_another_keys_work():
    # Tenant A's only slot is taken and 150 of its runs wait behind it, all older than tenant B's one
    # run. Scans pass over A's full partition: a worker, execute_next() and tick() all reach B.
    tenants = _Tenants()
    runtime = tenants.runtime
    async with runtime:
        backlog, b = await tenants.hold_a_then_queue(150)
        # Maintenance reserves B's free slot although 150 rows of the full partition come first.
        assert (await runtime.tick()).dispatch_reserved == 1
        assert (await runtime.runs.get(b)).dispatch_expires_at is not None
        assert (await runtime.tick()).dispatch_reserved == 0  # A stays full
        done = await runtime.execute_next()
        assert done is not None and done.id == b and done.status is RunStatus.SUCCEEDED
        # Nothing else can run now: A's partition is full, and that is not work for a drain worker.
        drained = runtime.worker(mode=WorkerMode.DRAIN, concurrency=2)
        await asyncio.wait_for(drained.closed, 5)
        assert drained.executed == 0
        await tenants.release()
        assert (await runtime.runs.get(backlog[0])).status is RunStatus.QUEUED
        await asyncio.wait_for(runtime.worker(mode=WorkerMode.DRAIN, concurrency=2).closed, 30)
        assert tenants.executed.count("a") == 151 and tenants.executed.count("b") == 1


async def test_a_backlog_longer_than_one_scan_does_not_starve_another_keys_work():
    # 1,200 runs of tenant A wait behind its taken slot, more than one capacity scan reads: successive
    # scans go on where the previous one stopped, so B's run is reached within a few calls.
    tenants = _Tenants()
    runtime = tenants.runtime
    async with runtime:
        _, b = await tenants.hold_a_then_queue(1200)
        ticks = 0
        while (await runtime.runs.get(b)).dispatch_expires_at is None and ticks < 10:
            await runtime.tick()
            ticks += 1
        assert (await runtime.runs.get(b)).dispatch_expires_at is not None, f"not reserved after {ticks} ticks"
        for _ in range(10):
            done = await runtime.execute_next()
            if done is not None:
                break
        assert done is not None and done.id == b and done.status is RunStatus.SUCCEEDED
        await tenants.release()


async def test_a_reservation_keeps_its_run_in_line_for_a_polling_worker_behind_a_backlog():
    """tick() reserves a full key's slots for its oldest runs; a polling worker reading the runnable index
    from the front must find them there, not at the back behind thousands of runs it cannot start."""
    limited = queue("limited", concurrency_limit=2)

    @task("dispatch.backlog", queue=limited, concurrency_key=lambda payload: "hot")
    async def backlog(payload: dict) -> None:
        return None

    (runtime,), clock = shared_runtimes([backlog], queues=[DEFAULT_QUEUE, limited])
    async with runtime:
        runs = [(await runtime.trigger(backlog, {"n": n})).run for n in range(700)]  # past one scan's window
        clock.advance("1s")
        assert (await runtime.tick()).dispatch_reserved == 2
        reserved = _reserved(await runtime.store.get_runs([run.id for run in runs[:5]]), clock.now())
        assert [run.id for run in reserved] == [runs[0].id, runs[1].id]  # the oldest, still first in line
        first = await runtime.execute_next()
        assert first is not None and first.id == runs[0].id and first.status is RunStatus.SUCCEEDED


async def test_a_full_keys_long_backlog_does_not_keep_another_keys_run_waiting():
    """The docs promise one key's backlog never holds up another key's runs: with the hot key's slots
    taken and 3,000 of its runs ahead, one poll finds the other key's run."""
    limited = queue("limited", concurrency_limit=2)
    release = asyncio.Event()

    @task("dispatch.keyed", queue=limited, concurrency_key=lambda payload: payload["key"])
    async def keyed(payload: dict) -> str:
        if payload["key"] == "hot":
            await release.wait()
        return payload["key"]

    (runtime,), clock = shared_runtimes([keyed], queues=[DEFAULT_QUEUE, limited])
    async with runtime:
        for n in range(3_000):
            await runtime.trigger(keyed, {"key": "hot", "n": n})
        cold = (await runtime.trigger(keyed, {"key": "cold"})).run
        clock.advance("1s")
        holding = [asyncio.ensure_future(runtime.execute_next()) for _ in range(2)]  # the hot key is full
        for _ in range(500):  # until both hold their slot (bounded: 5 s)
            if len((await runtime.runs.list(statuses=["running"])).data) == 2:
                break
            await asyncio.sleep(0.01)
        try:
            done = await runtime.execute_next()
            assert done is not None and done.id == cold.id and done.output == "cold"
        finally:
            release.set()
            await asyncio.gather(*holding)


@pytest.mark.parametrize("caller", ["execute_next", "drain worker"])
async def test_nothing_from_a_drain_or_execute_next_means_no_run_could_start_however_long_the_backlog(
    caller: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A poll worker reads a bounded window behind a full key's backlog per poll (it polls again); a drain
    or execute_next ends on "nothing", so it reads on to the newest due row before saying so. The window
    is made small here, so a short backlog is past it."""
    from runlane.core import store as store_module

    monkeypatch.setattr(store_module, "_CAPACITY_SCAN_MAX_ROWS", 600)
    limited = queue("limited", concurrency_limit=1)
    release = asyncio.Event()

    @task("dispatch.keyed", queue=limited, concurrency_key=lambda payload: payload["key"])
    async def keyed(payload: dict) -> str:
        if payload["key"] == "hot" and payload["n"] == 0:
            await release.wait()
        return payload["key"]

    (runtime,), clock = shared_runtimes([keyed], queues=[DEFAULT_QUEUE, limited])
    async with runtime:
        for n in range(1_500):
            await runtime.trigger(keyed, {"key": "hot", "n": n})
        cold = (await runtime.trigger(keyed, {"key": "cold", "n": 0})).run
        clock.advance("1s")
        holding = asyncio.ensure_future(runtime.execute_next())  # the hot key's one slot, held
        for _ in range(500):  # until it holds its slot (bounded: 5 s)
            if (await runtime.runs.list(statuses=["running"])).data:
                break
            await asyncio.sleep(0.01)
        try:
            if caller == "execute_next":
                done = await runtime.execute_next()
                assert done is not None and done.id == cold.id
            else:
                executed: list[str] = []
                worker = runtime.worker(mode=WorkerMode.DRAIN, on_run_executed=lambda run: executed.append(run.id))
                await asyncio.wait_for(worker.closed, 30)
                assert executed == [cold.id]
        finally:
            release.set()
            await holding


async def test_a_slot_woken_during_a_scan_in_flight_does_not_take_its_empty_answer():
    # A drain slot whose run just finished (freeing its partition's slot) asks for work while another
    # slot's scan, begun while that run still held the slot, is in flight. That scan's "nothing due"
    # predates the wake-up, so the slot scans again instead of ending the drain with runs left.
    from runlane.core.runtime import CandidatePool

    answers = [asyncio.get_running_loop().create_future(), ["run-2"]]
    scans: list[int] = []

    class Store:
        async def list_runnable(self, queues, now, limit, **options):
            scans.append(len(scans))
            answer = answers[len(scans) - 1]
            refs = await answer if isinstance(answer, asyncio.Future) else answer
            return [RunnableRef(run_id, "q", now) for run_id in refs]

    pool = CandidatePool(4)
    now = datetime.now().astimezone()
    first = asyncio.ensure_future(pool.refill(Store(), ["q"], now, set(), generation=1))
    await asyncio.sleep(0)
    woken = asyncio.ensure_future(pool.refill(Store(), ["q"], now, set(), generation=2))
    same = asyncio.ensure_future(pool.refill(Store(), ["q"], now, set(), generation=1))
    await asyncio.sleep(0)
    answers[0].set_result([])
    assert await first is None and await same is None  # they knew no more than the scan did
    assert await woken is True and pool.take(set()) == "run-2"
    assert len(scans) == 2


async def test_a_run_id_used_again_after_pruning_counts_in_its_own_partition():
    # A store remembers the concurrency keys of the rows its scans read. A pruned run's id can be used
    # again by a run of another key: that run must not wait behind the first key's backlog.
    tenants = queue("tenants", concurrency_limit=1)
    order: list[str] = []

    @task("dispatch.reused", queue=tenants, concurrency_key=lambda payload: payload["tenant"])
    async def work(payload: dict) -> None:
        order.append(payload["tenant"])

    (runtime,), clock = shared_runtimes([work], queues=[DEFAULT_QUEUE, tenants])
    async with runtime:
        await runtime.trigger(work, {"tenant": "a"}, run_id="run_nightly")
        assert (await runtime.execute_next()).status is RunStatus.SUCCEEDED
        clock.advance("1d")
        assert (await runtime.runs.prune(older_than="1h")).pruned == 1
        clock.advance("1s")
        for _ in range(20):
            await runtime.trigger(work, {"tenant": "a"})
        await runtime.trigger(work, {"tenant": "b"}, run_id="run_nightly")  # the same id, another key
        order.clear()
        await asyncio.wait_for(runtime.worker(mode=WorkerMode.DRAIN, concurrency=2).closed, 30)
        assert order.index("b") <= 1, order


# ---------------------------------------------------------------------------------------------
# Releases that change a queue's limit while its slots are reserved


def _release(store, clock, limit: int | None):
    """One release's runtime over ``store``: its queue ``gw`` bounded by ``limit`` (or not)."""
    from runlane import create_lane
    from runlane.core.lanes import LaneDelivery
    from runlane.vocabulary import LaneDeliveryMode
    from runlane_local import local_storage_driver

    gw = queue("gw", default=True, concurrency_limit=limit)

    @task("deploy.gw", queue=gw)
    async def call(payload: dict) -> dict:
        return payload

    lane = create_lane(
        storage=local_storage_driver(store=store, clock=clock),
        delivery=LaneDelivery(mode=LaneDeliveryMode.STORAGE_POLLING),
    )
    return create_runlane(lane=lane, queues=[gw], tasks=[call], clock=clock), call


async def test_a_lower_limit_lets_runs_reserved_under_the_higher_one_start_at_once():
    """Reservations the previous release's tick made (limit 3) are more than the new limit (1): the
    reserved runs take the slots they hold instead of waiting out the dispatch timeout with nothing
    running; a run without a reservation waits for the new limit."""
    from runlane.testing import ControlledClock
    from runlane_local import LocalStorageStore

    store, clock = LocalStorageStore(), ControlledClock()
    old, call = _release(store, clock, 3)
    async with old:
        runs = [(await old.trigger(call, {"n": n})).run for n in range(4)]
        assert (await old.tick()).dispatch_reserved == 3
    new, _ = _release(store, clock, 1)
    async with new:
        clock.advance("1ms")
        await new.tick()
        started = [await new.execute_next() for _ in range(3)]
        assert [run.id for run in started if run is not None] == [run.id for run in runs[:3]]
        assert all(run.status is RunStatus.SUCCEEDED for run in started)
        last = await new.execute_next()  # the unreserved run, once the limit (1) has room
        assert last is not None and last.id == runs[3].id


async def test_reservations_claimed_while_a_queue_was_unbounded_leave_no_slot_taken_when_the_limit_returns():
    from runlane.testing import ControlledClock
    from runlane_local import LocalStorageStore

    store, clock = LocalStorageStore(), ControlledClock()
    bounded, call = _release(store, clock, 3)
    async with bounded:
        for n in range(5):
            await bounded.trigger(call, {"n": n})
        assert (await bounded.tick()).dispatch_reserved == 3
    unbounded, _ = _release(store, clock, None)
    async with unbounded:
        assert len([run for run in [await unbounded.execute_next() for _ in range(5)] if run is not None]) == 5
    again, call = _release(store, clock, 3)
    async with again:
        fresh = [(await again.trigger(call, {"n": n})).run for n in range(3)]
        clock.advance("1ms")
        assert (await again.tick()).dispatch_reserved == 3  # all three slots are free again
        executed = [await again.execute_next() for _ in range(3)]
        assert [run.id for run in executed if run is not None] == [run.id for run in fresh]
