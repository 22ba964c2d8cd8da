"""``runlane.runs.prune()``: validated before storage, hides pruned runs from every operator read at
once, continues with frozen cursors, and leaves active work and other environments alone."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from runlane import (
    Actor,
    ActorType,
    ErrorCode,
    LaneDelivery,
    LaneDeliveryMode,
    PruneResult,
    RunlaneError,
    RunStatus,
    TaskContext,
    TriggerOutcomeType,
    contract_defaults,
    create_lane,
    create_runlane,
    queue,
    task,
)
from runlane.core.pruning import decode_run_tombstone
from runlane.models import environment_key
from runlane.storage.tables import run_tombstone_key
from runlane.testing import ControlledClock
from runlane_local import LocalStorageStore, local_lane, local_storage_driver

from runtime_support import DEFAULT_QUEUE

T0 = datetime(2026, 1, 1, tzinfo=UTC)
PARKED = queue("parked")  # never executed here: its runs stay active
OPERATOR = Actor(type=ActorType.OPERATOR, id="ops@example.com")


@task("work.ok", idempotency_key=lambda payload: payload["key"], idempotency_key_ttl="30d")
async def ok(payload: dict) -> str:
    return "done"


@task("work.boom")
async def boom(payload: dict) -> None:
    raise ValueError("boom")


@task("work.parked", queue=PARKED)
async def parked(payload: dict) -> None:
    return None


class _Crash(Exception):
    pass


class _Transaction:
    def __init__(self, inner: Any, driver: StorageProbe) -> None:
        self._inner = inner
        self._driver = driver

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def delete(self, current: Any) -> None:
        if self._driver.crash_on_delete and current.key.collection in ("run_events", "run_steps"):
            raise _Crash("cleanup interrupted")
        self._inner.delete(current)


class StorageProbe:
    """The local driver, counting storage calls; optionally dying when cleanup deletes a child record."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.name = inner.name
        self.profile = inner.profile
        self.calls = 0
        self.crash_on_delete = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def get(self, keys: Any) -> Any:
        self.calls += 1
        return await self._inner.get(keys)

    async def query(self, query: Any) -> Any:
        self.calls += 1
        return await self._inner.query(query)

    async def with_transaction(self, callback: Any) -> Any:
        self.calls += 1
        return await self._inner.with_transaction(lambda tx: callback(_Transaction(tx, self)))


def make(*, environment: str = "default", store: LocalStorageStore | None = None, clock: ControlledClock | None = None):
    clock = clock or ControlledClock(T0)
    probe = StorageProbe(local_storage_driver(store=store))
    lane = create_lane(storage=probe, delivery=LaneDelivery(mode=LaneDeliveryMode.STORAGE_POLLING))
    runtime = create_runlane(
        lane=lane,
        queues=[DEFAULT_QUEUE, PARKED],
        tasks=[ok, boom, parked],
        clock=clock,
        environment=environment,
    )
    return runtime, clock, probe


async def finish(runtime: Any, definition: Any, payload: dict) -> str:
    run = await runtime.run_now(definition, payload)
    return run.id


async def visible(runtime: Any) -> set[str]:
    return {summary.id for summary in (await runtime.runs.list(limit=100)).data}


# ---------------------------------------------------------------------------------------------


async def test_prune_removes_old_terminal_runs_and_keeps_active_and_recent_ones():
    runtime, clock, _ = make()
    async with runtime:
        succeeded = await finish(runtime, ok, {"key": "a"})
        failed = await finish(runtime, boom, {})
        active = (await runtime.trigger(parked, {})).run.id
        clock.advance("2d")
        recent = await finish(runtime, ok, {"key": "b"})
        assert (await runtime.runs.get(failed)).status is RunStatus.FAILED

        result = await runtime.runs.prune(older_than="1d", statuses="succeeded")  # one bare status: one value
        assert result == PruneResult(pruned=1, next_cursor=None)
        assert await runtime.runs.get(succeeded) is None
        assert await runtime.store.get_run(succeeded) is None  # cleanup removed the records too
        assert await visible(runtime) == {failed, active, recent}

        assert (await runtime.runs.prune(older_than="1d")).pruned == 1  # every terminal status by default
        assert await visible(runtime) == {active, recent}
        # A cutoff in the future still never touches active work.
        assert (await runtime.runs.prune(older_than=clock.now() + timedelta(days=1))).pruned == 1
        assert await visible(runtime) == {active}
        assert (await runtime.runs.get(active)).status is RunStatus.QUEUED


async def test_each_prune_call_deletes_the_records_of_every_run_it_pruned():
    # 300 runs of four events each are more child records than the cleanup budget for an older
    # backlog (1,000): the call still deletes all of them, so paging through cursors leaves nothing.
    runtime, clock, _ = make()
    async with runtime:
        run_ids = [await finish(runtime, ok, {"key": f"k{i}"}) for i in range(300)]
        clock.advance("2d")
        assert (await runtime.runs.prune(older_than="1d", limit=300)).pruned == 300
        assert [run_id for run_id in run_ids if await runtime.store.get_run(run_id) is not None] == []


async def test_after_an_interrupted_prune_following_the_cursors_deletes_every_record_left():
    # A call that dies after tombstoning (here: while deleting the first child record) leaves its runs
    # hidden with all their records. When they are more than one call cleans besides its own runs, the
    # calls that find nothing left to prune still return a cursor until every record is deleted.
    runtime, clock, probe = make()
    async with runtime:
        run_ids = [await finish(runtime, ok, {"key": f"k{i}"}) for i in range(300)]  # 1,200 events
        clock.advance("2d")
        probe.crash_on_delete = True
        with pytest.raises(_Crash):
            await runtime.runs.prune(older_than="1d", limit=300)
        probe.crash_on_delete = False
        assert await visible(runtime) == set()

        result = await runtime.runs.prune(older_than="1d", limit=300)
        calls = 1
        while result.next_cursor is not None:
            assert calls < 10
            result = await runtime.runs.prune(older_than="1d", limit=300, cursor=result.next_cursor)
            assert result.pruned == 0
            calls += 1
        assert [run_id for run_id in run_ids if await runtime.store.get_run(run_id) is not None] == []
        # Nothing is left to clean: the next call is done at once.
        assert await runtime.runs.prune(older_than="1d") == PruneResult(pruned=0, next_cursor=None)


@task("work.waits")
async def waits(payload: dict, ctx: TaskContext) -> str:
    if ctx.attempt == 1:
        return ctx.wait_for_run(payload["source"])
    return "resumed"


async def test_pruning_a_run_that_was_waited_for_keeps_its_completion_wait_marker():
    # The marker is a durable, monotonic hint that waiters were ever registered (the storage contract):
    # pruning cannot know none are left, so it never deletes one.
    from runlane.core.store import completion_wait_key

    clock = ControlledClock(T0)
    runtime = create_runlane(lane=local_lane(), queues=[DEFAULT_QUEUE, PARKED], tasks=[ok, waits], clock=clock)
    async with runtime:
        source = (await runtime.trigger(ok, {"key": "waited"})).run
        waiter = await runtime.run_now(waits, {"source": source.id})
        assert waiter.status is RunStatus.RELEASED
        marker = completion_wait_key(environment_key(runtime.environment), source.id)
        assert (await runtime.lane.storage.get([marker]))[0] is not None
        assert (await runtime.execute_next()).id == source.id
        assert (await runtime.execute_next()).output == "resumed"
        clock.advance("2d")
        assert (await runtime.runs.prune(older_than="1d")).pruned == 2
        assert await runtime.runs.get(source.id) is None and await runtime.store.get_run(source.id) is None
        assert (await runtime.lane.storage.get([marker]))[0] is not None


async def test_a_pruned_run_is_invisible_from_its_tombstoning_commit_even_before_cleanup():
    runtime, clock, probe = make()
    async with runtime:
        run_id = await finish(runtime, ok, {"key": "k"})
        clock.advance("2d")
        kept = await finish(runtime, ok, {"key": "other"})  # too recent to prune
        pruned_at = clock.now()
        probe.crash_on_delete = True
        with pytest.raises(_Crash):
            await runtime.runs.prune(older_than="1d", statuses=["succeeded"], limit=1)
        probe.crash_on_delete = False

        # Tombstoned, children not cleaned: the stored run record is still there ...
        stored = await runtime.store.get_run(run_id)
        assert stored is not None and stored.status is RunStatus.SUCCEEDED
        (record,) = await runtime.lane.storage.get([run_tombstone_key(runtime.store.env_key, run_id)])
        tombstone = decode_run_tombstone(record)
        assert tombstone.pruned_by == contract_defaults.actor.operator and tombstone.tombstoned_at == pruned_at
        # ... but every operator read already hides it.
        assert await runtime.runs.get(run_id) is None
        assert await visible(runtime) == {kept}
        for action in (
            lambda: runtime.runs.events(run_id),
            lambda: runtime.runs.attempts(run_id),
            lambda: runtime.runs.rerun(run_id),
            lambda: runtime.runs.retry(run_id),
            lambda: runtime.runs.cancel(run_id),
        ):
            with pytest.raises(RunlaneError) as caught:
                await action()
            assert caught.value.code is ErrorCode.RUN_NOT_FOUND

        # The next prune call finishes the cleanup (nothing new to tombstone).
        assert (await runtime.runs.prune(older_than="1d", statuses=["succeeded"], limit=1)).pruned == 0
        assert await runtime.store.get_run(run_id) is None
        (record,) = await runtime.lane.storage.get([run_tombstone_key(runtime.store.env_key, run_id)])
        assert record is None
        assert (await runtime.runs.get(kept)).status is RunStatus.SUCCEEDED


async def test_requests_are_validated_before_storage_is_touched():
    runtime, clock, probe = make()
    async with runtime:
        await finish(runtime, ok, {"key": "a"})
        before = probe.calls
        bad_requests: list[dict[str, Any]] = [
            {"older_than": "1d", "statuses": ["running"]},  # active statuses are rejected
            {"older_than": "1d", "statuses": ["queued", "succeeded"]},
            {"older_than": "1d", "statuses": []},
            {"older_than": "1d", "statuses": ["nope"]},
            {"older_than": "1d", "statuses": "running"},
            {"older_than": "1d", "statuses": 3},
            {"older_than": "soon"},
            {"older_than": datetime(2026, 1, 1)},  # naive
            {"older_than": 30},
            {"older_than": "1d", "limit": 0},
            {"older_than": "1d", "limit": True},
            {"older_than": "1d", "cursor": "not-a-cursor"},
        ]
        for request in bad_requests:
            with pytest.raises(RunlaneError) as caught:
                await runtime.runs.prune(**request)
            assert caught.value.code is ErrorCode.VALIDATION_FAILED, request
        with pytest.raises(RunlaneError) as caught:  # an option, as on cancel, retry and rerun
            await runtime.runs.prune(older_than="1d", actor={"type": "operator"})  # type: ignore[arg-type]
        assert caught.value.code is ErrorCode.CONFIGURATION_INVALID
        assert probe.calls == before


async def test_an_actor_id_too_large_for_the_tombstone_says_so():
    # The tombstone records who pruned the run: an actor id past the lane's record limit is the
    # caller's mistake to correct, not work to split.
    runtime, clock, _ = make()
    async with runtime:
        run_id = await finish(runtime, ok, {"key": "a"})
        clock.advance("2d")
        huge = Actor(type=ActorType.OPERATOR, id="x" * 500_000)
        with pytest.raises(RunlaneError) as caught:
            await runtime.runs.prune(older_than="1d", actor=huge)
        assert caught.value.code is ErrorCode.VALIDATION_FAILED
        message = caught.value.message
        assert "max_record_bytes" in message and "actor id" in message and "500,000 bytes" in message
        assert "split the work" not in message
        assert (await runtime.runs.get(run_id)).status is RunStatus.SUCCEEDED  # not pruned
        assert (await runtime.runs.prune(older_than="1d", actor=OPERATOR)).pruned == 1


async def test_continuations_keep_their_frozen_scope():
    runtime, clock, _ = make()
    async with runtime:
        old = [await finish(runtime, ok, {"key": f"k{i}"}) for i in range(5)]
        clock.advance("2d")
        first = await runtime.runs.prune(older_than="1d", statuses=["succeeded"], limit=2, actor=OPERATOR)
        assert first.pruned == 2 and first.next_cursor is not None
        # A run finishing later, and a clock that moves on, do not widen the continuation.
        later = await finish(runtime, ok, {"key": "later"})
        clock.advance("3d")
        for wrong in (
            {"statuses": ["succeeded", "failed"]},
            {"statuses": None},
            {"older_than": "12h"},  # another duration: the spec rejects a continuation with another olderThan
            {"older_than": "30d"},
            {"older_than": T0},
        ):
            options = {"older_than": "1d", "statuses": ["succeeded"], **wrong}
            with pytest.raises(RunlaneError) as caught:
                await runtime.runs.prune(limit=2, cursor=first.next_cursor, **options)
            assert caught.value.code is ErrorCode.VALIDATION_FAILED
        pruned = first.pruned
        cursor = first.next_cursor
        while cursor is not None:
            page = await runtime.runs.prune(older_than="1d", statuses=["succeeded"], limit=2, cursor=cursor)
            pruned += page.pruned
            cursor = page.next_cursor
        assert pruned == 5
        assert [await runtime.runs.get(run_id) for run_id in old] == [None] * 5
        assert (await runtime.runs.get(later)).status is RunStatus.SUCCEEDED
        # A fresh prune computes a new cutoff and takes the later run as well.
        assert (await runtime.runs.prune(older_than="1d")).pruned == 1


async def test_pruning_releases_the_retained_idempotency_key():
    runtime, clock, _ = make()
    async with runtime:
        first = await finish(runtime, ok, {"key": "invoice_1"})
        again = await runtime.trigger(ok, {"key": "invoice_1"})
        assert again.outcome is TriggerOutcomeType.RETURNED_EXISTING and again.run.id == first
        clock.advance("2d")
        assert (await runtime.runs.prune(older_than="1d")).pruned == 1
        fresh = await runtime.trigger(ok, {"key": "invoice_1"})
        assert fresh.outcome is TriggerOutcomeType.CREATED and fresh.run.id != first


async def test_pruning_keeps_the_observation_stream_and_other_environments():
    store = LocalStorageStore()
    clock = ControlledClock(T0)
    production, _, _ = make(environment="production", store=store, clock=clock)
    staging, _, _ = make(environment="staging", store=store, clock=clock)
    async with production, staging:
        pruned = await finish(production, ok, {"key": "p"})
        other = await finish(staging, ok, {"key": "s"})
        records = (await production.observations.scan(limit=100)).records
        assert {record.observation.run_id for record in records} == {pruned}
        clock.advance("2d")
        assert (await production.runs.prune(older_than="1d")).pruned == 1
        assert await production.runs.get(pruned) is None
        assert (await staging.runs.get(other)).status is RunStatus.SUCCEEDED
        assert (await production.observations.scan(limit=100)).records == records


async def test_prune_on_a_closed_runtime_is_refused():
    runtime, _, probe = make()
    async with runtime:
        pass
    with pytest.raises(RunlaneError) as caught:
        await runtime.runs.prune(older_than="1d")
    assert caught.value.code is ErrorCode.CONFIGURATION_INVALID


def test_the_sync_facade_prunes_and_scans_too():
    runtime, clock, _ = make()
    with runtime.sync as sync:
        run = sync.run_now(ok, {"key": "sync"})
        assert {record.observation.run_id for record in sync.observations.scan(limit=100).records} == {run.id}
        clock.advance("2d")
        assert sync.runs.prune(older_than="1d") == PruneResult(pruned=1, next_cursor=None)
        assert sync.runs.get(run.id) is None
        assert sync.observations.checkpoint("nobody") is None
        trimmed = sync.observations.trim(older_than="1d")
        assert (trimmed.deleted, trimmed.more) == (4, False)
        assert sync.observations.scan(limit=100).records == []
