"""The throwaway PostgreSQL server used by the Postgres tests and benchmarks (``runlane_postgres.testing``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

import psycopg  # installed with plugins/postgres by ./dev
import runlane_postgres.testing as testing

from postgres_support import postgres_server

PostgresTestServer = testing.PostgresTestServer

needs_harness = pytest.mark.skipif(
    testing.postgres_test_url() is not None,
    reason="RUNLANE_POSTGRES_TEST_DATABASE_URL is set, so the throwaway server is not in use",
)


def show(url: str, *names: str) -> list[str]:
    with psycopg.connect(url, connect_timeout=10) as connection:
        return [connection.execute(f"SHOW {name}").fetchone()[0] for name in names]


def alive(pid: int) -> bool:
    """Whether ``pid`` is a running process (a zombie counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_until(condition, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def test_session_database_commits_as_production_does_but_skips_the_disk_flush(postgres_url):
    # A commit waits for its write-ahead log as in production (synchronous_commit); the session's own
    # server skips only the flush to disk (fsync), which an operating-system crash alone would need.
    fsync, synchronous_commit = show(postgres_url, "fsync", "synchronous_commit")
    assert synchronous_commit == "on"
    if postgres_server() is not None:
        assert fsync == "off"


@needs_harness
def test_session_server_listens_only_on_loopback(postgres_url):
    assert postgres_url.startswith("postgresql://postgres:") and "@127.0.0.1:" in postgres_url
    assert postgres_url.endswith("/runlane_test")
    listen, max_connections, shared_buffers, logging_collector = show(
        postgres_url, "listen_addresses", "max_connections", "shared_buffers", "logging_collector"
    )
    assert listen == "127.0.0.1"
    assert (max_connections, shared_buffers, logging_collector) == ("200", "128MB", "off")
    with psycopg.connect(postgres_url) as connection:
        assert connection.execute("SELECT current_database()").fetchone()[0] == "runlane_test"


@needs_harness
def test_session_server_asks_for_a_password_over_tcp(postgres_url):
    # Any local user can reach the port: without the password nobody gets in as superuser (who could run
    # commands as the server's user with COPY ... FROM PROGRAM), nor as any other role.
    if postgres_server() is None:
        pytest.skip("an external database decides its own authentication")
    parts = urlsplit(postgres_url)
    for user, password in (("postgres", None), ("postgres", "wrong"), ("nobody_in_particular", None)):
        netloc = user + (f":{password}" if password else "") + f"@{parts.hostname}:{parts.port}"
        with pytest.raises(psycopg.OperationalError) as refused:
            psycopg.connect(urlunsplit(parts._replace(netloc=netloc)), connect_timeout=5)
        assert "password" in str(refused.value), refused.value


@needs_harness
def test_restart_keeps_committed_data_on_the_same_port(postgres_url):
    server = postgres_server()
    port = server.port
    with psycopg.connect(postgres_url, autocommit=True) as connection:
        connection.execute("CREATE TABLE survives_restart (id int PRIMARY KEY, note text)")
        connection.execute("INSERT INTO survives_restart VALUES (1, 'committed')")
        server.restart()
        with pytest.raises(psycopg.OperationalError):
            connection.execute("SELECT 1")  # the old session ended with the old server
    assert server.port == port and postgres_url == server.url
    with psycopg.connect(postgres_url) as connection:
        assert connection.execute("SELECT id, note FROM survives_restart").fetchall() == [(1, "committed")]

    server.stop_server()
    assert not server.running
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(postgres_url, connect_timeout=2)
    server.stop_server()  # already down: no-op
    server.start_server()
    with psycopg.connect(postgres_url) as connection:
        assert connection.execute("SELECT count(*) FROM survives_restart").fetchone()[0] == 1
        connection.execute("DROP TABLE survives_restart")


@needs_harness
def test_own_server_settings_databases_user_and_cleanup():
    server = PostgresTestServer(settings={"work_mem": "8MB", "synchronous_commit": "off"})
    with server:
        assert server.startup_seconds is not None and server.startup_seconds < server.startup_timeout
        assert show(server.url, "work_mem", "synchronous_commit", "fsync") == ["8MB", "off", "on"]

        # Root cannot run PostgreSQL: the server then runs as an unprivileged system user.
        status = Path(f"/proc/{server.pid}/status").read_text().splitlines()
        postmaster_uid = int(next(line for line in status if line.startswith("Uid:")).split()[1])
        assert postmaster_uid == server.data_dir.stat().st_uid
        if os.geteuid() == 0:
            assert postmaster_uid != 0 and server.os_user in ("postgres", "nobody")
        else:
            assert postmaster_uid == os.geteuid()

        isolated = server.create_database("isolated_module")
        assert isolated == f"postgresql://postgres:{server.password}@127.0.0.1:{server.port}/isolated_module"
        with psycopg.connect(server.url, autocommit=True) as connection:
            connection.execute("CREATE TABLE only_in_runlane_test (id int)")
        with psycopg.connect(isolated) as connection:
            assert connection.execute("SELECT current_database()").fetchone()[0] == "isolated_module"
            assert connection.execute("SELECT to_regclass('only_in_runlane_test')").fetchone()[0] is None
        server.drop_database("isolated_module")

        base_dir = server.base_dir
        # A client session left open across stop(), plus the server's long-lived processes.
        lingering = psycopg.connect(server.admin_url, autocommit=True)
        pids = [server.pid, lingering.execute("SELECT pg_backend_pid()").fetchone()[0]]
        pids += [
            row[0]
            for row in lingering.execute(
                "SELECT pid FROM pg_stat_activity WHERE backend_type IN "
                "('checkpointer', 'background writer', 'walwriter', 'autovacuum launcher')"
            )
        ]
        assert len(pids) == 6 and all(alive(pid) for pid in pids)
        assert base_dir.is_dir() and server.log_path.is_file()

    lingering.close()
    assert not server.running
    assert [pid for pid in pids if alive(pid)] == []
    assert not base_dir.exists()
    server.stop()  # twice: harmless


@needs_harness
def test_server_does_not_outlive_a_killed_owner():
    script = textwrap.dedent(
        """
        import os, signal
        from runlane_postgres.testing import PostgresTestServer
        server = PostgresTestServer()
        server.start()
        print(server.pid, server.base_dir, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # no atexit, no stop(): only the watchdog is left
        """
    )
    completed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=90)
    assert completed.returncode == -9, completed.stderr
    pid_text, base_dir = completed.stdout.split()
    assert wait_until(lambda: not alive(int(pid_text)) and not Path(base_dir).exists())


def test_missing_binaries_name_what_to_install(tmp_path, monkeypatch):
    with pytest.raises(RuntimeError, match="apt-get install postgresql-15"):
        PostgresTestServer(bin_dir=tmp_path).start()
    monkeypatch.setenv("RUNLANE_POSTGRES_BIN", str(tmp_path))
    with pytest.raises(RuntimeError, match="RUNLANE_POSTGRES_BIN"):
        testing.find_postgres_binaries()


def test_postgres_test_url_reads_the_environment(monkeypatch):
    monkeypatch.setenv("RUNLANE_POSTGRES_TEST_DATABASE_URL", "postgresql://u@db.example:5432/x")
    assert testing.postgres_test_url() == "postgresql://u@db.example:5432/x"
    monkeypatch.setenv("RUNLANE_POSTGRES_TEST_DATABASE_URL", "")
    assert testing.postgres_test_url() is None
    monkeypatch.delenv("RUNLANE_POSTGRES_TEST_DATABASE_URL")
    assert testing.postgres_test_url() is None


# Root runs the server as another user that owns the temporary directory, and anyone who can connect
# can run commands as that user: a link it plants there must not make root write (or chown) another file.


def planted_target(tmp_path: Path) -> tuple[Path, tuple[object, ...]]:
    """A file of the caller's that a planted link points at, and what must stay as it is."""
    target = tmp_path / "not_for_the_server.txt"
    target.write_text("belongs to the caller\n")
    target.chmod(0o600)
    info = target.stat()
    return target, (info.st_uid, info.st_gid, info.st_mode, target.read_bytes())


def current(target: Path) -> tuple[object, ...]:
    info = target.stat()
    return (info.st_uid, info.st_gid, info.st_mode, target.read_bytes())


def refusal(action) -> str:
    try:
        action()
    except RuntimeError as error:
        return str(error)
    return "(no error)"


@needs_harness
@pytest.mark.parametrize("name", ["runlane_test.conf", "postgresql.conf"])
def test_a_symbolic_link_where_a_settings_file_goes_is_refused(name, tmp_path, monkeypatch):
    target, before = planted_target(tmp_path)
    real_initdb = PostgresTestServer._initdb

    def initdb_then_plant(self, binaries):
        real_initdb(self, binaries)
        planted = self.data_dir / name
        planted.unlink(missing_ok=True)
        planted.symlink_to(target)

    monkeypatch.setattr(PostgresTestServer, "_initdb", initdb_then_plant)
    server = PostgresTestServer()
    try:
        refused = refusal(server.start)
    finally:
        server.stop()
    assert current(target) == before
    assert re.search(f"refusing to use \\S*/data/{name}: it is a symbolic link", refused), refused


@needs_harness
@pytest.mark.parametrize("link", ["symbolic", "hard"])
def test_a_link_where_the_log_goes_is_refused_on_restart(link, tmp_path):
    server = PostgresTestServer()
    try:
        server.start()
        # A hard link must stay on one file system: its target is planted beside the log, as root's file.
        target, before = planted_target(tmp_path if link == "symbolic" else server.base_dir)
        server.log_path.unlink()  # the running server keeps the file it has open
        if link == "symbolic":
            server.log_path.symlink_to(target)
        else:
            os.link(target, server.log_path)
        refused = refusal(server.restart)
        running = server.running
        after = current(target)  # before stop() removes the server's directory
    finally:
        server.stop()
    assert after == before
    assert re.search(f"refusing to use \\S*/postgres.log: it is a {link} link", refused), refused
    assert not running


@needs_harness
def test_the_server_does_not_get_the_callers_environment(monkeypatch):
    # The server's user can read its processes' environments (/proc/PID/environ).
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "runlane-test-not-a-real-secret")
    with PostgresTestServer() as server:
        environment = Path(f"/proc/{server.pid}/environ").read_bytes().split(b"\0")
        home = f"HOME={server.base_dir}".encode()
    assert b"LC_ALL=C" in environment and home in environment
    assert not [entry for entry in environment if b"AWS_SECRET_ACCESS_KEY" in entry or b"not-a-real-secret" in entry]
