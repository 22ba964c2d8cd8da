"""Shared PostgreSQL helpers for the tests; not a test module itself.

Tests get a database URL from ``postgres_server_url()`` (or the session fixture ``postgres_url`` in
``conftest.py``, which calls it). With ``RUNLANE_POSTGRES_TEST_DATABASE_URL`` set that URL is used
as is and no server is started; otherwise the first call starts one throwaway
``PostgresTestServer`` for the whole test session and later calls reuse it.

The session server runs with ``fsync=off``: a commit still waits for its write-ahead log to be written,
as in production, but not for the disk to flush it, which only an operating-system crash would need.
On a slow disk that is minutes of the suite. The benchmarks keep the durable defaults.

The session server is stopped by ``stop_postgres_server()`` (from the fixture's teardown and from
``pytest_sessionfinish``); should neither run, ``PostgresTestServer`` stops it from ``atexit``,
and its watchdog stops it if the test process dies outright.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from runlane_postgres.testing import PostgresTestServer, postgres_test_url

_lock = threading.Lock()
_server: PostgresTestServer | None = None


def postgres_server() -> PostgresTestServer | None:
    """The session's managed server (started on first use), or ``None`` when an external URL is set.

    Tests that need to restart or stop the database take the server from here and skip when it is
    ``None``; the server keeps its data and port across ``restart()``.
    """
    global _server
    if postgres_test_url() is not None:
        return None
    with _lock:
        if _server is None:
            server = PostgresTestServer(settings={"fsync": "off"})
            server.start()
            _server = server
        elif not _server.running:
            _server.start_server()  # a test stopped it with stop_server() and did not restart it
        return _server


def postgres_server_url() -> str:
    """``RUNLANE_POSTGRES_TEST_DATABASE_URL`` if set, else the URL of the session's managed server."""
    external = postgres_test_url()
    if external is not None:
        return external
    server = postgres_server()
    assert server is not None
    return server.url


def stop_postgres_server() -> None:
    """Stop and remove the session's managed server, if one was started; safe to call repeatedly."""
    global _server
    with _lock:
        server, _server = _server, None
    if server is not None:
        server.stop()


def migrated_schema(url: str, prefix: str) -> str:
    """A fresh schema named ``<prefix>_<random>`` with the migration applied in the database of ``url``."""
    import asyncio
    import uuid

    from runlane_postgres import apply_postgres_migrations

    schema = f"{prefix}_{uuid.uuid4().hex[:10]}"
    asyncio.run(apply_postgres_migrations(url, schema=schema))
    return schema


def restartable_postgres_server(prefix: str) -> tuple[PostgresTestServer, str]:
    """The session's managed server and a freshly migrated schema in it, for a test that stops or
    restarts the server; the test is skipped when an external database is configured instead."""
    import pytest

    server = postgres_server()
    if server is None:
        pytest.skip("RUNLANE_POSTGRES_TEST_DATABASE_URL is set: the tests cannot stop or restart that server")
    return server, migrated_schema(server.url, prefix)


class Schemas:
    """Fresh schema names for one test module (``<prefix>_<random>``); ``drop_all()`` drops every one."""

    def __init__(self, url: str, prefix: str) -> None:
        self.url = url
        self.prefix = prefix
        self.created: list[str] = []

    def name(self) -> str:
        import uuid

        schema = f"{self.prefix}_{uuid.uuid4().hex[:12]}"
        self.created.append(schema)
        return schema

    async def migrated(self) -> str:
        from runlane_postgres import apply_postgres_migrations

        schema = self.name()
        await apply_postgres_migrations(self.url, schema)
        return schema

    def execute(self, statement: Any, params: Any = None) -> list[tuple[Any, ...]]:
        import psycopg

        with psycopg.connect(self.url, autocommit=True, connect_timeout=10) as connection:
            cursor = connection.execute(statement, params)
            return cursor.fetchall() if cursor.description else []

    @contextmanager
    def login_role(self, password: str | None = None) -> Iterator[tuple[str, str]]:
        """A fresh login role without privileges and the URL that connects as it (its password is its name
        unless ``password`` is given, which the URL then carries percent-encoded); the role and what it owns
        are dropped afterwards. Skips the test when the database's user may not create roles."""
        import uuid
        from urllib.parse import quote, urlsplit, urlunsplit

        import psycopg
        import pytest
        from psycopg import sql

        role = f"{self.prefix}_role_{uuid.uuid4().hex[:8]}"
        secret = role if password is None else password
        try:
            self.execute(sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(sql.Identifier(role), sql.Literal(secret)))
        except psycopg.Error:
            pytest.skip("the test database does not let this role create roles")
        parts = urlsplit(self.url)
        netloc = f"{role}:{quote(secret, safe='')}@{parts.hostname}:{parts.port}"
        try:
            yield role, urlunsplit(parts._replace(netloc=netloc))
        finally:
            self.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            self.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))

    def drop_all(self) -> None:
        from psycopg import sql

        for schema in self.created:
            self.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def assert_refused_without_quoting(url: str, secrets: list[str], says: str) -> None:
    """``url`` is refused as ``configuration_invalid`` saying ``says``, by the resolver and by the driver
    factory alike, and none of ``secrets`` appears in the message, the meta or the repr."""
    import json

    import pytest
    from runlane_postgres import postgres_storage, resolve_postgres_connection

    from runlane.errors import ErrorCode, RunlaneError

    for attempt in (lambda: resolve_postgres_connection(url), lambda: postgres_storage(url)):
        with pytest.raises(RunlaneError) as info:
            attempt()
        error = info.value
        assert error.code is ErrorCode.CONFIGURATION_INVALID and not error.retryable
        shown = error.message + json.dumps(error.meta) + repr(error)
        assert not [secret for secret in secrets if secret in shown], error.message
        assert says in error.message, error.message


# Timeout values the Postgres options refuse, as runlane.toml writes them (option, TOML value).
INVALID_TIMEOUTS = [
    ("statement_timeout", '"soon"'),
    ("statement_timeout", "0"),
    ("pool_timeout", '"-1s"'),
    ("pool_timeout", "true"),
    ("connect_timeout", '"0s"'),
    ("connect_timeout", "nan"),
]


def configured_lane(directory: Path, lane_toml: str) -> Any:
    """The lane a ``runlane.toml`` holding ``lane_toml`` configures, built the way every command builds it
    (not started)."""
    from runlane.cli.main import _lane_factory
    from runlane.config import load_config
    from runlane.plugins.manager import get_registries

    (directory / "runlane.toml").write_text(lane_toml)
    loaded = load_config(directory / "runlane.toml", environ={})
    assert loaded is not None and loaded.lane is not None
    return _lane_factory(loaded, get_registries())(loaded.lane.use, loaded.lane.options)


@contextmanager
def pgbouncer(url: str, pool_mode: str) -> Iterator[str]:
    """A PgBouncer in ``pool_mode`` (``session`` or ``transaction``) on a free loopback port in front of
    the database of ``url``, and the URL that connects through it; skips the test without a ``pgbouncer``
    program. As root it runs as ``postgres`` (else ``nobody``), since PgBouncer refuses to run as root."""
    import os
    import pwd
    import shutil
    import socket
    import subprocess
    import tempfile
    import time
    from urllib.parse import unquote, urlsplit, urlunsplit

    import pytest

    program = shutil.which("pgbouncer") or ("/usr/sbin/pgbouncer" if os.path.exists("/usr/sbin/pgbouncer") else None)
    if program is None:
        pytest.skip("pgbouncer is not installed (Debian: apt-get install pgbouncer)")
    parts = urlsplit(url)
    database = parts.path.lstrip("/")
    target = f"host={parts.hostname} port={parts.port or 5432} dbname={database} user={unquote(parts.username or '')}"
    if parts.password:
        target += f" password={unquote(parts.password)}"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    directory = tempfile.mkdtemp(prefix="runlane_pgbouncer_", dir="/tmp")
    os.chmod(directory, 0o755)
    config = os.path.join(directory, "pgbouncer.ini")
    with open(config, "w", encoding="utf-8") as file:
        file.write(
            f"[databases]\n{database} = {target}\n[pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = {port}\n"
            f"unix_socket_dir =\nauth_type = any\npool_mode = {pool_mode}\ndefault_pool_size = 20\n"
        )
    os.chmod(config, 0o644)
    user = None
    if os.geteuid() == 0:
        for name in ("postgres", "nobody"):
            with contextlib.suppress(KeyError):
                user = pwd.getpwnam(name).pw_name
                break
    log = open(os.path.join(directory, "pgbouncer.log"), "wb")  # noqa: SIM115 - closed below
    process = subprocess.Popen([program, config], stdout=log, stderr=log, user=user, start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while True:
            with socket.socket() as client:
                if client.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"pgbouncer did not start: {open(log.name, encoding='utf-8').read()[-2000:]}")
            time.sleep(0.02)
        yield urlunsplit(parts._replace(netloc=f"{parts.username or 'runlane'}@127.0.0.1:{port}"))
    finally:
        process.terminate()
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)
        log.close()
        shutil.rmtree(directory, ignore_errors=True)
