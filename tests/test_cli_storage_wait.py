"""Long-running commands started before their database is up wait for it; one-shot commands fail fast.

A real ``runlane`` process against a real PostgreSQL server: one that is not listening (a closed port),
and the session's throwaway server, stopped before the worker starts and started while it waits.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
from pathlib import Path
from typing import Any

from cli_support import RUNLANE, cli, cli_env, make_project, run_json_until, wait_for, write

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
    log = tmp_path / "work.log"
    server.stop_server(mode="fast")
    assert RUNLANE is not None
    with log.open("w") as out:
        worker = subprocess.Popen([RUNLANE, "--json", "work"], cwd=root, stdout=out, stderr=subprocess.STDOUT,
                                  text=True, env=cli_env())  # fmt: skip

    def records() -> list[dict[str, Any]]:
        return [json.loads(line) for line in log.read_text().splitlines()]

    def seen(kind: str) -> dict[str, Any] | None:
        return next((r for r in records() if r.get("type") == kind), None)

    try:
        wait_for(lambda: seen("storage_waiting"), timeout=30, what="the worker to report it is waiting")
        server.start_server()
        wait_for(lambda: seen("worker_started"), timeout=60, what="the worker to start once Postgres is up")
        triggered = cli(root, "--json", "trigger", "ping", "{}")
        assert triggered.returncode == 0, triggered.stderr
        run_id = json.loads(triggered.stdout)["run"]["id"]
        executed = wait_for(lambda: seen("run"), timeout=30, what="the run to execute")
        assert executed["run"]["id"] == run_id and executed["run"]["status"] == "succeeded"
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=30) == 0
    finally:
        if not server.running:
            server.start_server()
        if worker.poll() is None:
            worker.kill()
            worker.wait(timeout=10)
    kinds = [r.get("type") for r in records()]
    assert kinds[:3] == ["storage_waiting", "storage_available", "worker_started"], kinds
