"""The embedded durable SQLite storage driver.

One database file holds everything. Every process on the machine that opens the same file with this
driver shares its records, conflicts, ordered append heads and exclusive candidate holds. The file
must live on a local disk: SQLite's locking is not reliable over network file systems.

Mechanics:

* **Schema.** ``start()`` creates the tables in a new file and records ``schema_version`` in
  ``runlane_meta``; a file of version 1 is upgraded in place, one with another version is refused
  (``configuration_invalid``). Tables: ``runlane_records`` (key, version, canonical document, byte
  size, the record's index entries), ``runlane_index_rows`` (index name, encoded partition, encoded
  sort, key; none for an entry that restates its record's key, see ``runlane.storage.key_order``:
  those pages read the records' key range), a one-row version counter, ``runlane_holds``
  (exclusive candidates) and the two operator projection tables of ``runlane.storage.operator_sql``.
  Encoded keys and sort values are ASCII hex and ``/``, so SQLite's ``BINARY`` collation gives
  exactly the contract's byte order.
* **One thread per driver.** Every sqlite3 call runs on the driver's own worker thread (a
  single-worker executor owning one connection), so a commit waiting for the file's write lock,
  held by another process, never blocks the event loop.
* **Optimistic attempts.** Reads are plain SELECTs that take no write lock. An attempt remembers
  every record it read (present with its version, absent as ``None``) and answers repeated reads of
  a key from that memory, like a snapshot. The commit runs in ``BEGIN IMMEDIATE``: it re-reads the
  versions of the whole read set and of every staged key, rolls back and replays the callback when
  any differs, and otherwise applies records, index rows, the operator projection and the append
  batch before ``COMMIT``. A read-only attempt is validated in one read transaction.
* **Group commit.** Attempts of one event loop that reach their commit while a commit is in flight
  share the next write transaction (``runlane.storage.batching``): one ``BEGIN IMMEDIATE`` and one
  log sync for all of them, each applied in order after a savepoint of its own, so a later attempt
  sees the earlier ones' writes and an attempt that conflicts or fails is rolled back alone; an
  error that makes SQLite roll back the whole transaction (a full disk, an I/O error) fails them all.
* **Non-repeating versions.** A one-row counter in the file issues versions inside the commit, so
  versions never repeat across the file, even for a key deleted and created again.
* **Ordered append.** The stream head is read and advanced inside the commit's write transaction,
  so aborted and replayed attempts consume no positions.
* **Exclusive candidates.** SQLite has no row locks, so an exclusive selection runs in a short
  write transaction that skips rows held by another live attempt and records a hold (owner, host,
  pid, expiry) for each returned row, never for a look-ahead row. Holds are released with the
  attempt: in the commit's own transaction, or right after a rollback, replay or cancellation.
  Holds of a crashed process never block for long: they expire after ``hold_timeout`` seconds,
  and a hold whose owner process (same host and pid namespace) has exited is removed at once. An
  expired hold only costs exclusivity, never correctness: core re-reads every candidate and the
  commit validates versions. So hold transactions commit without a sync of their own
  (``synchronous=NORMAL`` for them): the next durable commit syncs the log with them, and losing
  them to a power failure loses nothing.
* **Wake hints.** Every commit to the file is the hint: while an idle poll worker of this process
  is subscribed, a watcher thread with a connection of its own reads ``PRAGMA data_version`` (a
  read of SQLite's shared memory, no disk I/O) when the file's directory reports a write (Linux
  inotify: a commit appends to the ``-wal`` file), at most once per ``wake_poll_interval``, or
  every ``wake_poll_interval`` where inotify is missing. When another connection has committed it
  calls the subscribers with the queue ``"*"`` (any queue). A trigger in another process thus
  starts within milliseconds instead of ``empty_poll_delay``, and an idle watcher costs nothing.
* **Busy file.** SQLite's busy handler waits in short slices; between slices the driver's thread
  is released and the retry sleeps with jitter on the event loop, until ``busy_timeout`` has passed
  and the operation fails with a retryable ``storage_unavailable``.
* **Durability.** WAL journal with ``synchronous=FULL`` by default: a commit survives a process
  crash and power loss. ``synchronous="normal"`` makes commits cheaper; the file stays consistent,
  but the last transactions may roll back after an operating system crash or power loss. The
  ``-wal`` file grows while readers hold back checkpoints; once a checkpoint has caught up, SQLite
  truncates it to ``WAL_SIZE_LIMIT`` instead of keeping its high-water mark on disk.
* **Forks.** A process forked while a driver is started gets none of it: the inherited driver
  refuses every call (without touching the parent's connection), and the child starts a driver of
  its own. A child forked in the middle of a SQLite call would inherit SQLite's mutexes and its
  bookkeeping of the file's locks mid-change, and could not open the file; so the driver's thread
  and the watcher hold a lock around each call, which an ``os.register_at_fork`` hook takes before
  the fork (see ``_before_fork``).
* **Client clock.** ``now()`` samples the injected clock once per attempt and freezes it. Clocks of
  processes sharing a file can differ; version and ownership fences still protect every write, but
  skew can cause early duplicate execution or brief capacity oversubscription.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import functools
import itertools
import logging
import os
import queue
import random
import re
import select
import socket
import sqlite3
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Awaitable, Callable, Iterable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import orjson

from runlane.durations import duration_ms
from runlane.errors import ErrorCode, RunlaneError, StorageConflictKind, create_storage_conflict_error
from runlane.models import Environment, Page, RunEventRecord, RunRecord, RunSummary, environment_key
from runlane.storage import (
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
    StorageQueryPosition,
    StorageQueryResult,
    StorageRecord,
    StorageRecordKey,
    StorageTransaction,
    decode_storage_query_cursor,
    decode_storage_tuple,
    materialize_storage_append,
    read_storage_stream_position,
    storage_stream_layouts,
)
from runlane.storage.attempt import (
    StagedWrite,
    StorageAttempt,
    WrittenDocuments,
    check_storage_keys,
    contract_violation,
    enforce_storage_limit,
    page_index_rows,
    pause_before_replay,
)
from runlane.storage.batching import Batcher
from runlane.storage.key_order import KEY_ORDERED_COLLECTION_PREFIXES, key_ordered_range, repeats_key
from runlane.storage.operator_sql import (
    OPERATOR_EVENT_COLUMNS,
    OPERATOR_RUN_COLUMNS,
    finish_event_page,
    finish_run_page,
    is_operator_event_key,
    is_operator_run_key,
    operator_event_row,
    operator_run_row,
    run_event_list_query,
    run_list_query,
)
from runlane.storage.tables import corrupt_stored_record, peek_run_document
from runlane.vocabulary import SortDirection

from runlane.storage.clock import ClientClock, Clock, SystemClock, checked_clock

__all__ = ["SCHEMA_VERSION", "SqliteStorageDriver", "sqlite_storage"]

T = TypeVar("T")
R = TypeVar("R")

logger = logging.getLogger(__name__)

#: The layout version this driver writes and reads; a file recording another one is refused.
SCHEMA_VERSION = 2

_SYNCHRONOUS = {"full": "FULL", "extra": "EXTRA", "normal": "NORMAL"}
#: Bytes the ``-wal`` file is truncated to when the log restarts after a checkpoint
#: (``PRAGMA journal_size_limit``); without it the file keeps its largest size for good.
WAL_SIZE_LIMIT = 64 * 1024 * 1024
_BUSY_SLICE = 0.1  # seconds SQLite's own busy handler waits before the driver's thread is released
_RETRY_JITTER = 0.02  # upper bound of the random pause between busy retries, in seconds
_MAX_VARIABLES = 500  # bound parameters per statement (SQLite's limit can be as low as 999)
#: The most transaction attempts one write transaction (group commit) carries.
MAX_COMMIT_BATCH = 64

# What a transaction attempt commits: (reads, writes, append, exclusive hold owner).
_Commit = tuple[dict[str, str | None], list[StagedWrite], StorageAppendCommand | None, str | None]

_RECORDS = "runlane_records"
_INDEX_ROWS = "runlane_index_rows"
_HOLDS = "runlane_holds"
_OPERATOR_RUNS = "runlane_operator_runs"
_OPERATOR_EVENTS = "runlane_operator_events"

# Column types of the operator projection tables, in the order of ``OPERATOR_*_COLUMNS``.
_OPERATOR_RUN_TYPES = {
    "environment": "TEXT NOT NULL",
    "run_id": "TEXT NOT NULL",
    "record_key": "TEXT NOT NULL",
    "tombstone_key": "TEXT NOT NULL",
    "status": "TEXT NOT NULL",
    "task_id": "TEXT NOT NULL",
    "queue": "TEXT NOT NULL",
    "idempotency_key": "TEXT",
    "singleton_key": "TEXT",
    "source_run_id": "TEXT",
    "created_at": "TEXT NOT NULL",
    "updated_at": "TEXT NOT NULL",
    "run_at": "TEXT",
    "available_missing": "INTEGER NOT NULL",
    "available_at": "TEXT NOT NULL",
}
_OPERATOR_EVENT_TYPES = {
    "environment": "TEXT NOT NULL",
    "run_id": "TEXT NOT NULL",
    "sequence": "TEXT NOT NULL",
    "record_key": "TEXT NOT NULL",
    "type": "TEXT NOT NULL",
    "occurred_at": "TEXT NOT NULL",
}


def _columns(types: dict[str, str]) -> str:
    return ", ".join(f"{column} {kind}" for column, kind in types.items())


_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS runlane_meta (name TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID",
    # Records (documents of a kilobyte or more) live in a rowid table: in a WITHOUT ROWID table a
    # page holds only a few such rows, and every write rebalances far more of the tree. Index rows and
    # holds are small, so their primary key is the table.
    f"CREATE TABLE IF NOT EXISTS {_RECORDS} ("
    "key TEXT PRIMARY KEY, version INTEGER NOT NULL, document TEXT NOT NULL, byte_size INTEGER NOT NULL, "
    "indexes TEXT NOT NULL)",
    f"CREATE TABLE IF NOT EXISTS {_INDEX_ROWS} ("
    "index_name TEXT NOT NULL, partition TEXT NOT NULL, sort TEXT NOT NULL, key TEXT NOT NULL, "
    "PRIMARY KEY (index_name, partition, sort, key)) WITHOUT ROWID",
    "CREATE TABLE IF NOT EXISTS runlane_version_counter (id INTEGER PRIMARY KEY CHECK (id = 1), last INTEGER NOT NULL)",
    "INSERT OR IGNORE INTO runlane_version_counter (id, last) VALUES (1, 0)",
    f"CREATE TABLE IF NOT EXISTS {_HOLDS} ("
    "key TEXT PRIMARY KEY, owner TEXT NOT NULL, host TEXT NOT NULL, pid INTEGER NOT NULL, expires_at REAL NOT NULL"
    ") WITHOUT ROWID",
    f"CREATE INDEX IF NOT EXISTS runlane_holds_by_owner ON {_HOLDS} (owner)",
    f"CREATE TABLE IF NOT EXISTS {_OPERATOR_RUNS} ({_columns(_OPERATOR_RUN_TYPES)}, "
    "PRIMARY KEY (environment, run_id)) WITHOUT ROWID",
    f"CREATE INDEX IF NOT EXISTS runlane_operator_runs_by_created ON {_OPERATOR_RUNS} "
    "(environment, created_at, run_id)",
    f"CREATE INDEX IF NOT EXISTS runlane_operator_runs_by_updated ON {_OPERATOR_RUNS} "
    "(environment, updated_at, run_id)",
    # A status filter reads its own runs in created order instead of scanning past the other statuses.
    f"CREATE INDEX IF NOT EXISTS runlane_operator_runs_by_status ON {_OPERATOR_RUNS} "
    "(environment, status, created_at, run_id)",
    # The run_at order reads the runs with and without an availability apart, each in this order.
    f"CREATE INDEX IF NOT EXISTS runlane_operator_runs_by_availability ON {_OPERATOR_RUNS} "
    "(environment, available_missing, available_at, run_id)",
    # Filters that pick few runs out of many read only those runs, in created order; the key columns
    # are usually empty, so their indexes hold only the runs that have one.
    f"CREATE INDEX IF NOT EXISTS runlane_operator_runs_by_task ON {_OPERATOR_RUNS} "
    "(environment, task_id, created_at, run_id)",
    f"CREATE INDEX IF NOT EXISTS runlane_operator_runs_by_idempotency_key ON {_OPERATOR_RUNS} "
    "(environment, idempotency_key, created_at, run_id) WHERE idempotency_key IS NOT NULL",
    f"CREATE INDEX IF NOT EXISTS runlane_operator_runs_by_singleton_key ON {_OPERATOR_RUNS} "
    "(environment, singleton_key, created_at, run_id) WHERE singleton_key IS NOT NULL",
    f"CREATE INDEX IF NOT EXISTS runlane_operator_runs_by_source_run ON {_OPERATOR_RUNS} "
    "(environment, source_run_id, created_at, run_id) WHERE source_run_id IS NOT NULL",
    f"CREATE TABLE IF NOT EXISTS {_OPERATOR_EVENTS} ({_columns(_OPERATOR_EVENT_TYPES)}, "
    "PRIMARY KEY (environment, run_id, sequence)) WITHOUT ROWID",
    f"CREATE INDEX IF NOT EXISTS runlane_operator_events_by_time ON {_OPERATOR_EVENTS} "
    "(environment, occurred_at, run_id, sequence)",
    # One run's events in time order (the default order of runs.events), without reading every event
    # of the environment through the time index.
    f"CREATE INDEX IF NOT EXISTS runlane_operator_events_of_run_by_time ON {_OPERATOR_EVENTS} "
    "(environment, run_id, occurred_at, sequence)",
)

_TABLES = frozenset(
    {"runlane_meta", _RECORDS, _INDEX_ROWS, "runlane_version_counter", _HOLDS, _OPERATOR_RUNS, _OPERATOR_EVENTS}
)
_SCHEMA_INDEXES = frozenset(
    statement.split()[5] for statement in _SCHEMA if statement.startswith("CREATE INDEX IF NOT EXISTS")
)


def _upsert(table: str, columns: Sequence[str], key: Sequence[str]) -> str:
    """Insert a row, or update the one with its key in place (which rewrites only the secondary
    index entries whose columns changed, where a DELETE and an INSERT would rewrite them all)."""
    changed = ", ".join(f"{column} = excluded.{column}" for column in columns if column not in key)
    return (
        f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))}) "
        f"ON CONFLICT ({', '.join(key)}) DO UPDATE SET {changed}"
    )


_UPSERT_RECORD = _upsert(_RECORDS, ("key", "version", "document", "byte_size", "indexes"), ("key",))
_UPSERT_RUN = _upsert(_OPERATOR_RUNS, OPERATOR_RUN_COLUMNS, ("environment", "run_id"))
_UPSERT_EVENT = _upsert(_OPERATOR_EVENTS, OPERATOR_EVENT_COLUMNS, ("environment", "run_id", "sequence"))
_DELETE_RUN = f"DELETE FROM {_OPERATOR_RUNS} WHERE environment = ? AND run_id = ?"
_DELETE_EVENT = f"DELETE FROM {_OPERATOR_EVENTS} WHERE environment = ? AND run_id = ? AND sequence = ?"

# SQLite primary result codes (the low byte of an extended code).
_SQLITE_ERROR, _SQLITE_PERM, _SQLITE_BUSY, _SQLITE_LOCKED, _SQLITE_NOMEM, _SQLITE_READONLY = 1, 3, 5, 6, 7, 8
_SQLITE_IOERR, _SQLITE_CORRUPT, _SQLITE_FULL, _SQLITE_CANTOPEN, _SQLITE_PROTOCOL = 10, 11, 13, 14, 15
_SQLITE_CONSTRAINT, _SQLITE_AUTH, _SQLITE_NOTADB = 19, 23, 26
_SQLITE_IOERR_SHORT_READ = _SQLITE_IOERR | 2 << 8  # extended codes
_SQLITE_IOERR_SHMSIZE = _SQLITE_IOERR | 19 << 8
# What to do about a retryable failure, after its text (workers try again by themselves); by extended
# code first, then by primary code.
_REMEDIES = {
    _SQLITE_BUSY: (
        ": another connection held the file's write lock for longer than the lane's busy_timeout; try again, "
        "raise busy_timeout, or shorten the other process's write transactions"
    ),
    _SQLITE_FULL: "; the disk holding the file is full: free space there, and workers go on by themselves",
    # The -shm file beside the database could not be extended: SQLite reports a full disk so.
    _SQLITE_IOERR_SHMSIZE: (
        ": its -shm file could not be extended, as when the disk holding the file is full: free space there, "
        "and workers go on by themselves"
    ),
    # The pages the -wal and -shm files name are not in the file: another file than theirs is at the path.
    _SQLITE_IOERR_SHORT_READ: (
        "; the file is shorter than its -wal and -shm files say, as when it was deleted or replaced while "
        "other processes had it open: stop every process using it, then start them again (what they wrote "
        "after the file was deleted or replaced is lost)"
    ),
}


# SQLite's words for a statement naming a table, column or index the file does not have.
_SCHEMA_CHANGED = ("no such table", "no such column", "has no column named", "no such index")


# ---------------------------------------------------------------------------------------------
# Exclusive hold owners


_PROCESS_TOKEN = uuid.uuid4().hex
_owner_counter = itertools.count(1)
_live_owners: set[str] = set()  # owners of this process whose attempt has not ended
_live_owners_lock = threading.Lock()


def _new_owner() -> str:
    """A hold owner id unique per attempt across processes (and forks: the pid is part of it)."""
    owner = f"{_PROCESS_TOKEN}-{os.getpid()}-{next(_owner_counter)}"
    with _live_owners_lock:
        _live_owners.add(owner)
    return owner


def _end_owner(owner: str) -> None:
    with _live_owners_lock:
        _live_owners.discard(owner)


def _owner_is_live(owner: str) -> bool:
    with _live_owners_lock:
        return owner in _live_owners


@functools.lru_cache(maxsize=4)
def _host_identity(pid: int) -> str:
    """Where a pid means this process table: the host name plus, on Linux, the pid namespace."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    return f"{socket.gethostname()}|{namespace}"


def _pid_alive(pid: int) -> bool:
    """Whether a process of this process table exists (always assumed outside POSIX)."""
    if os.name != "posix" or pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it exists but belongs to another user
        return True
    return True


# ---------------------------------------------------------------------------------------------
# Stored rows


def _dump_indexes(entries: Iterable[StorageIndexEntry]) -> str:
    return orjson.dumps([[entry.name.value, entry.encoded_partition, entry.encoded_sort] for entry in entries]).decode()


def _load_indexes(encoded_key: str, text: Any) -> list[tuple[str, str, str]]:
    try:
        rows = orjson.loads(text) if isinstance(text, str) else None
        if not isinstance(rows, list):
            raise ValueError("not a list")
        result = []
        for row in rows:
            if not (isinstance(row, list) and len(row) == 3 and all(isinstance(part, str) for part in row)):
                raise ValueError("not a [name, partition, sort] row")
            result.append((row[0], row[1], row[2]))
        return result
    except ValueError as error:
        raise corrupt_stored_record(encoded_key, "its index entries do not decode.", error) from None


def _stored_version(encoded_key: str, version: Any) -> str:
    if type(version) is not int or version < 1:
        raise corrupt_stored_record(encoded_key, f"its version {version!r} is not a positive integer.")
    return str(version)


_INDEX_NAMES = {name.value: name for name in StorageIndexName}


@functools.lru_cache(maxsize=1024)
def _decoded_partition(encoded: str) -> tuple[str, ...]:
    """Decoded index partitions: few distinct ones (environments, queues, runs of recent reads)."""
    return decode_storage_tuple(encoded)


def _stored_record(
    key: StorageRecordKey | None,
    encoded_key: str,
    version: Any,
    text: Any,
    indexes: Any,
    written: WrittenDocuments | None = None,
) -> StorageRecord:
    """A ``StorageRecord`` from a stored row; anything but a canonical row raises ``invariant_violation``.
    A document whose text is exactly one this driver replaced under that key (``written``) is that
    document, already holding its decoded value."""
    checked_version = _stored_version(encoded_key, version)
    if not isinstance(text, str):
        raise corrupt_stored_record(encoded_key, "its document is not text.")
    document = None if written is None else written.recall(encoded_key, text)
    if document is None:
        try:
            document = StorageDocument.parse(text)
        except RunlaneError as error:
            raise corrupt_stored_record(encoded_key, error.message, error) from None
    entries = []
    try:
        if key is None:
            key = StorageRecordKey.decode(encoded_key)
        for name, partition, sort in _load_indexes(encoded_key, indexes):
            index = _INDEX_NAMES.get(name)
            if index is None:
                raise corrupt_stored_record(encoded_key, f"an index entry names an unknown index {name!r}.")
            entries.append(
                StorageIndexEntry._trusted(
                    index, _decoded_partition(partition), decode_storage_tuple(sort), partition, sort
                )
            )
    except RunlaneError as error:
        if error.code is ErrorCode.INVARIANT_VIOLATION:
            raise
        raise corrupt_stored_record(encoded_key, error.message, error) from None
    return StorageRecord(key, checked_version, document, tuple(entries))


def _chunks(items: Sequence[T], size: int = _MAX_VARIABLES) -> list[Sequence[T]]:
    return [items[start : start + size] for start in range(0, len(items), size)]


def _placeholders(count: int) -> str:
    return ", ".join("?" * count)


def _index_query(
    query: StorageQuery, after: StorageQueryPosition | None, limit: int, holder: str | None
) -> tuple[str, list[Any]]:
    """The SELECT of one page of index rows in query order, strictly after ``after``; with ``holder``,
    rows held by any other owner are skipped.

    For a key-ordered index name (``runlane.storage.key_order``) the page merges the index rows of
    entries that do not restate their record's key with the key range of the records whose keys do
    (each checked to list the entry), each cut to the page first."""
    descending = query.direction is SortDirection.DESC
    order = "DESC" if descending else "ASC"
    bounds = query.range
    present = [
        (operator, value)
        for operator, value in ((">", bounds.gt), (">=", bounds.gte), ("<", bounds.lt), ("<=", bounds.lte))
        if value is not None
    ]
    clauses = ["index_name = ?", "partition = ?", *(f"sort {operator} ?" for operator, _ in present)]
    params: list[Any] = [query.index.value, query.encoded_partition, *(value for _, value in present)]
    if after is not None:
        clauses.append(f"(sort, key) {'<' if descending else '>'} (?, ?)")
        params.extend((after.sort, after.key))
    if holder is not None:
        clauses.append(f"NOT EXISTS (SELECT 1 FROM {_HOLDS} h WHERE h.key = i.key AND h.owner != ?)")
        params.append(holder)
    keyed_range = key_ordered_range(query.index, query.encoded_partition)
    if keyed_range is not None:
        # A row that restates its key (left by a process running an earlier version) is read from
        # the records instead: skip it here, or it would be returned twice.
        clauses.append("key <> ? || sort")
        params.append(keyed_range.prefix)
    params.append(limit)
    rows = (
        f"SELECT sort, key FROM {_INDEX_ROWS} i WHERE {' AND '.join(clauses)} "
        f"ORDER BY sort {order}, key {order} LIMIT ?"
    )
    if keyed_range is None:
        return rows, params
    prefix, start = keyed_range.prefix, keyed_range.start
    # The records' key range (KeyOrderedRange); a sort bound is the prefix + bound.
    keyed = ["r.key >= ?", "r.key < ?", *(f"r.key {operator} ?" for operator, _ in present)]
    params.extend((start, prefix, keyed_range.upper, *(prefix + value for _, value in present)))
    if after is not None:
        keyed.append(
            f"r.key {'<=' if descending else '>='} ? AND (substr(r.key, ?), r.key) {'<' if descending else '>'} (?, ?)"
        )
        params.extend((prefix + after.sort, start, after.sort, after.key))
    if holder is not None:
        keyed.append(f"NOT EXISTS (SELECT 1 FROM {_HOLDS} h WHERE h.key = r.key AND h.owner != ?)")
        params.append(holder)
    keyed.append("instr(r.indexes, ? || substr(r.key, ?) || '\"]') > 0")  # the entry in _dump_indexes' form
    params.extend((orjson.dumps([query.index.value, query.encoded_partition, ""]).decode()[:-2], start, limit, limit))
    by_key = (
        f"SELECT substr(r.key, ?) AS sort, r.key AS key FROM {_RECORDS} r WHERE {' AND '.join(keyed)} "
        f"ORDER BY r.key {order} LIMIT ?"
    )
    sql = (
        f"SELECT sort, key FROM (SELECT * FROM ({rows}) UNION ALL SELECT * FROM ({by_key})) "
        f"ORDER BY sort {order}, key {order} LIMIT ?"
    )
    return sql, params


# ---------------------------------------------------------------------------------------------
# Errors


class _Busy(Exception):
    """The database stayed locked for one busy slice; the driver retries until ``busy_timeout``."""


def _primary_code(error: sqlite3.Error) -> int | None:
    code = getattr(error, "sqlite_errorcode", None)
    return None if code is None else code & 0xFF


def _is_busy(error: sqlite3.Error) -> bool:
    code = _primary_code(error)
    if code is not None:
        return code in (_SQLITE_BUSY, _SQLITE_LOCKED)
    return isinstance(error, sqlite3.OperationalError) and "locked" in str(error)


# ---------------------------------------------------------------------------------------------
# Transaction attempts


class _SqliteTransaction(StorageAttempt):
    """One attempt of a transaction callback.

    ``StorageAttempt`` keeps the contract's bookkeeping; this class reads through the driver,
    answers repeated reads of a key with the record first read, and holds exclusive candidates
    under an owner id of its own.
    """

    def __init__(self, driver: SqliteStorageDriver, limits: StorageLimits, clock: Clock) -> None:
        super().__init__(limits, clock)
        self._driver = driver
        self._seen: dict[str, StorageRecord | None] = {}
        self.owner: str | None = None  # set by the first exclusive selection
        self.holding = False  # some selection recorded holds (to release unless the commit did)

    async def _fetch(self, keys: list[StorageRecordKey]) -> list[StorageRecord | None]:
        seen = self._seen
        unseen = [key for key in keys if key.encoded not in seen]
        if unseen:
            found = await self._driver._read(unseen)
            for key, record in zip(unseen, found):
                seen.setdefault(key.encoded, record)
        return [seen[key.encoded] for key in keys]

    async def _candidates(self, query: StorageQuery, mode: StorageCandidateMode) -> StorageQueryResult:
        if mode != StorageCandidateMode.EXCLUSIVE:
            return await self._driver._query(query)
        if self.owner is None:
            self.owner = _new_owner()
        result = await self._driver._select_exclusive(query, self.owner)
        self.holding = self.holding or bool(result.items)
        return result


# ---------------------------------------------------------------------------------------------
# Forks


#: The most seconds a fork waits for the SQLite calls in flight to end (see ``_before_fork``).
_FORK_WAIT = 10.0
#: The most seconds ``start()`` waits for its connection to open (see ``SqliteStorageDriver.start``).
_CONNECT_TIMEOUT = 10.0

# Everything of this process whose threads make SQLite calls, each call inside its ``_fork_lock``.
_fork_guarded: weakref.WeakSet[_DriverThread | SqliteStorageDriver] = weakref.WeakSet()
_fork_guarded_lock = threading.Lock()
_fork_held: dict[int, list[threading.RLock]] = {}  # the locks each forking thread took, by thread id
_fork_hooks_registered = False


def _guard_forks(guarded: _DriverThread | SqliteStorageDriver) -> None:
    """Make forks of this process wait for ``guarded``'s SQLite calls (held only weakly: an object
    nobody uses any more needs no guard)."""
    global _fork_hooks_registered
    with _fork_guarded_lock:
        _fork_guarded.add(guarded)
        if not _fork_hooks_registered and hasattr(os, "register_at_fork"):
            os.register_at_fork(
                before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child
            )
            _fork_hooks_registered = True


def _before_fork() -> None:
    """Let every SQLite call in flight end, and start no other, until the fork is done.

    A child forked in the middle of a SQLite call inherits SQLite's mutexes and its bookkeeping of
    the file's locks as that call left them, owned by a thread that does not exist in the child:
    opening the same file there hangs, or finds it locked for good. So the fork first takes the
    lock every driver thread (and wake hint watcher) holds around each call and transaction. No
    such call waits for another thread, so the wait is short; the forking thread's own lock (a
    fork from inside a call) is reentrant; the locks are taken in one order, so two threads forking
    at once cannot hold each other up; and past ``_FORK_WAIT`` the fork goes ahead anyway rather
    than hang the process behind a call that never ends.
    """
    with _fork_guarded_lock:
        guarded = sorted(_fork_guarded, key=id)
    deadline = time.monotonic() + _FORK_WAIT
    held = _fork_held.setdefault(threading.get_ident(), [])
    for each in guarded:
        lock = each._fork_lock
        if lock.acquire(timeout=max(deadline - time.monotonic(), 0.0)):
            held.append(lock)


def _after_fork_in_parent() -> None:
    for lock in reversed(_fork_held.pop(threading.get_ident(), [])):
        lock.release()


def _after_fork_in_child() -> None:
    """The child has only the forking thread: every inherited driver thread, watcher and the parent's
    connections stay with the parent. Mark them unusable without touching any connection (closing
    one would act on the parent's file state), and give the child fresh locks, since any of the old
    ones may have been held by a thread that is gone."""
    global _fork_guarded, _fork_guarded_lock, _live_owners_lock
    _fork_held.clear()
    inherited = list(_fork_guarded)
    _fork_guarded = weakref.WeakSet()
    _fork_guarded_lock = threading.Lock()
    for each in inherited:
        each._after_fork_in_child()
    _live_owners_lock = threading.Lock()
    _live_owners.clear()  # the parent's attempts do not run here


# ---------------------------------------------------------------------------------------------
# The driver


_Call = tuple["concurrent.futures.Future[Any]", Callable[..., Any], tuple[Any, ...]]


class _DriverThread:
    """The driver's one thread, running submitted calls in order: a ``ThreadPoolExecutor`` of one worker
    that still takes work while the interpreter exits. ``concurrent.futures`` refuses new work once its
    exit hook has run, which comes before ``atexit`` hooks, so a runtime closed by one (the sync facade's,
    for a web app that never calls ``close()``) could not write the outcomes of the attempts it waits
    for. A daemon thread: a driver nobody closes does not keep the process from exiting."""

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._shut = False
        self._forked = False  # inherited by a forked child, where the thread does not exist
        self._fork_lock = threading.RLock()  # held around every call, so a fork comes between two (_before_fork)
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        _guard_forks(self)  # for as long as the thread runs: it holds this object
        self._thread.start()

    def submit(self, function: Callable[..., R], *args: Any) -> concurrent.futures.Future[R]:
        if self._forked:  # before the lock, which a thread of the parent may have held at the fork
            raise RuntimeError("cannot schedule new calls in a forked process")
        future: concurrent.futures.Future[R] = concurrent.futures.Future()
        with self._lock:  # never queued behind the shutdown marker, where nothing would run it
            if self._shut:
                raise RuntimeError("cannot schedule new calls after shutdown")
            self._calls.put((future, function, args))
        return future

    def shutdown(self, wait: bool = True) -> None:
        if self._forked:
            return
        with self._lock:
            if not self._shut:
                self._shut = True
                self._calls.put(None)
        if wait and threading.current_thread() is not self._thread:
            self._thread.join()

    def _serve(self) -> None:
        while (call := self._calls.get()) is not None:
            future, function, args = call
            if not future.set_running_or_notify_cancel():
                continue
            try:
                with self._fork_lock:  # each call is one whole transaction: none is left open at a fork
                    result = function(*args)
            except BaseException as error:  # noqa: BLE001 - handed to the caller, as an executor does
                future.set_exception(error)
            else:
                future.set_result(result)

    def _after_fork_in_child(self) -> None:
        """In a forked child: refuse every call (the thread stayed with the parent), with fresh locks."""
        self._forked = True
        self._lock = threading.Lock()
        self._fork_lock = threading.RLock()


_SQLITE_HEADER = b"SQLite format 3\x00"  # the first 16 bytes of every SQLite database file


class SqliteStorageDriver(ClientClock):
    """Durable ``StorageDriver`` and ``OperatorReadDriver`` over one SQLite file (see the module docstring)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        clock: Clock | None = None,
        limits: StorageLimits | None = None,
        max_transaction_attempts: int = 16,
        busy_timeout: float | str | timedelta = 5.0,
        hold_timeout: float | str | timedelta = 30.0,
        synchronous: str = "full",
        name: str = "sqlite-storage",
    ) -> None:
        if not isinstance(path, (str, os.PathLike)):
            raise RunlaneError(ErrorCode.CONFIGURATION_INVALID, "path must be a file path (str or os.PathLike).")
        raw = os.fspath(path)
        if not isinstance(raw, str):
            raise RunlaneError(ErrorCode.CONFIGURATION_INVALID, f"The SQLite storage path must be text, got {raw!r}.")
        expanded = expand_database_path(raw)
        if clock is not None:
            checked_clock(clock)
        if limits is not None and not isinstance(limits, StorageLimits):
            raise RunlaneError(ErrorCode.CONFIGURATION_INVALID, "limits must be a StorageLimits value.")
        attempts = max_transaction_attempts
        if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
            raise RunlaneError(ErrorCode.CONFIGURATION_INVALID, "max_transaction_attempts must be a positive integer.")
        if not isinstance(synchronous, str) or synchronous.lower() not in _SYNCHRONOUS:
            raise RunlaneError(
                ErrorCode.CONFIGURATION_INVALID,
                f"synchronous must be one of {', '.join(sorted(_SYNCHRONOUS))}, got {synchronous!r}.",
            )
        if not isinstance(name, str) or not name:
            raise RunlaneError(ErrorCode.CONFIGURATION_INVALID, "name must be a non-empty string.")
        self.name = name
        self.path = expanded.absolute()
        self.synchronous = synchronous.lower()
        self._lowered = False  # the connection runs below the configured durability (``_unsynced``)
        self._written = WrittenDocuments()  # documents this driver replaced, recognized when read back
        # Per event loop (a batcher's futures belong to one loop); closed loops are dropped.
        self._committers: dict[asyncio.AbstractEventLoop, Batcher[_Commit, bool]] = {}
        self._committers_lock = threading.Lock()
        self._subscribers: dict[object, Callable[[str], None]] = {}  # wake hint callbacks
        # The watcher thread, its stop flag and the pipe end that wakes it from its wait.
        self._watcher: tuple[threading.Thread, threading.Event, int] | None = None
        self._watch_lock = threading.Lock()
        self._fork_lock = threading.RLock()  # held by the watcher around its SQLite calls (_before_fork)
        self.busy_timeout = _seconds(busy_timeout, "busy_timeout")
        self.hold_timeout = _seconds(hold_timeout, "hold_timeout")
        self.max_transaction_attempts = attempts
        self.profile = StorageProfile(
            durability=StorageDurability.DURABLE,
            clock_authority=StorageClockAuthority.CLIENT,
            index_consistency=StorageIndexConsistency.STRONG,
            limits=limits or StorageLimits(),
            exclusive_candidates=True,
            ordered_append=True,
            process_local=False,
        )
        self._clock: Clock = clock or SystemClock()
        self._executor: _DriverThread | None = None
        self._connection: sqlite3.Connection | None = None
        self._pid = 0  # the process that started the driver (a forked child must start its own)

    def __repr__(self) -> str:
        return f"SqliteStorageDriver(name={self.name!r}, path={str(self.path)!r})"

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        """Open the file (creating it and its schema when absent) on the driver's own thread."""
        if self._executor is not None:
            return
        self._check_path()
        executor = _DriverThread(f"runlane-{self.name}")
        self._executor = executor
        self._pid = os.getpid()
        _guard_forks(self)
        opening = executor.submit(self._connect)
        try:
            try:
                opened = asyncio.shield(asyncio.wrap_future(opening))
                self._connection = await asyncio.wait_for(opened, _CONNECT_TIMEOUT)
            except TimeoutError:
                raise RunlaneError(
                    ErrorCode.STORAGE_UNAVAILABLE,
                    f"SQLite storage {str(self.path)!r} did not open within {_CONNECT_TIMEOUT:g}s: SQLite is stuck "
                    "in this process, as after a fork in the middle of a SQLite call by code other than this "
                    "driver. Create the lane in a process started fresh (subprocess, or multiprocessing's "
                    "'spawn' start method), or fork before anything in the process uses SQLite.",
                    meta={"path": str(self.path), "timeout": _CONNECT_TIMEOUT},
                ) from None
            await self._call(self._prepare)
        except BaseException:
            self._executor = None
            # Closed on the driver's thread after the connect, even one still stuck: waited for only
            # when the connect has ended, so a stuck one leaves nothing hanging here.
            closing = executor.submit(self._close_opened, opening)
            executor.shutdown(wait=False)
            if opening.done():
                await asyncio.shield(asyncio.wrap_future(closing))
            raise

    async def close(self) -> None:
        """Close the connection after the operations already queued; later calls fail until ``start()``."""
        self._stop_watcher()
        executor = self._executor
        if executor is None:
            return
        self._executor = None
        if self._pid != os.getpid():
            # A forked child inherited the driver: its thread runs only in the parent, which still uses
            # the connection, so the child lets go of both without touching them.
            self._connection = None
            return
        try:
            await asyncio.shield(asyncio.wrap_future(executor.submit(self._close_connection)))
        finally:
            executor.shutdown(wait=False)

    def _file_directory(self) -> Path:
        """Where SQLite keeps the ``-wal`` and ``-shm`` files: beside the file a symbolic link names."""
        return Path(os.path.realpath(self.path)).parent

    def _check_path(self) -> None:
        path = self.path
        directory = self._file_directory()

        def refuse(why: str) -> RunlaneError:
            message = f"Cannot open SQLite storage {str(path)!r}: {why}"
            return RunlaneError(ErrorCode.CONFIGURATION_INVALID, message, meta={"path": str(path)})

        try:  # a name too long for the file system, a loop of links: no file can be there
            if not directory.is_dir():
                if directory.exists():  # a file where the path needs a directory ("app.db/runlane.db")
                    raise refuse(f"{str(directory)!r} is a file, not a directory, so no database file can be in it.")
                raise refuse(f"the directory {str(directory)!r} does not exist.")
            if path.is_dir():
                raise refuse("it is a directory, not a database file.")
            if path.exists() and not path.is_file():
                raise refuse("it is not a regular file (a device, a pipe or a socket), so not a database file.")
            if path.is_symlink() and not path.exists():  # exists() is False for a loop of links too
                with contextlib.suppress(FileNotFoundError):  # a link to a file yet to be created is fine
                    os.stat(path)
            header = b""
            with contextlib.suppress(FileNotFoundError, PermissionError):  # no file yet; access is checked below
                with open(path, "rb") as file:
                    header = file.read(len(_SQLITE_HEADER))
        except OSError as error:
            raise refuse(f"{error.strerror or error}.") from None
        # SQLite takes a file of a byte or so for an empty database and overwrites it; any other file that is
        # not a database it refuses. (An empty file is a database whose pages are all in its write-ahead log.)
        if header and header != _SQLITE_HEADER:
            raise RunlaneError(
                ErrorCode.CONFIGURATION_INVALID,
                f"SQLite storage {str(path)!r} is not a SQLite database (it does not start with SQLite's header): "
                "point the lane at its Runlane database, or at a path where no file exists yet to create one.",
                meta={"path": str(path)},
            )
        # WAL mode creates ``<file>-wal`` and ``<file>-shm`` beside the database, so the directory
        # must be writable even when the file exists.
        if not os.access(directory, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.R_OK | os.W_OK)):
            raise refuse(
                "the file and its directory must be readable and writable (SQLite keeps its write-ahead log "
                "beside the file)."
            )

    def _connect(self) -> sqlite3.Connection:
        try:
            return sqlite3.connect(
                str(self.path),
                timeout=min(self.busy_timeout, _BUSY_SLICE),
                isolation_level=None,  # transactions are explicit: BEGIN / BEGIN IMMEDIATE ... COMMIT
                check_same_thread=False,
            )
        except sqlite3.Error as error:
            raise self._error(error, opening=True) from error

    def _prepare(self, connection: sqlite3.Connection) -> None:
        try:
            # Any statement reads the header: a file that is not a database fails here. Another
            # application's database is refused before anything changes it (WAL mode is persistent).
            self._refuse_foreign(connection)
            mode = connection.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise RunlaneError(
                    ErrorCode.CONFIGURATION_INVALID,
                    f"SQLite storage {str(self.path)!r} cannot use write-ahead logging (journal mode {mode!r}); "
                    "put the file on a local file system.",
                    meta={"path": str(self.path)},
                )
            connection.execute(f"PRAGMA synchronous = {_SYNCHRONOUS[self.synchronous]}")
            connection.execute(f"PRAGMA journal_size_limit = {int(WAL_SIZE_LIMIT)}")
            self._ensure_schema(connection)
        except sqlite3.Error as error:
            if _is_busy(error):
                raise
            if connection.in_transaction:
                connection.execute("ROLLBACK")
            raise self._error(error, opening=True) from error

    def _ensure_schema(self, connection: sqlite3.Connection) -> None:
        """Create the schema in a file without one; check the version and tables of a file with one.

        A file whose schema is already current is only read (starting a lane never waits for a writer
        of another process); anything to create or upgrade runs in one write transaction, so processes
        starting together do it once.
        """
        if self._schema_is_current(connection):
            return
        path = str(self.path)
        connection.execute("BEGIN IMMEDIATE")
        tables = self._refuse_foreign(connection)
        if "runlane_meta" not in tables:
            for statement in _SCHEMA:
                connection.execute(statement)
            connection.execute(
                "INSERT INTO runlane_meta (name, value) VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),)
            )
            connection.execute("COMMIT")
            return
        row = connection.execute("SELECT value FROM runlane_meta WHERE name = 'schema_version'").fetchone()
        found = None if row is None else row[0]
        if found == "1":  # version 2 keeps no index row for an entry that restates its record's key
            for name, collection in KEY_ORDERED_COLLECTION_PREFIXES.items():
                connection.execute(
                    f"DELETE FROM {_INDEX_ROWS} WHERE index_name = ? AND key = ? || partition || '/' || sort",
                    (name, collection),
                )
            connection.execute(
                "UPDATE runlane_meta SET value = ? WHERE name = 'schema_version'", (str(SCHEMA_VERSION),)
            )
            found = str(SCHEMA_VERSION)
        if found != str(SCHEMA_VERSION):
            newer = isinstance(found, str) and found.isdecimal() and int(found) > SCHEMA_VERSION
            remedy = (
                "it was written by a newer release of runlane-local: upgrade runlane-local in every process "
                "that opens the file"
                if newer
                else "it is not a layout any release of runlane-local writes: restore the file from a backup, "
                "or give Runlane a new file"
            )
            raise RunlaneError(
                ErrorCode.CONFIGURATION_INVALID,
                f"SQLite storage {path!r} has schema version {found!r}; this driver reads version "
                f"{SCHEMA_VERSION} only (and upgrades version 1): {remedy}.",
                meta={"path": path, "schema_version": found},
            )
        missing = sorted(_TABLES - tables)
        if missing or connection.execute("SELECT last FROM runlane_version_counter WHERE id = 1").fetchone() is None:
            what = ", ".join(missing) or "the version counter"
            raise RunlaneError(
                ErrorCode.INVARIANT_VIOLATION,
                f"SQLite storage {path!r} has an incomplete Runlane schema (missing {what}): something other "
                "than Runlane changed the file; restore it from a backup, or give Runlane a new file.",
                meta={"path": path, "missing": missing},
            )
        for statement in _SCHEMA:  # indexes added since the file was created (derived data only)
            if statement.startswith("CREATE INDEX IF NOT EXISTS"):
                connection.execute(statement)
        connection.execute("COMMIT")

    def _refuse_foreign(self, connection: sqlite3.Connection) -> set[str]:
        """The file's table names; ``configuration_invalid`` when it holds tables but not Runlane's."""
        tables = {row[0] for row in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        foreign = sorted(name for name in tables if not name.startswith("sqlite_"))
        if foreign and "runlane_meta" not in tables:
            path = str(self.path)
            raise RunlaneError(
                ErrorCode.CONFIGURATION_INVALID,
                f"SQLite storage {path!r} is a database of something else (tables {', '.join(foreign[:5])}); "
                "give Runlane a file of its own.",
                meta={"path": path},
            )
        return tables

    def _schema_is_current(self, connection: sqlite3.Connection) -> bool:
        """Whether every table, index and the version of this schema are there, in one read transaction."""
        connection.execute("BEGIN")
        try:
            listed = connection.execute("SELECT name FROM sqlite_master WHERE type IN ('table', 'index')")
            names = {row[0] for row in listed}
            if not (_TABLES | _SCHEMA_INDEXES) <= names or "runlane_meta" not in names:
                return False
            row = connection.execute("SELECT value FROM runlane_meta WHERE name = 'schema_version'").fetchone()
            counter = connection.execute("SELECT last FROM runlane_version_counter WHERE id = 1").fetchone()
            return row is not None and row[0] == str(SCHEMA_VERSION) and counter is not None
        finally:
            # A read that failed may have ended the transaction itself (an I/O error does): a COMMIT
            # then would fail too and hide that failure.
            if connection.in_transaction:
                connection.execute("COMMIT")

    def _close_opened(self, opening: concurrent.futures.Future[sqlite3.Connection]) -> None:
        """Close the connection ``opening`` opened, if it did (a failed ``start()``)."""
        if opening.cancelled() or opening.exception() is not None:
            return
        connection = opening.result()
        if self._connection is connection:
            self._connection = None
        _close(connection)

    def _close_connection(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            _close(connection)

    def _after_fork_in_child(self) -> None:
        """In a forked child: the driver stays refused (``_pid``), its watcher thread is gone; fresh locks."""
        self._fork_lock = threading.RLock()
        self._watch_lock = threading.Lock()
        self._committers_lock = threading.Lock()

    # -- running on the driver's thread ------------------------------------------------------------

    def _closed(self) -> RunlaneError:
        return RunlaneError(ErrorCode.STORAGE_UNAVAILABLE, f"Storage driver {self.name!r} is not started (or closed).")

    def _error(self, error: sqlite3.Error, *, opening: bool = False) -> RunlaneError:
        """The ``RunlaneError`` of a SQLite failure."""
        code = _primary_code(error)
        where = f"SQLite storage {str(self.path)!r}"
        meta = {"path": str(self.path), "sqlite_error": getattr(error, "sqlite_errorname", type(error).__name__)}
        if code == _SQLITE_NOTADB:
            return RunlaneError(
                ErrorCode.CONFIGURATION_INVALID,
                f"{where} is not a SQLite database ({error}): point the lane at its Runlane database, or at a "
                "path where no file exists yet to create one.",
                meta=meta,
                cause=error,
            )
        if code == _SQLITE_CORRUPT:
            return RunlaneError(
                ErrorCode.INVARIANT_VIOLATION,
                f"{where} is corrupt ({error}): stop every process using it and restore it from a backup, or "
                "salvage what is left with 'sqlite3 FILE .recover' into a new file.",
                meta=meta,
                cause=error,
            )
        if code == _SQLITE_CONSTRAINT:
            return RunlaneError(
                ErrorCode.INVARIANT_VIOLATION, f"{where} violates its own constraints: {error}", meta=meta, cause=error
            )
        if code == _SQLITE_ERROR:  # SQLite refused a statement of this driver's
            if any(text in str(error) for text in _SCHEMA_CHANGED):
                return RunlaneError(
                    ErrorCode.INVARIANT_VIOLATION,
                    f"{where} does not have the Runlane schema this release reads ({error}): something other than "
                    "Runlane changed the file; restore it from a backup, or give Runlane a new file.",
                    meta=meta,
                    cause=error,
                )
            return RunlaneError(
                ErrorCode.INTERNAL_ERROR, f"{where} refused a statement: {error}", meta=meta, cause=error
            )
        if code in (_SQLITE_CANTOPEN, _SQLITE_PERM, _SQLITE_READONLY, _SQLITE_AUTH):
            kind = ErrorCode.CONFIGURATION_INVALID if opening else ErrorCode.STORAGE_UNAVAILABLE
            return RunlaneError(
                kind,
                f"{where} cannot be opened for writing: {error}; let this user write the file, the -wal and -shm "
                "files beside it and their folder.",
                meta=meta,
                cause=error,
            )
        if code in (_SQLITE_BUSY, _SQLITE_LOCKED, _SQLITE_IOERR, _SQLITE_FULL, _SQLITE_NOMEM, _SQLITE_PROTOCOL):
            remedy = _REMEDIES.get(error.sqlite_errorcode, _REMEDIES.get(code, "; try again"))
            return RunlaneError(
                ErrorCode.STORAGE_UNAVAILABLE,
                f"{where} is unavailable: {error}{remedy}.",
                retryable=True,
                meta=meta,
                cause=error,
            )
        return RunlaneError(ErrorCode.STORAGE_UNAVAILABLE, f"{where} failed: {error}", meta=meta, cause=error)

    def _guarded(self, operation: Callable[..., R], *args: Any) -> R:
        """Run ``operation(connection, *args)`` on the driver's thread; roll back whatever it left open."""
        connection = self._connection
        if connection is None:
            raise self._closed()
        try:
            if self._lowered:  # a hold transaction failed before restoring the durability
                self._synced(connection)
            return operation(connection, *args)
        except BaseException as error:
            if connection.in_transaction:
                try:
                    connection.execute("ROLLBACK")
                except sqlite3.Error:
                    pass
            if isinstance(error, sqlite3.Error):
                if _is_busy(error):
                    raise _Busy() from error
                raise self._error(error) from error
            raise

    async def _call(self, operation: Callable[..., R], *args: Any, shield: bool = False) -> R:
        """``operation`` on the driver's thread, retried with jitter while the file is busy (bounded by
        ``busy_timeout``). ``shield`` keeps it running when the caller is cancelled."""
        deadline: float | None = None
        while True:
            executor = self._executor
            if executor is None:
                raise self._closed()
            if self._pid != os.getpid():
                raise RunlaneError(
                    ErrorCode.STORAGE_UNAVAILABLE,
                    f"Storage driver {self.name!r} was started in process {self._pid}; a forked process must "
                    "create and start a driver of its own.",
                )
            try:
                future = asyncio.wrap_future(executor.submit(self._guarded, operation, *args))
            except RuntimeError:  # shut down by a concurrent close()
                raise self._closed() from None
            try:
                return await (asyncio.shield(future) if shield else future)
            except _Busy as busy:
                now = time.monotonic()
                if deadline is None:
                    deadline = now + max(self.busy_timeout - _BUSY_SLICE, 0.0)
                if now >= deadline:
                    raise RunlaneError(
                        ErrorCode.STORAGE_UNAVAILABLE,
                        f"SQLite storage {str(self.path)!r} stayed locked for {self.busy_timeout:g}s (database is "
                        f"locked){_REMEDIES[_SQLITE_BUSY]}.",
                        retryable=True,
                        meta={"path": str(self.path), "busy_timeout": self.busy_timeout},
                        cause=busy.__cause__,
                    ) from busy.__cause__
                await asyncio.sleep(random.uniform(0, _RETRY_JITTER))

    # -- reads -------------------------------------------------------------------------------------

    async def _read(self, keys: list[StorageRecordKey]) -> list[StorageRecord | None]:
        return await self._call(self._read_records, keys)

    def _read_records(self, connection: sqlite3.Connection, keys: list[StorageRecordKey]) -> list[StorageRecord | None]:
        unique = list({key.encoded: key for key in keys}.values())
        rows: dict[str, tuple[Any, ...]] = {}
        chunks = _chunks(unique)
        if len(chunks) > 1:
            connection.execute("BEGIN")  # one snapshot for every chunk
        for chunk in chunks:
            sql = (
                f"SELECT key, version, document, indexes FROM {_RECORDS} "
                f"WHERE key IN ({_placeholders(len(chunk))})"
            )
            for row in connection.execute(sql, [key.encoded for key in chunk]):
                rows[row[0]] = row
        if connection.in_transaction:
            connection.execute("COMMIT")
        records: dict[str, StorageRecord] = {}
        for key in unique:
            row = rows.get(key.encoded)
            if row is not None:
                records[key.encoded] = _stored_record(key, row[0], row[1], row[2], row[3], self._written)
        return [records.get(key.encoded) for key in keys]

    async def _query(self, query: StorageQuery) -> StorageQueryResult:
        after = decode_storage_query_cursor(query)
        sql, params = _index_query(query, after, query.limit + 1, None)
        rows = await self._call(_fetch_all, sql, params)
        return page_index_rows(query, iter(rows), look_ahead=True)

    async def _select_exclusive(self, query: StorageQuery, owner: str) -> StorageQueryResult:
        after = decode_storage_query_cursor(query)
        sql, params = _index_query(query, after, query.limit, owner)
        probe = _index_query(query, after, 1, None)
        rows = await self._call(self._hold_rows, sql, params, owner, probe)
        return page_index_rows(query, iter(rows), look_ahead=False)

    def _hold_rows(
        self,
        connection: sqlite3.Connection,
        sql: str,
        params: list[Any],
        owner: str,
        probe: tuple[str, list[Any]],
    ) -> list[tuple[str, str]]:
        """Select free rows and hold them for ``owner``, in one write transaction; none is needed when
        ``probe`` (the same page, held rows included) finds no row at all, as an idle worker's scan."""
        if not connection.execute(*probe).fetchone():
            return []
        now = time.time()
        pid = os.getpid()
        host = _host_identity(pid)
        self._unsynced(connection)
        connection.execute("BEGIN IMMEDIATE")
        connection.execute(f"DELETE FROM {_HOLDS} WHERE expires_at <= ?", (now,))
        stale = []
        alive: dict[int, bool] = {}
        holders = connection.execute(f"SELECT DISTINCT owner, host, pid FROM {_HOLDS} WHERE owner != ?", (owner,))
        for other, other_host, other_pid in holders.fetchall():
            if other_host != host:
                continue  # another machine's (or pid namespace's) process: only expiry frees it
            if other_pid == pid:
                dead = not _owner_is_live(other)
            else:
                if other_pid not in alive:
                    alive[other_pid] = _pid_alive(other_pid)
                dead = not alive[other_pid]
            if dead:
                stale.append((other,))
        if stale:
            connection.executemany(f"DELETE FROM {_HOLDS} WHERE owner = ?", stale)
        rows = connection.execute(sql, params).fetchall()
        expires = now + self.hold_timeout
        connection.executemany(
            f"INSERT OR REPLACE INTO {_HOLDS} (key, owner, host, pid, expires_at) VALUES (?, ?, ?, ?, ?)",
            [(key, owner, host, pid, expires) for _, key in rows],
        )
        connection.execute("COMMIT")
        self._synced(connection)
        return rows

    def _unsynced(self, connection: sqlite3.Connection) -> None:
        """Commit the next transaction without syncing the log (for holds only: see the module notes)."""
        if self.synchronous != "normal":
            self._lowered = True
            connection.execute("PRAGMA synchronous = NORMAL")

    def _synced(self, connection: sqlite3.Connection) -> None:
        """Back to the configured durability (``_guarded`` calls it first when a hold transaction
        failed before it could)."""
        if self._lowered:
            connection.execute(f"PRAGMA synchronous = {_SYNCHRONOUS[self.synchronous]}")
            self._lowered = False

    def _delete_holds(self, connection: sqlite3.Connection, owner: str) -> None:
        self._unsynced(connection)
        connection.execute("BEGIN IMMEDIATE")
        connection.execute(f"DELETE FROM {_HOLDS} WHERE owner = ?", (owner,))
        connection.execute("COMMIT")
        self._synced(connection)

    async def _release(self, owner: str) -> None:
        """Drop ``owner``'s holds (kept running if the caller is cancelled); a failure leaves them to expire."""
        try:
            await self._call(self._delete_holds, owner, shield=True)
        except RunlaneError as error:
            logger.warning("Could not release exclusive holds in %s; they expire on their own: %s", self.path, error)
        finally:
            _end_owner(owner)

    # -- commit ------------------------------------------------------------------------------------

    def _validate(self, connection: sqlite3.Connection, reads: dict[str, str | None]) -> bool:
        """Whether every read of a read-only attempt still holds, checked in one read transaction."""
        connection.execute("BEGIN")
        current = _current_rows(connection, list(reads))
        connection.execute("COMMIT")
        return all(_version_of(current.get(key)) == version for key, version in reads.items())

    def _commit_batch(self, connection: sqlite3.Connection, attempts: Sequence[_Commit]) -> list[bool | RunlaneError]:
        """Validate and apply attempts in one write transaction (one log sync for all), in order, so a
        later attempt sees the earlier ones' writes. Per attempt: ``True`` (committed), ``False`` (a
        read or expected version changed: replay it) or the error it raised. In a batch of several,
        an attempt that conflicts or fails is rolled back alone, to a savepoint; a lone attempt's
        error, and one after which SQLite rolled back the whole transaction, is raised (``_guarded``
        rolls back)."""
        projections = [_projection_changes(writes) for _, writes, _, _ in attempts]  # decoded before the lock
        alone = len(attempts) == 1
        connection.execute("BEGIN IMMEDIATE")
        counter = connection.execute("SELECT last FROM runlane_version_counter WHERE id = 1").fetchone()
        if counter is None or type(counter[0]) is not int:
            raise RunlaneError(
                ErrorCode.INVARIANT_VIOLATION,
                f"SQLite storage {str(self.path)!r} lost its version counter: something other than Runlane changed "
                "the file; restore it from a backup, or give Runlane a new file.",
                meta={"path": str(self.path)},
            )
        version = counter[0]
        outcomes: list[bool | RunlaneError] = []
        for attempt, projection in zip(attempts, projections):
            applied: int | RunlaneError | None
            if alone:
                applied = self._apply(connection, *attempt, projection, version)
            else:
                connection.execute("SAVEPOINT runlane_attempt")
                try:
                    applied = self._apply(connection, *attempt, projection, version)
                except (RunlaneError, sqlite3.Error) as error:
                    if not connection.in_transaction:
                        # SQLite rolled the whole transaction back itself (a full disk, an I/O error,
                        # no memory): the attempts applied before are undone too, so the batch fails
                        # as one with that error.
                        raise
                    applied = self._error(error) if isinstance(error, sqlite3.Error) else error
                if not isinstance(applied, int):
                    connection.execute("ROLLBACK TO runlane_attempt")
                connection.execute("RELEASE runlane_attempt")
            if isinstance(applied, int):
                version = applied
                outcomes.append(True)
            else:
                outcomes.append(False if applied is None else applied)
        if True not in outcomes:
            connection.execute("ROLLBACK")
            return outcomes
        connection.execute("UPDATE runlane_version_counter SET last = ? WHERE id = 1", (version,))
        connection.execute("COMMIT")
        return outcomes

    def _apply(
        self,
        connection: sqlite3.Connection,
        reads: dict[str, str | None],
        writes: list[StagedWrite],
        append: StorageAppendCommand | None,
        owner: str | None,
        projection: list[tuple[StorageRecordKey, Any, Any]],
        version: int,
    ) -> int | None:
        """Validate one attempt and write it (inside ``_commit_batch``'s transaction); the last
        version it used, or ``None`` when a read or an expected version no longer holds."""
        keys = list(dict.fromkeys([*reads, *(write.key.encoded for write in writes)]))
        current = _current_rows(connection, keys)
        conflict = any(_version_of(current.get(key)) != expected for key, expected in reads.items()) or any(
            _version_of(current.get(write.key.encoded)) != write.expected for write in writes
        )
        if conflict:
            return None
        removed: list[tuple[str, str, str, str]] = []
        added: list[tuple[str, str, str, str]] = []
        deleted: list[tuple[str]] = []
        stored: list[tuple[str, int, str, int, str]] = []

        def put(encoded: str, old: tuple[Any, ...] | None, record: Any) -> None:
            nonlocal version
            # Entries that restate the key have no row: the key range of the records serves them.
            if old is not None:
                removed.extend(
                    (name, part, sort, encoded)
                    for name, part, sort in _load_indexes(encoded, old[1])
                    if not repeats_key(name, part, sort, encoded)
                )
            if record is None:
                deleted.append((encoded,))
                return
            version += 1
            document = record.document
            stored.append((encoded, version, document.text, document.byte_size, _dump_indexes(record.indexes)))
            for entry in record.indexes:
                row = (entry.name.value, entry.encoded_partition, entry.encoded_sort, encoded)
                if not repeats_key(*row):
                    added.append(row)

        for write in writes:
            put(write.key.encoded, current.get(write.key.encoded), write.record)
        if append is not None:
            head, old_head, records = _allocate(connection, append)
            put(head.key.encoded, old_head, head)
            for record in records:
                put(record.key.encoded, None, record)

        connection.executemany(
            f"DELETE FROM {_INDEX_ROWS} WHERE index_name = ? AND partition = ? AND sort = ? AND key = ?", removed
        )
        connection.executemany(f"DELETE FROM {_RECORDS} WHERE key = ?", deleted)
        connection.executemany(_UPSERT_RECORD, stored)
        connection.executemany(
            f"INSERT INTO {_INDEX_ROWS} (index_name, partition, sort, key) VALUES (?, ?, ?, ?)", added
        )
        # Each run and event record written leaves exactly its row (or none) in the projection.
        rows: dict[str, list[Any]] = {_UPSERT_RUN: [], _DELETE_RUN: [], _UPSERT_EVENT: [], _DELETE_EVENT: []}
        for key, run_row, event_row in projection:
            if is_operator_run_key(key):
                statement, row = (_DELETE_RUN, key.parts) if run_row is None else (_UPSERT_RUN, run_row)
            else:
                statement, row = (_DELETE_EVENT, key.parts) if event_row is None else (_UPSERT_EVENT, event_row)
            rows[statement].append(row)
        for statement, values in rows.items():
            if values:
                connection.executemany(statement, values)
        if owner is not None:
            connection.execute(f"DELETE FROM {_HOLDS} WHERE owner = ?", (owner,))
        return version

    def _committer(self) -> Batcher[_Commit, bool]:
        """This event loop's group commit: attempts that reach their commit while one is in flight
        share the next write transaction."""
        loop = asyncio.get_running_loop()
        committer = self._committers.get(loop)
        if committer is None:
            with self._committers_lock:
                committer = self._committers.get(loop)
                if committer is None:
                    for gone in [other for other in self._committers if other.is_closed()]:
                        del self._committers[gone]
                    committer = self._committers[loop] = Batcher(self._flush_commits, max_batch_size=MAX_COMMIT_BATCH)
        return committer

    async def _flush_commits(self, attempts: list[_Commit]) -> list[bool | RunlaneError]:
        return await self._call(self._commit_batch, attempts)

    # -- wake hints (StorageWakeHints) ---------------------------------------------------------

    #: Seconds between two looks at the file's commit counter while a worker waits for hints.
    wake_poll_interval: float = 0.005

    def publish_wake_hint(self, queue: str) -> None:
        """Touch the database file (its modification time) once the commit is visible. Subscribers in other
        processes watch its directory: a commit's own writes reach the -wal file before it becomes
        visible, and what makes it visible (the -shm index, written through memory) tells no watcher,
        so on a slow log sync the touch is what wakes them at once. ``queue`` is not sent: a watcher
        wakes every idle slot of its process, which then looks for due runs of its own queues."""
        with contextlib.suppress(OSError):  # workers still see the commit at their next look or poll
            os.utime(self.path)

    def subscribe_wake_hints(self, callback: Callable[[str], None]) -> Callable[[], None]:
        """Call ``callback("*")``, from the watcher thread, soon after any other connection commits to
        the file. Returns an unsubscribe; the watcher runs while anyone is subscribed."""
        token = object()
        with self._watch_lock:
            self._subscribers[token] = callback
            running = self._watcher is not None and self._watcher[0].is_alive()
            if not running and self._executor is not None and self._pid == os.getpid():
                if self._watcher is not None:  # it ended on an error: replace it
                    os.close(self._watcher[2])
                    self._watcher = None
                self._start_watcher()

        def unsubscribe() -> None:
            with self._watch_lock:
                self._subscribers.pop(token, None)
                idle = not self._subscribers
            if idle:
                self._stop_watcher()

        return unsubscribe

    def _stop_watcher(self) -> None:
        with self._watch_lock:
            watcher, self._watcher = self._watcher, None
        if watcher is not None:
            thread, stop, wake = watcher
            stop.set()
            if self._pid == os.getpid():  # a forked child's copy of the pipe would wake the parent's watcher
                with contextlib.suppress(OSError):  # the thread may have ended already
                    os.write(wake, b"x")
            if thread is not threading.current_thread():
                thread.join(timeout=1.0)
            os.close(wake)

    def _start_watcher(self) -> None:
        """Start the watcher thread (under ``_watch_lock``). Its connection, directory watch and first
        ``data_version`` are taken here, before the subscriber is told it is subscribed: a commit that
        lands once ``subscribe_wake_hints`` has returned is always heard. Without a connection there is
        no watcher (workers still poll)."""
        try:
            with self._fork_lock:
                connection = sqlite3.connect(
                    str(self.path), timeout=_BUSY_SLICE, isolation_level=None, check_same_thread=False
                )
        except sqlite3.Error:
            return
        events = _directory_writes(self._file_directory())
        try:
            seen = self._data_version(connection)
        except sqlite3.Error:
            with self._fork_lock:
                connection.close()
            if events is not None:
                os.close(events)
            return
        stop = threading.Event()
        wake_read, wake_write = os.pipe()
        thread = threading.Thread(
            target=self._watch,
            args=(stop, wake_read, connection, events, seen),
            name=f"runlane-{self.name}-hints",
            daemon=True,
        )
        self._watcher = (thread, stop, wake_write)
        thread.start()

    def _watch(
        self, stop: threading.Event, wake: int, connection: sqlite3.Connection, events: int | None, seen: Any
    ) -> None:
        """The watcher thread: look at ``data_version`` until stopped, each time the file's directory
        reports a write (Linux inotify), else every ``wake_poll_interval``; any failure ends the
        hints (workers still poll). Each SQLite call holds ``_fork_lock``, as the driver's thread does."""
        try:
            written = 0.0  # when the directory last reported a write
            if events is not None:  # poll(), not select(), which cannot wait on descriptors past 1023
                poller = select.poll()
                poller.register(events, select.POLLIN)
                poller.register(wake, select.POLLIN)
            while not stop.is_set():
                if events is None:
                    if stop.wait(self.wake_poll_interval):
                        break
                else:
                    # Until a file in the directory is written (a commit appends to the -wal file),
                    # or a while has passed anyway. A commit becomes visible only after its last
                    # write (and the log sync), with no event of its own: for a while after a
                    # write, look again every millisecond.
                    recent = time.monotonic() - written < _WATCH_SETTLE
                    ready = poller.poll(1000 * (_WATCH_SOON if recent else _WATCH_IDLE_CHECK))
                    if stop.is_set():
                        break
                    if ready:
                        with contextlib.suppress(BlockingIOError):
                            while os.read(events, 4096):
                                pass
                        written = time.monotonic()
                version = self._data_version(connection)
                if version == seen:
                    continue
                seen = version
                with self._watch_lock:
                    callbacks = list(self._subscribers.values())
                for callback in callbacks:
                    try:
                        callback("*")
                    except Exception:  # noqa: BLE001 - one subscriber's failure never stops the others
                        pass
                if events is not None and stop.wait(self.wake_poll_interval):
                    break  # at most one wake-up per interval: a busy file costs no more than polling
        except sqlite3.Error:
            pass
        finally:
            with self._fork_lock:
                connection.close()
            os.close(wake)
            if events is not None:
                os.close(events)

    def _data_version(self, connection: sqlite3.Connection) -> Any:
        with self._fork_lock:
            return connection.execute("PRAGMA data_version").fetchone()[0]

    # -- StorageDriver -----------------------------------------------------------------------------

    async def get(self, keys: Sequence[StorageRecordKey]) -> list[StorageRecord | None]:
        checked = check_storage_keys(keys)
        enforce_storage_limit(self.profile.limits, "max_point_reads", len(checked))
        if not checked:
            if self._executor is None:
                raise self._closed()
            return []
        return await self._read(checked)

    async def query(self, query: StorageQuery) -> StorageQueryResult:
        if not isinstance(query, StorageQuery):
            raise contract_violation("query() takes a StorageQuery.")
        enforce_storage_limit(self.profile.limits, "max_query_results", query.limit)
        return await self._query(query)

    async def with_transaction(self, callback: Callable[[StorageTransaction], Awaitable[T]]) -> T:
        if self._executor is None:
            raise self._closed()
        for number in range(self.max_transaction_attempts):
            attempt = _SqliteTransaction(self, self.profile.limits, self._clock)
            released = False
            try:
                result = await callback(attempt)
                attempt.check_committable()
                if attempt.has_mutations:
                    commit = (attempt.reads, attempt.writes, attempt.append_command, attempt.owner)
                    committed = await self._committer().submit(commit)
                    released = committed
                    if committed:
                        self._written.remember(attempt.writes)
                elif attempt.reads:
                    committed = await self._call(self._validate, attempt.reads)
                else:
                    committed = True
            finally:
                attempt.end()
                if attempt.owner is not None:
                    if released or not attempt.holding:
                        _end_owner(attempt.owner)
                    else:
                        await self._release(attempt.owner)
            if committed:
                return result
            await pause_before_replay(number)
        raise create_storage_conflict_error(
            StorageConflictKind.TRANSACTION,
            f"The transaction lost optimistic validation {self.max_transaction_attempts} times; retry the operation.",
            meta={"attempts": self.max_transaction_attempts},
        )

    # -- OperatorReadDriver ------------------------------------------------------------------------

    async def get_run(self, environment: Environment, run_id: str) -> RunRecord | None:
        return await self._call(_visible_run, environment_key(environment), run_id)

    async def list_runs(self, filter: RunFilter, pagination: PaginationParams) -> Page[RunSummary]:
        query = run_list_query(
            filter, pagination, runs_table=_OPERATOR_RUNS, records_table=_RECORDS, placeholder="?"
        )
        return await self._call(
            lambda connection: finish_run_page(query, filter, _fetch_all(connection, query.text, query.params))
        )

    async def list_run_events(self, filter: RunEventFilter, pagination: PaginationParams) -> Page[RunEventRecord]:
        query = run_event_list_query(
            filter,
            pagination,
            events_table=_OPERATOR_EVENTS,
            runs_table=_OPERATOR_RUNS,
            records_table=_RECORDS,
            placeholder="?",
        )
        return await self._call(
            lambda connection: finish_event_page(query, filter, _fetch_all(connection, query.text, query.params))
        )


# ---------------------------------------------------------------------------------------------
# Statements run on the driver's thread


_WATCH_IDLE_CHECK = 0.25  # seconds between two looks at the file when inotify reports nothing
_WATCH_SOON = 0.001  # seconds between two looks for a while after a write
_WATCH_SETTLE = 0.02  # how long after a write a commit may still become visible (the log sync)
_IN_MODIFY, _IN_ATTRIB, _IN_CREATE, _IN_MOVED_TO = 0x2, 0x4, 0x100, 0x80


def _directory_writes(directory: Path) -> int | None:
    """A nonblocking inotify descriptor that becomes readable when a file in ``directory`` is written
    or created; ``None`` where inotify is not available (then the watcher polls)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            return None
        if libc.inotify_add_watch(fd, os.fsencode(directory), _IN_MODIFY | _IN_ATTRIB | _IN_CREATE | _IN_MOVED_TO) < 0:
            os.close(fd)
            return None
        return fd
    except (OSError, AttributeError):
        return None


def _close(connection: sqlite3.Connection) -> None:
    try:
        if connection.in_transaction:
            connection.execute("ROLLBACK")
    except sqlite3.Error:
        pass
    connection.close()


def _fetch_all(connection: sqlite3.Connection, sql: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
    return connection.execute(sql, params).fetchall()


def _current_rows(connection: sqlite3.Connection, keys: list[str]) -> dict[str, tuple[Any, Any]]:
    """``key -> (version, index entries text)`` of the stored ``keys`` (in the caller's transaction)."""
    current: dict[str, tuple[Any, Any]] = {}
    for chunk in _chunks(keys):
        sql = f"SELECT key, version, indexes FROM {_RECORDS} WHERE key IN ({_placeholders(len(chunk))})"
        for key, version, indexes in connection.execute(sql, list(chunk)):
            current[key] = (version, indexes)
    return current


def _version_of(row: tuple[Any, Any] | None) -> str | None:
    return None if row is None else str(row[0])


def _projection_changes(writes: list[StagedWrite]) -> list[tuple[StorageRecordKey, Any, Any]]:
    """``(key, run row, event row)`` of every staged write to a run or run event record."""
    changes: list[tuple[StorageRecordKey, Any, Any]] = []
    for write in writes:
        key, record = write.key, write.record
        if is_operator_run_key(key):
            row = None if record is None else operator_run_row(key, record.document)
            changes.append((key, row, None))
        elif is_operator_event_key(key):
            row = None if record is None else operator_event_row(key, record.document)
            changes.append((key, None, row))
    return changes


def _allocate(
    connection: sqlite3.Connection, command: StorageAppendCommand
) -> tuple[Any, tuple[Any, Any] | None, tuple[Any, ...]]:
    """The new head, the stored head row and the records of ``command`` at the committed head."""
    layout = storage_stream_layouts[command.stream]
    head_key = layout.head_key(command.partition)
    row = connection.execute(
        f"SELECT version, document, indexes FROM {_RECORDS} WHERE key = ?", (head_key.encoded,)
    ).fetchone()
    head = None if row is None else _stored_record(head_key, head_key.encoded, row[0], row[1], row[2])
    appended = materialize_storage_append(command, read_storage_stream_position(head))
    taken = _current_rows(connection, [record.key.encoded for record in appended.records])
    if taken:
        raise RunlaneError(
            ErrorCode.INVARIANT_VIOLATION,
            f"The {command.stream.value} stream already holds records past its head; refusing to overwrite them.",
        )
    return appended.head, None if row is None else (row[0], row[2]), appended.records


def _visible_run(connection: sqlite3.Connection, environment: str, run_id: str) -> RunRecord | None:
    row = connection.execute(
        f"SELECT r.key, r.document FROM {_OPERATOR_RUNS} o JOIN {_RECORDS} r ON r.key = o.record_key "
        f"WHERE o.environment = ? AND o.run_id = ? "
        f"AND NOT EXISTS (SELECT 1 FROM {_RECORDS} t WHERE t.key = o.tombstone_key)",
        (environment, run_id),
    ).fetchone()
    if row is None:
        return None
    encoded, text = row
    if not isinstance(text, str):
        raise corrupt_stored_record(encoded, "its document is not text.")
    try:
        document = StorageDocument.parse(text)
    except RunlaneError as error:
        raise corrupt_stored_record(encoded, error.message, error) from None
    run = peek_run_document(document)
    return None if run is None else run.model_copy(deep=True)


def _seconds(value: float | str | timedelta, what: str) -> float:
    if isinstance(value, (str, timedelta)):
        return duration_ms(value, what) / 1000
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value == float("inf"):
        raise RunlaneError(
            ErrorCode.CONFIGURATION_INVALID,
            f"{what} must be a positive number of seconds or a duration such as '5s', got {value!r}.",
        )
    return float(value)


# A URL rather than a path (two characters at least before "://", so no Windows drive letter).
_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]+)://")


def expand_database_path(raw: str) -> Path:
    """``raw`` as a path with ``~`` expanded; a path no file can have, or one SQLite would take for an
    in-memory or URI database, is ``configuration_invalid``."""
    if not raw or raw == ":memory:" or raw.startswith("file:"):
        raise RunlaneError(
            ErrorCode.CONFIGURATION_INVALID,
            f"The SQLite storage path must name a database file, got {raw!r}; use the local lane for "
            "in-memory storage.",
            meta={"path": raw},
        )
    url = _URL.match(raw)
    if url is not None:  # a SQLAlchemy-style sqlite:///app.db, or a server's URL: its text may hold a password
        scheme = url.group(1)
        other = " (the postgres-polling lane keeps runs in Postgres)" if scheme.lower().startswith("postgres") else ""
        raise RunlaneError(
            ErrorCode.CONFIGURATION_INVALID,
            f"The SQLite storage path must be a file path, got a {scheme}:// URL: write the database file's path, "
            f"such as 'runlane.db' (relative to the config file) or '/var/lib/app/runlane.db'{other}.",
            meta={"field": "path"},
        )
    if "\0" in raw:
        raise RunlaneError(
            ErrorCode.CONFIGURATION_INVALID,
            f"The SQLite storage path {raw!r} contains a NUL character, which no file name can hold.",
            meta={"path": raw},
        )
    try:
        return Path(raw).expanduser()
    except RuntimeError:  # ~user of an unknown user, or no home directory to put for ~
        raise RunlaneError(
            ErrorCode.CONFIGURATION_INVALID,
            f"The SQLite storage path {raw!r} starts with '~', but the home directory it names cannot be "
            "found: name an existing user's home, or give the path without '~'.",
            meta={"path": raw},
        ) from None


def sqlite_storage(
    path: str | os.PathLike[str],
    *,
    clock: Clock | None = None,
    limits: StorageLimits | None = None,
    max_transaction_attempts: int = 16,
    busy_timeout: float | str | timedelta = 5.0,
    hold_timeout: float | str | timedelta = 30.0,
    synchronous: str = "full",
    name: str = "sqlite-storage",
) -> SqliteStorageDriver:
    """The embedded durable driver over the SQLite file at ``path`` (created with its schema on ``start()``).

    Several processes on one machine may open the same file. ``busy_timeout`` bounds how long one
    operation waits for the file's write lock before a retryable ``storage_unavailable``;
    ``hold_timeout`` bounds how long an exclusive candidate hold of a vanished attempt can block
    others; ``synchronous`` is ``"full"`` (default: commits survive power loss), ``"extra"`` or
    ``"normal"`` (faster; the last commits may roll back after an OS crash or power loss).
    """
    return SqliteStorageDriver(
        path,
        clock=clock,
        limits=limits,
        max_transaction_attempts=max_transaction_attempts,
        busy_timeout=busy_timeout,
        hold_timeout=hold_timeout,
        synchronous=synchronous,
        name=name,
    )
