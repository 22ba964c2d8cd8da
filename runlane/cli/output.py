"""The CLI's one rendering layer: commands hand data here, this module turns it into text or JSON.

Results go to stdout, diagnostics and errors to stderr. With ``--json`` a command result is one JSON
document and long-running lifecycle output is newline-delimited JSON; without it results are Rich
cards, tables and timelines. Commands never print on their own and this module never calls the runtime.

Ids, keys, reasons, outputs, failure and log messages are data that producers and end users choose, so
text is made printable (``printable()``) wherever it becomes something printed: ``printable_text()`` for
Rich text, ``_table()`` for cells and the ``Output`` primitives for the lines they are given. A terminal
would act on an escape sequence printed raw (clear the screen, set the window title, fake a link) and a
newline would print a line that looks like one of ours. JSON escapes the C0 controls; ``_dumps`` escapes
the others a terminal acts on (``terminal_safe_json``).
"""

from __future__ import annotations

import codecs
import contextlib
import dataclasses
import enum
import errno
import io
import json
import logging
import os
import re
import sys
import threading
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from types import TracebackType
from typing import IO, Any

from pydantic import BaseModel
from pydantic_core import to_jsonable_python
from rich.console import Console
from rich.table import Table
from rich.cells import cell_len
from rich.text import Text

from ..core.attempt import RunContextFilter, current_task_context
from ..core.authoring import error_location
from ..errors import RunlaneError
from ..json_values import json_escape_char, terminal_safe_json
from ..vocabulary import run_status_values

__all__ = [
    "Output",
    "attempt_detail",
    "attempt_details",
    "display_value",
    "event_detail",
    "forward_runtime_logs",
    "json_import_logs",
    "iso",
    "plural",
    "printable",
    "printable_text",
    "quiet_connection_pool",
    "run_rows",
    "tick_counts",
    "to_json_value",
    "trigger_summary",
]


# What a terminal acts on instead of showing: the C0 and C1 controls and DEL (ESC starts CSI and OSC
# sequences, CR returns over what was printed), the line and paragraph separators, and the bidirectional
# formatting characters, which reorder what is shown after them. A lone surrogate cannot be encoded at all.
_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069\ud800-\udfff]")
_NAMED_ESCAPES = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    code = ord(char)
    return _NAMED_ESCAPES.get(char) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


def printable(text: str) -> str:
    """``text`` with every character a terminal would act on escaped as ``repr()`` escapes it (``\\x1b``,
    ``\\n``, ``\\u202e``); everything else, printable Unicode and backslashes included, as it is."""
    return _UNPRINTABLE.sub(_escape, text)


def queue_label(name: str, *, default: bool, registered: bool, style: str = "") -> Text:
    """A queue's name as ``runlane queues`` and the dashboard show it, marked when it is the default queue or
    one this project does not register."""
    label = printable_text(name, style)
    if default:
        label.append(" (default)", style="dim")
    if not registered:
        label.append(" (not registered)", style="yellow")
    return label


def queue_limit_label(concurrency_limit: int | None, *, registered: bool) -> str:
    """A queue's concurrency limit as shown: ``-`` for none, ``?`` for a queue whose policy is not known here."""
    if not registered:
        return "?"
    return "-" if concurrency_limit is None else str(concurrency_limit)


def printable_text(text: str, style: str = "") -> Text:
    """``Text(text, style=style)`` for text that shows data: made ``printable()`` first (a ``Text`` drops some
    control characters silently and keeps ESC and newlines)."""
    return Text(printable(text), style=style)


def to_json_value(value: Any) -> Any:
    """A JSON-safe copy of ``value``: models in pydantic's JSON mode, dataclasses as objects, enums as values."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_json_value(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(key): to_json_value(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [to_json_value(item) for item in value]
    if isinstance(value, enum.Enum):
        return value.value
    return to_jsonable_python(value)


def _dumps(value: Any, *, ascii_only: bool = False) -> str:
    # JSON escapes C0 controls; the characters it leaves as they are and a terminal acts on (C1 controls,
    # bidi controls) are escaped too, so no stored value reaches the terminal raw through --json either.
    return terminal_safe_json(json.dumps(to_json_value(value), ensure_ascii=ascii_only, separators=(",", ":")))


_NON_ASCII = re.compile(r"[^\x00-\x7f]")


def _ascii_json(text: str) -> str:
    """JSON text (documents, or lines of them) with every character outside ASCII written as a ``\\uXXXX``
    escape: still the same JSON, since such characters can only be inside its strings."""
    return _NON_ASCII.sub(json_escape_char, text)


def iso(value: datetime | None) -> str | None:
    if value is None:
        return None
    text = value.astimezone(UTC).isoformat(timespec="milliseconds")
    return text.replace("+00:00", "Z")


# ``run_`` and 32 hex digits: a generated run id, shown whole.
_RUN_ID_WIDTH = 36
_TIME_WIDTH = len("2026-01-01T00:00:00Z")


def _run_rows(rows: list[dict[str, str]], width: int) -> list[Text]:
    """``runs list`` laid out in ``width`` columns, one line per run (a header first).

    Ids (whole up to a generated id's length) and times are for copying and keep their width; when the
    terminal is too narrow the created and attempts columns give way, then the task and queue names,
    the status and an id longer than a generated one are cut with an ellipsis (`runs get` and --json show
    everything).
    """
    columns = ["id", "status", "task", "queue", "attempts", "run at", "created"]
    cells = {name: [printable(row[name]) for row in rows] for name in columns}
    natural = {name: max(cell_len(name), *(cell_len(value) for value in cells[name])) for name in columns}
    smallest = {"id": _RUN_ID_WIDTH, "status": 9, "task": 4, "queue": 4}
    floor = {name: min(natural[name], least) for name, least in smallest.items()}

    def total(names: list[str], widths: dict[str, int]) -> int:
        return sum(widths[name] for name in names) + 2 * (len(names) - 1)

    widths = dict(natural)
    for optional in ("created", "attempts"):
        if total(columns, widths) <= width:
            break
        if total(columns, {**widths, **floor}) > width:
            columns.remove(optional)
    for name in ("id", "task", "queue", "status"):  # what is cut first, down to its floor
        excess = total(columns, widths) - width
        if excess > 0:
            widths[name] = max(floor[name], widths[name] - excess)

    def line(values: dict[str, str], style: str = "") -> Text:
        cells = []
        for name in columns:  # attempts, never cut, align right
            cell = Text(values[name].rjust(widths[name]) if name == "attempts" else values[name])
            cell.truncate(widths[name], overflow="ellipsis", pad=name != columns[-1])
            cells.append(cell)
        return Text("  ", style=style).join(cells)

    header = line({name: name for name in columns}, "bold")
    return [header, *(line({name: cells[name][index] for name in columns}) for index in range(len(rows)))]


def _seconds(value: datetime | None) -> str:
    """``iso`` to the second, for tables (``runs get`` and --json keep the milliseconds)."""
    if value is None:
        return ""
    return value.astimezone(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def _now() -> str:
    return iso(datetime.now(UTC)) or ""


def _compact(value: Any) -> str:
    return json.dumps(to_json_value(value), ensure_ascii=False, separators=(",", ":"))


def _what_next(run: Any) -> str:
    """What a run's line adds after an attempt: why it failed, when it is retried, what it waits for."""
    parts = []
    if run.failure is not None and display_value(run.status) in ("retrying", "failed"):
        parts.append(f"error={display_value(run.failure.code)}")
    if display_value(run.status) == "retrying":
        parts.append(f"retry_at={iso(run.run_at)}")
    if run.wait is not None:
        parts.extend(_wait_parts(run.wait))
    return "".join(f" {part}" for part in parts)


def _wait_parts(wait: Any) -> list[str]:
    """What a release waits for: ``waiting_for=signal:KEY``, ``waiting_for=run:ID`` or ``resume_at=T``, then
    the wait's ``timeout_at``."""
    kind = display_value(wait.type)
    if kind == "signal":
        parts = [f"waiting_for=signal:{wait.signal_key}"]
    elif kind == "run_completion":
        parts = [f"waiting_for=run:{wait.run_id}"]
    else:
        parts = [f"resume_at={iso(wait.resume_at)}"]
    if getattr(wait, "timeout_at", None) is not None:
        parts.append(f"timeout_at={iso(wait.timeout_at)}")
    return parts


def _wait_text(wait: Any) -> str:
    """What a released run waits for, in words: ``signal KEY``, ``run ID`` or ``time until T``, then
    ``(timeout T)`` when the wait has one."""
    kind = display_value(wait.type)
    if kind == "signal":
        text = f"signal {wait.signal_key}"
    elif kind == "run_completion":
        text = f"run {wait.run_id}"
    else:
        text = f"time until {iso(wait.resume_at)}"
    timeout_at = getattr(wait, "timeout_at", None)
    return text if timeout_at is None else f"{text} (timeout {iso(timeout_at)})"


def plural(count: int, noun: str) -> str:
    """``1 run``, ``2 runs``."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def trigger_summary(result: Any) -> str:
    """A trigger result on one line, marked as its card's heading is."""
    if display_value(result.outcome) == "created":
        return f"✓ created {result.run.id}"
    return f"⊝ returned existing {result.run.id} (idempotency)"


def tick_counts(result: Any) -> str:
    """A tick's counts as ``name=value`` pairs, in the spec's camelCase (``deliveryRequested=2``)."""
    return "tick " + " ".join(f"{_camel(f.name)}={getattr(result, f.name)}" for f in dataclasses.fields(result))


def display_value(value: Any) -> str:
    """How the CLI shows a value: enums by their value, times as ISO 8601 UTC with milliseconds."""
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, datetime):
        return iso(value) or ""
    return str(value)


def run_rows(run: Any, *, full: bool = True) -> list[tuple[str, Any]]:
    """The labelled fields of a run card (``runs get``, the dashboard); callers skip ``None`` values."""
    rows: list[tuple[str, Any]] = [
        ("status", run.status),
        ("task", run.task_id),
        ("queue", run.queue),
        ("environment", run.environment.name),
        ("event sequence", run.event_sequence),
        ("created", run.created_at),
        ("updated", run.updated_at),
        ("run at", run.run_at),
        # Who holds a running run, and until when: past that time the worker is gone and tick() recovers it.
        ("lease", None if run.lease is None else f"{run.lease.worker_id} until {iso(run.lease.expires_at)}"),
        ("attempt deadline", run.attempt_deadline_at),
        # A bounded queue's dispatch reservation: the run holds a slot of its partition until then, waiting
        # for a worker; a queued run without one waits for tick() to reserve a slot.
        ("dispatched", run.dispatched_at),
        ("dispatch expires", run.dispatch_expires_at),
        ("started", run.started_at),
        ("finished", run.finished_at),
        ("attempts", run.counters.attempts),
        ("failures", run.counters.failures),
        ("releases", run.counters.releases),
        ("retries", run.counters.retries),
        ("idempotency key", run.idempotency_key),
        ("singleton key", run.singleton_key),
        ("concurrency key", run.concurrency_key),
    ]
    if run.source is not None:
        source = f"{display_value(run.source.type)}"
        source_run = run.source.source_run_id or run.source.schedule_id
        rows.append(("source", f"{source} {source_run}" if source_run else source))
    if run.wait is not None:
        rows.append(("waiting for", _wait_text(run.wait)))
    if run.failure is not None:
        rows.append(("failure", failure_text(run.failure)))
    if full:
        if run.payload is not None:
            rows.append(("payload", _compact(run.payload)))
        if run.has_output:
            rows.append(("output", _compact(run.output)))
        if run.meta:
            rows.append(("meta", _compact(run.meta)))
    return rows


class OutputLost(Exception):
    """Writing the command's result to stdout failed (a full disk, a device error) after the command had
    done its work: reported as such, never as a traceback that reads like the command failing."""

    def __init__(self, error: OSError) -> None:
        super().__init__(error.strerror or str(error))
        self.error = error


class _GuardedStream:
    """A text stream whose write errors, other than a closed pipe (a reader such as ``head`` that
    stopped reading, which the command line handles like other Unix tools), become ``OutputLost``.

    On a file descriptor, text is written as bytes until all of it is written: Python's text stream
    takes a short write (a file at its size limit, a full disk) as done and drops the rest, so a cut
    result would exit 0. Text the stream's encoding cannot hold (a latin-1 or ASCII locale) is escaped
    (``\u2713``) rather than raised after the command's change was saved."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        stream = self._stream
        try:
            descriptor = stream.fileno()
        except (AttributeError, OSError, ValueError):  # not a file (a captured stream)
            descriptor = None
        try:
            if descriptor is None:
                return stream.write(text)
            stream.flush()  # what was printed to the stream before goes first
            encoding = getattr(stream, "encoding", None) or "utf-8"
            remaining = memoryview(text.encode(encoding, errors="backslashreplace"))
            while remaining:
                remaining = remaining[os.write(descriptor, remaining) :]
            return len(text)
        except OSError as error:
            raise _lost(error) from error

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as error:
            raise _lost(error) from error

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


_UNICODE_ENCODINGS = frozenset(
    {"utf-8", "utf-8-sig", "utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le", "utf-32-be"}
)


def _ascii_only(stream: Any) -> bool:
    """Whether JSON written to ``stream`` must be ASCII: its encoding (a latin-1 or ASCII locale's) cannot
    hold every character, and what it cannot hold would be written as a Python escape (``\\xeb``), which
    is not JSON. A stream without an encoding (a buffer) takes any text."""
    encoding = getattr(stream, "encoding", None) or "utf-8"
    try:
        return codecs.lookup(encoding).name not in _UNICODE_ENCODINGS
    except LookupError:
        return True


def _console_environ() -> Mapping[str, str] | None:
    """The environment Rich reads the terminal's size from, without a ``COLUMNS`` or ``LINES`` that is not
    a positive integer (``None``: ``os.environ`` as it is). Rich takes ``COLUMNS=0`` as a width of 0 and
    prints every line as nothing; such a value is ignored as if unset, so the terminal's own size counts."""
    invalid = {name for name in ("COLUMNS", "LINES") if name in os.environ and not _positive(os.environ[name])}
    if not invalid:
        return None
    return {name: value for name, value in os.environ.items() if name not in invalid}


# The narrowest width a dev process renders for another terminal (its bridge refuses less): a narrower
# terminal gets lines it wraps, not an error.
_NARROWEST_RENDERING = 20


def _positive(text: str) -> bool:
    return text.isascii() and text.isdigit() and int(text) > 0


def _lost(error: OSError) -> BaseException:
    return error if error.errno == errno.EPIPE else OutputLost(error)


# The status a process killed by SIGPIPE reports (128 + 13), as `yes | head -1` gives `yes`.
EXIT_BROKEN_PIPE = 141


_stdout_closed = False  # the reader of stdout stopped reading, during a command that then went on


def stdout_was_closed() -> bool:
    """Whether a long-running command's stdout reader went away (it then exits with ``EXIT_BROKEN_PIPE``)."""
    return _stdout_closed


class _Console(Console):
    """A console whose stdout reader may stop reading (``runlane runs list | head -1``): nothing more is
    printed, and the command ends as other Unix tools do then, not as if it had failed."""

    def __init__(self, *args: Any, owner: Output | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._owner = owner

    def on_broken_pipe(self) -> None:
        global _stdout_closed
        self.quiet = True
        try:
            descriptor = self.file.fileno()  # this console's stream: sys.stdout may stand in for another
        except (AttributeError, OSError, ValueError):  # a buffer: nothing to silence
            descriptor = None
        if descriptor is not None:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, descriptor)
            os.close(devnull)
        stop = None if self._owner is None else self._owner.on_stdout_closed
        if stop is None:
            raise SystemExit(EXIT_BROKEN_PIPE)
        # A worker or maintenance loop (`runlane work | head`) stops as on SIGTERM, letting the attempts
        # in flight record their outcomes, instead of dying with them.
        _stdout_closed = True
        stop()


class Output:
    """Where and how one CLI invocation prints: ``json`` picks JSON over Rich text."""

    def __init__(
        self,
        *,
        json_mode: bool = False,
        stdout: Any | None = None,
        stderr: Any | None = None,
        width: int | None = None,
        color: bool | None = None,
    ) -> None:
        """``stdout``/``stderr``/``width``/``color`` default to the process streams and terminal; the dev
        bridge passes buffers and the calling terminal's settings to render a proxied command's result."""
        self.json = json_mode
        self._out = stdout if stdout is not None else _GuardedStream(sys.stdout)
        self._err = stderr if stderr is not None else sys.stderr
        environ = _console_environ()
        # soft_wrap keeps long ids and JSON on one line; captured or piped output is never cropped to 80
        # columns, so tables stay greppable in logs and CI.
        # markup=False: ids, reasons and outputs are shown as they are, brackets included ("[/]" is data).
        # Set by a long-running command: what to do when the reader of stdout goes away.
        self.on_stdout_closed: Callable[[], None] | None = None
        # Set while something else draws on the terminal (the dashboard): where log records go instead.
        self._logs_to: Callable[[logging.LogRecord], None] | None = None

        def console(file: Any) -> Console:
            return _Console(
                owner=self,
                file=file,
                soft_wrap=True,
                highlight=False,
                markup=False,
                width=width or _width(file),
                force_terminal=color,
                _environ=environ,
            )

        self.stdout = console(self._out)
        self.stderr = console(self._err)

    @contextmanager
    def logs_to(self, show: Callable[[logging.LogRecord], None]) -> Iterator[None]:
        """Hand the log records to ``show`` while the block runs, instead of printing them: a full-screen
        program (the dashboard) owns the terminal then, and a line written on it would break its screen."""
        previous, self._logs_to = self._logs_to, show
        try:
            yield
        finally:
            self._logs_to = previous

    def give_stdout_away(self) -> None:
        """Print everything on stderr from now on: something else (a console exporter's records) owns
        stdout, and a line of ours there would corrupt what reads it."""
        self._out = self._err
        self.stdout = self.stderr

    @contextmanager
    def inherited_stdout_to_stderr(self) -> Iterator[Any]:
        """While the block runs, file descriptor 1 is stderr, and this output's stdout (and what the main
        thread writes to ``sys.stdout``: a console exporter's records) goes to the real stdout through a
        descriptor of its own, the stream yielded. A child process a handler starts inherits descriptor 1
        (``subprocess.run(["git", ...])``, ``os.system``), as does C code writing to it: what they print
        lands on stderr, not as bare lines among the command's JSON lines."""
        stream: Any = sys.stdout
        guarded = self._out
        try:
            descriptor = stream.fileno()
        except (AttributeError, OSError, ValueError):  # not a file (a captured stream): nothing inherits it
            descriptor = None
        if descriptor != 1 or not isinstance(guarded, _GuardedStream) or guarded._stream is not stream:
            yield stream  # stdout given away (to stderr), or not the process's: left as it is
            return
        stream.flush()
        own = os.fdopen(os.dup(1), "w", encoding=sys.stdout.encoding, errors=sys.stdout.errors, buffering=1)
        os.dup2(2, 1)
        self._out = _GuardedStream(own)
        self.stdout.file = self._out  # type: ignore[assignment]
        try:
            yield own
        finally:
            with contextlib.suppress(OSError):
                own.flush()
            os.dup2(own.fileno(), 1)  # the real stdout again (or /dev/null, once its reader went away)
            own.close()
            self._out = guarded
            self.stdout.file = guarded  # type: ignore[assignment]

    # -- primitives ----------------------------------------------------------------------------

    def emit_json(self, value: Any) -> None:
        try:
            self._json_line(self._out, value)
        except BrokenPipeError:
            # The reader went away, as for a line Rich prints: a long-running command stops as on SIGTERM
            # (this may run in its signal handler, which must then still stop it), any other one ends.
            self.stdout.on_broken_pipe()

    def _json_line(self, stream: Any, value: Any) -> None:
        # Escaped when the stream's encoding cannot hold every character: still the same JSON document.
        stream.write(_dumps(value, ascii_only=_ascii_only(stream)) + "\n")
        stream.flush()

    def write_rendered(self, stdout: str, stderr: str = "") -> None:
        """Text a ``runlane dev`` process already rendered for this invocation (a proxied command). The dev
        process renders JSON for a stream that takes any text; on one that cannot, it is escaped as JSON
        escapes it (``\\u00eb``), as this invocation's own JSON would be."""
        for text, stream in ((stdout, self._out), (stderr, self._err)):
            if not text:
                continue
            stream.write(_ascii_json(text) if self.json and _ascii_only(stream) else text)
            stream.flush()

    def terminal(self) -> tuple[int | None, bool]:
        """The width this invocation renders with and whether it shows colour, for a dev process rendering
        on its behalf: colour on a terminal, unless this invocation's ``NO_COLOR`` or ``TERM=dumb`` says
        otherwise (the dev process reads only its own environment, so it is told no colour at all)."""
        console = self.stdout
        color = console.is_terminal and console.color_system is not None and not console.no_color
        return max(console.width, _NARROWEST_RENDERING), color

    def line(self, text: str | Text = "") -> None:
        """A line of stdout; the data in a ``Text`` is made ``printable()`` by its caller."""
        self.stdout.print(printable(text) if isinstance(text, str) else text)

    def warn(self, text: str) -> None:
        """A diagnostic for humans; always stderr, never part of a result."""
        self.stderr.print(printable_text(text, "yellow"))

    def warning(self, code: str, text: str) -> None:
        """A warning about how the command ran (not its result): ``warning: ...`` on stderr, or with
        ``--json`` one ``{"warning": {"code", "message"}}`` line there, beside any error document."""
        if self.json:
            self._json_line(self._err, {"warning": {"code": code, "message": text}})
            return
        self.stderr.print(printable_text(f"warning: {text}", "yellow"))

    def log(self, record: logging.LogRecord) -> None:
        """One log record of the runtime (a failed attempt, a storage outage): stderr, as a timestamped
        line with its traceback below, or one JSON object with ``--json``; handed to the function of ``logs_to()``
        instead while one is set."""
        if self._logs_to is not None:
            self._logs_to(record)
            return
        at = iso(datetime.fromtimestamp(record.created, UTC)) or ""
        message = record.getMessage()
        if self.json:
            trace = logging.Formatter().formatException(record.exc_info) if record.exc_info else None
            value: dict[str, Any] = {
                "at": at, "type": "log", "level": record.levelname.lower(), "logger": record.name, "message": message,
            }  # fmt: skip
            fields = ((name, getattr(record, name, None)) for name in _LOG_FIELDS)
            value.update({name: field for name, field in fields if field is not None})
            if trace is not None:
                value["exception"] = trace
            self._json_line(self._err, value)
            return
        line = Text(f"{at} ", style="dim")
        style = "red" if record.levelno >= logging.ERROR else "yellow"
        if not record.name.startswith("runlane"):  # the application's own record: say whose, and which run's
            run_id = getattr(record, "run_id", None)
            message = f"{record.name}: {message}" + (f" (run {run_id})" if run_id is not None else "")
        line.append(printable(f"{record.levelname.lower()} {message}"), style=style)
        self.stderr.print(line)
        if record.exc_info:
            # Already printable, line by line: the traceback's own line breaks are kept.
            self.stderr.print(Text(_traceback_text(record.exc_info), style="dim"))

    def error(self, error: RunlaneError) -> None:
        if self.json:
            self._json_line(self._err, {"error": error.to_json()})
            return
        self.stderr.print(printable_text(f"error[{error.code.value}]: {error.message}", "bold red"))

    # -- cards ---------------------------------------------------------------------------------

    def _card(self, rows: Iterable[tuple[str, Any]], indent: int = 2) -> None:
        rows = [(label, value) for label, value in rows if value is not None]
        if not rows:
            return
        width = max(len(label) for label, _ in rows)
        for label, value in rows:
            line = Text(" " * indent)
            line.append(label.ljust(width), style="dim")
            line.append("  ")
            line.append(printable(display_value(value)))
            self.stdout.print(line)

    def run_card(self, run: Any, *, heading: Text | None = None) -> None:
        self.stdout.print(heading if heading is not None else printable_text(run.id, "bold"))
        self._card(run_rows(run))

    # -- command results -----------------------------------------------------------------------

    def trigger_result(self, result: Any) -> None:
        if self.json:
            self.emit_json({"run": result.run, "outcome": result.outcome})
            return
        run = result.run
        if display_value(result.outcome) == "created":
            self.run_card(run, heading=Text.assemble(("✓ created ", "bold green"), (printable(run.id), "bold")))
        else:
            heading = Text.assemble(
                ("⊝ returned existing ", "bold yellow"), (printable(run.id), "bold"), " (idempotency)"
            )
            self.run_card(run, heading=heading)
            self.line()
            if run_status_values.is_terminal(run.status):
                hint = f"  use runlane rerun {printable(run.id)} to execute this work again"
            else:  # rerun takes finished runs only: the work is still to do, or being done
                status = display_value(run.status)
                hint = f"  the run is still {status}; runlane runs get {printable(run.id)} follows it"
            self.line(Text.assemble(("hint", "bold cyan"), hint))

    def run_result(self, run: Any, *, verb: str) -> None:
        """A run created or changed by an operator command (retry, rerun, cancel)."""
        if self.json:
            self.emit_json({"run": run})
            return
        self.run_card(run, heading=Text.assemble((f"✓ {verb} ", "bold green"), (printable(run.id), "bold")))

    def run_detail(self, run: Any, events: Any | None) -> None:
        if self.json:
            document: dict[str, Any] = {"run": run}
            if events is not None:
                document["events"] = {"data": events.data, "next_cursor": events.next_cursor}
            self.emit_json(document)
            return
        self.run_card(run)
        if events is None:
            return
        self.line()
        self.line(Text("events", style="bold"))
        if not events.data:
            self.line(Text("  (no events)", style="dim"))
        for record in events.data:
            event = record.event
            line = Text("  ")
            line.append(f"{record.sequence:>4}  ", style="dim")
            line.append(f"{iso(event.occurred_at)}  ")
            line.append(printable(display_value(event.type)), style="cyan")
            detail = event_detail(event)
            if detail:
                line.append(printable(f"  {detail}"))
            self.line(line)
        if events.next_cursor:
            self.line()
            self.line(Text.assemble(("next cursor", "bold cyan"), printable(f"  {events.next_cursor}")))

    def runs_table(self, page: Any) -> None:
        if self.json:
            self.emit_json({"data": page.data, "next_cursor": page.next_cursor})
            return
        if not page.data:
            self.line(Text("no runs", style="dim"))
        else:
            rows = []
            for run in page.data:
                counters = getattr(run, "counters", None)
                rows.append(
                    {
                        "id": run.id,
                        "status": display_value(run.status),
                        "task": run.task_id,
                        "queue": run.queue,
                        "attempts": str(counters.attempts) if counters is not None else "",
                        "run at": _seconds(getattr(run, "run_at", None)),
                        "created": _seconds(run.created_at),
                    }
                )
            for line in _run_rows(rows, self.stdout.width):
                self.line(line)
        if page.next_cursor:
            self.line()
            self.line(Text.assemble(("next cursor", "bold cyan"), printable(f"  {page.next_cursor}")))

    def queues_table(self, queues: Sequence[Any]) -> None:
        """``runlane queues``: each queue's policy and its active runs by status."""
        if self.json:
            self.emit_json({"queues": [queue.to_json() for queue in queues]})
            return
        table = _table()
        # A long name gives way (cut with an ellipsis) before the counts do.
        table.add_column("queue", min_width=len("queue"))
        table.add_column("limit", justify="right")
        statuses = list(queues[0].to_json()["counts"]) if queues else []
        for status in statuses:
            table.add_column(status.replace("_", " "), justify="right")
        for queue in queues:
            document = queue.to_json()
            capped = set(document["capped"])
            registered = document["registered"]
            name = queue_label(document["name"], default=document["default"], registered=registered)
            name.no_wrap, name.overflow = True, "ellipsis"
            cells = [
                f"{count}{'+' if status in capped else ''}" if count else Text("0", style="dim")
                for status, count in document["counts"].items()
            ]
            table.add_row(name, queue_limit_label(document["concurrency_limit"], registered=registered), *cells)
        self.stdout.print(table)

    def schedules_table(self, schedules: Sequence[Any]) -> None:
        """``runlane schedules``: each schedule's definition, next fire time and latest materialized one; a
        latest record that cannot be read is shown as such and explained on stderr."""
        documents = [item.to_json() for item in schedules]
        if self.json:
            self.emit_json({"data": documents})
        elif not documents:
            self.line(Text("no schedules registered", style="dim"))
        else:
            table = _table()
            for column in ("schedule", "task", "type", "expression", "queue", "enabled", "next fire", "latest fire"):
                table.add_column(column, no_wrap=column not in ("task", "expression"))
            for document in documents:
                upcoming, latest = document["next_fire_at"], document["latest_fire_at"]
                if document["latest_fire_error"] is not None:
                    latest = Text("unreadable", style="red")
                elif document["latest_fire_skipped"]:  # an active run held the task's singleton key then
                    latest = Text(f"{latest} (skipped)", style="yellow")
                table.add_row(
                    document["id"],
                    document["task_id"],
                    document["type"],
                    document["expression"],
                    document["queue"],
                    "yes" if document["enabled"] else Text("no", style="yellow"),
                    upcoming or Text("-" if document["enabled"] else "- (disabled)", style="dim"),
                    latest or Text("-", style="dim"),
                )
            self.stdout.print(table)
        for document in documents:
            error = document["latest_fire_error"]
            if error is not None:
                self.warning(error["code"], f"the latest fire time of schedule {document['id']!r}: {error['message']}")

    def attempts_table(self, run: Any, attempts: Sequence[Any]) -> None:
        run_id = run.id
        if self.json:
            self.emit_json({"run_id": run_id, "attempts": list(attempts)})
            return
        if not attempts:
            self.line(printable_text(f"{run_id} has no attempts yet", "dim"))
            return
        table = _table()
        table.add_column("attempt", justify="right", no_wrap=True)
        for column in ("status", "started", "completed"):
            table.add_column(column, no_wrap=True)
        # The only column that gives way when the line is too long (a long output or failure): its text is
        # cut, never wrapped, and the attempt, its status and times stay whole.
        table.add_column("detail")
        for attempt, detail in zip(attempts, attempt_details(run, attempts)):
            if len(detail) > _CELL_CHARS:  # no line shows more; a big output is not measured whole
                detail = detail[: _CELL_CHARS - 1] + "…"
            table.add_row(
                str(attempt.attempt),
                display_value(attempt.status),
                iso(attempt.started_at) or "",
                iso(attempt.completed_at) or "",
                Text(printable(detail), no_wrap=True, overflow="ellipsis"),
            )
        self.stdout.print(table)

    def steps_table(self, run_id: str, page: Any) -> None:
        """``runs steps``: one line per completed durable step, its output cut to the terminal width."""
        if self.json:
            self.emit_json({"run_id": run_id, "data": page.data, "next_cursor": page.next_cursor})
            return
        if not page.data:
            more = " on this page" if page.next_cursor else ""
            self.line(printable_text(f"{run_id} has no completed steps{more}", "dim"))
        else:
            table = _table()
            # The step key and the output give way when the line is too long, the longer one first; their
            # text is cut, never wrapped, and the attempt and the time stay whole.
            table.add_column("step", min_width=len("step"))
            table.add_column("attempt", justify="right", no_wrap=True)
            table.add_column("completed", no_wrap=True)
            table.add_column("output", min_width=len("output"))
            for step in page.data:
                output = _compact(step.output)
                if len(output) > _CELL_CHARS:  # no line shows more; a big output is not measured whole
                    output = output[: _CELL_CHARS - 1] + "…"
                key = step.step_key if len(step.step_key) <= _CELL_CHARS else step.step_key[: _CELL_CHARS - 1] + "…"
                cells = (Text(printable(text), no_wrap=True, overflow="ellipsis") for text in (key, output))
                step_key, cell = cells
                table.add_row(step_key, str(step.attempt), iso(step.completed_at) or "", cell)
            self.stdout.print(table)
        if page.next_cursor:
            self.line()
            self.line(Text.assemble(("next cursor", "bold cyan"), printable(f"  {page.next_cursor}")))

    def tick_result(self, result: Any) -> None:
        if self.json:
            self.emit_json({"tick": result})
            return
        self.line(Text("✓ tick complete", style="bold green"))
        self._card((f.name.replace("_", " "), getattr(result, f.name)) for f in dataclasses.fields(result))

    def prune_result(self, result: Any) -> None:
        if self.json:
            self.emit_json({"pruned": result.pruned, "next_cursor": result.next_cursor})
            return
        self.line(Text(f"✓ pruned {result.pruned} run{'s' if result.pruned != 1 else ''}", style="bold green"))
        if result.next_cursor:
            self.line(Text.assemble(("next cursor", "bold cyan"), printable(f"  {result.next_cursor}")))
            self.line(Text("  pass it back with --cursor and the same --older-than and --status", style="dim"))

    def trim_result(self, result: Any) -> None:
        if self.json:
            self.emit_json({"deleted": result.deleted, "more": result.more})
            return
        plural = "s" if result.deleted != 1 else ""
        self.line(Text(f"✓ trimmed {result.deleted} observation record{plural}", style="bold green"))
        if result.more:
            self.line(Text("  older records remain: run it again, or pass --all", style="dim"))

    def signal_result(self, signal_key: str, runs: Sequence[Any], limit: int | None = None) -> None:
        """The runs a signal resumed; ``more`` (``--json``) when it resumed ``limit`` runs, the most one
        send resumes, so others may still wait."""
        more = limit is not None and len(runs) >= limit
        if self.json:
            self.emit_json(
                {"signal_key": signal_key, "resumed": [run.id for run in runs], "runs": list(runs), "more": more}
            )
            return
        resumed = f"✓ signal {signal_key} resumed {len(runs)} run{'s' if len(runs) != 1 else ''}"
        self.line(printable_text(resumed, "bold green"))
        for run in runs:
            self.line(f"  {run.id}  {run.task_id}  {display_value(run.status)}")
        if more:
            self.line(Text(f"  that is the limit ({limit}): more runs may still wait; send it again", style="dim"))

    def plugins_table(
        self, plugins: Sequence[Any], failures: Sequence[Any] = (), collisions: Sequence[str] = ()
    ) -> None:
        if self.json:
            self.emit_json(
                {
                    "plugins": [plugin.to_json() for plugin in plugins],
                    "failures": [dataclasses.asdict(failure) for failure in failures],
                    "collisions": list(collisions),
                }
            )
            return
        table = _table()
        for column in ("plugin", "distribution", "version", "provides"):
            table.add_column(column)
        for plugin in plugins:
            provides = "; ".join(f"{kind}: {', '.join(names)}" for kind, names in plugin.provides.items())
            table.add_row(plugin.name, plugin.distribution or "", plugin.version or "", provides or "-")
        self.stdout.print(table)
        for failure in failures:
            self.warn(f"skipped plugin {failure.name!r}: {failure.error}")
        for plugin in plugins:
            if plugin.runlane_compatible is False:
                self.warn(
                    f"plugin {plugin.name!r} declares it works with runlane{plugin.requires_runlane}, "
                    "not with the runlane installed; it may fail"
                )
        for collision in collisions:
            self.warn(collision)

    def file_written(self, path: str, *, overwritten: bool) -> None:
        if self.json:
            self.emit_json({"path": path, "overwritten": overwritten})
            return
        self.line(Text.assemble(("✓ wrote ", "bold green"), (printable(path), "bold")))

    # -- lifecycle records (work, dev) ---------------------------------------------------------

    def record(self, kind: str, text: str, **fields: Any) -> None:
        """One timestamped append-only lifecycle line, or one NDJSON object with ``--json``."""
        at = _now()
        if self.json:
            self.emit_json({"at": at, "type": kind, **fields})
            return
        line = Text(f"{at} ", style="dim")
        line.append(printable(text))
        self.stdout.print(line)

    def run_executed(self, run: Any) -> None:
        text = (
            f"run {display_value(run.status)} {run.id} task={run.task_id} queue={run.queue} "
            f"attempts={run.counters.attempts}"
        )
        self.record("run", text + _what_next(run), run=run)

    def tick_record(self, result: Any) -> None:
        counts = {f.name: getattr(result, f.name) for f in dataclasses.fields(result)}
        self.record("tick", tick_counts(result), tick=counts)

    def command_record(self, command: str, *, summary: str | None = None, error: RunlaneError | None = None) -> None:
        """A command ``runlane dev`` ran for another terminal: its result in a few words, or its error."""
        if error is not None:
            self.record(
                "command", f"command {command} ✗ {error.code.value}: {error.message}",
                command=command, ok=False, error=error.to_json(),
            )  # fmt: skip
            return
        self.record("command", f"command {command} {summary}", command=command, ok=True, summary=summary)


# Structured fields runtime log records carry (``extra=``) that a JSON log line repeats.
_LOG_FIELDS = ("run_id", "task_id", "attempt", "error_code", "worker_id", "blocked_seconds")


def _not_handled_on_the_way(record: logging.LogRecord) -> bool:
    """Whether no logger between the record's and the root has a handler: one the application gave its own
    loggers already wrote it (Python's last resort stays silent then too). A ``NullHandler`` (what a
    library, and ``logging.captureWarnings``, put on their loggers so as not to print) writes nothing."""
    logger: logging.Logger | None = logging.getLogger(record.name)
    while logger is not None and logger.parent is not None:  # the root has no parent
        if any(not isinstance(handler, logging.NullHandler) for handler in logger.handlers):
            return False
        logger = logger.parent if logger.propagate else None
    return True


class _OutputHandler(logging.Handler):
    def __init__(self, output: Output, level: int = logging.INFO) -> None:
        super().__init__(level)
        self.output = output
        self.addFilter(RunContextFilter())

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.output.log(record)
        except Exception:
            self.handleError(record)


@contextmanager
def json_import_logs(output: Output) -> Iterator[None]:
    """With ``--json``, while the application's modules are imported: what they log (warnings and up) and
    ``warnings.warn()`` while logging is not configured comes out as JSON lines like the command's other
    records, not as the bare lines Python prints then. Only Python's last-resort handler is replaced, not
    the root logger's handlers, so a module that configures logging as it is imported (``basicConfig()``)
    still does, and its handlers get what is logged after. Each line they print() is a log record of logger
    ``stdout`` on stderr, as a handler's is (``prints_as_json_logs``): stdout carries the command's own JSON
    lines only."""
    if not output.json:
        yield
        return
    with _stdout_as_records(LineStream(_printed_line_records(output), sys.stderr)), _import_log_records(output):
        yield


@contextmanager
def _import_log_records(output: Output) -> Iterator[None]:
    if logging.getLogger().handlers:
        yield
        return
    previous = logging.lastResort
    capturing = getattr(logging, "_warnings_showwarning", None) is not None  # an enclosing block already does
    logging.lastResort = _OutputHandler(output, logging.WARNING)
    # Captured warnings go to the py.warnings logger, which captureWarnings() gives a NullHandler (so the
    # last resort never sees them): they get a handler of their own, silent once logging is configured.
    warned = _OutputHandler(output, logging.WARNING)
    warned.addFilter(lambda record: not logging.getLogger().handlers)
    py_warnings = logging.getLogger("py.warnings")
    py_warnings.addHandler(warned)
    if not capturing:
        logging.captureWarnings(True)
    try:
        yield
    finally:
        if not capturing:
            logging.captureWarnings(False)
        py_warnings.removeHandler(warned)
        logging.lastResort = previous


@contextmanager
def forward_runtime_logs(output: Output) -> Iterator[None]:
    """Print the ``runlane`` loggers' records (info and up), and the application's (warnings and up, and
    ``warnings.warn()``, unless one of its own loggers' handlers wrote them), through ``output`` while the
    block runs, unless the application configured logging itself (a handler on the root or ``runlane``
    logger): then its own handlers get them, as they would anywhere else.

    The database driver's connection pool logs each failed reconnect and discarded connection as a
    warning; Runlane reports an outage itself (once, and again when storage answers), so those are
    kept to errors meanwhile (``quiet_connection_pool``)."""
    logger = logging.getLogger("runlane")
    root = logging.getLogger()
    if root.handlers or logger.handlers:
        yield
        return
    handler = _OutputHandler(output)
    # The application's own records (warnings and up, as Python shows them when logging is not configured)
    # come out the same way instead of as bare lines among the JSON ones, naming their run.
    application = _OutputHandler(output, logging.WARNING)
    application.addFilter(_not_handled_on_the_way)
    level, propagate = logger.level, logger.propagate
    # Entered before the handlers are added: it would take them for the application's own.
    with quiet_connection_pool():
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
        root.addHandler(application)
        logging.captureWarnings(True)  # warnings.warn() too, instead of bare lines among the JSON ones
        # With --json, an exception that ends a thread (one a handler started) too: Python prints its traceback
        # as bare lines on stderr, which holds JSON lines only.
        thread_hook = threading.excepthook
        if output.json:
            threading.excepthook = _log_thread_exception
        try:
            yield
        finally:
            if threading.excepthook is _log_thread_exception:
                threading.excepthook = thread_hook
            logging.captureWarnings(False)
            logger.removeHandler(handler)
            root.removeHandler(application)
            logger.setLevel(level)
            logger.propagate = propagate


def _log_thread_exception(args: threading.ExceptHookArgs) -> None:
    """What ``threading.excepthook`` prints, as an error record of logger ``threading``; a ``SystemExit`` ends
    its thread silently, as Python has it."""
    if issubclass(args.exc_type, SystemExit):
        return
    name = args.thread.name if args.thread is not None else threading.get_ident()
    if args.exc_value is None:
        logging.getLogger("threading").error("Exception in thread %s: %s", name, args.exc_type.__name__)
        return
    logging.getLogger("threading").error(
        "Exception in thread %s", name, exc_info=(args.exc_type, args.exc_value, args.exc_traceback)
    )


class LineStream(io.TextIOBase):
    """A stand-in text stream (for ``sys.stdout`` or ``sys.stderr``) that hands each line written to it,
    once complete and not blank, to ``emit``; lines are gathered per thread, so the prints of two handler
    threads never mix. ``fileno()`` and the like are ``beside``'s: a child process given this stream writes
    there. ``finish()`` when it is taken away: a last line without its line break is handed on then."""

    def __init__(self, emit: Callable[[str], None], beside: Any) -> None:
        self._emit_line = emit
        self._beside = beside
        self._lock = threading.Lock()
        self._unfinished: dict[int, str] = {}  # thread ident -> its line so far, for flush() at the end

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        ident = threading.get_ident()
        with self._lock:
            *lines, rest = (self._unfinished.pop(ident, "") + text).split("\n")
            if rest:
                self._unfinished[ident] = rest
            for line in lines:
                self._emit(line)
        return len(text)

    def flush(self) -> None:
        """Hand on the calling thread's unfinished line: another thread's flush does not cut a line that
        one is still printing."""
        with self._lock:
            unfinished = self._unfinished.pop(threading.get_ident(), None)
            if unfinished is not None:
                self._emit(unfinished)
        self._beside.flush()

    def finish(self) -> None:
        """Hand on every thread's unfinished line (when the stand-in is taken away)."""
        with self._lock:
            unfinished, self._unfinished = list(self._unfinished.values()), {}
            for line in unfinished:
                self._emit(line)
        self.flush()

    def _emit(self, line: str) -> None:
        if line.strip():
            self._emit_line(line)

    def fileno(self) -> int:
        return int(self._beside.fileno())

    def isatty(self) -> bool:
        return False

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"


class _HandlerPrints(LineStream):
    """``sys.stdout`` while handlers run under ``--json``: what is written inside an attempt (its handler, a
    ``def`` handler's thread, the tasks it starts) becomes log records, and so does what a thread of no
    attempt writes (a plain ``threading.Thread`` a handler started carries no context: its lines are
    records without a run). What the main thread writes outside attempts (a console exporter's records,
    the process's own lines) reaches the real stdout as before."""

    def __init__(self, emit: Callable[[str], None], beside: Any, real: Any) -> None:
        super().__init__(emit, beside)
        self._real = real

    def write(self, text: str) -> int:
        if not _printed_by_handlers():
            return int(self._real.write(text))
        return super().write(text)

    def flush(self) -> None:
        super().flush()
        self._real.flush()

    def fileno(self) -> int:
        return super().fileno() if _printed_by_handlers() else int(self._real.fileno())


def _printed_by_handlers() -> bool:
    """Whether the calling code writes for handlers: inside an attempt, or on a thread other than the main one
    (the command's own output and its exporters write from the main thread)."""
    return current_task_context() is not None or threading.current_thread() is not threading.main_thread()


def _printed_line_records(output: Output) -> Callable[[str], None]:
    """What hands each printed line to ``output`` as a log record of logger ``stdout`` (naming the run it was
    printed for, if any)."""
    context = RunContextFilter()

    def emit(line: str) -> None:
        record = logging.LogRecord("stdout", logging.INFO, "", 0, line, None, None)
        context.filter(record)
        output.log(record)

    return emit


@contextmanager
def prints_as_json_logs(output: Output) -> Iterator[None]:
    """With ``--json``, while handlers run in this process: each line a handler print()s comes out as one
    JSON log record (logger ``stdout``, naming its run) on stderr, since stdout carries the command's own
    JSON lines and a bare line among them breaks whatever parses it. Without ``--json`` prints stay on
    stdout."""
    if not output.json:
        yield
        return
    with output.inherited_stdout_to_stderr() as real:
        with _stdout_as_records(_HandlerPrints(_printed_line_records(output), sys.stderr, real)):
            yield


@contextmanager
def _stdout_as_records(lines: LineStream) -> Iterator[None]:
    """``lines`` as ``sys.stdout`` while the block runs (unless something replaced it meanwhile), finished
    after it."""
    real = sys.stdout
    sys.stdout = lines
    try:
        yield
    finally:
        if sys.stdout is lines:
            sys.stdout = real
        lines.finish()


@contextmanager
def quiet_connection_pool() -> Iterator[None]:
    """Keep the database driver's connection pool to errors while the block runs: it logs each discarded
    connection and failed reconnect as a warning, which Python would print as a bare line beside the
    command's own report of the outage (``storage_unavailable``). An application that configured logging
    itself (a handler on the root or ``runlane`` logger) gets them as it configured."""
    if logging.getLogger().handlers or logging.getLogger("runlane").handlers:
        yield
        return
    pool = logging.getLogger("psycopg.pool")
    pool_level = pool.level
    pool.setLevel(max(pool_level, logging.ERROR))
    try:
        yield
    finally:
        pool.setLevel(pool_level)


class _Table(Table):
    """A result table: its ``str`` cells show data, so they are made ``printable()`` (the data in ``Text``
    cells is made printable by whoever builds them)."""

    def add_row(self, *renderables: Any, style: Any = None, end_section: bool = False) -> None:
        cells = (printable(cell) if isinstance(cell, str) else cell for cell in renderables)
        super().add_row(*cells, style=style, end_section=end_section)


def _table() -> Table:
    return _Table(box=None, pad_edge=False, show_edge=False, header_style="bold")


_ExcInfo = tuple[type[BaseException], BaseException, TracebackType | None] | tuple[None, None, None]


def _traceback_text(exc_info: _ExcInfo) -> str:
    """A logged exception's traceback, printable line by line. What each exception in the chain says (its
    message, its notes) is data and printed on its own line, its line breaks escaped too: a newline in a
    message would otherwise print a line that looks like a log line of its own."""
    if exc_info[1] is None:
        return printable(logging.Formatter().formatException(exc_info))
    top = traceback.TracebackException(type(exc_info[1]), exc_info[1], exc_info[2])
    pending, seen = [top], set()
    while pending:
        node = pending.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        # ``format()`` asks each exception of the chain for these lines; only they hold its own text. Notes
        # are printed a line each, so theirs are escaped before.
        if isinstance(node.__notes__, Sequence):
            node.__notes__ = [printable(note) if isinstance(note, str) else note for note in node.__notes__]
        setattr(node, "format_exception_only", _printable_lines(node.format_exception_only))
        links = (node.__cause__, node.__context__, *(node.exceptions or ()))
        pending.extend(link for link in links if link is not None)
    text = "".join(top.format()).removesuffix("\n")
    return "\n".join(printable(line) for line in text.split("\n"))


def _printable_lines(lines: Callable[..., Iterable[str]]) -> Callable[..., Iterator[str]]:
    def printable_lines(*args: Any, **kwargs: Any) -> Iterator[str]:
        for line in lines(*args, **kwargs):
            body = line.removesuffix("\n")
            yield printable(body) + line[len(body) :]

    return printable_lines


def _width(stream: Any) -> int | None:
    isatty = getattr(stream, "isatty", None)
    return None if callable(isatty) and isatty() else _PIPED_WIDTH


_PIPED_WIDTH = 400
# The most characters of one JSON value a table cell takes in (it is cut to the line width anyway).
_CELL_CHARS = 2 * _PIPED_WIDTH


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


def failure_text(failure: Any) -> str:
    """``code: message``, and where validation failed (``meta.errors``, as ``--json`` shows in full): the
    stored message may be the same for every payload, so without this only ``--json`` says which field.
    A message that names them already (a payload or step output that drifted from its schema) is left as it is."""
    text = f"{display_value(failure.code)}: {failure.message}"
    errors = failure.meta.get("errors") if isinstance(failure.meta, dict) else None
    if isinstance(errors, list) and errors and all(isinstance(item, dict) for item in errors):
        whole = "output" if "step_key" in failure.meta else "payload"  # a step's stored output, or the payload
        shown = "; ".join(
            f"{error_location(item.get('loc') or (), whole)}: {item.get('msg', '?')}" for item in errors[:3]
        )
        more = f"; and {len(errors) - 3} more" if len(errors) > 3 else ""
        if shown not in failure.message:
            text += f" ({shown}{more})"
    reason = failure.meta.get("reason") if isinstance(failure.meta, dict) else None
    if display_value(failure.code) == "operation_cancelled" and isinstance(reason, str) and reason:
        text += f" (reason: {reason})"  # worker_stopped: nobody cancelled the run, its worker was stopping
    return text


def attempt_details(run: Any, attempts: Sequence[Any]) -> list[str]:
    """``attempt_detail`` of each of ``run``'s ``attempts``: one still ``running`` recorded no outcome when a
    later attempt started, or when the run itself is no longer running (its lease expired, and the run
    was made due again, or finished, without it)."""
    live = display_value(run.status) in ("running", "cancellation_requested")
    last = len(attempts) - 1
    return [attempt_detail(attempt, ended=index < last or not live) for index, attempt in enumerate(attempts)]


def attempt_detail(attempt: Any, *, ended: bool = False) -> str:
    """What an attempt ended with: its failure, when it is retried, why it released and what for, or its
    output. An ``ended`` attempt that is still ``running`` recorded no outcome."""
    if ended and attempt.status == "running":
        return "no outcome: its worker stopped (crashed, was killed, or lost the lease)"
    if attempt.failure is not None:
        # A retried attempt failed too: its failure alone would not say when the run runs again.
        retried = f" retry_at={iso(attempt.retry_at)}" if attempt.retry_at is not None else ""
        return failure_text(attempt.failure) + retried
    if display_value(attempt.status) == "released":
        released = f"released: {attempt.release_reason}" if attempt.release_reason else "released"
        wait = attempt.release_wait
        waited = _wait_parts(wait) if wait is not None else []
        if wait is None and attempt.resume_at is not None:
            waited = [f"resume_at={iso(attempt.resume_at)}"]
        return " ".join([released, *waited])
    if attempt.has_output:
        return f"output {_compact(attempt.output)}"
    return ""


def event_detail(event: Any) -> str:
    """One event's notable fields on a line: attempt, reason, times, what a release waits for, failure, actor."""
    parts: list[str] = []
    for name in ("attempt", "reason", "retry_at", "resume_at", "run_at", "attempt_deadline_at"):
        value = getattr(event, name, None)
        if value is not None and not isinstance(value, BaseModel):
            parts.append(f"{name}={display_value(value)}")
    wait = getattr(event, "wait", None)
    if isinstance(wait, BaseModel) and display_value(getattr(wait, "type", None)) != "time":  # resume_at is above
        parts.extend(_wait_parts(wait))
    failure = getattr(event, "failure", None)
    if failure is not None:
        parts.append(f"failure={failure_text(failure)}")
    actor = getattr(event, "actor", None)
    if actor is not None:
        parts.append(f"actor={display_value(actor.type)}" + (f":{actor.id}" if actor.id else ""))
    return " ".join(parts)
