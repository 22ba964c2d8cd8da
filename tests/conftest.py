"""Session-wide fixtures shared by the test modules."""

from __future__ import annotations

import http.server
import json
import sys
import threading
from collections.abc import Callable, Iterator

import pytest


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A PostgreSQL database URL for the session (see ``tests/postgres_support.py``).

    ``RUNLANE_POSTGRES_TEST_DATABASE_URL`` when set, else a throwaway server started on first use
    and stopped when the session ends.
    """
    # Imported here so test modules that never touch PostgreSQL do not need runlane-postgres.
    from postgres_support import postgres_server_url, stop_postgres_server

    try:
        yield postgres_server_url()
    finally:
        stop_postgres_server()


@pytest.fixture(scope="session")
def sqs_server() -> Iterator[object]:
    """An SQS-compatible server (moto's server mode) on a loopback port for the session.

    Tests create queues with unique names, so they never see each other's messages.
    """
    from runlane_sqs.testing import SqsTestServer

    server = SqsTestServer()
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.fixture
def sqs_refusing() -> Iterator[Callable[..., str]]:
    """Start an HTTP endpoint that answers every SQS call with one error, as SQS writes it on the wire:
    ``sqs_refusing(status, shape, query_code=None)`` returns its URL; the ``X-Amz-Target`` of each call
    it got is appended to ``sqs_refusing.calls``. ``query_code`` is the ``x-amzn-query-error`` code real
    SQS adds, which botocore reports as the error code."""
    servers: list[http.server.ThreadingHTTPServer] = []
    calls: list[str] = []

    def start(status: int, shape: str, query_code: str | None = None) -> str:
        class Refusing(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                calls.append(self.headers.get("X-Amz-Target") or "")
                body = json.dumps({"__type": f"com.amazonaws.sqs#{shape}", "message": "refused"}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/x-amz-json-1.0")
                if query_code is not None:
                    self.send_header("x-amzn-query-error", f"{query_code};Sender")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refusing)
        servers.append(server)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{server.server_address[1]}"

    start.calls = calls  # type: ignore[attr-defined]
    try:
        yield start
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # Also covers a server started through postgres_support without the fixture.
    support = sys.modules.get("postgres_support")
    if support is not None:
        support.stop_postgres_server()
