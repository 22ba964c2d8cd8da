"""The ``runlane dev`` control bridge: two terminals over one process-local lane.

A background ``runlane dev`` (the installed script, in a subprocess) owns the in-memory lane; separate
``runlane`` processes trigger, list, inspect and cancel through its loopback bridge. Every wait is a
bounded poll and the dev process is always killed in ``finally``. Session files go to a per-test
temporary directory (``TMPDIR``), so tests never see each other's sessions.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import re
import signal
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from runlane.cli import bridge
from runlane.cli.bridge import COMMAND_PATH, MAX_REQUEST_BYTES, read_session, session_path
from runlane.cli.output import Output

from runlane.cli.main import SIGNAL_REPEAT_S
from cli_support import RUNLANE, Project, cli, command, make_project, post, running_dev, wait_for


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


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Project:
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmpdir))  # this process computes the same session paths
    return Project(make_project(tmp_path / "proj", TASKS), tmpdir)


@pytest.fixture
def dev(project: Project) -> Iterator[subprocess.Popen[str]]:
    """A background ``runlane dev`` polling only the ``emails`` queue (``slow`` runs stay queued)."""
    with running_dev(project, "--queue", "emails", "--tick-interval", "1s") as process:
        yield process


# ---------------------------------------------------------------------------------------------


def test_two_terminal_flow_sees_the_dev_process_state(project: Project, dev: subprocess.Popen[str]) -> None:
    session = read_session(project.config)
    assert session is not None
    mode = stat.S_IMODE(session.file.stat().st_mode)
    assert mode == 0o600
    recorded = json.loads(session.file.read_text())
    assert set(recorded) == {"config_path", "port", "token", "pid", "started_at", "lane", "environment", "lane_name"}
    assert recorded["config_path"] == str(project.config.resolve())
    assert (recorded["environment"], recorded["lane_name"]) == ("default", "local")

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
    warning, error = [json.loads(line) for line in missing.stderr.splitlines()]
    assert warning["warning"]["code"] == "process_local_lane" and error["error"]["code"] == "run_not_found"
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
    assert post(session.port, b"[" * 100_000 + b"]" * 100_000, token=session.token)[0] == 400  # not a 500
    assert post(session.port, json.dumps({"command": "tick"}).encode(), token=session.token)[0] == 400

    status, body = post(session.port, list_runs, token=session.token)
    assert status == 200 and json.loads(body["stdout"]) == {"data": [], "next_cursor": None}
    assert dev.poll() is None  # none of that ended the dev process


def test_a_client_that_sends_nothing_is_answered_when_dev_stops_instead_of_holding_the_stop_up(
    project: Project, dev: subprocess.Popen[str]
) -> None:
    session = read_session(project.config)
    assert session is not None
    idle = [socket.create_connection(("127.0.0.1", session.port), timeout=10) for _ in range(5)]
    try:
        time.sleep(0.2)  # the server has taken them in, waiting for their requests
        dev.send_signal(signal.SIGTERM)
        for connection in idle:
            answer = b""
            while chunk := connection.recv(65536):
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 503 "), answer
            assert b"runlane dev is stopping; the request was not run." in answer
        assert dev.wait(timeout=30) == 0
    finally:
        for connection in idle:
            connection.close()


def test_the_latest_dev_for_a_config_path_wins(project: Project, dev: subprocess.Popen[str]) -> None:
    first = read_session(project.config)
    assert first is not None
    with running_dev(project, "--tick-interval", "1s", log_name="dev2.log") as second:
        latest = read_session(project.config)
        assert latest is not None and latest.pid == second.pid
        assert latest.token != first.token
        # The first dev exiting does not remove the second one's session.
        dev.send_signal(signal.SIGTERM)
        dev.wait(timeout=20)
        assert read_session(project.config) == latest
        run_id = project.json("trigger", "slow.report", "{}")["run"]["id"]
        assert [row["id"] for row in project.json("runs", "list")["data"]] == [run_id]


def test_when_the_latest_dev_stops_the_one_it_superseded_serves_again(
    project: Project, dev: subprocess.Popen[str]
) -> None:
    first = read_session(project.config)
    assert first is not None
    kept = project.json("trigger", "slow.report", "{}")["run"]["id"]  # held by the first dev
    with running_dev(project, "--tick-interval", "1s", log_name="dev2.log") as second:
        # The session file is written before the warning is: wait for it.
        log = wait_for(
            lambda: text if "dev_superseded" in (text := (project.tmpdir / "dev2.log").read_text()) else None,
            what="the dev_superseded warning",
        )
        assert '"code":"dev_superseded"' in log.replace(" ", "") and f"pid {dev.pid}" in log
        assert project.json("runs", "list")["data"] == []  # the second dev's own, empty lane
        second.send_signal(signal.SIGINT)
        time.sleep(SIGNAL_REPEAT_S)  # sooner, it would be taken for the same signal delivered twice
        second.send_signal(signal.SIGINT)  # the second signal exits at once
        second.wait(timeout=20)
    assert read_session(project.config) == first  # handed back, not deleted
    listed = project.cli("--json", "runs", "list")
    assert [row["id"] for row in json.loads(listed.stdout)["data"]] == [kept]
    assert "warning" not in listed.stderr


def test_dev_prints_each_command_it_runs_for_another_terminal(project: Project) -> None:
    at = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z"
    with running_dev(project, "--tick-interval", "1s", log_name="human.log", json_mode=False) as process:
        run_id = project.json("trigger", "emails.welcome", '{"user_id": "u1"}')["run"]["id"]
        assert project.cli("runs", "list").returncode == 0
        assert project.cli("cancel", "run_missing").returncode == 1
        log = project.tmpdir / "human.log"
        wait_for(lambda: "command cancel" in log.read_text(), what="the cancel command line")
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=20)
    lines = (project.tmpdir / "human.log").read_text().splitlines()
    commands = [line for line in lines if " command " in line]
    assert len(commands) == 3, lines
    assert re.fullmatch(rf"{at} command trigger ✓ created {run_id}", commands[0])
    assert re.fullmatch(rf"{at} command runs list ✓ \d+ runs?", commands[1])
    assert re.fullmatch(rf"{at} command cancel ✗ run_not_found: .*run_missing.*", commands[2])

    with running_dev(project, "--tick-interval", "1s", log_name="json.log") as process:
        run_id = project.json("trigger", "emails.welcome", '{"user_id": "u2"}')["run"]["id"]
        assert project.cli("runs", "get", "run_missing").returncode == 1
        log = project.tmpdir / "json.log"
        wait_for(lambda: '"command":"runs get"' in log.read_text(), what="the runs get command record")
    records = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    commands = [record for record in records if record["type"] == "command"]
    assert [(record["command"], record["ok"]) for record in commands] == [("trigger", True), ("runs get", False)]
    assert commands[0]["summary"] == f"✓ created {run_id}" and re.fullmatch(at, commands[0]["at"])
    assert commands[1]["error"]["code"] == "run_not_found"


def test_a_task_added_after_dev_started_is_unknown_there_and_the_error_says_to_restart_it(
    project: Project, dev: subprocess.Popen[str]
) -> None:
    tasks = project.root / "app" / "tasks.py"
    added = '\n\n@task("emails.goodbye", queue=emails)\ndef goodbye(payload: dict) -> None:\n    return None\n'
    tasks.write_text(tasks.read_text() + added)
    result = project.cli("trigger", "emails.goodbye", "{}")
    assert result.returncode == 1
    assert result.stderr.startswith("error[task_not_found]: No task 'emails.goodbye' is registered in this runtime;")
    assert f"runlane dev (pid {dev.pid}) ran this command with the task modules it imported when it started" in (
        " ".join(result.stderr.split())
    )
    error = json.loads(project.cli("--json", "trigger", "emails.goodbye", "{}").stderr)["error"]
    assert error["code"] == "task_not_found" and error["meta"] == {"task_id": "emails.goodbye"}
    assert "restart it if you have added or renamed the task since" in error["message"]


def test_dashboard_reads_are_not_printed_by_dev(project: Project, dev: subprocess.Popen[str]) -> None:
    from runlane.cli.main import OPERATIONS, parse_params
    from runlane.cli.output import Output

    importlib.import_module("runlane.cli.queues")  # registers the operation
    session = read_session(project.config)
    assert session is not None
    op = OPERATIONS["queues"]
    quiet = asyncio.run(bridge.exchange(session, op, parse_params(op, {}), Output(json_mode=True), quiet=True))
    loud = asyncio.run(bridge.exchange(session, op, parse_params(op, {}), Output(json_mode=True)))
    assert quiet is not None and loud is not None and quiet.stdout == loud.stdout
    log = project.tmpdir / "dev.log"
    wait_for(lambda: '"command":"queues"' in log.read_text(), what="the queues command record")
    assert log.read_text().count('"command":"queues"') == 1


@pytest.mark.parametrize("once", [True, False], ids=["once", "long-running"])
def test_dev_rejects_an_unknown_queue_before_it_ticks_or_serves(project: Project, once: bool) -> None:
    result = project.cli("--json", "dev", *(["--once"] if once else []), "--queue", "emails", "nosuch", timeout=30)
    assert result.returncode == 1
    assert result.stdout == ""  # no tick, no dev_started or bridge_started record
    error = json.loads(result.stderr)["error"]
    assert error["code"] == "configuration_invalid" and "'nosuch' is not registered" in error["message"]
    assert not list((project.tmpdir / f"runlane-dev-{os.getuid()}").glob("*.json"))


def test_stateful_commands_warn_when_a_process_local_lane_has_no_dev_session(project: Project) -> None:
    triggered = project.cli("trigger", "emails.welcome", '{"user_id": "u1"}')
    assert triggered.returncode == 0 and "✓ created run_" in triggered.stdout
    warning = triggered.stderr.strip()
    assert warning.startswith("warning: the 'local' lane keeps runs in this process only and no `runlane dev` ")
    assert "Start `runlane dev` in another terminal" in warning and "sqlite lane" in warning

    listed = project.cli("--json", "runs", "list")
    assert listed.returncode == 0 and json.loads(listed.stdout)["data"] == []
    assert json.loads(listed.stderr)["warning"]["code"] == "process_local_lane"

    # Proxied into a live dev session, the same commands share its state and say nothing of the kind.
    with running_dev(project, "--tick-interval", "1s"):
        proxied = project.cli("trigger", "emails.welcome", '{"user_id": "u2"}')
        assert proxied.returncode == 0 and proxied.stderr == ""


def test_a_dev_started_on_another_lane_than_the_config_now_names_does_not_take_the_command(
    project: Project, dev: subprocess.Popen[str]
) -> None:
    """The config switched from the local lane to sqlite while a dev runs: its runs go to the file."""
    text = project.config.read_text().replace('use = "local"', 'use = "sqlite"\npath = "app.db"')
    project.config.write_text(text)
    result = project.cli("--json", "trigger", "emails.welcome", '{"user_id": "u1"}')
    assert result.returncode == 0, result.stderr
    (warning,) = [json.loads(line)["warning"] for line in result.stderr.splitlines()]
    assert warning["code"] == "dev_config_changed"
    run_id = json.loads(result.stdout)["run"]["id"]
    assert (project.root / "app.db").exists()
    listed = project.json("runs", "list")
    assert [run["id"] for run in listed["data"]] == [run_id]


def test_a_dev_serving_another_environment_does_not_take_the_command(
    project: Project, dev: subprocess.Popen[str]
) -> None:
    """The same lane, another environment (as a ${VAR} of the config would change it): the command must not
    run in the dev process's environment, and the warnings say why without claiming no dev is running."""
    project.config.write_text(project.config.read_text().replace("[runlane]", '[runlane]\nenvironment = "other"', 1))
    result = project.cli("trigger", "emails.welcome", '{"user_id": "u1"}')
    assert result.returncode == 0, result.stderr
    assert "now names another lane, runtime or environment" in result.stderr
    assert "no `runlane dev` serves runlane.toml as it reads now" in result.stderr
    assert "is running" not in result.stderr


def test_a_shared_lane_gets_no_process_local_warning(tmp_path: Path) -> None:
    root = make_project(tmp_path / "proj", TASKS, lane="sqlite")
    result = cli(root, "trigger", "emails.welcome", '{"user_id": "u1"}')
    assert result.returncode == 0 and result.stderr == ""


async def test_a_dev_that_does_not_answer_is_named_while_the_command_waits(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A dev process whose event loop a handler blocks: the connection is accepted, no answer comes.
    async def never_answers(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # until the client gives up and closes
        writer.close()

    server = await asyncio.start_server(never_answers, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    monkeypatch.setattr(bridge, "SLOW_ANSWER_NOTE_S", 0.1)
    monkeypatch.setattr(bridge, "RESPONSE_TIMEOUT_S", 0.5)
    session = bridge.Session("/x/runlane.toml", port, "token", 4242, "2026-01-01T00:00:00.000Z", Path("/nowhere"))
    try:
        for as_json in (False, True):
            with pytest.raises(bridge.RunlaneError) as raised:
                await bridge._post(session, b"{}", Output(json_mode=as_json))
            assert raised.value.code.value == "transport_unavailable" and "did not answer" in raised.value.message
            err = capsys.readouterr().err
            if as_json:  # stderr under --json holds JSON documents only
                (line,) = err.splitlines()
                assert json.loads(line)["warning"]["code"] == "dev_busy"
            else:
                assert "warning: waiting for runlane dev (pid 4242) to answer" in err
    finally:
        server.close()
        await server.wait_closed()


async def test_a_command_that_waits_by_design_is_given_as_long_as_it_asked_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # `runs wait --timeout 2s` answers after two seconds: a bridge limit shorter than that does not apply.
    from runlane.cli.main import OPERATIONS, parse_params

    importlib.import_module("runlane.cli.runs")  # registers the operation

    async def answers_late(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await asyncio.sleep(0.8)
        body = b'{"stdout": "", "stderr": "", "exit": 4}'
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answers_late, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    monkeypatch.setattr(bridge, "RESPONSE_TIMEOUT_S", 0.3)
    session = bridge.Session("/x/runlane.toml", port, "token", 4242, "2026-01-01T00:00:00.000Z", Path("/nowhere"))
    op = OPERATIONS["runs wait"]
    try:
        params = parse_params(op, {"run_id": "run_1", "timeout": "2s"})
        rendered = await bridge.exchange(session, op, params, Output(json_mode=True))
        assert rendered is not None and rendered.exit_status == 4
        get = OPERATIONS["runs get"]
        with pytest.raises(bridge.RunlaneError) as raised:  # any other command keeps the bridge's limit
            await bridge.exchange(session, get, parse_params(get, {"run_id": "run_1"}), Output(json_mode=True))
        assert raised.value.code.value == "transport_unavailable"
    finally:
        server.close()
        await server.wait_closed()


def test_runs_wait_through_dev_exits_with_how_the_run_ended(project: Project, dev: subprocess.Popen[str]) -> None:
    welcome = project.json("trigger", "emails.welcome", '{"user_id": "u1"}')["run"]["id"]
    done = project.cli("--json", "runs", "wait", welcome, "--timeout", "20s")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["run"]["output"] == {"sent": "u1"}
    parked = project.json("trigger", "slow.report", "{}")["run"]["id"]  # dev does not poll this queue
    waited = project.cli("runs", "wait", parked, "--timeout", "200ms")
    assert waited.returncode == 4 and f"run {parked} is still queued after 200ms" in waited.stderr
    project.json("cancel", parked)
    assert project.cli("runs", "wait", parked).returncode == 3


def _connections_to(port: int) -> int:
    """Established TCP connections to 127.0.0.1:``port`` (read from ``/proc/net/tcp``, server side)."""
    local = f"0100007F:{port:04X}"
    rows = [line.split() for line in Path("/proc/net/tcp").read_text().splitlines()[1:]]
    return sum(1 for row in rows if row[1] == local and row[3] == "01")


def test_a_wait_through_dev_is_told_when_dev_stops_first(project: Project, dev: subprocess.Popen[str]) -> None:
    # runlane dev stops (Ctrl-C) while it serves another terminal's `runs wait`: that command is told so,
    # instead of being cut off (and then running on an empty lane of its own: run_not_found), and dev
    # stops without a traceback.
    parked = project.json("trigger", "slow.report", "{}")["run"]["id"]  # dev does not poll this queue
    assert RUNLANE is not None
    waiter = subprocess.Popen(
        [RUNLANE, "runs", "wait", parked], cwd=project.root, env=project.env(), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    session = read_session(project.config)
    assert session is not None
    try:
        # The wait's request is in the dev process once its connection to the bridge is open (the command
        # takes a second or two to start; a fixed sleep can stop dev before it has connected).
        wait_for(lambda: _connections_to(session.port) or waiter.poll() is not None, what="the wait's connection")
        time.sleep(0.3)  # its request sent and read
        dev.send_signal(signal.SIGINT)
        dev.wait(timeout=30)
        _, waited = waiter.communicate(timeout=30)
    finally:
        if waiter.poll() is None:
            waiter.kill()
    assert waiter.returncode == 1, waited
    assert "error[transport_unavailable]: runlane dev" in waited and "stopped before the runs wait command" in waited
    assert "run_not_found" not in waited and "stale" not in waited
    assert "Traceback" not in (project.tmpdir / "dev.log").read_text()


def _served_connections(port: int) -> int:
    """Connections the server on 127.0.0.1:``port`` holds open: established, or closed by the client only."""
    local = f"0100007F:{port:04X}"
    rows = [line.split() for line in Path("/proc/net/tcp").read_text().splitlines()[1:]]
    return sum(1 for row in rows if row[1] == local and row[3] in ("01", "08"))  # ESTABLISHED, CLOSE_WAIT


def test_a_wait_through_dev_whose_caller_went_away_is_stopped(project: Project, dev: subprocess.Popen[str]) -> None:
    # `timeout 60 runlane runs wait RUN` (or Ctrl-C) ends the caller: dev stops the wait it ran for it too,
    # instead of polling the run until it finishes for an answer nobody reads.
    parked = project.json("trigger", "slow.report", "{}")["run"]["id"]  # dev does not poll this queue
    session = read_session(project.config)
    assert session is not None
    body = command("runs wait", {"run_id": parked})
    caller = socket.create_connection(("127.0.0.1", session.port), timeout=10)
    head = (
        f"POST {COMMAND_PATH} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {session.token}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    caller.sendall(head.encode() + body)
    wait_for(lambda: _served_connections(session.port), what="the wait's connection")
    time.sleep(0.3)  # its request read and its wait started
    caller.close()
    wait_for(lambda: _served_connections(session.port) == 0, what="dev to let go of the abandoned wait")
    project.json("cancel", parked)  # the run ends: no answer to write for the wait, and no traceback
    assert project.cli("runs", "wait", parked).returncode == 3
    assert "Traceback" not in (project.tmpdir / "dev.log").read_text()


def _planted_session(project: Project, folder_mode: int) -> socket.socket:
    """A session file for the project's config in a session folder left open (``folder_mode``), naming a
    port that listens but is never served: what another local user could plant to receive commands."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(5)
    listener.setblocking(False)
    file = session_path(project.config)
    file.parent.mkdir(mode=0o700, exist_ok=True)
    file.parent.chmod(folder_mode)
    document = {
        "config_path": str(project.config.resolve()),
        "port": listener.getsockname()[1],
        "token": "planted",
        "pid": 1,
        "started_at": "2026-01-01T00:00:00.000Z",
        "lane": None,
    }
    file.write_text(json.dumps(document))
    file.chmod(0o600)
    return listener


@pytest.mark.parametrize("folder_mode", [0o777, 0o755], ids=["writable", "readable"])
def test_a_session_in_a_folder_others_can_enter_is_never_used(project: Project, folder_mode: int) -> None:
    listener = _planted_session(project, folder_mode)
    try:
        assert read_session(project.config) is None
        assert project.json("runs", "list")["data"] == []  # ran on its own runtime
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing was sent to the planted port
        started = project.cli("dev", timeout=30)  # and dev refuses to write its session there
        assert started.returncode == 1, started.stdout + started.stderr
        assert "error[configuration_invalid]" in started.stderr and "is not private to you" in started.stderr
        assert "Traceback" not in started.stderr
    finally:
        listener.close()


def test_a_session_file_others_can_write_or_a_link_is_never_used(project: Project) -> None:
    listener = _planted_session(project, 0o700)
    try:
        file = session_path(project.config)
        file.chmod(0o666)
        assert read_session(project.config) is None
        file.chmod(0o600)
        assert read_session(project.config) is not None  # the same file, private: a session
        elsewhere = file.with_name("elsewhere.json")
        file.rename(elsewhere)
        file.symlink_to(elsewhere)
        assert read_session(project.config) is None
        assert project.json("runs", "list")["data"] == []
        with pytest.raises(BlockingIOError):
            listener.accept()
    finally:
        listener.close()


def test_through_dev_a_payload_json_cannot_hold_or_one_too_large_is_refused_and_nothing_is_created(
    project: Project, dev: subprocess.Popen[str]
) -> None:
    def refused(*args: str) -> dict[str, Any]:
        result = project.cli("--json", "trigger", *args)
        assert result.returncode == 1 and "Traceback" not in result.stderr
        return json.loads(result.stderr)["error"]

    # NaN and Infinity are not JSON: a usage error, as any other invalid JSON, never stored as null.
    for args in (
        ('{"user_id": NaN}',),
        ('{"user_id": "u", "n": Infinity}',),
        ('{"user_id": "u", "n": 1e999}',),
        ('{"user_id": "u"}', "--meta", '{"m": NaN}'),
    ):
        result = project.cli("trigger", "emails.welcome", *args)
        assert result.returncode == 2 and "Traceback" not in result.stderr
        assert "JSON has no NaN or Infinity" in result.stderr

    # Larger than dev takes per command: said by this command, not a dropped connection.
    (project.root / "huge.json").write_text(json.dumps({"user_id": "x" * (MAX_REQUEST_BYTES + 10)}))
    error = refused("emails.welcome", "@huge.json")
    assert error["code"] == "validation_failed" and "runlane dev takes at most" in error["message"]
    assert error["meta"]["max_bytes"] == MAX_REQUEST_BYTES

    assert project.json("runs", "list")["data"] == []


def test_dev_once_says_it_cannot_reach_the_runs_of_a_running_dev(project: Project, dev: subprocess.Popen[str]) -> None:
    project.json("trigger", "emails.welcome", '{"user_id": "u1"}', "--delay", "1h")
    result = project.cli("--json", "dev", "--once")
    assert result.returncode == 0, result.stderr
    warnings = [json.loads(line)["warning"] for line in result.stderr.splitlines() if '"warning"' in line]
    assert [w["code"] for w in warnings] == ["process_local_lane"], result.stderr
    assert f"live in `runlane dev` (pid {dev.pid})" in warnings[0]["message"]
    assert "`runlane dev --once` cannot reach them" in warnings[0]["message"]


def test_dev_once_alone_on_a_process_local_lane_does_not_warn(project: Project) -> None:
    result = project.cli("--json", "dev", "--once")
    assert result.returncode == 0 and '"warning"' not in result.stderr, result.stderr


HOLDING_TASKS = TASKS + """

import os
import time


@task("hold", queue=emails)
def hold(payload: dict) -> None:
    while not os.path.exists("release"):  # the test creates it to let the run finish
        time.sleep(0.01)
"""


def test_a_stopping_dev_creates_no_run_that_would_end_with_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmpdir))
    project = Project(make_project(tmp_path / "proj", HOLDING_TASKS), tmpdir)
    with running_dev(project, "--tick-interval", "1h") as process:
        done = project.json("trigger", "emails.welcome", '{"user_id": "u1"}')["run"]["id"]
        wait_for(lambda: project.json("runs", "get", done)["run"]["status"] == "succeeded", what="the first run")
        held = project.json("trigger", "hold", "{}")["run"]["id"]
        wait_for(lambda: project.json("runs", "get", held)["run"]["status"] == "running", what="the held run")
        process.send_signal(signal.SIGINT)  # it stops once the held run finishes
        log = project.tmpdir / "dev.log"
        wait_for(lambda: '"type":"stopping"' in log.read_text(), what="the stopping record")

        created = project.cli("--json", "trigger", "emails.welcome", '{"user_id": "late"}')
        assert created.returncode == 1 and created.stdout == ""
        error = json.loads(created.stderr)["error"]
        assert error["code"] == "storage_unavailable" and error["retryable"] is True
        assert f"runlane dev (pid {process.pid}) is stopping" in error["message"]
        rerun = project.cli("--json", "rerun", done)
        assert rerun.returncode == 1 and json.loads(rerun.stderr)["error"]["code"] == "storage_unavailable"
        # It still answers what does not create a run.
        listed = project.json("runs", "list")["data"]
        assert [run["id"] for run in listed] == [held, done]

        (project.root / "release").write_text("")
        assert process.wait(timeout=20) == 0
