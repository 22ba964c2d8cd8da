"""``runlane dev --reload``: a real supervisor process restarting a real ``runlane dev`` on a SQLite lane."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from cli_support import RUNLANE, cli, cli_env, make_project, wait_for, write

TASKS = """
from runlane import queue, task

default = queue("default", default=True)


@task("version")
def version(payload: dict) -> dict:
    return {"version": VERSION}


VERSION = 1
"""


class Supervisor:
    def __init__(self, root: Path, process: subprocess.Popen[str], log: Path) -> None:
        self.root = root
        self.process = process
        self.log = log

    def records(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.log.read_text().splitlines() if line.startswith("{")]

    def wait_for_record(self, kind: str, count: int = 1, **fields: Any) -> dict[str, Any]:
        def found() -> dict[str, Any] | None:
            matching = [r for r in self.records() if r.get("type") == kind and fields.items() <= r.items()]
            return matching[count - 1] if len(matching) >= count else None

        return wait_for(found, timeout=30, what=f"record {count} of type {kind} {fields} in {self.log.read_text()}")

    def executed_version(self, count: int) -> int:
        run_id = cli_json(self.root, "trigger", "version", "{}")["run"]["id"]
        record = self.wait_for_record("run", count=count)
        assert record["run"]["id"] == run_id and record["run"]["status"] == "succeeded", record
        return record["run"]["output"]["version"]


def cli_json(root: Path, *args: str) -> Any:
    result = cli(root, "--json", *args)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def edit(path: Path, change: Callable[[str], str]) -> None:
    before = path.stat().st_mtime_ns
    path.write_text(change(path.read_text()))
    os.utime(path, ns=(before + 2_000_000_000, before + 2_000_000_000))  # a visible change on any file system


def processes_in(root: Path) -> list[int]:
    """Processes whose working directory is ``root``: the supervisor and its dev child."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if Path(os.readlink(entry / "cwd")) == root:
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


@contextmanager
def supervising(root: Path) -> Iterator[Supervisor]:
    assert RUNLANE is not None
    log = root.parent / f"{root.name}.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            [RUNLANE, "--json", "dev", "--reload", "--tick-interval", "1h"],
            cwd=root, stdout=out, stderr=subprocess.STDOUT, text=True, env=cli_env(),
        )  # fmt: skip
        try:
            yield Supervisor(root, process, log)
        finally:
            if process.poll() is None:
                process.kill()
            process.wait(timeout=10)
            wait_for(lambda: not processes_in(root), timeout=15, what="the dev child to go away")


def test_dev_reload_restarts_with_new_code_and_survives_a_broken_edit(tmp_path: Path) -> None:
    root = make_project(tmp_path / "project", tasks=TASKS, lane="sqlite")
    tasks = root / "app" / "tasks.py"
    with supervising(root) as dev:
        watching = dev.wait_for_record("reload_watching")
        assert watching["root"] == str(root) and watching["files"] == 3  # two modules and runlane.toml
        dev.wait_for_record("worker_started")
        assert dev.executed_version(1) == 1

        edit(tasks, lambda text: text.replace("VERSION = 1", "VERSION = 2"))
        assert dev.wait_for_record("reloading")["changed"] == ["app/tasks.py"]
        dev.wait_for_record("worker_stopped")
        dev.wait_for_record("worker_started", count=2)
        assert dev.executed_version(2) == 2

        # A broken edit stops the child with the import error; the next save starts it again.
        edit(tasks, lambda text: text + "\ndef broken(:\n")
        exited = dev.wait_for_record("dev_exited")
        assert exited["status"] == 1
        errors = [r["error"]["message"] for r in dev.records() if "error" in r]
        assert any("cannot import module 'app.tasks': SyntaxError" in message for message in errors), errors
        edit(tasks, lambda text: text.replace("VERSION = 2", "VERSION = 3").replace("\ndef broken(:\n", ""))
        dev.wait_for_record("worker_started", count=3)
        assert dev.executed_version(3) == 3

        # Files the project does not own are not watched.
        write(root / ".venv" / "pyvenv.cfg", "home = /usr\n")
        write(root / ".venv" / "lib" / "module.py", "X = 1\n")
        write(root / "app" / "__pycache__" / "stale.py", "X = 1\n")
        edit(tasks, lambda text: text.replace("VERSION = 3", "VERSION = 4"))  # a change that is watched, after them
        dev.wait_for_record("worker_started", count=4)
        reloads = [r["changed"] for r in dev.records() if r.get("type") == "reloading"]
        assert reloads == [["app/tasks.py"]] * 4

        dev.process.send_signal(signal.SIGTERM)
        assert dev.process.wait(timeout=30) == 0
        # The child stopped gracefully: its worker stopped, and nothing came after it but the maintenance
        # pass that was running when the signal came (on a busy machine it ends after the worker).
        last = [record.get("type") for record in dev.records()]
        while last and last[-1] == "tick":
            last.pop()
        assert last[-1] == "worker_stopped", dev.records()[-3:]


def test_dev_reload_child_stops_when_the_supervisor_is_killed(tmp_path: Path) -> None:
    root = make_project(tmp_path / "project", tasks=TASKS, lane="sqlite")
    with supervising(root) as dev:
        dev.wait_for_record("worker_started")
        assert len(processes_in(root)) == 2
        dev.process.send_signal(signal.SIGKILL)
        dev.process.wait(timeout=10)
        # The child is told to stop (SIGTERM) when its parent dies, instead of running on unsupervised.
        wait_for(lambda: not processes_in(root), timeout=15, what="the dev child to stop after its supervisor died")
        dev.wait_for_record("worker_stopped")


def test_dev_reload_runs_runlane_beside_a_project_module_named_runlane(tmp_path: Path) -> None:
    root = make_project(tmp_path / "project", tasks=TASKS, lane="sqlite")
    write(root / "runlane.py", 'print("the project\'s own runlane.py ran")\n')  # a scratch file of that name
    with supervising(root) as dev:
        first = wait_for(
            lambda: next((r for r in dev.records() if r.get("type") in ("worker_started", "dev_exited")), None),
            timeout=30,
            what=f"runlane dev to start or exit in {dev.log.read_text()}",
        )
        assert first["type"] == "worker_started", dev.log.read_text()
        assert dev.executed_version(1) == 1
        dev.process.send_signal(signal.SIGTERM)
        assert dev.process.wait(timeout=30) == 0


def test_dev_reload_refuses_once(tmp_path: Path) -> None:
    root = make_project(tmp_path / "project", tasks=TASKS, lane="sqlite")
    result = cli(root, "dev", "--reload", "--once")
    assert result.returncode == 2
    assert result.stderr.endswith("Error: --reload applies only without --once.\n")


RUNTIME = """
from runlane import create_runlane, queue, task
from runlane_local import local_lane

default = queue("default", default=True)


@task("noop")
def noop(payload: dict) -> None:
    return None


def create_app_runlane():
    return create_runlane(lane=local_lane(), tasks=[noop], queues=[default])
"""


def test_dev_reload_warns_that_a_runtime_factory_on_an_in_memory_lane_loses_its_runs(tmp_path: Path) -> None:
    root = tmp_path / "project"
    write(root / "app" / "__init__.py", "")
    write(root / "app" / "runtime.py", RUNTIME)
    assert cli(root, "init", "config", "--runtime", "app.runtime:create_app_runlane").returncode == 0
    with supervising(root) as dev:
        dev.wait_for_record("worker_started")
        # runlane.toml names no lane: only the runtime it built knows that its runs live in this process.
        warnings = [r["warning"] for r in dev.records() if "warning" in r]
        assert [w["code"] for w in warnings] == ["process_local_lane"], warnings
        assert "each restart of --reload starts with none" in warnings[0]["message"]
        edit(root / "app" / "runtime.py", lambda text: text + "\n")
        dev.wait_for_record("worker_started", count=2)
        assert len([r for r in dev.records() if "warning" in r]) == 2  # said again at each restart
        dev.process.send_signal(signal.SIGTERM)
        assert dev.process.wait(timeout=30) == 0


def test_dev_reload_on_a_durable_lane_does_not_warn(tmp_path: Path) -> None:
    root = make_project(tmp_path / "project", tasks=TASKS, lane="sqlite")
    with supervising(root) as dev:
        dev.wait_for_record("worker_started")
        assert not [r for r in dev.records() if "warning" in r]
        dev.process.send_signal(signal.SIGTERM)
        assert dev.process.wait(timeout=30) == 0


SLOW_TASKS = """
import time

from runlane import queue, task

default = queue("default", default=True)


@task("slow")
def slow(payload: dict) -> dict:
    print("slow started", flush=True)
    time.sleep(1.5)
    return {"finished": True}
"""


def test_ctrl_c_during_a_restart_lets_the_runs_in_progress_finish(tmp_path: Path) -> None:
    root = make_project(tmp_path / "project", tasks=SLOW_TASKS, lane="sqlite")
    with supervising(root) as dev:
        dev.wait_for_record("worker_started")
        run_id = cli_json(root, "trigger", "slow", "{}")["run"]["id"]
        dev.wait_for_record("log", message="slow started")
        edit(root / "app" / "tasks.py", lambda text: text + "\n")
        dev.wait_for_record("reloading")
        # The child is already stopping after its current run: one Ctrl-C must not turn that into an
        # exit at once, which would leave the run `running` until its lease expires.
        dev.process.send_signal(signal.SIGINT)
        assert dev.process.wait(timeout=30) == 0
        assert dev.wait_for_record("run")["run"]["id"] == run_id
        assert [r["type"] for r in dev.records() if r.get("type") in ("stopping", "exit")] == ["stopping"] * 2
        assert len([r for r in dev.records() if r.get("type") == "worker_started"]) == 1  # not restarted
    run = cli_json(root, "runs", "get", run_id)["run"]
    assert run["status"] == "succeeded" and run["counters"]["attempts"] == 1, run
