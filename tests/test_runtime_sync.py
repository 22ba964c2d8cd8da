"""``runlane.sync``: the blocking facade, used from plain synchronous code."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from runlane import (
    ErrorCode, RunlaneError, RunRecord, RunStatus, TaskContext, TriggerOutcomeType, WorkerMode, queue, task,
)

from runtime_support import DEFAULT_QUEUE, make_runtime


@task("sync.echo")
def echo(payload: dict) -> dict:
    return payload


@task("sync.wait")
async def wait_signal(payload: dict, ctx: TaskContext):
    if ctx.attempt == 1:
        return ctx.wait_for_signal("go")
    return "went"


def test_the_facade_runs_the_whole_lifecycle_without_an_event_loop():
    runtime, _ = make_runtime(echo, wait_signal)
    sync = runtime.sync
    assert runtime.sync is sync
    with sync:
        result = sync.trigger(echo, {"n": 1})
        assert result.outcome is TriggerOutcomeType.CREATED
        run = sync.execute_next()
        assert run.status is RunStatus.SUCCEEDED and run.output == {"n": 1}
        assert sync.runs.get(run.id).status is RunStatus.SUCCEEDED
        assert [e.event.type.value for e in sync.runs.events(run.id).data][-1] == "run.succeeded"
        assert sync.run_now(echo, {"n": 2}).output == {"n": 2}
        waiting = sync.run_now(wait_signal, {})
        assert [r.id for r in sync.signals.send("go")] == [waiting.id]
        assert sync.execute_next().output == "went"
        queued = sync.trigger(echo, {"n": 3}).run
        assert sync.runs.cancel(queued.id).status is RunStatus.CANCELLED
        assert sync.tick().delivery_requested == 0
        assert sync.tasks["sync.echo"] is echo and sync.environment.name == "default"
    assert runtime.closed
    with pytest.raises(RunlaneError) as raised:
        sync.trigger(echo, {})
    assert raised.value.code is ErrorCode.CONFIGURATION_INVALID


def test_sync_workers_drain_and_stop():
    runtime, _ = make_runtime(echo)
    with runtime.sync as sync:
        for n in range(5):
            sync.trigger(echo, {"n": n})
        worker = sync.worker(mode=WorkerMode.DRAIN, concurrency=2)
        worker.wait(timeout=5)
        assert worker.executed == 5
        poller = sync.worker(empty_poll_delay="5ms")
        sync.trigger(echo, {"n": 9})
        poller.stop()
        assert poller.closed.done()


def test_the_facade_can_serve_a_runtime_an_application_loop_also_uses():
    runtime, _ = make_runtime(echo)
    results: list = []

    async def application() -> None:
        async with runtime:
            # A producer thread triggers through the facade while this loop runs a worker.
            worker = runtime.worker(empty_poll_delay="5ms")
            thread = threading.Thread(target=lambda: results.extend(runtime.sync.trigger(echo, {"n": n}) for n in range(3)))
            thread.start()
            while worker.executed < 3:
                await asyncio.sleep(0.002)
            thread.join()
            await worker.stop()

    asyncio.run(application())
    assert len(results) == 3 and runtime.closed


def test_calling_the_facade_from_its_own_loop_is_refused():
    runtime, _ = make_runtime(echo)
    sync = runtime.sync

    async def inside() -> None:
        sync.trigger(echo, {})

    with pytest.raises(RunlaneError, match="own event-loop thread"):
        sync.call(inside)
    sync.close()


async def test_calling_the_facade_from_async_code_is_refused_instead_of_blocking_the_loop():
    runtime, _ = make_runtime(echo)
    worker = await asyncio.to_thread(runtime.sync.worker)
    async with runtime:
        for call in (lambda: runtime.sync.trigger(echo, {}), runtime.sync.close, lambda: worker.wait(0.5)):
            with pytest.raises(RunlaneError) as raised:
                call()
            assert raised.value.code is ErrorCode.CONFIGURATION_INVALID
            assert "this thread runs an event loop (async code): await the async API" in raised.value.message
        assert not runtime.closed  # the refused close() did nothing


@task("sync.slow")
def slow(payload: dict) -> str:
    time.sleep(payload["seconds"])
    return "done"


def test_close_while_a_call_is_running_answers_that_call():
    runtime, _ = make_runtime(slow)
    sync = runtime.sync
    sync.start()
    answered: list[object] = []

    def request() -> None:
        try:
            answered.append(sync.run_now(slow, {"seconds": 0.3}))
        except RunlaneError as error:
            answered.append(error)

    thread = threading.Thread(target=request, daemon=True)
    thread.start()
    deadline = time.monotonic() + 5
    while not any(s.status is RunStatus.RUNNING for s in sync.runs.list().data):  # the call is under way
        assert time.monotonic() < deadline
        time.sleep(0.01)
    sync.close()
    thread.join(timeout=10)
    assert not thread.is_alive(), "the call in flight was never answered"
    assert len(answered) == 1  # its result, or the error of a closed lane: never silence
    (answer,) = answered
    assert isinstance(answer, RunlaneError) or answer.status is RunStatus.SUCCEEDED


def test_a_sync_worker_stopped_after_close_does_nothing():
    runtime, _ = make_runtime(echo)
    worker = runtime.sync.worker(mode=WorkerMode.POLL, empty_poll_delay="10ms")
    runtime.sync.close()
    assert worker.closed.done()
    worker.stop()  # shutdown code often stops what it started after closing the runtime


def in_forked_child(call: Callable[[], str], *, alarm: int = 5) -> str:
    """What ``call()`` returns in a child forked now, or the code and message of the ``RunlaneError`` it
    raises ("failed" when it raises anything else). The child never runs pytest's teardown, and ``alarm``
    seconds end a call that hangs (killed, it reports nothing: the result is empty)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        outcome = "failed"
        try:
            with contextlib.suppress(BaseException):
                signal.alarm(alarm)
                try:
                    outcome = call()
                except RunlaneError as error:
                    outcome = f"{error.code.value}: {error.message}"
        finally:
            os.write(write, outcome.encode())
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read) as reader:
        return reader.read()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_process_forked_after_the_runtime_started_is_refused_and_the_parent_keeps_working(tmp_path):
    from runlane import create_runlane, queue
    from runlane_local import sqlite_lane

    default = queue("default", default=True)
    runtime = create_runlane(lane=sqlite_lane(tmp_path / "fork.db"), queues=[default], tasks=[echo])
    runtime.sync.start()  # as an application does at start-up, before its server forks workers

    def first_call() -> str:
        try:
            runtime.sync.trigger(echo, {"n": 1})
            return "no error"
        finally:
            runtime.sync.close()  # leaves the parent's connections alone

    try:
        outcome = in_forked_child(first_call, alarm=20)
        assert outcome.startswith("configuration_invalid: ") and "forked" in outcome and "after the fork" in outcome
        assert runtime.sync.trigger(echo, {"n": 2}).outcome is TriggerOutcomeType.CREATED
        assert runtime.sync.execute_next().status is RunStatus.SUCCEEDED
    finally:
        runtime.sync.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_process_forked_after_a_failed_first_call_starts_a_runtime_of_its_own(tmp_path):
    # The master's first facade call failed before the lane started (a typo, storage down at start-up),
    # so the runtime is not started but the facade loop's thread is: the child's calls used to be sent
    # to that loop, which no thread runs after the fork, and waited for ever.
    from runlane import create_runlane, queue
    from runlane_local import sqlite_lane

    default = queue("default", default=True)
    runtime = create_runlane(lane=sqlite_lane(tmp_path / "fork.db"), queues=[default], tasks=[echo])
    with pytest.raises(RunlaneError) as refused:
        runtime.sync.trigger("sync.no_such_task", {})
    assert refused.value.code is ErrorCode.TASK_NOT_FOUND

    def trigger_and_execute() -> str:
        outcome = runtime.sync.trigger(echo, {"n": 1}).outcome.value
        outcome += " " + runtime.sync.execute_next().status.value
        runtime.sync.close()
        return outcome

    try:
        assert in_forked_child(trigger_and_execute) == "created succeeded"
        assert runtime.sync.trigger(echo, {"n": 2}).outcome is TriggerOutcomeType.CREATED
    finally:
        runtime.sync.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_process_forked_while_another_thread_starts_the_runtime_is_refused_instead_of_waiting(tmp_path, monkeypatch):
    # The start runs on the parent's facade loop and never ends in the child: a call there used to wait
    # for it for ever, then found a lane half started on a loop the child does not run.
    from runlane import create_runlane, queue
    from runlane_local import sqlite_lane

    lane = sqlite_lane(tmp_path / "fork.db")
    real_start = lane.storage.start
    entered, release = threading.Event(), threading.Event()

    async def slow_start() -> None:
        entered.set()
        await asyncio.to_thread(release.wait, 5)
        await real_start()

    monkeypatch.setattr(lane.storage, "start", slow_start)
    runtime = create_runlane(lane=lane, queues=[queue("default", default=True)], tasks=[echo])
    starter = threading.Thread(target=runtime.sync.start)
    starter.start()
    try:
        assert entered.wait(5)
        outcome = in_forked_child(lambda: runtime.sync.trigger(echo, {"n": 1}) and "no error")
        assert outcome.startswith("configuration_invalid: ") and "forked" in outcome
        release.set()
        starter.join(5)
        assert runtime.sync.trigger(echo, {"n": 2}).outcome is TriggerOutcomeType.CREATED
    finally:
        release.set()
        starter.join(5)
        runtime.sync.close()


EXIT_WITHOUT_CLOSE = """
import sys, time
from runlane import create_runlane, queue, task
from runlane_local import sqlite_lane

default = queue("default", default=True)


@task("slow")
def slow(payload: dict) -> str:
    time.sleep(0.5)
    return "done"


@task("slow_async")
async def slow_async(payload: dict) -> str:
    import asyncio
    await asyncio.sleep(0.5)
    return "done"


runlane = create_runlane(lane=sqlite_lane(sys.argv[1]), queues=[default], tasks=[slow, slow_async])
runlane.sync.worker(concurrency=2)
run_id = runlane.sync.trigger(sys.argv[2], {}).run.id
while runlane.sync.runs.get(run_id).status != "running":
    time.sleep(0.01)
print(run_id, flush=True)
# The script ends here without runlane.sync.close(), as a web app's process usually does.
"""


@pytest.mark.parametrize("handler", ["slow", "slow_async"])
def test_a_process_exiting_without_close_records_the_running_attempt_on_sqlite(tmp_path, handler) -> None:
    # At exit the facade stops its workers (a handler that does not look at ctx.signal runs on) and closes
    # the runtime, which waits for the attempt and writes its outcome: after the interpreter's thread pools
    # stopped taking work, which the SQLite lane must not depend on.
    from runlane import create_runlane, queue
    from runlane_local import sqlite_lane

    path = tmp_path / "runlane.db"
    done = subprocess.run(
        [sys.executable, "-c", EXIT_WITHOUT_CLOSE, str(path), handler], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and "storage_unavailable" not in done.stderr, done.stderr
    run_id = done.stdout.strip()

    async def stored() -> RunStatus:
        async with create_runlane(lane=sqlite_lane(path), queues=[queue("default", default=True)]) as reader:
            return (await reader.runs.get(run_id)).status  # type: ignore[union-attr]

    assert asyncio.run(stored()) is RunStatus.SUCCEEDED


# What the scripts below start with: a runtime over the SQLite file named by their first argument.
SQLITE_SCRIPT = """
import asyncio, atexit, os, sys
from runlane import RunlaneError, create_runlane, queue, task
from runlane_local import sqlite_lane

default = queue("default", default=True)


@task("noop")
async def noop(payload: dict) -> None:
    return None


runlane = create_runlane(lane=sqlite_lane(sys.argv[1]), queues=[default], tasks=[noop])
"""


def run_sqlite_script(tmp_path, body: str, *, first: str = "") -> subprocess.CompletedProcess[str]:
    """Run ``first`` (before runlane is imported) + ``SQLITE_SCRIPT`` + ``body`` in a Python process of its
    own; its completed process."""
    return subprocess.run(
        [sys.executable, "-c", first + SQLITE_SCRIPT + body, str(tmp_path / "runlane.db")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


# Registered before runlane is imported, so it runs after the facade's exit hook.
REPORT_AT_EXIT = """
import atexit
atexit.register(lambda: report())
"""

STARTED_ON_A_CLOSED_LOOP = """


def report() -> None:
    try:
        asyncio.run(runlane.trigger(noop, {}))
    except RunlaneError as error:
        print("closed at exit" if "closed" in error.message else error.message, flush=True)
    else:
        print("still open at exit", flush=True)


asyncio.run(runlane.trigger(noop, {}))  # starts the runtime on a loop that then closes
runlane.sync.trigger(noop, {})  # then the facade, on its own loop
"""


def test_a_runtime_started_on_a_loop_since_closed_is_closed_by_the_facade_at_exit(tmp_path) -> None:
    # Nothing else can close it: its first loop is gone, and its connections on the facade loop would
    # otherwise hold up the exit until they are dropped.
    done = run_sqlite_script(tmp_path, STARTED_ON_A_CLOSED_LOOP, first=REPORT_AT_EXIT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "closed at exit"


def test_a_closed_sync_facade_leaves_no_exit_hook_behind():
    """A process that makes runtime after runtime (a test suite, a runtime per request) keeps no exit
    hook, nor anything else, per closed runtime: one hook closes whatever facades still run at exit."""
    import atexit
    import gc

    from runlane.core.sync import SyncRunlane

    before = atexit._ncallbacks()
    for _ in range(20):
        runtime, _ = make_runtime(echo)
        runtime.sync.trigger(echo, {"n": 1})
        runtime.sync.close()
    del runtime
    gc.collect()
    assert atexit._ncallbacks() == before
    assert not [value for value in gc.get_objects() if type(value) is SyncRunlane]


FORKED_CHILD_EXITS = """
runlane.sync.trigger(noop, {})


async def wait_for_work() -> None:
    await asyncio.get_running_loop().create_future()


workers = []


async def background() -> None:  # as a connection pool keeps workers waiting on the facade loop
    workers.append(asyncio.get_running_loop().create_task(wait_for_work(), name="pool-worker"))


async def stop() -> None:
    workers[0].cancel()


runlane.sync.call(background)
pid = os.fork()
if pid == 0:
    sys.exit(0)  # a forked server worker that never used Runlane, exiting normally
os.waitpid(pid, 0)
runlane.sync.call(stop)
runlane.sync.close()
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_exits_without_warnings_about_the_parents_tasks(tmp_path):
    done = run_sqlite_script(tmp_path, FORKED_CHILD_EXITS)
    assert done.returncode == 0, done.stderr
    assert "Task was destroyed" not in done.stderr, done.stderr


def test_a_def_handler_stopping_its_own_sync_worker_is_refused_instead_of_waiting_for_itself():
    """The stop waits for the worker's attempts, the handler's own included: it was never answered, and the
    worker and runlane.sync.close() waited for ever. It is refused as close() is; another worker stops."""
    handles: dict[str, object] = {}
    refused: list[RunlaneError] = []

    @task("sync.stops.its.worker")
    def stops(payload: dict) -> str:
        handles["other"].stop()  # type: ignore[attr-defined]
        try:
            handles["own"].stop()  # type: ignore[attr-defined]
        except RunlaneError as error:
            refused.append(error)
        return "returned"

    runtime, _ = make_runtime(stops, queues=[DEFAULT_QUEUE, queue("other")])
    sync = runtime.sync
    handles["other"] = sync.worker(queues=["other"])
    run = sync.trigger(stops, {}).run
    handles["own"] = sync.worker(mode=WorkerMode.POLL, empty_poll_delay="10ms")
    assert sync.runs.wait(run.id, timeout="10s").output == "returned"
    (error,) = refused
    assert error.code is ErrorCode.CONFIGURATION_INVALID
    assert error.message.startswith(f"worker.stop() was called by the handler of run {run.id}")
    assert handles["other"].closed.done()  # type: ignore[attr-defined]
    handles["own"].stop()  # type: ignore[attr-defined]
    sync.close()


def test_a_call_after_close_is_refused_without_starting_a_facade_loop_that_would_outlive_it():
    """A runtime called again after close() started a new facade loop thread, which ran until the process exited."""
    before = {thread.ident for thread in threading.enumerate()}
    runtime, _ = make_runtime(echo)
    runtime.sync.trigger(echo, {})
    runtime.sync.close()
    for call in (lambda: runtime.sync.trigger(echo, {}), runtime.sync.runs.list):
        with pytest.raises(RunlaneError) as raised:
            call()
        assert raised.value.code is ErrorCode.CONFIGURATION_INVALID
        assert raised.value.message.startswith("This Runlane runtime is closed")
    assert [thread.name for thread in threading.enumerate() if thread.ident not in before] == []
    runtime.sync.close()  # closing again does nothing


INTERRUPTED_WAITS = """
import signal, threading, time

run_id = runlane.sync.trigger(noop, {}).run.id  # no worker: it stays queued
for _ in range(3):  # Ctrl-C, three times, in a shell that goes on (python -i, a Django shell)
    threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT)).start()
    try:
        runlane.sync.runs.wait(run_id)
    except KeyboardInterrupt:
        pass


async def calls_left() -> list[str]:
    await asyncio.sleep(0.05)  # what was cancelled has ended
    return [task.get_coro().__qualname__ for task in asyncio.all_tasks() if task is not asyncio.current_task()]


print(runlane.sync.call(calls_left), flush=True)
runlane.sync.close()
"""


INTERRUPTED_RUN_NOW = """
import signal, threading


@task("cooperative")
async def cooperative(payload: dict, ctx) -> None:
    await ctx.signal.wait()
    ctx.signal.raise_if_aborted()


runlane = create_runlane(lane=sqlite_lane(sys.argv[1]), queues=[default], tasks=[cooperative])
threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
runlane.sync.run_now(cooperative, {}, run_id="run_interrupted")  # Ctrl-C ends the script here
"""


def test_a_wait_interrupted_by_ctrl_c_stops_instead_of_going_on_for_nobody(tmp_path) -> None:
    """runs.wait() interrupted went on polling storage on the facade loop until the runtime closed. An
    interrupted run_now() goes on, for the close at exit to stop its attempt and hand its run back."""
    done = run_sqlite_script(tmp_path, INTERRUPTED_WAITS)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"

    done = run_sqlite_script(tmp_path, INTERRUPTED_RUN_NOW)
    assert "KeyboardInterrupt" in done.stderr, done.stderr

    async def stored() -> tuple[RunStatus, str | None]:
        from runlane import create_runlane, queue
        from runlane_local import sqlite_lane

        lane = sqlite_lane(tmp_path / "runlane.db")
        async with create_runlane(lane=lane, queues=[queue("default", default=True)]) as reader:
            run = await reader.runs.get("run_interrupted")
            return run.status, (await reader.runs.attempts(run.id))[-1].release_reason  # type: ignore[union-attr]

    assert asyncio.run(stored()) == (RunStatus.RELEASED, "worker_stopped")


def in_a_thread(call: Callable[[], object], timeout: float = 10.0) -> object:
    """``call()``'s result (or what it raised) from a daemon thread, so a call that never returns fails the test."""
    answers: list[object] = []

    def answer() -> None:
        try:
            answers.append(call())
        except BaseException as error:  # noqa: BLE001 - SystemExit included: it is what is checked
            answers.append(error)

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    thread.join(timeout)
    assert answers, f"the call had not returned after {timeout} s"
    return answers[0]


def test_an_async_def_handler_calling_sys_exit_on_the_facade_loop_fails_its_attempt():
    """On the facade loop's thread sys.exit() ends only that thread, as it does a def handler's: it stopped the
    loop instead, so run_now() waited for ever and every later call found the loop closed."""

    @task("sync.async.exits")
    async def exits(payload: dict) -> None:
        sys.exit(3)

    runtime, _ = make_runtime(exits, echo)
    sync = runtime.sync
    try:
        run = in_a_thread(lambda: sync.run_now(exits, {}))
        assert isinstance(run, RunRecord), run
        assert run.status is RunStatus.FAILED and run.failure.code is ErrorCode.TASK_FAILED  # type: ignore[union-attr]
        assert sync.run_now(echo, {"n": 1}).output == {"n": 1}
    finally:
        in_a_thread(sync.close)


def test_sys_exit_in_a_sync_workers_callback_reaches_its_wait_and_the_facade_serves_on():
    """A SystemExit raised by code on the facade loop (a worker's on_run_executed) stopped the loop and ended
    its thread: the worker's wait() never answered, and every later call failed with 'Event loop is closed'."""

    def exits(run: RunRecord) -> None:
        sys.exit(4)

    runtime, _ = make_runtime(echo)
    sync = runtime.sync
    try:
        worker = sync.worker(empty_poll_delay="5ms", on_run_executed=exits)
        sync.trigger(echo, {"n": 1})
        raised = in_a_thread(lambda: worker.wait(timeout=5))
        assert isinstance(raised, SystemExit) and raised.code == 4, raised
        assert sync.run_now(echo, {"n": 2}).output == {"n": 2}
    finally:
        in_a_thread(sync.close)


def test_a_call_that_found_the_facade_loop_just_before_close_stopped_it_is_refused_as_closed(monkeypatch):
    """A call in one thread that found the facade loop as close() in another stopped it was sent to the
    closed loop: it failed with RuntimeError('Event loop is closed') and a 'never awaited' warning, or, sent
    between the loop's stop and its close, waited for ever. It is refused as a call after close is."""
    runtime, _ = make_runtime(echo)
    sync = runtime.sync
    sync.trigger(echo, {})
    found, closed = threading.Event(), threading.Event()
    send = asyncio.run_coroutine_threadsafe

    def late(coroutine, loop):  # the call has found the loop, and goes on only once close() has run
        if threading.current_thread().name == "late-call":
            found.set()
            closed.wait(10)
        return send(coroutine, loop)

    monkeypatch.setattr(asyncio, "run_coroutine_threadsafe", late)
    thread, answers = _late_call(sync)
    assert found.wait(10)
    sync.close()
    closed.set()
    thread.join(10)
    (answer,) = answers
    assert isinstance(answer, RunlaneError) and answer.code is ErrorCode.CONFIGURATION_INVALID, answer
    assert answer.message.startswith("This Runlane runtime is closed")


def _late_call(sync: Any) -> tuple[threading.Thread, list[object]]:
    """A ``runs.get`` on a thread named ``late-call``, started: its answer (or error) lands in the list."""
    answers: list[object] = []

    def call() -> None:
        try:
            answers.append(sync.runs.get("run_missing"))
        except BaseException as error:  # noqa: BLE001 - what the call raised is what is checked
            answers.append(error)

    thread = threading.Thread(target=call, name="late-call", daemon=True)
    thread.start()
    return thread, answers


def test_a_call_sent_as_close_stops_the_facade_loop_is_answered_instead_of_waiting_for_ever(monkeypatch):
    import runlane.core.sync

    monkeypatch.setattr(runlane.core.sync, "_LOOP_CHECK_S", 0.01)  # how soon the caller sees the loop closed
    runtime, _ = make_runtime(echo)
    sync = runtime.sync
    stopped, sent = threading.Event(), threading.Event()
    make_loop = asyncio.new_event_loop

    def closing_slowly() -> asyncio.AbstractEventLoop:  # a call arrives between the loop's stop and its close
        loop = make_loop()
        close = loop.close

        def close_after_the_call() -> None:
            stopped.set()
            sent.wait(10)
            close()

        loop.close = close_after_the_call  # type: ignore[method-assign]
        return loop

    monkeypatch.setattr(asyncio, "new_event_loop", closing_slowly)
    sync.trigger(echo, {})
    send = asyncio.run_coroutine_threadsafe

    found = threading.Event()

    def when_stopped(coroutine, loop):  # the call has found the loop, and goes on once the loop has stopped
        if threading.current_thread().name == "late-call":
            found.set()
            stopped.wait(10)
            try:
                return send(coroutine, loop)
            finally:
                sent.set()
        return send(coroutine, loop)

    monkeypatch.setattr(asyncio, "run_coroutine_threadsafe", when_stopped)
    thread, answers = _late_call(sync)
    assert found.wait(10)
    sync.close()
    thread.join(10)
    assert answers, "the call waited on a loop that had stopped"
    (answer,) = answers
    assert isinstance(answer, RunlaneError) and answer.code is ErrorCode.CONFIGURATION_INVALID, answer
