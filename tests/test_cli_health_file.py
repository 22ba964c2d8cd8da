"""``--health-file``: a long-running command keeps a file fresh for liveness probes and removes it on exit."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from cli_support import background, cli, make_project, wait_for
from runlane.cli.main import SIGNAL_REPEAT_S

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


def test_a_single_tick_refuses_a_health_file_it_would_not_keep(tmp_path: Path) -> None:
    root = make_project(tmp_path / "project", tasks=TASKS, lane="sqlite")
    result = cli(root, "tick", "--health-file", str(tmp_path / "alive"))
    assert result.returncode == 2
    assert "--health-file needs --every: a single pass has no liveness to report." in result.stderr
    assert not (tmp_path / "alive").exists()


QUICK_TASKS = TASKS + '''

@task("quick")
def quick(payload: dict) -> None:
    import time

    time.sleep(2)
'''

SLOW_TASKS = TASKS + '''

@task("slow")
def slow(payload: dict) -> None:
    import time

    time.sleep(20)
'''


def test_a_forced_exit_removes_the_health_file_too(tmp_path: Path) -> None:
    root = make_project(tmp_path / "project", tasks=SLOW_TASKS, lane="sqlite")
    health = tmp_path / "alive"
    assert cli(root, "trigger", "slow", "{}").returncode == 0
    with background(root, "work", "--health-file", str(health), log=tmp_path / "work.log") as worker:
        wait_for(lambda: health.exists(), timeout=30, what="the health file")
        time.sleep(0.5)  # the slow run is claimed: a first signal waits for it
        worker.process.send_signal(signal.SIGTERM)
        wait_for(lambda: worker.first("stopping") is not None, timeout=10, what="the stopping line")
        time.sleep(SIGNAL_REPEAT_S)  # sooner, it would be taken for the same signal delivered twice
        worker.process.send_signal(signal.SIGTERM)  # a second signal exits at once
        assert worker.process.wait(timeout=10) == 128 + signal.SIGTERM
    assert not health.exists(), "a probe would find a process that is gone alive"


def test_a_health_file_an_earlier_process_left_does_not_pass_while_storage_is_awaited(tmp_path: Path) -> None:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # nothing listens there once the block ends
    root = make_project(tmp_path / "project", tasks=TASKS, lane="sqlite")
    (root / "runlane.toml").write_text(
        '[runlane]\ntasks = ["app.tasks"]\n\n[lane]\nuse = "postgres-polling"\n'
        f'connection_string = "postgresql://postgres@127.0.0.1:{port}/app"\n'
    )
    health = tmp_path / "alive"
    health.touch()  # left behind by a process that was killed
    with background(root, "work", "--health-file", str(health), log=tmp_path / "work.log") as worker:
        worker.wait_for("storage_waiting")
        assert not health.exists(), "a worker still waiting for its database looked ready"
        assert worker.stop() == 0


async def test_the_health_file_is_never_written_through_a_link_or_into_a_fifo(tmp_path: Path) -> None:
    # Another user who can write the folder could plant a link while the command waits for storage: the
    # worker's user would then create or keep touching a file of their choosing.
    import pytest

    from runlane import ErrorCode, RunlaneError
    from runlane.cli.main import touching

    target = tmp_path / "not-yours"
    link = tmp_path / "alive"
    link.symlink_to(target)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    # A FIFO is refused at once rather than waited on (no reader: the open itself fails).
    for path, why in ((link, "it is a symbolic link"), (fifo, f"Cannot write the health file {fifo}")):
        with pytest.raises(RunlaneError) as caught:
            async with touching(path):
                pass
        assert caught.value.code is ErrorCode.CONFIGURATION_INVALID and why in caught.value.message
    assert not target.exists()
    async with touching(tmp_path / "plain"):
        assert (tmp_path / "plain").is_file()
    assert not (tmp_path / "plain").exists()


def test_a_path_that_holds_something_else_is_refused_not_deleted(tmp_path: Path) -> None:
    """A health file a killed process left is empty; a mistyped path (the database, a source file) must
    not be deleted as one."""
    root = make_project(tmp_path / "project", tasks=TASKS, lane="sqlite")
    precious = root / "notes.txt"
    precious.write_text("precious\n")
    result = cli(root, "work", "--drain", "--health-file", str(precious))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith(f"error[configuration_invalid]: The health file {precious} already exists")
    assert precious.read_text() == "precious\n"


def test_one_stop_delivered_twice_at_once_is_still_a_graceful_stop(tmp_path: Path) -> None:
    """coreutils `timeout` (or a process manager signalling the process, then its group) sends SIGTERM
    twice at once: that is one request to stop, which lets the run in progress finish."""
    root = make_project(tmp_path / "project", tasks=QUICK_TASKS, lane="sqlite")
    assert cli(root, "trigger", "quick", "{}").returncode == 0
    with background(root, "work", log=tmp_path / "work.log") as worker:
        worker.wait_for("worker_started")
        time.sleep(0.5)  # the run is claimed
        worker.process.send_signal(signal.SIGTERM)
        worker.process.send_signal(signal.SIGTERM)
        assert worker.process.wait(timeout=20) == 0
        assert [record["type"] for record in worker.records()].count("stopping") == 1
        assert not any(record["type"] == "exit" for record in worker.records())
