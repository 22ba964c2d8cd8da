"""Core's run and run-event tables: keys and document codecs shared by core and operator projections.

Drivers never edit these documents; a driver with an operator read model decodes them (and hides
anything that does not decode as canonical) to keep its projection in the same commit.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ValidationError

from ..errors import ErrorCode, RunlaneError
from ..models import (
    Environment,
    RunCompletionWaitCondition,
    RunCounters,
    RunEventRecord,
    RunFailure,
    RunLease,
    RunRecord,
    RunSource,
    SignalWaitCondition,
    TimeWaitCondition,
)
from ..vocabulary import RunSourceType, RunStatus, RunWaitConditionType
from .codecs import encode_storage_unsigned_integer
from .types import StorageDocument, StorageRecordKey

__all__ = [
    "RUNS_COLLECTION",
    "RUN_EVENTS_COLLECTION",
    "RUN_TOMBSTONES_COLLECTION",
    "RunChildCounts",
    "OPERATOR_ROW_CODECS",
    "compact_decoded",
    "decode_run_document",
    "decode_run_event_document",
    "describe_record_key",
    "encode_run_document",
    "encode_run_event_document",
    "peek_run_document",
    "peek_run_event_document",
    "record_key_meta",
    "run_event_key",
    "run_key",
    "run_tombstone_key",
    "try_decode_run_document",
    "try_decode_run_event_document",
]

RUNS_COLLECTION = "runs"
RUN_EVENTS_COLLECTION = "run_events"
RUN_STEPS_COLLECTION = "run_steps"
RUN_TOMBSTONES_COLLECTION = "run_tombstones"


def run_key(environment_key: str, run_id: str) -> StorageRecordKey:
    return StorageRecordKey(RUNS_COLLECTION, environment_key, run_id)


def run_event_key(environment_key: str, run_id: str, sequence: int) -> StorageRecordKey:
    return StorageRecordKey(RUN_EVENTS_COLLECTION, environment_key, run_id, encode_storage_unsigned_integer(sequence))


def run_tombstone_key(environment_key: str, run_id: str) -> StorageRecordKey:
    return StorageRecordKey(RUN_TOMBSTONES_COLLECTION, environment_key, run_id)


@dataclass(frozen=True, slots=True)
class RunChildCounts:
    """Exact child counts a visible run keeps so pruning never trusts an advisory index."""

    events: int = 0
    outbox: int = 0
    steps: int = 0
    links: int = 0

    def to_json(self) -> dict[str, int]:
        return {"events": self.events, "outbox": self.outbox, "steps": self.steps, "links": self.links}


def encode_run_document(run: RunRecord, children: RunChildCounts | None = None) -> StorageDocument:
    counts = children or RunChildCounts()
    document = StorageDocument.encode({"run": run.model_dump(mode="json"), "children": counts.to_json()})
    return remember_run_document(document, run, counts)


_RUN_CODEC = "run"
# The codecs of the models ``operator_sql`` remembers as a commit's projection row sources (runs, then run events).
OPERATOR_ROW_CODECS = ("run/operator_row", "run_event/operator_row")


def _copy_json(value: Any) -> Any:
    if type(value) is dict:
        return {key: _copy_json(item) for key, item in value.items()}
    if type(value) is list:
        return [_copy_json(item) for item in value]
    return value


def _detached(run: RunRecord) -> RunRecord:
    """A copy sharing no mutable JSON (payload, output, meta, trace carrier, failure meta) with ``run``.

    Runs are frozen models, but their JSON fields are plain dicts and lists; a remembered run must
    never alias an object a caller holds, or a caller's mutation would leak into the next write.
    """
    values = run.__dict__
    update: dict[str, Any] = {}
    for name in ("payload", "output", "meta", "trace_carrier"):
        value = values[name]
        if type(value) is dict or type(value) is list:
            update[name] = _copy_json(value)
    failure = values["failure"]
    if failure is not None and failure.meta:
        update["failure"] = failure.model_copy(update={"meta": _copy_json(failure.meta)})
    if not update:
        return run
    if type(run) is not RunRecord or not _DIRECT_COPY:
        return run.model_copy(update=update)
    # ``run.model_copy(update=update)`` without its generic machinery: a shallow copy of the field
    # values with the copied JSON values swapped in, and the updated fields marked as set.
    copied = object.__new__(RunRecord)
    data = values.copy()
    data.update(update)
    fields_set = set(run.__pydantic_fields_set__)
    fields_set.update(update)
    _set(copied, "__dict__", data)
    _set(copied, "__pydantic_fields_set__", fields_set)
    _set(copied, "__pydantic_extra__", None)
    _set(copied, "__pydantic_private__", None)
    return copied


_set = object.__setattr__
# Valid while runs have no private attributes, no post-init hook and no extra fields.
_DIRECT_COPY = (
    not RunRecord.__private_attributes__
    and RunRecord.__pydantic_post_init__ is None
    and RunRecord.model_config.get("extra") != "allow"
)


def remember_run_document(document: StorageDocument, run: RunRecord, children: RunChildCounts) -> StorageDocument:
    """Remember the run a document was encoded from, so decoding it again skips parsing and validation."""
    return document.remember_decoded((_RUN_CODEC, _detached(run), children))


def describe_record_key(key: StorageRecordKey) -> str:
    """A record key as an operator reads it: ``runs/default/run_1`` (the encoded form is hex)."""
    return "/".join((key.collection, *key.parts))


# Collections whose keys are ``(environment, run_id, ...)``: a corrupt record of one names its run.
_RUN_KEYED = frozenset({RUNS_COLLECTION, RUN_EVENTS_COLLECTION, RUN_STEPS_COLLECTION, RUN_TOMBSTONES_COLLECTION})


def record_key_meta(key: StorageRecordKey) -> dict[str, Any]:
    """What an error about the record at ``key`` carries: the key (encoded and readable) and, for a
    record of a run, the run id and environment."""
    meta: dict[str, Any] = {"key": key.encoded, "record": describe_record_key(key)}
    if key.collection in _RUN_KEYED and len(key.parts) >= 2:
        meta["environment"] = key.parts[0]
        meta["run_id"] = key.parts[1]
    return meta


def corrupt_stored_record(encoded_key: str, detail: str, cause: BaseException | None = None) -> RunlaneError:
    """The ``invariant_violation`` of a stored row a SQL driver cannot read (not an envelope, an index
    column that does not decode, ...): named as an operator reads it (``runs/default/run_1``, and its
    run), then by the encoded value of its ``key`` column, to find the row with SQL (that value is hex)."""
    try:
        key = StorageRecordKey.decode(encoded_key)
    except (RunlaneError, ValueError):
        meta: dict[str, Any] = {"key": encoded_key}
        where, remedy = "with an undecodable key", "delete it"
    else:
        meta = record_key_meta(key)
        where, remedy = describe_record_key(key), "delete it"
        if "run_id" in meta:
            where, remedy = f"{where} of run {meta['run_id']}", "delete the run's records"
    return RunlaneError(
        ErrorCode.INVARIANT_VIOLATION,
        f"The stored record {where} (key column {encoded_key!r}) is corrupt: {detail.rstrip('.')}. This is "
        f"durable corruption: restore the record from a backup, or {remedy}.",
        meta=meta,
        cause=cause,
    )


def corrupt_record(
    what: str, key: StorageRecordKey, problem: str | None = None, error: Exception | None = None
) -> RunlaneError:
    """The ``invariant_violation`` of a stored ``what`` (``run``, ``schedule occurrence``) that does not
    decode, naming its record and, when known, what is wrong with it (``describe_problem``)."""
    return RunlaneError(
        ErrorCode.INVARIANT_VIOLATION,
        f"The stored {what} at {describe_record_key(key)} is not a valid document"
        f"{'' if problem is None else ': ' + problem}. This is durable corruption: restore the record from a "
        "backup, or delete it.",
        meta=record_key_meta(key),
        cause=error,
    )


def describe_problem(error: Exception, within: tuple[str, ...] = ()) -> str:
    """What is wrong with a document, in a few words (the first validation error, with its field)."""
    if isinstance(error, ValidationError):
        first = error.errors(include_url=False)[0]
        where = ".".join(str(part) for part in (*within, *first.get("loc", ())))
        return f"{where}: {first.get('msg', 'invalid')}" if where else str(first.get("msg", "invalid"))
    if isinstance(error, KeyError):
        return f"field {error.args[0]!r} is missing"
    return str(error) or type(error).__name__


def _stored_run_id(value: Any) -> str | None:
    run = value.get("run") if isinstance(value, dict) else None
    run_id = run.get("id") if isinstance(run, dict) else None
    return run_id if isinstance(run_id, str) else None


def _corrupt_document(
    what: str, subject: str, stored_run_id: object, key: StorageRecordKey | None, problem: str, error: Exception | None
) -> RunlaneError:
    """The error of a ``what`` document (``run``, ``run event``) that does not decode, naming its run (from
    the key, else the document) and record; built on the error path only."""
    meta: dict[str, Any] = {} if key is None else record_key_meta(key)
    run_id = meta.get("run_id") or (stored_run_id if isinstance(stored_run_id, str) else None)
    if run_id is not None:
        meta["run_id"] = run_id
    named = f"a {what}" if run_id is None else subject.format(run_id=run_id)
    where = "" if key is None else f" (record {describe_record_key(key)})"
    return RunlaneError(
        ErrorCode.INVARIANT_VIOLATION,
        f"The stored document of {named}{where} is not a valid {what}: {problem}. This is durable corruption: "
        "restore the record from a backup, or delete the run's records.",
        meta=meta,
        cause=error,
    )


def _corrupt_run(value: Any, key: StorageRecordKey | None, problem: str, error: Exception | None) -> RunlaneError:
    return _corrupt_document("run", "run {run_id}", _stored_run_id(value), key, problem, error)


def _corrupt_event(value: Any, key: StorageRecordKey | None, error: Exception) -> RunlaneError:
    stored = value.get("run_id") if isinstance(value, dict) else None
    return _corrupt_document("run event", "an event of run {run_id}", stored, key, describe_problem(error), error)


_CHILD_COUNTERS = ("events", "outbox", "steps", "links")
_CHILDREN_SHAPE = "children is not an object of events, outbox, steps and links counts"


def _bad_child_count(children: RunChildCounts) -> str:
    for name in _CHILD_COUNTERS:
        count = getattr(children, name)
        if type(count) is not int or count < 0:
            return f"children.{name} is {count!r}, not a whole number >= 0"
    return "children is invalid"


# ---------------------------------------------------------------------------------------------
# The compact remembered run
#
# A store that keeps records for a long time (the in-memory driver, and the documents a SQL driver
# replaced last: ``attempt.WrittenDocuments``) keeps the remembered run of each active run's document. As
# a model, a run is several objects the garbage collector tracks (the instance, its field dict and
# set, nested models), so a store holding many active runs makes every full collection of the process
# slower. ``compact_decoded`` turns the remembered run into one tuple of plain values (strings,
# numbers, datetimes, enum values, frozen JSON values), which the collector stops tracking;
# ``decode_run_document`` rebuilds an equal run from it, with fresh JSON values and nested models
# (counters, immutable and few, are shared per distinct value, as ``_detached`` shares nested models).

_COMPACT_CODEC = "run/compact"
_ATOMIC = frozenset({str, int, bool, type(None), datetime})
_RUN_FIELDS = tuple(RunRecord.model_fields)
_ALL_RUN_FIELDS = frozenset(_RUN_FIELDS)
_FIELD_SETS: dict[frozenset[str], tuple[str, ...]] = {}

# Nested models: class, its enum fields (field -> enum) and its JSON fields. A model that gains,
# loses or renames a field no longer matches ``_COMPACT_ENABLED`` and runs are remembered as models.
_NESTED: tuple[tuple[type[BaseModel], dict[str, type[enum.Enum]], tuple[str, ...]], ...] = (
    (RunCounters, {}, ()),
    (RunLease, {}, ()),
    (TimeWaitCondition, {"type": RunWaitConditionType}, ()),
    (SignalWaitCondition, {"type": RunWaitConditionType}, ()),
    (RunCompletionWaitCondition, {"type": RunWaitConditionType}, ()),
    (RunFailure, {"code": ErrorCode}, ("meta",)),
    (RunSource, {"type": RunSourceType}, ()),
)
_NESTED_INDEX = {model: index for index, (model, _, _) in enumerate(_NESTED)}
_NESTED_FIELDS: dict[type[BaseModel], tuple[str, ...]] = {
    RunCounters: ("attempts", "failures", "retries", "releases"),
    RunLease: ("worker_id", "token", "claimed_at", "expires_at"),
    TimeWaitCondition: ("type", "resume_at"),
    SignalWaitCondition: ("type", "signal_key", "timeout_at"),
    RunCompletionWaitCondition: ("type", "run_id", "timeout_at"),
    RunFailure: ("code", "message", "retryable", "meta"),
    RunSource: ("type", "source_run_id", "schedule_id", "occurrence_id"),
}
_RUN_EXPECTED = (
    "id", "environment", "task_id", "queue", "status", "payload", "counters", "event_sequence", "created_at",
    "updated_at", "run_at", "started_at", "finished_at", "lease", "attempt_deadline_at", "dispatched_at",
    "dispatch_expires_at", "wait", "failure", "output", "has_output", "source", "idempotency_key", "singleton_key",
    "concurrency_key", "trace_carrier", "meta",
)  # fmt: skip
_COMPACT_MODELS: tuple[type[BaseModel], ...] = (RunRecord, Environment, *_NESTED_FIELDS)
_COMPACT_ENABLED = (
    _RUN_FIELDS == _RUN_EXPECTED
    and tuple(Environment.model_fields) == ("name",)
    and all(tuple(model.model_fields) == fields for model, fields in _NESTED_FIELDS.items())
    and all(
        not model.__private_attributes__
        and model.__pydantic_post_init__ is None
        and model.model_config.get("extra") != "allow"
        for model in _COMPACT_MODELS
    )
)


class _NotCompact(Exception):
    pass


# A flat JSON object (string keys, scalar values: the usual payload, meta or trace carrier) is kept as
# ``(_FLAT_OBJECT, key, value, key, value, ...)``: the collector untracks a tuple of untracked items,
# never a tuple holding a dict. The marker is an object no JSON value can hold. Other values are
# copied as they are (``_copy_json``).
_FLAT_OBJECT: Any = object()
_SCALARS = frozenset({str, int, float, bool, type(None)})


def _freeze_json(value: Any) -> Any:
    if type(value) is dict:
        flat: list[Any] = [_FLAT_OBJECT]
        for key, item in value.items():
            if type(item) not in _SCALARS or type(key) is not str:
                return _copy_json(value)
            flat.append(key)
            flat.append(item)
        return tuple(flat)
    return _copy_json(value)


def _thaw_json(value: Any) -> Any:
    kind = type(value)
    if kind is tuple:
        if value and value[0] is _FLAT_OBJECT:
            return {value[at]: value[at + 1] for at in range(1, len(value), 2)}
        return value
    if kind is dict or kind is list:
        return _copy_json(value)
    return value


def _field_set_key(fields: set[str]) -> tuple[str, ...]:
    frozen = frozenset(fields)
    key = _FIELD_SETS.get(frozen)
    if key is None:
        if len(_FIELD_SETS) >= 1024:
            raise _NotCompact
        key = _FIELD_SETS[frozen] = tuple(sorted(frozen))
    return key


def _atomic(value: Any) -> Any:
    if type(value) not in _ATOMIC:
        raise _NotCompact
    return value


def _freeze_nested(value: Any) -> Any:
    if value is None:
        return None
    model = type(value)
    index = _NESTED_INDEX.get(model)
    if index is None or value.__pydantic_extra__ is not None or value.__pydantic_private__ is not None:
        raise _NotCompact
    _, enums, json_fields = _NESTED[index]
    values = value.__dict__
    frozen: list[Any] = [index, _field_set_key(value.__pydantic_fields_set__)]
    for name in _NESTED_FIELDS[model]:
        item = values[name]
        enum = enums.get(name)
        if enum is not None:
            if type(item) is not enum:
                raise _NotCompact
            frozen.append(item._value_)
        elif name in json_fields:
            frozen.append(_freeze_json(item))
        else:
            frozen.append(_atomic(item))
    return tuple(frozen)


@functools.lru_cache(maxsize=1024)
def _shared_counters(frozen: tuple[Any, ...]) -> Any:
    """One immutable instance per distinct counters value (runs share few of them)."""
    return _build_nested(frozen)


def _thaw_nested(frozen: tuple[Any, ...]) -> Any:
    index = frozen[0]
    if index == _COUNTERS_INDEX:
        return _shared_counters(frozen)
    if index == _LEASE_INDEX:  # one per running run: built without the generic loop
        _, fields_set, worker_id, token, claimed_at, expires_at = frozen
        values = {"worker_id": worker_id, "token": token, "claimed_at": claimed_at, "expires_at": expires_at}
        return _instance(RunLease, values, set(fields_set))
    return _build_nested(frozen)


def _build_nested(frozen: tuple[Any, ...]) -> Any:
    model, enums, json_fields = _NESTED[frozen[0]]
    values = {}
    for name, item in zip(_NESTED_FIELDS[model], frozen[2:]):
        enum = enums.get(name)
        if enum is not None:
            item = enum(item)
        elif name in json_fields:
            item = _thaw_json(item)
        values[name] = item
    return _instance(model, values, set(frozen[1]))


_COUNTERS_INDEX = _NESTED_INDEX[RunCounters]
_LEASE_INDEX = _NESTED_INDEX[RunLease]


def _instance(model: type[BaseModel], values: dict[str, Any], fields_set: set[str]) -> Any:
    instance = object.__new__(model)
    _set(instance, "__dict__", values)
    _set(instance, "__pydantic_fields_set__", fields_set)
    _set(instance, "__pydantic_extra__", None)
    _set(instance, "__pydantic_private__", None)
    return instance


@functools.lru_cache(maxsize=64)
def _environment(name: str) -> Environment:
    return _instance(Environment, {"name": name}, {"name"})


_STATUSES = {status._value_: status for status in RunStatus}


def _freeze_run(run: RunRecord) -> tuple[Any, ...] | None:
    """The compact form of a remembered run, or ``None`` when a value has no compact form."""
    if not _COMPACT_ENABLED or type(run) is not RunRecord:
        return None
    if run.__pydantic_extra__ is not None or run.__pydantic_private__ is not None:
        return None
    v = run.__dict__
    environment = v["environment"]
    status = v["status"]
    if (
        type(environment) is not Environment
        or environment.__pydantic_fields_set__ != {"name"}
        or environment.__pydantic_extra__ is not None
        or environment.__pydantic_private__ is not None
        or type(status) is not RunStatus
    ):
        return None
    atomic = (
        v["id"], environment.name, v["task_id"], v["queue"], v["event_sequence"], v["created_at"], v["updated_at"],
        v["run_at"], v["started_at"], v["finished_at"], v["attempt_deadline_at"], v["dispatched_at"],
        v["dispatch_expires_at"], v["has_output"], v["idempotency_key"], v["singleton_key"], v["concurrency_key"],
    )  # fmt: skip
    if not _ATOMIC.issuperset(map(type, atomic)):
        return None
    (
        run_id, name, task_id, queue, event_sequence, created_at, updated_at, run_at, started_at, finished_at,
        attempt_deadline_at, dispatched_at, dispatch_expires_at, has_output, idempotency_key, singleton_key,
        concurrency_key,
    ) = atomic  # fmt: skip
    fields_set = run.__pydantic_fields_set__
    try:
        return (
            _RUN_FIELDS if fields_set == _ALL_RUN_FIELDS else _field_set_key(fields_set),
            run_id,
            name,
            task_id,
            queue,
            status._value_,
            _freeze_json(v["payload"]),
            _freeze_nested(v["counters"]),
            event_sequence,
            created_at,
            updated_at,
            run_at,
            started_at,
            finished_at,
            _freeze_nested(v["lease"]),
            attempt_deadline_at,
            dispatched_at,
            dispatch_expires_at,
            _freeze_nested(v["wait"]),
            _freeze_nested(v["failure"]),
            _freeze_json(v["output"]),
            has_output,
            _freeze_nested(v["source"]),
            idempotency_key,
            singleton_key,
            concurrency_key,
            _freeze_json(v["trace_carrier"]),
            _freeze_json(v["meta"]),
        )
    except _NotCompact:
        return None


def _thaw_run(frozen: tuple[Any, ...]) -> RunRecord:
    """A fresh run equal to the one ``_freeze_run`` froze (sharing no JSON value with ``frozen``)."""
    (
        fields_set, run_id, environment, task_id, queue, status, payload, counters, event_sequence, created_at,
        updated_at, run_at, started_at, finished_at, lease, attempt_deadline_at, dispatched_at, dispatch_expires_at,
        wait, failure, output, has_output, source, idempotency_key, singleton_key, concurrency_key, trace_carrier,
        meta,
    ) = frozen  # fmt: skip
    values = {
        "id": run_id,
        "environment": _environment(environment),
        "task_id": task_id,
        "queue": queue,
        "status": _STATUSES[status],
        "payload": _thaw_json(payload),
        "counters": None if counters is None else _thaw_nested(counters),
        "event_sequence": event_sequence,
        "created_at": created_at,
        "updated_at": updated_at,
        "run_at": run_at,
        "started_at": started_at,
        "finished_at": finished_at,
        "lease": None if lease is None else _thaw_nested(lease),
        "attempt_deadline_at": attempt_deadline_at,
        "dispatched_at": dispatched_at,
        "dispatch_expires_at": dispatch_expires_at,
        "wait": None if wait is None else _thaw_nested(wait),
        "failure": None if failure is None else _thaw_nested(failure),
        "output": _thaw_json(output),
        "has_output": has_output,
        "source": None if source is None else _thaw_nested(source),
        "idempotency_key": idempotency_key,
        "singleton_key": singleton_key,
        "concurrency_key": concurrency_key,
        "trace_carrier": _thaw_json(trace_carrier),
        "meta": _thaw_json(meta),
    }
    return _instance(RunRecord, values, set(fields_set))


@functools.lru_cache(maxsize=256)
def _children(counts: tuple[int, int, int, int]) -> RunChildCounts:
    return RunChildCounts(*counts)


def compact_decoded(decoded: Any) -> Any:
    """What a store that keeps records for long should keep of a document's remembered value.

    The remembered run of a run document becomes its compact form (see above), which
    ``decode_run_document`` and ``peek_run_document`` read like the run itself; any other value, and a
    run without a compact form, is returned unchanged, except projection row sources remembered for a
    commit (``operator_sql.remember_run_row``), which give ``None``: nothing worth keeping.
    """
    if type(decoded) is tuple and decoded[0] in OPERATOR_ROW_CODECS:
        return None
    if type(decoded) is tuple and len(decoded) == 3 and decoded[0] == _RUN_CODEC:
        children = decoded[2]
        frozen = _freeze_run(decoded[1])
        if frozen is not None and type(children) is RunChildCounts:
            counts = (children.events, children.outbox, children.steps, children.links)
            return (_COMPACT_CODEC, frozen, counts)
    return decoded


def decode_run_document(
    document: StorageDocument, key: StorageRecordKey | None = None
) -> tuple[RunRecord, RunChildCounts]:
    """The run and child counts of a run document (a fresh, caller-owned run every time).

    A document that does not decode, or whose child counts are not whole numbers >= 0, is
    ``invariant_violation`` naming the run (and the record, when ``key`` is given)."""
    remembered = document.decoded
    if type(remembered) is tuple:
        codec = remembered[0]
        if codec == _RUN_CODEC:
            return _detached(remembered[1]), remembered[2]
        if codec == _COMPACT_CODEC:
            return _thaw_run(remembered[1]), _children(remembered[2])
    value = document.value
    try:
        run = RunRecord.model_validate(value["run"])
        children = RunChildCounts(**value["children"])
    except (KeyError, ValidationError) as error:
        raise _corrupt_run(value, key, describe_problem(error, ("run",)), error) from None
    except TypeError as error:
        raise _corrupt_run(value, key, _CHILDREN_SHAPE, error) from None
    events, outbox, steps, links = children.events, children.outbox, children.steps, children.links
    if not (
        type(events) is int
        and type(outbox) is int
        and type(steps) is int
        and type(links) is int
        and events >= 0
        and outbox >= 0
        and steps >= 0
        and links >= 0
    ):
        # Pruning trusts these counts to delete exactly a run's records: never remember a bad one.
        raise _corrupt_run(value, key, _bad_child_count(children), None)
    remember_run_document(document, run, children)
    return run, children


def try_decode_run_document(document: StorageDocument) -> RunRecord | None:
    try:
        return decode_run_document(document)[0]
    except RunlaneError:
        return None


_UNDECODABLE = ("undecodable",)


def peek_run_document(document: StorageDocument) -> RunRecord | None:
    """The run of a run document, decoded at most once per document and *shared*: read-only use only
    (a driver's operator projection copies before handing it out). ``None`` when it does not decode."""
    remembered = document.decoded
    if type(remembered) is not tuple or remembered[0] != _RUN_CODEC:
        if remembered is _UNDECODABLE:
            return None
        if type(remembered) is tuple and remembered[0] == _COMPACT_CODEC:
            run, children = decode_run_document(document)
            document.remember_decoded((_RUN_CODEC, run, children))  # ``run`` is fresh: nothing to detach
            return run
        try:
            decode_run_document(document)
        except RunlaneError:
            document.remember_decoded(_UNDECODABLE)
            return None
        remembered = document.decoded
    return remembered[1]


def encode_run_event_document(record: RunEventRecord) -> StorageDocument:
    return StorageDocument.encode(record.model_dump(mode="json"))


def decode_run_event_document(document: StorageDocument, key: StorageRecordKey | None = None) -> RunEventRecord:
    value: Any = document.value
    try:
        return RunEventRecord.model_validate(value)
    except ValidationError as error:
        raise _corrupt_event(value, key, error) from None


def try_decode_run_event_document(document: StorageDocument) -> RunEventRecord | None:
    try:
        return decode_run_event_document(document)
    except RunlaneError:
        return None


_EVENT_CODEC = "run_event"


def peek_run_event_document(document: StorageDocument) -> RunEventRecord | None:
    """Like ``peek_run_document`` for a run event document: decoded once, shared, read-only."""
    remembered = document.decoded
    if remembered is None or remembered[0] != _EVENT_CODEC:
        if remembered is _UNDECODABLE:
            return None
        event = try_decode_run_event_document(document)
        document.remember_decoded(_UNDECODABLE if event is None else (_EVENT_CODEC, event))
        return event
    return remembered[1]
