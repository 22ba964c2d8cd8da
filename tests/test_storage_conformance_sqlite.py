"""The SQLite driver runs the whole storage conformance suite, every optional part on.

Each test gets a fresh database file; ``peer_driver`` is a second, independent driver over the same
file (its own connection and thread), as another process would open it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from runlane_local import SqliteStorageDriver, sqlite_storage
from runlane.testing import StorageDriverConformance


class TestSqliteStorageDriver(StorageDriverConformance):
    supports_append = True
    supports_exclusive_candidates = True
    supports_operator_reads = True

    @pytest.fixture
    def database(self, tmp_path: Path) -> Path:
        return tmp_path / "runlane.db"

    @pytest.fixture
    def driver(self, database: Path) -> SqliteStorageDriver:
        return sqlite_storage(database)

    @pytest.fixture
    def peer_driver(self, database: Path) -> SqliteStorageDriver:
        return sqlite_storage(database, name="sqlite-storage-peer")
