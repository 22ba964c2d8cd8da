"""runlane-postgres as an operator runs it: a schema a newer release migrated, the driver failure kept
behind every mapped error, reserved schema names, and the timeouts of a ``runlane.toml`` lane.

Every test that touches the database works in schemas of its own (``runlane_ops_*``), dropped when the
module ends.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psycopg
import pytest
from cli_support import cli, write
import postgres_support
from postgres_support import INVALID_TIMEOUTS, Schemas
from psycopg import errors as pg_errors
from psycopg import sql
from runlane_postgres import (
    apply_postgres_migrations,
    map_postgres_error,
    postgres_migration_sql,
    postgres_polling_lane,
    postgres_storage,
)
from runlane_postgres.migration import SCHEMA_VERSION, validate_schema_name

from runlane import TaskContext, WorkerMode, create_runlane, queue, task
from runlane.errors import ErrorCode, RunlaneError
from runlane.plugins.manager import get_registries
from runlane.plugins.registries import ProviderContext, validate_options
from runlane.storage import NewStorageRecord, StorageDocument, StorageRecordKey
from runlane.testing import ControlledClock


@pytest.fixture(scope="module")
def schemas(postgres_url: str) -> Iterator[Schemas]:
    created = Schemas(postgres_url, "runlane_ops")
    try:
        yield created
    finally:
        created.drop_all()


async def expect_error(awaitable: Any, code: ErrorCode) -> RunlaneError:
    with pytest.raises(RunlaneError) as info:
        await awaitable
    assert info.value.code is code, f"expected {code.value}, got {info.value.code.value}: {info.value.message}"
    return info.value


# ---------------------------------------------------------------------------------------------
# A schema a newer release migrated

MARKER = "migrated by a newer release"


def from_the_future(schemas: Schemas, schema: str, *, needs: int = SCHEMA_VERSION + 1, functions: bool = True) -> None:
    """What a newer release's migration leaves: a later version in the ledger, which drivers from
    version ``needs`` on may use, and (with ``functions``) functions of its own."""
    name = sql.Identifier(schema)
    schemas.execute(
        sql.SQL(
            "INSERT INTO {}.runlane_schema_migrations (version, name, min_driver_version) VALUES (%s, 'future', %s)"
        ).format(name),
        (SCHEMA_VERSION + 1, needs),
    )
    if not functions:
        return
    schemas.execute(
        sql.SQL(
            "CREATE OR REPLACE FUNCTION {}.runlane_commit_batch(locks jsonb, attempts jsonb) "
            "RETURNS TABLE (commit_status integer, commit_state text, commit_message text, commit_detail text) "
            "LANGUAGE plpgsql AS $body$ BEGIN /* {} */ RETURN; END $body$"
        ).format(name, sql.SQL(MARKER))
    )


def commit_batch_body(schemas: Schemas, schema: str) -> str:
    rows = schemas.execute(
        "SELECT p.prosrc FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
        "WHERE n.nspname = %s AND p.proname = 'runlane_commit_batch'",
        (schema,),
    )
    assert len(rows) == 1
    return str(rows[0][0])


def versions(schemas: Schemas, schema: str) -> list[int]:
    query = sql.SQL("SELECT version FROM {}.runlane_schema_migrations ORDER BY version")
    return [version for (version,) in schemas.execute(query.format(sql.Identifier(schema)))]


async def test_migrate_refuses_a_newer_schema_and_changes_nothing(schemas: Schemas) -> None:
    schema = await schemas.migrated()
    from_the_future(schemas, schema)
    newer = SCHEMA_VERSION + 1
    error = await expect_error(apply_postgres_migrations(schemas.url, schema), ErrorCode.CONFIGURATION_INVALID)
    assert f"is at version {newer}, newer than version {SCHEMA_VERSION}" in error.message
    assert "Nothing was changed" in error.message and "upgrade runlane-postgres" in error.message
    assert error.meta == {"schema": schema, "version": newer, "supported_version": SCHEMA_VERSION}
    assert not error.retryable
    # The newer release's function and ledger are what they were.
    assert MARKER in commit_batch_body(schemas, schema)
    assert versions(schemas, schema) == [*range(1, SCHEMA_VERSION + 1), newer]


async def test_start_refuses_a_newer_schema(schemas: Schemas) -> None:
    schema = await schemas.migrated()
    from_the_future(schemas, schema)
    driver = postgres_storage(schemas.url, schema=schema, min_size=0)
    error = await expect_error(driver.start(), ErrorCode.CONFIGURATION_INVALID)
    assert f"is at version {SCHEMA_VERSION + 1}, newer than version {SCHEMA_VERSION}" in error.message
    assert "Upgrade runlane-postgres" in error.message
    # Not started: nothing was written through the newer release's functions.
    await expect_error(driver.get([StorageRecordKey("c", "k")]), ErrorCode.STORAGE_UNAVAILABLE)


def test_cli_migrate_refuses_a_newer_schema(tmp_path: Path, schemas: Schemas) -> None:
    schema = schemas.name()
    url = f"{schemas.url}?schema={schema}"
    first = cli(tmp_path, "postgres", "migrate", "--url", url)
    assert first.returncode == 0, first.stderr
    from_the_future(schemas, schema)
    refused = cli(tmp_path, "postgres", "migrate", "--url", url)
    assert refused.returncode == 1, refused.stdout
    assert "error[configuration_invalid]" in refused.stderr and "Traceback" not in refused.stderr
    assert f"version {SCHEMA_VERSION + 1}" in refused.stderr and "nothing to do" not in refused.stdout
    as_json = cli(tmp_path, "--json", "postgres", "migrate", "--url", url)
    assert as_json.returncode == 1 and json.loads(as_json.stderr)["error"]["code"] == "configuration_invalid"
    assert MARKER in commit_batch_body(schemas, schema)


async def test_a_newer_schema_this_driver_may_use_starts_and_migrating_it_changes_nothing(
    schemas: Schemas, tmp_path: Path
) -> None:
    # A newer release that only added to the schema (indexes, say) records that this release may still
    # use it: a rollout or rollback runs both, and the older one's deploy step must not fail.
    schema = await schemas.migrated()
    from_the_future(schemas, schema, needs=SCHEMA_VERSION)
    newer = SCHEMA_VERSION + 1
    result = await apply_postgres_migrations(schemas.url, schema)
    assert (result.previous_version, result.version, result.changed) == (newer, newer, False)
    assert MARKER in commit_batch_body(schemas, schema)  # this release's SQL was not applied over it
    told = cli(tmp_path, "postgres", "migrate", "--url", f"{schemas.url}?schema={schema}")
    assert told.returncode == 0, told.stderr
    assert f"already at version {newer}; nothing to do" in told.stdout
    assert MARKER in commit_batch_body(schemas, schema)

    # This release's workers run on it (with functions that work, unlike the marker's).
    schema = await schemas.migrated()
    from_the_future(schemas, schema, needs=SCHEMA_VERSION, functions=False)
    work = queue("compatible", default=True)

    @task("ops.compatible", queue=work)
    async def echo(payload: dict) -> dict:
        return payload

    runlane = create_runlane(
        lane=postgres_polling_lane(schemas.url, schema=schema, min_size=0), queues=[work], tasks=[echo]
    )
    async with runlane:
        run = (await runlane.trigger(echo, {"n": 1})).run
        executed = await runlane.execute_next()
        assert executed is not None and (executed.id, executed.output) == (run.id, {"n": 1})


async def test_concurrent_migrations_of_a_newer_schema_all_refuse_it(schemas: Schemas) -> None:
    schema = await schemas.migrated()
    from_the_future(schemas, schema)
    results = await asyncio.gather(
        *(apply_postgres_migrations(schemas.url, schema) for _ in range(3)), return_exceptions=True
    )
    assert [getattr(result, "code", result) for result in results] == [ErrorCode.CONFIGURATION_INVALID] * 3
    assert MARKER in commit_batch_body(schemas, schema)


# ---------------------------------------------------------------------------------------------
# The driver's failure stays behind the mapped error


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (pg_errors.AdminShutdown("terminating connection"), ErrorCode.STORAGE_UNAVAILABLE),
        (pg_errors.SerializationFailure("could not serialize"), ErrorCode.STORAGE_CONFLICT),
        (pg_errors.UndefinedTable('relation "x" does not exist'), ErrorCode.CONFIGURATION_INVALID),
        (pg_errors.InsufficientPrivilege("permission denied for schema x"), ErrorCode.CONFIGURATION_INVALID),
        (pg_errors.DivisionByZero("division by zero"), ErrorCode.INTERNAL_ERROR),
        (psycopg.OperationalError("connection refused"), ErrorCode.STORAGE_UNAVAILABLE),
    ],
)
def test_every_mapped_error_keeps_the_driver_failure_as_its_cause(error: Exception, code: ErrorCode) -> None:
    mapped = map_postgres_error(error, "do something")
    assert mapped.code is code and mapped.__cause__ is error
    assert "cause" not in mapped.to_json()  # server-side detail only


async def test_a_failed_commit_keeps_the_postgres_error_with_its_context(schemas: Schemas) -> None:
    schema = await schemas.migrated()
    driver = postgres_storage(schemas.url, schema=schema, min_size=0)
    await driver.start()
    try:
        # A schema broken under a running driver (a function dropped by hand): the commit fails.
        for function in ("runlane_commit_batch(jsonb, jsonb)", "runlane_commit(jsonb)"):
            schemas.execute(sql.SQL("DROP FUNCTION {}.{}").format(sql.Identifier(schema), sql.SQL(function)))

        async def stage(tx: Any) -> None:
            tx.create(NewStorageRecord(StorageRecordKey("c", "k"), StorageDocument.encode({}), ()))

        error = await expect_error(driver.with_transaction(stage), ErrorCode.CONFIGURATION_INVALID)
        assert "runlane postgres migrate" in error.message
        assert isinstance(error.__cause__, pg_errors.UndefinedFunction)
        assert error.__cause__.sqlstate == error.meta["sqlstate"] == "42883"
    finally:
        await driver.close()


async def test_a_migration_refused_by_the_server_keeps_its_error(schemas: Schemas) -> None:
    with schemas.login_role() as (_, url):
        # The role may not create the schema: the server's refusal is the cause.
        error = await expect_error(apply_postgres_migrations(url, schemas.name()), ErrorCode.CONFIGURATION_INVALID)
        assert isinstance(error.__cause__, pg_errors.InsufficientPrivilege)
        # A role without access to a migrated schema cannot start a driver on it.
        migrated = await schemas.migrated()
        driver = postgres_storage(url, schema=migrated, min_size=0)
        error = await expect_error(driver.start(), ErrorCode.CONFIGURATION_INVALID)
        assert isinstance(error.__cause__, pg_errors.InsufficientPrivilege)

async def test_the_documented_privileges_run_an_application_and_refuse_it_the_migration(schemas: Schemas) -> None:
    # docs/lanes.md ("Privileges"): a migrator owns the schema, the application role gets what it needs
    # through default privileges set before the first migration.
    schema = schemas.name()
    with schemas.login_role() as (migrator, migrator_url), schemas.login_role() as (app, app_url):
        for statement in (
            "CREATE SCHEMA {schema} AUTHORIZATION {migrator}",
            "GRANT USAGE ON SCHEMA {schema} TO {app}",
            "ALTER DEFAULT PRIVILEGES FOR ROLE {migrator} IN SCHEMA {schema} "
            "GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO {app}",
            "ALTER DEFAULT PRIVILEGES FOR ROLE {migrator} IN SCHEMA {schema} GRANT USAGE ON SEQUENCES TO {app}",
            "ALTER DEFAULT PRIVILEGES FOR ROLE {migrator} IN SCHEMA {schema} GRANT EXECUTE ON FUNCTIONS TO {app}",
            # A database that does not let every role run new functions (a common hardening).
            "ALTER DEFAULT PRIVILEGES FOR ROLE {migrator} REVOKE EXECUTE ON FUNCTIONS FROM PUBLIC",
        ):
            names = {"schema": schema, "migrator": migrator, "app": app}
            schemas.execute(sql.SQL(statement).format(**{key: sql.Identifier(value) for key, value in names.items()}))
        assert (await apply_postgres_migrations(migrator_url, schema)).changed
        error = await expect_error(apply_postgres_migrations(app_url, schema), ErrorCode.CONFIGURATION_INVALID)
        assert "permission denied" in error.message, error.message

        work = queue("privileged", default=True, concurrency_limit=2)

        @task("privileged.echo", queue=work, idempotency_key=lambda payload: payload["key"])
        async def echo(payload: dict[str, str], ctx: TaskContext) -> str:
            return await ctx.step.run("echo", lambda token: payload["key"])

        clock = ControlledClock(datetime.now(UTC))
        runtime = create_runlane(
            lane=postgres_polling_lane(app_url, schema=schema), queues=[work], tasks=[echo], clock=clock
        )
        async with runtime:
            first = await runtime.trigger(echo, {"key": "a"})
            done = await runtime.execute_next()
            assert done is not None and done.id == first.run.id and done.output == "a"
            await runtime.tick()
            second = await runtime.trigger(echo, {"key": "b"})
            assert (await runtime.runs.cancel(second.run.id)).status == "cancelled"
            rerun = await runtime.runs.rerun(first.run.id)
            await runtime.worker(mode=WorkerMode.DRAIN).closed
            assert (await runtime.runs.get(rerun.id)).status == "succeeded"  # type: ignore[union-attr]
            await runtime.idempotency_keys.reset(echo, key="a")
            clock.advance("1h")
            assert (await runtime.runs.prune(older_than="1m")).pruned == 3
            assert (await runtime.runs.list()).data == []


# ---------------------------------------------------------------------------------------------
# Schema names Postgres reserves


@pytest.mark.parametrize("schema", ["pg_runlane", "PG_runlane", "Pg_x", "pg_"])
def test_a_pg_schema_name_is_refused_up_front(tmp_path: Path, schema: str) -> None:
    with pytest.raises(RunlaneError) as info:
        validate_schema_name(schema)
    assert info.value.code is ErrorCode.CONFIGURATION_INVALID
    assert "pg_ prefix is reserved by Postgres" in info.value.message and "choose another name" in info.value.message
    with pytest.raises(RunlaneError):
        postgres_migration_sql(schema)
    with pytest.raises(RunlaneError):
        postgres_storage(f"postgresql://db/app?schema={schema}")
    result = cli(tmp_path, "postgres", "migrate", "--url", "postgresql://127.0.0.1:1/db", "--schema", schema)
    assert result.returncode == 1 and "error[configuration_invalid]" in result.stderr
    assert "reserved by Postgres" in result.stderr and "Traceback" not in result.stderr


def test_names_that_only_contain_pg_are_fine() -> None:
    for schema in ("runlane_pg_", "pgrunlane", "_pg_x"):
        assert validate_schema_name(schema) == schema


def test_a_reserved_name_the_server_refuses_is_configuration_invalid() -> None:
    error = pg_errors.ReservedName('unacceptable schema name "pg_x"')
    mapped = map_postgres_error(error, "apply the Runlane migration", migrating=True)
    assert mapped.code is ErrorCode.CONFIGURATION_INVALID and mapped.__cause__ is error
    assert "pg_" in mapped.message and "choose another schema name" in mapped.message


# ---------------------------------------------------------------------------------------------
# Timeouts of a runlane.toml lane


def configured_lane(tmp_path: Path, url: str, options: str) -> Any:
    """The postgres-polling lane of ``runlane.toml`` with ``options``, built as the CLI builds it."""
    return postgres_support.configured_lane(
        tmp_path, f'[lane]\nuse = "postgres-polling"\nconnection_string = "{url}"\n{options}'
    )


def test_toml_lane_timeouts_reach_the_driver(tmp_path: Path) -> None:
    lane = configured_lane(
        tmp_path, "postgresql://db/app", 'statement_timeout = "5m"\npool_timeout = "1500ms"\nconnect_timeout = 3\n'
    )
    storage = lane.storage
    assert (storage.statement_timeout, storage.pool_timeout, storage.connect_timeout) == (300.0, 1.5, 3.0)
    defaults = configured_lane(tmp_path, "postgresql://db/app", "")
    assert (defaults.storage.statement_timeout, defaults.storage.pool_timeout) == (30.0, 30.0)
    assert defaults.storage.connect_timeout == 10.0


def test_the_storage_driver_provider_takes_the_lanes_timeouts() -> None:
    """A plugin lane composing the ``postgres`` storage driver (``context.registries.storage_drivers``)
    configures it with the same keys as ``postgres-polling``, timeouts included."""
    registries = get_registries()
    provider = registries.storage_drivers.get("postgres")
    context = ProviderContext(environment="default", base_dir=Path.cwd(), registries=registries)
    options = {"url": "postgresql://db/app", "statement_timeout": "5m", "pool_timeout": "1500ms", "connect_timeout": 3}
    driver = provider.create(validate_options(provider, options), context)
    assert (driver.statement_timeout, driver.pool_timeout, driver.connect_timeout) == (300.0, 1.5, 3.0)
    assert driver.name == "postgres-storage"
    with pytest.raises(RunlaneError) as info:
        validate_options(provider, {"url": "postgresql://db/app", "pool_timeout": "-1s"})
    assert info.value.code is ErrorCode.CONFIGURATION_INVALID and info.value.meta["keys"] == ["pool_timeout"]


@pytest.mark.parametrize(
    ("option", "value"),
    INVALID_TIMEOUTS,
)
def test_invalid_toml_lane_timeouts_are_configuration_invalid(tmp_path: Path, option: str, value: str) -> None:
    with pytest.raises(RunlaneError) as info:
        configured_lane(tmp_path, "postgresql://db/app", f"{option} = {value}\n")
    assert info.value.code is ErrorCode.CONFIGURATION_INVALID
    assert f"key {option!r}" in info.value.message and info.value.meta["keys"] == [option]
    assert "unknown key" not in info.value.message
    # The CLI says the same, without a traceback.
    result = cli(tmp_path, "runs", "list")
    assert result.returncode == 1 and "error[configuration_invalid]" in result.stderr
    assert option in result.stderr and "Traceback" not in result.stderr


async def test_the_toml_statement_timeout_is_the_one_pooled_connections_use(tmp_path: Path, schemas: Schemas) -> None:
    schema = await schemas.migrated()
    # One set in the URL's options is overridden by the lane's option (docs/lanes.md says so).
    url = f"{schemas.url}?options=-c%20statement_timeout%3D7min"
    lane = configured_lane(tmp_path, url, f'schema = "{schema}"\nmin_size = 0\nstatement_timeout = "5m"\n')
    driver = lane.storage
    await driver.start()
    try:
        conn = await driver._acquire()
        try:
            cursor = await conn.execute("SHOW statement_timeout")
            assert await cursor.fetchone() == ("5min",)
        finally:
            await driver._return(conn)
    finally:
        await driver.close()


class _Skewed:
    def __init__(self, seconds: float) -> None:
        self.offset = timedelta(seconds=seconds)

    def now(self) -> datetime:
        return datetime.now(UTC) + self.offset


@pytest.mark.parametrize(("seconds", "words"), [(30, "30.0 s ahead of"), (-90, "90.0 s behind")])
async def test_a_process_whose_clock_is_off_the_servers_is_warned_at_start(
    schemas: Schemas, caplog: pytest.LogCaptureFixture, seconds: float, words: str
) -> None:
    schema = await schemas.migrated()
    caplog.set_level(logging.WARNING, logger="runlane.clock")
    for clock in (None, _Skewed(seconds)):
        caplog.clear()
        runtime = create_runlane(
            lane=postgres_polling_lane(schemas.url, schema=schema), queues=[queue("default", default=True)], clock=clock
        )
        async with runtime:
            pass
        warned = [record for record in caplog.records if record.name == "runlane.clock"]
        if clock is None:
            assert warned == []  # this machine's clock and the server's are one
        else:
            [record] = warned
            assert f"This process's clock is {words} the Postgres server's" in record.getMessage()
            assert "synchronize this machine's clock (NTP)" in record.getMessage()
            assert abs(record.clock_offset_seconds - seconds) < 1


async def test_a_runtime_on_a_controlled_clock_is_not_told_to_synchronize_the_machines_clock(
    schemas: Schemas, caplog: pytest.LogCaptureFixture
) -> None:
    # A test's ControlledClock is months off the server's on purpose: the start warned with advice to
    # synchronize this machine's clock (NTP), which is in sync.
    from runlane.testing import ControlledClock

    schema = await schemas.migrated()
    caplog.set_level(logging.WARNING, logger="runlane.clock")
    runtime = create_runlane(
        lane=postgres_polling_lane(schemas.url, schema=schema),
        queues=[queue("default", default=True)],
        clock=ControlledClock(datetime(2020, 1, 1, tzinfo=UTC)),
    )
    async with runtime:
        pass
    assert [record.getMessage() for record in caplog.records if record.name == "runlane.clock"] == []


@pytest.mark.parametrize("date_style", ["SQL,DMY", "German", "Postgres,MDY"])
async def test_a_database_with_another_date_style_is_served_and_its_clock_compared(
    schemas: Schemas, caplog: pytest.LogCaptureFixture, date_style: str
) -> None:
    # A database or role that sets DateStyle (as ALTER DATABASE ... SET DateStyle does): psycopg reads the
    # server's clock only in the ISO style, so start() failed with internal_error before.
    schema = await schemas.migrated()
    options = "options=" + quote(f"-c DateStyle={date_style} -c TimeZone=Asia/Kathmandu", safe="")
    url = schemas.url + ("&" if "?" in schemas.url else "?") + options
    caplog.set_level(logging.WARNING, logger="runlane.clock")
    default = queue("default", default=True)

    @task("echo", queue=default)
    async def echo(payload: dict[str, Any]) -> dict[str, Any]:
        return payload

    runtime = create_runlane(
        lane=postgres_polling_lane(url, schema=schema), queues=[default], tasks=[echo], clock=_Skewed(30)
    )
    async with runtime:
        await runtime.trigger(echo, {"n": 1})
        done = await runtime.execute_next()
        assert done is not None and done.status.value == "succeeded"
    [record] = [record for record in caplog.records if record.name == "runlane.clock"]
    assert abs(record.clock_offset_seconds - 30) < 1


SKEWED_RUNTIME = """
import os
from datetime import UTC, datetime, timedelta

from runlane import create_runlane, queue, task
from runlane_postgres import postgres_polling_lane


class AheadClock:
    def now(self) -> datetime:
        return datetime.now(UTC) + timedelta(seconds=30)


default = queue("default", default=True)


@task("noop")
async def noop(payload: dict) -> None:
    return None


runlane = create_runlane(
    lane=postgres_polling_lane(os.environ["DATABASE_URL"], schema=os.environ["SCHEMA"]),
    queues=[default],
    tasks=[noop],
    clock=AheadClock(),
)
"""


@pytest.mark.parametrize("args", [["work", "--drain"], ["tick"]], ids=["work", "tick"])
async def test_the_cli_prints_the_clock_warning_as_its_other_records(
    tmp_path: Path, schemas: Schemas, args: list[str]
) -> None:
    # Logged while the runtime starts, before a command forwards the records of its run: with --json
    # every line on stderr must still be JSON, as a log shipper reads it.
    schema = await schemas.migrated()
    write(tmp_path / "app" / "__init__.py", "")
    write(tmp_path / "app" / "tasks.py", SKEWED_RUNTIME)
    write(tmp_path / "runlane.toml", '[runlane]\nruntime = "app.tasks:runlane"\n')
    environment = {"DATABASE_URL": schemas.url, "SCHEMA": schema}
    done = await asyncio.to_thread(cli, tmp_path, "--json", *args, env=environment)
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in done.stderr.splitlines() if line.strip()]  # every line is JSON
    [warning] = [record for record in records if record.get("logger") == "runlane.clock"]
    assert "30.0 s ahead of the Postgres server's" in warning["message"]


# ---------------------------------------------------------------------------------------------
# Ids and keys too long for a Postgres index entry


def _random_id(seed: str, length: int) -> str:
    """Valid ids that do not compress (Postgres would fit a repetitive long value in an index entry)."""
    import random
    import string

    chosen = random.Random(seed)
    return "".join(chosen.choice(string.ascii_letters + string.digits) for _ in range(length))


async def test_ids_too_long_to_index_are_refused_up_front_and_an_outcome_fails_the_run_once(schemas: Schemas) -> None:
    """Valid ids and keys of a few hundred characters each can add up past a btree entry. A trigger is
    refused before anything is written; an outcome (a wait for a run of a long non-ASCII id, which this
    lane could never hold) fails its run at once instead of failing to commit, leaving the run running,
    and running the handler again."""
    run_id, awaited = _random_id("run", 450), "\U0001f600" * 500
    calls: list[int] = []
    default = queue("default", default=True)

    @task("approvals.wait")
    async def wait_for_approval(payload: dict, ctx: TaskContext) -> Any:
        calls.append(ctx.attempt)
        return ctx.wait_for_run(awaited, timeout="1d")

    lane = postgres_polling_lane(schemas.url, schema=await schemas.migrated())
    clock = ControlledClock()
    runtime = create_runlane(lane=lane, queues=[default], tasks=[wait_for_approval], clock=clock)
    async with runtime:
        emoji_id = "\U0001f600" * 512  # one valid id: 2,048 bytes of UTF-8, 4,096 hex digits in its key
        error = await expect_error(runtime.trigger(wait_for_approval, {}, run_id=emoji_id), ErrorCode.VALIDATION_FAILED)
        assert error.message.startswith("Run of task 'approvals.wait' cannot be stored: its ids and keys need an")
        assert error.message.endswith("Use shorter ids and keys (hash long values).")
        assert error.meta["limit"] == 2704 and error.meta["actual"] > 2704
        assert (await runtime.runs.list()).data == []

        await runtime.trigger(wait_for_approval, {}, run_id=run_id)
        done = await runtime.execute_next()
        assert done is not None and done.status.value == "failed" and calls == [1]
        assert done.failure is not None and done.failure.code is ErrorCode.TASK_OUTPUT_INVALID
        assert done.failure.message.startswith("The attempt's outcome cannot be stored: its ids and keys need")
        assert done.failure.message.endswith("Use shorter ids and keys (hash long values).")
        clock.advance("6m")  # past the lease: nothing is left running to take over
        await runtime.tick()
        assert await runtime.execute_next() is None and calls == [1]
