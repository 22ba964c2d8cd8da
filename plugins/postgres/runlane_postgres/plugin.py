"""runlane-postgres's plugin: the ``postgres-polling`` lane, the ``postgres`` storage driver and the
``runlane postgres`` commands (``migrate``, ``sql``), registered through the public hooks.

Loaded through the ``runlane`` entry-point group (``postgres = "runlane_postgres.plugin"``) like any
third-party plugin. In ``runlane.toml``::

    [lane]
    use = "postgres-polling"
    connection_string = "${DATABASE_URL}"   # or url = ...; postgres:// or postgresql://
    schema = "runlane"                      # optional: else ?schema= in the URL, else public
    statement_timeout = "30s"               # optional, like connect_timeout ("10s") and pool_timeout ("30s")
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any

import typer
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from rich.text import Text

from runlane.durations import duration_seconds
from runlane.errors import ErrorCode, RunlaneError
from runlane.plugins import hookimpl
from runlane.plugins.registries import LaneProvider, ProviderContext, StorageDriverProvider, validate_options

from .migration import DEFAULT_SCHEMA, postgres_migration_sql, validate_schema_name

if TYPE_CHECKING:
    from runlane.core.lanes import Lane

    from .migration import PostgresMigrationResult
    from .storage import PostgresStorageDriver

# The driver (and psycopg) is imported when a lane, driver or migration is actually created, so
# loading this plugin keeps every `runlane` command fast.

__all__ = [
    "PostgresPollingLaneOptions",
    "PostgresStorageOptions",
    "postgres_cli",
    "register_commands",
    "register_lanes",
    "register_storage_drivers",
]

# Left out of the options' repr: the URL may hold a password.
_CONNECTION_STRING = Field(min_length=1, validation_alias=AliasChoices("connection_string", "url"), repr=False)


class _ConnectionOptions(BaseModel):
    """``connection_string`` and its alias ``url``: one of them, not both (which one would win?)."""

    @model_validator(mode="before")
    @classmethod
    def _one_spelling(cls, data: Any) -> Any:
        if isinstance(data, dict) and "connection_string" in data and "url" in data:
            raise ValueError("set connection_string or its alias url, not both")
        return data

# ``schema`` is the documented option name; pydantic only warns that it shadows a deprecated
# BaseModel method, which these frozen option models never call.
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message='Field name "schema"', category=UserWarning)

    class PostgresStorageOptions(_ConnectionOptions):
        """Options of the ``postgres`` storage driver, and the Postgres options of the lanes over it.

        ``connection_string`` (alias ``url``) is a ``postgres://`` or ``postgresql://`` URL; ``schema``
        overrides a Prisma-style ``?schema=`` in it (default ``public``); ``min_size`` / ``max_size``
        bound the connection pool. ``connect_timeout`` (per connection attempt, default ``10s``),
        ``statement_timeout`` (per statement, set on each pooled connection, default ``30s``) and
        ``pool_timeout`` (the wait for a free pooled connection, default ``30s``) are durations such as
        ``"5m"``, or positive numbers of seconds.
        """

        model_config = ConfigDict(extra="forbid", frozen=True)

        connection_string: str = _CONNECTION_STRING
        schema: str | None = None  # type: ignore[assignment]  # the option shadows BaseModel.schema(), as above
        name: str = Field(default="postgres-storage", min_length=1)
        min_size: int = Field(default=1, ge=0)
        max_size: int = Field(default=10, ge=1)
        connect_timeout: float = 10.0
        statement_timeout: float = 30.0
        pool_timeout: float = 30.0

        @field_validator("connect_timeout", "statement_timeout", "pool_timeout", mode="before")
        @classmethod
        def _seconds(cls, value: object, info: ValidationInfo) -> float:
            try:
                return duration_seconds(value, str(info.field_name))
            except RunlaneError as error:
                raise ValueError(error.message.rstrip(".")) from None

    class PostgresPollingLaneOptions(PostgresStorageOptions):
        """Options of ``[lane] use = "postgres-polling"``: the storage options (see ``PostgresStorageOptions``),
        ``name`` naming the lane."""

        name: str = Field(default="postgres-polling", min_length=1)


def create_postgres_polling_lane(options: PostgresPollingLaneOptions, context: ProviderContext) -> Lane:
    from .lane import postgres_polling_lane

    return postgres_polling_lane(
        options.connection_string,
        schema=options.schema,
        name=options.name,
        min_size=options.min_size,
        max_size=options.max_size,
        connect_timeout=options.connect_timeout,
        statement_timeout=options.statement_timeout,
        pool_timeout=options.pool_timeout,
    )


def create_postgres_storage(options: PostgresStorageOptions, context: ProviderContext | None) -> PostgresStorageDriver:
    from .storage import postgres_storage

    return postgres_storage(
        options.connection_string,
        schema=options.schema,
        name=options.name,
        min_size=options.min_size,
        max_size=options.max_size,
        connect_timeout=options.connect_timeout,
        statement_timeout=options.statement_timeout,
        pool_timeout=options.pool_timeout,
    )


@hookimpl
def register_lanes(register: Callable[[LaneProvider], None]) -> None:
    register(LaneProvider("postgres-polling", PostgresPollingLaneOptions, create_postgres_polling_lane))


@hookimpl
def register_storage_drivers(register: Callable[[StorageDriverProvider], None]) -> None:
    register(StorageDriverProvider("postgres", PostgresStorageOptions, create_postgres_storage))


# ---------------------------------------------------------------------------------------------
# runlane postgres ...

postgres_cli = typer.Typer(help="Postgres storage: apply or print the migration SQL.", no_args_is_help=True)

UrlOption = Annotated[
    str | None,
    typer.Option(
        "--url",
        help="Database URL (postgres:// or postgresql://); default: the configured lane's connection string.",
        metavar="URL",
    ),
]
SchemaOption = Annotated[
    str | None,
    typer.Option(
        "--schema",
        help="Postgres schema (default: the configured lane's; with --url, ?schema= in it, or public).",
        metavar="SCHEMA",
    ),
]
SqlSchemaOption = Annotated[
    str | None,
    typer.Option(
        "--schema",
        help="Postgres schema the SQL creates and qualifies (default: the configured lane's, or public).",
        metavar="SCHEMA",
    ),
]


async def _configured_connection(ctx: typer.Context) -> tuple[str, str | None]:
    """The connection string and schema of the configured lane (``postgres-polling``, or any lane
    whose options carry a nested ``postgres`` table, such as ``postgres-sqs``), or of the lane the
    configured ``runtime`` factory builds (built, not started: nothing connects)."""
    from runlane.cli.main import load_cli_config

    config = load_cli_config(ctx)
    lane = config.lane
    if lane is None and config.runlane.runtime is None:
        raise RunlaneError(
            ErrorCode.CONFIGURATION_INVALID,
            f"{config.path} configures no [lane] or runtime to read a Postgres connection from; pass --url.",
        )
    found, lane_name = await _configured_postgres(ctx)
    if found is None:
        where = f"The configured lane {lane_name!r}" if lane is not None else f"The lane {lane_name!r} of the runtime"
        raise RunlaneError(
            ErrorCode.CONFIGURATION_INVALID,
            f"{where} does not keep its runs in Postgres; pass --url.",
            meta={"lane": lane_name},
        )
    return found


async def _configured_postgres(ctx: typer.Context) -> tuple[tuple[str, str | None] | None, str]:
    """The Postgres connection string and schema of the configured lane (``None`` when it is not on
    Postgres), and the lane's name."""
    from runlane.cli.main import build_configured_runtime, load_cli_config

    from .storage import PostgresStorageDriver

    config = load_cli_config(ctx)
    lane = config.lane
    if lane is not None:
        return _postgres_of(config), lane.use
    runtime = await build_configured_runtime(ctx)
    storage = runtime.lane.storage
    if not isinstance(storage, PostgresStorageDriver):
        return None, runtime.lane.name
    return (storage.connection_string, storage.schema), runtime.lane.name


def _postgres_of(config: Any) -> tuple[str, str | None] | None:
    """The connection string and schema the configured lane names, or ``None`` when it is not on Postgres:
    its options as its provider validates them (``postgres-polling``'s own, or a ``postgres`` table such
    as ``postgres-sqs``'s ``[lane.postgres]``), so a mistake there is refused as every command refuses it,
    naming the file, instead of a migration of the wrong schema."""
    from runlane.cli.main import in_config_file
    from runlane.plugins.manager import get_registries

    lane = config.lane
    with in_config_file(config):
        provider = get_registries().lanes.get(lane.use)
        options = validate_options(provider, lane.options, table=f"[{config.source.table_name('lane')}]")
        postgres = options if isinstance(options, PostgresStorageOptions) else getattr(options, "postgres", None)
        if not isinstance(postgres, PostgresStorageOptions):
            return None
        # What the driver checks beyond the options' model (the URL, the schema, min_size against max_size),
        # as when a command creates the lane: the driver connects nowhere until it starts.
        create_postgres_storage(postgres, None)
    return postgres.connection_string, postgres.schema


async def _configured_schema(ctx: typer.Context) -> str:
    """The schema of the configured Postgres lane (its option, else ``?schema=`` in its URL), so that the
    SQL matches what ``migrate`` would apply; ``public`` without a configuration or a Postgres lane."""
    from runlane.cli.main import state_of
    from runlane.config import load_config

    from .storage import resolve_postgres_connection

    config = load_config(state_of(ctx).config_path)
    if config is None or (config.lane is None and config.runlane.runtime is None):
        return DEFAULT_SCHEMA
    found, _ = await _configured_postgres(ctx)
    return DEFAULT_SCHEMA if found is None else resolve_postgres_connection(*found).schema


@postgres_cli.command("migrate", short_help="Apply the migration to the configured lane's database.")
def migrate(ctx: typer.Context, url: UrlOption = None, schema: SchemaOption = None) -> None:
    """Apply the Runlane migration to the configured lane's database (or --url).

    It creates the schema, or upgrades one an earlier version created. Safe to repeat."""
    from runlane.cli.main import guard, invoke, state_of

    from .migration import SCHEMA_VERSION, apply_postgres_migrations, mistaken_for
    from .storage import resolve_postgres_connection

    output = state_of(ctx).output

    if url is not None:
        guard(ctx, lambda: resolve_postgres_connection(url, schema))  # a bad URL or schema, before connecting

    async def main() -> PostgresMigrationResult:
        if url is not None:
            return await apply_postgres_migrations(url, schema)
        connection_string, configured_schema = await _configured_connection(ctx)
        return await apply_postgres_migrations(connection_string, schema if schema is not None else configured_schema)

    result = invoke(ctx, main)
    # A misspelt schema (or one in another case, or none set) is created, empty, beside the one holding the runs.
    mistaken = mistaken_for(result.other_schemas, result.schema)
    if mistaken:
        names = ", ".join(repr(name) for name in mistaken)
        output.warning(
            "other_runlane_schemas",
            f"created the Runlane schema {result.schema!r} in {result.database}, which also holds "
            f"{'the Runlane schema' if len(mistaken) == 1 else 'the Runlane schemas'} {names}: when the lane "
            f"should use {'that' if len(mistaken) == 1 else 'one of those'}, set its schema (the schema option, "
            "or ?schema= in the connection string; the name keeps its case) and drop this new, empty one "
            f"(DROP SCHEMA \"{result.schema}\" CASCADE).",
        )
    if output.json:
        output.emit_json(result.to_json())
        return
    if result.changed and result.previous_version:
        message = (
            f"upgraded schema {result.schema!r} in {result.database} from version {result.previous_version} "
            f"to version {result.version}"
        )
    elif result.changed:
        message = f"migrated schema {result.schema!r} in {result.database} to version {result.version}"
    elif result.version == SCHEMA_VERSION:
        # The SQL ran again: it creates what is missing (a dropped table, index or function) and leaves the rest.
        message = (
            f"schema {result.schema!r} in {result.database} is already at version {result.version}; applied again, "
            "so each of its tables, indexes and functions is in place"
        )
    else:
        message = f"schema {result.schema!r} in {result.database} is already at version {result.version}; nothing to do"
    output.line(Text.assemble(("✓ ", "bold green"), message))


@postgres_cli.command("sql", short_help="Print the migration SQL for your own migration tool.")
def sql(ctx: typer.Context, schema: SqlSchemaOption = None) -> None:
    """Print the migration SQL for your own migration tool (to a file: runlane postgres sql > runlane.sql).

    Apply it in one transaction (psql --single-transaction -f runlane.sql), so that concurrent deploys
    wait for each other."""
    from runlane.cli.main import guard, invoke, state_of

    output = state_of(ctx).output
    if schema is not None:
        name = guard(ctx, lambda: validate_schema_name(schema))
    else:
        name = invoke(ctx, lambda: _configured_schema(ctx))
    text = postgres_migration_sql(name)
    if output.json:
        output.emit_json({"schema": name, "sql": text})
        return
    sys.stdout.write(text)
    sys.stdout.flush()


@hookimpl
def register_commands(app: Any) -> None:
    add_typer = getattr(app, "add_typer", None)
    if callable(add_typer):  # the root Typer app; anything else gets no sub-app
        add_typer(postgres_cli, name="postgres")
