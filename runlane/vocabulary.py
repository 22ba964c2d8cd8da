"""Every enum of the persisted vocabulary. Values are the exact strings stored and exchanged."""

from __future__ import annotations

import enum
from typing import Literal

__all__ = [
    "ActorType",
    "ExecuteDeliveryIgnoredReason",
    "ExecuteDeliveryStatus",
    "LaneDeliveryMode",
    "OutboxMessageStatus",
    "PaginationCursorKind",
    "RetryBackoffType",
    "RunAttemptStatus",
    "RunDispatchReservationCondition",
    "RunEventSortField",
    "RunEventType",
    "RunSortField",
    "RunSourceType",
    "RunStatus",
    "RunStatusClassification",
    "RunWaitConditionType",
    "RunlaneObservationExporterTickStatus",
    "RunlaneObservationSourceKind",
    "RunlaneObservationType",
    "ScheduleOccurrenceStatus",
    "ScheduleType",
    "SortDirection",
    "TaskReleaseType",
    "TriggerDispatchMode",
    "TriggerOutcomeType",
    "WakeupPublishOutcomeType",
    "WorkerMode",
    "DurationUnit",
    "RunEventSortFieldName",
    "RunEventTypeName",
    "RunSortFieldName",
    "RunStatusName",
    "SortDirectionName",
    "TriggerDispatchModeName",
    "WorkerModeName",
    "run_status_values",
]


class RunStatus(enum.StrEnum):
    CANCELLATION_REQUESTED = "cancellation_requested"
    CANCELLED = "cancelled"
    FAILED = "failed"
    QUEUED = "queued"
    RELEASED = "released"
    RETRYING = "retrying"
    RUNNING = "running"
    SCHEDULED = "scheduled"
    SUCCEEDED = "succeeded"


class RunStatusClassification(enum.StrEnum):
    ACTIVE = "active"
    TERMINAL = "terminal"


class RunEventType(enum.StrEnum):
    CANCELLATION_REQUESTED = "run.cancellation_requested"
    CANCELLED = "run.cancelled"
    CREATED = "run.created"
    DELIVERY_REQUESTED = "run.delivery_requested"
    FAILED = "run.failed"
    LEASE_CLAIMED = "run.lease_claimed"
    LEASE_HEARTBEAT = "run.lease_heartbeat"
    RELEASED = "run.released"
    RETRY_SCHEDULED = "run.retry_scheduled"
    STARTED = "run.started"
    SUCCEEDED = "run.succeeded"


class RunSourceType(enum.StrEnum):
    MANUAL_RETRY = "manual_retry"
    RERUN = "rerun"
    SCHEDULE = "schedule"
    TRIGGER = "trigger"


class RunWaitConditionType(enum.StrEnum):
    RUN_COMPLETION = "run_completion"
    SIGNAL = "signal"
    TIME = "time"


class RunAttemptStatus(enum.StrEnum):
    CANCELLED = "cancelled"
    FAILED = "failed"
    RELEASED = "released"
    RETRYING = "retrying"
    RUNNING = "running"
    SUCCEEDED = "succeeded"


class RunDispatchReservationCondition(enum.StrEnum):
    ACTIVE = "active"
    EXPIRED = "expired"


class TriggerOutcomeType(enum.StrEnum):
    CREATED = "created"
    RETURNED_EXISTING = "returned_existing"


class ActorType(enum.StrEnum):
    OPERATOR = "operator"
    SCHEDULE = "schedule"
    SYSTEM = "system"
    WORKER = "worker"


class RetryBackoffType(enum.StrEnum):
    EXPONENTIAL = "exponential"
    FIXED = "fixed"


class TaskReleaseType(enum.StrEnum):
    RELEASE = "task_release"


class ScheduleType(enum.StrEnum):
    CRON = "cron"
    INTERVAL = "interval"
    ONCE = "once"


class ScheduleOccurrenceStatus(enum.StrEnum):
    CLAIMED = "claimed"
    COMPLETED = "completed"


class DurationUnit(enum.StrEnum):
    DAY = "d"
    HOUR = "h"
    MILLISECOND = "ms"
    MINUTE = "m"
    SECOND = "s"


class LaneDeliveryMode(enum.StrEnum):
    STORAGE_POLLING = "storage_polling"
    TRANSPORT = "transport"


class OutboxMessageStatus(enum.StrEnum):
    CLAIMED = "claimed"
    DEAD_LETTERED = "dead_lettered"
    FAILED = "failed"
    PENDING = "pending"
    PUBLISHED = "published"


class TriggerDispatchMode(enum.StrEnum):
    EAGER = "eager"
    DEFERRED = "deferred"


class WakeupPublishOutcomeType(enum.StrEnum):
    FAILED = "failed"
    PUBLISHED = "published"


class WorkerMode(enum.StrEnum):
    DRAIN = "drain"
    POLL = "poll"


class ExecuteDeliveryStatus(enum.StrEnum):
    EXECUTED = "executed"
    IGNORED = "ignored"


class ExecuteDeliveryIgnoredReason(enum.StrEnum):
    ABANDONED = "abandoned"
    ALREADY_LEASED = "already_leased"
    CLAIM_LOST = "claim_lost"
    NOT_DUE = "not_due"
    RUN_NOT_FOUND = "run_not_found"
    TERMINAL = "terminal"
    WRONG_QUEUE = "wrong_queue"


class SortDirection(enum.StrEnum):
    ASC = "asc"
    DESC = "desc"


class RunSortField(enum.StrEnum):
    CREATED_AT = "created_at"
    RUN_AT = "run_at"
    UPDATED_AT = "updated_at"


class RunEventSortField(enum.StrEnum):
    OCCURRED_AT = "occurred_at"
    SEQUENCE = "sequence"


class PaginationCursorKind(enum.StrEnum):
    RUN_LIST = "run_list"
    RUN_EVENT_LIST = "run_event_list"
    RUN_PRUNE = "run_prune"
    RUN_STEP_LIST = "run_step_list"


class RunlaneObservationType(enum.StrEnum):
    RUN_EVENT = "run_event"
    RUN_STEP = "run_step"


class RunlaneObservationSourceKind(enum.StrEnum):
    RUN_EVENT = "run_event"
    RUN_STEP = "run_step"


class RunlaneObservationExporterTickStatus(enum.StrEnum):
    ABORTED = "aborted"
    EXPORTED = "exported"
    FAILED = "failed"
    IDLE = "idle"


class _RunStatusValues:
    """Status groups shared by core and storage scans (status-only gates; time comes from predicates)."""

    active: frozenset[RunStatus] = frozenset(
        {
            RunStatus.QUEUED,
            RunStatus.SCHEDULED,
            RunStatus.RUNNING,
            RunStatus.RETRYING,
            RunStatus.RELEASED,
            RunStatus.CANCELLATION_REQUESTED,
        }
    )
    terminal: frozenset[RunStatus] = frozenset({RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED})
    runnable_candidates: frozenset[RunStatus] = frozenset(
        {RunStatus.QUEUED, RunStatus.RELEASED, RunStatus.RETRYING, RunStatus.RUNNING, RunStatus.SCHEDULED}
    )
    delivery_recovery_candidates: frozenset[RunStatus] = frozenset(
        {RunStatus.RELEASED, RunStatus.RETRYING, RunStatus.RUNNING, RunStatus.SCHEDULED}
    )
    cancellation_finalization_candidates: frozenset[RunStatus] = frozenset({RunStatus.CANCELLATION_REQUESTED})
    # Statuses from which a waiting run can be cancelled directly (no active user code).
    directly_cancellable: frozenset[RunStatus] = frozenset(
        {RunStatus.QUEUED, RunStatus.SCHEDULED, RunStatus.RETRYING, RunStatus.RELEASED}
    )

    def classify(self, status: RunStatus) -> RunStatusClassification:
        return RunStatusClassification.TERMINAL if status in self.terminal else RunStatusClassification.ACTIVE

    def is_active(self, status: RunStatus) -> bool:
        return status in self.active

    def is_terminal(self, status: RunStatus) -> bool:
        return status in self.terminal

    def is_runnable_candidate(self, status: RunStatus) -> bool:
        return status in self.runnable_candidates

    def is_delivery_recovery_candidate(self, status: RunStatus) -> bool:
        return status in self.delivery_recovery_candidates

    def is_cancellation_finalization_candidate(self, status: RunStatus) -> bool:
        return status in self.cancellation_finalization_candidates


run_status_values = _RunStatusValues()

# The values of the enums a caller may also name by their text, for type checkers: ``worker(mode="pol")``
# is an error where it is written, not only when it runs. A test keeps each equal to its enum's values.
RunStatusName = Literal[
    "cancellation_requested", "cancelled", "failed", "queued", "released", "retrying", "running", "scheduled",
    "succeeded",
]
RunEventTypeName = Literal[
    "run.cancellation_requested", "run.cancelled", "run.created", "run.delivery_requested", "run.failed",
    "run.lease_claimed", "run.lease_heartbeat", "run.released", "run.retry_scheduled", "run.started", "run.succeeded",
]
TriggerDispatchModeName = Literal["eager", "deferred"]
WorkerModeName = Literal["drain", "poll"]
SortDirectionName = Literal["asc", "desc"]
RunSortFieldName = Literal["created_at", "run_at", "updated_at"]
RunEventSortFieldName = Literal["occurred_at", "sequence"]
