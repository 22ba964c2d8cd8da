"""Schedule materialization in ``tick()``: every schedule kind produces ordinary runs that workers
execute, with deterministic identities, no backfill, safe concurrent maintenance and crash recovery."""

from __future__ import annotations

import asyncio
from collections import Counter
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from pydantic import BaseModel, field_validator

from runlane import (
    Actor,
    ActorType,
    ErrorCode,
    LaneDelivery,
    LaneDeliveryMode,
    RunlaneError,
    RunSourceType,
    RunStatus,
    TickResult,
    WorkerMode,
    contract_defaults,
    create_lane,
    create_runlane,
    queue,
    schedule,
    task,
)
from runlane.core.schedules import latest_due_fire_time, schedule_occurrence_id, scheduled_run_id
from runlane.core.store import ClaimRequest
from runlane.testing import ControlledClock
from runlane_local import local_storage_driver

from runtime_support import DEFAULT_QUEUE, all_runs, make_runtime, shared_runtimes

T0 = datetime(2026, 1, 1, tzinfo=UTC)
CLAIM = contract_defaults.lease.duration


def expected_run_id(runtime: Any, schedule_id: str, fire_at: datetime) -> str:
    return scheduled_run_id(schedule_occurrence_id(runtime.environment, schedule_id, fire_at))


async def run_ids(runtime: Any) -> set[str]:
    return {summary.id for summary in await all_runs(runtime)}


async def drain(runtime: Any) -> None:
    await runtime.worker(mode=WorkerMode.DRAIN).closed


class Recorder:
    def __init__(self) -> None:
        self.calls: list[Any] = []


# ---------------------------------------------------------------------------------------------
# Every kind produces executed runs


async def test_once_schedule_materializes_one_run_with_a_schedule_source_and_a_worker_executes_it():
    seen = Recorder()

    @task("reports.once", schedule=schedule("reports.launch", run_at=T0 + timedelta(hours=1), payload={"n": 7}))
    async def report(payload: dict) -> dict:
        seen.calls.append(payload)
        return {"sent": payload["n"]}

    runtime, clock = make_runtime(report, clock=ControlledClock(T0))
    async with runtime:
        assert await runtime.tick() == TickResult()
        clock.advance("90m")  # late: once schedules still materialize their original run_at
        assert (await runtime.tick()).materialized == 1
        run_id = expected_run_id(runtime, "reports.launch", T0 + timedelta(hours=1))
        run = await runtime.runs.get(run_id)
        assert run is not None and run.status is RunStatus.QUEUED and run.queue == "default"
        source = run.source
        assert source is not None and source.type is RunSourceType.SCHEDULE
        assert source.schedule_id == "reports.launch"
        assert source.occurrence_id == schedule_occurrence_id(runtime.environment, "reports.launch", T0 + timedelta(hours=1))
        assert run.idempotency_key is None and run.payload == {"n": 7}
        created = (await runtime.runs.events(run_id, sort_by="sequence")).data[0]
        assert created.event.actor == Actor(type=ActorType.SCHEDULE, id="reports.launch")
        assert created.event.occurred_at == clock.now()

        await drain(runtime)
        assert seen.calls == [{"n": 7}]
        assert (await runtime.runs.get(run_id)).status is RunStatus.SUCCEEDED
        clock.advance("1d")
        assert (await runtime.tick()).materialized == 0
        assert await run_ids(runtime) == {run_id}


async def test_interval_schedule_respects_starts_at_and_ends_at_and_never_backfills():
    starts = T0 + timedelta(minutes=30)
    ends = T0 + timedelta(hours=3, minutes=30)
    seen = Recorder()

    @task("sync.interval", schedule=schedule("sync.hourly", every="1h", starts_at=starts, ends_at=ends))
    async def sync() -> None:
        seen.calls.append("ran")

    runtime, clock = make_runtime(sync, clock=ControlledClock(T0))
    async with runtime:
        assert (await runtime.tick()).materialized == 0  # before starts_at
        clock.set(starts)
        assert (await runtime.tick()).materialized == 1
        clock.advance("15m")
        assert (await runtime.tick()).materialized == 0  # the same boundary is already materialized
        clock.set(T0 + timedelta(hours=5))
        # Boundaries 01:30 and 02:30 were missed: only the latest one at or before ends_at materializes.
        assert (await runtime.tick()).materialized == 1
        clock.set(T0 + timedelta(hours=10))
        assert (await runtime.tick()).materialized == 0  # nothing after ends_at
        assert await run_ids(runtime) == {expected_run_id(runtime, "sync.hourly", at) for at in (starts, ends)}
        await drain(runtime)
        assert len(seen.calls) == 2
        assert {summary.status for summary in await all_runs(runtime)} == {RunStatus.SUCCEEDED}


async def test_a_late_tick_materializes_only_the_latest_interval_boundary():
    @task("metrics.flush", schedule=schedule("metrics.every_15m", every="15m"))
    async def flush() -> None:
        return None

    runtime, clock = make_runtime(flush, clock=ControlledClock(T0 + timedelta(minutes=1)))
    async with runtime:
        assert (await runtime.tick()).materialized == 1  # the 00:00 boundary
        clock.advance("2h")  # eight boundaries pass without maintenance
        assert (await runtime.tick()).materialized == 1
        assert await run_ids(runtime) == {
            expected_run_id(runtime, "metrics.every_15m", T0),
            expected_run_id(runtime, "metrics.every_15m", T0 + timedelta(hours=2)),
        }


async def test_cron_in_new_york_follows_the_wall_clock_across_both_daylight_saving_changes():
    executed: Counter[str] = Counter()

    def handler(name: str):
        async def run(payload: dict) -> None:
            executed[name] += 1

        return run

    daily = task("digests.send", schedule=schedule("digests.daily", cron="0 9 * * *", time_zone="America/New_York", payload={}))(
        handler("daily")
    )
    night = task("batch.night", schedule=schedule("batch.0230", cron="30 2 * * *", time_zone="America/New_York", payload={}))(
        handler("night")
    )
    early = task("batch.early", schedule=schedule("batch.0130", cron="30 1 * * *", time_zone="America/New_York", payload={}))(
        handler("early")
    )

    def utc(text: str) -> datetime:
        return datetime.fromisoformat(text).replace(tzinfo=UTC)

    # (tick time, {schedule id: fire time materialized by that tick}); all in UTC.
    timeline = [
        # Saturday 10:00 EST.
        ("2026-03-07T15:00", {"digests.daily": "2026-03-07T14:00", "batch.0230": "2026-03-07T07:30", "batch.0130": "2026-03-07T06:30"}),
        # Spring forward (02:00 EST -> 03:00 EDT): 09:00 is now 13:00Z and 02:30 does not exist that day.
        ("2026-03-08T14:30", {"digests.daily": "2026-03-08T13:00", "batch.0130": "2026-03-08T06:30"}),
        ("2026-03-09T14:30", {"digests.daily": "2026-03-09T13:00", "batch.0230": "2026-03-09T06:30", "batch.0130": "2026-03-09T05:30"}),
        # Fall back (02:00 EDT -> 01:00 EST), during the first pass through 01:xx.
        ("2026-11-01T05:45", {"digests.daily": "2026-10-31T13:00", "batch.0230": "2026-10-31T06:30", "batch.0130": "2026-11-01T05:30"}),
        # The second pass through 01:xx (EST): 01:30 already fired at its first occurrence.
        ("2026-11-01T06:45", {}),
        ("2026-11-01T15:00", {"digests.daily": "2026-11-01T14:00", "batch.0230": "2026-11-01T07:30"}),
    ]
    runtime, clock = make_runtime(daily, night, early, clock=ControlledClock(utc(timeline[0][0])))
    async with runtime:
        expected: set[str] = set()
        for at, fires in timeline:
            clock.set(utc(at))
            before = await run_ids(runtime)
            result = await runtime.tick()
            created = await run_ids(runtime) - before
            wanted = {expected_run_id(runtime, schedule_id, utc(fire)) for schedule_id, fire in fires.items()}
            assert created == wanted, at
            assert result.materialized == len(wanted), at
            expected |= wanted
            await drain(runtime)
        assert await run_ids(runtime) == expected
        assert {summary.status for summary in await all_runs(runtime)} == {RunStatus.SUCCEEDED}
        assert executed == Counter(daily=5, night=4, early=4)


async def test_disabled_schedules_never_materialize():
    @task("off", schedule=schedule("off.every_minute", every="1m", enabled=False))
    async def off() -> None:
        return None

    runtime, clock = make_runtime(off, clock=ControlledClock(T0))
    async with runtime:
        clock.advance("1h")
        assert (await runtime.tick()).materialized == 0
        assert await run_ids(runtime) == set()


# ---------------------------------------------------------------------------------------------
# Run creation semantics


async def test_scheduled_runs_use_the_schedule_queue_then_the_task_queue_then_the_default_queue():
    reports = queue("reports")
    urgent = queue("urgent")

    @task("q.schedule", queue=reports, schedule=schedule("q.by_schedule", every="1h", queue=urgent))
    async def by_schedule() -> None:
        return None

    @task("q.task", queue=reports, schedule=schedule("q.by_task", every="1h"))
    async def by_task() -> None:
        return None

    @task("q.default", schedule=schedule("q.by_default", every="1h"))
    async def by_default() -> None:
        return None

    runtime, _ = make_runtime(
        by_schedule, by_task, by_default, queues=[DEFAULT_QUEUE, reports, urgent], clock=ControlledClock(T0)
    )
    async with runtime:
        assert (await runtime.tick()).materialized == 3
        queues = {summary.task_id: summary.queue for summary in await all_runs(runtime)}
        assert queues == {"q.schedule": "urgent", "q.task": "reports", "q.default": "default"}


async def test_task_singleton_keys_skip_an_overlapping_occurrence_and_the_tick_goes_on():
    @task("sync.locked", singleton_key="sync_lock", schedule=schedule("sync.locked.hourly", every="1h"))
    async def locked() -> None:
        return None

    @task("sync.free", schedule=schedule("sync.free.hourly", every="1h"))
    async def free() -> None:
        return None

    runtime, clock = make_runtime(locked, free, clock=ControlledClock(T0))
    async with runtime:
        assert (await runtime.tick()).materialized == 2
        first = expected_run_id(runtime, "sync.locked.hourly", T0)
        assert (await runtime.runs.get(first)).singleton_key == "sync_lock"
        clock.advance("1h")
        # The first locked run is still queued: its next occurrence is skipped, the free one materializes.
        assert (await runtime.tick()).materialized == 1
        skipped = expected_run_id(runtime, "sync.locked.hourly", T0 + timedelta(hours=1))
        assert await runtime.runs.get(skipped) is None
        assert (await runtime.tick()).materialized == 0  # the skipped occurrence is settled, not retried
        await drain(runtime)
        clock.advance("1h")
        assert (await runtime.tick()).materialized == 2
        assert await runtime.runs.get(expected_run_id(runtime, "sync.locked.hourly", T0 + timedelta(hours=2))) is not None


async def test_concurrency_keys_apply_and_idempotency_keys_do_not():
    bounded = queue("bounded", concurrency_limit=1)

    @task(
        "keys.task",
        queue=bounded,
        idempotency_key="same_key",
        concurrency_key="tenant_a",
        schedule=schedule("keys.every_hour", every="1h"),
    )
    async def keyed() -> None:
        return None

    runtime, clock = make_runtime(keyed, queues=[DEFAULT_QUEUE, bounded], clock=ControlledClock(T0))
    async with runtime:
        assert (await runtime.tick()).materialized == 1
        clock.advance("1h")
        # A full bounded queue does not block materialization, and the task's idempotency key does not
        # fold recurring occurrences into one run.
        assert (await runtime.tick()).materialized == 1
        runs = [await runtime.runs.get(summary.id) for summary in await all_runs(runtime)]
        assert len(runs) == 2
        assert all(run.concurrency_key == "tenant_a" and run.idempotency_key is None for run in runs)
        await drain(runtime)
        assert {run.status for run in [await runtime.runs.get(run.id) for run in runs]} == {RunStatus.SUCCEEDED}


async def test_schedule_materialization_limit_bounds_one_tick():
    tasks = []
    for index in range(3):

        async def handler() -> None:
            return None

        tasks.append(task(f"limited.{index}", schedule=schedule(f"limited.{index}.hourly", every="1h"))(handler))
    runtime, _ = make_runtime(*tasks, clock=ControlledClock(T0))
    async with runtime:
        counts = [(await runtime.tick(schedule_materialization_limit=2)).materialized for _ in range(3)]
        assert counts == [2, 1, 0]
        assert len(await run_ids(runtime)) == 3
        with pytest.raises(RunlaneError) as caught:
            await runtime.tick(schedule_materialization_limit=0)
        assert caught.value.code is ErrorCode.CONFIGURATION_INVALID


async def test_a_failing_schedule_ends_the_tick_and_a_tick_after_the_fix_does_the_rest():
    broken = {"on": False}  # the resolver works when the task is defined, then its lock service goes away

    def lock_key(payload: dict) -> str:
        if broken["on"]:
            raise ValueError("lock service unavailable")
        return "lock"

    @task("chain.first", schedule=schedule("chain.first.hourly", every="1h", payload={}))
    async def first(payload: dict) -> None:
        return None

    @task("chain.broken", singleton_key=lock_key, schedule=schedule("chain.broken.hourly", every="1h", payload={}))
    async def failing(payload: dict) -> None:
        return None

    @task("chain.last", schedule=schedule("chain.last.hourly", every="1h", payload={}))
    async def last(payload: dict) -> None:
        return None

    @task("plain")
    async def plain() -> None:
        return None

    runtime, clock = make_runtime(first, failing, last, plain, clock=ControlledClock(T0))
    async with runtime:
        stuck, cancelling = [(await runtime.trigger(plain)).run.id for _ in range(2)]
        claims = await runtime.store.claim(
            [ClaimRequest(run_id, None, "crashed-worker", f"tok-{run_id}", 1000, also_start=True) for run_id in (stuck, cancelling)]
        )
        assert all(claim.claimed for claim in claims)
        await runtime.runs.cancel(cancelling)
        # The crashed worker's leases expired: delivery recovery and cancellation finalization are due.
        clock.advance("1m")
        broken["on"] = True
        with pytest.raises(RunlaneError) as caught:
            await runtime.tick()
        assert caught.value.code is ErrorCode.CONFIGURATION_INVALID
        assert caught.value.meta["schedule_id"] == "chain.broken.hourly"
        assert "Schedule 'chain.broken.hourly' did not fire" in caught.value.message
        # The schedule before it stays materialized; the pass stopped there: neither the schedule after it
        # nor the later phases (cancellation finalization, delivery recovery) ran in that call.
        assert await run_ids(runtime) == {stuck, cancelling, expected_run_id(runtime, "chain.first.hourly", T0)}
        assert (await runtime.runs.get(stuck)).status is RunStatus.RUNNING
        assert (await runtime.runs.get(cancelling)).status is RunStatus.CANCELLATION_REQUESTED
        with pytest.raises(RunlaneError):  # until it is fixed, every pass stops there
            await runtime.tick()

        broken["on"] = False
        result = await runtime.tick()
        assert (result.materialized, result.cancellations_finalized, result.delivery_requested) == (2, 1, 1)
        assert await run_ids(runtime) == {stuck, cancelling} | {
            expected_run_id(runtime, f"chain.{name}.hourly", T0) for name in ("first", "broken", "last")
        }
        assert (await runtime.runs.get(stuck)).status is not RunStatus.RUNNING
        assert (await runtime.runs.get(cancelling)).status is RunStatus.CANCELLED


# ---------------------------------------------------------------------------------------------
# Concurrent maintenance and crash recovery


async def test_two_runtimes_ticking_concurrently_over_one_store_create_one_run_per_occurrence():
    executions: Counter[str] = Counter()
    schedules = [
        schedule("race.every_minute", every="1m", payload={}),
        schedule("race.every_5m", every="5m", payload={}),
        schedule("race.cron", cron="*/10 * * * *", payload={}),
    ]

    @task("race.task", schedule=schedules)
    async def racing(payload: dict, ctx) -> None:
        executions[ctx.run_id] += 1

    (first, second), clock = shared_runtimes([racing], [racing], clock=ControlledClock(T0))
    async with first, second:
        expected: set[str] = set()
        materialized = 0
        for _ in range(25):
            clock.advance("1m")
            for item in schedules:
                fire_at = latest_due_fire_time(item, clock.now())
                assert fire_at is not None
                expected.add(expected_run_id(first, item.id, fire_at))
            results = await asyncio.gather(first.tick(), second.tick(), first.tick())
            materialized += sum(result.materialized for result in results)
        assert materialized == len(expected)
        assert await run_ids(first) == expected == await run_ids(second)
        await asyncio.gather(drain(first), drain(second))
        assert executions == Counter({run_id: 1 for run_id in expected})


class _Crash(Exception):
    """The process died: nothing after this point of the transaction happened."""


class _CrashingTransaction:
    def __init__(self, inner: Any, driver: CompletionCrashDriver) -> None:
        self._inner = inner
        self._driver = driver

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def replace(self, current: Any, record: Any) -> None:
        completing = record.key.collection == "schedule_occurrences" and record.document.value["status"] == "completed"
        if completing and self._driver.crashes_left:
            self._driver.crashes_left -= 1
            raise _Crash("lost the occurrence completion")
        self._inner.replace(current, record)


class CompletionCrashDriver:
    """The local driver, except that the next occurrence completion is lost (its transaction dies)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.name = inner.name
        self.profile = inner.profile
        self.crashes_left = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def with_transaction(self, callback: Any) -> Any:
        return await self._inner.with_transaction(lambda tx: callback(_CrashingTransaction(tx, self)))


async def test_a_run_created_before_a_lost_completion_is_recovered_without_a_duplicate():
    executions: list[str] = []

    @task("recover.task", schedule=schedule("recover.once", run_at=T0 + timedelta(minutes=5), payload={}))
    async def recover(payload: dict, ctx) -> None:
        executions.append(ctx.run_id)

    clock = ControlledClock(T0)
    driver = CompletionCrashDriver(local_storage_driver())
    lane = create_lane(storage=driver, delivery=LaneDelivery(mode=LaneDeliveryMode.STORAGE_POLLING))
    runtime = create_runlane(lane=lane, queues=[DEFAULT_QUEUE], tasks=[recover], clock=clock)
    run_id = expected_run_id(runtime, "recover.once", T0 + timedelta(minutes=5))
    async with runtime:
        clock.advance("10m")
        driver.crashes_left = 1
        with pytest.raises(_Crash):
            await runtime.tick()
        assert await run_ids(runtime) == {run_id}  # created, but the occurrence is still claimed
        # While the crashed claim is live nobody touches the occurrence.
        assert (await runtime.tick()).materialized == 0
        clock.advance(CLAIM + timedelta(seconds=1))
        assert (await runtime.tick()).materialized == 1  # reclaimed, the existing run reused, completed
        assert (await runtime.tick()).materialized == 0
        assert await run_ids(runtime) == {run_id}
        types = [record.event.type.value for record in (await runtime.runs.events(run_id, sort_by="sequence")).data]
        assert types.count("run.created") == 1
        await drain(runtime)
        assert executions == [run_id]


def hourly_with_lost_completions() -> tuple[Any, CompletionCrashDriver, Any, ControlledClock, str]:
    """A runtime with one hourly schedule over a driver that can lose completions, at 00:10: the runtime,
    the driver, its occurrences, the clock and the 00:00 occurrence's id."""
    from runlane.core.schedules import ScheduleOccurrences

    @task("hourly.task", schedule=schedule("hourly.every", every="1h", payload={}))
    async def hourly(payload: dict) -> None:
        return None

    clock = ControlledClock(T0 + timedelta(minutes=10))
    driver = CompletionCrashDriver(local_storage_driver(clock=clock))
    lane = create_lane(storage=driver, delivery=LaneDelivery(mode=LaneDeliveryMode.STORAGE_POLLING))
    runtime = create_runlane(lane=lane, queues=[DEFAULT_QUEUE], tasks=[hourly], clock=clock)
    occurrences = ScheduleOccurrences(driver, runtime.environment)
    return runtime, driver, occurrences, clock, schedule_occurrence_id(runtime.environment, "hourly.every", T0)


async def test_a_lost_completion_found_only_after_the_next_fire_time_leaves_no_claimed_occurrence_behind():
    runtime, driver, occurrences, clock, midnight = hourly_with_lost_completions()
    async with runtime:
        driver.crashes_left = 1
        with pytest.raises(_Crash):
            await runtime.tick()  # 00:00: its run is created, the completion is lost
        clock.advance("1h")  # the claim expired long ago, and 01:00 is the latest due fire time now
        assert (await runtime.tick()).materialized == 1
        assert await run_ids(runtime) == {
            expected_run_id(runtime, "hourly.every", T0),
            expected_run_id(runtime, "hourly.every", T0 + timedelta(hours=1)),
        }
        # No pass looks at 00:00 again: its claim is settled, not left claimed for ever.
        assert await occurrences.get(midnight) is None
        assert await occurrences.expired_claims(clock.now() + timedelta(days=1), 100) == ([], None)
        assert (await runtime.tick()).materialized == 0


async def test_expired_claims_a_pass_leaves_alone_do_not_hide_the_ones_after_them():
    runtime, driver, occurrences, clock, midnight = hourly_with_lost_completions()
    async with runtime:
        # Claims that materializers of schedules since removed died holding: they expire first, and no pass
        # of this runtime may settle them (the schedules could be another runtime's).
        for n in range(5):
            await occurrences.claim(
                f"removed.{n}", "hourly.task", T0, claim_token=f"token_{n}", worker_id="gone", claim_duration_ms=1_000
            )
        driver.crashes_left = 1
        with pytest.raises(_Crash):
            await runtime.tick()  # 00:00: its run is created, the completion is lost
        clock.advance("1h")
        for _ in range(4):  # two claims read per pass: the passes read on past the ones they leave
            await runtime.tick(schedule_materialization_limit=2)
        assert await occurrences.get(midnight) is None
        remaining, _ = await occurrences.expired_claims(clock.now(), 100)
        assert sorted(item.schedule_id for item in remaining if not isinstance(item, RunlaneError)) == [
            f"removed.{n}" for n in range(5)
        ]


async def test_a_fire_time_that_ran_never_runs_again_after_its_run_is_pruned_and_the_schedule_changes():
    # Hourly runs at 00:00 and 01:00; the 00:00 run is pruned; the schedule is redeployed every 2 hours,
    # whose latest due fire time is 00:00 again. That fire time already ran: nothing is created.
    from runlane_local import LocalStorageStore, local_storage_driver

    store = LocalStorageStore()
    clock = ControlledClock(T0 + timedelta(minutes=30))

    def deployed(every: str) -> Any:
        @task("reports.tick", schedule=schedule("reports.tick.every", every=every, payload={}))
        async def tick_report(payload: dict) -> None:
            return None

        lane = create_lane(
            storage=local_storage_driver(store=store, clock=clock),
            delivery=LaneDelivery(mode=LaneDeliveryMode.STORAGE_POLLING),
        )
        return create_runlane(lane=lane, queues=[DEFAULT_QUEUE], tasks=[tick_report], clock=clock)

    hourly = deployed("1h")
    async with hourly:
        assert (await hourly.tick()).materialized == 1  # 00:00
        await drain(hourly)
        clock.advance("1h")
        assert (await hourly.tick()).materialized == 1  # 01:00
        await drain(hourly)
        clock.advance("15m")
        assert (await hourly.runs.prune(older_than="1h")).pruned == 1  # the 00:00 run
        left = await run_ids(hourly)
    every_two_hours = deployed("2h")
    async with every_two_hours:
        assert (await every_two_hours.tick()).materialized == 0
        assert await run_ids(every_two_hours) == left


# ---------------------------------------------------------------------------------------------
# Registration checks


def _runtime_with(*tasks: Any, queues: list[Any] | None = None) -> Any:
    from runlane_local import local_lane

    return create_runlane(lane=local_lane(), queues=queues or [DEFAULT_QUEUE], tasks=list(tasks))


def test_schedule_ids_must_be_unique_across_the_runtime():
    @task("dup.a", schedule=schedule("shared.id", every="1h"))
    async def a() -> None:
        return None

    @task("dup.b", schedule=schedule("shared.id", every="2h"))
    async def b() -> None:
        return None

    with pytest.raises(RunlaneError) as caught:
        _runtime_with(a, b)
    assert caught.value.code is ErrorCode.CONFIGURATION_INVALID
    assert "shared.id" in caught.value.message and caught.value.meta["schedule_id"] == "shared.id"
    _runtime_with(a)  # alone it is fine


def test_a_key_resolver_that_fails_on_a_schedule_payload_is_refused_when_the_task_is_defined():
    # Every tick resolves the task's keys for its schedules: a resolver that fails on the static payload
    # would fail every tick (and stop its other phases), so the task is refused up front.
    with pytest.raises(RunlaneError) as raised:

        @task(
            "reports.per_account",
            singleton_key=lambda payload: f"acct.{payload['account']}",
            schedule=schedule("reports.nightly", every="1h", payload={}),
        )
        async def per_account(payload: dict) -> None:
            return None

    assert raised.value.code is ErrorCode.CONFIGURATION_INVALID
    assert raised.value.message.startswith("Schedule 'reports.nightly': The singleton key resolver of task")
    assert raised.value.meta["schedule_id"] == "reports.nightly" and raised.value.meta["field"] == "singleton_key"

    @task(
        "reports.per_account",
        concurrency_key=lambda payload: f"acct.{payload['account']}",
        schedule=schedule("reports.nightly", every="1h", payload={"account": "a1"}),
    )
    async def fine(payload: dict) -> None:
        return None

    assert fine.schedules[0].id == "reports.nightly"


def test_schedule_queues_are_checked_against_the_registry():
    unregistered = queue("elsewhere")
    drifted = queue("reports", concurrency_limit=2)
    unbounded = queue("reports")

    @task("sq.unregistered", schedule=schedule("sq.unregistered.s", every="1h", queue=unregistered))
    async def one() -> None:
        return None

    @task("sq.drifted", schedule=schedule("sq.drifted.s", every="1h", queue=drifted))
    async def two() -> None:
        return None

    bounded = queue("bounded", concurrency_limit=1)

    @task("sq.keyed", queue=bounded, concurrency_key="k", schedule=schedule("sq.keyed.s", every="1h", queue=unbounded))
    async def three() -> None:
        return None

    # No queue on the schedule or the task: its runs land on the (unbounded) default queue.
    @task("sq.keyed_default", concurrency_key="k", schedule=schedule("sq.keyed_default.s", every="1h"))
    async def four() -> None:
        return None

    for definition, field in ((one, "queues"), (two, "queues"), (three, "concurrency_key"), (four, "concurrency_key")):
        with pytest.raises(RunlaneError) as caught:
            _runtime_with(definition, queues=[DEFAULT_QUEUE, unbounded, bounded])
        assert caught.value.code is ErrorCode.CONFIGURATION_INVALID
        assert caught.value.meta["field"] == field
    with pytest.raises(RunlaneError, match="schedule 'sq.keyed_default.s' runs it on queue 'default'"):
        _runtime_with(four, queues=[DEFAULT_QUEUE])
    # On a bounded default queue the same task registers and its runs are partitioned by the key.
    bounded_default = queue("default", default=True, concurrency_limit=1)
    runtime = _runtime_with(four, queues=[bounded_default])
    assert runtime is not None


async def test_a_one_off_schedule_blocked_by_its_singleton_key_runs_once_the_key_is_free():
    at = T0 + timedelta(minutes=1)

    @task("report.once", singleton_key="report", schedule=schedule("report.once", run_at=at, payload={}))
    async def report(payload: dict) -> None:
        return None

    runtime, clock = make_runtime(report, clock=ControlledClock(T0))
    async with runtime:
        blocker = (await runtime.trigger(report, {})).run  # still queued at the fire time
        clock.advance("2m")
        assert (await runtime.tick()).materialized == 0
        assert (await runtime.execute_next()).id == blocker.id  # the key is free again
        clock.advance("10m")  # past the occurrence's claim
        assert (await runtime.tick()).materialized == 1
        scheduled = [run for run in (await runtime.runs.list()).data if run.id != blocker.id]
        assert [run.source.schedule_id for run in scheduled] == ["report.once"]


async def test_schedules_past_the_materialization_limit_get_their_turn():
    @task("poll.tenants", schedule=[schedule(f"poll.t{n}", every="1m", payload={"n": n}) for n in range(5)])
    async def poll(payload: dict) -> None:
        return None

    runtime, clock = make_runtime(poll, clock=ControlledClock(T0))
    async with runtime:
        for _ in range(4):
            await runtime.tick(schedule_materialization_limit=2)
            clock.advance("1m")
        ran = {run.source.schedule_id for run in (await runtime.runs.list(limit=100)).data}
    assert ran == {f"poll.t{n}" for n in range(5)}


async def test_a_tick_in_a_new_process_each_time_still_gives_every_schedule_its_turn():
    # A cron job running `runlane tick` every minute starts a new runtime for each pass: where the last
    # pass stopped at its limit is kept in storage, so schedules past the limit are not starved.
    @task("poll.feeds", schedule=[schedule(f"poll.f{n:02d}", every="1m", payload={"n": n}) for n in range(7)])
    async def feeds(payload: dict) -> None:
        return None

    (*passes, reader), clock = shared_runtimes(*([feeds] for _ in range(4)), clock=ControlledClock(T0))
    for runtime in passes:
        async with runtime:
            assert (await runtime.tick(schedule_materialization_limit=3)).materialized == 3
        clock.advance("1m")
    async with reader:
        fired = Counter(run.source.schedule_id for run in (await reader.runs.list(limit=100)).data)
    # 3 passes of 3 cover all 7 schedules (the third pass wraps around to the first two).
    assert set(fired) == {f"poll.f{n:02d}" for n in range(7)}
    assert sum(fired.values()) == 9


async def test_two_applications_with_other_schedules_in_one_environment_each_give_every_schedule_its_turn():
    # Each application's pass stops at its limit and saves where the next starts: a schedule id the other
    # application does not have, so each started every pass with its first schedule and never reached
    # its later ones.
    @task("billing.sync", schedule=[schedule(f"billing.s{n}", every="1m", payload={"n": n}) for n in range(3)])
    async def billing(payload: dict) -> None:
        return None

    @task("mail.sync", schedule=[schedule(f"mail.s{n}", every="1m", payload={"n": n}) for n in range(3)])
    async def mail(payload: dict) -> None:
        return None

    (first, second, reader), clock = shared_runtimes([billing], [mail], [billing, mail], clock=ControlledClock(T0))
    async with first, second, reader:
        for _ in range(3):
            clock.advance("1m")  # every schedule is due again at each pass: the limit decides who fires
            assert (await first.tick(schedule_materialization_limit=1)).materialized == 1
            assert (await second.tick(schedule_materialization_limit=1)).materialized == 1
        fired = {run.source.schedule_id for run in (await reader.runs.list(limit=100)).data}
    assert fired == {f"{app}.s{n}" for app in ("billing", "mail") for n in range(3)}


# ---------------------------------------------------------------------------------------------
# Schedules that cannot fire, and fire times competing for one singleton key

def region_schema(accepted: set[str]) -> type[BaseModel]:
    """A payload schema accepting the regions in ``accepted`` as it is when a payload is validated: a
    schedule's payload valid when registered can be refused when due, as after a deploy changed the rules."""

    class Region(BaseModel):
        region: str

        @field_validator("region")
        @classmethod
        def known(cls, value: str) -> str:
            if value not in accepted:
                raise ValueError(f"unknown region {value!r}")
            return value

    return Region


# The local lane's record limit less what a new run leaves free (see Runlane._check_scheduled_runs_fit).
ROOM = 400 * 1024 - 4096 - 1024


def test_a_schedule_whose_payload_can_never_be_stored_is_refused_at_registration():
    @task("reports.build", schedule=schedule("reports.hourly", every="1h", payload={"template": "x" * 500_000}))
    async def build(payload: dict) -> None:
        return None

    with pytest.raises(RunlaneError) as caught:
        make_runtime(build)
    assert caught.value.code is ErrorCode.CONFIGURATION_INVALID
    assert caught.value.meta["schedule_id"] == "reports.hourly" and caught.value.meta["field"] == "payload"
    assert "a run of it would take 500,8" in caught.value.message
    assert "could never be stored on this lane" in caught.value.message
    assert "its payload takes 500,015. Keep large data elsewhere and pass a reference" in caught.value.message


def test_a_schedule_payload_just_small_enough_alone_but_not_with_its_run_is_refused_at_registration():
    """The run around the payload (ids, source, times, events) counts too: a payload that leaves too little
    room for it would fail every pass instead, and stop the maintenance after it."""
    blob = "x" * (ROOM - len('{"template":""}') - 50)

    @task("reports.build", schedule=schedule("reports.hourly", every="1h", payload={"template": blob}))
    async def build(payload: dict) -> None:
        return None

    with pytest.raises(RunlaneError) as caught:
        make_runtime(build)
    assert caught.value.code is ErrorCode.CONFIGURATION_INVALID and caught.value.meta["schedule_id"] == "reports.hourly"

    @task("reports.build", schedule=schedule("reports.hourly", every="1h", payload={"template": blob[:-1000]}))
    async def fits(payload: dict) -> None:
        return None

    make_runtime(fits)  # 1,000 bytes less: its runs fit, and it is accepted


async def test_a_schedule_failing_every_pass_is_reported_once_and_the_maintenance_loop_keeps_going():
    from runlane.cli.tick import tick_until_stopped

    accepted = {"eu"}

    Region = region_schema(accepted)

    # Valid when registered, refused when due: fails every pass until fixed.
    @task("reports.build", schema=Region, schedule=schedule("reports.hourly", every="1h", payload={"region": "eu"}))
    async def build(payload: Any) -> None:
        return None

    @task("ok.task", schedule=schedule("ok.minutely", every="1m"))
    async def fine() -> None:
        return None

    runtime, clock = make_runtime(build, fine, clock=ControlledClock(T0))
    accepted.clear()
    records: list[tuple[str, dict[str, Any]]] = []
    ticks: list[Any] = []

    class Output:
        def record(self, kind: str, text: str, **fields: Any) -> None:
            records.append((kind, fields))

        def tick_record(self, result: Any) -> None:
            ticks.append(result)

    stopping = asyncio.Event()
    passes = 0

    class Stepping:
        async def tick(self, **limits: Any) -> Any:
            nonlocal passes
            passes += 1
            if passes == 3:
                stopping.set()
            clock.advance("1h")
            return await runtime.tick(**limits)

    async with runtime:
        looping = tick_until_stopped(Stepping(), Output(), {}, 0.001, stopping)  # type: ignore[arg-type]
        await asyncio.wait_for(looping, 20)
        runs = await all_runs(runtime)
    assert passes == 3 and ticks == []  # every pass raised, none stopped the loop
    (failed,) = records
    assert failed[0] == "tick_failed" and failed[1]["error_code"] == "configuration_invalid"
    assert "Invalid payload of schedule 'reports.hourly'" in failed[1]["error_message"]
    # Each pass stops at the failing schedule: the one after it waits for the fix, as the later phases do.
    assert runs == []


async def test_a_schedule_payload_the_task_no_longer_accepts_says_to_fix_the_schedule_not_the_run():
    """Validated at registration, then again before each materialization: the task's rules may have
    changed since (a validator reading settings, say). No run exists yet, so the advice is about the schedule."""
    accepted = {"eu", "us"}

    Region = region_schema(accepted)

    @task("reports.regional", schema=Region, schedule=schedule("reports.eu", every="1h", payload={"region": "eu"}))
    async def regional(payload: Any) -> None:
        return None

    runtime, clock = make_runtime(regional, clock=ControlledClock(T0))
    async with runtime:
        accepted.discard("eu")  # the region was retired after the schedule was registered
        with pytest.raises(RunlaneError) as caught:
            await runtime.tick()
        assert await all_runs(runtime) == []
    assert caught.value.code is ErrorCode.CONFIGURATION_INVALID
    assert caught.value.meta["schedule_id"] == "reports.eu"
    message = caught.value.message
    assert message.startswith("Invalid payload of schedule 'reports.eu' (task 'reports.regional'): region: ")
    assert "unknown region 'eu'" in message
    assert message.endswith(
        "Change the schedule's payload= to one the task accepts, or pass enabled=False to schedule() until it does."
    )
    assert "trigger a new run" not in message


async def test_a_one_off_fire_time_is_not_starved_by_a_recurring_schedule_of_the_same_singleton_task():
    once_at = T0 + timedelta(minutes=1)

    @task(
        "accounts.sync",
        singleton_key=lambda payload: "account_123",
        schedule=[
            schedule("accounts.sync.minutely", every="1m", payload={"full": False}),
            schedule("accounts.sync.full_once", run_at=once_at, payload={"full": True}),
        ],
    )
    async def sync(payload: dict) -> None:
        return None

    runtime, clock = make_runtime(sync, clock=ControlledClock(T0 + timedelta(seconds=30)))
    async with runtime:
        for _ in range(2 * 60):  # an hour of passes every 30 s, with a worker that keeps up
            await runtime.tick()
            while await runtime.execute_next() is not None:
                pass
            clock.advance("30s")
        runs = await all_runs(runtime)
    fired = Counter(run.source.schedule_id for run in runs)
    assert fired["accounts.sync.full_once"] == 1
    assert fired["accounts.sync.minutely"] >= 50  # it yields only the fire times the one-off's run held
