"""``runlane.testing`` waiting helpers: a test waits for a run a live worker moves, in real time."""

from __future__ import annotations

import asyncio
import time

import pytest

from runlane import ErrorCode, RunlaneError, RunStatus, WorkerMode, create_runlane, queue, task
from runlane.testing import list_run_event_types, wait_for_condition, wait_for_run_event, wait_for_run_status
from runlane_local import local_lane

default = queue("default", default=True)
gate = asyncio.Event()


@task("waiting.gated")
async def gated(payload: dict) -> str:
    await gate.wait()
    return payload["name"]


@task("waiting.broken")
async def broken(payload: dict) -> None:
    raise ValueError("no such customer")


@pytest.fixture(autouse=True)
def _closed_gate():
    gate.clear()


def runtime():
    return create_runlane(lane=local_lane(), queues=[default], tasks=[gated, broken])


async def test_waits_for_a_run_a_live_worker_finishes():
    async with runtime() as runlane:
        worker = runlane.worker(mode=WorkerMode.POLL, empty_poll_delay="5ms")
        try:
            run = (await runlane.trigger(gated, {"name": "ada"})).run
            started = await wait_for_run_event(runlane, run.id, "run.started")
            assert started.event.type == "run.started" and started.event.run_id == run.id
            running = await wait_for_run_status(runlane, run.id, RunStatus.RUNNING)
            assert running.status is RunStatus.RUNNING
            gate.set()
            done = await wait_for_run_status(runlane, run.id, "succeeded", timeout="2s")
            assert done.status is RunStatus.SUCCEEDED and done.output == "ada"
            assert await list_run_event_types(runlane, run.id) == [
                "run.created",
                "run.delivery_requested",
                "run.lease_claimed",
                "run.started",
                "run.succeeded",
            ]
        finally:
            gate.set()  # the handler does not watch its signal: let it end before the worker stops
            await worker.stop()


async def test_one_of_several_statuses_is_enough():
    async with runtime() as runlane:
        run = (await runlane.trigger(gated, {"name": "ada"})).run
        found = await wait_for_run_status(runlane, run.id, ["succeeded", RunStatus.QUEUED], timeout="1s")
        assert found.status is RunStatus.QUEUED


async def test_a_run_that_ends_otherwise_fails_the_wait_at_once():
    async with runtime() as runlane:
        worker = runlane.worker(mode=WorkerMode.POLL, empty_poll_delay="5ms")
        try:
            run = (await runlane.trigger(broken, {})).run
            began = time.monotonic()
            with pytest.raises(AssertionError, match=r"ended failed \(task_failed: Task failed\.\) .* succeeded"):
                await wait_for_run_status(runlane, run.id, "succeeded", timeout="30s")
            assert time.monotonic() - began < 10  # not the timeout
        finally:
            await worker.stop()


async def test_a_run_cancelled_before_it_started_never_gets_the_awaited_event():
    async with runtime() as runlane:
        run = (await runlane.trigger(gated, {"name": "ada"})).run
        await runlane.runs.cancel(run.id)
        with pytest.raises(AssertionError, match=r"ended cancelled without a run\.started event"):
            await wait_for_run_event(runlane, run.id, "run.started", timeout="30s")


async def test_a_timeout_says_where_the_run_is():
    async with runtime() as runlane:
        run = (await runlane.trigger(gated, {"name": "ada"})).run
        with pytest.raises(TimeoutError, match=rf"Run {run.id} did not reach succeeded within 50ms; it is queued\."):
            await wait_for_run_status(runlane, run.id, "succeeded", timeout="50ms")
        with pytest.raises(TimeoutError, match=r"did not reach cancelled or failed within 20ms; it does not exist"):
            await wait_for_run_status(runlane, "run_missing", ["failed", "cancelled"], timeout="20ms")
        with pytest.raises(TimeoutError, match=rf"Run {run.id} had no run.lease_claimed event within 20ms"):
            await wait_for_run_event(runlane, run.id, "run.lease_claimed", timeout="20ms")


async def test_a_run_created_while_waiting_is_found():
    async with runtime() as runlane:

        async def later():
            await asyncio.sleep(0.05)
            await runlane.trigger(gated, {"name": "ada"}, run_id="run_later")

        producer = asyncio.create_task(later())
        found = await wait_for_run_status(runlane, "run_later", "queued", timeout="2s")
        await producer
        assert found.id == "run_later"


async def test_wait_for_condition_takes_plain_and_async_checks():
    calls = []

    def plain():
        calls.append(1)
        return len(calls) >= 3 and "ready"

    assert await wait_for_condition(plain, interval="1ms") == "ready"
    assert len(calls) == 3

    async def never():
        return None

    with pytest.raises(TimeoutError, match="the outbox draining did not happen within 30ms"):
        await wait_for_condition(never, timeout="30ms", description="the outbox draining")

    def boom():
        raise KeyError("gone")

    with pytest.raises(KeyError):
        await wait_for_condition(boom)


async def test_bad_arguments_are_validation_errors():
    async with runtime() as runlane:
        run = (await runlane.trigger(gated, {"name": "ada"})).run
        for call in (
            wait_for_run_status(runlane, run.id, "finished"),
            wait_for_run_status(runlane, run.id, []),
            wait_for_run_status(runlane, run.id, "queued", timeout="soon"),
            wait_for_run_event(runlane, run.id, "run.done"),
            wait_for_condition(lambda: True, interval="0ms"),
        ):
            with pytest.raises(RunlaneError) as caught:
                await call
            assert caught.value.code is ErrorCode.VALIDATION_FAILED
        with pytest.raises(RunlaneError) as caught:
            await list_run_event_types(runlane, "run_missing")
        assert caught.value.code is ErrorCode.RUN_NOT_FOUND


async def test_the_timeout_also_ends_a_check_that_is_still_running():
    async def hangs() -> bool:
        await asyncio.sleep(30)  # a read that never answers
        return True

    started = time.monotonic()
    with pytest.raises(TimeoutError, match="did not happen within 100ms"):
        await wait_for_condition(hangs, timeout="100ms", description="the read")
    assert time.monotonic() - started < 5


async def test_a_call_s_result_instead_of_a_function_is_named():
    async def check() -> bool:
        return True

    with pytest.raises(TypeError, match="takes a function to call again and again"):
        await wait_for_condition(check())  # type: ignore[call-overload]  # the mistake this test is about
