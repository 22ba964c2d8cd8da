"""The pure run reducer: every Core Reducer rule as one table, plus lifecycle and purity checks."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from runlane import (
    Actor,
    ActorType,
    DeliveryIntent,
    Environment,
    ErrorCode,
    RunCancellationRequestedEvent,
    RunCancelledEvent,
    RunCompletionWaitCondition,
    RunCreatedEvent,
    RunDeliveryRequestedEvent,
    RunFailedEvent,
    RunFailure,
    RunlaneError,
    RunLease,
    RunLeaseClaimedEvent,
    RunLeaseHeartbeatEvent,
    RunRecord,
    RunReleasedEvent,
    RunRetryScheduledEvent,
    RunSource,
    RunSourceType,
    RunStartedEvent,
    RunStatus,
    RunSucceededEvent,
    SignalWaitCondition,
    StorageConflictKind,
    TimeWaitCondition,
    contract_defaults,
    get_storage_conflict_kind,
    project_run_events,
)
from runlane.reducer import MAX_EVENT_SEQUENCE

# ---------------------------------------------------------------------------------------------
# Event builders. Times are seconds after T0; leases last LEASE_SECONDS.

T0 = datetime(2026, 1, 1, tzinfo=UTC)
ENV = Environment(name="production")
OTHER_ENV = Environment(name="staging")
RUN_ID = "run_123"
QUEUE = "emails"
SYSTEM = contract_defaults.actor.system
WORKER = Actor(type=ActorType.WORKER, id="worker-1")
LEASE_SECONDS = 300
LATE = 1_000_000  # far past every due time and lease in the histories below
VOID = object()
FAILURE = RunFailure(code=ErrorCode.TASK_FAILED, message="Task failed.", retryable=True)
SOURCE = RunSource(type=RunSourceType.RERUN, source_run_id="run_parent")
CREATED_META = {"origin": "signup"}
CREATED_TRACE = {"traceparent": "00-created-01"}


def t(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def _base(at: float, **overrides: Any) -> dict[str, Any]:
    values: dict[str, Any] = {"run_id": RUN_ID, "environment": ENV, "occurred_at": t(at), "actor": SYSTEM}
    values.update(overrides)
    return values


def created(at: float = 0, **overrides: Any) -> RunCreatedEvent:
    values = {"task_id": "emails.send", "queue": QUEUE, "payload": {"user_id": "user_1"}}
    values.update(overrides)
    return RunCreatedEvent(**_base(at, **values))


def full_created(at: float = 0) -> RunCreatedEvent:
    return created(
        at,
        run_at=t(at),
        concurrency_key="tenant_1",
        idempotency_key="idem_1",
        singleton_key="single_1",
        source=SOURCE,
        trace_carrier=CREATED_TRACE,
        meta=CREATED_META,
    )


def delivery(
    at: float,
    available: float | None = None,
    *,
    dispatch_expires: float | None = None,
    delivery_trace: dict[str, str] | None = None,
    trace: dict[str, str] | None = None,
    queue: str = QUEUE,
    run_id: str = RUN_ID,
    environment: Environment = ENV,
    meta: dict[str, Any] | None = None,
) -> RunDeliveryRequestedEvent:
    intent = DeliveryIntent(
        environment=environment,
        run_id=run_id,
        queue=queue,
        requested_at=t(at),
        available_at=t(at if available is None else available),
        dispatch_expires_at=None if dispatch_expires is None else t(dispatch_expires),
        trace_carrier=delivery_trace,
    )
    return RunDeliveryRequestedEvent(**_base(at, delivery=intent, trace_carrier=trace, meta=meta))


def lease(at: float, token: str = "lease-1", worker: str = "worker-1", ttl: float = LEASE_SECONDS) -> RunLease:
    return RunLease(worker_id=worker, token=token, claimed_at=t(at), expires_at=t(at + ttl))


def claim(
    at: float, *, token: str = "lease-1", worker: str = "worker-1", deadline: float | None = None
) -> RunLeaseClaimedEvent:
    return RunLeaseClaimedEvent(
        **_base(
            at,
            actor=WORKER,
            lease=lease(at, token, worker),
            attempt_deadline_at=None if deadline is None else t(deadline),
        )
    )


def heartbeat(
    at: float, *, token: str = "lease-1", worker: str = "worker-1", since: float | None = None
) -> RunLeaseHeartbeatEvent:
    renewed = RunLease(
        worker_id=worker, token=token, claimed_at=t(at if since is None else since), expires_at=t(at + LEASE_SECONDS)
    )
    return RunLeaseHeartbeatEvent(**_base(at, actor=WORKER, lease=renewed))


def started(at: float, attempt: int) -> RunStartedEvent:
    return RunStartedEvent(**_base(at, actor=WORKER, attempt=attempt))


def succeeded(at: float, attempt: int, output: Any = VOID, **overrides: Any) -> RunSucceededEvent:
    if output is VOID:
        return RunSucceededEvent(**_base(at, actor=WORKER, attempt=attempt, **overrides))
    return RunSucceededEvent(**_base(at, actor=WORKER, attempt=attempt, output=output, has_output=True, **overrides))


def failed(at: float, attempt: int) -> RunFailedEvent:
    return RunFailedEvent(**_base(at, actor=WORKER, attempt=attempt, failure=FAILURE))


def retry(at: float, attempt: int, retry_at: float) -> RunRetryScheduledEvent:
    return RunRetryScheduledEvent(
        **_base(at, actor=WORKER, attempt=attempt, failure=FAILURE, delay="30s", retry_at=t(retry_at))
    )


def release_time(at: float, attempt: int, resume_at: float | None, delay: str | None = "5m") -> RunReleasedEvent:
    return RunReleasedEvent(
        **_base(at, actor=WORKER, attempt=attempt, delay=delay, resume_at=None if resume_at is None else t(resume_at))
    )


def signal_wait(timeout: float | None = None) -> SignalWaitCondition:
    return SignalWaitCondition(signal_key="report_ready", timeout_at=None if timeout is None else t(timeout))


def run_wait(timeout: float | None = None) -> RunCompletionWaitCondition:
    return RunCompletionWaitCondition(run_id="run_source", timeout_at=None if timeout is None else t(timeout))


def release_wait(at: float, attempt: int, wait: Any, **overrides: Any) -> RunReleasedEvent:
    return RunReleasedEvent(**_base(at, actor=WORKER, attempt=attempt, wait=wait, reason="waiting", **overrides))


def cancel_request(at: float) -> RunCancellationRequestedEvent:
    return RunCancellationRequestedEvent(
        **_base(at, actor=contract_defaults.actor.operator, reason="operator_requested")
    )


def cancelled(at: float, attempt: int | None = None) -> RunCancelledEvent:
    return RunCancelledEvent(
        **_base(at, actor=contract_defaults.actor.operator, reason="operator_requested", attempt=attempt)
    )


# ---------------------------------------------------------------------------------------------
# Starting states: named histories projected from scratch (each step is itself a table row below).

_QUEUED = [full_created(0), delivery(0)]
_CLAIMED = [*_QUEUED, claim(10, deadline=200)]
_RUNNING = [*_CLAIMED, started(11, 1)]

HISTORIES: dict[str, list[Any]] = {
    "new": [],
    "created": [created(0)],
    "created_future": [created(0, run_at=t(100))],
    "queued": _QUEUED,
    "reserved": [full_created(0), delivery(0, dispatch_expires=60)],
    "scheduled": [full_created(0), delivery(0, available=100)],
    "claimed": _CLAIMED,
    "running": _RUNNING,
    "cancellation_requested": [*_RUNNING, cancel_request(20)],
    "retrying": [*_RUNNING, retry(30, 1, retry_at=100)],
    "released_time": [*_RUNNING, release_time(30, 1, resume_at=100)],
    "released_signal": [*_RUNNING, release_wait(30, 1, signal_wait(timeout=100))],
    "released_signal_no_timeout": [*_RUNNING, release_wait(30, 1, signal_wait())],
    "released_run": [*_RUNNING, release_wait(30, 1, run_wait(timeout=100))],
    "succeeded": [*_RUNNING, succeeded(40, 1, {"ok": True})],
    "failed": [*_RUNNING, failed(40, 1)],
    "cancelled": [*_QUEUED, cancelled(40)],
}

# One representative history per status, for the status x event matrix.
STATUS_HISTORY = {
    RunStatus.QUEUED: "queued",
    RunStatus.SCHEDULED: "scheduled",
    RunStatus.RUNNING: "running",
    RunStatus.CANCELLATION_REQUESTED: "cancellation_requested",
    RunStatus.RETRYING: "retrying",
    RunStatus.RELEASED: "released_time",
    RunStatus.SUCCEEDED: "succeeded",
    RunStatus.FAILED: "failed",
    RunStatus.CANCELLED: "cancelled",
}

_STATE_CACHE: dict[str, RunRecord | None] = {}


def state(name: str) -> RunRecord | None:
    if name not in _STATE_CACHE:
        history = HISTORIES[name]
        _STATE_CACHE[name] = project_run_events(None, 0, history) if history else None
    return _STATE_CACHE[name]


def sequence_of(run: RunRecord | None) -> int:
    return run.event_sequence if run is not None else contract_defaults.run.new_event_sequence


def custom(name: str, **changes: Any) -> Callable[[], RunRecord]:
    """A named history with fields swapped in (for states no reachable history produces)."""

    def build() -> RunRecord:
        run = state(name)
        assert run is not None
        return run.model_copy(update=changes)

    return build


# ---------------------------------------------------------------------------------------------
# The table


@dataclass(frozen=True)
class Rejects:
    code: ErrorCode = ErrorCode.INVARIANT_VIOLATION
    contains: Sequence[str] = ()
    conflict: StorageConflictKind | None = None


@dataclass(frozen=True)
class Case:
    name: str
    start: str | Callable[[], RunRecord | None]
    events: Sequence[Any] | Callable[[RunRecord | None], Sequence[Any]]
    expect: dict[str, Any] | Rejects
    sequence: Any = field(default=VOID)  # overrides expected_sequence when set


def counters(attempts: int = 0, failures: int = 0, retries: int = 0, releases: int = 0) -> tuple[int, int, int, int]:
    return (attempts, failures, retries, releases)


CLEARED_EXECUTION = {"lease": None, "attempt_deadline_at": None, "dispatched_at": None, "dispatch_expires_at": None}

CASES: list[Case] = [
    # --- run.created ------------------------------------------------------------------------
    Case(
        "created copies identity and creation fields",
        "new",
        [full_created(0)],
        {
            "id": RUN_ID,
            "environment": ENV,
            "task_id": "emails.send",
            "queue": QUEUE,
            "payload": {"user_id": "user_1"},
            "run_at": t(0),
            "concurrency_key": "tenant_1",
            "idempotency_key": "idem_1",
            "singleton_key": "single_1",
            "source": SOURCE,
            "trace_carrier": CREATED_TRACE,
            "meta": CREATED_META,
            "created_at": t(0),
            "updated_at": t(0),
            "status": RunStatus.QUEUED,
            "counters": counters(),
            "event_sequence": 1,
            "lease": None,
            "wait": None,
            "failure": None,
            "has_output": False,
            "output": None,
            "started_at": None,
            "finished_at": None,
        },
    ),
    Case(
        "created with a future run_at is still queued",
        "new",
        [created(0, run_at=t(100))],
        {"status": RunStatus.QUEUED, "run_at": t(100)},
    ),
    Case(
        "created without run_at leaves it unset",
        "new",
        [created(5)],
        {"run_at": None, "created_at": t(5), "updated_at": t(5)},
    ),
    Case(
        "created then delivery in one call",
        "new",
        [created(0), delivery(0)],
        {"status": RunStatus.QUEUED, "event_sequence": 2, "run_at": t(0)},
    ),
    Case(
        "created then lease claim in one call (inline execution)",
        "new",
        [created(0), claim(0, deadline=60), started(0, 1)],
        {
            "status": RunStatus.RUNNING,
            "lease": lease(0),
            "attempt_deadline_at": t(60),
            "counters": counters(1),
            "event_sequence": 3,
        },
    ),
    # --- run.delivery_requested -------------------------------------------------------------
    Case(
        "delivery on a queued run keeps it queued",
        "created",
        [delivery(5)],
        {
            "status": RunStatus.QUEUED,
            "run_at": t(5),
            "dispatched_at": None,
            "dispatch_expires_at": None,
            "updated_at": t(5),
        },
    ),
    Case("delivery available now is queued", "created", [delivery(5, available=5)], {"status": RunStatus.QUEUED}),
    Case(
        "delivery available later is scheduled",
        "created",
        [delivery(5, available=6)],
        {"status": RunStatus.SCHEDULED, "run_at": t(6)},
    ),
    Case(
        "delivery available earlier is queued",
        "created",
        [delivery(5, available=1)],
        {"status": RunStatus.QUEUED, "run_at": t(1)},
    ),
    Case(
        "delivery on a queued run before its run_at",
        "created_future",
        [delivery(5, available=100)],
        {"status": RunStatus.SCHEDULED},
    ),
    Case(
        "delivery wakes a due scheduled run",
        "scheduled",
        [delivery(100)],
        {"status": RunStatus.QUEUED, "run_at": t(100)},
    ),
    Case(
        "delivery wakes a due retrying run and keeps its failure",
        "retrying",
        [delivery(150)],
        {"status": RunStatus.QUEUED, "run_at": t(150), "failure": FAILURE, "counters": counters(1, 1, 1)},
    ),
    Case(
        "delivery wakes a due time-released run and clears its wait",
        "released_time",
        [delivery(100)],
        {"status": RunStatus.QUEUED, "wait": None, "run_at": t(100), "counters": counters(1, releases=1)},
    ),
    Case(
        "signal delivery wakes a signal wait before its timeout",
        "released_signal",
        [delivery(50)],
        {"status": RunStatus.QUEUED, "wait": None, "run_at": t(50)},
    ),
    Case(
        "signal delivery wakes a signal wait without timeout",
        "released_signal_no_timeout",
        [delivery(50)],
        {"status": RunStatus.QUEUED, "wait": None},
    ),
    Case(
        "timeout delivery wakes a signal wait once due",
        "released_signal",
        [delivery(100)],
        {"status": RunStatus.QUEUED, "wait": None},
    ),
    Case(
        "completion delivery wakes a run-completion wait before its timeout",
        "released_run",
        [delivery(50)],
        {"status": RunStatus.QUEUED, "wait": None},
    ),
    Case(
        "release and immediate resume in one call (source already terminal)",
        "running",
        [release_wait(30, 1, run_wait()), delivery(30)],
        {"status": RunStatus.QUEUED, "wait": None, "counters": counters(1, releases=1), "run_at": t(30)},
    ),
    Case(
        "delivery recovers a running run whose lease expired",
        "running",
        [delivery(10 + LEASE_SECONDS)],
        {"status": RunStatus.QUEUED, **CLEARED_EXECUTION, "counters": counters(1), "started_at": t(11)},
    ),
    Case(
        "delivery with dispatch_expires_at records the reservation",
        "created",
        [delivery(5, dispatch_expires=65)],
        {"status": RunStatus.QUEUED, "dispatched_at": t(5), "dispatch_expires_at": t(65)},
    ),
    Case(
        "unbounded delivery clears an earlier reservation",
        "reserved",
        [delivery(70)],
        {"dispatched_at": None, "dispatch_expires_at": None},
    ),
    Case(
        "a fresh reservation replaces an expired one",
        "reserved",
        [delivery(70, dispatch_expires=130)],
        {"dispatched_at": t(70), "dispatch_expires_at": t(130)},
    ),
    Case(
        "trace carrier: delivery carrier wins",
        "created",
        [delivery(5, delivery_trace={"traceparent": "delivery"}, trace={"traceparent": "event"})],
        {"trace_carrier": {"traceparent": "delivery"}},
    ),
    Case(
        "trace carrier: event carrier when delivery has none",
        "created",
        [delivery(5, trace={"traceparent": "event"})],
        {"trace_carrier": {"traceparent": "event"}},
    ),
    Case(
        "trace carrier: current kept when neither carries one",
        "queued",
        [delivery(5)],
        {"trace_carrier": CREATED_TRACE},
    ),
    Case(
        "trace carrier: only delivery refreshes it",
        "queued",
        [claim(10).model_copy(update={"trace_carrier": {"traceparent": "claim"}})],
        {"trace_carrier": CREATED_TRACE},
    ),
    # --- run.lease_claimed ------------------------------------------------------------------
    Case(
        "claim moves a queued run to running",
        "reserved",
        [claim(10, deadline=200)],
        {
            "status": RunStatus.RUNNING,
            "lease": lease(10),
            "attempt_deadline_at": t(200),
            "dispatched_at": None,
            "dispatch_expires_at": None,
            "wait": None,
            "counters": counters(),
        },
    ),
    Case(
        "claim without attempt deadline",
        "queued",
        [claim(10)],
        {"status": RunStatus.RUNNING, "attempt_deadline_at": None},
    ),
    Case("claim a queued run at its run_at", "queued", [claim(0)], {"status": RunStatus.RUNNING}),
    Case("claim a queued run without run_at at updated_at", "created", [claim(0)], {"status": RunStatus.RUNNING}),
    Case(
        "claim a queued run once its created run_at is due",
        "created_future",
        [claim(100)],
        {"status": RunStatus.RUNNING},
    ),
    Case("claim a due scheduled run", "scheduled", [claim(100)], {"status": RunStatus.RUNNING, "run_at": t(100)}),
    Case("claim a due retrying run", "retrying", [claim(100)], {"status": RunStatus.RUNNING, "failure": FAILURE}),
    Case(
        "claim a due time-released run clears the wait",
        "released_time",
        [claim(100)],
        {"status": RunStatus.RUNNING, "wait": None},
    ),
    Case(
        "claim a signal wait once its timeout is due",
        "released_signal",
        [claim(100)],
        {"status": RunStatus.RUNNING, "wait": None},
    ),
    Case(
        "claim a running run whose lease expired",
        "running",
        [claim(10 + LEASE_SECONDS, token="lease-2", worker="worker-2")],
        {
            "status": RunStatus.RUNNING,
            "lease": lease(10 + LEASE_SECONDS, "lease-2", "worker-2"),
            "attempt_deadline_at": None,
            "counters": counters(1),
        },
    ),
    # --- run.lease_heartbeat ----------------------------------------------------------------
    Case(
        "heartbeat replaces the lease and keeps everything else",
        "running",
        [heartbeat(100, since=10)],
        {
            "status": RunStatus.RUNNING,
            "lease": RunLease(
                worker_id="worker-1", token="lease-1", claimed_at=t(10), expires_at=t(100 + LEASE_SECONDS)
            ),
            "attempt_deadline_at": t(200),
            "counters": counters(1),
            "started_at": t(11),
            "updated_at": t(100),
        },
    ),
    Case(
        "heartbeat on a cancellation-requested run keeps the status",
        "cancellation_requested",
        [heartbeat(100)],
        {"status": RunStatus.CANCELLATION_REQUESTED, "lease": lease(100), "attempt_deadline_at": t(200)},
    ),
    Case(
        "heartbeat after the lease expired but before another claim",
        "running",
        [heartbeat(LATE)],
        {"lease": lease(LATE)},
    ),
    # --- run.started ------------------------------------------------------------------------
    Case(
        "started begins attempt 1",
        "claimed",
        [started(11, 1)],
        {
            "counters": counters(1),
            "started_at": t(11),
            "status": RunStatus.RUNNING,
            "lease": lease(10),
            "failure": None,
        },
    ),
    Case(
        "started after retry clears the previous failure",
        "retrying",
        [delivery(100), claim(101), started(102, 2)],
        {"counters": counters(2, 1, 1), "failure": None, "started_at": t(102)},
    ),
    Case(
        "started clears stale output",
        custom("running", output={"stale": True}, has_output=True),
        [started(12, 2)],
        {"output": None, "has_output": False, "counters": counters(2)},
    ),
    Case(
        "started attempt 2 after reclaiming an expired lease",
        "running",
        [claim(400, token="lease-2"), started(401, 2)],
        {"counters": counters(2), "started_at": t(401)},
    ),
    # --- run.succeeded ----------------------------------------------------------------------
    Case(
        "succeeded with object output",
        "running",
        [succeeded(40, 1, {"email_id": "em_1"})],
        {
            "status": RunStatus.SUCCEEDED,
            "output": {"email_id": "em_1"},
            "has_output": True,
            "finished_at": t(40),
            "failure": None,
            "counters": counters(1),
            **CLEARED_EXECUTION,
        },
    ),
    Case(
        "succeeded with explicit null output", "running", [succeeded(40, 1, None)], {"output": None, "has_output": True}
    ),
    Case("succeeded with falsy output", "running", [succeeded(40, 1, 0)], {"output": 0, "has_output": True}),
    Case(
        "void success has no output",
        "running",
        [succeeded(40, 1)],
        {"output": None, "has_output": False, "status": RunStatus.SUCCEEDED},
    ),
    Case(
        "succeeded from cancellation_requested (the reducer accepts it; core chooses cancelled)",
        "cancellation_requested",
        [succeeded(40, 1)],
        {"status": RunStatus.SUCCEEDED, "lease": None},
    ),
    # --- run.failed -------------------------------------------------------------------------
    Case(
        "failed stores the failure and finishes",
        "running",
        [failed(40, 1)],
        {
            "status": RunStatus.FAILED,
            "failure": FAILURE,
            "counters": counters(1, 1),
            "finished_at": t(40),
            "output": None,
            "has_output": False,
            **CLEARED_EXECUTION,
        },
    ),
    Case(
        "failed from cancellation_requested",
        "cancellation_requested",
        [failed(40, 1)],
        {"status": RunStatus.FAILED, "lease": None},
    ),
    # --- run.retry_scheduled ----------------------------------------------------------------
    Case(
        "retry_scheduled counts failure pressure and sets run_at",
        "running",
        [retry(40, 1, retry_at=70)],
        {
            "status": RunStatus.RETRYING,
            "failure": FAILURE,
            "counters": counters(1, 1, 1),
            "run_at": t(70),
            "finished_at": None,
            "has_output": False,
            **CLEARED_EXECUTION,
        },
    ),
    Case(
        "retry_scheduled from cancellation_requested",
        "cancellation_requested",
        [retry(40, 1, 70)],
        {"status": RunStatus.RETRYING},
    ),
    # --- run.released -----------------------------------------------------------------------
    Case(
        "time release materializes a time wait",
        "running",
        [release_time(40, 1, resume_at=340)],
        {
            "status": RunStatus.RELEASED,
            "wait": TimeWaitCondition(resume_at=t(340)),
            "run_at": t(340),
            "counters": counters(1, releases=1),
            "failure": None,
            "finished_at": None,
            "has_output": False,
            **CLEARED_EXECUTION,
        },
    ),
    Case(
        "signal release with timeout",
        "running",
        [release_wait(40, 1, signal_wait(timeout=3640))],
        {
            "status": RunStatus.RELEASED,
            "wait": signal_wait(timeout=3640),
            "run_at": t(3640),
            "counters": counters(1, releases=1),
        },
    ),
    Case(
        "signal release without timeout has no run_at",
        "running",
        [release_wait(40, 1, signal_wait())],
        {"wait": signal_wait(), "run_at": None},
    ),
    Case(
        "run-completion release with timeout",
        "running",
        [release_wait(40, 1, run_wait(timeout=90))],
        {"wait": run_wait(timeout=90), "run_at": t(90)},
    ),
    Case(
        "run-completion release without timeout",
        "running",
        [release_wait(40, 1, run_wait())],
        {"wait": run_wait(), "run_at": None},
    ),
    Case(
        "release from cancellation_requested (a waiting outcome)",
        "cancellation_requested",
        [release_time(40, 1, resume_at=100)],
        {"status": RunStatus.RELEASED, "lease": None},
    ),
    # --- run.cancellation_requested ---------------------------------------------------------
    Case(
        "cancellation request keeps the lease and deadline",
        "running",
        [cancel_request(20)],
        {
            "status": RunStatus.CANCELLATION_REQUESTED,
            "lease": lease(10),
            "attempt_deadline_at": t(200),
            "counters": counters(1),
        },
    ),
    Case(
        "cancellation request before the attempt started",
        "claimed",
        [cancel_request(10)],
        {"status": RunStatus.CANCELLATION_REQUESTED},
    ),
    Case(
        "cancellation request on an expired lease",
        "running",
        [cancel_request(LATE)],
        {"status": RunStatus.CANCELLATION_REQUESTED},
    ),
    # --- run.cancelled ----------------------------------------------------------------------
    Case(
        "cancel a queued run",
        "reserved",
        [cancelled(40)],
        {"status": RunStatus.CANCELLED, "finished_at": t(40), **CLEARED_EXECUTION},
    ),
    Case("cancel a scheduled run", "scheduled", [cancelled(40)], {"status": RunStatus.CANCELLED}),
    Case(
        "cancel a retrying run clears the failure",
        "retrying",
        [cancelled(40)],
        {"status": RunStatus.CANCELLED, "failure": None, "counters": counters(1, 1, 1)},
    ),
    Case(
        "cancel a released run clears the wait",
        "released_signal",
        [cancelled(40)],
        {"status": RunStatus.CANCELLED, "wait": None},
    ),
    Case(
        "cancel a cancellation-requested run clears the lease",
        "cancellation_requested",
        [cancelled(40, attempt=1)],
        {
            "status": RunStatus.CANCELLED,
            "finished_at": t(40),
            "output": None,
            "has_output": False,
            "failure": None,
            **CLEARED_EXECUTION,
        },
    ),
    Case(
        "cancel clears stale output and failure",
        custom("cancellation_requested", output=None, has_output=True, failure=FAILURE),
        [cancelled(40)],
        {"has_output": False, "failure": None},
    ),
    # --- field rules ------------------------------------------------------------------------
    Case(
        "meta and source are never rewritten by later events",
        "queued",
        [delivery(5, meta={"later": True}), claim(6).model_copy(update={"meta": {"claim": 1}}), started(7, 1)],
        {"meta": CREATED_META, "source": SOURCE},
    ),
    Case(
        "event_sequence is expected plus the number of events",
        "running",
        [heartbeat(12), heartbeat(13), heartbeat(14)],
        {"event_sequence": 7},
    ),
    Case(
        "updated_at is the last event's occurred_at", "running", [heartbeat(12), heartbeat(50)], {"updated_at": t(50)}
    ),
    Case("occurred_at may move backwards between events", "running", [heartbeat(5)], {"updated_at": t(5)}),
    Case("created_at is never rewritten", "running", [succeeded(40, 1)], {"created_at": t(0)}),
    # --- sequence contract ------------------------------------------------------------------
    Case(
        "stale sequence (behind)",
        "queued",
        [delivery(5)],
        Rejects(ErrorCode.STORAGE_CONFLICT, conflict=StorageConflictKind.EVENT_SEQUENCE),
        sequence=1,
    ),
    Case(
        "stale sequence (ahead)",
        "queued",
        [delivery(5)],
        Rejects(ErrorCode.STORAGE_CONFLICT, conflict=StorageConflictKind.EVENT_SEQUENCE),
        sequence=3,
    ),
    Case(
        "create race: the run already exists",
        "queued",
        [full_created(0)],
        Rejects(ErrorCode.STORAGE_CONFLICT, conflict=StorageConflictKind.EVENT_SEQUENCE),
        sequence=0,
    ),
    Case(
        "missing run with a non-zero sequence is stale",
        "new",
        [delivery(5)],
        Rejects(ErrorCode.STORAGE_CONFLICT, conflict=StorageConflictKind.EVENT_SEQUENCE),
        sequence=4,
    ),
    Case(
        "stale beats an impossible event", "succeeded", [delivery(5)], Rejects(ErrorCode.STORAGE_CONFLICT), sequence=1
    ),
    Case("negative sequence", "new", [created(0)], Rejects(contains=["expected_sequence"]), sequence=-1),
    Case("float sequence", "new", [created(0)], Rejects(contains=["whole number"]), sequence=0.0),
    Case("string sequence", "new", [created(0)], Rejects(), sequence="0"),
    Case("bool sequence", "created", [delivery(0)], Rejects(contains=["bool"]), sequence=True),
    Case("None sequence", "new", [created(0)], Rejects(), sequence=None),
    Case(
        "unsafe sequence",
        "new",
        [created(0)],
        Rejects(contains=[str(MAX_EVENT_SEQUENCE)]),
        sequence=MAX_EVENT_SEQUENCE + 1,
    ),
    Case("invalid sequence beats empty events", "new", [], Rejects(contains=["expected_sequence"]), sequence=-1),
    Case(
        "final sequence past the safe range",
        custom("queued", event_sequence=MAX_EVENT_SEQUENCE),
        [delivery(5)],
        Rejects(contains=["exceed"]),
    ),
    Case(
        "sequence at the safe limit",
        custom("queued", event_sequence=MAX_EVENT_SEQUENCE - 1),
        [delivery(5)],
        {"event_sequence": MAX_EVENT_SEQUENCE},
    ),
    Case("empty events for a new run", "new", [], Rejects(contains=["at least one event"])),
    Case("empty events for an existing run", "queued", (), Rejects(contains=["at least one event"])),
    Case("empty events beat a stale sequence", "queued", [], Rejects(ErrorCode.INVARIANT_VIOLATION), sequence=1),
    # --- event order, identity -----------------------------------------------------------------
    Case(
        "a new run must start with run.created",
        "new",
        [delivery(0)],
        Rejects(contains=["run.delivery_requested", "only valid first event"]),
    ),
    Case(
        "run.created twice in one call",
        "new",
        [created(0), created(0)],
        Rejects(contains=["run.created", "first event"]),
    ),
    Case(
        "run.created after other events in one call",
        "new",
        [created(0), delivery(0), created(1)],
        Rejects(contains=["first event"]),
    ),
    Case(
        "event for another run",
        "queued",
        [delivery(5).model_copy(update={"run_id": "run_other"})],
        Rejects(contains=["run_other"]),
    ),
    Case(
        "event for another environment",
        "queued",
        [delivery(5).model_copy(update={"environment": OTHER_ENV})],
        Rejects(contains=["staging"]),
    ),
    Case(
        "later event in a new-run batch for another run",
        "new",
        [created(0), delivery(0).model_copy(update={"run_id": "run_x"})],
        Rejects(),
    ),
    Case("not a run event", "queued", [lease(5)], Rejects(contains=["not a run event"])),
    Case(
        "rejection names the failing index",
        "queued",
        [claim(10), started(11, 1), started(12, 1)],
        Rejects(contains=["event 2", "run.started"]),
    ),
    # --- run.delivery_requested rejections -----------------------------------------------------
    Case(
        "delivery queue mismatch",
        "queued",
        [delivery(5, queue="other")],
        Rejects(contains=["delivery.queue", "'other'"]),
    ),
    Case(
        "delivery run id mismatch", "queued", [delivery(5, run_id="run_other")], Rejects(contains=["delivery.run_id"])
    ),
    Case(
        "delivery environment mismatch",
        "queued",
        [delivery(5, environment=OTHER_ENV)],
        Rejects(contains=["delivery.environment"]),
    ),
    Case(
        "delivery before a scheduled run is due",
        "scheduled",
        [delivery(99)],
        Rejects(contains=["not due", "scheduled"]),
    ),
    Case("delivery before a retry is due", "retrying", [delivery(99)], Rejects(contains=["not due", "retrying"])),
    Case(
        "delivery before a time release is due",
        "released_time",
        [delivery(99)],
        Rejects(contains=["not due", "released"]),
    ),
    Case(
        "delivery while the lease is active",
        "running",
        [delivery(10 + LEASE_SECONDS - 1)],
        Rejects(contains=["lease is active"]),
    ),
    Case(
        "delivery to a claimed run with an active lease",
        "claimed",
        [delivery(20)],
        Rejects(contains=["lease is active"]),
    ),
    Case(
        "delivery to a cancellation-requested run",
        "cancellation_requested",
        [delivery(LATE)],
        Rejects(contains=["not runnable"]),
    ),
    # --- run.lease_claimed rejections ----------------------------------------------------------
    Case(
        "claim a queued run before its run_at", "created_future", [claim(99)], Rejects(contains=["not runnable until"])
    ),
    Case("claim a queued run before its updated_at", "queued", [claim(-1)], Rejects(contains=["not runnable until"])),
    Case("claim a scheduled run before due", "scheduled", [claim(99)], Rejects(contains=["not runnable until"])),
    Case("claim a retrying run before due", "retrying", [claim(99)], Rejects(contains=["not runnable until"])),
    Case(
        "claim a time-released run before due", "released_time", [claim(99)], Rejects(contains=["not runnable until"])
    ),
    Case(
        "claim a signal wait before its timeout",
        "released_signal",
        [claim(99)],
        Rejects(contains=["not runnable until"]),
    ),
    Case(
        "claim a signal wait without timeout",
        "released_signal_no_timeout",
        [claim(LATE)],
        Rejects(contains=["no due time"]),
    ),
    Case(
        "claim a running run with an unexpired lease",
        "running",
        [claim(10 + LEASE_SECONDS - 1, token="lease-2")],
        Rejects(contains=["lease is active"]),
    ),
    Case(
        "claim a cancellation-requested run",
        "cancellation_requested",
        [claim(LATE)],
        Rejects(contains=["not runnable"]),
    ),
    # --- run.lease_heartbeat rejections --------------------------------------------------------
    Case(
        "heartbeat with the wrong token",
        "running",
        [heartbeat(100, token="lease-9")],
        Rejects(contains=["token and worker id"]),
    ),
    Case(
        "heartbeat with the wrong worker",
        "running",
        [heartbeat(100, worker="worker-9")],
        Rejects(contains=["token and worker id"]),
    ),
    Case(
        "heartbeat on a run without a lease",
        custom("running", lease=None),
        [heartbeat(100)],
        Rejects(contains=["no current lease"]),
    ),
    # --- run.started rejections ----------------------------------------------------------------
    Case("started skipping an attempt number", "claimed", [started(11, 2)], Rejects(contains=["next attempt 1"])),
    Case("started repeating the current attempt", "running", [started(12, 1)], Rejects(contains=["next attempt 2"])),
    Case(
        "started after the lease expired",
        "claimed",
        [started(10 + LEASE_SECONDS, 1)],
        Rejects(contains=["lease expired"]),
    ),
    Case(
        "started without a lease",
        custom("claimed", lease=None),
        [started(11, 1)],
        Rejects(contains=["no active lease"]),
    ),
    Case(
        "started on a cancellation-requested run",
        "cancellation_requested",
        [started(21, 2)],
        Rejects(contains=["cancellation_requested"]),
    ),
    # --- attempt completion rejections ---------------------------------------------------------
    Case("succeeded with the wrong attempt", "running", [succeeded(40, 2)], Rejects(contains=["current attempt 1"])),
    Case("failed with the wrong attempt", "running", [failed(40, 2)], Rejects(contains=["current attempt 1"])),
    Case("retry with the wrong attempt", "running", [retry(40, 2, 70)], Rejects(contains=["current attempt 1"])),
    Case(
        "release with the wrong attempt", "running", [release_time(40, 2, 100)], Rejects(contains=["current attempt 1"])
    ),
    Case(
        "succeeded before any attempt started",
        "claimed",
        [succeeded(40, 1)],
        Rejects(contains=["no attempt has started"]),
    ),
    Case("failed before any attempt started", "claimed", [failed(40, 1)], Rejects(contains=["no attempt has started"])),
    Case(
        "retry before any attempt started", "claimed", [retry(40, 1, 70)], Rejects(contains=["no attempt has started"])
    ),
    Case(
        "release before any attempt started",
        "claimed",
        [release_time(40, 1, 100)],
        Rejects(contains=["no attempt has started"]),
    ),
    Case(
        "time release without delay",
        "running",
        [release_time(40, 1, resume_at=100, delay=None)],
        Rejects(contains=["delay and resume_at"]),
    ),
    Case(
        "time release without resume_at",
        "running",
        [release_time(40, 1, resume_at=None)],
        Rejects(contains=["delay and resume_at"]),
    ),
    Case(
        "time release with neither",
        "running",
        [release_time(40, 1, resume_at=None, delay=None)],
        Rejects(contains=["delay and resume_at"]),
    ),
    Case(
        "signal release with resume_at",
        "running",
        [release_wait(40, 1, signal_wait(timeout=100), resume_at=t(100))],
        Rejects(contains=["signal release carries its wait only"]),
    ),
    Case(
        "signal release with delay",
        "running",
        [release_wait(40, 1, signal_wait(), delay="5m")],
        Rejects(contains=["wait only"]),
    ),
    Case(
        "run-completion release with resume_at",
        "running",
        [release_wait(40, 1, run_wait(), resume_at=t(100))],
        Rejects(contains=["run_completion release carries its wait only"]),
    ),
    # --- cancellation rejections ---------------------------------------------------------------
    Case(
        "direct cancel of a running run",
        "running",
        [cancelled(40, attempt=1)],
        Rejects(contains=["run.cancelled", "running", "cancellation_requested"]),
    ),
    Case("direct cancel of a claimed run", "claimed", [cancelled(40)], Rejects(contains=["cancellation_requested"])),
    Case(
        "cancellation requested twice",
        "cancellation_requested",
        [cancel_request(21)],
        Rejects(contains=["already requested"]),
    ),
    Case("cancellation request on a waiting run", "queued", [cancel_request(5)], Rejects(contains=["run.cancelled"])),
    Case(
        "cancellation request without a lease",
        custom("running", lease=None),
        [cancel_request(20)],
        Rejects(contains=["no lease"]),
    ),
    Case(
        "cancelled naming another attempt",
        "cancellation_requested",
        [cancelled(40, attempt=2)],
        Rejects(contains=["current attempt 1"]),
    ),
    Case(
        "cancelled naming an attempt of a run that never started",
        "queued",
        [cancelled(40, attempt=1)],
        Rejects(contains=["current attempt 0"]),
    ),
]


class _Sequence(int):
    """An int subclass (such as a driver's own integer type) is still a whole number."""


class _TaggedHeartbeat(RunLeaseHeartbeatEvent):
    """Subclasses of the event models follow their base event's rules."""


CASES += [
    Case("int subclass sequence", "queued", [delivery(5)], {"event_sequence": 3}, sequence=_Sequence(2)),
    Case(
        "event model subclass",
        "running",
        [_TaggedHeartbeat(**heartbeat(100).model_dump())],
        {"lease": lease(100), "updated_at": t(100)},
    ),
    Case("a new run must start with a run event", "new", [lease(0)], Rejects(contains=["RunLease", "first event"])),
]


# ---------------------------------------------------------------------------------------------
# Status x event matrix: every event type from every status where the status makes it impossible.
# Events happen LATE so no time or lease condition is what rejects them.


def _late_event(kind: str, run: RunRecord) -> Any:
    attempts = run.counters.attempts
    current = max(attempts, 1)
    return {
        "created": lambda: created(LATE),
        "delivery_requested": lambda: delivery(LATE),
        "lease_claimed": lambda: claim(LATE, token="lease-late"),
        "lease_heartbeat": lambda: heartbeat(LATE),
        "started": lambda: started(LATE, attempts + 1),
        "succeeded": lambda: succeeded(LATE, current),
        "failed": lambda: failed(LATE, current),
        "retry_scheduled": lambda: retry(LATE, current, LATE + 30),
        "released": lambda: release_time(LATE, current, LATE + 30),
        "cancellation_requested": lambda: cancel_request(LATE),
        "cancelled": lambda: cancelled(LATE),
    }[kind]()


_RUNNABLE = {RunStatus.QUEUED, RunStatus.SCHEDULED, RunStatus.RETRYING, RunStatus.RELEASED, RunStatus.RUNNING}
_OWNED = {RunStatus.RUNNING, RunStatus.CANCELLATION_REQUESTED}
ALLOWED_STATUSES: dict[str, set[RunStatus]] = {
    "created": set(),
    "delivery_requested": _RUNNABLE,
    "lease_claimed": _RUNNABLE,
    "lease_heartbeat": _OWNED,
    "started": {RunStatus.RUNNING},
    "succeeded": _OWNED,
    "failed": _OWNED,
    "retry_scheduled": _OWNED,
    "released": _OWNED,
    "cancellation_requested": {RunStatus.RUNNING},
    "cancelled": {
        RunStatus.QUEUED,
        RunStatus.SCHEDULED,
        RunStatus.RETRYING,
        RunStatus.RELEASED,
        RunStatus.CANCELLATION_REQUESTED,
    },
}

for _kind, _allowed in ALLOWED_STATUSES.items():
    for _status, _history in STATUS_HISTORY.items():
        if _status in _allowed:
            continue
        _run = state(_history)
        assert _run is not None
        _event = _late_event(_kind, _run)
        CASES.append(
            Case(
                f"matrix: run.{_kind} rejected from {_status.value}",
                _history,
                [_event],
                Rejects(contains=[_event.type.value, f"status {_status.value}"]),
            )
        )
    # The same event can never open a new run, except run.created itself.
    if _kind != "created":
        _event = _late_event(_kind, state("running"))  # type: ignore[arg-type]
        CASES.append(
            Case(f"matrix: run.{_kind} cannot open a new run", "new", [_event], Rejects(contains=["first event"]))
        )


def _start(case: Case) -> RunRecord | None:
    return state(case.start) if isinstance(case.start, str) else case.start()


def _counter_tuple(value: Any) -> tuple[int, int, int, int]:
    return (value.attempts, value.failures, value.retries, value.releases)


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_reducer_table(case: Case) -> None:
    current = _start(case)
    events = case.events(current) if callable(case.events) else case.events
    sequence = sequence_of(current) if case.sequence is VOID else case.sequence
    before = current.model_dump() if current is not None else None

    if isinstance(case.expect, Rejects):
        with pytest.raises(RunlaneError) as raised:
            project_run_events(current, sequence, events)
        error = raised.value
        assert error.code is case.expect.code, error.message
        assert error.retryable is (case.expect.code is ErrorCode.STORAGE_CONFLICT)
        if case.expect.code is ErrorCode.STORAGE_CONFLICT:
            assert get_storage_conflict_kind(error) is StorageConflictKind.EVENT_SEQUENCE
        for fragment in case.expect.contains:
            assert fragment in error.message, error.message
    else:
        result = project_run_events(current, sequence, events)
        for name, expected in case.expect.items():
            actual = getattr(result, name)
            if name == "counters":
                actual = _counter_tuple(actual)
            assert actual == expected, f"{name}: {actual!r} != {expected!r}"
        if "event_sequence" not in case.expect:
            assert result.event_sequence == sequence + len(events)
        if "updated_at" not in case.expect:
            assert result.updated_at == events[-1].occurred_at
        _assert_valid_record(result)
        assert result is not current
        if current is not None:
            assert result.__dict__ is not current.__dict__

    if current is not None:
        assert current.model_dump() == before, "the reducer must not change its input"


def _assert_valid_record(run: RunRecord) -> None:
    """The unvalidated build must equal what full validation produces, and keep the record's invariants."""
    assert RunRecord.model_validate(run.model_dump()) == run
    assert RunRecord.model_validate_json(run.model_dump_json()) == run
    if run.status not in {RunStatus.RUNNING, RunStatus.CANCELLATION_REQUESTED}:
        assert run.lease is None and run.attempt_deadline_at is None
    if run.status is not RunStatus.RELEASED:
        assert run.wait is None
    if run.status is not RunStatus.SUCCEEDED:
        assert run.has_output is False and run.output is None
    if run.status in {RunStatus.RELEASED, RunStatus.CANCELLED, RunStatus.SUCCEEDED}:
        assert run.failure is None
    if run.status in {RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED}:
        assert run.finished_at is not None
    else:
        assert run.finished_at is None
    if run.status is not RunStatus.QUEUED:
        assert run.dispatched_at is None and run.dispatch_expires_at is None


# ---------------------------------------------------------------------------------------------
# Output visibility in the JSON shape


def test_void_success_omits_output_and_null_output_stays_visible() -> None:
    running = state("running")
    void = project_run_events(running, 4, [succeeded(40, 1)])
    null = project_run_events(running, 4, [succeeded(40, 1, None)])
    obj = project_run_events(running, 4, [succeeded(40, 1, {"a": [1, 2]})])
    assert "output" not in void.to_json() and "output" not in void.model_dump()
    assert null.to_json()["output"] is None and null.model_dump()["output"] is None
    assert obj.to_json()["output"] == {"a": [1, 2]}


def test_stale_sequence_error_shape() -> None:
    queued = state("queued")
    with pytest.raises(RunlaneError) as raised:
        project_run_events(queued, 1, [delivery(5)])
    error = raised.value
    assert error.code is ErrorCode.STORAGE_CONFLICT and error.retryable
    assert error.meta == {
        "expected_sequence": 1,
        "current_sequence": 2,
        "run_id": RUN_ID,
        "storage_conflict_kind": "event_sequence",
    }


def test_invariant_error_meta_names_event_and_status() -> None:
    with pytest.raises(RunlaneError) as raised:
        project_run_events(state("running"), 4, [cancelled(40, attempt=1)])
    assert raised.value.meta == {"event_type": "run.cancelled", "event_index": 0, "status": "running", "run_id": RUN_ID}
    assert not raised.value.retryable


# ---------------------------------------------------------------------------------------------
# Whole lifecycles: one call == event by event == any split


HAPPY_PATH = [
    full_created(0),
    delivery(0),
    claim(1, deadline=100),
    started(2, 1),
    heartbeat(30, since=1),
    succeeded(40, 1, {"email_id": "em_42"}),
]

LONG_PATH = [
    full_created(0),
    delivery(0, available=50),  # scheduled
    delivery(50, dispatch_expires=110),  # due: queued with a bounded-queue reservation
    claim(51, deadline=150),
    started(52, 1),
    retry(60, 1, retry_at=90),
    delivery(90),
    claim(91, token="lease-2"),
    started(92, 2),
    release_wait(100, 2, signal_wait(timeout=4000)),
    delivery(200, trace={"traceparent": "signal"}),
    claim(201, token="lease-3", worker="worker-2"),
    started(202, 3),
    heartbeat(250, token="lease-3", worker="worker-2", since=201),
    release_time(260, 3, resume_at=400),
    delivery(400),
    claim(401, token="lease-4"),
    started(402, 4),
    cancel_request(410),
    heartbeat(420, token="lease-4", since=401),
    cancelled(430, attempt=4),
]


def _one_by_one(events: Sequence[Any]) -> RunRecord:
    run: RunRecord | None = None
    for event in events:
        run = project_run_events(run, sequence_of(run), [event])
    assert run is not None
    return run


@pytest.mark.parametrize("events", [HAPPY_PATH, LONG_PATH], ids=["happy_path", "long_path"])
def test_lifecycle_batch_equals_event_by_event(events: list[Any]) -> None:
    batch = project_run_events(None, 0, events)
    assert _one_by_one(events) == batch
    assert batch.event_sequence == len(events)
    _assert_valid_record(batch)
    rng = random.Random(7)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(events)), k=min(3, len(events) - 1)))
        run: RunRecord | None = None
        for low, high in zip([0, *cuts], [*cuts, len(events)], strict=True):
            run = project_run_events(run, sequence_of(run), events[low:high])
        assert run == batch


def test_happy_path_fields() -> None:
    run = project_run_events(None, 0, HAPPY_PATH)
    assert run.status is RunStatus.SUCCEEDED
    assert _counter_tuple(run.counters) == counters(1)
    assert (run.output, run.has_output) == ({"email_id": "em_42"}, True)
    assert (run.started_at, run.finished_at, run.updated_at, run.run_at) == (t(2), t(40), t(40), t(0))
    assert run.lease is None and run.attempt_deadline_at is None
    assert run.meta == CREATED_META and run.trace_carrier == CREATED_TRACE


def test_long_path_fields() -> None:
    run = project_run_events(None, 0, LONG_PATH)
    assert run.status is RunStatus.CANCELLED
    assert _counter_tuple(run.counters) == counters(4, 1, 1, 2)
    assert run.trace_carrier == {"traceparent": "signal"}
    assert run.failure is None and run.wait is None and run.finished_at == t(430)


def test_intermediate_states_of_long_path() -> None:
    statuses = []
    run: RunRecord | None = None
    for event in LONG_PATH:
        run = project_run_events(run, sequence_of(run), [event])
        statuses.append(run.status)
    assert statuses == [
        RunStatus.QUEUED,
        RunStatus.SCHEDULED,
        RunStatus.QUEUED,
        RunStatus.RUNNING,
        RunStatus.RUNNING,
        RunStatus.RETRYING,
        RunStatus.QUEUED,
        RunStatus.RUNNING,
        RunStatus.RUNNING,
        RunStatus.RELEASED,
        RunStatus.QUEUED,
        RunStatus.RUNNING,
        RunStatus.RUNNING,
        RunStatus.RUNNING,
        RunStatus.RELEASED,
        RunStatus.QUEUED,
        RunStatus.RUNNING,
        RunStatus.RUNNING,
        RunStatus.CANCELLATION_REQUESTED,
        RunStatus.CANCELLATION_REQUESTED,
        RunStatus.CANCELLED,
    ]


def test_reducer_accepts_any_sequence_type() -> None:
    assert project_run_events(None, 0, tuple(HAPPY_PATH)) == project_run_events(None, 0, HAPPY_PATH)


def test_projection_is_deterministic() -> None:
    assert project_run_events(None, 0, LONG_PATH) == project_run_events(None, 0, LONG_PATH)


# ---------------------------------------------------------------------------------------------
# Random walks through valid transitions: batch and incremental projection always agree.


def _valid_next(run: RunRecord, now: float, rng: random.Random, token: list[int]) -> list[Any]:
    status = run.status
    attempts = run.counters.attempts
    options: list[Callable[[], Any]] = []
    at = now
    if status in {RunStatus.QUEUED, RunStatus.SCHEDULED, RunStatus.RETRYING, RunStatus.RELEASED}:
        wake = max(at, (run.run_at - T0).total_seconds() if run.run_at else at)
        options.append(lambda: delivery(wake, available=wake + rng.choice([0, 0, 5])))
        options.append(lambda: cancelled(wake))
        if status is not RunStatus.RELEASED or run.run_at is not None:
            token[0] += 1
            options.append(lambda: claim(wake, token=f"lease-{token[0]}", deadline=wake + 100))
    if status in {RunStatus.RUNNING, RunStatus.CANCELLATION_REQUESTED}:
        assert run.lease is not None
        lease_token = run.lease.token
        options.append(lambda: heartbeat(at, token=lease_token))
        if attempts >= 1:
            options.append(lambda: succeeded(at, attempts, rng.choice([VOID, None, {"n": attempts}])))
            options.append(lambda: failed(at, attempts))
            options.append(lambda: retry(at, attempts, at + 10))
            options.append(lambda: release_time(at, attempts, at + 10))
            options.append(lambda: release_wait(at, attempts, signal_wait(timeout=rng.choice([None, at + 10]))))
        if status is RunStatus.RUNNING:
            options.append(lambda: started(at, attempts + 1))
            options.append(lambda: cancel_request(at))
        else:
            options.append(lambda: cancelled(at, attempt=attempts or None))
    return [rng.choice(options)()]


@pytest.mark.parametrize("seed", range(40))
def test_random_walk_batch_equals_incremental(seed: int) -> None:
    rng = random.Random(seed)
    events: list[Any] = [full_created(0), delivery(0)]
    run = project_run_events(None, 0, events)
    now = 0.0
    token = [0]
    while run.status not in {RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED} and len(events) < 60:
        now += 1
        (event,) = _valid_next(run, now, rng, token)
        now = max(now, (event.occurred_at - T0).total_seconds())
        run = project_run_events(run, run.event_sequence, [event])
        _assert_valid_record(run)
        events.append(event)
    assert project_run_events(None, 0, events) == run
    assert run.event_sequence == len(events)
