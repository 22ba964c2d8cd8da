"""runlane-postgres beyond the conformance suite: connection strings, the migration (function, file,
CLI), the start-up probe, exact document storage, corrupt rows, error mapping, reconnects, the lane
and the plugin.

Every test that touches the database works in schemas of its own (``runlane_driver_*``), dropped
when the module ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
import runlane_postgres.storage as pg_storage
from cli_support import cli, write
from postgres_support import Schemas, assert_refused_without_quoting, pgbouncer
from psycopg import errors as pg_errors
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import PoolTimeout
from runlane_postgres import (
    apply_postgres_migrations,
    map_postgres_error,
    postgres_migration_sql,
    postgres_polling_lane,
    postgres_storage,
    resolve_postgres_connection,
)
from runlane_postgres.migration import MIGRATION_LOCK_KEY, SCHEMA_VERSION, shipped_migration_sql
from runlane_postgres.plugin import PostgresPollingLaneOptions
from sql_driver_support import check_replaced_documents_are_recognized

from runlane import create_runlane, queue, task
from runlane.errors import ErrorCode, RunlaneError, is_storage_conflict
from runlane.models import Environment
from runlane.plugins.manager import get_registries
from runlane.plugins.registries import validate_options
from runlane.storage import (
    NewStorageRecord,
    StorageAppendCommand,
    StorageCandidateMode,
    StorageClockAuthority,
    StorageDocument,
    StorageDurability,
    StorageIndexConsistency,
    StorageIndexEntry,
    StorageIndexName,
    StorageLimits,
    StorageQuery,
    StorageRange,
    StorageRecordKey,
    StorageStreamName,
    storage_stream_layouts,
)
from runlane.storage.key_order import KEY_ORDERED_INDEXES
from runlane.storage.operator import PaginationParams, RunEventFilter, RunFilter
from runlane.testing import ControlledClock
from runlane.vocabulary import RunStatus, WorkerMode

# ---------------------------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="module")
def schemas(postgres_url: str) -> Iterator[Schemas]:
    created = Schemas(postgres_url, "runlane_driver")
    try:
        yield created
    finally:
        created.drop_all()


@pytest.fixture(scope="module")
def shared_schema(schemas: Schemas) -> str:
    return asyncio.run(schemas.migrated())


def closed_port() -> int:
    """A loopback port nothing listens on (bound and released at once)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def record(key: StorageRecordKey, value: dict[str, Any], *entries: StorageIndexEntry) -> NewStorageRecord:
    return NewStorageRecord(key, StorageDocument.encode(value), entries)


async def create(driver: Any, *records: NewStorageRecord) -> None:
    async def stage(tx: Any) -> None:
        for item in records:
            tx.create(item)

    await driver.with_transaction(stage)


async def expect_error(awaitable: Any, code: ErrorCode) -> RunlaneError:
    with pytest.raises(RunlaneError) as info:
        await awaitable
    assert info.value.code is code, f"expected {code.value}, got {info.value.code.value}: {info.value.message}"
    return info.value


# ---------------------------------------------------------------------------------------------
# Connection strings and options (no database)


@pytest.mark.parametrize(
    "url",
    ["", "   ", "mysql://user@localhost/db", "localhost:5432/db", "http://localhost/db", None, 5432],
)
def test_only_postgres_urls_are_accepted(url: Any) -> None:
    with pytest.raises(RunlaneError) as info:
        resolve_postgres_connection(url)
    assert info.value.code is ErrorCode.CONFIGURATION_INVALID
    with pytest.raises(RunlaneError):
        postgres_storage(url)


@pytest.mark.parametrize(
    "url, says",
    [
        ("postgres://user@localhost:notaport/db", "port to 'notaport'; it must be a whole number"),
        ("postgres://user@localhost/db?sslmode=strict", "sslmode to 'strict'; use one of allow, disable"),
        ("postgres://user@localhost/db?connect_timeout=5s", "connect_timeout to '5s'"),
        ("postgres://user@localhost/db?bogus=1", 'invalid URI query parameter: "bogus"'),
        ("postgres://user@localhost:99999/db", "port to '99999'; a port is between 1 and 65535"),
        ("postgres://user@localhost/db?port=0", "port to '0'; a port is between 1 and 65535"),
        ("postgres://user@localhost/db?channel_binding=bogus", "channel_binding to 'bogus'; use one of disable"),
        ("postgres://user@localhost/db?ssl_min_protocol_version=TLSv9", "ssl_min_protocol_version to 'TLSv9'"),
        # A replication connection cannot run Runlane's statements: every probe failed as an outage.
        ("postgres://user@localhost/db?replication=database", "replication to 'database'; Runlane needs an ordinary"),
        ("postgres://user@localhost/db?replication=true", "replication to 'true'; Runlane needs an ordinary"),
        (
            "postgres://user@localhost/db?ssl_min_protocol_version=TLSv1.3&ssl_max_protocol_version=TLSv1.2",
            "ssl_min_protocol_version to 'TLSv1.3', above its ssl_max_protocol_version 'TLSv1.2'",
        ),
    ],
)
def test_options_libpq_would_refuse_on_every_connect_are_refused_up_front(url: str, says: str) -> None:
    with pytest.raises(RunlaneError) as info:
        postgres_storage(url)
    assert info.value.code is ErrorCode.CONFIGURATION_INVALID and not info.value.retryable
    assert says in info.value.message
    # Multiple hosts with their ports, and the options libpq knows, are fine.
    postgres_storage("postgres://user@a:5432,b:5433/db?sslmode=require&connect_timeout=5&target_session_attrs=any")
    postgres_storage("postgres://user@localhost/db?replication=off")
    postgres_storage("postgres://user@localhost/db?ssl_min_protocol_version=TLSv1.2&ssl_max_protocol_version=TLSv1.2")


def test_schema_resolution_explicit_then_url_then_public() -> None:
    plain = resolve_postgres_connection("postgresql://user:secret@db.example:5432/app")
    assert (plain.schema, plain.conninfo) == ("public", "postgresql://user:secret@db.example:5432/app")
    from_url = resolve_postgres_connection("postgres://db/app?sslmode=require&schema=tenant_1&application_name=a%20b")
    assert from_url.schema == "tenant_1"
    assert from_url.conninfo == "postgres://db/app?sslmode=require&application_name=a%20b", "schema= must be removed"
    assert from_url.parameters == {"sslmode", "application_name"}
    explicit = resolve_postgres_connection("postgresql://db/app?schema=from_url", "Explicit_Schema")
    assert explicit.schema == "Explicit_Schema" and "schema" not in explicit.conninfo
    assert resolve_postgres_connection("POSTGRESQL://db/app?schema=s").schema == "s"
    assert "secret" not in plain.display and plain.display == "db.example:5432/app"
    same_twice = resolve_postgres_connection("postgresql://db/app?schema=s&schema=s")
    assert same_twice.schema == "s" and same_twice.conninfo == "postgresql://db/app"


def test_a_url_without_a_host_keeps_its_slashes_and_names_its_socket() -> None:
    # urlunsplit would turn postgresql:///app into postgresql:/app, which libpq cannot parse.
    socket = resolve_postgres_connection("postgresql:///app?host=/run/postgresql&schema=tenant_1&sslmode=disable")
    assert socket.conninfo == "postgresql:///app?host=/run/postgresql&sslmode=disable"
    assert (socket.schema, socket.display) == ("tenant_1", "socket /run/postgresql, database app")
    encoded = resolve_postgres_connection("postgres://%2Frun%2Fpostgresql/app")
    assert encoded.display == "socket /run/postgresql, database app"
    assert resolve_postgres_connection("postgresql:///app").display == "localhost/app"


# Passwords with characters a URL must percent-encode: none of them may reach a message, meta or display.
@pytest.mark.parametrize(
    "url, secrets, says",
    [
        ("postgresql://app:Ab%9xYzQ@db.internal:5432/app", ["Ab%9xYzQ", "9xYzQ"], "password has a '%'"),
        ("postgresql://app@db.internal/app?password=S3cr%ZZet", ["S3cr", "ZZet"], "password parameter has a '%'"),
        ("postgres://app@db/app?sslmode=require&password=S3cr%ZZet", ["S3cr", "ZZet"], "password parameter has"),
        ("postgresql://app:S3 cret@db.example/app", ["S3 cret", "cret"], "password has a space"),
        ("postgresql://app:Pa%00Qz9@db.example/app", ["Pa%00Qz9", "Qz9"], "password encodes a zero byte"),
        # libpq: host "app", port "Kq7", database "Zr9w@db.internal:5432/app"
        ("postgresql://app:Kq7/Zr9w@db.internal:5432/app", ["Kq7", "Zr9w"], "an '@' after its user name"),
        # libpq: password "p", host "ssw0rd@127.0.0.1"
        ("postgresql://app:p@ssw0rd@127.0.0.1:1/app", ["ssw0rd"], "an '@' after its user name"),
        # libpq: user name "db.internal?password=p", host "ssw0rd"
        ("postgresql://db.internal?password=p@ssw0rd", ["ssw0rd", "password=p"], "an '@' after a '?'"),
        # libpq's parse errors that quote the whole URL quote it without credentials.
        ("postgresql://app:Tr0ub4dor@[::1/app", ["Tr0ub4dor"], '"postgresql://***@[::1/app"'),
        ("postgresql://app:Tr0ub4dor@[::1]x/app?password=Xyzzy42", ["Tr0ub4dor", "Xyzzy42"], "?password=***"),
        ("POSTGRES://app:Tr0ub4dor@db.internal/app?bogus=1", ["Tr0ub4dor"], 'invalid URI query parameter: "bogus"'),
        ("postgresql://app:e@db.internal/app?bogus=1", ["e@"], "it would quote the password"),
    ],
)
def test_a_password_is_never_quoted_when_the_url_is_refused(url: str, secrets: list[str], says: str) -> None:
    assert_refused_without_quoting(url, secrets, says)


@pytest.mark.parametrize(
    "url, password",
    [
        ("postgresql://app:Hunter2?Tr0ub4dor@db.internal:5432/app?schema=s1", "Hunter2?Tr0ub4dor"),
        ("postgresql://app:Hunter2#Tr0ub4dor@db.internal:5432/app?schema=s1", "Hunter2#Tr0ub4dor"),
        ("postgresql://app:Hu:nt,er2@db.internal:5432/app?schema=s1", "Hu:nt,er2"),
        ("postgresql://app:p%40ss%2Fw%3Fo%25rd@db.internal:5432/app?schema=s1", "p@ss/w?o%rd"),
        ("postgresql://app@db.internal:5432/app?password=Hunter2%23Tr0ub4dor&schema=s1", "Hunter2#Tr0ub4dor"),
    ],
)
def test_urls_libpq_accepts_are_split_the_way_libpq_splits_them(url: str, password: str) -> None:
    # libpq ends the user name and password at the first "@" before any "/"; "?" and "#" do not end them.
    target = resolve_postgres_connection(url)
    assert target.display == "db.internal:5432/app" and target.schema == "s1"
    options = conninfo_to_dict(target.conninfo)
    assert (options["user"], options["password"], options["host"], options["port"]) == (
        "app", password, "db.internal", "5432"
    )  # fmt: skip
    assert options["dbname"] == "app" and "schema" not in target.conninfo
    secret = password[:7]
    assert secret not in repr(target) and secret not in repr(postgres_storage(url))
    assert secret not in repr(PostgresPollingLaneOptions.model_validate({"url": url}))


async def test_the_database_shown_for_a_password_with_a_question_mark_has_no_credentials(
    tmp_path: Path, schemas: Schemas
) -> None:
    found = re.fullmatch(r"(postgres(?:ql)?://)(?:[^@/]+)@([^/]+)/(\w+)", schemas.url)
    if found is None:
        pytest.skip("the test database URL has options")
    scheme, hosts, database = found.groups()
    with schemas.login_role(password="Hunter2?Tr0ub4dor") as (role, _):
        # The role may create the schema it migrates; its password is written as is, "?" and all.
        grant = sql.SQL("GRANT CREATE ON DATABASE {} TO {}")
        schemas.execute(grant.format(sql.Identifier(database), sql.Identifier(role)))
        url = f"{scheme}{role}:Hunter2?Tr0ub4dor@{hosts}/{database}"
        await _migrate_and_show_without_the_password(tmp_path, schemas, url)


async def _migrate_and_show_without_the_password(tmp_path: Path, schemas: Schemas, url: str) -> None:
    hosts, database = url.rsplit("@", 1)[1].split("/")
    schema = schemas.name()
    migrated = await apply_postgres_migrations(url, schema)
    assert migrated.database == f"{hosts}/{database}"
    text = cli(tmp_path, "postgres", "migrate", "--url", f"{url}?schema={schema}")
    assert text.returncode == 0, text.stderr
    assert f"schema '{schema}' in {hosts}/{database} is already at version {SCHEMA_VERSION}" in text.stdout
    as_json = cli(tmp_path, "--json", "postgres", "migrate", "--url", url, "--schema", schema)
    assert as_json.returncode == 0 and json.loads(as_json.stdout)["database"] == f"{hosts}/{database}"
    driver = postgres_storage(f"{url}?schema={schema}")
    try:
        await driver.start()
        assert "Hunter2" not in repr(driver)
    finally:
        await driver.close()
    unreachable_url = f"postgresql://app:Hunter2?Tr0ub4dor@127.0.0.1:{closed_port()}/app"
    unreachable = postgres_storage(unreachable_url, connect_timeout=2)
    error = await expect_error(unreachable.start(), ErrorCode.STORAGE_UNAVAILABLE)
    assert "Hunter2" not in error.message and "127.0.0.1:" in error.message
    await unreachable.close()
    for refused in ("postgresql://app:Ab%9xYzQ@db.internal:5432/app", "postgresql://app:p@ssw0rd@127.0.0.1:1/app"):
        shown = cli(tmp_path, "postgres", "migrate", "--url", refused)
        assert shown.returncode == 1 and "error[configuration_invalid]" in shown.stderr
        assert "percent-encode" in shown.stderr and "9xYzQ" not in shown.stderr and "ssw0rd" not in shown.stderr


async def test_a_lane_over_the_unix_socket_of_the_server_works(schemas: Schemas) -> None:
    from postgres_support import postgres_server

    server = postgres_server()
    if server is None:
        pytest.skip("RUNLANE_POSTGRES_TEST_DATABASE_URL is set: its socket directory is unknown")
    schema = schemas.name()
    url = f"postgresql:///{server.database}?host={server.socket_dir}&port={server.port}&user={server.user}"
    migrated = await apply_postgres_migrations(url, schema)
    assert migrated.database == f"socket {server.socket_dir}, database {server.database}"
    echo_queue = queue("socket", default=True)

    @task("socket.echo", queue=echo_queue)
    async def echo(payload: dict) -> dict:
        return payload

    runtime = create_runlane(lane=postgres_polling_lane(url, schema=schema), queues=[echo_queue], tasks=[echo])
    async with runtime:
        await runtime.trigger(echo, {"over": "socket"})
        done = await runtime.execute_next()
        assert done is not None and done.output == {"over": "socket"}


@pytest.mark.parametrize(
    "schema", ["", "1starts_with_digit", "has-dash", "semi;colon", "x" * 64, 'quote"d', "space d"]
)
def test_schema_names_must_be_plain_identifiers(schema: str) -> None:
    with pytest.raises(RunlaneError) as info:
        resolve_postgres_connection("postgresql://db/app", schema)
    assert info.value.code is ErrorCode.CONFIGURATION_INVALID
    with pytest.raises(RunlaneError):
        resolve_postgres_connection(f"postgresql://db/app?schema={schema}")
    with pytest.raises(RunlaneError):
        postgres_migration_sql(schema)


def test_conflicting_schema_parameters_are_rejected() -> None:
    with pytest.raises(RunlaneError) as info:
        resolve_postgres_connection("postgresql://db/app?schema=a&schema=b")
    assert info.value.code is ErrorCode.CONFIGURATION_INVALID


@pytest.mark.parametrize(
    "options",
    [
        {"min_size": 5, "max_size": 2},
        {"max_size": 0},
        {"min_size": -1},
        {"max_transaction_attempts": 0},
        {"name": ""},
        {"clock": object()},
        {"limits": {"max_point_reads": 1}},
        {"connect_timeout": 0},
        {"statement_timeout": -1},
    ],
)
def test_driver_options_are_validated(options: dict[str, Any]) -> None:
    with pytest.raises(RunlaneError) as info:
        postgres_storage("postgresql://db/app", **options)
    assert info.value.code is ErrorCode.CONFIGURATION_INVALID


def test_profile_is_honest_and_the_clock_is_the_clients() -> None:
    clock = ControlledClock()
    driver = postgres_storage("postgresql://db/app", clock=clock, limits=StorageLimits(max_point_reads=7))
    profile = driver.profile
    assert profile.durability is StorageDurability.DURABLE
    assert profile.clock_authority is StorageClockAuthority.CLIENT
    assert profile.index_consistency is StorageIndexConsistency.STRONG
    assert profile.exclusive_candidates and profile.ordered_append and not profile.process_local
    assert profile.limits.max_point_reads == 7
    assert driver.clock is clock
    other = ControlledClock()
    driver.use_clock(other)
    assert driver.clock is other
    with pytest.raises(RunlaneError):
        driver.use_clock(object())  # type: ignore[arg-type]
    assert "secret" not in repr(postgres_storage("postgresql://u:secret@db/app"))


# ---------------------------------------------------------------------------------------------
# Migration SQL


def test_shipped_migration_file_is_the_default_sql() -> None:
    shipped = Path(__file__).parents[1] / "plugins/postgres/runlane_postgres/migrations/0001_initial.sql"
    assert shipped.read_text(encoding="utf-8") == postgres_migration_sql() == postgres_migration_sql("public")
    assert shipped_migration_sql() == postgres_migration_sql()


def test_the_version_2_cleanup_names_every_index_whose_entries_restate_their_key() -> None:
    text = postgres_migration_sql()
    cleanup = text[text.index("-- Version 2:") :]
    names = re.findall(r"WHEN '(\w+)' THEN '(\w+)'", cleanup) + re.findall(r"ELSE '(\w+)' END", cleanup)
    listed = re.search(r"x.index_name IN \(([^)]*)\)", cleanup).group(1)
    assert [name.strip(" '") for name in listed.split(",")] == [index.value for index in KEY_ORDERED_INDEXES]
    assert dict(names[:-1]) | {listed.split(",")[-1].strip(" '"): names[-1]} == {
        index.value: collection for index, collection in KEY_ORDERED_INDEXES.items()
    }


def test_migration_sql_quotes_and_qualifies_the_schema() -> None:
    text = postgres_migration_sql("Tenant_7")
    assert 'CREATE SCHEMA "Tenant_7";' in text and "to_regnamespace('\"Tenant_7\"')" in text
    assert '"Tenant_7".runlane_records' in text and '"public"' not in text
    # Exactly the default file with the schema identifier swapped: nothing else differs.
    assert text.replace('"Tenant_7"', '"public"') == shipped_migration_sql()
    for statement in ("CREATE TABLE IF NOT EXISTS", "CREATE INDEX IF NOT EXISTS", "CREATE OR REPLACE FUNCTION"):
        assert statement in text


async def test_migration_is_idempotent_and_reports_what_it_did(schemas: Schemas) -> None:
    schema = schemas.name()
    first = await apply_postgres_migrations(f"{schemas.url}?schema={schema}")
    assert (first.schema, first.previous_version, first.version, first.changed) == (schema, 0, SCHEMA_VERSION, True)
    again = await apply_postgres_migrations(schemas.url, schema)
    assert (again.previous_version, again.version, again.changed) == (SCHEMA_VERSION, SCHEMA_VERSION, False)
    assert again.to_json()["changed"] is False
    rows = schemas.execute(
        "SELECT table_name FROM information_schema.tables WHERE table_schema = %s ORDER BY 1", (schema,)
    )
    assert [name for (name,) in rows] == [
        "runlane_index_rows",
        "runlane_operator_events",
        "runlane_operator_runs",
        "runlane_records",
        "runlane_schema_migrations",
    ]


async def test_concurrent_migrations_of_one_schema_all_succeed_and_one_reports_the_change(schemas: Schemas) -> None:
    # Deploys racing (init containers of several replicas): each waits for the one that got in first.
    schema = schemas.name()
    results = await asyncio.gather(*(apply_postgres_migrations(schemas.url, schema) for _ in range(4)))
    assert sorted(result.previous_version for result in results) == [0, *[SCHEMA_VERSION] * 3]
    assert [result.changed for result in results].count(True) == 1
    assert f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK_KEY});" in shipped_migration_sql()


async def test_a_role_that_owns_its_schema_migrates_it_without_create_on_the_database(schemas: Schemas) -> None:
    schema, used = schemas.name(), schemas.name()
    with schemas.login_role() as (role, url):
        owned = sql.SQL("CREATE SCHEMA {} AUTHORIZATION {}").format(sql.Identifier(schema), sql.Identifier(role))
        schemas.execute(owned)
        first = await apply_postgres_migrations(url, schema)  # the role has no CREATE on the database
        again = await apply_postgres_migrations(url, schema)  # a release step repeated on every deploy
        assert (first.changed, again.changed, again.version) == (True, False, SCHEMA_VERSION)
        other = schemas.name()
        error = await expect_error(apply_postgres_migrations(url, other), ErrorCode.CONFIGURATION_INVALID)
        assert "grant the role CREATE on the database, or create the schema beforehand" in error.message
        # A schema the role may use but does not own: the advice is about owning it, not about access.
        schemas.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(used)))
        schemas.execute(sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(sql.Identifier(used), sql.Identifier(role)))
        error = await expect_error(apply_postgres_migrations(url, used), ErrorCode.CONFIGURATION_INVALID)
        assert "make the migrating role the schema's owner, or grant it CREATE on the schema" in error.message

async def test_a_schema_owner_whose_tables_another_role_created_is_told_to_own_them(schemas: Schemas) -> None:
    # Migrated first as a superuser, then given to a migrator role as docs/lanes.md says: the migrator was told
    # to become the schema's owner, which it already was.
    schema = await schemas.migrated()
    with schemas.login_role() as (role, url):
        try:
            schemas.execute(sql.SQL("ALTER SCHEMA {} OWNER TO {}").format(sql.Identifier(schema), sql.Identifier(role)))
            error = await expect_error(apply_postgres_migrations(url, schema), ErrorCode.CONFIGURATION_INVALID)
            assert "belong to another role" in error.message and "OWNER TO" in error.message, error.message
            assert "make the migrating role the schema's owner" not in error.message
            owned = schemas.execute(
                "SELECT format('ALTER %%s %%I.%%I OWNER TO %%I', CASE c.relkind WHEN 'S' THEN 'SEQUENCE' "
                "ELSE 'TABLE' END, n.nspname, c.relname, %s::text) FROM pg_class AS c "
                "JOIN pg_namespace AS n ON n.oid = c.relnamespace "
                "WHERE n.nspname = %s::text AND c.relkind IN ('r', 'S') "
                "UNION ALL SELECT format('ALTER FUNCTION %%s OWNER TO %%I', p.oid::regprocedure, %s::text) "
                "FROM pg_proc AS p JOIN pg_namespace AS n ON n.oid = p.pronamespace WHERE n.nspname = %s",
                (role, schema, role, schema),
            )
            for (statement,) in owned:  # what the message says to do
                schemas.execute(statement)
            assert (await apply_postgres_migrations(url, schema)).version == SCHEMA_VERSION
        finally:
            schemas.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


async def test_migration_against_an_unreachable_server_is_storage_unavailable() -> None:
    error = await expect_error(
        apply_postgres_migrations(f"postgresql://postgres@127.0.0.1:{closed_port()}/db"), ErrorCode.STORAGE_UNAVAILABLE
    )
    assert error.retryable


# ---------------------------------------------------------------------------------------------
# Start-up probe and lifecycle


@pytest.mark.parametrize("encoding", ["LATIN1", "SQL_ASCII"])
async def test_a_database_that_is_not_utf8_is_refused_by_migrate_and_by_start(schemas: Schemas, encoding: str) -> None:
    # migrate refuses it before creating anything, instead of succeeding for workers that then refuse to start.
    name = f"runlane_driver_{encoding.lower()}_{uuid.uuid4().hex[:8]}"
    schemas.execute(
        sql.SQL("CREATE DATABASE {} ENCODING {} LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0").format(
            sql.Identifier(name), sql.Literal(encoding)
        )
    )
    url = urlunsplit(urlsplit(schemas.url)._replace(path=f"/{name}"))
    try:
        for attempt in (apply_postgres_migrations(url, "runlane"), postgres_storage(url, schema="runlane").start()):
            error = await expect_error(attempt, ErrorCode.CONFIGURATION_INVALID)
            assert f"uses the {encoding} encoding" in error.message, error.message
            assert "CREATE DATABASE ... ENCODING 'UTF8'" in error.message, error.message
        with psycopg.connect(url, autocommit=True) as connection:
            assert connection.execute("SELECT to_regnamespace('runlane')").fetchone() == (None,)
    finally:
        schemas.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


async def test_start_fails_fast_on_an_unmigrated_schema(schemas: Schemas) -> None:
    schema = schemas.name()
    schemas.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    for name in (schema, schemas.name()):  # an empty schema, then one that does not exist at all
        driver = postgres_storage(schemas.url, schema=name)
        error = await expect_error(driver.start(), ErrorCode.CONFIGURATION_INVALID)
        assert "runlane postgres migrate" in error.message
        await expect_error(driver.get([StorageRecordKey("c", "k")]), ErrorCode.STORAGE_UNAVAILABLE)


async def test_start_on_a_schema_with_another_case_or_spelling_names_the_migrated_one(schemas: Schemas) -> None:
    # A lane whose schema differs from the migrated one was only told to migrate, which creates an empty
    # schema beside the one holding the runs.
    migrated = await schemas.migrated()
    for meant in (migrated.upper(), migrated[:-1] + ("x" if migrated[-1] != "x" else "y")):
        driver = postgres_storage(schemas.url, schema=meant)
        error = await expect_error(driver.start(), ErrorCode.CONFIGURATION_INVALID)
        assert f"The Runlane schema {meant!r} is not migrated" in error.message, error.message
        assert f"which holds the Runlane schema {migrated!r}" in error.message or (
            f"which holds the Runlane schemas {migrated!r}," in error.message
        ), error.message
        assert "set the lane's schema" in error.message and "runlane postgres migrate" in error.message
        assert migrated in error.meta["runlane_schemas"]
        assert schemas.execute("SELECT to_regnamespace(%s)", (f'"{meant}"',)) == [(None,)]  # nothing created


@pytest.mark.parametrize(
    ("dropped", "named", "rows_lost"),
    [
        ("DROP TABLE {}.runlane_index_rows", "runlane_index_rows", True),
        ("DROP TABLE {}.runlane_operator_runs", "runlane_operator_runs", True),
        ("DROP TABLE {}.runlane_operator_events", "runlane_operator_events", True),
        ("DROP SEQUENCE {}.runlane_record_versions CASCADE", "runlane_record_versions", False),
        ("DROP FUNCTION {}.runlane_commit_batch(jsonb, jsonb)", "runlane_commit_batch(jsonb,jsonb)", False),
        ("DROP FUNCTION {}.runlane_commit(jsonb) CASCADE", "runlane_commit(jsonb)", False),
    ],
)
async def test_start_fails_fast_on_a_schema_missing_part_of_the_migration(
    schemas: Schemas, dropped: str, named: str, rows_lost: bool
) -> None:
    # start() probed the ledger and the records table only: a worker started on a schema with a table or a
    # function dropped by hand, and every trigger or claim failed later (a dropped runlane_commit_batch only
    # when commits came together).
    schema = await schemas.migrated()
    schemas.execute(sql.SQL(dropped).format(sql.Identifier(schema)))
    driver = postgres_storage(schemas.url, schema=schema)
    error = await expect_error(driver.start(), ErrorCode.CONFIGURATION_INVALID)
    assert f"lacks {named}" in error.message and "runlane postgres migrate" in error.message, error.message
    assert ("restore them from a backup" in error.message) is rows_lost, error.message
    assert named in error.meta["missing"]
    await expect_error(driver.get([StorageRecordKey("c", "k")]), ErrorCode.STORAGE_UNAVAILABLE)
    result = await apply_postgres_migrations(schemas.url, schema)  # creates what is missing
    assert result.previous_version == SCHEMA_VERSION
    await driver.start()
    try:
        await create(driver, record(StorageRecordKey("c", "k"), {"v": 1}))
        assert (await driver.get([StorageRecordKey("c", "k")]))[0] is not None
    finally:
        await driver.close()


async def test_start_on_a_schema_whose_migration_did_not_finish_says_so(schemas: Schemas) -> None:
    schema = await schemas.migrated()
    schemas.execute(sql.SQL("DELETE FROM {}.runlane_schema_migrations").format(sql.Identifier(schema)))
    error = await expect_error(postgres_storage(schemas.url, schema=schema).start(), ErrorCode.CONFIGURATION_INVALID)
    assert "records no applied version (a migration that did not finish)" in error.message, error.message
    assert "runlane postgres migrate" in error.message


async def test_a_call_waiting_for_a_connection_when_the_driver_closes_says_so_not_that_postgres_is_down(
    schemas: Schemas,
) -> None:
    # A runtime closed while calls of other threads still run: the call waiting for a pooled connection
    # was told "Postgres is unreachable", retryable, with the server up and the lane closed for good.
    driver = postgres_storage(schemas.url, schema=await schemas.migrated(), min_size=1, max_size=1)
    await driver.start()
    key = StorageRecordKey("c", "k")
    holding, release = asyncio.Event(), asyncio.Event()

    async def hold(tx: Any) -> None:
        await tx.get([key])  # takes the pool's only connection
        holding.set()
        await release.wait()

    holder = asyncio.create_task(driver.with_transaction(hold))
    await holding.wait()
    waiting = asyncio.create_task(driver.get([key]))
    await asyncio.sleep(0.01)  # waiting for the connection
    closing = asyncio.create_task(driver.close())
    try:
        error = await expect_error(asyncio.wait_for(waiting, 10), ErrorCode.STORAGE_UNAVAILABLE)
        assert "the lane was closed meanwhile" in error.message and "unreachable" not in error.message, error.message
        assert error.retryable is False
    finally:
        release.set()
        await asyncio.wait_for(asyncio.gather(holder, closing, return_exceptions=True), 10)


async def test_start_waits_for_a_locked_schema_no_longer_than_statement_timeout(schemas: Schemas) -> None:
    # A migration holding the schema's ledger (a long index build in one transaction, say): the start-up
    # probe gives up as a statement of a pooled connection would, instead of waiting for as long as it takes.
    schema = await schemas.migrated()
    driver = postgres_storage(schemas.url, schema=schema, statement_timeout=0.5)
    async with await psycopg.AsyncConnection.connect(schemas.url) as holder:
        await holder.execute(sql.SQL("LOCK TABLE {}.runlane_schema_migrations").format(sql.Identifier(schema)))
        loop = asyncio.get_running_loop()
        started = loop.time()
        error = await expect_error(asyncio.wait_for(driver.start(), 30), ErrorCode.STORAGE_UNAVAILABLE)
        assert error.retryable and loop.time() - started < 10
    await driver.start()
    await driver.close()


async def test_a_version_1_schema_fails_fast_and_migrate_drops_rows_of_entries_restating_their_key(
    schemas: Schemas,
) -> None:
    schema = await schemas.migrated()
    env, by_run = f"env-{uuid.uuid4().hex[:8]}", StorageIndexName.RUN_EVENTS_BY_RUN
    events = [StorageRecordKey("run_events", env, "run_1", position) for position in ("01", "02")]
    elsewhere = StorageRecordKey("other", env, "x")
    entries = {key: StorageIndexEntry(by_run, (env, "run_1"), (key.parts[-1],)) for key in events}
    entries[elsewhere] = StorageIndexEntry(by_run, (env, "run_1"), ("01",))
    driver = postgres_storage(schemas.url, schema=schema, min_size=0)
    await driver.start()
    try:

        async def write(tx: Any) -> None:
            for key, entry in entries.items():
                tx.create(NewStorageRecord(key, StorageDocument.encode({}), (entry,)))

        await driver.with_transaction(write)
    finally:
        await driver.close()
    rows = sql.SQL("SELECT key FROM {}.runlane_index_rows WHERE index_name = %s ORDER BY key").format(
        sql.Identifier(schema)
    )
    assert schemas.execute(rows, (by_run.value,)) == [(elsewhere.encoded,)]
    # What version 1 stored: a row for every entry, and no version 2.
    for key in events:
        entry = entries[key]
        schemas.execute(
            sql.SQL("INSERT INTO {}.runlane_index_rows VALUES (%s, %s, %s, %s)").format(sql.Identifier(schema)),
            (by_run.value, entry.encoded_partition, entry.encoded_sort, key.encoded),
        )
    schemas.execute(
        sql.SQL("DELETE FROM {}.runlane_schema_migrations WHERE version >= 2").format(sql.Identifier(schema))
    )
    stale = postgres_storage(schemas.url, schema=schema, min_size=0)
    error = await expect_error(stale.start(), ErrorCode.CONFIGURATION_INVALID)
    assert "version 1" in error.message and "runlane postgres migrate" in error.message

    upgraded = await apply_postgres_migrations(schemas.url, schema)
    assert (upgraded.previous_version, upgraded.version, upgraded.changed) == (1, SCHEMA_VERSION, True)
    assert schemas.execute(rows, (by_run.value,)) == [(elsewhere.encoded,)]
    expected = [(elsewhere, ("01",)), (events[0], ("01",)), (events[1], ("02",))]  # ties by key: "other" first
    driver = postgres_storage(schemas.url, schema=schema, min_size=0)
    await driver.start()
    try:
        page = await driver.query(StorageQuery(by_run, (env, "run_1"), limit=10))
        assert [(item.key, item.sort) for item in page.items] == expected
        # A process still running the earlier version writes such a row again: it is not read twice.
        entry = entries[events[1]]
        schemas.execute(
            sql.SQL("INSERT INTO {}.runlane_index_rows VALUES (%s, %s, %s, %s)").format(sql.Identifier(schema)),
            (by_run.value, entry.encoded_partition, entry.encoded_sort, events[1].encoded),
        )
        from runlane.testing.storage_conformance import _query_all as query_all  # the suite's pager

        for limit in (1, 10):
            assert await query_all(driver, StorageQuery(by_run, (env, "run_1"), limit=limit)) == expected, limit
    finally:
        await driver.close()


_FILTER_INDEXES = [
    "runlane_operator_runs_by_idempotency_key",
    "runlane_operator_runs_by_singleton_key",
    "runlane_operator_runs_by_source_run",
    "runlane_operator_runs_by_task",
]


async def test_a_version_2_schema_fails_fast_and_migrate_adds_the_filter_indexes(schemas: Schemas) -> None:
    schema = await schemas.migrated()
    name = sql.Identifier(schema)
    indexes = "SELECT indexname FROM pg_indexes WHERE schemaname = %s AND indexname = ANY(%s) ORDER BY 1"
    assert [index for (index,) in schemas.execute(indexes, (schema, _FILTER_INDEXES))] == _FILTER_INDEXES
    # What version 2 left: no filter indexes, no min_driver_version column, no version 3.
    for index in _FILTER_INDEXES:
        schemas.execute(sql.SQL("DROP INDEX {}.{}").format(name, sql.Identifier(index)))
    schemas.execute(sql.SQL("DELETE FROM {}.runlane_schema_migrations WHERE version = 3").format(name))
    schemas.execute(sql.SQL("ALTER TABLE {}.runlane_schema_migrations DROP COLUMN min_driver_version").format(name))
    stale = postgres_storage(schemas.url, schema=schema, min_size=0)
    error = await expect_error(stale.start(), ErrorCode.CONFIGURATION_INVALID)
    assert "is at version 2, this driver needs 3" in error.message and "runlane postgres migrate" in error.message

    upgraded = await apply_postgres_migrations(schemas.url, schema)
    assert (upgraded.previous_version, upgraded.version, upgraded.changed) == (2, 3, True)
    assert [index for (index,) in schemas.execute(indexes, (schema, _FILTER_INDEXES))] == _FILTER_INDEXES
    ledger = sql.SQL("SELECT version, min_driver_version FROM {}.runlane_schema_migrations ORDER BY 1").format(name)
    assert schemas.execute(ledger) == [(1, None), (2, None), (3, 2)]
    driver = postgres_storage(schemas.url, schema=schema, min_size=0)
    await driver.start()
    await driver.close()


async def test_start_on_a_missing_database_is_configuration_invalid(schemas: Schemas) -> None:
    base = schemas.url.rsplit("/", 1)[0]
    driver = postgres_storage(f"{base}/runlane_no_such_database_{uuid.uuid4().hex[:6]}")
    error = await expect_error(driver.start(), ErrorCode.CONFIGURATION_INVALID)
    assert error.meta.get("sqlstate") == "3D000"
    assert "then run `runlane postgres migrate`" in error.message
    # Migrating a database that does not exist does not tell the user to migrate it.
    from runlane_postgres import apply_postgres_migrations

    error = await expect_error(
        apply_postgres_migrations(f"{base}/runlane_no_such_database_{uuid.uuid4().hex[:6]}"),
        ErrorCode.CONFIGURATION_INVALID,
    )
    assert error.message.endswith("check the connection string's user, password and database.")


async def test_a_server_setting_the_connection_options_get_wrong_is_configuration_invalid(schemas: Schemas) -> None:
    # The server refuses it on every connect: waiting would never help.
    for options in ("-c%20statement_timeout%3Dabc", "-c%20no_such_setting%3D1"):
        driver = postgres_storage(f"{schemas.url}?options={options}")
        error = await expect_error(driver.start(), ErrorCode.CONFIGURATION_INVALID)
        assert not error.retryable and "fix the connection string's options" in error.message


def test_timeouts_must_be_finite() -> None:
    for option in ("pool_timeout", "connect_timeout", "statement_timeout"):
        with pytest.raises(RunlaneError, match=f"{option} must be a positive number of seconds"):
            postgres_storage("postgres://user@localhost/db", **{option: float("nan")})


@pytest.mark.parametrize("seconds", [0, -5, float("nan"), float("inf"), True, "10s"])
async def test_a_migration_connect_timeout_must_be_a_positive_number_of_seconds(seconds: Any) -> None:
    """Refused before connecting, as the driver refuses it, not rounded up to a second nor failing as
    internal_error when the connection is attempted."""
    with pytest.raises(RunlaneError, match="connect_timeout must be a positive number of seconds") as info:
        await apply_postgres_migrations(f"postgresql://postgres@127.0.0.1:{closed_port()}/db", connect_timeout=seconds)
    assert info.value.code is ErrorCode.CONFIGURATION_INVALID


async def test_unreachable_server_is_storage_unavailable_within_the_connect_timeout() -> None:
    driver = postgres_storage(f"postgresql://postgres@127.0.0.1:{closed_port()}/db", connect_timeout=2)
    loop = asyncio.get_running_loop()
    started = loop.time()
    error = await expect_error(driver.start(), ErrorCode.STORAGE_UNAVAILABLE)
    assert error.retryable and loop.time() - started < 10
    assert "127.0.0.1" in error.message


async def test_calls_outside_start_and_close_are_storage_unavailable(schemas: Schemas, shared_schema: str) -> None:
    driver = postgres_storage(schemas.url, schema=shared_schema, min_size=0)
    key = StorageRecordKey("lifecycle", uuid.uuid4().hex)
    await expect_error(driver.get([key]), ErrorCode.STORAGE_UNAVAILABLE)
    await driver.start()
    await driver.start()  # idempotent
    assert await driver.get([key]) == [None]
    await driver.close()
    await driver.close()
    error = await expect_error(driver.with_transaction(lambda tx: tx.get([key])), ErrorCode.STORAGE_UNAVAILABLE)
    assert error.retryable
    await driver.start()  # a closed driver can start again
    try:
        assert await driver.get([key]) == [None]
    finally:
        await driver.close()


async def test_a_forked_process_cannot_use_the_parents_driver(schemas: Schemas, shared_schema: str) -> None:
    """A forked child refuses the inherited driver (its connections are the parent's), and closing it
    there leaves the parent's sessions alone."""
    driver = postgres_storage(schemas.url, schema=shared_schema, min_size=2, max_size=2)
    await driver.start()
    key = StorageRecordKey("forked", uuid.uuid4().hex)
    try:
        assert await driver.get([key]) == [None]
        name = f"runlane-fork-{uuid.uuid4().hex[:8]}"
        pool = driver._pool
        assert pool is not None
        async with pool.connection() as conn:  # a pooled session to find again after the child
            await conn.execute(f"SET application_name = '{name}'")
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                asyncio.run(asyncio.wait_for(driver.get([key]), 5))
            except RunlaneError as error:
                code = 0 if error.code is ErrorCode.STORAGE_UNAVAILABLE and "forked" in error.message else 2
            except BaseException:
                code = 3
            if code == 0:
                try:
                    asyncio.run(asyncio.wait_for(driver.close(), 5))
                except BaseException:
                    code = 4
            os._exit(code)
        deadline = asyncio.get_running_loop().time() + 30
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if asyncio.get_running_loop().time() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise AssertionError("the forked child hung on the parent's driver")
            await asyncio.sleep(0.02)
        assert os.waitstatus_to_exitcode(status) == 0
        async with await psycopg.AsyncConnection.connect(schemas.url, autocommit=True) as observer:
            cursor = await observer.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", (name,))
            assert await cursor.fetchone() == (1,), "the child ended a session of the parent"
        assert await driver.get([key]) == [None]
    finally:
        await driver.close()


# ---------------------------------------------------------------------------------------------
# Documents are stored exactly


async def test_documents_round_trip_byte_for_byte(schemas: Schemas, shared_schema: str) -> None:
    driver = postgres_storage(schemas.url, schema=shared_schema, min_size=0)
    await driver.start()
    try:
        token = uuid.uuid4().hex
        values = [
            {"float": 1e16, "small": 1.5e-7, "negative_zero": -0.0, "one": 1.0, "huge": 2**70},
            {"text": "é😀 \u0000 \n \"quoted\" \\ back", "nested": {"z": [1, {"a": None}], "a": True}},
            {},
        ]
        keys = [StorageRecordKey("fidelity", token, str(n)) for n in range(len(values))]
        written = [record(key, value) for key, value in zip(keys, values)]
        await create(driver, *written)
        found = await driver.get(keys)
        for item, stored in zip(written, found):
            assert stored is not None
            assert stored.document.text == item.document.text
            assert stored.document.byte_size == item.document.byte_size
            assert stored.document == item.document
        assert found[0].document.value["float"] == 1e16 and isinstance(found[0].document.value["float"], float)
        assert str(found[0].document.value["negative_zero"]) == "-0.0"
        rows = schemas.execute(
            sql.SQL("SELECT document::text, byte_size FROM {}.runlane_records WHERE key = %s").format(
                sql.Identifier(shared_schema)
            ),
            (keys[1].encoded,),
        )
        assert rows == [(written[1].document.text, written[1].document.byte_size)]
    finally:
        await driver.close()


# ---------------------------------------------------------------------------------------------
# Corrupt rows are never skipped


def _corrupt(schemas: Schemas, schema: str, key: StorageRecordKey, column: str, value: str) -> None:
    schemas.execute(
        sql.SQL("UPDATE {}.runlane_records SET {} = %s WHERE key = %s").format(
            sql.Identifier(schema), sql.Identifier(column)
        ),
        (value, key.encoded),
    )


@pytest.mark.parametrize(
    "document",
    [
        '{"schemaVersion":2,"value":{}}',
        '{"value":{"a":1}}',
        '{"schemaVersion":1,"value":[1,2]}',
        '{"schemaVersion":1,"value":{},"extra":{}}',
        "[1]",
        '{"schemaVersion":true,"value":{}}',
    ],
)
async def test_a_corrupt_document_is_an_invariant_violation(
    schemas: Schemas, shared_schema: str, document: str
) -> None:
    driver = postgres_storage(schemas.url, schema=shared_schema, min_size=0)
    await driver.start()
    try:
        key = StorageRecordKey("corrupt", uuid.uuid4().hex)
        healthy = StorageRecordKey("corrupt", uuid.uuid4().hex)
        await create(driver, record(key, {"v": 1}), record(healthy, {"v": 2}))
        _corrupt(schemas, shared_schema, key, "document", document)
        await expect_error(driver.get([healthy, key]), ErrorCode.INVARIANT_VIOLATION)

        async def read(tx: Any) -> Any:
            return await tx.get([key])

        await expect_error(driver.with_transaction(read), ErrorCode.INVARIANT_VIOLATION)
        assert (await driver.get([healthy]))[0] is not None, "the driver stays usable"
    finally:
        await driver.close()


async def test_a_worker_sets_a_due_run_with_a_corrupt_document_aside_and_runs_the_others(
    schemas: Schemas, caplog: pytest.LogCaptureFixture
) -> None:
    """The exclusive scan that finds a corrupt due run fails only the read of that run, so a worker
    logs it, sets it aside and goes on with the other runs instead of stopping (docs/operations.md)."""
    schema = await schemas.migrated()
    runtime = _runtime(schemas.url, schema)
    async with runtime:
        corrupt = (await runtime.trigger(_echo, {"n": 1})).run.id
        healthy = (await runtime.trigger(_echo, {"n": 2})).run.id
        _corrupt(schemas, schema, StorageRecordKey("runs", "default", corrupt), "document", '{"schemaVersion":2}')
        with caplog.at_level(logging.ERROR, logger="runlane.worker"):
            await asyncio.wait_for(runtime.worker(mode=WorkerMode.DRAIN).closed, 30)
        run = await runtime.runs.get(healthy)
        assert run is not None and run.status is RunStatus.SUCCEEDED
        assert any(corrupt in record.getMessage() and "set aside" in record.getMessage() for record in caplog.records)


async def test_corrupt_index_entries_are_an_invariant_violation(schemas: Schemas, shared_schema: str) -> None:
    driver = postgres_storage(schemas.url, schema=shared_schema, min_size=0)
    await driver.start()
    try:
        key = StorageRecordKey("corrupt-index", uuid.uuid4().hex)
        entry = StorageIndexEntry(StorageIndexName.OUTBOX_DUE, (key.parts[0],), ("s",))
        await create(driver, record(key, {"v": 1}, entry))
        assert (await driver.get([key]))[0].indexes == (entry,)
        for bogus in ("not_an_index,6161,6161", "outbox_due,zz,6161", "outbox_due"):
            _corrupt(schemas, shared_schema, key, "indexes", bogus)
            await expect_error(driver.get([key]), ErrorCode.INVARIANT_VIOLATION)
    finally:
        await driver.close()


_HEAD_PREFIX = '{"schemaVersion":1,"value":{"next_position":'


@pytest.mark.parametrize(
    ("head", "appended_at"),
    [
        (_HEAD_PREFIX + '"7"}}', 7),
        (_HEAD_PREFIX + '"10000000000000000000"}}', 10000000000000000000),
        ("{}", None),
        ('{"a":"' + "9" * 60 + '"}', None),
        (_HEAD_PREFIX + '""}}', None),
        (_HEAD_PREFIX + '"0"}}', None),
        (_HEAD_PREFIX + '"07"}}', None),
        (_HEAD_PREFIX + '"1a"}}', None),
        (_HEAD_PREFIX + '"-1"}}', None),
        (_HEAD_PREFIX + '"\u0661"}}', None),  # ARABIC-INDIC DIGIT ONE: a digit, but not 0-9
        (_HEAD_PREFIX + '"' + "1" * 21 + '"}}', None),
        (_HEAD_PREFIX + "7}}", None),
        (_HEAD_PREFIX + '"7"}} ', None),
        ('{"schemaVersion":1, "value":{"next_position":"7"}}', None),
        ('{"schemaVersion":2,"value":{"next_position":"7"}}', None),
    ],
)
async def test_appends_read_only_a_canonical_stream_head(
    schemas: Schemas, shared_schema: str, head: str, appended_at: int | None
) -> None:
    """The commit function takes the next position from a head of exactly the shape it writes (1 to
    20 digits, no leading zero); any other head is corrupt: the append fails and changes nothing."""
    driver = postgres_storage(schemas.url, schema=shared_schema, min_size=0)
    await driver.start()
    try:
        stream = f"head-{uuid.uuid4().hex}"
        layout = storage_stream_layouts[StorageStreamName.OBSERVATIONS]
        head_key = layout.head_key(stream)

        async def append(tx: Any) -> None:
            tx.append(StorageAppendCommand(StorageStreamName.OBSERVATIONS, stream, [{"n": 1}]))

        await driver.with_transaction(append)
        _corrupt(schemas, shared_schema, head_key, "document", head)
        if appended_at is None:
            await expect_error(driver.with_transaction(append), ErrorCode.INVARIANT_VIOLATION)
            assert schemas.execute(
                sql.SQL("SELECT document::text FROM {}.runlane_records WHERE key = %s").format(
                    sql.Identifier(shared_schema)
                ),
                (head_key.encoded,),
            ) == [(head,)], "a corrupt head is left as it was"
            positions = [1]
        else:
            await driver.with_transaction(append)
            (stored,) = await driver.get([head_key])
            assert stored is not None and stored.document.value == {"next_position": str(appended_at + 1)}
            positions = [1, appended_at]
        page = await driver.query(
            StorageQuery(StorageIndexName.OBSERVATION_STREAM, (stream,), StorageRange(), limit=10)
        )
        assert [int(item.sort[0]) for item in page.items] == positions
    finally:
        await driver.close()


async def test_a_corrupt_run_record_fails_operator_reads(schemas: Schemas) -> None:
    schema = await schemas.migrated()
    runtime = _runtime(schemas.url, schema)
    async with runtime:
        run_id = await _one_finished_run(runtime)
        driver = runtime.lane.storage
        key = StorageRecordKey("runs", "default", run_id)
        _corrupt(schemas, schema, key, "document", '{"schemaVersion":1}')
        await expect_error(driver.get_run(Environment(name="default"), run_id), ErrorCode.INVARIANT_VIOLATION)
        await expect_error(
            driver.list_runs(RunFilter(environment=Environment(name="default")), PaginationParams()),
            ErrorCode.INVARIANT_VIOLATION,
        )


async def test_a_run_document_the_driver_cannot_read_names_the_run_and_its_record(schemas: Schemas) -> None:
    """An operator reading the error learns which run it is and what to do, as on SQLite: the encoded key
    column alone is hex."""
    schema = await schemas.migrated()
    runtime = _runtime(schemas.url, schema)
    async with runtime:
        run_id = await _one_finished_run(runtime)
        key = StorageRecordKey("runs", "default", run_id)
        _corrupt(schemas, schema, key, "document", '{"schemaVersion":2,"value":{}}')
        error = await expect_error(runtime.runs.get(run_id), ErrorCode.INVARIANT_VIOLATION)
    assert f"runs/default/{run_id} of run {run_id}" in error.message and key.encoded in error.message
    assert "schema version 2" in error.message and "delete the run's records" in error.message
    assert error.meta["run_id"] == run_id and error.meta["record"] == f"runs/default/{run_id}"


async def test_operator_reads_report_a_projection_row_its_record_disagrees_with(schemas: Schemas) -> None:
    """A projection row whose run no longer matches it, or whose record is gone, fails the list with
    ``invariant_violation`` instead of showing the run under a filter it does not match or leaving it out."""
    schema = await schemas.migrated()
    runtime = _runtime(schemas.url, schema)
    environment = Environment(name="default")
    async with runtime:
        run_id = await _one_finished_run(runtime)
        driver = runtime.lane.storage
        failed = RunFilter(environment=environment, statuses=(RunStatus.FAILED,))
        assert (await driver.list_runs(failed, PaginationParams())).data == []
        schemas.execute(
            sql.SQL("UPDATE {}.runlane_operator_runs SET status = 'failed' WHERE run_id = %s").format(
                sql.Identifier(schema)
            ),
            (run_id,),
        )
        error = await expect_error(driver.list_runs(failed, PaginationParams()), ErrorCode.INVARIANT_VIOLATION)
        assert run_id in error.message and "succeeded" in error.message

        events = RunEventFilter(environment=environment, run_id=run_id)
        schemas.execute(
            sql.SQL(
                "DELETE FROM {0}.runlane_records WHERE key = "
                "(SELECT record_key FROM {0}.runlane_operator_events WHERE run_id = %s ORDER BY sequence LIMIT 1)"
            ).format(sql.Identifier(schema)),
            (run_id,),
        )
        error = await expect_error(driver.list_run_events(events, PaginationParams()), ErrorCode.INVARIANT_VIOLATION)
        assert "is missing" in error.message
        schemas.execute(
            sql.SQL("DELETE FROM {}.runlane_records WHERE key = %s").format(sql.Identifier(schema)),
            (StorageRecordKey("runs", "default", run_id).encoded,),
        )
        everything = RunFilter(environment=environment)
        error = await expect_error(driver.list_runs(everything, PaginationParams()), ErrorCode.INVARIANT_VIOLATION)
        assert run_id in error.message and "is missing" in error.message


# ---------------------------------------------------------------------------------------------
# Error mapping


def _error(kind: type[Exception], message: str = "boom") -> Exception:
    return kind(message)


class _CustomState(pg_errors.DatabaseError):
    sqlstate = "RL001"


@pytest.mark.parametrize(
    ("error", "code", "retryable"),
    [
        (_error(pg_errors.SerializationFailure), ErrorCode.STORAGE_CONFLICT, True),
        (_error(pg_errors.DeadlockDetected), ErrorCode.STORAGE_CONFLICT, True),
        (_error(pg_errors.AdminShutdown), ErrorCode.STORAGE_UNAVAILABLE, True),
        (_error(pg_errors.CrashShutdown), ErrorCode.STORAGE_UNAVAILABLE, True),
        (_error(pg_errors.CannotConnectNow), ErrorCode.STORAGE_UNAVAILABLE, True),
        (_error(pg_errors.ConnectionFailure), ErrorCode.STORAGE_UNAVAILABLE, True),
        (_error(pg_errors.TooManyConnections), ErrorCode.STORAGE_UNAVAILABLE, True),
        (_error(pg_errors.QueryCanceled), ErrorCode.STORAGE_UNAVAILABLE, True),
        (_error(psycopg.OperationalError), ErrorCode.STORAGE_UNAVAILABLE, True),
        (_error(PoolTimeout), ErrorCode.STORAGE_UNAVAILABLE, True),
        (_error(pg_errors.InvalidSchemaName), ErrorCode.CONFIGURATION_INVALID, False),
        (_error(pg_errors.UndefinedTable), ErrorCode.CONFIGURATION_INVALID, False),
        (_error(pg_errors.InvalidPassword), ErrorCode.CONFIGURATION_INVALID, False),
        (_error(pg_errors.InvalidCatalogName), ErrorCode.CONFIGURATION_INVALID, False),
        (_error(_CustomState), ErrorCode.INVARIANT_VIOLATION, False),
        (_error(pg_errors.DivisionByZero), ErrorCode.INTERNAL_ERROR, False),
    ],
)
def test_postgres_errors_map_to_runlane_errors(error: Exception, code: ErrorCode, retryable: bool) -> None:
    mapped = map_postgres_error(error, "do something")
    assert mapped.code is code and mapped.retryable is retryable
    assert mapped.message.startswith("Could not do something")
    if code is ErrorCode.STORAGE_CONFLICT:
        assert is_storage_conflict(mapped)
    if isinstance(error, (pg_errors.InvalidSchemaName, pg_errors.UndefinedTable)):
        assert "runlane postgres migrate" in mapped.message


async def test_a_migration_that_times_out_on_a_lock_says_how_to_apply_it_with_a_longer_timeout(
    schemas: Schemas,
) -> None:
    # The migration runs under the statement_timeout the role, the database or the URL sets, not the lane's.
    schema = await schemas.migrated()
    url = schemas.url + ("&" if "?" in schemas.url else "?") + "options=-c%20statement_timeout%3D300"
    async with await psycopg.AsyncConnection.connect(schemas.url) as holder:
        await holder.execute(sql.SQL("LOCK TABLE {}.runlane_schema_migrations").format(sql.Identifier(schema)))
        error = await expect_error(
            asyncio.wait_for(apply_postgres_migrations(url, schema), 30), ErrorCode.STORAGE_UNAVAILABLE
        )
    assert error.retryable and "ran past statement_timeout" in error.message, error.message
    assert "options=-c%20statement_timeout%3D0" in error.message, error.message
    assert "the lane's statement_timeout" not in error.message, error.message


async def test_a_trigger_whose_commit_lost_its_connection_says_how_to_repeat_it_safely(
    schemas: Schemas, shared_schema: str
) -> None:
    default = queue("default", default=True)

    @task("noop", queue=default)
    async def noop(payload: dict[str, Any]) -> None:
        return None

    lane = postgres_polling_lane(schemas.url, schema=shared_schema)
    runtime = create_runlane(lane=lane, queues=[default], tasks=[noop])
    key = uuid.uuid4().hex
    waiting = sql.SQL(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE {}"
    ).format(sql.Literal(f"%{shared_schema}%runlane_commit%"))
    async with runtime:
        async with await psycopg.AsyncConnection.connect(schemas.url) as holder:
            await holder.execute(
                sql.SQL("LOCK TABLE {}.runlane_records IN EXCLUSIVE MODE").format(sql.Identifier(shared_schema))
            )
            triggering = asyncio.ensure_future(runtime.trigger(noop, {}, idempotency_key=key))
            for _ in range(500):  # the commit waits for the lock: end its session then
                if schemas.execute(waiting) or triggering.done():
                    break
                await asyncio.sleep(0.01)
            error = await expect_error(asyncio.wait_for(triggering, 30), ErrorCode.STORAGE_UNAVAILABLE)
        assert error.retryable and "outcome is unknown" in error.message, error.message
        assert "check before repeating" in error.message and "idempotency key" in error.message, error.message
        first = await runtime.trigger(noop, {}, idempotency_key=key)
        again = await runtime.trigger(noop, {}, idempotency_key=key)
        assert again.run.id == first.run.id


async def test_a_call_that_finds_every_pooled_connection_busy_says_what_to_change(
    schemas: Schemas, shared_schema: str
) -> None:
    driver = postgres_storage(schemas.url, schema=shared_schema, min_size=1, max_size=1, pool_timeout=0.2)
    await driver.start()
    holding, release = asyncio.Event(), asyncio.Event()

    async def hold(tx: Any) -> None:
        await tx.get([StorageRecordKey("busy", "pool")])  # takes the pool's only connection
        holding.set()
        await release.wait()

    holder = asyncio.create_task(driver.with_transaction(hold))
    try:
        await asyncio.wait_for(holding.wait(), 10)
        error = await expect_error(
            asyncio.wait_for(driver.get([StorageRecordKey("busy", "other")]), 10), ErrorCode.STORAGE_UNAVAILABLE
        )
        assert error.retryable
        assert "retry the operation" in error.message, error.message
        assert "max_size" in error.message and "pool_timeout" in error.message, error.message
    finally:
        release.set()
        await asyncio.wait_for(holder, 10)
        await driver.close()


async def test_a_pool_that_cannot_open_min_size_connections_at_start_says_what_to_change(schemas: Schemas) -> None:
    schema = await schemas.migrated()
    with schemas.login_role() as (role, url):
        for statement in (
            "GRANT USAGE ON SCHEMA {schema} TO {role}",
            "GRANT SELECT ON ALL TABLES IN SCHEMA {schema} TO {role}",
            "ALTER ROLE {role} CONNECTION LIMIT 2",
        ):
            schemas.execute(sql.SQL(statement).format(schema=sql.Identifier(schema), role=sql.Identifier(role)))
        driver = postgres_storage(url, schema=schema, min_size=4, max_size=4, connect_timeout=1)
        error = await expect_error(asyncio.wait_for(driver.start(), 30), ErrorCode.STORAGE_UNAVAILABLE)
        assert error.retryable
        assert "min_size of 4 connections did not all open" in error.message, error.message
        assert "lower min_size" in error.message and "max_connections" in error.message, error.message


@pytest.mark.parametrize(
    ("options", "says"),
    [({"statement_timeout": 0.3}, "raise the lane's statement_timeout"), ({}, "raise the lock_timeout")],
    ids=["statement_timeout", "lock_timeout"],
)
async def test_a_statement_that_times_out_on_a_lock_says_so_and_what_to_do(
    schemas: Schemas, shared_schema: str, options: dict[str, Any], says: str
) -> None:
    # A session holding a lock on Runlane's tables (a migration, a long transaction): the trigger's commit
    # waits for it until statement_timeout, or the lock_timeout a role, database or URL sets, ends it.
    url = schemas.url + ("" if options else ("&" if "?" in schemas.url else "?") + "options=-c%20lock_timeout%3D300")
    default = queue("default", default=True)

    @task("noop", queue=default)
    async def noop(payload: dict[str, Any]) -> None:
        return None

    runtime = create_runlane(
        lane=postgres_polling_lane(url, schema=shared_schema, **options), queues=[default], tasks=[noop]
    )
    async with runtime:
        async with await psycopg.AsyncConnection.connect(schemas.url) as holder:
            await holder.execute(
                sql.SQL("LOCK TABLE {}.runlane_records IN EXCLUSIVE MODE").format(sql.Identifier(shared_schema))
            )
            error = await expect_error(
                asyncio.wait_for(runtime.trigger(noop, {}), 30), ErrorCode.STORAGE_UNAVAILABLE
            )
        assert error.retryable
        assert "unavailable" not in error.message and "retry the operation" in error.message, error.message
        assert "pg_stat_activity" in error.message and says in error.message, error.message
        await runtime.trigger(noop, {})  # once the lock is released


async def test_writes_to_a_read_only_server_say_to_connect_to_the_primary(schemas: Schemas, shared_schema: str) -> None:
    # What a standby, or a role with default_transaction_read_only (as after a failover), answers to a write.
    separator = "&" if "?" in schemas.url else "?"
    url = f"{schemas.url}{separator}options=-c%20default_transaction_read_only%3Don"
    driver = postgres_storage(url, schema=shared_schema, min_size=0, max_size=1)
    await driver.start()
    try:
        error = await expect_error(create(driver, record(StorageRecordKey("ro", uuid.uuid4().hex), {})),
                                   ErrorCode.STORAGE_UNAVAILABLE)  # fmt: skip
        assert error.retryable and error.meta["sqlstate"] == "25006"
        assert "read-only standby" in error.message and "connect to the primary" in error.message
    finally:
        await driver.close()


async def test_a_connection_that_found_the_server_read_only_is_not_reused(schemas: Schemas) -> None:
    # A session keeps the default_transaction_read_only it started with (a role set read-only, a standby
    # reached through a stale address during a failover): once writes are accepted again, the next try
    # must get a new session instead of failing on the pooled read-only one until it is recycled.
    schema = await schemas.migrated()
    default = queue("default", default=True)

    @task("noop", queue=default)
    async def noop(payload: dict[str, Any]) -> None:
        return None

    with schemas.login_role() as (role, url):
        for statement in (
            "GRANT USAGE ON SCHEMA {schema} TO {role}",
            "GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {schema} TO {role}",
            "GRANT USAGE ON ALL SEQUENCES IN SCHEMA {schema} TO {role}",
            "ALTER ROLE {role} SET default_transaction_read_only = on",
        ):
            schemas.execute(sql.SQL(statement).format(schema=sql.Identifier(schema), role=sql.Identifier(role)))
        lane = postgres_polling_lane(url, schema=schema, min_size=1, max_size=1)
        runtime = create_runlane(lane=lane, queues=[default], tasks=[noop])
        async with runtime:
            error = await expect_error(
                asyncio.wait_for(runtime.trigger(noop, {}, idempotency_key="k"), 30), ErrorCode.STORAGE_UNAVAILABLE
            )
            assert error.retryable and error.meta["sqlstate"] == "25006"
            schemas.execute(sql.SQL("ALTER ROLE {} RESET default_transaction_read_only").format(sql.Identifier(role)))
            created = await asyncio.wait_for(runtime.trigger(noop, {}, idempotency_key="k"), 30)
            assert created.run.status is RunStatus.QUEUED


@pytest.mark.parametrize(
    ("raised", "state", "said"),
    [
        # It cannot extend a table's file.
        (
            "'could not extend file \"base/16384/16397\": No space left on device' USING ERRCODE = 'disk_full'",
            "53100",
            ("disk is full", "nothing was written", "Free space", "retry the operation"),
        ),
        # Its lock table is full.
        (
            "'out of shared memory' USING ERRCODE = 'out_of_memory', "
            "HINT = 'You might need to increase max_locks_per_transaction.'",
            "53200",
            ("ran short of a resource", "out of shared memory", "max_locks_per_transaction", "retry the operation"),
        ),
    ],
    ids=["full-disk", "out-of-shared-memory"],
)
async def test_a_server_short_of_a_resource_is_a_retryable_outage_that_says_what_ran_out(
    schemas: Schemas, raised: str, state: str, said: tuple[str, ...]
) -> None:
    # What the server answers when it runs short of a resource (SQLSTATE class 53): the trigger writes
    # nothing, says what to free or raise, workers ride it out, and the trigger is taken once it passes.
    schema = await schemas.migrated()
    table = sql.Identifier(schema, "runlane_records")
    schemas.execute(
        sql.SQL(
            "CREATE FUNCTION {fn}() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION {raised}; END $$"
        ).format(fn=sql.Identifier(schema, "short"), raised=sql.SQL(raised))
    )
    schemas.execute(
        sql.SQL("CREATE TRIGGER short BEFORE INSERT ON {table} FOR EACH ROW EXECUTE FUNCTION {fn}()").format(
            table=table, fn=sql.Identifier(schema, "short")
        )
    )
    default = queue("default", default=True)

    @task("noop", queue=default)
    async def noop(payload: dict[str, Any]) -> None:
        return None

    runtime = create_runlane(lane=postgres_polling_lane(schemas.url, schema=schema), queues=[default], tasks=[noop])
    async with runtime:
        error = await expect_error(
            asyncio.wait_for(runtime.trigger(noop, {}, idempotency_key="k"), 30), ErrorCode.STORAGE_UNAVAILABLE
        )
        assert error.retryable and error.meta["sqlstate"] == state
        for words in said:
            assert words in error.message, error.message
        assert (await runtime.runs.list()).data == []
        schemas.execute(sql.SQL("DROP TRIGGER short ON {table}").format(table=table))
        created = await runtime.trigger(noop, {}, idempotency_key="k")
        assert created.run.status is RunStatus.QUEUED
        assert [run.id for run in (await runtime.runs.list()).data] == [created.run.id]


@pytest.mark.parametrize(
    "message",
    [
        "connection failed: FATAL:  sorry, too many clients already",
        "connection failed: FATAL:  remaining connection slots are reserved for non-replication superuser connections",
        "connection failed: FATAL:  remaining connection slots are reserved for roles with the SUPERUSER attribute",
    ],
)
def test_a_full_server_is_named_as_such_at_connect(message: str) -> None:
    mapped = map_postgres_error(psycopg.OperationalError(message), "connect")
    assert mapped.code is ErrorCode.STORAGE_UNAVAILABLE and mapped.retryable
    assert mapped.meta["sqlstate"] == "53300" and "no connection slot left" in mapped.message
    assert "max_connections" in mapped.message


@pytest.mark.parametrize(
    ("message", "says"),
    [  # PgBouncer's words at login: the same on every connect, so not an outage to wait out
        ("FATAL:  unsupported startup parameter: options", "ignore_startup_parameters"),
        ("FATAL:  no such database: app_staging", "check the connection string's user, password and database"),
    ],
    ids=["startup-parameter", "database"],
)
def test_a_pooler_refusing_the_connection_string_is_a_configuration_error(message: str, says: str) -> None:
    failed = 'connection failed: connection to server at "127.0.0.1", port 6432 failed: ' + message
    mapped = map_postgres_error(psycopg.OperationalError(failed), "connect to Postgres")
    assert mapped.code is ErrorCode.CONFIGURATION_INVALID and not mapped.retryable, mapped.message
    assert message in mapped.message and says in mapped.message, mapped.message


@pytest.mark.parametrize("kind", ["role", "database"])
async def test_a_role_or_database_at_its_connection_limit_is_named_as_such_at_connect(
    schemas: Schemas, shared_schema: str, kind: str
) -> None:
    with schemas.login_role() as (role, url):
        name = role if kind == "role" else f"{role}_db"
        if kind == "database":
            schemas.execute(sql.SQL("CREATE DATABASE {} OWNER {}").format(sql.Identifier(name), sql.Identifier(role)))
            url = urlunsplit(urlsplit(url)._replace(path=f"/{name}"))
        schemas.execute(sql.SQL(f"ALTER {kind.upper()} {{}} CONNECTION LIMIT 0").format(sql.Identifier(name)))
        try:
            driver = postgres_storage(url, schema=shared_schema, connect_timeout=2)
            error = await expect_error(asyncio.wait_for(driver.start(), 30), ErrorCode.STORAGE_UNAVAILABLE)
        finally:
            if kind == "database":
                schemas.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))
    assert error.retryable and error.meta["sqlstate"] == "53300"
    assert "no connection slot left" in error.message, error.message
    assert f"raise the {kind}'s CONNECTION LIMIT" in error.message, error.message


_FAILED_AT = 'connection failed: connection to server at "10.0.0.5", port 5432 failed: '


@pytest.mark.parametrize(
    "message",
    [  # libpq's words, against a server that accepts SSL
        'root certificate file "/home/app/.postgresql/root.crt" does not exist',
        'could not read root certificate file "/etc/app/ca.pem": no certificate or crl found',
        "SSL error: certificate verify failed",
        'server certificate for "db.internal" does not match host name "10.0.0.5"',
        'certificate present, but not private key file "/home/app/.postgresql/postgresql.key"',
        'private key file "/etc/app/client.key" has group or world access; file must have permissions u=rw (0600)',
        'could not read certificate file "/etc/app/client.crt": no start line',
    ],
)
def test_tls_settings_libpq_refuses_on_every_connect_are_a_configuration_error(message: str) -> None:
    # The same on every connect until the files or the connection string change: not an outage to wait out.
    mapped = map_postgres_error(psycopg.OperationalError(_FAILED_AT + message), "connect to Postgres")
    assert mapped.code is ErrorCode.CONFIGURATION_INVALID and not mapped.retryable
    assert message in mapped.message and "sslrootcert" in mapped.message and "unreachable" not in mapped.message


def test_a_connection_string_without_the_password_the_server_asks_for_is_a_configuration_error() -> None:
    # DATABASE_URL without its password (and none in PGPASSWORD or the passfile): every connect fails alike.
    failed = _FAILED_AT + "fe_sendauth: no password supplied"
    mapped = map_postgres_error(psycopg.OperationalError(failed), "connect to Postgres")
    assert mapped.code is ErrorCode.CONFIGURATION_INVALID and not mapped.retryable, mapped.message
    assert "check the connection string's user, password and database" in mapped.message, mapped.message


async def refused_at_start(schemas: Schemas, parameter: str) -> RunlaneError:
    """The ``configuration_invalid`` that ``start()`` raises for the test server's URL with ``parameter`` added."""
    separator = "&" if "?" in schemas.url else "?"
    driver = postgres_storage(f"{schemas.url}{separator}{parameter}", schema=schemas.name(), min_size=0)
    try:
        return await expect_error(driver.start(), ErrorCode.CONFIGURATION_INVALID)
    finally:
        await driver.close()


async def test_sslmode_require_against_a_server_without_ssl_is_a_configuration_error(schemas: Schemas) -> None:
    # libpq refuses such a server on every connect, so a worker must not wait for it as for an outage.
    if schemas.execute("SHOW ssl") == [("on",)]:
        pytest.skip("the test server accepts SSL connections")
    error = await refused_at_start(schemas, "sslmode=require")
    assert not error.retryable
    assert "server does not support SSL" in error.message and "enable SSL on the server" in error.message
    assert "sslmode" in error.message and "unreachable" not in error.message


@pytest.mark.parametrize("service_file", ["defines another service", "does not exist"])
async def test_a_service_libpq_cannot_look_up_is_a_configuration_error(
    schemas: Schemas, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, service_file: str
) -> None:
    # Refused the same way on every connect: a worker must not wait for it as for an outage.
    path = tmp_path / "pg_service.conf"
    if service_file == "defines another service":
        path.write_text("[elsewhere]\nhost=127.0.0.1\n")
    monkeypatch.setenv("PGSERVICEFILE", str(path))
    error = await refused_at_start(schemas, "service=runlane_app")
    assert not error.retryable and "unreachable" not in error.message
    assert "cannot look up the connection string's service" in error.message and "PGSERVICEFILE" in error.message

# ---------------------------------------------------------------------------------------------
# Group commit: concurrent attempts of one driver share one transaction, each rolled back alone


async def test_concurrent_commits_share_batches_and_fail_alone(
    schemas: Schemas, shared_schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import runlane_postgres.storage as storage_module

    driver = postgres_storage(schemas.url, schema=shared_schema, min_size=0, max_size=4)
    batches: list[int] = []
    commit_batch = driver._commit_batch

    async def spy(conn: Any, attempts: Any) -> Any:
        batches.append(len(attempts))
        return await commit_batch(conn, attempts)

    driver._commit_batch = spy  # type: ignore[method-assign]
    await driver.start()
    try:
        token = uuid.uuid4().hex
        counter = StorageRecordKey("batch-counter", token)
        await create(driver, record(counter, {"n": 0}))
        stream = f"batch-{token}"
        head = storage_stream_layouts[StorageStreamName.OBSERVATIONS].head_key(stream)
        broken = f"broken-{token}"
        broken_head = storage_stream_layouts[StorageStreamName.OBSERVATIONS].head_key(broken)

        async def increment(tx: Any) -> None:
            (current,) = await tx.get([counter])
            tx.replace(current, record(counter, {"n": current.document.value["n"] + 1}))
            tx.append(StorageAppendCommand(StorageStreamName.OBSERVATIONS, stream, [{"n": 1}]))

        async def blind_create(n: int) -> None:
            await create(driver, record(StorageRecordKey("batch-item", token, str(n)), {"n": n}))

        async def append_to_broken(tx: Any) -> None:
            tx.append(StorageAppendCommand(StorageStreamName.OBSERVATIONS, broken, [{"n": 1}]))

        await driver.with_transaction(append_to_broken)
        _corrupt(schemas, shared_schema, broken_head, "document", '{"schemaVersion":1,"value":{"next_position":"x"}}')
        # The first commit of the burst stays in flight a moment, so the others reach theirs meanwhile and
        # queue behind it, however this machine schedules them: a batch forms on every run.
        call, held = storage_module._call, asyncio.Event()

        async def first_commit_waits(conn: Any, statement: Any, params: Any) -> Any:
            if statement is driver._sql.commit_prepared and not held.is_set():
                held.set()
                await asyncio.sleep(0.2)
            return await call(conn, statement, params)

        monkeypatch.setattr(storage_module, "_call", first_commit_waits)
        outcomes = await asyncio.gather(
            *(driver.with_transaction(increment) for _ in range(12)),
            *(blind_create(n) for n in range(12)),
            *(driver.with_transaction(append_to_broken) for _ in range(3)),
            return_exceptions=True,
        )
        assert outcomes[:24] == [None] * 24
        for failure in outcomes[24:]:
            assert isinstance(failure, RunlaneError) and failure.code is ErrorCode.INVARIANT_VIOLATION
        assert batches and max(batches) > 1, batches
        (current,) = await driver.get([counter])
        assert current is not None and current.document.value == {"n": 12}
        # The appends that committed took contiguous positions: replays and failures consumed none.
        (stored_head,) = await driver.get([head])
        assert stored_head is not None and stored_head.document.value == {"next_position": "13"}
        items = await driver.get([StorageRecordKey("batch-item", token, str(n)) for n in range(12)])
        assert all(item is not None for item in items)
        # A blind create of an existing key in a batch fails alone, as a conflict that replays and
        # then finds the record: no other attempt of the batch is affected.
        again = await asyncio.gather(blind_create(0), blind_create(100), return_exceptions=True)
        assert isinstance(again[0], RunlaneError) and again[1] is None
    finally:
        await driver.close()


# ---------------------------------------------------------------------------------------------
# Reconnects


async def test_transactions_holding_exclusive_candidates_keep_the_prepared_statements(
    schemas: Schemas, shared_schema: str
) -> None:
    """Exclusive candidate scans (sent through psycopg, in a transaction that ends in ROLLBACK) many
    times over on one connection: psycopg prepares nothing of its own there, because once it has, it
    answers a ROLLBACK with DEALLOCATE ALL, dropping the statements the driver prepared."""
    driver = postgres_storage(schemas.url, schema=shared_schema, min_size=0, max_size=1)
    await driver.start()
    try:
        token = uuid.uuid4().hex
        entry = StorageIndexEntry(StorageIndexName.RUNS_RUNNABLE, ("held", token), ("2026",))
        await create(driver, record(StorageRecordKey("held-run", token), {"n": 1}, entry))
        query = StorageQuery(StorageIndexName.RUNS_RUNNABLE, ("held", token), StorageRange(), limit=1)

        async def scan(tx: Any) -> int:
            found = await tx.query_candidates(query, mode=StorageCandidateMode.EXCLUSIVE)
            # The candidate came with the scan; the absent key is a prepared read in the same transaction.
            read, absent = await tx.get([found.items[0].key, StorageRecordKey("held-run", "absent", token)])
            assert absent is None
            return read.document.value["n"]

        for _ in range(12):  # read-only: every attempt ends in ROLLBACK on the driver's one connection
            assert await driver.with_transaction(scan) == 1
        conn = await driver._acquire()
        try:
            cursor = await conn.execute("SELECT name FROM pg_prepared_statements")
            names = {row[0] for row in await cursor.fetchall()}
        finally:
            await driver._return(conn)
        assert any(name.startswith("runlane_get_") for name in names), names
        assert all(name.startswith("runlane_") for name in names), names
        (again,) = await driver.get([StorageRecordKey("held-run", token)])
        assert again is not None and again.document.value == {"n": 1}
    finally:
        await driver.close()


async def test_a_prepared_statement_name_stands_for_one_text_whatever_the_schema(schemas: Schemas) -> None:
    """A pooler in transaction mode hands a client a server session another client prepared on. Had the
    lanes of two schemas prepared their statements under the same names, one lane's commit would run
    the other's statement there and write into the other schema; with names that identify their text
    such a session refuses the name instead."""
    first, second = await schemas.migrated(), await schemas.migrated()
    prepared: dict[str, set[str]] = {}
    for schema in (first, second):
        driver = postgres_storage(schemas.url, schema=schema, min_size=0, max_size=1)
        await driver.start()
        try:
            token = uuid.uuid4().hex
            entry = StorageIndexEntry(StorageIndexName.RUNS_RUNNABLE, ("named", token), ("2026",))
            await create(driver, record(StorageRecordKey("named-run", token), {"n": 1}, entry))
            query = StorageQuery(StorageIndexName.RUNS_RUNNABLE, ("named", token), StorageRange(), limit=1)
            assert len((await driver.query(query)).items) == 1
            conn = await driver._acquire()
            try:
                cursor = await conn.execute("SELECT name, statement FROM pg_prepared_statements")
                rows = await cursor.fetchall()
            finally:
                await driver._return(conn)
        finally:
            await driver.close()
        for name, text in rows:
            prepared.setdefault(name, set()).add(text)
    assert any(".runlane_commit($1" in text for texts in prepared.values() for text in texts), prepared
    assert all(len(texts) == 1 for texts in prepared.values()), prepared


async def test_a_pooler_in_transaction_mode_is_refused_at_start_and_one_in_session_mode_serves(
    schemas: Schemas, shared_schema: str
) -> None:
    # Clients of a transaction-mode pool take turns on server sessions: the driver's prepared statements,
    # settings and LISTEN would land in sessions other clients then use.
    with pgbouncer(schemas.url, "transaction") as url:
        driver = postgres_storage(url, schema=shared_schema, connect_timeout=5)
        error = await expect_error(asyncio.wait_for(driver.start(), 30), ErrorCode.CONFIGURATION_INVALID)
        assert "shares server sessions between clients" in error.message, error.message
        assert "pool_mode = session" in error.message, error.message
    with pgbouncer(schemas.url, "session") as url:
        driver = postgres_storage(url, schema=shared_schema, connect_timeout=5)
        await asyncio.wait_for(driver.start(), 30)
        try:
            key = StorageRecordKey("pooled", uuid.uuid4().hex)
            await create(driver, record(key, {"n": 1}))
            (read,) = await driver.get([key])
            assert read is not None and read.document.value == {"n": 1}
        finally:
            await driver.close()


async def test_a_prepared_statement_gone_from_the_session_is_a_configuration_error_naming_poolers(
    schemas: Schemas, shared_schema: str
) -> None:
    # What a pooler sharing sessions does when the check at start could not tell (another client took
    # the server session meanwhile): the statement the connection prepared is not in the session it gets.
    driver = postgres_storage(schemas.url, schema=shared_schema, min_size=0, max_size=1)
    await driver.start()
    try:
        key = StorageRecordKey("deallocated", uuid.uuid4().hex)
        assert await driver.get([key]) == [None]
        conn = await driver._acquire()
        try:
            await conn.execute("DEALLOCATE ALL")
        finally:
            await driver._return(conn)
        error = await expect_error(driver.get([key]), ErrorCode.CONFIGURATION_INVALID)
        assert error.meta["sqlstate"] == "26000" and not error.retryable
        assert "transaction or statement pooling" in error.message, error.message
        assert "pool_mode = session" in error.message and "server_reset_query" in error.message, error.message
    finally:
        await driver.close()


async def flush_statistics(driver: Any) -> None:
    """Have the session of a one-connection driver publish its table statistics now."""
    conn = await driver._acquire()
    try:
        await conn.execute("SELECT pg_stat_force_next_flush()")
    finally:
        await driver._return(conn)
    await asyncio.sleep(0.2)


async def test_commits_find_rows_by_key_however_the_tables_grew(schemas: Schemas) -> None:
    """A session whose commits first ran while the tables were tiny keeps checking, replacing and
    removing rows by primary key after the tables grew by 50,000 rows (not analyzed since): the
    commit function never scans a whole table (a join against the payload's lists would be planned
    once per session and could)."""
    schema = await schemas.migrated()
    driver = postgres_storage(schemas.url, schema=schema, min_size=0, max_size=1)
    index_rows = sql.Identifier(schema, "runlane_index_rows")

    def entry(n: int) -> StorageIndexEntry:
        return StorageIndexEntry(StorageIndexName.RUNS_RUNNABLE, ("env", "q"), (f"{n:06}",))

    async def move(key: StorageRecordKey, n: int) -> None:
        async def body(tx: Any) -> None:
            (current,) = await tx.get([key])
            tx.replace(current, record(key, {"n": n}, entry(n)))

        await driver.with_transaction(body)

    await driver.start()
    try:
        key = StorageRecordKey("moving", "one")
        await create(driver, record(key, {"n": 0}, entry(0)))
        await move(key, 1)  # the session's first removal, from a table of one row
        await flush_statistics(driver)
        schemas.execute(
            sql.SQL(
                "INSERT INTO {} (index_name, partition, sort, key) "
                "SELECT 'other', 'p', lpad(g::text, 8, '0'), 'k' || g FROM generate_series(1, 50000) AS g"
            ).format(index_rows)
        )
        schemas.execute(
            sql.SQL(
                "INSERT INTO {} (key, version, document, byte_size) "
                "SELECT 'filler/' || g, g, '{{}}', 2 FROM generate_series(1, 50000) AS g"
            ).format(sql.Identifier(schema, "runlane_records"))
        )
        before = schemas.execute(
            "SELECT relname, seq_scan FROM pg_stat_user_tables WHERE schemaname = %s ORDER BY relname",
            (schema,),
        )
        for n in range(2, 12):
            await move(key, n)
    finally:
        await driver.close()  # the session ends: its table statistics are flushed
    deadline = asyncio.get_running_loop().time() + 1.5  # the ended session's statistics arrive promptly
    while True:
        after = schemas.execute(
            "SELECT relname, seq_scan FROM pg_stat_user_tables WHERE schemaname = %s ORDER BY relname",
            (schema,),
        )
        if after != before or asyncio.get_running_loop().time() > deadline:
            break
        await asyncio.sleep(0.1)
    assert after == before, "a commit scanned a whole table"
    rows = schemas.execute(sql.SQL("SELECT sort FROM {} WHERE index_name = 'runs_runnable'").format(index_rows))
    assert [row[0] for row in rows] == [entry(11).encoded_sort]


async def test_documents_replaced_here_are_recognized_and_others_are_read(schemas: Schemas, shared_schema: str) -> None:
    here = postgres_storage(schemas.url, schema=shared_schema, min_size=0, max_size=2)
    elsewhere = postgres_storage(schemas.url, schema=shared_schema, min_size=0, max_size=2)
    await here.start()
    await elsewhere.start()
    try:
        key = StorageRecordKey("recognized", uuid.uuid4().hex)
        await check_replaced_documents_are_recognized(here, elsewhere, key, record)

        async def delete(tx: Any) -> None:
            (current,) = await tx.get([key])
            tx.delete(current)

        await here.with_transaction(delete)
        assert await here.get([key]) == [None]
    finally:
        await here.close()
        await elsewhere.close()


async def test_pooled_connections_recover_after_a_server_restart(schemas: Schemas, shared_schema: str) -> None:
    from postgres_support import postgres_server

    server = postgres_server()
    if server is None:
        pytest.skip("RUNLANE_POSTGRES_TEST_DATABASE_URL is set: the test cannot restart that server")
    driver = postgres_storage(schemas.url, schema=shared_schema, min_size=2, max_size=2)
    await driver.start()
    try:
        key = StorageRecordKey("restart", uuid.uuid4().hex)
        await create(driver, record(key, {"n": 0}))
        await asyncio.to_thread(server.restart)
        assert (await driver.get([key]))[0].document.value == {"n": 0}, "a dead pooled connection is retried once"

        async def bump(tx: Any) -> int:
            [current] = await tx.get([key])
            value = current.document.value["n"] + 1
            tx.replace(current, record(key, {"n": value}))
            return value

        await asyncio.to_thread(server.restart)
        assert await driver.with_transaction(bump) == 1, "a read-phase disconnect replays on a fresh connection"
        assert (await driver.get([key]))[0].document.value == {"n": 1}

        # A transaction whose first statement is its commit (a blind create) on pooled connections the
        # restart closed: a closed one is never used, so the outcome is never left unknown.
        await asyncio.to_thread(server.restart)
        created = StorageRecordKey("restart", uuid.uuid4().hex)
        await create(driver, record(created, {"blind": True}))
        assert (await driver.get([created]))[0].document.value == {"blind": True}

        await asyncio.to_thread(server.stop_server)
        try:
            loop = asyncio.get_running_loop()
            started = loop.time()
            blind = StorageRecordKey("restart", uuid.uuid4().hex)
            calls = (
                lambda: create(driver, record(blind, {"n": 0})),  # its first statement is the commit
                lambda: driver.get([key]),
                lambda: driver.with_transaction(bump),
            )
            for call in calls:
                error = await expect_error(call(), ErrorCode.STORAGE_UNAVAILABLE)
                assert error.retryable
            assert loop.time() - started < 10, "a server that is down fails calls fast, not after pool_timeout"
        finally:
            await asyncio.to_thread(server.start_server)
        assert await driver.with_transaction(bump) == 2, "the driver works again once the server is back"
    finally:
        await driver.close()


def _server_processes(postmaster: int) -> list[int]:
    """The postmaster and its children (backends, background workers)."""
    found = [postmaster]
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == postmaster:
                found.append(int(entry.name))
    return found


def _managed_postmaster() -> int:
    """The managed test server's postmaster pid; the test is skipped without one (or without /proc)."""
    from postgres_support import postgres_server

    server = postgres_server()
    if server is None or server.pid is None or not Path("/proc").is_dir():
        pytest.skip("needs the managed test server and /proc")
    return server.pid


@contextlib.contextmanager
def _frozen(pids: list[int]) -> Iterator[None]:
    """Stop ``pids`` (SIGSTOP) for the block, as a stalled host would; always continued afterwards."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


async def test_a_server_that_stops_answering_fails_calls_in_time_instead_of_holding_them(
    schemas: Schemas, shared_schema: str
) -> None:
    # A frozen server (a stalled host, a failover in progress): its kernel keeps the connections open and
    # acknowledges what is sent, so neither keepalives nor TCP timeouts end the wait for an answer. A call
    # gives up a little after statement_timeout, as storage_unavailable, and the driver recovers.
    postmaster = _managed_postmaster()
    driver = postgres_storage(schemas.url, schema=shared_schema, min_size=1, max_size=2, statement_timeout=0.5)
    await driver.start()
    try:
        key = StorageRecordKey("frozen", uuid.uuid4().hex)
        await create(driver, record(key, {"n": 0}))
        with _frozen(_server_processes(postmaster)):
            loop = asyncio.get_running_loop()
            started = loop.time()
            # statement_timeout, the margin, then the one retry on a fresh connection that connect_timeout ends.
            error = await expect_error(asyncio.wait_for(driver.get([key]), 40), ErrorCode.STORAGE_UNAVAILABLE)
            assert error.retryable
            assert loop.time() - started < 30, "the call waited for the server instead of giving up"
        assert (await driver.get([key]))[0].document.value == {"n": 0}, "a fresh connection serves the next call"
    finally:
        await driver.close()


async def test_operator_reads_of_a_server_that_stops_answering_fail_in_time(
    schemas: Schemas, shared_schema: str
) -> None:
    # runs list, runs events and runs get (the operator reads) run through psycopg's cursors rather than
    # the driver's own statement calls: they give up on a frozen server in time as well. The four reads
    # wait out one freeze together, each on a pooled connection of its own.
    postmaster = _managed_postmaster()
    driver = postgres_storage(
        schemas.url, schema=shared_schema, min_size=4, max_size=4, statement_timeout=0.5, connect_timeout=1
    )
    await driver.start()
    environment = Environment(name="default")
    calls = {
        "list_runs": lambda: driver.list_runs(RunFilter(environment=environment), PaginationParams()),
        "list_run_events": lambda: driver.list_run_events(
            RunEventFilter(environment=environment, run_id="run_1"), PaginationParams()
        ),
        "get_run": lambda: driver.get_run(environment, "run_1"),
        "explain": lambda: driver.explain(RunFilter(environment=environment), PaginationParams()),
    }

    async def fails_in_time(read: str) -> float:
        started = asyncio.get_running_loop().time()
        error = await expect_error(asyncio.wait_for(calls[read](), 40), ErrorCode.STORAGE_UNAVAILABLE)
        assert error.retryable, read
        return asyncio.get_running_loop().time() - started

    try:
        await asyncio.gather(*(call() for call in calls.values()))
        with _frozen(_server_processes(postmaster)):
            waited = await asyncio.gather(*(fails_in_time(read) for read in calls))
        assert max(waited) < 15, f"a read waited for the server instead of giving up: {dict(zip(calls, waited))}"
        for call in calls.values():
            await call()  # a fresh connection serves the next one
    finally:
        await driver.close()


async def test_stalled_connections_are_left_behind_in_time_when_the_server_still_takes_new_ones(
    schemas: Schemas, shared_schema: str
) -> None:
    # Only the open connections' backends are frozen (the postmaster still accepts new ones): the call
    # gives its stalled connection up, the check of the other idle ones is not waited for beyond the
    # answer deadline, and the retry on a fresh connection succeeds.
    _managed_postmaster()
    driver = postgres_storage(schemas.url, schema=shared_schema, min_size=2, max_size=4, statement_timeout=0.5)
    await driver.start()
    try:
        key = StorageRecordKey("stalled", uuid.uuid4().hex)
        await create(driver, record(key, {"n": 1}))
        with psycopg.connect(schemas.url, autocommit=True) as admin:
            frozen = [row[0] for row in admin.execute(
                "SELECT pid FROM pg_stat_activity WHERE application_name = 'runlane' AND pid <> pg_backend_pid()"
            ).fetchall()]  # fmt: skip
        assert frozen
        with _frozen(frozen):
            loop = asyncio.get_running_loop()
            started = loop.time()
            found = await asyncio.wait_for(driver.get([key]), 60)
            assert found[0] is not None and found[0].document.value == {"n": 1}
            assert loop.time() - started < 25, "the call waited for the stalled connections' check"
    finally:
        await driver.close()


# ---------------------------------------------------------------------------------------------
# Wake hints


async def test_wake_hints_reach_subscribers_of_other_instances(schemas: Schemas, shared_schema: str) -> None:
    from runlane.storage import supports_wake_hints

    publisher = postgres_storage(schemas.url, schema=shared_schema, min_size=0)
    listener = postgres_storage(schemas.url, schema=shared_schema, min_size=0)
    elsewhere = postgres_storage(schemas.url, schema=await schemas.migrated(), min_size=0)
    assert supports_wake_hints(publisher)
    for driver in (publisher, listener, elsewhere):
        await driver.start()
    try:
        received: asyncio.Queue[str] = asyncio.Queue()
        foreign: list[str] = []
        unsubscribe = listener.subscribe_wake_hints(received.put_nowait)
        stop_foreign = elsewhere.subscribe_wake_hints(foreign.append)
        deadline = asyncio.get_running_loop().time() + 10
        got: set[str] = set()
        while got != {"emails", "reports"}:  # the listener may still be connecting: publish until heard
            assert asyncio.get_running_loop().time() < deadline, f"no wake hint arrived (got {got})"
            publisher.publish_wake_hint("emails")
            publisher.publish_wake_hint("reports")
            with contextlib.suppress(TimeoutError):
                got.add(await asyncio.wait_for(received.get(), 0.2))
        assert foreign == [], "hints never cross into another schema"
        unsubscribe()
        stop_foreign()
        publisher.publish_wake_hint(123)  # type: ignore[arg-type]  # ignored, never raises
    finally:
        for driver in (publisher, listener, elsewhere):
            await driver.close()
    publisher.publish_wake_hint("after-close")  # a closed driver drops hints silently


class _CancellationWaiters:
    """Runtimes over the shared schema with one task, ``waits_for_cancellation``: its run with payload
    ``{"n": n}`` sets ``started[n]`` as it starts, then ``observed[n]`` once its attempt sees a cancellation."""

    def __init__(self, shared_schema: str) -> None:
        self.started: dict[int, asyncio.Event] = {}
        self.observed: dict[int, asyncio.Event] = {}
        self.queue = queue("default", default=True)

        @task("waits_for_cancellation", queue=self.queue)
        async def waits_for_cancellation(payload: dict[str, Any], ctx: Any) -> None:
            self.started[payload["n"]].set()
            for _ in range(3000):
                if ctx.signal.aborted:
                    self.observed[payload["n"]].set()
                    return
                await asyncio.sleep(0.01)

        self.task = waits_for_cancellation
        self.schema = shared_schema

    def runtime(self, url: str) -> Any:
        lane = postgres_polling_lane(url, schema=self.schema)
        return create_runlane(lane=lane, queues=[self.queue], tasks=[self.task])

    async def trigger(self, runtime: Any, n: int) -> str:
        """Trigger run ``n`` and wait until its attempt has started; its run id."""
        self.started[n], self.observed[n] = asyncio.Event(), asyncio.Event()
        triggered = await runtime.trigger(self.task, {"n": n})
        await asyncio.wait_for(self.started[n].wait(), 30)
        return str(triggered.run.id)


def _named(url: str, application_name: str) -> str:
    return url + ("&" if "?" in url else "?") + f"application_name={application_name}"


async def _terminate_backend(schemas: Schemas, application_name: str, query_like: str) -> None:
    """Terminate the server session of ``application_name`` whose last query is like ``query_like``, once
    it exists (waiting for it up to 10 s)."""
    find = sql.SQL("SELECT pid FROM pg_stat_activity WHERE application_name = {} AND query LIKE {}").format(
        sql.Literal(application_name), sql.Literal(query_like)
    )
    for _ in range(1000):
        if rows := schemas.execute(find):
            schemas.execute(sql.SQL("SELECT pg_terminate_backend({})").format(sql.Literal(rows[0][0])))
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"no session of {application_name} ran a query like {query_like!r}")


async def test_a_cancellation_requested_while_the_listener_reconnects_reaches_the_attempt_at_once(
    schemas: Schemas, shared_schema: str
) -> None:
    # The worker process's listening connection is lost (a restart, an idle_session_timeout, a network cut)
    # just before another process cancels its run: the hint sent meanwhile is lost, and the attempt used to
    # observe the request only at its next heartbeat, half a lease later.
    name = f"runlane_listener_{uuid.uuid4().hex[:8]}"
    waiters = _CancellationWaiters(shared_schema)
    async with waiters.runtime(_named(schemas.url, name)) as working, waiters.runtime(schemas.url) as cancelling:
        worker = working.worker(mode=WorkerMode.POLL, lease_duration="60s")
        try:
            run_id = await waiters.trigger(cancelling, 0)
            await _terminate_backend(schemas, name, "LISTEN%")
            await cancelling.runs.cancel(run_id)
            await asyncio.wait_for(waiters.observed[0].wait(), 10)
        finally:
            worker.request_stop()
            await asyncio.wait_for(worker.wait_closed(), 30)


async def test_a_cancellation_hint_after_the_server_closed_the_hints_connection_still_arrives_at_once(
    schemas: Schemas, shared_schema: str
) -> None:
    # The cancelling process keeps one connection for the hints it sends; the server closed it while it sat
    # idle (a restart, an idle_session_timeout). The next cancellation's hint used to be lost on it, and the
    # attempt observed the request only at its next heartbeat, half a lease later.
    name = f"runlane_hints_{uuid.uuid4().hex[:8]}"
    waiters = _CancellationWaiters(shared_schema)
    async with waiters.runtime(schemas.url) as working, waiters.runtime(_named(schemas.url, name)) as cancelling:
        worker = working.worker(mode=WorkerMode.POLL, concurrency=2, lease_duration="60s")
        try:
            first = await waiters.trigger(cancelling, 0)
            await cancelling.runs.cancel(first)  # its hint opens the connection hints are sent on
            await asyncio.wait_for(waiters.observed[0].wait(), 10)
            second = await waiters.trigger(cancelling, 1)
            await _terminate_backend(schemas, name, "%pg_notify%")
            await asyncio.sleep(0.1)
            await cancelling.runs.cancel(second)
            await asyncio.wait_for(waiters.observed[1].wait(), 10)
        finally:
            worker.request_stop()
            await asyncio.wait_for(worker.wait_closed(), 30)


async def test_hint_senders_and_listeners_of_a_loop_that_stopped_are_replaced(
    schemas: Schemas, shared_schema: str
) -> None:
    """The sender of held-back hints runs on the loop that held the first one back, and the listener
    on the loop that subscribed first. When that loop stops meanwhile (a loop closed with its tasks
    pending, say), the next hint held back, or the next subscription, on a live loop starts one
    there instead of waiting forever behind the dead one."""
    import threading

    publisher = postgres_storage(schemas.url, schema=shared_schema, min_size=0)
    listener = postgres_storage(schemas.url, schema=shared_schema, min_size=0)
    await publisher.start()
    await listener.start()
    try:
        received: asyncio.Queue[str] = asyncio.Queue()
        unsubscribe = listener.subscribe_wake_hints(received.put_nowait)

        def other_loop() -> None:
            async def hold_back() -> None:
                publisher.subscribe_wake_hints(lambda queue: None)  # its listener dies with this loop
                publisher.publish_wake_hint("first")  # goes out at once
                publisher.publish_wake_hint("held")  # within the interval: its sender waits...
                await asyncio.sleep(0)  # ...and the loop stops before it sends

            loop = asyncio.new_event_loop()
            try:
                loop.run_until_complete(hold_back())
            finally:
                loop.close()

        thread = threading.Thread(target=other_loop)
        thread.start()
        await asyncio.to_thread(thread.join, 10)
        deadline = asyncio.get_running_loop().time() + 10
        got: set[str] = set()
        while "late" not in got:  # the listener may still be connecting: publish until heard
            assert asyncio.get_running_loop().time() < deadline, f"the held-back hint never went out (got {got})"
            publisher.publish_wake_hint("late")
            with contextlib.suppress(TimeoutError):
                got.add(await asyncio.wait_for(received.get(), 0.2))
        unsubscribe()
        heard: asyncio.Queue[str] = asyncio.Queue()
        stop_hearing = publisher.subscribe_wake_hints(heard.put_nowait)  # a listener on this loop
        while True:
            assert asyncio.get_running_loop().time() < deadline, "the new subscription never heard a hint"
            listener.publish_wake_hint("heard")
            with contextlib.suppress(TimeoutError):
                if await asyncio.wait_for(heard.get(), 0.2) == "heard":
                    break
        stop_hearing()
    finally:
        await publisher.close()
        await listener.close()


# ---------------------------------------------------------------------------------------------
# Lane and plugin

_queue = queue("pg-driver-tests", default=True)


@task("pg_driver_tests.echo", queue=_queue)
async def _echo(payload: dict) -> dict:
    return {"echo": payload}


def _runtime(url: str, schema: str) -> Any:
    return create_runlane(lane=postgres_polling_lane(url, schema=schema, min_size=0), queues=[_queue], tasks=[_echo])


async def _one_finished_run(runtime: Any) -> str:
    created = await runtime.trigger(_echo, {"n": 1})
    finished = await runtime.execute_next()
    assert finished is not None and finished.id == created.run.id
    return created.run.id


async def test_a_trigger_sends_its_wake_hint_inside_its_commit(schemas: Schemas, monkeypatch: pytest.MonkeyPatch) -> None:
    """A trigger's hint rides in its commit (NOTIFY delivered when it commits; no statement of its
    own); a trigger that fails sends none; hints for one queue stay at most one per interval."""
    schema = await schemas.migrated()
    listener = postgres_storage(schemas.url, schema=schema, min_size=0)
    await listener.start()
    runtime = _runtime(schemas.url, schema)
    try:
        received: asyncio.Queue[str] = asyncio.Queue()
        unsubscribe = listener.subscribe_wake_hints(received.put_nowait)
        async with runtime:
            driver = runtime.lane.storage
            # Long enough that the second trigger below always falls inside it, however slow this
            # machine is (the default is a few milliseconds).
            driver.wake_hint_interval = 0.5
            statements: list[bytes] = []  # NOTIFY statements of their own
            call = pg_storage._call

            async def counting(conn: Any, statement: Any, params: Any) -> Any:
                if statement is pg_storage._NOTIFY:
                    statements.append(b"NOTIFY")
                return await call(conn, statement, params)

            monkeypatch.setattr(pg_storage, "_call", counting)
            deadline = asyncio.get_running_loop().time() + 10
            heard = None
            while heard is None:  # the listener may still be connecting: trigger until heard
                assert asyncio.get_running_loop().time() < deadline, "no wake hint arrived"
                await asyncio.sleep(driver.wake_hint_interval)
                await runtime.trigger(_echo, {"n": 1})
                with contextlib.suppress(TimeoutError):
                    heard = await asyncio.wait_for(received.get(), 0.3)
            assert heard == _queue.name
            assert statements == [], "the hint needed a NOTIFY statement of its own"
            # A second trigger at once: debounced, it goes out after the interval (not lost).
            await runtime.trigger(_echo, {"n": 2})
            assert await asyncio.wait_for(received.get(), 5) == _queue.name
            assert statements == [b"NOTIFY"]
            # A trigger that fails commits nothing, so it wakes nobody.
            await asyncio.sleep(driver.wake_hint_interval * 2)
            while not received.empty():
                received.get_nowait()
            await runtime.trigger(_echo, {"n": 3}, singleton_key="only-one")
            assert await asyncio.wait_for(received.get(), 5) == _queue.name
            await asyncio.sleep(driver.wake_hint_interval * 2)
            with pytest.raises(RunlaneError) as refused:
                await runtime.trigger(_echo, {"n": 4}, singleton_key="only-one")
            assert is_storage_conflict(refused.value)
            await asyncio.sleep(0.3)
            assert received.empty()
            # A hint held back within the interval rides with the next commit once due: while
            # commits keep coming, held-back hints need no statement of their own.
            statements.clear()
            await runtime.trigger(_echo, {"n": 5})  # due: in its commit
            await runtime.trigger(_echo, {"n": 6})  # within the interval: held back
            await asyncio.sleep(driver.wake_hint_interval * 1.2)
            await runtime.trigger(_echo, {"n": 7})  # carries the held-back hint
            await asyncio.sleep(driver.wake_hint_interval * 2)  # past the point a statement would go out
            assert statements == []
            assert [received.get_nowait() for _ in range(received.qsize())] == [_queue.name, _queue.name]
        unsubscribe()
    finally:
        await listener.close()


async def test_postgres_polling_lane_runs_tasks_end_to_end(schemas: Schemas) -> None:
    schema = await schemas.migrated()
    lane = postgres_polling_lane(f"{schemas.url}?schema={schema}")
    assert lane.name == "postgres-polling"
    assert lane.capabilities.production_durable and lane.capabilities.operator_reads
    assert lane.storage.schema == schema
    runtime = _runtime(schemas.url, schema)
    async with runtime:
        run_id = await _one_finished_run(runtime)
        run = await runtime.runs.get(run_id)
        assert run is not None and run.status.value == "succeeded" and run.output == {"echo": {"n": 1}}
        page = await runtime.runs.list()
        assert [summary.id for summary in page.data] == [run_id]
        events = await runtime.runs.events(run_id)
        assert [event.sequence for event in events.data] == list(range(1, len(events.data) + 1))


def test_plugin_registers_the_lane_and_the_storage_driver() -> None:
    registries = get_registries()
    lane_provider = registries.lanes.get("postgres-polling")
    assert lane_provider.plugin == "postgres"
    options = validate_options(lane_provider, {"url": "postgresql://db/app", "schema": "tenant"})
    assert isinstance(options, PostgresPollingLaneOptions)
    assert (options.connection_string, options.schema) == ("postgresql://db/app", "tenant")
    assert options.name == "postgres-polling"
    same = validate_options(lane_provider, {"connection_string": "postgresql://db/app"})
    assert same.connection_string == "postgresql://db/app" and same.schema is None
    with pytest.raises(RunlaneError) as info:
        validate_options(lane_provider, {"url": "postgresql://db/app", "shema": "typo"})
    assert info.value.code is ErrorCode.CONFIGURATION_INVALID and "shema" in info.value.message
    with pytest.raises(RunlaneError):
        validate_options(lane_provider, {"schema": "tenant"})  # no connection string
    with pytest.raises(RunlaneError) as info:  # both spellings: which one was meant?
        validate_options(lane_provider, {"url": "postgresql://db/a", "connection_string": "postgresql://db/b"})
    assert "(plugin 'postgres'): set connection_string or its alias url, not both. Allowed keys" in info.value.message
    lane = lane_provider.create(options, None)
    assert lane.name == "postgres-polling" and lane.storage.schema == "tenant"
    storage_provider = registries.storage_drivers.get("postgres")
    driver = storage_provider.create(validate_options(storage_provider, {"url": "postgresql://db/app?schema=s"}), None)
    assert driver.schema == "s" and driver.name == "postgres-storage"


# ---------------------------------------------------------------------------------------------
# CLI: runlane postgres sql / migrate


def test_cli_sql_prints_the_migration(tmp_path: Path) -> None:
    result = cli(tmp_path, "postgres", "sql")
    assert result.returncode == 0, result.stderr
    assert result.stdout == postgres_migration_sql()
    named = cli(tmp_path, "postgres", "sql", "--schema", "tenant_9")
    assert named.returncode == 0 and named.stdout == postgres_migration_sql("tenant_9")
    as_json = cli(tmp_path, "--json", "postgres", "sql", "--schema", "tenant_9")
    assert json.loads(as_json.stdout) == {"schema": "tenant_9", "sql": postgres_migration_sql("tenant_9")}
    bad = cli(tmp_path, "postgres", "sql", "--schema", "not-valid")
    assert bad.returncode == 1 and "error[configuration_invalid]" in bad.stderr and bad.stdout == ""
    usage = cli(tmp_path, "postgres", "sql", "--no-such-flag")
    assert usage.returncode == 2


@pytest.mark.parametrize(
    ("lane", "schema"),
    [
        ('use = "postgres-polling"\nconnection_string = "postgresql://db/app"\nschema = "billing"\n', "billing"),
        ('use = "postgres-polling"\nconnection_string = "postgresql://db/app?schema=orders"\n', "orders"),
        ('use = "sqlite"\npath = "runlane.db"\n', "public"),
    ],
    ids=["schema-option", "schema-in-url", "not-postgres"],
)
def test_cli_sql_is_for_the_configured_lane_s_schema_unless_told_otherwise(
    tmp_path: Path, lane: str, schema: str
) -> None:
    # The SQL a DBA generates for their migration tool matches what `runlane postgres migrate` applies.
    (tmp_path / "runlane.toml").write_text(f"[lane]\n{lane}")
    result = cli(tmp_path, "--json", "postgres", "sql")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["schema"] == schema
    told = cli(tmp_path, "--json", "postgres", "sql", "--schema", "elsewhere")
    assert json.loads(told.stdout)["schema"] == "elsewhere"


def test_cli_migrate_with_url_and_with_the_configured_lane(tmp_path: Path, schemas: Schemas) -> None:
    schema = schemas.name()
    url = f"{schemas.url}?schema={schema}"
    first = cli(tmp_path, "postgres", "migrate", "--url", url)
    assert first.returncode == 0, first.stderr
    assert f"migrated schema '{schema}'" in first.stdout and f"version {SCHEMA_VERSION}" in first.stdout
    again = cli(tmp_path, "--json", "postgres", "migrate", "--url", url)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout) == {
        "schema": schema,
        "database": resolve_postgres_connection(url).display,
        "previous_version": SCHEMA_VERSION,
        "version": SCHEMA_VERSION,
        "changed": False,
        "other_schemas": [],
    }
    # Applied again, it puts back what was dropped by hand, and says it did not just look.
    schemas.execute(sql.SQL("DROP FUNCTION {}.runlane_commit(jsonb)").format(sql.Identifier(schema)))
    repaired = cli(tmp_path, "postgres", "migrate", "--url", url)
    assert repaired.returncode == 0, repaired.stderr
    applied_again = "applied again, so each of its tables, indexes and functions is in place"
    assert f"is already at version {SCHEMA_VERSION}; {applied_again}" in repaired.stdout
    function = sql.SQL("SELECT to_regprocedure({})").format(sql.Literal(f'"{schema}".runlane_commit(jsonb)'))
    assert schemas.execute(function)[0][0] is not None
    # A schema an earlier version created is upgraded, and says so.
    earlier = sql.SQL("DELETE FROM {}.runlane_schema_migrations WHERE version >= 2").format(sql.Identifier(schema))
    schemas.execute(earlier)
    upgraded = cli(tmp_path, "postgres", "migrate", "--url", url)
    assert upgraded.returncode == 0, upgraded.stderr
    assert f"upgraded schema '{schema}'" in upgraded.stdout
    assert f"from version 1 to version {SCHEMA_VERSION}" in upgraded.stdout

    configured = schemas.name()
    write(tmp_path / "app" / "__init__.py", "")
    write(tmp_path / "app" / "tasks.py", "from runlane import queue\n\ndefault = queue('default', default=True)\n")
    write(tmp_path / "runlane.toml", _polling_config(schemas.url, configured))
    before = cli(tmp_path, "runs", "list")
    assert before.returncode == 1 and "runlane postgres migrate" in before.stderr
    migrated = cli(tmp_path, "postgres", "migrate")
    assert migrated.returncode == 0, migrated.stderr
    assert f"migrated schema '{configured}'" in migrated.stdout
    after = cli(tmp_path, "--json", "runs", "list")
    assert after.returncode == 0, after.stderr
    assert json.loads(after.stdout)["data"] == []

    unreachable = cli(tmp_path, "postgres", "migrate", "--url", f"postgresql://postgres@127.0.0.1:{closed_port()}/db")
    assert unreachable.returncode == 1 and "error[storage_unavailable]" in unreachable.stderr
    wrong_scheme = cli(tmp_path, "--json", "postgres", "migrate", "--url", "mysql://db/app")
    assert wrong_scheme.returncode == 1
    assert json.loads(wrong_scheme.stderr)["error"]["code"] == "configuration_invalid"


def test_cli_migrate_and_sql_use_the_lane_of_a_configured_runtime_factory(tmp_path: Path, schemas: Schemas) -> None:
    # `runlane init config --runtime app.runtime:create` writes no [lane]: the factory builds it.
    schema = schemas.name()
    write(tmp_path / "app" / "__init__.py", "")
    write(
        tmp_path / "app" / "runtime.py",
        f"""
        from runlane import create_runlane, queue
        from runlane_postgres import postgres_polling_lane

        default = queue("default", default=True)


        def create():
            return create_runlane(lane=postgres_polling_lane("{schemas.url}", schema="{schema}"), queues=[default])
        """,
    )
    write(tmp_path / "runlane.toml", '[runlane]\nruntime = "app.runtime:create"\n')
    generated = cli(tmp_path, "--json", "postgres", "sql")
    assert generated.returncode == 0, generated.stderr
    assert json.loads(generated.stdout)["schema"] == schema
    migrated = cli(tmp_path, "postgres", "migrate")
    assert migrated.returncode == 0, migrated.stderr
    assert f"migrated schema '{schema}'" in migrated.stdout
    listed = cli(tmp_path, "--json", "runs", "list")
    assert listed.returncode == 0, listed.stderr

    # A factory whose lane is not on Postgres: migrate names --url, sql is for public.
    write(
        tmp_path / "app" / "runtime.py",
        """
        from runlane import create_runlane, queue
        from runlane_local import sqlite_lane

        default = queue("default", default=True)


        def create():
            return create_runlane(lane=sqlite_lane("runlane.db"), queues=[default])
        """,
    )
    refused = cli(tmp_path, "postgres", "migrate")
    assert refused.returncode == 1 and "error[configuration_invalid]" in refused.stderr
    assert "does not keep its runs in Postgres; pass --url" in refused.stderr
    assert json.loads(cli(tmp_path, "--json", "postgres", "sql").stdout)["schema"] == "public"


def _polling_config(url: str, schema: str) -> str:
    """A runlane.toml of the ``app.tasks`` module on the postgres-polling lane of ``url`` and ``schema``."""
    return (
        f'[runlane]\ntasks = ["app.tasks"]\n\n[lane]\nuse = "postgres-polling"\n'
        f'connection_string = "{url}"\nschema = "{schema}"\n'
    )


def test_runs_wait_waits_out_a_server_restart_quietly(tmp_path: Path) -> None:
    """runlane runs wait on a server that stops and comes back: it goes on waiting, and shows the run once
    it finishes, without a bare warning line from the connection pool about the connections it discarded."""
    import subprocess
    import time

    from cli_support import RUNLANE, cli_env, wait_for
    from postgres_support import restartable_postgres_server

    server, schema = restartable_postgres_server("runlane_driver")
    write(tmp_path / "app" / "__init__.py", "")
    write(
        tmp_path / "app" / "tasks.py",
        """
        from runlane import queue, task

        default = queue("default", default=True)

        @task("echo", queue=default)
        def echo(payload: dict) -> dict:
            return payload
        """,
    )
    write(tmp_path / "runlane.toml", _polling_config(server.url, schema))
    triggered = cli(tmp_path, "--json", "trigger", "echo", "{}")
    assert triggered.returncode == 0, triggered.stderr
    run_id = json.loads(triggered.stdout)["run"]["id"]
    assert RUNLANE is not None
    waiting = subprocess.Popen(
        [RUNLANE, "runs", "wait", run_id], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=cli_env(),
    )  # fmt: skip
    try:
        reading = sql.SQL("SELECT count(*) FROM pg_stat_activity WHERE query LIKE {}").format(
            sql.Literal(f'%"{schema}".runlane_records%')
        )
        # The wait reads the run on a pooled connection, again each second once it has waited a while:
        # stop the server under it then.
        wait_for(lambda: psycopg.connect(server.url, autocommit=True).execute(reading).fetchone()[0], what="the wait")
        time.sleep(3)
        server.stop_server()
        time.sleep(3)  # reads failing meanwhile, once a second
        assert waiting.poll() is None, waiting.communicate()
        server.start_server()
        drained = cli(tmp_path, "work", "--drain")
        assert drained.returncode == 0, drained.stderr
        stdout, stderr = waiting.communicate(timeout=60)
    finally:
        if waiting.poll() is None:
            waiting.kill()
        server.start_server()
    assert waiting.returncode == 0, stderr
    assert stderr == "" and run_id in stdout and "succeeded" in stdout


def test_cli_migrate_warns_when_it_creates_a_schema_named_like_one_the_database_holds(
    tmp_path: Path, schemas: Schemas
) -> None:
    # A lane's schema misspelt or in another case: migrate created an empty schema beside the one holding the
    # runs, and the workers then started on it.
    migrated = asyncio.run(schemas.migrated())
    for meant in (migrated.upper(), migrated[:-1] + ("x" if migrated[-1] != "x" else "y")):
        schemas.created.append(meant)
        done = cli(tmp_path, "postgres", "migrate", "--url", schemas.url, "--schema", meant)
        assert done.returncode == 0, done.stderr
        assert f"migrated schema {meant!r}" in done.stdout
        assert f"warning: created the Runlane schema {meant!r}" in done.stderr, done.stderr
        assert repr(migrated) in done.stderr and f'DROP SCHEMA "{meant}" CASCADE' in done.stderr
        again = cli(tmp_path, "postgres", "migrate", "--url", schemas.url, "--schema", meant, "--json")
        assert again.returncode == 0 and "warning" not in again.stderr, again.stderr  # only when it creates it
        assert json.loads(again.stdout)["other_schemas"] == []
    unlike = "unlike_" + uuid.uuid4().hex[:8]
    schemas.created.append(unlike)
    done = cli(tmp_path, "postgres", "migrate", "--url", schemas.url, "--schema", unlike, "--json")
    assert done.returncode == 0 and "warning" not in done.stderr, done.stderr  # another environment's schema, say
    assert json.loads(done.stdout)["changed"] is True


def test_cli_migrate_needs_a_postgres_lane_or_a_url(tmp_path: Path) -> None:
    no_config = cli(tmp_path, "postgres", "migrate")
    assert no_config.returncode == 1 and "error[configuration_invalid]" in no_config.stderr
    write(tmp_path / "runlane.toml", '[runlane]\ntasks = []\n\n[lane]\nuse = "local"\n')
    local = cli(tmp_path, "postgres", "migrate")
    assert local.returncode == 1 and "--url" in local.stderr


@pytest.mark.parametrize(
    ("options", "refusal"),
    [
        ("min_size = 5\nmax_size = 2", "min_size must not exceed max_size"),
        ('url = "mysql://db/app"', "must start with postgres:// or postgresql://"),
        ('url = "postgresql://127.0.0.1/app?schema=bad-name"', "Invalid Postgres schema 'bad-name'"),
    ],
)
def test_cli_migrate_and_sql_refuse_lane_settings_every_command_refuses(
    tmp_path: Path, options: str, refusal: str
) -> None:
    # migrate applied, and sql printed, the schema of a lane whose settings its workers then refused at
    # start; and the URL's mistakes were not said to be the config file's.
    url = "" if options.startswith("url") else 'url = "postgresql://127.0.0.1:1/app"\n'
    write(tmp_path / "runlane.toml", f'[runlane]\ntasks = []\n\n[lane]\nuse = "postgres-polling"\n{url}{options}\n')
    for command in (("postgres", "migrate"), ("postgres", "sql")):
        done = cli(tmp_path, *command)
        assert done.returncode == 1, done.stdout
        assert "error[configuration_invalid]: runlane.toml: " in done.stderr and refusal in done.stderr, done.stderr
        assert "Traceback" not in done.stderr and done.stdout == ""


def test_a_sync_producer_that_exits_without_close_closes_its_connections_quietly(
    tmp_path: Path, schemas: Schemas
) -> None:
    # A web app's producer (runlane.sync) rarely has a place to call close(): at exit the runtime the
    # facade started is closed, so no pooled connection task is dropped with the facade's thread.
    import subprocess
    import sys

    schema = asyncio.run(schemas.migrated())
    script = tmp_path / "producer.py"
    write(
        script,
        f"""
        from runlane import create_runlane, queue, task
        from runlane_postgres import postgres_polling_lane

        default = queue("default", default=True)


        @task("emails.send")
        def send(payload: dict) -> None:
            return None


        lane = postgres_polling_lane("{schemas.url}", schema="{schema}")
        runlane = create_runlane(lane=lane, queues=[default], tasks=[send])
        print(runlane.sync.trigger(send, {{"to": "a@example.com"}}).outcome.value)
        """,
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "created"
    assert done.stderr == ""
