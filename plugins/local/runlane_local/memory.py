"""The in-memory reference storage driver.

This driver is the executable reference of the storage contract, kept small enough to read in one
sitting. It is process-local development storage, not durable production storage.

Mechanics:

* **Immutable state.** A store's committed state is one immutable ``_State`` value: records in an
  ``immutables.Map`` keyed by encoded record key, index partitions as copy-on-write ``_SortedRows``,
  the operator projection, and the last issued version. A commit builds the next value and swaps it
  in under a ``threading.Lock``; older values stay valid for whoever still holds them. Records whose
  document carries no decoded value are kept as packed tuples of strings the garbage collector does
  not track (``_pack``), so a large store does not slow down the process's full collections.
* **Attempt snapshots.** Every attempt reads the state captured when it starts. ``get`` records each
  key with the version seen, or ``None`` when absent; the commit replays the attempt when any of those
  dependencies (or a staged create / replace / delete condition) no longer holds.
* **Non-repeating versions.** A store-wide counter issues a fresh positive decimal version to every
  created or replaced record.
* **Ordered append.** The head of a stream partition is read from the committed state during the
  commit, under the lock, so aborted and replayed attempts consume no positions.
* **Exclusive candidates.** The store records which live attempt holds each returned candidate; the
  holds are released when that attempt ends (commit, rollback or replay).
* **Client clock.** ``now()`` samples the injected clock once per attempt and freezes it.
"""

from __future__ import annotations

import asyncio
import threading
from bisect import bisect_left, bisect_right, insort
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from operator import itemgetter
from typing import Any, Protocol, TypeVar

import immutables

from runlane.errors import ErrorCode, RunlaneError, StorageConflictKind, create_storage_conflict_error
from runlane.models import Environment, Page, RunEventRecord, RunRecord, RunSummary, environment_key
from runlane.storage import (
    NewStorageRecord,
    PaginationParams,
    RunEventFilter,
    RunFilter,
    StorageAppendCommand,
    StorageCandidateMode,
    StorageClockAuthority,
    StorageDocument,
    StorageDurability,
    StorageIndexConsistency,
    StorageIndexEntry,
    StorageIndexName,
    StorageLimits,
    StorageProfile,
    StorageQuery,
    StorageQueryResult,
    StorageRecord,
    StorageRecordKey,
    StorageTransaction,
    clamp_page_limit,
    decode_operator_cursor,
    decode_storage_query_cursor,
    decode_storage_tuple,
    encode_operator_cursor,
    encode_storage_unsigned_integer,
    materialize_storage_append,
    read_storage_stream_position,
    run_event_matches_filter,
    run_event_sort_value,
    run_matches_filter,
    run_sort_value,
    storage_stream_layouts,
)
from runlane.storage.attempt import (
    StagedWrite,
    StorageAttempt,
    check_storage_keys,
    contract_violation,
    enforce_storage_limit,
    page_index_rows,
)
from runlane.storage.tables import (
    RUN_EVENTS_COLLECTION,
    RUNS_COLLECTION,
    peek_run_document,
    peek_run_event_document,
    run_tombstone_key,
)
from runlane.vocabulary import PaginationCursorKind, SortDirection

__all__ = ["LocalStorageDriver", "LocalStorageStore", "local_storage_driver"]

T = TypeVar("T")
Row = tuple[str, str]  # one index row: (encoded sort value, encoded record key)
PartitionKey = tuple[str, str]  # (index name, encoded partition)

_EMPTY_MAP: immutables.Map = immutables.Map()


class Clock(Protocol):
    def now(self) -> datetime: ...


class _UtcClock:
    def now(self) -> datetime:
        return datetime.now(UTC)


# ---------------------------------------------------------------------------------------------
# Copy-on-write ordered index partitions

_CHUNK = 128

Position = tuple[int, int]  # (chunk index, offset in chunk); (len(chunks), 0) is the end


class _SortedRows:
    """An immutable ordered sequence of index rows, stored as sorted chunks of at most ``2 * _CHUNK``.

    ``updated`` returns a new value that copies only the chunks a commit touches and the chunk
    directory, so a commit never copies a whole partition and earlier snapshots keep their view.
    Positions are ``(chunk, offset)`` pairs, so nothing is recomputed across all chunks per change.
    """

    __slots__ = ("_chunks", "_lasts")

    def __init__(self, chunks: tuple[tuple[Row, ...], ...] = (), lasts: tuple[Row, ...] | None = None) -> None:
        self._chunks = chunks
        self._lasts = lasts if lasts is not None else tuple(chunk[-1] for chunk in chunks)

    def __bool__(self) -> bool:
        return bool(self._chunks)

    @property
    def end(self) -> Position:
        return (len(self._chunks), 0)

    def bisect(self, target: Any, *, right: bool, key: Callable[[Row], Any] | None = None) -> Position:
        """The insertion point of ``target`` (``bisect_left`` or ``bisect_right`` semantics)."""
        search = bisect_right if right else bisect_left
        chunk = search(self._lasts, target, key=key)
        if chunk == len(self._chunks):
            return self.end
        offset = search(self._chunks[chunk], target, key=key)
        return (chunk, offset) if offset < len(self._chunks[chunk]) else (chunk + 1, 0)

    def between(self, start: Position, stop: Position, *, descending: bool) -> Iterator[Row]:
        """Rows from ``start`` (inclusive) to ``stop`` (exclusive), reversed when ``descending``."""
        if start >= stop:
            return
        chunks = self._chunks
        first_chunk, first_offset = start
        stop_chunk, stop_offset = stop
        if not descending:
            for index in range(first_chunk, min(stop_chunk + 1, len(chunks))):
                rows = chunks[index]
                low = first_offset if index == first_chunk else 0
                high = stop_offset if index == stop_chunk else len(rows)
                yield from rows[low:high]
            return
        for index in range(min(stop_chunk, len(chunks) - 1), first_chunk - 1, -1):
            rows = chunks[index]
            low = first_offset if index == first_chunk else 0
            high = stop_offset if index == stop_chunk else len(rows)
            yield from reversed(rows[low:high])

    def updated(self, removes: list[Row], inserts: list[Row]) -> _SortedRows:
        """``remove`` every row of ``removes``, then ``insert`` every row of ``inserts``, copying each
        touched chunk and the chunk directory once (one commit's changes to one partition)."""
        chunks = self._chunks
        if not chunks:
            if removes:
                raise RunlaneError(ErrorCode.INVARIANT_VIOLATION, "An index row of a stored record is missing.")
            rows = sorted(inserts)
            pieces = tuple(tuple(rows[at : at + _CHUNK]) for at in range(0, len(rows), _CHUNK))
            return _SortedRows(pieces)
        lasts = self._lasts
        last_chunk = len(chunks) - 1
        touched: dict[int, list[Row]] = {}
        # Chunk boundaries stay those of ``self`` while rows move: a chunk only ever holds rows of its
        # original range (or, for the last one, beyond it), so global order holds.
        for row in removes:
            chunk = bisect_left(lasts, row)
            rows = touched.get(chunk)
            if rows is None:
                if chunk > last_chunk:
                    raise RunlaneError(ErrorCode.INVARIANT_VIOLATION, "An index row of a stored record is missing.")
                rows = touched[chunk] = list(chunks[chunk])
            at = bisect_left(rows, row)
            if at == len(rows) or rows[at] != row:
                raise RunlaneError(ErrorCode.INVARIANT_VIOLATION, "An index row of a stored record is missing.")
            del rows[at]
        for row in inserts:
            chunk = min(bisect_left(lasts, row), last_chunk)
            rows = touched.get(chunk)
            if rows is None:
                rows = touched[chunk] = list(chunks[chunk])
            insort(rows, row)
        directory: list[tuple[Row, ...]] = []
        directory_lasts: list[Row] = []
        start = 0
        for chunk in sorted(touched):
            directory.extend(chunks[start:chunk])
            directory_lasts.extend(lasts[start:chunk])
            rows = touched[chunk]
            # An emptied chunk disappears; one grown past 2 * _CHUNK rows splits into _CHUNK-row pieces.
            step = len(rows) if len(rows) <= 2 * _CHUNK else _CHUNK
            for at in range(0, len(rows), step or 1):
                piece = tuple(rows[at : at + step])
                directory.append(piece)
                directory_lasts.append(piece[-1])
            start = chunk + 1
        directory.extend(chunks[start:])
        directory_lasts.extend(lasts[start:])
        return _SortedRows(tuple(directory), tuple(directory_lasts))


_NO_ROWS = _SortedRows()
_sort_of = itemgetter(0)


def _scan(rows: _SortedRows, query: StorageQuery) -> Iterator[Row]:
    """Rows of ``query``'s range in query order, strictly after its cursor position (if any)."""
    bounds = query.range
    start, stop = (0, 0), rows.end
    if bounds.gte is not None:
        start = rows.bisect(bounds.gte, right=False, key=_sort_of)
    elif bounds.gt is not None:
        start = rows.bisect(bounds.gt, right=True, key=_sort_of)
    if bounds.lt is not None:
        stop = rows.bisect(bounds.lt, right=False, key=_sort_of)
    elif bounds.lte is not None:
        stop = rows.bisect(bounds.lte, right=True, key=_sort_of)
    descending = query.direction is SortDirection.DESC
    after = decode_storage_query_cursor(query)
    if after is not None:
        if descending:
            stop = min(stop, rows.bisect((after.sort, after.key), right=False))
        else:
            start = max(start, rows.bisect((after.sort, after.key), right=True))
    return rows.between(start, stop, descending=descending)


# ---------------------------------------------------------------------------------------------
# Committed state


@dataclass(frozen=True, slots=True)
class _State:
    records: immutables.Map  # encoded key -> StorageRecord, or its packed form (see ``_pack``)
    indexes: immutables.Map  # (index name, encoded partition) -> _SortedRows
    # The operator projection: which run and run event records exist, grouped by their key minus its
    # last part, as the encoded keys of their records (read from ``records`` and decoded on first
    # operator read, see ``_projected``). Only creates and deletes change it; a replaced record keeps
    # its key.
    #   ("runs", environment) -> Map[run id -> encoded record key]
    #   ("run_events", environment, run id) -> Map[encoded sequence -> encoded record key]
    projection: immutables.Map
    last_version: int = 0

    def version_of(self, encoded_key: str) -> str | None:
        stored = self.records.get(encoded_key)
        return None if stored is None else _version(stored)

    def record(self, encoded_key: str) -> StorageRecord | None:
        return _unpack(self.records.get(encoded_key))

    def run_ids(self, environment: str) -> Iterable[str]:
        return self.projection.get((RUNS_COLLECTION, environment), _EMPTY_MAP).keys()

    def visible_run(self, environment: str, run_id: str, cache: DecodedCache) -> RunRecord | None:
        """A run is visible while its record decodes and no tombstone exists for it."""
        encoded = self.projection.get((RUNS_COLLECTION, environment), _EMPTY_MAP).get(run_id)
        if encoded is None or run_tombstone_key(environment, run_id).encoded in self.records:
            return None
        return _projected(self.records[encoded], cache, _checked_run)

    def run_events(self, environment: str, run_id: str, cache: DecodedCache) -> Iterable[RunEventRecord]:
        keys = self.projection.get((RUN_EVENTS_COLLECTION, environment, run_id), _EMPTY_MAP).values()
        records = self.records
        return [
            event for encoded in keys if (event := _projected(records[encoded], cache, _checked_event)) is not None
        ]


_EMPTY_STATE = _State(_EMPTY_MAP, _EMPTY_MAP, _EMPTY_MAP)


# A committed record is kept in one of two forms. A record whose document carries a decoded value
# (run documents written by core remember their run, so reading them back skips parsing) stays a
# ``StorageRecord``. Every other record is packed into a tuple of strings and ints,
#   (encoded key, version, document text, document byte size, ((index, encoded partition, encoded sort), ...)),
# which the garbage collector stops tracking: a store holds millions of history rows, and each
# tracked object makes every full collection of the process slower. Reads rebuild an equal
# ``StorageRecord`` from the packed form.
Packed = tuple[str, str, str, int, tuple[tuple[str, str, str], ...]]
Stored = StorageRecord | Packed


def _pack(key: StorageRecordKey, version: str, record: NewStorageRecord) -> Stored:
    document = record.document
    if document.decoded is not None:
        return StorageRecord(key, version, document, record.indexes)
    rows = tuple((entry.name._value_, entry.encoded_partition, entry.encoded_sort) for entry in record.indexes)
    return (key.encoded, version, document.text, document.byte_size, rows)


def _version(stored: Stored) -> str:
    return stored[1] if type(stored) is tuple else stored.version  # type: ignore[union-attr]


def _index_rows(stored: Stored) -> Iterable[tuple[str, str, str]]:
    if type(stored) is tuple:
        return stored[4]  # type: ignore[return-value]
    entries = stored.indexes  # type: ignore[union-attr]
    return ((entry.name._value_, entry.encoded_partition, entry.encoded_sort) for entry in entries)


def _unpack(stored: Stored | None) -> StorageRecord | None:
    if stored is None or type(stored) is not tuple:
        return stored  # type: ignore[return-value]
    encoded, version, text, byte_size, rows = stored  # type: ignore[misc]
    parts = decode_storage_tuple(encoded)
    entries = tuple(
        StorageIndexEntry._trusted(
            StorageIndexName(name), decode_storage_tuple(partition), decode_storage_tuple(sort), partition, sort
        )
        for name, partition, sort in rows
    )
    key = StorageRecordKey._trusted(parts[0], parts[1:], encoded)
    return StorageRecord(key, version, StorageDocument(text, byte_size), entries)


# Projected collections and the number of key parts their records have.
_PROJECTED = {RUNS_COLLECTION: 2, RUN_EVENTS_COLLECTION: 3}


def _is_projected(key: StorageRecordKey) -> bool:
    return _PROJECTED.get(key.collection) == len(key.parts)


# A projected document that does not decode, or that disagrees with its key, stays a valid raw record
# outside the operator view. Decoding happens on first operator read and is kept (see ``_projected``),
# so commits stay free of decoding and each stored version is decoded at most once. The values are
# shared: operator reads hand out deep copies only.


def _checked_run(record: StorageRecord) -> RunRecord | None:
    run = peek_run_document(record.document)
    if run is None or (environment_key(run.environment), run.id) != record.key.parts:
        return None
    return run


def _checked_event(record: StorageRecord) -> RunEventRecord | None:
    event = peek_run_event_document(record.document)
    if event is None:
        return None
    identity = (
        environment_key(event.event.environment),
        event.event.run_id,
        encode_storage_unsigned_integer(event.sequence),
    )
    return event if identity == record.key.parts else None


DecodedCache = dict[str, tuple[str, Any]]  # encoded key -> (version, decoded value or None)


def _projected(stored: Stored, cache: DecodedCache, check: Callable[[StorageRecord], Any]) -> Any:
    """The decoded projection value of a stored record, decoded at most once per stored version: an
    unpacked record keeps it on its document, a packed one in ``cache`` (commits drop the entries of
    the keys they write)."""
    if type(stored) is not tuple:
        return check(stored)  # type: ignore[arg-type]
    encoded, version = stored[0], stored[1]
    hit = cache.get(encoded)  # type: ignore[arg-type]
    if hit is not None and hit[0] == version:
        return hit[1]
    value = check(_unpack(stored))  # type: ignore[arg-type]
    cache[encoded] = (version, value)  # type: ignore[index]
    return value


def _apply(state: _State, writes: Sequence[StagedWrite], cache: DecodedCache) -> _State:
    """The state after ``writes`` (already validated): records, index rows, projection, versions.

    Index rows are collected per partition and each partition is rebuilt once per commit.
    """
    version = state.last_version
    committed = state.records
    records = committed.mutate()
    members_changed: dict[tuple[str, ...], list[tuple[str, str | None]]] = {}
    changes: dict[PartitionKey, tuple[list[Row], list[Row]]] = {}
    for write in writes:
        key = write.key
        encoded = key.encoded
        old = committed.get(encoded)
        if cache:
            cache.pop(encoded, None)
        if old is not None:
            del records[encoded]
            for name, encoded_partition, encoded_sort in _index_rows(old):
                partition = (name, encoded_partition)
                change = changes.get(partition)
                if change is None:
                    change = changes[partition] = ([], [])
                change[0].append((encoded_sort, encoded))
        staged = write.record
        new = None
        if staged is not None:
            version += 1
            new = records[encoded] = _pack(key, str(version), staged)
            for entry in staged.indexes:
                partition = (entry.name._value_, entry.encoded_partition)
                change = changes.get(partition)
                if change is None:
                    change = changes[partition] = ([], [])
                change[1].append((entry.encoded_sort, encoded))
        if (old is None) != (new is None):  # a create or a delete: projection membership changes
            parts = key.parts
            if _PROJECTED.get(key.collection) == len(parts):
                group = (key.collection, *parts[:-1])
                change_list = members_changed.get(group)
                if change_list is None:
                    change_list = members_changed[group] = []
                change_list.append((parts[-1], None if new is None else encoded))

    projection = state.projection
    if members_changed:
        groups = projection.mutate()
        for group, member_changes in members_changed.items():
            members = groups.get(group, _EMPTY_MAP).mutate()
            for member, member_key in member_changes:
                if member_key is not None:
                    members[member] = member_key
                elif member in members:
                    del members[member]
            if len(members):
                groups[group] = members.finish()
            elif group in groups:
                del groups[group]
        projection = groups.finish()

    indexes = state.indexes
    if changes:
        mutation = indexes.mutate()
        for partition, (removes, inserts) in changes.items():
            rows = indexes.get(partition, _NO_ROWS).updated(removes, inserts)
            if rows:
                mutation[partition] = rows
            elif partition in mutation:
                del mutation[partition]
        indexes = mutation.finish()
    return _State(records.finish(), indexes, projection, version)


class LocalStorageStore:
    """Committed state that several driver instances may share.

    Drivers over one store see the same records, conflict with each other and share exclusive
    candidate holds. The state is one immutable value, replaced atomically under a lock, so the store
    can be used from several threads and event loops.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state = _EMPTY_STATE
        self._holds: dict[str, object] = {}  # encoded key -> the live attempt holding it
        # Operator reads' decoded values of packed projected records (see ``_projected``).
        self._decoded: DecodedCache = {}

    def _snapshot(self) -> _State:
        with self._lock:
            return self._state

    def _hold(self, owner: object, query: StorageQuery, candidates: Iterator[Row]) -> StorageQueryResult:
        """Skip rows other attempts hold and hold every returned row for ``owner`` (never a look-ahead row)."""
        with self._lock:
            free = (row for row in candidates if self._holds.get(row[1], owner) is owner)
            result = page_index_rows(query, free, look_ahead=False)
            for item in result.items:
                self._holds[item.key.encoded] = owner
            return result

    def _release(self, owner: object, keys: Iterable[str]) -> None:
        with self._lock:
            for key in keys:
                if self._holds.get(key) is owner:
                    del self._holds[key]

    def _commit(self, reads: dict[str, str | None], writes: list[StagedWrite], append: StorageAppendCommand | None) -> bool:
        """Validate the read set and staged conditions, then swap in the next state; ``False`` on a conflict."""
        with self._lock:
            state = self._state
            committed = state.records.get
            for key, version in reads.items():
                stored = committed(key)
                if (None if stored is None else _version(stored)) != version:
                    return False
            for key, expected, _ in writes:
                stored = committed(key.encoded)
                if (None if stored is None else _version(stored)) != expected:
                    return False
            if append is not None:
                writes = [*writes, *_allocate(state, append)]
            self._state = _apply(state, writes, self._decoded)
            return True


def _allocate(state: _State, command: StorageAppendCommand) -> list[StagedWrite]:
    """The head and records of ``command`` at the committed head (a corrupt or exhausted head raises)."""
    layout = storage_stream_layouts[command.stream]
    head = state.record(layout.head_key(command.partition).encoded)
    appended = materialize_storage_append(command, read_storage_stream_position(head))
    if any(record.key.encoded in state.records for record in appended.records):
        raise RunlaneError(
            ErrorCode.INVARIANT_VIOLATION,
            f"The {command.stream.value} stream already holds records past its head; refusing to overwrite them.",
        )
    head_write = StagedWrite(appended.head.key, None if head is None else head.version, appended.head)
    return [head_write, *(StagedWrite(record.key, None, record) for record in appended.records)]


# ---------------------------------------------------------------------------------------------
# Transaction attempts


class _LocalTransaction(StorageAttempt):
    """One attempt of a transaction callback over the snapshot taken when it started.

    ``StorageAttempt`` keeps the contract's bookkeeping; this class reads the snapshot, holds
    exclusive candidates in the store and commits through it.
    """

    def __init__(self, store: LocalStorageStore, snapshot: _State, limits: StorageLimits, clock: Clock) -> None:
        super().__init__(limits, clock)
        self._store = store
        self._state = snapshot
        self._held: list[str] = []  # exclusive candidates this attempt holds

    async def _fetch(self, keys: list[StorageRecordKey]) -> list[StorageRecord | None]:
        await asyncio.sleep(0)  # let concurrent attempts interleave
        records = self._state.records.get
        return [_unpack(records(key.encoded)) for key in keys]

    async def _candidates(self, query: StorageQuery, mode: StorageCandidateMode) -> StorageQueryResult:
        await asyncio.sleep(0)  # let concurrent attempts interleave
        self._check_open()
        candidates = _scan(self._state.indexes.get((query.index.value, query.encoded_partition), _NO_ROWS), query)
        if mode != StorageCandidateMode.EXCLUSIVE:
            return page_index_rows(query, candidates, look_ahead=True)
        result = self._store._hold(self, query, candidates)
        self._held.extend(item.key.encoded for item in result.items)
        return result

    def _commit(self) -> bool:
        """Commit the staged work; ``False`` when validation failed and the callback must be replayed."""
        self.check_committable()
        return self._store._commit(self.reads, self.writes, self.append_command)

    def end(self) -> None:
        """Close the attempt (after commit, rollback or before a replay) and release its holds."""
        super().end()
        if self._held:
            self._store._release(self, self._held)


# ---------------------------------------------------------------------------------------------
# The driver


class LocalStorageDriver:
    """In-memory ``StorageDriver`` and ``OperatorReadDriver`` over a ``LocalStorageStore``."""

    def __init__(
        self,
        *,
        clock: Clock | None = None,
        limits: StorageLimits | None = None,
        store: LocalStorageStore | None = None,
        max_transaction_attempts: int = 16,
        name: str = "local-memory-storage",
    ) -> None:
        if clock is not None and not callable(getattr(clock, "now", None)):
            raise RunlaneError(ErrorCode.CONFIGURATION_INVALID, "clock must be an object with a now() method.")
        if limits is not None and not isinstance(limits, StorageLimits):
            raise RunlaneError(ErrorCode.CONFIGURATION_INVALID, "limits must be a StorageLimits value.")
        if store is not None and not isinstance(store, LocalStorageStore):
            raise RunlaneError(ErrorCode.CONFIGURATION_INVALID, "store must be a LocalStorageStore.")
        attempts = max_transaction_attempts
        if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
            raise RunlaneError(ErrorCode.CONFIGURATION_INVALID, "max_transaction_attempts must be a positive integer.")
        if not isinstance(name, str) or not name:
            raise RunlaneError(ErrorCode.CONFIGURATION_INVALID, "name must be a non-empty string.")
        self.name = name
        self.profile = StorageProfile(
            durability=StorageDurability.PROCESS,
            clock_authority=StorageClockAuthority.CLIENT,
            index_consistency=StorageIndexConsistency.STRONG,
            limits=limits or StorageLimits(),
            exclusive_candidates=True,
            ordered_append=True,
            process_local=True,
        )
        self.store = store or LocalStorageStore()
        self.max_transaction_attempts = attempts
        self._clock: Clock = clock or _UtcClock()
        self._closed = False

    def __repr__(self) -> str:
        return f"LocalStorageDriver(name={self.name!r})"

    # -- clock -----------------------------------------------------------------------------------

    @property
    def clock(self) -> Clock:
        """The clock every transaction attempt's ``now()`` samples (client clock authority)."""
        return self._clock

    def use_clock(self, clock: Clock) -> None:
        """Sample ``clock`` in every later transaction attempt (an attempt in flight keeps its time).

        ``create_runlane(clock=...)`` calls this so storage time and runtime time come from one clock;
        tests may call it directly. ``clock`` is any object with a ``now()`` returning aware datetimes.
        """
        if not callable(getattr(clock, "now", None)):
            raise RunlaneError(ErrorCode.CONFIGURATION_INVALID, "clock must be an object with a now() method.")
        self._clock = clock

    # -- lifecycle: nothing to connect; a closed driver refuses work until started again ---------

    async def start(self) -> None:
        self._closed = False

    async def close(self) -> None:
        self._closed = True

    def _snapshot(self) -> _State:
        if self._closed:
            raise RunlaneError(ErrorCode.STORAGE_UNAVAILABLE, f"Storage driver {self.name!r} is closed.")
        return self.store._snapshot()

    # -- StorageDriver ---------------------------------------------------------------------------

    async def get(self, keys: Sequence[StorageRecordKey]) -> list[StorageRecord | None]:
        checked = check_storage_keys(keys)
        enforce_storage_limit(self.profile.limits, "max_point_reads", len(checked))
        await asyncio.sleep(0)
        records = self._snapshot().records
        return [_unpack(records.get(key.encoded)) for key in checked]

    async def query(self, query: StorageQuery) -> StorageQueryResult:
        if not isinstance(query, StorageQuery):
            raise contract_violation("query() takes a StorageQuery.")
        enforce_storage_limit(self.profile.limits, "max_query_results", query.limit)
        await asyncio.sleep(0)
        rows = self._snapshot().indexes.get((query.index.value, query.encoded_partition), _NO_ROWS)
        return page_index_rows(query, _scan(rows, query), look_ahead=True)

    async def with_transaction(self, callback: Callable[[StorageTransaction], Awaitable[T]]) -> T:
        for _ in range(self.max_transaction_attempts):
            attempt = _LocalTransaction(self.store, self._snapshot(), self.profile.limits, self._clock)
            try:
                result = await callback(attempt)
                committed = attempt._commit()
            finally:
                attempt.end()
            if committed:
                return result
            await asyncio.sleep(0)  # let the winner of the conflict make progress before replaying
        raise create_storage_conflict_error(
            StorageConflictKind.TRANSACTION,
            f"The transaction lost optimistic validation {self.max_transaction_attempts} times; retry the operation.",
            meta={"attempts": self.max_transaction_attempts},
        )

    # -- OperatorReadDriver ----------------------------------------------------------------------

    async def get_run(self, environment: Environment, run_id: str) -> RunRecord | None:
        run = self._snapshot().visible_run(environment_key(environment), run_id, self.store._decoded)
        return None if run is None else run.model_copy(deep=True)

    async def list_runs(self, filter: RunFilter, pagination: PaginationParams) -> Page[RunSummary]:
        state = self._snapshot()
        cache = self.store._decoded
        environment = environment_key(filter.environment)
        runs = (
            run
            for run_id in state.run_ids(environment)
            if (run := state.visible_run(environment, run_id, cache)) is not None and run_matches_filter(run, filter)
        )
        rows = [(run_sort_value(run, filter.sort_by, filter.sort_direction), run) for run in runs]
        page, cursor = _operator_page(rows, PaginationCursorKind.RUN_LIST, filter, filter.sort_direction, pagination)
        return Page[RunSummary](data=[run.to_summary().model_copy(deep=True) for run in page], next_cursor=cursor)

    async def list_run_events(self, filter: RunEventFilter, pagination: PaginationParams) -> Page[RunEventRecord]:
        state = self._snapshot()
        cache = self.store._decoded
        environment = environment_key(filter.environment)
        run_ids = state.run_ids(environment) if filter.run_id is None else (filter.run_id,)
        events = (
            event
            for run_id in run_ids
            if state.visible_run(environment, run_id, cache) is not None
            for event in state.run_events(environment, run_id, cache)
            if run_event_matches_filter(event, filter)
        )
        rows = [(run_event_sort_value(event, filter.sort_by), event) for event in events]
        kind = PaginationCursorKind.RUN_EVENT_LIST
        page, cursor = _operator_page(rows, kind, filter, filter.sort_direction, pagination)
        return Page[RunEventRecord](data=[event.model_copy(deep=True) for event in page], next_cursor=cursor)


def _operator_page(
    rows: list[tuple[tuple[str, ...], T]],
    kind: PaginationCursorKind,
    filter: RunFilter | RunEventFilter,
    direction: SortDirection,
    pagination: PaginationParams,
) -> tuple[list[T], str | None]:
    """Sort ``(sort value, item)`` rows, continue strictly after the cursor and cut one page."""
    limit = clamp_page_limit(pagination.limit)
    after = decode_operator_cursor(pagination.cursor, kind, filter)
    descending = direction is SortDirection.DESC
    rows.sort(key=itemgetter(0), reverse=descending)
    if after is not None:
        rows = [row for row in rows if (row[0] < after if descending else row[0] > after)]
    cursor = encode_operator_cursor(kind, filter, rows[limit - 1][0]) if len(rows) > limit else None
    return [item for _, item in rows[:limit]], cursor


def local_storage_driver(
    *,
    clock: Clock | None = None,
    limits: StorageLimits | None = None,
    store: LocalStorageStore | None = None,
    max_transaction_attempts: int = 16,
    name: str = "local-memory-storage",
) -> LocalStorageDriver:
    """The in-memory reference driver: process-local, strongly indexed, client clock.

    Pass one ``store`` to several drivers to make them share records, conflicts and exclusive holds.
    """
    return LocalStorageDriver(
        clock=clock, limits=limits, store=store, max_transaction_attempts=max_transaction_attempts, name=name
    )
