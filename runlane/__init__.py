"""Runlane: durable tasks on your own infrastructure."""

from .core.attempt import RunContextFilter, StepRunner, TaskContext, current_task_context
from .core.authoring import (
    Backoff,
    QueueDefinition,
    Retry,
    RetryPolicy,
    ScheduleDefinition,
    TaskDefinition,
    TaskRelease,
    queue,
    schedule,
    task,
)
from .core.cancellation import CancellationController, CancellationSignal, link_signals
from .core.lanes import Lane, LaneCapabilities, LaneDelivery, TransportAdapter, TransportCapabilities, create_lane
from .core.observations import (
    ConsoleObservationSink,
    ObservationExporter,
    ObservationPage,
    ObservationSink,
    ObservationTrimResult,
)
from .core.pruning import PruneResult
from .core.runtime import ExecuteDeliveryResult, Runlane, TickResult, TriggerRunResult, create_runlane
from .core.sync import SyncRunlane, SyncWorkerHandle
from .core.worker import WorkerHandle
from .defaults import contract_defaults
from .durations import Duration, duration_ms, format_duration, parse_duration
from .errors import (
    ErrorCode,
    RunlaneError,
    StorageConflictKind,
    create_storage_conflict_error,
    get_storage_conflict_kind,
    is_storage_conflict,
)
from .ids import is_valid_id, validate_id
from .json_values import canonical_json, ensure_json_object, ensure_json_value, is_json_value
from .models import (
    Actor,
    DeliveryIntent,
    DeliveryMessage,
    Environment,
    ObservationRecord,
    OutboxClaim,
    OutboxFailureRecord,
    OutboxMessage,
    Page,
    RunAttemptSummary,
    RunCancellationRequestedEvent,
    RunCancelledEvent,
    RunCompletionWaitCondition,
    RunCounters,
    RunCreatedEvent,
    RunDeliveryRequestedEvent,
    RunEvent,
    RunEventRecord,
    RunFailedEvent,
    RunFailure,
    RunLease,
    RunLeaseClaimedEvent,
    RunLeaseHeartbeatEvent,
    RunlaneObservation,
    RunlaneObservationRecord,
    RunRecord,
    RunReleasedEvent,
    RunRetryScheduledEvent,
    RunSource,
    RunStartedEvent,
    RunStepRecord,
    RunSucceededEvent,
    RunSummary,
    RunWaitCondition,
    ScheduleOccurrence,
    SignalWaitCondition,
    TimeWaitCondition,
    WakeupPublishOutcome,
    environment_key,
)
from .reducer import project_run_events
from .run_scans import (
    get_run_attempt_timeout_finalization_available_at,
    get_run_cancellation_finalization_available_at,
    get_run_delivery_recovery_available_at,
    get_run_runnable_available_at,
    is_run_dispatch_reservation,
    is_run_runnable_at,
)
from .storage.operator import PaginationParams, RunEventFilter, RunFilter, TimeRange
from .vocabulary import (
    ActorType,
    DurationUnit,
    ExecuteDeliveryIgnoredReason,
    ExecuteDeliveryStatus,
    LaneDeliveryMode,
    OutboxMessageStatus,
    PaginationCursorKind,
    RetryBackoffType,
    RunAttemptStatus,
    RunDispatchReservationCondition,
    RunEventSortField,
    RunEventType,
    RunlaneObservationExporterTickStatus,
    RunlaneObservationSourceKind,
    RunlaneObservationType,
    RunSortField,
    RunSourceType,
    RunStatus,
    RunStatusClassification,
    RunWaitConditionType,
    ScheduleOccurrenceStatus,
    ScheduleType,
    SortDirection,
    TaskReleaseType,
    TriggerDispatchMode,
    TriggerOutcomeType,
    WakeupPublishOutcomeType,
    WorkerMode,
    run_status_values,
)

from .plugins import hookimpl

__version__ = "0.1.0"

__all__ = [
    "hookimpl",
    "Actor", "ActorType", "Backoff", "CancellationController", "CancellationSignal", "ConsoleObservationSink",
    "ExecuteDeliveryResult", "Lane", "LaneCapabilities", "LaneDelivery", "ObservationExporter", "ObservationPage",
    "ObservationRecord", "ObservationSink", "ObservationTrimResult", "PruneResult", "QueueDefinition", "Retry",
    "RetryPolicy", "RunContextFilter", "Runlane", "ScheduleDefinition", "StepRunner", "SyncRunlane", "SyncWorkerHandle",
    "TaskContext", "TaskDefinition", "TaskRelease", "TickResult", "TransportAdapter", "TransportCapabilities",
    "TriggerRunResult", "WorkerHandle", "create_lane", "create_runlane", "current_task_context", "link_signals",
    "queue", "schedule", "task", "DeliveryIntent", "DeliveryMessage", "Duration", "DurationUnit", "Environment",
    "ErrorCode", "ExecuteDeliveryIgnoredReason", "ExecuteDeliveryStatus", "LaneDeliveryMode", "OutboxClaim",
    "OutboxFailureRecord", "OutboxMessage", "OutboxMessageStatus", "Page", "PaginationCursorKind",
    "PaginationParams", "RetryBackoffType", "RunAttemptStatus", "RunAttemptSummary",
    "RunCancellationRequestedEvent", "RunCancelledEvent", "RunCompletionWaitCondition", "RunCounters",
    "RunCreatedEvent", "RunDeliveryRequestedEvent", "RunDispatchReservationCondition", "RunEvent",
    "RunEventFilter", "RunEventRecord", "RunEventSortField", "RunEventType", "RunFailedEvent", "RunFailure",
    "RunFilter", "RunLease", "RunLeaseClaimedEvent", "RunLeaseHeartbeatEvent", "RunRecord", "RunReleasedEvent",
    "RunRetryScheduledEvent", "RunSortField", "RunSource", "RunSourceType", "RunStartedEvent", "RunStatus",
    "RunStatusClassification", "RunStepRecord", "RunSucceededEvent", "RunSummary", "RunWaitCondition",
    "RunWaitConditionType", "RunlaneError", "RunlaneObservation", "RunlaneObservationExporterTickStatus",
    "RunlaneObservationRecord", "RunlaneObservationSourceKind", "RunlaneObservationType", "ScheduleOccurrence",
    "ScheduleOccurrenceStatus", "ScheduleType", "SignalWaitCondition", "SortDirection", "StorageConflictKind",
    "TaskReleaseType", "TimeRange", "TimeWaitCondition", "TriggerDispatchMode", "TriggerOutcomeType",
    "WakeupPublishOutcome", "WakeupPublishOutcomeType", "WorkerMode", "__version__", "canonical_json",
    "contract_defaults", "create_storage_conflict_error", "duration_ms", "ensure_json_object",
    "ensure_json_value", "environment_key", "format_duration", "get_run_attempt_timeout_finalization_available_at",
    "get_run_cancellation_finalization_available_at", "get_run_delivery_recovery_available_at",
    "get_run_runnable_available_at", "get_storage_conflict_kind", "is_json_value", "is_run_dispatch_reservation",
    "is_run_runnable_at", "is_storage_conflict", "is_valid_id", "parse_duration", "project_run_events",
    "run_status_values", "validate_id",
]
