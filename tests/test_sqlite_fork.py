"""Processes forked while a SQLite lane is busy open the same file with lanes of their own; a start
whose connection never opens fails instead of hanging."""

from __future__ import annotations

import os
import signal
import sqlite3
import threading
import time
from typing import Any

import pytest

from runlane import ErrorCode, Runlane, RunlaneError, TriggerOutcomeType, create_runlane, queue, task
from runlane_local import sqlite_lane, sqlite_storage
from runlane_local import sqlite as sqlite_module

DEFAULT = queue("default", default=True)
CHILDREN = 8
CHILD_TIMEOUT = 6.0  # seconds for all children together; each needs well under one


@task("fork.echo")
def echo(payload: dict) -> dict:
    return payload


def _child(path: str, number: int) -> None:
    """The forked child: a runtime of its own on the same file, one run, closed. Never returns."""
    status = 1
    try:
        runtime = create_runlane(lane=sqlite_lane(path), queues=[DEFAULT], tasks=[echo])
        try:
            result = runtime.sync.trigger(echo, {"child": number}, idempotency_key=f"child-{number}")
            if result.outcome is TriggerOutcomeType.CREATED:
                status = 0
        finally:
            runtime.sync.close()
    except BaseException:  # noqa: BLE001 - reported through the exit status; pytest must not run here
        status = 2
    finally:
        os._exit(status)


def _wait_all(pids: list[int], deadline: float) -> dict[int, int | None]:
    """Each child's exit status, ``None`` for one still running at ``deadline`` (then killed)."""
    statuses: dict[int, int | None] = {}
    pending = set(pids)
    while pending and time.monotonic() < deadline:
        for pid in list(pending):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                statuses[pid] = os.waitstatus_to_exitcode(status)
                pending.discard(pid)
        if pending:
            time.sleep(0.005)
    for pid in pending:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        statuses[pid] = None
    return statuses


def _all_run_ids(runtime: Runlane) -> set[str]:
    ids: set[str] = set()
    cursor = None
    while True:
        page = runtime.sync.runs.list(cursor=cursor, limit=100)
        ids.update(run.id for run in page.data)
        if page.next_cursor is None:
            return ids
        cursor = page.next_cursor


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_children_forked_while_the_lane_is_busy_start_lanes_of_their_own(tmp_path):
    path = str(tmp_path / "fork.db")
    runtime = create_runlane(lane=sqlite_lane(path), queues=[DEFAULT], tasks=[echo])
    runtime.sync.start()
    stop = threading.Event()
    triggered: list[str] = []
    failures: list[BaseException] = []

    def load() -> None:  # keeps the driver's thread inside SQLite calls most of the time
        try:
            while not stop.is_set():
                triggered.append(runtime.sync.trigger(echo, {"load": len(triggered)}).run.id)
        except BaseException as error:  # noqa: BLE001 - asserted below
            failures.append(error)

    thread = threading.Thread(target=load, daemon=True)
    pids: list[int] = []
    try:
        thread.start()
        while len(triggered) < 3 and thread.is_alive():
            time.sleep(0.001)
        for number in range(CHILDREN):
            pid = os.fork()
            if pid == 0:
                _child(path, number)
            pids.append(pid)
            time.sleep(0.002)  # a fork at another point of the driver's work
        statuses = _wait_all(pids, time.monotonic() + CHILD_TIMEOUT)
        pids.clear()
        stop.set()
        thread.join(timeout=5)
        assert not thread.is_alive() and not failures
        failed = {number: status for number, status in enumerate(statuses.values()) if status != 0}
        assert not failed, f"children that hung (None) or could not use a lane of their own: {failed}"
        # The parent's lane kept working through the forks, and every run of both sides is there.
        ids = _all_run_ids(runtime)
        assert len(ids) == len(triggered) + CHILDREN and ids >= set(triggered)
        assert runtime.sync.trigger(echo, {"after": True}).outcome is TriggerOutcomeType.CREATED
    finally:
        stop.set()
        _wait_all(pids, time.monotonic())
        thread.join(timeout=5)
        runtime.sync.close()


async def test_a_start_whose_connection_never_opens_fails_instead_of_hanging(tmp_path, monkeypatch):
    """SQLite stuck in the process (a fork in the middle of a call by code that does not guard its
    calls) hangs the connect: ``start()`` gives up with ``storage_unavailable``, and the connection
    opened late is closed on the driver's thread."""
    release = threading.Event()
    opened: list[sqlite3.Connection] = []
    real_connect = sqlite3.connect

    def stuck_connect(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        release.wait(3.0)
        connection = real_connect(*args, **kwargs)
        opened.append(connection)
        return connection

    monkeypatch.setattr(sqlite_module, "_CONNECT_TIMEOUT", 0.05, raising=False)
    monkeypatch.setattr(sqlite_module.sqlite3, "connect", stuck_connect)
    driver = sqlite_storage(tmp_path / "stuck.db")
    try:
        with pytest.raises(RunlaneError) as raised:
            await driver.start()
        assert raised.value.code is ErrorCode.STORAGE_UNAVAILABLE
        assert "did not open within" in raised.value.message and "fresh" in raised.value.message
    finally:
        release.set()
    deadline = time.monotonic() + 3.0
    while not opened and time.monotonic() < deadline:
        time.sleep(0.005)
    (late,) = opened
    while time.monotonic() < deadline:
        try:
            late.execute("SELECT 1")
        except sqlite3.ProgrammingError:  # closed
            break
        time.sleep(0.005)
    else:
        raise AssertionError("the connection opened after the timeout was left open")
    monkeypatch.undo()
    await driver.start()  # the process is fine again: a later start opens the file
    try:
        assert await driver.get([]) == []
    finally:
        await driver.close()
