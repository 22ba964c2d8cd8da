"""More bad input through the public API: worker slot counts, clocks, listing filters and contexts kept
past their attempt. Each is a ``RunlaneError`` with the spec's code, and nothing is written."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest

from runlane import (
    WorkerMode,
    ErrorCode,
    RunlaneError,
    RunStatus,
    StorageConflictKind,
    TaskContext,
    create_runlane,
    get_storage_conflict_kind,
    queue,
    task,
)
from runlane.core.runtime import MAX_TRACE_CARRIER_BYTES, MAX_WORKER_CONCURRENCY
from runlane.testing import ControlledClock
from runlane_local import local_lane

from cli_support import cli, make_project
from runtime_support import DEFAULT_QUEUE, all_runs, make_runtime

kept: dict[str, TaskContext] = {}


@task("more.child")
async def child(payload: dict) -> None:
    return None


@task("more.parent")
async def parent(payload: dict, ctx: TaskContext) -> None:
    kept["async"] = ctx  # kept past the attempt, as a callback or a background task might


@task("more.sync_parent")
def sync_parent(payload: dict, ctx: TaskContext) -> None:
    kept["def"] = ctx


@task("more.waits")
async def waits(payload: dict, ctx: TaskContext):
    return ctx.wait_for_signal("go")


@task("more.keyed", idempotency_key=lambda p: p["key"], singleton_key=lambda p: p["key"])
async def keyed(payload: dict) -> None:
    return None


# ---------------------------------------------------------------------------------------------
# Worker slots


async def test_a_worker_with_more_slots_than_the_bound_is_refused_before_it_starts():
    runtime, _ = make_runtime(child)
    async with runtime:
        with pytest.raises(RunlaneError) as raised:
            runtime.worker(mode="drain", concurrency=MAX_WORKER_CONCURRENCY + 1)
        assert raised.value.code is ErrorCode.CONFIGURATION_INVALID
        assert raised.value.meta == {"field": "concurrency", "max": MAX_WORKER_CONCURRENCY}
        assert "at most 10,000" in raised.value.message and "more worker processes" in raised.value.message
        with pytest.raises(RunlaneError) as raised:
            runtime.worker(mode="drain", concurrency=1_000_000_000)  # would hold the loop making slots
        assert raised.value.code is ErrorCode.CONFIGURATION_INVALID
        # The bound itself is a worker like any other.
        await runtime.trigger(child, {})
        handle = runtime.worker(mode="drain", concurrency=MAX_WORKER_CONCURRENCY)
        await asyncio.wait_for(handle.closed, 30)
        assert handle.executed == 1


def test_the_sync_worker_has_the_same_bound():
    runtime, _ = make_runtime(child)
    with runtime.sync as sync:
        with pytest.raises(RunlaneError) as raised:
            sync.worker(mode="drain", concurrency=MAX_WORKER_CONCURRENCY + 1)
        assert raised.value.code is ErrorCode.CONFIGURATION_INVALID
        assert raised.value.meta["field"] == "concurrency"


@pytest.mark.parametrize("command", [["work", "--drain"], ["dev", "--once"]])
def test_the_cli_refuses_more_slots_than_the_bound_before_it_does_anything(tmp_path: Path, command: list[str]):
    project = make_project(tmp_path)
    result = cli(project, *command, "--concurrency", str(MAX_WORKER_CONCURRENCY + 1))
    assert result.returncode == 2, result.stderr  # a usage error, like any option out of its range
    assert "--concurrency" in result.stderr and str(MAX_WORKER_CONCURRENCY) in result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""  # dev --once ran no tick


# ---------------------------------------------------------------------------------------------
# Clocks


class _ReturnsText:
    def now(self) -> object:
        return "2030-01-01T00:00:00Z"


class _Raises:
    def now(self) -> object:
        raise KeyError("boom")


class _Naive:
    def now(self) -> object:
        return datetime(2030, 1, 1)


@pytest.mark.parametrize(
    "clock, said",
    [
        (_ReturnsText(), "_ReturnsText passed to create_runlane(clock=...) returned '2030-01-01T00:00:00Z'"),
        (_Raises(), "_Raises passed to create_runlane(clock=...) raised KeyError from now()"),
        (_Naive(), "_Naive passed to create_runlane(clock=...) returned a naive datetime (2030-01-01T00:00:00)"),
    ],
)
def test_a_clock_that_cannot_tell_the_time_is_refused_by_create_runlane(clock, said):
    with pytest.raises(RunlaneError) as raised:
        create_runlane(lane=local_lane(), queues=[DEFAULT_QUEUE], tasks=[child], clock=clock)
    assert raised.value.code is ErrorCode.CONFIGURATION_INVALID
    assert said in raised.value.message and "timezone-aware datetime" in raised.value.message
    assert raised.value.meta == {"field": "clock"}


class _TurnsBad:
    """A controlled clock until ``bad`` is set; then ``now()`` calls ``bad`` instead."""

    def __init__(self) -> None:
        self.clock = ControlledClock()
        self.bad: object = None

    def now(self) -> object:
        return self.clock.now() if self.bad is None else self.bad()  # type: ignore[operator]


def _raise() -> object:
    raise KeyError("boom")


@pytest.mark.parametrize(
    "bad, said",
    [
        (lambda: "noon", "returned 'noon' from now()"),
        (_raise, "raised KeyError from now(): 'boom'"),
        (lambda: datetime(2030, 1, 1), "returned a naive datetime"),
    ],
)
async def test_a_clock_that_goes_wrong_later_is_a_configuration_error_naming_the_clock(bad, said):
    clock = _TurnsBad()
    runtime = create_runlane(lane=local_lane(), queues=[DEFAULT_QUEUE], tasks=[child], clock=clock)
    async with runtime:
        clock.bad = bad
        for call in (lambda: runtime.trigger(child, {}), lambda: runtime.run_now(child, {}), runtime.tick):
            with pytest.raises(RunlaneError) as raised:
                await call()
            assert raised.value.code is ErrorCode.CONFIGURATION_INVALID
            assert "The clock _TurnsBad passed to create_runlane(clock=...)" in raised.value.message
            assert said in raised.value.message
        clock.bad = None
        assert await all_runs(runtime) == []


@pytest.mark.parametrize("bad", [lambda: "noon", _raise, lambda: datetime(2030, 1, 1)])
async def test_operator_actions_with_a_clock_gone_wrong_are_configuration_errors_and_change_nothing(bad):
    # Cancel and signal sends read the time in storage's commit, from the same clock.
    clock = _TurnsBad()
    runtime = create_runlane(lane=local_lane(), queues=[DEFAULT_QUEUE], tasks=[child, waits], clock=clock)
    async with runtime:
        await runtime.trigger(waits, {})
        waiting = await runtime.execute_next()
        assert waiting is not None and waiting.status is RunStatus.RELEASED
        run = (await runtime.trigger(child, {})).run  # queued
        clock.bad = bad
        for call in (lambda: runtime.runs.cancel(run.id), lambda: runtime.signals.send("go")):
            with pytest.raises(RunlaneError) as raised:
                await call()
            assert raised.value.code is ErrorCode.CONFIGURATION_INVALID
            assert "clock" in raised.value.message
        clock.bad = None
        assert await runtime.runs.get(run.id) == run
        assert await runtime.runs.get(waiting.id) == waiting


async def test_a_clock_in_another_time_zone_is_read_in_utc():
    class Paris:
        def now(self) -> datetime:
            return datetime(2030, 1, 1, 9, 30, tzinfo=ZoneInfo("Europe/Paris"))

    runtime = create_runlane(lane=local_lane(), queues=[DEFAULT_QUEUE], tasks=[child], clock=Paris())
    async with runtime:
        run = (await runtime.trigger(child, {})).run
        assert run.created_at == datetime(2030, 1, 1, 8, 30, tzinfo=UTC)


# ---------------------------------------------------------------------------------------------
# Listing filters


@pytest.mark.parametrize(
    "call, field",
    [
        (lambda rt, run: rt.runs.list(statuses=5), "statuses"),
        (lambda rt, run: rt.runs.list(task_ids=5), "task_ids"),
        (lambda rt, run: rt.runs.list(statuses=[["queued"]]), "statuses"),
        (lambda rt, run: rt.runs.list(task_ids=[{"id": "more.child"}]), "task_ids"),
        (lambda rt, run: rt.runs.events(run.id, types=5), "types"),
        (lambda rt, run: rt.runs.events(run.id, types=[["run.created"]]), "types"),
        (lambda rt, run: rt.runs.list(queues=5), "queues"),
        (lambda rt, run: rt.runs.list(queues=[5]), "queues"),
        (lambda rt, run: rt.runs.list(queues=[["default"]]), "queues"),
    ],
)
async def test_a_listing_filter_that_is_no_list_of_values_is_a_validation_error(call, field):
    runtime, _ = make_runtime(child)
    async with runtime:
        run = (await runtime.trigger(child, {})).run
        with pytest.raises(RunlaneError) as raised:
            await call(runtime, run)
        assert raised.value.code is ErrorCode.VALIDATION_FAILED
        assert raised.value.meta == {"field": field}
        assert raised.value.message.startswith(f"{field} must ")


def test_the_sync_facade_reports_a_malformed_filter_the_same_way():
    runtime, _ = make_runtime(child)
    with runtime.sync as sync:
        run = sync.trigger(child, {}).run
        for call in (lambda: sync.runs.list(statuses=5), lambda: sync.runs.events(run.id, types=5)):
            with pytest.raises(RunlaneError) as raised:
                call()
            assert raised.value.code is ErrorCode.VALIDATION_FAILED


@pytest.mark.parametrize(
    "call",
    [
        lambda rt: rt.runs.find_current(task=keyed, idempotency_key=5),
        lambda rt: rt.runs.find_current(task=keyed, idempotency_key=""),
        lambda rt: rt.runs.find_current(task=keyed, idempotency_key="bad:key"),
        lambda rt: rt.runs.find_active(task=keyed, idempotency_key=5),
        lambda rt: rt.runs.find_active(task=keyed, singleton_key=""),
        # The same value as a runs.list filter, for comparison.
        lambda rt: rt.runs.list(idempotency_key=5),
        lambda rt: rt.runs.list(idempotency_key=""),
    ],
)
async def test_a_malformed_lookup_key_is_the_same_validation_error_on_every_operator_read(call):
    runtime, _ = make_runtime(keyed)
    async with runtime:
        with pytest.raises(RunlaneError) as raised:
            await call(runtime)
        assert raised.value.code is ErrorCode.VALIDATION_FAILED
        assert raised.value.message.startswith("Invalid ")


async def test_a_queue_definition_the_runtime_does_not_register_stays_a_configuration_error():
    runtime, _ = make_runtime(child)
    async with runtime:
        for queues in ([queue("unregistered")], [queue("default", concurrency_limit=2)]):
            with pytest.raises(RunlaneError) as raised:
                await runtime.runs.list(queues=queues)
            assert raised.value.code is ErrorCode.CONFIGURATION_INVALID
        with pytest.raises(RunlaneError) as raised:
            runtime.worker(mode="drain", queues=[5])  # a worker's queues are configuration
        assert raised.value.code is ErrorCode.CONFIGURATION_INVALID


# ---------------------------------------------------------------------------------------------
# A TaskContext kept past its attempt


def _assert_lease_lost(error: RunlaneError) -> None:
    assert error.code is ErrorCode.STORAGE_CONFLICT
    assert get_storage_conflict_kind(error) is StorageConflictKind.LEASE_OWNERSHIP


async def test_a_context_kept_past_its_attempt_cannot_trigger_a_child():
    runtime, _ = make_runtime(parent, child)
    async with runtime:
        finished = await runtime.run_now(parent, {})
        ctx = kept.pop("async")
        with pytest.raises(RunlaneError) as stepped:
            await ctx.step.run("late", lambda token: 1)
        with pytest.raises(RunlaneError) as triggered:
            await ctx.trigger(child, {})
        # Refused as a late step is, and nothing is created.
        _assert_lease_lost(stepped.value)
        _assert_lease_lost(triggered.value)
        assert triggered.value.meta["run_id"] == finished.id
        assert "ctx.trigger()" in triggered.value.message and "kept past its attempt" in triggered.value.message
        assert [run.id for run in await all_runs(runtime)] == [finished.id]


async def test_a_def_handlers_context_kept_past_its_attempt_cannot_trigger_a_child():
    runtime, _ = make_runtime(sync_parent, child)
    async with runtime:
        finished = await runtime.run_now(sync_parent, {})
        ctx = kept.pop("def")
        with pytest.raises(RunlaneError) as triggered:
            await asyncio.to_thread(ctx.trigger, child, {})  # blocking, from a thread of its own
        _assert_lease_lost(triggered.value)
        assert [run.id for run in await all_runs(runtime)] == [finished.id]


async def test_a_late_step_does_not_call_its_function():
    runtime, _ = make_runtime(parent, child)
    async with runtime:
        await runtime.run_now(parent, {})
        ctx = kept.pop("async")
        called: list[str] = []
        with pytest.raises(RunlaneError) as raised:
            await ctx.step.run("late", called.append)
        _assert_lease_lost(raised.value)
        assert called == []


# ---------------------------------------------------------------------------------------------
# Trace carriers


@task("more.traced_parent")
async def traced_parent(payload: dict, ctx: TaskContext) -> None:
    await ctx.trigger(child, {}, trace_carrier={"baggage": "b" * (MAX_TRACE_CARRIER_BYTES + 1)})


async def test_a_trace_carrier_up_to_the_bound_is_kept_and_one_past_it_refused_everywhere():
    # The carrier rides in every wakeup of its run: one past the bound is refused where it is given,
    # before anything is written, so no wakeup a transport or consumer would refuse is ever made.
    runtime, _ = make_runtime(child, traced_parent)
    async with runtime:
        largest = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
        largest["baggage"] = "é" * ((MAX_TRACE_CARRIER_BYTES - len("traceparent") - 55 - len("baggage")) // 2)
        run = (await runtime.trigger(child, {}, trace_carrier=largest)).run
        assert run.trace_carrier == largest
        assert (await runtime.execute_next()).trace_carrier == largest  # finished, so it can be rerun
        too_large = {**largest, "baggage": largest["baggage"] + "é"}  # two bytes more than the bound
        for call in (
            lambda: runtime.trigger(child, {}, trace_carrier=too_large),
            lambda: runtime.run_now(child, {}, trace_carrier=too_large),
            lambda: runtime.runs.rerun(run.id, trace_carrier=too_large),
        ):
            with pytest.raises(RunlaneError) as raised:
                await call()
            assert raised.value.code is ErrorCode.CONFIGURATION_INVALID
            assert raised.value.meta == {"field": "trace_carrier", "max_bytes": MAX_TRACE_CARRIER_BYTES}
            assert "put larger context in the payload or meta" in raised.value.message
        assert [listed.id for listed in await all_runs(runtime)] == [run.id]

        parent_run = (await runtime.trigger(traced_parent, {})).run
        result = await runtime.execute_next()
        assert result.id == parent_run.id and result.failure.code is ErrorCode.CONFIGURATION_INVALID
        assert len(await all_runs(runtime)) == 2  # the child was never created


@pytest.mark.parametrize(("consumers", "said"), [(5, "got int"), (b"audit", "got bytes"), ({"audit": 1}, "got dict")])
async def test_observations_trim_refuses_consumers_that_are_not_a_list_of_names(consumers: object, said: str) -> None:
    runtime, _ = make_runtime()
    async with runtime:
        with pytest.raises(RunlaneError) as caught:
            await runtime.observations.trim(older_than="1d", consumers=consumers)  # type: ignore[arg-type]
        assert caught.value.code is ErrorCode.VALIDATION_FAILED and caught.value.meta == {"field": "consumers"}
        assert said in caught.value.message
        assert (await runtime.observations.trim(older_than="1d", consumers=None)).deleted == 0  # None: no consumer


def _nested(levels: int) -> object:
    value: object = 1
    for _ in range(levels):
        value = [value]
    return value


async def test_values_nested_past_the_limit_are_refused_where_they_enter_and_never_stop_a_worker() -> None:
    """The encoders that store a value stop at 255 levels: a value nested deeper than MAX_JSON_DEPTH (200)
    is the caller's error where it enters (a trigger's payload or meta, a handler's output), not a
    failure of the write that stores it, which took the worker (and `runlane dev`) down."""
    from runlane import task
    from runlane.json_values import MAX_JSON_DEPTH

    @task("deep.output")
    async def deep_output(payload: dict) -> object:
        return _nested(payload["levels"])

    runtime, _ = make_runtime(deep_output)
    async with runtime:
        with pytest.raises(RunlaneError) as caught:
            await runtime.trigger(deep_output, {"levels": 1, "deep": _nested(300)})
        assert caught.value.code is ErrorCode.VALIDATION_FAILED
        assert "nested more than 200 levels deep at $.deep" in caught.value.message
        with pytest.raises(RunlaneError) as caught:
            await runtime.trigger(deep_output, {"levels": 1}, meta={"deep": _nested(300)})
        assert f"nested more than {MAX_JSON_DEPTH} levels deep" in caught.value.message
        assert await all_runs(runtime) == []  # nothing written
        await runtime.trigger(deep_output, {"levels": MAX_JSON_DEPTH})  # the deepest output there may be
        await runtime.trigger(deep_output, {"levels": 300})
        await runtime.trigger(deep_output, {"levels": 2})
        executed: list[str] = []
        worker = runtime.worker(mode=WorkerMode.DRAIN, on_run_executed=lambda run: executed.append(run.id))
        await asyncio.wait_for(worker.closed, 10)
        assert len(executed) == 3  # the worker went on past the run whose output it refused
        runs = [await runtime.runs.get(run_id) for run_id in executed]
        outcomes = {run.payload["levels"]: (run.status, run.failure and run.failure.code) for run in runs}
        assert outcomes == {
            MAX_JSON_DEPTH: (RunStatus.SUCCEEDED, None),
            300: (RunStatus.FAILED, ErrorCode.TASK_OUTPUT_INVALID),
            2: (RunStatus.SUCCEEDED, None),
        }


async def test_a_lane_whose_record_limit_holds_no_run_says_so_instead_of_blaming_the_payload():
    """A driver advertising a max_record_bytes below the room a run keeps free can store no run at all:
    the refusal names the lane's limit as the cause, not the (tiny) payload."""
    from runlane import LaneDelivery, LaneDeliveryMode, create_lane
    from runlane.storage import StorageLimits
    from runlane_local import local_storage_driver

    @task("tiny.lane")
    async def tiny(payload: dict) -> None:
        return None

    limits = StorageLimits(max_record_bytes=2048, max_transaction_bytes=8192)
    storage = local_storage_driver(limits=limits)
    lane = create_lane(storage=storage, delivery=LaneDelivery(mode=LaneDeliveryMode.STORAGE_POLLING))
    runtime = create_runlane(lane=lane, queues=[DEFAULT_QUEUE], tasks=[tiny])
    async with runtime:
        with pytest.raises(RunlaneError) as caught:
            await runtime.trigger(tiny, {"a": 1})
        assert caught.value.code is ErrorCode.VALIDATION_FAILED
        message = caught.value.message
        assert "cannot be stored on this lane whatever its payload" in message
        assert "max_record_bytes of 2,048 bytes" in message and "larger max_record_bytes" in message
        assert "pass a reference" not in message
        assert await all_runs(runtime) == []


# ---------------------------------------------------------------------------------------------
# Times that leave the datetime range in UTC

# Aware times datetime can hold whose UTC reading it cannot: after 9999-12-31 or before 0001-01-01.
_PAST_THE_END = datetime(9999, 12, 31, 23, tzinfo=timezone(timedelta(hours=-5)))
_BEFORE_THE_START = datetime(1, 1, 1, tzinfo=timezone(timedelta(hours=5)))


@pytest.mark.parametrize("when", [_PAST_THE_END, _BEFORE_THE_START])
async def test_a_time_out_of_range_in_utc_is_refused_not_an_overflow(when: datetime) -> None:
    runtime, _ = make_runtime(child)
    async with runtime:
        with pytest.raises(RunlaneError) as caught:
            await runtime.trigger(child, {}, run_at=when)
        assert caught.value.code is ErrorCode.CONFIGURATION_INVALID and caught.value.meta == {"field": "run_at"}
        assert "out of range in UTC" in caught.value.message
        for call in (runtime.runs.prune, runtime.observations.trim):
            with pytest.raises(RunlaneError) as caught:
                await call(older_than=when)
            assert caught.value.code is ErrorCode.VALIDATION_FAILED and caught.value.meta == {"field": "older_than"}
            assert "out of range in UTC" in caught.value.message
        assert await all_runs(runtime) == []  # nothing written
