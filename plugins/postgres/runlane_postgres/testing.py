"""A throwaway PostgreSQL server for tests and benchmarks.

``PostgresTestServer`` runs ``initdb`` into a fresh temporary directory and starts a private
``postgres`` on ``127.0.0.1`` and a free ephemeral port, with its unix socket, data directory and
log file all inside that temporary directory. Everything is removed again by ``stop()``::

    with PostgresTestServer() as server:
        connect(server.url)          # postgresql://postgres:PASSWORD@127.0.0.1:PORT/runlane_test
        server.restart()             # same data directory and port
        url = server.create_database("isolated")

Durability settings (``fsync``, ``synchronous_commit``, ``full_page_writes``) keep PostgreSQL's
defaults, so tests exercise the same commit path as production; pass ``settings`` to change them.

Every wait is bounded: ``initdb``, startup, ``pg_ctl stop`` and the kill fallback all have
timeouts, and a failed startup raises ``RuntimeError`` with the tail of the server log.

No server outlives the process that started it. ``stop()`` is registered with ``atexit``, and each
running server also has a small watchdog process holding one end of a pipe: if the owning process
dies without stopping the server (``SIGKILL``, ``os._exit``, a fatal signal), the pipe closes and
the watchdog shuts the server down and removes the temporary directory.

Only the standard library is needed to start and stop a server; ``create_database`` and
``drop_database`` use psycopg, a dependency of this distribution.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, LiteralString

__all__ = [
    "DEFAULT_DATABASE",
    "MINIMUM_MAJOR_VERSION",
    "PostgresBinaries",
    "PostgresTestServer",
    "find_postgres_binaries",
    "postgres_test_url",
]

TEST_DATABASE_URL_ENV = "RUNLANE_POSTGRES_TEST_DATABASE_URL"
BIN_DIR_ENV = "RUNLANE_POSTGRES_BIN"
DEFAULT_DATABASE = "runlane_test"
MINIMUM_MAJOR_VERSION = 15
DEBIAN_BIN_DIR = "/usr/lib/postgresql/15/bin"
INSTALL_HINT = (
    "install PostgreSQL 15 server binaries (Debian/Ubuntu: `apt-get install postgresql-15`), "
    f"or set {BIN_DIR_ENV} to a directory containing initdb, pg_ctl and postgres, "
    f"or set {TEST_DATABASE_URL_ENV} to use an existing database"
)

HOST = "127.0.0.1"
# Settings every test server gets; caller ``settings`` are written after these and win.
BASE_SETTINGS: dict[str, str] = {
    "max_connections": "200",
    "shared_buffers": "128MB",
    "logging_collector": "off",
}
# The longest unix socket path (sun_path holds 108 bytes); longer temp paths fall back to /tmp.
_MAX_SOCKET_PATH = 100
_SOCKET_NAME_LENGTH = len("/.s.PGSQL.65535.lock")
_POLL_SECONDS = 0.05
_KILL_GRACE_SECONDS = 5.0
_LOG_TAIL_LINES = 40
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
# The only variables of the caller's environment the server programs get (the rest may hold secrets,
# and the server's user can read its processes' environments). PATH lets initdb find postgres; the
# library paths keep builds outside the system's library directories (RUNLANE_POSTGRES_BIN) working.
_INHERITED_ENVIRONMENT = ("PATH", "TZ", "LD_LIBRARY_PATH", "DYLD_LIBRARY_PATH")
_DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"
# Files under the temporary directory are opened without following a symbolic link in their last
# component (each directory on the way is opened the same way), and without blocking on a FIFO.
_NO_FOLLOW = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC

ShutdownMode = Literal["smart", "fast", "immediate"]


def postgres_test_url() -> str | None:
    """The database URL from ``RUNLANE_POSTGRES_TEST_DATABASE_URL``, or ``None`` when unset or empty."""
    return os.environ.get(TEST_DATABASE_URL_ENV) or None


@dataclass(frozen=True)
class PostgresBinaries:
    initdb: Path
    pg_ctl: Path
    postgres: Path
    version: str
    major: int


_PROGRAMS = ("initdb", "pg_ctl", "postgres")


def _in_directory(directory: Path) -> dict[str, Path] | None:
    found = {}
    for name in _PROGRAMS:
        candidate = directory / name
        if not (candidate.is_file() and os.access(candidate, os.X_OK)):
            return None
        found[name] = candidate
    return found


def _on_path() -> dict[str, Path] | None:
    found = {}
    for name in _PROGRAMS:
        located = shutil.which(name)
        if located is None:
            return None
        found[name] = Path(located)
    return found


def _pg_config_bindir() -> Path | None:
    pg_config = shutil.which("pg_config")
    if pg_config is None:
        return None
    try:
        completed = subprocess.run(
            [pg_config, "--bindir"], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    output = completed.stdout.strip()
    return Path(output) if completed.returncode == 0 and output else None


def _server_version(postgres: Path) -> tuple[str, int] | None:
    """``("15.6", 15)`` from ``postgres --version`` (allowed as root), or ``None`` if unusable."""
    try:
        completed = subprocess.run(
            [str(postgres), "--version"], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"\(PostgreSQL\)\s+(\d+)(\S*)", completed.stdout)
    if completed.returncode != 0 or match is None:
        return None
    return match.group(1) + match.group(2), int(match.group(1))


def find_postgres_binaries(bin_dir: str | os.PathLike[str] | None = None) -> PostgresBinaries:
    """Locate ``initdb``, ``pg_ctl`` and ``postgres`` of PostgreSQL 15 or newer.

    Search order: ``bin_dir`` (or ``$RUNLANE_POSTGRES_BIN``), which must hold all three; then
    ``pg_config --bindir``; then ``/usr/lib/postgresql/15/bin``; then ``PATH``. Candidates older
    than PostgreSQL 15 are skipped. Raises ``RuntimeError`` naming what to install.
    """
    explicit = bin_dir if bin_dir is not None else os.environ.get(BIN_DIR_ENV) or None
    rejected: list[str] = []
    if explicit is not None:
        candidates: list[tuple[str, dict[str, Path] | None]] = [(str(explicit), _in_directory(Path(explicit)))]
    else:
        candidates = []
        bindir = _pg_config_bindir()
        if bindir is not None:
            candidates.append((f"pg_config --bindir ({bindir})", _in_directory(bindir)))
        candidates.append((DEBIAN_BIN_DIR, _in_directory(Path(DEBIAN_BIN_DIR))))
        candidates.append(("PATH", _on_path()))
    for label, programs in candidates:
        if programs is None:
            rejected.append(f"{label}: initdb, pg_ctl or postgres missing")
            continue
        version = _server_version(programs["postgres"])
        if version is None:
            rejected.append(f"{label}: `{programs['postgres']} --version` failed")
            continue
        if version[1] < MINIMUM_MAJOR_VERSION:
            rejected.append(f"{label}: PostgreSQL {version[0]} is older than {MINIMUM_MAJOR_VERSION}")
            continue
        return PostgresBinaries(**programs, version=version[0], major=version[1])
    raise RuntimeError(
        f"PostgreSQL {MINIMUM_MAJOR_VERSION} server binaries not found ({'; '.join(rejected)}): {INSTALL_HINT}."
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((HOST, 0))
        return int(probe.getsockname()[1])


def _conf_value(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "''") + "'"


def _sql(template: LiteralString, identifier: str) -> Any:
    from psycopg import sql

    return sql.SQL(template).format(sql.Identifier(identifier))


def _child_pids(parent: int) -> list[int]:
    """Direct children of ``parent`` (the postmaster's backends and auxiliaries); Linux only."""
    children = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8", errors="replace") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent:
            children.append(int(entry))
    return children


def _signal(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signum)


def _refused(path: Path, why: str) -> RuntimeError:
    return RuntimeError(
        f"refusing to use {path}: {why}; something other than this PostgreSQL test server changed its "
        "temporary directory (the server's user owns it), so stop() this server and start a new one"
    )


def _traversable(path: Path, uid: int, gid: int) -> bool:
    """Whether a process running as ``uid``/``gid`` can reach into ``path`` (``x`` on every ancestor)."""
    for directory in [path, *path.parents]:
        try:
            info = directory.stat()
        except OSError:
            return False
        if info.st_uid == uid:
            allowed = info.st_mode & 0o100
        elif info.st_gid == gid:
            allowed = info.st_mode & 0o010
        else:
            allowed = info.st_mode & 0o001
        if not allowed:
            return False
    return True


# Runs as ``python -c WATCHDOG pid base_dir``; blocks on stdin until the owner writes "stopped"
# (orderly stop: nothing to do) or the pipe closes because the owner died (stop the server).
_WATCHDOG = r"""
import os, shutil, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
pid, base = int(sys.argv[1]), sys.argv[2]
if sys.stdin.buffer.read().strip() == b"stopped":
    sys.exit(0)
def alive(p):
    try:
        with open("/proc/%d/stat" % p) as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        pass
    try:
        os.kill(p, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True
def children(p):
    found = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        try:
            with open("/proc/%s/stat" % entry) as f:
                if entry.isdigit() and int(f.read().rsplit(")", 1)[1].split()[1]) == p:
                    found.append(int(entry))
        except (OSError, ValueError, IndexError):
            pass
    return found
def kill(p, s):
    try:
        os.kill(p, s)
    except (ProcessLookupError, PermissionError):
        pass
if alive(pid):
    family = children(pid)
    kill(pid, signal.SIGQUIT)
    deadline = time.monotonic() + 5
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    for p in [pid, *family, *children(pid)]:
        kill(p, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
shutil.rmtree(base, ignore_errors=True)
"""


class PostgresTestServer:
    """A private, throwaway PostgreSQL (15+) server; a sync context manager.

    ``start()`` creates a temporary directory, runs ``initdb`` (UTF8, C
    locale, ``--no-sync`` since the cluster is disposable) and starts ``postgres`` listening only on
    ``127.0.0.1`` at a free ephemeral port, with its unix socket in the temporary directory and its
    log in ``log_path``. It waits (at most ``startup_timeout`` seconds) until the server accepts
    connections and then creates the database ``runlane_test``. ``url`` and ``admin_url`` (the
    ``postgres`` database) connect as the superuser ``user`` with ``password``, a random one: the server
    trusts connections on its unix socket (in the private temporary directory) and asks for a password
    (SCRAM) over TCP, where every local user can connect.

    ``stop_server()`` / ``start_server()`` stop and start the same cluster on the same port (to keep
    the database down for a while); ``restart()`` does both. ``stop()`` stops the server and
    removes the temporary directory; it is safe to call twice and also runs at interpreter exit.

    Running as root: PostgreSQL refuses to run as root, so when ``os.geteuid() == 0`` the server
    programs (``initdb``, ``postgres``, ``pg_ctl``) run as an existing unprivileged system user:
    ``run_as`` if given, else ``postgres`` if that user exists, else ``nobody``. The switch uses
    ``subprocess.Popen(user=..., group=..., extra_groups=[])``, i.e. the child drops to that user's
    uid and primary gid before ``exec`` (no ``su``/``setpriv``/``sudo`` needed, nothing runs in a
    ``preexec_fn``). The temporary directory is ``chown``-ed to that user, and it is created under
    ``tempfile.gettempdir()`` only if that user can traverse it, else under ``/tmp``. The calling
    process (root) keeps reading the log and removing the directory itself.

    That user owns the temporary directory, and anyone who can connect is the database superuser and
    can run commands as that user (``COPY ... FROM PROGRAM``), so root trusts nothing in it: the files
    it writes or reads there (settings, the log, ``postmaster.pid``) are opened without following
    symbolic links and must be regular files of that user without other hard links, else
    ``RuntimeError``; new ones are created exclusively, ``0600``, and given to that user through their
    descriptor. The server programs get a minimal environment (``PATH``, ``TZ``, library paths,
    ``LC_ALL=C``, ``HOME`` set to the temporary directory, ``USER``/``LOGNAME``), not the caller's.
    """

    def __init__(
        self,
        *,
        settings: Mapping[str, str] | None = None,
        user: str = "postgres",
        database: str = DEFAULT_DATABASE,
        bin_dir: str | os.PathLike[str] | None = None,
        run_as: str | None = None,
        startup_timeout: float = 30.0,
        stop_timeout: float = 30.0,
        initdb_timeout: float = 120.0,
    ) -> None:
        for name in (user, database):
            if not _IDENTIFIER.match(name):
                raise ValueError(f"not a plain SQL identifier: {name!r}")
        self.settings = {str(key): str(value) for key, value in (settings or {}).items()}
        self.user = user
        # The superuser's password over TCP: a local user who finds the port is not let in as superuser
        # (who could run commands as the server's user with COPY ... FROM PROGRAM).
        self.password = secrets.token_urlsafe(24)
        self.database = database
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.initdb_timeout = initdb_timeout
        self._bin_dir = bin_dir
        self._run_as = run_as
        self._lock = threading.RLock()
        self._binaries: PostgresBinaries | None = None
        self._base_dir: Path | None = None
        self._port: int | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._watchdog: subprocess.Popen[bytes] | None = None
        self._credentials: tuple[int, int, str] | None = None  # uid, gid, name when dropping root
        self._atexit_registered = False
        self.startup_seconds: float | None = None  # initdb + first start + database creation

    # -- context manager -------------------------------------------------------------------------

    def __enter__(self) -> PostgresTestServer:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else ("stopped" if self._base_dir else "not started")
        return f"<PostgresTestServer {state} port={self._port} dir={self._base_dir}>"

    # -- properties ------------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("the PostgreSQL test server has not been started")
        return self._port

    @property
    def host(self) -> str:
        return HOST

    @property
    def pid(self) -> int | None:
        """The postmaster's process id while the server runs."""
        return self._process.pid if self.running and self._process is not None else None

    @property
    def base_dir(self) -> Path:
        if self._base_dir is None:
            raise RuntimeError("the PostgreSQL test server has not been started")
        return self._base_dir

    @property
    def data_dir(self) -> Path:
        return self.base_dir / "data"

    @property
    def socket_dir(self) -> Path:
        return self.base_dir

    @property
    def log_path(self) -> Path:
        return self.base_dir / "postgres.log"

    @property
    def binaries(self) -> PostgresBinaries:
        if self._binaries is None:
            self._binaries = find_postgres_binaries(self._bin_dir)
        return self._binaries

    @property
    def os_user(self) -> str:
        """The operating-system user the server processes run as."""
        if self._credentials is not None:
            return self._credentials[2]
        try:
            return pwd.getpwuid(os.geteuid()).pw_name
        except KeyError:
            return str(os.geteuid())

    @property
    def url(self) -> str:
        """``postgresql://USER:PASSWORD@127.0.0.1:PORT/runlane_test``."""
        return self.url_for(self.database)

    @property
    def admin_url(self) -> str:
        """The URL of the ``postgres`` maintenance database."""
        return self.url_for("postgres")

    def url_for(self, database: str) -> str:
        return f"postgresql://{self.user}:{self.password}@{HOST}:{self.port}/{database}"

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> PostgresTestServer:
        """Create a fresh cluster, start it and create the test database. No-op when running."""
        with self._lock:
            if self._base_dir is not None:
                if not self.running:
                    self.start_server()
                return self
            began = time.monotonic()
            binaries = self.binaries
            self._credentials = self._drop_root_credentials()
            self._register_atexit()
            try:
                self._base_dir = self._make_base_dir()
                self._initdb(binaries)
                self._include_settings()
                self._start_on_free_port()
                if self.database != "postgres":
                    self._execute_admin(_sql("CREATE DATABASE {}", self.database))
            except BaseException:
                self.stop()
                raise
            self.startup_seconds = time.monotonic() - began
            return self

    def stop(self) -> None:
        """Stop the server and remove the temporary directory; safe to call any number of times."""
        with self._lock:
            try:
                self.stop_server()
            finally:
                if self._base_dir is not None:
                    shutil.rmtree(self._base_dir, ignore_errors=True)
                    self._base_dir = None
                self._port = None
                self._unregister_atexit()

    def restart(self, mode: ShutdownMode = "fast") -> None:
        """Stop the server (``pg_ctl stop -m mode``) and start it again on the same data and port."""
        with self._lock:
            self.stop_server(mode)
            self.start_server()

    def start_server(self) -> None:
        """Start the already-initialised cluster again (after ``stop_server()``). No-op when running."""
        with self._lock:
            if self._base_dir is None:
                raise RuntimeError("start() the PostgreSQL test server before start_server()")
            if self.running:
                return
            self._launch()
            self._wait_until_ready()

    def stop_server(self, mode: ShutdownMode = "fast") -> None:
        """Stop the server but keep its data directory and port; no-op when not running.

        Runs ``pg_ctl stop -m mode`` bounded by ``stop_timeout``; if the postmaster is still alive
        after that it gets ``SIGQUIT`` (immediate shutdown) and then ``SIGKILL`` with its children.
        """
        with self._lock:
            process = self._process
            if process is None:
                return
            try:
                if process.poll() is None and self._pg_ctl_stop(mode):
                    self._wait_for_exit(process, self.stop_timeout)
                if process.poll() is None:
                    children = _child_pids(process.pid)
                    _signal(process.pid, signal.SIGQUIT)
                    self._wait_for_exit(process, _KILL_GRACE_SECONDS)
                    for pid in [process.pid, *children, *_child_pids(process.pid)]:
                        _signal(pid, signal.SIGKILL)
                    self._wait_for_exit(process, _KILL_GRACE_SECONDS)
            finally:
                self._process = None
                self._release_watchdog()

    # -- databases -------------------------------------------------------------------------------

    def create_database(self, name: str) -> str:
        """Create database ``name`` (a plain identifier) and return its URL."""
        if not _IDENTIFIER.match(name):
            raise ValueError(f"not a plain SQL identifier: {name!r}")
        self._execute_admin(_sql("CREATE DATABASE {}", name))
        return self.url_for(name)

    def drop_database(self, name: str) -> None:
        """Drop database ``name`` if it exists, disconnecting its sessions."""
        if not _IDENTIFIER.match(name):
            raise ValueError(f"not a plain SQL identifier: {name!r}")
        self._execute_admin(_sql("DROP DATABASE IF EXISTS {} WITH (FORCE)", name))

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        """The last ``lines`` lines of the server log ("" when there is none)."""
        try:
            text = self._read_server_file(self.log_path.name)
        except (OSError, RuntimeError):
            return ""
        return "\n".join(text.splitlines()[-lines:])

    # -- internals -------------------------------------------------------------------------------

    def _drop_root_credentials(self) -> tuple[int, int, str] | None:
        if os.geteuid() != 0:
            return None
        names = [self._run_as] if self._run_as else ["postgres", "nobody"]
        for name in names:
            try:
                entry = pwd.getpwnam(name)
            except KeyError:
                continue
            if entry.pw_uid == 0:
                raise RuntimeError(f"cannot run PostgreSQL as {name!r}: it is a root account")
            return entry.pw_uid, entry.pw_gid, entry.pw_name
        raise RuntimeError(
            f"running as root, and none of the users {names} exists to run PostgreSQL as "
            "(PostgreSQL refuses to run as root); create one, e.g. `useradd --system postgres`"
        )

    def _make_base_dir(self) -> Path:
        parent = Path(tempfile.gettempdir())
        credentials = self._credentials
        too_long = len(str(parent)) + len("/runlane-pg-XXXXXXXX") + _SOCKET_NAME_LENGTH > _MAX_SOCKET_PATH
        unreachable = credentials is not None and not _traversable(parent, credentials[0], credentials[1])
        if too_long or unreachable:
            parent = Path("/tmp")
        base = Path(tempfile.mkdtemp(prefix="runlane-pg-", dir=parent))
        if credentials is not None:
            os.chown(base, credentials[0], credentials[1])
            if not _traversable(base, credentials[0], credentials[1]):
                shutil.rmtree(base, ignore_errors=True)
                raise RuntimeError(f"user {credentials[2]!r} cannot reach the temporary directory {base}")
        return base

    def _child_env(self) -> dict[str, str]:
        """The whole environment of ``initdb``, ``postgres`` and ``pg_ctl``: nothing else is passed on."""
        env = {name: os.environ[name] for name in _INHERITED_ENVIRONMENT if os.environ.get(name)}
        env.setdefault("PATH", _DEFAULT_PATH)
        env["LC_ALL"] = "C"
        env["HOME"] = str(self.base_dir)
        env["USER"] = env["LOGNAME"] = self.os_user
        return env

    def _as_server_user(self) -> dict[str, Any]:
        """``Popen`` keyword arguments that run a program as the server's OS user, in ``base_dir``."""
        options: dict[str, Any] = {"cwd": str(self.base_dir), "env": self._child_env(), "stdin": subprocess.DEVNULL}
        if self._credentials is not None:
            options.update(user=self._credentials[0], group=self._credentials[1], extra_groups=[])
        return options

    def _initdb(self, binaries: PostgresBinaries) -> None:
        # Trust on the unix socket, in the private temporary directory; a password over TCP, where any local
        # user can connect.
        with open(self._open_server_file("pwfile", create=True), "w", encoding="utf-8") as pwfile:
            pwfile.write(self.password + "\n")
        command = [
            str(binaries.initdb),
            f"--pgdata={self.data_dir}",
            f"--username={self.user}",
            f"--pwfile={self.base_dir / 'pwfile'}",
            "--auth-local=trust",
            "--auth-host=scram-sha-256",
            "--encoding=UTF8",
            "--locale=C",
            "--no-sync",
        ]
        try:
            completed = subprocess.run(
                command, capture_output=True, timeout=self.initdb_timeout, check=False, **self._as_server_user()
            )
        except subprocess.TimeoutExpired as error:
            raise RuntimeError(f"initdb did not finish within {self.initdb_timeout:g}s") from error
        finally:
            directory = self._open_server_directory("")
            try:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink("pwfile", dir_fd=directory)
            finally:
                os.close(directory)
        if completed.returncode != 0:
            output = (completed.stdout + completed.stderr).decode("utf-8", errors="replace").strip()
            raise RuntimeError(f"initdb failed (exit {completed.returncode}) as {self.os_user!r}:\n{output}")

    def _include_settings(self) -> None:
        descriptor = self._open_server_file("data/postgresql.conf", create=False)
        with open(descriptor, "w", encoding="utf-8") as conf:
            conf.write("\n# Runlane test server settings\ninclude 'runlane_test.conf'\n")

    def _write_settings(self) -> None:
        values = {
            **BASE_SETTINGS,
            "listen_addresses": HOST,
            "port": str(self.port),
            "unix_socket_directories": str(self.socket_dir),
            **self.settings,
        }
        descriptor = self._open_server_file("data/runlane_test.conf", create=True, replace=True)
        with open(descriptor, "w", encoding="utf-8") as conf:
            conf.write("".join(f"{key} = {_conf_value(value)}\n" for key, value in values.items()))

    # Root writes into directories the server's user owns: that user may have put a symbolic or hard
    # link there (it is reachable as the database superuser), so every file is opened by descriptor,
    # relative to a directory descriptor, never following a link, and checked before it is written.

    def _server_owner(self) -> tuple[int, int]:
        if self._credentials is not None:
            return self._credentials[0], self._credentials[1]
        return os.geteuid(), os.getegid()

    def _open_server_directory(self, relative: str) -> int:
        """A descriptor of ``base_dir`` (``relative == ""``) or of a directory below it."""
        path = self.base_dir
        try:
            descriptor = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _NO_FOLLOW)
        except OSError as error:
            raise _refused(path, f"it cannot be opened as a directory ({error.strerror})") from error
        for part in Path(relative).parts:
            path = path / part
            try:
                opened = os.open(part, os.O_RDONLY | os.O_DIRECTORY | _NO_FOLLOW, dir_fd=descriptor)
            except OSError as error:
                raise _refused(path, f"it cannot be opened as a directory ({error.strerror})") from error
            finally:
                os.close(descriptor)
            descriptor = opened
        return descriptor

    def _check_server_file(self, descriptor: int, path: Path) -> None:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode):
            raise _refused(path, "it is not a regular file")
        if info.st_nlink != 1:
            raise _refused(path, "it is a hard link to another file")
        if info.st_uid != self._server_owner()[0]:
            raise _refused(path, f"it belongs to uid {info.st_uid}, not to the server's user {self.os_user!r}")

    def _open_server_file(self, relative: str, *, create: bool, replace: bool = False) -> int:
        """A descriptor for writing ``base_dir/relative``, refusing links.

        ``replace``: a new, empty file replaces any regular file there. Otherwise the file is appended
        to; ``create`` makes it when missing. A new file is ``0600`` and belongs to the server's user.
        """
        path = self.base_dir / relative
        parent, _, name = relative.rpartition("/")
        directory = self._open_server_directory(parent)
        try:
            if replace:
                try:
                    info = os.stat(name, dir_fd=directory, follow_symlinks=False)
                except FileNotFoundError:
                    pass
                else:
                    if stat.S_ISLNK(info.st_mode):
                        raise _refused(path, "it is a symbolic link")
                    if not stat.S_ISREG(info.st_mode):
                        raise _refused(path, "it is not a regular file")
                    os.unlink(name, dir_fd=directory)
            if create or replace:
                try:
                    descriptor = os.open(
                        name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NO_FOLLOW, 0o600, dir_fd=directory
                    )
                except FileExistsError:
                    if replace:
                        raise _refused(path, "a file appeared there while it was being replaced") from None
                else:
                    try:
                        if self._credentials is not None:
                            os.fchown(descriptor, self._credentials[0], self._credentials[1])
                        os.set_blocking(descriptor, True)
                    except BaseException:
                        os.close(descriptor)
                        raise
                    return descriptor
            try:
                descriptor = os.open(name, os.O_WRONLY | os.O_APPEND | _NO_FOLLOW, dir_fd=directory)
            except OSError as error:
                if error.errno == errno.ELOOP:
                    raise _refused(path, "it is a symbolic link") from error
                raise _refused(path, f"it cannot be opened for writing ({error.strerror})") from error
            try:
                self._check_server_file(descriptor, path)
                os.set_blocking(descriptor, True)
            except BaseException:
                os.close(descriptor)
                raise
            return descriptor
        finally:
            os.close(directory)

    def _read_server_file(self, relative: str) -> str:
        """The text of ``base_dir/relative``, refusing links (root must not read other files for that user)."""
        path = self.base_dir / relative
        parent, _, name = relative.rpartition("/")
        directory = self._open_server_directory(parent)
        try:
            descriptor = os.open(name, os.O_RDONLY | _NO_FOLLOW, dir_fd=directory)
        finally:
            os.close(directory)
        with open(descriptor, "rb") as handle:
            self._check_server_file(descriptor, path)
            return handle.read().decode("utf-8", errors="replace")

    def _start_on_free_port(self, attempts: int = 5) -> None:
        for attempt in range(attempts):
            self._port = _free_port()
            self._write_settings()
            try:
                self.start_server()
                return
            except RuntimeError:
                # Another process may have taken the port between probing and binding: retry.
                if attempt + 1 == attempts or "could not bind" not in self.log_tail(20):
                    raise

    def _launch(self) -> None:
        log = self._open_server_file(self.log_path.name, create=True)
        try:
            self._process = subprocess.Popen(
                [str(self.binaries.postgres), "-D", str(self.data_dir)],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                **self._as_server_user(),
            )
        finally:
            os.close(log)
        self._watchdog = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _WATCHDOG, str(self._process.pid), str(self.base_dir)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def _release_watchdog(self) -> None:
        watchdog, self._watchdog = self._watchdog, None
        if watchdog is None:
            return
        try:
            assert watchdog.stdin is not None
            watchdog.stdin.write(b"stopped")
            watchdog.stdin.close()
        except OSError:
            pass
        try:
            watchdog.wait(timeout=_KILL_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            watchdog.kill()
            watchdog.wait(timeout=_KILL_GRACE_SECONDS)

    def _wait_until_ready(self) -> None:
        process = self._process
        assert process is not None
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if process.poll() is not None:
                self._process = None
                self._release_watchdog()
                raise RuntimeError(
                    f"PostgreSQL exited with status {process.returncode} during startup on port {self._port}; "
                    f"last lines of its log:\n{self.log_tail()}"
                )
            if self._pid_file_ready(process.pid) and self._accepts_tcp():
                return
            if time.monotonic() >= deadline:
                self.stop_server("immediate")
                raise RuntimeError(
                    f"PostgreSQL did not accept connections on port {self._port} within "
                    f"{self.startup_timeout:g}s; last lines of its log:\n{self.log_tail()}"
                )
            time.sleep(_POLL_SECONDS)

    def _pid_file_ready(self, pid: int) -> bool:
        # Line 1 holds the postmaster pid, line 8 its status; "ready" once it accepts connections
        # (the same signal ``pg_ctl start -w`` waits for).
        try:
            lines = self._read_server_file("data/postmaster.pid").splitlines()
        except (OSError, RuntimeError):
            return False
        return len(lines) >= 8 and lines[0].strip() == str(pid) and lines[7].strip() == "ready"

    def _accepts_tcp(self) -> bool:
        try:
            with socket.create_connection((HOST, self.port), timeout=1.0):
                return True
        except OSError:
            return False

    def _pg_ctl_stop(self, mode: ShutdownMode) -> bool:
        """``pg_ctl stop -m mode -w``; whether it reported success (else fall back to signals at once)."""
        seconds = max(1, int(self.stop_timeout))
        command = [str(self.binaries.pg_ctl), "stop", "-D", str(self.data_dir), "-m", mode, "-w", "-t", str(seconds)]
        try:
            completed = subprocess.run(
                command, capture_output=True, timeout=seconds + 5, check=False, **self._as_server_user()
            )
        except (OSError, subprocess.TimeoutExpired):
            return False
        return completed.returncode == 0

    @staticmethod
    def _wait_for_exit(process: subprocess.Popen[bytes], timeout: float) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=timeout)

    def _execute_admin(self, statement: Any) -> None:
        import psycopg

        with psycopg.connect(self.admin_url, autocommit=True, connect_timeout=10) as connection:
            connection.execute(statement)

    def _stop_at_exit(self) -> None:
        # Never block interpreter exit: if another (daemon) thread still holds the lock, hand the
        # cleanup to the watchdog by closing its pipe without the "stopped" message.
        if self._lock.acquire(timeout=_KILL_GRACE_SECONDS):
            try:
                self.stop()
            finally:
                self._lock.release()
            return
        watchdog = self._watchdog
        if watchdog is not None and watchdog.stdin is not None:
            with contextlib.suppress(OSError):
                watchdog.stdin.close()

    def _register_atexit(self) -> None:
        if not self._atexit_registered:
            atexit.register(self._stop_at_exit)
            self._atexit_registered = True

    def _unregister_atexit(self) -> None:
        if self._atexit_registered:
            atexit.unregister(self._stop_at_exit)
            self._atexit_registered = False
