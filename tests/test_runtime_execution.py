"""The shared attempt path through ``execute_next``, ``run_now`` and ``execute_delivery``."""

from __future__ import annotations

import asyncio
import json
import logging
import traceback
import sys
import threading

import pytest
from pydantic import BaseModel, field_validator

from runlane import (
    Actor,
    ActorType,
    CancellationController,
    DeliveryMessage,
    Environment,
    ErrorCode,
    ExecuteDeliveryIgnoredReason,
    ExecuteDeliveryStatus,
    Retry,
    RunlaneError,
    RunStatus,
    StorageConflictKind,
    TaskContext,
    WorkerMode,
    create_runlane,
    get_storage_conflict_kind,
    queue,
    task,
)

from runlane.core.store import ClaimRequest
from runlane.testing import wait_for_run_status
from runtime_support import DEFAULT_QUEUE, event_types, make_runtime, shared_runtimes


class Welcome(BaseModel):
    user_id: str


sent: list[str] = []


@task("emails.welcome")
def send_welcome(payload: Welcome) -> None:
    sent.append(payload.user_id)


@task("echo")
async def echo(payload: dict) -> dict:
    return {"echo": payload}


# ---------------------------------------------------------------------------------------------
# execute_next and outcomes


async def test_quick_start_trigger_then_execute_next():
    sent.clear()
    runtime, _ = make_runtime(send_welcome)
    async with runtime:
        queued = (await runtime.trigger(runtime.tasks["emails.welcome"], {"user_id": "user_123"})).run
        completed = await runtime.execute_next()
        assert queued.status is RunStatus.QUEUED
        assert completed is not None and completed.status is RunStatus.SUCCEEDED
        assert sent == ["user_123"]
        assert (await runtime.runs.get(queued.id)).status is RunStatus.SUCCEEDED
        assert await event_types(runtime, queued.id) == [
            "run.created",
            "run.delivery_requested",
            "run.lease_claimed",
            "run.started",
            "run.succeeded",
        ]
        assert await runtime.execute_next() is None


async def test_execute_next_with_an_aborted_signal_does_nothing():
    runtime, _ = make_runtime(echo)
    async with runtime:
        await runtime.trigger(echo, {})
        controller = CancellationController()
        controller.abort("shutting down")
        assert await runtime.execute_next(signal=controller.signal) is None
        assert (await runtime.execute_next()).status is RunStatus.SUCCEEDED


async def test_output_and_void_success():
    @task("void")
    async def void() -> None:
        return None

    runtime, _ = make_runtime(echo, void)
    async with runtime:
        await runtime.trigger(echo, {"a": [1, 2]})
        run = await runtime.execute_next()
        assert run.has_output and run.output == {"echo": {"a": [1, 2]}}
        await runtime.trigger(void)
        run = await runtime.execute_next()
        assert run.status is RunStatus.SUCCEEDED and not run.has_output
        assert "output" not in run.to_json()


async def test_the_returned_run_holds_the_output_as_stored_not_the_handlers_object():
    kept = {"pair": (1, 2), "status": RunStatus.QUEUED, "count": 1}

    @task("shared.output")
    async def shared_output() -> dict:
        return kept

    runtime, _ = make_runtime(shared_output)
    async with runtime:
        await runtime.trigger(shared_output)
        done = await runtime.execute_next()
        kept["count"] = 99  # the handler's object changes after it returned
        stored = await runtime.runs.get(done.id)
        assert done.output == {"pair": [1, 2], "status": "queued", "count": 1}
        assert type(done.output["status"]) is str
        assert done == stored


@pytest.mark.parametrize(
    "raised, code, message, retryable, meta",
    [
        (RuntimeError("secret detail"), ErrorCode.TASK_FAILED, "Task failed.", True, {}),
        (
            RunlaneError(ErrorCode.VALIDATION_FAILED, "the invoice secret is wrong", meta={"invoice": "inv_1"}),
            ErrorCode.VALIDATION_FAILED,
            None,
            False,
            {"invoice": "inv_1"},
        ),
        (RunlaneError(ErrorCode.TASK_FAILED, "x", retryable=True), ErrorCode.TASK_FAILED, "Task failed.", True, {}),
    ],
)
async def test_failures_are_mapped_to_task_facing_failures(raised, code, message, retryable, meta):
    @task("fails")
    async def fails() -> None:
        raise raised

    runtime, _ = make_runtime(fails)
    async with runtime:
        await runtime.trigger(fails)
        run = await runtime.execute_next()
        assert run.status is RunStatus.FAILED
        assert run.failure.code is code
        assert run.failure.retryable is retryable
        assert run.failure.meta == meta
        assert "secret" not in run.failure.message
        if message is not None:
            assert run.failure.message == message


async def test_failed_attempts_are_logged_with_their_exception_while_history_stays_sanitized(caplog):
    @task("flaky", retry=Retry(3, backoff="1s"))
    async def flaky() -> None:
        raise RuntimeError("secret detail")

    @task("bad.output.logged")
    async def bad_output() -> object:
        return object()

    @task("fine")
    async def fine() -> None:
        return None

    runtime, clock = make_runtime(flaky, bad_output, fine)
    caplog.set_level(logging.INFO, logger="runlane")
    async with runtime:
        flaky_id = (await runtime.trigger(flaky)).run.id
        first = await runtime.execute_next()
        assert first.status is RunStatus.RETRYING and first.failure.message == "Task failed."
        [retrying] = caplog.records
        assert (retrying.name, retrying.levelno) == ("runlane.task", logging.WARNING)
        assert retrying.getMessage() == (
            f"Run {flaky_id} (task flaky): attempt 1 failed with task_failed (Task failed.); "
            f"retry at {first.run_at.isoformat(timespec='milliseconds').replace('+00:00', 'Z')}."
        )
        assert (retrying.run_id, retrying.task_id, retrying.attempt, retrying.error_code) == (
            flaky_id, "flaky", 1, "task_failed"
        )
        assert isinstance(retrying.exc_info[1], RuntimeError) and str(retrying.exc_info[1]) == "secret detail"

        caplog.clear()
        await runtime.trigger(bad_output)
        assert (await runtime.execute_next()).status is RunStatus.FAILED
        [invalid] = caplog.records
        assert invalid.levelno == logging.ERROR and invalid.exc_info is None
        assert (
            "failed with task_output_invalid (Task output is not JSON-compatible: object is not a JSON value at $.); "
            "the run has failed."
        ) in invalid.getMessage()

        caplog.clear()
        await runtime.trigger(fine)
        assert (await runtime.execute_next()).status is RunStatus.SUCCEEDED
        assert caplog.records == []

        for attempt in (2, 3):
            clock.advance("1s")
            await runtime.tick()
            caplog.clear()
            run = await runtime.execute_next()
            [record] = caplog.records
            assert record.attempt == attempt and "secret detail" not in record.getMessage()
        assert run.status is RunStatus.FAILED and record.levelno == logging.ERROR
        assert record.getMessage().endswith("attempt 3 failed with task_failed (Task failed.); the run has failed.")
        history = await runtime.runs.events(flaky_id)
        assert "secret detail" not in json.dumps([item.to_json() for item in history.data])


async def test_a_logged_failure_traceback_starts_at_the_handler_and_keeps_what_it_called(caplog):
    def parse(text: str) -> int:
        return int(text)

    @task("sync.parse")
    def sync_parse(payload: dict) -> int:
        return parse(payload["text"])

    @task("async.parse")
    async def async_parse(payload: dict) -> int:
        return parse(payload["text"])

    runtime, _ = make_runtime(sync_parse, async_parse)
    caplog.set_level(logging.INFO, logger="runlane")
    async with runtime:
        for definition in (sync_parse, async_parse):
            caplog.clear()
            await runtime.trigger(definition, {"text": "twelve"})
            assert (await runtime.execute_next()).status is RunStatus.FAILED
            [record] = caplog.records
            frames = traceback.extract_tb(record.exc_info[2])
            # The runtime's own frames (the attempt path, the handler thread pool) are left out; the
            # handler and everything below it stay.
            assert [frame.name for frame in frames] == [definition.handler.__name__, "parse"]
            assert "ValueError: invalid literal for int()" in caplog.text


@pytest.mark.parametrize(
    ("output", "message"),
    [
        ({"when": object()}, "Task output is not JSON-compatible: object is not a JSON value at $.when."),
        ({1: "non-string key"}, "Task output is not JSON-compatible: object keys must be strings, got int at $."),
        (
            {"k" * 500: {1, 2}},  # a long key is cut short in the message
            "Task output is not JSON-compatible: set is not a JSON value at $." + "k" * 197 + "….",
        ),
        (float("nan"), "Task output is not JSON-compatible: numbers must be finite (no NaN or Infinity) at $."),
        (
            {"type": "task_release", "delay": "5s"},
            "Task output uses the reserved type 'task_release'; return ctx.release(...) to release the run.",
        ),
    ],
)
async def test_invalid_output_fails_with_task_output_invalid_saying_where(output: object, message: str) -> None:
    @task("bad.output")
    async def bad_output() -> object:
        return output

    runtime, _ = make_runtime(bad_output)
    async with runtime:
        await runtime.trigger(bad_output)
        run = await runtime.execute_next()
        assert run.status is RunStatus.FAILED
        assert (run.failure.code, run.failure.message) == (ErrorCode.TASK_OUTPUT_INVALID, message)
        assert not run.has_output


async def test_a_release_returned_inside_the_output_says_to_return_it_itself() -> None:
    @task("approve")
    def approve(payload: dict, ctx: TaskContext) -> object:
        return {"decision": ctx.wait_for_signal("approved", timeout="1h")}

    runtime, _ = make_runtime(approve)
    async with runtime:
        await runtime.trigger(approve, {})
        run = await runtime.execute_next()
        assert run.status is RunStatus.FAILED and run.failure.code is ErrorCode.TASK_OUTPUT_INVALID
        assert run.failure.message == (
            "Task output holds a release at $.decision; return the release itself (return ctx.wait_for_signal(...), "
            "ctx.wait_for_run(...) or ctx.release(...)) to release the run."
        )
        assert run.failure.meta == {"output_type": "dict", "path": "$.decision"}


async def test_a_handler_that_raises_cancelled_error_or_calls_sys_exit_fails_without_stopping_the_worker():
    @task("escapes.cancellation")
    async def escapes(payload: dict) -> None:
        inner = asyncio.ensure_future(asyncio.sleep(10))
        inner.cancel()
        await inner  # re-raises the inner task's CancelledError in the handler

    @task("calls.exit")
    def exits(payload: dict) -> None:
        sys.exit(3)

    runtime, _ = make_runtime(escapes, exits, echo)
    async with runtime:
        ids = [(await runtime.trigger(item, {})).run.id for item in (escapes, exits, echo, echo)]
        await asyncio.wait_for(runtime.worker(mode=WorkerMode.DRAIN, concurrency=2).closed, 5)
        runs = [await runtime.runs.get(run_id) for run_id in ids]
        assert [run.status for run in runs] == [
            RunStatus.FAILED, RunStatus.FAILED, RunStatus.SUCCEEDED, RunStatus.SUCCEEDED
        ]
        assert [run.failure.code for run in runs[:2]] == [ErrorCode.TASK_FAILED, ErrorCode.TASK_FAILED]


class _LibraryStop(BaseException):
    """A library's BaseException (as gevent's Timeout or a test framework's failure are)."""


class _TamperedCode(RunlaneError):
    def __init__(self) -> None:
        super().__init__(ErrorCode.VALIDATION_FAILED, "declined")
        self.code = "validation_failed"  # a plain str where an ErrorCode belongs


@pytest.mark.parametrize(
    ("outcome", "code"),
    [
        ("library_base_exception", ErrorCode.TASK_FAILED),
        ("keyboard_interrupt", ErrorCode.TASK_FAILED),
        ("str_code", ErrorCode.VALIDATION_FAILED),
        ("meta_not_an_object", ErrorCode.VALIDATION_FAILED),  # its meta is left out
        ("integer_too_long_for_json", ErrorCode.TASK_OUTPUT_INVALID),
    ],
)
async def test_an_exotic_handler_outcome_fails_its_attempt_and_the_worker_goes_on(outcome, code):
    @task("exotic", retry=Retry(1))
    def exotic(payload: dict) -> object:
        if outcome == "library_base_exception":
            raise _LibraryStop()
        if outcome == "keyboard_interrupt":
            raise KeyboardInterrupt
        if outcome == "str_code":
            raise _TamperedCode()
        if outcome == "meta_not_an_object":
            error = RunlaneError(ErrorCode.VALIDATION_FAILED, "declined")
            error.meta = ["not", "an", "object"]
            raise error
        return {"n": 10**5000}

    runtime, _ = make_runtime(exotic, echo)
    async with runtime:
        ids = [(await runtime.trigger(item, {})).run.id for item in (exotic, echo, echo)]
        await asyncio.wait_for(runtime.worker(mode=WorkerMode.DRAIN, concurrency=2).closed, 5)
        runs = [await runtime.runs.get(run_id) for run_id in ids]
    assert [run.status for run in runs] == [RunStatus.FAILED, RunStatus.SUCCEEDED, RunStatus.SUCCEEDED]
    assert runs[0].failure.code is code


async def test_cancelling_the_task_that_runs_an_attempt_is_not_recorded_as_its_outcome():
    entered = asyncio.Event()

    @task("waits")
    async def waits(payload: dict) -> None:
        entered.set()
        await asyncio.sleep(10)

    runtime, _ = make_runtime(waits)
    async with runtime:
        run_id = (await runtime.trigger(waits, {})).run.id
        attempt = asyncio.ensure_future(runtime.execute_next())
        await asyncio.wait_for(entered.wait(), 2)
        attempt.cancel()
        with pytest.raises(asyncio.CancelledError):
            await attempt
        assert (await runtime.runs.get(run_id)).status is RunStatus.RUNNING  # left to lease recovery


def _over_the_record_limit(runtime) -> str:
    return "x" * (runtime.lane.storage.profile.limits.max_record_bytes + 1)


async def test_output_too_large_for_the_lane_fails_the_attempt_and_follows_the_retry_policy():
    @task("big.output", retry=Retry(2, backoff="1s"))
    async def big_output() -> dict:
        return {"blob": _over_the_record_limit(runtime)}

    runtime, clock = make_runtime(big_output)
    async with runtime:
        run_id = (await runtime.trigger(big_output)).run.id
        first = await runtime.execute_next()
        assert (first.id, first.status) == (run_id, RunStatus.RETRYING)  # not left running until its lease expires
        assert first.failure.code is ErrorCode.TASK_OUTPUT_INVALID and first.failure.retryable
        assert first.failure.message.startswith("Task output is too large to store: ")
        assert first.failure.meta["storage_limit"] == "max_record_bytes"
        assert first.failure.meta["actual"] > first.failure.meta["limit"]
        clock.advance("1s")
        await runtime.tick()
        second = await runtime.execute_next()
        assert second.status is RunStatus.FAILED and not second.has_output
        assert second.counters.attempts == 2


async def test_failure_meta_too_large_for_the_lane_is_dropped_and_the_failure_kept():
    @task("big.meta")
    async def big_meta() -> None:
        raise RunlaneError(ErrorCode.VALIDATION_FAILED, "bad invoice", meta={"dump": _over_the_record_limit(runtime)})

    runtime, _ = make_runtime(big_meta)
    async with runtime:
        await runtime.trigger(big_meta)
        run = await runtime.execute_next()
        assert run.status is RunStatus.FAILED
        assert (run.failure.code, run.failure.retryable) == (ErrorCode.VALIDATION_FAILED, False)
        assert run.failure.meta["meta_dropped"] == "too large to store"
        assert "dump" not in run.failure.meta


async def test_step_output_too_large_for_the_lane_is_task_output_invalid_in_the_handler():
    caught: list[RunlaneError] = []

    @task("big.step")
    async def big_step(payload: dict, ctx: TaskContext) -> str:
        try:
            await ctx.step.run("fetch", lambda token: {"blob": _over_the_record_limit(runtime)})
        except RunlaneError as error:
            caught.append(error)
            return "recovered"
        return "stored"

    runtime, _ = make_runtime(big_step)
    async with runtime:
        await runtime.trigger(big_step, {})
        run = await runtime.execute_next()
        assert (run.status, run.output) == (RunStatus.SUCCEEDED, "recovered")
        [error] = caught
        assert (error.code, error.retryable) == (ErrorCode.TASK_OUTPUT_INVALID, True)
        assert error.message.startswith("Step 'fetch' output is too large to store: ")
        assert error.meta["step_key"] == "fetch"


async def test_trigger_with_a_payload_too_large_for_the_lane_writes_nothing():
    runtime, _ = make_runtime(echo)
    async with runtime:
        with pytest.raises(RunlaneError) as raised:
            await runtime.trigger(echo, {"blob": _over_the_record_limit(runtime)})
        assert raised.value.code is ErrorCode.VALIDATION_FAILED
        assert raised.value.message.startswith("Run of task 'echo' is too large to store: ")
        assert "its payload takes" in raised.value.message
        assert "pass a reference to large data (an id or a URL) in the payload" in raised.value.message
        # When the meta is what takes the room, the message says so.
        with pytest.raises(RunlaneError) as raised:
            await runtime.trigger(echo, {"blob": "small"}, meta={"note": _over_the_record_limit(runtime)})
        assert "its meta takes" in raised.value.message and "in the meta instead" in raised.value.message
        # And when the actor's id does, the message names it rather than a meta of 2 bytes.
        with pytest.raises(RunlaneError) as raised:
            operator = Actor(type=ActorType.OPERATOR, id=_over_the_record_limit(runtime))
            await runtime.trigger(echo, {}, actor=operator)
        assert "its actor id takes" in raised.value.message and "with a short id" in raised.value.message
        assert (await runtime.runs.list()).data == []


async def test_task_context_describes_the_attempt():
    seen: list[TaskContext] = []
    facts: dict = {}

    @task("ctx")
    async def ctx_task(payload: dict, ctx: TaskContext) -> None:
        seen.append(ctx)
        facts.update(
            run_id=ctx.run_id,
            task_id=ctx.task_id,
            attempt=ctx.attempt,
            queue=ctx.queue,
            environment=ctx.environment,
            trace=ctx.trace_carrier,
            aborted=ctx.signal.aborted,
            requested=ctx.is_cancellation_requested(),
            meta=ctx.meta,
            created_at=ctx.created_at,
            source=ctx.source,
        )
        ctx.meta["changed"] = True  # a copy: the run's own meta stays as triggered

    runtime, clock = make_runtime(ctx_task, environment="staging")
    async with runtime:
        run = (await runtime.trigger(ctx_task, {}, trace_carrier={"traceparent": "t"}, meta={"tenant": "t1"})).run
        clock.advance("5m")
        await runtime.execute_next()
        assert facts == {
            "run_id": run.id,
            "task_id": "ctx",
            "attempt": 1,
            "queue": "default",
            "environment": Environment(name="staging"),
            "trace": {"traceparent": "t"},
            "aborted": False,
            "requested": False,
            "meta": {"tenant": "t1"},
            "created_at": run.created_at,
            "source": None,
        }
        assert (await runtime.runs.get(run.id)).meta == {"tenant": "t1"}


async def test_a_handler_reads_the_runtime_clock_from_its_context_to_give_up_on_stale_work():
    """ctx.now() is the runtime's clock, so a test's ControlledClock drives a handler's own time decision
    (datetime.now() there reads the real time, months past a ControlledClock's start)."""
    from datetime import timedelta

    @task("ctx.stale", retry=Retry(5, backoff="1h"))
    async def stale(payload: dict, ctx: TaskContext) -> str:
        if ctx.now() - ctx.created_at > timedelta(hours=2):
            raise RunlaneError(ErrorCode.TASK_FAILED, "Too late.", retryable=False, meta={"at": ctx.now().isoformat()})
        raise ConnectionError("provider down")

    @task("ctx.now_in_a_thread")
    def now_in_a_thread(payload: dict, ctx: TaskContext) -> str:
        return ctx.now().isoformat()

    runtime, clock = make_runtime(stale, now_in_a_thread)
    async with runtime:
        run = (await runtime.trigger(stale, {})).run
        outcomes = []
        while (record := await runtime.execute_next()) is not None or clock.now() < run.created_at + timedelta(hours=4):
            if record is not None:
                outcomes.append(record.status)
            clock.advance("1h")
        assert outcomes == ["retrying", "retrying", "retrying", "failed"]
        failed = await runtime.runs.get(run.id)
        assert failed.failure.meta == {"at": "2026-01-01T03:00:00+00:00"}

        threaded = (await runtime.trigger(now_in_a_thread, {})).run
        assert (await runtime.execute_next()).output == clock.now().isoformat()
        assert threaded.created_at == clock.now()


async def test_a_def_handler_that_gets_no_thread_never_runs_and_its_run_is_released(monkeypatch, caplog):
    # At a limit on threads (a container's pids limit, ulimit -u), ThreadPoolExecutor.submit queues the call
    # and then fails to start a thread for it. The attempt must not be recorded as failed while the queued
    # call runs later on a thread that frees up: that ran handlers of failed runs, and twice with retries.
    calls: list[int] = []
    first_started = threading.Event()
    release_first = threading.Event()

    later_started = {3: threading.Event(), 4: threading.Event()}
    release_later = threading.Event()

    @task("threads.limited", retry=Retry(3, backoff="1s"))
    def limited(payload: dict) -> None:
        calls.append(payload["n"])
        if payload["n"] == 1:
            first_started.set()
            release_first.wait(10)
        if payload["n"] in later_started:
            later_started[payload["n"]].set()
            release_later.wait(10)

    runtime, clock = make_runtime(limited)
    start = threading.Thread.start

    def at_the_limit(thread: threading.Thread) -> None:
        if thread.name.startswith("runlane-handler") and first_started.is_set():
            raise RuntimeError("can't start new thread")
        start(thread)

    async with runtime:
        first = (await runtime.trigger(limited, {"n": 1})).run
        second = (await runtime.trigger(limited, {"n": 2})).run
        running = asyncio.ensure_future(runtime.execute_next())
        await asyncio.to_thread(first_started.wait, 10)
        monkeypatch.setattr(threading.Thread, "start", at_the_limit)
        with caplog.at_level(logging.ERROR, logger="runlane.worker"):
            released = await runtime.execute_next()
        assert released is not None and released.id == second.id and released.status is RunStatus.RELEASED
        assert released.counters.failures == 0
        events = (await runtime.runs.events(second.id, sort_by="sequence")).data
        assert events[-1].event.type == "run.released" and events[-1].event.reason == "handler_thread_unavailable"
        assert "no thread could be started for its def handler" in caplog.text and "--concurrency" in caplog.text
        release_first.set()
        assert (await asyncio.wait_for(running, 10)).status is RunStatus.SUCCEEDED
        await asyncio.sleep(0.05)  # the first run's thread is free again: the queued call must not run
        assert calls == [1]
        monkeypatch.setattr(threading.Thread, "start", start)
        clock.advance("5s")
        done = await runtime.execute_next()
        assert done is not None and done.id == second.id and done.status is RunStatus.SUCCEEDED
        assert calls == [1, 2] and first.id != second.id
        # Threads can be started again: two handlers at once get a thread each, none waits behind the other.
        for n in (3, 4):
            await runtime.trigger(limited, {"n": n})
        both = [asyncio.ensure_future(runtime.execute_next()) for _ in range(2)]
        try:
            for n in (3, 4):
                assert await asyncio.to_thread(later_started[n].wait, 5), f"handler {n} waited for a thread"
        finally:
            release_later.set()
            await asyncio.gather(*both)


async def test_sync_handlers_run_in_a_worker_thread_with_blocking_context_calls():
    threads: list[int] = []

    @task("child.sync")
    def child(payload: dict) -> None:
        return None

    @task("parent.sync")
    def parent(payload: dict, ctx: TaskContext) -> dict:
        threads.append(threading.get_ident())
        result = ctx.trigger(child, {"n": 1})
        token_seen = ctx.step.run("step-a", lambda token: {"token": token})
        return {"child": result.run.id, "step": token_seen["token"]}

    runtime, _ = make_runtime(parent, child)
    async with runtime:
        await runtime.trigger(parent, {})
        run = await runtime.execute_next()
        assert run.status is RunStatus.SUCCEEDED, run.failure
        assert threads and threads[0] != threading.get_ident()
        assert (await runtime.runs.get(run.output["child"])).task_id == "child.sync"
        assert run.output["step"].startswith("step_")


async def test_execute_next_only_claims_from_the_given_queues():
    reports = queue("reports")

    @task("report", queue=reports)
    async def report() -> None:
        return None

    runtime, _ = make_runtime(echo, report, queues=[DEFAULT_QUEUE, reports])
    async with runtime:
        await runtime.trigger(echo, {})
        await runtime.trigger(report)
        run = await runtime.execute_next(queues=[reports])
        assert run.task_id == "report"
        assert await runtime.execute_next(queues=["reports"]) is None
        assert (await runtime.execute_next()).task_id == "echo"


async def test_schema_drift_fails_the_attempt_before_the_handler_runs():
    called: list[int] = []

    @task("drift")
    async def loose(payload: dict) -> None:
        called.append(1)

    class Strict(BaseModel):
        required: int

    @task("drift", schema=Strict)
    async def strict(payload) -> None:
        called.append(2)

    (producer, consumer), _ = shared_runtimes([loose], [strict])
    async with producer, consumer:
        await producer.trigger(loose, {"other": "x"})
        run = await consumer.execute_next()
        assert run.status is RunStatus.FAILED
        assert run.failure.code is ErrorCode.VALIDATION_FAILED
        assert not run.failure.retryable
        assert called == []


class Tagged(BaseModel):
    tags: dict

    @field_validator("tags")
    @classmethod
    def needs_env(cls, value: dict) -> dict:
        return {"env": value["env"], **value}  # a KeyError, not a ValueError, for tags without "env"


async def test_a_schema_validator_raising_another_exception_is_a_validation_failure(caplog):
    @task("tagged")
    async def loose(payload: dict) -> None:
        return None

    @task("tagged")
    async def strict(payload: Tagged) -> None:
        return None

    (producer, consumer), _ = shared_runtimes([loose], [strict])
    async with producer, consumer:
        with pytest.raises(RunlaneError) as refused:
            await consumer.trigger(strict, {"tags": {}})
        assert refused.value.code is ErrorCode.VALIDATION_FAILED and "KeyError" in refused.value.message
        assert (await consumer.runs.list()).data == []
        source = (await producer.trigger(loose, {"tags": {"team": "a"}})).run
        with caplog.at_level(logging.ERROR, logger="runlane.task"):
            run = await consumer.execute_next()  # instead of raising KeyError, leaving the run running
        assert run.id == source.id and run.status is RunStatus.FAILED
        assert run.failure.code is ErrorCode.VALIDATION_FAILED and not run.failure.retryable
        assert run.failure.meta["error_type"] == "KeyError"
        assert "team" not in json.dumps(run.failure.model_dump(mode="json"))  # no part of the payload
        assert "needs_env" in caplog.text  # the validator's traceback is logged for whoever fixes it


async def test_a_stored_payload_fails_the_attempt_once_the_task_takes_none():
    called: list[int] = []

    @task("cleanup")
    async def with_payload(payload: dict) -> None:
        called.append(1)

    @task("cleanup")
    async def without_payload() -> None:  # the next deploy's handler: it takes no payload
        called.append(2)

    (producer, consumer), _ = shared_runtimes([with_payload], [without_payload])
    async with producer, consumer:
        source = (await producer.trigger(with_payload, {"older_than": "7d"})).run
        # As rerun refuses to copy that payload into a new run, the worker refuses the run it is stored in.
        with pytest.raises(RunlaneError) as refused:
            await consumer.runs.rerun((await producer.run_now(with_payload, {"older_than": "1d"})).id)
        assert refused.value.code is ErrorCode.VALIDATION_FAILED
        assert refused.value.message.endswith("trigger a new run with one that does.")  # not "omit it"
        run = await consumer.execute_next()
        assert run.id == source.id and run.status is RunStatus.FAILED
        assert run.failure.code is ErrorCode.VALIDATION_FAILED and not run.failure.retryable
        assert called == [1]  # only the run_now above, in the producer


async def test_retry_on_and_no_retry_on_decide_which_exceptions_are_retried():
    class Declined(Exception):
        pass

    raised: dict[str, BaseException] = {}

    @task("payments.filtered", retry=Retry(3, backoff="1s", retry_on=ConnectionError, no_retry_on=Declined))
    def filtered(payload: dict) -> None:
        raise raised[payload["case"]]

    cases = {
        "connection": ConnectionResetError("reset"),  # retry_on matches: retried
        "declined": Declined("card declined"),  # no_retry_on: failed at once
        "other": ValueError("bad amount"),  # matches no retry_on: failed at once
        "runlane": RunlaneError(ErrorCode.TASK_FAILED, "upstream", retryable=True),  # not a ConnectionError either
    }
    raised.update(cases)
    runtime, _ = make_runtime(filtered)
    async with runtime:
        for case in cases:
            await runtime.trigger(filtered, {"case": case}, run_id=f"run_{case}")
        for _ in cases:
            await runtime.execute_next()
        statuses = {case: (await runtime.runs.get(f"run_{case}")).status for case in cases}
        failure = (await runtime.runs.get("run_declined")).failure
    assert statuses == {
        "connection": RunStatus.RETRYING,
        "declined": RunStatus.FAILED,
        "other": RunStatus.FAILED,
        "runlane": RunStatus.FAILED,
    }
    assert failure is not None and failure.code is ErrorCode.TASK_FAILED and failure.retryable is False
    assert failure.message == "Task failed."  # still no exception text in history


async def test_a_non_retryable_runlane_error_inside_a_task_group_is_not_retried():
    async def stale() -> None:
        raise RunlaneError(ErrorCode.TASK_FAILED, "The report is stale.", retryable=False)

    @task("grouped.stale", retry=Retry(4, backoff="1s"))
    async def grouped(payload: dict) -> None:
        async with asyncio.TaskGroup() as group:
            group.create_task(stale())

    runtime, _ = make_runtime(grouped)
    async with runtime:
        run = (await runtime.trigger(grouped, {})).run
        done = await runtime.execute_next()
    assert done is not None and done.id == run.id and done.status is RunStatus.FAILED
    assert done.counters.attempts == 1 and done.failure.retryable is False


async def test_a_runlane_error_a_task_group_raises_alone_keeps_its_code_and_meta():
    async def declined() -> None:
        raise RunlaneError(ErrorCode.VALIDATION_FAILED, "Card declined.", meta={"decline_code": "expired"})

    @task("grouped.declined", retry=Retry(4, backoff="1s"))
    async def grouped(payload: dict) -> None:
        async with asyncio.TaskGroup() as group:
            group.create_task(declined())
            group.create_task(asyncio.sleep(10))  # cancelled by the group, not one of its exceptions

    runtime, _ = make_runtime(grouped)
    async with runtime:
        await runtime.trigger(grouped, {})
        done = await runtime.execute_next()
    assert done.status is RunStatus.FAILED and done.counters.attempts == 1
    assert (done.failure.code, done.failure.retryable) == (ErrorCode.VALIDATION_FAILED, False)
    assert done.failure.meta == {"decline_code": "expired"}


async def test_a_run_whose_task_is_not_registered_fails_without_retry():
    @task("known", retry=Retry(3))
    async def known() -> None:
        return None

    (producer, consumer), _ = shared_runtimes([known], [echo])
    async with producer, consumer:
        await producer.trigger(known)
        run = await consumer.execute_next()
        assert run.status is RunStatus.FAILED
        assert run.failure.code is ErrorCode.TASK_NOT_FOUND
        assert not run.failure.retryable


# ---------------------------------------------------------------------------------------------
# run_now


async def test_run_now_creates_claims_and_executes_one_attempt_inline():
    runtime, _ = make_runtime(echo)
    async with runtime:
        run = await runtime.run_now(echo, {"x": 1})
        assert run.status is RunStatus.SUCCEEDED
        assert run.output == {"echo": {"x": 1}}
        assert await event_types(runtime, run.id) == ["run.created", "run.lease_claimed", "run.started", "run.succeeded"]


async def test_run_now_duplicate_idempotency_returns_the_existing_run_without_executing():
    calls: list[int] = []

    @task("inline.keyed", idempotency_key="button")
    async def keyed() -> int:
        calls.append(1)
        return len(calls)

    runtime, _ = make_runtime(keyed)
    async with runtime:
        first = await runtime.run_now(keyed)
        second = await runtime.run_now(keyed)
        assert second.id == first.id and second.output == 1
        assert calls == [1]


async def test_run_now_returns_retrying_and_released_runs_without_looping():
    @task("inline.retry", retry=Retry(3, backoff="10s"))
    async def retrying() -> None:
        raise RuntimeError("transient")

    @task("inline.release")
    async def releasing(payload: dict, ctx: TaskContext):
        return ctx.release("1m", reason="not_ready")

    runtime, clock = make_runtime(retrying, releasing)
    async with runtime:
        run = await runtime.run_now(retrying)
        assert run.status is RunStatus.RETRYING and run.counters.attempts == 1
        run = await runtime.run_now(releasing, {})
        assert run.status is RunStatus.RELEASED and run.counters.releases == 1
        assert await runtime.execute_next() is None


async def test_run_now_singleton_conflict_rejects_before_creation():
    @task("inline.singleton", singleton_key="resource")
    async def guarded() -> None:
        return None

    runtime, _ = make_runtime(guarded)
    async with runtime:
        await runtime.trigger(guarded)
        with pytest.raises(RunlaneError) as raised:
            await runtime.run_now(guarded)
        assert get_storage_conflict_kind(raised.value) is StorageConflictKind.SINGLETON_KEY


@pytest.mark.parametrize("concurrency_key", [None, "tenant_a"])
async def test_run_now_on_a_full_bounded_queue_rejects_before_anything_is_written(concurrency_key):
    limited = queue("limited", concurrency_limit=1)
    release = asyncio.Event()
    started = asyncio.Event()

    @task("inline.bounded", queue=limited, concurrency_key=(lambda p: p["tenant"]) if concurrency_key else None)
    async def bounded(payload: dict) -> str:
        if payload.get("hold"):
            started.set()
            await release.wait()
        return payload["tenant"]

    runtime, _ = make_runtime(bounded, queues=[DEFAULT_QUEUE, limited])
    async with runtime:
        holder = asyncio.ensure_future(runtime.run_now(bounded, {"tenant": "tenant_a", "hold": True}))
        await asyncio.wait_for(started.wait(), 2)
        # The holder's inline lease occupies the only slot of its partition: run_now refuses a second
        # lease there, retryably, without creating the run; a trigger still creates a queued run.
        with pytest.raises(RunlaneError) as raised:
            await runtime.run_now(bounded, {"tenant": "tenant_a"}, run_id="run_refused")
        assert raised.value.code is ErrorCode.STORAGE_CONFLICT and raised.value.retryable
        assert get_storage_conflict_kind(raised.value) is StorageConflictKind.QUEUE_CAPACITY
        assert raised.value.meta["queue"] == "limited" and raised.value.meta["concurrency_limit"] == 1
        assert await runtime.store.get_run("run_refused") is None
        assert [summary.id for summary in (await runtime.runs.list()).data] == [(await holder_run(runtime)).id]
        queued = (await runtime.trigger(bounded, {"tenant": "tenant_a"})).run
        assert queued.status is RunStatus.QUEUED
        if concurrency_key:
            # Another capacity partition of the same queue still has its slot.
            other = await runtime.run_now(bounded, {"tenant": "tenant_b"})
            assert other.status is RunStatus.SUCCEEDED
        release.set()
        assert (await asyncio.wait_for(holder, 2)).status is RunStatus.SUCCEEDED
        # The slot is free again: the same call now succeeds.
        again = await runtime.run_now(bounded, {"tenant": "tenant_a"}, run_id="run_refused")
        assert again.status is RunStatus.SUCCEEDED and again.output == "tenant_a"


async def holder_run(runtime):
    (running,) = [summary for summary in (await runtime.runs.list()).data if summary.status is RunStatus.RUNNING]
    return running


async def test_run_now_with_an_aborted_signal_still_creates_the_run():
    @task("inline.signal")
    async def observe(payload: dict, ctx: TaskContext) -> bool:
        return ctx.signal.aborted

    runtime, _ = make_runtime(observe)
    async with runtime:
        controller = CancellationController()
        controller.abort()
        run = await runtime.run_now(observe, {}, signal=controller.signal)
        assert run.status is RunStatus.SUCCEEDED and run.output is True


async def test_run_now_rejects_when_the_inline_lease_is_lost():
    @task("inline.lost")
    async def lose(payload: dict, ctx: TaskContext) -> None:
        await ctx.signal.wait()

    (runtime, other), clock = shared_runtimes([lose], [lose])
    async with runtime, other:
        task_ = asyncio.ensure_future(runtime.run_now(lose, {}, lease_duration="1s", heartbeat_interval="10ms"))
        await asyncio.sleep(0.005)
        # A worker of another process recovers the run after its lease expires and claims it.
        clock.advance("2s")
        (run,) = (await runtime.runs.list()).data
        stolen = await other.store.claim([ClaimRequest(run.id, None, "thief", "tok", 60_000)])
        assert stolen[0].claimed
        with pytest.raises(RunlaneError) as raised:
            await asyncio.wait_for(task_, 2)
        assert get_storage_conflict_kind(raised.value) is StorageConflictKind.LEASE_OWNERSHIP


# ---------------------------------------------------------------------------------------------
# execute_delivery


def _message(run, queue_name=None) -> DeliveryMessage:
    return DeliveryMessage(
        environment=run.environment, run_id=run.id, queue=queue_name or run.queue, requested_at=run.created_at
    )


async def test_execute_delivery_executes_the_delivered_run():
    runtime, _ = make_runtime(echo)
    async with runtime:
        run = (await runtime.trigger(echo, {"n": 1})).run
        result = await runtime.execute_delivery(_message(run))
        assert result.status is ExecuteDeliveryStatus.EXECUTED
        assert result.run.status is RunStatus.SUCCEEDED
        again = await runtime.execute_delivery(_message(run).model_dump())
        assert (again.status, again.reason) == (ExecuteDeliveryStatus.IGNORED, ExecuteDeliveryIgnoredReason.TERMINAL)


async def test_execute_delivery_ignored_reasons():
    limited = queue("limited", concurrency_limit=1)

    @task("release.later")
    async def later(payload: dict, ctx: TaskContext):
        return ctx.release("1h")

    @task("hold", queue=limited)
    async def hold(payload: dict, ctx: TaskContext) -> None:
        await ctx.signal.wait()

    runtime, clock = make_runtime(echo, later, hold, queues=[DEFAULT_QUEUE, limited])
    async with runtime:
        queued = (await runtime.trigger(echo, {})).run
        ghost = queued.model_copy(update={"id": "run_missing"})
        result = await runtime.execute_delivery(_message(ghost))
        assert result.reason is ExecuteDeliveryIgnoredReason.RUN_NOT_FOUND
        result = await runtime.execute_delivery(_message(queued, "limited"))
        assert result.reason is ExecuteDeliveryIgnoredReason.WRONG_QUEUE
        released = (await runtime.run_now(later, {}))
        result = await runtime.execute_delivery(_message(released))
        assert result.reason is ExecuteDeliveryIgnoredReason.NOT_DUE
        # A running run whose lease is live is already leased; a second bounded run finds no capacity.
        first = (await runtime.trigger(hold, {})).run
        second = (await runtime.trigger(hold, {})).run
        holder = asyncio.ensure_future(runtime.execute_delivery(_message(first)))
        await asyncio.sleep(0.01)
        result = await runtime.execute_delivery(_message(first))
        assert result.reason is ExecuteDeliveryIgnoredReason.ALREADY_LEASED
        result = await runtime.execute_delivery(_message(second))
        assert result.reason is ExecuteDeliveryIgnoredReason.CLAIM_LOST
        for ignored in (result,):
            assert ignored.status is ExecuteDeliveryStatus.IGNORED
        await runtime.runs.cancel(first.id)
        done = await asyncio.wait_for(holder, 2)
        assert done.run.status is RunStatus.CANCELLED


async def test_execute_delivery_abandons_an_attempt_that_lost_its_lease(caplog):
    @task("slow")
    async def slow(payload: dict, ctx: TaskContext) -> None:
        await ctx.signal.wait()

    (runtime, other), clock = shared_runtimes([slow], [slow])
    caplog.set_level(logging.INFO, logger="runlane")
    async with runtime, other:
        run = (await runtime.trigger(slow, {})).run
        pending = asyncio.ensure_future(
            runtime.execute_delivery(_message(run), lease_duration="1s", heartbeat_interval="5ms")
        )
        # The attempt holds its lease before the clock moves past it (on a busy machine that can take a while).
        await wait_for_run_status(runtime, run.id, RunStatus.RUNNING, timeout="10s", interval="1ms")
        clock.advance("2s")
        # A worker of another process takes the run (this process never takes it from its own live attempt).
        assert (await other.store.claim([ClaimRequest(run.id, None, "thief", "tok", 60_000)]))[0].claimed
        result = await asyncio.wait_for(pending, 2)
        assert (result.status, result.reason) == (ExecuteDeliveryStatus.IGNORED, ExecuteDeliveryIgnoredReason.ABANDONED)
        [abandoned] = [record for record in caplog.records if record.name == "runlane.task"]
        assert (abandoned.levelno, abandoned.run_id, abandoned.attempt) == (logging.WARNING, run.id, 1)
        assert abandoned.getMessage().startswith(f"Run {run.id} (task slow): attempt 1 lost its lease;")


async def test_execute_delivery_persists_a_failure_for_an_unregistered_task_or_queue():
    legacy = queue("legacy")

    @task("legacy.task", queue=legacy)
    async def legacy_task() -> None:
        return None

    (producer, other), _ = shared_runtimes([echo, legacy_task], [], queues=[DEFAULT_QUEUE, legacy])
    # A consumer process that knows neither the legacy queue nor the echo task.
    consumer = create_runlane(lane=other.lane, queues=[DEFAULT_QUEUE], tasks=[], clock=other.clock)
    async with producer, consumer:
        for run in ((await producer.trigger(echo, {})).run, (await producer.trigger(legacy_task)).run):
            result = await consumer.execute_delivery(_message(run))
            assert result.status is ExecuteDeliveryStatus.EXECUTED
            assert result.run.status is RunStatus.FAILED
            assert not result.run.failure.retryable
        assert result.run.failure.code is ErrorCode.CONFIGURATION_INVALID


async def test_execute_delivery_rejects_an_aborted_signal_and_a_foreign_environment():
    runtime, _ = make_runtime(echo)
    async with runtime:
        run = (await runtime.trigger(echo, {})).run
        controller = CancellationController()
        controller.abort()
        with pytest.raises(RunlaneError) as raised:
            await runtime.execute_delivery(_message(run), signal=controller.signal)
        assert raised.value.code is ErrorCode.OPERATION_CANCELLED
        assert (await runtime.runs.get(run.id)).status is RunStatus.QUEUED
        foreign = _message(run).model_copy(update={"environment": Environment(name="other")})
        with pytest.raises(RunlaneError) as raised:
            await runtime.execute_delivery(foreign)
        assert raised.value.code is ErrorCode.CONFIGURATION_INVALID
        assert "give each environment SQS queues of its own" in raised.value.message  # what causes it
        with pytest.raises(RunlaneError) as raised:
            await runtime.execute_delivery({"run_id": run.id})
        assert raised.value.code is ErrorCode.CONFIGURATION_INVALID


async def test_run_events_page_in_sequence_and_time_order_with_cursors():
    @task("paged")
    async def paged(payload: dict, ctx: TaskContext):
        if ctx.attempt < 3:
            return ctx.release("1s")
        return "done"

    runtime, clock = make_runtime(paged)
    async with runtime:
        run = (await runtime.trigger(paged, {})).run
        for _ in range(3):
            await runtime.execute_next()
            clock.advance("1s")
        everything = (await runtime.runs.events(run.id, sort_by="sequence", limit=100)).data
        assert [record.sequence for record in everything] == list(range(1, len(everything) + 1))
        assert len(everything) == 11  # created, delivery requested, then claimed + started + outcome three times
        collected, cursor = [], None
        while True:
            page = await runtime.runs.events(run.id, sort_by="sequence", limit=4, cursor=cursor)
            collected.extend(page.data)
            cursor = page.next_cursor
            if cursor is None:
                break
        assert collected == everything
        newest_first = (await runtime.runs.events(run.id, sort_by="occurred_at", sort_direction="desc", limit=100)).data
        assert [r.sequence for r in newest_first] == [r.sequence for r in reversed(everything)]
        released = (await runtime.runs.events(run.id, types=["run.released"])).data
        assert [r.event.type.value for r in released] == ["run.released", "run.released"]
        with pytest.raises(RunlaneError) as raised:
            await runtime.runs.events(run.id, sort_by="sequence", limit=4, cursor=(await runtime.runs.events(run.id, limit=1)).next_cursor)
        assert raised.value.code is ErrorCode.VALIDATION_FAILED
        attempts = await runtime.runs.attempts(run.id)
        assert [a.status.value for a in attempts] == ["released", "released", "succeeded"]
        assert attempts[-1].output == "done"


# ---------------------------------------------------------------------------------------------
# Attempts that end with no outcome


async def _crash_next_attempt(runtime, clock, calls: list[int]) -> None:
    """Run the next attempt until its handler starts, then drop it as a killed worker would (no outcome,
    no heartbeat), and let its lease expire."""
    started = len(calls)
    attempt = asyncio.ensure_future(runtime.execute_next(lease_duration="30s", heartbeat_interval="20s"))
    for _ in range(1000):
        if len(calls) > started or attempt.done():
            break
        await asyncio.sleep(0.005)
    assert len(calls) == started + 1, attempt.result() if attempt.done() else "the attempt never started"
    attempt.cancel()
    await asyncio.gather(attempt, return_exceptions=True)
    clock.advance("31s")


@pytest.mark.parametrize(
    ("retry", "crashes"),
    [(None, 3), (Retry(2, backoff="1s"), 3), (Retry(5, backoff="1s"), 5)],
    ids=["no-retry-policy", "small-budget", "large-budget"],
)
async def test_a_run_whose_attempts_keep_ending_with_no_outcome_is_failed_once_its_attempts_are_spent(retry, crashes):
    calls: list[int] = []

    @task("native.crash", retry=retry)
    async def crashing(payload: dict, ctx: TaskContext) -> None:
        calls.append(ctx.attempt)
        await asyncio.sleep(3600)  # stands in for an attempt that takes its worker process down

    runtime, clock = make_runtime(crashing)
    async with runtime:
        run = (await runtime.trigger(crashing, {})).run
        for _ in range(crashes):
            await _crash_next_attempt(runtime, clock, calls)
        # Every crashed attempt so far was recovered; this one is failed without calling the handler.
        done = await asyncio.wait_for(runtime.execute_next(), 10)
        assert calls == list(range(1, crashes + 1))
        assert done.id == run.id and done.status is RunStatus.FAILED
        assert done.failure.code is ErrorCode.TASK_FAILED and not done.failure.retryable
        assert done.failure.meta == {"abandoned_attempts": crashes, "max_attempts": crashes}
        assert "ended with no outcome" in done.failure.message
        assert await runtime.execute_next() is None
        assert (await runtime.runs.get(run.id)).status is RunStatus.FAILED


async def test_failures_spend_the_budget_with_crashed_attempts_and_releases_spend_none():
    calls: list[int] = []

    @task("native.mixed", retry=Retry(4, backoff="1s"))
    async def mixed(payload: dict, ctx: TaskContext):
        calls.append(ctx.attempt)
        if ctx.attempt == 1:
            return ctx.release("1s")  # business waiting: spends no attempt
        if ctx.attempt == 2:
            raise RuntimeError("transient")
        await asyncio.sleep(3600)

    runtime, clock = make_runtime(mixed)
    async with runtime:
        run = (await runtime.trigger(mixed, {})).run
        assert (await runtime.execute_next()).status is RunStatus.RELEASED
        clock.advance("1s")
        assert (await runtime.execute_next()).status is RunStatus.RETRYING
        clock.advance("2s")
        for _ in range(3):  # attempts 3, 4 and 5 crash; with the failure of attempt 2 they spend 4
            await _crash_next_attempt(runtime, clock, calls)
        done = await asyncio.wait_for(runtime.execute_next(), 10)
        assert calls == [1, 2, 3, 4, 5]
        assert done.id == run.id and done.status is RunStatus.FAILED
        assert done.failure.meta == {"abandoned_attempts": 3, "max_attempts": 4}


async def test_a_crashed_attempt_within_the_budget_runs_again():
    calls: list[int] = []

    @task("native.once")
    async def flaky(payload: dict, ctx: TaskContext) -> int:
        calls.append(ctx.attempt)
        if ctx.attempt < 3:
            await asyncio.sleep(3600)
        return ctx.attempt

    runtime, clock = make_runtime(flaky)
    async with runtime:
        await runtime.trigger(flaky, {})
        await _crash_next_attempt(runtime, clock, calls)
        await _crash_next_attempt(runtime, clock, calls)
        done = await runtime.execute_next()
        assert done.status is RunStatus.SUCCEEDED and done.output == 3 and calls == [1, 2, 3]
