"""Frozen record models: runs, events, leases, waits, delivery, outbox, schedules, steps, observations.

Field names are snake_case; persisted enum values are the vocabulary strings. Times are aware UTC
``datetime`` values (naive inputs are rejected so a local time can never be stored by mistake).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated, Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_serializer, model_validator
from pydantic.functional_validators import AfterValidator

from .errors import ErrorCode, RunlaneError, pydantic_problems
from .ids import validate_id
from .json_values import ensure_json_value
from .vocabulary import (
    ActorType,
    OutboxMessageStatus,
    RunAttemptStatus,
    RunEventType,
    RunSourceType,
    RunStatus,
    RunWaitConditionType,
    RunlaneObservationSourceKind,
    RunlaneObservationType,
    ScheduleOccurrenceStatus,
    WakeupPublishOutcomeType,
)

__all__ = [
    "Actor",
    "DeliveryIntent",
    "DeliveryMessage",
    "Environment",
    "ObservationRecord",
    "OutboxClaim",
    "OutboxFailureRecord",
    "OutboxMessage",
    "Page",
    "RunAttemptSummary",
    "RunCancellationRequestedEvent",
    "RunCancelledEvent",
    "RunCompletionWaitCondition",
    "RunCounters",
    "RunCreatedEvent",
    "RunDeliveryRequestedEvent",
    "RunEvent",
    "RunEventRecord",
    "RunFailedEvent",
    "RunFailure",
    "RunLease",
    "RunLeaseClaimedEvent",
    "RunLeaseHeartbeatEvent",
    "RunRecord",
    "RunReleasedEvent",
    "RunRetryScheduledEvent",
    "RunSource",
    "RunStartedEvent",
    "RunStepRecord",
    "RunSucceededEvent",
    "RunSummary",
    "RunWaitCondition",
    "RunlaneModel",
    "RunlaneObservation",
    "RunlaneObservationRecord",
    "ScheduleOccurrence",
    "SignalWaitCondition",
    "TimeWaitCondition",
    "TraceCarrier",
    "UtcDateTime",
    "WakeupPublishOutcome",
    "environment_key",
]


T = TypeVar("T")


# Field validators raise ``ValueError`` so every invalid field surfaces the same way, as a pydantic
# ``ValidationError`` (a ``RunlaneError`` raised inside a validator would escape pydantic unwrapped,
# so a record with a bad id and one with a bad type would fail differently).


def _utc(value: datetime) -> datetime:
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError(
            "datetimes must be timezone-aware, such as datetime(2026, 1, 1, tzinfo=UTC) or datetime.now(UTC); "
            "a date, or a time without an offset, has no zone"
        )
    try:
        return value.astimezone(UTC)
    except OverflowError:
        raise ValueError("the datetime is outside the representable range once converted to UTC") from None


def _id(what: str):
    def check(value: str) -> str:
        try:
            return validate_id(value, what)
        except RunlaneError as error:
            raise ValueError(error.message) from None

    return AfterValidator(check)


def _json(value: Any) -> Any:
    try:
        return ensure_json_value(value)
    except RunlaneError as error:
        raise ValueError(error.message) from None


UtcDateTime = Annotated[datetime, AfterValidator(_utc)]
RunId = Annotated[str, _id("run id")]
TaskId = Annotated[str, _id("task id")]
QueueName = Annotated[str, _id("queue name")]
Key = Annotated[str, _id("key")]
WorkerId = Annotated[str, _id("worker id")]
JsonValueField = Annotated[Any, AfterValidator(_json)]
JsonObjectField = Annotated[dict[str, Any], AfterValidator(_json)]
TraceCarrier = dict[str, str]


class RunlaneModel(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=False)

    def to_json(self) -> dict[str, Any]:
        """JSON-safe dict (times as ISO 8601 strings, enums as their values)."""
        return self.model_dump(mode="json", exclude_none=True)


if TYPE_CHECKING:  # the type checker keeps each model's own signature
    from pydantic._internal._model_construction import ModelMetaclass as CallerBuilt
else:

    class CallerBuilt(type(BaseModel)):
        """The metaclass of models callers build by hand and pass to the API (``Environment(...)``,
        ``Actor(...)``, ``TimeRange(...)``): a bad field is a ``RunlaneError``, by default their
        ``configuration_invalid`` like any other malformed option (a class's ``__caller_error__`` gives
        its own code and name), not a pydantic error. Only the call of the class is wrapped (not
        ``__init__``, which pydantic would then call for every nested value too): inside a record, or
        through ``model_validate``, the same value is still the record's ``ValidationError``."""

        def __call__(cls, *args: Any, **fields: Any) -> Any:
            try:
                return super().__call__(*args, **fields)
            except ValidationError as error:
                default = (ErrorCode.CONFIGURATION_INVALID, cls.__name__.lower(), cls.__name__.lower())
                code, what, whole = getattr(cls, "__caller_error__", default)
                raise RunlaneError(
                    code,
                    f"Invalid {what}: {pydantic_problems(error, whole)}.",
                    meta={"fields": list(cls.model_fields)},
                ) from None


class Environment(RunlaneModel, metaclass=CallerBuilt):
    """A durable namespace: development, staging, production, a tenant, a test suite."""

    name: str = Field(min_length=1, max_length=200)


def environment_key(environment: Environment) -> str:
    """The durable scoping key of an environment; use it for every storage partition and uniqueness scope."""
    return environment.name


class Actor(RunlaneModel, metaclass=CallerBuilt):
    type: ActorType
    id: str | None = None


# ---------------------------------------------------------------------------------------------
# Run building blocks


class RunCounters(RunlaneModel):
    attempts: int = 0
    failures: int = 0
    retries: int = 0
    releases: int = 0


class RunLease(RunlaneModel):
    worker_id: WorkerId
    token: str = Field(min_length=1)
    claimed_at: UtcDateTime
    expires_at: UtcDateTime


class RunFailure(RunlaneModel):
    code: ErrorCode
    message: str
    retryable: bool = False
    meta: JsonObjectField = Field(default_factory=dict)


class RunSource(RunlaneModel):
    type: RunSourceType
    source_run_id: RunId | None = None
    schedule_id: Key | None = None
    occurrence_id: str | None = None


class TimeWaitCondition(RunlaneModel):
    type: Literal[RunWaitConditionType.TIME] = RunWaitConditionType.TIME
    resume_at: UtcDateTime


class SignalWaitCondition(RunlaneModel):
    type: Literal[RunWaitConditionType.SIGNAL] = RunWaitConditionType.SIGNAL
    signal_key: Key
    timeout_at: UtcDateTime | None = None


class RunCompletionWaitCondition(RunlaneModel):
    type: Literal[RunWaitConditionType.RUN_COMPLETION] = RunWaitConditionType.RUN_COMPLETION
    run_id: RunId
    timeout_at: UtcDateTime | None = None


RunWaitCondition = Annotated[
    TimeWaitCondition | SignalWaitCondition | RunCompletionWaitCondition, Field(discriminator="type")
]


class DeliveryIntent(RunlaneModel):
    """Durable wakeup intent carried by ``run.delivery_requested``."""

    environment: Environment
    run_id: RunId
    queue: QueueName
    requested_at: UtcDateTime
    available_at: UtcDateTime
    # Set only for a bounded-queue dispatch reservation.
    dispatch_expires_at: UtcDateTime | None = None
    trace_carrier: TraceCarrier | None = None


class DeliveryMessage(RunlaneModel):
    """A transport wakeup: only environment, run id, queue, request time and trace context."""

    environment: Environment
    run_id: RunId
    queue: QueueName
    requested_at: UtcDateTime
    trace_carrier: TraceCarrier | None = None


# ---------------------------------------------------------------------------------------------
# Run events


class _RunEventBase(RunlaneModel):
    run_id: RunId
    environment: Environment
    occurred_at: UtcDateTime
    actor: Actor
    trace_carrier: TraceCarrier | None = None
    meta: JsonObjectField | None = None


class RunCreatedEvent(_RunEventBase):
    type: Literal[RunEventType.CREATED] = RunEventType.CREATED
    task_id: TaskId
    queue: QueueName
    payload: JsonValueField = None
    run_at: UtcDateTime | None = None
    concurrency_key: Key | None = None
    idempotency_key: Key | None = None
    # Captured retention policy: milliseconds, or "active" to release ownership at any terminal state.
    idempotency_key_ttl: int | Literal["active"] | None = None
    singleton_key: Key | None = None
    source: RunSource | None = None


class RunDeliveryRequestedEvent(_RunEventBase):
    type: Literal[RunEventType.DELIVERY_REQUESTED] = RunEventType.DELIVERY_REQUESTED
    delivery: DeliveryIntent


class RunLeaseClaimedEvent(_RunEventBase):
    type: Literal[RunEventType.LEASE_CLAIMED] = RunEventType.LEASE_CLAIMED
    lease: RunLease
    attempt_deadline_at: UtcDateTime | None = None


class RunLeaseHeartbeatEvent(_RunEventBase):
    type: Literal[RunEventType.LEASE_HEARTBEAT] = RunEventType.LEASE_HEARTBEAT
    lease: RunLease


class RunStartedEvent(_RunEventBase):
    type: Literal[RunEventType.STARTED] = RunEventType.STARTED
    attempt: int = Field(ge=1)


def _void_output_omitted(has_output: bool, data: dict[str, Any]) -> dict[str, Any]:
    """A dump of a model with ``output``/``has_output``: a void success leaves ``output`` out, an
    explicit JSON ``null`` output stays visible."""
    if not has_output:
        data.pop("output", None)
    elif "output" not in data:
        data["output"] = None
    return data


class RunSucceededEvent(_RunEventBase):
    """Success; ``has_output`` is ``False`` for a void success (the handler returned ``None``)."""

    type: Literal[RunEventType.SUCCEEDED] = RunEventType.SUCCEEDED
    attempt: int = Field(ge=1)
    output: JsonValueField = None
    has_output: bool = False

    @model_validator(mode="after")
    def _void_has_no_output(self) -> RunSucceededEvent:
        if not self.has_output and self.output is not None:
            raise ValueError("a void success (has_output=False) cannot carry output")
        return self

    @model_serializer(mode="wrap")
    def _omit_void_output(self, handler: Any) -> dict[str, Any]:
        return _void_output_omitted(self.has_output, handler(self))


class RunFailedEvent(_RunEventBase):
    type: Literal[RunEventType.FAILED] = RunEventType.FAILED
    attempt: int = Field(ge=1)
    failure: RunFailure


class RunRetryScheduledEvent(_RunEventBase):
    type: Literal[RunEventType.RETRY_SCHEDULED] = RunEventType.RETRY_SCHEDULED
    attempt: int = Field(ge=1)
    failure: RunFailure
    delay: str
    retry_at: UtcDateTime


class RunReleasedEvent(_RunEventBase):
    """Business waiting. Time waits carry ``delay`` + ``resume_at``; signal/run waits carry ``wait`` only."""

    type: Literal[RunEventType.RELEASED] = RunEventType.RELEASED
    attempt: int = Field(ge=1)
    delay: str | None = None
    resume_at: UtcDateTime | None = None
    wait: Annotated[SignalWaitCondition | RunCompletionWaitCondition, Field(discriminator="type")] | None = None
    reason: str | None = None


class RunCancellationRequestedEvent(_RunEventBase):
    type: Literal[RunEventType.CANCELLATION_REQUESTED] = RunEventType.CANCELLATION_REQUESTED
    reason: str | None = None


class RunCancelledEvent(_RunEventBase):
    type: Literal[RunEventType.CANCELLED] = RunEventType.CANCELLED
    reason: str | None = None
    # The attempt that stopped cooperatively, when a started attempt was cancelled.
    attempt: int | None = Field(default=None, ge=1)


RunEvent = Annotated[
    RunCreatedEvent
    | RunDeliveryRequestedEvent
    | RunLeaseClaimedEvent
    | RunLeaseHeartbeatEvent
    | RunStartedEvent
    | RunSucceededEvent
    | RunFailedEvent
    | RunRetryScheduledEvent
    | RunReleasedEvent
    | RunCancellationRequestedEvent
    | RunCancelledEvent,
    Field(discriminator="type"),
]


class RunEventRecord(RunlaneModel):
    """One persisted history row: storage-assigned ``id``, per-run ``sequence`` and the event."""

    id: str = Field(min_length=1)
    sequence: int = Field(ge=1)
    event: RunEvent


# ---------------------------------------------------------------------------------------------
# Run projection


class RunRecord(RunlaneModel):
    """The materialized view of a run's durable history (built only by ``project_run_events``)."""

    id: RunId
    environment: Environment
    task_id: TaskId
    queue: QueueName
    status: RunStatus
    payload: JsonValueField = None
    counters: RunCounters = Field(default_factory=RunCounters)
    event_sequence: int = Field(ge=1)
    created_at: UtcDateTime
    updated_at: UtcDateTime
    run_at: UtcDateTime | None = None
    started_at: UtcDateTime | None = None
    finished_at: UtcDateTime | None = None
    lease: RunLease | None = None
    attempt_deadline_at: UtcDateTime | None = None
    dispatched_at: UtcDateTime | None = None
    dispatch_expires_at: UtcDateTime | None = None
    wait: RunWaitCondition | None = None
    failure: RunFailure | None = None
    output: JsonValueField = None
    has_output: bool = False
    source: RunSource | None = None
    idempotency_key: Key | None = None
    singleton_key: Key | None = None
    concurrency_key: Key | None = None
    trace_carrier: TraceCarrier | None = None
    meta: JsonObjectField | None = None

    @model_validator(mode="after")
    def _void_has_no_output(self) -> RunRecord:
        if not self.has_output and self.output is not None:
            raise ValueError("a run without output (has_output=False) cannot carry output")
        return self

    @model_serializer(mode="wrap")
    def _omit_void_output(self, handler: Any) -> dict[str, Any]:
        return _void_output_omitted(self.has_output, handler(self))

    def to_json(self) -> dict[str, Any]:
        data = self.model_dump(mode="json", exclude_none=True)
        if self.has_output and "output" not in data:
            data["output"] = None
        return data

    def to_summary(self) -> RunSummary:
        return RunSummary(
            id=self.id,
            environment=self.environment,
            task_id=self.task_id,
            queue=self.queue,
            status=self.status,
            counters=self.counters,
            created_at=self.created_at,
            updated_at=self.updated_at,
            run_at=self.run_at,
            started_at=self.started_at,
            finished_at=self.finished_at,
            failure=self.failure,
            source=self.source,
            wait=self.wait,
        )


class RunSummary(RunlaneModel):
    """The compact list row: no payload, output, lease, trace carrier, metadata or keys."""

    id: RunId
    environment: Environment
    task_id: TaskId
    queue: QueueName
    status: RunStatus
    counters: RunCounters
    created_at: UtcDateTime
    updated_at: UtcDateTime
    run_at: UtcDateTime | None = None
    started_at: UtcDateTime | None = None
    finished_at: UtcDateTime | None = None
    failure: RunFailure | None = None
    source: RunSource | None = None
    wait: RunWaitCondition | None = None


class RunAttemptSummary(RunlaneModel):
    attempt: int
    started_at: UtcDateTime
    status: RunAttemptStatus
    completed_at: UtcDateTime | None = None
    output: JsonValueField = None
    has_output: bool = False
    failure: RunFailure | None = None
    retry_delay: str | None = None
    retry_at: UtcDateTime | None = None
    release_delay: str | None = None
    release_wait: RunWaitCondition | None = None
    release_reason: str | None = None
    resume_at: UtcDateTime | None = None

    @model_validator(mode="after")
    def _void_has_no_output(self) -> RunAttemptSummary:
        if not self.has_output and self.output is not None:
            raise ValueError("an attempt without output (has_output=False) cannot carry output")
        return self

    @model_serializer(mode="wrap")
    def _omit_void_output(self, handler: Any) -> dict[str, Any]:
        return _void_output_omitted(self.has_output, handler(self))


class Page(BaseModel, Generic[T]):
    model_config = ConfigDict(frozen=True)

    data: list[T]
    next_cursor: str | None = None


# ---------------------------------------------------------------------------------------------
# Steps, outbox, schedules, observations


class RunStepRecord(RunlaneModel):
    environment: Environment
    run_id: RunId
    step_key: Key
    token: str = Field(min_length=1)
    attempt: int = Field(ge=1)
    output: JsonValueField = None
    completed_at: UtcDateTime


class OutboxFailureRecord(RunlaneModel):
    code: ErrorCode
    message: str
    retryable: bool
    failed_at: UtcDateTime
    meta: JsonObjectField = Field(default_factory=dict)


class OutboxClaim(RunlaneModel):
    token: str = Field(min_length=1)
    worker_id: WorkerId | None = None
    claimed_at: UtcDateTime
    expires_at: UtcDateTime


class OutboxMessage(RunlaneModel):
    id: str = Field(min_length=1)
    environment: Environment
    run_id: RunId
    queue: QueueName
    status: OutboxMessageStatus
    message: DeliveryMessage
    available_at: UtcDateTime
    attempts: int = 0
    created_at: UtcDateTime
    updated_at: UtcDateTime
    claim: OutboxClaim | None = None
    published_at: UtcDateTime | None = None
    provider_message_id: str | None = None
    last_failure: OutboxFailureRecord | None = None

    @model_validator(mode="after")
    def _claim_matches_status(self) -> OutboxMessage:
        if (self.status is OutboxMessageStatus.CLAIMED) != (self.claim is not None):
            raise ValueError("an outbox message carries a claim exactly when its status is 'claimed'")
        return self


class WakeupPublishOutcome(RunlaneModel):
    type: WakeupPublishOutcomeType
    published_at: UtcDateTime | None = None
    provider_message_id: str | None = None
    failure: OutboxFailureRecord | None = None

    @model_validator(mode="after")
    def _shape(self) -> WakeupPublishOutcome:
        if self.type is WakeupPublishOutcomeType.PUBLISHED and self.published_at is None:
            raise ValueError("a published outcome needs published_at")
        if self.type is WakeupPublishOutcomeType.FAILED and self.failure is None:
            raise ValueError("a failed outcome needs a failure record")
        return self


class ScheduleOccurrence(RunlaneModel):
    id: str = Field(min_length=1)
    environment: Environment
    schedule_id: Key
    task_id: TaskId
    fire_at: UtcDateTime
    status: ScheduleOccurrenceStatus
    claim_token: str | None = None
    claimed_by: WorkerId | None = None
    claim_expires_at: UtcDateTime | None = None
    run_ids: list[RunId] = Field(default_factory=list)
    created_at: UtcDateTime
    updated_at: UtcDateTime
    completed_at: UtcDateTime | None = None


class RunlaneObservation(RunlaneModel):
    """A sanitized observation: no payload, output, step output, failure detail or release metadata.

    ``status`` is the run's status right after the observed event (``run.created`` observes ``queued``
    even when the same commit went on to claim the run).
    """

    type: RunlaneObservationType
    environment: Environment
    run_id: RunId
    task_id: TaskId | None = None
    queue: QueueName | None = None
    occurred_at: UtcDateTime
    event_id: str | None = None
    event_type: RunEventType | None = None
    event_sequence: int | None = None
    status: RunStatus | None = None
    attempt: int | None = None
    failure_code: ErrorCode | None = None
    step_key: Key | None = None
    step_token: str | None = None
    trace_carrier: TraceCarrier | None = None

    @model_validator(mode="before")
    @classmethod
    def _stored_before_event_sequence(cls, data: Any) -> Any:
        # Records stored before the field took the spec's name ``event_sequence`` call it ``sequence``.
        if isinstance(data, dict) and "sequence" in data and "event_sequence" not in data:
            data = {("event_sequence" if key == "sequence" else key): value for key, value in data.items()}
        return data


class RunlaneObservationRecord(RunlaneModel):
    id: str = Field(min_length=1)
    environment: Environment
    stream_position: str
    source_kind: RunlaneObservationSourceKind
    source_id: str
    observation: RunlaneObservation
    recorded_at: UtcDateTime

    @field_validator("stream_position")
    @classmethod
    def _u64(cls, value: str) -> str:
        # ASCII digits only: ``str.isdigit`` also accepts other scripts' digits such as '١'.
        canonical = value.isascii() and value.isdigit() and not value.startswith("0") and len(value) <= 20
        if not canonical or int(value) > 2**64 - 1:
            raise ValueError("stream positions are positive unsigned 64-bit decimal strings")
        return value


ObservationRecord = RunlaneObservationRecord
"""The durable observation record under its short name (the spec's ``RunlaneObservationRecord``)."""
