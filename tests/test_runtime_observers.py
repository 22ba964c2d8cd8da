"""Live observers: called after commit with sanitized observations; failures are isolated."""

from __future__ import annotations

import asyncio
import logging

import pytest

from runlane import (
    RunlaneObservation,
    RunlaneObservationType,
    RunStatus,
    TaskContext,
    WorkerMode,
    task,
)
from runlane.errors import RunlaneError

from runtime_support import make_runtime


@task("observed")
async def observed(payload: dict, ctx: TaskContext) -> dict:
    return {"secret_output": "s3cr3t"}


@task("observed.singleton", singleton_key="one")
async def single(payload: dict) -> None:
    return None


async def test_every_persisted_event_is_observed_once_in_order_without_private_data():
    seen: list[RunlaneObservation] = []
    runtime, _ = make_runtime(observed, observers=[seen.append])
    async with runtime:
        run = (await runtime.trigger(observed, {"secret_payload": "p4ss"}, trace_carrier={"traceparent": "t"})).run
        await runtime.execute_next()
        events = (await runtime.runs.events(run.id, sort_by="sequence")).data
    assert [o.type for o in seen] == [RunlaneObservationType.RUN_EVENT] * len(events)
    assert [(o.event_id, o.event_sequence, o.event_type) for o in seen] == [
        (record.id, record.sequence, record.event.type) for record in events
    ]
    assert all(o.run_id == run.id and o.task_id == "observed" and o.queue == "default" for o in seen)
    assert seen[0].trace_carrier == {"traceparent": "t"}
    assert seen[-1].status is RunStatus.SUCCEEDED and seen[-1].attempt == 1
    text = "".join(o.model_dump_json() for o in seen)
    assert "p4ss" not in text and "s3cr3t" not in text


async def test_each_observation_carries_the_status_its_own_event_left_the_run_in():
    seen: list[RunlaneObservation] = []
    runtime, _ = make_runtime(observed, observers=[seen.append])
    async with runtime:
        run = await runtime.run_now(observed, {})  # created, lease_claimed, started in one commit
        queued = (await runtime.trigger(observed, {})).run  # created + delivery_requested
        stored = (await runtime.observations.scan(limit=100)).records
    live = [(o.run_id, o.event_type.value, o.status) for o in seen]
    assert live == [
        (run.id, "run.created", RunStatus.QUEUED),
        (run.id, "run.lease_claimed", RunStatus.RUNNING),
        (run.id, "run.started", RunStatus.RUNNING),
        (run.id, "run.succeeded", RunStatus.SUCCEEDED),
        (queued.id, "run.created", RunStatus.QUEUED),
        (queued.id, "run.delivery_requested", RunStatus.QUEUED),
    ]
    assert [(r.observation.run_id, r.observation.event_type.value, r.observation.status) for r in stored] == live


def test_an_observation_stored_with_the_field_sequence_reads_as_event_sequence():
    stored = {"type": "run_event", "environment": {"name": "e"}, "run_id": "run_1", "sequence": 3,
              "occurred_at": "2026-11-30T08:00:00.000Z", "event_type": "run.started", "status": "running"}
    observation = RunlaneObservation.model_validate(stored)
    assert observation.event_sequence == 3 and "sequence" not in observation.to_json()


async def test_observer_failures_are_reported_and_never_change_run_state():
    reported: list[tuple[BaseException, RunlaneObservation]] = []
    calls: list[str] = []

    def broken(observation: RunlaneObservation) -> None:
        raise RuntimeError("observer bug")

    async def async_observer(observation: RunlaneObservation) -> None:
        calls.append(observation.event_type.value)

    runtime, _ = make_runtime(
        observed,
        observers=[broken, async_observer],
        on_observer_error=lambda error, observation: reported.append((error, observation)),
    )
    async with runtime:
        await runtime.trigger(observed, {})
        run = await runtime.execute_next()
    assert run.status is RunStatus.SUCCEEDED
    assert len(reported) == len(calls) == 5
    assert all(isinstance(error, RuntimeError) for error, _ in reported)
    assert calls[-1] == "run.succeeded"


async def test_an_observer_calling_sys_exit_is_reported_and_the_worker_goes_on(caplog):
    """``sys.exit()`` in an observer (or in its error handler) is the observer's failure, not the end
    of the worker that happened to call it."""

    def exiting(observation: RunlaneObservation) -> None:
        raise SystemExit(6)

    reported: list[BaseException] = []
    runtime, _ = make_runtime(observed, observers=[exiting], on_observer_error=lambda error, _: reported.append(error))
    async with runtime:
        for _ in range(2):
            await runtime.trigger(observed, {})
        await runtime.worker(mode=WorkerMode.DRAIN, concurrency=2).closed
        assert [run.status for run in (await runtime.runs.list()).data] == [RunStatus.SUCCEEDED] * 2
    assert reported and all(isinstance(error, SystemExit) for error in reported)

    def exiting_handler(error: BaseException, observation: RunlaneObservation) -> None:
        raise SystemExit(7)

    runtime, _ = make_runtime(observed, observers=[exiting], on_observer_error=exiting_handler)
    with caplog.at_level(logging.ERROR, logger="runlane.observers"):
        async with runtime:
            await runtime.trigger(observed, {})
            assert (await runtime.execute_next()).status is RunStatus.SUCCEEDED
    assert any("on_observer_error raised" in record.getMessage() for record in caplog.records)


async def test_observer_errors_without_a_handler_or_with_a_failing_one_are_logged_not_raised(caplog):
    def broken(observation):
        raise RuntimeError("observer bug")

    def broken_handler(error, observation):
        raise RuntimeError("handler bug")

    caplog.set_level(logging.WARNING, logger="runlane.observers")
    # Without a handler, one report a minute per observer; a failing handler, once per observation.
    expected = [(logging.WARNING, "observer bug", 1), (logging.ERROR, "handler bug", 5)]
    for options, (level, raised, count) in zip(
        ({"observers": [broken]}, {"observers": [broken], "on_observer_error": broken_handler}), expected
    ):
        caplog.clear()
        runtime, _ = make_runtime(observed, **options)
        async with runtime:
            run_id = (await runtime.trigger(observed, {})).run.id
            assert (await runtime.execute_next()).status is RunStatus.SUCCEEDED
        # five observations: created, delivery requested, lease claimed, started, succeeded
        assert len(caplog.records) == count
        first = caplog.records[0]
        assert first.levelno == level and str(first.exc_info[1]) == raised
        assert f"on run.created of run {run_id}" in first.getMessage()
        assert (first.run_id, first.task_id) == (run_id, "observed")


async def test_a_failing_observer_is_reported_once_a_minute_with_the_failures_in_between(caplog, monkeypatch):
    import runlane.core.runtime as runtime_module

    def broken(observation):
        raise RuntimeError("observer bug")

    caplog.set_level(logging.WARNING, logger="runlane.observers")
    runtime, _ = make_runtime(observed, observers=[broken])
    async with runtime:
        await runtime.trigger(observed, {})
        await runtime.execute_next()
        assert len(caplog.records) == 1 and "more time" not in caplog.records[0].getMessage()
        monkeypatch.setattr(runtime_module, "_OBSERVER_REPORT_INTERVAL_S", 0.0)  # the minute is over
        await runtime.trigger(observed, {})
        assert "(and 4 more time(s) since it was last reported)" in caplog.records[1].getMessage()
        assert "Pass on_observer_error= to create_runlane()" in caplog.records[1].getMessage()


def test_a_plugin_observer_is_named_with_its_plugin_when_it_fails():
    from runlane.plugins.registries import Contribution, Registries

    def audit(observation):
        raise RuntimeError("observer bug")

    registries = Registries()
    registries.observers.append(Contribution(audit, "audit-plugin"))
    (wrapped,) = registries.plugin_observers()
    assert repr(wrapped).endswith("audit of plugin 'audit-plugin'")
    assert "authors of plugin 'audit-plugin'" in wrapped.failure_hint
    assert wrapped == registries.plugin_observers()[0]  # collected again, the same observer
    with pytest.raises(RuntimeError):
        wrapped(None)


async def test_rejected_writes_are_not_observed():
    seen: list[RunlaneObservation] = []
    runtime, _ = make_runtime(single, observers=[seen.append])
    async with runtime:
        await runtime.trigger(single, {})
        count = len(seen)
        with pytest.raises(RunlaneError):
            await runtime.trigger(single, {})
        assert len(seen) == count


async def test_cancellation_and_maintenance_events_are_observed():
    seen: list[RunlaneObservation] = []

    @task("observed.release")
    async def release(payload: dict, ctx: TaskContext):
        return ctx.release("1m")

    runtime, clock = make_runtime(release, observers=[seen.append])
    async with runtime:
        run = (await runtime.trigger(release, {})).run
        await runtime.execute_next()
        clock.advance("1m")
        await runtime.tick()
        await runtime.runs.cancel(run.id)
    types = [o.event_type.value for o in seen]
    assert types[-3:] == ["run.released", "run.delivery_requested", "run.cancelled"]


async def test_an_observer_letting_a_cancellation_escape_is_its_failure_not_the_callers():
    """An observer awaiting something that was cancelled (a telemetry task stopped meanwhile) raises
    ``CancelledError`` though nobody cancelled the trigger: the trigger committed and says so."""

    async def awaiting_a_cancelled_send(observation: RunlaneObservation) -> None:
        send = asyncio.get_running_loop().create_future()
        send.cancel()
        await send

    reported: list[BaseException] = []
    runtime, _ = make_runtime(
        observed, observers=[awaiting_a_cancelled_send], on_observer_error=lambda error, _: reported.append(error)
    )
    async with runtime:
        created = await runtime.trigger(observed, {})
        assert created.run.status is RunStatus.QUEUED
        assert (await runtime.execute_next()).status is RunStatus.SUCCEEDED  # created ... succeeded: 5 events
    assert len(reported) == 5 and all(isinstance(error, asyncio.CancelledError) for error in reported)


async def test_cancelling_the_caller_while_an_observer_runs_still_cancels_it():
    entered = asyncio.Event()

    async def slow(observation: RunlaneObservation) -> None:
        entered.set()
        await asyncio.sleep(3600)

    reported: list[BaseException] = []
    runtime, _ = make_runtime(observed, observers=[slow], on_observer_error=lambda error, _: reported.append(error))
    async with runtime:
        trigger = asyncio.ensure_future(runtime.trigger(observed, {}))
        await asyncio.wait_for(entered.wait(), 5)
        trigger.cancel()
        with pytest.raises(asyncio.CancelledError):
            await trigger
    assert reported == []
