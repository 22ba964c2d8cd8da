"""The ``runlane dev`` control bridge: stateful commands from another terminal run inside the dev process.

A process-local lane keeps its state in the ``runlane dev`` process, so a second ``runlane trigger`` or
``runlane runs list`` would otherwise see an empty store. ``runlane dev`` therefore serves a small
loopback HTTP/1.1 endpoint (127.0.0.1 only, an ephemeral port, a random bearer token compared in
constant time) and writes a session file (mode 0600, written atomically) under
``<tempdir>/runlane-dev-<uid>/`` (a folder that must be this user's own, mode 0700), keyed by a hash of
the resolved config path. Stateful commands look for a live session for their config path first and,
when one answers, send their validated arguments there;
the dev process runs the same registered operation (``main.OPERATIONS``: the same public runtime calls
and the same rendering), returns the rendered text and prints a timestamped ``command`` line (or NDJSON
record) saying what it ran and how it ended, beside its ``run`` and ``tick`` lines; a request marked
``quiet`` (the dashboard's periodic reads) is not printed. A stale session file (dead pid, refused
connection, rejected token, garbled file) is removed and the command runs on its own runtime.

The bridge is a development aid, not a transport: it serves exactly the stateful commands, one JSON
request per connection, bounded in size and time.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import io
import json
import math
import os
import secrets
import stat
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ..errors import ErrorCode, RunlaneError
from .main import OPERATIONS, Operation, OperationParams, parse_params
from .output import Output, to_json_value

__all__ = [
    "COMMAND_PATH",
    "MAX_REQUEST_BYTES",
    "BridgeServer",
    "Rendered",
    "Session",
    "exchange",
    "live_dev_pid",
    "proxy",
    "render_operation",
    "read_session",
    "session_dir",
    "session_path",
]

COMMAND_PATH = "/v1/command"
MAX_REQUEST_BYTES = 1024 * 1024
"""The largest request body the bridge reads; larger requests get 413 without being read."""
MAX_HEADER_BYTES = 16 * 1024
MAX_HEADERS = 64
READ_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 5.0
RESPONSE_TIMEOUT_S = 300.0
# After this long without an answer a proxied command says what it is waiting for (seconds).
SLOW_ANSWER_NOTE_S = 5.0

_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    411: "Length Required",
    413: "Content Too Large",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


# -- session files ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Session:
    """One ``runlane dev`` process's bridge, as recorded in its session file."""

    config_path: str
    port: int
    token: str
    pid: int
    started_at: str
    file: Path
    lane: str | None = None  # ``lane_signature`` of the configuration it was started with
    # What its runtime serves: the environment and lane names (``None`` in a file of an earlier release).
    # With ``runtime = "module:attribute"`` only the runtime knows them, not the configuration file.
    environment: str | None = None
    lane_name: str | None = None


def session_dir() -> Path:
    """This user's session folder: ``<tempdir>/runlane-dev-<uid>``, mode 0700. Per user, because a
    folder another user made first could hand them this user's commands (see ``_private_folder``)."""
    uid = _uid()
    return Path(tempfile.gettempdir()) / f"runlane-dev-{uid if uid is not None else os.environ.get('USERNAME', 'user')}"


def _uid() -> int | None:
    """This process's user id (``None`` where the platform has none)."""
    getuid = getattr(os, "getuid", None)
    return getuid() if callable(getuid) else None


def _owned_privately(info: os.stat_result) -> bool:
    """Owned by this user, and nobody else may read, write or enter it."""
    uid = _uid()
    return (uid is None or info.st_uid == uid) and not info.st_mode & 0o077


def _private_folder(directory: Path) -> RunlaneError | None:
    """Why ``directory`` (which exists) cannot hold this user's sessions, or ``None`` when it can: a
    session file names the port and token commands are sent to, so the folder must be this user's own
    and closed to everyone else (a real directory, not a link another user could point elsewhere)."""
    try:
        info = os.lstat(directory)
    except OSError as error:
        return RunlaneError(
            ErrorCode.CONFIGURATION_INVALID,
            f"The runlane dev session folder {directory} cannot be read ({error.strerror}); remove it, or set "
            "TMPDIR to a folder of your own.",
        )
    if stat.S_ISDIR(info.st_mode) and _owned_privately(info):
        return None
    return RunlaneError(
        ErrorCode.CONFIGURATION_INVALID,
        f"The runlane dev session folder {directory} is not private to you (owner uid {info.st_uid}, mode "
        f"{stat.filemode(info.st_mode)}): a session file there could send your commands elsewhere. Remove it, "
        "or set TMPDIR to a folder of your own.",
        meta={"path": str(directory)},
    )


def _resolved(config_path: Path | str) -> str:
    return str(Path(config_path).expanduser().resolve())


def session_path(config_path: Path | str) -> Path:
    """The session file for a config path: one per resolved path, so the latest ``runlane dev`` wins."""
    # surrogatepass: a file name that is not UTF-8 text (an ASCII locale's non-ASCII bytes) still has one.
    digest = hashlib.sha256(_resolved(config_path).encode("utf-8", "surrogatepass")).hexdigest()[:32]
    return session_dir() / f"{digest}.json"


def lane_signature(config: Any) -> str:
    """What decides where a loaded configuration's runs live: its lane with its options, or its runtime
    factory. A dev session serves a command only while the configuration still says the same."""
    section = config.config
    lane = section.lane
    document = {
        "runtime": section.runlane.runtime,
        "lane": None if lane is None else {"use": lane.use, "options": lane.options},
        "environment": section.runlane.environment,
    }
    return hashlib.sha256(json.dumps(document, sort_keys=True, default=str).encode("utf-8")).hexdigest()[:32]


def write_session(
    config_path: Path | str,
    *,
    port: int,
    token: str,
    lane: str | None = None,
    environment: str | None = None,
    lane_name: str | None = None,
) -> Session:
    """Atomically (re)write the session file for ``config_path`` with mode 0600."""
    session = Session(
        config_path=_resolved(config_path),
        port=port,
        token=token,
        pid=os.getpid(),
        started_at=datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        file=session_path(config_path),
        lane=lane,
        environment=environment,
        lane_name=lane_name,
    )
    _store_session(session)
    return session


def _store_session(session: Session) -> None:
    directory = session.file.parent
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as error:
        raise RunlaneError(
            ErrorCode.CONFIGURATION_INVALID,
            f"Could not create the runlane dev session folder {directory} ({error.strerror}); set TMPDIR to a "
            "folder you can write.",
        ) from None
    refused = _private_folder(directory)
    if refused is not None:
        raise refused
    document = {
        "config_path": session.config_path,
        "port": session.port,
        "token": session.token,
        "pid": session.pid,
        "started_at": session.started_at,
        "lane": session.lane,
        "environment": session.environment,
        "lane_name": session.lane_name,
    }
    fd, temporary = tempfile.mkstemp(prefix=".session-", suffix=".tmp", dir=directory)  # created 0600
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            os.fchmod(handle.fileno(), 0o600)
            json.dump(document, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, session.file)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def hand_back_session(session: Session, previous: Session | None) -> None:
    """``session``'s dev is stopping: give the session file back to ``previous`` (the dev it superseded
    for the same config) when that one still runs, else remove the file (``discard_session``)."""
    if previous is not None and pid_alive(previous.pid) and _recorded_token(session.file) == session.token:
        _store_session(previous)
        return
    discard_session(session)


def _recorded_token(file: Path) -> str | None:
    """The token a session file holds now (``None`` when it is gone or unreadable)."""
    try:
        current = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    token = current.get("token") if isinstance(current, dict) else None
    return token if isinstance(token, str) else None


def read_session(config_path: Path | str) -> Session | None:
    """The recorded session for ``config_path``; a garbled file is removed and counts as none."""
    target = session_path(config_path)
    if _private_folder(target.parent) is not None:
        return None  # missing, or not this user's own: nothing in it is trusted
    try:
        # Not through a link, and only a file of this user's that nobody else can write or read.
        descriptor = os.open(target, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    with os.fdopen(descriptor, encoding="utf-8") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode) or not _owned_privately(info):
            return None
        try:
            text = handle.read()
        except (OSError, ValueError):
            return None
    try:
        document = json.loads(text)
        session = Session(
            config_path=str(document["config_path"]),
            port=int(document["port"]),
            token=str(document["token"]),
            pid=int(document["pid"]),
            started_at=str(document["started_at"]),
            file=target,
            lane=_text_or_none(document.get("lane")),
            environment=_text_or_none(document.get("environment")),
            lane_name=_text_or_none(document.get("lane_name")),
        )
    except (ValueError, KeyError, TypeError):
        with contextlib.suppress(OSError):
            target.unlink()
        return None
    if session.config_path != _resolved(config_path) or not 0 < session.port < 65536:
        return None
    return session


def _text_or_none(value: object) -> str | None:
    return value if isinstance(value, str) else None


def discard_session(session: Session) -> None:
    """Remove ``session``'s file unless a newer ``runlane dev`` has replaced it since it was read."""
    recorded = _recorded_token(session.file)
    if recorded is not None and recorded != session.token:
        return
    with contextlib.suppress(OSError):
        session.file.unlink()


def live_dev_pid(config_path: Path | str) -> int | None:
    """The pid of the live ``runlane dev`` whose session serves ``config_path``, if there is one."""
    session = read_session(config_path)
    return session.pid if session is not None and pid_alive(session.pid) else None


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    return True


# -- server ----------------------------------------------------------------------------------------


class _Reject(Exception):
    def __init__(self, status: int, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


class _CallerGone(Exception):
    """The caller of a command closed its connection before the answer: there is no one to answer."""


async def _caller_gone(reader: asyncio.StreamReader) -> None:
    """Return once the caller has closed its connection (a caller sends nothing after its request)."""
    with contextlib.suppress(ConnectionError, OSError):
        while await reader.read(1024):
            pass


class BridgeServer:
    """The loopback control server of one ``runlane dev`` process over its started runtime."""

    def __init__(
        self,
        runtime: Any,
        config_path: Path | str,
        *,
        output: Output | None = None,
        lane: str | None = None,
        stopping: asyncio.Event | None = None,
    ) -> None:
        self.runtime = runtime
        self.config_path = config_path
        self.lane = lane
        # Set once the dev process is stopping: it still answers (a runs list, a cancel of a run that
        # holds the stop up), but creates no run, as one created then would end with it, unrun.
        self.stopping = stopping
        self.token = secrets.token_urlsafe(32)
        self.output = output
        self.session: Session | None = None
        self.superseded: Session | None = None  # a live dev of the same config this one took over from
        self._server: asyncio.Server | None = None
        # Set when the dev process stops: a command still running for another terminal (a runs wait) is
        # answered that the process stopped, instead of being cut off.
        self._closing = asyncio.Event()
        self._answering: set[asyncio.Task[Any]] = set()

    @property
    def port(self) -> int:
        assert self._server is not None, "the bridge is not started"
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> Session:
        self._server = await asyncio.start_server(self._handle, host="127.0.0.1", port=0, limit=MAX_HEADER_BYTES)
        previous = read_session(self.config_path)
        if previous is not None and previous.pid != os.getpid() and pid_alive(previous.pid):
            self.superseded = previous  # the latest dev wins; that one serves again once this one stops
        self.session = write_session(
            self.config_path,
            port=self.port,
            token=self.token,
            lane=self.lane,
            environment=self.runtime.environment.name,
            lane_name=self.runtime.lane.name,
        )
        return self.session

    def hand_back(self) -> None:
        """Give up the session file (to the dev this one superseded, if it still runs)."""
        if self.session is not None:
            hand_back_session(self.session, self.superseded)
            self.session = None

    async def close(self) -> None:
        self.hand_back()
        if self._server is not None:
            self._server.close()
            self._closing.set()
            if self._answering:
                await asyncio.wait(self._answering, timeout=5)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), timeout=5)
            self._server = None

    async def __aenter__(self) -> BridgeServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handler = asyncio.current_task()
        if handler is not None:  # ``close()`` lets the answers in progress be written
            self._answering.add(handler)
            handler.add_done_callback(self._answering.discard)
        try:
            try:
                request = await asyncio.wait_for(self._read_unless_closing(reader), timeout=READ_TIMEOUT_S)
                status, body = 200, await self._execute_unless_closing(request, reader)
            except _Reject as reject:
                status, body = reject.status, {"error": {"code": reject.code.value, "message": reject.message}}
            except TimeoutError:
                status, body = 408, _error_body(ErrorCode.CONFIGURATION_INVALID, "The request was not received in time.")
            except _CallerGone:
                return
            except Exception as error:  # noqa: BLE001 - one broken request must not end the dev process
                status, body = 500, _error_body(ErrorCode.INTERNAL_ERROR, f"{type(error).__name__}: {error}")
            payload = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
            head = (
                f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
                "Content-Type: application/json\r\n"
                f"Content-Length: {len(payload)}\r\n"
                "Connection: close\r\n\r\n"
            )
            writer.write(head.encode("ascii") + payload)
            await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _read_unless_closing(self, reader: asyncio.StreamReader) -> dict[str, Any]:
        """``_read_request``, or, when the dev process stops first, a refusal: a client that has not sent
        its request (one that sends nothing at all) must not hold up the stop, as a command it could
        still run would not be run anyway."""
        reading = asyncio.ensure_future(self._read_request(reader))
        closing = asyncio.ensure_future(self._closing.wait())
        read = False
        try:
            await asyncio.wait({reading, closing}, return_when=asyncio.FIRST_COMPLETED)
            read = reading.done()
        finally:
            closing.cancel()
            if not reading.done():
                reading.cancel()
        if read:
            return reading.result()
        raise _Reject(503, ErrorCode.STORAGE_UNAVAILABLE, "runlane dev is stopping; the request was not run.")

    async def _execute_unless_closing(self, request: dict[str, Any], reader: asyncio.StreamReader) -> dict[str, Any]:
        """``_execute``, or, when the dev process stops first, an answer that says so.

        A command that may take long by design (``runs wait``) is also stopped when its caller goes away
        (interrupted, or its own ``timeout`` ran out), as it would stop in the caller's own process: it is
        not left waiting in this one for an answer nobody reads."""
        task = asyncio.ensure_future(self._execute(request))
        closing = asyncio.ensure_future(self._closing.wait())
        watched = {task, closing}
        if OPERATIONS[request["command"]].answer_within is not None:
            watched.add(asyncio.ensure_future(_caller_gone(reader)))
        try:
            await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
            stopping = closing.done()
        finally:
            for waiter in watched - {task}:
                waiter.cancel()
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        if not stopping:
            raise _CallerGone
        return _error_body(
            ErrorCode.TRANSPORT_UNAVAILABLE,
            f"runlane dev (pid {os.getpid()}) stopped before the {request.get('command')} command finished.",
        )

    async def _read_request(self, reader: asyncio.StreamReader) -> dict[str, Any]:
        try:
            request_line = (await reader.readuntil(b"\r\n")).decode("latin-1").rstrip("\r\n")
            headers: dict[str, str] = {}
            total = len(request_line)
            while True:
                line = (await reader.readuntil(b"\r\n")).decode("latin-1").rstrip("\r\n")
                if not line:
                    break
                total += len(line)
                if total > MAX_HEADER_BYTES or len(headers) >= MAX_HEADERS:
                    raise _Reject(431, ErrorCode.CONFIGURATION_INVALID, "Request headers are too large.")
                name, sep, value = line.partition(":")
                if not sep:
                    raise _Reject(400, ErrorCode.CONFIGURATION_INVALID, "Malformed request header.")
                headers[name.strip().lower()] = value.strip()
        except asyncio.LimitOverrunError:
            raise _Reject(431, ErrorCode.CONFIGURATION_INVALID, "Request headers are too large.") from None
        except asyncio.IncompleteReadError:
            raise _Reject(400, ErrorCode.CONFIGURATION_INVALID, "Incomplete request.") from None
        parts = request_line.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            raise _Reject(400, ErrorCode.CONFIGURATION_INVALID, "Malformed request line.")
        method, target, _ = parts
        if target != COMMAND_PATH:
            raise _Reject(404, ErrorCode.CONFIGURATION_INVALID, f"The dev bridge serves only POST {COMMAND_PATH}.")
        if method != "POST":
            raise _Reject(405, ErrorCode.CONFIGURATION_INVALID, f"The dev bridge serves only POST {COMMAND_PATH}.")
        scheme, _, presented = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            presented.strip().encode("utf-8"), self.token.encode("utf-8")
        ):
            raise _Reject(401, ErrorCode.CONFIGURATION_INVALID, "Missing or wrong dev bridge token.")
        if "transfer-encoding" in headers:
            raise _Reject(400, ErrorCode.CONFIGURATION_INVALID, "Chunked requests are not accepted.")
        length_text = headers.get("content-length")
        if length_text is None:
            raise _Reject(411, ErrorCode.CONFIGURATION_INVALID, "Content-Length is required.")
        if not length_text.isdigit():
            raise _Reject(400, ErrorCode.CONFIGURATION_INVALID, "Content-Length is not a number.")
        length = int(length_text)
        if length > MAX_REQUEST_BYTES:
            raise _Reject(413, ErrorCode.CONFIGURATION_INVALID, f"The request exceeds {MAX_REQUEST_BYTES} bytes.")
        try:
            raw = await reader.readexactly(length)
        except asyncio.IncompleteReadError:
            raise _Reject(400, ErrorCode.CONFIGURATION_INVALID, "Incomplete request body.") from None
        try:
            document = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):  # RecursionError: nested too deeply
            raise _Reject(400, ErrorCode.CONFIGURATION_INVALID, "The request body is not JSON.") from None
        return _validate_request(document)

    async def _execute(self, request: dict[str, Any]) -> dict[str, Any]:
        op = OPERATIONS[request["command"]]
        log = self.output if self.output is not None and not request.get("quiet", False) else None
        try:
            params = parse_params(op, request["params"])
        except RunlaneError as error:
            if log is not None:
                log.command_record(op.name, error=error)
            raise _Reject(400, error.code, error.message) from None
        shape = request["output"]
        stdout, stderr = io.StringIO(), io.StringIO()
        output = Output(
            json_mode=shape["json"], stdout=stdout, stderr=stderr, width=shape["width"], color=shape["color"] or None
        )
        try:
            if op.creates_runs and self.stopping is not None and self.stopping.is_set():
                raise RunlaneError(
                    ErrorCode.STORAGE_UNAVAILABLE,
                    f"runlane dev (pid {os.getpid()}) is stopping, and the runs of its in-memory lane end with it: "
                    f"the {op.name} command was not run. Run it again once runlane dev runs again.",
                    retryable=True,
                )
            result = await op.call(self.runtime, params)
        except RunlaneError as error:
            if log is not None:
                log.command_record(op.name, error=error)
            return {"error": error.to_json()}
        op.render(output, params, result)
        if log is not None:
            log.command_record(op.name, summary=op.summary(params, result))
        answer: dict[str, Any] = {"stdout": stdout.getvalue(), "stderr": stderr.getvalue()}
        status = op.exit_status(params, result)
        if status:
            answer["exit"] = status
        return answer


async def render_operation(
    runtime: Any,
    op: Operation,
    params: OperationParams,
    *,
    json_mode: bool = True,
    width: int | None = None,
    color: bool | None = None,
) -> tuple[str, str]:
    """Run ``op`` on ``runtime`` and return what it renders (stdout, stderr); its ``RunlaneError`` propagates."""
    stdout, stderr = io.StringIO(), io.StringIO()
    output = Output(json_mode=json_mode, stdout=stdout, stderr=stderr, width=width, color=color)
    result = await op.call(runtime, params)
    op.render(output, params, result)
    return stdout.getvalue(), stderr.getvalue()


def _error_body(code: ErrorCode, message: str) -> dict[str, Any]:
    return {"error": {"code": code.value, "message": message}}


_REQUEST_KEYS = {"command", "params", "output", "quiet"}


def _validate_request(document: Any) -> dict[str, Any]:
    def bad(message: str) -> _Reject:
        return _Reject(400, ErrorCode.CONFIGURATION_INVALID, message)

    if not isinstance(document, dict) or not {"command", "params", "output"} <= set(document) <= _REQUEST_KEYS:
        raise bad('The request must be an object with "command", "params" and "output", and optionally "quiet".')
    if not isinstance(document.get("quiet", False), bool):
        raise bad('"quiet" must be a boolean.')
    command = document["command"]
    if not isinstance(command, str) or command not in OPERATIONS:
        raise bad(f"Unknown command {command!r}; the dev bridge serves: {', '.join(sorted(OPERATIONS))}.")
    if not isinstance(document["params"], dict):
        raise bad('"params" must be an object.')
    shape = document["output"]
    if not isinstance(shape, dict) or set(shape) != {"json", "width", "color"}:
        raise bad('"output" must be an object with exactly "json", "width" and "color".')
    width = shape["width"]
    if not isinstance(shape["json"], bool) or not isinstance(shape["color"], bool):
        raise bad('"output.json" and "output.color" must be booleans.')
    if width is not None and (isinstance(width, bool) or not isinstance(width, int) or not 20 <= width <= 10_000):
        raise bad('"output.width" must be null or an integer from 20 to 10000.')
    return document


# -- client ----------------------------------------------------------------------------------------


class _Stale(Exception):
    """The session did not answer as a live bridge: ignore and remove it."""


async def _post(
    session: Session, body: bytes, output: Output, *, token: str | None = None, answer_within: float | None = None
) -> tuple[int, Any]:
    """POST ``body`` to the session's bridge; its answer must come within ``answer_within`` seconds
    (default ``RESPONSE_TIMEOUT_S``; ``math.inf``: no limit)."""
    limit = RESPONSE_TIMEOUT_S if answer_within is None else answer_within
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection("127.0.0.1", session.port), timeout=CONNECT_TIMEOUT_S
        )
    except (OSError, TimeoutError) as error:
        raise _Stale(str(error)) from None
    try:
        head = (
            f"POST {COMMAND_PATH} HTTP/1.1\r\n"
            f"Host: 127.0.0.1:{session.port}\r\n"
            f"Authorization: Bearer {session.token if token is None else token}\r\n"
            "Content-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n"
        )
        writer.write(head.encode("ascii") + body)
        await writer.drain()
        note = None
        if limit == RESPONSE_TIMEOUT_S:  # a command that takes long by design needs no note
            note = asyncio.get_running_loop().call_later(SLOW_ANSWER_NOTE_S, _say_waiting, session, output)
        try:
            raw = await asyncio.wait_for(reader.read(), timeout=None if limit == math.inf else limit)
        finally:
            if note is not None:
                note.cancel()
    except TimeoutError:
        raise RunlaneError(
            ErrorCode.TRANSPORT_UNAVAILABLE, f"The runlane dev process (pid {session.pid}) did not answer in time."
        ) from None
    except (ConnectionError, OSError) as error:
        raise RunlaneError(
            ErrorCode.TRANSPORT_UNAVAILABLE, f"The runlane dev process (pid {session.pid}) dropped the request: {error}."
        ) from None
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()
    head_bytes, sep, payload = raw.partition(b"\r\n\r\n")
    status_line = head_bytes.split(b"\r\n", 1)[0].decode("latin-1")
    parts = status_line.split(" ", 2)
    if not sep or len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise _Stale("not a runlane dev bridge response")
    try:
        document = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise _Stale("not a runlane dev bridge response") from None
    return int(parts[1]), document


def _say_waiting(session: Session, output: Output) -> None:
    output.warning(
        "dev_busy",
        f"waiting for runlane dev (pid {session.pid}) to answer; it has been busy for "
        f"{SLOW_ANSWER_NOTE_S:g}s. A handler blocking its event loop (time.sleep or blocking I/O in an "
        f"async def) holds every command up; gives up after {RESPONSE_TIMEOUT_S:g}s.",
    )


def _request_body(op: Operation, params: OperationParams, output: Output, *, quiet: bool = False) -> bytes:
    width, color = output.terminal()
    document: dict[str, Any] = {
        "command": op.name,
        "params": to_json_value(params.model_dump(mode="json", exclude_unset=False)),
        "output": {"json": output.json, "width": width, "color": color},
    }
    if quiet:
        document["quiet"] = True
    return json.dumps(document, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def _ignore_stale(session: Session, why: str, output: Output) -> None:
    """Remove a dead session file and say so once on stderr (the command then runs on its own)."""
    discard_session(session)
    output.warning(
        "dev_session_stale", f"ignored a stale runlane dev session ({why}); running this command on its own runtime."
    )


def serves(session: Session, lane: str, output: Output) -> bool:
    """Whether ``session``'s dev serves a configuration whose ``lane_signature`` is ``lane``; when it was
    started with another lane, say so (the command then runs on its own runtime)."""
    if session.lane is None or session.lane == lane:
        return True
    output.warning(
        "dev_config_changed",
        f"runlane dev (pid {session.pid}) serves {session.config_path} as it read it when it started; the "
        "file now names another lane, runtime or environment (its ${VAR}s read from this command's "
        "environment), so this command runs on its own runtime. Restart runlane dev to serve the new one.",
    )
    return False


async def proxy(
    config_path: Path | str, op: Operation, params: OperationParams, output: Output, *, lane: str | None = None
) -> int | None:
    """Run ``op`` in the live ``runlane dev`` session for ``config_path`` and print its result.

    Returns the status the command exits with, or ``None`` (after removing a stale session file) when
    there is no live session, or when the session was started with another lane than ``lane``
    (``lane_signature`` of the configuration as it is now: its runs live elsewhere), so the caller runs
    the command on its own runtime. A command error raised inside the dev process is raised here as the
    same ``RunlaneError``.
    """
    session = read_session(config_path)
    if session is None:
        return None
    if not pid_alive(session.pid):
        _ignore_stale(session, f"its process {session.pid} is not running", output)
        return None
    if lane is not None and not serves(session, lane, output):
        return None
    try:
        rendered = await exchange(session, op, params, output)
    except RunlaneError as error:
        if error.code is not ErrorCode.TASK_NOT_FOUND:
            raise
        # The task catalog is the one the dev process imported when it started, not the files as they are.
        raise RunlaneError(
            error.code,
            f"{error.message} runlane dev (pid {session.pid}) ran this command with the task modules it "
            "imported when it started: restart it if you have added or renamed the task since "
            "(runlane dev --reload restarts on every change).",
            retryable=error.retryable,
            meta=error.meta,
        ) from None
    if rendered is None:
        return None
    output.write_rendered(rendered.stdout, rendered.stderr)
    return rendered.exit_status


@dataclass(frozen=True, slots=True)
class Rendered:
    """What a command run in the dev process printed for its caller, and the status it exits with."""

    stdout: str
    stderr: str
    exit_status: int = 0


async def exchange(
    session: Session, op: Operation, params: OperationParams, output: Output, *, quiet: bool = False
) -> Rendered | None:
    """Run ``op`` in the dev process of ``session``, rendered for ``output``, or ``None`` (after removing
    the session file) when the session turned out to be stale. A command error raised in the dev process
    is raised here as the same ``RunlaneError``. A ``quiet`` command is not printed in the dev process's
    output (for reads a client repeats on a timer)."""
    answer_within = None
    if op.answer_within is not None:
        answer_within = op.answer_within(params)
        answer_within = math.inf if answer_within is None else answer_within
    body = _request_body(op, params, output, quiet=quiet)
    if len(body) > MAX_REQUEST_BYTES:  # refused unread by the dev process: say why here
        raise RunlaneError(
            ErrorCode.VALIDATION_FAILED,
            f"The {op.name} command is {len(body):,} bytes with its arguments, and runlane dev takes at most "
            f"{MAX_REQUEST_BYTES:,} (1 MiB) per command; a run must fit its lane's max_record_bytes (400 KiB by "
            "default) anyway. Store large data elsewhere and pass a reference to it.",
            meta={"bytes": len(body), "max_bytes": MAX_REQUEST_BYTES},
        )
    try:
        status, document = await _post(session, body, output, answer_within=answer_within)
    except _Stale:
        _ignore_stale(session, "it did not answer as a runlane dev bridge", output)
        return None
    if status == 401:
        _ignore_stale(session, "it rejected the recorded token", output)
        return None
    error = document.get("error") if isinstance(document, dict) else None
    if status == 200 and isinstance(document, dict) and error is None:
        exit_status = document.get("exit", 0)
        if isinstance(exit_status, bool) or not isinstance(exit_status, int) or not 0 <= exit_status <= 125:
            raise RunlaneError(
                ErrorCode.INTERNAL_ERROR, "The runlane dev process answered with an invalid exit status."
            )
        return Rendered(str(document.get("stdout", "")), str(document.get("stderr", "")), exit_status)
    if isinstance(error, dict):
        code_value: Any = error.get("code")  # any JSON value: one that is no error code is an internal error
        try:
            code = ErrorCode(code_value)
        except ValueError:
            code = ErrorCode.INTERNAL_ERROR
        raise RunlaneError(
            code,
            str(error.get("message") or "The runlane dev process rejected the request."),
            retryable=bool(error.get("retryable", False)),
            meta=error.get("meta") if isinstance(error.get("meta"), dict) else None,
        )
    raise RunlaneError(ErrorCode.INTERNAL_ERROR, f"The runlane dev process answered HTTP {status}.")
