"""Run pruning: tombstones hide old terminal runs in one commit, bounded cleanup removes every child
record by exact counters, and prune cursors freeze their retention scope."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest

from runlane import (
    Actor,
    ActorType,
    Environment,
    ErrorCode,
    PaginationCursorKind,
    PaginationParams,
    RunEventFilter,
    RunlaneError,
    RunStatus,
    TaskContext,
    TriggerOutcomeType,
    LaneDelivery,
    LaneDeliveryMode,
    contract_defaults,
    create_lane,
    create_runlane,
    queue,
    task,
)
from runlane.core.pruning import (
    DEFAULT_CLEANUP_BUDGET,
    PruneResult,
    RunPruner,
    decode_run_tombstone,
    prune_cursor_scope,
    resolve_prune_request,
    run_tombstone_record,
)
from runlane.core.store import idempotency_owner_key, run_step_key
from runlane.storage import (
    NewStorageRecord,
    StorageAppendCommand,
    StorageDocument,
    StorageIndexEntry,
    StorageIndexName,
    StorageLimitError,
    StorageLimits,
    StorageQuery,
    StorageRecordKey,
    encode_operator_cursor,
)
from runlane.storage.cursor import decode_opaque_token, encode_opaque_token
from runlane.storage.tables import (
    RunChildCounts,
    decode_run_document,
    encode_run_document,
    run_key,
    run_tombstone_key,
)
from runlane.storage.types import StorageStreamName
from runlane.testing import ControlledClock
from runlane_local import local_lane, local_storage_driver

DEFAULT = queue("default", default=True)
PARKED = queue("parked")  # never executed here: its runs stay active
OPERATOR = Actor(type=ActorType.OPERATOR, id="ops@example.com")
DAY_MS = 86_400_000
TERMINAL = frozenset({RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED})


@task("work.plain")
async def plain(payload: dict) -> str:
    return "done"


@task("work.steps")
async def with_steps(payload: dict, ctx: TaskContext) -> int:
    first = await ctx.step.run("first", lambda token: {"n": 1})
    second = await ctx.step.run("second", lambda token: {"n": 2})
    return first["n"] + second["n"]


@task("work.boom")
async def boom(payload: dict) -> None:
    raise RuntimeError("provider rejected")


@task("work.keyed", idempotency_key=lambda payload: payload["key"])
async def keyed(payload: dict) -> str:
    return "keyed"


@task("work.parked", queue=PARKED)
async def parked(payload: dict) -> None:
    return None


TASKS = [plain, with_steps, boom, keyed, parked]


def make(limits: StorageLimits | None = None):
    clock = ControlledClock()
    lane = local_lane()
    if limits is not None:
        lane = create_lane(
            storage=local_storage_driver(limits=limits),
            delivery=LaneDelivery(mode=LaneDeliveryMode.STORAGE_POLLING),
            operator_reads=True,
        )
    runtime = create_runlane(lane=lane, queues=[DEFAULT, PARKED], tasks=TASKS, clock=clock)
    return runtime, clock


async def finish(runtime, task_def, payload=None, **options) -> str:
    """Trigger one run and execute it to its terminal state; returns the run id."""
    run = (await runtime.trigger(task_def, payload if payload is not None else {}, **options)).run
    executed = await runtime.execute_next(queues=[DEFAULT])
    assert executed is not None and executed.id == run.id
    runtime.clock.advance("1s")  # distinct finish times keep the candidate order predictable
    return run.id


async def cancelled(runtime) -> str:
    run = (await runtime.trigger(plain, {})).run
    assert (await runtime.runs.cancel(run.id)).status is RunStatus.CANCELLED
    runtime.clock.advance("1s")
    return run.id


async def raw(driver, key: StorageRecordKey):
    (record,) = await driver.get([key])
    return record


async def index_keys(driver, index: StorageIndexName, partition: tuple[str, ...]) -> list[StorageRecordKey]:
    result = await driver.query(StorageQuery(index, partition, limit=100))
    return [ref.key for ref in result.items]


async def child_keys(driver, env: str, run_id: str) -> dict[str, list[StorageRecordKey]]:
    return {
        "events": await index_keys(driver, StorageIndexName.RUN_EVENTS_BY_RUN, (env, run_id)),
        "steps": await index_keys(driver, StorageIndexName.RUN_STEPS_BY_RUN, (env, run_id)),
        "outbox": await index_keys(driver, StorageIndexName.OUTBOX_BY_RUN, (env, run_id)),
    }


async def visible_ids(runtime) -> set[str]:
    page = await runtime.runs.list(limit=100)
    assert page.next_cursor is None
    return {summary.id for summary in page.data}


async def visible_events(runtime, run_id: str) -> list[Any]:
    """Events operator reads show for a run (none once it is tombstoned, whether or not the raw
    record lookup still finds the run)."""
    try:
        page = await runtime.runs.events(run_id, limit=100)
    except RunlaneError as error:
        assert error.code is ErrorCode.RUN_NOT_FOUND
        return []
    return page.data


async def prune_all(pruner: RunPruner, clock: ControlledClock, *, older_than="1d", statuses=None, limit=None):
    now = clock.now()
    cutoff, chosen, wanted = resolve_prune_request(older_than=older_than, statuses=statuses, limit=limit, now=now)
    return await pruner.prune(older_than=cutoff, statuses=chosen, limit=wanted, cursor=None, actor=OPERATOR, now=now)


class _Raises:
    def __init__(self, code: ErrorCode) -> None:
        self.code = code
        self.error: RunlaneError | None = None

    def __enter__(self) -> _Raises:
        return self

    def __exit__(self, kind, error, traceback) -> bool:
        assert error is not None, f"expected {self.code.value}"
        assert isinstance(error, RunlaneError), error
        assert error.code is self.code, (error.code, error.message)
        self.error = error
        return True


# ---------------------------------------------------------------------------------------------
# Eligibility and cleanup through the public runtime


async def test_prunes_only_old_terminal_runs_of_the_chosen_statuses_and_removes_every_record():
    runtime, clock = make()
    async with runtime:
        driver = runtime.lane.storage
        env = runtime.store.env_key
        stepped = await finish(runtime, with_steps)
        failed = await finish(runtime, boom)
        plain_old = await finish(runtime, plain)
        cancelled_old = await cancelled(runtime)
        active = (await runtime.trigger(parked, {})).run.id  # queued: never executed
        clock.advance("2d")
        recent = await finish(runtime, plain)
        every = (stepped, failed, plain_old, cancelled_old, active, recent)
        statuses = {run_id: (await runtime.runs.get(run_id)).status for run_id in every}
        assert statuses == {
            stepped: RunStatus.SUCCEEDED,
            failed: RunStatus.FAILED,
            plain_old: RunStatus.SUCCEEDED,
            cancelled_old: RunStatus.CANCELLED,
            active: RunStatus.QUEUED,
            recent: RunStatus.SUCCEEDED,
        }
        children = {run_id: await child_keys(driver, env, run_id) for run_id in statuses}
        assert len(children[stepped]["steps"]) == 2 and len(children[stepped]["events"]) >= 4

        pruner = RunPruner(driver, runtime.environment)
        result = await prune_all(pruner, clock, statuses=[RunStatus.SUCCEEDED, RunStatus.CANCELLED])
        assert result == PruneResult(pruned=3, next_cursor=None)

        for run_id in (stepped, plain_old, cancelled_old):
            assert await runtime.runs.get(run_id) is None
            assert await visible_events(runtime, run_id) == []
            assert await raw(driver, run_key(env, run_id)) is None
            assert await raw(driver, run_tombstone_key(env, run_id)) is None
            for kind, keys in children[run_id].items():
                assert [await raw(driver, key) for key in keys] == [None] * len(keys), kind
            assert await child_keys(driver, env, run_id) == {"events": [], "steps": [], "outbox": []}
        assert await raw(driver, run_step_key(env, stepped, "first")) is None
        # The failed, active and recent runs keep everything.
        assert await visible_ids(runtime) == {failed, active, recent}
        for run_id in (failed, active, recent):
            assert (await runtime.runs.get(run_id)).status is statuses[run_id]
            assert await child_keys(driver, env, run_id) == children[run_id]
        assert await index_keys(driver, StorageIndexName.RUN_TOMBSTONES, (env,)) == []

        # Pruning the failed status too takes the failed run; the active run is never a candidate.
        result = await prune_all(pruner, clock, statuses=None)
        assert result.pruned == 1
        assert await visible_ids(runtime) == {active, recent}
        assert await raw(driver, run_key(env, failed)) is None
        # Even a cutoff in the future leaves active work alone.
        clock.advance("1d")
        result = await prune_all(pruner, clock, older_than=clock.now() + timedelta(days=1))
        assert result.pruned == 1
        assert await visible_ids(runtime) == {active}
        assert (await runtime.runs.get(active)).status is RunStatus.QUEUED
        assert await child_keys(driver, env, active) == children[active]


async def test_tombstone_hides_the_run_in_its_commit_and_cleanup_follows_exact_counters():
    runtime, clock = make()
    async with runtime:
        driver = runtime.lane.storage
        env = runtime.store.env_key
        run_id = await finish(runtime, with_steps)
        kept = await finish(runtime, plain)
        (record,) = await driver.get([run_key(env, run_id)])
        run, counts = decode_run_document(record.document)
        events = await index_keys(driver, StorageIndexName.RUN_EVENTS_BY_RUN, (env, run_id))
        assert counts == RunChildCounts(events=len(events), steps=2)
        finished_at = run.finished_at
        clock.advance("2d")

        pruner = RunPruner(driver, runtime.environment, cleanup_budget=0)
        cutoff, statuses, limit = resolve_prune_request(older_than="1d", now=clock.now())
        pruned_at = clock.now()
        result = await pruner.prune(
            older_than=cutoff,
            statuses=frozenset({RunStatus.SUCCEEDED}),
            limit=1,
            cursor=None,
            actor=OPERATOR,
            now=pruned_at,
        )
        assert result.pruned == 1

        # The tombstone copies the exact counts; the run keeps its document without index entries.
        tombstone_record = await raw(driver, run_tombstone_key(env, run_id))
        tombstone = decode_run_tombstone(tombstone_record)
        assert tombstone.children == counts and tombstone.pruned_by == OPERATOR and tombstone.tombstoned_at == pruned_at
        assert tombstone_record.document.value["pruned_by"] == {"type": "operator", "id": "ops@example.com"}
        hidden = await raw(driver, run_key(env, run_id))
        assert hidden.document == record.document and hidden.indexes == ()
        terminal = await index_keys(driver, StorageIndexName.RUNS_TERMINAL_BY_FINISHED_AT, (env,))
        assert run_key(env, run_id) not in terminal and run_key(env, kept) in terminal
        assert [key.parts[-1] for key in await index_keys(driver, StorageIndexName.RUN_TOMBSTONES, (env,))] == [run_id]
        # Operator reads hide the run and its history at once; raw children are still there.
        assert await driver.get_run(runtime.environment, run_id) is None
        assert await visible_ids(runtime) == {kept}
        assert await visible_events(runtime, run_id) == []
        assert len(await index_keys(driver, StorageIndexName.RUN_EVENTS_BY_RUN, (env, run_id))) == counts.events
        assert finished_at is not None and finished_at < cutoff

        # Bounded cleanup: every pass deletes at most its budget and lowers the counters exactly.
        remaining = counts.events + counts.steps
        while remaining > 2:
            step = await pruner.cleanup(budget=2)
            assert (step.deleted, step.finished, step.pending) == (2, 0, 1)
            remaining -= 2
            current = decode_run_tombstone(await raw(driver, run_tombstone_key(env, run_id))).children
            left = await child_keys(driver, env, run_id)
            assert current.events == len(left["events"]) and current.steps == len(left["steps"])
            assert current.events + current.steps == remaining
            assert await raw(driver, run_key(env, run_id)) is not None
        last = await pruner.cleanup(budget=2)
        assert (last.deleted, last.finished, last.pending) == (remaining, 1, 0)
        assert await raw(driver, run_key(env, run_id)) is None
        assert await raw(driver, run_tombstone_key(env, run_id)) is None
        assert await runtime.runs.get(run_id) is None
        assert await pruner.cleanup() == type(last)()
        assert (await runtime.runs.get(kept)).status is RunStatus.SUCCEEDED


class CommitProbe:
    """A driver wrapper that checks, after every committed transaction, that each watched run is either
    visible with its index entries and no tombstone, or hidden with a tombstone and no index entries."""

    def __init__(self, inner, environment: Environment, run_ids: list[str]) -> None:
        self._inner = inner
        self._environment = environment
        self._run_ids = run_ids
        self.commits = 0
        self.states: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def with_transaction(self, callback):
        result = await self._inner.with_transaction(callback)
        self.commits += 1
        env = self._environment.name
        for run_id in self._run_ids:
            record, tombstone = await self._inner.get([run_key(env, run_id), run_tombstone_key(env, run_id)])
            visible = await self._inner.get_run(self._environment, run_id)
            if tombstone is None and record is None:
                assert visible is None
                self.states.add("gone")
            elif tombstone is None:
                assert record.indexes and visible is not None
                self.states.add("visible")
            else:
                assert visible is None and (record is None or record.indexes == ())
                events = await self._inner.list_run_events(
                    RunEventFilter(environment=self._environment, run_id=run_id), PaginationParams(limit=10)
                )
                assert events.data == []
                self.states.add("tombstoned")
        return result


async def test_every_commit_keeps_visibility_and_tombstones_in_step():
    runtime, clock = make()
    async with runtime:
        run_ids = [await finish(runtime, with_steps) for _ in range(3)]
        clock.advance("2d")
        probe = CommitProbe(runtime.lane.storage, runtime.environment, run_ids)
        pruner = RunPruner(probe, runtime.environment, cleanup_budget=3)
        results = []
        while True:
            results.append(await prune_all(pruner, clock, limit=2))
            storage, env = runtime.lane.storage, runtime.store.env_key
            tombstones = await index_keys(storage, StorageIndexName.RUN_TOMBSTONES, (env,))
            if not tombstones and results[-1].pruned == 0:
                break
        assert sum(result.pruned for result in results) == 3
        assert probe.commits > 6 and probe.states == {"visible", "tombstoned", "gone"}
        assert await visible_ids(runtime) == set()


# ---------------------------------------------------------------------------------------------
# Continuations


async def test_continuations_keep_the_frozen_cutoff_across_calls():
    runtime, clock = make()
    async with runtime:
        driver = runtime.lane.storage
        old = []
        for _ in range(5):
            old.append(await finish(runtime, plain))
            clock.advance("1m")
        clock.advance("1d")
        # Finished after the first call's cutoff: a recomputed cutoff would take it later on.
        later = await finish(runtime, plain)
        pruner = RunPruner(driver, runtime.environment)

        cutoffs = []
        pruned = 0
        cursor = None
        calls = 0
        while True:
            cutoff, statuses, limit = resolve_prune_request(
                older_than="1d", statuses=[RunStatus.SUCCEEDED], limit=2, cursor=cursor, now=clock.now(),
                environment=runtime.environment,
            )
            cutoffs.append(cutoff)
            result = await pruner.prune(
                older_than=cutoff, statuses=statuses, limit=limit, cursor=cursor, actor=OPERATOR, now=clock.now(),
                older_than_ms=DAY_MS,
            )
            calls += 1
            pruned += result.pruned
            assert result.pruned <= 2
            clock.advance("2d")  # far enough that `later` would be old under a fresh cutoff
            if result.next_cursor is None:
                break
            cursor = result.next_cursor
        assert len(set(cutoffs)) == 1 and calls == 3
        assert pruned == 5
        assert await visible_ids(runtime) == {later}
        # A new prune (no cursor) computes a new cutoff and takes the later run as well.
        assert (await prune_all(pruner, clock)).pruned == 1
        assert await visible_ids(runtime) == set()
        assert [await runtime.runs.get(run_id) for run_id in old] == [None] * len(old)


async def test_limit_counts_pruned_runs_so_a_status_filter_gets_past_older_runs_of_other_statuses():
    # The three oldest terminal runs failed; pruning succeeded runs with a limit of 2 reads past them
    # in the same call (the limit bounds runs pruned, not rows read) and ends without a cursor.
    runtime, clock = make()
    async with runtime:
        failed = [await finish(runtime, boom) for _ in range(3)]
        succeeded = await finish(runtime, plain)
        clock.advance("2d")
        pruner = RunPruner(runtime.lane.storage, runtime.environment)
        cursor = None
        results = []
        while True:
            cutoff, statuses, limit = resolve_prune_request(
                older_than="1d", statuses=["succeeded"], limit=2, cursor=cursor, now=clock.now()
            )
            result = await pruner.prune(
                older_than=cutoff, statuses=statuses, limit=limit, cursor=cursor, actor=OPERATOR, now=clock.now(),
                older_than_ms=DAY_MS,
            )
            results.append(result.pruned)
            if result.next_cursor is None:
                break
            cursor = result.next_cursor
        assert results == [1]
        assert await visible_ids(runtime) == set(failed)
        assert await runtime.runs.get(succeeded) is None


async def test_a_call_reads_a_bounded_number_of_rows_and_continues_with_a_cursor():
    # 1,050 older failed runs stand before the one succeeded run: a call reads at most 1,000 rows
    # (ten per run asked for, at least 1,000), returns a cursor, and the next call gets to the run.
    runtime, clock = make()
    async with runtime:
        for _ in range(1050):
            await finish(runtime, boom)
        succeeded = await finish(runtime, plain)
        clock.advance("2d")
        first = await runtime.runs.prune(older_than="1d", statuses=["succeeded"], limit=1)
        assert first.pruned == 0 and first.next_cursor is not None
        second = await runtime.runs.prune(older_than="1d", statuses=["succeeded"], limit=1, cursor=first.next_cursor)
        assert second.pruned == 1 and second.next_cursor is None
        assert await runtime.runs.get(succeeded) is None


async def test_foreign_and_tampered_cursors_are_rejected():
    runtime, clock = make()
    async with runtime:
        for _ in range(3):
            await finish(runtime, plain)
        clock.advance("2d")
        driver = runtime.lane.storage
        pruner = RunPruner(driver, runtime.environment, cleanup_budget=0)
        now = clock.now()
        cutoff, statuses, _ = resolve_prune_request(older_than="1d", statuses=["succeeded"], now=now)
        first = await pruner.prune(
            older_than=cutoff, statuses=statuses, limit=1, cursor=None, actor=OPERATOR, now=now, older_than_ms=DAY_MS
        )
        cursor = first.next_cursor
        assert first.pruned == 1 and cursor is not None

        # The same scope continues; another duration, or a date, does not.
        assert resolve_prune_request(older_than="24h", statuses=["succeeded"], cursor=cursor, now=now)[0] == cutoff
        for other in ("23h", "2d", cutoff):
            with _Raises(ErrorCode.VALIDATION_FAILED) as caught:
                resolve_prune_request(older_than=other, statuses=["succeeded"], cursor=cursor, now=now)
            assert "older_than 1d" in caught.error.message or "frozen" in caught.error.message

        # Another environment.
        with _Raises(ErrorCode.VALIDATION_FAILED):
            resolve_prune_request(
                older_than="1d", statuses=["succeeded"], cursor=cursor, now=now, environment="staging"
            )
        with _Raises(ErrorCode.VALIDATION_FAILED):
            await RunPruner(driver, Environment(name="staging")).prune(
                older_than=cutoff, statuses=statuses, limit=1, cursor=cursor, actor=OPERATOR, now=now
            )
        # Other statuses, including omitted statuses (all terminal).
        for other in (["succeeded", "failed"], None):
            with _Raises(ErrorCode.VALIDATION_FAILED):
                resolve_prune_request(older_than="1d", statuses=other, cursor=cursor, now=now)
        with _Raises(ErrorCode.VALIDATION_FAILED):
            await pruner.prune(older_than=cutoff, statuses=TERMINAL, limit=1, cursor=cursor, actor=OPERATOR, now=now)
        # A different explicit cutoff.
        with _Raises(ErrorCode.VALIDATION_FAILED) as caught:
            earlier = cutoff - timedelta(seconds=1)
            resolve_prune_request(older_than=earlier, statuses=["succeeded"], cursor=cursor, now=now)
        assert "frozen" in caught.error.message
        with _Raises(ErrorCode.VALIDATION_FAILED):
            await pruner.prune(
                older_than=cutoff + timedelta(hours=1),
                statuses=statuses,
                limit=1,
                cursor=cursor,
                actor=OPERATOR,
                now=now,
            )
        # A cursor of another kind with the same scope.
        scope = prune_cursor_scope(runtime.environment, cutoff, statuses, DAY_MS)
        listing = encode_operator_cursor(PaginationCursorKind.RUN_LIST, scope, ("x", "y"))
        with _Raises(ErrorCode.VALIDATION_FAILED):
            resolve_prune_request(older_than="1d", statuses=["succeeded"], cursor=listing, now=now)
        with _Raises(ErrorCode.VALIDATION_FAILED):
            await pruner.prune(older_than=cutoff, statuses=statuses, limit=1, cursor=listing, actor=OPERATOR, now=now)
        # Damaged bytes.
        flipped = cursor[:-3] + ("A" if cursor[-3] != "A" else "B") + cursor[-2:]
        for damaged in (flipped, cursor + "x", "not-a-cursor", ""):
            with _Raises(ErrorCode.VALIDATION_FAILED):
                resolve_prune_request(older_than="1d", statuses=["succeeded"], cursor=damaged, now=now)
        # A consistently re-encoded cursor that moves the frozen cutoff forward.
        payload = decode_opaque_token(cursor)
        moved = dict(scope, older_than=(now - timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%S.%fZ"))
        forged = encode_operator_cursor(PaginationCursorKind.RUN_PRUNE, moved, payload["last"])
        with _Raises(ErrorCode.VALIDATION_FAILED) as caught:
            resolve_prune_request(older_than="1d", statuses=["succeeded"], cursor=forged, now=now)
        assert "later than older_than allows" in caught.error.message
        with _Raises(ErrorCode.VALIDATION_FAILED):
            await pruner.prune(older_than=cutoff, statuses=statuses, limit=1, cursor=forged, actor=OPERATOR, now=now)
        # A malformed position inside a correctly scoped cursor.
        bad_position = encode_operator_cursor(PaginationCursorKind.RUN_PRUNE, scope, ("not-a-date",))
        with _Raises(ErrorCode.VALIDATION_FAILED):
            await pruner.prune(
                older_than=cutoff, statuses=statuses, limit=1, cursor=bad_position, actor=OPERATOR, now=now
            )
        bad_payload = encode_opaque_token({"v": 1, "scope": "{", "last": []})
        with _Raises(ErrorCode.VALIDATION_FAILED):
            resolve_prune_request(older_than="1d", statuses=["succeeded"], cursor=bad_payload, now=now)
        # Nothing above pruned anything more.
        assert len(await visible_ids(runtime)) == 2
        # A cursor issued for a date continues with that date only.
        dated = await pruner.prune(older_than=cutoff, statuses=statuses, limit=1, cursor=None, actor=OPERATOR, now=now)
        continued = resolve_prune_request(older_than=cutoff, statuses=["succeeded"], cursor=dated.next_cursor, now=now)
        assert continued[0] == cutoff
        with _Raises(ErrorCode.VALIDATION_FAILED) as caught:
            resolve_prune_request(older_than="1d", statuses=["succeeded"], cursor=dated.next_cursor, now=now)
        assert "issued for the cutoff" in caught.error.message


# ---------------------------------------------------------------------------------------------
# Idempotency owners


async def test_pruning_releases_the_idempotency_owner_of_the_pruned_run():
    runtime, clock = make()
    async with runtime:
        driver = runtime.lane.storage
        env = runtime.store.env_key
        first = await finish(runtime, keyed, {"key": "order_1"})
        again = await runtime.trigger(keyed, {"key": "order_1"})
        assert again.outcome is TriggerOutcomeType.RETURNED_EXISTING and again.run.id == first
        owner_key = idempotency_owner_key(env, keyed.id, "order_1")
        assert (await raw(driver, owner_key)).document.value["run_id"] == first
        clock.advance("2d")

        result = await prune_all(RunPruner(driver, runtime.environment, cleanup_budget=0), clock)
        assert result.pruned == 1
        # The owner is gone in the tombstone commit, before cleanup.
        assert await raw(driver, owner_key) is None
        assert await raw(driver, run_tombstone_key(env, first)) is not None
        assert await runtime.runs.find_current(task=keyed, idempotency_key="order_1") is None
        fresh = await runtime.trigger(keyed, {"key": "order_1"})
        assert fresh.outcome is TriggerOutcomeType.CREATED and fresh.run.id != first


async def test_an_owner_that_points_to_another_run_is_kept():
    runtime, clock = make()
    async with runtime:
        driver = runtime.lane.storage
        env = runtime.store.env_key
        # A failed run releases its key at once; the next run with the key owns it.
        failing = (await runtime.trigger(boom, {}, idempotency_key="shared")).run
        assert (await runtime.execute_next()).status is RunStatus.FAILED
        owner_key = idempotency_owner_key(env, boom.id, "shared")
        assert await raw(driver, owner_key) is None
        clock.advance("2d")
        holder = (await runtime.trigger(boom, {}, idempotency_key="shared")).run
        assert holder.id != failing.id
        assert (await prune_all(RunPruner(driver, runtime.environment), clock)).pruned == 1
        assert (await raw(driver, owner_key)).document.value["run_id"] == holder.id
        assert (await runtime.trigger(boom, {}, idempotency_key="shared")).run.id == holder.id


# ---------------------------------------------------------------------------------------------
# Storage limits, outbox rows and observation records


async def test_batches_split_when_a_transaction_exceeds_storage_limits():
    limits = StorageLimits(
        max_point_reads=20,
        max_query_results=20,
        max_record_bytes=48 * 1024,
        max_transaction_records=16,
        max_transaction_bytes=64 * 1024,
    )
    runtime, clock = make(limits=limits)
    async with runtime:
        big = {"blob": "x" * (20 * 1024)}
        run_ids = [await finish(runtime, plain, big) for _ in range(4)]
        clock.advance("2d")
        attempts: list[tuple[int, str]] = []

        class Recording(RunPruner):
            async def _tombstone(self, run_ids, *args):
                try:
                    count = await super()._tombstone(run_ids, *args)
                except StorageLimitError:
                    attempts.append((len(run_ids), "rolled back"))
                    raise
                attempts.append((len(run_ids), "committed"))
                return count

        pruner = Recording(runtime.lane.storage, runtime.environment)
        # Four runs in one batch would replace ~80 KiB of run documents: more than one transaction may
        # stage, so the batch rolls back, is halved and each half commits whole.
        assert pruner._tombstone_batch_size() >= 4
        result = await prune_all(pruner, clock)
        assert result == PruneResult(pruned=4, next_cursor=None)
        assert attempts[0] == (4, "rolled back")
        committed = [size for size, outcome in attempts if outcome == "committed"]
        assert sum(committed) == 4 and max(committed) < 4
        env = runtime.store.env_key
        for run_id in run_ids:
            assert await raw(runtime.lane.storage, run_key(env, run_id)) is None
            assert await raw(runtime.lane.storage, run_tombstone_key(env, run_id)) is None


async def _rewrite_children(driver, env: str, run_id: str, children: RunChildCounts) -> None:
    """Give a stored run other child counts (as a later feature writing outbox rows would)."""

    async def body(tx):
        (record,) = await tx.get([run_key(env, run_id)])
        await tx.now()
        run, _ = decode_run_document(record.document)
        tx.replace(record, NewStorageRecord(record.key, encode_run_document(run, children), record.indexes))

    await driver.with_transaction(body)


def _outbox_row(env: str, run_id: str, message_id: str, *, owner: str | None = None) -> NewStorageRecord:
    return NewStorageRecord(
        StorageRecordKey("outbox_messages", env, message_id),
        StorageDocument.encode({"message_id": message_id, "run_id": owner or run_id}),
        (
            StorageIndexEntry(
                StorageIndexName.OUTBOX_BY_RUN, (env, run_id), ("2024-01-01T00:00:00.000000Z", message_id)
            ),
        ),
    )


async def _create(driver, *records: NewStorageRecord) -> None:
    async def body(tx):
        await tx.now()
        for record in records:
            tx.create(record)

    await driver.with_transaction(body)


async def test_outbox_rows_are_cleaned_generically_and_observations_are_kept():
    runtime, clock = make()
    async with runtime:
        driver = runtime.lane.storage
        env = runtime.store.env_key
        run_id = await finish(runtime, plain)
        (record,) = await driver.get([run_key(env, run_id)])
        _, counts = decode_run_document(record.document)
        await _create(driver, _outbox_row(env, run_id, "msg_1"), _outbox_row(env, run_id, "msg_2"))
        await _rewrite_children(driver, env, run_id, RunChildCounts(events=counts.events, outbox=2))

        async def observe(tx):
            value = {"type": "run.succeeded", "run_id": run_id}
            tx.append(StorageAppendCommand(StorageStreamName.OBSERVATIONS, env, [value]))

        await driver.with_transaction(observe)
        # The runtime observed every event of the run; the hand-written record follows them.
        stream = await index_keys(driver, StorageIndexName.OBSERVATION_STREAM, (env,))
        assert len(stream) == counts.events + 1
        observed = [await raw(driver, key) for key in stream]
        assert observed[-1].document.value["run_id"] == run_id
        clock.advance("2d")

        assert (await prune_all(RunPruner(driver, runtime.environment), clock)).pruned == 1
        assert await index_keys(driver, StorageIndexName.OUTBOX_BY_RUN, (env, run_id)) == []
        assert await raw(driver, StorageRecordKey("outbox_messages", env, "msg_1")) is None
        assert await raw(driver, run_key(env, run_id)) is None
        assert [await raw(driver, key) for key in stream] == observed
        assert await index_keys(driver, StorageIndexName.OBSERVATION_STREAM, (env,)) == stream


async def test_runs_with_wait_token_links_are_not_pruned():
    runtime, clock = make()
    async with runtime:
        driver = runtime.lane.storage
        env = runtime.store.env_key
        run_id = await finish(runtime, plain)
        (record,) = await driver.get([run_key(env, run_id)])
        _, counts = decode_run_document(record.document)
        await _rewrite_children(driver, env, run_id, RunChildCounts(events=counts.events, links=1))
        clock.advance("2d")
        assert (await prune_all(RunPruner(driver, runtime.environment), clock)).pruned == 0
        assert await visible_ids(runtime) == {run_id}


# ---------------------------------------------------------------------------------------------
# Invariants: counters decide, nothing is orphaned


async def _tombstoned(runtime, clock) -> tuple[Any, str, str, RunPruner]:
    driver = runtime.lane.storage
    env = runtime.store.env_key
    run_id = await finish(runtime, plain)
    clock.advance("2d")
    pruner = RunPruner(driver, runtime.environment, cleanup_budget=0)
    assert (await prune_all(pruner, clock)).pruned == 1
    return driver, env, run_id, pruner


async def _set_tombstone_counts(driver, env: str, run_id: str, **changes: int) -> None:
    async def body(tx):
        (record,) = await tx.get([run_tombstone_key(env, run_id)])
        await tx.now()
        tombstone = decode_run_tombstone(record)
        children = replace(tombstone.children, **changes)
        tx.replace(record, run_tombstone_record(env, replace(tombstone, children=children)))

    await driver.with_transaction(body)


async def test_an_uncounted_child_is_an_invariant_violation_and_nothing_is_deleted():
    runtime, clock = make()
    async with runtime:
        driver, env, run_id, pruner = await _tombstoned(runtime, clock)
        tombstone = decode_run_tombstone(await raw(driver, run_tombstone_key(env, run_id)))
        # One more event than the tombstone counts.
        await _set_tombstone_counts(driver, env, run_id, events=tombstone.children.events - 1)
        with _Raises(ErrorCode.INVARIANT_VIOLATION):
            await pruner.cleanup(budget=100)
        assert await raw(driver, run_tombstone_key(env, run_id)) is not None
        events = await index_keys(driver, StorageIndexName.RUN_EVENTS_BY_RUN, (env, run_id))
        assert len(events) == tombstone.children.events


async def test_a_child_of_another_run_is_an_invariant_violation():
    runtime, clock = make()
    async with runtime:
        driver, env, run_id, pruner = await _tombstoned(runtime, clock)
        await _create(driver, _outbox_row(env, run_id, "msg_foreign", owner="run_someone_else"))
        await _set_tombstone_counts(driver, env, run_id, outbox=1)
        with _Raises(ErrorCode.INVARIANT_VIOLATION) as caught:
            await pruner.cleanup(budget=100)
        assert "does not belong" in caught.error.message
        assert await raw(driver, StorageRecordKey("outbox_messages", env, "msg_foreign")) is not None
        assert await raw(driver, run_tombstone_key(env, run_id)) is not None


async def test_a_child_left_when_counters_reach_zero_keeps_the_run_and_tombstone():
    runtime, clock = make()
    async with runtime:
        driver, env, run_id, pruner = await _tombstoned(runtime, clock)
        await _create(driver, _outbox_row(env, run_id, "msg_uncounted"))
        with _Raises(ErrorCode.INVARIANT_VIOLATION):
            await pruner.cleanup(budget=100)
        assert await raw(driver, run_tombstone_key(env, run_id)) is not None
        assert await raw(driver, run_key(env, run_id)) is not None
        assert await raw(driver, StorageRecordKey("outbox_messages", env, "msg_uncounted")) is not None


async def test_an_empty_index_page_is_not_proof_of_completion():
    runtime, clock = make()
    async with runtime:
        driver, env, run_id, pruner = await _tombstoned(runtime, clock)
        # The counters say two steps remain but no step is indexed (yet): cleanup waits.
        await _set_tombstone_counts(driver, env, run_id, steps=2)
        result = await pruner.cleanup(budget=100)
        assert result.finished == 0 and result.pending == 1 and result.deleted > 0
        tombstone = decode_run_tombstone(await raw(driver, run_tombstone_key(env, run_id)))
        assert tombstone.children == RunChildCounts(steps=2)
        assert await raw(driver, run_key(env, run_id)) is not None
        assert (await pruner.cleanup(budget=100)).pending == 1


async def test_a_run_already_tombstoned_is_skipped():
    runtime, clock = make()
    async with runtime:
        driver, env, run_id, pruner = await _tombstoned(runtime, clock)
        before = await raw(driver, run_tombstone_key(env, run_id))
        # Even handed straight to a batch (as an eventual index row could), it is not tombstoned again.
        cutoff = clock.now()
        assert await pruner._tombstone([run_id], cutoff, TERMINAL, OPERATOR, cutoff, []) == 0
        assert await raw(driver, run_tombstone_key(env, run_id)) == before
        assert (await prune_all(pruner, clock)).pruned == 0


# ---------------------------------------------------------------------------------------------
# Request resolution


def test_resolve_prune_request_defaults_and_durations():
    now = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)
    assert resolve_prune_request(older_than="30d", now=now) == (
        now - timedelta(days=30),
        TERMINAL,
        contract_defaults.pruning.batch_limit,
    )
    assert resolve_prune_request(older_than=timedelta(hours=2), statuses=["failed"], limit=5, now=now) == (
        now - timedelta(hours=2),
        frozenset({RunStatus.FAILED}),
        5,
    )
    explicit = datetime(2026, 4, 1, 14, 0, tzinfo=timezone(timedelta(hours=2)))
    cutoff, statuses, _ = resolve_prune_request(
        older_than=explicit, statuses=[RunStatus.SUCCEEDED, "cancelled"], now=now
    )
    assert cutoff == explicit and cutoff.tzinfo is UTC
    assert statuses == frozenset({RunStatus.SUCCEEDED, RunStatus.CANCELLED})
    assert DEFAULT_CLEANUP_BUDGET > 0


@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        ({"statuses": ["queued"]}, "succeeded, failed, cancelled"),
        ({"statuses": [RunStatus.SUCCEEDED, RunStatus.RUNNING]}, "succeeded, failed, cancelled"),
        ({"statuses": ["cancellation_requested"]}, "terminal statuses only"),
        ({"statuses": ["done"]}, "succeeded, failed, cancelled"),
        ({"statuses": []}, "at least one terminal status"),
        ({"statuses": 7}, "list of terminal statuses"),
        ({"limit": 0}, "limit"),
        ({"limit": -3}, "limit"),
        ({"limit": True}, "limit"),
        ({"limit": "5"}, "limit"),
        ({"older_than": "30 days"}, "older_than"),
        ({"older_than": "0s"}, "older_than"),
        ({"older_than": timedelta(0)}, "older_than"),
        ({"older_than": 30}, "older_than"),
        ({"older_than": datetime(2026, 1, 1)}, "timezone-aware"),
        ({"now": datetime(2026, 1, 1)}, "timezone-aware"),
    ],
)
def test_resolve_prune_request_rejects_bad_input(options, fragment):
    request = {"older_than": "30d", "now": datetime(2026, 5, 1, tzinfo=UTC), **options}
    with _Raises(ErrorCode.VALIDATION_FAILED) as caught:
        resolve_prune_request(**request)
    assert fragment in caught.error.message


async def test_prune_rejects_active_statuses_and_bad_arguments_before_storage():
    runtime, clock = make()
    async with runtime:
        pruner = RunPruner(runtime.lane.storage, runtime.environment)
        now = clock.now()
        base = {"older_than": now, "statuses": TERMINAL, "limit": 10, "cursor": None, "actor": OPERATOR, "now": now}
        for changes in (
            {"statuses": frozenset({RunStatus.RUNNING})},
            {"limit": 0},
            {"older_than": datetime(2026, 1, 1)},
        ):
            with _Raises(ErrorCode.VALIDATION_FAILED):
                await pruner.prune(**{**base, **changes})
        with _Raises(ErrorCode.CONFIGURATION_INVALID):  # an option, as on cancel, retry and rerun
            await pruner.prune(**{**base, "actor": {"type": "operator"}})
        with _Raises(ErrorCode.CONFIGURATION_INVALID):
            RunPruner(runtime.lane.storage, runtime.environment, cleanup_budget=-1)
