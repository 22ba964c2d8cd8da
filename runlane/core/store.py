"""The core storage layer: typed tables over a ``StorageDriver`` and every transactional write path.

This module is the only runtime code that touches a ``StorageDriver``. It owns the logical
collections below, their document codecs, keys and index entries, and the workflow bookkeeping that
moves with every run transition (idempotency and singleton owners, bounded-queue capacity,
completion-wait markers, exact child counts). The reducer decides lifecycle rules; this module only
persists what the reducer projects.

| collection               | key parts                              | document                                      |
| ------------------------ | -------------------------------------- | --------------------------------------------- |
| ``runs``                 | env, run_id                            | ``{run, children}`` (``tables``)              |
| ``run_events``           | env, run_id, sequence (20 digits)      | ``RunEventRecord``                            |
| ``idempotency_owners``   | env, task_id, key                      | ``{run_id, ttl, expires_at}``                 |
| ``singleton_owners``     | env, key                               | ``{run_id}``                                  |
| ``queue_capacity``       | env, queue, concurrency key or ``""``  | ``{occupants: {run_id: lease_expiry}}``       |
| ``run_steps``            | env, run_id, step_key                  | ``RunStepRecord``                             |
| ``run_completion_waits`` | env, source_run_id                     | ``{}`` (presence marker; never deleted), with |
|                          |                                        | ``resume_due`` while its waiters are resumed  |

Every write path is one ``driver.with_transaction`` call whose callback point-reads what it needs,
seals the read set with ``now()``, projects with the reducer and stages all writes. Callbacks do no
I/O, call no user code and create no random identities: event ids derive from a base drawn before
the transaction, so a replayed attempt stages exactly the same records.

Every persisted run event and every first-time step completion is also appended to the environment's
durable observation stream in the same commit (``observations.py``): one ``stage_observations`` call
per attempt, with the stream head in the attempt's first read when the driver has no native ordered
append. Results carry the sanitized observations of their commit so live observers see exactly what
was stored.
"""

from __future__ import annotations

import functools
import hashlib
import re
import sys
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Final, Protocol, TypeVar, cast

import orjson

from ..defaults import contract_defaults
from ..durations import duration_ms, later
from ..errors import ErrorCode, RunlaneError, StorageConflictKind, create_storage_conflict_error
from ..ids import is_valid_id, random_bits_128, random_uuid4_hex
from ..json_values import canonical_json, canonical_json_of_checked, ensure_json_value
from ..model_build import build_validated, worker_actor
from ..model_json import (
    document_dumps,
    run_event_record_document_value,
    run_event_record_json,
    run_record_document_value,
    run_record_json,
)
from ..models import (
    Actor,
    DeliveryIntent,
    DeliveryMessage,
    Environment,
    OutboxClaim,
    OutboxFailureRecord,
    OutboxMessage,
    RunCreatedEvent,
    RunDeliveryRequestedEvent,
    RunEvent,
    RunEventRecord,
    RunlaneObservation,
    RunLease,
    RunLeaseClaimedEvent,
    RunLeaseHeartbeatEvent,
    RunRecord,
    RunStartedEvent,
    RunStepRecord,
    environment_key,
)
from ..reducer import project_run_events
from ..run_scans import (
    get_run_attempt_timeout_finalization_available_at,
    get_run_cancellation_finalization_available_at,
    get_run_delivery_recovery_available_at,
    get_run_dispatch_available_at,
    get_run_runnable_available_at,
)
from ..storage import (
    STORAGE_DOCUMENT_SCHEMA_VERSION,
    NewStorageRecord,
    StorageDocument,
    StorageDriver,
    StorageIndexEntry,
    StorageIndexName,
    StorageIndexRef,
    StorageLimitError,
    StorageLimits,
    StorageQuery,
    StorageCandidateMode,
    StorageRange,
    StorageRecord,
    StorageRecordKey,
    StorageTransaction,
    decode_iso_date,
    encode_iso_date,
    encode_storage_tuple,
    encode_storage_tuple_prefix_upper_bound,
    encode_storage_unsigned_integer,
    measure_storage_record,
)
from ..storage.operator_sql import remember_event_row, remember_run_row
from ..storage.tables import (
    RUN_EVENTS_COLLECTION,
    RUN_STEPS_COLLECTION,
    RUNS_COLLECTION,
    RunChildCounts,
    corrupt_record,
    decode_run_document,
    decode_run_event_document,
    describe_problem,
    describe_record_key,
    record_key_meta,
    remember_run_document,
    run_tombstone_key,
)
from ..vocabulary import (
    ActorType,
    ExecuteDeliveryIgnoredReason,
    OutboxMessageStatus,
    RunSourceType,
    RunStatus,
    RunWaitConditionType,
    TriggerOutcomeType,
    run_status_values,
)
from .observations import (
    HEAD_NOT_READ,
    event_observation_documents,
    event_statuses,
    observation_for_event,
    observation_head_reads,
    stage_observation_documents,
    stage_observations,
    step_observation_value,
)

__all__ = [
    "IDEMPOTENCY_OWNERS_COLLECTION",
    "OUTBOX_MESSAGES_COLLECTION",
    "QUEUE_CAPACITY_COLLECTION",
    "COMPLETION_RESUME_GRACE_MS",
    "RUN_COMPLETION_WAITS_COLLECTION",
    "RUN_STEPS_COLLECTION",
    "SINGLETON_OWNERS_COLLECTION",
    "AppendResult",
    "Build",
    "ClaimRequest",
    "ClaimResult",
    "CompletionRequest",
    "CoreStore",
    "CreateRunPlan",
    "CreateRunResult",
    "HeartbeatRequest",
    "NextClaimRequest",
    "OutboxMark",
    "ReserveRequest",
    "ReserveResult",
    "RunnableRef",
    "StepCompletion",
    "completion_resume_partition",
    "completion_wait_key",
    "encode_run_document_fast",
    "idempotency_owner_key",
    "is_step_position",
    "new_event_id",
    "outbox_message_key",
    "queue_capacity_key",
    "run_index_entries",
    "run_step_key",
    "run_step_keys",
    "signal_wait_partition",
    "singleton_owner_key",
]

IDEMPOTENCY_OWNERS_COLLECTION: Final = "idempotency_owners"
SINGLETON_OWNERS_COLLECTION: Final = "singleton_owners"
QUEUE_CAPACITY_COLLECTION: Final = "queue_capacity"
RUN_COMPLETION_WAITS_COLLECTION: Final = "run_completion_waits"
OUTBOX_MESSAGES_COLLECTION: Final = "outbox_messages"
# How long after a source run finishes tick() takes over resuming the runs waiting for it, should the
# process that finished it not have done so: longer than that process keeps trying through an outage.
COMPLETION_RESUME_GRACE_MS: Final = 60_000

_TERMINAL: Final = run_status_values.terminal
_RUNNABLE: Final = run_status_values.runnable_candidates
_ATTEMPT_OWNERS: Final = frozenset({RunStatus.RUNNING, RunStatus.CANCELLATION_REQUESTED})
_NEW_SEQUENCE: Final = contract_defaults.run.new_event_sequence
_DEFAULT_IDEMPOTENCY_TTL_MS: Final = duration_ms(contract_defaults.idempotency.ttl)
_SYSTEM_ACTOR: Final = Actor(type=ActorType.SYSTEM)
_NO_EVENTS: tuple[RunEventRecord, ...] = ()
_EVENT_ID_MASK: Final = (1 << 128) - 1
# How many due rows of a bounded queue one candidate scan reads at most, passing over the rows of
# full capacity partitions to reach another partition's runnable work.
_CAPACITY_SCAN_ROWS: Final = 500
# A scan that found nothing open reads on behind a full partition's backlog, up to this many rows in all,
# instead of leaving a poll worker idle for its poll delay per 250 rows: with 50,000 runs of one key
# ahead of them, another key's runs waited more than a minute.
_CAPACITY_SCAN_MAX_ROWS: Final = 5000
# A capacity scan reads the rows it needs a page at a time, the first page this many rows (or twice the
# candidates still wanted), each next one twice the last: a slot that wants one run reads a few rows, not
# a window of the backlog.
_CAPACITY_SCAN_FIRST_PAGE: Final = 16
# How many runs' concurrency keys a store remembers for its capacity scans: a scan over rows it has seen
# before reads no run documents. A run's key never changes, but its id can be reused once the run is
# pruned (trigger(run_id=...)), so a key is remembered with the due time of the index row it was read for
# and read again when a row names another (a new run, or the same one retrying).
_CONCURRENCY_KEYS_KEPT: Final = 100_000
# Bytes of the record limit a new run must leave free for what its lifecycle adds to its record without
# a check of its own: the lease of a claim (a worker id of up to 512 characters, escaped) and a
# failure Runlane records itself. Outputs, releases and cancellations are checked when they happen.
RUN_RECORD_HEADROOM_BYTES: Final = 4096
# More a run leaves free unless an operator's rerun or retry created it: that recovery run repeats its
# payload and meta and adds its link to the source run (and the operator as actor), so a run trigger()
# accepted can always be rerun or retried.
RECOVERY_LINK_BYTES: Final = 1024
_RECOVERY_SOURCES: Final = frozenset({RunSourceType.RERUN, RunSourceType.MANUAL_RETRY})

T = TypeVar("T")
R = TypeVar("R")


class _ForRun(Protocol):
    @property
    def run_id(self) -> str: ...


Q = TypeVar("Q", bound=_ForRun)  # a request about one run


# ---------------------------------------------------------------------------------------------
# Keys


# Keys are built on every write path, mostly from the same collection and environment, so the encoded
# ``collection/environment`` prefix is computed once. Every fast path produces exactly the text of
# ``encode_storage_tuple``; a component that is not a plain ``str`` or not valid Unicode takes the
# validating ``StorageRecordKey`` constructor, which raises the precise contract error.


@functools.lru_cache(maxsize=256)
def _encoded_prefix(collection: str, env_key: str) -> str:
    return encode_storage_tuple((collection, env_key))


@functools.lru_cache(maxsize=256)
def _encoded_tuple(parts: tuple[str, ...]) -> str:
    """Cached encodings of small repeated tuples (index partitions such as ``(environment, queue)``)."""
    return encode_storage_tuple(parts)


def _hex(component: str) -> str:
    """One encoded tuple component; raises ``UnicodeEncodeError`` / ``AttributeError`` when it is no text."""
    return component.encode("utf-8").hex()


def _key1(collection: str, env_key: str, part: str) -> StorageRecordKey:
    if type(env_key) is str and type(part) is str:
        try:
            encoded = f"{_encoded_prefix(collection, env_key)}/{_hex(part)}"
        except (UnicodeEncodeError, RunlaneError):
            pass
        else:
            return StorageRecordKey._trusted(collection, (env_key, part), encoded)
    return StorageRecordKey(collection, env_key, part)


def _key2(collection: str, env_key: str, first: str, second: str) -> StorageRecordKey:
    if type(env_key) is str and type(first) is str and type(second) is str:
        try:
            encoded = f"{_encoded_prefix(collection, env_key)}/{_hex(first)}/{_hex(second)}"
        except (UnicodeEncodeError, RunlaneError):
            pass
        else:
            return StorageRecordKey._trusted(collection, (env_key, first, second), encoded)
    return StorageRecordKey(collection, env_key, first, second)


def _index_entry(name: StorageIndexName, partition: tuple[str, ...], sort: tuple[str, ...]) -> StorageIndexEntry:
    """``StorageIndexEntry(name, partition, sort)`` for core-built tuples (partition encodings cached)."""
    try:
        encoded_sort = "/".join([_hex(component) for component in sort])
        encoded_partition = _encoded_tuple(partition)
    except (UnicodeEncodeError, AttributeError, TypeError, RunlaneError):
        return StorageIndexEntry(name, partition, sort)
    return StorageIndexEntry._trusted(name, partition, sort, encoded_partition, encoded_sort)


# A caller's key (idempotency, singleton, concurrency, step) longer than this in UTF-8 is a part of its
# record's key by its digest: every lane then takes every key the API accepts (512 characters of any
# script), where a record key is bounded (Postgres indexes at most 2,704 bytes of one). Keys are ids, which
# never hold ':', so a digest cannot be taken for a key; the run keeps the key itself.
_MAX_KEY_PART_BYTES: Final = 512


# A signal key longer than this is its waits' index partition by its digest: their entries hold the run id
# too (as their record key), and a key of this size keeps one within what the run's trigger() checked (the
# run id and queue of its runnable entry) on every lane, with the longest environment name.
_MAX_SIGNAL_PARTITION_BYTES: Final = 256


def _key_part(key: str, max_bytes: int = _MAX_KEY_PART_BYTES) -> str:
    encoded = key.encode("utf-8")
    if len(encoded) <= max_bytes:
        return key
    return "sha256:" + hashlib.sha256(encoded).hexdigest()


def signal_wait_partition(signal_key: str) -> str:
    """The partition component of the runs waiting on ``signal_key`` (their resume checks the key itself)."""
    return _key_part(signal_key, _MAX_SIGNAL_PARTITION_BYTES)


def idempotency_owner_key(env_key: str, task_id: str, key: str) -> StorageRecordKey:
    return _key2(IDEMPOTENCY_OWNERS_COLLECTION, env_key, task_id, _key_part(key))


def singleton_owner_key(env_key: str, key: str) -> StorageRecordKey:
    return _key1(SINGLETON_OWNERS_COLLECTION, env_key, _key_part(key))


def queue_capacity_key(env_key: str, queue: str, concurrency_key: str | None) -> StorageRecordKey:
    # Runs without a concurrency key share one partition; ids are never empty, so "" cannot collide.
    partition = "" if concurrency_key is None else _key_part(concurrency_key)
    return _key2(QUEUE_CAPACITY_COLLECTION, env_key, queue, partition)


def run_step_key(env_key: str, run_id: str, step_key: str) -> StorageRecordKey:
    return _key2(RUN_STEPS_COLLECTION, env_key, run_id, _key_part(step_key))


def run_step_keys(env_key: str, run_id: str, step_key: str) -> tuple[StorageRecordKey, ...]:
    """Where a step's record may be: its key, then, for a step key past 512 bytes, the key itself in place
    of its digest, as a release before the digest stored it (a run released then resumes with its steps)."""
    key = run_step_key(env_key, run_id, step_key)
    if key.parts[-1] == step_key:
        return (key,)
    return (key, _key2(RUN_STEPS_COLLECTION, env_key, run_id, step_key))


_DIGEST_PART: Final = re.compile(r"sha256:[0-9a-f]{64}")


def is_step_position(value: object) -> bool:
    """Whether ``value`` is a position in a run's steps, in step-key order: a step key, or the digest
    a step key past 512 bytes is stored by."""
    return is_valid_id(value) or (isinstance(value, str) and _DIGEST_PART.fullmatch(value) is not None)


def completion_wait_key(env_key: str, source_run_id: str) -> StorageRecordKey:
    return _key1(RUN_COMPLETION_WAITS_COLLECTION, env_key, source_run_id)


def outbox_message_key(env_key: str, outbox_message_id: str) -> StorageRecordKey:
    return _key1(OUTBOX_MESSAGES_COLLECTION, env_key, outbox_message_id)


@functools.lru_cache(maxsize=1024)
def _cached_run_key(env_key: str, run_id: str) -> StorageRecordKey:
    return _key1(RUNS_COLLECTION, env_key, run_id)


def _run_key(env_key: str, run_id: str) -> StorageRecordKey:
    """A run's key; the keys of recently used runs are shared (a run is read and written by every
    transition, and keys are immutable)."""
    if type(env_key) is str and type(run_id) is str:
        return _cached_run_key(env_key, run_id)
    return _key1(RUNS_COLLECTION, env_key, run_id)


def new_event_id() -> str:
    """A fresh durable event id (``evt_`` + 32 hex digits); never call it inside a transaction callback."""
    return f"evt_{random_uuid4_hex()}"


class _EventIds:
    """Event ids for one write path, derived from a base drawn before the transaction.

    ``restart()`` runs at the top of every attempt, so a replayed attempt hands out the same ids.
    """

    __slots__ = ("_base", "_next")

    def __init__(self) -> None:
        self._base = random_bits_128()
        self._next = 0

    def restart(self) -> None:
        self._next = 0

    def take(self) -> str:
        value = (self._base + self._next) & _EVENT_ID_MASK
        self._next += 1
        return f"evt_{value:032x}"


# ---------------------------------------------------------------------------------------------
# Index derivation


def delayed_delivery_at(run: RunRecord) -> datetime | None:
    """When a delayed trigger's run needs its delivery requested: a queued run whose only event is
    ``run.created`` with a ``run_at`` (an unbounded queue's trigger requests delivery at once, a bounded
    queue's run is dispatched instead). ``None`` for any other run."""
    if run.status is not RunStatus.QUEUED or run.event_sequence != 1:
        return None
    return run.run_at


def run_index_entries(run: RunRecord, bounded: Collection[str] = ()) -> tuple[StorageIndexEntry, ...]:
    """Every index entry of a run record, derived only from the run and the bounded queue names.

    A queued run of a bounded queue (one named in ``bounded``) is a dispatch candidate: without a
    reservation at its runnable time, with one at ``dispatch_expires_at`` (so an expired reservation
    is found again). So is a bounded queue's run due for delivery recovery (a due retry or release, an
    expired lease): maintenance wakes it through a capacity reservation, never with a bare delivery
    request, so it is a dispatch candidate instead of a delivery-recovery one.
    """
    env = environment_key(run.environment)
    run_id = run.id
    status = run.status
    entries: list[StorageIndexEntry] = []
    if status in _TERMINAL:
        if run.finished_at is not None:
            entries.append(
                _index_entry(
                    StorageIndexName.RUNS_TERMINAL_BY_FINISHED_AT, (env,), (encode_iso_date(run.finished_at), run_id)
                )
            )
    else:
        if status in _RUNNABLE:
            runnable_at = get_run_runnable_available_at(run)
            if runnable_at is not None:
                runnable_iso = encode_iso_date(runnable_at)
                entries.append(
                    _index_entry(StorageIndexName.RUNS_RUNNABLE, (env, run.queue), (runnable_iso, run_id))
                )
                recovery_at = get_run_delivery_recovery_available_at(run)
                if recovery_at is not None:
                    # Every recovery candidate is a runnable candidate at the same time (scheduled,
                    # retrying, released: run_at; running: lease expiry), so the encoding is shared.
                    recovery_iso = runnable_iso if recovery_at == runnable_at else encode_iso_date(recovery_at)
                    if bounded and run.queue in bounded:
                        entries.append(
                            _index_entry(
                                StorageIndexName.RUNS_NEEDING_DISPATCH, (env, run.queue), (recovery_iso, run_id)
                            )
                        )
                    else:
                        entries.append(
                            _index_entry(StorageIndexName.RUNS_NEEDING_DELIVERY, (env,), (recovery_iso, run_id))
                        )
                if status is RunStatus.QUEUED and not (bounded and run.queue in bounded):
                    delayed = delayed_delivery_at(run)
                    if delayed is not None:
                        entries.append(
                            _index_entry(StorageIndexName.RUNS_NEEDING_DELIVERY, (env,), (runnable_iso, run_id))
                        )
                if status is RunStatus.QUEUED and bounded and run.queue in bounded:
                    reserved = run.dispatch_expires_at
                    dispatch_iso = runnable_iso if reserved is None else encode_iso_date(reserved)
                    entries.append(
                        _index_entry(StorageIndexName.RUNS_NEEDING_DISPATCH, (env, run.queue), (dispatch_iso, run_id))
                    )
        cancel_at = get_run_cancellation_finalization_available_at(run)
        if cancel_at is not None:
            entries.append(
                _index_entry(
                    StorageIndexName.RUNS_NEEDING_CANCELLATION_FINALIZATION,
                    (env,),
                    (encode_iso_date(cancel_at), run_id),
                )
            )
        timeout_at = get_run_attempt_timeout_finalization_available_at(run)
        if timeout_at is not None:
            entries.append(
                _index_entry(
                    StorageIndexName.RUNS_NEEDING_TIMEOUT_FINALIZATION, (env,), (encode_iso_date(timeout_at), run_id)
                )
            )
        wait = run.wait
        if status is RunStatus.RELEASED and wait is not None:
            # A wait's entry sorts by creation time alone (its record key, the run id, orders ties), and a
            # long signal key is partitioned by its digest: restating the run id after a key or another run's
            # id of 512 characters made the entry larger than any trigger() had checked, over a lane's index
            # entry limit (the release could then not be recorded).
            if wait.type is RunWaitConditionType.SIGNAL:
                entries.append(
                    _index_entry(
                        StorageIndexName.RUNS_WAITING_FOR_SIGNAL,
                        (env, signal_wait_partition(wait.signal_key)),
                        (encode_iso_date(run.created_at),),
                    )
                )
            elif wait.type is RunWaitConditionType.RUN_COMPLETION:
                entries.append(
                    _index_entry(
                        StorageIndexName.RUNS_WAITING_FOR_COMPLETION,
                        (env, wait.run_id),
                        (encode_iso_date(run.created_at),),
                    )
                )
    source = run.source
    if source is not None and source.source_run_id is not None:
        # By creation time alone, as a wait's entry: the run id after the source's made the entry of a child
        # or rerun with a long id of a run with one over a lane's index entry limit (its trigger was refused).
        entries.append(
            _index_entry(
                StorageIndexName.RUNS_BY_SOURCE_RUN, (env, source.source_run_id), (encode_iso_date(run.created_at),)
            )
        )
    return tuple(entries)


def _model_document(value: dict[str, Any]) -> StorageDocument:
    """The canonical document of a value dumped from already-validated models.

    Same text as ``StorageDocument.encode`` without walking the value again: the models checked
    every JSON field when they were built. Anything ``json.dumps`` or UTF-8 rejects (a non-finite
    number, a lone surrogate in a plain string field) falls back to the validating encoder, which
    raises the precise error.
    """
    envelope = {"schemaVersion": STORAGE_DOCUMENT_SCHEMA_VERSION, "value": value}
    try:
        # ``canonical_json_of_checked`` is this text; the UTF-8 bytes give the size without encoding again.
        data = orjson.dumps(envelope, option=orjson.OPT_SORT_KEYS)
    except orjson.JSONEncodeError:
        pass
    else:
        return StorageDocument(data.decode("utf-8"), len(data))
    try:
        text = canonical_json_of_checked(envelope)
        return StorageDocument(text, len(text.encode("utf-8")))
    except (ValueError, TypeError):  # UnicodeEncodeError is a ValueError
        return StorageDocument.encode(value)


def _value_document(value: dict[str, Any], fallback: Callable[..., dict[str, Any]], *args: Any) -> StorageDocument:
    """``_model_document(fallback(*args))`` for ``value`` built by the ``*_document_value`` dumps of the
    same models (their datetimes and enums left for ``orjson`` to write: identical text)."""
    try:
        data = document_dumps({"schemaVersion": STORAGE_DOCUMENT_SCHEMA_VERSION, "value": value})
    except orjson.JSONEncodeError:
        return _model_document(fallback(*args))
    return StorageDocument(data.decode("utf-8"), len(data))


def _run_json(run: RunRecord, counts: dict[str, int]) -> dict[str, Any]:
    return {"run": run_record_json(run), "children": counts}


def _check_room(store: CoreStore, run: RunRecord, size: int) -> None:
    """Refuse a new run whose record (``size`` bytes) leaves less than ``RUN_RECORD_HEADROOM_BYTES`` of the
    record limit: its claim adds a lease to the record, and a run that could never be claimed would stay
    the oldest due work of its queue, failing every worker that reaches it. A run not created by a rerun
    or retry leaves ``RECOVERY_LINK_BYTES`` more, for its own rerun or retry."""
    limit = store._limits.max_record_bytes
    reserved = RUN_RECORD_HEADROOM_BYTES
    if run.source is None or run.source.type not in _RECOVERY_SOURCES:
        reserved += RECOVERY_LINK_BYTES
    if size > limit - reserved:
        raise StorageLimitError("max_record_bytes", limit - reserved, size, reserved=reserved)


def check_room_to_run(store: CoreStore, run: RunRecord, events: int) -> None:
    """``StorageLimitError`` when ``run``, new with ``events`` events, would not fit a record of ``store``'s lane
    with the room a new run leaves (the check its creation makes)."""
    _check_room(store, run, encode_run_document_fast(run, RunChildCounts(events=events)).byte_size)


def encode_run_document_fast(run: RunRecord, children: RunChildCounts) -> StorageDocument:
    """``tables.encode_run_document`` for a run built by the reducer (identical text).

    The document remembers its run, so the next transition reads it back without parsing, unless
    the run is terminal: finished runs are rarely read again, and a document without a remembered
    run lets a driver keep it compact (the in-memory driver packs it out of the garbage collector's
    sight). Reading one decodes the text. A terminal run's document remembers its run only as the
    source of its operator projection row, for the commit that writes it (``remember_run_row``),
    which such a driver drops.
    """
    counts = children.to_json()
    document = _value_document({"run": run_record_document_value(run), "children": counts}, _run_json, run, counts)
    if run.status in _TERMINAL:
        return remember_run_row(document, run)  # only the commit's projection row reads it
    return remember_run_document(document, run, children)


def _run_record(
    env: str,
    run: RunRecord,
    children: RunChildCounts,
    bounded: Collection[str] = (),
    key: StorageRecordKey | None = None,
) -> NewStorageRecord:
    """The stored record of ``run``; ``key`` is its key when the caller already holds it."""
    return NewStorageRecord._trusted(
        _run_key(env, run.id) if key is None else key,
        encode_run_document_fast(run, children),
        run_index_entries(run, bounded),
    )


def _reserved(run: RunRecord) -> bool:
    """Whether the run holds a dispatch reservation (a queued run's slot of a bounded queue). Its slot is
    given back when it is claimed or finished even if its queue is no longer bounded (a release dropped
    the limit), or the slot would stay taken until the reservation expires, should the limit come back."""
    return run.status is RunStatus.QUEUED and run.dispatch_expires_at is not None


def capacity_partition_room(env_key: str, queue: str, limits: StorageLimits) -> int:
    """How many occupants (running or reserved runs with generated ids, the longest, a scheduled run's)
    one capacity partition of ``queue`` can hold within a record of ``limits``: a queue whose
    ``concurrency_limit`` is larger could never reach it, its record refused once that many runs hold a slot."""
    key = queue_capacity_key(env_key, queue, None)
    expiry = encode_iso_date(datetime.max.replace(tzinfo=UTC))

    def size(count: int) -> int:
        occupants = {f"run_sched_{index:032x}": expiry for index in range(count)}
        return measure_storage_record(NewStorageRecord(key, StorageDocument.encode({"occupants": occupants})))

    one = size(1)
    each = size(2) - one
    return 1 + max(0, limits.max_record_bytes - one) // each


def _occupancy(run: RunRecord | None) -> str | None:
    """The capacity occupancy expiry of a run (ISO), or ``None`` when it occupies no slot."""
    if run is None:
        return None
    status = run.status
    if status in _ATTEMPT_OWNERS:
        lease = run.lease
        return None if lease is None else encode_iso_date(lease.expires_at)
    if status is RunStatus.QUEUED and run.dispatch_expires_at is not None:
        return encode_iso_date(run.dispatch_expires_at)
    return None


def _outbox_entries(message: OutboxMessage) -> tuple[StorageIndexEntry, ...]:
    env = environment_key(message.environment)
    entries = [
        _index_entry(
            StorageIndexName.OUTBOX_BY_RUN, (env, message.run_id), (encode_iso_date(message.created_at), message.id)
        )
    ]
    status = message.status
    due: datetime | None = None
    if status in (OutboxMessageStatus.PENDING, OutboxMessageStatus.FAILED):
        due = message.available_at
    elif status is OutboxMessageStatus.CLAIMED and message.claim is not None:
        due = message.claim.expires_at
    if due is not None:
        entries.append(_index_entry(StorageIndexName.OUTBOX_DUE, (env,), (encode_iso_date(due), message.id)))
    return tuple(entries)


def _outbox_record(env: str, message: OutboxMessage) -> NewStorageRecord:
    return NewStorageRecord(
        outbox_message_key(env, message.id),
        _model_document(message.model_dump(mode="json")),
        _outbox_entries(message),
    )


def _decode_outbox(record: StorageRecord) -> OutboxMessage:
    try:
        return OutboxMessage.model_validate(record.document.value)
    except ValueError as error:
        raise corrupt_record("outbox message", record.key, describe_problem(error), error) from None


def _new_outbox_message(
    record: RunEventRecord, event: RunDeliveryRequestedEvent, now: datetime, run_trace: dict[str, str] | None
) -> OutboxMessage:
    """The outbox row of one persisted ``run.delivery_requested`` (``event``, the record's own event; its
    id derives from the event id).

    Its wakeup carries the delivery's trace context, else the event's, else the one the run was
    triggered with, so a consumer's attempt joins the trace of the trigger however it was woken."""
    delivery = event.delivery
    trace = delivery.trace_carrier if delivery.trace_carrier is not None else event.trace_carrier
    return OutboxMessage(
        id=f"obx_{record.id.removeprefix('evt_')}",
        environment=delivery.environment,
        run_id=delivery.run_id,
        queue=delivery.queue,
        status=OutboxMessageStatus.PENDING,
        message=DeliveryMessage(
            environment=delivery.environment,
            run_id=delivery.run_id,
            queue=delivery.queue,
            requested_at=delivery.requested_at,
            trace_carrier=trace if trace is not None else run_trace,
        ),
        available_at=max(delivery.available_at, now),
        attempts=0,
        created_at=now,
        updated_at=now,
    )


def _event_records(
    env: str, run_id: str, start: int, events: Sequence[RunEvent], ids: _EventIds
) -> list[tuple[RunEventRecord, NewStorageRecord]]:
    """The history rows of ``events`` appended after sequence ``start`` (ids from ``ids``)."""
    try:
        run_hex = _hex(run_id)
        key_prefix = f"{_encoded_prefix(RUN_EVENTS_COLLECTION, env)}/{run_hex}/"
        partition = (env, run_id)
        encoded_partition = f"{_encoded_tuple((env,))}/{run_hex}"
    except (UnicodeEncodeError, AttributeError, TypeError, RunlaneError):
        return [_event_record(env, run_id, start + index + 1, ids.take(), event) for index, event in enumerate(events)]
    by_run = StorageIndexName.RUN_EVENTS_BY_RUN
    rows: list[tuple[RunEventRecord, NewStorageRecord]] = []
    sequence = start
    for event in events:
        sequence += 1
        # The event was validated when it was built; the record only wraps it with its identity.
        event_id = ids.take()
        record = build_validated(RunEventRecord, {"id": event_id, "sequence": sequence, "event": event})
        position = encode_storage_unsigned_integer(sequence)
        position_hex = position.encode("ascii").hex()
        stored = NewStorageRecord._trusted(
            StorageRecordKey._trusted(RUN_EVENTS_COLLECTION, (env, run_id, position), key_prefix + position_hex),
            remember_event_row(
                _value_document(
                    run_event_record_document_value(event_id, sequence, event),
                    run_event_record_json,
                    event_id,
                    sequence,
                    event,
                ),
                sequence,
                event,
            ),
            (StorageIndexEntry._trusted(by_run, partition, (position,), encoded_partition, position_hex),),
        )
        rows.append((record, stored))
    return rows


def _event_record(
    env: str, run_id: str, sequence: int, event_id: str, event: Any
) -> tuple[RunEventRecord, NewStorageRecord]:
    """One history row through the validating constructors (ids that are not valid Unicode raise)."""
    record = RunEventRecord.model_construct(id=event_id, sequence=sequence, event=event)
    position = encode_storage_unsigned_integer(sequence)
    stored = NewStorageRecord(
        StorageRecordKey(RUN_EVENTS_COLLECTION, env, run_id, position),
        _model_document(run_event_record_json(event_id, sequence, event)),
        (StorageIndexEntry(StorageIndexName.RUN_EVENTS_BY_RUN, (env, run_id), (position,)),),
    )
    return record, stored


def _idempotency_owner_record(key: StorageRecordKey, value: dict[str, Any]) -> NewStorageRecord:
    # The expiry entry sorts by time alone: its record key (task id and key) orders ties. Restating them
    # in the sort made the entry of a retained owner twice the size of the key run creation stored, over
    # a lane's index entry limit with long ids (the run's outcome could then not be recorded).
    expires_at = value.get("expires_at")
    indexes: tuple[StorageIndexEntry, ...] = ()
    if expires_at is not None:
        indexes = (StorageIndexEntry(StorageIndexName.IDEMPOTENCY_OWNERS_BY_EXPIRY, (key.parts[0],), (expires_at,)),)
    return NewStorageRecord(key, StorageDocument.encode(value), indexes)


def _completion_wait_marker_record(key: StorageRecordKey, value: dict[str, Any]) -> NewStorageRecord:
    # A marker whose source has finished while runs waited for it carries the time from which tick()
    # resumes them, should the process that finished the source not get to it (see ``_Attempt.apply``).
    due = value.get("resume_due")
    indexes: tuple[StorageIndexEntry, ...] = ()
    if isinstance(due, str):
        partition = completion_resume_partition(key.parts[0])
        indexes = (StorageIndexEntry(StorageIndexName.RUNS_NEEDING_DELIVERY, partition, (due,)),)
    return NewStorageRecord(key, StorageDocument.encode(value), indexes)


def completion_resume_partition(env: str) -> tuple[str, str]:
    """The ``RUNS_NEEDING_DELIVERY`` partition of the completion-wait markers whose source has finished and
    whose waiters may not all be resumed yet (their record keys name the sources; the sort is the due time)."""
    return (env, RUN_COMPLETION_WAITS_COLLECTION)


def _step_record(env: str, step: RunStepRecord) -> NewStorageRecord:
    key = run_step_key(env, step.run_id, step.step_key)
    return NewStorageRecord(
        key,
        _model_document(step.model_dump(mode="json")),
        (StorageIndexEntry(StorageIndexName.RUN_STEPS_BY_RUN, (env, step.run_id), (key.parts[-1],)),),
    )


# ---------------------------------------------------------------------------------------------
# Requests and results


@dataclass(frozen=True, slots=True)
class CreateRunPlan:
    """A new run: its ``run.created`` event and the events committed with it.

    ``follow_up`` is a ``run.delivery_requested`` (unbounded trigger), nothing (bounded trigger) or
    ``run.lease_claimed`` + ``run.started`` (``run_now``). Idempotency (task id, key, captured ttl)
    and the singleton key are read from ``created``.

    ``generated_run_id`` says core drew the run id for this plan (no caller chose it), so the run is
    certainly new: without idempotency and singleton keys the first attempt creates it without
    reading its key first (see ``CoreStore.create_run``).
    """

    created: RunCreatedEvent
    follow_up: tuple[RunEvent, ...] = ()
    generated_run_id: bool = False
    #: A queue to wake other processes' workers for, sent with the commit when the transaction can
    #: carry it (``StorageWakeHints``); ``CreateRunResult.hinted`` says whether it did.
    wake_hint: str | None = None

    @property
    def events(self) -> tuple[RunEvent, ...]:
        return (self.created, *self.follow_up)


@dataclass(frozen=True, slots=True)
class CreateRunResult:
    """``outcome`` is ``created`` (``events`` are the persisted rows) or ``returned_existing``
    (``run`` is the live idempotency owner's run and nothing was written)."""

    run: RunRecord
    outcome: TriggerOutcomeType
    events: tuple[RunEventRecord, ...] = ()
    observations: tuple[RunlaneObservation, ...] = ()
    outbox: tuple[OutboxMessage, ...] = ()
    hinted: bool = False  # the plan's wake hint went out with the commit

    @property
    def created(self) -> bool:
        return self.outcome is TriggerOutcomeType.CREATED


@dataclass(frozen=True, slots=True)
class RunnableRef:
    run_id: str
    queue: str
    available_at: datetime


@dataclass(frozen=True, slots=True)
class ClaimRequest:
    """One lease claim. ``queue`` (when set) must be the run's queue; ``also_start`` appends
    ``run.started`` for the next attempt in the same commit."""

    run_id: str
    queue: str | None
    worker_id: str
    lease_token: str
    lease_ms: int
    attempt_deadline_ms: int | None = None
    also_start: bool = False

    @classmethod
    def to_start(
        cls, run_id: str, worker_id: str, lease_ms: int, attempt_deadline_ms: int | None, *, queue: str | None = None
    ) -> ClaimRequest:
        """A worker's claim under a fresh lease token that also starts the run's next attempt."""
        return cls(run_id, queue, worker_id, random_uuid4_hex(), lease_ms, attempt_deadline_ms, also_start=True)


@dataclass(frozen=True, slots=True)
class NextClaimRequest:
    """Claim the oldest due run of ``queues`` that no other caller is claiming (``claim_next``).

    ``attempt_deadline_ms`` is an explicit attempt budget; without one, the run's task decides
    (``claim_next``'s ``task_deadline``). With ``confirm_idle`` (the default), no run is claimed only
    when a scan of the whole queue found nothing; without it, a scan that starts where the previous
    one found its oldest candidate may say so, and a run due below that point waits for the next
    full scan, at most a second later (``_RunnableFloors``)."""

    queues: tuple[str, ...]
    worker_id: str
    lease_ms: int
    attempt_deadline_ms: int | None = None
    confirm_idle: bool = True


@dataclass(frozen=True, slots=True)
class ClaimResult:
    """``run`` is the claimed projection, or ``None`` with ``reason`` saying why the claim was not made.

    A lost race is a result, never an exception; ``error`` is set only when the run could not be
    processed at all (a corrupt record, an oversized single claim).
    """

    run_id: str
    run: RunRecord | None
    reason: ExecuteDeliveryIgnoredReason | None = None
    events: tuple[RunEventRecord, ...] = ()
    error: RunlaneError | None = None
    observations: tuple[RunlaneObservation, ...] = ()

    @property
    def claimed(self) -> bool:
        return self.run is not None


@dataclass(frozen=True, slots=True)
class AppendResult:
    """The projected run and the exact event rows persisted (empty for a no-op).

    ``completion_waiters`` is ``True`` when this write made the run terminal and a completion-wait
    marker exists for it: the caller must then scan ``RUNS_WAITING_FOR_COMPLETION``.
    ``observations`` are the sanitized observations of ``events``, as appended to the stream.
    """

    run: RunRecord
    events: tuple[RunEventRecord, ...] = ()
    completion_waiters: bool = False
    observations: tuple[RunlaneObservation, ...] = ()
    outbox: tuple[OutboxMessage, ...] = ()


Build = Callable[[RunRecord, datetime], Sequence[RunEvent]]


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    """One append to an existing run inside a batch.

    ``build(run, now)`` is pure and returns the events to append (``[]`` for a no-op). With
    ``lease_token`` the write is fenced: the run must be running or cancellation-requested under that
    lease. ``known`` is any earlier version of the run; its immutable identity fields let the batch
    read the run and its owner rows in one round trip.
    """

    run_id: str
    build: Build
    lease_token: str | None = None
    known: RunRecord | None = None


@dataclass(frozen=True, slots=True)
class StepCompletion:
    """One step's output for ``CoreStore.complete_steps``."""

    step_key: str
    token: str
    output: Any


@dataclass(frozen=True, slots=True)
class HeartbeatRequest:
    run_id: str
    lease_token: str
    worker_id: str
    lease_ms: int
    known: RunRecord | None = None


@dataclass(frozen=True, slots=True)
class ReserveRequest:
    """One bounded-queue dispatch reservation, held for ``dispatch_timeout_ms`` once made."""

    run_id: str
    dispatch_timeout_ms: int


@dataclass(frozen=True, slots=True)
class ReserveResult:
    """``run`` is the reserved projection, or ``None`` when the run was not reserved (not dispatchable,
    partition full); ``error`` only when the run could not be processed at all."""

    run_id: str
    run: RunRecord | None
    events: tuple[RunEventRecord, ...] = ()
    observations: tuple[RunlaneObservation, ...] = ()
    outbox: tuple[OutboxMessage, ...] = ()
    error: RunlaneError | None = None

    @property
    def reserved(self) -> bool:
        return self.run is not None


@dataclass(frozen=True, slots=True)
class OutboxMark:
    """The publish result of one claimed outbox row."""

    outbox_message_id: str
    status: OutboxMessageStatus
    published_at: datetime | None = None
    provider_message_id: str | None = None
    failure: OutboxFailureRecord | None = None
    next_available_at: datetime | None = None


# ---------------------------------------------------------------------------------------------
# Errors


class _Gone:
    """A run a capacity scan's index row named but storage no longer holds (pruned meanwhile)."""


_GONE: Final = _Gone()


class _Refused:
    """What an attempt returns instead of raising ``error``, an inconsistency between records it read
    (an owner naming a run it does not find holding the key): two reads are two snapshots, so another
    process's commit between them (the run finishing and pruned) looks the same. Returned, the attempt
    ends with the driver validating its reads: stale ones replay it, and only reads that still hold at
    commit, durable corruption indeed, raise ``error`` (``_unless_refused``)."""

    __slots__ = ("error",)

    def __init__(self, error: RunlaneError) -> None:
        self.error = error


def _unless_refused(result: T | _Refused) -> T:
    if isinstance(result, _Refused):
        raise result.error
    return result


class _NeedKeys(Exception):
    """An attempt found it needs records it did not read; the write path restarts reading them too."""

    def __init__(self, keys: Iterable[StorageRecordKey]) -> None:
        super().__init__("more keys needed")
        self.keys = tuple(keys)


class _UnreadableRun(Exception):
    """The driver refused to read a candidate run's record: the claim transaction rolls back and retries
    without it."""

    def __init__(self, run_id: str, error: RunlaneError) -> None:
        super().__init__(run_id)
        self.run_id = run_id
        self.error = error


def _unreadable_run(error: RunlaneError, env: str, run_ids: Iterable[str]) -> str | None:
    """The run among ``run_ids`` whose stored record ``error`` says the driver could not read (drivers
    name the record in ``meta["key"]``), if any."""
    if error.code is not ErrorCode.INVARIANT_VIOLATION:
        return None
    key = error.meta.get("key")
    if not isinstance(key, str):
        return None
    for run_id in run_ids:
        if _run_key(env, run_id).encoded == key:
            return run_id
    return None


def _lease_conflict(run_id: str, why: str) -> RunlaneError:
    return create_storage_conflict_error(
        StorageConflictKind.LEASE_OWNERSHIP,
        f"Lease ownership of run {run_id} was lost: {why}. Abandon the attempt; another worker or maintenance owns the run now.",
        meta={"run_id": run_id},
    )


def run_not_found(run_id: str, environment: Environment) -> RunlaneError:
    """``run_not_found`` for ``run_id``, worded the same by every path that reports it. It names the
    environment: where several share a database, a run of another one is the likeliest cause."""
    return RunlaneError(
        ErrorCode.RUN_NOT_FOUND,
        f"Run {run_id} does not exist in environment {environment.name!r}.",
        meta={"run_id": run_id, "environment": environment.name},
    )


def _utc(value: datetime) -> datetime:
    return value if value.tzinfo is UTC else value.astimezone(UTC)


def _event_observations(
    store: CoreStore, run: RunRecord, records: Sequence[RunEventRecord]
) -> tuple[tuple[RunlaneObservation, ...], list[StorageDocument]]:
    """The observations of the events one commit appends to ``run`` (as projected by that commit) and
    their stream documents: exactly ``event_observation_values(run, records)``, encoded. The
    observation objects are built only when the runtime has live observers (``store.observing``)."""
    observations = (
        tuple([
            observation_for_event(record, run, status) for record, status in zip(records, event_statuses(run, records))
        ])
        if store.observing
        else ()
    )
    return observations, event_observation_documents(run, records)


# ---------------------------------------------------------------------------------------------
# One transaction attempt


class _RunSlot:
    """A run read by an attempt, with the transitions applied to it so far."""

    __slots__ = ("changed", "children", "events", "outbox", "record", "run")

    def __init__(self, record: StorageRecord | None, run: RunRecord, children: RunChildCounts) -> None:
        self.record = record
        self.run = run
        self.children = children
        self.events: list[NewStorageRecord] = []
        self.outbox: list[OutboxMessage] = []
        self.changed = False


class _Attempt:
    """The working state of one transaction attempt: records read, runs and owner rows as changed by
    the transitions applied so far, and the staging of every change at the end.

    Several transitions in one batch may touch the same owner row (two runs of one capacity
    partition) or the same run; each sees the others' effects and every key is staged once.
    """

    def __init__(self, store: CoreStore, tx: StorageTransaction) -> None:
        self.store = store
        self.env = store.env_key
        self.tx = tx
        self.records: dict[str, StorageRecord | None] = {}
        self.keys: dict[str, StorageRecordKey] = {}
        self.runs: dict[str, _RunSlot | None] = {}
        # Owner rows (idempotency, singleton, markers): values as read, and the changes to stage
        # (a value dict, or None to delete).
        self.owners_read: dict[str, dict[str, Any] | None] = {}
        self.owner_writes: dict[str, dict[str, Any] | None] = {}
        # Capacity partitions: run id -> lease expiry ISO.
        self.capacity: dict[str, dict[str, str]] = {}
        self.capacity_original: dict[str, dict[str, str]] = {}
        self.markers: dict[str, StorageRecordKey] = {}
        # Observation stream documents of every transition applied so far, in commit order.
        self.observed: list[StorageDocument] = []
        self.first_read = True
        self.now = datetime.min.replace(tzinfo=UTC)
        self._now_iso: str | None = None

    # -- reads ---------------------------------------------------------------------------------

    async def read(self, keys: Iterable[StorageRecordKey]) -> None:
        wanted: dict[str, StorageRecordKey] = {}
        if self.first_read:
            # The point-write observation fallback needs the stream head in the first read (no-op
            # with native ordered append).
            self.first_read = False
            for key in self.store.observation_heads:
                wanted[key.encoded] = key
        for key in keys:
            encoded = key.encoded
            if encoded not in self.records and encoded not in wanted:
                wanted[encoded] = key
        if not wanted:
            return
        ordered = list(wanted.values())
        found = await self.tx.get(ordered)
        for key, record in zip(ordered, found):
            self.records[key.encoded] = record
            self.keys[key.encoded] = key

    async def seal(self) -> datetime:
        self.now = _utc(await self.tx.now())
        self._now_iso = None
        return self.now

    @property
    def now_iso(self) -> str:
        """``now`` as a storage date, encoded on first use (most attempts compare none)."""
        text = self._now_iso
        if text is None:
            text = self._now_iso = encode_iso_date(self.now)
        return text

    def require(self, keys: Iterable[StorageRecordKey]) -> None:
        missing = [key for key in keys if key.encoded not in self.records]
        if missing:
            raise _NeedKeys(missing)

    def slot(self, run_id: str) -> _RunSlot | None:
        """The run as changed by this attempt so far (``None``: absent). Raises for a corrupt record."""
        if run_id in self.runs:
            return self.runs[run_id]
        key = _run_key(self.env, run_id)
        if key.encoded not in self.records:
            raise _NeedKeys((key,))
        record = self.records[key.encoded]
        slot = None
        if record is not None:
            run, children = self.store._decode_run(record)
            slot = _RunSlot(record, run, children)
        self.runs[run_id] = slot
        return slot

    def peek_run(self, run_id: str) -> RunRecord | None:
        """Like ``slot`` but a corrupt record reads as absent (used for key prediction only)."""
        try:
            slot = self.slot(run_id)
        except RunlaneError:
            return None
        return None if slot is None else slot.run

    def owner(self, key: StorageRecordKey) -> dict[str, Any] | None:
        """An owner row as this attempt left it so far (``None``: absent)."""
        encoded = key.encoded
        if encoded in self.owner_writes:
            return self.owner_writes[encoded]
        if encoded in self.owners_read:
            return self.owners_read[encoded]
        record = self.records[encoded]
        value = None if record is None else record.document.value
        self.owners_read[encoded] = value
        return value

    def set_owner(self, key: StorageRecordKey, value: dict[str, Any] | None) -> None:
        self.owner_writes[key.encoded] = value

    def occupants(self, key: StorageRecordKey) -> dict[str, str]:
        encoded = key.encoded
        found = self.capacity.get(encoded)
        if found is not None:
            return found
        record = self.records[encoded]
        original: dict[str, str] = {}
        if record is not None:
            value = record.document.value.get("occupants")
            if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
                raise corrupt_record("queue capacity", key, "its occupants are not a map of run ids to lease expiries")
            original = value
        self.capacity_original[encoded] = original
        working = dict(original)
        self.capacity[encoded] = working
        return working

    # -- key prediction --------------------------------------------------------------------------

    def marker_key(self, run_id: str) -> StorageRecordKey:
        """The completion-wait marker key of ``run_id`` (built once per attempt)."""
        key = self.markers.get(run_id)
        if key is None:
            key = self.markers[run_id] = completion_wait_key(self.env, run_id)
        return key

    def finish_keys(self, run: RunRecord) -> list[StorageRecordKey]:
        return _finish_keys(self.store, run)

    def capacity_keys(self, run: RunRecord) -> list[StorageRecordKey]:
        # A run reserved while its queue was bounded holds a slot until its claim, whatever the queue
        # is now: the claim must be able to give the slot back (``_owner_effects``).
        if run.queue in self.store.queue_limits or _reserved(run):
            return [queue_capacity_key(self.env, run.queue, run.concurrency_key)]
        return []

    # -- transitions -----------------------------------------------------------------------------

    def free_slots(self, run: RunRecord) -> bool:
        """Whether the run's capacity partition has room for it (always, for unbounded queues, and for a
        run that holds a live slot of it already: a reservation becoming a lease adds no occupant, even
        when a lower limit than the one that granted it counts more occupants now)."""
        limit = self.store.queue_limits.get(run.queue)
        if limit is None:
            return True
        key = queue_capacity_key(self.env, run.queue, run.concurrency_key)
        self.require((key,))
        now_iso = self.now_iso
        occupants = self.occupants(key)
        held = occupants.get(run.id)
        if held is not None and held > now_iso:
            return True
        busy = 0
        for occupant, expires_at in occupants.items():
            if occupant != run.id and expires_at > now_iso:
                busy += 1
        return busy < limit

    def apply(self, slot: _RunSlot, events: Sequence[RunEvent], ids: _EventIds) -> AppendResult:
        """Project ``events`` onto the slot's run and record every consequence in this attempt.

        Everything that can fail (projection, missing keys, corrupt owner rows) runs before the
        attempt's state changes, so a failed transition leaves no trace in the batch.
        """
        old = slot.run
        new = project_run_events(old, old.event_sequence, events)
        effects: list[Callable[[], object]] = []
        resumed = self._completion_wait(new, effects)
        if resumed is not None:
            events = [*events, resumed]
            new = project_run_events(old, old.event_sequence, events)
        effects.extend(self._owner_effects(old, new))
        records = self._event_records(new, old.event_sequence, events, ids)
        rows = tuple([record for record, _ in records])
        observations, documents = _event_observations(self.store, new, rows)
        outbox = self._outbox_rows(rows, new)
        # Commit the transition into the attempt.
        for apply_effect in effects:
            apply_effect()
        self.observed.extend(documents)
        slot.run = new
        slot.children = RunChildCounts(
            events=slot.children.events + len(records),
            outbox=slot.children.outbox + len(outbox),
            steps=slot.children.steps,
            links=slot.children.links,
        )
        slot.events.extend(stored for _, stored in records)
        slot.outbox.extend(outbox)
        slot.changed = True
        waiters = False
        if new.status in _TERMINAL and old.status not in _TERMINAL:
            marker = self.marker_key(new.id)
            waiters = self.owner(marker) is not None
            if waiters:
                # Resuming the waiters is the caller's next write (``completion_waiters``). Should the process
                # die first, or storage stay away longer than it keeps trying, tick() finds the source by this
                # due time and resumes them; the caller clears it once every waiter is resumed.
                due = encode_iso_date(later(self.now, COMPLETION_RESUME_GRACE_MS))
                self.set_owner(marker, {"resume_due": due})
        return AppendResult(new, rows, waiters, observations, outbox)

    def _outbox_rows(self, rows: Sequence[RunEventRecord], run: RunRecord) -> tuple[OutboxMessage, ...]:
        """One outbox row per ``run.delivery_requested`` in ``rows`` on a transport lane (none otherwise).

        On a bounded queue only a dispatch reservation's request is published: a plain one (a signal or a
        finished run resuming a waiter) leaves the run queued for the capacity-reserving dispatch of
        ``tick()``, which publishes its wakeup with a slot; published at once, it would wake a consumer
        that cannot claim the run while the queue is full, and dispatch would publish a second one."""
        if not self.store.outbox:
            return ()
        trace = run.trace_carrier
        bounded = run.queue in self.store.queue_limits
        return tuple(
            [
                _new_outbox_message(row, event, self.now, trace)
                for row in rows
                if isinstance(event := row.event, RunDeliveryRequestedEvent)
                and (not bounded or event.delivery.dispatch_expires_at is not None)
            ]
        )

    def create(
        self, run: RunRecord, events: Sequence[RunEvent], ids: _EventIds
    ) -> tuple[tuple[RunEventRecord, ...], tuple[RunlaneObservation, ...], tuple[OutboxMessage, ...]]:
        effects = self._owner_effects(None, run)
        records = self._event_records(run, _NEW_SEQUENCE, events, ids)
        rows = tuple([record for record, _ in records])
        observations, documents = _event_observations(self.store, run, rows)
        outbox = self._outbox_rows(rows, run)
        for apply_effect in effects:
            apply_effect()
        self.observed.extend(documents)
        slot = _RunSlot(None, run, RunChildCounts(events=len(records), outbox=len(outbox)))
        slot.events.extend(stored for _, stored in records)
        slot.outbox.extend(outbox)
        slot.changed = True
        self.runs[run.id] = slot
        return rows, observations, outbox

    def _event_records(
        self, run: RunRecord, start: int, events: Sequence[RunEvent], ids: _EventIds
    ) -> list[tuple[RunEventRecord, NewStorageRecord]]:
        return _event_records(self.env, run.id, start, events, ids)

    def _completion_wait(self, new: RunRecord, effects: list[Callable[[], object]]) -> RunEvent | None:
        """For a release that waits for another run: the ``run.delivery_requested`` that resumes it in
        the same commit when the source is already terminal; otherwise (running, waiting, or absent: a
        run still to be created with that id) the marker is created (an effect) so the source's terminal
        transition knows to look for waiters."""
        wait = new.wait
        if new.status is not RunStatus.RELEASED or wait is None or wait.type is not RunWaitConditionType.RUN_COMPLETION:
            return None
        source_key = _run_key(self.env, wait.run_id)
        marker = completion_wait_key(self.env, wait.run_id)
        self.require((source_key, marker))
        source = self.peek_run(wait.run_id)
        if source is not None and source.status in _TERMINAL:
            now = self.now
            return RunDeliveryRequestedEvent(
                run_id=new.id,
                environment=new.environment,
                occurred_at=now,
                actor=_SYSTEM_ACTOR,
                delivery=DeliveryIntent(
                    environment=new.environment, run_id=new.id, queue=new.queue, requested_at=now, available_at=now
                ),
            )
        if self.owner(marker) is None:
            effects.append(lambda: self.set_owner(marker, {}))
        return None

    def _owner_effects(self, old: RunRecord | None, new: RunRecord) -> list[Callable[[], object]]:
        """Owner-row changes implied by ``old -> new``, as deferred mutations (validated now)."""
        effects: list[Callable[[], object]] = []
        env = self.env
        run_id = new.id
        # Bounded-queue capacity: an occupant while an attempt may be running (until its lease
        # expiry) or while a queued run holds a dispatch reservation (until it expires). A claim of a
        # reserved run turns the reservation into the lease occupant.
        bounded = new.queue in self.store.queue_limits
        wanted = _occupancy(new) if bounded else None
        occupied = old is not None and ((bounded and old.status in _ATTEMPT_OWNERS) or _reserved(old))
        if wanted is not None or occupied:
            key = queue_capacity_key(env, new.queue, new.concurrency_key)
            self.require((key,))
            occupants = self.occupants(key)
            if occupants.get(run_id) != wanted:
                if wanted is None:
                    effects.append(lambda: occupants.pop(run_id, None))
                else:
                    effects.append(lambda: occupants.__setitem__(run_id, wanted))
        if new.status in _TERMINAL and (old is None or old.status not in _TERMINAL):
            keys: list[StorageRecordKey] = [self.marker_key(run_id)]
            idempotency = None
            if new.idempotency_key is not None:
                idempotency = idempotency_owner_key(env, new.task_id, new.idempotency_key)
                keys.append(idempotency)
            singleton = None
            if new.singleton_key is not None:
                singleton = singleton_owner_key(env, new.singleton_key)
                keys.append(singleton)
            self.require(keys)
            if idempotency is not None:
                owner = self.owner(idempotency)
                if owner is not None and owner.get("run_id") == run_id:
                    ttl = owner.get("ttl")
                    if new.status is RunStatus.FAILED or ttl == "active" or new.finished_at is None:
                        effects.append(lambda: self.set_owner(idempotency, None))
                    else:
                        ttl_ms = (
                            ttl if isinstance(ttl, int) and not isinstance(ttl, bool) else _DEFAULT_IDEMPOTENCY_TTL_MS
                        )
                        expires_at = encode_iso_date(later(new.finished_at, ttl_ms))
                        retained = {"run_id": run_id, "ttl": ttl_ms, "expires_at": expires_at}
                        effects.append(lambda: self.set_owner(idempotency, retained))
            if singleton is not None:
                owner = self.owner(singleton)
                if owner is not None and owner.get("run_id") == run_id:
                    effects.append(lambda: self.set_owner(singleton, None))
        return effects

    # -- staging ---------------------------------------------------------------------------------

    def _check_room_to_run(self, run: RunRecord, stored: NewStorageRecord) -> None:
        _check_room(self.store, run, stored.document.byte_size)

    def stage(self) -> None:
        tx = self.tx
        env = self.env
        bounded = self.store.queue_limits
        for slot in self.runs.values():
            if slot is None or not slot.changed:
                continue
            known_key = None if slot.record is None else slot.record.key
            stored = _run_record(env, slot.run, slot.children, bounded, known_key)
            if slot.record is None:
                self._check_room_to_run(slot.run, stored)
                tx.create(stored)
            else:
                tx.replace(slot.record, stored)
            for event in slot.events:
                tx.create(event)
            for message in slot.outbox:
                tx.create(_outbox_record(env, message))
        for encoded, value in self.owner_writes.items():
            current = self.records.get(encoded)
            key = self.keys[encoded]
            if value is None:
                if current is not None:
                    tx.delete(current)
                continue
            if current is not None and self.owners_read.get(encoded) == value:
                continue
            if key.collection == IDEMPOTENCY_OWNERS_COLLECTION:
                new_record = _idempotency_owner_record(key, value)
            elif key.collection == RUN_COMPLETION_WAITS_COLLECTION:
                new_record = _completion_wait_marker_record(key, value)
            else:
                new_record = NewStorageRecord(key, StorageDocument.encode(value))
            if current is None:
                tx.create(new_record)
            else:
                tx.replace(current, new_record)
        for encoded, working in self.capacity.items():
            if working == self.capacity_original[encoded]:
                continue  # unchanged: expired occupants are pruned only when the row is rewritten anyway
            now_iso = self.now_iso
            live = {run_id: expires_at for run_id, expires_at in working.items() if expires_at > now_iso}
            current = self.records.get(encoded)
            if not live:
                if current is not None:
                    tx.delete(current)
                continue
            new_record = NewStorageRecord(self.keys[encoded], StorageDocument.encode({"occupants": live}))
            if current is None:
                tx.create(new_record)
            else:
                tx.replace(current, new_record)
        if self.observed:
            self.store.stage_observation_documents(tx, self.observed, self.records)


# ---------------------------------------------------------------------------------------------
# Where scans for due runs start


class _RunnableFloors:
    """Where this process's scans for the due runs of each queue start.

    A claim deletes the run's row of the runnable index, and a store with multi-version rows
    (Postgres) keeps deleted rows in its index until they are vacuumed: a scan from the start of the
    queue's rows steps over every run claimed since, the more the longer the backlog or the time
    since the last vacuum (draining 20,000 queued runs, a scan took three times as long on average
    as draining 2,000). So a scan starts at the oldest candidate the previous scan of the queue
    found (the rows before it were gone, not yet committed, or held by other claimers), or, when a
    full scan found none, a second before the time that scan read up to: a worker woken for one new
    run does not step over every run the queue had since the last vacuum.

    A due run can still sit below that floor: a running run whose lease expired, or a retrying,
    released or scheduled run that came due, at a time before the floor; a run triggered by a
    process whose clock is behind; one another claimer held and let go. Such a run is found by the
    next full scan: the first scan of a queue, a scan ``FULL_SCAN_AFTER`` seconds or more after the
    queue's last full scan, and the rescan of a floor scan that found nothing, so a queue is only
    idle when the whole of it was read. Poll workers skip that rescan (``confirm_idle``): they look
    again within ``empty_poll_delay`` or at a wake-up, and an idle one would otherwise read the whole
    queue on every look.
    """

    FULL_SCAN_AFTER = 1.0  # seconds
    IDLE_MARGIN = timedelta(seconds=1)

    __slots__ = ("_floors",)

    def __init__(self) -> None:
        self._floors: dict[str, tuple[str, float]] = {}  # queue -> (floor, last full scan)

    def start(self, queue: str) -> str | None:
        """The encoded sort a scan of ``queue`` starts at, or ``None`` for a full scan."""
        known = self._floors.get(queue)
        if known is None or time.monotonic() - known[1] >= self.FULL_SCAN_AFTER:
            return None
        return known[0]

    def found(self, queue: str, first: tuple[str, ...] | None, *, full: bool, now: datetime) -> None:
        """Record a scan of ``queue`` for runs due at ``now``: the sort of the first candidate it held
        (``None``: none). A full scan that held none leaves the floor ``IDLE_MARGIN`` before ``now``
        (runs triggered meanwhile by a process whose clock is a little behind still sort above it)."""
        known = self._floors.get(queue)
        full = full or known is None
        if first is not None:
            floor = encode_storage_tuple(first)
        elif full:
            floor = encode_storage_tuple((encode_iso_date(now - self.IDLE_MARGIN),))
        else:  # an empty scan from the floor leaves it where it was
            floor = cast(tuple[str, float], known)[0]  # not a full scan: ``known`` is set
        self._floors[queue] = (floor, time.monotonic() if full else cast(tuple[str, float], known)[1])


# ---------------------------------------------------------------------------------------------
# The store


class CoreStore:
    """Typed tables over one ``StorageDriver`` for one environment.

    ``queue_limits`` maps each bounded queue name to its ``concurrency_limit``; runs of other queues
    take no capacity.
    """

    def __init__(
        self,
        driver: StorageDriver,
        environment: Environment,
        *,
        queue_limits: Mapping[str, int] | None = None,
        outbox: bool = False,
        observing: bool = True,
    ) -> None:
        self.driver = driver
        # Results carry the observation objects of their commit only for a runtime with live observers;
        # the stream records are written either way.
        self.observing = bool(observing)
        # Transport lanes write an outbox row with every run.delivery_requested.
        self.outbox = bool(outbox)
        self.environment = environment
        self.env_key = environment_key(environment)
        limits = dict(queue_limits or {})
        for name, limit in limits.items():
            if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
                raise RunlaneError(
                    ErrorCode.CONFIGURATION_INVALID,
                    f"Queue {name!r} needs a positive whole concurrency limit, got {limit!r}.",
                )
        self.queue_limits: dict[str, int] = limits
        # Keys every write path adds to its first read: the observation stream head, only when the
        # driver has no native ordered append.
        self.observation_heads: tuple[StorageRecordKey, ...] = observation_head_reads(driver.profile, environment)
        self._runnable_floors = _RunnableFloors()
        # Which queue's candidates a claim over several queues prefers next, per set of queues (turns).
        self._queue_turns: dict[tuple[str, ...], int] = {}
        # Where the next capacity scan of (index, queue) goes on past its window of oldest rows (see
        # ``open_candidates``); ``None``: right after that window.
        self._capacity_scan_resume: dict[tuple[StorageIndexName, str], str | None] = {}
        # run id -> (concurrency key, the encoded due time of the index row it was read for), of runs capacity
        # scans have read (oldest first, at most ``_CONCURRENCY_KEYS_KEPT``).
        self._concurrency_keys: dict[str, tuple[str | None, str]] = {}
        # ``(run_id, lease_token) -> bool``: whether an attempt of this process holds that lease (the
        # runtime's ``CancellationRegistry.holds``). A claim never takes a run from such an attempt,
        # whatever this process's clock says about the lease.
        self.holds_lease: Callable[[str, str], bool] | None = None
        # Runs the runtime set aside for the life of this store (an unreadable document, or a runnable
        # index row that keeps naming a run that is gone or finished): runnable scans pass over them so
        # the runs behind them still get claimed.
        self.set_aside_runs: set[str] = set()

    def lease_held_here(self, run: RunRecord) -> bool:
        """Whether ``run``'s lease belongs to a live attempt of this process (see ``holds_lease``)."""
        lease = run.lease
        holds = self.holds_lease
        return lease is not None and holds is not None and holds(run.id, lease.token)

    def __repr__(self) -> str:
        return f"CoreStore(driver={getattr(self.driver, 'name', self.driver)!r}, environment={self.env_key!r})"

    # -- codecs ----------------------------------------------------------------------------------

    def _decode_run(self, record: StorageRecord) -> tuple[RunRecord, RunChildCounts]:
        run, children = decode_run_document(record.document, record.key)
        if run.id != record.key.parts[-1] or environment_key(run.environment) != record.key.parts[0]:
            raise corrupt_record("run", record.key, "its id or environment does not match its key")
        return run, children

    @property
    def _limits(self) -> StorageLimits:
        return self.driver.profile.limits

    def _chunk_size(self, reads_per_item: int, records_per_item: int) -> int:
        """Items per transaction, leaving room for the observation stream head (a read in the point-write
        fallback, and a record either way). Estimates only: a chunk that still exceeds a limit is halved."""
        limits = self._limits
        reads = limits.max_point_reads - len(self.observation_heads)
        records = limits.max_transaction_records - 1
        return max(1, min(reads // reads_per_item, records // records_per_item))

    def stage_observations(
        self, tx: StorageTransaction, values: Sequence[dict[str, Any]], found: Mapping[str, StorageRecord | None]
    ) -> None:
        """Stage one attempt's observation values; ``found`` holds what the attempt read by encoded key."""
        head: Any = HEAD_NOT_READ
        heads = self.observation_heads
        if heads:
            head = found.get(heads[0].encoded, HEAD_NOT_READ)
        stage_observations(tx, self.driver.profile, self.environment, values, head=head, checked=True)

    def stage_observation_documents(
        self, tx: StorageTransaction, documents: Sequence[StorageDocument], found: Mapping[str, StorageRecord | None]
    ) -> None:
        """``stage_observations`` for documents from ``event_observation_documents``."""
        head: Any = HEAD_NOT_READ
        heads = self.observation_heads
        if heads:
            head = found.get(heads[0].encoded, HEAD_NOT_READ)
        stage_observation_documents(tx, self.driver.profile, self.env_key, documents, head=head)

    async def _transact(self, body: Callable[[StorageTransaction, tuple[StorageRecordKey, ...]], Any]) -> Any:
        """Run ``body`` in a transaction, restarting with more keys when an attempt asks for them."""
        extra: dict[str, StorageRecordKey] = {}
        while True:
            keys = tuple(extra.values())
            try:
                return await self.driver.with_transaction(lambda tx: body(tx, keys))  # awaited before ``keys`` changes
            except _NeedKeys as need:
                added = [key for key in need.keys if key.encoded not in extra]
                if not added:  # pragma: no cover - an attempt asked for keys it was given
                    raise RunlaneError(
                        ErrorCode.INVARIANT_VIOLATION, "A storage write path kept asking for the same keys."
                    ) from None
                for key in added:
                    extra[key.encoded] = key

    async def _split(
        self,
        items: Sequence[T],
        run_batch: Callable[[Sequence[T]], Any],
        on_limit: Callable[[T, StorageLimitError], R],
    ) -> list[R]:
        """Run ``items`` in chunks; a chunk that exceeds a storage limit rolled back and is halved."""
        try:
            return await run_batch(items)
        except StorageLimitError as error:
            if len(items) == 1:
                return [on_limit(items[0], error)]
            middle = len(items) // 2
            return [
                *await self._split(items[:middle], run_batch, on_limit),
                *await self._split(items[middle:], run_batch, on_limit),
            ]

    async def _chunked(
        self,
        items: Sequence[T],
        size: int,
        run_batch: Callable[[Sequence[T]], Any],
        on_limit: Callable[[T, StorageLimitError], R],
    ) -> list[R]:
        results: list[R] = []
        for start in range(0, len(items), size):
            results.extend(await self._split(items[start : start + size], run_batch, on_limit))
        return results

    # -- reads -----------------------------------------------------------------------------------

    async def get_run(self, run_id: str) -> RunRecord | None:
        """The stored run, pruned or not (the execution paths' read; no tombstone lookup)."""
        (record,) = await self.driver.get([_run_key(self.env_key, run_id)])
        return None if record is None else self._decode_run(record)[0]

    async def get_visible_run(self, run_id: str) -> RunRecord | None:
        """The run as operators see it: ``None`` from the commit that tombstoned it (one read of both keys)."""
        env = self.env_key
        record, tombstone = await self.driver.get([_run_key(env, run_id), run_tombstone_key(env, run_id)])
        if record is None or tombstone is not None:
            return None
        return self._decode_run(record)[0]

    async def get_runs(self, run_ids: Sequence[str]) -> list[RunRecord | None]:
        size = self._limits.max_point_reads
        runs: list[RunRecord | None] = []
        for start in range(0, len(run_ids), size):
            keys = [_run_key(self.env_key, run_id) for run_id in run_ids[start : start + size]]
            for record in await self.driver.get(keys):
                runs.append(None if record is None else self._decode_run(record)[0])
        return runs

    async def _peek_runs(self, run_ids: Sequence[str]) -> list[RunRecord | RunlaneError | None]:
        """``get_runs`` for a scan: a run whose record cannot be read is its ``invariant_violation``
        instead of failing the read of the others."""
        env = self.env_key
        found: list[RunRecord | RunlaneError | None] = []
        size = self._limits.max_point_reads
        for start in range(0, len(run_ids), size):
            chunk = list(run_ids[start : start + size])
            refused: dict[str, RunlaneError] = {}
            while True:
                readable = [run_id for run_id in chunk if run_id not in refused]
                try:
                    records = await self.driver.get([_run_key(env, run_id) for run_id in readable])
                except RunlaneError as error:
                    run_id = _unreadable_run(error, env, readable)
                    if run_id is None:
                        raise
                    refused[run_id] = error
                    continue
                break
            by_id = dict(zip(readable, records))
            for run_id in chunk:
                if run_id in refused:
                    found.append(refused[run_id])
                    continue
                record = by_id[run_id]
                try:
                    found.append(None if record is None else self._decode_run(record)[0])
                except RunlaneError as error:
                    if error.code is not ErrorCode.INVARIANT_VIOLATION:
                        raise
                    found.append(error)
        return found

    async def _concurrency_keys_of(self, rows: Sequence[tuple[str, str]]) -> list[str | None | RunlaneError | _Gone]:
        """The concurrency key of the run of each index row ``(due time, run id)``, for a capacity scan: from
        what this store remembers for that row, else read (``_peek_runs``; a run whose record cannot be read
        is its error, a run that is gone ``_GONE``)."""
        known = self._concurrency_keys
        read: dict[str, str | None | RunlaneError | _Gone] = {}
        for due, run_id in rows:
            entry = known.get(run_id)
            if entry is not None and entry[1] == due:
                read[run_id] = entry[0]
        unseen = [(due, run_id) for due, run_id in rows if run_id not in read]
        if unseen:
            for (due, run_id), run in zip(unseen, await self._peek_runs([run_id for _, run_id in unseen])):
                if isinstance(run, RunRecord):
                    read[run_id] = run.concurrency_key
                    known.pop(run_id, None)  # re-inserted as the newest
                    known[run_id] = (run.concurrency_key, due)
                else:
                    read[run_id] = _GONE if run is None else run
        keys = [read[run_id] for _, run_id in rows]
        if len(known) > _CONCURRENCY_KEYS_KEPT:
            newest = list(known.items())[len(known) // 2 :]
            known.clear()
            known.update(newest)
        return keys

    async def get_step(self, run_id: str, step_key: str) -> RunStepRecord | None:
        return _first_step(await self.driver.get(list(run_step_keys(self.env_key, run_id, step_key))))

    async def get_step_with_run(self, run_id: str, step_key: str) -> tuple[RunStepRecord | None, RunRecord | None]:
        """A step and its run, in one read: whether the step is stored, and who holds the run's lease now."""
        env = self.env_key
        *steps, run = await self.driver.get([*run_step_keys(env, run_id, step_key), _run_key(env, run_id)])
        return _first_step(steps), None if run is None else self._decode_run(run)[0]

    async def list_steps(
        self, run_id: str, *, after: str | None = None, limit: int = 100
    ) -> tuple[list[RunStepRecord], str | None]:
        """A page of a run's steps in step-key order after the step key ``after``, and the step key to
        continue after when more follow (``None`` at the end).

        One index query and one point read; a step deleted between them (its run pruned) is skipped.
        """
        query = StorageQuery(
            StorageIndexName.RUN_STEPS_BY_RUN,
            (self.env_key, run_id),
            StorageRange() if after is None else StorageRange(gt=encode_storage_tuple((after,))),
            limit=min(max(1, limit), self._limits.max_query_results, self._limits.max_point_reads),
        )
        result = await self.driver.query(query)
        if not result.items:
            return [], None
        records = await self.driver.get([item.key for item in result.items])
        steps: list[RunStepRecord] = []
        for item, record in zip(result.items, records):
            if record is None:
                continue
            step = _decode_step(record)
            if step.run_id != run_id or item.sort[-1] not in (step.step_key, _key_part(step.step_key)):
                raise corrupt_record(
                    "run step", record.key, f"it holds step {step.step_key!r} of run {step.run_id}, not its own"
                )
            steps.append(step)
        return steps, None if result.next_cursor is None else result.items[-1].sort[-1]

    async def has_completion_wait_marker(self, source_run_id: str) -> bool:
        (record,) = await self.driver.get([completion_wait_key(self.env_key, source_run_id)])
        return record is not None

    async def completion_resumed(self, source_run_id: str) -> None:
        """Clear the resume due time ``source_run_id``'s terminal commit left on its completion-wait marker,
        once every run that waited for it has been resumed (see ``_Attempt.apply``)."""
        key = completion_wait_key(self.env_key, source_run_id)

        async def body(tx: StorageTransaction, extra: tuple[StorageRecordKey, ...]) -> None:
            attempt = _Attempt(self, tx)
            await attempt.read([key, *extra])
            await attempt.seal()
            marker = attempt.owner(key)
            if marker is not None and "resume_due" in marker:
                attempt.set_owner(key, {})
                attempt.stage()

        await self._transact(body)

    async def find_idempotent_run(self, task_id: str, key: str) -> RunRecord | None:
        """The run owning ``(task_id, key)`` while the owner is live (an expired owner reads as absent)."""
        owner_key = idempotency_owner_key(self.env_key, task_id, key)

        async def body(tx: StorageTransaction) -> RunRecord | _Refused | None:
            (record,) = await tx.get([owner_key])
            if record is None:
                return None
            owner = record.document.value
            run_id = owner.get("run_id")
            if not isinstance(run_id, str):
                raise corrupt_record("idempotency owner", owner_key, "it names no run")
            (run_record,) = await tx.get([_run_key(self.env_key, run_id)])
            now_iso = encode_iso_date(_utc(await tx.now()))
            expires_at = owner.get("expires_at")
            if expires_at is not None and expires_at <= now_iso:
                return None
            run = None if run_record is None else self._decode_run(run_record)[0]
            if run is None or (run.task_id, run.idempotency_key) != (task_id, key):
                return _Refused(_foreign_owner(owner_key, run_id, run, "idempotency key"))  # as a trigger's would
            return run

        return _unless_refused(await self.driver.with_transaction(body))

    async def find_singleton_run(self, key: str) -> RunRecord | None:
        """The active run holding singleton ``key``, if any (the owner and its run read in one transaction)."""
        owner_key = singleton_owner_key(self.env_key, key)

        async def body(tx: StorageTransaction) -> RunRecord | _Refused | None:
            (record,) = await tx.get([owner_key])
            if record is None:
                return None
            run_id = record.document.value.get("run_id")
            if not isinstance(run_id, str):
                raise corrupt_record("singleton owner", owner_key, "it names no run")
            (run_record,) = await tx.get([_run_key(self.env_key, run_id)])
            await tx.now()
            run = None if run_record is None else self._decode_run(run_record)[0]
            if run is None or run.singleton_key != key:
                return _Refused(_foreign_owner(owner_key, run_id, run, "singleton key"))  # as a trigger's would
            return run if run.status not in _TERMINAL else None

        return _unless_refused(await self.driver.with_transaction(body))

    async def reset_idempotency_key(self, task_id: str, key: str) -> RunRecord | None:
        """Delete the owner of ``(task_id, key)`` so the next trigger creates a new run, unless its run is
        active: then nothing changes and that run is returned. The owner and its run are read, and the
        owner deleted, in one transaction, so a trigger taking the key meanwhile is never reset."""
        owner_key = idempotency_owner_key(self.env_key, task_id, key)

        async def body(tx: StorageTransaction) -> RunRecord | None:
            (record,) = await tx.get([owner_key])
            run: RunRecord | None = None
            if record is not None:
                run_id = record.document.value.get("run_id")
                if not isinstance(run_id, str):
                    raise corrupt_record("idempotency owner", owner_key, "it names no run")
                (run_record,) = await tx.get([_run_key(self.env_key, run_id)])
                run = None if run_record is None else self._decode_run(run_record)[0]
            await tx.now()
            if run is not None and run.status not in _TERMINAL:
                return run
            if record is not None:
                tx.delete(record)
            return None

        return await self.driver.with_transaction(body)

    async def list_runnable(
        self, queues: Sequence[str], now: datetime, limit: int, *, thorough: bool = False
    ) -> list[RunnableRef]:
        """Due runnable candidates of ``queues`` (available at or before ``now``), oldest first within a
        queue, the queues taking turns (``_in_turns``).

        A bounded queue's candidates are those its capacity can take (``open_candidates``): a run
        whose partition is full is not work this caller can do. ``thorough``: see ``open_candidates``.
        """
        if limit < 1 or not queues:
            return []
        upper = encode_storage_tuple_prefix_upper_bound((encode_iso_date(now),))
        set_aside = self.set_aside_runs
        wanted = limit + len(set_aside)  # enough candidates to get past the runs set aside
        page = min(wanted, self._limits.max_query_results)
        per_queue: list[tuple[str, list[tuple[str, str]]]] = []
        for queue in dict.fromkeys(queues):
            if queue in self.queue_limits:
                due = await self.open_candidates(StorageIndexName.RUNS_RUNNABLE, queue, now, wanted, thorough=thorough)
            else:
                query = StorageQuery(
                    StorageIndexName.RUNS_RUNNABLE, (self.env_key, queue), StorageRange(lt=upper), limit=page
                )
                due = [(item.sort[0], item.sort[1]) for item in (await self.driver.query(query)).items]
            per_queue.append((queue, [(at, run_id) for at, run_id in due if run_id not in set_aside]))
        rows = self._in_turns(per_queue)
        return [RunnableRef(run_id, queue, decode_iso_date(at)) for at, run_id, queue in rows[:limit]]

    def _in_turns(self, per_queue: Sequence[tuple[str, Sequence[tuple[str, str]]]]) -> list[tuple[str, str, str]]:
        """``(time, run id, queue)`` of each queue's candidates (oldest first), with the queues taking
        turns: every queue's oldest before any queue's second, and so on, a different queue first on each
        call (per set of queues), so a queue's new runs get their share behind another queue's backlog."""
        order = tuple(queue for queue, _ in per_queue)
        if len(order) < 2:
            return [(at, run_id, queue) for queue, rows in per_queue for at, run_id in rows]
        first = self._queue_turns.get(order, 0) % len(order)
        self._queue_turns[order] = first + 1
        ranked = sorted(
            (turn, (position - first) % len(order), at, run_id, queue)
            for position, (queue, rows) in enumerate(per_queue)
            for turn, (at, run_id) in enumerate(rows)
        )
        return [(at, run_id, queue) for _, _, at, run_id, queue in ranked]

    async def open_candidates(
        self, index: StorageIndexName, queue: str, now: datetime, limit: int, *, thorough: bool = False
    ) -> list[tuple[str, str]]:
        """Due rows ``(sort time, run id)`` of bounded queue ``queue`` in ``index`` (``RUNS_RUNNABLE`` or
        ``RUNS_NEEDING_DISPATCH``) that its capacity can take, oldest first, at most ``limit``.

        A row is open when its run already holds a slot of its concurrency-key partition (a dispatch
        reservation) or when that partition has a free slot not yet handed to an earlier row. Rows of
        full partitions are passed over, as the storage contract asks of runnable and dispatch scans,
        so one key's backlog does not hide another key's work. One call reads up to ``_CAPACITY_SCAN_ROWS``
        rows, in pages that start small and double (a call that wants one run reads a few rows): the oldest
        half of them, then the other half where the previous call of this store stopped, wrapping around
        at the newest due row, so that behind a backlog of any length every row is looked at within a
        bounded number of calls while the oldest rows keep their turn first. A call that has found nothing
        open reads on from there, up to ``_CAPACITY_SCAN_MAX_ROWS`` rows, or with ``thorough`` (its caller
        ends its work when nothing is found: a drain, ``execute_next``) up to the newest due row. The store
        remembers the concurrency key of each row it has read (``_concurrency_keys_of``): rows scanned again
        cost no run reads.
        Candidates only: the claim or reservation decides again on what it reads.
        """
        queue_limit = self.queue_limits[queue]
        now_iso = encode_iso_date(now)
        upper = encode_storage_tuple_prefix_upper_bound((now_iso,))
        page = max(1, min(self._limits.max_query_results, self._limits.max_point_reads))
        holders: dict[str | None, set[str]] = {}  # concurrency key -> runs holding a live slot of its partition
        free: dict[str | None, int] = {}  # concurrency key -> slots of its partition left to hand out
        kept: list[tuple[str, str]] = []
        set_aside = self.set_aside_runs

        async def scan(after: str | None, budget: int) -> tuple[str | None, bool]:
            """Open rows past ``after`` (an encoded sort), reading at most ``budget`` rows; returns the
            encoded sort of the last row read and whether the newest due row was reached."""
            scanned = 0
            last = after
            scanned_range = StorageRange(lt=upper) if after is None else StorageRange(gt=after, lt=upper)
            size = max(_CAPACITY_SCAN_FIRST_PAGE, 2 * (limit - len(kept)))
            while len(kept) < limit and scanned < budget:
                asked = min(page, size, budget - scanned)
                query = StorageQuery(index, (self.env_key, queue), scanned_range, limit=asked)
                size *= 2
                result = await self.driver.query(query)
                scanned += len(result.items)
                items = [item for item in result.items if item.sort[1] not in set_aside]
                keys = await self._concurrency_keys_of([(item.sort[0], item.sort[1]) for item in items])
                unknown: list[str | None] = []
                for key in dict.fromkeys(keys):
                    if not isinstance(key, (RunlaneError, _Gone)) and key not in free:
                        unknown.append(key)
                if unknown:
                    records = await self.driver.get([queue_capacity_key(self.env_key, queue, key) for key in unknown])
                    for key, record in zip(unknown, records):
                        occupants = None if record is None else record.document.value.get("occupants")
                        live = {
                            held for held, until in (occupants.items() if isinstance(occupants, dict) else ())
                            if isinstance(until, str) and until > now_iso
                        }  # fmt: skip
                        holders[key] = live
                        free[key] = max(0, queue_limit - len(live))
                for item, key in zip(items, keys):
                    if isinstance(key, _Gone):
                        continue  # pruned meanwhile
                    # A run that cannot be read stays a candidate, taking no capacity: the claim or reservation
                    # that reads it reports it (and a worker sets it aside). So does a run holding a slot already.
                    if not isinstance(key, RunlaneError) and item.sort[1] not in holders[key]:
                        if free[key] < 1:
                            continue  # its partition is full
                        free[key] -= 1
                    kept.append((item.sort[0], item.sort[1]))
                    if len(kept) >= limit:
                        return encode_storage_tuple(item.sort), False
                if len(result.items) < asked:
                    return last if not result.items else encode_storage_tuple(result.items[-1].sort), True
                last = encode_storage_tuple(result.items[-1].sort)  # past the runs passed over too
                scanned_range = StorageRange(gt=last, lt=upper)
            return last, False

        window = _CAPACITY_SCAN_ROWS // 2
        front, ended = await scan(None, window)
        if len(kept) < limit and not ended:
            resume_key = (index, queue)
            resume = self._capacity_scan_resume.get(resume_key)
            if resume is None or front is None or resume <= front:
                resume = front
            stopped, ended = await scan(resume, _CAPACITY_SCAN_ROWS - window)
            read = _CAPACITY_SCAN_ROWS
            while not kept and not ended and stopped is not None and (thorough or read < _CAPACITY_SCAN_MAX_ROWS):
                stopped, ended = await scan(stopped, window)
                read += window
            self._capacity_scan_resume[resume_key] = None if ended else stopped
            if thorough and not kept and resume != front:
                # This call resumed where the last one stopped: the rows between its first window and
                # there are read too before it says nothing can start (their keys are known by now).
                await scan(front, sys.maxsize)
        return kept

    async def query_index(
        self,
        index: StorageIndexName,
        partition: Sequence[str] = (),
        *,
        until: datetime | None = None,
        limit: int = 100,
    ) -> list[str]:
        """Run ids of one run index partition, in index order.

        ``partition`` holds the components after the environment (``()`` for environment-wide
        indexes, ``(signal_key,)``, ``(source_run_id,)`` or ``(queue,)``); ``until`` keeps rows whose
        time sort component is at or before it. Results are candidates: re-read before deciding.
        """
        bounds = StorageRange()
        if until is not None:
            bounds = StorageRange(lt=encode_storage_tuple_prefix_upper_bound((encode_iso_date(until),)))
        query = StorageQuery(
            index, (self.env_key, *partition), bounds, limit=min(max(1, limit), self._limits.max_query_results)
        )
        result = await self.driver.query(query)
        return [item.key.parts[-1] for item in result.items]

    async def list_events(self, run_id: str, *, after_sequence: int = 0, limit: int = 100) -> list[RunEventRecord]:
        """A run's events in sequence order, after ``after_sequence`` (raw-record path)."""
        query = StorageQuery(
            StorageIndexName.RUN_EVENTS_BY_RUN,
            (self.env_key, run_id),
            StorageRange(gt=encode_storage_unsigned_integer(after_sequence)) if after_sequence else StorageRange(),
            limit=min(max(1, limit), self._limits.max_query_results, self._limits.max_point_reads),
        )
        result = await self.driver.query(query)
        if not result.items:
            return []
        records = await self.driver.get([item.key for item in result.items])
        return [decode_run_event_document(record.document) for record in records if record is not None]

    # -- creation --------------------------------------------------------------------------------

    async def create_run(self, plan: CreateRunPlan) -> CreateRunResult:
        """Create a run with its first events, owners and capacity in one commit.

        A live idempotency owner returns its run (``returned_existing``, nothing written); an active
        singleton owner raises ``storage_conflict`` (``singleton_key``); an existing run id raises the
        reducer's ``event_sequence`` conflict.
        """
        created = plan.created
        events = plan.events
        env = self.env_key
        run_key = _run_key(env, created.run_id)
        idempotency = (
            idempotency_owner_key(env, created.task_id, created.idempotency_key)
            if created.idempotency_key is not None
            else None
        )
        singleton = singleton_owner_key(env, created.singleton_key) if created.singleton_key is not None else None
        leased = any(isinstance(event, RunLeaseClaimedEvent) for event in plan.follow_up)
        capacity = (
            queue_capacity_key(env, created.queue, created.concurrency_key)
            if leased and created.queue in self.queue_limits
            else None
        )
        ttl = created.idempotency_key_ttl
        ttl_value: int | str = _DEFAULT_IDEMPOTENCY_TTL_MS if ttl is None else ttl
        ids = _EventIds()
        # A run id core drew itself names no existing run, and with no owner row to consult nothing
        # else needs reading: the first attempt stages a blind create of the run (one read fewer, a
        # round trip on a remote driver). Commit validation still refuses a create of a present key,
        # and every replay takes the reading path, which reports an existing run exactly as before.
        blind = plan.generated_run_id and idempotency is None and singleton is None

        async def body(tx: StorageTransaction, extra: tuple[StorageRecordKey, ...]) -> CreateRunResult | _Refused:
            nonlocal blind
            create_blind, blind = blind, False
            ids.restart()
            attempt = _Attempt(self, tx)
            first: list[StorageRecordKey] = [] if create_blind else [run_key]
            first.extend(key for key in (idempotency, singleton, capacity) if key is not None)
            await attempt.read([*first, *extra])
            owner_runs = []
            for owner_key in (idempotency, singleton):
                if owner_key is not None and attempt.records[owner_key.encoded] is not None:
                    owner_run_id = _owner_run_id(attempt, owner_key)
                    owner_runs.append(_run_key(env, owner_run_id))
            await attempt.read(owner_runs)
            await attempt.seal()

            if idempotency is not None:
                owner = attempt.owner(idempotency)
                if owner is not None:
                    expires_at = owner.get("expires_at")
                    owner_run_id = _owner_run_id(attempt, idempotency)
                    existing = attempt.slot(owner_run_id)
                    if expires_at is None or expires_at > attempt.now_iso:
                        held = None if existing is None else existing.run
                        if held is None or (held.task_id, held.idempotency_key) != (
                            created.task_id,
                            created.idempotency_key,
                        ):
                            return _Refused(_foreign_owner(idempotency, owner_run_id, held, "idempotency key"))
                        return CreateRunResult(held, TriggerOutcomeType.RETURNED_EXISTING)
            current = None if create_blind else attempt.slot(created.run_id)
            if current is not None:
                existing_run = current.run
                raise create_storage_conflict_error(
                    StorageConflictKind.EVENT_SEQUENCE,
                    f"Run id {existing_run.id} is taken by an existing {existing_run.status.value} run of task "
                    f"{existing_run.task_id!r}; nothing was written. "
                    + (
                        "Trigger again to draw another id."
                        if plan.generated_run_id
                        else "Choose another run id, or omit it to have one drawn."
                    ),
                    # A drawn id is drawn again by the next call; a chosen one stays taken.
                    retryable=plan.generated_run_id,
                    meta={"run_id": existing_run.id, "expected_sequence": _NEW_SEQUENCE,
                          "current_sequence": existing_run.event_sequence},
                )
            run = project_run_events(None, _NEW_SEQUENCE, events)
            if singleton is not None:
                owner = attempt.owner(singleton)
                if owner is not None:
                    holder_id = _owner_run_id(attempt, singleton)
                    holder = attempt.slot(holder_id)
                    if holder is None or holder.run.singleton_key != created.singleton_key:
                        held = None if holder is None else holder.run
                        return _Refused(_foreign_owner(singleton, holder_id, held, "singleton key"))
                    if holder.run.status not in _TERMINAL:
                        raise create_storage_conflict_error(
                            StorageConflictKind.SINGLETON_KEY,
                            f"Singleton key {created.singleton_key!r} is held by active run {holder.run.id}; "
                            "wait for it to finish or cancel it.",
                            meta={"singleton_key": created.singleton_key, "run_id": holder.run.id},
                        )
                attempt.set_owner(singleton, {"run_id": run.id})
            if capacity is not None and not attempt.free_slots(run):
                # The lease created with the run occupies a slot like any claim: a full partition
                # refuses it, and nothing is written.
                raise create_storage_conflict_error(
                    StorageConflictKind.QUEUE_CAPACITY,
                    f"Queue {created.queue!r} has no free capacity"
                    + (f" for concurrency key {created.concurrency_key!r}" if created.concurrency_key else "")
                    + f" (concurrency limit {self.queue_limits[created.queue]});"
                    " retry once a running attempt finishes.",
                    meta={
                        "queue": created.queue,
                        "concurrency_key": created.concurrency_key,
                        "concurrency_limit": self.queue_limits[created.queue],
                    },
                )
            if idempotency is not None:
                attempt.set_owner(idempotency, {"run_id": run.id, "ttl": ttl_value, "expires_at": None})
            records, observations, outbox = attempt.create(run, events, ids)
            attempt.stage()
            carry = None if plan.wake_hint is None else getattr(tx, "wake_hint", None)
            hinted = bool(carry(plan.wake_hint)) if carry is not None else False
            return CreateRunResult(run, TriggerOutcomeType.CREATED, records, observations, outbox, hinted)

        return _unless_refused(await self._transact(body))

    # -- claims ----------------------------------------------------------------------------------

    async def claim(self, requests: Sequence[ClaimRequest]) -> list[ClaimResult]:
        """Claim many runs, each in its own right but all in one commit per chunk.

        Each result is the claimed run or ``None`` with a reason (``run_not_found``, ``wrong_queue``,
        ``terminal``, ``not_due``, ``already_leased``, ``claim_lost`` when the bounded-queue partition
        is full). A chunk that exceeds a storage limit is halved and retried.
        """
        if not requests:
            return []

        def on_limit(request: ClaimRequest, error: StorageLimitError) -> ClaimResult:
            return ClaimResult(request.run_id, None, ExecuteDeliveryIgnoredReason.CLAIM_LOST, error=error)

        # Per claim: the run and its capacity row, two events and their two observation records.
        return await self._chunked(list(requests), self._chunk_size(2, 6), self._claim_batch, on_limit)

    async def claim_next(
        self,
        requests: Sequence[NextClaimRequest],
        now: datetime,
        task_deadline: Callable[[RunRecord], int | None] = lambda run: None,
    ) -> list[ClaimResult | None]:
        """Claim the oldest due runs for ``requests``: one transaction per group of requests with the
        same queues and lease, each taking as many candidates as the group has requests.

        Candidates come from an exclusive index scan (runnable at or before ``now``), so callers in
        other processes skip the runs this transaction is claiming instead of racing for them; every
        claim is still checked against the run as read, as ``claim`` does. A request's result is a
        claimed run; else, when a candidate could not be claimed, a result without a run saying why;
        else ``None``: nothing was due for it.

        Meant for unbounded queues: a bounded queue's oldest due runs may all wait for capacity that
        reservations of later runs hold, which only a deeper scan (``list_runnable``) gets past.
        """
        results: list[ClaimResult | None] = [None] * len(requests)
        groups: dict[tuple[Any, ...], list[int]] = {}
        for index, request in enumerate(requests):
            group = (
                request.queues, request.worker_id, request.lease_ms, request.attempt_deadline_ms, request.confirm_idle
            )
            groups.setdefault(group, []).append(index)

        def claim_group(chunk: Sequence[NextClaimRequest]) -> Awaitable[list[ClaimResult | None]]:
            return self._claim_next_batch(chunk[0], len(chunk), now, task_deadline)

        def on_limit(request: NextClaimRequest, error: StorageLimitError) -> ClaimResult | None:
            raise error  # a single claim over a limit names no run to report it for

        for indexes in groups.values():
            grouped = [requests[index] for index in indexes]
            claims = await self._chunked(grouped, self._chunk_size(2, 6), claim_group, on_limit)
            for index, claim in zip(indexes, claims):
                results[index] = claim
        return results

    async def _claim_next_batch(
        self,
        request: NextClaimRequest,
        count: int,
        now: datetime,
        task_deadline: Callable[[RunRecord], int | None],
    ) -> list[ClaimResult | None]:
        ids = _EventIds()
        env = self.env_key
        upper = encode_storage_tuple_prefix_upper_bound((encode_iso_date(now),))
        # Exactly as many candidates as claims wanted: every held candidate is one other callers skip.
        limit = min(count, self._limits.max_query_results)
        floors = self._runnable_floors
        set_aside = self.set_aside_runs
        # Runs whose record the driver refused to read in an earlier try of this batch: each is reported
        # as a claim that failed, and the batch claims the other candidates without it.
        unreadable: dict[str, RunlaneError] = {}

        def passed_over(run_id: str) -> bool:
            return run_id in set_aside or run_id in unreadable

        async def scan_on(
            tx: StorageTransaction, queue: str, items: Sequence[StorageIndexRef]
        ) -> list[tuple[str, str]]:
            """The ``(time, run id)`` of the candidates in ``items`` not passed over; a run passed over is
            never claimed, so the scan goes on past it, holding only as many more candidates as are still
            wanted, and it does not hide the runs behind it."""
            kept: list[tuple[str, str]] = []
            asked = limit
            while True:
                kept.extend((item.sort[0], item.sort[1]) for item in items if not passed_over(item.sort[1]))
                if len(kept) >= limit or len(items) < asked:
                    return kept
                asked = limit - len(kept)
                scanned = StorageRange(gt=encode_storage_tuple(items[-1].sort), lt=upper)
                query = StorageQuery(StorageIndexName.RUNS_RUNNABLE, (env, queue), scanned, limit=asked)
                items = (await tx.query_candidates(query, mode=StorageCandidateMode.EXCLUSIVE)).items

        async def body(tx: StorageTransaction, extra: tuple[StorageRecordKey, ...]) -> list[ClaimResult | None]:
            ids.restart()
            attempt = _Attempt(self, tx)
            per_queue: list[tuple[str, list[tuple[str, str]]]] = []
            for queue in request.queues:
                floor = floors.start(queue)
                while True:
                    scanned = StorageRange(lt=upper) if floor is None else StorageRange(gte=floor, lt=upper)
                    query = StorageQuery(StorageIndexName.RUNS_RUNNABLE, (env, queue), scanned, limit=limit)
                    found = await tx.query_candidates(query, mode=StorageCandidateMode.EXCLUSIVE)
                    kept = await scan_on(tx, queue, found.items)
                    if kept or floor is None or not request.confirm_idle:
                        break
                    floor = None  # nothing at or above the floor: look below it before calling the queue idle
                floors.found(queue, found.items[0].sort if found.items else None, full=floor is None, now=now)
                per_queue.append((queue, kept))
            rows = self._in_turns(per_queue)
            run_ids = list(dict.fromkeys(run_id for _, run_id, _ in rows[:limit]))
            refused = [
                ClaimResult(run_id, None, ExecuteDeliveryIgnoredReason.CLAIM_LOST, error=error)
                for run_id, error in unreadable.items()
            ]
            if not run_ids:
                return [refused[0] if refused else None] * count
            run_keys = [_run_key(env, run_id) for run_id in run_ids]
            try:
                await attempt.read([*extra, *run_keys])
            except RunlaneError as error:
                run_id = _unreadable_run(error, env, run_ids)
                if run_id is None:
                    raise
                raise _UnreadableRun(run_id, error) from None
            derived: list[StorageRecordKey] = []
            for run_id in run_ids:
                run = attempt.peek_run(run_id)
                if run is not None:
                    derived.extend(attempt.capacity_keys(run))
            await attempt.read(derived)
            await attempt.seal()
            claims: list[ClaimResult] = []
            missed: list[ClaimResult] = list(refused)
            for run_id in run_ids:
                deadline = request.attempt_deadline_ms
                if deadline is None:
                    run = attempt.peek_run(run_id)
                    deadline = None if run is None else task_deadline(run)
                claim = ClaimRequest.to_start(run_id, request.worker_id, request.lease_ms, deadline)
                result = self._claim_one(attempt, claim, ids)
                (claims if result.run is not None else missed).append(result)
            attempt.stage()
            # Requests left without a run get the most telling miss: a corrupt run, then a full
            # bounded-queue partition (``claim_lost``), then a candidate someone else took.
            missed.sort(key=lambda miss: (miss.error is None, miss.reason is not ExecuteDeliveryIgnoredReason.CLAIM_LOST))
            leftover: list[ClaimResult | None] = [missed[0]] if missed else [None]
            return [*claims, *leftover * (count - len(claims))]

        while True:
            try:
                return cast(list[ClaimResult | None], await self._transact(body))
            except _UnreadableRun as refused:
                # The transaction rolled back; the next try scans again and passes over this run.
                unreadable[refused.run_id] = refused.error

    async def _run_batch(
        self,
        requests: Sequence[Any],
        derive: Callable[[_Attempt, RunRecord], Sequence[StorageRecordKey]],
        apply_one: Callable[[_Attempt, Any, datetime, _EventIds], Any],
        *,
        hint: Callable[[Any], Sequence[StorageRecordKey] | None] | None = None,
        capture_errors: bool = False,
    ) -> list[Any]:
        """One transaction over several runs: the shared shape of claims, reservations, completions
        and heartbeats.

        Reads every run (plus the owner rows ``hint`` names for a run the caller already holds), then
        the rows ``derive`` names for the other runs, seals, and applies each request in order. With
        ``capture_errors`` a ``RunlaneError`` from one request becomes that request's result instead
        of failing the batch.
        """
        ids = _EventIds()
        env = self.env_key
        first: list[StorageRecordKey] = []
        hinted: set[str] = set()
        for request in requests:
            first.append(_run_key(env, request.run_id))
            keys = None if hint is None else hint(request)
            if keys is not None:
                hinted.add(request.run_id)
                first.extend(keys)

        async def body(tx: StorageTransaction, extra: tuple[StorageRecordKey, ...]) -> list[Any]:
            ids.restart()
            attempt = _Attempt(self, tx)
            await attempt.read([*first, *extra])
            derived: list[StorageRecordKey] = []
            for request in requests:
                if request.run_id not in hinted:
                    run = attempt.peek_run(request.run_id)
                    if run is not None:
                        derived.extend(derive(attempt, run))
            await attempt.read(derived)
            now = await attempt.seal()
            results: list[Any] = []
            for request in requests:
                try:
                    results.append(apply_one(attempt, request, now, ids))
                except RunlaneError as error:
                    if not capture_errors:
                        raise
                    results.append(error)
            attempt.stage()
            return results

        return await self._transact(body)

    async def _claim_batch(self, requests: Sequence[ClaimRequest]) -> list[ClaimResult]:
        async def claim(batch: Sequence[ClaimRequest]) -> list[ClaimResult]:
            return cast(
                list[ClaimResult],
                await self._run_batch(
                    batch,
                    lambda attempt, run: attempt.capacity_keys(run),
                    lambda attempt, request, now, ids: self._claim_one(attempt, request, ids),
                ),
            )

        def refused(request: ClaimRequest, error: RunlaneError) -> ClaimResult:
            return ClaimResult(request.run_id, None, ExecuteDeliveryIgnoredReason.CLAIM_LOST, error=error)

        return await self._without_unreadable(requests, claim, refused)

    async def _without_unreadable(
        self,
        requests: Sequence[Q],
        run_batch: Callable[[Sequence[Q]], Awaitable[list[R]]],
        refused: Callable[[Q, RunlaneError], R],
    ) -> list[R]:
        """``run_batch(requests)``; when the driver refuses to read one run's record at all (it fails the
        whole read), that request gets ``refused(request, error)`` (as a record that does not decode
        gets its error) and the others of the batch go on without it, instead of all failing with it."""
        try:
            return await run_batch(requests)
        except RunlaneError as error:
            unreadable = _unreadable_run(error, self.env_key, (request.run_id for request in requests))
            if unreadable is None:
                raise
            kept = [request for request in requests if request.run_id != unreadable]
            others = iter(await self._without_unreadable(kept, run_batch, refused) if kept else ())
            return [
                refused(request, error) if request.run_id == unreadable else next(others)
                for request in requests
            ]

    def _claim_one(self, attempt: _Attempt, request: ClaimRequest, ids: _EventIds) -> ClaimResult:
        run_id = request.run_id
        try:
            slot = attempt.slot(run_id)
        except RunlaneError as error:
            return ClaimResult(run_id, None, ExecuteDeliveryIgnoredReason.CLAIM_LOST, error=error)
        if slot is None:
            return ClaimResult(run_id, None, ExecuteDeliveryIgnoredReason.RUN_NOT_FOUND)
        run = slot.run
        if request.queue is not None and run.queue != request.queue:
            return ClaimResult(run_id, None, ExecuteDeliveryIgnoredReason.WRONG_QUEUE)
        status = run.status
        if status in _TERMINAL:
            return ClaimResult(run_id, None, ExecuteDeliveryIgnoredReason.TERMINAL)
        if status is RunStatus.CANCELLATION_REQUESTED:
            return ClaimResult(run_id, None, ExecuteDeliveryIgnoredReason.ALREADY_LEASED)
        now = attempt.now
        available = get_run_runnable_available_at(run)
        if available is None:
            return ClaimResult(run_id, None, ExecuteDeliveryIgnoredReason.NOT_DUE)
        if available > now:
            reason = (
                ExecuteDeliveryIgnoredReason.ALREADY_LEASED
                if status is RunStatus.RUNNING
                else ExecuteDeliveryIgnoredReason.NOT_DUE
            )
            return ClaimResult(run_id, None, reason)
        if status is RunStatus.RUNNING and self.lease_held_here(run):
            return ClaimResult(run_id, None, ExecuteDeliveryIgnoredReason.ALREADY_LEASED)
        if not attempt.free_slots(run):
            return ClaimResult(run_id, None, ExecuteDeliveryIgnoredReason.CLAIM_LOST)
        deadline = (
            None if request.attempt_deadline_ms is None else later(now, request.attempt_deadline_ms)
        )
        expires_at = later(now, request.lease_ms)
        worker_id, token = request.worker_id, request.lease_token
        events: list[RunEvent]
        if is_valid_id(worker_id) and type(token) is str and token and type(now) is datetime and now.tzinfo is UTC:
            # Every part is already valid (stored run, checked request, UTC transaction time): build
            # the lease and events without validating them again.
            actor = worker_actor(worker_id)
            lease = build_validated(
                RunLease, {"worker_id": worker_id, "token": token, "claimed_at": now, "expires_at": expires_at}
            )
            common = {"run_id": run.id, "environment": run.environment, "occurred_at": now, "actor": actor}
            claimed = {**common, "lease": lease, "attempt_deadline_at": deadline}
            events = [build_validated(RunLeaseClaimedEvent, claimed)]
            if request.also_start:
                events.append(build_validated(RunStartedEvent, {**common, "attempt": run.counters.attempts + 1}))
        else:
            actor = Actor(type=ActorType.WORKER, id=worker_id)
            lease = RunLease(worker_id=worker_id, token=token, claimed_at=now, expires_at=expires_at)
            events = [
                RunLeaseClaimedEvent(
                    run_id=run_id,
                    environment=run.environment,
                    occurred_at=now,
                    actor=actor,
                    lease=lease,
                    attempt_deadline_at=deadline,
                )
            ]
            if request.also_start:
                events.append(
                    RunStartedEvent(
                        run_id=run_id,
                        environment=run.environment,
                        occurred_at=now,
                        actor=actor,
                        attempt=run.counters.attempts + 1,
                    )
                )
        try:
            result = attempt.apply(slot, events, ids)
        except RunlaneError as error:
            return ClaimResult(run_id, None, ExecuteDeliveryIgnoredReason.CLAIM_LOST, error=error)
        return ClaimResult(run_id, result.run, None, result.events, observations=result.observations)

    # -- bounded-queue dispatch ----------------------------------------------------------------------

    async def reserve_dispatch(self, requests: Sequence[ReserveRequest]) -> list[ReserveResult]:
        """Reserve bounded-queue capacity for queued runs, each with its ``run.delivery_requested``.

        Per run, in one commit with its capacity partition: the run must still be a queued run of a
        bounded queue that is due and holds no active reservation (or a run of a bounded queue due for
        delivery recovery: a due retry or release, an expired lease), and its partition must have a free
        slot (running and cancellation-requested leases plus unexpired reservations). The reservation
        occupies the slot until ``dispatch_expires_at``; on a transport lane the outbox row is written
        in the same commit. A run that is no longer dispatchable or whose partition is full is skipped.
        """
        if not requests:
            return []

        def on_limit(request: ReserveRequest, error: StorageLimitError) -> ReserveResult:
            return ReserveResult(request.run_id, None, error=error)

        # Per reservation: the run and its capacity row, one event, its observation and outbox row.
        return await self._chunked(list(requests), self._chunk_size(2, 5), self._reserve_batch, on_limit)

    async def _reserve_batch(self, requests: Sequence[ReserveRequest]) -> list[ReserveResult]:
        async def reserve(batch: Sequence[ReserveRequest]) -> list[ReserveResult]:
            return await self._run_batch(
                batch,
                lambda attempt, run: attempt.finish_keys(run),
                lambda attempt, request, now, ids: self._reserve_one(attempt, request, ids),
            )

        return await self._without_unreadable(
            requests, reserve, lambda request, error: ReserveResult(request.run_id, None, error=error)
        )

    def _reserve_one(self, attempt: _Attempt, request: ReserveRequest, ids: _EventIds) -> ReserveResult:
        run_id = request.run_id
        try:
            slot = attempt.slot(run_id)
        except RunlaneError as error:
            return ReserveResult(run_id, None, error=error)
        if slot is None:
            return ReserveResult(run_id, None)
        run = slot.run
        now = attempt.now
        if run.queue not in self.queue_limits:
            return ReserveResult(run_id, None)
        # Not yet due, or reserved already; a due retry or release, or an expired lease, is recovered
        # through the dispatch path too.
        available = get_run_dispatch_available_at(run)
        if available is None or available > now:
            return ReserveResult(run_id, None)
        if not attempt.free_slots(run):
            return ReserveResult(run_id, None)
        event = RunDeliveryRequestedEvent(
            run_id=run_id,
            environment=run.environment,
            occurred_at=now,
            actor=_SYSTEM_ACTOR,
            trace_carrier=run.trace_carrier,
            delivery=DeliveryIntent(
                environment=run.environment,
                run_id=run_id,
                queue=run.queue,
                requested_at=now,
                # The time it has been due since, not now: a reservation must not send its run to the back
                # of the runnable index, behind a backlog a polling worker reads from the front.
                available_at=available,
                dispatch_expires_at=later(now, request.dispatch_timeout_ms),
            ),
        )
        try:
            result = attempt.apply(slot, [event], ids)
        except RunlaneError as error:
            return ReserveResult(run_id, None, error=error)
        return ReserveResult(run_id, result.run, result.events, result.observations, result.outbox)

    # -- outbox ----------------------------------------------------------------------------------

    async def list_due_outbox(self, now: datetime, limit: int) -> list[str]:
        """Ids of outbox rows due at ``now`` (pending/failed by availability, claimed by claim expiry)."""
        upper = encode_storage_tuple_prefix_upper_bound((encode_iso_date(now),))
        query = StorageQuery(
            StorageIndexName.OUTBOX_DUE,
            (self.env_key,),
            StorageRange(lt=upper),
            limit=min(max(1, limit), self._limits.max_query_results),
        )
        result = await self.driver.query(query)
        return [item.key.parts[-1] for item in result.items]

    async def get_outbox_messages(self, ids: Sequence[str]) -> list[OutboxMessage | None]:
        size = self._limits.max_point_reads
        found: list[OutboxMessage | None] = []
        for start in range(0, len(ids), size):
            keys = [outbox_message_key(self.env_key, item) for item in ids[start : start + size]]
            for record in await self.driver.get(keys):
                found.append(None if record is None else _decode_outbox(record))
        return found

    async def list_run_outbox(self, run_id: str, limit: int = 100) -> list[OutboxMessage]:
        """The outbox rows of one run, oldest first."""
        query = StorageQuery(
            StorageIndexName.OUTBOX_BY_RUN,
            (self.env_key, run_id),
            StorageRange(),
            limit=min(max(1, limit), self._limits.max_query_results, self._limits.max_point_reads),
        )
        result = await self.driver.query(query)
        if not result.items:
            return []
        records = await self.driver.get([item.key for item in result.items])
        return [_decode_outbox(record) for record in records if record is not None]

    async def claim_outbox(
        self, ids: Sequence[str], *, claim_token: str, claim_ms: int, worker_id: str | None = None
    ) -> list[OutboxMessage]:
        """Claim the given rows that are due (pending / failed at their availability, or claimed with an
        expired claim) under ``claim_token`` in one commit; returns exactly the rows now claimed."""
        ids = list(dict.fromkeys(ids))[: self._limits.max_point_reads]
        if not ids:
            return []
        env = self.env_key
        keys = [outbox_message_key(env, item) for item in ids]

        async def body(tx: StorageTransaction) -> list[OutboxMessage]:
            found = await tx.get(keys)
            now = _utc(await tx.now())
            claimed: list[OutboxMessage] = []
            for record in found:
                if record is None:
                    continue
                message = _decode_outbox(record)
                status = message.status
                if status in (OutboxMessageStatus.PENDING, OutboxMessageStatus.FAILED):
                    if message.available_at > now:
                        continue
                elif status is OutboxMessageStatus.CLAIMED:
                    if message.claim is None or message.claim.expires_at > now:
                        continue
                else:
                    continue
                updated = message.model_copy(
                    update={
                        "status": OutboxMessageStatus.CLAIMED,
                        "claim": OutboxClaim(
                            token=claim_token,
                            worker_id=worker_id,
                            claimed_at=now,
                            expires_at=later(now, claim_ms),
                        ),
                        "updated_at": now,
                    }
                )
                tx.replace(record, _outbox_record(env, updated))
                claimed.append(updated)
            return claimed

        return await self.driver.with_transaction(body)

    async def mark_outbox(self, claim_token: str, marks: Sequence[OutboxMark]) -> list[OutboxMessage]:
        """Record publish results for claimed rows in one commit, fenced by ``claim_token``.

        Each mark is ``published``, ``failed`` (retryable: ``attempts`` + 1, available again at
        ``next_available_at``) or ``dead_lettered``. Any row whose current claim is not
        ``claim_token`` rejects the whole call with ``storage_conflict`` (``outbox_claim``) and nothing
        is written.
        """
        if not marks:
            return []
        env = self.env_key
        keys = [outbox_message_key(env, mark.outbox_message_id) for mark in marks]

        async def body(tx: StorageTransaction) -> list[OutboxMessage]:
            found = await tx.get(keys)
            now = _utc(await tx.now())
            staged: list[tuple[StorageRecord, OutboxMessage]] = []
            for mark, record in zip(marks, found):
                message = None if record is None else _decode_outbox(record)
                if (
                    record is None
                    or message is None
                    or message.status is not OutboxMessageStatus.CLAIMED
                    or message.claim is None
                    or message.claim.token != claim_token
                ):
                    raise create_storage_conflict_error(
                        StorageConflictKind.OUTBOX_CLAIM,
                        f"Outbox message {mark.outbox_message_id} is no longer held by this claim; "
                        "another publisher claimed it after the claim expired.",
                        meta={"outbox_message_id": mark.outbox_message_id},
                    )
                update: dict[str, Any] = {
                    "status": mark.status,
                    "claim": None,
                    "updated_at": now,
                    "attempts": message.attempts + 1,
                }
                if mark.status is OutboxMessageStatus.PUBLISHED:
                    update["published_at"] = mark.published_at or now
                    update["provider_message_id"] = mark.provider_message_id
                else:
                    update["last_failure"] = mark.failure
                    if mark.status is OutboxMessageStatus.FAILED:
                        update["available_at"] = mark.next_available_at or now
                staged.append((record, message.model_copy(update=update)))
            for record, updated in staged:
                tx.replace(record, _outbox_record(env, updated))
            return [updated for _, updated in staged]

        return await self.driver.with_transaction(body)

    # -- appends and completions -------------------------------------------------------------------

    async def append(
        self,
        run_id: str,
        build: Build,
        *,
        expected_lease_token: str | None = None,
        known: RunRecord | None = None,
    ) -> AppendResult:
        """Append the events ``build(run, now)`` returns to one run, with all bookkeeping, in one commit.

        Raises ``run_not_found`` for a missing run, ``storage_conflict`` (``lease_ownership``) when
        ``expected_lease_token`` no longer holds the run, and whatever ``build`` or the reducer raise.
        """
        (result,) = await self._complete_batch([CompletionRequest(run_id, build, expected_lease_token, known)])
        if isinstance(result, BaseException):
            raise result
        return result

    async def complete(self, requests: Sequence[CompletionRequest]) -> list[AppendResult | RunlaneError]:
        """Append to many runs in one commit per chunk; each item's failure is reported in its place."""
        if not requests:
            return []

        def on_limit(request: CompletionRequest, error: StorageLimitError) -> RunlaneError:
            return error

        # Per append: the run and up to four owner rows, typically one event and its observation record.
        return await self._chunked(list(requests), self._chunk_size(5, 7), self._complete_batch, on_limit)

    async def _complete_batch(self, requests: Sequence[CompletionRequest]) -> list[AppendResult | RunlaneError]:
        def hint(request: CompletionRequest) -> list[StorageRecordKey] | None:
            known = request.known
            return _finish_keys(self, known) if known is not None and known.id == request.run_id else None

        async def append(batch: Sequence[CompletionRequest]) -> list[AppendResult | RunlaneError]:
            return await self._run_batch(
                batch, lambda attempt, run: attempt.finish_keys(run), self._append_one, hint=hint, capture_errors=True
            )

        return await self._without_unreadable(requests, append, lambda request, error: error)

    def _append_one(self, attempt: _Attempt, request: CompletionRequest, now: datetime, ids: _EventIds) -> AppendResult:
        slot = attempt.slot(request.run_id)
        token = request.lease_token
        if token is not None:
            _check_lease(request.run_id, None if slot is None else slot.run, token)
        if slot is None:
            raise run_not_found(request.run_id, self.environment)
        events = list(request.build(slot.run, now))
        if not events:
            return AppendResult(slot.run)
        return attempt.apply(slot, events, ids)

    # -- heartbeats ------------------------------------------------------------------------------

    async def heartbeat(
        self, run_id: str, lease_token: str, worker_id: str, lease_ms: int, *, known: RunRecord | None = None
    ) -> RunRecord:
        """Extend the lease; returns the run so the caller sees ``cancellation_requested``.

        Raises ``storage_conflict`` (``lease_ownership``) when the lease is no longer this worker's.
        """
        (result,) = await self._heartbeat_batch([HeartbeatRequest(run_id, lease_token, worker_id, lease_ms, known)])
        if isinstance(result, BaseException):
            raise result
        return result

    async def heartbeat_many(self, requests: Sequence[HeartbeatRequest]) -> list[RunRecord | RunlaneError]:
        if not requests:
            return []

        def on_limit(request: HeartbeatRequest, error: StorageLimitError) -> RunlaneError:
            return error

        return await self._chunked(list(requests), self._chunk_size(2, 4), self._heartbeat_batch, on_limit)

    async def _heartbeat_batch(self, requests: Sequence[HeartbeatRequest]) -> list[RunRecord | RunlaneError]:
        env = self.env_key

        def hint(request: HeartbeatRequest) -> list[StorageRecordKey] | None:
            known = request.known
            if known is None or known.id != request.run_id or known.queue not in self.queue_limits:
                return None
            return [queue_capacity_key(env, known.queue, known.concurrency_key)]

        return await self._run_batch(
            requests, lambda attempt, run: attempt.capacity_keys(run), self._heartbeat_one, hint=hint, capture_errors=True
        )

    def _heartbeat_one(self, attempt: _Attempt, request: HeartbeatRequest, now: datetime, ids: _EventIds) -> RunRecord:
        slot = attempt.slot(request.run_id)
        run = _check_lease(request.run_id, None if slot is None else slot.run, request.lease_token)
        assert slot is not None and run.lease is not None
        if run.lease.worker_id != request.worker_id:
            raise _lease_conflict(run.id, f"the lease belongs to worker {run.lease.worker_id}")
        event = RunLeaseHeartbeatEvent(
            run_id=run.id,
            environment=run.environment,
            occurred_at=now,
            actor=Actor(type=ActorType.WORKER, id=request.worker_id),
            lease=RunLease(
                worker_id=request.worker_id,
                token=request.lease_token,
                claimed_at=run.lease.claimed_at,
                expires_at=later(now, request.lease_ms),
            ),
        )
        return attempt.apply(slot, [event], ids).run

    # -- steps -----------------------------------------------------------------------------------

    async def complete_step(
        self, run_id: str, step_key: str, token: str, lease_token: str, attempt: int, output: Any
    ) -> tuple[RunStepRecord, bool]:
        """``complete_steps`` for one step; its own failure is raised."""
        (result,) = await self.complete_steps(run_id, lease_token, attempt, [StepCompletion(step_key, token, output)])
        if isinstance(result, RunlaneError):
            raise result
        return result

    async def complete_steps(
        self, run_id: str, lease_token: str, attempt: int, steps: Sequence[StepCompletion]
    ) -> list[tuple[RunStepRecord, bool] | RunlaneError]:
        """Persist the outputs of steps of one attempt in one transaction, each once, fenced by the lease,
        attempt and status.

        Per step: ``(step, True)`` for a first completion (its observation is appended in the same commit),
        ``(existing, False)`` when the same output was already stored (nothing is written for it), or the
        step's own error: ``invariant_violation`` for a different stored output (or a different output
        for the same key earlier in ``steps``), ``validation_failed`` for an output that is not JSON. A lost
        lease is raised (``storage_conflict`` / ``lease_ownership``), and so is a storage limit the steps
        exceed together (nothing was written; the caller splits them).
        """
        env = self.env_key
        run_key = _run_key(env, run_id)
        texts: list[str | RunlaneError] = []
        for step in steps:
            try:
                texts.append(canonical_json(ensure_json_value(step.output, "step output")))
            except RunlaneError as error:
                texts.append(error)
        wanted = list(dict.fromkeys(step.step_key for step in steps))
        reads = [run_key, *(run_step_key(env, run_id, key) for key in wanted), *self.observation_heads]

        async def body(tx: StorageTransaction) -> list[tuple[RunStepRecord, bool] | RunlaneError]:
            found = await tx.get(reads)
            run_record = found[0]
            stored = {key: record for key, record in zip(wanted, found[1:]) if record is not None}
            now = _utc(await tx.now())
            run, children = (None, None) if run_record is None else self._decode_run(run_record)
            _check_lease(run_id, run, lease_token)
            assert run is not None and children is not None
            if run.counters.attempts != attempt:
                raise _lease_conflict(run_id, f"attempt {attempt} is not the current attempt {run.counters.attempts}")
            known = {key: _decode_step(record) for key, record in stored.items()}
            results: list[tuple[RunStepRecord, bool] | RunlaneError] = []
            values: list[dict[str, Any]] = []
            for completion, text in zip(steps, texts):
                if isinstance(text, RunlaneError):
                    results.append(text)
                    continue
                existing = known.get(completion.step_key)
                if existing is not None:
                    if canonical_json(existing.output) != text:
                        results.append(
                            RunlaneError(
                                ErrorCode.INVARIANT_VIOLATION,
                                f"Step {completion.step_key!r} of run {run_id} was already completed with a "
                                "different output; a step key must always produce the same output.",
                                meta={"run_id": run_id, "step_key": completion.step_key},
                            )
                        )
                    else:
                        results.append((existing, False))
                    continue
                step = RunStepRecord(
                    environment=run.environment,
                    run_id=run_id,
                    step_key=completion.step_key,
                    token=completion.token,
                    attempt=attempt,
                    output=completion.output,
                    completed_at=now,
                )
                known[completion.step_key] = step
                tx.create(_step_record(env, step))
                values.append(step_observation_value(step, run))
                results.append((step, True))
            if values:
                counted = RunChildCounts(
                    events=children.events,
                    outbox=children.outbox,
                    steps=children.steps + len(values),
                    links=children.links,
                )
                # ``run`` was decoded from ``run_record``, so the record is there.
                tx.replace(cast(StorageRecord, run_record), _run_record(env, run, counted, self.queue_limits))
                # Only first-time completions are observed; replays wrote nothing.
                self.stage_observations(tx, values, {key.encoded: record for key, record in zip(reads, found)})
            return results

        return await self.driver.with_transaction(body)

    def step_batch_size(self) -> int:
        """Steps ``complete_steps`` takes at once: per step one read, the step and its observation."""
        return self._chunk_size(1, 2)


# ---------------------------------------------------------------------------------------------
# Helpers


def _finish_keys(store: CoreStore, run: RunRecord) -> list[StorageRecordKey]:
    """Owner rows any transition of ``run`` may touch, including one to a terminal state."""
    env = store.env_key
    keys = [completion_wait_key(env, run.id)]
    if run.idempotency_key is not None:
        keys.append(idempotency_owner_key(env, run.task_id, run.idempotency_key))
    if run.singleton_key is not None:
        keys.append(singleton_owner_key(env, run.singleton_key))
    if run.queue in store.queue_limits or _reserved(run):
        keys.append(queue_capacity_key(env, run.queue, run.concurrency_key))
    return keys


def _foreign_owner(key: StorageRecordKey, run_id: str, run: RunRecord | None, what: str) -> RunlaneError:
    """``invariant_violation`` for an owner row whose run does not hold its key (or does not exist): trusting
    it would return another task's run, or start a second run under a key another run holds."""
    problem = "does not exist" if run is None else f"does not hold that {what} (task {run.task_id!r})"
    return RunlaneError(
        ErrorCode.INVARIANT_VIOLATION,
        f"The stored {what} owner {describe_record_key(key)} names run {run_id}, which {problem}; nothing was "
        "written. This is durable corruption: delete the owner record (for an idempotency key, "
        "runlane.idempotency_keys.reset() does) once you know which run holds the key.",
        meta={**record_key_meta(key), "run_id": run_id},
    )


def _owner_run_id(attempt: _Attempt, key: StorageRecordKey) -> str:
    owner = attempt.owner(key)
    run_id = None if owner is None else owner.get("run_id")
    if not isinstance(run_id, str):
        raise corrupt_record(key.collection, key, "it names no run")
    return run_id


def _check_lease(run_id: str, run: RunRecord | None, token: str) -> RunRecord:
    if run is None:
        raise _lease_conflict(run_id, "the run no longer exists")
    if run.status not in _ATTEMPT_OWNERS:
        raise _lease_conflict(run_id, f"the run is {run.status.value}")
    if run.lease is None or run.lease.token != token:
        raise _lease_conflict(run_id, "another lease holds the run")
    return run


def _first_step(records: Sequence[StorageRecord | None]) -> RunStepRecord | None:
    """The step of the first record found, in ``run_step_keys`` order."""
    for record in records:
        if record is not None:
            return _decode_step(record)
    return None


def _decode_step(record: StorageRecord) -> RunStepRecord:
    try:
        return RunStepRecord.model_validate(record.document.value)
    except ValueError as error:
        raise corrupt_record("run step", record.key, describe_problem(error), error) from None
