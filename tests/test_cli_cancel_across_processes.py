"""``runlane cancel`` of a run whose attempt is running in a ``runlane work`` process.

The worker heartbeats every five minutes here (a ten-minute lease), so only a hint can make it observe
the request within the test's wait: on Postgres the cancelling process's ``NOTIFY`` naming the run, on
SQLite the worker noticing another connection's commit and reading its running runs.
"""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from cli_support import RUNLANE, cli, cli_env, make_project, wait_for, write

TASKS = """
import asyncio

from runlane import TaskContext, queue, task

default = queue("default", default=True)


@task("waits.for.cancel")
async def waits_for_cancel(payload: dict, ctx: TaskContext) -> dict:
    await asyncio.wait_for(ctx.signal.wait(), timeout=120)
    return {"cancellation_requested": ctx.is_cancellation_requested()}
"""


@pytest.mark.parametrize("lane", ["sqlite", "postgres"])
def test_cancel_from_another_process_reaches_the_running_attempt_at_once(
    tmp_path: Path, request: pytest.FixtureRequest, lane: str
) -> None:
    root = make_project(tmp_path / "project", tasks=TASKS, lane="sqlite")
    if lane == "postgres":
        from postgres_support import migrated_schema

        url = request.getfixturevalue("postgres_url")
        schema = migrated_schema(url, "cancel")
        write(root / "runlane.toml", f'[runlane]\ntasks = ["app.tasks"]\n\n[lane]\nuse = "postgres-polling"\n'
                                     f'connection_string = "{url}"\nschema = "{schema}"\n')  # fmt: skip
    log = tmp_path / "work.log"
    assert RUNLANE is not None
    with log.open("w") as out:
        worker = subprocess.Popen(
            [RUNLANE, "--json", "work", "--concurrency", "2", "--lease-duration", "10m"],
            cwd=root, stdout=out, stderr=subprocess.STDOUT, text=True, env=cli_env(),
        )  # fmt: skip

    def records() -> list[dict[str, Any]]:
        return [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]

    def get(run_id: str) -> dict[str, Any]:
        result = cli(root, "--json", "runs", "get", run_id)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)["run"]

    try:
        wait_for(lambda: any(r.get("type") == "worker_started" for r in records()), timeout=30, what="the worker")
        triggered = cli(root, "--json", "trigger", "waits.for.cancel", "{}")
        assert triggered.returncode == 0, triggered.stderr
        run_id = json.loads(triggered.stdout)["run"]["id"]
        wait_for(lambda: get(run_id)["status"] == "running", timeout=30, what="the attempt to start")

        cancelled = cli(root, "--json", "cancel", run_id)
        assert cancelled.returncode == 0, cancelled.stderr
        assert json.loads(cancelled.stdout)["run"]["status"] == "cancellation_requested"

        executed = wait_for(
            lambda: next((r for r in records() if r.get("type") == "run" and r["run"]["id"] == run_id), None),
            timeout=30,
            what="the worker to observe the cancellation (its next heartbeat is minutes away)",
        )
        assert executed["run"]["status"] == "cancelled"
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=30) == 0
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(timeout=10)
    run = get(run_id)
    assert run["status"] == "cancelled" and run["counters"]["attempts"] == 1
