"""The Postgres driver runs the whole storage conformance suite, every optional part on.

All tests share one freshly migrated schema (the suite gives every test its own collection, index
partitions, stream partitions and environment), dropped when the module ends. Each test gets new,
unstarted driver instances over it.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql
from runlane_postgres import apply_postgres_migrations, postgres_storage

from runlane.testing import StorageDriverConformance


@pytest.fixture(scope="module")
def postgres_schema(postgres_url: str) -> Iterator[str]:
    schema = f"runlane_conformance_{uuid.uuid4().hex[:12]}"
    asyncio.run(apply_postgres_migrations(postgres_url, schema))
    try:
        yield schema
    finally:
        with psycopg.connect(postgres_url, autocommit=True, connect_timeout=10) as connection:
            connection.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


class TestPostgresStorageDriver(StorageDriverConformance):
    supports_append = True
    supports_exclusive_candidates = True
    supports_operator_reads = True

    @pytest.fixture
    def driver(self, postgres_url: str, postgres_schema: str):
        return postgres_storage(postgres_url, schema=postgres_schema, min_size=0, name="postgres-conformance")

    @pytest.fixture
    def peer_driver(self, postgres_url: str, postgres_schema: str):
        return postgres_storage(postgres_url, schema=postgres_schema, min_size=0, name="postgres-conformance-peer")
