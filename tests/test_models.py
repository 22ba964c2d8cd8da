"""Record models: frozen, strict about unknown fields and times, and faithful through JSON."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from pydantic import TypeAdapter, ValidationError

from runlane.errors import ErrorCode, RunlaneError
from runlane.models import (
    Actor,
    DeliveryIntent,
    DeliveryMessage,
    Environment,
    OutboxClaim,
    OutboxFailureRecord,
    OutboxMessage,
    RunAttemptSummary,
    RunCancellationRequestedEvent,
    RunCancelledEvent,
    RunCompletionWaitCondition,
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
    RunSucceededEvent,
    RunSummary,
    SignalWaitCondition,
    TimeWaitCondition,
    WakeupPublishOutcome,
    environment_key,
)
from runlane.vocabulary import (
    ActorType,
    OutboxMessageStatus,
    RunAttemptStatus,
    RunEventType,
    RunlaneObservationSourceKind,
    RunlaneObservationType,
    RunSourceType,
    RunStatus,
    WakeupPublishOutcomeType,
)

T0 = datetime(2024, 1, 1, tzinfo=UTC)
ENV = Environment(name="production")
SYSTEM = Actor(type=ActorType.SYSTEM)


def run(**changes: Any) -> RunRecord:
    fields: dict[str, Any] = {
        "id": "run_1",
        "environment": ENV,
        "task_id": "emails.welcome",
        "queue": "emails",
        "status": RunStatus.QUEUED,
        "payload": {"user_id": "user_123"},
        "event_sequence": 1,
        "created_at": T0,
        "updated_at": T0,
    }
    return RunRecord(**{**fields, **changes})


def event_base(**changes: Any) -> dict[str, Any]:
    return {"run_id": "run_1", "environment": ENV, "occurred_at": T0, "actor": SYSTEM, **changes}


def lease() -> RunLease:
    return RunLease(worker_id="worker_1", token="lease_1", claimed_at=T0, expires_at=T0 + timedelta(minutes=5))


def failure() -> RunFailure:
    return RunFailure(code=ErrorCode.TASK_FAILED, message="Task failed.", retryable=True, meta={"provider_code": "x"})


def every_event() -> list[Any]:
    return [
        RunCreatedEvent(**event_base(), task_id="emails.welcome", queue="emails", payload={"a": [1, None]}, idempotency_key="k", idempotency_key_ttl=60_000, source=RunSource(type=RunSourceType.TRIGGER, source_run_id="run_0")),
        RunDeliveryRequestedEvent(**event_base(), delivery=DeliveryIntent(environment=ENV, run_id="run_1", queue="emails", requested_at=T0, available_at=T0, trace_carrier={"traceparent": "00-abc"})),
        RunLeaseClaimedEvent(**event_base(), lease=lease(), attempt_deadline_at=T0 + timedelta(minutes=1)),
        RunLeaseHeartbeatEvent(**event_base(), lease=lease()),
        RunStartedEvent(**event_base(), attempt=1),
        RunSucceededEvent(**event_base(), attempt=1, output=None, has_output=True),
        RunSucceededEvent(**event_base(), attempt=1),
        RunFailedEvent(**event_base(), attempt=1, failure=failure()),
        RunRetryScheduledEvent(**event_base(), attempt=1, failure=failure(), delay="30s", retry_at=T0 + timedelta(seconds=30)),
        RunReleasedEvent(**event_base(), attempt=1, delay="5m", resume_at=T0 + timedelta(minutes=5), reason="waiting"),
        RunReleasedEvent(**event_base(), attempt=1, wait=SignalWaitCondition(signal_key="approval_1", timeout_at=T0 + timedelta(days=1))),
        RunReleasedEvent(**event_base(), attempt=1, wait=RunCompletionWaitCondition(run_id="run_0")),
        RunCancellationRequestedEvent(**event_base(), reason="operator"),
        RunCancelledEvent(**event_base(), attempt=1, meta={"why": "test"}),
    ]


# ---------------------------------------------------------------------------------------------
# Frozen, strict models


def test_models_are_frozen():
    record = run()
    with pytest.raises(ValidationError):
        record.status = RunStatus.RUNNING  # type: ignore[misc]
    with pytest.raises(ValidationError):
        ENV.name = "staging"  # type: ignore[misc]
    with pytest.raises(ValidationError):
        lease().token = "other"  # type: ignore[misc]
    assert hash(ENV) == hash(Environment(name="production"))


@pytest.mark.parametrize(
    "model, data",
    [
        (Environment, {"name": "production", "region": "eu"}),
        (Actor, {"type": "system", "name": "x"}),
        (RunFailure, {"code": "task_failed", "message": "m", "stack": "..."}),
        (TimeWaitCondition, {"resume_at": T0, "delay": "5m"}),
    ],
)
def test_extra_fields_are_rejected(model, data):
    with pytest.raises(ValidationError) as caught:
        model.model_validate(data)
    assert "extra" in str(caught.value).lower()


def test_extra_fields_on_records_and_events_are_rejected():
    with pytest.raises(ValidationError):
        RunRecord.model_validate({**run().model_dump(), "unknown": 1})
    with pytest.raises(ValidationError):
        RunStartedEvent.model_validate({**event_base(), "attempt": 1, "unknown": 1})


def test_naive_datetimes_are_rejected_everywhere():
    naive = datetime(2024, 1, 1)
    with pytest.raises(ValidationError, match="timezone-aware"):
        run(created_at=naive)
    with pytest.raises(ValidationError):
        run(run_at=naive)
    with pytest.raises(ValidationError):
        RunStartedEvent(**event_base(occurred_at=naive), attempt=1)
    with pytest.raises(ValidationError):
        RunLease(worker_id="w", token="t", claimed_at=naive, expires_at=T0)
    with pytest.raises(ValidationError):
        RunRecord.model_validate_json(run().model_dump_json().replace("2024-01-01T00:00:00Z", "2024-01-01T00:00:00"))


def test_aware_datetimes_are_converted_to_utc():
    tokyo = timezone(timedelta(hours=9))
    record = run(created_at=datetime(2024, 1, 1, 9, tzinfo=tokyo), updated_at="2024-01-01T04:00:00-05:00")
    assert record.created_at == T0 and record.created_at.tzinfo is UTC
    assert record.updated_at == datetime(2024, 1, 1, 9, tzinfo=UTC) and record.updated_at.tzinfo is UTC
    assert record.model_dump(mode="json")["created_at"] == "2024-01-01T00:00:00Z"


def test_aware_datetime_that_leaves_the_utc_range_is_a_validation_error():
    with pytest.raises(ValidationError):
        run(created_at=datetime(1, 1, 1, tzinfo=timezone(timedelta(hours=1))))


@pytest.mark.parametrize(
    "changes",
    [
        {"id": "run:1"},
        {"id": ""},
        {"task_id": "emails:welcome"},
        {"queue": ""},
        {"idempotency_key": "a:b"},
        {"payload": float("nan")},
        {"payload": {"when": T0}},
        {"payload": {1: "x"}},
        {"meta": {"n": float("inf")}},
        {"event_sequence": 0},
        {"status": "paused"},
    ],
)
def test_invalid_fields_are_validation_errors(changes):
    # Every invalid field fails the same way, whether the type or a contract rule is wrong.
    with pytest.raises(ValidationError):
        run(**changes)
    with pytest.raises(ValidationError):
        RunRecord.model_validate({**run().model_dump(mode="json"), **{k: v for k, v in changes.items()}})


def test_id_errors_keep_their_helpful_message():
    with pytest.raises(ValidationError, match="':' is reserved"):
        run(id="run:1")
    with pytest.raises(ValidationError, match=r"finite"):
        run(payload=[1, float("nan")])


def test_environment_key():
    assert environment_key(ENV) == "production"
    with pytest.raises(ValidationError):
        Environment.model_validate({"name": ""})


def test_an_actor_or_environment_built_with_a_bad_field_is_configuration_invalid():
    with pytest.raises(RunlaneError) as caught:
        Actor(type="user", id="u1")  # type: ignore[arg-type]
    assert caught.value.code is ErrorCode.CONFIGURATION_INVALID
    assert caught.value.message == (
        "Invalid actor: type: Input should be 'operator', 'schedule', 'system' or 'worker'."
    )
    with pytest.raises(RunlaneError) as caught:
        Environment(name="")
    assert caught.value.code is ErrorCode.CONFIGURATION_INVALID
    assert caught.value.message == "Invalid environment: name: String should have at least 1 character."
    # Inside a record the same values are the record's validation error, as before.
    with pytest.raises(ValidationError):
        Actor.model_validate({"type": "user"})


# ---------------------------------------------------------------------------------------------
# Run output


def test_void_success_omits_output_from_json():
    record = run(status=RunStatus.SUCCEEDED, has_output=False)
    assert "output" not in record.model_dump()
    assert "output" not in record.model_dump(mode="json")
    assert "output" not in json.loads(record.model_dump_json())
    assert "output" not in record.to_json()
    assert record.to_json()["has_output"] is False
    assert RunRecord.model_validate_json(record.model_dump_json()) == record


def test_explicit_null_output_stays_visible():
    record = run(status=RunStatus.SUCCEEDED, output=None, has_output=True)
    for data in (record.model_dump(), record.model_dump(mode="json"), json.loads(record.model_dump_json()), record.to_json(), record.model_dump(exclude_none=True)):
        assert "output" in data and data["output"] is None
    restored = RunRecord.model_validate_json(record.model_dump_json())
    assert restored == record and restored.has_output is True


@pytest.mark.parametrize("output", [0, False, "", [], {}, {"ok": True}, [None]])
def test_falsy_and_structured_outputs_round_trip(output):
    record = run(status=RunStatus.SUCCEEDED, output=output, has_output=True)
    assert record.to_json()["output"] == output
    assert RunRecord.model_validate_json(record.model_dump_json()).output == output


def test_output_without_has_output_is_rejected():
    with pytest.raises(ValidationError):
        run(status=RunStatus.SUCCEEDED, output={"x": 1})
    with pytest.raises(ValidationError):
        RunSucceededEvent(**event_base(), attempt=1, output=1)
    with pytest.raises(ValidationError):
        RunAttemptSummary(attempt=1, started_at=T0, status=RunAttemptStatus.SUCCEEDED, output=1)


def test_attempt_summary_output_follows_the_run_rule():
    void = RunAttemptSummary(attempt=1, started_at=T0, status=RunAttemptStatus.SUCCEEDED, completed_at=T0)
    assert "output" not in void.model_dump(mode="json")
    explicit_null = RunAttemptSummary(attempt=1, started_at=T0, status=RunAttemptStatus.SUCCEEDED, has_output=True)
    assert explicit_null.model_dump(mode="json", exclude_none=True)["output"] is None
    for summary in (void, explicit_null):
        assert RunAttemptSummary.model_validate_json(summary.model_dump_json()) == summary


def test_succeeded_event_output_follows_the_run_rule():
    void = RunSucceededEvent(**event_base(), attempt=1)
    assert "output" not in void.model_dump(mode="json") and "output" not in json.loads(void.model_dump_json())
    explicit_null = RunSucceededEvent(**event_base(), attempt=1, output=None, has_output=True)
    assert explicit_null.model_dump(mode="json")["output"] is None
    for event in (void, explicit_null):
        assert RunSucceededEvent.model_validate_json(event.model_dump_json()) == event


def test_run_summary_is_compact():
    record = run(status=RunStatus.SUCCEEDED, output={"secret": 1}, has_output=True, lease=lease(), meta={"m": 1}, trace_carrier={"t": "1"}, idempotency_key="k")
    summary = record.to_summary()
    assert isinstance(summary, RunSummary)
    dumped = summary.model_dump()
    for omitted in ("payload", "output", "lease", "meta", "trace_carrier", "idempotency_key", "singleton_key", "concurrency_key", "attempt_deadline_at", "dispatch_expires_at"):
        assert omitted not in dumped
    assert summary.id == record.id and summary.status is RunStatus.SUCCEEDED


def test_run_wait_condition_discriminates_by_type():
    for wait in (TimeWaitCondition(resume_at=T0), SignalWaitCondition(signal_key="s"), RunCompletionWaitCondition(run_id="run_0")):
        record = run(status=RunStatus.RELEASED, wait=wait)
        restored = RunRecord.model_validate_json(record.model_dump_json())
        assert type(restored.wait) is type(wait) and restored.wait == wait
    with pytest.raises(ValidationError):
        run(status=RunStatus.RELEASED, wait={"type": "forever"})


# ---------------------------------------------------------------------------------------------
# Run events

EVENT_ADAPTER: TypeAdapter[Any] = TypeAdapter(RunEvent)


@pytest.mark.parametrize("event", every_event(), ids=lambda e: f"{e.type.value}")
def test_run_event_union_round_trips_through_json(event):
    data = json.loads(EVENT_ADAPTER.dump_json(event))
    assert data["type"] == event.type.value
    restored = EVENT_ADAPTER.validate_json(json.dumps(data))
    assert type(restored) is type(event)
    assert restored == event
    record = RunEventRecord(id="evt_1", sequence=3, event=event)
    restored_record = RunEventRecord.model_validate_json(record.model_dump_json())
    assert restored_record == record and type(restored_record.event) is type(event)
    assert RunEventRecord.model_validate(record.model_dump(mode="json")) == record


def test_every_event_type_has_a_model():
    assert {event.type for event in every_event()} == set(RunEventType)


def test_run_event_union_rejects_unknown_or_mismatched_types():
    started = RunStartedEvent(**event_base(), attempt=1).model_dump(mode="json")
    with pytest.raises(ValidationError):
        EVENT_ADAPTER.validate_python({**started, "type": "run.exploded"})
    with pytest.raises(ValidationError):
        EVENT_ADAPTER.validate_python({k: v for k, v in started.items() if k != "type"})
    with pytest.raises(ValidationError):
        EVENT_ADAPTER.validate_python({**started, "type": "run.failed"})  # no failure field
    with pytest.raises(ValidationError):
        RunStartedEvent.model_validate({**started, "type": "run.created"})
    with pytest.raises(ValidationError):
        RunEventRecord(id="e", sequence=0, event=RunStartedEvent(**event_base(), attempt=1))
    with pytest.raises(ValidationError):
        RunStartedEvent(**event_base(), attempt=0)


# ---------------------------------------------------------------------------------------------
# Delivery and outbox


def outbox(**changes: Any) -> OutboxMessage:
    fields: dict[str, Any] = {
        "id": "out_1",
        "environment": ENV,
        "run_id": "run_1",
        "queue": "emails",
        "status": OutboxMessageStatus.PENDING,
        "message": DeliveryMessage(environment=ENV, run_id="run_1", queue="emails", requested_at=T0),
        "available_at": T0,
        "created_at": T0,
        "updated_at": T0,
    }
    return OutboxMessage(**{**fields, **changes})


def claim() -> OutboxClaim:
    return OutboxClaim(token="claim_1", worker_id="worker_1", claimed_at=T0, expires_at=T0 + timedelta(seconds=30))


@pytest.mark.parametrize("status", list(OutboxMessageStatus))
def test_outbox_message_carries_a_claim_exactly_when_claimed(status):
    if status is OutboxMessageStatus.CLAIMED:
        assert outbox(status=status, claim=claim()).claim == claim()
        with pytest.raises(ValidationError, match="claim"):
            outbox(status=status)
    else:
        assert outbox(status=status).claim is None
        with pytest.raises(ValidationError, match="claim"):
            outbox(status=status, claim=claim())


def test_outbox_message_round_trips():
    failed = OutboxFailureRecord(code=ErrorCode.TRANSPORT_PUBLISH_FAILED, message="rejected", retryable=True, failed_at=T0, meta={"request_id": "r"})
    for message in (outbox(status=OutboxMessageStatus.CLAIMED, claim=claim(), attempts=1), outbox(status=OutboxMessageStatus.FAILED, last_failure=failed)):
        assert OutboxMessage.model_validate_json(message.model_dump_json()) == message


def test_wakeup_publish_outcome_shape():
    WakeupPublishOutcome(type=WakeupPublishOutcomeType.PUBLISHED, published_at=T0, provider_message_id="m")
    with pytest.raises(ValidationError):
        WakeupPublishOutcome(type=WakeupPublishOutcomeType.PUBLISHED)
    with pytest.raises(ValidationError):
        WakeupPublishOutcome(type=WakeupPublishOutcomeType.FAILED)


# ---------------------------------------------------------------------------------------------
# Observation records


def observation_record(position: str) -> RunlaneObservationRecord:
    return RunlaneObservationRecord(
        id="obs_1",
        environment=ENV,
        stream_position=position,
        source_kind=RunlaneObservationSourceKind.RUN_EVENT,
        source_id="evt_1",
        observation=RunlaneObservation(type=RunlaneObservationType.RUN_EVENT, environment=ENV, run_id="run_1", occurred_at=T0, event_type=RunEventType.STARTED),
        recorded_at=T0,
    )


@pytest.mark.parametrize("position", ["1", "42", "18446744073709551615"])
def test_observation_stream_positions_are_positive_u64_decimals(position):
    record = observation_record(position)
    assert record.stream_position == position
    assert RunlaneObservationRecord.model_validate_json(record.model_dump_json()) == record


def test_observation_record_is_importable_under_its_short_name_too():
    import runlane
    from runlane.models import ObservationRecord

    assert ObservationRecord is RunlaneObservationRecord and runlane.ObservationRecord is RunlaneObservationRecord
    assert ObservationRecord.model_validate_json(observation_record("7").model_dump_json()).stream_position == "7"


@pytest.mark.parametrize(
    "position",
    ["", "0", "01", "-1", "+1", " 1", "1.0", "1e3", "١", "１", "²", "18446744073709551616", "9" * 5000, "00000000000000000001"],
)
def test_observation_stream_position_rule(position):
    with pytest.raises(ValidationError):
        observation_record(position)
    with pytest.raises(ValidationError):
        RunlaneObservationRecord.model_validate({**observation_record("1").model_dump(mode="json"), "stream_position": position})
