"""``--health-file``: a long-running command keeps a file fresh for liveness probes and removes it on exit."""

from __future__ import annotations

import os
from pathlib import Path

from cli_support import background, cli, make_project, wait_for

TASKS = """
from runlane import queue, task

default = queue("default", default=True)


@task("noop")
def noop(payload: dict) -> None:
    return None
"""


def test_a_worker_keeps_its_health_file_fresh_and_removes_it_when_it_stops(tmp_path: Path) -> None:
    root = make_project(tmp_path / "project", tasks=TASKS, lane="sqlite")
    health = tmp_path / "alive"
    with background(root, "work", "--health-file", str(health), log=tmp_path / "work.log") as worker:
        wait_for(lambda: health.exists(), timeout=30, what="the health file")
        first = health.stat().st_mtime_ns
        os.utime(health, ns=(first - 60_000_000_000, first - 60_000_000_000))  # as a probe would find it, stale
        wait_for(lambda: health.stat().st_mtime_ns > first, timeout=10, what="the health file to be touched again")
        assert worker.stop() == 0
        assert not health.exists()
        assert worker.records()[-1]["type"] == "worker_stopped"


def test_a_health_file_that_cannot_be_written_is_refused_before_work_starts(tmp_path: Path) -> None:
    root = make_project(tmp_path / "project", tasks=TASKS, lane="sqlite")
    result = cli(root, "work", "--health-file", str(tmp_path / "missing" / "alive"))
    assert result.returncode == 1
    missing = tmp_path / "missing" / "alive"
    assert result.stderr.startswith(f"error[configuration_invalid]: Cannot write the health file {missing}")
    assert "worker started" not in result.stdout
