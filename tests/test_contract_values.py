"""Contract values: ids, durations, JSON values, errors, persisted enum values, defaults and the test clock."""

from __future__ import annotations

import copy
import enum
import json
import math
import pickle
from datetime import UTC, datetime, timedelta, timezone

import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import runlane
from runlane import (
    ActorType,
    DurationUnit,
    ErrorCode,
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
    RunlaneError,
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
    StorageConflictKind,
    TaskReleaseType,
    TriggerDispatchMode,
    TriggerOutcomeType,
    WakeupPublishOutcomeType,
    WorkerMode,
    contract_defaults,
    create_storage_conflict_error,
    duration_ms,
    ensure_json_object,
    ensure_json_value,
    format_duration,
    get_storage_conflict_kind,
    is_json_value,
    is_storage_conflict,
    is_valid_id,
    parse_duration,
    run_status_values,
    validate_id,
)
from runlane.ids import MAX_ID_LENGTH, validate_optional_id
from runlane.json_values import non_finite_float_path
from runlane.storage import StorageLimitError
from runlane.testing.clock import ControlledClock

PROPERTY = settings(max_examples=300, deadline=None)
MAX_SAFE_INTEGER = 2**53 - 1


def raises_code(expected: ErrorCode, call, *args, **kwargs) -> RunlaneError:
    with pytest.raises(RunlaneError) as caught:
        call(*args, **kwargs)
    assert caught.value.code is expected
    return caught.value


# ---------------------------------------------------------------------------------------------
# Identifiers


@pytest.mark.parametrize("value", ["emails.welcome", "a", "user_123", "provider_account_3f2a", "x" * MAX_ID_LENGTH, "é/ü 空白"])
def test_valid_ids(value):
    assert validate_id(value, "task id") == value
    assert is_valid_id(value)


def test_id_errors_are_configuration_invalid_and_say_what_to_do():
    empty = raises_code(ErrorCode.CONFIGURATION_INVALID, validate_id, "", "task id")
    assert "task id" in empty.message and "empty" in empty.message
    assert empty.meta == {"field": "task id"}
    colon = raises_code(ErrorCode.CONFIGURATION_INVALID, validate_id, "emails:welcome", "task id")
    assert "':'" in colon.message and "emails:welcome" in colon.message and "'.'" in colon.message
    for value in (None, 5, b"bytes", ["a"]):
        wrong_type = raises_code(ErrorCode.CONFIGURATION_INVALID, validate_id, value, "queue name")
        assert "expected a string" in wrong_type.message and "queue name" in wrong_type.message
    long = raises_code(ErrorCode.CONFIGURATION_INVALID, validate_id, "x" * (MAX_ID_LENGTH + 1), "idempotency key")
    assert str(MAX_ID_LENGTH) in long.message and "hash" in long.message
    assert not long.retryable


@pytest.mark.parametrize("value", ["", ":", "a:b", ":leading", "trailing:", None, 1, "x" * (MAX_ID_LENGTH + 1)])
def test_invalid_ids(value):
    assert not is_valid_id(value)
    with pytest.raises(RunlaneError):
        validate_id(value)


def test_id_validation_code_and_optional_ids():
    raises_code(ErrorCode.VALIDATION_FAILED, validate_id, "a:b", code=ErrorCode.VALIDATION_FAILED)
    assert validate_optional_id(None) is None
    assert validate_optional_id("run_1") == "run_1"
    raises_code(ErrorCode.CONFIGURATION_INVALID, validate_optional_id, "")


# ---------------------------------------------------------------------------------------------
# Durations


@pytest.mark.parametrize(
    "value, milliseconds",
    [
        ("500ms", 500),
        ("0.5s", 500),
        ("30s", 30_000),
        ("5m", 300_000),
        ("2h", 7_200_000),
        ("7d", 604_800_000),
        ("1ms", 1),
        ("1.5s", 1_500),
        ("0.001s", 1),
        ("1.25m", 75_000),
        (timedelta(seconds=30), 30_000),
        (timedelta(milliseconds=1), 1),
        (timedelta(days=1, microseconds=5000), 86_400_005),
        (f"{MAX_SAFE_INTEGER}ms", MAX_SAFE_INTEGER),
    ],
)
def test_valid_durations(value, milliseconds):
    assert duration_ms(value) == milliseconds
    assert parse_duration(value) == timedelta(milliseconds=milliseconds)


@pytest.mark.parametrize(
    "value",
    [
        "0s",
        "0ms",
        "0.0001s",
        "-1s",
        "+1s",
        "1.5ms",
        "10",
        "5 m",
        " 5m",
        "5m ",
        "30s\n",
        "1w",
        "1y",
        "5M",
        "5S",
        "1e3ms",
        ".5s",
        "5.s",
        "1_000ms",
        "٥s",  # non-ASCII digits
        "５s",
        "",
        "ms",
        "1" * 99 + "s",  # 100 characters, but far too large
        "1" * 100 + "s",  # longer than 100 characters
        f"{MAX_SAFE_INTEGER + 1}ms",
        "104249991375d",  # just above 2**53 - 1 milliseconds
        timedelta(0),
        timedelta(seconds=-1),
        timedelta(microseconds=1500),
        timedelta(microseconds=1),
        30,
        30.0,
        None,
        True,
    ],
)
def test_invalid_durations(value):
    error = raises_code(ErrorCode.CONFIGURATION_INVALID, duration_ms, value)
    assert error.meta == {"field": "duration"}


def test_duration_errors_name_the_field_and_can_use_another_code():
    error = raises_code(ErrorCode.VALIDATION_FAILED, duration_ms, "5 m", "release delay", code=ErrorCode.VALIDATION_FAILED)
    assert "release delay" in error.message and "'30s'" in error.message
    assert "100" in raises_code(ErrorCode.CONFIGURATION_INVALID, duration_ms, "1" * 101 + "s").message


def test_format_duration_picks_the_largest_exact_unit():
    assert format_duration(500) == "500ms"
    assert format_duration(1500) == "1500ms"
    assert format_duration(30_000) == "30s"
    assert format_duration(60_000) == "1m"
    assert format_duration(90_000) == "90s"
    assert format_duration(7_200_000) == "2h"
    assert format_duration(604_800_000) == "7d"
    assert format_duration(timedelta(minutes=5)) == "5m"
    assert format_duration("0.5s") == "500ms"
    assert format_duration("120s") == "2m"


@pytest.mark.parametrize("value", [0, -1, -60_000, MAX_SAFE_INTEGER + 1, True, False, 1.5, None, "0s", timedelta(0)])
def test_format_duration_rejects_non_durations(value):
    raises_code(ErrorCode.CONFIGURATION_INVALID, format_duration, value)


@PROPERTY
@given(st.one_of(st.integers(min_value=1, max_value=MAX_SAFE_INTEGER), st.sampled_from([1, 999, 1000, 59_999, 60_000, 86_400_000, MAX_SAFE_INTEGER])))
def test_format_duration_round_trips(milliseconds):
    text = format_duration(milliseconds)
    assert duration_ms(text) == milliseconds
    assert format_duration(timedelta(milliseconds=milliseconds)) == text
    assert text.removesuffix(text.lstrip("0123456789")).isdigit()
    assert text.lstrip("0123456789") in {unit.value for unit in DurationUnit}


# ---------------------------------------------------------------------------------------------
# JSON values


def _cyclic_list():
    value: list = [1]
    value.append([value])
    return value


def _cyclic_dict():
    value: dict = {"a": {"b": []}}
    value["a"]["b"].append(value)
    return value


@pytest.mark.parametrize(
    "value",
    [None, True, False, 0, -1, 2**80, 1.5, -0.0, "", "é𝄞", [], {}, [1, [2, [3]]], {"a": {"b": [None, {"c": "d"}]}}, (1, 2)],
)
def test_json_values_accepted(value):
    assert is_json_value(value)
    assert ensure_json_value(value) is value


@pytest.mark.parametrize(
    "value, path",
    [
        (math.nan, "$"),
        ({"a": [1, math.inf]}, "$.a[1]"),
        ({"a": {"b": -math.inf}}, "$.a.b"),
        (_cyclic_list(), "$[1][0]"),
        (_cyclic_dict(), "$.a.b[0]"),
        ({1: "x"}, "$"),
        ({"a": {(1, 2): "x"}}, "$.a"),
        ({"a": {1, 2}}, "$.a"),
        ({"a": [b"bytes"]}, "$.a[0]"),
        ({"a": bytearray(b"x")}, "$.a"),
        ({"when": datetime(2024, 1, 1, tzinfo=UTC)}, "$.when"),
        ({"delta": timedelta(1)}, "$.delta"),
        ({"obj": object()}, "$.obj"),
        ({"s": "lone \ud800"}, "$.s"),
        ({"lone \udc00": 1}, "$"),
        ({"f": len}, "$.f"),
    ],
)
def test_json_values_rejected_with_the_path(value, path):
    assert not is_json_value(value)
    error = raises_code(ErrorCode.VALIDATION_FAILED, ensure_json_value, value, "payload")
    assert error.meta == {"field": "payload", "path": path}
    assert f"at {path}" in error.message and "payload" in error.message


def test_json_validation_uses_the_given_code_and_survives_deep_nesting():
    raises_code(ErrorCode.TASK_OUTPUT_INVALID, ensure_json_value, {1: 2}, "output", code=ErrorCode.TASK_OUTPUT_INVALID)
    deep: list = []
    current = deep
    for _ in range(10_000):
        current.append([])
        current = current[0]
    assert not is_json_value(deep)
    raises_code(ErrorCode.VALIDATION_FAILED, ensure_json_value, deep)


def test_shared_references_are_not_cycles():
    shared = [1, 2]
    assert is_json_value({"a": shared, "b": [shared, shared]})


class _Reading(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="allow")
    values: dict
    scale: float = 1.0


def _deep_with(leaf: object, depth: int = 5_000) -> dict:
    top: dict = {}
    current = top
    for _ in range(depth):
        current["x"] = {}
        current = current["x"]
    current["v"] = leaf
    return top


@pytest.mark.parametrize(
    "value, path",
    [
        ({"ok": [1, 1.5, "x", True, None]}, None),
        ({"a": [1, {"b": math.nan}]}, "$.a[1].b"),
        ((1.0, math.inf), "$[1]"),
        ({"tags": {1.0, -math.inf}}, "$.tags[]"),
        (_Reading(values={"t": math.inf}), "$.values.t"),
        (_Reading(values={}, scale=math.nan), "$.scale"),
        (_Reading(values={}, extra_field=math.nan), "$.extra_field"),
        (_Reading(values={"t": 2.5}), None),
        (pydantic.RootModel[list[float]]([1.0, math.nan]), "$.root[1]"),
        (math.nan, "$"),
        (_deep_with(1.0), None),
        (_deep_with(math.nan), "$" + ".x" * 5_000 + ".v"),
    ],
)
def test_non_finite_float_path_finds_the_first_nan_or_infinity(value: object, path: str | None) -> None:
    assert non_finite_float_path(value) == path


def test_non_finite_float_path_survives_cycles() -> None:
    cycle: list = [1.0]
    cycle.append(cycle)
    assert non_finite_float_path(cycle) is None
    cycle.append(math.nan)
    assert non_finite_float_path(cycle) == "$[2]"


def test_json_objects():
    assert ensure_json_object({"a": 1}) == {"a": 1}
    for value in ([1], "x", None, 1):
        raises_code(ErrorCode.VALIDATION_FAILED, ensure_json_object, value)


def test_canonical_json():
    assert runlane.canonical_json({"b": [1, 2.5], "a": "é"}) == '{"a":"é","b":[1,2.5]}'
    with pytest.raises(ValueError):
        runlane.canonical_json({"n": math.nan})


# ---------------------------------------------------------------------------------------------
# Errors


def test_runlane_error_defaults():
    error = RunlaneError(ErrorCode.RUN_NOT_FOUND)
    assert error.code is ErrorCode.RUN_NOT_FOUND
    assert error.retryable is False
    assert error.meta == {}
    assert error.message == "Run not found."
    assert str(error) == "Run not found."
    assert RunlaneError("validation_failed", "bad").code is ErrorCode.VALIDATION_FAILED
    with pytest.raises(ValueError):
        RunlaneError("not_a_code")


def test_runlane_error_json_shape_keeps_cause_server_side():
    cause = OSError("connection reset: password=hunter2")
    meta = {"provider_code": "x"}
    error = RunlaneError(ErrorCode.STORAGE_UNAVAILABLE, "Storage is unavailable.", retryable=True, meta=meta, cause=cause)
    meta["provider_code"] = "changed"
    assert error.__cause__ is cause
    assert error.to_json() == {"code": "storage_unavailable", "message": "Storage is unavailable.", "retryable": True, "meta": {"provider_code": "x"}}
    assert "hunter2" not in json.dumps(error.to_json())


def test_runlane_errors_survive_pickling_as_a_process_pool_sends_them_to_the_parent():
    # A multiprocessing pool child sends the exception it raised to the parent pickled; rebuilt from its
    # message alone, the parent's result thread died on it ("... is not a valid ErrorCode") and map() hung.
    error = RunlaneError(ErrorCode.CONFIGURATION_INVALID, "Forked.", retryable=True, meta={"parent_pid": 7})
    for copied in (pickle.loads(pickle.dumps(error)), copy.copy(error)):
        assert type(copied) is RunlaneError
        assert (copied.code, copied.message, copied.retryable) == (error.code, "Forked.", True)
        assert copied.meta == {"parent_pid": 7}
        assert str(copied) == "Forked."
    limit = pickle.loads(pickle.dumps(StorageLimitError("max_payload_bytes", 10, 20, reserved=2)))
    assert type(limit) is StorageLimitError
    assert (limit.limit, limit.allowed, limit.actual, limit.reserved) == ("max_payload_bytes", 10, 20, 2)
    assert limit.code is ErrorCode.VALIDATION_FAILED and limit.meta["storage_limit"] == "max_payload_bytes"


def test_storage_conflict_errors():
    error = create_storage_conflict_error(StorageConflictKind.LEASE_OWNERSHIP, meta={"run_id": "run_1"})
    assert error.code is ErrorCode.STORAGE_CONFLICT
    assert error.retryable is True
    assert error.meta == {"run_id": "run_1", "storage_conflict_kind": "lease_ownership"}
    assert get_storage_conflict_kind(error) is StorageConflictKind.LEASE_OWNERSHIP
    assert is_storage_conflict(error)
    assert is_storage_conflict(error, StorageConflictKind.LEASE_OWNERSHIP)
    assert not is_storage_conflict(error, StorageConflictKind.EVENT_SEQUENCE)

    # The kind in meta always wins over a caller-supplied value under the same key.
    forced = create_storage_conflict_error("idempotency_key", "Taken.", retryable=False, meta={"storage_conflict_kind": "bogus"})
    assert forced.meta["storage_conflict_kind"] == "idempotency_key"
    assert forced.retryable is False and forced.message == "Taken."
    with pytest.raises(ValueError):
        create_storage_conflict_error("bogus")


def test_storage_conflict_kind_of_other_errors_is_none():
    assert get_storage_conflict_kind(ValueError("x")) is None
    assert get_storage_conflict_kind(RunlaneError(ErrorCode.VALIDATION_FAILED, meta={"storage_conflict_kind": "lease_ownership"})) is None
    assert get_storage_conflict_kind(RunlaneError(ErrorCode.STORAGE_CONFLICT)) is None
    assert get_storage_conflict_kind(RunlaneError(ErrorCode.STORAGE_CONFLICT, meta={"storage_conflict_kind": "bogus"})) is None
    assert not is_storage_conflict(RunlaneError(ErrorCode.STORAGE_CONFLICT))


# ---------------------------------------------------------------------------------------------
# Persisted enum values, written out exactly as the vocabulary pages list them


def values(enum_type: type[enum.Enum]) -> dict[str, str]:
    return {member.name: member.value for member in enum_type}


def test_enums_are_str_enums():
    for enum_type in ENUM_VALUES:
        assert issubclass(enum_type, enum.StrEnum)
    assert RunStatus.QUEUED == "queued"
    assert RunEventType.DELIVERY_REQUESTED == "run.delivery_requested"
    assert ErrorCode.STORAGE_CONFLICT == "storage_conflict"


ENUM_VALUES: dict[type[enum.Enum], dict[str, str]] = {
    ErrorCode: {
        "ADAPTER_CONTRACT_VIOLATION": "adapter_contract_violation",
        "CAPABILITY_UNSUPPORTED": "capability_unsupported",
        "CONFIGURATION_INVALID": "configuration_invalid",
        "INTERNAL_ERROR": "internal_error",
        "INVARIANT_VIOLATION": "invariant_violation",
        "OPERATION_CANCELLED": "operation_cancelled",
        "OBSERVATION_EXPORT_FAILED": "observation_export_failed",
        "RUN_NOT_FOUND": "run_not_found",
        "SCHEDULE_NOT_FOUND": "schedule_not_found",
        "STORAGE_CONFLICT": "storage_conflict",
        "STORAGE_UNAVAILABLE": "storage_unavailable",
        "TASK_FAILED": "task_failed",
        "TASK_NOT_FOUND": "task_not_found",
        "TASK_OUTPUT_INVALID": "task_output_invalid",
        "TASK_TIMED_OUT": "task_timed_out",
        "TRANSPORT_PUBLISH_FAILED": "transport_publish_failed",
        "TRANSPORT_UNAVAILABLE": "transport_unavailable",
        "VALIDATION_FAILED": "validation_failed",
    },
    StorageConflictKind: {
        "EVENT_SEQUENCE": "event_sequence",
        "IDEMPOTENCY_KEY": "idempotency_key",
        "LEASE_OWNERSHIP": "lease_ownership",
        # Named by the observation checkpoint contract (advanceObservationCheckpoint), not the kind table.
        "OBSERVATION_CHECKPOINT": "observation_checkpoint",
        "OUTBOX_CLAIM": "outbox_claim",
        "SCHEDULE_OCCURRENCE": "schedule_occurrence",
        "SINGLETON_KEY": "singleton_key",
        # Python-side extension: run_now found its bounded-queue capacity partition full.
        "QUEUE_CAPACITY": "queue_capacity",
        # Python-side extension: a storage transaction exhausted its optimistic attempt budget.
        "TRANSACTION": "transaction",
    },
    LaneDeliveryMode: {"STORAGE_POLLING": "storage_polling", "TRANSPORT": "transport"},
    OutboxMessageStatus: {
        "CLAIMED": "claimed",
        "DEAD_LETTERED": "dead_lettered",
        "FAILED": "failed",
        "PENDING": "pending",
        "PUBLISHED": "published",
    },
    TriggerDispatchMode: {"EAGER": "eager", "DEFERRED": "deferred"},
    WakeupPublishOutcomeType: {"FAILED": "failed", "PUBLISHED": "published"},
    WorkerMode: {"DRAIN": "drain", "POLL": "poll"},
    ExecuteDeliveryStatus: {"EXECUTED": "executed", "IGNORED": "ignored"},
    ExecuteDeliveryIgnoredReason: {
        "ABANDONED": "abandoned",
        "ALREADY_LEASED": "already_leased",
        "CLAIM_LOST": "claim_lost",
        "NOT_DUE": "not_due",
        "RUN_NOT_FOUND": "run_not_found",
        "TERMINAL": "terminal",
        "WRONG_QUEUE": "wrong_queue",
    },
    RunlaneObservationType: {"RUN_EVENT": "run_event", "RUN_STEP": "run_step"},
    RunlaneObservationSourceKind: {"RUN_EVENT": "run_event", "RUN_STEP": "run_step"},
    RunlaneObservationExporterTickStatus: {"ABORTED": "aborted", "EXPORTED": "exported", "FAILED": "failed", "IDLE": "idle"},
    SortDirection: {"ASC": "asc", "DESC": "desc"},
    RunSortField: {"CREATED_AT": "created_at", "RUN_AT": "run_at", "UPDATED_AT": "updated_at"},
    RunEventSortField: {"OCCURRED_AT": "occurred_at", "SEQUENCE": "sequence"},
    PaginationCursorKind: {
        "RUN_LIST": "run_list",
        "RUN_EVENT_LIST": "run_event_list",
        "RUN_PRUNE": "run_prune",
        # Python-side extension: pages of runs.steps (a run's durable steps in step-key order).
        "RUN_STEP_LIST": "run_step_list",
    },
    RunStatus: {
        "CANCELLATION_REQUESTED": "cancellation_requested",
        "CANCELLED": "cancelled",
        "FAILED": "failed",
        "QUEUED": "queued",
        "RELEASED": "released",
        "RETRYING": "retrying",
        "RUNNING": "running",
        "SCHEDULED": "scheduled",
        "SUCCEEDED": "succeeded",
    },
    RunStatusClassification: {"ACTIVE": "active", "TERMINAL": "terminal"},
    RunDispatchReservationCondition: {"ACTIVE": "active", "EXPIRED": "expired"},
    RunAttemptStatus: {
        "CANCELLED": "cancelled",
        "FAILED": "failed",
        "RELEASED": "released",
        "RETRYING": "retrying",
        "RUNNING": "running",
        "SUCCEEDED": "succeeded",
    },
    RunEventType: {
        "CANCELLATION_REQUESTED": "run.cancellation_requested",
        "CANCELLED": "run.cancelled",
        "CREATED": "run.created",
        "DELIVERY_REQUESTED": "run.delivery_requested",
        "FAILED": "run.failed",
        "LEASE_CLAIMED": "run.lease_claimed",
        "LEASE_HEARTBEAT": "run.lease_heartbeat",
        "RELEASED": "run.released",
        "RETRY_SCHEDULED": "run.retry_scheduled",
        "STARTED": "run.started",
        "SUCCEEDED": "run.succeeded",
    },
    RunSourceType: {"MANUAL_RETRY": "manual_retry", "RERUN": "rerun", "SCHEDULE": "schedule", "TRIGGER": "trigger"},
    RunWaitConditionType: {"RUN_COMPLETION": "run_completion", "SIGNAL": "signal", "TIME": "time"},
    TriggerOutcomeType: {"CREATED": "created", "RETURNED_EXISTING": "returned_existing"},
    ActorType: {"OPERATOR": "operator", "SCHEDULE": "schedule", "SYSTEM": "system", "WORKER": "worker"},
    RetryBackoffType: {"EXPONENTIAL": "exponential", "FIXED": "fixed"},
    TaskReleaseType: {"RELEASE": "task_release"},
    ScheduleType: {"CRON": "cron", "INTERVAL": "interval", "ONCE": "once"},
    ScheduleOccurrenceStatus: {"CLAIMED": "claimed", "COMPLETED": "completed"},
    DurationUnit: {"DAY": "d", "HOUR": "h", "MILLISECOND": "ms", "MINUTE": "m", "SECOND": "s"},
}


@pytest.mark.parametrize("enum_type", list(ENUM_VALUES), ids=lambda e: e.__name__)
def test_persisted_enum_values(enum_type):
    assert values(enum_type) == ENUM_VALUES[enum_type]


def test_status_groups():
    assert run_status_values.active == {
        RunStatus("queued"), RunStatus("scheduled"), RunStatus("running"),
        RunStatus("retrying"), RunStatus("released"), RunStatus("cancellation_requested"),
    }
    assert {s.value for s in run_status_values.terminal} == {"succeeded", "failed", "cancelled"}
    assert {s.value for s in run_status_values.runnable_candidates} == {"queued", "released", "retrying", "running", "scheduled"}
    assert {s.value for s in run_status_values.delivery_recovery_candidates} == {"released", "retrying", "running", "scheduled"}
    assert {s.value for s in run_status_values.cancellation_finalization_candidates} == {"cancellation_requested"}
    for status in RunStatus:
        assert run_status_values.is_active(status) != run_status_values.is_terminal(status)
        expected = RunStatusClassification.TERMINAL if run_status_values.is_terminal(status) else RunStatusClassification.ACTIVE
        assert run_status_values.classify(status) is expected


# ---------------------------------------------------------------------------------------------
# contract_defaults


def test_contract_defaults():
    assert contract_defaults.lease.duration == timedelta(minutes=5)
    assert duration_ms(contract_defaults.retry.backoff) == duration_ms("30s")
    assert contract_defaults.retry.backoff == "30s"
    assert contract_defaults.idempotency.ttl == "30d"
    assert contract_defaults.pruning.batch_limit == 100
    maintenance = contract_defaults.maintenance
    assert maintenance.schedule_materialization_limit == 100
    assert maintenance.cancellation_finalization_limit == 100
    assert maintenance.timeout_finalization_limit == 100
    assert maintenance.dispatch_reservation_limit == 100
    assert maintenance.delivery_request_limit == 100
    assert maintenance.outbox_claim_limit == 100
    assert contract_defaults.sort.runs.field == RunSortField.CREATED_AT == "created_at"
    assert contract_defaults.sort.runs.direction is SortDirection.DESC
    assert contract_defaults.sort.run_events.field == RunEventSortField.OCCURRED_AT == "occurred_at"
    assert contract_defaults.sort.run_events.direction is SortDirection.ASC
    assert 1 <= contract_defaults.pagination.default_limit <= contract_defaults.pagination.max_limit
    assert contract_defaults.run.new_event_sequence == 0
    assert contract_defaults.dispatch.on_trigger is TriggerDispatchMode.EAGER
    assert contract_defaults.actor.system.type is ActorType.SYSTEM and contract_defaults.actor.system.id is None
    assert contract_defaults.actor.operator.type is ActorType.OPERATOR and contract_defaults.actor.operator.id is None
    assert contract_defaults.queue == "default"
    assert contract_defaults.environment == "default"


def test_contract_defaults_are_frozen():
    with pytest.raises(AttributeError):
        contract_defaults.lease = None  # type: ignore[misc]
    with pytest.raises(AttributeError):
        contract_defaults.maintenance.outbox_claim_limit = 1  # type: ignore[misc]


# ---------------------------------------------------------------------------------------------
# ControlledClock


def test_controlled_clock_starts_at_a_fixed_utc_time():
    clock = ControlledClock()
    assert clock.now() == datetime(2026, 1, 1, tzinfo=UTC)
    assert clock.now().tzinfo is UTC
    assert clock.now() == clock.now()


def test_controlled_clock_advance_and_set():
    clock = ControlledClock(datetime(2024, 1, 1, 2, tzinfo=timezone(timedelta(hours=2))))
    assert clock.now() == datetime(2024, 1, 1, tzinfo=UTC)
    assert clock.now().tzinfo is UTC
    assert clock.advance("5m") == datetime(2024, 1, 1, 0, 5, tzinfo=UTC)
    assert clock.advance(timedelta(milliseconds=250)) == datetime(2024, 1, 1, 0, 5, 0, 250_000, tzinfo=UTC)
    assert clock.advance(timedelta(0)) == clock.now()
    assert clock.now() == datetime(2024, 1, 1, 0, 5, 0, 250_000, tzinfo=UTC)
    assert clock.set(datetime(2023, 6, 1, tzinfo=UTC)) == datetime(2023, 6, 1, tzinfo=UTC)  # may move backwards
    assert clock.now() == datetime(2023, 6, 1, tzinfo=UTC)
    assert clock.set(datetime(2023, 6, 1, 9, tzinfo=timezone(timedelta(hours=9)))).tzinfo is UTC


def test_controlled_clock_rejects_naive_times_and_bad_durations():
    with pytest.raises(RunlaneError) as caught:
        ControlledClock(datetime(2024, 1, 1))
    assert caught.value.code is ErrorCode.CONFIGURATION_INVALID
    clock = ControlledClock()
    before = clock.now()
    with pytest.raises(RunlaneError):
        clock.set(datetime(2024, 1, 1))
    for bad in ("-1s", "0s", "soon", timedelta(seconds=-1), 5):
        with pytest.raises(RunlaneError):
            clock.advance(bad)
    assert clock.now() == before
