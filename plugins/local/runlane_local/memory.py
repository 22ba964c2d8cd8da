"""The in-memory reference storage driver.

This driver is the executable reference of the storage contract, kept small enough to read in one
sitting. It is process-local development storage, not durable production storage.

Mechanics:

* **Versioned state.** A store's committed state is three tables (records by encoded key, index
  partitions, operator projection groups) in ``_Versions``: one plain dict of current values per
  table, plus, while older snapshots are live, the values commits replaced. A commit writes only the
  keys it changes, under a ``threading.Lock``, and publishes a new ``_State``: a view of the tables as
  of its commit number, which stays valid for whoever holds it (reads register their snapshot).
  Records are packed tuples of strings and ints (``_pack``), index partitions and projection groups
  immutable values, so the garbage collector stops tracking nearly all of a store and a large store
  does not slow down the process's full collections. Index partitions and projection groups fold
  their changes lazily (``_partition_rows``, ``_State.group``): a partition nobody reads is never
  rebuilt, a busy one once for many commits.
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
import functools
import threading
from bisect import bisect_left, bisect_right, insort
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from operator import itemgetter
from typing import Any, TypeVar, overload

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
    encode_storage_tuple,
    encode_storage_unsigned_integer,
    parse_unsigned_64_decimal,
    read_storage_stream_position,
    run_event_matches_filter,
    run_event_sort_value,
    run_matches_filter,
    run_sort_value,
    storage_stream_layouts,
)
from runlane.storage.clock import ClientClock, Clock, SystemClock, checked_clock
from runlane.storage.attempt import (
    StagedWrite,
    StorageAttempt,
    check_storage_keys,
    contract_violation,
    enforce_storage_limit,
    page_index_rows,
    pause_before_replay,
)
from runlane.storage.streams import storage_append_rows
from runlane.storage.tables import (
    RUN_EVENTS_COLLECTION,
    RUN_TOMBSTONES_COLLECTION,
    RUNS_COLLECTION,
    compact_decoded,
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
        rows: list[Row] | None  # ``None`` only after a ``touched.get`` miss below
        if not chunks:
            if removes:
                raise RunlaneError(ErrorCode.INVARIANT_VIOLATION, "An index row of a stored record is missing.")
            rows = sorted(inserts)
            pieces = tuple(tuple(rows[at : at + _CHUNK]) for at in range(0, len(rows), _CHUNK))
            return _SortedRows(pieces)
        lasts = self._lasts
        if not removes:
            if not inserts:
                return self
            if len(inserts) > 1:
                inserts = sorted(inserts)
            if inserts[0] > lasts[-1]:
                # Every row sorts after the partition's last row (stream positions, new history rows,
                # due times that only grow): only the last chunk changes.
                grown = chunks[-1] + tuple(inserts)
                if len(grown) <= 2 * _CHUNK:
                    return _SortedRows((*chunks[:-1], grown), (*lasts[:-1], grown[-1]))
                pieces = tuple([grown[at : at + _CHUNK] for at in range(0, len(grown), _CHUNK)])
                return _SortedRows((*chunks[:-1], *pieces), (*lasts[:-1], *[piece[-1] for piece in pieces]))
        if len(chunks) == 1:  # a small partition: one chunk, no directory to rebuild
            rows = list(chunks[0])
            for row in removes:
                at = bisect_left(rows, row)
                if at == len(rows) or rows[at] != row:
                    raise RunlaneError(ErrorCode.INVARIANT_VIOLATION, "An index row of a stored record is missing.")
                del rows[at]
            for row in inserts:
                insort(rows, row)
            if not rows:
                return _NO_ROWS
            if len(rows) <= 2 * _CHUNK:
                single = tuple(rows)
                return _SortedRows((single,), (single[-1],))
            pieces = tuple([tuple(rows[at : at + _CHUNK]) for at in range(0, len(rows), _CHUNK)])
            return _SortedRows(pieces, tuple([piece[-1] for piece in pieces]))
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

# An index partition as the state keeps it:
#   (chunks, last rows, unfolded row count, row count, removes, inserts, removes, inserts, ...)
# the rows folded so far as a ``_SortedRows``'s chunks and their last rows, the number of rows in the
# changes not folded in yet, the partition's row count, then those changes, per commit, as flat
# tuples (sort, key, sort, key, ...) of the rows it removed and inserted (flat, so the collector
# untracks them at once). Commits only add their changes; the first read of the partition folds
# them (once per state value, and for later states too, see ``_Versions.settle``) and a commit folds
# them when they grow past ``_FOLD_ROWS`` rows or ``_FOLD_VALUES`` values, so a partition nobody
# reads (a run's history rows) is never rebuilt and a busy one is rebuilt once for many commits.
_Partition = tuple[Any, ...]
_EMPTY_PARTITION: _Partition = ((), (), 0, 0)
_FOLD_ROWS = 256
_FOLD_VALUES = 4 + 2 * 16  # at most 16 commits' changes wait to be folded


def _pairs(flat: Sequence[str]) -> list[Row]:
    return list(zip(flat[0::2], flat[1::2]))


def _partition_rows(partition: _Partition) -> _SortedRows:
    """The rows of a stored partition with its pending changes folded in."""
    chunks, lasts = partition[0], partition[1]
    rows = _SortedRows(chunks, lasts) if chunks else _NO_ROWS
    if len(partition) == 4:
        return rows
    if len(partition) == 6:
        return rows.updated(_pairs(partition[4]), _pairs(partition[5]))
    # The net change of the commits in order: a row inserted by one commit and removed by a later
    # one never reaches the rows; a row removed and inserted again stays.
    removed: dict[Row, None] = {}
    inserted: dict[Row, None] = {}
    for at in range(4, len(partition), 2):
        for row in _pairs(partition[at]):
            if row in inserted:
                del inserted[row]
            else:
                removed[row] = None
        for row in _pairs(partition[at + 1]):
            if row in removed:
                del removed[row]
            else:
                inserted[row] = None
    return rows.updated(list(removed), list(inserted))


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
# Large projection groups

_BUCKET_MASK = (1 << 10) - 1
_MISSING: Any = object()


class _Buckets:
    """An immutable mapping kept as small plain ``dict`` buckets in an ``immutables.Map`` by key hash
    (a projection group too large to copy whole on every change, see ``_regroup``).

    A change copies only the buckets it touches, so earlier values keep their view, and the plain
    dicts cost the garbage collector nothing once their values (strings) are untracked.
    """

    __slots__ = ("_map", "_size")

    def __init__(self, buckets: immutables.Map = _EMPTY_MAP, size: int = 0) -> None:
        self._map = buckets
        self._size = size

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def get(self, key: Any, default: Any = None) -> Any:
        bucket = self._map.get(hash(key) & _BUCKET_MASK)
        return default if bucket is None else bucket.get(key, default)

    def __getitem__(self, key: Any) -> Any:
        value = self.get(key, _MISSING)
        if value is _MISSING:
            raise KeyError(key)
        return value

    def __contains__(self, key: Any) -> bool:
        return self.get(key, _MISSING) is not _MISSING

    def keys(self) -> Iterator[Any]:
        for bucket in self._map.values():
            yield from bucket

    def values(self) -> Iterator[Any]:
        for bucket in self._map.values():
            yield from bucket.values()

    def items(self) -> Iterator[tuple[Any, Any]]:
        for bucket in self._map.values():
            yield from bucket.items()

    def mutate(self) -> _BucketsMutation:
        return _BucketsMutation(self)


class _BucketsMutation:
    """Changes to a ``_Buckets`` value; ``finish()`` returns the new value."""

    __slots__ = ("_base", "_copies", "_size")

    def __init__(self, base: _Buckets) -> None:
        self._base = base._map
        self._copies: dict[int, dict[Any, Any]] = {}
        self._size = base._size

    def _bucket(self, key: Any) -> dict[Any, Any]:
        index = hash(key) & _BUCKET_MASK
        bucket = self._copies.get(index)
        if bucket is None:
            found = self._base.get(index)
            bucket = self._copies[index] = {} if found is None else found.copy()
        return bucket

    def __contains__(self, key: Any) -> bool:
        index = hash(key) & _BUCKET_MASK
        bucket = self._copies.get(index)
        if bucket is None:
            bucket = self._base.get(index)
        return bucket is not None and key in bucket

    def __setitem__(self, key: Any, value: Any) -> None:
        bucket = self._bucket(key)
        if key not in bucket:
            self._size += 1
        bucket[key] = value

    def __delitem__(self, key: Any) -> None:
        del self._bucket(key)[key]
        self._size -= 1

    def finish(self) -> _Buckets:
        if not self._copies:
            return _Buckets(self._base, self._size)
        mutation = self._base.mutate()
        for index, bucket in self._copies.items():
            if bucket:
                mutation[index] = bucket
            elif index in mutation:
                del mutation[index]
        return _Buckets(mutation.finish(), self._size)


_NO_BUCKETS = _Buckets()


# ---------------------------------------------------------------------------------------------
# Versioned tables


class _Versions:
    """Every committed record, index partition and projection group of a store, readable as of any
    live snapshot.

    ``latest`` holds three dicts (records, index partitions, projection groups) with the current
    value of every key. A commit made while other snapshots are live first keeps, per key it writes,
    the value it replaces in ``older`` (as ``(commit, value before it)``, oldest first, ``None`` for
    absent), then writes ``latest``; a read as of snapshot ``s`` takes the value before the first
    commit after ``s`` when there is one. The order of those two writes, and reading ``latest``
    before ``older``, keeps a read correct while another thread commits. Kept values are dropped once
    no live snapshot is older than their commit (``log`` lists them in commit order), so ``older``
    only ever holds what concurrent attempts still read.

    A dict of packed records is one object for the garbage collector however many records it holds,
    and a commit writes only the keys it changes: nothing is copied per commit but the changed
    values themselves (index partitions and projection groups are immutable values).
    """

    __slots__ = ("latest", "live", "lock", "log", "older")

    def __init__(self, lock: Any) -> None:
        self.lock = lock  # the store's lock: commits, holds and ``settle`` take it
        self.latest: tuple[dict[Any, Any], dict[Any, Any], dict[Any, Any]] = ({}, {}, {})
        self.older: tuple[dict[Any, Any], dict[Any, Any], dict[Any, Any]] = ({}, {}, {})
        self.log: deque[tuple[int, int, Any]] = deque()
        self.live: dict[int, int] = {}  # snapshot commit -> readers holding it

    def write(self, commit: int, table: int, puts: list[tuple[Any, Any]], keep: bool) -> None:
        """Apply one commit's values to one table (``None`` deletes); ``keep`` when other snapshots are live."""
        latest = self.latest[table]
        if keep:
            older = self.older[table]
            log = self.log
            for key, value in puts:
                older[key] = (*older.get(key, ()), (commit, latest.get(key)))
                log.append((commit, table, key))
                if value is None:
                    latest.pop(key, None)
                else:
                    latest[key] = value
            return
        for key, value in puts:
            if value is None:
                latest.pop(key, None)
            else:
                latest[key] = value

    def settle(self, table: int, key: Any, current: Any, equivalent: Any) -> None:
        """Replace ``key``'s current value by an equivalent one (a folded index partition), so later
        reads and commits start from it; nothing changes when ``key`` was written meanwhile."""
        with self.lock:
            latest = self.latest[table]
            if latest.get(key) is current:
                latest[key] = equivalent

    def hold(self, commit: int) -> None:
        self.live[commit] = self.live.get(commit, 0) + 1

    def release(self, commit: int) -> None:
        """Drop one reader of snapshot ``commit`` and every kept value no live snapshot needs."""
        live = self.live
        count = live[commit] - 1
        if count:
            live[commit] = count
        else:
            del live[commit]
        log = self.log
        if not log:
            return
        if not live:
            for older in self.older:
                older.clear()
            log.clear()
            return
        oldest = min(live)
        while log and log[0][0] <= oldest:
            _, table, key = log.popleft()
            older = self.older[table]
            kept = older[key]
            if len(kept) == 1:
                del older[key]
            else:
                older[key] = kept[1:]


class _Table:
    """One table of ``_Versions`` as of one commit (a state's records, index partitions or groups)."""

    __slots__ = ("_commit", "_latest", "_older")

    def __init__(self, versions: _Versions, table: int, commit: int) -> None:
        self._latest = versions.latest[table]
        self._older = versions.older[table]
        self._commit = commit

    def get(self, key: Any, default: Any = None) -> Any:
        value = self._latest.get(key)
        older = self._older
        if older:
            kept = older.get(key)
            if kept is not None:
                commit = self._commit
                for written, before in kept:
                    if written > commit:
                        value = before
                        break
        return default if value is None else value

    def __getitem__(self, key: Any) -> Any:
        value = self.get(key)
        if value is None:
            raise KeyError(key)
        return value

    def __contains__(self, key: Any) -> bool:
        return self.get(key) is not None

    def keys(self) -> list[Any]:
        latest, older = self._latest, self._older
        candidates = [*latest, *(key for key in list(older) if key not in latest)]
        return [key for key in candidates if self.get(key) is not None]

    def values(self) -> list[Any]:
        return [self[key] for key in self.keys()]

    def items(self) -> list[tuple[Any, Any]]:
        return [(key, self[key]) for key in self.keys()]


_RECORDS, _INDEXES, _GROUPS = 0, 1, 2


# ---------------------------------------------------------------------------------------------
# Committed state


class _State:
    """The store as of one commit: views of its versioned tables plus the unfolded projection changes.

    A value: nothing changes it once built, except the caches of what its reads computed (``folded``,
    ``folded_rows``), which hold the same values whichever thread fills them.
    """

    __slots__ = (
        "commit", "folded", "folded_rows", "groups", "indexes", "last_version", "listed", "pending", "records",
        "versions",
    )  # fmt: skip

    def __init__(
        self, versions: _Versions, commit: int, pending: _Pending | None = None, last_version: int = 0
    ) -> None:
        self.versions = versions
        self.commit = commit
        self.records = _Table(versions, _RECORDS, commit)  # encoded key -> packed record (see ``_pack``)
        # (index name, encoded partition) -> _Partition (see ``_partition_rows``)
        self.indexes = _Table(versions, _INDEXES, commit)
        # The operator projection: which run and run event records exist, grouped by their key minus
        # its last part, as the encoded keys of their records (read from ``records`` and decoded on
        # first operator read, see ``_projected``). Only creates and deletes change it; a replaced
        # record keeps its key. A group is a plain dict until it grows large, then ``_Buckets`` (see
        # ``_regroup``).
        #   ("runs", environment) -> {run id: encoded record key}
        #   ("run_events", environment, run id) -> {encoded sequence: encoded record key}
        # Commits do not fold their changes into the groups one by one: ``pending`` holds the changes
        # since they were last folded, newest commit first, as (changes, older pending, number of
        # changes); ``group()`` applies them on operator reads and a commit folds them once there
        # are many.
        self.groups = _Table(versions, _GROUPS, commit)
        self.pending = pending
        self.last_version = last_version
        self.folded: dict[Any, Any] | None = None
        self.folded_rows: dict[PartitionKey, _SortedRows] | None = None
        # Operator lists of this state, sorted, by filter (without its cursor): the pages of one listing
        # are cut from one sort instead of each sorting every run again.
        self.listed: dict[str, tuple[list[Any], list[Any]]] = {}

    def version_of(self, encoded_key: str) -> str | None:
        stored = self.records.get(encoded_key)
        return None if stored is None else stored[1]

    def record(self, encoded_key: str) -> StorageRecord | None:
        return _unpack(self.records.get(encoded_key))

    def rows(self, index: str, encoded_partition: str) -> _SortedRows:
        partition = (index, encoded_partition)
        found = self.indexes.get(partition)
        if found is None:
            return _NO_ROWS
        if not found[2]:
            return _SortedRows(found[0], found[1])
        folded = self.folded_rows
        if folded is None:
            folded = {}
            self.folded_rows = folded
        rows = folded.get(partition)
        if rows is None:
            rows = folded[partition] = _partition_rows(found)
            self.versions.settle(_INDEXES, partition, found, (rows._chunks, rows._lasts, 0, found[3]))
        return rows

    def group(self, key: tuple[str, ...]) -> Any:
        """A projection group with the pending changes applied (computed once per state value)."""
        if self.pending is None:
            return self.groups.get(key, _NO_MEMBERS)
        folded = self.folded
        if folded is None:
            folded = self.folded = {_BY_GROUP: _changes_by_group(self.pending)}
        members = folded.get(key)
        if members is None:
            changes = folded[_BY_GROUP].get(key)
            members = self.groups.get(key)
            if changes is not None:
                members = _regroup(members, changes)
            members = folded[key] = _NO_MEMBERS if members is None else members
        return members

    def run_ids(self, environment: str) -> Iterable[str]:
        return self.group((RUNS_COLLECTION, environment)).keys()

    def visible_run(self, environment: str, run_id: str, cache: DecodedCache) -> RunRecord | None:
        """A run is visible while its record decodes and no tombstone exists for it."""
        encoded = self.group((RUNS_COLLECTION, environment)).get(run_id)
        if encoded is None or run_tombstone_key(environment, run_id).encoded in self.records:
            return None
        return _projected(self.records[encoded], cache, _checked_run)

    def visible_runs(self, environment: str, cache: DecodedCache) -> Iterator[RunRecord]:
        """Every visible run of ``environment`` (``visible_run`` of each, without building a key per run)."""
        for _, _, run in self.visible_run_entries(environment, cache):
            yield run

    def visible_run_entries(self, environment: str, cache: DecodedCache) -> Iterator[tuple[str, Any, RunRecord]]:
        """``(encoded key, stored version, run)`` of every visible run of ``environment``."""
        records = self.records
        tombstones = encode_storage_tuple((RUN_TOMBSTONES_COLLECTION, environment)) + "/"
        for run_id, encoded in self.group((RUNS_COLLECTION, environment)).items():
            if tombstones + run_id.encode("utf-8").hex() in records:
                continue
            stored = records[encoded]
            run = _projected(stored, cache, _checked_run)
            if run is not None:
                yield encoded, stored[1], run

    def run_events(self, environment: str, run_id: str, cache: DecodedCache) -> Iterable[RunEventRecord]:
        keys = self.group((RUN_EVENTS_COLLECTION, environment, run_id)).values()
        records = self.records
        return [
            event for encoded in keys if (event := _projected(records[encoded], cache, _checked_event)) is not None
        ]


_BY_GROUP: Any = object()  # the key of a state's pending changes by group in its ``folded`` cache


# One commit's projection changes, (group, member, encoded key or ``None`` for a removal), and the
# pending changes before it.
_Change = tuple[tuple[str, ...], str, "str | None"]
_Pending = tuple[tuple[_Change, ...], Any, int]
# Pending changes are folded into the projection by the commit that brings them past this count.
_FOLD_AT = 4096


def _changes_by_group(pending: _Pending | None) -> dict[tuple[str, ...], list[tuple[str, str | None]]]:
    """The ``pending`` changes per group, in commit order."""
    batches = []
    while pending is not None:
        batches.append(pending[0])
        pending = pending[1]
    by_group: dict[tuple[str, ...], list[tuple[str, str | None]]] = {}
    for changes in reversed(batches):
        for group, member, member_key in changes:
            listed = by_group.get(group)
            if listed is None:
                listed = by_group[group] = []
            listed.append((member, member_key))
    return by_group


_NO_MEMBERS: dict[str, str] = {}


def _empty_state(lock: Any) -> _State:
    return _State(_Versions(lock), 0)


# A projection group larger than this is kept as ``_Buckets`` so a create does not copy all of it.
_LARGE_GROUP = 256


def _regroup(members: dict[str, str] | _Buckets | None, changes: list[tuple[str, str | None]]) -> Any:
    """A projection group after ``changes`` (member -> encoded key, or ``None`` to remove); ``None`` when empty."""
    if members is None or type(members) is dict:
        updated = {} if members is None else members.copy()
        for member, member_key in changes:
            if member_key is not None:
                updated[member] = member_key
            else:
                updated.pop(member, None)
        if len(updated) <= _LARGE_GROUP:
            return updated or None
        mutation = _NO_BUCKETS.mutate()
        for member, member_key in updated.items():
            mutation[member] = member_key
        return mutation.finish()
    mutation = members.mutate()  # type: ignore[union-attr]
    for member, member_key in changes:
        if member_key is not None:
            mutation[member] = member_key
        elif member in mutation:
            del mutation[member]
    grouped = mutation.finish()
    return grouped if grouped else None


# A committed record is packed into a tuple of strings and ints,
#   (encoded key, version, document text, document byte size, index rows),
# where the index rows are one flat tuple (index, encoded partition, encoded sort, index, ...), plus,
# for a document that carries a decoded value (run documents written by core remember their run, so
# reading them back skips parsing), a sixth item: that value as ``compact_decoded`` keeps it. The
# garbage collector stops tracking such tuples (the shallower the nesting, the sooner: a collection
# untracks a tuple only after everything inside it): a store holds millions of history rows and many
# active runs, and each tracked object makes every full collection of the process slower. Reads
# rebuild an equal ``StorageRecord`` from the packed form.
Packed = tuple[Any, ...]
Stored = Packed


def _pack(key: StorageRecordKey, version: str, record: NewStorageRecord) -> Stored:
    document = record.document
    indexes = record.indexes
    if not indexes:
        rows: tuple[str, ...] = ()
    elif len(indexes) == 1:
        entry = indexes[0]
        rows = (entry.name._value_, entry.encoded_partition, entry.encoded_sort)
    else:
        flat: list[str] = []
        for entry in indexes:
            flat += (entry.name._value_, entry.encoded_partition, entry.encoded_sort)
        rows = tuple(flat)
    decoded = document._decoded
    if decoded is not None:
        decoded = compact_decoded(decoded)  # ``None`` for what only a commit reads
    if decoded is None:
        return (key.encoded, version, document._text, document._byte_size, rows)
    return (key.encoded, version, document._text, document._byte_size, rows, decoded)


def _version(stored: Stored) -> str:
    return stored[1]


_INDEX_NAMES = {name._value_: name for name in StorageIndexName}


@functools.lru_cache(maxsize=1024)
def _decoded_partition(encoded: str) -> tuple[str, ...]:
    """Decoded index partitions: few distinct ones (environments, queues, runs of recent reads)."""
    return decode_storage_tuple(encoded)


def _decoded_sort(encoded: str) -> tuple[str, ...]:
    """``decode_storage_tuple`` of an encoding this driver stored (made by ``encode_storage_tuple``)."""
    return tuple([bytes.fromhex(part).decode("utf-8") for part in encoded.split("/")])


@overload
def _unpack(stored: Stored, key: StorageRecordKey | None = None) -> StorageRecord: ...


@overload
def _unpack(stored: Stored | None, key: StorageRecordKey | None = None) -> StorageRecord | None: ...


def _unpack(stored: Stored | None, key: StorageRecordKey | None = None) -> StorageRecord | None:
    """The record of a packed value; ``key`` is its key when the caller holds it (it was read by key)."""
    if stored is None:
        return None
    encoded, version, text, byte_size, rows = stored[:5]
    if not rows:
        entries: tuple[StorageIndexEntry, ...] = ()
    else:
        entries = tuple(
            [
                StorageIndexEntry._trusted(
                    _INDEX_NAMES[rows[at]],
                    _decoded_partition(rows[at + 1]),
                    _decoded_sort(rows[at + 2]),
                    rows[at + 1],
                    rows[at + 2],
                )
                for at in range(0, len(rows), 3)
            ]
        )
    if key is None:
        parts = decode_storage_tuple(encoded)
        key = StorageRecordKey._trusted(parts[0], parts[1:], encoded)
    document = StorageDocument(text, byte_size)
    if len(stored) == 6:
        document.remember_decoded(stored[5])
    return StorageRecord._trusted(key, version, document, entries)


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
    """The decoded projection value of a stored record, decoded at most once per stored version and
    kept in ``cache`` (commits drop the entries of the keys they write)."""
    encoded, version = stored[0], stored[1]
    hit = cache.get(encoded)
    if hit is not None and hit[0] == version:
        return hit[1]
    value = check(_unpack(stored))
    cache[encoded] = (version, value)
    return value


def _apply(
    state: _State,
    writes: Sequence[StagedWrite],
    cache: DecodedCache,
    appended: _Appended | None = None,
    keep: bool = False,
) -> _State | None:
    """The state after ``writes`` and then ``appended``: records, index rows, projection, versions;
    ``None`` when a write's expected version no longer holds (the commit must be replayed).

    ``state`` is the store's current state. Everything that can fail runs before the records change;
    ``keep`` keeps the replaced values for other live snapshots (see ``_Versions``). Index rows are
    collected per partition.
    """
    versions = state.versions
    latest = versions.latest[_RECORDS]
    olds = []
    for key, expected, _ in writes:
        old = latest.get(key.encoded)
        if (None if old is None else old[1]) != expected:
            return None
        olds.append(old)
    version = state.last_version
    puts: list[tuple[str, Stored | None]] = []
    projected: list[_Change] = []
    changes: dict[PartitionKey, tuple[list[str], list[str]]] = {}  # flat (sort, key, ...) removes, inserts
    for (key, _, staged), old in zip(writes, olds):
        encoded = key.encoded
        if cache:
            cache.pop(encoded, None)
        if old is not None:
            rows = old[4]
            for at in range(0, len(rows), 3):
                partition = (rows[at], rows[at + 1])
                change = changes.get(partition)
                if change is None:
                    change = changes[partition] = ([], [])
                change[0].extend((rows[at + 2], encoded))
        if staged is not None:
            version += 1
            puts.append((encoded, _pack(key, str(version), staged)))
            for entry in staged.indexes:
                partition = (entry.name._value_, entry.encoded_partition)
                change = changes.get(partition)
                if change is None:
                    change = changes[partition] = ([], [])
                change[1].extend((entry.encoded_sort, encoded))
            if old is not None:
                continue  # a replace: projection membership stays
        elif old is not None:
            puts.append((encoded, None))
        else:
            continue  # deleting an absent record (never staged by the attempt bookkeeping)
        # A create or a delete: projection membership changes.
        parts = key.parts
        if _PROJECTED.get(key.collection) == len(parts):
            projected.append(((key.collection, *parts[:-1]), parts[-1], None if staged is None else encoded))

    if appended is not None:
        # Stream records: creates of fresh keys (checked by ``_allocate``) with one index row each,
        # never projected.
        name, encoded_partition, rows = appended
        partition = (name, encoded_partition)
        change = changes.get(partition)
        if change is None:
            change = changes[partition] = ([], [])
        inserts = change[1]
        for encoded, text, byte_size, sort, encoded_sort in rows:
            version += 1
            if cache:
                cache.pop(encoded, None)
            puts.append((encoded, (encoded, str(version), text, byte_size, (name, encoded_partition, encoded_sort))))
            inserts.extend((encoded_sort, encoded))

    group_puts: list[tuple[Any, Any]] = []
    pending = state.pending
    if projected:
        count = len(projected) + (0 if pending is None else pending[2])
        pending = (tuple(projected), pending, count)
        if count >= _FOLD_AT:  # fold every pending change into the groups
            groups = versions.latest[_GROUPS]
            for group, member_changes in _changes_by_group(pending).items():
                group_puts.append((group, _regroup(groups.get(group), member_changes)))
            pending = None

    index_puts: list[tuple[Any, Any]] = []
    if changes:
        partitions = versions.latest[_INDEXES]
        for partition, (removes, inserts) in changes.items():
            found = partitions.get(partition)
            if found is None:
                found = _EMPTY_PARTITION
            count = found[3] + (len(inserts) - len(removes)) // 2
            if count <= 0:  # every row is gone: nothing to fold
                index_puts.append((partition, None))
                continue
            unfolded_rows = found[2] + (len(removes) + len(inserts)) // 2
            grown = (found[0], found[1], unfolded_rows, count, *found[4:], tuple(removes), tuple(inserts))
            if unfolded_rows > _FOLD_ROWS or len(grown) > _FOLD_VALUES:
                rows = _partition_rows(grown)
                index_puts.append((partition, (rows._chunks, rows._lasts, 0, count)))
            else:
                index_puts.append((partition, grown))

    # Nothing below can fail: the commit becomes visible table by table, each value before it is
    # replaced kept for older snapshots when ``keep``.
    commit = state.commit + 1
    versions.write(commit, _RECORDS, puts, keep)
    if index_puts:
        versions.write(commit, _INDEXES, index_puts, keep)
    if group_puts:
        versions.write(commit, _GROUPS, group_puts, keep)
    return _State(versions, commit, pending, version)


class LocalStorageStore:
    """Committed state that several driver instances may share.

    Drivers over one store see the same records, conflict with each other and share exclusive
    candidate holds. The state is one immutable value, replaced atomically under a lock, so the store
    can be used from several threads and event loops.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state = _empty_state(self._lock)
        self._holds: dict[str, object] = {}  # encoded key -> the live attempt holding it
        # Operator reads' decoded values of packed projected records (see ``_projected``).
        self._decoded: DecodedCache = {}
        # Run listings' sort values: encoded key -> (stored version, sort field, direction, value).
        self._run_sorts: dict[str, tuple[Any, Any, Any, tuple[str, ...]]] = {}

    def _snapshot(self) -> _State:
        with self._lock:
            return self._state

    def _hold_snapshot(self) -> _State:
        """The current state, readable as it is until ``_release_snapshot`` (concurrent commits keep
        the values it reads)."""
        with self._lock:
            state = self._state
            state.versions.hold(state.commit)
            return state

    def _release_snapshot(self, state: _State) -> None:
        with self._lock:
            state.versions.release(state.commit)

    def _hold(self, owner: object, query: StorageQuery, candidates: Iterator[Row]) -> StorageQueryResult:
        """Skip rows other attempts hold and hold every returned row for ``owner`` (never a look-ahead row)."""
        with self._lock:
            free = (row for row in candidates if self._holds.get(row[1], owner) is owner)
            result = page_index_rows(query, free, look_ahead=False, trusted=True)
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
            committed = state.versions.latest[_RECORDS].get  # the current state reads the latest values
            for key, version in reads.items():
                stored = committed(key)
                if (None if stored is None else stored[1]) != version:
                    return False
            appended = None
            if append is not None:
                head_write, appended = _allocate(state, append)
                writes = [*writes, head_write]
            # Other live snapshots than the committing attempt's need the values this commit replaces.
            keep = sum(state.versions.live.values()) > 1
            applied = _apply(state, writes, self._decoded, appended, keep)  # validates the staged conditions
            if applied is None:
                return False
            self._state = applied
            return True


# Stream records of one append as the driver stores them: (index name, encoded index partition,
# [(encoded key, document text, document byte size, sort, encoded sort), ...]).
_Appended = tuple[str, str, list[tuple[str, str, int, str, str]]]

# The canonical text of a stream head: {"schemaVersion":1,"value":{"next_position":"<decimal>"}}.
_HEAD_PREFIX = '{"schemaVersion":1,"value":{"next_position":"'
_HEAD_SUFFIX = '"}}'


def _head_position(stored: Stored | None) -> int:
    """``read_storage_stream_position`` of a stored head, reading a canonical packed head without parsing."""
    if stored is None:
        return 1
    text = stored[2]
    if text.startswith(_HEAD_PREFIX) and text.endswith(_HEAD_SUFFIX):
        try:
            return parse_unsigned_64_decimal(text[len(_HEAD_PREFIX) : -len(_HEAD_SUFFIX)])
        except RunlaneError:
            pass  # the general reader below raises the precise error
    return read_storage_stream_position(_unpack(stored))


def _allocate(state: _State, command: StorageAppendCommand) -> tuple[StagedWrite, _Appended]:
    """The head write and records of ``command`` at the committed head (a corrupt or exhausted head raises)."""
    layout = storage_stream_layouts[command.stream]
    stored = state.records.get(layout.head_key(command.partition).encoded)
    start = _head_position(stored)
    key_prefix, encoded_partition, rows = storage_append_rows(command, start)
    records = state.records
    appended = []
    for sort, encoded_sort, text, byte_size in rows:
        encoded = key_prefix + encoded_sort
        if encoded in records:
            raise RunlaneError(
                ErrorCode.INVARIANT_VIOLATION,
                f"The {command.stream.value} stream already holds records past its head; refusing to overwrite them.",
            )
        appended.append((encoded, text, byte_size, sort, encoded_sort))
    head = layout.head_record(command.partition, start + len(rows))
    head_write = StagedWrite(head.key, None if stored is None else _version(stored), head)
    return head_write, (layout.index._value_, encoded_partition, appended)


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
        return [_unpack(records(key.encoded), key) for key in keys]

    async def _candidates(self, query: StorageQuery, mode: StorageCandidateMode) -> StorageQueryResult:
        await asyncio.sleep(0)  # let concurrent attempts interleave
        self._check_open()
        candidates = _scan(self._state.rows(query.index.value, query.encoded_partition), query)
        if mode != StorageCandidateMode.EXCLUSIVE:
            return page_index_rows(query, candidates, look_ahead=True, trusted=True)
        result = self._store._hold(self, query, candidates)
        self._held.extend(item.key.encoded for item in result.items)
        return result

    def _commit(self) -> bool:
        """Commit the staged work; ``False`` when validation failed and the callback must be replayed."""
        self.check_committable()
        return self._store._commit(self.reads, self.writes, self.append_command)

    def end(self) -> None:
        """Close the attempt (after commit, rollback or before a replay) and release its holds and
        its snapshot."""
        if not self.ended:
            self._store._release_snapshot(self._state)
        super().end()
        if self._held:
            self._store._release(self, self._held)


# ---------------------------------------------------------------------------------------------
# The driver


class LocalStorageDriver(ClientClock):
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
        if clock is not None:
            checked_clock(clock)
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
        self._clock: Clock = clock or SystemClock()
        self._closed = False

    def __repr__(self) -> str:
        return f"LocalStorageDriver(name={self.name!r})"

    # -- lifecycle: nothing to connect; a closed driver refuses work until started again ---------

    async def start(self) -> None:
        self._closed = False

    async def close(self) -> None:
        self._closed = True

    def _snapshot(self) -> _State:
        """The current state held for reading (``store._release_snapshot`` it when done)."""
        if self._closed:
            raise RunlaneError(ErrorCode.STORAGE_UNAVAILABLE, f"Storage driver {self.name!r} is closed.")
        return self.store._hold_snapshot()

    def _read(self, read: Callable[[_State], T]) -> T:
        """``read`` of the current state, which stays as it is while ``read`` runs."""
        state = self._snapshot()
        try:
            return read(state)
        finally:
            self.store._release_snapshot(state)

    # -- StorageDriver ---------------------------------------------------------------------------

    async def get(self, keys: Sequence[StorageRecordKey]) -> list[StorageRecord | None]:
        checked = check_storage_keys(keys)
        enforce_storage_limit(self.profile.limits, "max_point_reads", len(checked))
        await asyncio.sleep(0)
        return self._read(lambda state: [_unpack(state.records.get(key.encoded), key) for key in checked])

    async def query(self, query: StorageQuery) -> StorageQueryResult:
        if not isinstance(query, StorageQuery):
            raise contract_violation("query() takes a StorageQuery.")
        enforce_storage_limit(self.profile.limits, "max_query_results", query.limit)
        await asyncio.sleep(0)
        rows = self._read(lambda state: state.rows(query.index.value, query.encoded_partition))
        return page_index_rows(query, _scan(rows, query), look_ahead=True, trusted=True, remember=True)

    async def with_transaction(self, callback: Callable[[StorageTransaction], Awaitable[T]]) -> T:
        for number in range(self.max_transaction_attempts):
            attempt = _LocalTransaction(self.store, self._snapshot(), self.profile.limits, self._clock)
            try:
                result = await callback(attempt)
                committed = attempt._commit()
            finally:
                attempt.end()
            if committed:
                return result
            await pause_before_replay(number)
        raise create_storage_conflict_error(
            StorageConflictKind.TRANSACTION,
            f"The transaction lost optimistic validation {self.max_transaction_attempts} times; retry the operation.",
            meta={"attempts": self.max_transaction_attempts},
        )

    # -- OperatorReadDriver ----------------------------------------------------------------------

    async def get_run(self, environment: Environment, run_id: str) -> RunRecord | None:
        run = self._read(lambda state: state.visible_run(environment_key(environment), run_id, self.store._decoded))
        return None if run is None else run.model_copy(deep=True)

    async def list_runs(self, filter: RunFilter, pagination: PaginationParams) -> Page[RunSummary]:
        return self._read(lambda state: self._list_runs(state, filter, pagination))

    def _list_runs(self, state: _State, filter: RunFilter, pagination: PaginationParams) -> Page[RunSummary]:
        def rows() -> list[tuple[tuple[str, ...], Any]]:
            # A listing is sorted again after every commit: each run's sort value is kept for its stored
            # version, so a run that did not change is not encoded again (dates are the costly part).
            cache, sorts = self.store._decoded, self.store._run_sorts
            environment = environment_key(filter.environment)
            field, direction = filter.sort_by, filter.sort_direction
            listed: list[tuple[tuple[str, ...], Any]] = []
            seen = 0
            for encoded, version, run in state.visible_run_entries(environment, cache):
                seen += 1
                if not run_matches_filter(run, filter):
                    continue
                kept = sorts.get(encoded)
                if kept is not None and kept[0] == version and kept[1] is field and kept[2] is direction:
                    value = kept[3]
                else:
                    value = run_sort_value(run, field, direction)
                    sorts[encoded] = (version, field, direction, value)
                listed.append((value, run))
            if len(sorts) > 2 * seen + 1024:  # runs pruned since: start over rather than keep theirs
                sorts.clear()
            return listed

        kind = PaginationCursorKind.RUN_LIST
        page, cursor = _operator_page(state, rows, kind, filter, filter.sort_direction, pagination)
        return Page[RunSummary](data=[run.to_summary().model_copy(deep=True) for run in page], next_cursor=cursor)

    async def list_run_events(self, filter: RunEventFilter, pagination: PaginationParams) -> Page[RunEventRecord]:
        return self._read(lambda state: self._list_run_events(state, filter, pagination))

    def _list_run_events(
        self, state: _State, filter: RunEventFilter, pagination: PaginationParams
    ) -> Page[RunEventRecord]:
        def rows() -> list[tuple[tuple[str, ...], Any]]:
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
            return [(run_event_sort_value(event, filter.sort_by), event) for event in events]

        kind = PaginationCursorKind.RUN_EVENT_LIST
        page, cursor = _operator_page(state, rows, kind, filter, filter.sort_direction, pagination)
        return Page[RunEventRecord](data=[event.model_copy(deep=True) for event in page], next_cursor=cursor)


_LISTINGS_KEPT = 16  # sorted operator lists one state keeps


def _operator_page(
    state: _State,
    rows: Callable[[], list[tuple[tuple[str, ...], T]]],
    kind: PaginationCursorKind,
    filter: RunFilter | RunEventFilter,
    direction: SortDirection,
    pagination: PaginationParams,
) -> tuple[list[T], str | None]:
    """The page after the cursor of the ``(sort value, item)`` rows, sorted once per state and filter."""
    limit = clamp_page_limit(pagination.limit)
    after = decode_operator_cursor(pagination.cursor, kind, filter)
    key = f"{kind.value}:{filter.model_dump_json()}"
    listed = state.listed.get(key)
    if listed is None:
        ordered = sorted(rows(), key=itemgetter(0))  # ascending; a descending page reads it backwards
        listed = ([value for value, _ in ordered], [item for _, item in ordered])
        if len(state.listed) >= _LISTINGS_KEPT:
            state.listed.clear()
        state.listed[key] = listed
    values, items = listed
    if direction is SortDirection.DESC:
        end = len(values) if after is None else bisect_left(values, after)
        start = max(0, end - limit)
        page = items[start:end][::-1]
        cursor = encode_operator_cursor(kind, filter, values[start]) if start > 0 else None
    else:
        start = 0 if after is None else bisect_right(values, after)
        end = start + limit
        page = items[start:end]
        cursor = encode_operator_cursor(kind, filter, values[end - 1]) if end < len(values) else None
    return page, cursor


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
