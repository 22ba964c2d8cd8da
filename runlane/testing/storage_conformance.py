"""``StorageDriverConformance``: the storage contract as a pytest base class a driver package subclasses.

The suite proves the storage contract's verification checklist through the public driver surface
only (``get``, ``query``, ``with_transaction`` and, when switched on, ordered append, exclusive
candidates and operator reads), so the same tests run against an in-memory driver and a database.
It never looks inside a driver: every test works in its own collection, index partitions, stream
partitions and environment, keeps its data small, and builds limit-breaking inputs from the
driver's own ``profile.limits``.

Usage::

    class TestMyDriver(StorageDriverConformance):
        supports_append = True

        @pytest.fixture
        def driver(self):
            return my_storage_driver()  # fresh and not yet started, one per test

Test methods are plain synchronous functions. Each runs its body with ``asyncio.run`` under a hard
timeout and starts and closes the drivers inside that loop, so no async pytest plugin is needed.
Races are forced with ``asyncio.Event`` interleavings; a driver that blocks a competing writer
instead of failing it later (a locking database) gets a bounded wait and is then held to the same
serializable outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import pytest

from ..errors import ErrorCode, RunlaneError, is_storage_conflict
from ..models import (
    Actor,
    DeliveryIntent,
    Environment,
    RunCreatedEvent,
    RunDeliveryRequestedEvent,
    RunEventRecord,
    RunFailure,
    RunLease,
    RunRecord,
    RunSource,
    RunStartedEvent,
    environment_key,
)
from ..storage import (
    MAX_UNSIGNED_64,
    NewStorageRecord,
    OperatorReadDriver,
    PaginationParams,
    RunEventFilter,
    RunFilter,
    StorageAppendCommand,
    StorageCandidateMode,
    StorageClockAuthority,
    StorageDocument,
    StorageDriver,
    StorageDurability,
    StorageIndexConsistency,
    StorageIndexEntry,
    StorageIndexName,
    StorageLimitError,
    StorageProfile,
    StorageQuery,
    StorageQueryResult,
    StorageRange,
    StorageRecord,
    StorageRecordKey,
    StorageStreamName,
    TimeRange,
    encode_iso_date,
    encode_storage_tuple,
    encode_storage_unsigned_integer,
    measure_storage_append,
    measure_storage_record,
    parse_unsigned_64_decimal,
    read_storage_stream_position,
    run_event_matches_filter,
    run_event_sort_value,
    run_matches_filter,
    run_sort_value,
    storage_stream_layouts,
    supports_operator_reads,
)
from ..storage.key_order import KEY_ORDERED_INDEXES
from ..storage.tables import (
    RunChildCounts,
    encode_run_document,
    encode_run_event_document,
    run_event_key,
    run_key,
    run_tombstone_key,
)
from ..vocabulary import (
    ActorType,
    RunEventSortField,
    RunEventType,
    RunSortField,
    RunSourceType,
    RunStatus,
    SortDirection,
)

__all__ = ["StorageDriverConformance"]

# Generic tests write opaque records into these catalog indexes, in partitions nobody else uses.
_INDEX = StorageIndexName.OUTBOX_DUE
_OTHER_INDEX = StorageIndexName.SCHEDULE_OCCURRENCES_CLAIMED
_THIRD_INDEX = StorageIndexName.IDEMPOTENCY_OWNERS_BY_EXPIRY
_STREAM = StorageStreamName.OBSERVATIONS
_LAYOUT = storage_stream_layouts[_STREAM]
_MAX_PAGES = 1000
_ASC, _DESC = SortDirection.ASC, SortDirection.DESC
_CONTRACT = ErrorCode.ADAPTER_CONTRACT_VIOLATION


# ---------------------------------------------------------------------------------------------
# Names, records and reads


class _Scope:
    """Fresh names for one test, so drivers over a shared database never see another test's data."""

    def __init__(self) -> None:
        self.token = uuid.uuid4().hex[:16]
        self.collection = f"conformance_{self.token}"
        self.environment = Environment(name=f"conformance-{self.token}")

    @property
    def env_key(self) -> str:
        return environment_key(self.environment)

    def key(self, *parts: str) -> StorageRecordKey:
        return StorageRecordKey(self.collection, *parts)

    def partition(self, name: str = "p") -> tuple[str, str]:
        return (f"conformance-{self.token}", name)

    def stream(self, name: str = "s") -> str:
        return f"conformance-{self.token}-{name}"


class _Rollback(Exception):
    """Raised by a test callback to abandon its attempt."""


def _entry(partition: Sequence[str], *sort: str, index: StorageIndexName = _INDEX) -> StorageIndexEntry:
    return StorageIndexEntry(index, partition, sort)


def _record(key: StorageRecordKey, value: dict[str, Any], *entries: StorageIndexEntry) -> NewStorageRecord:
    return NewStorageRecord(key, StorageDocument.encode(value), entries)


def _sized_record(key: StorageRecordKey, size: int, *entries: StorageIndexEntry) -> NewStorageRecord:
    """A record whose ``measure_storage_record`` is exactly ``size`` bytes."""
    base = measure_storage_record(_record(key, {"pad": ""}, *entries))
    if size < base:
        raise ValueError(f"a record of {size} bytes cannot hold its own key and envelope ({base} bytes)")
    record = _record(key, {"pad": "x" * (size - base)}, *entries)
    assert measure_storage_record(record) == size
    return record


def _value(record: StorageRecord | None) -> dict[str, Any] | None:
    return None if record is None else record.document.value


async def _create_in_one(driver: StorageDriver, *records: NewStorageRecord) -> None:
    """Create ``records`` in one transaction."""

    async def stage(tx: Any) -> None:
        for record in records:
            tx.create(record)

    await driver.with_transaction(stage)


async def _create(driver: StorageDriver, *records: NewStorageRecord) -> None:
    """Create ``records`` for a test's setup: in one transaction, or in as few as the driver's limits
    allow (a driver may advertise limits smaller than a test's data)."""
    limits = driver.profile.limits
    batch: list[NewStorageRecord] = []
    size = 0
    for record in records:
        measured = measure_storage_record(record)
        if batch and (len(batch) == limits.max_transaction_records or size + measured > limits.max_transaction_bytes):
            await _create_in_one(driver, *batch)
            batch, size = [], 0
        batch.append(record)
        size += measured
    if batch:
        await _create_in_one(driver, *batch)


async def _get_one(driver: StorageDriver, key: StorageRecordKey) -> StorageRecord | None:
    found = await driver.get([key])
    assert len(found) == 1, f"get() of one key returned {len(found)} positions"
    return found[0]


async def _get_stored(driver: StorageDriver, key: StorageRecordKey) -> StorageRecord:
    """``_get_one`` of a key the test has written and not deleted; no extra check, so a driver that lost
    the record fails where the test uses it."""
    return cast(StorageRecord, await _get_one(driver, key))


async def _value_of(driver: StorageDriver, key: StorageRecordKey) -> dict[str, Any] | None:
    return _value(await _get_one(driver, key))


async def _get_many(driver: StorageDriver, keys: Sequence[StorageRecordKey]) -> list[StorageRecord | None]:
    chunk = driver.profile.limits.max_point_reads
    found: list[StorageRecord | None] = []
    for start in range(0, len(keys), chunk):
        found.extend(await driver.get(list(keys[start : start + chunk])))
    return found


async def _update(
    driver: StorageDriver, key: StorageRecordKey, change: Callable[[dict[str, Any]], dict[str, Any]]
) -> None:
    async def attempt(tx: Any) -> None:
        [current] = await tx.get([key])
        assert current is not None, f"{key!r} should exist"
        tx.replace(
            current, NewStorageRecord(key, StorageDocument.encode(change(current.document.value)), current.indexes)
        )

    await driver.with_transaction(attempt)


def _refs(result: StorageQueryResult) -> list[tuple[StorageRecordKey, tuple[str, ...]]]:
    return [(ref.key, tuple(ref.sort)) for ref in result.items]


async def _query_all(driver: StorageDriver, query: StorageQuery) -> list[tuple[StorageRecordKey, tuple[str, ...]]]:
    """Every ref of ``query``, following cursors (each page is checked against the limit)."""
    collected: list[tuple[StorageRecordKey, tuple[str, ...]]] = []
    cursor = query.cursor
    for _ in range(_MAX_PAGES):
        result = await driver.query(_with(query, cursor=cursor))
        assert len(result.items) <= query.limit, f"a page of limit {query.limit} returned {len(result.items)} items"
        collected.extend(_refs(result))
        if result.next_cursor is None:
            return collected
        cursor = result.next_cursor
    raise AssertionError(f"query pagination did not end after {_MAX_PAGES} pages")


def _with(query: StorageQuery, **changes: Any) -> StorageQuery:
    fields: dict[str, Any] = {
        "index": query.index,
        "partition": query.partition,
        "range": query.range,
        "direction": query.direction,
        "limit": query.limit,
        "cursor": query.cursor,
    }
    fields.update(changes)
    return StorageQuery(**fields)


def _ordered(
    items: Iterable[tuple[StorageRecordKey, tuple[str, ...]]], direction: SortDirection = _ASC
) -> list[tuple[StorageRecordKey, tuple[str, ...]]]:
    """The contract's order: encoded sort, then encoded record key; DESC is the exact reverse."""
    ascending = sorted(items, key=lambda item: (encode_storage_tuple(item[1]), item[0].encoded))
    return ascending if direction is _ASC else ascending[::-1]


def _entries(record: StorageRecord | NewStorageRecord) -> set[StorageIndexEntry]:
    """A record's index entries; their order carries no meaning (one entry per index name)."""
    return set(record.indexes)


def _describe(refs: Sequence[tuple[StorageRecordKey, tuple[str, ...]]]) -> list[str]:
    return [f"{'/'.join(key.parts)}@{sort!r}" for key, sort in refs]


# ---------------------------------------------------------------------------------------------
# Error expectations


def _check_error(error: BaseException, codes: Sequence[ErrorCode], what: str) -> RunlaneError:
    expected = [code.value for code in codes]
    assert isinstance(error, RunlaneError), f"{what}: expected a RunlaneError with code {expected}, got {error!r}"
    assert error.code in codes, f"{what}: expected code {expected}, got {error.code.value!r} ({error.message})"
    return error


async def _expect_error(awaitable: Awaitable[Any], *codes: ErrorCode, what: str) -> RunlaneError:
    try:
        await awaitable
    except Exception as error:  # noqa: BLE001 - any other exception is reported as the failure
        return _check_error(error, codes, what)
    raise AssertionError(f"{what}: expected a RunlaneError with code {[c.value for c in codes]}, but it succeeded")


async def _expect_limit(awaitable: Awaitable[Any], *limits: str, what: str) -> StorageLimitError:
    try:
        await awaitable
    except Exception as error:  # noqa: BLE001 - any other exception is reported as the failure
        assert isinstance(error, StorageLimitError), (
            f"{what}: expected StorageLimitError({'/'.join(limits)}), got {error!r}"
        )
        assert error.code is ErrorCode.VALIDATION_FAILED, f"{what}: a limit error has code validation_failed"
        assert error.retryable is False, f"{what}: a limit error is not retryable (core splits the work instead)"
        assert error.limit in limits, f"{what}: expected the {' or '.join(limits)} limit, got {error.limit!r}"
        return error
    raise AssertionError(f"{what}: expected StorageLimitError({'/'.join(limits)}), but it succeeded")


def _expect_contract_error(call: Callable[[], Any], what: str) -> None:
    """A synchronous staging call that must be rejected with ``adapter_contract_violation``."""
    try:
        call()
    except Exception as error:  # noqa: BLE001 - any other exception is reported as the failure
        _check_error(error, (_CONTRACT,), what)
        return
    raise AssertionError(f"{what}: expected adapter_contract_violation, but the call was accepted")


# ---------------------------------------------------------------------------------------------
# Forced interleavings


@dataclass
class _Race:
    a_result: Any
    b_result: Any
    # True when B had committed before A's committed attempt finished (the optimistic path: A must
    # reflect B); False when the driver kept B waiting until A was done (a locking driver: A first).
    b_first: bool
    a_attempts: int
    b_attempts: int


_Pause = Callable[[], Awaitable[None]]


@dataclass
class _Holder:
    """An open attempt holding exclusive candidates until ``finish()``."""

    task: asyncio.Task[Any]
    selected: asyncio.Future[list[StorageRecordKey]]
    release: asyncio.Event

    async def finish(self) -> None:
        self.release.set()
        with contextlib.suppress(_Rollback):
            await self.task


# ---------------------------------------------------------------------------------------------
# Operator read data


_T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
_SYSTEM = Actor(type=ActorType.SYSTEM)
_ALPHA, _BETA, _GAMMA = "conformance.alpha", "conformance.beta", "conformance.gamma"


def _at(minutes: float) -> datetime:
    return _T0 + timedelta(minutes=minutes)


def _run(environment: Environment, run_id: str, status: RunStatus, created: float, **fields: Any) -> RunRecord:
    fields.setdefault("updated_at", _at(created))
    fields.setdefault("task_id", _ALPHA)
    fields.setdefault("queue", "default")
    fields.setdefault("event_sequence", 3)
    return RunRecord(id=run_id, environment=environment, status=status, created_at=_at(created), **fields)


def _events(run: RunRecord, occurred: Sequence[float]) -> list[RunEventRecord]:
    """The first ``len(occurred)`` events of a created / delivery_requested / started history."""
    environment, run_id = run.environment, run.id
    base: dict[str, Any] = {"run_id": run_id, "environment": environment, "actor": _SYSTEM}

    def created(at: datetime) -> Any:
        return RunCreatedEvent(**base, occurred_at=at, task_id=run.task_id, queue=run.queue, payload={"seq": [1]})

    def delivery_requested(at: datetime) -> Any:
        intent = DeliveryIntent(
            environment=environment, run_id=run_id, queue=run.queue, requested_at=at, available_at=at
        )
        return RunDeliveryRequestedEvent(**base, occurred_at=at, delivery=intent)

    def started(at: datetime) -> Any:
        return RunStartedEvent(**base, occurred_at=at, attempt=1, meta={"note": {"depth": [1, 2]}})

    builders = (created, delivery_requested, started)
    return [
        RunEventRecord(id=f"{run_id}.event.{n}", sequence=n, event=build(_at(minute)))
        for n, (build, minute) in enumerate(zip(builders, occurred), 1)
    ]


@dataclass
class _OperatorData:
    scope: _Scope
    runs: list[RunRecord]  # visible runs of scope.environment
    events: list[RunEventRecord]  # their events
    foreign_run: RunRecord  # a run of another environment


def _operator_data(scope: _Scope) -> _OperatorData:
    env = scope.environment
    lease = RunLease(worker_id="conformance-worker", token="lease-1", claimed_at=_at(6), expires_at=_at(30))
    runs = [
        _run(
            env,
            "run-b",
            RunStatus.QUEUED,
            0,
            idempotency_key="idem-1",
            payload={"n": 1, "nested": {"list": [1, 2]}},
            meta={"m": {"x": 1}},
        ),
        _run(
            env,
            "run-e",
            RunStatus.RUNNING,
            5,
            updated_at=_at(7),
            task_id=_BETA,
            queue="fast",
            lease=lease,
            started_at=_at(6),
        ),
        _run(
            env,
            "run-c",
            RunStatus.SUCCEEDED,
            5,
            updated_at=_at(9),
            finished_at=_at(9),
            singleton_key="single-1",
            output={"ok": True},
            has_output=True,
        ),
        _run(
            env,
            "run-a",
            RunStatus.SCHEDULED,
            10,
            run_at=_at(60),
            task_id=_BETA,
            source=RunSource(type=RunSourceType.RERUN, source_run_id="run-c"),
        ),
        _run(
            env,
            "run-f",
            RunStatus.FAILED,
            15,
            updated_at=_at(20),
            finished_at=_at(20),
            task_id=_GAMMA,
            queue="fast",
            failure=RunFailure(code=ErrorCode.TASK_FAILED, message="boom", meta={"detail": {"a": 1}}),
        ),
        _run(env, "run-d", RunStatus.QUEUED, 20, run_at=_at(25), idempotency_key="idem-2", event_sequence=2),
    ]
    occurred = {
        "run-b": (0, 1, 2),
        "run-e": (5, 5, 6),
        "run-c": (5, 6, 7),
        "run-a": (10, 11, 12),
        "run-f": (15, 16, 17),
        "run-d": (20, 21),
    }
    events = [event for run in runs for event in _events(run, occurred[run.id])]
    foreign = _run(Environment(name=f"{env.name}-other"), "run-b", RunStatus.QUEUED, 0)
    return _OperatorData(scope, runs, events, foreign)


def _run_record(run: RunRecord, children: RunChildCounts | None = None) -> NewStorageRecord:
    return NewStorageRecord(run_key(environment_key(run.environment), run.id), encode_run_document(run, children))


def _event_record(event: RunEventRecord) -> NewStorageRecord:
    env_key = environment_key(event.event.environment)
    entry = StorageIndexEntry(
        StorageIndexName.RUN_EVENTS_BY_RUN,
        (env_key, event.event.run_id),
        (encode_storage_unsigned_integer(event.sequence),),
    )
    return NewStorageRecord(
        run_event_key(env_key, event.event.run_id, event.sequence), encode_run_event_document(event), (entry,)
    )


def _tombstone_record(run: RunRecord, at: datetime) -> NewStorageRecord:
    env_key = environment_key(run.environment)
    entry = StorageIndexEntry(StorageIndexName.RUN_TOMBSTONES, (env_key,), (encode_iso_date(at), run.id))
    document = StorageDocument.encode(
        {"run_id": run.id, "tombstoned_at": encode_iso_date(at), "children": RunChildCounts().to_json()}
    )
    return NewStorageRecord(run_tombstone_key(env_key, run.id), document, (entry,))


def _expected_runs(runs: Iterable[RunRecord], filter: RunFilter) -> list[RunRecord]:
    matching = [run for run in runs if run_matches_filter(run, filter)]
    matching.sort(
        key=lambda run: run_sort_value(run, filter.sort_by, filter.sort_direction),
        reverse=filter.sort_direction is _DESC,
    )
    return matching


def _expected_events(events: Iterable[RunEventRecord], filter: RunEventFilter) -> list[RunEventRecord]:
    matching = [event for event in events if run_event_matches_filter(event, filter)]
    matching.sort(key=lambda event: run_event_sort_value(event, filter.sort_by), reverse=filter.sort_direction is _DESC)
    return matching


# ---------------------------------------------------------------------------------------------
# Ordered append helpers


async def _read_stream(driver: StorageDriver, partition: str) -> tuple[int | None, list[tuple[int, dict[str, Any]]]]:
    """The head's next position (``None`` when absent) and every record of a stream partition,
    checked against the canonical layout: key, index row, and the position field of the document."""
    head = await _get_one(driver, _LAYOUT.head_key(partition))
    next_position = None if head is None else read_storage_stream_position(head)
    limit = min(100, driver.profile.limits.max_query_results)
    refs = await _query_all(driver, StorageQuery(_LAYOUT.index, (partition,), limit=limit))
    positions = []
    for key, sort in refs:
        assert len(sort) == 1, f"a stream index row has one sort component, got {sort!r}"
        position = int(sort[0])
        assert sort == (encode_storage_unsigned_integer(position),), f"stream sort {sort!r} is not a sortable u64"
        assert key == _LAYOUT.record_key(partition, position), (
            f"stream row {key!r} does not use the canonical record key"
        )
        positions.append(position)
    records = await _get_many(driver, [_LAYOUT.record_key(partition, position) for position in positions])
    stream = []
    for position, record in zip(positions, records, strict=True):
        assert record is not None, f"the stream index lists position {position}, but its record is missing"
        value = record.document.value
        raw = value.pop(_LAYOUT.position_field, None)
        assert isinstance(raw, str), (
            f"record {position} must carry {_LAYOUT.position_field!r} as a decimal string, got {raw!r}"
        )
        assert parse_unsigned_64_decimal(raw) == position and raw == str(position), (
            f"record at {position} says position {raw!r}"
        )
        expected_entry = StorageIndexEntry(_LAYOUT.index, (partition,), (encode_storage_unsigned_integer(position),))
        assert _entries(record) == {expected_entry}, f"record {position} has index entries {record.indexes!r}"
        stream.append((position, value))
    return next_position, stream


def _assert_contiguous(next_position: int | None, stream: list[tuple[int, dict[str, Any]]], first: int = 1) -> None:
    positions = [position for position, _ in stream]
    assert positions == list(range(first, first + len(stream))), (
        f"stream positions are not gap-free from {first}: {positions}"
    )
    assert next_position == first + len(stream), (
        f"head next_position is {next_position}, expected {first + len(stream)}"
    )


def _assert_batches(stream: list[tuple[int, dict[str, Any]]], batches: dict[str, int]) -> None:
    """Each batch appears exactly once, in order, on contiguous positions."""
    seen: dict[str, list[tuple[int, int]]] = {}
    for position, value in stream:
        seen.setdefault(value["batch"], []).append((position, value["i"]))
    assert set(seen) == set(batches), f"stream batches {sorted(seen)} differ from committed batches {sorted(batches)}"
    for batch, rows in seen.items():
        positions = [position for position, _ in rows]
        assert [i for _, i in rows] == list(range(batches[batch])), (
            f"batch {batch} values are missing, repeated or reordered: {rows}"
        )
        assert positions == list(range(positions[0], positions[0] + len(rows))), (
            f"batch {batch} is not contiguous: {positions}"
        )


async def _point_append(tx: Any, partition: str, values: Sequence[dict[str, Any]], *, pause: bool = False) -> None:
    """Core's fallback path: read the head, create records at the next positions, create or replace the head."""
    [head] = await tx.get([_LAYOUT.head_key(partition)])
    start = read_storage_stream_position(head)
    if pause:
        await asyncio.sleep(0)
    for offset, value in enumerate(values):
        tx.create(_LAYOUT.stream_record(partition, start + offset, value))
    new_head = _LAYOUT.head_record(partition, start + len(values))
    if head is None:
        tx.create(new_head)
    else:
        tx.replace(head, new_head)


def _batch(name: str, count: int) -> list[dict[str, Any]]:
    return [{"batch": name, "i": i} for i in range(count)]


# ---------------------------------------------------------------------------------------------
# The suite


# How long past ``timeout_seconds`` a test whose event loop is blocked gets before it fails.
_BLOCKED_GRACE_S = 5.0


# A transaction that lost a race failed instead of replaying its attempt.
_NOT_REPLAYED = (
    "transaction A failed with {error!r} after {other} while A's first attempt was open: a driver must roll "
    "such an attempt back and replay it with fresh reads, and fail with a retryable storage_conflict only once "
    "its attempt budget is spent"
)


class StorageDriverConformance:
    """Subclass as ``Test...`` and override the ``driver`` fixture (a fresh, unstarted driver per test).

    Switch on the optional parts the driver implements; each must also be advertised by its profile
    (``ordered_append``, ``exclusive_candidates``) or its type (``OperatorReadDriver``). Exclusive
    candidates additionally need ``peer_driver``: a second, independent instance over the same store.
    """

    supports_append: bool = False
    supports_exclusive_candidates: bool = False
    supports_operator_reads: bool = False

    #: Hard limit for one test's body; nothing in the suite may hang.
    timeout_seconds: float = 60.0
    #: How long a forced interleaving waits for the competing writer while an attempt stays open.
    race_wait_seconds: float = 1.0
    #: Concurrent transactions in the contention tests (keep it within the driver's attempt budget).
    concurrent_writers: int = 8

    # The checklist's wait-token line (completion, timeout, reciprocal links, pruning and token index
    # mappings) is proven by the runtime's own table tests over a conforming driver, not here.

    @pytest.fixture
    def driver(self) -> StorageDriver:
        pytest.fail("Override the `driver` fixture: return a fresh, unstarted StorageDriver for every test.")

    @pytest.fixture
    def peer_driver(self) -> StorageDriver:
        pytest.skip(
            "Override the `peer_driver` fixture to return a second, independent, unstarted driver over the "
            "same store as `driver` (required when supports_exclusive_candidates is True)."
        )

    # -- harness ---------------------------------------------------------------------------------

    def run_async(self, body: Callable[[], Awaitable[Any]], *drivers: StorageDriver) -> None:
        """Run ``body`` in a fresh event loop, starting ``drivers`` first and closing them afterwards."""

        async def main() -> None:
            started: list[StorageDriver] = []
            try:
                for driver in drivers:
                    await driver.start()
                    started.append(driver)
                await body()
            finally:
                for driver in reversed(started):
                    await driver.close()

        # On a thread of its own, so that a driver blocking its event loop (a lock held across an await,
        # a blocking call) fails the test instead of hanging the run: that thread is left behind.
        outcome: list[BaseException] = []

        def guarded() -> None:
            try:
                asyncio.run(asyncio.wait_for(main(), self.timeout_seconds))
            except BaseException as error:  # noqa: BLE001 - re-raised on the test's own thread
                outcome.append(error)

        thread = threading.Thread(target=guarded, name="storage-conformance", daemon=True)
        thread.start()
        thread.join(self.timeout_seconds + min(_BLOCKED_GRACE_S, self.timeout_seconds))
        blocked = (
            f"the test did not finish within {self.timeout_seconds}s: a transaction, selection or commit is blocked"
        )
        if thread.is_alive():
            raise AssertionError(f"{blocked}, and it holds its event loop (a blocking call or lock in the driver?)")
        if outcome:
            if isinstance(outcome[0], TimeoutError):
                raise AssertionError(blocked) from None
            raise outcome[0]

    def _page_limit(self, driver: StorageDriver, wanted: int = 100) -> int:
        return min(wanted, driver.profile.limits.max_query_results)

    async def _interleave(
        self,
        a_driver: StorageDriver,
        a_body: Callable[[Any, int, _Pause], Awaitable[Any]],
        b_driver: StorageDriver,
        b_body: Callable[[Any, int], Awaitable[Any]],
    ) -> _Race:
        """Run transaction A; when A's first attempt calls ``pause()`` (after its reads), run
        transaction B to completion before A continues, unless the driver keeps B waiting."""
        paused = asyncio.Event()
        counts = {"a": 0, "b": 0}
        b_done_when_a_finished = False

        async def run_b() -> Any:
            await paused.wait()

            async def attempt(tx: Any) -> Any:
                counts["b"] += 1
                return await b_body(tx, counts["b"])

            return await b_driver.with_transaction(attempt)

        b_task = asyncio.create_task(run_b())

        async def pause() -> None:
            if counts["a"] == 1 and not paused.is_set():
                paused.set()
                await asyncio.wait({b_task}, timeout=self.race_wait_seconds)

        async def attempt(tx: Any) -> Any:
            nonlocal b_done_when_a_finished
            counts["a"] += 1
            result = await a_body(tx, counts["a"], pause)
            # Whether B had committed before this attempt of A reached its commit; the value left by
            # A's committed attempt decides which serial order the outcome must match.
            b_done_when_a_finished = b_task.done() and not b_task.cancelled() and b_task.exception() is None
            return result

        try:
            a_result = await a_driver.with_transaction(attempt)
        except BaseException as error:
            b_committed = b_task.done() and not b_task.cancelled() and b_task.exception() is None
            if not b_task.done():
                b_task.cancel()
            with contextlib.suppress(BaseException):
                await b_task
            if b_committed and isinstance(error, Exception) and not isinstance(error, AssertionError):
                # The driver's own error alone would not say which rule it broke.
                raise AssertionError(_NOT_REPLAYED.format(error=error, other="transaction B committed")) from error
            raise
        assert paused.is_set(), "transaction A never reached its pause point"
        b_result = await b_task
        return _Race(a_result, b_result, b_done_when_a_finished, counts["a"], counts["b"])

    async def _hold(self, driver: StorageDriver, query: StorageQuery, *, rollback: bool = False) -> _Holder:
        """Open an attempt that selects ``query`` exclusively and keeps its holds until ``finish()``."""
        loop = asyncio.get_running_loop()
        selected: asyncio.Future[list[StorageRecordKey]] = loop.create_future()
        release = asyncio.Event()

        async def attempt(tx: Any) -> None:
            result = await tx.query_candidates(query, mode=StorageCandidateMode.EXCLUSIVE)
            if not selected.done():
                selected.set_result([ref.key for ref in result.items])
            await release.wait()
            if rollback:
                raise _Rollback()

        task = asyncio.create_task(driver.with_transaction(attempt))
        watched: set[asyncio.Future[Any]] = {task, selected}
        await asyncio.wait(watched, timeout=self.race_wait_seconds * 5, return_when=asyncio.FIRST_COMPLETED)
        if not selected.done():
            if task.done():
                task.result()  # surface the selection's own error
            task.cancel()
            raise AssertionError("an exclusive selection did not return while other attempts were open")
        return _Holder(task, selected, release)

    async def _select_exclusive(self, driver: StorageDriver, query: StorageQuery) -> list[StorageRecordKey]:
        async def attempt(tx: Any) -> list[StorageRecordKey]:
            result = await tx.query_candidates(query, mode=StorageCandidateMode.EXCLUSIVE)
            return [ref.key for ref in result.items]

        try:
            return await asyncio.wait_for(driver.with_transaction(attempt), self.race_wait_seconds * 5)
        except TimeoutError:
            raise AssertionError(
                "an exclusive selection blocked instead of skipping records held by another attempt"
            ) from None

    def _require(self, switch: str) -> None:
        if not getattr(self, switch):
            pytest.skip(f"set {switch} = True on the conformance subclass to run this part of the suite")

    # =============================================================================================
    # Profile and shape

    def test_profile_matches_the_enabled_suites(self, driver: StorageDriver) -> None:
        """The profile is a true, coherent StorageProfile and advertises every switched-on part."""
        assert isinstance(driver, StorageDriver), "the driver must implement the StorageDriver protocol"
        assert isinstance(driver.name, str) and driver.name, "a driver has a non-empty name"
        profile = driver.profile
        assert isinstance(profile, StorageProfile), f"profile must be a StorageProfile, got {profile!r}"
        assert profile.durability in tuple(StorageDurability)
        assert profile.clock_authority in tuple(StorageClockAuthority)
        assert profile.index_consistency in tuple(StorageIndexConsistency)
        limits = profile.limits
        assert limits.max_transaction_bytes >= limits.max_record_bytes, (
            "max_transaction_bytes must be >= max_record_bytes"
        )
        assert limits.max_transaction_records * limits.max_record_bytes >= limits.max_transaction_bytes, (
            "max_transaction_bytes must be reachable within max_transaction_records records"
        )
        if self.supports_append:
            assert profile.ordered_append, "supports_append is on, but the profile does not advertise ordered_append"
        else:
            assert not profile.ordered_append, (
                "the profile advertises ordered_append: switch on supports_append, nothing else proves it"
            )
        if not self.supports_exclusive_candidates:
            assert not profile.exclusive_candidates, (
                "the profile advertises exclusive_candidates: switch on supports_exclusive_candidates (with a "
                "`peer_driver` fixture), nothing else proves it"
            )
        if self.supports_exclusive_candidates:
            assert profile.exclusive_candidates, (
                "supports_exclusive_candidates is on, but the profile does not advertise it"
            )
            # Which class defines the fixture (pytest wraps fixture functions in a new object on every
            # attribute access, so the attributes themselves cannot be compared).
            owner = next(klass for klass in type(self).__mro__ if "peer_driver" in vars(klass))
            assert owner is not StorageDriverConformance, (
                "supports_exclusive_candidates needs a `peer_driver` fixture: a second instance over the same store"
            )
        if self.supports_operator_reads:
            assert supports_operator_reads(driver) and isinstance(driver, OperatorReadDriver), (
                "supports_operator_reads is on, but the driver lacks get_run / list_runs / list_run_events"
            )

        async def body() -> None:
            assert await driver.get([]) == [], "get([]) returns no positions"

        self.run_async(body, driver)

    # =============================================================================================
    # Point reads

    def test_get_returns_one_position_per_requested_key(self, driver: StorageDriver) -> None:
        """Outside a transaction: order, duplicates and misses, exact documents, indexes and versions."""

        async def body() -> None:
            scope = _Scope()
            a, b, missing, other_missing = scope.key("a"), scope.key("b", "2"), scope.key("missing"), scope.key("b")
            first = _record(a, {"name": "a", "list": [1, {"x": None}]}, _entry(scope.partition(), "1"))
            second = _record(
                b, {"name": "b"}, _entry(scope.partition(), "2"), _entry(scope.partition(), "z", index=_OTHER_INDEX)
            )
            await _create(driver, first, second)
            found = await _get_many(driver, [a, missing, b, a, other_missing, b])  # one get() within the limits
            assert isinstance(found, list) and len(found) == 6, f"expected 6 positions, got {found!r}"
            assert found[1] is None and found[4] is None, "a missing key reads as None at its own position"
            versions: dict[int, str] = {}
            for position, expected in ((0, first), (2, second), (3, first), (5, second)):
                record = found[position]
                assert isinstance(record, StorageRecord), (
                    f"position {position} should hold a StorageRecord, got {record!r}"
                )
                assert record.key == expected.key, (
                    f"position {position} holds {record.key!r}, expected {expected.key!r}"
                )
                assert record.document == expected.document and record.document.value == expected.document.value
                assert _entries(record) == _entries(expected), f"position {position} index entries differ"
                parse_unsigned_64_decimal(record.version)
                versions[position] = record.version
            assert versions[0] == versions[3] and versions[2] == versions[5]

        self.run_async(body, driver)

    def test_transaction_get_returns_one_position_per_requested_key(self, driver: StorageDriver) -> None:
        """Inside a transaction: the same exact positions, duplicates and misses."""

        async def body() -> None:
            scope = _Scope()
            a, b, missing = scope.key("a"), scope.key("b"), scope.key("missing")
            await _create(driver, _record(a, {"name": "a"}), _record(b, {"name": "b"}))
            outside = await driver.get([a, b])

            chunk = driver.profile.limits.max_point_reads

            async def attempt(tx: Any) -> list[StorageRecord | None]:
                keys = [b, missing, a, b, missing]
                first = [record for at in range(0, len(keys), chunk) for record in await tx.get(keys[at : at + chunk])]
                second = await tx.get([a])
                return [*first, *second]

            found = await driver.with_transaction(attempt)
            assert [None if r is None else r.key for r in found] == [b, None, a, b, None, a], (
                f"positions differ: {found!r}"
            )
            assert (
                found[0] == outside[1] and found[2] == outside[0] and found[3] == outside[1] and found[5] == outside[0]
            ), "a transaction reads the same committed records and versions as get()"

        self.run_async(body, driver)

    def test_versions_are_positive_decimals_that_change_on_every_commit(self, driver: StorageDriver) -> None:
        """Every committed create or replace issues a new opaque positive decimal version."""

        async def body() -> None:
            scope = _Scope()
            key = scope.key("versioned")
            await _create(driver, _record(key, {"n": 0}))
            seen = [(await _get_stored(driver, key)).version]
            for n in range(1, 4):
                await _update(driver, key, lambda value: {"n": n})  # _update calls it before returning
                seen.append((await _get_stored(driver, key)).version)
            for version in seen:
                assert isinstance(version, str), f"versions are strings, got {version!r}"
                parse_unsigned_64_decimal(version)
            assert len(set(seen)) == len(seen), f"a replace reused a version: {seen}"

            async def abandoned(tx: Any) -> None:
                [current] = await tx.get([key])
                tx.replace(current, _record(key, {"n": -1}))
                raise _Rollback()

            with contextlib.suppress(_Rollback):
                await driver.with_transaction(abandoned)
            after = await _get_stored(driver, key)
            assert after.version == seen[-1] and after.document.value == {"n": 3}, (
                "a rolled-back attempt changed the record"
            )

        self.run_async(body, driver)

    # =============================================================================================
    # Defensive copies

    def test_returned_records_are_defensive_copies(self, driver: StorageDriver) -> None:
        """Mutating returned lists, values and nested objects never changes stored state."""

        async def body() -> None:
            scope = _Scope()
            key = scope.key("copied")
            original = {"nested": {"list": [1, 2, {"deep": "x"}]}, "when": "2026-01-01T00:00:00.000000Z"}
            await _create(driver, _record(key, original, _entry(scope.partition(), "s")))
            found = await driver.get([key, key])
            value = cast(StorageRecord, found[0]).document.value
            value["nested"]["list"].append("mutated")
            value["nested"]["list"][2]["deep"] = "mutated"
            value["added"] = True
            found.clear()
            found.append(None)

            async def attempt(tx: Any) -> None:
                [inside] = await tx.get([key])
                inside_value = inside.document.value
                inside_value["nested"]["list"].clear()
                inside_value["when"] = "mutated"

            await driver.with_transaction(attempt)
            again = await driver.get([key, key])
            assert len(again) == 2 and again[0] is not None, "mutating a returned list changed later reads"
            assert again[0].document.value == original and cast(StorageRecord, again[1]).document.value == original, (
                f"stored value changed through a returned copy: {again[0].document.value!r}"
            )
            refs = _refs(await driver.query(StorageQuery(_INDEX, scope.partition(), limit=self._page_limit(driver))))
            assert refs == [(key, ("s",))], f"index rows changed through a returned copy: {refs!r}"

        self.run_async(body, driver)

    def test_write_inputs_are_copied_at_the_boundary(self, driver: StorageDriver) -> None:
        """Mutating the caller's values after staging or committing never changes stored state."""

        async def body() -> None:
            scope = _Scope()
            key, other = scope.key("input"), scope.key("input-2")
            value: dict[str, Any] = {"list": [1, 2], "map": {"a": 1}}
            entries = [_entry(scope.partition(), "s")]
            keys = [key, other]

            async def attempt(tx: Any) -> None:
                tx.create(NewStorageRecord(key, StorageDocument.encode(value), entries))
                value["list"].append(3)
                value["map"]["a"] = 2
                entries.append(_entry(scope.partition(), "t", index=_OTHER_INDEX))
                tx.create(_record(other, {"second": True}))

            await driver.with_transaction(attempt)
            value["map"]["b"] = 3
            found = cast(list[StorageRecord], await driver.get(keys))
            assert found[0].document.value == {"list": [1, 2], "map": {"a": 1}}, f"stored {found[0].document.value!r}"
            assert _entries(found[0]) == {_entry(scope.partition(), "s")}, "index entries changed after staging"
            assert found[1].document.value == {"second": True}
            refs = _refs(
                await driver.query(StorageQuery(_OTHER_INDEX, scope.partition(), limit=self._page_limit(driver)))
            )
            assert refs == [], "an index entry added to the caller's list after staging was stored"

        self.run_async(body, driver)

    # =============================================================================================
    # Conditional create, exact replace and delete

    def test_create_after_an_absent_read_or_blind_create_succeeds(self, driver: StorageDriver) -> None:
        """create() may target a key read as absent or an unread key; both commit together."""

        async def body() -> None:
            scope = _Scope()
            read_absent, blind = scope.key("read-absent"), scope.key("blind")

            async def attempt(tx: Any) -> str:
                assert await tx.get([read_absent]) == [None]
                tx.create(_record(read_absent, {"how": "read"}))
                tx.create(_record(blind, {"how": "blind"}))
                return "done"

            assert await driver.with_transaction(attempt) == "done", "with_transaction returns the callback's result"
            assert await _value_of(driver, read_absent) == {"how": "read"}
            assert await _value_of(driver, blind) == {"how": "blind"}

        self.run_async(body, driver)

    def test_create_rejects_a_key_read_as_present(self, driver: StorageDriver) -> None:
        """create() of a key this attempt read as present is a contract violation; nothing commits."""

        async def body() -> None:
            scope = _Scope()
            key, companion = scope.key("present"), scope.key("companion")
            await _create(driver, _record(key, {"v": 1}))
            before = await _get_one(driver, key)
            attempts = 0

            async def attempt(tx: Any) -> None:
                nonlocal attempts
                attempts += 1
                [current] = await tx.get([key])
                assert current is not None
                tx.create(_record(companion, {"v": "companion"}))
                tx.create(_record(key, {"v": 2}))

            await _expect_error(driver.with_transaction(attempt), _CONTRACT, what="create() of a key read as present")
            assert attempts == 1, (
                f"a contract violation is not a conflict and must not be replayed ({attempts} attempts)"
            )
            assert await _get_one(driver, key) == before, "the existing record changed"
            assert await _get_one(driver, companion) is None, "another mutation of the rejected attempt committed"

        self.run_async(body, driver)

    def test_blind_create_of_an_existing_key_commits_nothing(self, driver: StorageDriver) -> None:
        """A blind create of a present key loses its condition: the whole batch rolls back."""

        async def body() -> None:
            scope = _Scope()
            existing, replaced, deleted, created = (
                scope.key("existing"),
                scope.key("replaced"),
                scope.key("deleted"),
                scope.key("new"),
            )
            await _create(
                driver,
                _record(existing, {"v": "original"}, _entry(scope.partition(), "e")),
                _record(replaced, {"v": 1}, _entry(scope.partition(), "r")),
                _record(deleted, {"v": 1}, _entry(scope.partition(), "d")),
            )
            before = await driver.get([existing, replaced, deleted])
            attempts = 0

            async def attempt(tx: Any) -> None:
                nonlocal attempts
                attempts += 1
                current_replaced, current_deleted = await tx.get([replaced, deleted])
                tx.create(_record(created, {"v": "new"}, _entry(scope.partition(), "n")))
                tx.replace(current_replaced, _record(replaced, {"v": 2}, _entry(scope.partition(), "r2")))
                tx.delete(current_deleted)
                tx.create(_record(existing, {"v": "overwritten"}))

            error = await _expect_error(
                driver.with_transaction(attempt), ErrorCode.STORAGE_CONFLICT, what="blind create of an existing key"
            )
            assert error.retryable, "a lost create condition is a retryable storage_conflict"
            assert await driver.get([existing, replaced, deleted]) == before, (
                "a mutation of the failed batch was applied"
            )
            assert await _get_one(driver, created) is None, "a create of the failed batch was applied"
            refs = _refs(await driver.query(StorageQuery(_INDEX, scope.partition(), limit=self._page_limit(driver))))
            assert refs == _ordered([(existing, ("e",)), (replaced, ("r",)), (deleted, ("d",))]), (
                f"index rows changed: {refs!r}"
            )

        self.run_async(body, driver)

    def test_replace_and_delete_apply_the_version_read_in_the_attempt(self, driver: StorageDriver) -> None:
        """replace() and delete() of records read in the same attempt commit exactly."""

        async def body() -> None:
            scope = _Scope()
            keep, gone = scope.key("keep"), scope.key("gone")
            await _create(driver, _record(keep, {"v": 1}), _record(gone, {"v": 1}))

            async def attempt(tx: Any) -> None:
                current_keep, current_gone = await tx.get([keep, gone])
                tx.replace(current_keep, _record(keep, {"v": 2}))
                tx.delete(current_gone)

            await driver.with_transaction(attempt)
            assert await _value_of(driver, keep) == {"v": 2}
            assert await _get_one(driver, gone) is None, "delete() did not remove the record"
            await _create(driver, _record(gone, {"v": "again"}))
            assert await _value_of(driver, gone) == {"v": "again"}, "a deleted key can be created again"

        self.run_async(body, driver)

    def test_replace_or_delete_of_an_unread_or_stale_record_is_rejected(self, driver: StorageDriver) -> None:
        """replace()/delete() need the record exactly as this attempt read it; nothing else commits."""

        async def body() -> None:
            scope = _Scope()
            key, companion, absent = scope.key("target"), scope.key("companion"), scope.key("absent")
            await _create(driver, _record(key, {"v": 1}))
            stale = await _get_one(driver, key)
            await _update(driver, key, lambda value: {"v": 2})
            current = await _get_stored(driver, key)

            async def unread_replace(tx: Any) -> None:
                tx.create(_record(companion, {"v": 0}))
                tx.replace(current, _record(key, {"v": "unread"}))

            async def unread_delete(tx: Any) -> None:
                tx.create(_record(companion, {"v": 0}))
                tx.delete(current)

            async def stale_replace(tx: Any) -> None:
                [fresh] = await tx.get([key])
                assert fresh is not None and fresh.version == current.version
                tx.create(_record(companion, {"v": 0}))
                tx.replace(stale, _record(key, {"v": "stale"}))

            async def stale_delete(tx: Any) -> None:
                await tx.get([key])
                tx.create(_record(companion, {"v": 0}))
                tx.delete(stale)

            async def absent_replace(tx: Any) -> None:
                assert await tx.get([absent]) == [None]
                tx.create(_record(companion, {"v": 0}))
                tx.replace(StorageRecord(absent, current.version, current.document), _record(absent, {"v": "ghost"}))

            cases = {
                "replace() of a record this attempt never read": unread_replace,
                "delete() of a record this attempt never read": unread_delete,
                "replace() with an older version than this attempt read": stale_replace,
                "delete() with an older version than this attempt read": stale_delete,
                "replace() of a key this attempt read as absent": absent_replace,
            }
            for what, callback in cases.items():
                await _expect_error(driver.with_transaction(callback), _CONTRACT, ErrorCode.STORAGE_CONFLICT, what=what)
                assert await _get_one(driver, key) == current, f"{what}: the record changed"
                assert await _get_one(driver, companion) is None, f"{what}: another mutation of the attempt committed"
                assert await _get_one(driver, absent) is None, f"{what}: a record appeared"

        self.run_async(body, driver)

    def test_replace_cannot_change_the_key(self, driver: StorageDriver) -> None:
        """A replacement keeps its key; a different key is a contract violation and nothing commits."""

        async def body() -> None:
            scope = _Scope()
            key, other, companion = scope.key("source"), scope.key("target"), scope.key("companion")
            await _create(driver, _record(key, {"v": 1}))
            before = await _get_one(driver, key)

            async def attempt(tx: Any) -> None:
                [current] = await tx.get([key])
                tx.create(_record(companion, {}))
                tx.replace(current, _record(other, {"v": 2}))

            await _expect_error(driver.with_transaction(attempt), _CONTRACT, what="replace() that changes the key")
            assert await driver.get([key, other, companion]) == [before, None, None], (
                "a key-changing replace wrote something"
            )

        self.run_async(body, driver)

    def test_a_key_is_mutated_at_most_once_per_attempt(self, driver: StorageDriver) -> None:
        """A second create/replace/delete of one key in an attempt is a contract violation; nothing commits."""

        async def body() -> None:
            scope = _Scope()
            key, fresh = scope.key("once"), scope.key("fresh")
            await _create(driver, _record(key, {"v": 1}))
            before = await _get_one(driver, key)

            async def replace_then_delete(tx: Any) -> None:
                [current] = await tx.get([key])
                tx.replace(current, _record(key, {"v": 2}))
                tx.delete(current)

            async def replace_twice(tx: Any) -> None:
                [current] = await tx.get([key])
                tx.replace(current, _record(key, {"v": 2}))
                tx.replace(current, _record(key, {"v": 3}))

            async def create_twice(tx: Any) -> None:
                tx.create(_record(fresh, {"v": 1}))
                tx.create(_record(fresh, {"v": 2}))

            async def delete_then_create(tx: Any) -> None:
                [current] = await tx.get([key])
                tx.delete(current)
                tx.create(_record(key, {"v": "recreated"}))

            for what, callback in {
                "replace() then delete() of one key": replace_then_delete,
                "two replace() calls on one key": replace_twice,
                "two create() calls on one key": create_twice,
                "delete() then create() of one key": delete_then_create,
            }.items():
                await _expect_error(driver.with_transaction(callback), _CONTRACT, what=what)
                assert await driver.get([key, fresh]) == [before, None], f"{what}: something was written"

        self.run_async(body, driver)

    # =============================================================================================
    # Attempt phases: frozen time, sealed reads, ended attempts

    def test_now_is_frozen_within_an_attempt(self, driver: StorageDriver) -> None:
        """Every now() call of one attempt returns the same aware datetime, however long the attempt runs."""

        async def body() -> None:
            scope = _Scope()

            async def attempt(tx: Any) -> list[datetime]:
                first = await tx.now()
                await asyncio.sleep(0.02)
                second = await tx.now()
                tx.create(_record(scope.key("stamped"), {"at": encode_iso_date(first)}))
                await asyncio.sleep(0.01)
                third = await tx.now()
                return [first, second, third]

            times = await driver.with_transaction(attempt)
            for value in times:
                assert isinstance(value, datetime) and value.tzinfo is not None and value.utcoffset() is not None, (
                    f"now() must return an aware datetime, got {value!r}"
                )
            assert times[0] == times[1] == times[2], f"now() changed within one attempt: {times}"

        self.run_async(body, driver)

    def test_now_moves_on_between_attempts_and_keeps_to_the_wall_clock(self, driver: StorageDriver) -> None:
        """Each attempt reads the time anew: a later attempt's now() is later, and close to the real time
        (a cached or fixed time makes nothing ever due)."""

        async def body() -> None:
            async def attempt(tx: Any) -> datetime:
                return await tx.now()

            first = await driver.with_transaction(attempt)
            await asyncio.sleep(0.05)
            second = await driver.with_transaction(attempt)
            assert second > first, f"now() did not move on between attempts 50 ms apart: {first} then {second}"
            wall = datetime.now(UTC)
            assert abs(second - wall) < timedelta(minutes=10), (
                f"now() reads {second}, but the wall clock is {wall}: is a time cached or fixed?"
            )

        self.run_async(body, driver)

    def test_reads_are_rejected_after_now(self, driver: StorageDriver) -> None:
        """now() seals the read set: a later get() or query_candidates() is a contract violation."""

        async def body() -> None:
            scope = _Scope()
            key = scope.key("k")
            await _create(driver, _record(key, {"v": 1}, _entry(scope.partition(), "a")))
            query = StorageQuery(_INDEX, scope.partition(), limit=self._page_limit(driver))
            reads: dict[str, Callable[[Any], Awaitable[Any]]] = {
                "get()": lambda tx: tx.get([key]),
                "query_candidates()": lambda tx: tx.query_candidates(query),
            }
            for name, read in reads.items():
                reached: list[bool] = []
                attempts: list[int] = []

                async def attempt(
                    tx: Any, read: Any = read, reached: list[bool] = reached, attempts: list[int] = attempts
                ) -> None:
                    attempts.append(1)
                    await tx.get([scope.key("before")])
                    await tx.now()
                    await read(tx)
                    reached.append(True)
                    tx.create(_record(scope.key("after"), {"v": 1}))

                await _expect_error(driver.with_transaction(attempt), _CONTRACT, what=f"{name} after now()")
                assert not reached, f"{name} after now() returned instead of raising"
                assert len(attempts) == 1, f"{name} after now(): a contract violation must not be replayed"
                assert await _get_one(driver, scope.key("after")) is None

        self.run_async(body, driver)

    def test_reads_are_rejected_after_the_first_mutation(self, driver: StorageDriver) -> None:
        """Staging create/replace/delete ends the read phase; the attempt commits nothing."""

        async def body() -> None:
            scope = _Scope()
            key, other = scope.key("k"), scope.key("other")
            await _create(driver, _record(key, {"v": 1}, _entry(scope.partition(), "a")))
            before = await _get_one(driver, key)
            query = StorageQuery(_INDEX, scope.partition(), limit=self._page_limit(driver))

            def create(tx: Any, current: StorageRecord) -> None:
                tx.create(_record(scope.key("created"), {"v": 1}))

            def replace(tx: Any, current: StorageRecord) -> None:
                tx.replace(current, _record(key, {"v": 2}))

            def delete(tx: Any, current: StorageRecord) -> None:
                tx.delete(current)

            reads: dict[str, Callable[[Any], Awaitable[Any]]] = {
                "get()": lambda tx: tx.get([other]),
                "query_candidates()": lambda tx: tx.query_candidates(query),
            }
            for mutation_name, mutation in {"create()": create, "replace()": replace, "delete()": delete}.items():
                for read_name, read in reads.items():
                    reached: list[bool] = []

                    async def attempt(
                        tx: Any, mutation: Any = mutation, read: Any = read, reached: list[bool] = reached
                    ) -> None:
                        [current] = await tx.get([key])
                        mutation(tx, current)
                        await read(tx)
                        reached.append(True)

                    what = f"{read_name} after {mutation_name}"
                    await _expect_error(driver.with_transaction(attempt), _CONTRACT, what=what)
                    assert not reached, f"{what} returned instead of raising"
                    assert await _get_one(driver, key) == before, f"{what}: the staged mutation committed"
                    assert await _get_one(driver, scope.key("created")) is None, f"{what}: the staged create committed"

        self.run_async(body, driver)

    def test_an_ended_attempt_cannot_be_used(self, driver: StorageDriver) -> None:
        """The transaction object is dead once with_transaction() returns or raises."""

        async def body() -> None:
            scope = _Scope()
            key = scope.key("k")
            await _create(driver, _record(key, {"v": 1}))
            kept: list[Any] = []

            async def committed(tx: Any) -> None:
                kept.append(tx)
                await tx.get([key])

            async def failed(tx: Any) -> None:
                kept.append(tx)
                raise _Rollback()

            await driver.with_transaction(committed)
            with contextlib.suppress(_Rollback):
                await driver.with_transaction(failed)
            current = await _get_one(driver, key)
            for tx in kept:
                await _expect_error(tx.get([key]), _CONTRACT, what="get() on an ended attempt")
                await _expect_error(
                    tx.query_candidates(StorageQuery(_INDEX, scope.partition(), limit=1)),
                    _CONTRACT,
                    what="query_candidates() on an ended attempt",
                )
                _expect_contract_error(
                    lambda: tx.create(_record(scope.key("late"), {"v": 1})), "create() on an ended attempt"
                )
                _expect_contract_error(
                    lambda: tx.replace(current, _record(key, {"v": 2})), "replace() on an ended attempt"
                )
                _expect_contract_error(lambda: tx.delete(current), "delete() on an ended attempt")
            assert await driver.get([key, scope.key("late")]) == [current, None], "an ended attempt wrote something"

        self.run_async(body, driver)

    # =============================================================================================
    # Rollback, replay and conflicts

    def test_a_raising_callback_rolls_back_every_staged_mutation(self, driver: StorageDriver) -> None:
        """An exception after staging creates, replaces and deletes propagates unchanged, is not
        replayed, and leaves records and index rows untouched."""

        async def body() -> None:
            scope = _Scope()
            created, replaced, deleted = scope.key("created"), scope.key("replaced"), scope.key("deleted")
            await _create(
                driver,
                _record(replaced, {"v": 1}, _entry(scope.partition(), "r1")),
                _record(
                    deleted,
                    {"v": 1},
                    _entry(scope.partition(), "d1"),
                    _entry(scope.partition(), "d", index=_OTHER_INDEX),
                ),
            )
            before = await driver.get([created, replaced, deleted])
            raised = _Rollback("boom")
            attempts = 0

            async def attempt(tx: Any) -> None:
                nonlocal attempts
                attempts += 1
                _, current_replaced, current_deleted = await tx.get([created, replaced, deleted])
                tx.create(_record(created, {"v": 1}, _entry(scope.partition(), "c1")))
                tx.replace(current_replaced, _record(replaced, {"v": 2}, _entry(scope.partition(), "r2")))
                tx.delete(current_deleted)
                await tx.now()
                raise raised

            with pytest.raises(_Rollback) as info:
                await driver.with_transaction(attempt)
            assert info.value is raised, "the callback's own exception must propagate unchanged"
            assert attempts == 1, (
                f"an exception from the callback is not a conflict; it was replayed ({attempts} attempts)"
            )
            assert await driver.get([created, replaced, deleted]) == before, "a staged mutation survived the rollback"
            refs = _refs(await driver.query(StorageQuery(_INDEX, scope.partition(), limit=self._page_limit(driver))))
            assert refs == _ordered([(replaced, ("r1",)), (deleted, ("d1",))]), f"index rows changed: {_describe(refs)}"
            other = _refs(
                await driver.query(StorageQuery(_OTHER_INDEX, scope.partition(), limit=self._page_limit(driver)))
            )
            assert other == [(deleted, ("d",))], "a rolled-back delete removed index rows"

            async def runlane_error(tx: Any) -> None:
                tx.create(_record(created, {"v": 1}))
                raise RunlaneError(ErrorCode.VALIDATION_FAILED, "callback refused")

            error = await _expect_error(
                driver.with_transaction(runlane_error), ErrorCode.VALIDATION_FAILED, what="callback error"
            )
            assert error.message == "callback refused", "the callback's RunlaneError must propagate unchanged"
            assert await _get_one(driver, created) is None

        self.run_async(body, driver)

    def test_cancelled_attempt_writes_nothing(self, driver: StorageDriver) -> None:
        """Cancelling with_transaction() while the callback is suspended after staging writes nothing
        and leaves the driver usable for the same keys."""

        async def body() -> None:
            scope = _Scope()
            key, created = scope.key("k"), scope.key("created")
            await _create(driver, _record(key, {"v": 1}, _entry(scope.partition(), "a")))
            before = await _get_one(driver, key)
            staged = asyncio.Event()

            async def attempt(tx: Any) -> None:
                [current] = await tx.get([key])
                tx.replace(current, _record(key, {"v": "cancelled"}, _entry(scope.partition(), "b")))
                tx.create(_record(created, {"v": 1}))
                staged.set()
                await asyncio.Event().wait()

            task = asyncio.create_task(driver.with_transaction(attempt))
            await asyncio.wait_for(staged.wait(), self.race_wait_seconds * 5)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            assert await driver.get([key, created]) == [before, None], "a cancelled attempt wrote something"
            await asyncio.wait_for(_update(driver, key, lambda value: {"v": 2}), self.race_wait_seconds * 5)
            assert await _value_of(driver, key) == {"v": 2}, "the key is unusable after a cancelled attempt"

        self.run_async(body, driver)

    def test_present_read_conflict_replays_and_only_the_committed_result_escapes(self, driver: StorageDriver) -> None:
        """A record read by A and replaced by B before A commits forces A to replay; A's first
        attempt's write and result are discarded."""

        async def body() -> None:
            scope = _Scope()
            key = scope.key("counter")
            await _create(driver, _record(key, {"n": 1}))

            async def a(tx: Any, attempt: int, pause: _Pause) -> tuple[str, int, int]:
                [current] = await tx.get([key])
                await pause()
                n = current.document.value["n"]
                tx.replace(current, _record(key, {"n": n + 1, "by": "a"}))
                return ("a", attempt, n)

            async def b(tx: Any, attempt: int) -> int:
                [current] = await tx.get([key])
                n = current.document.value["n"]
                tx.replace(current, _record(key, {"n": n + 10, "by": "b"}))
                return n

            race = await self._interleave(driver, a, driver, b)
            final = await _value_of(driver, key)
            assert final is not None and final["n"] == 12, f"an update was lost: final value {final!r}"
            if race.b_first:
                assert race.a_attempts == 2, (
                    "A read a record B replaced before A committed; expected one replay, "
                    f"got {race.a_attempts} attempts"
                )
                assert race.a_result == ("a", 2, 11), (
                    f"only the committed attempt's result may escape, got {race.a_result!r}"
                )
                assert final["by"] == "a"
            else:
                assert race.a_result == ("a", race.a_attempts, 1) and final["by"] == "b"

        self.run_async(body, driver)

    def test_absent_read_dependency_is_validated_at_commit(self, driver: StorageDriver) -> None:
        """A key read as absent and created by another writer before commit is a conflict (write skew
        between two absence checks is impossible)."""

        async def body() -> None:
            scope = _Scope()
            left, right = scope.key("left"), scope.key("right")

            async def a(tx: Any, attempt: int, pause: _Pause) -> str:
                [other] = await tx.get([right])
                await pause()
                if other is not None:
                    return "a saw right"
                tx.create(_record(left, {"by": "a"}))
                return "a created left"

            async def b(tx: Any, attempt: int) -> str:
                [other] = await tx.get([left])
                if other is not None:
                    return "b saw left"
                tx.create(_record(right, {"by": "b"}))
                return "b created right"

            race = await self._interleave(driver, a, driver, b)
            present = [
                key.parts[0]
                for key, record in zip((left, right), await driver.get([left, right]))
                if record is not None
            ]
            assert len(present) == 1, (
                f"both absence checks passed and both keys were created ({present}): absent reads are not validated"
            )
            if race.b_first:
                assert (race.a_result, race.b_result, present) == ("a saw right", "b created right", ["right"]), (
                    f"A read 'right' as absent, B created it before A committed; A must replay: {race!r}"
                )
                assert race.a_attempts == 2, f"expected one replay of A, got {race.a_attempts} attempts"

        self.run_async(body, driver)

    def test_read_only_dependency_is_validated_at_commit(self, driver: StorageDriver) -> None:
        """A key only read (never written) by A and changed by B before A commits forces A to replay."""

        async def body() -> None:
            scope = _Scope()
            rate, derived = scope.key("rate"), scope.key("derived")
            await _create(driver, _record(rate, {"rate": 1}), _record(derived, {"value": 0}))

            async def a(tx: Any, attempt: int, pause: _Pause) -> int:
                current_rate, current_derived = await tx.get([rate, derived])
                await pause()
                value = current_rate.document.value["rate"] * 10
                tx.replace(current_derived, _record(derived, {"value": value}))
                return value

            async def b(tx: Any, attempt: int) -> None:
                [current] = await tx.get([rate])
                tx.replace(current, _record(rate, {"rate": 2}))

            race = await self._interleave(driver, a, driver, b)
            final = await _value_of(driver, derived)
            if race.b_first:
                assert final == {"value": 20}, f"A used a rate B had already replaced: derived {final!r} (expected 20)"
                assert race.a_attempts == 2 and race.a_result == 20
            else:
                assert final == {"value": 10} and race.a_result == 10
            assert await _value_of(driver, rate) == {"rate": 2}

        self.run_async(body, driver)

    def test_blind_create_conflict_is_detected(self, driver: StorageDriver) -> None:
        """Two blind creates of one key: the one committing second fails and never overwrites."""

        async def body() -> None:
            scope = _Scope()
            key, side = scope.key("contested"), scope.key("side-effect")

            async def create_or_report(tx: Any, who: str, attempt: int) -> str:
                if attempt > 1:
                    [current] = await tx.get([key])
                    if current is not None:
                        return f"{who} found {current.document.value['by']}"
                tx.create(_record(key, {"by": who}))
                if who == "a":
                    tx.create(_record(side, {"by": who}))
                return f"{who} created"

            async def a(tx: Any, attempt: int, pause: _Pause) -> str:
                await pause()
                return await create_or_report(tx, "a", attempt)

            async def b(tx: Any, attempt: int) -> str:
                return await create_or_report(tx, "b", attempt)

            race = await self._interleave(driver, a, driver, b)
            final = await _value_of(driver, key)
            if race.b_first:
                assert final == {"by": "b"}, f"A's blind create overwrote B's committed record: {final!r}"
                assert race.a_result == "a found b", f"A must replay and see B's record, got {race.a_result!r}"
                assert await _get_one(driver, side) is None, (
                    "the failed blind-create attempt committed its other writes"
                )
            else:
                assert final == {"by": "a"} and race.b_result == "b found a"

        self.run_async(body, driver)

    def test_delete_and_recreate_between_read_and_commit_is_a_conflict(self, driver: StorageDriver) -> None:
        """A record read by A, then deleted and created again by another writer before A commits, is a
        changed dependency (versions never repeat), so A replays against the new record."""

        async def body() -> None:
            scope = _Scope()
            key = scope.key("recycled")
            await _create(driver, _record(key, {"generation": 1, "n": 0}))
            paused, recycled = asyncio.Event(), asyncio.Event()
            attempts = 0
            recycled_first = False

            async def attempt(tx: Any) -> int:
                nonlocal attempts, recycled_first
                attempts += 1
                [current] = await tx.get([key])
                if attempts == 1:
                    paused.set()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(recycled.wait(), self.race_wait_seconds)
                value = current.document.value
                tx.replace(current, _record(key, {**value, "n": value["n"] + 1}))
                recycled_first = recycled.is_set()  # the committed attempt's value decides the expectation
                return value["generation"]

            async def recycle() -> None:
                await paused.wait()

                async def delete(tx: Any) -> None:
                    [current] = await tx.get([key])
                    tx.delete(current)

                await driver.with_transaction(delete)
                await _create(driver, _record(key, {"generation": 2, "n": 0}))
                recycled.set()

            recycler = asyncio.create_task(recycle())
            try:
                generation = await driver.with_transaction(attempt)
            except Exception as error:
                if not recycled.is_set() or isinstance(error, AssertionError):
                    raise
                recreated = _NOT_REPLAYED.format(error=error, other="the key was deleted and recreated")
                raise AssertionError(recreated) from error
            await recycler
            final = await _value_of(driver, key)
            if recycled_first:
                assert generation == 2 and final == {"generation": 2, "n": 1}, (
                    f"A replaced a record that was deleted and recreated after A read it (final {final!r}): "
                    "the read dependency must fail even when a record with the same key exists again"
                )
                assert attempts == 2, f"expected one replay, got {attempts} attempts"
            else:
                assert generation == 1 and final == {"generation": 2, "n": 0}, f"unexpected final record {final!r}"

        self.run_async(body, driver)

    def test_concurrent_increments_are_never_lost(self, driver: StorageDriver) -> None:
        """Many concurrent read-modify-write attempts on the same keys end exactly at the expected totals."""

        async def body() -> None:
            scope = _Scope()
            first, second = scope.key("first"), scope.key("second")
            await _create(driver, _record(first, {"n": 0}), _record(second, {"n": 0}))
            writers = self.concurrent_writers

            async def increment(tx: Any) -> None:
                current_first, current_second = await tx.get([first, second])
                await asyncio.sleep(0)
                tx.replace(current_first, _record(first, {"n": current_first.document.value["n"] + 1}))
                tx.replace(current_second, _record(second, {"n": current_second.document.value["n"] + 2}))

            await asyncio.gather(*(driver.with_transaction(increment) for _ in range(writers)))
            assert await _value_of(driver, first) == {"n": writers}, (
                f"lost increments on the first counter: {await _value_of(driver, first)}"
            )
            assert await _value_of(driver, second) == {"n": 2 * writers}, "lost increments on the second counter"

        self.run_async(body, driver)

    def test_concurrent_transfers_preserve_the_total(self, driver: StorageDriver) -> None:
        """Concurrent transfers between overlapping accounts keep every balance and the total exact."""

        async def body() -> None:
            scope = _Scope()
            accounts = [scope.key("account", str(i)) for i in range(3)]
            await _create(driver, *(_record(key, {"balance": 100}) for key in accounts))
            moves = [(i % 3, (i + 1) % 3, i + 1) for i in range(self.concurrent_writers)]

            async def transfer(source: int, target: int, amount: int) -> None:
                async def attempt(tx: Any) -> None:
                    current_source, current_target = await tx.get([accounts[source], accounts[target]])
                    await asyncio.sleep(0)
                    tx.replace(
                        current_source,
                        _record(accounts[source], {"balance": current_source.document.value["balance"] - amount}),
                    )
                    tx.replace(
                        current_target,
                        _record(accounts[target], {"balance": current_target.document.value["balance"] + amount}),
                    )

                await driver.with_transaction(attempt)

            await asyncio.gather(*(transfer(*move) for move in moves))
            expected = [100] * 3
            for source, target, amount in moves:
                expected[source] -= amount
                expected[target] += amount
            stored = cast(list[StorageRecord], await driver.get(accounts))
            balances = [record.document.value["balance"] for record in stored]
            assert balances == expected, f"balances {balances} differ from {expected}: a transfer was lost or torn"

        self.run_async(body, driver)

    def test_racing_creators_of_one_absent_key_have_exactly_one_winner(self, driver: StorageDriver) -> None:
        """Concurrent read-absent-then-create attempts on one key: exactly one creates it."""

        async def body() -> None:
            scope = _Scope()
            key = scope.key("singleton")
            racers = self.concurrent_writers
            all_read = asyncio.Event()
            readers = 0

            async def racer(name: str) -> str:
                async def attempt(tx: Any) -> str:
                    nonlocal readers
                    [current] = await tx.get([key])
                    if current is not None:
                        return "lost"
                    readers += 1
                    if readers == racers:
                        all_read.set()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(all_read.wait(), self.race_wait_seconds)
                    tx.create(_record(key, {"winner": name}))
                    return "won"

                return await driver.with_transaction(attempt)

            results = await asyncio.gather(*(racer(f"racer-{i}") for i in range(racers)))
            winners = [f"racer-{i}" for i, result in enumerate(results) if result == "won"]
            assert len(winners) == 1, f"expected exactly one creator, got {winners}"
            assert await _value_of(driver, key) == {"winner": winners[0]}, "the stored record is not the winner's"

        self.run_async(body, driver)

    def test_conflicts_are_detected_across_instances(self, driver: StorageDriver, peer_driver: StorageDriver) -> None:
        """Two independent instances over one store validate each other's writes."""

        async def body() -> None:
            scope = _Scope()
            key = scope.key("shared")
            await _create(driver, _record(key, {"n": 0}))
            assert await _value_of(peer_driver, key) == {"n": 0}, "peer_driver does not see driver's commits"

            async def a(tx: Any, attempt: int, pause: _Pause) -> None:
                [current] = await tx.get([key])
                await pause()
                tx.replace(current, _record(key, {"n": current.document.value["n"] + 1}))

            async def b(tx: Any, attempt: int) -> None:
                [current] = await tx.get([key])
                tx.replace(current, _record(key, {"n": current.document.value["n"] + 10}))

            await self._interleave(driver, a, peer_driver, b)
            assert await _value_of(driver, key) == {"n": 11}, "an update from the other instance was lost"

            async def increment(tx: Any) -> None:
                [current] = await tx.get([key])
                await asyncio.sleep(0)
                tx.replace(current, _record(key, {"n": current.document.value["n"] + 1}))

            writers = self.concurrent_writers
            await asyncio.gather(
                *((driver if i % 2 else peer_driver).with_transaction(increment) for i in range(writers))
            )
            assert await _value_of(peer_driver, key) == {"n": 11 + writers}, (
                "concurrent increments across instances were lost"
            )

        self.run_async(body, driver, peer_driver)

    def test_exhausted_conflict_budget_raises_a_retryable_storage_conflict(self, driver: StorageDriver) -> None:
        """An attempt that loses validation every time ends with a retryable storage_conflict and commits nothing."""

        async def body() -> None:
            scope = _Scope()
            key, marker = scope.key("hot"), scope.key("marker")
            await _create(driver, _record(key, {"n": 0}))
            attempts = 0
            bumps = 0
            writers: list[asyncio.Task[None]] = []
            blocked = False

            async def bump() -> None:
                nonlocal bumps
                await _update(driver, key, lambda value: {"n": value["n"] + 1})
                bumps += 1

            async def attempt(tx: Any) -> None:
                nonlocal attempts, blocked
                attempts += 1
                if attempts > 1000:
                    raise AssertionError("the driver replayed a conflicting callback more than 1000 times")
                [current] = await tx.get([key])
                writer = asyncio.create_task(bump())
                writers.append(writer)
                await asyncio.wait({writer}, timeout=self.race_wait_seconds)
                tx.replace(current, _record(key, {"n": -1}))
                tx.create(_record(marker, {"attempt": attempts}))
                blocked = not writer.done()  # the committed attempt's value decides

            try:
                await driver.with_transaction(attempt)
            except Exception as error:  # noqa: BLE001 - any other exception is reported as the failure
                failure: BaseException | None = error
            else:
                failure = None
            await asyncio.gather(*writers)
            if failure is None and blocked:
                pytest.skip("the driver makes competing writers wait, so a conflict cannot be forced on every attempt")
            assert failure is not None, (
                f"every attempt lost its read set, yet the transaction committed (after {attempts} attempts)"
            )
            conflict = _check_error(failure, (ErrorCode.STORAGE_CONFLICT,), "an exhausted conflict budget")
            assert conflict.retryable, "an exhausted conflict budget must be retryable"
            assert is_storage_conflict(conflict), "a storage_conflict carries meta['storage_conflict_kind']"
            assert attempts >= 2, f"a conflicting attempt must be replayed before giving up (got {attempts} attempt)"
            assert await _get_one(driver, marker) is None, "a losing attempt committed its create"
            assert await _value_of(driver, key) == {"n": bumps}, "a losing attempt's replace was applied"

        self.run_async(body, driver)

    # =============================================================================================
    # Queries: order, ranges, ties and cursors

    def test_query_orders_by_encoded_sort_in_both_directions(self, driver: StorageDriver) -> None:
        """Ascending and descending pages follow component-wise UTF-8 byte order of sort tuples and
        only return rows of the queried index and partition."""

        async def body() -> None:
            scope = _Scope()
            sorts = [
                ("b",),
                ("a", "z"),
                ("a",),
                ("a!",),
                ("ab",),
                ("10",),
                ("9",),
                ("\uffff",),
                ("\U00010000",),
                ("\ue000",),
                ("é",),
                ("e",),
                ("a", "\U0010ffff"),
                ("A",),
            ]
            written = []
            records = []
            for n, sort in enumerate(sorts):
                key = scope.key(f"r{n:02d}")
                written.append((key, sort))
                records.append(_record(key, {"n": n}, _entry(scope.partition(), *sort)))
            records.append(_record(scope.key("elsewhere"), {}, _entry(scope.partition("other"), "a")))
            records.append(_record(scope.key("other-index"), {}, _entry(scope.partition(), "a", index=_OTHER_INDEX)))
            await _create(driver, *records)

            def result_query(direction: SortDirection) -> StorageQuery:
                return StorageQuery(_INDEX, scope.partition(), direction=direction, limit=self._page_limit(driver))

            for direction in (_ASC, _DESC):
                expected = _ordered(written, direction)
                if len(expected) > self._page_limit(driver):  # pages smaller than the rows: follow the cursors
                    got = await _query_all(driver, result_query(direction))
                    assert got == expected, (
                        f"{direction} order differs:\n got      {_describe(got)}\n expected {_describe(expected)}"
                    )
                    continue
                result = await driver.query(result_query(direction))
                got = _refs(result)
                assert got == expected, (
                    f"{direction} order differs:\n got      {_describe(got)}\n expected {_describe(expected)}"
                )
                if result.next_cursor is not None:
                    rest = await _query_all(driver, _with(result_query(direction), cursor=result.next_cursor))
                    assert rest == [], (
                        f"a page holding every row may only carry a cursor to an empty continuation, got {rest}"
                    )
            empty = await driver.query(StorageQuery(_INDEX, scope.partition("nobody"), limit=self._page_limit(driver)))
            assert _refs(empty) == [] and empty.next_cursor is None, "an empty partition returns no rows and no cursor"

        self.run_async(body, driver)

    def test_query_range_bounds(self, driver: StorageDriver) -> None:
        """gt, gte, lt, lte, their combinations, between() and prefix() select exactly their rows."""

        async def body() -> None:
            scope = _Scope()
            sorts = [(f"{i:02d}",) for i in range(10)] + [("03", "x"), ("07", "x"), ("07", "x", "y")]
            written = [(scope.key(f"r{n:02d}"), sort) for n, sort in enumerate(sorts)]
            await _create(driver, *(_record(key, {}, _entry(scope.partition(), *sort)) for key, sort in written))
            low, high = encode_storage_tuple(("03",)), encode_storage_tuple(("07",))

            def encoded(sort: tuple[str, ...]) -> str:
                return encode_storage_tuple(sort)

            cases: dict[str, tuple[StorageRange, Callable[[str], bool]]] = {
                "gt": (StorageRange(gt=low), lambda s: s > low),
                "gte": (StorageRange(gte=low), lambda s: s >= low),
                "lt": (StorageRange(lt=high), lambda s: s < high),
                "lte": (StorageRange(lte=high), lambda s: s <= high),
                "gt+lt": (StorageRange(gt=low, lt=high), lambda s: low < s < high),
                "gte+lte": (StorageRange(gte=low, lte=high), lambda s: low <= s <= high),
                "gt+lte": (StorageRange(gt=low, lte=high), lambda s: low < s <= high),
                "gte+lt": (StorageRange(gte=low, lt=high), lambda s: low <= s < high),
                "between": (StorageRange.between(("03",), ("07",)), lambda s: low <= s < high),
                "between-exclusive-inclusive": (
                    StorageRange.between(("03",), ("07",), lower_inclusive=False, upper_inclusive=True),
                    lambda s: low < s <= high,
                ),
                "prefix 03": (StorageRange.prefix(("03",)), lambda s: s in (encoded(("03",)), encoded(("03", "x")))),
                "prefix 07/x": (
                    StorageRange.prefix(("07", "x")),
                    lambda s: s in (encoded(("07", "x")), encoded(("07", "x", "y"))),
                ),
                "prefix 99": (StorageRange.prefix(("99",)), lambda s: False),
                "inverted": (StorageRange(gt=high, lt=low), lambda s: False),
                "point": (StorageRange(gte=low, lte=low), lambda s: s == low),
            }
            for name, (bounds, contains) in cases.items():
                for direction in (_ASC, _DESC):
                    query = StorageQuery(
                        _INDEX, scope.partition(), range=bounds, direction=direction, limit=self._page_limit(driver)
                    )
                    got = _refs(await driver.query(query))
                    expected = _ordered([item for item in written if contains(encoded(item[1]))], direction)
                    assert got == expected, (
                        f"range {name} {direction}:\n got      {_describe(got)}\n expected {_describe(expected)}"
                    )
                    paged = await _query_all(driver, _with(query, limit=2))
                    assert paged == expected, f"range {name} {direction} paged by 2 differs: {_describe(paged)}"

        self.run_async(body, driver)

    def test_query_prefix_range_includes_components_starting_with_the_max_code_point(
        self, driver: StorageDriver
    ) -> None:
        """A tuple-prefix range needs no Unicode sentinel: values starting with U+10FFFF still match."""

        async def body() -> None:
            scope = _Scope()
            top = "\U0010ffff"
            sorts = [
                (top,),
                (top, "a"),
                (top, top),
                (top, top + "z"),
                (top + "a",),
                (top + top,),
                ("\U0010fffe",),
                ("z",),
                ("a",),
                ("a", top),
                ("a", top + "b"),
                ("a", top, "c"),
                ("a" + top,),
                ("b",),
            ]
            written = [(scope.key(f"r{n:02d}"), sort) for n, sort in enumerate(sorts)]
            await _create(driver, *(_record(key, {}, _entry(scope.partition(), *sort)) for key, sort in written))
            prefixes = [(top,), ("a",), ("a", top), (top, top)]
            for prefix in prefixes:
                for direction in (_ASC, _DESC):
                    query = StorageQuery(
                        _INDEX,
                        scope.partition(),
                        range=StorageRange.prefix(prefix),
                        direction=direction,
                        limit=self._page_limit(driver),
                    )
                    expected = _ordered([item for item in written if item[1][: len(prefix)] == prefix], direction)
                    got = _refs(await driver.query(query))
                    assert got == expected, (
                        f"prefix {prefix!r} {direction}:\n got      {_describe(got)}\n expected {_describe(expected)}"
                    )
                    assert await _query_all(driver, _with(query, limit=1)) == expected, (
                        f"prefix {prefix!r} paged by 1 differs"
                    )

        self.run_async(body, driver)

    def test_query_breaks_sort_ties_by_encoded_record_key(self, driver: StorageDriver) -> None:
        """Equal sort values order by encoded record key (component-wise), not by insertion or joined text."""

        async def body() -> None:
            scope = _Scope()
            parts = [
                ("b",),
                ("a!",),
                ("a", "z"),
                ("a",),
                ("A",),
                ("é",),
                ("e", "\u0301"),
                ("\U00010000",),
                ("\uffff",),
                ("ab",),
            ]
            written: list[tuple[StorageRecordKey, tuple[str, ...]]] = [
                (scope.key(*key_parts), ("tie",)) for key_parts in parts
            ]
            written.append((scope.key("m"), ("tia",)))
            written.append((scope.key("0"), ("tie", "")))
            for key, sort in written:  # one commit each, in a non-sorted order
                await _create(driver, _record(key, {}, _entry(scope.partition(), *sort)))
            for direction in (_ASC, _DESC):
                query = StorageQuery(_INDEX, scope.partition(), direction=direction, limit=self._page_limit(driver))
                expected = _ordered(written, direction)
                got = await _query_all(driver, query)  # one page unless the driver's pages are smaller
                assert got == expected, (
                    f"tie order {direction}:\n got      {_describe(got)}\n expected {_describe(expected)}"
                )
                for size in (1, 3):
                    paged = await _query_all(driver, _with(query, limit=size))
                    assert paged == expected, f"ties paged by {size} ({direction}) differ: {_describe(paged)}"

        self.run_async(body, driver)

    def test_query_pagination_yields_every_item_exactly_once(self, driver: StorageDriver) -> None:
        """Following cursors returns every row once, in order, with every page within its limit."""

        async def body() -> None:
            scope = _Scope()
            written = [(scope.key(f"k{n:02d}"), (f"{n // 3:02d}",)) for n in range(17)]  # runs of three equal sorts
            await _create(driver, *(_record(key, {}, _entry(scope.partition(), *sort)) for key, sort in written))
            ranges = {"all": StorageRange(), "from 02": StorageRange(gte=encode_storage_tuple(("02",)))}
            for range_name, bounds in ranges.items():
                for direction in (_ASC, _DESC):
                    expected = _ordered(
                        [item for item in written if bounds.contains(encode_storage_tuple(item[1]))], direction
                    )
                    for size in (1, 2, 3, 4, 16, 17):
                        query = StorageQuery(
                            _INDEX,
                            scope.partition(),
                            range=bounds,
                            direction=direction,
                            limit=self._page_limit(driver, size),
                        )
                        pages = await _query_all(driver, query)
                        assert pages == expected, (
                            f"{range_name} {direction} by {size}:\n"
                            f" got      {_describe(pages)}\n expected {_describe(expected)}"
                        )
            first = await driver.query(StorageQuery(_INDEX, scope.partition(), limit=2))
            assert first.next_cursor is not None, "a page that stops before the end must return a cursor"
            rest = await _query_all(
                driver,
                StorageQuery(_INDEX, scope.partition(), limit=self._page_limit(driver, 5), cursor=first.next_cursor),
            )
            assert _refs(first) + rest == _ordered(written), (
                "a cursor continues with a different limit (limit is not part of its scope)"
            )

        self.run_async(body, driver)

    def test_query_cursor_is_bound_to_its_scope(self, driver: StorageDriver) -> None:
        """A cursor is rejected (validation_failed) for another index, partition, range or direction,
        through query() and query_candidates()."""

        async def body() -> None:
            scope = _Scope()
            records = []
            for n in range(5):
                entries = (_entry(scope.partition(), f"{n}"), _entry(scope.partition(), f"{n}", index=_OTHER_INDEX))
                records.append(_record(scope.key(f"k{n}"), {}, *entries))
                records.append(_record(scope.key(f"q{n}"), {}, _entry(scope.partition("q"), f"{n}")))
            await _create(driver, *records)
            base = StorageQuery(
                _INDEX, scope.partition(), range=StorageRange(gte=encode_storage_tuple(("0",))), limit=2
            )
            cursor = (await driver.query(base)).next_cursor
            assert cursor is not None, "a page that stops before the end must return a cursor"
            variants = {
                "index": _with(base, index=_OTHER_INDEX, cursor=cursor),
                "partition": _with(base, partition=scope.partition("q"), cursor=cursor),
                "range": _with(base, range=StorageRange(gte=encode_storage_tuple(("1",))), cursor=cursor),
                "no range": _with(base, range=StorageRange(), cursor=cursor),
                "direction": _with(base, direction=_DESC, cursor=cursor),
            }
            for name, query in variants.items():
                await _expect_error(
                    driver.query(query), ErrorCode.VALIDATION_FAILED, what=f"query() cursor with another {name}"
                )
                attempts = 0

                async def attempt(tx: Any, query: StorageQuery = query) -> None:
                    nonlocal attempts
                    attempts += 1
                    await tx.query_candidates(query)

                await _expect_error(
                    driver.with_transaction(attempt),
                    ErrorCode.VALIDATION_FAILED,
                    what=f"query_candidates() cursor with another {name}",
                )
                assert attempts == 1, "a rejected cursor is not a conflict and must not be replayed"
            continued = await driver.query(_with(base, cursor=cursor))
            assert [key.parts[0] for key, _ in _refs(continued)] == ["k2", "k3"], (
                "the cursor no longer continues its own query"
            )

        self.run_async(body, driver)

    def test_malformed_query_cursor_is_rejected(self, driver: StorageDriver) -> None:
        """A damaged or foreign cursor string is rejected with validation_failed."""

        async def body() -> None:
            scope = _Scope()
            await _create(
                driver, *(_record(scope.key(f"k{n}"), {}, _entry(scope.partition(), f"{n}")) for n in range(3))
            )
            query = StorageQuery(_INDEX, scope.partition(), limit=1)
            cursor = (await driver.query(query)).next_cursor
            assert cursor is not None
            for bad in ("not-a-cursor", "", "!!!!", cursor[:-4], cursor + "A", cursor[::-1], "e30"):
                await _expect_error(
                    driver.query(_with(query, cursor=bad)),
                    ErrorCode.VALIDATION_FAILED,
                    what=f"malformed cursor {bad!r}",
                )

        self.run_async(body, driver)

    def test_query_candidates_return_the_committed_index_inside_an_attempt(self, driver: StorageDriver) -> None:
        """Advisory query_candidates() (default and explicit mode) matches query() on committed rows."""

        async def body() -> None:
            scope = _Scope()
            written = [(scope.key(f"k{n}"), (f"{(n * 7) % 5}",)) for n in range(5)]
            await _create(driver, *(_record(key, {}, _entry(scope.partition(), *sort)) for key, sort in written))
            query = StorageQuery(_INDEX, scope.partition(), direction=_DESC, limit=self._page_limit(driver))

            async def attempt(tx: Any) -> tuple[Any, Any]:
                default = await tx.query_candidates(query)
                advisory = await tx.query_candidates(query, mode=StorageCandidateMode.ADVISORY)
                return _refs(default), _refs(advisory)

            default, advisory = await driver.with_transaction(attempt)
            assert default == advisory == _ordered(written, _DESC) == _refs(await driver.query(query))

        self.run_async(body, driver)

    # =============================================================================================
    # Atomic index movement

    def test_replace_moves_index_rows_in_the_same_commit(self, driver: StorageDriver) -> None:
        """A replacement's entries replace all old rows: changed sort, changed partition, dropped and added indexes."""

        async def body() -> None:
            scope = _Scope()
            key, neighbour = scope.key("moving"), scope.key("neighbour")
            p, q = scope.partition(), scope.partition("q")
            await _create(
                driver,
                _record(key, {"v": 1}, _entry(p, "m"), _entry(p, "x", index=_OTHER_INDEX)),
                _record(neighbour, {"v": 1}, _entry(p, "n")),
            )
            limit = self._page_limit(driver)

            async def move(tx: Any) -> None:
                [current] = await tx.get([key])
                tx.replace(current, _record(key, {"v": 2}, _entry(p, "z"), _entry(q, "y", index=_THIRD_INDEX)))

            await driver.with_transaction(move)
            assert _refs(await driver.query(StorageQuery(_INDEX, p, limit=limit))) == [
                (neighbour, ("n",)),
                (key, ("z",)),
            ], "the old sort row must be gone and the new one present"
            assert _refs(await driver.query(StorageQuery(_OTHER_INDEX, p, limit=limit))) == [], (
                "a dropped index entry remained"
            )
            assert _refs(await driver.query(StorageQuery(_THIRD_INDEX, q, limit=limit))) == [(key, ("y",))], (
                "an added index entry is missing"
            )
            stored = await _get_stored(driver, key)
            assert _entries(stored) == {_entry(p, "z"), _entry(q, "y", index=_THIRD_INDEX)}, (
                f"stored entries {stored.indexes!r}"
            )

            async def move_partition(tx: Any) -> None:
                [current] = await tx.get([key])
                tx.replace(current, _record(key, {"v": 3}, _entry(q, "z")))

            await driver.with_transaction(move_partition)
            assert _refs(await driver.query(StorageQuery(_INDEX, p, limit=limit))) == [(neighbour, ("n",))]
            assert _refs(await driver.query(StorageQuery(_INDEX, q, limit=limit))) == [(key, ("z",))]
            assert _refs(await driver.query(StorageQuery(_THIRD_INDEX, q, limit=limit))) == []

        self.run_async(body, driver)

    def test_delete_removes_every_index_row(self, driver: StorageDriver) -> None:
        """Deleting a record removes all of its index rows in the same commit."""

        async def body() -> None:
            scope = _Scope()
            key, kept = scope.key("doomed"), scope.key("kept")
            p = scope.partition()
            await _create(
                driver,
                _record(
                    key, {}, _entry(p, "a"), _entry(p, "b", index=_OTHER_INDEX), _entry(p, "c", index=_THIRD_INDEX)
                ),
                _record(kept, {}, _entry(p, "a")),
            )

            async def delete(tx: Any) -> None:
                [current] = await tx.get([key])
                tx.delete(current)

            await driver.with_transaction(delete)
            limit = self._page_limit(driver)
            assert _refs(await driver.query(StorageQuery(_INDEX, p, limit=limit))) == [(kept, ("a",))]
            assert _refs(await driver.query(StorageQuery(_OTHER_INDEX, p, limit=limit))) == []
            assert _refs(await driver.query(StorageQuery(_THIRD_INDEX, p, limit=limit))) == []

        self.run_async(body, driver)

    def test_entries_that_restate_their_key_page_together_with_every_other_entry(self, driver: StorageDriver) -> None:
        """Under the index names whose entries usually restate the record key (events and steps by run,
        stream records), records whose entry does, whose entry does not, whose key lies in the same key
        range without the entry, and records of other collections all page in the contract's order;
        replacing and deleting them moves their entries like any other."""

        async def body() -> None:
            scope = _Scope()
            env = f"conformance-{scope.token}"
            partition = (env, "r")
            limit = self._page_limit(driver)
            for index, collection in KEY_ORDERED_INDEXES.items():

                def key(*parts: str, collection: str = collection) -> StorageRecordKey:
                    return StorageRecordKey(collection, *parts)

                def entry(*sort: str, partition: tuple[str, ...] = partition, index: StorageIndexName = index) -> StorageIndexEntry:
                    return StorageIndexEntry(index, partition, sort)

                restating = [key(*partition, *sort) for sort in (("01",), ("02",), ("03",), ("04", "x"), ("05",))]
                written = [(k, k.parts[len(partition) :]) for k in restating]
                written += [
                    (key(*partition, "06"), ("03",)),  # same collection and range, another sort: ties with 03
                    (scope.key(index.value, "elsewhere"), ("02",)),  # another collection
                    (key(*partition, "04", "x", "y"), ("04", "x", "y")),  # restating, one component longer
                ]
                await _create(
                    driver,
                    *(_record(k, {"n": n}, entry(*sort)) for n, (k, sort) in enumerate(written)),
                    _record(key(*partition, "07"), {}),  # in the key range, no entry
                    _record(key(*partition, "08"), {}, StorageIndexEntry(_INDEX, partition, ("08",))),
                    _record(key(env, "r1", "02"), {}, entry("02", partition=(env, "r1"))),  # neighbouring partition
                    _record(key(env, "r", "09"), {}, entry("09", index=_OTHER_INDEX)),  # another index name
                )

                async def check(what: str, expected_rows: list[tuple[StorageRecordKey, tuple[str, ...]]]) -> None:
                    for direction in (_ASC, _DESC):
                        expected = _ordered(expected_rows, direction)
                        for page in (1, 2, limit):
                            query = StorageQuery(index, partition, direction=direction, limit=page)
                            got = await _query_all(driver, query)
                            assert got == expected, (
                                f"{index} {what} {direction} in pages of {page}:\n"
                                f" got      {_describe(got)}\n expected {_describe(expected)}"
                            )
                        low, high = encode_storage_tuple(("02",)), encode_storage_tuple(("04", "x"))
                        bounded = StorageQuery(
                            index, partition, range=StorageRange(gt=low, lte=high), direction=direction, limit=2
                        )
                        got = await _query_all(driver, bounded)
                        wanted = [item for item in expected if low < encode_storage_tuple(item[1]) <= high]
                        assert got == wanted, f"{index} {what} {direction} in (02, 04/x]: {_describe(got)}"
                    if self.supports_exclusive_candidates:
                        held = await self._select_exclusive(driver, StorageQuery(index, partition, limit=3))
                        first = [k for k, _ in _ordered(expected_rows)[:3]]
                        assert held == first, f"{index} {what}: an exclusive page got {held}, expected {first}"

                await check("as written", written)

                async def rewrite(tx: Any) -> None:
                    current = await tx.get([restating[1], restating[2], written[5][0]])
                    # The 02 record's entry stops restating its key, the 03 record loses it, and the
                    # record that did not restate its key now does.
                    tx.replace(current[0], _record(restating[1], {}, entry("00")))
                    tx.replace(current[1], _record(restating[2], {}))
                    tx.replace(current[2], _record(written[5][0], {}, entry("06")))

                await driver.with_transaction(rewrite)
                rows: list[tuple[StorageRecordKey, tuple[str, ...]]] = [
                    (restating[1], ("00",)),
                    (written[5][0], ("06",)),
                ]
                rows += [item for item in written if item[0] not in (restating[1], restating[2], written[5][0])]
                await check("after replacing", rows)

                async def delete(tx: Any) -> None:
                    for current in await tx.get([restating[0], restating[1], written[5][0]]):
                        tx.delete(current)

                await driver.with_transaction(delete)
                rows = [item for item in rows if item[0] not in (restating[0], restating[1], written[5][0])]
                await check("after deleting", rows)

        self.run_async(body, driver)

    # =============================================================================================
    # Limits

    def test_point_read_limit(self, driver: StorageDriver) -> None:
        """get() of max_point_reads keys works; one more is a StorageLimitError, in and out of attempts."""

        async def body() -> None:
            scope = _Scope()
            limit = driver.profile.limits.max_point_reads
            keys = [scope.key(f"k{n}") for n in range(limit + 1)]
            assert await driver.get(keys[:limit]) == [None] * limit, "a get() at exactly max_point_reads must succeed"
            await _expect_limit(driver.get(keys), "max_point_reads", what="get() of max_point_reads + 1 keys")
            marker = scope.key("marker")

            async def attempt(tx: Any) -> None:
                await tx.get(keys)
                tx.create(_record(marker, {}))

            await _expect_limit(
                driver.with_transaction(attempt),
                "max_point_reads",
                "max_transaction_records",
                what="transaction get() over the limit",
            )
            assert await _get_one(driver, marker) is None

        self.run_async(body, driver)

    def test_query_limit(self, driver: StorageDriver) -> None:
        """A query limit above max_query_results is a StorageLimitError for query() and query_candidates()."""

        async def body() -> None:
            scope = _Scope()
            maximum = driver.profile.limits.max_query_results
            await _create(driver, _record(scope.key("k"), {}, _entry(scope.partition(), "a")))
            ok = await driver.query(StorageQuery(_INDEX, scope.partition(), limit=maximum))
            assert len(ok.items) == 1
            too_big = StorageQuery(_INDEX, scope.partition(), limit=maximum + 1)
            await _expect_limit(driver.query(too_big), "max_query_results", what="query() above max_query_results")
            marker = scope.key("marker")

            async def attempt(tx: Any) -> None:
                await tx.query_candidates(too_big)
                tx.create(_record(marker, {}))

            await _expect_limit(
                driver.with_transaction(attempt), "max_query_results", what="query_candidates() above max_query_results"
            )
            assert await _get_one(driver, marker) is None

        self.run_async(body, driver)

    def test_record_size_limit(self, driver: StorageDriver) -> None:
        """A record of exactly max_record_bytes commits; one byte more fails on create and replace, writing nothing."""

        async def body() -> None:
            scope = _Scope()
            maximum = driver.profile.limits.max_record_bytes
            key, companion = scope.key("big"), scope.key("companion")
            entry = _entry(scope.partition(), "s")
            await _create(driver, _sized_record(key, maximum, entry))
            stored = await _get_one(driver, key)
            assert stored is not None and measure_storage_record(stored) == maximum

            async def create_oversized(tx: Any) -> None:
                tx.create(_record(companion, {}))
                tx.create(_sized_record(scope.key("bigger"), maximum + 1, entry))

            await _expect_limit(
                driver.with_transaction(create_oversized), "max_record_bytes", what="create() of max_record_bytes + 1"
            )
            assert await driver.get([companion, scope.key("bigger")]) == [None, None], (
                "a rejected attempt wrote something"
            )

            async def replace_oversized(tx: Any) -> None:
                [current] = await tx.get([key])
                tx.create(_record(companion, {}))
                tx.replace(current, _sized_record(key, maximum + 1, entry))

            await _expect_limit(
                driver.with_transaction(replace_oversized),
                "max_record_bytes",
                what="replace() with max_record_bytes + 1",
            )
            assert await driver.get([key, companion]) == [stored, None], "a rejected replacement changed state"

        self.run_async(body, driver)

    def test_transaction_record_limit(self, driver: StorageDriver) -> None:
        """max_transaction_records mutations commit; one more fails and commits none of them."""

        async def body() -> None:
            scope = _Scope()
            maximum = driver.profile.limits.max_transaction_records
            fits = [_record(scope.key("fits", str(n)), {}) for n in range(maximum)]
            await _create_in_one(driver, *fits)
            assert all(record is not None for record in await _get_many(driver, [r.key for r in fits])), (
                "a transaction of exactly max_transaction_records records must commit"
            )
            over = [_record(scope.key("over", str(n)), {}) for n in range(maximum + 1)]
            await _expect_limit(
                _create_in_one(driver, *over), "max_transaction_records", what="max_transaction_records + 1 creates"
            )
            found = await _get_many(driver, [r.key for r in over])
            assert all(record is None for record in found), (
                "a transaction over the record limit committed part of its work"
            )

        self.run_async(body, driver)

    def test_point_reads_count_toward_the_transaction_record_limit(self, driver: StorageDriver) -> None:
        """The records an attempt read (present or absent) count toward max_transaction_records together
        with the ones it writes: at the limit it commits, one over it fails and commits nothing."""

        async def body() -> None:
            scope = _Scope()
            limits = driver.profile.limits
            maximum = limits.max_transaction_records
            reads = max(1, min(limits.max_point_reads, maximum) // 2)
            read_keys = [scope.key("read", str(n)) for n in range(reads)]

            def attempt(name: str, writes: int) -> Callable[[Any], Awaitable[None]]:
                async def run(tx: Any) -> None:
                    await tx.get(read_keys)
                    for n in range(writes):
                        tx.create(_record(scope.key(name, str(n)), {}))

                return run

            await driver.with_transaction(attempt("fits", maximum - reads))
            fitted = await _get_many(driver, [scope.key("fits", str(n)) for n in range(maximum - reads)])
            assert all(record is not None for record in fitted), (
                "reads plus writes of exactly max_transaction_records must commit"
            )
            await _expect_limit(
                driver.with_transaction(attempt("over", maximum - reads + 1)),
                "max_transaction_records",
                what=f"{reads} reads and {maximum - reads + 1} creates",
            )
            found = await _get_many(driver, [scope.key("over", str(n)) for n in range(maximum - reads + 1)])
            assert all(record is None for record in found), "a transaction over the record limit committed a write"

        self.run_async(body, driver)

    def test_transaction_byte_limit(self, driver: StorageDriver) -> None:
        """Records totalling exactly max_transaction_bytes commit; one byte more fails and commits nothing."""

        async def body() -> None:
            scope = _Scope()
            limits = driver.profile.limits

            def batch(name: str, total: int) -> list[NewStorageRecord] | None:
                count = -(-total // limits.max_record_bytes)
                if count > limits.max_transaction_records:
                    return None
                sizes = [total // count + (1 if n < total % count else 0) for n in range(count)]
                return [_sized_record(scope.key(name, f"{n:04d}"), size) for n, size in enumerate(sizes)]

            exact = batch("exact", limits.max_transaction_bytes)
            assert exact is not None
            await _create_in_one(driver, *exact)
            assert all(r is not None for r in await _get_many(driver, [r.key for r in exact])), (
                "a transaction of exactly max_transaction_bytes must commit"
            )
            over = batch("over", limits.max_transaction_bytes + 1)
            if over is None:
                pytest.skip(
                    "these limits cannot exceed max_transaction_bytes without exceeding max_transaction_records"
                )
            await _expect_limit(
                _create_in_one(driver, *over), "max_transaction_bytes", what="max_transaction_bytes + 1 bytes"
            )
            assert all(r is None for r in await _get_many(driver, [r.key for r in over])), (
                "a transaction over the byte limit committed part of its work"
            )

        self.run_async(body, driver)

    # =============================================================================================
    # Operator reads

    def _operator(self, driver: StorageDriver) -> OperatorReadDriver:
        self._require("supports_operator_reads")
        assert supports_operator_reads(driver), (
            "supports_operator_reads is on, but the driver has no operator read methods"
        )
        return driver

    async def _write_operator_data(self, driver: StorageDriver, data: _OperatorData) -> None:
        records = [_run_record(run) for run in data.runs] + [_event_record(event) for event in data.events]
        records.append(_run_record(data.foreign_run))
        records.extend(_event_record(event) for event in _events(data.foreign_run, (0, 1, 2)))
        chunk = max(1, min(driver.profile.limits.max_transaction_records, 20))
        for start in range(0, len(records), chunk):
            await _create(driver, *records[start : start + chunk])

    async def _list_runs_all(self, reads: OperatorReadDriver, filter: RunFilter, limit: int | None) -> list[Any]:
        collected: list[Any] = []
        cursor = None
        for _ in range(_MAX_PAGES):
            page = await reads.list_runs(filter, PaginationParams(limit=limit, cursor=cursor))
            assert limit is None or len(page.data) <= limit, f"a page of limit {limit} returned {len(page.data)} runs"
            collected.extend(page.data)
            if page.next_cursor is None:
                return collected
            cursor = page.next_cursor
        raise AssertionError("run list pagination did not end")

    async def _list_events_all(self, reads: OperatorReadDriver, filter: RunEventFilter, limit: int | None) -> list[Any]:
        collected: list[Any] = []
        cursor = None
        for _ in range(_MAX_PAGES):
            page = await reads.list_run_events(filter, PaginationParams(limit=limit, cursor=cursor))
            assert limit is None or len(page.data) <= limit, f"a page of limit {limit} returned {len(page.data)} events"
            collected.extend(page.data)
            if page.next_cursor is None:
                return collected
            cursor = page.next_cursor
        raise AssertionError("run event pagination did not end")

    def test_operator_get_run_returns_exactly_what_was_written(self, driver: StorageDriver) -> None:
        """get_run() returns the canonical run document's RunRecord, scoped by environment."""
        reads = self._operator(driver)

        async def body() -> None:
            data = _operator_data(_Scope())
            await self._write_operator_data(driver, data)
            for run in data.runs:
                got = await reads.get_run(run.environment, run.id)
                assert got == run, (
                    f"get_run({run.id!r}) differs from the written run:\n got      {got!r}\n expected {run!r}"
                )
            assert await reads.get_run(data.scope.environment, "run-missing") is None
            assert await reads.get_run(data.foreign_run.environment, "run-b") == data.foreign_run
            assert await reads.get_run(data.foreign_run.environment, "run-c") is None, (
                "get_run() leaked across environments"
            )

        self.run_async(body, driver)

    def test_operator_list_runs_filters_sorts_and_pages(self, driver: StorageDriver) -> None:
        """list_runs() matches the shared filter and ordering rules for every sort field and direction,
        page by page."""
        reads = self._operator(driver)

        async def body() -> None:
            data = _operator_data(_Scope())
            await self._write_operator_data(driver, data)
            env = data.scope.environment
            filters: dict[str, dict[str, Any]] = {
                "all": {},
                "statuses": {"statuses": (RunStatus.QUEUED, RunStatus.SCHEDULED)},
                "task ids": {"task_ids": (_ALPHA,)},
                "queues": {"queues": ("fast",)},
                "created_at": {"created_at": TimeRange(start=_at(5), end=_at(15))},
                "updated_at": {"updated_at": TimeRange(start=_at(9))},
                "run_at": {"run_at": TimeRange(end=_at(30))},
                "idempotency key": {"idempotency_key": "idem-1"},
                "singleton key": {"singleton_key": "single-1"},
                "source run": {"source_run_id": "run-c"},
                "combined": {"statuses": (RunStatus.QUEUED, RunStatus.RUNNING), "task_ids": (_ALPHA, _BETA)},
                "nothing": {"task_ids": ("conformance.none",)},
            }
            for name, fields in filters.items():
                for sort_by in tuple(RunSortField):
                    for direction in (_ASC, _DESC):
                        filter = RunFilter(environment=env, sort_by=sort_by, sort_direction=direction, **fields)
                        expected = [run.to_summary() for run in _expected_runs(data.runs, filter)]
                        for limit in (None, 2):
                            got = await self._list_runs_all(reads, filter, limit)
                            assert got == expected, (
                                f"list_runs {name} by {sort_by} {direction} (limit {limit}):\n"
                                f" got      {[s.id for s in got]}\n expected {[s.id for s in expected]}"
                            )

        self.run_async(body, driver)

    def test_operator_list_run_events_filters_sorts_and_pages(self, driver: StorageDriver) -> None:
        """list_run_events() matches the shared rules for one run and for a whole environment."""
        reads = self._operator(driver)

        async def body() -> None:
            data = _operator_data(_Scope())
            await self._write_operator_data(driver, data)
            env = data.scope.environment
            filters: dict[str, dict[str, Any]] = {
                "one run by sequence": {"run_id": "run-b", "sort_by": RunEventSortField.SEQUENCE},
                "one run by time": {"run_id": "run-e"},
                "one run, types": {"run_id": "run-e", "types": (RunEventType.STARTED, RunEventType.CREATED)},
                "environment": {},
                "environment, types": {"types": (RunEventType.DELIVERY_REQUESTED,)},
                "environment, occurred_at": {"occurred_at": TimeRange(start=_at(5), end=_at(11))},
                "missing run": {"run_id": "run-missing"},
            }
            for name, fields in filters.items():
                for direction in (_ASC, _DESC):
                    filter = RunEventFilter(environment=env, sort_direction=direction, **fields)
                    expected = _expected_events(data.events, filter)
                    for limit in (None, 2):
                        got = await self._list_events_all(reads, filter, limit)
                        assert got == expected, (
                            f"list_run_events {name} {direction} (limit {limit}):\n"
                            f" got      {[(e.event.run_id, e.sequence) for e in got]}\n"
                            f" expected {[(e.event.run_id, e.sequence) for e in expected]}"
                        )

        self.run_async(body, driver)

    def test_operator_cursor_from_another_filter_is_rejected(self, driver: StorageDriver) -> None:
        """An operator cursor only continues the filter and sort that produced it."""
        reads = self._operator(driver)

        async def body() -> None:
            data = _operator_data(_Scope())
            await self._write_operator_data(driver, data)
            env = data.scope.environment
            runs_filter = RunFilter(environment=env, sort_by=RunSortField.CREATED_AT, sort_direction=_ASC)
            run_cursor = (await reads.list_runs(runs_filter, PaginationParams(limit=1))).next_cursor
            assert run_cursor is not None, "a partial run page must return a cursor"
            events_filter = RunEventFilter(environment=env, run_id="run-b")
            event_cursor = (await reads.list_run_events(events_filter, PaginationParams(limit=1))).next_cursor
            assert event_cursor is not None, "a partial event page must return a cursor"
            other_runs = {
                "statuses": RunFilter(environment=env, statuses=(RunStatus.QUEUED,), sort_direction=_ASC),
                "sort field": RunFilter(environment=env, sort_by=RunSortField.UPDATED_AT, sort_direction=_ASC),
                "direction": RunFilter(environment=env, sort_direction=_DESC),
                "environment": RunFilter(environment=data.foreign_run.environment, sort_direction=_ASC),
            }
            for name, filter in other_runs.items():
                await _expect_error(
                    reads.list_runs(filter, PaginationParams(limit=1, cursor=run_cursor)),
                    ErrorCode.VALIDATION_FAILED,
                    what=f"run cursor reused with another {name}",
                )
            await _expect_error(
                reads.list_runs(runs_filter, PaginationParams(limit=1, cursor=event_cursor)),
                ErrorCode.VALIDATION_FAILED,
                what="an event cursor used for a run list",
            )
            await _expect_error(
                reads.list_run_events(
                    RunEventFilter(environment=env, run_id="run-e"), PaginationParams(limit=1, cursor=event_cursor)
                ),
                ErrorCode.VALIDATION_FAILED,
                what="an event cursor reused for another run",
            )
            await _expect_error(
                reads.list_run_events(events_filter, PaginationParams(limit=1, cursor=run_cursor)),
                ErrorCode.VALIDATION_FAILED,
                what="a run cursor used for an event list",
            )
            for bad in ("not-a-cursor", run_cursor[:-3]):
                await _expect_error(
                    reads.list_runs(runs_filter, PaginationParams(limit=1, cursor=bad)),
                    ErrorCode.VALIDATION_FAILED,
                    what=f"malformed cursor {bad!r}",
                )
            page = await reads.list_runs(runs_filter, PaginationParams(limit=1, cursor=run_cursor))
            assert [s.id for s in page.data] == [_expected_runs(data.runs, runs_filter)[1].id], (
                "the cursor no longer continues its own list"
            )

        self.run_async(body, driver)

    def test_operator_tombstone_hides_the_run_and_its_events_in_the_same_commit(self, driver: StorageDriver) -> None:
        """Creating the run's tombstone record removes it and its events from every operator read at
        once; a rolled-back tombstone changes nothing; the raw records stay for later cleanup."""
        reads = self._operator(driver)

        async def body() -> None:
            data = _operator_data(_Scope())
            await self._write_operator_data(driver, data)
            env, env_key = data.scope.environment, data.scope.env_key
            victim = next(run for run in data.runs if run.id == "run-e")
            all_events = RunEventFilter(environment=env)

            async def abandoned(tx: Any) -> None:
                tx.create(_tombstone_record(victim, _at(100)))
                raise _Rollback()

            with contextlib.suppress(_Rollback):
                await driver.with_transaction(abandoned)
            assert await reads.get_run(env, victim.id) == victim, "a rolled-back tombstone hid the run"

            survivor = next(run for run in data.runs if run.id == "run-b")
            updated = survivor.model_copy(update={"status": RunStatus.CANCELLED, "updated_at": _at(101)})

            async def tombstone(tx: Any) -> None:
                [current] = await tx.get([run_key(env_key, survivor.id)])
                tx.create(_tombstone_record(victim, _at(100)))
                tx.replace(current, _run_record(updated))

            await driver.with_transaction(tombstone)
            assert await reads.get_run(env, victim.id) is None, "get_run() still returns a tombstoned run"
            listed = await self._list_runs_all(reads, RunFilter(environment=env), None)
            assert victim.id not in [s.id for s in listed], "list_runs() still lists a tombstoned run"
            remaining = [updated if run.id == survivor.id else run for run in data.runs if run.id != victim.id]
            assert listed == [run.to_summary() for run in _expected_runs(remaining, RunFilter(environment=env))], (
                "the same commit's run update is not visible together with the tombstone"
            )
            assert await self._list_events_all(reads, RunEventFilter(environment=env, run_id=victim.id), None) == [], (
                "list_run_events() still returns a tombstoned run's events"
            )
            env_events = await self._list_events_all(reads, all_events, None)
            assert env_events == _expected_events(
                [e for e in data.events if e.event.run_id != victim.id], all_events
            ), "environment-wide events still include a tombstoned run, or lost another run's events"
            raw = await driver.get([run_key(env_key, victim.id), run_event_key(env_key, victim.id, 1)])
            assert all(record is not None for record in raw), (
                "tombstoning must not remove raw records (cleanup does that later)"
            )

        self.run_async(body, driver)

    def test_operator_reads_ignore_non_canonical_documents(self, driver: StorageDriver) -> None:
        """Records in the run and event collections that do not decode stay raw and are never projected."""
        reads = self._operator(driver)

        async def body() -> None:
            data = _operator_data(_Scope())
            await self._write_operator_data(driver, data)
            env, env_key = data.scope.environment, data.scope.env_key
            odd = [
                NewStorageRecord(run_key(env_key, "run-opaque"), StorageDocument.encode({"hello": "world"})),
                NewStorageRecord(
                    run_key(env_key, "run-partial"),
                    StorageDocument.encode({"run": {"id": "run-partial"}, "children": {}}),
                ),
                NewStorageRecord(run_event_key(env_key, "run-b", 9), StorageDocument.encode({"not": "an event"})),
                NewStorageRecord(run_event_key(env_key, "run-opaque", 1), StorageDocument.encode({"sequence": "one"})),
            ]
            await _create(driver, *odd)
            for run_id in ("run-opaque", "run-partial"):
                assert await reads.get_run(env, run_id) is None, (
                    f"get_run() projected the non-canonical document {run_id!r}"
                )
            listed = await self._list_runs_all(reads, RunFilter(environment=env), None)
            assert listed == [run.to_summary() for run in _expected_runs(data.runs, RunFilter(environment=env))], (
                f"list_runs() changed after non-canonical records were written: {[s.id for s in listed]}"
            )
            events = await self._list_events_all(reads, RunEventFilter(environment=env), None)
            assert events == _expected_events(data.events, RunEventFilter(environment=env)), (
                "a non-canonical event was projected"
            )
            raw = await driver.get([record.key for record in odd])
            assert [r.document for r in raw if r is not None] == [r.document for r in odd], (
                "non-canonical documents must stay readable raw"
            )

        self.run_async(body, driver)

    def test_operator_projection_follows_replace_delete_and_rollback(self, driver: StorageDriver) -> None:
        """Operator reads change exactly with committed run writes and never with rolled-back ones."""
        reads = self._operator(driver)

        async def body() -> None:
            data = _operator_data(_Scope())
            await self._write_operator_data(driver, data)
            env, env_key = data.scope.environment, data.scope.env_key
            run = next(r for r in data.runs if r.id == "run-d")
            running = run.model_copy(update={"status": RunStatus.RUNNING, "updated_at": _at(30), "started_at": _at(30)})
            newcomer = _run(env, "run-new", RunStatus.QUEUED, 40)

            async def rolled_back(tx: Any) -> None:
                [current] = await tx.get([run_key(env_key, run.id)])
                tx.replace(current, _run_record(running))
                tx.create(_run_record(newcomer))
                raise _Rollback()

            with contextlib.suppress(_Rollback):
                await driver.with_transaction(rolled_back)
            assert await reads.get_run(env, run.id) == run, "a rolled-back replace changed the operator view"
            assert await reads.get_run(env, newcomer.id) is None, "a rolled-back create is visible to operator reads"

            async def replace(tx: Any) -> None:
                [current] = await tx.get([run_key(env_key, run.id)])
                tx.replace(current, _run_record(running))
                tx.create(_run_record(newcomer))

            await driver.with_transaction(replace)
            assert await reads.get_run(env, run.id) == running
            assert await reads.get_run(env, newcomer.id) == newcomer
            queued = await self._list_runs_all(reads, RunFilter(environment=env, statuses=(RunStatus.QUEUED,)), None)
            assert run.id not in [s.id for s in queued] and newcomer.id in [s.id for s in queued], (
                "list_runs() status filtering does not follow the replacement"
            )

            async def delete(tx: Any) -> None:
                [current] = await tx.get([run_key(env_key, newcomer.id)])
                tx.delete(current)

            await driver.with_transaction(delete)
            assert await reads.get_run(env, newcomer.id) is None, "a deleted run is still visible"
            everything = await self._list_runs_all(reads, RunFilter(environment=env), None)
            assert newcomer.id not in [s.id for s in everything]

        self.run_async(body, driver)

    def test_operator_results_are_defensive_copies(self, driver: StorageDriver) -> None:
        """Mutating returned runs, summaries, events, pages and nested values never changes later reads."""
        reads = self._operator(driver)

        async def body() -> None:
            data = _operator_data(_Scope())
            await self._write_operator_data(driver, data)
            env = data.scope.environment
            original = next(r for r in data.runs if r.id == "run-b")
            # The casts restate what _operator_data wrote (run-b has meta and starts with run.created, run-f
            # has a failure); they check nothing, so a driver that lost a value fails at its lookup.
            run = cast(RunRecord, await reads.get_run(env, "run-b"))
            run.payload["nested"]["list"].append("mutated")
            cast(dict[str, Any], run.meta)["m"]["x"] = "mutated"
            failed = cast(RunRecord, await reads.get_run(env, "run-f"))
            cast(RunFailure, failed.failure).meta["detail"]["a"] = "mutated"
            page = await reads.list_runs(RunFilter(environment=env, statuses=(RunStatus.FAILED,)), PaginationParams())
            cast(RunFailure, page.data[0].failure).meta["detail"]["b"] = 2
            page.data.clear()
            events = await reads.list_run_events(RunEventFilter(environment=env, run_id="run-b"), PaginationParams())
            cast(RunCreatedEvent, events.data[0].event).payload["seq"].append("mutated")
            cast(dict[str, Any], events.data[2].event.meta)["note"]["depth"].clear()
            events.data.reverse()
            assert await reads.get_run(env, "run-b") == original, "a returned run shares nested values with the store"
            assert await reads.get_run(env, "run-f") == next(r for r in data.runs if r.id == "run-f")
            again = await reads.list_runs(RunFilter(environment=env, statuses=(RunStatus.FAILED,)), PaginationParams())
            assert [cast(RunFailure, s.failure).meta for s in again.data] == [{"detail": {"a": 1}}], (
                "a returned summary shares nested values"
            )
            again_events = await reads.list_run_events(
                RunEventFilter(environment=env, run_id="run-b"), PaginationParams()
            )
            assert again_events.data == [e for e in data.events if e.event.run_id == "run-b"], (
                "a returned event shares nested values"
            )

        self.run_async(body, driver)

    # =============================================================================================
    # Ordered append

    def test_append_assigns_contiguous_positions_after_previous_batches(self, driver: StorageDriver) -> None:
        """Each batch gets contiguous positive u64 decimal positions right after the previous batch,
        with the canonical head, records, keys and index rows; partitions are independent."""
        self._require("supports_append")

        async def body() -> None:
            scope = _Scope()
            stream, other = scope.stream(), scope.stream("other")
            batches = {"first": 3, "second": 1, "third": 2}
            for name, count in batches.items():

                async def attempt(tx: Any, name: str = name, count: int = count) -> str:
                    tx.append(StorageAppendCommand(_STREAM, stream, _batch(name, count)))
                    return name

                assert await driver.with_transaction(attempt) == name

            async def other_attempt(tx: Any) -> None:
                tx.append(StorageAppendCommand(_STREAM, other, _batch("elsewhere", 2)))

            await driver.with_transaction(other_attempt)
            next_position, records = await _read_stream(driver, stream)
            _assert_contiguous(next_position, records)
            assert [value["batch"] for _, value in records] == ["first"] * 3 + ["second"] + ["third"] * 2, (
                "batches out of commit order"
            )
            _assert_batches(records, batches)
            other_next, other_records = await _read_stream(driver, other)
            _assert_contiguous(other_next, other_records)
            assert [value for _, value in other_records] == _batch("elsewhere", 2)

        self.run_async(body, driver)

    def test_append_rejects_values_carrying_the_position_field(self, driver: StorageDriver) -> None:
        """Storage assigns positions: a value with the stream's position field is rejected, nothing written."""
        self._require("supports_append")

        async def body() -> None:
            scope = _Scope()
            stream, marker = scope.stream(), scope.key("marker")

            async def attempt(tx: Any) -> None:
                tx.create(_record(marker, {}))
                tx.append(StorageAppendCommand(_STREAM, stream, [{"ok": 1}, {_LAYOUT.position_field: "7"}]))

            await _expect_error(
                driver.with_transaction(attempt), _CONTRACT, what="append() of a value with its own position"
            )
            assert await _read_stream(driver, stream) == (None, []), "a rejected append wrote stream records"
            assert await _get_one(driver, marker) is None

        self.run_async(body, driver)

    def test_concurrent_appenders_produce_one_gap_free_sequence(self, driver: StorageDriver) -> None:
        """Concurrent native appends interleave as whole contiguous batches in one gap-free sequence."""
        self._require("supports_append")

        async def body() -> None:
            scope = _Scope()
            stream = scope.stream()
            batches = {f"batch-{n}": 1 + n % 3 for n in range(self.concurrent_writers)}

            async def append(name: str, count: int) -> None:
                async def attempt(tx: Any) -> None:
                    await asyncio.sleep(0)
                    tx.append(StorageAppendCommand(_STREAM, stream, _batch(name, count)))

                await driver.with_transaction(attempt)

            await asyncio.gather(*(append(name, count) for name, count in batches.items()))
            next_position, records = await _read_stream(driver, stream)
            _assert_contiguous(next_position, records)
            _assert_batches(records, batches)

        self.run_async(body, driver)

    def test_rolled_back_or_replayed_appends_consume_no_positions(self, driver: StorageDriver) -> None:
        """An abandoned attempt leaves no records and no gap; a replayed attempt appends its batch once."""
        self._require("supports_append")

        async def body() -> None:
            scope = _Scope()
            stream, guard = scope.stream(), scope.key("guard")
            await _create(driver, _record(guard, {"n": 0}))

            async def abandoned(tx: Any) -> None:
                tx.append(StorageAppendCommand(_STREAM, stream, _batch("abandoned", 3)))
                raise _Rollback()

            with contextlib.suppress(_Rollback):
                await driver.with_transaction(abandoned)
            assert await _read_stream(driver, stream) == (None, []), "a rolled-back append left records or a head"

            async def a(tx: Any, attempt: int, pause: _Pause) -> int:
                [current] = await tx.get([guard])
                await pause()
                tx.replace(current, _record(guard, {"n": current.document.value["n"] + 1}))
                tx.append(StorageAppendCommand(_STREAM, stream, _batch("replayed", 2)))
                return attempt

            async def b(tx: Any, attempt: int) -> None:
                [current] = await tx.get([guard])
                tx.replace(current, _record(guard, {"n": current.document.value["n"] + 10}))
                tx.append(StorageAppendCommand(_STREAM, stream, _batch("competitor", 1)))

            race = await self._interleave(driver, a, driver, b)
            with contextlib.suppress(_Rollback):
                await driver.with_transaction(abandoned)

            async def last(tx: Any) -> None:
                tx.append(StorageAppendCommand(_STREAM, stream, _batch("last", 1)))

            await driver.with_transaction(last)
            next_position, records = await _read_stream(driver, stream)
            _assert_contiguous(next_position, records)
            _assert_batches(records, {"replayed": 2, "competitor": 1, "last": 1})
            if race.b_first:
                assert race.a_attempts == 2, "the conflicting appender should have been replayed once"
                assert [value["batch"] for _, value in records] == ["competitor", "replayed", "replayed", "last"]
            assert await _value_of(driver, guard) == {"n": 11}

        self.run_async(body, driver)

    def test_point_writers_and_native_append_share_one_stream(self, driver: StorageDriver) -> None:
        """Core's point-write fallback and native append use the same head and record layout, in turn."""
        self._require("supports_append")

        async def body() -> None:
            scope = _Scope()
            stream = scope.stream()
            order = [
                ("point-1", 2, "point"),
                ("native-1", 2, "native"),
                ("point-2", 1, "point"),
                ("native-2", 3, "native"),
            ]
            for name, count, kind in order:

                async def attempt(tx: Any, name: str = name, count: int = count, kind: str = kind) -> None:
                    if kind == "point":
                        await _point_append(tx, stream, _batch(name, count))
                    else:
                        tx.append(StorageAppendCommand(_STREAM, stream, _batch(name, count)))

                await driver.with_transaction(attempt)
            next_position, records = await _read_stream(driver, stream)
            _assert_contiguous(next_position, records)
            assert [value["batch"] for _, value in records] == ["point-1"] * 2 + ["native-1"] * 2 + ["point-2"] + [
                "native-2"
            ] * 3
            _assert_batches(records, {name: count for name, count, _ in order})

        self.run_async(body, driver)

    def test_concurrent_mixed_writers_share_one_gap_free_stream(self, driver: StorageDriver) -> None:
        """Concurrent point writers and native appenders protect the head (present and absent) and
        produce one gap-free sequence of whole batches."""
        self._require("supports_append")

        async def body() -> None:
            scope = _Scope()
            stream = scope.stream()
            writers = self.concurrent_writers
            batches = {f"{'point' if n % 2 else 'native'}-{n}": 2 for n in range(writers)}

            async def write(name: str, count: int) -> None:
                async def attempt(tx: Any) -> None:
                    if name.startswith("point"):
                        await _point_append(tx, stream, _batch(name, count), pause=True)
                    else:
                        await asyncio.sleep(0)
                        tx.append(StorageAppendCommand(_STREAM, stream, _batch(name, count)))

                await driver.with_transaction(attempt)

            await asyncio.gather(*(write(name, count) for name, count in batches.items()))
            next_position, records = await _read_stream(driver, stream)
            _assert_contiguous(next_position, records)
            _assert_batches(records, batches)

        self.run_async(body, driver)

    def test_append_near_the_u64_maximum_and_corrupt_heads_fail_without_changing_state(
        self, driver: StorageDriver
    ) -> None:
        """A batch whose next head would pass 2**64 - 1 fails; one that fits exactly commits; a corrupt
        head fails; no failure moves the head, writes records or commits the attempt's other writes."""
        self._require("supports_append")

        async def body() -> None:
            scope = _Scope()
            near, corrupt, marker = scope.stream("near"), scope.stream("corrupt"), scope.key("marker")
            start = MAX_UNSIGNED_64 - 2
            await _create(driver, _LAYOUT.head_record(near, start))
            await _create(
                driver, NewStorageRecord(_LAYOUT.head_key(corrupt), StorageDocument.encode({"next_position": "0"}))
            )
            corrupt_before = await _get_one(driver, _LAYOUT.head_key(corrupt))

            async def append(partition: str, count: int) -> None:
                async def attempt(tx: Any) -> None:
                    tx.create(_record(marker, {}))
                    tx.append(StorageAppendCommand(_STREAM, partition, _batch("b", count)))

                await driver.with_transaction(attempt)

            async def expect_unchanged_failure(partition: str, count: int, what: str) -> None:
                head = await _get_one(driver, _LAYOUT.head_key(partition))
                error = await _expect_error(append(partition, count), ErrorCode.INVARIANT_VIOLATION, what=what)
                assert not error.retryable, f"{what}: an exhausted or corrupt stream is not a retryable conflict"
                assert await _get_one(driver, _LAYOUT.head_key(partition)) == head, f"{what}: the head changed"
                assert await _get_one(driver, marker) is None, f"{what}: the attempt's other writes committed"

            # From MAX - 2, three positions would need a next head of MAX + 1.
            await expect_unchanged_failure(near, 3, "an append whose next head passes 2**64 - 1")
            for position in (start, start + 1, MAX_UNSIGNED_64):
                assert await _get_one(driver, _LAYOUT.record_key(near, position)) is None, (
                    "a failed append wrote a record"
                )
            await append(near, 2)
            for position in (start, start + 1):
                record = await _get_one(driver, _LAYOUT.record_key(near, position))
                assert record is not None and record.document.value[_LAYOUT.position_field] == str(position), (
                    f"expected a record at position {position}, got {record!r}"
                )
            head = await _get_one(driver, _LAYOUT.head_key(near))
            assert read_storage_stream_position(head) == MAX_UNSIGNED_64, (
                "the head after the last position is 2**64 - 1"
            )

            async def drop_marker(tx: Any) -> None:
                [current] = await tx.get([marker])
                tx.delete(current)

            await driver.with_transaction(drop_marker)  # it committed with that append
            await expect_unchanged_failure(near, 1, "an append to an exhausted stream")
            assert await _get_one(driver, _LAYOUT.record_key(near, MAX_UNSIGNED_64)) is None
            await expect_unchanged_failure(corrupt, 1, "an append over a corrupt head")
            assert await _get_one(driver, _LAYOUT.head_key(corrupt)) == corrupt_before, "a corrupt head was overwritten"
            assert await _get_one(driver, _LAYOUT.record_key(corrupt, 1)) is None

        self.run_async(body, driver)

    def test_append_counts_toward_transaction_limits(self, driver: StorageDriver) -> None:
        """The head and every appended record count toward record and byte limits, together with point
        mutations; record size is measured at the widest position."""
        self._require("supports_append")

        async def body() -> None:
            scope = _Scope()
            limits = driver.profile.limits
            stream, marker = scope.stream(), scope.key("marker")

            async def attempt_with(values: list[dict[str, Any]], creates: int = 0) -> None:
                async def attempt(tx: Any) -> None:
                    for n in range(creates):
                        tx.create(_record(scope.key("point", str(n)), {}))
                    tx.create(_record(marker, {}))
                    tx.append(StorageAppendCommand(_STREAM, stream, values))

                await driver.with_transaction(attempt)

            too_many = _batch("many", limits.max_transaction_records)  # + head + marker
            await _expect_limit(
                attempt_with(too_many), "max_transaction_records", what="append over max_transaction_records"
            )
            await _expect_limit(
                attempt_with(_batch("mixed", 1), creates=limits.max_transaction_records - 2),
                "max_transaction_records",
                what="point creates plus an append over max_transaction_records",
            )
            assert await _read_stream(driver, stream) == (None, []) and await _get_one(driver, marker) is None

            def sized_value(size: int) -> dict[str, Any]:
                probe = StorageAppendCommand(_STREAM, stream, [{"pad": ""}])
                base = measure_storage_append(probe)[2][0]
                value = {"pad": "x" * (size - base)}
                assert measure_storage_append(StorageAppendCommand(_STREAM, stream, [value]))[2][0] == size
                return value

            await _expect_limit(
                attempt_with([sized_value(limits.max_record_bytes + 1)]),
                "max_record_bytes",
                what="an appended value over max_record_bytes at the widest position",
            )
            assert await _read_stream(driver, stream) == (None, []) and await _get_one(driver, marker) is None

            largest = StorageAppendCommand(_STREAM, stream, [sized_value(limits.max_record_bytes)])
            if measure_storage_append(largest)[1] > limits.max_transaction_bytes:
                return  # these limits leave no room for a head beside a record of max_record_bytes

            async def fits(tx: Any) -> None:
                tx.append(largest)

            await driver.with_transaction(fits)
            next_position, records = await _read_stream(driver, stream)
            _assert_contiguous(next_position, records)
            assert len(records) == 1, "an appended value of exactly max_record_bytes at the widest position must commit"

        self.run_async(body, driver)

    def test_append_forbids_the_streams_head_and_records_in_the_same_attempt(self, driver: StorageDriver) -> None:
        """An appending attempt cannot read or mutate its partition's head or records, cannot append
        twice, and cannot read after appending; other partitions and keys stay usable."""
        self._require("supports_append")

        async def body() -> None:
            scope = _Scope()
            stream, other, marker = scope.stream(), scope.stream("other"), scope.key("marker")

            async def seed(tx: Any) -> None:
                tx.append(StorageAppendCommand(_STREAM, stream, _batch("seed", 1)))

            await driver.with_transaction(seed)
            command = StorageAppendCommand(_STREAM, stream, _batch("x", 1))
            head_key, record_key = _LAYOUT.head_key(stream), _LAYOUT.record_key(stream, 1)

            async def read_head_then_append(tx: Any) -> None:
                await tx.get([head_key])
                tx.create(_record(marker, {}))
                tx.append(command)

            async def read_record_then_append(tx: Any) -> None:
                await tx.get([record_key, marker])
                tx.create(_record(marker, {}))
                tx.append(command)

            async def create_head_then_append(tx: Any) -> None:
                tx.create(_record(marker, {}))
                tx.create(_LAYOUT.head_record(stream, 5))
                tx.append(command)

            async def create_record_then_append(tx: Any) -> None:
                tx.create(_record(marker, {}))
                tx.create(_LAYOUT.stream_record(stream, 9, {"sneaky": True}))
                tx.append(command)

            async def append_then_create_head(tx: Any) -> None:
                tx.create(_record(marker, {}))
                tx.append(command)
                tx.create(_LAYOUT.head_record(stream, 5))

            async def append_then_create_record(tx: Any) -> None:
                tx.append(command)
                tx.create(_record(marker, {}))
                tx.create(_LAYOUT.stream_record(stream, 2, {"sneaky": True}))

            async def append_twice(tx: Any) -> None:
                tx.create(_record(marker, {}))
                tx.append(command)
                tx.append(StorageAppendCommand(_STREAM, other, _batch("y", 1)))

            async def append_then_get(tx: Any) -> None:
                tx.append(command)
                await tx.get([marker])
                tx.create(_record(marker, {}))

            async def append_then_query(tx: Any) -> None:
                tx.append(command)
                await tx.query_candidates(StorageQuery(_INDEX, scope.partition(), limit=1))
                tx.create(_record(marker, {}))

            cases = {
                "read the head, then append": read_head_then_append,
                "read a record, then append": read_record_then_append,
                "create the head, then append": create_head_then_append,
                "create a record, then append": create_record_then_append,
                "append, then create the head": append_then_create_head,
                "append, then create a record": append_then_create_record,
                "two appends in one attempt": append_twice,
                "append, then get()": append_then_get,
                "append, then query_candidates()": append_then_query,
            }
            for what, callback in cases.items():
                await _expect_error(driver.with_transaction(callback), _CONTRACT, what=what)
                next_position, records = await _read_stream(driver, stream)
                assert (next_position, [v["batch"] for _, v in records]) == (2, ["seed"]), f"{what}: the stream changed"
                assert await _get_one(driver, marker) is None, f"{what}: another write of the attempt committed"
                assert await _read_stream(driver, other) == (None, []), f"{what}: the other partition changed"

            async def allowed(tx: Any) -> None:
                assert await tx.get([_LAYOUT.head_key(other), marker]) == [None, None]
                tx.create(_record(marker, {"with": "append"}))
                tx.append(command)

            await driver.with_transaction(allowed)
            next_position, records = await _read_stream(driver, stream)
            assert (next_position, [v["batch"] for _, v in records]) == (3, ["seed", "x"]), (
                "an allowed append did not commit"
            )
            assert await _value_of(driver, marker) == {"with": "append"}, (
                "the point write did not commit with the append"
            )

        self.run_async(body, driver)

    # =============================================================================================
    # Exclusive candidates

    async def _exclusive_rows(self, driver: StorageDriver, scope: _Scope, count: int) -> list[StorageRecordKey]:
        keys = [scope.key(f"c{n:02d}") for n in range(count)]
        await _create(
            driver, *(_record(key, {"n": n}, _entry(scope.partition(), f"{n:02d}")) for n, key in enumerate(keys))
        )
        return keys

    def test_exclusive_selections_are_disjoint_across_instances(
        self, driver: StorageDriver, peer_driver: StorageDriver
    ) -> None:
        """While one instance's attempt holds candidates, the other instance's exclusive selection
        skips exactly those records, in either direction."""
        self._require("supports_exclusive_candidates")

        async def body() -> None:
            scope = _Scope()
            keys = await self._exclusive_rows(driver, scope, 8)
            limit = self._page_limit(driver)
            first = await self._hold(driver, StorageQuery(_INDEX, scope.partition(), limit=3))
            held = first.selected.result()
            assert held == keys[:3], f"an exclusive page follows query order: got {held}"
            try:
                peer = await self._select_exclusive(peer_driver, StorageQuery(_INDEX, scope.partition(), limit=limit))
                assert not set(peer) & set(held), (
                    f"the peer instance selected records another attempt holds: {set(peer) & set(held)}"
                )
                assert peer == keys[3:], f"the peer should get every free record in order, got {peer}"
                descending = await self._select_exclusive(
                    peer_driver, StorageQuery(_INDEX, scope.partition(), direction=_DESC, limit=2)
                )
                assert descending == [keys[7], keys[6]], f"exclusive DESC selection returned {descending}"
                same_instance = await self._select_exclusive(
                    driver, StorageQuery(_INDEX, scope.partition(), limit=limit)
                )
                assert same_instance == keys[3:], "another attempt on the same instance must also skip held records"
            finally:
                await first.finish()

        self.run_async(body, driver, peer_driver)

    def test_exclusive_holds_last_until_the_attempt_commits(
        self, driver: StorageDriver, peer_driver: StorageDriver
    ) -> None:
        """Held records stay unavailable until the holder commits, then become selectable again."""
        self._require("supports_exclusive_candidates")

        async def body() -> None:
            scope = _Scope()
            keys = await self._exclusive_rows(driver, scope, 4)
            query = StorageQuery(_INDEX, scope.partition(), limit=self._page_limit(driver))
            holder = await self._hold(driver, StorageQuery(_INDEX, scope.partition(), limit=2))
            for _ in range(3):
                again = await self._select_exclusive(peer_driver, query)
                assert again == keys[2:], f"held records leaked before the holder ended: {again}"
                await asyncio.sleep(0.01)
            await holder.finish()
            assert await self._select_exclusive(peer_driver, query) == keys, (
                "records stayed held after the holder committed"
            )
            assert await self._select_exclusive(driver, query) == keys

        self.run_async(body, driver, peer_driver)

    def test_exclusive_holds_are_released_by_rollback_and_cancellation(
        self, driver: StorageDriver, peer_driver: StorageDriver
    ) -> None:
        """A rolled-back or cancelled holder releases its records."""
        self._require("supports_exclusive_candidates")

        async def body() -> None:
            scope = _Scope()
            keys = await self._exclusive_rows(driver, scope, 4)
            query = StorageQuery(_INDEX, scope.partition(), limit=self._page_limit(driver))
            holder = await self._hold(peer_driver, StorageQuery(_INDEX, scope.partition(), limit=3), rollback=True)
            assert await self._select_exclusive(driver, query) == keys[3:]
            await holder.finish()
            assert await self._select_exclusive(driver, query) == keys, (
                "records stayed held after the holder rolled back"
            )
            cancelled = await self._hold(peer_driver, StorageQuery(_INDEX, scope.partition(), limit=2))
            assert await self._select_exclusive(driver, query) == keys[2:]
            cancelled.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await cancelled.task
            assert await self._select_exclusive(driver, query) == keys, (
                "records stayed held after the holder was cancelled"
            )

        self.run_async(body, driver, peer_driver)

    def test_concurrent_exclusive_selections_are_pairwise_disjoint(
        self, driver: StorageDriver, peer_driver: StorageDriver
    ) -> None:
        """Many attempts on both instances, all open at once, select pairwise-disjoint records."""
        self._require("supports_exclusive_candidates")

        async def body() -> None:
            scope = _Scope()
            selectors = self.concurrent_writers
            keys = await self._exclusive_rows(driver, scope, selectors * 2)
            query = StorageQuery(_INDEX, scope.partition(), limit=2)
            arrived = 0
            everyone = asyncio.Event()

            async def select(instance: StorageDriver) -> list[StorageRecordKey]:
                async def attempt(tx: Any) -> list[StorageRecordKey]:
                    nonlocal arrived
                    result = await tx.query_candidates(query, mode=StorageCandidateMode.EXCLUSIVE)
                    arrived += 1
                    if arrived == selectors:
                        everyone.set()
                    await asyncio.wait_for(everyone.wait(), self.race_wait_seconds * 5)
                    return [ref.key for ref in result.items]

                return await instance.with_transaction(attempt)

            try:
                picks = await asyncio.gather(*(select(driver if n % 2 else peer_driver) for n in range(selectors)))
            except TimeoutError:
                raise AssertionError("concurrent exclusive attempts could not all be open at once") from None
            chosen = [key for pick in picks for key in pick]
            assert len(chosen) == len(set(chosen)), f"concurrent exclusive selections overlap: {picks}"
            assert sorted(chosen, key=lambda key: key.encoded) == keys, "concurrent selections skipped free records"

        self.run_async(body, driver, peer_driver)

    def test_advisory_reads_ignore_exclusive_holds(self, driver: StorageDriver, peer_driver: StorageDriver) -> None:
        """query() and advisory query_candidates() still return held records."""
        self._require("supports_exclusive_candidates")

        async def body() -> None:
            scope = _Scope()
            keys = await self._exclusive_rows(driver, scope, 3)
            query = StorageQuery(_INDEX, scope.partition(), limit=self._page_limit(driver))
            holder = await self._hold(driver, query)
            try:
                assert [key for key, _ in _refs(await peer_driver.query(query))] == keys, "query() skipped held records"

                async def advisory(tx: Any) -> list[StorageRecordKey]:
                    default = await tx.query_candidates(query)
                    explicit = await tx.query_candidates(query, mode=StorageCandidateMode.ADVISORY)
                    assert _refs(default) == _refs(explicit)
                    return [ref.key for ref in default.items]

                assert await peer_driver.with_transaction(advisory) == keys, (
                    "advisory query_candidates() skipped held records"
                )
            finally:
                await holder.finish()

        self.run_async(body, driver, peer_driver)
