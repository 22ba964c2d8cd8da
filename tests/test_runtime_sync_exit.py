"""``runlane.sync`` at interpreter exit: what a process that never calls ``close()`` leaves behind."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runlane import RunStatus, create_runlane, queue
from runlane_local import sqlite_lane

# The exit close waits this long at most (runlane.core.sync._EXIT_CLOSE_S): a process handing its run back
# must exit well within it.
EXIT_CLOSE_S = 10.0

# A worker runs a def handler that checks ctx.signal until it is aborted (for 30 s at most), then the
# process ends: its main module returns, or Ctrl-C interrupts the worker.wait() it blocks in. Or run_now()
# runs the handler: Ctrl-C interrupts it in the main thread, or the main module returns while a thread of
# its own waits in it.
COOPERATIVE_DEF_HANDLER = """
import pathlib, sys, threading, time
from runlane import TaskContext, create_runlane, queue, task
from runlane_local import sqlite_lane

default = queue("default", default=True)
running = pathlib.Path(sys.argv[2])


@task("poll")
def poll(payload: dict, ctx: TaskContext) -> str:
    running.write_text("running")
    deadline = time.monotonic() + 30
    while not ctx.signal.aborted and time.monotonic() < deadline:
        time.sleep(0.005)
    ctx.signal.raise_if_aborted()
    return "never aborted"


runlane = create_runlane(lane=sqlite_lane(sys.argv[1]), queues=[default], tasks=[poll])
if sys.argv[3] == "run_now":
    print("run_by_run_now", flush=True)
    runlane.sync.run_now(poll, {}, run_id="run_by_run_now")
elif sys.argv[3] == "run_now_in_a_thread":
    print("run_by_run_now", flush=True)
    threading.Thread(target=runlane.sync.run_now, args=(poll, {}), kwargs={"run_id": "run_by_run_now"}).start()
else:
    print(runlane.sync.trigger(poll, {}).run.id, flush=True)
    worker = runlane.sync.worker()
    if sys.argv[3] == "wait":
        worker.wait()
deadline = time.monotonic() + 20
while not running.exists() and time.monotonic() < deadline:
    time.sleep(0.005)
# The script ends here without runlane.sync.close(), as a web app's process usually does.
"""


def stored_attempt(path: Path, run_id: str) -> tuple[RunStatus, str | None]:
    """The run's status and its last attempt's release reason, read by a runtime of this process."""

    async def read() -> tuple[RunStatus, str | None]:
        async with create_runlane(lane=sqlite_lane(path), queues=[queue("default", default=True)]) as reader:
            run = await reader.runs.get(run_id)
            assert run is not None
            attempts = await reader.runs.attempts(run_id)
            return run.status, attempts[-1].release_reason

    return asyncio.run(read())


@pytest.mark.parametrize("ending", ["return", "wait", "run_now", "run_now_in_a_thread"])
def test_a_process_exiting_while_a_cooperative_def_handler_runs_hands_its_run_back(tmp_path, ending) -> None:
    # Def handlers run in a thread pool the interpreter joins at exit before any atexit hook: the facade
    # must abort ctx.signal before that join, as it does for an async handler, or the exit waits for the
    # handler as long as it runs. A run_now() handler's too: it was aborted only by the runtime's close, after
    # that join, so the exit waited for ever for a handler waiting for its signal.
    path, running = tmp_path / "runlane.db", tmp_path / "running"
    process = subprocess.Popen(
        [sys.executable, "-c", COOPERATIVE_DEF_HANDLER, str(path), str(running), ending],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while not running.exists():
            assert process.poll() is None and time.monotonic() < deadline, "the handler never started"
            time.sleep(0.005)
        started_exit = time.monotonic()
        if ending in ("wait", "run_now"):
            process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=60)
        exited_in = time.monotonic() - started_exit
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert exited_in < EXIT_CLOSE_S / 2, f"the exit waited {exited_in:.1f} s for the handler: {stderr}"
    if ending in ("return", "run_now_in_a_thread"):
        assert process.returncode == 0, stderr
    assert "storage_unavailable" not in stderr, stderr
    assert stored_attempt(path, stdout.strip()) == (RunStatus.RELEASED, "worker_stopped")


# The head of the scripts below: a runtime with a def task ``echo`` over the SQLite file of argv[1].
ECHO_RUNTIME = """
import sys
from runlane import create_runlane, queue, task
from runlane_local import sqlite_lane

default = queue("default", default=True)


@task("echo")
def echo(payload: dict) -> dict:
    return payload


runlane = create_runlane(lane=sqlite_lane(sys.argv[1]), queues=[default], tasks=[echo])
"""

# Hooks run in the reverse order of their registration: ``late``, registered after runlane was imported,
# uses the facade for the first time while the process exits, twice; then the facade's own exit hook
# (registered when runlane was imported) closes the runtime; then ``report``, registered before runlane was
# imported, says whether the runtime ``late`` started was closed.
FIRST_USED_AT_EXIT = """
import atexit


def report() -> None:
    print("closed" if runlane.closed else "still open", flush=True)


atexit.register(report)
""" + ECHO_RUNTIME + """


def late() -> None:
    print(runlane.sync.run_now(echo, {"n": 1}).status.value, flush=True)
    print(runlane.sync.trigger(echo, {"n": 2}).outcome.value, flush=True)


atexit.register(late)
"""


def run_script(script: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """``script`` in a Python process of its own, over the SQLite file ``runlane.db`` in ``tmp_path``; it must
    exit 0."""
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "runlane.db")], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done


def test_an_atexit_hook_uses_the_facade_for_every_call_it_makes_and_the_runtime_closes_after_it(tmp_path) -> None:
    done = run_script(FIRST_USED_AT_EXIT, tmp_path)
    # The def handler gets no thread this late: the run is handed back for a worker, and the log says why,
    # not that the process is at a limit on threads. The second call works too.
    assert done.stdout.split() == ["released", "created", "closed"], done.stderr
    assert "this process is exiting" in done.stderr, done.stderr
    assert "ulimit" not in done.stderr, done.stderr


# ``early``, registered before runlane was imported, runs after the facade's exit hook closed the runtime
# that the main module used.
USED_BY_AN_EARLIER_ATEXIT_HOOK = """
import atexit


def early() -> None:
    try:
        runlane.sync.trigger(echo, {"n": 2})
    except Exception as error:
        print(type(error).__name__, error, flush=True)


atexit.register(early)
""" + ECHO_RUNTIME + """
print(runlane.sync.trigger(echo, {"n": 1}).outcome.value, flush=True)
"""


def test_a_call_from_an_atexit_hook_registered_before_runlane_says_why_the_runtime_is_closed(tmp_path) -> None:
    # It was told "This Runlane runtime is closed; create a new runtime", by a process that never closed it.
    done = run_script(USED_BY_AN_EARLIER_ATEXIT_HOOK, tmp_path)
    created, refusal = done.stdout.splitlines()
    assert created == "created" and refusal.startswith("RunlaneError "), done.stdout
    assert "closed as the process exits" in refusal and "after importing runlane" in refusal, refusal


# A thread still running when the main module returns goes on using the facade: the runtime closes once
# the interpreter has waited for it, not when the workers stop.
THREAD_OUTLIVES_MAIN = ECHO_RUNTIME + """
import threading, time
runlane.sync.worker()


def producer() -> None:
    time.sleep(0.05)  # after the main module has returned
    for n in range(3):
        print(runlane.sync.trigger(echo, {"n": n}).outcome.value, flush=True)


threading.Thread(target=producer).start()
"""


def test_a_thread_outliving_the_main_module_still_triggers_through_the_facade(tmp_path) -> None:
    done = run_script(THREAD_OUTLIVES_MAIN, tmp_path)
    assert done.stdout.split() == ["created"] * 3, done.stderr
