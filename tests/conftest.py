"""Session-wide fixtures shared by the test modules."""

from __future__ import annotations

import sys
from collections.abc import Iterator

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


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # Also covers a server started through postgres_support without the fixture.
    support = sys.modules.get("postgres_support")
    if support is not None:
        support.stop_postgres_server()
