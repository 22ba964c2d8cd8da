"""Durable observation export: sanitized observation records, their ordered stream, checkpoints and the exporter.

What this module owns:

* the sanitized observation of a committed run event or first-time step completion, and the stored
  record value with a stable, source-derived record id (the same fact always maps to the same id);
* staging those records in the caller's storage transaction, through the driver's native ordered
  append or, without it, through point writes over the same head and record layout;
* forward scans of one environment's stream, per-consumer checkpoints that only move forward from the
  expected cursor to a real record, and the exporter that moves records to a sink at least once.

What it must not do: call a sink, a telemetry SDK or any I/O from inside a storage transaction, put
payloads, outputs, step outputs, failure detail or release metadata into an observation, or move a
checkpoint before the sink has accepted the batch.
"""

from __future__ import annotations

import asyncio
import codecs
import functools
import hashlib
import inspect
import json
import logging
import sys
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import IO, Any, Protocol, TypeVar, cast, runtime_checkable

import orjson
from pydantic import TypeAdapter, ValidationError

from ..defaults import contract_defaults
from ..durations import Duration, duration_ms
from ..errors import (
    ErrorCode,
    RunlaneError,
    StorageConflictKind,
    create_storage_conflict_error,
    get_storage_conflict_kind,
)
from ..ids import validate_id
from ..json_values import canonical_json_of_checked, terminal_safe_json
from ..model_build import build_validated
from ..model_json import datetime_json, runlane_observation_json
from ..models import (
    Environment,
    RunEventRecord,
    RunlaneObservation,
    RunlaneObservationRecord,
    RunRecord,
    RunStepRecord,
    UtcDateTime,
    environment_key,
)
from ..storage import (
    STORAGE_DOCUMENT_SCHEMA_VERSION,
    NewStorageRecord,
    StorageAppendCommand,
    StorageDocument,
    StorageDriver,
    StorageIndexConsistency,
    StorageIndexName,
    StorageProfile,
    StorageQuery,
    StorageRange,
    StorageRecord,
    StorageRecordKey,
    StorageStreamName,
    StorageTransaction,
    decode_storage_unsigned_integer,
    encode_iso_date,
    encode_storage_append_value,
    encode_storage_tuple,
    encode_storage_unsigned_integer,
    format_unsigned_64_decimal,
    materialize_storage_append,
    parse_unsigned_64_decimal,
    read_storage_stream_position,
    storage_stream_layouts,
)
from ..storage.cursor import decode_opaque_token, encode_opaque_token
from ..storage.streams import AppendValueShape
from ..vocabulary import (
    RunEventType,
    RunlaneObservationExporterTickStatus,
    RunlaneObservationSourceKind,
    RunlaneObservationType,
    RunStatus,
)
from .cancellation import CancellationSignal, being_cancelled

__all__ = [
    "HEAD_NOT_READ",
    "OBSERVATION_CHECKPOINTS_COLLECTION",
    "ConsoleObservationSink",
    "ExporterTick",
    "ObservationExporter",
    "ObservationExporterStats",
    "ObservationPage",
    "ObservationSink",
    "ObservationTrimResult",
    "advance_observation_checkpoint",
    "event_observation_documents",
    "event_observation_values",
    "event_statuses",
    "get_observation_checkpoint",
    "observation_checkpoint_key",
    "observation_cursor",
    "observation_for_event",
    "observation_for_step",
    "observation_head_key",
    "observation_head_reads",
    "observation_record_id",
    "observation_record_value",
    "scan_observation_records",
    "stage_observation_documents",
    "stage_observations",
    "step_observation_value",
    "trim_observation_records",
]

_logger = logging.getLogger("runlane.export")

T = TypeVar("T")

OBSERVATION_CHECKPOINTS_COLLECTION = "observation_checkpoints"

_STREAM = StorageStreamName.OBSERVATIONS
_LAYOUT = storage_stream_layouts[_STREAM]
_CURSOR_VERSION = 1
_CURSOR_KIND = "observation_stream"
_TIME = TypeAdapter(UtcDateTime)


def _environment(value: Environment | str, *, code: ErrorCode = ErrorCode.VALIDATION_FAILED) -> Environment:
    if isinstance(value, Environment):
        return value
    if isinstance(value, str):
        try:
            return Environment.model_validate({"name": value})
        except ValidationError:
            pass
    raise RunlaneError(
        code, f"environment must be an Environment or a non-empty name, got {value!r}.", meta={"field": "environment"}
    )


def _invariant(message: str, error: Exception | None = None) -> RunlaneError:
    return RunlaneError(ErrorCode.INVARIANT_VIOLATION, message, cause=error)


# ---------------------------------------------------------------------------------------------
# Sanitized observations and stored record values


# The status an event leaves its run in, where the event alone decides it. A heartbeat leaves the
# status as it was; a delivery request makes the run scheduled or queued (``_status_after``).
_STATUS_AFTER: dict[RunEventType, RunStatus] = {
    RunEventType.CREATED: RunStatus.QUEUED,
    RunEventType.LEASE_CLAIMED: RunStatus.RUNNING,
    RunEventType.STARTED: RunStatus.RUNNING,
    RunEventType.SUCCEEDED: RunStatus.SUCCEEDED,
    RunEventType.FAILED: RunStatus.FAILED,
    RunEventType.RETRY_SCHEDULED: RunStatus.RETRYING,
    RunEventType.RELEASED: RunStatus.RELEASED,
    RunEventType.CANCELLATION_REQUESTED: RunStatus.CANCELLATION_REQUESTED,
    RunEventType.CANCELLED: RunStatus.CANCELLED,
}


def event_statuses(run: RunRecord, records: Sequence[RunEventRecord]) -> list[RunStatus]:
    """The run's status right after each of the events one commit appended (``run`` as projected by the
    commit, which gives the last one): ``run_now`` commits created, lease_claimed and started at once,
    and its ``run.created`` left the run queued."""
    statuses = [_status_after(record.event, run.status) for record in records[:-1]]
    if records:
        statuses.append(run.status)
    return statuses


def _status_after(event: Any, current: RunStatus) -> RunStatus:
    kind = event.type
    if kind is RunEventType.DELIVERY_REQUESTED:
        return RunStatus.SCHEDULED if event.delivery.available_at > event.occurred_at else RunStatus.QUEUED
    return _STATUS_AFTER.get(kind, current)


def observation_for_event(
    record: RunEventRecord, run: RunRecord, status: RunStatus | None = None
) -> RunlaneObservation:
    """The sanitized observation of one committed run event; ``run`` is the run as projected by its
    commit, ``status`` the run's status right after this event (``event_statuses``; the run's own when
    not given).

    Carries identity, type, sequence, status, attempt, the failure *code* and the trace carrier; never
    the payload, output, failure message or metadata, release reason or wait detail.
    """
    event = record.event
    if event.run_id != run.id or (event.environment is not run.environment and event.environment != run.environment):
        raise _invariant(f"Event {record.id!r} belongs to another run than {run.id!r}; refusing to observe it.")
    # Events without these fields would take pydantic's slow missing-attribute path through getattr.
    fields = event.__dict__
    failure = fields.get("failure")
    values: dict[str, Any] = {
        "type": RunlaneObservationType.RUN_EVENT,
        "environment": run.environment,
        "run_id": run.id,
        "task_id": run.task_id,
        "queue": run.queue,
        "occurred_at": event.occurred_at,
        "event_id": record.id,
        "event_type": event.type,
        "event_sequence": record.sequence,
        "status": run.status if status is None else status,
        "attempt": fields.get("attempt"),
        "failure_code": None if failure is None else failure.code,
        "trace_carrier": _trace_carrier(event, run),
    }
    if type(run) is RunRecord and type(record) is RunEventRecord and _is_utc(event.occurred_at):
        # Every value comes from a validated run and event (every write path observes what it just
        # persisted): build the observation without validating the parts again.
        return build_validated(RunlaneObservation, values)
    return RunlaneObservation(**values)


def observation_for_step(step: RunStepRecord, run: RunRecord | None = None) -> RunlaneObservation:
    """The sanitized observation of a first-time durable step completion (never the step output)."""
    if run is not None and (run.id != step.run_id or run.environment != step.environment):
        raise _invariant(f"Step {step.step_key!r} belongs to another run than {run.id!r}; refusing to observe it.")
    values: dict[str, Any] = {
        "type": RunlaneObservationType.RUN_STEP,
        "environment": step.environment,
        "run_id": step.run_id,
        "task_id": None if run is None else run.task_id,
        "queue": None if run is None else run.queue,
        "occurred_at": step.completed_at,
        "step_key": step.step_key,
        "step_token": step.token,
        "attempt": step.attempt,
    }
    if type(step) is RunStepRecord and (run is None or type(run) is RunRecord) and _is_utc(step.completed_at):
        return build_validated(RunlaneObservation, values)
    return RunlaneObservation(**values)


def _is_utc(value: object) -> bool:
    return type(value) is datetime and value.tzinfo is UTC


def observation_record_id(
    environment: Environment | str, source_kind: RunlaneObservationSourceKind | str, source_id: str
) -> str:
    """``obs_`` + sha256 of ``[environment key, source kind, source id]``: stable across retries and restarts."""
    kind = source_kind if type(source_kind) is RunlaneObservationSourceKind else RunlaneObservationSourceKind(source_kind)
    env = environment.name if type(environment) is Environment else environment_key(_environment(environment))
    text = canonical_json_of_checked([env, kind.value, source_id])
    return "obs_" + hashlib.sha256(text.encode("utf-8")).hexdigest()


def observation_record_value(
    observation: RunlaneObservation,
    source_kind: RunlaneObservationSourceKind | str,
    source_id: str,
    recorded_at: datetime,
) -> dict[str, Any]:
    """The stored value of one observation record (storage adds ``stream_position`` at commit)."""
    if not isinstance(observation, RunlaneObservation):
        raise RunlaneError(ErrorCode.INVARIANT_VIOLATION, "observation_record_value() takes a RunlaneObservation.")
    kind = source_kind if type(source_kind) is RunlaneObservationSourceKind else RunlaneObservationSourceKind(source_kind)
    if not isinstance(source_id, str) or not source_id:
        raise RunlaneError(ErrorCode.INVARIANT_VIOLATION, "An observation source id must be a non-empty string.")
    if _is_utc(recorded_at):
        recorded = datetime_json(recorded_at)
    else:
        try:
            recorded = _TIME.dump_python(_TIME.validate_python(recorded_at), mode="json")
        except ValidationError as error:
            message = f"Invalid observation time {recorded_at!r}."
            raise RunlaneError(ErrorCode.INVARIANT_VIOLATION, message, cause=error) from None
    environment = observation.environment
    return {
        "id": observation_record_id(environment, kind, source_id),
        "environment": {"name": environment.name} if type(environment) is Environment else environment.to_json(),
        "source_kind": kind.value,
        "source_id": source_id,
        "recorded_at": recorded,
        "observation": runlane_observation_json(observation),
    }


def event_observation_values(run: RunRecord, events: Sequence[RunEventRecord]) -> list[dict[str, Any]]:
    """Stored values for the events one commit appends to ``run`` (``run`` as projected by that commit)."""
    kind = RunlaneObservationSourceKind.RUN_EVENT
    return [
        observation_record_value(observation_for_event(record, run, status), kind, record.id, record.event.occurred_at)
        for record, status in zip(events, event_statuses(run, events))
    ]


_EVENT_SOURCE = RunlaneObservationSourceKind.RUN_EVENT
_EVENT_SOURCE_VALUE = _EVENT_SOURCE.value
_RUN_EVENT_OBSERVATION = RunlaneObservationType.RUN_EVENT.value
# Every event observation value's greatest top-level key (see ``encode_storage_append_value``).
_EVENT_VALUE_SHAPE = AppendValueShape("source_kind")


@functools.lru_cache(maxsize=64)
def _event_id_prefix(env: str) -> str:
    """``canonical_json([env, "run_event", source_id])`` up to the source id, for ``observation_record_id``."""
    return canonical_json_of_checked([env, _EVENT_SOURCE.value, ""])[:-3]


def _carrier_of(event: Any, run: RunRecord) -> Mapping[str, str] | None:
    """The trace carrier an event's observation carries: the event's own, else its run's, so that every
    record of a run triggered in a trace can be put in that trace without remembering earlier records."""
    return event.trace_carrier if event.trace_carrier is not None else run.trace_carrier


def _trace_carrier(event: Any, run: RunRecord) -> dict[str, str] | None:
    carrier = _carrier_of(event, run)
    return None if carrier is None else dict(carrier)


def event_observation_documents(run: RunRecord, records: Sequence[RunEventRecord]) -> list[StorageDocument]:
    """The stream documents of the events one commit appends to ``run`` (``run`` as projected by that
    commit): exactly ``encode_storage_append_value(value, checked=True)`` of each value of
    ``event_observation_values(run, records)``, written in one pass from the run and the event records
    without the intermediate observation models or values.

    The text is the canonical JSON ``orjson`` writes for those values (keys sorted, no whitespace),
    assembled from its parts: free-form strings (environment, ids, names) are encoded by ``orjson``,
    enum values and times need no escaping. Anything unusual takes the value path.
    """
    environment = run.environment
    status = run.status
    if (
        type(run) is not RunRecord
        or type(environment) is not Environment
        or type(status) not in _PLAIN_ENUMS
        or run.task_id is None  # optional observation fields are left out when ``None``
        or run.queue is None
    ):
        return _slow_event_documents(run, records)
    env = environment.name
    try:
        env_json = _env_json(env)
        run_json = _dumps(run.id).decode("utf-8")
        tail = f',"queue":{_dumps(run.queue).decode("utf-8")},"run_id":{run_json},"status":"'
        task_json = f'","task_id":{_dumps(run.task_id).decode("utf-8")},'
    except (orjson.JSONEncodeError, TypeError):
        return _slow_event_documents(run, records)
    # The parts every document of this run shares, around the per-event values.
    head = f'{{"schemaVersion":{STORAGE_DOCUMENT_SCHEMA_VERSION},"value":{{"environment":{env_json},"id":"obs_'
    environment_json = f'"environment":{env_json},"event_id":'
    id_prefix = _event_id_prefix(env)
    sha256 = hashlib.sha256
    run_id = run.id
    documents = []
    last = len(records) - 1
    for index, record in enumerate(records):
        event = record.event
        occurred = event.occurred_at
        sequence = record.sequence
        event_type = event.type
        if (
            type(record) is not RunEventRecord
            or event.run_id != run_id
            or not (event.environment is environment or event.environment == environment)
            or type(occurred) is not datetime
            or occurred.tzinfo is not UTC
            or type(sequence) is not int
            or type(event_type) not in _PLAIN_ENUMS
            or record.id is None
        ):
            return _slow_event_documents(run, records)
        fields = event.__dict__
        attempt = fields.get("attempt")
        failure = fields.get("failure")
        carrier = _carrier_of(event, run)
        event_id = record.id
        if type(event_id) is str and event_id.isascii() and event_id.isidentifier():
            # [A-Za-z0-9_]: nothing to escape, in the document or in the id's hashed text
            event_json = f'"{event_id}"'
            digest = sha256(f"{id_prefix}{event_json}]".encode("utf-8")).hexdigest()
        else:
            event_json = _dumps(event_id).decode("utf-8")
            digest = observation_record_id(env, _EVENT_SOURCE, event_id)[4:]
        attempt_json = ""
        if attempt is not None:
            if type(attempt) is not int:
                return _slow_event_documents(run, records)
            attempt_json = f'"attempt":{attempt},'
        failure_json = ""
        if failure is not None:
            code = failure.code
            if type(code) not in _PLAIN_ENUMS:
                return _slow_event_documents(run, records)
            failure_json = f'"failure_code":"{code._value_}",'
        carrier_json = ""
        if carrier is not None:
            try:
                carrier_json = f'"trace_carrier":{_dumps(dict(carrier), option=orjson.OPT_SORT_KEYS).decode("utf-8")},'
            except (orjson.JSONEncodeError, TypeError):
                return _slow_event_documents(run, records)
        at = datetime_json(occurred)
        after = status if index == last else _status_after(event, status)
        text = (
            f'{head}{digest}","observation":{{{attempt_json}{environment_json}{event_json},"event_sequence":'
            f'{sequence},"event_type":"{event_type._value_}",{failure_json}"occurred_at":"{at}"{tail}'
            f'{after._value_}{task_json}{carrier_json}"type":"{_RUN_EVENT_OBSERVATION}"}},"recorded_at":"{at}",'
            f'"source_id":{event_json},"source_kind":"{_EVENT_SOURCE_VALUE}"}}}}'
        )
        size = len(text) if text.isascii() else len(text.encode("utf-8"))
        documents.append(StorageDocument(text, size).remember_decoded(_EVENT_VALUE_SHAPE))
    return documents


_dumps = orjson.dumps


@functools.lru_cache(maxsize=64)
def _env_json(env: str) -> str:
    return _dumps({"name": env}).decode("utf-8")


def _plain(enum: type[Any]) -> bool:
    """Whether every value of a string enum is written by ``orjson`` as itself between quotes."""
    return all(_dumps(member._value_).decode("utf-8") == f'"{member._value_}"' for member in enum)


# String enums whose values need no escaping (all of Runlane's: checked here, not assumed).
_PLAIN_ENUMS = frozenset(
    enum for enum in (RunStatus, RunEventType, ErrorCode, RunlaneObservationType) if _plain(enum)
)


def _slow_event_documents(run: RunRecord, records: Sequence[RunEventRecord]) -> list[StorageDocument]:
    return [encode_storage_append_value(value, checked=True) for value in event_observation_values(run, records)]


def step_observation_value(step: RunStepRecord, run: RunRecord | None = None) -> dict[str, Any]:
    """The stored value for a first-time step completion (not for an idempotent replay)."""
    return observation_record_value(
        observation_for_step(step, run), RunlaneObservationSourceKind.RUN_STEP, step.token, step.completed_at
    )


# ---------------------------------------------------------------------------------------------
# Staging appends inside the caller's transaction


class _HeadNotRead:
    __slots__ = ()

    def __repr__(self) -> str:
        return "HEAD_NOT_READ"


HEAD_NOT_READ: Any = _HeadNotRead()
"""Default of ``stage_observations(head=...)``: the caller did not read the head (native append only)."""


def observation_head_key(environment: Environment | str) -> StorageRecordKey:
    """The stream head of ``environment``; the point-write fallback needs it in the attempt's read phase."""
    return _LAYOUT.head_key(environment_key(_environment(environment)))


def observation_head_reads(profile: StorageProfile, environment: Environment | str) -> tuple[StorageRecordKey, ...]:
    """Keys a write path adds to its one ``tx.get`` so it can stage observations later in the attempt.

    Empty with native ordered append: an attempt that appends must not also read the stream head.
    """
    return () if profile.ordered_append else (observation_head_key(environment),)


def stage_observations(
    tx: StorageTransaction,
    profile: StorageProfile,
    environment: Environment | str,
    values: Sequence[Mapping[str, Any]],
    *,
    head: StorageRecord | None = HEAD_NOT_READ,
    checked: bool = False,
) -> None:
    """Stage ``values`` (from ``observation_record_value``) as the next records of the environment's stream.

    Call it at most once per attempt and environment, after the reads, with every value the commit
    produces. With ``profile.ordered_append`` this stages one native append. Without it, ``head`` must
    be exactly what this attempt's read phase returned for ``observation_head_key(environment)``
    (``None`` when absent); the records are created at the next positions and the head is created or
    replaced. Both paths persist identical documents at identical positions, so both kinds of writer
    can share one store.

    ``checked=True`` promises that every value is exactly what ``observation_record_value`` (or
    ``event_observation_values`` / ``step_observation_value``) returned: JSON-safe by construction, so
    it is encoded without walking it again (core's write paths stage one value per persisted event).
    """
    if not values:
        return
    env = environment_key(_environment(environment, code=ErrorCode.INVARIANT_VIOLATION))
    for value in values:
        if not isinstance(value, Mapping) or value.get("environment") != {"name": env}:
            raise RunlaneError(
                ErrorCode.INVARIANT_VIOLATION,
                f"Only observation values of environment {env!r} can join its stream "
                "(build them with observation_record_value).",
            )
    # Encoding reads each value once, here: a plain dict is not copied first.
    documents = [
        encode_storage_append_value(value if type(value) is dict else dict(value), checked=checked) for value in values
    ]
    _stage_documents(tx, profile, env, documents, head)


def stage_observation_documents(
    tx: StorageTransaction,
    profile: StorageProfile,
    env: str,
    documents: Sequence[StorageDocument],
    *,
    head: StorageRecord | None = HEAD_NOT_READ,
) -> None:
    """``stage_observations`` for values already encoded by ``event_observation_documents`` for the
    environment whose key is ``env`` (core's write paths, which build them from what they persist)."""
    if documents:
        _stage_documents(tx, profile, env, documents, head)


def _stage_documents(
    tx: StorageTransaction,
    profile: StorageProfile,
    env: str,
    documents: Sequence[StorageDocument],
    head: StorageRecord | None,
) -> None:
    command = StorageAppendCommand._trusted(_STREAM, env, tuple(documents))
    if profile.ordered_append:
        tx.append(command)
        return
    if head is HEAD_NOT_READ:
        raise RunlaneError(
            ErrorCode.INVARIANT_VIOLATION,
            "The point-write observation fallback needs the stream head read in this attempt "
            "(include observation_head_key() in the attempt's get and pass the result as head=).",
        )
    if head is not None and (not isinstance(head, StorageRecord) or head.key != _LAYOUT.head_key(env)):
        raise RunlaneError(ErrorCode.INVARIANT_VIOLATION, f"head= is not the observation stream head of {env!r}.")
    appended = materialize_storage_append(command, read_storage_stream_position(head))
    for record in appended.records:
        tx.create(record)
    if head is None:
        tx.create(appended.head)
    else:
        tx.replace(head, appended.head)




# ---------------------------------------------------------------------------------------------
# Cursors


def observation_cursor(environment: Environment | str, stream_position: str) -> str:
    """The opaque cursor that continues after the record at ``stream_position`` in ``environment``."""
    position = parse_unsigned_64_decimal(stream_position)
    return _encode_cursor(environment_key(_environment(environment)), position)


def _encode_cursor(env: str, position: int) -> str:
    payload = {"v": _CURSOR_VERSION, "kind": _CURSOR_KIND, "environment": env}
    return encode_opaque_token({**payload, "position": format_unsigned_64_decimal(position)})


def _decode_cursor(cursor: object, what: str = "cursor") -> tuple[str, int]:
    """``(environment key, position)`` of a cursor; anything else is ``validation_failed``."""
    payload = decode_opaque_token(cursor)
    valid = (
        isinstance(payload, dict)
        and set(payload) == {"v", "kind", "environment", "position"}
        and type(payload["v"]) is int
        and payload["v"] == _CURSOR_VERSION
        and payload["kind"] == _CURSOR_KIND
        and isinstance(payload["environment"], str)
        and isinstance(payload["position"], str)
    )
    if valid:
        try:
            return payload["environment"], parse_unsigned_64_decimal(payload["position"])
        except RunlaneError:
            pass
    raise RunlaneError(
        ErrorCode.VALIDATION_FAILED,
        f"Malformed observation {what}: pass back the whole cursor value a scan returned, unchanged.",
        meta={"field": what},
    )


# ---------------------------------------------------------------------------------------------
# Scans


@dataclass(frozen=True, slots=True)
class ObservationPage:
    """Records after the requested cursor in stream order; ``cursor`` continues after the last one
    (the requested cursor when the page is empty)."""

    records: list[RunlaneObservationRecord]
    cursor: str | None


def _decode_record(env: str, position: int, record: StorageRecord) -> RunlaneObservationRecord:
    try:
        decoded = RunlaneObservationRecord.model_validate(record.document.value)
    except ValidationError as error:
        raise _invariant(f"Observation record {position} of {env!r} is not canonical.", error) from None
    if decoded.stream_position != str(position) or environment_key(decoded.environment) != env:
        raise _invariant(f"Observation record {position} of {env!r} does not match its key.")
    return decoded


async def scan_observation_records(
    driver: StorageDriver,
    environment: Environment | str,
    *,
    cursor: str | None = None,
    limit: int | None = None,
) -> ObservationPage:
    """Observation records of ``environment`` after ``cursor`` in stable forward stream order.

    ``limit`` is clamped to ``contract_defaults.pagination`` and the driver's query page. Index rows
    are candidates: every record is read back by key. Over an eventually consistent index the page
    also stops at the first position gap, so a record whose index row lags is never skipped.
    """
    env = environment_key(_environment(environment))
    after = 0
    if cursor is not None:
        cursor_env, after = _decode_cursor(cursor)
        if cursor_env != env:
            raise RunlaneError(
                ErrorCode.VALIDATION_FAILED,
                "This observation cursor belongs to another environment; scan without a cursor or pass its own.",
                meta={"field": "cursor"},
            )
    max_limit = min(contract_defaults.pagination.max_limit, driver.profile.limits.max_query_results)
    if limit is None:
        page_limit = min(contract_defaults.pagination.default_limit, max_limit)
    elif isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        message = f"limit must be a positive integer, got {limit!r}."
        raise RunlaneError(ErrorCode.VALIDATION_FAILED, message, meta={"field": "limit"})
    else:
        page_limit = min(limit, max_limit)
    lower = StorageRange(gt=None if after == 0 else encode_storage_tuple([encode_storage_unsigned_integer(after)]))
    result = await driver.query(StorageQuery(StorageIndexName.OBSERVATION_STREAM, (env,), lower, limit=page_limit))
    positions: list[int] = []
    expected = after + 1
    contiguous = driver.profile.index_consistency is StorageIndexConsistency.EVENTUAL
    for ref in result.items:
        key = ref.key
        if key.collection != _LAYOUT.record_collection or len(key.parts) != 2 or key.parts[0] != env:
            raise _invariant(f"The observation stream index of {env!r} returned a foreign key {key!r}.")
        position = decode_storage_unsigned_integer(key.parts[1])
        if position <= after or (positions and position <= positions[-1]):
            raise _invariant(f"The observation stream index of {env!r} returned positions out of order.")
        if contiguous and position != expected and (positions or after > 0):
            break
        positions.append(position)
        expected = position + 1
    records: list[RunlaneObservationRecord] = []
    chunk = driver.profile.limits.max_point_reads
    complete = True
    for start in range(0, len(positions), chunk):
        if not complete:
            break
        wanted = positions[start : start + chunk]
        stored = await driver.get([_LAYOUT.record_key(env, position) for position in wanted])
        for position, record in zip(wanted, stored, strict=True):
            if record is None:  # a candidate that is not (or no longer) readable ends the page
                complete = False
                break
            records.append(_decode_record(env, position, record))
    next_cursor = cursor if not records else _encode_cursor(env, int(records[-1].stream_position))
    return ObservationPage(records, next_cursor)


# ---------------------------------------------------------------------------------------------
# Checkpoints


def observation_checkpoint_key(environment: Environment | str, consumer: str) -> StorageRecordKey:
    return StorageRecordKey(OBSERVATION_CHECKPOINTS_COLLECTION, environment_key(_environment(environment)), consumer)


def _consumer(consumer: object, code: ErrorCode = ErrorCode.VALIDATION_FAILED) -> str:
    return validate_id(consumer, "observation consumer", code=code)


def _checkpoint_position(record: StorageRecord | None, env: str) -> tuple[str | None, int]:
    """The stored cursor and its position (``None``, 0 without a checkpoint)."""
    if record is None:
        return None, 0
    value = record.document.value
    stored = value.get("cursor")
    try:
        cursor_env, position = _decode_cursor(stored)
    except RunlaneError:
        cursor_env, position = None, 0
    if cursor_env != env or value.get("position") != format_unsigned_64_decimal(position):
        raise _invariant(f"The observation checkpoint {record.key!r} is corrupt.")
    return stored, position


async def get_observation_checkpoint(
    driver: StorageDriver, environment: Environment | str, consumer: str
) -> str | None:
    """The last cursor ``consumer`` checkpointed in ``environment`` (``None`` before its first advance)."""
    env = environment_key(_environment(environment))
    name = _consumer(consumer)
    [record] = await driver.get([StorageRecordKey(OBSERVATION_CHECKPOINTS_COLLECTION, env, name)])
    return _checkpoint_position(record, env)[0]


async def advance_observation_checkpoint(
    driver: StorageDriver,
    environment: Environment | str,
    consumer: str,
    *,
    expected_cursor: str | None,
    cursor: str,
) -> None:
    """Move ``consumer``'s checkpoint from ``expected_cursor`` to ``cursor`` in one transaction.

    Rejected with ``StorageConflictKind.OBSERVATION_CHECKPOINT`` when the stored checkpoint is not
    ``expected_cursor`` (a stale writer; retryable), when ``cursor`` does not reference an existing
    record of this environment's stream, or when it does not move strictly forward (both final).
    """
    env = environment_key(_environment(environment))
    name = _consumer(consumer)
    target_env, target = _decode_cursor(cursor)
    expected: int | None = None
    if expected_cursor is not None:
        expected_env, expected = _decode_cursor(expected_cursor, "expected_cursor")
        if expected_env != env:
            expected = -1  # never matches a stored checkpoint of this environment
    key = StorageRecordKey(OBSERVATION_CHECKPOINTS_COLLECTION, env, name)
    conflict_meta = {"environment": env, "consumer": name}

    async def attempt(tx: StorageTransaction) -> None:
        reads = [key]
        if target_env == env:
            reads.append(_LAYOUT.record_key(env, target))
        found = await tx.get(reads)
        current = found[0]
        _, stored = _checkpoint_position(current, env)
        if expected != (None if current is None else stored):
            raise create_storage_conflict_error(
                StorageConflictKind.OBSERVATION_CHECKPOINT,
                f"The observation checkpoint of consumer {name!r} moved since it was read; read it again and retry.",
                meta=conflict_meta,
            )
        if target_env != env or found[1] is None:
            raise create_storage_conflict_error(
                StorageConflictKind.OBSERVATION_CHECKPOINT,
                f"The cursor does not reference an observation record of environment {env!r}.",
                retryable=False,
                meta=conflict_meta,
            )
        if current is not None and target <= stored:
            raise create_storage_conflict_error(
                StorageConflictKind.OBSERVATION_CHECKPOINT,
                f"Observation checkpoints only move forward; consumer {name!r} is already at or past this cursor.",
                retryable=False,
                meta=conflict_meta,
            )
        now = await tx.now()
        document = StorageDocument.encode(
            {
                "environment": {"name": env},
                "consumer": name,
                "cursor": _encode_cursor(env, target),
                "position": format_unsigned_64_decimal(target),
                "updated_at": encode_iso_date(now),
            }
        )
        record = NewStorageRecord(key, document)
        if current is None:
            tx.create(record)
        else:
            tx.replace(current, record)

    await driver.with_transaction(attempt)


# ---------------------------------------------------------------------------------------------
# Retention


@dataclass(frozen=True, slots=True)
class ObservationTrimResult:
    """What one ``trim`` call deleted; ``more`` when records it may delete remain (call it again)."""

    deleted: int
    more: bool


async def trim_observation_records(
    driver: StorageDriver,
    environment: Environment | str,
    *,
    recorded_before: datetime,
    consumers: Sequence[str] = (),
    limit: int = 1000,
) -> ObservationTrimResult:
    """Delete the oldest observation records of ``environment``, in stream order, while they were
    recorded before ``recorded_before`` and every consumer of ``consumers`` has checkpointed past them;
    at most ``limit`` records, in bounded transactions. The stream head is kept, so positions never
    repeat. A consumer without a checkpoint keeps everything: records it has not exported are never
    deleted for it. Consumers not named are not consulted: a record they have not exported yet may go.
    """
    env = environment_key(_environment(environment))
    names = [_consumer(name) for name in consumers]
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise RunlaneError(ErrorCode.VALIDATION_FAILED, f"limit must be a positive integer, got {limit!r}.")
    if not _is_utc(recorded_before):
        raise RunlaneError(ErrorCode.VALIDATION_FAILED, "recorded_before must be an aware datetime.")
    keep_from: int | None = None  # the first position a named consumer has not exported
    if names:
        found = await driver.get([StorageRecordKey(OBSERVATION_CHECKPOINTS_COLLECTION, env, name) for name in names])
        keep_from = min(_checkpoint_position(record, env)[1] for record in found) + 1
    limits = driver.profile.limits
    batch = max(1, min(limits.max_query_results, limits.max_point_reads, limits.max_transaction_records))
    deleted = 0
    while deleted < limit:
        upper = None if keep_from is None else encode_storage_tuple([encode_storage_unsigned_integer(keep_from)])
        page = await driver.query(
            StorageQuery(
                StorageIndexName.OBSERVATION_STREAM, (env,), StorageRange(lt=upper), limit=min(batch, limit - deleted)
            )
        )
        keys = [ref.key for ref in page.items if ref.key.collection == _LAYOUT.record_collection]
        if not keys:
            return ObservationTrimResult(deleted, more=False)

        async def body(tx: StorageTransaction, keys: list[StorageRecordKey] = keys) -> tuple[int, bool]:
            doomed: list[StorageRecord] = []
            reached = False  # a record recorded at or after the cutoff: everything after it is newer
            for record in await tx.get(keys):
                if record is None:
                    continue  # another trim deleted it
                if _recorded_at(record, env) >= recorded_before:
                    reached = True
                    break
                doomed.append(record)
            await tx.now()
            for record in doomed:
                tx.delete(record)
            return len(doomed), reached

        removed, reached = await driver.with_transaction(body)
        deleted += removed
        if reached:
            return ObservationTrimResult(deleted, more=False)
        if not removed:  # the index still lists records another trim deleted: leave them to a later call
            return ObservationTrimResult(deleted, more=True)
    return ObservationTrimResult(deleted, more=True)


def _recorded_at(record: StorageRecord, env: str) -> datetime:
    try:
        return datetime.fromisoformat(record.document.value["recorded_at"])
    except (KeyError, TypeError, ValueError):
        raise _invariant(f"Observation record {record.key!r} of {env!r} has no valid recorded_at.") from None


# ---------------------------------------------------------------------------------------------
# Sinks


@runtime_checkable
class ObservationSink(Protocol):
    """Receives batches of observation records; returning means the batch was accepted.

    Delivery is at least once: a batch can be delivered again after a crash or a failed checkpoint
    advance, so sinks that need exactly-once effects dedupe by ``record.id``. A sink may also have a
    ``close()`` (plain or async); ``runlane export`` and ``runlane dev`` call it when they stop.
    """

    async def export(self, records: Sequence[RunlaneObservationRecord]) -> None: ...


class ConsoleObservationSink:
    """Writes one JSON object per record and line (``stream`` defaults to the current ``sys.stdout``)."""

    def __init__(self, stream: IO[str] | None = None) -> None:
        if stream is not None and not callable(getattr(stream, "write", None)):
            raise RunlaneError(ErrorCode.CONFIGURATION_INVALID, "stream must be a text stream with a write() method.")
        self._stream = stream

    @property
    def writes_to_stdout(self) -> bool:
        """Whether the records go to standard output (where a command's own lines would mix with them)."""
        return self._stream is None or self._stream is sys.stdout

    async def export(self, records: Sequence[RunlaneObservationRecord]) -> None:
        stream = self._stream if self._stream is not None else sys.stdout
        # A stream that cannot encode every character (PYTHONIOENCODING=ascii, a Latin-1 locale) gets the
        # same JSON with \u escapes: written raw, a task id or environment name it cannot encode failed
        # every batch for ever.
        ascii_only = not _encodes_unicode(stream)
        lines = "".join(
            terminal_safe_json(
                json.dumps(record.to_json(), sort_keys=True, separators=(",", ":"), ensure_ascii=ascii_only)
            )
            + "\n"
            for record in records
        )
        try:
            stream.write(lines)
            flush = getattr(stream, "flush", None)
            if callable(flush):
                flush()
        except BrokenPipeError as error:
            # Whatever read the stream (`runlane export | shipper`) has gone: no later write can reach
            # it, so the exporter stops instead of retrying into a closed pipe for ever.
            raise RunlaneError(
                ErrorCode.OBSERVATION_EXPORT_FAILED,
                f"The console exporter's {self._stream_name(stream)} was closed by its reader (a broken pipe); "
                f"the {len(records)} record(s) of this batch stay pending for the next export.",
                meta={"records": len(records)},
                cause=error,
            ) from None

    @staticmethod
    def _stream_name(stream: object) -> str:
        return "stdout" if stream is sys.stdout else "stderr" if stream is sys.stderr else "stream"


def _encodes_unicode(stream: object) -> bool:
    """Whether ``stream`` can write any character: a UTF encoding, or no encoding at all (``io.StringIO``)."""
    encoding = getattr(stream, "encoding", None)
    if not isinstance(encoding, str):
        return True
    try:
        return codecs.lookup(encoding).name.startswith("utf")
    except LookupError:
        return False


# ---------------------------------------------------------------------------------------------
# Exporter


@dataclass(frozen=True, slots=True)
class ObservationExporterStats:
    """Totals of one exporter instance since it was created."""

    ticks: int = 0
    exported: int = 0
    batches: int = 0
    failures: int = 0
    last_exported_at: datetime | None = None


@dataclass(frozen=True, slots=True)
class ExporterTick:
    """One scan/export/checkpoint cycle: ``exported`` records accepted and checkpointed, the original
    ``error`` of a failed tick, the checkpoint ``cursor`` after the tick, and the exporter's totals."""

    status: RunlaneObservationExporterTickStatus
    exported: int = 0
    error: BaseException | None = None
    cursor: str | None = None
    stats: ObservationExporterStats = field(default_factory=ObservationExporterStats)


class _Clock(Protocol):
    def now(self) -> datetime: ...


class _Aborted(Exception):
    pass


class ObservationExporter:
    """Moves one environment's observation records to ``sink`` for one named ``consumer``, at least once.

    Each tick reads the consumer's checkpoint, scans up to ``batch_size`` records after it, hands them
    to the sink and advances the checkpoint only after the sink accepted them. Run one active loop
    per ``(environment, consumer)``: a second loop with the same consumer loses the checkpoint race.
    """

    def __init__(
        self,
        driver: StorageDriver,
        environment: Environment | str,
        consumer: str,
        sink: ObservationSink,
        *,
        batch_size: int = 100,
        clock: _Clock | None = None,
    ) -> None:
        invalid = ErrorCode.CONFIGURATION_INVALID
        for method in ("get", "query", "with_transaction"):
            if not callable(getattr(driver, method, None)):
                message = f"driver must be a storage driver (missing {method}())."
                raise RunlaneError(invalid, message, meta={"field": "driver"})
        if not callable(getattr(sink, "export", None)):
            message = "sink must be an object with an async export(records) method."
            raise RunlaneError(invalid, message, meta={"field": "sink"})
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            message = f"batch_size must be a positive integer, got {batch_size!r}."
            raise RunlaneError(invalid, message, meta={"field": "batch_size"})
        if clock is not None and not callable(getattr(clock, "now", None)):
            raise RunlaneError(invalid, "clock must be an object with a now() method.", meta={"field": "clock"})
        self.driver = driver
        self.environment = _environment(environment, code=invalid)
        self.consumer = _consumer(consumer, invalid)
        self.sink = sink
        self.batch_size = batch_size
        self._clock = clock
        self._stats = ObservationExporterStats()

    def __repr__(self) -> str:
        return f"ObservationExporter(environment={self.environment.name!r}, consumer={self.consumer!r})"

    @property
    def stats(self) -> ObservationExporterStats:
        return self._stats

    def _now(self) -> datetime:
        return self._clock.now() if self._clock is not None else datetime.now(UTC)

    def _tick(
        self,
        status: RunlaneObservationExporterTickStatus,
        *,
        exported: int = 0,
        error: BaseException | None = None,
        cursor: str | None,
    ) -> ExporterTick:
        stats = self._stats
        failed = status is RunlaneObservationExporterTickStatus.FAILED
        done = status is RunlaneObservationExporterTickStatus.EXPORTED
        self._stats = ObservationExporterStats(
            ticks=stats.ticks + 1,
            exported=stats.exported + exported,
            batches=stats.batches + (1 if done else 0),
            failures=stats.failures + (1 if failed else 0),
            last_exported_at=self._now() if done else stats.last_exported_at,
        )
        return ExporterTick(status, exported, error, cursor, self._stats)

    async def export_once(self, *, signal: CancellationSignal | None = None) -> ExporterTick:
        """One scan/export/checkpoint cycle: ``idle``, ``exported``, ``failed`` (checkpoint untouched) or
        ``aborted`` when ``signal`` aborts before the sink accepted the batch."""
        _check_signal(signal)
        status = RunlaneObservationExporterTickStatus
        checkpoint: str | None = None
        if signal is not None and signal.aborted:
            return self._tick(status.ABORTED, cursor=None)
        try:
            checkpoint = await get_observation_checkpoint(self.driver, self.environment, self.consumer)
            records, cursor = await self._scan(checkpoint)
            if not records:
                return self._tick(status.IDLE, cursor=checkpoint)
            await _unless_aborted(_call_sink(self.sink, records), signal)
            # A scan that returned records ends at a cursor (``ObservationPage``).
            await self._advance(checkpoint, cast(str, cursor))
        except _Aborted:
            return self._tick(status.ABORTED, cursor=checkpoint)
        except Exception as error:
            return self._tick(status.FAILED, error=error, cursor=checkpoint)
        except asyncio.CancelledError as error:
            if being_cancelled():
                raise  # the exporter's own task is being cancelled
            # A sink that let the cancellation of something it awaited escape failed this batch, as any
            # untyped failure does: the loop retries it instead of ending as if it had been cancelled.
            return self._tick(status.FAILED, error=error, cursor=checkpoint)
        return self._tick(status.EXPORTED, exported=len(records), cursor=cursor)

    async def _advance(self, checkpoint: str | None, cursor: str) -> None:
        """Advance the checkpoint past a batch the sink accepted.

        A checkpoint that moved since this tick read it was moved by another exporter of the same consumer,
        which delivered the batch too: the retryable conflict says so, since the operator is to stop one.
        The batch was scanned after ``checkpoint``, so the advance can only be refused for good because
        its last record no longer exists: retention (``observations.trim`` without this consumer) deleted
        it while the sink sent the batch. That is a race, not a broken exporter: the next tick scans again
        from the checkpoint, past what was deleted, so the refusal is retryable here instead of stopping
        the exporter loop for good.
        """
        try:
            await advance_observation_checkpoint(
                self.driver, self.environment, self.consumer, expected_cursor=checkpoint, cursor=cursor
            )
        except RunlaneError as error:
            if get_storage_conflict_kind(error) is not StorageConflictKind.OBSERVATION_CHECKPOINT:
                raise
            if error.retryable:
                # The checkpoint moved since this tick read it: only another exporter of this consumer moves it.
                raise create_storage_conflict_error(
                    StorageConflictKind.OBSERVATION_CHECKPOINT,
                    f"Another exporter advanced the checkpoint of consumer {self.consumer!r} while this one sent "
                    "the batch, so both delivered it; run one exporter per consumer (give each sink a consumer "
                    "of its own).",
                    meta=error.meta,
                    cause=error,
                ) from None
            raise create_storage_conflict_error(
                StorageConflictKind.OBSERVATION_CHECKPOINT,
                f"Observation records consumer {self.consumer!r} was exporting were deleted (observations.trim) "
                "while the sink sent them; the next export scans again from its checkpoint.",
                meta=error.meta,
                cause=error,
            ) from None

    async def _scan(self, checkpoint: str | None) -> tuple[tuple[RunlaneObservationRecord, ...], str | None]:
        records: list[RunlaneObservationRecord] = []
        cursor = checkpoint
        while len(records) < self.batch_size:
            page = await scan_observation_records(
                self.driver, self.environment, cursor=cursor, limit=self.batch_size - len(records)
            )
            if not page.records:
                break
            records.extend(page.records)
            cursor = page.cursor
        return tuple(records), cursor

    async def run(
        self, *, signal: CancellationSignal | None = None, idle_delay: Duration = "1s", retry_delay: Duration = "5s"
    ) -> None:
        """Export until ``signal`` aborts: poll every ``idle_delay`` when idle, retry retryable and untyped
        failures after ``retry_delay`` (or after the ``retry_after_s`` a failure's meta asks for, an
        endpoint's ``Retry-After``, when that is longer, up to an hour), and raise a non-retryable
        ``RunlaneError``. A batch the sink is sending when ``signal`` aborts is finished, and its checkpoint
        advanced, before the loop returns: abandoning it would leave the sink to send it anyway and the next
        run to send it again."""
        _check_signal(signal)
        idle = duration_ms(idle_delay, "idle_delay") / 1000
        retry = duration_ms(retry_delay, "retry_delay") / 1000
        status = RunlaneObservationExporterTickStatus
        failures = 0  # consecutive failed ticks: the first is logged, then the recovery
        while signal is None or not signal.aborted:
            tick = await self.export_once()
            if tick.status in (status.EXPORTED, status.IDLE) and failures:
                _logger.warning(
                    "Observation export for consumer %r in %r works again after %d failures.",
                    self.consumer, self.environment.name, failures,
                )  # fmt: skip
                failures = 0
            if tick.status is status.EXPORTED:
                continue
            if tick.status is status.ABORTED:
                return
            if tick.status is status.IDLE:
                await _sleep(idle, signal)
                continue
            error = tick.error
            if isinstance(error, RunlaneError) and not error.retryable:
                raise error
            if not failures:
                # A RunlaneError says what failed; only an unexpected exception needs its traceback.
                described = f"{error.code.value}: {error.message}" if isinstance(error, RunlaneError) else "see below"
                _logger.warning(
                    "Observation export for consumer %r in %r failed (%s); retrying every %ss.",
                    self.consumer, self.environment.name, described, retry,
                    exc_info=None if isinstance(error, RunlaneError) else error,
                )  # fmt: skip
            failures += 1
            await _sleep(max(retry, _asked_delay(error)), signal)


# The longest wait a sink's failure may ask for before the next try (``retry_after_s``).
_MAX_ASKED_DELAY_S = 3600.0


def _asked_delay(error: BaseException | None) -> float:
    """The seconds a retryable failure asks to wait before the next try (``meta["retry_after_s"]``, as an
    endpoint's ``Retry-After`` sets it), at most an hour; 0 when it asks for none."""
    asked = error.meta.get("retry_after_s") if isinstance(error, RunlaneError) else None
    if isinstance(asked, bool) or not isinstance(asked, (int, float)) or not asked > 0:
        return 0.0
    return min(float(asked), _MAX_ASKED_DELAY_S)


def _check_signal(signal: object) -> None:
    if signal is not None and not isinstance(signal, CancellationSignal):
        raise RunlaneError(ErrorCode.CONFIGURATION_INVALID, f"signal must be a CancellationSignal, got {signal!r}.")


async def _call_sink(sink: ObservationSink, records: tuple[RunlaneObservationRecord, ...]) -> None:
    try:
        result = sink.export(records)
        if inspect.isawaitable(result):
            await result
    except SystemExit as error:
        # Left to escape, it would end the event loop of whatever hosts the exporter (runlane dev's worker
        # included) with the sink's exit status; it is this exporter's failure for good instead.
        raise RunlaneError(
            ErrorCode.OBSERVATION_EXPORT_FAILED,
            f"The sink called sys.exit({error.code!r}); a sink reports a failure by raising.",
            retryable=False,
            cause=error,
        ) from error


async def _unless_aborted(work: Awaitable[T], signal: CancellationSignal | None) -> T:
    """Await ``work``, or cancel it and raise ``_Aborted`` when ``signal`` aborts first."""
    if signal is None:
        return await work
    task = asyncio.ensure_future(work)
    waiter = asyncio.ensure_future(signal.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise _Aborted()
    finally:
        for pending in (task, waiter):
            if not pending.done():
                pending.cancel()
        await asyncio.gather(task, waiter, return_exceptions=True)


async def _sleep(seconds: float, signal: CancellationSignal | None) -> None:
    if signal is None:
        await asyncio.sleep(seconds)
        return
    try:
        await asyncio.wait_for(signal.wait(), seconds)
    except TimeoutError:
        pass
