"""``runlane cancel`` of a run whose attempt is running in a ``runlane work`` process.

The worker heartbeats every five minutes here (a ten-minute lease), so only a hint can make it observe
the request within the test's wait: on Postgres the cancelling process's ``NOTIFY`` naming the run, on
SQLite the worker noticing another connection's commit and reading its running runs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cli_support import background, cli, make_project, wait_for, write

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
    def get(run_id: str) -> dict[str, Any]:
        result = cli(root, "--json", "runs", "get", run_id)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)["run"]

    command = ("work", "--concurrency", "2", "--lease-duration", "10m")
    with background(root, *command, log=tmp_path / "work.log") as worker:
        worker.wait_for("worker_started")
        triggered = cli(root, "--json", "trigger", "waits.for.cancel", "{}")
        assert triggered.returncode == 0, triggered.stderr
        run_id = json.loads(triggered.stdout)["run"]["id"]
        wait_for(lambda: get(run_id)["status"] == "running", timeout=30, what="the attempt to start")

        cancelled = cli(root, "--json", "cancel", run_id)
        assert cancelled.returncode == 0, cancelled.stderr
        assert json.loads(cancelled.stdout)["run"]["status"] == "cancellation_requested"

        # The worker's next heartbeat is minutes away: only the hint can make it observe this in time.
        executed = worker.wait_for("run")
        assert executed["run"]["id"] == run_id and executed["run"]["status"] == "cancelled"
        assert worker.stop() == 0
    run = get(run_id)
    assert run["status"] == "cancelled" and run["counters"]["attempts"] == 1
