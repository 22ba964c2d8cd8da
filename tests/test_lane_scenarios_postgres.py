"""The lane scenarios over the postgres-polling lane on a real server: each ``new()`` is a freshly
migrated schema (dropped when the test ends), and ``peer()`` another lane over the same schema
(another process's view)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from runlane_postgres import postgres_migration_sql, postgres_polling_lane

from runlane.testing import LaneCompositionConformance

from lane_scenarios import LaneFactory, LaneScenarios


class TestPostgresLaneScenarios(LaneScenarios):
    @pytest.fixture
    def lanes(self, postgres_url: str) -> Iterator[LaneFactory]:
        schemas: list[str] = []

        def new():
            schemas.append(f"scenario_{uuid.uuid4().hex[:12]}")
            # Called from inside the scenario's event loop: migrate with a plain blocking connection.
            with psycopg.connect(postgres_url, autocommit=True, connect_timeout=10) as connection:
                connection.execute(postgres_migration_sql(schemas[-1]).encode())
            return postgres_polling_lane(postgres_url, schema=schemas[-1])

        try:
            yield LaneFactory(new=new, peer=lambda: postgres_polling_lane(postgres_url, schema=schemas[-1]))
        finally:
            with psycopg.connect(postgres_url, autocommit=True, connect_timeout=10) as connection:
                for schema in schemas:
                    connection.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


class TestPostgresPollingLaneComposition(LaneCompositionConformance):
    @pytest.fixture
    def lane(self, postgres_url: str) -> Iterator[Any]:
        from postgres_support import migrated_schema

        schema = migrated_schema(postgres_url, "lane_conformance")
        try:
            yield postgres_polling_lane(postgres_url, schema=schema)
        finally:
            with psycopg.connect(postgres_url, autocommit=True, connect_timeout=10) as connection:
                connection.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
