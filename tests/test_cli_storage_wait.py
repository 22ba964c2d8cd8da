"""Long-running commands started before their database is up wait for it; one-shot commands fail fast.

A real ``runlane`` process against a real PostgreSQL server: one that is not listening (a closed port),
and the session's throwaway server, stopped before the worker starts and started while it waits.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import socket
import time
from pathlib import Path

import pytest
import typer
from cli_support import background, cli, make_project, run_json_until, wait_for, write

from runlane import ErrorCode, RunlaneError
from runlane.cli import main
from runlane.cli.output import Output

TASKS = """
from runlane import queue, task

default = queue("default", default=True)


@task("ping")
def ping(payload: dict) -> dict:
    return {"pong": True}
"""


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]  # closed again when the block ends: nothing listens there


def postgres_project(root: Path, url: str) -> Path:
    make_project(root, tasks=TASKS, lane="sqlite")
    write(root / "runlane.toml", f'[runlane]\ntasks = ["app.tasks"]\n\n[lane]\nuse = "postgres-polling"\n'
                                 f'connection_string = "{url}"\n')  # fmt: skip
    return root


def test_long_running_commands_wait_for_storage_and_one_shot_commands_fail_fast(tmp_path: Path) -> None:
    root = postgres_project(tmp_path / "project", f"postgresql://postgres@127.0.0.1:{closed_port()}/app")
    for command in (["work"], ["tick", "--every", "1s"]):
        records, status, stderr = run_json_until(
            root, command, lambda seen: seen[-1]["type"] == "storage_waiting", stop=signal.SIGTERM, timeout=30
        )
        assert status == 0, stderr
        waiting = records[0]
        assert waiting["error"]["code"] == "storage_unavailable"
        assert [r["type"] for r in records] == ["storage_waiting", "stopped"]
        assert stderr == ""

    for command in (["work", "--drain"], ["tick"], ["runs", "list"]):
        result = cli(root, *command)
        assert result.returncode == 1
        assert result.stderr.startswith("error[storage_unavailable]: Could not connect to Postgres"), result.stderr


def test_a_worker_started_before_postgres_runs_once_it_is_up(tmp_path: Path) -> None:
    from postgres_support import restartable_postgres_server

    server, schema = restartable_postgres_server("wait")
    root = postgres_project(tmp_path / "project", f"{server.url}?schema={schema}")
    server.stop_server(mode="fast")
    try:
        with background(root, "work", log=tmp_path / "work.log") as worker:
            worker.wait_for("storage_waiting")
            server.start_server()
            worker.wait_for("worker_started", timeout=60)
            triggered = cli(root, "--json", "trigger", "ping", "{}")
            assert triggered.returncode == 0, triggered.stderr
            run_id = json.loads(triggered.stdout)["run"]["id"]
            executed = worker.wait_for("run")
            assert executed["run"]["id"] == run_id and executed["run"]["status"] == "succeeded"
            assert worker.stop() == 0
            kinds = [record.get("type") for record in worker.records()]
    finally:
        if not server.running:
            server.start_server()
    assert kinds[:3] == ["storage_waiting", "storage_available", "worker_started"], kinds


def test_a_worker_reports_an_outage_in_its_own_words_only(tmp_path: Path) -> None:
    from postgres_support import restartable_postgres_server

    server, schema = restartable_postgres_server("quiet")
    root = postgres_project(tmp_path / "project", f"{server.url}?schema={schema}")
    log = tmp_path / "work.log"
    try:
        with background(root, "work", "--empty-poll-delay", "50ms", log=log) as worker:
            worker.wait_for("worker_started")
            server.stop_server(mode="fast")
            wait_for(lambda: "storage failed (storage_unavailable" in log.read_text(), what="the outage reported")
            server.start_server()
            wait_for(lambda: "reachable again" in log.read_text(), timeout=60, what="the recovery reported")
            assert worker.stop() == 0
    finally:
        if not server.running:
            server.start_server()
    text = log.read_text()
    # The connection pool's own warnings (each failed reconnect, each discarded connection) stay out of it.
    assert "error connecting in" not in text and "discarding" not in text, text


def test_a_maintenance_loop_reports_an_outage_once_and_its_end(tmp_path: Path) -> None:
    from postgres_support import restartable_postgres_server

    server, schema = restartable_postgres_server("tickout")
    root = postgres_project(tmp_path / "project", f"{server.url}?schema={schema}")
    try:
        with background(root, "tick", "--every", "100ms", log=tmp_path / "tick.log") as loop:
            loop.wait_for("tick")
            server.stop_server(mode="fast")
            failed = loop.wait_for("tick_failed")
            assert failed["error_code"] == "storage_unavailable"
            time.sleep(0.5)  # several passes fail meanwhile
            server.start_server()
            recovered = loop.wait_for("tick_recovered", timeout=60)
            assert recovered["failed"] >= 2
            assert loop.stop() == 0
            records = loop.records()
    finally:
        if not server.running:
            server.start_server()
    # One line for the outage and one for its end, not an error per pass.
    assert [record.get("type") for record in records].count("tick_failed") == 1
    assert not any("error" in record for record in records)


async def test_a_stop_signal_ends_the_wait_without_waiting_for_the_attempt_in_flight(monkeypatch) -> None:
    """A database that accepts connections but never answers: the attempt in flight is given up at once."""
    attempting = asyncio.Event()

    class Runtime:
        calls = 0

        async def start(self) -> None:
            self.calls += 1
            if self.calls == 1:
                raise RunlaneError(ErrorCode.STORAGE_UNAVAILABLE, "Could not connect.", retryable=True)
            attempting.set()
            await asyncio.Event().wait()  # a connection attempt that does not end by itself

    monkeypatch.setattr(main, "_FIRST_RETRY_S", 0.01)
    stdout = io.StringIO()
    waiting = asyncio.ensure_future(main._start_when_storage_answers(Runtime(), Output(json_mode=True, stdout=stdout)))
    await asyncio.wait_for(attempting.wait(), 10)
    os.kill(os.getpid(), signal.SIGTERM)
    with pytest.raises(typer.Exit) as exited:
        await asyncio.wait_for(waiting, 10)
    assert exited.value.exit_code == 0
    assert [json.loads(line)["type"] for line in stdout.getvalue().splitlines()] == ["storage_waiting", "stopped"]
