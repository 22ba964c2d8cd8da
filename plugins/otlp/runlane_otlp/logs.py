"""``ObservationLogs``: observation records in, OpenTelemetry log records out, one for one.

Each record of the durable stream becomes one log record carrying the sanitized observation (never a
payload, output or failure detail) as ``runlane.*`` attributes:

* ``timestamp`` is when the fact occurred, ``observed_timestamp`` the record's ``recorded_at`` (the same time);
* ``event_name`` is ``runlane.`` plus the event type (``runlane.run.succeeded``), or
  ``runlane.step.completed`` for a durable step; the body is the event type, or ``step.completed``;
* severity is ``ERROR`` for ``run.failed``, ``WARN`` for ``run.retry_scheduled``, ``INFO`` otherwise;
* ``runlane.observation_id`` is the record's stable id: the stream is at least once, so a backend that
  must not count a record twice dedupes by it.

A run triggered with a W3C ``traceparent`` puts the log records of its events in that trace (trace and
span id of the caller), so a backend shows them beside the request that asked for the work. Every
run event observation of such a run carries its trace carrier. For step records, which carry none,
the trace context of recent runs is also kept in memory, bounded (``max_runs``); ``rollback()`` undoes
what the last ``feed()`` added to it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from opentelemetry._logs import LogRecord, SeverityNumber
from opentelemetry.context import Context
from opentelemetry.sdk._logs import ReadableLogRecord
from opentelemetry.sdk.resources import Resource
from opentelemetry.trace import INVALID_SPAN, NonRecordingSpan, set_span_in_context

from runlane.models import RunlaneObservationRecord
from runlane.vocabulary import RunEventType, RunlaneObservationType

from ._otel import ABSENT, SCOPE, nanos, observation_resource, parent_context, restore

__all__ = ["SEVERITIES", "ObservationLogs"]

SEVERITIES: dict[RunEventType, SeverityNumber] = {
    RunEventType.FAILED: SeverityNumber.ERROR,
    RunEventType.RETRY_SCHEDULED: SeverityNumber.WARN,
}
"""Event types logged above ``INFO``."""

_STEP = "step.completed"
# Pinned so that records built on a thread with an active span (an application's) never pick it up.
_NO_TRACE = set_span_in_context(INVALID_SPAN, Context())


class ObservationLogs:
    """Turns observation records, in stream order, into OpenTelemetry log records."""

    def __init__(self, *, resource: Resource | None = None, max_runs: int = 10_000) -> None:
        self.resource = resource if resource is not None else observation_resource()
        self.max_runs = max_runs
        self._traces: OrderedDict[tuple[str, str], Context] = OrderedDict()
        self._before: dict[tuple[str, str], Any] = {}  # what the last feed() changed, as it was

    def feed(self, records: Iterable[RunlaneObservationRecord]) -> list[ReadableLogRecord]:
        self._before = {}
        return [self._one(record) for record in records]

    def rollback(self) -> None:
        """Undo what the last ``feed()`` changed."""
        restore(self._traces, self._before)
        self._before = {}

    def _trace(self, record: RunlaneObservationRecord) -> Context:
        observation = record.observation
        key = (observation.environment.name, observation.run_id)
        parent = parent_context(observation.trace_carrier)
        if parent is not None:
            self._before.setdefault(key, self._traces.get(key, ABSENT))
            self._traces[key] = context = set_span_in_context(NonRecordingSpan(parent), Context())
            while len(self._traces) > self.max_runs:
                evicted, value = self._traces.popitem(last=False)
                self._before.setdefault(evicted, value)
            return context
        traced = self._traces.get(key)
        if traced is None:
            return _NO_TRACE
        self._traces.move_to_end(key)
        return traced

    def _one(self, record: RunlaneObservationRecord) -> ReadableLogRecord:
        observation = record.observation
        if observation.type is RunlaneObservationType.RUN_STEP:
            body = _STEP
            severity = SeverityNumber.INFO
        else:
            body = observation.event_type.value if observation.event_type is not None else observation.type.value
            severity = SEVERITIES.get(observation.event_type, SeverityNumber.INFO)  # type: ignore[arg-type]
        values: dict[str, Any] = {
            "runlane.observation_id": record.id,
            "runlane.stream_position": record.stream_position,
            "runlane.source_kind": record.source_kind.value,
            "runlane.source_id": record.source_id,
            "runlane.environment": observation.environment.name,
            "runlane.run_id": observation.run_id,
            "runlane.task_id": observation.task_id,
            "runlane.queue": observation.queue,
            "runlane.event_id": observation.event_id,
            "runlane.event_type": observation.event_type.value if observation.event_type is not None else None,
            "runlane.event_sequence": observation.event_sequence,
            "runlane.status": observation.status.value if observation.status is not None else None,
            "runlane.attempt": observation.attempt,
            "runlane.failure_code": observation.failure_code.value if observation.failure_code is not None else None,
            "runlane.step_key": observation.step_key,
            "runlane.step_token": observation.step_token,
        }
        return ReadableLogRecord(
            LogRecord(
                timestamp=nanos(observation.occurred_at),
                observed_timestamp=nanos(record.recorded_at),
                context=self._trace(record),
                severity_number=severity,
                severity_text=severity.name,
                body=body,
                attributes={name: value for name, value in values.items() if value is not None},
                event_name=f"runlane.{body}",
            ),
            resource=self.resource,
            instrumentation_scope=SCOPE,
        )
