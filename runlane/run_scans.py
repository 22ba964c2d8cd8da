"""Due-work predicates shared by the reducer, core scans and driver projections.

Each returns the time at which a run becomes eligible for one kind of work, or ``None`` when the
run is not a candidate at all. Callers compare the result with their own ``now``.
"""

from __future__ import annotations

from datetime import datetime

from .models import RunRecord
from .vocabulary import RunDispatchReservationCondition, RunStatus

__all__ = [
    "get_run_attempt_timeout_finalization_available_at",
    "get_run_cancellation_finalization_available_at",
    "get_run_delivery_recovery_available_at",
    "get_run_dispatch_available_at",
    "get_run_runnable_available_at",
    "is_run_dispatch_reservation",
    "is_run_runnable_at",
]


def get_run_runnable_available_at(run: RunRecord) -> datetime | None:
    """Queued runs at ``run_at or updated_at``; scheduled/retrying/released at ``run_at``; running at lease expiry."""
    status = run.status
    if status is RunStatus.QUEUED:
        return run.run_at or run.updated_at
    if status in (RunStatus.SCHEDULED, RunStatus.RETRYING, RunStatus.RELEASED):
        return run.run_at
    if status is RunStatus.RUNNING:
        return run.lease.expires_at if run.lease is not None else run.updated_at
    return None


def is_run_runnable_at(run: RunRecord, at: datetime) -> bool:
    available = get_run_runnable_available_at(run)
    return available is not None and available <= at


def get_run_delivery_recovery_available_at(run: RunRecord) -> datetime | None:
    """Due scheduled/released/retrying runs and expired-lease running runs; never queued runs."""
    status = run.status
    if status in (RunStatus.SCHEDULED, RunStatus.RETRYING, RunStatus.RELEASED):
        return run.run_at
    if status is RunStatus.RUNNING:
        return run.lease.expires_at if run.lease is not None else run.updated_at
    return None


def get_run_dispatch_available_at(run: RunRecord) -> datetime | None:
    """When a bounded queue's run may be dispatched (reserved, and its delivery requested): a queued run
    when due, or once the reservation it holds expires; other runs when delivery recovery is due."""
    if run.status is RunStatus.QUEUED:
        return run.dispatch_expires_at or get_run_runnable_available_at(run)
    return get_run_delivery_recovery_available_at(run)


def get_run_cancellation_finalization_available_at(run: RunRecord) -> datetime | None:
    if run.status is not RunStatus.CANCELLATION_REQUESTED:
        return None
    return run.lease.expires_at if run.lease is not None else run.updated_at


def get_run_attempt_timeout_finalization_available_at(run: RunRecord) -> datetime | None:
    """Only running runs whose current lease recorded ``run.started`` and that carry a fixed deadline."""
    if run.status is not RunStatus.RUNNING or run.attempt_deadline_at is None or run.lease is None:
        return None
    if run.started_at is None or run.started_at < run.lease.claimed_at:
        return None
    return run.attempt_deadline_at


def is_run_dispatch_reservation(run: RunRecord, at: datetime, condition: RunDispatchReservationCondition) -> bool:
    """Whether a queued run still owns (``ACTIVE``) or has lost (``EXPIRED``) a dispatch slot at ``at``."""
    if run.status is not RunStatus.QUEUED or run.dispatch_expires_at is None:
        return False
    if condition is RunDispatchReservationCondition.ACTIVE:
        return run.dispatch_expires_at > at
    return run.dispatch_expires_at <= at
