"""What the CLI writes depends on the streams it writes to: their encoding, whether they are a terminal,
and the caller's ``NO_COLOR``, ``TERM`` and ``COLUMNS``, also when ``runlane dev`` renders a command for
another terminal.

Every command runs the installed script in a subprocess. A terminal is a pseudo-terminal read until the
command exits (bounded by a deadline); a background ``runlane dev`` is always killed on exit.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import struct
import subprocess
import tempfile
import termios
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cli_support import RUNLANE, Project, cli, cli_env, make_project, ndjson, running_dev

TASKS = """
from runlane import queue, task

default = queue("default", default=True)
idle = queue("idle")  # no worker polls it: its runs stay queued


@task("echo")
def echo(payload: dict) -> dict:
    return payload


@task("boom")
def boom(payload: dict) -> dict:
    raise RuntimeError("boom ünïcode")


@task("later", queue=idle)
def later(payload: dict) -> dict:
    return payload
"""

ASCII = {"PYTHONIOENCODING": "ascii"}
SGR = re.compile(r"\x1b\[([0-9;]*)m")


def colours(text: str) -> set[int]:
    """The colour parameters (foreground, background) of the SGR sequences in ``text``."""
    params = {int(part) for match in SGR.finditer(text) for part in match.group(1).split(";") if part}
    return {param for param in params if 30 <= param <= 49 or 90 <= param <= 107}


def on_terminal(cwd: Path, *args: str, env: dict[str, str], timeout: float = 60) -> tuple[int, str]:
    """Run ``runlane ARGS`` with stdout and stderr on a 100-column pseudo-terminal: (exit status, what it showed)."""
    assert RUNLANE is not None, "the runlane console script is not installed; run pip install -e ."
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    try:
        process = subprocess.Popen(
            [RUNLANE, *args], cwd=cwd, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=env
        )
    finally:
        os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([master], [], [], left)[0]:
                raise AssertionError(f"runlane {' '.join(args)} did not finish within {timeout}s: {chunks}")
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the command exited and nothing holds the terminal any more
                break
            if not chunk:
                break
            chunks.append(chunk)
        return process.wait(timeout=timeout), b"".join(chunks).decode("utf-8", errors="replace")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
        os.close(master)


def run(project: Project, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(RUNLANE), *args], cwd=project.root, capture_output=True, text=True, timeout=60,
        env={**project.env(), **env},
    )  # fmt: skip


@pytest.fixture
def plain_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every process, ``runlane dev`` included, starts on a colour terminal type without colour overrides,
    whatever the environment running the tests says."""
    monkeypatch.setenv("TERM", "xterm-256color")
    for name in ("NO_COLOR", "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "COLORTERM", "PYTHONIOENCODING"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, plain_environment: None) -> Project:
    """A process-local lane project; this process finds its dev sessions where the commands do."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmpdir))
    return Project(make_project(tmp_path / "proj", TASKS), tmpdir)


@pytest.fixture
def dev(project: Project) -> Iterator[subprocess.Popen[str]]:
    with running_dev(project, "--queue", "default", "--tick-interval", "1s") as process:
        yield process


@pytest.fixture
def sqlite_project(tmp_path: Path, plain_environment: None) -> Path:
    return make_project(tmp_path / "sqlite", TASKS, lane="sqlite")


# -- JSON on a stream that cannot encode every character -----------------------------------------


def test_an_error_and_log_lines_on_an_ascii_stderr_are_json(sqlite_project: Path) -> None:
    missing = cli(sqlite_project, "--json", "runs", "get", "nöpe", env=ASCII)
    assert missing.returncode == 1 and missing.stderr.isascii()
    assert json.loads(missing.stderr)["error"]["meta"]["run_id"] == "nöpe"

    assert cli(sqlite_project, "--json", "trigger", "boom", "{}").returncode == 0
    drained = cli(sqlite_project, "--json", "work", "--drain", env=ASCII)
    assert drained.returncode == 0 and drained.stderr.isascii() and drained.stdout.isascii()
    logs = [record for record in ndjson(drained.stderr) if record.get("type") == "log"]
    assert logs and "RuntimeError: boom ünïcode" in logs[0]["exception"]
    assert [record["type"] for record in ndjson(drained.stdout)][-1] == "worker_stopped"


def test_a_warning_on_an_ascii_stderr_is_json(project: Project) -> None:
    # No dev serves it: the process-local lane warns, naming the config file.
    config = project.root / "ünï.toml"
    config.write_text(project.config.read_text(encoding="utf-8"), encoding="utf-8")
    listed = run(project, "-c", str(config), "--json", "runs", "list", env=ASCII)
    assert listed.returncode == 0 and listed.stderr.isascii()
    warning = json.loads(listed.stderr)["warning"]
    assert warning["code"] == "process_local_lane" and "ünï.toml" in warning["message"]
    assert json.loads(listed.stdout) == {"data": [], "next_cursor": None}


def test_a_result_rendered_by_dev_is_json_on_an_ascii_stdout(project: Project, dev: subprocess.Popen[str]) -> None:
    payload = {"name": "Zoë", "emoji": "😀", "quote": '"\\'}
    run_id = project.json("trigger", "later", json.dumps(payload))["run"]["id"]

    shown = run(project, "--json", "runs", "get", run_id, env=ASCII)
    assert shown.returncode == 0 and shown.stdout.isascii(), shown.stderr
    assert json.loads(shown.stdout)["run"]["payload"] == payload

    missing = run(project, "--json", "runs", "get", "nöpe", env=ASCII)
    assert missing.returncode == 1 and json.loads(missing.stderr)["error"]["meta"]["run_id"] == "nöpe"


# -- colour and escape codes through dev ---------------------------------------------------------


def test_dev_renders_for_the_callers_no_color_and_dumb_terminal(project: Project, dev: subprocess.Popen[str]) -> None:
    for _ in range(2):
        project.json("trigger", "later", "{}")
    args = ("runs", "list", "--limit", "1")  # a page with a next cursor, which is shown in colour

    status, coloured = on_terminal(project.root, *args, env=project.env())
    assert status == 0 and colours(coloured), coloured  # the terminal shows colour when nothing says otherwise

    status, no_color = on_terminal(project.root, *args, env={**project.env(), "NO_COLOR": "1"})
    assert status == 0 and "next cursor" in no_color and not colours(no_color), no_color

    status, dumb = on_terminal(project.root, *args, env={**project.env(), "TERM": "dumb"})
    assert status == 0 and "next cursor" in dumb and "\x1b" not in dumb, dumb


# -- COLUMNS ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("columns", ["0", "000", "-5", "wide"])
def test_a_columns_value_that_is_no_positive_width_is_ignored(sqlite_project: Path, columns: str) -> None:
    status, shown = on_terminal(sqlite_project, "runs", "get", "nope", env={**cli_env(), "COLUMNS": columns})
    assert status == 1 and "error[run_not_found]: Run nope does not exist" in shown, shown


def test_columns_zero_is_ignored_for_a_command_dev_renders(project: Project, dev: subprocess.Popen[str]) -> None:
    run_id = project.json("trigger", "later", "{}")["run"]["id"]
    status, shown = on_terminal(project.root, "runs", "list", env={**project.env(), "COLUMNS": "0"})
    assert status == 0 and run_id in shown, shown


def test_a_terminal_narrower_than_dev_renders_still_gets_its_output(
    project: Project, dev: subprocess.Popen[str]
) -> None:
    run_id = project.json("trigger", "later", "{}")["run"]["id"]
    status, shown = on_terminal(project.root, "runs", "get", run_id, env={**project.env(), "COLUMNS": "10"})
    assert status == 0 and "queued" in shown, shown


NOISY_TASKS = TASKS + """
import logging
import warnings

warnings.warn("the old client is deprecated", UserWarning)
logging.getLogger("app.setup").warning("cache directory missing; using a temporary one")
"""


def test_what_task_modules_log_or_warn_as_they_are_imported_is_json_under_json(tmp_path: Path) -> None:
    root = make_project(tmp_path, NOISY_TASKS, lane="sqlite")
    for args in (("queues",), ("work", "--drain")):
        result = cli(root, "--json", *args)
        assert result.returncode == 0, result.stderr
        ndjson(result.stdout)  # stdout is still JSON only
        records = ndjson(result.stderr)  # and so is every stderr line: no bare Python warning text
        messages = [record["message"] for record in records if record.get("type") == "log"]
        assert any("UserWarning: the old client is deprecated" in message for message in messages), records
        assert "cache directory missing; using a temporary one" in messages, records
    # Without --json they are printed as Python prints them.
    human = cli(root, "queues")
    assert "UserWarning: the old client is deprecated" in human.stderr
    assert "cache directory missing; using a temporary one" in human.stderr and "{" not in human.stderr


PRINTING_TASKS = TASKS + """
print("connecting to the cache at start-up")
"""


def test_what_task_modules_print_as_they_are_imported_is_a_log_record_under_json(tmp_path: Path) -> None:
    """stdout holds only the command's own JSON lines under --json: a task module's print() at import comes
    out as a log record of logger ``stdout`` on stderr, as a handler's print() does."""
    root = make_project(tmp_path, PRINTING_TASKS, lane="sqlite")
    for args in (("queues",), ("trigger", "echo", "{}"), ("work", "--drain")):
        result = cli(root, "--json", *args)
        assert result.returncode == 0, result.stderr
        assert "connecting to the cache" not in result.stdout, result.stdout
        ndjson(result.stdout)
        records = [record for record in ndjson(result.stderr) if record.get("type") == "log"]
        assert {"logger": "stdout", "message": "connecting to the cache at start-up"}.items() <= records[0].items()
    # Without --json a print stays on stdout.
    assert "connecting to the cache at start-up" in cli(root, "queues").stdout


def test_a_line_stream_keeps_each_threads_line_whole_whoever_flushes() -> None:
    """The stand-in stdout of handlers under --json: a line two print() calls make in one thread comes out
    whole even when another thread flushes in between; ``finish()`` hands on a last unfinished line."""
    import io
    import threading

    from runlane.cli.output import LineStream

    emitted: list[str] = []
    stream = LineStream(emitted.append, io.StringIO())
    started, flushed = threading.Event(), threading.Event()

    def other() -> None:
        started.wait(5)
        stream.write("from the other thread\n")
        stream.write("cut off")
        stream.flush()  # its own unfinished line only
        flushed.set()

    thread = threading.Thread(target=other)
    thread.start()
    stream.write("first half, ")
    started.set()
    assert flushed.wait(5)
    stream.write("second half\nlast words")
    thread.join(5)
    assert emitted == ["from the other thread", "cut off", "first half, second half"]
    stream.finish()
    assert emitted[-1] == "last words"
