"""The ``runlane dev`` control bridge: two terminals over one process-local lane.

A background ``runlane dev`` (the installed script, in a subprocess) owns the in-memory lane; separate
``runlane`` processes trigger, list, inspect and cancel through its loopback bridge. Every wait is a
bounded poll and the dev process is always killed in ``finally``. Session files go to a per-test
temporary directory (``TMPDIR``), so tests never see each other's sessions.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import stat
import sys
import subprocess
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from runlane.cli import bridge
from runlane.cli.bridge import COMMAND_PATH, MAX_REQUEST_BYTES, read_session, session_path


RUNLANE = shutil.which("runlane", path=str(Path(sys.executable).parent)) or shutil.which("runlane")

T = TypeVar("T")

TASKS = """
from runlane import queue, task

emails = queue("emails", default=True)
slow = queue("slow")


@task("emails.welcome", queue=emails)
def send_welcome(payload: dict) -> dict:
    return {"sent": payload["user_id"]}


@task("slow.report", queue=slow)
def report(payload: dict) -> dict:
    return {"reported": True}
"""


def wait_for(check: Callable[[], T | None], *, timeout: float = 20.0, what: str = "condition") -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


class Project:
    def __init__(self, root: Path, tmpdir: Path) -> None:
        self.root = root
        self.tmpdir = tmpdir
        self.config = root / "runlane.toml"

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("RUNLANE_LOAD_PLUGINS", None)
        env["COLUMNS"] = "200"
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


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Project:
    root = tmp_path / "proj"
    (root / "app").mkdir(parents=True)
    (root / "app" / "__init__.py").write_text("", encoding="utf-8")
    (root / "app" / "tasks.py").write_text(textwrap.dedent(TASKS).lstrip(), encoding="utf-8")
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmpdir))  # this process computes the same session paths
    proj = Project(root, tmpdir)
    result = proj.cli("init", "config", "--tasks", "app.tasks")
    assert result.returncode == 0, result.stderr
    return proj


@pytest.fixture
def dev(project: Project) -> Iterator[subprocess.Popen[str]]:
    """A background ``runlane dev`` polling only the ``emails`` queue (``slow`` runs stay queued)."""
    log = (project.tmpdir / "dev.log").open("w")
    process = subprocess.Popen(
        [RUNLANE, "--json", "dev", "--queue", "emails", "--tick-interval", "1s"],
        cwd=project.root,
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
        env=project.env(),
    )
    try:
        wait_for(
            lambda: (s := read_session(project.config)) is not None and s.pid == process.pid,
            what="the dev session file",
        )
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)
        log.close()


def post(port: int, body: bytes, *, token: str | None, path: str = COMMAND_PATH, method: str = "POST") -> tuple[int, Any]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        headers = {"Content-Type": "application/json"}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        connection.request(method, path, body=body, headers=headers)
        response = connection.getresponse()
        return response.status, json.loads(response.read() or b"null")
    finally:
        connection.close()


def command(name: str, params: dict[str, Any], *, json_mode: bool = True) -> bytes:
    document = {"command": name, "params": params, "output": {"json": json_mode, "width": 200, "color": False}}
    return json.dumps(document).encode()


# ---------------------------------------------------------------------------------------------


def test_two_terminal_flow_sees_the_dev_process_state(project: Project, dev: subprocess.Popen[str]) -> None:
    session = read_session(project.config)
    assert session is not None
    mode = stat.S_IMODE(session.file.stat().st_mode)
    assert mode == 0o600
    recorded = json.loads(session.file.read_text())
    assert set(recorded) == {"config_path", "port", "token", "pid", "started_at"}
    assert recorded["config_path"] == str(project.config.resolve())

    triggered = project.json("trigger", "emails.welcome", '{"user_id": "u1"}')
    run_id = triggered["run"]["id"]
    assert triggered["outcome"] == "created"

    def succeeded() -> dict[str, Any] | None:
        page = project.json("runs", "list")
        rows = [row for row in page["data"] if row["id"] == run_id and row["status"] == "succeeded"]
        return rows[0] if rows else None

    wait_for(succeeded, what="the dev worker to execute the triggered run")

    detail = project.json("runs", "get", run_id, "--events")
    assert detail["run"]["id"] == run_id and detail["run"]["status"] == "succeeded"
    types = [record["event"]["type"] for record in detail["events"]["data"]]
    assert types[0] == "run.created" and types[-1] == "run.succeeded"

    waiting = project.json("trigger", "slow.report", "{}")["run"]["id"]
    cancelled = project.json("cancel", waiting, "--reason", "not needed")
    assert cancelled["run"]["id"] == waiting and cancelled["run"]["status"] == "cancelled"
    statuses = {row["id"]: row["status"] for row in project.json("runs", "list")["data"]}
    assert statuses == {run_id: "succeeded", waiting: "cancelled"}

    # Human output is rendered for this terminal too.
    human = project.cli("runs", "list")
    assert human.returncode == 0 and run_id in human.stdout and "succeeded" in human.stdout

    # Errors raised inside the dev process come back with their code.
    missing = project.cli("--json", "runs", "get", "run_missing")
    assert missing.returncode == 1
    assert json.loads(missing.stderr)["error"]["code"] == "run_not_found"

    # Stopping dev removes its session file.
    dev.send_signal(signal.SIGTERM)
    dev.wait(timeout=20)
    assert not session.file.exists()


def test_kill_9_leaves_a_stale_session_that_the_next_command_removes(
    project: Project, dev: subprocess.Popen[str]
) -> None:
    project.json("trigger", "slow.report", "{}")
    file = session_path(project.config)
    dev.kill()
    dev.wait(timeout=10)
    assert file.exists()

    listed = project.cli("--json", "runs", "list")
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout) == {"data": [], "next_cursor": None}  # a fresh, empty in-memory lane
    assert "ignored a stale runlane dev session" in listed.stderr and "not running" in listed.stderr
    assert not file.exists()

    missing = project.cli("--json", "runs", "get", "run_anything")
    assert missing.returncode == 1
    assert json.loads(missing.stderr)["error"]["code"] == "run_not_found"
    assert "Traceback" not in missing.stderr


def test_a_session_whose_token_is_refused_is_removed(project: Project, dev: subprocess.Popen[str]) -> None:
    project.json("trigger", "slow.report", "{}")
    file = session_path(project.config)
    recorded = json.loads(file.read_text())
    file.write_text(json.dumps({**recorded, "token": "not-the-token"}))
    assert project.json("runs", "list")["data"] == []  # not proxied: the command ran on its own runtime
    assert not file.exists()


def test_a_refused_connection_marks_the_session_stale(project: Project) -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    bridge.write_session(project.config, port=port, token="t")  # pid = this (live) test process
    assert project.json("runs", "list")["data"] == []
    assert not session_path(project.config).exists()


def test_the_server_rejects_bad_requests(project: Project, dev: subprocess.Popen[str]) -> None:
    session = read_session(project.config)
    assert session is not None
    list_runs = command("runs list", {})

    assert post(session.port, list_runs, token=None)[0] == 401
    status, body = post(session.port, list_runs, token="wrong")
    assert status == 401 and body["error"]["message"] == "Missing or wrong dev bridge token."
    assert post(session.port, list_runs, token=session.token, method="GET")[0] == 405
    assert post(session.port, list_runs, token=session.token, path="/other")[0] == 404

    # An oversize body is refused from its Content-Length, before any of it is read.
    with socket.create_connection(("127.0.0.1", session.port), timeout=10) as raw:
        raw.sendall(
            f"POST {COMMAND_PATH} HTTP/1.1\r\nAuthorization: Bearer {session.token}\r\n"
            f"Content-Length: {MAX_REQUEST_BYTES + 1}\r\n\r\n".encode()
        )
        answer = b""
        while chunk := raw.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413 ")

    status, body = post(session.port, command("work", {}), token=session.token)
    assert status == 400 and "Unknown command" in body["error"]["message"]
    status, body = post(session.port, command("runs list", {"bogus": 1}), token=session.token)
    assert status == 400 and body["error"]["code"] == "configuration_invalid"
    assert post(session.port, b"{not json", token=session.token)[0] == 400
    assert post(session.port, json.dumps({"command": "tick"}).encode(), token=session.token)[0] == 400

    status, body = post(session.port, list_runs, token=session.token)
    assert status == 200 and json.loads(body["stdout"]) == {"data": [], "next_cursor": None}
    assert dev.poll() is None  # none of that ended the dev process


def test_the_latest_dev_for_a_config_path_wins(project: Project, dev: subprocess.Popen[str]) -> None:
    first = read_session(project.config)
    assert first is not None
    log = (project.tmpdir / "dev2.log").open("w")
    second = subprocess.Popen(
        [RUNLANE, "--json", "dev", "--tick-interval", "1s"],
        cwd=project.root, stdout=log, stderr=subprocess.STDOUT, text=True, env=project.env(),
    )
    try:
        latest = wait_for(
            lambda: (s := read_session(project.config)) is not None and s.pid == second.pid and s,
            what="the second dev session",
        )
        assert latest.token != first.token
        # The first dev exiting does not remove the second one's session.
        dev.send_signal(signal.SIGTERM)
        dev.wait(timeout=20)
        assert read_session(project.config) == latest
        run_id = project.json("trigger", "slow.report", "{}")["run"]["id"]
        assert [row["id"] for row in project.json("runs", "list")["data"]] == [run_id]
    finally:
        if second.poll() is None:
            second.kill()
        second.wait(timeout=10)
        log.close()
