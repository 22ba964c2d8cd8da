"""``AttemptSpans``: observation records in, finished OpenTelemetry spans out.

A span covers one attempt: it starts at the attempt's ``run.started`` and ends at the event that
ended the attempt. Its parent is the ``traceparent`` the run was triggered with (the observation of
``run.created`` carries it), so the attempt shows up under the request or job that triggered it;
without one, every attempt of a run shares a trace derived from the run id. Steps completed during
the attempt are span events.

Ids are derived, not random: the trace id from the run (when no parent gives one), the span id from
the id of the record that ended the attempt. A batch exported twice (the stream is at least once)
yields the same spans, which tracing backends store once.

State is kept in memory between batches, bounded (``max_runs``): the trace context of recent runs, and
the start and steps of open attempts; ``rollback()`` undoes what the last ``feed()`` changed (its batch
was not accepted and comes again). An exporter that restarts while an attempt is open still emits its
span, starting at its end (``runlane.start_unknown`` is set) and without the steps it missed.

An attempt that ends with no outcome (its worker crashed, was killed or lost the lease) records no event
of its own: its span (``runlane.outcome`` ``abandoned``, an error) ends at the ``run.delivery_requested`` or
``run.lease_claimed`` that made the run due or claimed it again, the moment Runlane knew it had ended
(``runlane.end_unknown`` is set), as ``runs.attempts()`` counts it.

``runlane.queue_wait_ms`` is how long an attempt waited between the ``run.delivery_requested`` that
made it due and its start, when the exporter saw both. An attempt made due without one (a polling
worker claiming a due retry) has none: the previous request's time would count the attempt before it.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.trace import SpanContext, SpanKind, TraceFlags
from opentelemetry.trace.status import Status, StatusCode

from runlane.models import RunlaneObservation, RunlaneObservationRecord
from runlane.vocabulary import RunEventType, RunlaneObservationType

from ._otel import ABSENT, SCOPE, nanos, observation_resource, parent_context, restore

__all__ = ["ATTEMPT_ENDS", "AttemptSpans"]

ATTEMPT_ENDS: dict[RunEventType, str] = {
    RunEventType.SUCCEEDED: "succeeded",
    RunEventType.FAILED: "failed",
    RunEventType.RETRY_SCHEDULED: "retry_scheduled",
    RunEventType.RELEASED: "released",
    RunEventType.CANCELLED: "cancelled",
}
"""The events that end an attempt, and the ``runlane.outcome`` each gives its span."""

ABANDONED = "abandoned"
"""The ``runlane.outcome`` of an attempt that ended with no outcome: its worker crashed, was killed or lost
the lease, and the run was made due again (``run.delivery_requested``) or claimed anew (``run.lease_claimed``)."""

_ERROR_OUTCOMES = frozenset({"failed", "retry_scheduled", ABANDONED})
# The events that end, with no outcome, an attempt still open: the run is due or claimed again.
_TAKEN_OVER = frozenset({RunEventType.DELIVERY_REQUESTED, RunEventType.LEASE_CLAIMED})


@dataclass(slots=True)
class _Run:
    parent: SpanContext | None = None
    requested_at: datetime | None = None
    open_attempts: dict[int, _Attempt] = field(default_factory=dict)


@dataclass(slots=True)
class _Attempt:
    started_at: datetime
    requested_at: datetime | None = None
    steps: list[tuple[str, datetime]] = field(default_factory=list)


def _copy(run: _Run) -> _Run:
    attempts = {n: _Attempt(a.started_at, a.requested_at, list(a.steps)) for n, a in run.open_attempts.items()}
    return _Run(run.parent, run.requested_at, attempts)



def _derived(size: int, *parts: str) -> int:
    digest = hashlib.sha256("\x1f".join(parts).encode("utf-8")).digest()
    return int.from_bytes(digest[:size], "big") or 1  # an all-zero id is invalid


class AttemptSpans:
    """Turns observation records, in stream order, into the spans of the attempts they end."""

    def __init__(self, *, resource: Resource | None = None, max_runs: int = 10_000) -> None:
        self.resource = resource if resource is not None else observation_resource()
        self.max_runs = max_runs
        self._runs: OrderedDict[tuple[str, str], _Run] = OrderedDict()
        self._before: dict[tuple[str, str], Any] = {}  # what the last feed() changed, as it was before

    def feed(self, records: Iterable[RunlaneObservationRecord]) -> list[ReadableSpan]:
        """The spans of the attempts ``records`` end (records that end nothing only update the state)."""
        self._before = {}
        spans: list[ReadableSpan] = []
        for record in records:
            spans.extend(self._one(record))
        return spans

    def rollback(self) -> None:
        """Undo what the last ``feed()`` changed."""
        restore(self._runs, self._before)
        self._before = {}

    def _run(self, observation: RunlaneObservation) -> _Run:
        key = (observation.environment.name, observation.run_id)
        run = self._runs.get(key)
        if key not in self._before:
            self._before[key] = ABSENT if run is None else _copy(run)
        if run is None:
            run = self._runs[key] = _Run()
            while len(self._runs) > self.max_runs:
                evicted, value = self._runs.popitem(last=False)
                self._before.setdefault(evicted, value)
        else:
            self._runs.move_to_end(key)
        return run

    def _one(self, record: RunlaneObservationRecord) -> list[ReadableSpan]:
        observation = record.observation
        run = self._run(observation)
        if observation.type is RunlaneObservationType.RUN_STEP:
            attempt = run.open_attempts.get(observation.attempt or 0)
            if attempt is not None and observation.step_key is not None:
                attempt.steps.append((observation.step_key, observation.occurred_at))
            return []
        if observation.trace_carrier and run.parent is None:
            run.parent = parent_context(observation.trace_carrier)
        ended: list[ReadableSpan] = []
        if observation.event_type in _TAKEN_OVER and run.open_attempts:
            # The run is due or claimed again while an attempt is open: that attempt ended with no outcome
            # (its worker crashed or lost the lease), as ``runs.attempts()`` counts it, and nothing the run
            # records later (a cancellation of the run queued again) is an outcome of it.
            for open_number in sorted(run.open_attempts):
                attempt = run.open_attempts.pop(open_number)
                ended.append(self._span(record, run, open_number, attempt, ABANDONED, end_unknown=True))
        if observation.event_type is RunEventType.DELIVERY_REQUESTED:
            run.requested_at = observation.occurred_at
            return ended
        if observation.event_type is RunEventType.STARTED and observation.attempt is not None:
            run.open_attempts[observation.attempt] = _Attempt(observation.occurred_at, run.requested_at)
            run.requested_at = None  # the next attempt waits from the next request, if there is one
            return ended
        outcome = ATTEMPT_ENDS.get(observation.event_type) if observation.event_type is not None else None
        if outcome is None:
            return ended
        number = observation.attempt
        if number is None:  # a cancellation finalized by maintenance: the attempt still open, if any
            if not run.open_attempts:
                return ended
            number = max(run.open_attempts)
        return [*ended, self._span(record, run, number, run.open_attempts.pop(number, None), outcome)]

    def _span(
        self,
        record: RunlaneObservationRecord,
        run: _Run,
        number: int,
        attempt: _Attempt | None,
        outcome: str,
        *,
        end_unknown: bool = False,
    ) -> ReadableSpan:
        """The span of attempt ``number``, ended by ``record`` (with ``end_unknown``: found ended by it)."""
        observation = record.observation
        environment = observation.environment.name
        trace_id = run.parent.trace_id if run.parent is not None else _derived(16, environment, observation.run_id)
        # One record can end several attempts with no outcome (an exporter that missed their ends): each
        # gets its own span id, still derived from the record, so a batch sent again yields the same spans.
        parts = (environment, record.id, str(number)) if end_unknown else (environment, record.id)
        context = SpanContext(
            trace_id, _derived(8, *parts), is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED)
        )
        attributes: dict[str, Any] = {
            "runlane.environment": environment,
            "runlane.run_id": observation.run_id,
            "runlane.task_id": observation.task_id or "",
            "runlane.queue": observation.queue or "",
            "runlane.attempt": number,
            "runlane.outcome": outcome,
            "messaging.system": "runlane",
            "messaging.operation.type": "process",
            "messaging.destination.name": observation.queue or "",
        }
        if observation.failure_code is not None:
            attributes["runlane.failure_code"] = observation.failure_code.value
        if end_unknown:
            attributes["runlane.end_unknown"] = True
        if attempt is None:
            attributes["runlane.start_unknown"] = True
        elif attempt.requested_at is not None:
            waited = attempt.started_at - attempt.requested_at
            attributes["runlane.queue_wait_ms"] = max(0, round(waited.total_seconds() * 1000))
        end = nanos(observation.occurred_at)
        start = nanos(attempt.started_at) if attempt is not None else end
        if outcome in _ERROR_OUTCOMES:
            status = Status(StatusCode.ERROR, observation.failure_code.value if observation.failure_code else outcome)
        elif outcome == "succeeded":
            status = Status(StatusCode.OK)
        else:
            status = Status(StatusCode.UNSET)
        events: Sequence[Event] = [
            Event("runlane.step", {"runlane.step_key": key}, timestamp=nanos(at))
            for key, at in (attempt.steps if attempt is not None else ())
        ]
        return ReadableSpan(
            name=observation.task_id or "runlane.attempt",
            context=context,
            parent=run.parent,
            resource=self.resource,
            attributes=attributes,
            events=events,
            kind=SpanKind.CONSUMER,
            status=status,
            start_time=start,
            end_time=max(end, start),
            instrumentation_scope=SCOPE,
        )
