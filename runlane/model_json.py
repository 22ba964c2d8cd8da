"""Fast JSON dumps of the models every write path persists: runs, run events and observations.

``run_record_json(run)`` equals ``run.model_dump(mode="json")``, ``run_event_record_json(id,
sequence, event)`` equals ``RunEventRecord(id=..., sequence=..., event=...).model_dump(mode="json")``
and ``runlane_observation_json(observation)`` equals ``observation.to_json()``, built straight from the
validated field values instead of through pydantic's generic serializer (the storage write path dumps
three runs, five events and five observations per executed run). Only the storage codecs and the
observation stream use them; the tests compare both dumps over every model shape, and a model whose
fields these functions do not know falls back to ``model_dump``.

Conversions are exactly pydantic's JSON mode: datetimes in ISO 8601 with ``Z`` for UTC (no fraction
when the microsecond is zero), enums as their values, nested models as objects with every field, and
free-form JSON values (payload, output, meta, trace carriers) through pydantic's own ``Any``
serializer (``to_jsonable_python``), so tuples, enum members and the like come out the same.

``run_record_document_value`` and ``run_event_record_document_value`` build the same values for a
storage document, except that UTC datetimes and enum members stay as they are: ``document_dumps``
(``orjson`` with sorted keys and ``Z`` for UTC) writes them exactly as the JSON dumps would be
written, without formatting each one in Python first.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import orjson
from pydantic import BaseModel
from pydantic_core import to_jsonable_python

from .models import (
    Actor,
    DeliveryIntent,
    Environment,
    RunCancellationRequestedEvent,
    RunCancelledEvent,
    RunCompletionWaitCondition,
    RunCounters,
    RunCreatedEvent,
    RunDeliveryRequestedEvent,
    RunEventRecord,
    RunFailedEvent,
    RunFailure,
    RunLease,
    RunLeaseClaimedEvent,
    RunLeaseHeartbeatEvent,
    RunlaneObservation,
    RunRecord,
    RunReleasedEvent,
    RunRetryScheduledEvent,
    RunSource,
    RunStartedEvent,
    RunSucceededEvent,
    SignalWaitCondition,
    TimeWaitCondition,
)

__all__ = [
    "datetime_json",
    "document_dumps",
    "run_event_json",
    "run_event_record_document_value",
    "run_event_record_json",
    "run_record_document_value",
    "run_record_json",
    "runlane_observation_json",
]


# The last two datetimes formatted and their text: one write path formats the same times for many
# fields (event time, delivery times, run timestamps). Holding a datetime keeps its identity unique
# while it is remembered; each pair is replaced as a unit, so threads never see a torn value.
_last_dt: tuple[Any, str] = (None, "")
_previous_dt: tuple[Any, str] = (None, "")


def _dt_required(value: datetime) -> str:
    global _last_dt, _previous_dt
    last = _last_dt
    if value is last[0]:
        return last[1]
    previous = _previous_dt
    if value is previous[0]:
        return previous[1]
    if type(value) is datetime and value.tzinfo is UTC:
        text = value.isoformat()[:-6] + "Z"  # ...+00:00; pydantic writes the UTC offset as Z
        _previous_dt = last
        _last_dt = (value, text)
        return text
    return to_jsonable_python(value)


def datetime_json(value: datetime) -> str:
    """A datetime exactly as pydantic's JSON mode writes it (``Z`` for UTC)."""
    return _dt_required(value)


def _enum(value: Any) -> Any:
    return getattr(value, "_value_", value)


def _same(value: Any) -> Any:
    return value


def _environment(value: Environment) -> dict[str, Any]:
    return {"name": value.name}


def _json(value: Any) -> Any:
    """A free-form JSON field exactly as pydantic's ``Any`` serializer writes it."""
    if value is None or type(value) is str or type(value) is int:
        return value
    return to_jsonable_python(value)


_Builders = tuple[
    Callable[[RunRecord], dict[str, Any]],
    Callable[[Any], dict[str, Any]],
    Callable[[str, int, Any], dict[str, Any]],
    dict[type[BaseModel], Callable[[Any, dict[str, Any]], None]],
]


def _builders(_dt_required: Callable[[Any], Any], _enum: Callable[[Any], Any]) -> _Builders:
    """The dump functions over one way of writing datetimes and enums: JSON text and values (the
    ``*_json`` functions), or the values themselves where ``orjson`` writes the same text (the
    ``*_document_value`` functions, see ``document_dumps``)."""

    def _dt(value: datetime | None) -> Any:
        if value is None:
            return None
        return _dt_required(value)

    def _actor(value: Actor) -> dict[str, Any]:
        return {"type": _enum(value.type), "id": value.id}

    def _counters(value: RunCounters) -> dict[str, Any]:
        return {
            "attempts": value.attempts,
            "failures": value.failures,
            "retries": value.retries,
            "releases": value.releases,
        }

    def _lease(value: RunLease | None) -> dict[str, Any] | None:
        if value is None:
            return None
        return {
            "worker_id": value.worker_id,
            "token": value.token,
            "claimed_at": _dt_required(value.claimed_at),
            "expires_at": _dt_required(value.expires_at),
        }

    def _failure(value: RunFailure | None) -> dict[str, Any] | None:
        if value is None:
            return None
        return {
            "code": _enum(value.code),
            "message": value.message,
            "retryable": value.retryable,
            "meta": _json(value.meta),
        }

    def _source(value: RunSource | None) -> dict[str, Any] | None:
        if value is None:
            return None
        return {
            "type": _enum(value.type),
            "source_run_id": value.source_run_id,
            "schedule_id": value.schedule_id,
            "occurrence_id": value.occurrence_id,
        }

    def _wait(value: Any) -> dict[str, Any] | None:
        if value is None:
            return None
        kind = type(value)
        if kind is TimeWaitCondition:
            return {"type": _enum(value.type), "resume_at": _dt_required(value.resume_at)}
        if kind is SignalWaitCondition:
            return {"type": _enum(value.type), "signal_key": value.signal_key, "timeout_at": _dt(value.timeout_at)}
        if kind is RunCompletionWaitCondition:
            return {"type": _enum(value.type), "run_id": value.run_id, "timeout_at": _dt(value.timeout_at)}
        return value.model_dump(mode="json")

    def _delivery(value: DeliveryIntent) -> dict[str, Any]:
        return {
            "environment": _environment(value.environment),
            "run_id": value.run_id,
            "queue": value.queue,
            "requested_at": _dt_required(value.requested_at),
            "available_at": _dt_required(value.available_at),
            "dispatch_expires_at": _dt(value.dispatch_expires_at),
            "trace_carrier": _json(value.trace_carrier),
        }

    def run_record_json(run: RunRecord) -> dict[str, Any]:
        """``run.model_dump(mode="json")`` (the output of a run without output is left out, as there)."""
        if not _ENABLED or type(run) is not RunRecord:
            return run.model_dump(mode="json")
        data = {
            "id": run.id,
            "environment": _environment(run.environment),
            "task_id": run.task_id,
            "queue": run.queue,
            "status": _enum(run.status),
            "payload": _json(run.payload),
            "counters": _counters(run.counters),
            "event_sequence": run.event_sequence,
            "created_at": _dt_required(run.created_at),
            "updated_at": _dt_required(run.updated_at),
            "run_at": _dt(run.run_at),
            "started_at": _dt(run.started_at),
            "finished_at": _dt(run.finished_at),
            "lease": _lease(run.lease),
            "attempt_deadline_at": _dt(run.attempt_deadline_at),
            "dispatched_at": _dt(run.dispatched_at),
            "dispatch_expires_at": _dt(run.dispatch_expires_at),
            "wait": _wait(run.wait),
            "failure": _failure(run.failure),
            "has_output": run.has_output,
            "source": _source(run.source),
            "idempotency_key": run.idempotency_key,
            "singleton_key": run.singleton_key,
            "concurrency_key": run.concurrency_key,
            "trace_carrier": _json(run.trace_carrier),
            "meta": _json(run.meta),
        }
        if run.has_output:
            data["output"] = _json(run.output)
        return data

    def _event_base(event: Any) -> dict[str, Any]:
        return {
            "run_id": event.run_id,
            "environment": _environment(event.environment),
            "occurred_at": _dt_required(event.occurred_at),
            "actor": _actor(event.actor),
            "trace_carrier": _json(event.trace_carrier),
            "meta": _json(event.meta),
            "type": _enum(event.type),
        }

    def _created(event: RunCreatedEvent, data: dict[str, Any]) -> None:
        data["task_id"] = event.task_id
        data["queue"] = event.queue
        data["payload"] = _json(event.payload)
        data["run_at"] = _dt(event.run_at)
        data["concurrency_key"] = event.concurrency_key
        data["idempotency_key"] = event.idempotency_key
        data["idempotency_key_ttl"] = event.idempotency_key_ttl
        data["singleton_key"] = event.singleton_key
        data["source"] = _source(event.source)

    def _delivery_requested(event: RunDeliveryRequestedEvent, data: dict[str, Any]) -> None:
        data["delivery"] = _delivery(event.delivery)

    def _lease_claimed(event: RunLeaseClaimedEvent, data: dict[str, Any]) -> None:
        data["lease"] = _lease(event.lease)
        data["attempt_deadline_at"] = _dt(event.attempt_deadline_at)

    def _lease_heartbeat(event: RunLeaseHeartbeatEvent, data: dict[str, Any]) -> None:
        data["lease"] = _lease(event.lease)

    def _started(event: RunStartedEvent, data: dict[str, Any]) -> None:
        data["attempt"] = event.attempt

    def _succeeded(event: RunSucceededEvent, data: dict[str, Any]) -> None:
        data["attempt"] = event.attempt
        if event.has_output:
            data["output"] = _json(event.output)
        data["has_output"] = event.has_output

    def _failed(event: RunFailedEvent, data: dict[str, Any]) -> None:
        data["attempt"] = event.attempt
        data["failure"] = _failure(event.failure)

    def _retry_scheduled(event: RunRetryScheduledEvent, data: dict[str, Any]) -> None:
        data["attempt"] = event.attempt
        data["failure"] = _failure(event.failure)
        data["delay"] = event.delay
        data["retry_at"] = _dt_required(event.retry_at)

    def _released(event: RunReleasedEvent, data: dict[str, Any]) -> None:
        data["attempt"] = event.attempt
        data["delay"] = event.delay
        data["resume_at"] = _dt(event.resume_at)
        data["wait"] = _wait(event.wait)
        data["reason"] = event.reason

    def _cancellation_requested(event: RunCancellationRequestedEvent, data: dict[str, Any]) -> None:
        data["reason"] = event.reason

    def _cancelled(event: RunCancelledEvent, data: dict[str, Any]) -> None:
        data["reason"] = event.reason
        data["attempt"] = event.attempt

    _EVENT_FIELDS: dict[type[BaseModel], Callable[[Any, dict[str, Any]], None]] = {
        RunCreatedEvent: _created,
        RunDeliveryRequestedEvent: _delivery_requested,
        RunLeaseClaimedEvent: _lease_claimed,
        RunLeaseHeartbeatEvent: _lease_heartbeat,
        RunStartedEvent: _started,
        RunSucceededEvent: _succeeded,
        RunFailedEvent: _failed,
        RunRetryScheduledEvent: _retry_scheduled,
        RunReleasedEvent: _released,
        RunCancellationRequestedEvent: _cancellation_requested,
        RunCancelledEvent: _cancelled,
    }

    def run_event_json(event: Any) -> dict[str, Any]:
        """``event.model_dump(mode="json")`` for any run event model."""
        fields = _EVENT_FIELDS.get(type(event)) if _ENABLED else None
        if fields is None:  # a subclass or a foreign value: the generic serializer decides
            return event.model_dump(mode="json")
        data = _event_base(event)
        fields(event, data)
        return data

    def run_event_record_json(event_id: str, sequence: int, event: Any) -> dict[str, Any]:
        """The JSON dump of ``RunEventRecord(id=event_id, sequence=sequence, event=event)``."""
        if not _ENABLED or type(event) not in _EVENT_FIELDS:
            record = RunEventRecord.model_construct(id=event_id, sequence=sequence, event=event)
            return record.model_dump(mode="json")
        return {"id": event_id, "sequence": sequence, "event": run_event_json(event)}

    return run_record_json, run_event_json, run_event_record_json, _EVENT_FIELDS


run_record_json, run_event_json, run_event_record_json, _EVENT_FIELDS = _builders(_dt_required, _enum)


def _dt_document(value: datetime) -> Any:
    """A UTC datetime as it is (``orjson`` with ``OPT_UTC_Z`` writes it as pydantic's JSON mode does),
    any other value as its JSON text."""
    if value.__class__ is datetime and value.tzinfo is UTC:
        return value
    return _dt_required(value)


run_record_document_value, _event_document_value, run_event_record_document_value, _ = _builders(_dt_document, _same)
_DOCUMENT_OPTIONS = orjson.OPT_SORT_KEYS | orjson.OPT_UTC_Z


def document_dumps(value: Any) -> bytes:
    """The canonical JSON bytes of a value holding ``*_document_value`` dumps: equal to
    ``canonical_json_of_checked`` of the same value with the ``*_json`` dumps."""
    return orjson.dumps(value, option=_DOCUMENT_OPTIONS)


# Optional observation fields in model order with their JSON conversion (``None`` values are omitted).
_OBSERVATION_OPTIONAL: tuple[tuple[str, Callable[[Any], Any]], ...] = (
    ("task_id", _same),
    ("queue", _same),
    ("event_id", _same),
    ("event_type", _enum),
    ("event_sequence", _same),
    ("status", _enum),
    ("attempt", _same),
    ("failure_code", _enum),
    ("step_key", _same),
    ("step_token", _same),
    ("trace_carrier", _json),
)


def runlane_observation_json(observation: RunlaneObservation) -> dict[str, Any]:
    """``observation.to_json()``: ``model_dump(mode="json", exclude_none=True)``."""
    if not _ENABLED or type(observation) is not RunlaneObservation:
        return observation.to_json()
    fields = observation.__dict__
    data: dict[str, Any] = {
        "type": _enum(fields["type"]),
        "environment": _environment(fields["environment"]),
        "run_id": fields["run_id"],
        "occurred_at": _dt_required(fields["occurred_at"]),
    }
    for name, convert in _OBSERVATION_OPTIONAL:
        value = fields[name]
        if value is not None:
            data[name] = convert(value)
    return data


# The field names each dump above writes. A model that gains, loses or renames a field no longer
# matches, and every dump falls back to ``model_dump`` (the tests fail on it first).
_BASE = ("run_id", "environment", "occurred_at", "actor", "trace_carrier", "meta", "type")
_WRITTEN: dict[type[BaseModel], tuple[str, ...]] = {
    Environment: ("name",),
    Actor: ("type", "id"),
    RunCounters: ("attempts", "failures", "retries", "releases"),
    RunLease: ("worker_id", "token", "claimed_at", "expires_at"),
    RunFailure: ("code", "message", "retryable", "meta"),
    RunSource: ("type", "source_run_id", "schedule_id", "occurrence_id"),
    TimeWaitCondition: ("type", "resume_at"),
    SignalWaitCondition: ("type", "signal_key", "timeout_at"),
    RunCompletionWaitCondition: ("type", "run_id", "timeout_at"),
    DeliveryIntent: (
        "environment", "run_id", "queue", "requested_at", "available_at", "dispatch_expires_at", "trace_carrier",
    ),
    RunRecord: (
        "id", "environment", "task_id", "queue", "status", "payload", "counters", "event_sequence", "created_at",
        "updated_at", "run_at", "started_at", "finished_at", "lease", "attempt_deadline_at", "dispatched_at",
        "dispatch_expires_at", "wait", "failure", "has_output", "source", "idempotency_key", "singleton_key",
        "concurrency_key", "trace_carrier", "meta", "output",
    ),
    RunEventRecord: ("id", "sequence", "event"),
    RunCreatedEvent: (
        *_BASE, "task_id", "queue", "payload", "run_at", "concurrency_key", "idempotency_key", "idempotency_key_ttl",
        "singleton_key", "source",
    ),
    RunDeliveryRequestedEvent: (*_BASE, "delivery"),
    RunLeaseClaimedEvent: (*_BASE, "lease", "attempt_deadline_at"),
    RunLeaseHeartbeatEvent: (*_BASE, "lease"),
    RunStartedEvent: (*_BASE, "attempt"),
    RunSucceededEvent: (*_BASE, "attempt", "output", "has_output"),
    RunFailedEvent: (*_BASE, "attempt", "failure"),
    RunRetryScheduledEvent: (*_BASE, "attempt", "failure", "delay", "retry_at"),
    RunReleasedEvent: (*_BASE, "attempt", "delay", "resume_at", "wait", "reason"),
    RunCancellationRequestedEvent: (*_BASE, "reason"),
    RunCancelledEvent: (*_BASE, "reason", "attempt"),
    RunlaneObservation: (
        "type", "environment", "run_id", "task_id", "queue", "occurred_at", "event_id", "event_type", "event_sequence",
        "status", "attempt", "failure_code", "step_key", "step_token", "trace_carrier",
    ),
}
_ENABLED = all(set(model.model_fields) == set(names) for model, names in _WRITTEN.items())
