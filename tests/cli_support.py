"""Shared scaffolding for tests that run the installed ``runlane`` script in a temporary project.

The second half serves the ``runlane dev`` bridge tests: a ``Project`` whose commands share one
``TMPDIR`` (so they find the same dev session files), a background ``runlane dev`` that is always
killed on exit, bounded polling, and raw HTTP requests to a session's bridge port.
"""

from __future__ import annotations

import atexit
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

RUNLANE = shutil.which("runlane", path=str(Path(sys.executable).parent)) or shutil.which("runlane")

TASKS_MODULE = """
from datetime import UTC, datetime

from pydantic import BaseModel

from runlane import queue, schedule, task

emails = queue("emails", default=True)


class Welcome(BaseModel):
    user_id: str


@task(
    "emails.welcome",
    queue=emails,
    schedule=schedule("welcome.once", run_at=datetime(2020, 1, 1, tzinfo=UTC), payload={"user_id": "user_1"}),
)
def send_welcome(payload: Welcome) -> dict:
    return {"sent": payload.user_id}
"""


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip(), encoding="utf-8")
    return path


_cli_tmpdir: str | None = None


def _private_tmpdir() -> str:
    """The ``TMPDIR`` of the ``runlane`` processes this test process starts: one folder of its own,
    removed when it exits, so what they leave in a temporary folder (a ``runlane dev`` session folder,
    say) is gone with it instead of staying in ``/tmp``."""
    global _cli_tmpdir
    if _cli_tmpdir is None:
        _cli_tmpdir = tempfile.mkdtemp(prefix="runlane-cli-tests-")
        atexit.register(shutil.rmtree, _cli_tmpdir, True)
    return _cli_tmpdir


def cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("RUNLANE_LOAD_PLUGINS", None)
    env["COLUMNS"] = "200"
    env["TMPDIR"] = _private_tmpdir()  # a Project's commands get the project's own instead
    return env


def cli(
    cwd: Path, *args: str, timeout: float = 60, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the installed ``runlane`` in ``cwd``; ``env`` adds to (or overrides) the environment."""
    assert RUNLANE is not None, "the runlane console script is not installed; run pip install -e ."
    environment = {**cli_env(), **(env or {})}
    return subprocess.run([RUNLANE, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=environment)


def ndjson(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def run_json_until(
    cwd: Path,
    args: list[str],
    until: Callable[[list[dict[str, Any]]], bool],
    stop: int = signal.SIGINT,
    timeout: float = 60,
) -> tuple[list[dict[str, Any]], int, str]:
    """Start ``runlane --json ARGS``, read its NDJSON lines until ``until(records so far)`` holds, send it
    ``stop`` and wait for it to exit: (every record, exit status, stderr). After ``timeout`` seconds the
    process is killed, so a condition that never comes fails the test instead of hanging it."""
    assert RUNLANE is not None
    process = subprocess.Popen(
        [RUNLANE, "--json", *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env()
    )
    watchdog = threading.Timer(timeout, process.kill)
    watchdog.start()
    try:
        assert process.stdout is not None
        seen: list[dict[str, Any]] = []
        for line in process.stdout:
            seen.append(json.loads(line))
            if until(seen):
                break
        else:
            raise AssertionError(f"runlane {' '.join(args)} ended (or was killed) before the awaited output: {seen}")
        process.send_signal(stop)
        rest, stderr = process.communicate(timeout=30)
    finally:
        watchdog.cancel()
        if process.poll() is None:
            process.kill()
    return seen + ndjson(rest), process.returncode, stderr


def make_project(root: Path, tasks: str = TASKS_MODULE, lane: str = "local") -> Path:
    """A project whose ``app.tasks`` module is ``tasks`` (by default a scheduled task), configured through
    ``runlane init config`` on ``lane`` (the in-memory ``local`` lane unless told otherwise)."""
    write(root / "app" / "__init__.py", "")
    write(root / "app" / "tasks.py", tasks)
    result = cli(root, "init", "config", "--tasks", "app.tasks", "--lane", lane)
    assert result.returncode == 0, result.stderr
    return root


# -- runlane dev bridge ----------------------------------------------------------------------------


def wait_for(check: Callable[[], T | None], *, timeout: float = 20.0, what: str = "condition") -> T:
    """Poll ``check`` until it returns something truthy (returned), failing after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


class Background:
    """A ``runlane --json ...`` process started by ``background()``; its NDJSON output is read from a log."""

    def __init__(self, process: subprocess.Popen[str], log: Path) -> None:
        self.process = process
        self.log = log

    def records(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.log.read_text().splitlines() if line.startswith("{")]

    def first(self, kind: str) -> dict[str, Any] | None:
        """The first record of type ``kind`` so far (``None`` before it is printed)."""
        return next((record for record in self.records() if record.get("type") == kind), None)

    def wait_for(self, kind: str, *, timeout: float = 30) -> dict[str, Any]:
        return wait_for(lambda: self.first(kind), timeout=timeout, what=f"a {kind} record in {self.log}")

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM, then its exit status."""
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=timeout)


@contextmanager
def background(cwd: Path, *args: str, log: Path) -> Iterator[Background]:
    """``runlane --json ARGS`` in ``cwd``, its stdout and stderr in ``log``; killed on exit if still running."""
    assert RUNLANE is not None, "the runlane console script is not installed; run pip install -e ."
    with log.open("w") as out:
        process = subprocess.Popen(
            [RUNLANE, "--json", *args], cwd=cwd, stdout=out, stderr=subprocess.STDOUT, text=True, env=cli_env()
        )
    try:
        yield Background(process, log)
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)


class Project:
    """A project directory whose ``runlane`` invocations share ``tmpdir`` as ``TMPDIR``."""

    def __init__(self, root: Path, tmpdir: Path) -> None:
        self.root = root
        self.tmpdir = tmpdir
        self.config = root / "runlane.toml"

    def env(self) -> dict[str, str]:
        env = cli_env()
        env["TMPDIR"] = str(self.tmpdir)
        return env

    def cli(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        assert RUNLANE is not None, "the runlane console script is not installed; run pip install -e ."
        return subprocess.run(
            [RUNLANE, *args], cwd=self.root, capture_output=True, text=True, timeout=timeout, env=self.env()
        )

    def json(self, *args: str) -> Any:
        result = self.cli("--json", *args)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)


@contextmanager
def running_dev(
    project: Project, *args: str, log_name: str = "dev.log", json_mode: bool = True
) -> Iterator[subprocess.Popen[str]]:
    """A background ``runlane --json dev *args`` (human output without ``json_mode``) for ``project``,
    yielded once its session file names it.

    Its output goes to ``<tmpdir>/<log_name>``; the process is killed (if still running) on exit. This
    process must use ``project.tmpdir`` as its temporary directory too (``tempfile.tempdir``), so it
    finds the session file where the dev process writes it.
    """
    from runlane.cli.bridge import read_session  # imports the CLI app: only for the bridge tests

    assert RUNLANE is not None, "the runlane console script is not installed; run pip install -e ."
    log_path = project.tmpdir / log_name
    log = log_path.open("w")
    process = subprocess.Popen(
        [RUNLANE, *(["--json"] if json_mode else []), "dev", *args],
        cwd=project.root,
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
        env=project.env(),
    )

    def serving() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"runlane dev exited with {process.returncode}:\n{log_path.read_text()}")
        session = read_session(project.config)
        return session is not None and session.pid == process.pid

    try:
        wait_for(serving, what="the dev session file")
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)
        log.close()


def post(
    port: int, body: bytes, *, token: str | None, path: str | None = None, method: str = "POST"
) -> tuple[int, Any]:
    """One raw request to a dev bridge on ``port`` (``path`` defaults to its command path):
    ``(HTTP status, decoded JSON body)``."""
    from runlane.cli.bridge import COMMAND_PATH

    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        headers = {"Content-Type": "application/json"}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        connection.request(method, path or COMMAND_PATH, body=body, headers=headers)
        response = connection.getresponse()
        return response.status, json.loads(response.read() or b"null")
    finally:
        connection.close()


def command(name: str, params: dict[str, Any], *, json_mode: bool = True) -> bytes:
    """A dev bridge request body for the stateful command ``name``."""
    document = {"command": name, "params": params, "output": {"json": json_mode, "width": 200, "color": False}}
    return json.dumps(document).encode()
