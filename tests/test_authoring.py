"""Defining work: queues, retry policies, schedules, tasks (schemas, payloads, keys) and release values."""

import dataclasses
import gc
import json
import warnings
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict

from runlane import (
    ErrorCode,
    RetryBackoffType,
    RunCompletionWaitCondition,
    RunlaneError,
    RunWaitConditionType,
    ScheduleType,
    SignalWaitCondition,
    TaskContext,
    TaskReleaseType,
)
from runlane.core.authoring import (
    Backoff,
    QueueDefinition,
    Retry,
    RetryPolicy,
    ScheduleDefinition,
    TaskDefinition,
    TaskRelease,
    build_run_wait,
    build_signal_wait,
    build_time_release,
    parse_idempotency_key_ttl,
    queue,
    schedule,
    task,
)

MAX_SAFE_INTEGER = 2**53 - 1
BAD_DURATIONS = ["5", "0s", "-1s", "1.5ms", "soon", "", 30, timedelta(0), timedelta(microseconds=1500)]


class Welcome(BaseModel):
    user_id: str


class Line(BaseModel):
    sku: str
    qty: int


class Order(BaseModel):
    id: str
    lines: list[Line]


class StrictEvent(BaseModel):
    model_config = ConfigDict(strict=True)

    at: datetime


def raises(code: ErrorCode):
    """Expect a ``RunlaneError`` with ``code``; yields the ``ExceptionInfo`` for message checks."""
    return pytest.raises(RunlaneError, check=lambda error: error.code is code)


def invalid():
    return raises(ErrorCode.CONFIGURATION_INVALID)


def welcome_task(**options: Any) -> TaskDefinition:
    @task("emails.welcome", **options)
    async def send_welcome(payload: Welcome, ctx) -> None:
        return None

    return send_welcome


# ---------------------------------------------------------------------------------------------
# Queues


def test_queue_defaults_to_an_unbounded_non_default_queue():
    emails = queue("emails")
    assert emails == QueueDefinition(name="emails")
    assert emails.default is False and emails.concurrency_limit is None and emails.dispatch_timeout_ms is None
    assert emails.is_bounded is False


def test_bounded_queue_resolves_its_dispatch_timeout_to_milliseconds():
    quickbooks = queue("quickbooks", concurrency_limit=2, dispatch_timeout="2m")
    assert quickbooks.is_bounded is True
    assert quickbooks.concurrency_limit == 2
    assert quickbooks.dispatch_timeout_ms == 120_000
    assert queue("quickbooks", concurrency_limit=2, dispatch_timeout=timedelta(minutes=2)) == quickbooks


def test_queues_with_the_same_policy_are_equal_and_different_policies_are_not():
    assert queue("emails", default=True) == queue("emails", default=True)
    assert queue("emails", default=True) != queue("emails")
    assert queue("billing", concurrency_limit=1) != queue("billing", concurrency_limit=2)


def test_queue_definitions_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        queue("emails").name = "other"  # type: ignore[misc]


@pytest.mark.parametrize("name", ["", "emails:eu", 7, None, "x" * 513])
def test_queue_name_must_be_a_valid_id(name):
    with invalid():
        queue(name)


@pytest.mark.parametrize("limit", [0, -1, True, 1.5, "2", MAX_SAFE_INTEGER + 1])
def test_concurrency_limit_must_be_a_positive_integer(limit):
    with invalid():
        queue("billing", concurrency_limit=limit)


def test_dispatch_timeout_without_a_concurrency_limit_is_rejected():
    with invalid() as caught:
        queue("emails", dispatch_timeout="2m")
    assert "concurrency_limit" in caught.value.message


@pytest.mark.parametrize("timeout", BAD_DURATIONS)
def test_dispatch_timeout_must_be_a_duration(timeout):
    with invalid():
        queue("billing", concurrency_limit=1, dispatch_timeout=timeout)


def test_queue_default_flag_must_be_a_boolean():
    with invalid():
        queue("emails", default="yes")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# Retry policies


def test_retry_is_the_retry_policy_class():
    assert Retry is RetryPolicy


def test_omitted_backoff_uses_the_contract_default_fixed_delay():
    policy = Retry(max_attempts=3)
    assert policy.backoff == Backoff(type=RetryBackoffType.FIXED, delay="30s")
    assert [policy.delay_ms_for(attempt) for attempt in (1, 2, 5)] == [30_000, 30_000, 30_000]


@pytest.mark.parametrize(
    ("attempts", "says"),
    [
        (0, "expected a positive whole number, got 0"),
        (True, "expected a positive whole number, got True"),
        (2**60, "1,152,921,504,606,846,976 is past 9,007,199,254,740,991, the largest whole number JSON keeps exact"),
    ],
)
def test_an_unusable_max_attempts_is_refused_saying_why(attempts, says):
    with pytest.raises(RunlaneError) as refused:
        Retry(attempts)
    assert refused.value.code is ErrorCode.CONFIGURATION_INVALID and says in refused.value.message


def test_string_backoff_is_fixed():
    policy = Retry(3, backoff="5s")
    assert policy.backoff.type is RetryBackoffType.FIXED
    assert [policy.delay_ms_for(attempt) for attempt in (1, 2, 3)] == [5_000, 5_000, 5_000]


def test_exponential_backoff_doubles_from_the_base_and_respects_max_delay():
    policy = Retry(10, backoff=Backoff(type=RetryBackoffType.EXPONENTIAL, delay="5s", max_delay="1m"))
    assert [policy.delay_ms_for(attempt) for attempt in range(1, 7)] == [5_000, 10_000, 20_000, 40_000, 60_000, 60_000]


def test_exponential_backoff_without_a_cap_stays_a_safe_integer():
    policy = Retry(3, backoff=Backoff(type="exponential", delay="1s"))
    assert policy.backoff.type is RetryBackoffType.EXPONENTIAL
    assert policy.delay_ms_for(3) == 4_000
    assert policy.delay_ms_for(10_000) == MAX_SAFE_INTEGER


def test_backoff_accepts_timedelta_durations():
    assert Backoff(RetryBackoffType.FIXED, timedelta(seconds=2)).delay_ms == 2_000


@pytest.mark.parametrize("attempts", [0, -1, True, 2.0, "3", None])
def test_retry_needs_a_positive_attempt_budget(attempts):
    with invalid():
        Retry(attempts)


def test_max_delay_below_delay_is_rejected():
    with invalid() as caught:
        Backoff(type=RetryBackoffType.EXPONENTIAL, delay="1m", max_delay="30s")
    assert "max_delay" in caught.value.message


def test_max_delay_equal_to_delay_is_allowed():
    backoff = Backoff(type=RetryBackoffType.EXPONENTIAL, delay="1m", max_delay="60s")
    assert backoff.max_delay_ms == backoff.delay_ms == 60_000


def test_max_delay_on_fixed_backoff_is_rejected():
    with invalid():
        Backoff(type=RetryBackoffType.FIXED, delay="1s", max_delay="1m")


def test_unknown_backoff_type_is_rejected():
    with invalid():
        Backoff(type="linear", delay="1s")


@pytest.mark.parametrize("delay", BAD_DURATIONS)
def test_backoff_delay_must_be_a_duration(delay):
    with invalid():
        Retry(3, backoff=delay)


def test_delay_is_computed_for_positive_attempt_numbers_only():
    with invalid():
        Retry(3).delay_ms_for(0)


@pytest.mark.parametrize("types", [(), "ValueError", ValueError(), (ValueError, "x"), int, (int,), [ValueError]])
@pytest.mark.parametrize("option", ["retry_on", "no_retry_on"])
def test_retry_exception_filters_take_exception_classes(option, types):
    with invalid() as caught:
        Retry(3, **{option: types})
    assert f"Retry {option} takes an exception class or a tuple of them" in caught.value.message


def test_retry_exception_filters_only_take_retries_away():
    assert Retry(3).retries(ValueError())
    limited = Retry(3, retry_on=(ConnectionError, TimeoutError), no_retry_on=ConnectionRefusedError)
    assert limited.retries(ConnectionResetError()) and limited.retries(TimeoutError())
    assert not limited.retries(ConnectionRefusedError())  # no_retry_on wins
    assert not limited.retries(ValueError())
    assert not Retry(3, no_retry_on=KeyError).retries(KeyError("k"))


def test_retry_exception_filters_look_inside_exception_groups():
    limited = Retry(3, retry_on=ConnectionError, no_retry_on=KeyError)
    nested = ExceptionGroup("tasks", [ConnectionResetError(), ExceptionGroup("inner", [TimeoutError()])])
    assert limited.retries(nested) is False  # a TimeoutError is no ConnectionError
    assert limited.retries(ExceptionGroup("tasks", [ConnectionResetError(), ConnectionRefusedError()]))
    assert not limited.retries(ExceptionGroup("tasks", [ConnectionResetError(), KeyError("k")]))
    assert not Retry(3, no_retry_on=KeyError).retries(ExceptionGroup("tasks", [ValueError(), KeyError("k")]))
    assert Retry(3, no_retry_on=KeyError).retries(ExceptionGroup("tasks", [ValueError()]))


def test_retry_policies_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Retry(3).max_attempts = 5  # type: ignore[misc]


# ---------------------------------------------------------------------------------------------
# Schedules


def test_schedule_kind_is_inferred_from_its_selector():
    daily = schedule("digests.daily", cron="0 9 * * *", time_zone="America/New_York")
    hourly = schedule("digests.hourly", every="1h", starts_at=datetime(2026, 1, 1, tzinfo=UTC))
    once = schedule("digests.launch", run_at=datetime(2026, 3, 1, 12, tzinfo=timezone(timedelta(hours=2))))
    assert (daily.type, daily.cron, daily.time_zone) == (ScheduleType.CRON, "0 9 * * *", "America/New_York")
    assert (hourly.type, hourly.every_ms) == (ScheduleType.INTERVAL, 3_600_000)
    assert hourly.starts_at == datetime(2026, 1, 1, tzinfo=UTC)
    assert (once.type, once.run_at) == (ScheduleType.ONCE, datetime(2026, 3, 1, 10, tzinfo=UTC))
    assert once.run_at.tzinfo is UTC
    assert daily.enabled is True and daily.queue is None


@pytest.mark.parametrize(
    "selectors",
    [{}, {"cron": "0 9 * * *", "every": "1h"}, {"every": "1h", "run_at": datetime(2026, 1, 1, tzinfo=UTC)}],
)
def test_schedule_needs_exactly_one_selector(selectors):
    with invalid() as caught:
        schedule("digests", **selectors)
    assert "exactly one" in caught.value.message


def test_schedule_id_must_be_a_valid_id():
    with invalid():
        schedule("digests:daily", every="1h")


def test_time_zone_applies_to_cron_only_and_must_exist():
    with invalid():
        schedule("digests", every="1h", time_zone="UTC")
    with invalid() as caught:
        schedule("digests", cron="0 9 * * *", time_zone="Mars/Olympus_Mons")
    assert "Mars/Olympus_Mons" in caught.value.message


def test_interval_bounds_apply_to_interval_schedules_only_and_must_be_ordered():
    start = datetime(2026, 1, 2, tzinfo=UTC)
    with invalid():
        schedule("digests", cron="0 9 * * *", starts_at=start)
    with invalid():
        schedule("digests", every="1h", starts_at=start, ends_at=start - timedelta(days=1))
    assert schedule("digests", every="1h", starts_at=start, ends_at=start).ends_at == start
    # Without starts_at the fire times count from the Unix epoch, so an end before it never fires.
    with invalid() as caught:
        schedule("legacy", every="1h", ends_at=datetime(1969, 12, 31, tzinfo=UTC))
    assert "ends_at must not be earlier than the Unix epoch, the anchor when starts_at is left" in caught.value.message
    assert schedule("legacy", every="1h", ends_at=datetime(1970, 1, 1, tzinfo=UTC)).starts_at is None


def test_schedule_times_must_be_timezone_aware():
    with invalid():
        schedule("digests", run_at=datetime(2026, 1, 1))
    with invalid():
        schedule("digests", every="1h", ends_at=datetime(2026, 1, 1))


@pytest.mark.parametrize("every", BAD_DURATIONS)
def test_interval_must_be_a_duration(every):
    with invalid():
        schedule("digests", every=every)


@pytest.mark.parametrize("cron", ["", "   ", 5])
def test_cron_must_be_a_non_empty_expression(cron):
    with invalid():
        schedule("digests", cron=cron)


def test_schedule_payload_is_optional_and_copied():
    omitted = schedule("digests", every="1h")
    assert (omitted.payload, omitted.has_payload) == (None, False)
    explicit_null = schedule("digests", every="1h", payload=None)
    assert (explicit_null.payload, explicit_null.has_payload) == (None, True)
    source = {"user_id": "user_123", "tags": ["a"]}
    copied = schedule("digests", every="1h", payload=source)
    source["tags"].append("b")
    assert copied.payload == {"user_id": "user_123", "tags": ["a"]}


def test_schedule_payload_must_be_json():
    with invalid():
        schedule("digests", every="1h", payload={"at": datetime(2026, 1, 1, tzinfo=UTC)})


def test_schedule_queue_and_enabled_are_checked():
    emails = queue("emails")
    assert schedule("digests", every="1h", queue=emails, enabled=False).queue is emails
    with invalid():
        schedule("digests", every="1h", queue="emails")  # type: ignore[arg-type]
    with invalid():
        schedule("digests", every="1h", enabled=0)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# Tasks: shape and schema


def test_task_returns_a_frozen_definition_holding_the_original_handler():
    emails = queue("emails", default=True)

    async def send_welcome(payload: Welcome, ctx) -> None:
        return None

    definition = task("emails.welcome", queue=emails, max_attempt_duration="5m")(send_welcome)
    assert isinstance(definition, TaskDefinition)
    assert definition.id == "emails.welcome"
    assert definition.handler is send_welcome
    assert definition.queue is emails
    assert definition.max_attempt_duration_ms == 300_000
    assert definition.schema is Welcome
    assert (definition.is_async, definition.takes_payload, definition.takes_context) == (True, True, True)
    assert definition.schedules == () and definition.retry is None
    assert "emails.welcome" in repr(definition)
    with pytest.raises(dataclasses.FrozenInstanceError):
        definition.id = "other"  # type: ignore[misc]


def test_task_definitions_compare_by_identity():
    assert welcome_task() != welcome_task()
    definition = welcome_task()
    assert definition == definition and {definition: 1}[definition] == 1


def test_schema_is_inferred_from_the_first_parameter_annotation():
    @task("numbers.sum")
    def add(payload: list[int]) -> int:
        return sum(payload)

    assert add.schema == list[int]
    assert (add.is_async, add.takes_payload, add.takes_context) == (False, True, False)
    assert add.validate_payload(["1", 2]) == [1, 2]


def test_string_annotations_are_resolved_in_the_handler_module():
    @task("emails.welcome")
    def send(payload: "Welcome") -> None:
        return None

    assert send.schema is Welcome
    assert send.validate_payload({"user_id": "u1"}) == Welcome(user_id="u1")


def test_only_the_payload_annotation_needs_to_resolve_at_run_time():
    # ctx and the return type imported under TYPE_CHECKING (with postponed annotations): names that exist
    # only for the type checker, which the payload schema does not need.
    @task("emails.welcome")
    async def send(payload: "Welcome", ctx: "TaskContext") -> "TaskRelease | None":  # noqa: F821
        return None

    @task("emails.welcome")
    def send_sync(payload: "list[Welcome]", ctx: "TaskContext") -> "NoSuchOutput":  # noqa: F821
        return None

    assert send.schema is Welcome and send.takes_context
    assert send_sync.validate_payload([{"user_id": "u1"}]) == [Welcome(user_id="u1")]
    with invalid() as caught:

        @task("emails.welcome")
        def broken(payload: "NoSuchModel", ctx: "TaskContext") -> None:  # noqa: F821
            return None

    assert "'NoSuchModel' is not defined" in caught.value.message


def test_unresolvable_string_annotation_asks_for_an_explicit_schema():
    with invalid() as caught:

        @task("emails.welcome")
        def send(payload: "NoSuchModel") -> None:  # noqa: F821 - the missing name is the point
            return None

    assert "schema=" in caught.value.message


def test_a_lone_context_parameter_is_refused_with_the_forms_that_take_one():
    with invalid() as caught:

        @task("cache.clear")
        async def clear(ctx: TaskContext) -> None:
            return None

    assert "the first parameter is the payload" in caught.value.message
    assert "current_task_context()" in caught.value.message and "arbitrary_types_allowed" not in caught.value.message


def test_explicit_schema_wins_over_the_annotation():
    @task("emails.welcome", schema=Welcome)
    def send(payload: dict, ctx) -> None:
        return None

    assert send.schema is Welcome
    assert send.validate_payload({"user_id": "u1"}) == Welcome(user_id="u1")


def test_explicit_schema_may_be_any_type_adapter_type():
    @task("numbers.pair", schema=tuple[int, int])
    def pair(payload):
        return list(payload)

    assert pair.validate_payload([1, "2"]) == (1, 2)
    assert pair.dump_payload((1, 2)) == [1, 2]


def test_unannotated_payload_accepts_any_json_value():
    @task("anything")
    def handle(payload, ctx):
        return None

    assert handle.schema is Any
    assert handle.validate_payload({"a": [1, None]}) == {"a": [1, None]}
    assert handle.takes_context is True


def test_handler_without_parameters_takes_no_payload():
    @task("maintenance.ping")
    async def ping() -> None:
        return None

    assert (ping.takes_payload, ping.takes_context, ping.schema) == (False, False, None)
    assert ping.validate_payload(None) is None
    assert ping.load_payload(None) is None
    assert ping.dump_payload(None) is None
    with raises(ErrorCode.VALIDATION_FAILED) as caught:
        ping.validate_payload({"unexpected": True})
    assert "takes no payload" in caught.value.message


def test_schema_without_a_payload_parameter_is_rejected():
    with invalid():

        @task("maintenance.ping", schema=Welcome)
        def ping() -> None:
            return None


# {"user_id": str}: a dict describing the shape, which pydantic fails on with a bare KeyError.
@pytest.mark.parametrize("schema", [3, "NoSuchType", object(), {"user_id": str}])
def test_unusable_schema_is_rejected(schema):
    with invalid() as caught:

        @task("emails.welcome", schema=schema)
        def send(payload) -> None:
            return None

    assert "payload schema" in caught.value.message


def test_async_callable_objects_are_async_handlers():
    class Handler:
        async def __call__(self, payload: Welcome) -> None:
            return None

    definition = task("emails.welcome")(Handler())
    assert definition.is_async is True and definition.schema is Welcome


def test_bare_task_decorator_is_rejected_with_a_hint():
    with invalid() as caught:

        @task  # type: ignore[arg-type]
        def send(payload: Welcome) -> None:
            return None

    assert '@task("' in caught.value.message


def test_task_id_must_be_a_valid_id():
    with invalid():
        task("emails:welcome")


def make_handler(kind: str):
    if kind == "three":

        def handler(payload, ctx, extra):
            return None

    elif kind == "varargs":

        def handler(*args):
            return None

    elif kind == "keyword_only":

        def handler(payload, *, required):
            return None

    elif kind == "generator":

        def handler(payload):
            yield payload

    else:
        handler = "not callable"
    return handler


@pytest.mark.parametrize("kind", ["three", "varargs", "keyword_only", "generator", "not_callable"])
def test_unsupported_handler_shapes_are_rejected(kind):
    with invalid():
        task("weird")(make_handler(kind))


def test_optional_keyword_parameters_are_allowed():
    @task("emails.welcome")
    def send(payload: Welcome, ctx, *, dry_run: bool = False, **extra) -> None:
        return None

    assert send.takes_context is True


@pytest.mark.parametrize("duration", BAD_DURATIONS)
def test_max_attempt_duration_must_be_a_duration(duration):
    with invalid():
        task("emails.welcome", max_attempt_duration=duration)


@pytest.mark.parametrize("retry", [3, {"max_attempts": 3}, "30s"])
def test_retry_option_must_be_a_retry_policy(retry):
    with invalid():
        task("emails.welcome", retry=retry)


def test_task_queue_must_be_a_queue_definition():
    with invalid() as caught:
        task("emails.welcome", queue="emails")  # type: ignore[arg-type]
    assert "queue(" in caught.value.message


# ---------------------------------------------------------------------------------------------
# Tasks: payload validation and storage


def test_payload_validation_error_names_the_task_and_locations():
    @task("orders.import")
    def import_order(payload: Order) -> None:
        return None

    with raises(ErrorCode.VALIDATION_FAILED) as caught:
        import_order.validate_payload({"lines": [{"sku": "a", "qty": "many"}], "secret": "x"})
    error = caught.value
    assert "orders.import" in error.message
    assert "id: Field required" in error.message
    assert "lines[0].qty" in error.message
    assert error.meta["task_id"] == "orders.import"
    assert error.meta["error_count"] == 2
    assert [item["loc"] for item in error.meta["errors"]] == [["id"], ["lines", 0, "qty"]]
    assert {item["type"] for item in error.meta["errors"]} == {"missing", "int_parsing"}
    assert json.loads(json.dumps(error.meta)) == error.meta
    # Payload values stay out of errors that may be persisted or printed.
    assert "many" not in json.dumps(error.meta) and "many" not in error.message


def test_payload_validation_errors_are_capped_with_the_total_kept():
    @task("numbers.sum")
    def add(payload: list[int]) -> None:
        return None

    with raises(ErrorCode.VALIDATION_FAILED) as caught:
        add.validate_payload(["x"] * 50)
    assert caught.value.meta["error_count"] == 50
    assert len(caught.value.meta["errors"]) == 20
    assert "and 47 more" in caught.value.message


def test_whole_payload_errors_are_reported_at_the_payload():
    @task("numbers.sum")
    def add(payload: list[int]) -> None:
        return None

    with raises(ErrorCode.VALIDATION_FAILED) as caught:
        add.validate_payload("not a list")
    assert "payload: " in caught.value.message


def test_stored_payloads_round_trip_through_json_mode_validation():
    @task("events.record")
    def record(payload: StrictEvent) -> None:
        return None

    at = datetime(2026, 1, 1, 9, tzinfo=UTC)
    validated = record.validate_payload(StrictEvent(at=at))
    stored = record.dump_payload(validated)
    assert stored == {"at": "2026-01-01T09:00:00Z"}
    # Strict models reject the ISO string as a Python value but accept it as JSON: loading uses JSON mode,
    # and so does a caller's payload of plain JSON data (a webhook body, the CLI's argument).
    assert record.load_payload(stored) == StrictEvent(at=at)
    assert record.validate_payload(stored) == StrictEvent(at=at)
    with raises(ErrorCode.VALIDATION_FAILED) as caught:
        record.validate_payload({"at": "next tuesday"})
    assert caught.value.meta["errors"][0]["loc"] == ["at"]


def test_stored_payload_that_no_longer_matches_is_a_validation_failure():
    with raises(ErrorCode.VALIDATION_FAILED) as caught:
        welcome_task().load_payload({"user": "old-shape"})
    assert "stored payload" in caught.value.message
    # Nobody can send the stored payload again (a retry or rerun takes none): say what can be done instead.
    assert caught.value.message.endswith("trigger a new run with one that does.")


def test_payload_that_cannot_be_stored_as_json_is_a_validation_failure():
    @task("anything")
    def handle(payload: Any) -> None:
        return None

    @task("ratios.record")
    def record(payload: float) -> None:
        return None

    with raises(ErrorCode.VALIDATION_FAILED):
        handle.dump_payload({"handle": object()})
    with raises(ErrorCode.VALIDATION_FAILED):
        record.dump_payload(record.validate_payload(float("nan")))


# ---------------------------------------------------------------------------------------------
# Tasks: keys and idempotency TTL


def test_static_keys_are_returned_as_given():
    definition = welcome_task(idempotency_key="welcome", singleton_key="mailer", concurrency_key="tenant_1")
    payload = Welcome(user_id="u1")
    assert definition.resolve_key("idempotency_key", payload) == "welcome"
    assert definition.resolve_key("singleton_key", payload) == "mailer"
    assert definition.resolve_key("concurrency_key", payload) == "tenant_1"


def test_unset_keys_resolve_to_none():
    assert welcome_task().resolve_key("singleton_key", Welcome(user_id="u1")) is None


def test_callable_keys_receive_the_validated_payload():
    definition = welcome_task(idempotency_key=lambda payload: f"welcome.{payload.user_id}")
    assert definition.resolve_key("idempotency_key", definition.validate_payload({"user_id": "u7"})) == "welcome.u7"


@pytest.mark.parametrize("result", ["welcome:u1", "", None, 42])
def test_callable_key_results_must_be_valid_ids(result):
    definition = welcome_task(singleton_key=lambda payload: result)
    with invalid() as caught:
        definition.resolve_key("singleton_key", Welcome(user_id="u1"))
    assert "emails.welcome" in caught.value.message


def test_a_raising_key_resolver_becomes_a_configuration_error_with_its_cause():
    definition = welcome_task(concurrency_key=lambda payload: payload.missing_field)
    with invalid() as caught:
        definition.resolve_key("concurrency_key", Welcome(user_id="u1"))
    assert isinstance(caught.value.__cause__, AttributeError)
    assert "concurrency key resolver" in caught.value.message


def test_a_key_resolver_may_raise_its_own_runlane_error():
    def refuse(payload):
        raise RunlaneError(ErrorCode.VALIDATION_FAILED, "No key for this tenant.")

    with raises(ErrorCode.VALIDATION_FAILED):
        welcome_task(idempotency_key=refuse).resolve_key("idempotency_key", Welcome(user_id="u1"))


@pytest.mark.parametrize("key", ["bad:key", "", 42, ["a"]])
def test_static_keys_are_validated_when_the_task_is_defined(key):
    with invalid():
        task("emails.welcome", singleton_key=key)


async def _async_key(payload: Any) -> str:
    return "welcome"


def _generator_key(payload: Any) -> Any:
    yield "welcome"


@pytest.mark.parametrize("resolver", [_async_key, _generator_key])
def test_a_key_resolver_that_cannot_return_a_key_is_refused_when_the_task_is_defined(resolver):
    # Its call gives a coroutine or a generator, never a key: every trigger would fail (and an
    # un-awaited coroutine warn), so the definition says what to write instead.
    with invalid() as caught:
        task("emails.welcome", idempotency_key=resolver)
    assert caught.value.meta["field"] == "idempotency_key"
    assert "plain function" in caught.value.message


def test_a_key_resolver_returning_a_coroutine_is_refused_without_leaving_it_unawaited():
    with invalid():
        task("emails.welcome", singleton_key=type("Resolver", (), {"__call__": _async_key})())
    definition = welcome_task(singleton_key=lambda payload: _async_key(payload))
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")  # a coroutine never awaited warns when it is collected
        with invalid() as caught:
            definition.resolve_key("singleton_key", Welcome(user_id="u1"))
        message = caught.value.message
        del caught  # its traceback holds the coroutine
        gc.collect()
    assert "plain function" in message
    assert [str(warning.message) for warning in warned] == []


def test_unknown_key_kind_is_a_programming_error():
    with pytest.raises(ValueError):
        welcome_task().resolve_key("tenant_key", None)  # type: ignore[arg-type]


def test_idempotency_key_ttl_without_a_key_is_rejected():
    with invalid() as caught:
        task("emails.welcome", idempotency_key_ttl="7d")
    assert "idempotency_key" in caught.value.message


def test_idempotency_key_ttl_is_active_or_milliseconds():
    assert welcome_task(idempotency_key="k", idempotency_key_ttl="active").idempotency_key_ttl == "active"
    assert welcome_task(idempotency_key="k", idempotency_key_ttl="7d").idempotency_key_ttl == 7 * 86_400_000
    assert welcome_task(idempotency_key="k").idempotency_key_ttl is None
    assert parse_idempotency_key_ttl(timedelta(hours=1)) == 3_600_000
    with invalid() as caught:
        welcome_task(idempotency_key="k", idempotency_key_ttl="forever")
    assert caught.value.message.endswith("'forever': use 'active' or a duration such as '1h' or '7d'.")
    with invalid() as caught:
        parse_idempotency_key_ttl("0s")
    assert caught.value.message.endswith("it must be positive.")


# ---------------------------------------------------------------------------------------------
# Tasks: colocated schedules


def test_task_accepts_one_schedule_or_a_list():
    daily = schedule("digests.daily", cron="0 9 * * *", payload={"user_id": "u1"})
    weekly = schedule("digests.weekly", cron="0 9 * * 1", payload={"user_id": "u1"})
    assert welcome_task(schedule=daily).schedules == (daily,)
    assert welcome_task(schedule=[daily, weekly]).schedules == (daily, weekly)


def test_schedule_payload_is_validated_against_the_task_schema_at_definition():
    with invalid() as caught:
        welcome_task(schedule=schedule("digests.daily", every="1d", payload={"user": "u1"}))
    error = caught.value
    assert "digests.daily" in error.message and "emails.welcome" in error.message
    assert error.meta["schedule_id"] == "digests.daily"
    assert error.meta["errors"][0]["loc"] == ["user_id"]


def test_omitted_schedule_payload_must_be_accepted_by_the_schema():
    with invalid() as caught:
        welcome_task(schedule=schedule("digests.daily", every="1d"))
    assert "payload=" in caught.value.message

    @task("maintenance.optional", schedule=schedule("maintenance.hourly", every="1h"))
    def optional(payload: Welcome | None) -> None:
        return None

    @task("maintenance.ping", schedule=schedule("maintenance.ping.hourly", every="1h"))
    def ping() -> None:
        return None

    assert optional.schedules[0].has_payload is False and ping.schedules[0].has_payload is False


def test_schedule_payload_for_a_task_without_payload_is_rejected():
    with invalid():

        @task("maintenance.ping", schedule=schedule("maintenance.hourly", every="1h", payload={"x": 1}))
        def ping() -> None:
            return None


def test_schedule_ids_must_be_unique_within_a_task():
    with invalid():
        welcome_task(schedule=[schedule("d", every="1h", payload={"user_id": "a"})] * 2)


@pytest.mark.parametrize("value", ["digests.daily", {"id": "digests.daily"}, [schedule("d", every="1h"), "x"]])
def test_task_schedule_option_takes_schedule_definitions_only(value):
    with invalid():
        task("maintenance.ping", schedule=value)


def test_schedule_definitions_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        schedule("d", every="1h").enabled = False  # type: ignore[misc]
    assert isinstance(schedule("d", every="1h"), ScheduleDefinition)


# ---------------------------------------------------------------------------------------------
# Release values


def test_time_release():
    release = build_time_release("5m", reason="provider_not_ready", meta={"attempted": 2})
    assert release.type is TaskReleaseType.RELEASE and release.type == "task_release"
    assert release.wait_type is RunWaitConditionType.TIME
    assert (release.delay_ms, release.signal_key, release.run_id, release.timeout_ms) == (300_000, None, None, None)
    assert (release.reason, release.meta) == ("provider_not_ready", {"attempted": 2})
    assert release.wait_condition(datetime(2026, 1, 1, tzinfo=UTC)) is None


def test_signal_wait_with_timeout_builds_its_wait_condition():
    now = datetime(2026, 1, 1, tzinfo=UTC)
    release = build_signal_wait("report_ready_r1", timeout="1h", reason="webhook_pending")
    assert release.wait_type is RunWaitConditionType.SIGNAL
    assert (release.signal_key, release.timeout_ms) == ("report_ready_r1", 3_600_000)
    assert release.delay_ms is None
    expected = SignalWaitCondition(signal_key="report_ready_r1", timeout_at=now + timedelta(hours=1))
    assert release.wait_condition(now) == expected


def test_run_wait_without_timeout_builds_its_wait_condition():
    now = datetime(2026, 1, 1, tzinfo=UTC)
    release = build_run_wait("run_abc")
    assert release.wait_type is RunWaitConditionType.RUN_COMPLETION
    assert (release.run_id, release.timeout_ms) == ("run_abc", None)
    assert release.wait_condition(now) == RunCompletionWaitCondition(run_id="run_abc")


@pytest.mark.parametrize("delay", BAD_DURATIONS + [None])
def test_release_delay_must_be_a_duration(delay):
    with invalid():
        build_time_release(delay)


@pytest.mark.parametrize("timeout", BAD_DURATIONS)
def test_wait_timeouts_must_be_durations(timeout):
    with invalid():
        build_signal_wait("ready", timeout=timeout)
    with invalid():
        build_run_wait("run_1", timeout=timeout)


@pytest.mark.parametrize("key", ["report:ready", "", None, 3])
def test_wait_targets_must_be_valid_ids(key):
    with invalid():
        build_signal_wait(key)
    with invalid():
        build_run_wait(key)


@pytest.mark.parametrize(
    "meta", [["not", "an", "object"], {"at": datetime(2026, 1, 1, tzinfo=UTC)}, {1: "int key"}, {"x": float("inf")}]
)
def test_release_meta_must_be_a_json_object(meta):
    with invalid():
        build_time_release("1s", meta=meta)


@pytest.mark.parametrize("reason", ["", 5])
def test_release_reason_must_be_a_non_empty_string(reason):
    with invalid():
        build_signal_wait("ready", reason=reason)


def test_release_meta_is_detached_from_the_caller():
    meta = {"tags": ["a"]}
    release = build_time_release("1s", meta=meta)
    meta["tags"].append("b")
    assert release.meta == {"tags": ["a"]}


@pytest.mark.parametrize(
    "fields",
    [
        {"wait_type": RunWaitConditionType.TIME},
        {"wait_type": RunWaitConditionType.TIME, "delay_ms": 1000, "timeout_ms": 5},
        {"wait_type": RunWaitConditionType.SIGNAL, "signal_key": "ready", "run_id": "run_1"},
        {"wait_type": RunWaitConditionType.RUN_COMPLETION, "delay_ms": 1000},
        {"wait_type": RunWaitConditionType.TIME, "delay_ms": 0},
        {"wait_type": "sleep", "delay_ms": 1000},
    ],
)
def test_inconsistent_release_values_are_rejected(fields):
    with invalid():
        TaskRelease(**fields)


def test_releases_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        build_time_release("1s").delay_ms = 5  # type: ignore[misc]
