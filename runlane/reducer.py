"""The pure run reducer: ``project_run_events`` turns append-only run events into a ``RunRecord``.

This module is the only place run lifecycle rules live. Runtime code projects the events it is about
to append, and storage persists the supplied events together with the supplied projection without
re-deriving status, counters, leases, retries, releases or cancellation.

Error classes follow the Core Reducer contract:

* a stale ``expected_sequence`` is a lost race: retryable ``storage_conflict`` with kind
  ``event_sequence``, so the caller re-reads and projects again;
* everything else (a malformed sequence, no events, an event that is impossible for the run's
  status, lease, attempt, queue, run id or environment) is ``invariant_violation``: core, storage or
  persisted history is inconsistent and retrying cannot help.

Rules this module decides where the contract leaves room (each is repeated where it is enforced):

* A missing run with a non-zero ``expected_sequence`` is stale, not malformed (see
  ``_stale_sequence``).
* ``run.delivery_requested`` wakes a released run waiting on a signal or a run completion at any
  time, because the signal or the source run's terminal state *is* the wakeup; a time release only
  once ``resume_at`` is due (see ``_delivery_requested``).
* ``run.started`` needs a lease that has not expired at ``occurred_at`` (new user code must not
  start under a lease another worker may already be recovering). Heartbeats, attempt outcomes and
  ``run.cancellation_requested`` do not: they report or stop work that already started, and
  maintenance finalizes expired cancellation requests.
* ``run.cancelled`` may name the stopped attempt; when it does, it must be the current attempt.
* ``occurred_at`` may move backwards between events: events come from workers, operators and
  maintenance on different clocks, the contract's impossible-projection list names order, status,
  lease, attempt, queue, run id and environment but not time, and ``event_sequence`` is the order
  of record. ``updated_at`` is always the last event's ``occurred_at``.

Performance: this runs on every write path. Events are applied to one private ``dict`` of record
fields and the ``RunRecord`` is built once per call without re-validating fields that were already
validated when the current run and the events were constructed. Nested JSON values (payload,
output, meta, trace carriers) are shared with the events, not copied; records and events are
treated as immutable values, and storage makes its own defensive copies.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any, Final, TypeVar

from pydantic import BaseModel

from .defaults import contract_defaults
from .errors import ErrorCode, RunlaneError, StorageConflictKind, create_storage_conflict_error
from .models import (
    RunCancellationRequestedEvent,
    RunCancelledEvent,
    RunCounters,
    RunCreatedEvent,
    RunDeliveryRequestedEvent,
    RunEvent,
    RunFailedEvent,
    RunLeaseClaimedEvent,
    RunLeaseHeartbeatEvent,
    RunRecord,
    RunReleasedEvent,
    RunRetryScheduledEvent,
    RunStartedEvent,
    RunSucceededEvent,
    TimeWaitCondition,
    environment_key,
)
from .run_scans import get_run_delivery_recovery_available_at, get_run_runnable_available_at
from .vocabulary import RunStatus, RunWaitConditionType, run_status_values

__all__ = ["MAX_EVENT_SEQUENCE", "project_run_events"]

MAX_EVENT_SEQUENCE: Final = 2**53 - 1
"""The largest event sequence the contract allows (the largest integer every JSON reader keeps exact)."""

_State = dict[str, Any]
_Model = TypeVar("_Model", bound=BaseModel)

_QUEUED: Final = RunStatus.QUEUED
_SCHEDULED: Final = RunStatus.SCHEDULED
_RUNNING: Final = RunStatus.RUNNING
_RETRYING: Final = RunStatus.RETRYING
_RELEASED: Final = RunStatus.RELEASED
_CANCELLATION_REQUESTED: Final = RunStatus.CANCELLATION_REQUESTED

_NEW_SEQUENCE: Final = contract_defaults.run.new_event_sequence
_TERMINAL: Final = run_status_values.terminal
_ATTEMPT_OWNERS: Final = frozenset({_RUNNING, _CANCELLATION_REQUESTED})
_CANCELLABLE: Final = run_status_values.directly_cancellable | {_CANCELLATION_REQUESTED}
_EVENT_WAKEUP_WAITS: Final = frozenset({RunWaitConditionType.SIGNAL, RunWaitConditionType.RUN_COMPLETION})

# Fields every transition out of active execution clears (retry, release, terminal outcomes).
_LEAVE_EXECUTION: Final[_State] = {
    "lease": None,
    "attempt_deadline_at": None,
    "dispatched_at": None,
    "dispatch_expires_at": None,
}


class _Rejected(Exception):
    """Raised by a transition with the reason it is impossible; turned into ``invariant_violation``."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


# ---------------------------------------------------------------------------------------------
# Building records without re-validation


def _record_defaults() -> _State:
    values: _State = {}
    for name, field in RunRecord.model_fields.items():
        values[name] = None if field.is_required() else field.get_default(call_default_factory=True)
    return values


_RECORD_DEFAULTS: Final = _record_defaults()
_RECORD_FIELDS: Final = frozenset(RunRecord.model_fields)
_COUNTER_FIELDS: Final = frozenset(RunCounters.model_fields)
_ZERO_COUNTERS: Final = RunCounters()
_set_attribute = object.__setattr__


def _can_build_directly(model: type[BaseModel]) -> bool:
    # Building an instance directly is what ``model_construct`` and ``model_copy`` do internally,
    # minus per-field default handling. It stays valid only while the model has no private
    # attributes, no post-init hook and no extra fields; otherwise fall back to ``model_construct``.
    return (
        not model.__private_attributes__
        and model.__pydantic_post_init__ is None
        and model.model_config.get("extra") != "allow"
    )


_DIRECT_BUILD: Final = _can_build_directly(RunRecord) and _can_build_directly(RunCounters)


def _construct(model: type[_Model], values: dict[str, Any], fields: frozenset[str]) -> _Model:
    """An instance of ``model`` over ``values`` (which it then owns); every value is already validated."""
    if not _DIRECT_BUILD:  # pragma: no cover - guards a future model change
        return model.model_construct(_fields_set=set(fields), **values)
    instance = object.__new__(model)
    _set_attribute(instance, "__dict__", values)
    _set_attribute(instance, "__pydantic_fields_set__", set(fields))
    _set_attribute(instance, "__pydantic_extra__", None)
    _set_attribute(instance, "__pydantic_private__", None)
    return instance


def _build(state: _State) -> RunRecord:
    return _construct(RunRecord, state, _RECORD_FIELDS)


def _view(state: _State) -> RunRecord:
    """A short-lived read-only view of the state so the shared due-work predicates apply unchanged."""
    return _build(state)


def _counters(
    current: RunCounters, *, attempts: int = 0, failures: int = 0, retries: int = 0, releases: int = 0
) -> RunCounters:
    return _construct(
        RunCounters,
        {
            "attempts": current.attempts + attempts,
            "failures": current.failures + failures,
            "retries": current.retries + retries,
            "releases": current.releases + releases,
        },
        _COUNTER_FIELDS,
    )


# ---------------------------------------------------------------------------------------------
# Sequence contract


def _check_sequence_value(expected_sequence: object) -> None:
    # bool is an int subclass; True must not pass as sequence 1.
    if not isinstance(expected_sequence, int) or isinstance(expected_sequence, bool):
        raise RunlaneError(
            ErrorCode.INVARIANT_VIOLATION,
            f"expected_sequence must be a whole number, got {type(expected_sequence).__name__}.",
            meta={"expected_sequence": repr(expected_sequence)},
        )
    if expected_sequence < 0 or expected_sequence > MAX_EVENT_SEQUENCE:
        raise RunlaneError(
            ErrorCode.INVARIANT_VIOLATION,
            f"expected_sequence must be between 0 and {MAX_EVENT_SEQUENCE}, got {expected_sequence}.",
            meta={"expected_sequence": str(expected_sequence)},
        )


def _stale_sequence(current_run: RunRecord | None, expected_sequence: int) -> RunlaneError:
    # The contract compares expected_sequence with "the current run sequence", and
    # contract_defaults.run.new_event_sequence is that sequence while no run exists. So a missing run
    # with a non-zero expected_sequence is treated like any other mismatch: a stale read (for example
    # the run was pruned between the caller's scan and its read), which the spec classifies as a
    # lost race ("A stale sequence is a normal lost race"), not an impossible projection. Retrying
    # re-reads and finds the run missing, which is the honest answer for the caller. The reverse
    # case, an existing run with expected_sequence 0, is the losing side of a create race.
    if current_run is None:
        current_sequence = _NEW_SEQUENCE
        subject = "no run exists yet"
    else:
        current_sequence = current_run.event_sequence
        subject = f"run {current_run.id} is at {current_sequence}"
    meta: dict[str, Any] = {"expected_sequence": expected_sequence, "current_sequence": current_sequence}
    if current_run is not None:
        meta["run_id"] = current_run.id
    return create_storage_conflict_error(
        StorageConflictKind.EVENT_SEQUENCE,
        f"Stale event sequence: expected {expected_sequence} but {subject}; re-read the run and project again.",
        meta=meta,
    )


# ---------------------------------------------------------------------------------------------
# Transitions. Each mutates ``state`` in place or raises ``_Rejected`` with the reason.


def _created_state(event: RunCreatedEvent) -> _State:
    state = dict(_RECORD_DEFAULTS)
    state.update(
        id=event.run_id,
        environment=event.environment,
        task_id=event.task_id,
        queue=event.queue,
        status=_QUEUED,
        payload=event.payload,
        counters=_ZERO_COUNTERS,
        created_at=event.occurred_at,
        updated_at=event.occurred_at,
        run_at=event.run_at,
        concurrency_key=event.concurrency_key,
        idempotency_key=event.idempotency_key,
        singleton_key=event.singleton_key,
        source=event.source,
        trace_carrier=event.trace_carrier,
        meta=event.meta,
    )
    return state


def _created_again(state: _State, event: RunCreatedEvent) -> None:
    raise _Rejected("run.created is only valid as the first event of a run")


def _delivery_requested(state: _State, event: RunDeliveryRequestedEvent) -> None:
    status = state["status"]
    at = event.occurred_at
    if status is _QUEUED:
        # Queued runs already hold delivery intent; a fresh request refreshes it (for example a
        # bounded-queue dispatch reservation after the previous one expired).
        pass
    elif status is _RELEASED and state["wait"] is not None and state["wait"].type in _EVENT_WAKEUP_WAITS:
        # Signal and run-completion waits are woken by the event itself (signals.send(), a source
        # run reaching a terminal state, or a release whose source is already terminal), so they
        # are wakeable before any timeout: "send() appends run.delivery_requested to each
        # still-released run waiting on that signal". Their timeout only adds maintenance delivery.
        pass
    elif status in run_status_values.delivery_recovery_candidates:
        # Due scheduled/retrying/time-released runs and running runs whose lease has expired.
        available = get_run_delivery_recovery_available_at(_view(state))
        if available is None or available > at:
            if status is _RUNNING:
                raise _Rejected(f"its lease is active until {_iso(available)}; only an expired lease can be recovered")
            raise _Rejected(f"run_at {_iso(available)} is not due at {_iso(at)}")
    elif status is _CANCELLATION_REQUESTED:
        raise _Rejected("a cancellation-requested run is not runnable; finalize it with run.cancelled instead")
    else:  # pragma: no cover - terminal statuses are rejected before transitions run
        raise _Rejected("the run cannot be woken")

    delivery = event.delivery
    if delivery.run_id != state["id"]:
        raise _Rejected(f"delivery.run_id {delivery.run_id!r} does not match the run")
    if environment_key(delivery.environment) != environment_key(state["environment"]):
        raise _Rejected(f"delivery.environment {delivery.environment.name!r} does not match the run's environment")
    if delivery.queue != state["queue"]:
        raise _Rejected(f"delivery.queue {delivery.queue!r} does not match the run's queue {state['queue']!r}")

    available_at = delivery.available_at
    state["status"] = _SCHEDULED if available_at > at else _QUEUED
    state["run_at"] = available_at
    state["lease"] = None
    state["attempt_deadline_at"] = None
    state["wait"] = None
    if delivery.dispatch_expires_at is not None:
        state["dispatched_at"] = at
        state["dispatch_expires_at"] = delivery.dispatch_expires_at
    else:
        state["dispatched_at"] = None
        state["dispatch_expires_at"] = None
    if delivery.trace_carrier is not None:
        state["trace_carrier"] = delivery.trace_carrier
    elif event.trace_carrier is not None:
        state["trace_carrier"] = event.trace_carrier


def _lease_claimed(state: _State, event: RunLeaseClaimedEvent) -> None:
    status = state["status"]
    if status not in run_status_values.runnable_candidates:
        # Terminal runs never get here, so this is cancellation_requested: active but not runnable.
        raise _Rejected("a cancellation-requested run is not runnable")
    at = event.occurred_at
    available = get_run_runnable_available_at(_view(state))
    if available is None:
        raise _Rejected(
            "the run has no due time; a released signal or run-completion wait needs run.delivery_requested first"
        )
    if available > at:
        if status is _RUNNING:
            raise _Rejected(f"the current lease is active until {_iso(available)}")
        raise _Rejected(f"the run is not runnable until {_iso(available)} (claimed at {_iso(at)})")
    state["status"] = _RUNNING
    state["lease"] = event.lease
    state["attempt_deadline_at"] = event.attempt_deadline_at
    state["dispatched_at"] = None
    state["dispatch_expires_at"] = None
    state["wait"] = None


def _lease_heartbeat(state: _State, event: RunLeaseHeartbeatEvent) -> None:
    if state["status"] not in _ATTEMPT_OWNERS:
        raise _Rejected("only running or cancellation-requested runs hold a lease to extend")
    lease = state["lease"]
    if lease is None:
        raise _Rejected("the run has no current lease")
    if event.lease.token != lease.token or event.lease.worker_id != lease.worker_id:
        raise _Rejected("a heartbeat must use the current lease token and worker id")
    # Status, counters and the fixed attempt deadline stay as they are.
    state["lease"] = event.lease


def _started(state: _State, event: RunStartedEvent) -> None:
    if state["status"] is not _RUNNING:
        raise _Rejected("an attempt starts only on a running run")
    lease = state["lease"]
    if lease is None:
        raise _Rejected("the run has no active lease")
    if lease.expires_at <= event.occurred_at:
        # "The run must be running with an active lease": an expired lease is recoverable by
        # another worker, so starting user code under it could run the attempt twice.
        raise _Rejected(f"the lease expired at {_iso(lease.expires_at)}")
    counters = state["counters"]
    if event.attempt != counters.attempts + 1:
        raise _Rejected(f"attempt {event.attempt} must be the next attempt {counters.attempts + 1}")
    state["counters"] = _counters(counters, attempts=1)
    state["failure"] = None
    state["output"] = None
    state["has_output"] = False
    state["started_at"] = event.occurred_at


def _check_attempt_completion(state: _State, event: Any) -> RunCounters:
    if state["status"] not in _ATTEMPT_OWNERS:
        raise _Rejected("attempt outcomes need a running or cancellation-requested run")
    counters: RunCounters = state["counters"]
    if counters.attempts < 1:
        raise _Rejected("no attempt has started")
    if event.attempt != counters.attempts:
        raise _Rejected(f"attempt {event.attempt} is not the current attempt {counters.attempts}")
    return counters


def _succeeded(state: _State, event: RunSucceededEvent) -> None:
    _check_attempt_completion(state, event)
    state.update(_LEAVE_EXECUTION)
    state["status"] = RunStatus.SUCCEEDED
    state["failure"] = None
    state["wait"] = None
    state["finished_at"] = event.occurred_at
    # Void success leaves output absent; explicit JSON null stays visible as output None + has_output.
    state["has_output"] = event.has_output
    state["output"] = event.output if event.has_output else None


def _failed(state: _State, event: RunFailedEvent) -> None:
    counters = _check_attempt_completion(state, event)
    state.update(_LEAVE_EXECUTION)
    state["status"] = RunStatus.FAILED
    state["counters"] = _counters(counters, failures=1)
    state["failure"] = event.failure
    state["output"] = None
    state["has_output"] = False
    state["wait"] = None
    state["finished_at"] = event.occurred_at


def _retry_scheduled(state: _State, event: RunRetryScheduledEvent) -> None:
    counters = _check_attempt_completion(state, event)
    state.update(_LEAVE_EXECUTION)
    state["status"] = _RETRYING
    state["counters"] = _counters(counters, failures=1, retries=1)
    state["failure"] = event.failure
    state["output"] = None
    state["has_output"] = False
    state["wait"] = None
    state["run_at"] = event.retry_at


def _released(state: _State, event: RunReleasedEvent) -> None:
    counters = _check_attempt_completion(state, event)
    wait = event.wait
    if wait is None:
        # Time release: "Time releases must carry delay and resumeAt"; the wait is materialized here.
        if event.delay is None or event.resume_at is None:
            raise _Rejected("a time release must carry both delay and resume_at")
        state["wait"] = TimeWaitCondition(resume_at=event.resume_at)
        state["run_at"] = event.resume_at
    else:
        # Signal and run-completion releases "carry wait only"; the timeout is not duplicated.
        if event.delay is not None or event.resume_at is not None:
            raise _Rejected(f"a {wait.type.value} release carries its wait only, without delay or resume_at")
        state["wait"] = wait
        state["run_at"] = wait.timeout_at
    state.update(_LEAVE_EXECUTION)
    state["status"] = _RELEASED
    state["counters"] = _counters(counters, releases=1)
    state["failure"] = None
    state["output"] = None
    state["has_output"] = False


def _cancellation_requested(state: _State, event: RunCancellationRequestedEvent) -> None:
    status = state["status"]
    if status is _CANCELLATION_REQUESTED:
        raise _Rejected("cancellation was already requested")
    if status is not _RUNNING:
        raise _Rejected("cancellation is requested only for a running run; cancel waiting runs with run.cancelled")
    if state["lease"] is None:
        raise _Rejected("the run has no lease")
    # The lease (and any attempt deadline) stays so the owner can stop cooperatively.
    state["status"] = _CANCELLATION_REQUESTED


def _cancelled(state: _State, event: RunCancelledEvent) -> None:
    status = state["status"]
    if status not in _CANCELLABLE:
        if status is _RUNNING:
            raise _Rejected("a running run must first be moved to cancellation_requested")
        raise _Rejected("the run cannot be cancelled")  # pragma: no cover - terminals are rejected earlier
    if event.attempt is not None and event.attempt != state["counters"].attempts:
        raise _Rejected(f"attempt {event.attempt} is not the current attempt {state['counters'].attempts}")
    state.update(_LEAVE_EXECUTION)
    state["status"] = RunStatus.CANCELLED
    state["output"] = None
    state["has_output"] = False
    state["failure"] = None
    state["wait"] = None
    state["finished_at"] = event.occurred_at


_TRANSITIONS: Final[dict[type, Callable[[_State, Any], None]]] = {
    RunCreatedEvent: _created_again,
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


def _transition_for(event: object) -> Callable[[_State, Any], None] | None:
    """The transition for a subclass of an event model (exact classes are looked up directly)."""
    for event_type, candidate in _TRANSITIONS.items():
        if isinstance(event, event_type):
            return candidate
    return None


# ---------------------------------------------------------------------------------------------
# Public entry point


def project_run_events(current_run: RunRecord | None, expected_sequence: int, events: Sequence[RunEvent]) -> RunRecord:
    """Project ``events`` onto ``current_run`` (``None`` for a new run) and return the new ``RunRecord``.

    ``expected_sequence`` is ``contract_defaults.run.new_event_sequence`` when creating a run and the
    current ``event_sequence`` otherwise. The result has ``event_sequence = expected_sequence +
    len(events)`` and ``updated_at`` equal to the last event's ``occurred_at``. Pure: no I/O, the
    inputs are never changed, and the same inputs always give the same record.

    Raises ``RunlaneError``: ``storage_conflict`` (kind ``event_sequence``, retryable) for a stale
    ``expected_sequence``; ``invariant_violation`` for a malformed sequence, no events, or an event
    that is impossible for the run.
    """
    # Order: the sequence value, at least one event, staleness, then event rules. Staleness comes
    # before any event rule so a lost race is never reported as a projection bug. The inline tests
    # are the fast path; the helpers raise the precise error.
    if type(expected_sequence) is not int or not 0 <= expected_sequence <= MAX_EVENT_SEQUENCE:
        _check_sequence_value(expected_sequence)
    if not events:
        raise RunlaneError(
            ErrorCode.INVARIANT_VIOLATION,
            "project_run_events needs at least one event.",
            meta={"run_id": current_run.id} if current_run is not None else None,
        )
    if expected_sequence != (_NEW_SEQUENCE if current_run is None else current_run.event_sequence):
        raise _stale_sequence(current_run, expected_sequence)
    count = len(events)
    final_sequence = expected_sequence + count
    if final_sequence > MAX_EVENT_SEQUENCE:
        raise RunlaneError(
            ErrorCode.INVARIANT_VIOLATION,
            f"Projecting {count} events from sequence {expected_sequence} would exceed {MAX_EVENT_SEQUENCE}.",
            meta={"expected_sequence": expected_sequence, "events": count},
        )

    if current_run is None:
        first = events[0]
        if not isinstance(first, RunCreatedEvent):
            raise _invariant(None, first, 0, None, "run.created is the only valid first event of a new run")
        state = _created_state(first)
        start = 1
    else:
        state = dict(current_run.__dict__)
        start = 0

    run_id = state["id"]
    run_environment = state["environment"]
    environment = environment_key(run_environment)
    for index in range(start, count):
        event = events[index]
        transition = _TRANSITIONS.get(type(event)) or _transition_for(event)
        status = state["status"]
        if transition is None:
            raise _invariant(state, event, index, status, "it is not a run event")
        if event.run_id != run_id:
            raise _invariant(state, event, index, status, f"the event targets run {event.run_id!r}")
        if event.environment is not run_environment and environment_key(event.environment) != environment:
            why = f"the event targets environment {event.environment.name!r}, not {environment!r}"
            raise _invariant(state, event, index, status, why)
        if status in _TERMINAL:
            raise _invariant(
                state,
                event,
                index,
                status,
                "terminal runs accept no later lifecycle events; rerun or manual retry creates a new linked run",
            )
        try:
            transition(state, event)
        except _Rejected as rejected:
            raise _invariant(state, event, index, status, rejected.why) from None
        state["updated_at"] = event.occurred_at

    state["event_sequence"] = final_sequence
    return _build(state)


def _invariant(state: _State | None, event: object, index: int, status: RunStatus | None, why: str) -> RunlaneError:
    event_type = getattr(event, "type", None)
    type_name = getattr(event_type, "value", None) or type(event).__name__
    run_id = state["id"] if state is not None else getattr(event, "run_id", None)
    status_text = status.value if status is not None else "none (new run)"
    meta: dict[str, Any] = {"event_type": type_name, "event_index": index, "status": status_text}
    if isinstance(run_id, str):
        meta["run_id"] = run_id
    return RunlaneError(
        ErrorCode.INVARIANT_VIOLATION,
        f"Cannot apply {type_name} to run {run_id} in status {status_text} (event {index}): {why}.",
        meta=meta,
    )


def _iso(value: datetime | None) -> str:
    return value.isoformat() if value is not None else "none"
