"""What every driver's transaction attempt shares: the contract's bookkeeping, written once.

``StorageAttempt`` implements ``StorageTransaction`` up to the point where a driver must touch its
own state. It tracks the read set (present keys with the version seen, absent keys as ``None``),
seals reads at the first ``now()`` or mutation, stages creates / replaces / deletes and one append
batch, enforces every advertised limit with ``StorageLimitError``, and remembers any misuse so the
attempt is rolled back even when the callback swallows the error. A driver subclass supplies:

* ``_fetch(keys)``: the stored records of ``keys`` (already checked), in order, ``None`` when absent;
* ``_candidates(query, mode)``: one page of index candidates (``page_index_rows`` builds it);
* optionally ``_sample_now()`` when the attempt's time does not come from a client clock.

After the callback returns, the driver reads ``reads``, ``writes`` and ``append_command`` to
validate and commit (``check_committable()`` first), and calls ``end()`` whatever happened.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import random
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import datetime
from typing import NamedTuple, NoReturn

from ..errors import ErrorCode, RunlaneError
from .clock import Clock
from .cursor import StorageQueryPosition, encode_storage_query_cursor
from .codecs import decode_storage_tuple
from .streams import measure_storage_append, storage_stream_layouts
from .tables import compact_decoded
from .types import (
    NewStorageRecord,
    StorageAppendCommand,
    StorageCandidateMode,
    StorageDocument,
    StorageIndexRef,
    StorageLimits,
    StorageQuery,
    StorageQueryResult,
    StorageRecord,
    StorageRecordKey,
    create_storage_limit_error,
    have_equal_storage_record_keys,
    measure_storage_record,
)

__all__ = [
    "StagedWrite",
    "StorageAttempt",
    "WrittenDocuments",
    "check_storage_keys",
    "contract_violation",
    "enforce_storage_limit",
    "page_index_rows",
    "pause_before_replay",
]

IndexRow = tuple[str, str]  # (encoded sort value, encoded record key)
OnError = Callable[[RunlaneError], NoReturn]


class StagedWrite(NamedTuple):
    """One staged mutation. ``expected`` is the version the key must still have at commit (``None``:
    absent); ``record`` is the new content (``None``: delete)."""

    key: StorageRecordKey
    expected: str | None
    record: NewStorageRecord | None


def contract_violation(message: str) -> RunlaneError:
    return RunlaneError(ErrorCode.ADAPTER_CONTRACT_VIOLATION, message)


def _raise(error: RunlaneError) -> NoReturn:
    raise error


def check_storage_keys(keys: Sequence[StorageRecordKey], *, on_error: OnError = _raise) -> list[StorageRecordKey]:
    """``keys`` as a list, or ``adapter_contract_violation`` when it is not a sequence of record keys."""
    if isinstance(keys, str) or not isinstance(keys, Sequence):
        on_error(contract_violation("get() takes a sequence of StorageRecordKey values."))
    checked = list(keys)
    if not all(isinstance(key, StorageRecordKey) for key in checked):
        on_error(contract_violation("get() takes a sequence of StorageRecordKey values."))
    return checked


def enforce_storage_limit(limits: StorageLimits, limit: str, actual: int, *, on_error: OnError = _raise) -> None:
    """Fail with ``StorageLimitError`` when ``actual`` exceeds the advertised ``limits.<limit>``."""
    allowed = getattr(limits, limit)
    if actual > allowed:
        on_error(create_storage_limit_error(limit, allowed, actual))


def _decode_trusted(encoded: str) -> tuple[str, ...]:
    return tuple([bytes.fromhex(part).decode("utf-8") for part in encoded.split("/")])


def _trusted_ref(sort: str, key: str) -> StorageIndexRef:
    parts = _decode_trusted(key)
    return StorageIndexRef(StorageRecordKey._trusted(parts[0], parts[1:], key), _decode_trusted(sort))


# A backlog's oldest rows are read by scan after scan (a bounded queue's capacity scan passes over a full
# partition's rows each time), so a plain query keeps their decoded references. Claims, which take each
# row once, do not: the cache's live objects would only slow the collector down (8% of a drain).
_remembered_ref = functools.lru_cache(maxsize=16384)(_trusted_ref)


def page_index_rows(
    query: StorageQuery, rows: Iterator[IndexRow], *, look_ahead: bool, trusted: bool = False, remember: bool = False
) -> StorageQueryResult:
    """Up to ``query.limit`` of ``rows`` (already in query order, after the cursor) as a result page.

    The page carries a cursor when another row follows; without ``look_ahead`` (exclusive candidates,
    where reading one row too many would hold it) a full page always carries one. ``trusted`` rows are
    encodings the driver made itself with ``encode_storage_tuple`` (decoded without checking them), and
    ``remember`` keeps them decoded for the next page that holds them (for rows read again and again).
    """
    page = list(itertools.islice(rows, query.limit))
    more = len(page) == query.limit and (not look_ahead or next(rows, None) is not None)
    if trusted:
        decode = _remembered_ref if remember else _trusted_ref
        items = tuple([decode(sort, key) for sort, key in page])
    else:
        items = tuple(_stored_index_ref(query, sort, key) for sort, key in page)
    cursor = encode_storage_query_cursor(query, StorageQueryPosition(*page[-1])) if more else None
    return StorageQueryResult(items, cursor)


def _stored_index_ref(query: StorageQuery, sort: str, key: str) -> StorageIndexRef:
    """An index row a driver read from its storage; one that does not decode is durable corruption
    (``invariant_violation`` naming the row), not a driver's contract violation."""
    try:
        return StorageIndexRef(StorageRecordKey.decode(key), decode_storage_tuple(sort))
    except RunlaneError as error:
        raise RunlaneError(
            ErrorCode.INVARIANT_VIOLATION,
            f"A stored row of the {query.index.value} index (partition {query.encoded_partition!r}, sort {sort!r}, "
            f"key {key!r}) is corrupt: {error.message.rstrip('.')}. This is durable corruption: repair the row "
            "from the index entries its record lists, or restore the storage from a backup.",
            meta={"index": query.index.value, "partition": query.encoded_partition, "row_sort": sort, "row_key": key},
            cause=error,
        ) from None


class StorageAttempt:
    """One attempt of a transaction callback (a ``StorageTransaction``); see the module docstring."""

    def __init__(self, limits: StorageLimits, clock: Clock | None = None) -> None:
        self._limits = limits
        self._max_records = limits.max_transaction_records
        self._max_record_bytes = limits.max_record_bytes
        self._max_bytes = limits.max_transaction_bytes
        self._clock = clock
        self.reads: dict[str, str | None] = {}  # encoded key -> version seen (None: read as absent)
        self._writes: dict[str, StagedWrite] = {}
        self.append_command: StorageAppendCommand | None = None
        self._failure: RunlaneError | None = None
        self._touched: dict[str, StorageRecordKey] = {}  # keys read or mutated (transaction records)
        self._append_records = 0
        self._staged_bytes = 0
        self._now: datetime | None = None
        self._sealed = False  # reads are over: now() was called or a mutation was staged
        self._reading = False
        self.ended = False

    # -- what a driver implements -----------------------------------------------------------------

    async def _fetch(self, keys: list[StorageRecordKey]) -> list[StorageRecord | None]:
        raise NotImplementedError

    async def _candidates(self, query: StorageQuery, mode: StorageCandidateMode) -> StorageQueryResult:
        raise NotImplementedError

    async def _sample_now(self) -> datetime:
        assert self._clock is not None, "an attempt without a clock must override _sample_now()"
        return self._clock.now()

    # -- what a driver reads after the callback ---------------------------------------------------

    @property
    def writes(self) -> list[StagedWrite]:
        return list(self._writes.values())

    @property
    def has_mutations(self) -> bool:
        return bool(self._writes) or self.append_command is not None

    def check_committable(self) -> None:
        """Raise the misuse or limit error this attempt hit (the callback may have swallowed it)."""
        if self._failure is not None:
            raise self._failure

    def end(self) -> None:
        """Close the attempt: the transaction object refuses every later call."""
        self.ended = True

    # -- reads --------------------------------------------------------------------------------------

    async def get(self, keys: Sequence[StorageRecordKey]) -> list[StorageRecord | None]:
        self._begin_read("get")
        try:
            checked = check_storage_keys(keys, on_error=self._fail)
            self._enforce("max_point_reads", len(checked))
            for key in checked:
                if key.encoded not in self._touched:
                    self._touch(key)
            found = await self._fetch(checked)
            self._check_open()
            reads = self.reads
            for key, record in zip(checked, found):
                reads[key.encoded] = None if record is None else record.version
            return found
        finally:
            self._reading = False

    async def query_candidates(
        self, query: StorageQuery, *, mode: StorageCandidateMode = StorageCandidateMode.ADVISORY
    ) -> StorageQueryResult:
        self._begin_read("query_candidates")
        try:
            if not isinstance(query, StorageQuery) or mode not in tuple(StorageCandidateMode):
                self._fail(contract_violation("query_candidates() takes a StorageQuery and a StorageCandidateMode."))
            self._enforce("max_query_results", query.limit)
            result = await self._candidates(query, mode)
            self._check_open()
            return result
        finally:
            self._reading = False

    def _begin_read(self, operation: str) -> None:
        """The checks before a read yields to the loop; the caller clears ``_reading`` when done."""
        self._check_open()
        if self._reading:
            self._fail(contract_violation(f"{operation}() overlaps another read of this attempt; await each read first."))
        self._check_unsealed(operation)
        self._reading = True

    def _check_unsealed(self, operation: str) -> None:
        if self._sealed:
            self._fail(contract_violation(f"{operation}() after now() or a mutation: the read set of this attempt is sealed."))

    # -- time -----------------------------------------------------------------------------------------

    async def now(self) -> datetime:
        self._check_open()
        if self._now is None:
            try:
                sampled = await self._sample_now()
            except RunlaneError:
                raise
            except Exception as error:  # a clock of the caller's that cannot tell the time
                message = f"The storage clock raised {type(error).__name__}: {error}; its now() must return a datetime."
                self._fail(RunlaneError(ErrorCode.CONFIGURATION_INVALID, message, cause=error))
            if not isinstance(sampled, datetime) or sampled.tzinfo is None or sampled.utcoffset() is None:
                message = "The storage clock must return timezone-aware datetimes."
                self._fail(RunlaneError(ErrorCode.CONFIGURATION_INVALID, message))
            self._now = sampled
        self._sealed = True
        return self._now

    # -- mutations ------------------------------------------------------------------------------------

    def create(self, record: NewStorageRecord) -> None:
        self._check_open()
        if not isinstance(record, NewStorageRecord):
            self._fail(contract_violation("create() takes a NewStorageRecord."))
        if self.reads.get(record.key.encoded) is not None:
            self._fail(contract_violation(f"create() of {record.key!r}, which this attempt read as present; use replace()."))
        self._stage(StagedWrite(record.key, None, record))

    def replace(self, current: StorageRecord, record: NewStorageRecord) -> None:
        self._check_open()
        if not isinstance(record, NewStorageRecord):
            self._fail(contract_violation("replace() takes the current StorageRecord and a NewStorageRecord."))
        self._check_read_exactly(current, "replace")
        if not have_equal_storage_record_keys(current.key, record.key):
            self._fail(contract_violation(f"replace() cannot change the key ({current.key!r} -> {record.key!r})."))
        self._stage(StagedWrite(record.key, current.version, record))

    def delete(self, current: StorageRecord) -> None:
        self._check_open()
        self._check_read_exactly(current, "delete")
        self._stage(StagedWrite(current.key, current.version, None))

    def append(self, command: StorageAppendCommand) -> None:
        self._check_open()
        if not isinstance(command, StorageAppendCommand):
            self._fail(contract_violation("append() takes a StorageAppendCommand."))
        if self.append_command is not None:
            self._fail(contract_violation("An attempt may stage only one append batch."))
        layout = storage_stream_layouts[command.stream]
        if any(layout.owns_key(key, command.partition) for key in self._touched.values()):
            self._fail(contract_violation("append() to a stream partition whose head or records this attempt read or mutated."))
        records, size, record_sizes = measure_storage_append(command)
        self._enforce("max_record_bytes", max(record_sizes))
        self._enforce("max_transaction_records", len(self._touched) + records)
        self._add_bytes(size)
        self.append_command, self._append_records = command, records
        self._sealed = True

    def _check_read_exactly(self, current: StorageRecord, operation: str) -> None:
        if not isinstance(current, StorageRecord):
            self._fail(contract_violation(f"{operation}() takes the StorageRecord this attempt read."))
        seen = self.reads.get(current.key.encoded)
        if seen is None:
            self._fail(contract_violation(f"{operation}() of {current.key!r}, which this attempt did not read as present."))
        if seen != current.version:
            message = f"{operation}() of {current.key!r} at version {current.version}, but this attempt read {seen}."
            self._fail(contract_violation(message))

    def _stage(self, write: StagedWrite) -> None:
        key, _, record = write
        encoded = key.encoded
        writes = self._writes
        if encoded in writes:
            self._fail(contract_violation(f"{key!r} is mutated twice in one attempt."))
        command = self.append_command
        if command is not None and storage_stream_layouts[command.stream].owns_key(key, command.partition):
            self._fail(contract_violation("A mutation of a stream partition this attempt appends to."))
        size = 0
        if record is not None:
            size = measure_storage_record(record)
            if size > self._max_record_bytes:
                self._enforce("max_record_bytes", size)
        if encoded not in self._touched:
            self._touch(key)
        self._staged_bytes += size
        if self._staged_bytes > self._max_bytes:
            self._enforce("max_transaction_bytes", self._staged_bytes)
        writes[encoded] = write
        self._sealed = True

    # -- limits ---------------------------------------------------------------------------------------

    def _touch(self, key: StorageRecordKey) -> None:
        if key.encoded not in self._touched:
            count = len(self._touched) + 1 + self._append_records
            if count > self._max_records:
                self._enforce("max_transaction_records", count)
            self._touched[key.encoded] = key

    def _add_bytes(self, size: int) -> None:
        self._staged_bytes += size
        self._enforce("max_transaction_bytes", self._staged_bytes)

    def _enforce(self, limit: str, actual: int) -> None:
        enforce_storage_limit(self._limits, limit, actual, on_error=self._fail)

    # -- lifecycle ------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self.ended:
            raise contract_violation("This transaction attempt has ended; the transaction object cannot be used any more.")
        if self._failure is not None:
            raise self._failure

    def _fail(self, error: RunlaneError) -> NoReturn:
        if self._failure is None:
            self._failure = error
        raise error


class WrittenDocuments:
    """The documents a driver replaced most recently, by encoded key, so that reading one back
    costs no parse: a run claimed and completed by one process is decoded once.

    Only replacements are kept: a process reads back the records it read and rewrote (the claim of a
    run, then its heartbeats and completion), while what it creates (a triggered run, history rows)
    is most often read by another process, a worker, if at all. Keeping creates cost a producer CPU
    on every trigger, to save one parse only when the same process also claims the run.

    ``recall`` hands out a kept document only when the stored text is exactly the one written;
    anything else (another process wrote since, or the row is corrupt) is parsed as usual. Safe to
    share between threads: one driver may serve several event loops, or read on a thread of its own.

    A kept document holds its remembered value in the compact form (``tables.compact_decoded``): a
    run as one tuple of plain values instead of a model with nested models, dicts and sets, and
    nothing for values only a commit needed. Thousands of kept runs are then not tens of thousands
    of objects for every garbage collection of the process to walk.
    """

    __slots__ = ("_bytes", "_documents", "_limit", "_limit_bytes", "_lock")

    def __init__(self, limit: int = 4096, limit_bytes: int = 32 * 1024 * 1024) -> None:
        # A plain dict keeps insertion order: a key written again is moved to the end by popping it
        # first, so the oldest entries are at the front. It may grow to 1.25 x ``limit`` documents (or
        # ``limit_bytes`` of text) before the oldest are dropped in one go. The byte budget bounds a
        # worker whose runs carry large payloads or outputs: 4,096 runs of 400 KiB would be 1.6 GB.
        self._documents: dict[str, StorageDocument] = {}
        self._limit = limit
        self._limit_bytes = limit_bytes
        self._bytes = 0
        self._lock = threading.Lock()

    def remember(self, writes: Iterable[StagedWrite]) -> None:
        """Keep the documents of a committed attempt's replacements (and forget its deletes)."""
        documents = self._documents
        with self._lock:
            size = self._bytes
            for key, expected, record in writes:
                if expected is None:
                    continue  # a create (see above); recall still compares the text it finds
                encoded = key.encoded
                old = documents.pop(encoded, None)
                if old is not None:
                    size -= old.byte_size
                if record is not None:
                    document = record.document
                    documents[encoded] = _kept(document)
                    size += document.byte_size
            limit, limit_bytes = self._limit, self._limit_bytes
            if len(documents) - limit > limit >> 2 or size - limit_bytes > limit_bytes >> 2:
                for encoded in list(documents):
                    if len(documents) <= limit and size <= limit_bytes:
                        break
                    size -= documents.pop(encoded).byte_size
            self._bytes = size

    def recall(self, encoded_key: str, text: object) -> StorageDocument | None:
        """The kept document of ``encoded_key`` when its text is exactly ``text``."""
        known = self._documents.get(encoded_key)
        return known if known is not None and known.text == text else None


def _kept(document: StorageDocument) -> StorageDocument:
    """``document`` as ``WrittenDocuments`` keeps it: the same text, its remembered value compacted."""
    decoded = document.decoded
    if decoded is None:
        return document
    compact = compact_decoded(decoded)
    if compact is decoded:
        return document
    return StorageDocument(document.text, document.byte_size).remember_decoded(compact)


async def pause_before_replay(replay: int) -> None:
    """Let the winner of a conflict make progress before a transaction callback runs again: one
    event-loop turn after the first conflict, then a random pause growing with each replay (up to
    50 ms), so attempts that keep colliding spread out instead of colliding again in lockstep."""
    await asyncio.sleep(0 if replay == 0 else random.uniform(0, min(0.001 * 2**replay, 0.05)))
