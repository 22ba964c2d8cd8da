"""Bad input is rejected with the spec's error code before anything is written."""

from __future__ import annotations

from datetime import timedelta

import pytest
from pydantic import BaseModel

from runlane import (
    ErrorCode,
    RunlaneError,
    RunStatus,
    StorageConflictKind,
    get_storage_conflict_kind,
    queue,
    task,
)

from runtime_support import DEFAULT_QUEUE, all_runs, event_types, make_runtime


class Order(BaseModel):
    order_id: str
    amount: int


bounded = queue("bounded", concurrency_limit=1)
unregistered = queue("unregistered")


@task("orders.charge")
async def charge(payload: Order) -> None:
    return None


@task("orders.keyed", idempotency_key=lambda p: p["key"], singleton_key=lambda p: p.get("single", "ok"))
async def keyed(payload: dict) -> None:
    return None


@task("orders.bounded", queue=bounded)
async def bounded_task(payload: dict) -> None:
    return None


@task("unregistered.task")
async def not_registered(payload: dict) -> None:
    return None


def _runtime():
    return make_runtime(charge, keyed, bounded_task, queues=[DEFAULT_QUEUE, bounded])


@pytest.mark.parametrize(
    "payload",
    [None, {}, {"order_id": "o1"}, {"order_id": "o1", "amount": "lots"}, ["o1", 5], "o1"],
)
async def test_invalid_payloads_fail_validation_before_any_write(payload):
    runtime, _ = _runtime()
    async with runtime:
        for call in (runtime.trigger, runtime.run_now):
            with pytest.raises(RunlaneError) as raised:
                await call(charge, payload)
            assert raised.value.code is ErrorCode.VALIDATION_FAILED
            assert raised.value.meta["errors"]
        assert await all_runs(runtime) == []


class Reading(BaseModel):
    sensor: str
    values: dict
    scale: float = 1.0


@task("readings.store")
async def store_reading(payload: Reading) -> None:
    return None


@pytest.mark.parametrize(
    "task_, payload, path",
    [
        (keyed, {"key": "k1", "ratio": float("nan")}, "$.ratio"),
        (keyed, {"key": "k2", "series": [1.0, {"peak": float("inf")}]}, "$.series[1].peak"),
        (store_reading, {"sensor": "s1", "values": {"t": float("-inf")}}, "$.values.t"),
        (store_reading, Reading(sensor="s1", values={}, scale=float("nan")), "$.scale"),
    ],
)
async def test_nan_or_infinity_in_a_payload_is_refused_not_turned_into_null(task_, payload, path):
    # pydantic's JSON mode writes these as null under untyped fields; storing that would change the data.
    runtime, _ = make_runtime(keyed, store_reading)
    async with runtime:
        with pytest.raises(RunlaneError) as raised:
            await runtime.trigger(task_, payload)
        assert raised.value.code is ErrorCode.VALIDATION_FAILED
        assert raised.value.meta["path"] == path
        assert "NaN or infinite" in raised.value.message
        assert await all_runs(runtime) == []


async def test_a_payload_nested_too_deeply_for_json_is_a_validation_error_before_any_write():
    nested: list = []
    innermost = nested
    for _ in range(5000):
        innermost.append([])
        innermost = innermost[0]
    runtime, _ = make_runtime(keyed)
    async with runtime:
        with pytest.raises(RunlaneError) as raised:
            await runtime.trigger(keyed, {"key": "k1", "series": nested})
        assert raised.value.code is ErrorCode.VALIDATION_FAILED
        assert "nested more than 200 levels deep at $.series[0]" in raised.value.message
        assert await all_runs(runtime) == []


async def test_a_key_with_a_lone_surrogate_in_an_untyped_payload_is_named_before_any_write():
    # What json.loads makes of '{"\\udcff": 1}' (a webhook body, the CLI): refused with only the encoder's
    # "'utf-8' codec can't encode character", which said neither where nor what to send instead.
    runtime, _ = _runtime()
    async with runtime:
        with pytest.raises(RunlaneError) as raised:
            await runtime.trigger(keyed, {"key": "k1", "tags": {"\udcff": 1}})
        assert raised.value.code is ErrorCode.VALIDATION_FAILED
        assert raised.value.message.startswith(
            "Invalid payload for task 'orders.keyed': object keys must be valid Unicode (no lone surrogates) at $.tags."
        )
        assert raised.value.meta["path"] == "$.tags"
        assert await all_runs(runtime) == []


async def test_an_integer_too_long_for_json_is_a_validation_error_before_any_write():
    runtime, _ = make_runtime(keyed)
    async with runtime:
        with pytest.raises(RunlaneError) as raised:
            await runtime.trigger(keyed, {"key": "k1", "count": 10**5000})
        assert raised.value.code is ErrorCode.VALIDATION_FAILED and "too many digits" in raised.value.message
        assert await all_runs(runtime) == []
        assert (await runtime.trigger(keyed, {"key": "k1", "count": 10**1000})).outcome.value == "created"


async def test_unknown_tasks_are_not_found():
    runtime, _ = _runtime()
    async with runtime:
        for unknown in (not_registered, "unregistered.task"):
            with pytest.raises(RunlaneError) as raised:
                await runtime.trigger(unknown, {})
            assert raised.value.code is ErrorCode.TASK_NOT_FOUND
        with pytest.raises(RunlaneError) as raised:
            await runtime.trigger(42, {})  # type: ignore[arg-type]
        assert raised.value.code is ErrorCode.CONFIGURATION_INVALID
        assert await all_runs(runtime) == []


VALID = {"order_id": "o1", "amount": 5}


@pytest.mark.parametrize(
    "options",
    [
        {"queue": unregistered},
        {"queue": "unregistered"},
        {"queue": queue("bounded", concurrency_limit=5)},
        {"queue": 7},
        {"idempotency_key": "a:b"},
        {"idempotency_key": ""},
        {"singleton_key": "x" * 600},
        {"concurrency_key": "tenant"},
        {"idempotency_key_ttl": "1h"},
        {"idempotency_key": "k", "idempotency_key_ttl": "forever"},
        {"idempotency_key": "k", "idempotency_key_ttl": timedelta(0)},
        {"meta": {"when": object()}},
        {"meta": ["not", "an", "object"]},
        {"trace_carrier": {"traceparent": 1}},
        {"trace_carrier": {"baggage": "k=" + "v" * 20_000}},
        {"actor": "operator"},
        {"run_id": "run:1"},
    ],
)
async def test_invalid_trigger_options_are_configuration_errors(options):
    runtime, _ = _runtime()
    async with runtime:
        with pytest.raises(RunlaneError) as raised:
            await runtime.trigger(charge, VALID, **options)
        assert raised.value.code is ErrorCode.CONFIGURATION_INVALID
        with pytest.raises(RunlaneError):
            await runtime.run_now(charge, VALID, **options)
        assert await all_runs(runtime) == []


@pytest.mark.parametrize("payload", [{"key": "a:b"}, {"key": 5}, {"key": "ok", "single": ""}, {}])
async def test_bad_resolved_keys_are_configuration_errors(payload):
    runtime, _ = _runtime()
    async with runtime:
        with pytest.raises(RunlaneError) as raised:
            await runtime.trigger(keyed, payload)
        assert raised.value.code is ErrorCode.CONFIGURATION_INVALID
        assert await all_runs(runtime) == []


async def test_an_explicit_run_id_that_exists_conflicts_and_leaves_the_first_run_intact():
    runtime, _ = _runtime()
    async with runtime:
        first = (await runtime.trigger(charge, VALID, run_id="run_fixed")).run
        with pytest.raises(RunlaneError) as raised:
            await runtime.trigger(charge, {"order_id": "o2", "amount": 1}, run_id="run_fixed")
        assert get_storage_conflict_kind(raised.value) is StorageConflictKind.EVENT_SEQUENCE
        assert await runtime.runs.get("run_fixed") == first
        assert await event_types(runtime, "run_fixed") == ["run.created", "run.delivery_requested"]


async def test_a_failed_singleton_creation_writes_no_idempotency_owner():
    runtime, _ = _runtime()
    async with runtime:
        await runtime.trigger(keyed, {"key": "k1", "single": "s"})
        with pytest.raises(RunlaneError):
            await runtime.trigger(keyed, {"key": "k2", "single": "s"})
        assert await runtime.runs.find_current(task=keyed, idempotency_key="k2") is None
        assert len(await all_runs(runtime)) == 1


@pytest.mark.parametrize(
    "call",
    [
        lambda rt: rt.runs.get("bad:id"),
        lambda rt: rt.runs.get(""),
        lambda rt: rt.runs.events("run:x"),
        lambda rt: rt.runs.cancel("run:x"),
        lambda rt: rt.runs.events("run_1", limit=0),
        lambda rt: rt.runs.events("run_1", cursor="garbage"),
        lambda rt: rt.runs.list(statuses=["exploded"]),
    ],
)
async def test_operator_reads_validate_their_input(call):
    runtime, _ = _runtime()
    async with runtime:
        await runtime.trigger(charge, VALID, run_id="run_1")
        with pytest.raises(RunlaneError) as raised:
            await call(runtime)
        assert raised.value.code is ErrorCode.VALIDATION_FAILED


async def test_missing_runs_are_reported():
    runtime, _ = _runtime()
    async with runtime:
        assert await runtime.runs.get("run_missing") is None
        with pytest.raises(RunlaneError) as raised:
            await runtime.runs.events("run_missing")
        assert raised.value.code is ErrorCode.RUN_NOT_FOUND


async def test_a_key_resolver_that_raises_is_a_configuration_error():
    @task("resolver.raises", idempotency_key=lambda p: p["missing"])
    async def raising(payload: dict) -> None:
        return None

    runtime, _ = make_runtime(raising)
    async with runtime:
        with pytest.raises(RunlaneError) as raised:
            await runtime.trigger(raising, {})
        assert raised.value.code is ErrorCode.CONFIGURATION_INVALID
        assert await all_runs(runtime) == []


async def test_a_valid_trigger_after_rejections_still_works():
    runtime, _ = _runtime()
    async with runtime:
        with pytest.raises(RunlaneError):
            await runtime.trigger(charge, {})
        run = (await runtime.trigger(charge, VALID)).run
        assert (await runtime.execute_next()).id == run.id
        assert (await runtime.runs.get(run.id)).status is RunStatus.SUCCEEDED


# What ``os.listdir()`` gives for a file name that is not UTF-8: text with a lone surrogate, which no
# storage can encode. Refused where it is given, not when a write fails later.
UNDECODABLE = b"report-\xff.csv".decode("utf-8", "surrogateescape")


async def test_a_release_reason_that_is_not_valid_unicode_fails_the_attempt_once():
    calls: list[int] = []

    @task("files.wait")
    async def wait_for_file(payload: dict, ctx) -> object:
        calls.append(ctx.attempt)
        return ctx.release("1m", reason=f"waiting for {UNDECODABLE}")

    runtime, clock = make_runtime(wait_for_file)
    async with runtime:
        await runtime.trigger(wait_for_file, {})
        done = await runtime.execute_next()
        assert done.status is RunStatus.FAILED and done.failure.code is ErrorCode.CONFIGURATION_INVALID
        assert done.failure.meta == {"field": "reason"}
        clock.advance("10m")  # nothing is left running for maintenance to take over
        await runtime.tick()
        assert await runtime.execute_next() is None and calls == [1]


async def test_a_cancel_reason_or_actor_id_that_is_not_valid_unicode_is_refused_before_any_write():
    from runlane import Actor, ActorType

    runtime, _ = _runtime()
    async with runtime:
        run = (await runtime.trigger(keyed, {"key": "k"})).run
        with pytest.raises(RunlaneError) as caught:
            await runtime.runs.cancel(run.id, reason=f"bad {UNDECODABLE}")
        assert caught.value.code is ErrorCode.CONFIGURATION_INVALID and caught.value.meta == {"field": "reason"}
        assert "not valid Unicode text" in caught.value.message
        operator = Actor(type=ActorType.OPERATOR, id=f"ops-{UNDECODABLE}")
        with pytest.raises(RunlaneError) as caught:
            await runtime.runs.cancel(run.id, actor=operator)
        assert caught.value.code is ErrorCode.CONFIGURATION_INVALID and caught.value.meta == {"field": "actor"}
        with pytest.raises(RunlaneError) as caught:
            await runtime.trigger(keyed, {"key": "other"}, actor=operator)
        assert caught.value.code is ErrorCode.CONFIGURATION_INVALID and caught.value.meta == {"field": "actor"}
        with pytest.raises(RunlaneError) as caught:
            await runtime.runs.prune(older_than="1d", actor=operator)
        assert caught.value.code is ErrorCode.CONFIGURATION_INVALID and caught.value.meta == {"field": "actor"}
        with pytest.raises(RunlaneError) as caught:
            await runtime.runs.prune(older_than="1d", actor="ops")  # type: ignore[arg-type]
        assert caught.value.code is ErrorCode.CONFIGURATION_INVALID and caught.value.meta == {"field": "actor"}
        assert (await runtime.runs.get(run.id)).status is RunStatus.QUEUED
        assert await event_types(runtime, run.id) == ["run.created", "run.delivery_requested"]
        assert len(await all_runs(runtime)) == 1


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("", "at least 1 character"),
        ("a\x00b", "it contains NUL"),
        ("prod\udcff", "lone surrogate (bytes that are not UTF-8"),
        ("\U0001f600" * 51, "longer than 200 bytes of UTF-8"),  # 51 characters, 204 bytes
        ("x" * 201, "longer than 200 bytes of UTF-8"),
    ],
)
def test_an_environment_name_no_lane_can_store_is_refused_by_create_runlane(name: str, problem: str):
    """The name is part of every key a lane writes: one that works in memory must work on Postgres too."""
    from runlane import create_runlane
    from runlane_local import local_lane

    with pytest.raises(RunlaneError) as raised:
        create_runlane(lane=local_lane(), queues=[DEFAULT_QUEUE], tasks=[charge], environment=name)
    assert raised.value.code is ErrorCode.CONFIGURATION_INVALID and raised.value.meta == {"field": "environment"}
    assert problem in raised.value.message and len(raised.value.message) < 200
    create_runlane(lane=local_lane(), queues=[DEFAULT_QUEUE], tasks=[charge], environment="\U0001f600" * 50)
