"""The Postgres storage schema: migration SQL as a function and as a shipped file, and how to apply it.

``postgres_migration_sql(schema)`` returns the whole schema for one Postgres schema (every table
reference is schema-qualified and quoted). It is read from ``migrations/0001_initial.sql`` inside this
package, which is written for the default schema ``public`` (teams may vendor or review it as is). The SQL is
idempotent (``IF NOT EXISTS`` / ``CREATE OR REPLACE``), so applying it twice changes nothing.

Tables (all text columns use the byte-order collation ``"C"``, so ``ORDER BY`` matches the
contract's encoded order):

* ``runlane_records``: one row per logical record: encoded key, version (from the
  ``runlane_record_versions`` sequence, never reused), the canonical document stored once as ``json``
  (exact text, so the document read back is byte-for-byte what was written), its size, and the
  record's index entries (``name,partition,sort`` joined by spaces) so a point read needs no join;
* ``runlane_index_rows``: one row per index entry; its primary key ``(index_name, partition, sort,
  key)`` is the single btree behind every index name's plan. An entry that restates its record's key
  (``runlane.storage.key_order``: events and steps by run, ordered-append records) has no row: the
  records' primary key already holds those entries in index order (schema version 2);
* ``runlane_operator_runs`` / ``runlane_operator_events``: the operator read projection
  (``runlane.storage.operator_sql``), updated in the same commit as the records it describes;
* ``runlane_schema_migrations``: applied versions, checked by the driver's start-up probe. Each version
  names the oldest driver that may still use the schema once it is applied (``min_driver_version``;
  version 3 adds indexes only, so it names 2). A schema that needs a newer driver than this one is
  refused by both the probe and ``apply_postgres_migrations``, which changes nothing then: this
  release's SQL would replace the newer release's functions with older ones. A newer schema that this
  driver may still use starts, and migrating it is a no-op, so an older release keeps running (and
  deploying) while a newer one rolls out or back.

``runlane_commit(p jsonb)`` applies one transaction attempt in a single statement: it takes
transaction-scoped advisory locks in the order given, re-checks every read and expected version,
writes records, index rows and projection rows, and last allocates ordered-append positions under
the stream head's lock. It changes nothing unless every check passes (a failed dependency check
returns status 1; a failure after the first write raises, which rolls the statement back).
``runlane_commit_batch(locks jsonb, attempts jsonb)`` applies several attempts in one transaction
(the driver's group commit): every lock first, then each attempt in a subtransaction of its own.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources

from runlane.errors import ErrorCode, RunlaneError

__all__ = [
    "DEFAULT_SCHEMA",
    "MIGRATION_FILE",
    "SCHEMA_VERSION",
    "PostgresMigrationResult",
    "apply_postgres_migrations",
    "postgres_migration_sql",
    "quote_schema",
    "shipped_migration_sql",
    "validate_schema_name",
]

DEFAULT_SCHEMA = "public"
SCHEMA_VERSION = 3
MIGRATION_FILE = "migrations/0001_initial.sql"
# The transaction-scoped advisory lock the migration SQL takes first, so that concurrent applications
# (deploys racing) run one after the other; the shipped file names the same key.
MIGRATION_LOCK_KEY = 7318952210413375533

# How alike two schema names are (difflib's ratio, case aside) for one to look like a misspelling of the other:
# "runlane" / "runlnae" is 0.86, "staging" / "production" 0.35.
_CLOSE_SPELLING = 0.75
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
# The shipped file is the migration for the default schema; every schema reference in it is this
# quoted identifier (no other text in the file contains it), so other schemas are one replacement.
_DEFAULT_SCHEMA_IDENTIFIER = '"public"'


def validate_schema_name(schema: object) -> str:
    """``schema`` when it is a plain Postgres identifier (letters, digits, ``_``, at most 63 bytes) that
    does not start with ``pg_``."""
    if not isinstance(schema, str) or not _IDENTIFIER.fullmatch(schema):
        raise RunlaneError(
            ErrorCode.CONFIGURATION_INVALID,
            f"Invalid Postgres schema {schema!r}: use a plain identifier of letters, digits and underscores "
            "that does not start with a digit (at most 63 characters).",
            meta={"field": "schema"},
        )
    # Postgres refuses to create a schema named pg_... (SQLSTATE 42939); any case is refused here, since
    # an unquoted PG_... is the same reserved name.
    if schema[:3].lower() == "pg_":
        raise RunlaneError(
            ErrorCode.CONFIGURATION_INVALID,
            f"Invalid Postgres schema {schema!r}: the pg_ prefix is reserved by Postgres for system schemas; "
            "choose another name, such as 'runlane'.",
            meta={"field": "schema"},
        )
    return schema


def quote_schema(schema: str) -> str:
    """The quoted identifier of a validated schema name (case is kept exactly)."""
    return f'"{validate_schema_name(schema)}"'


def postgres_migration_sql(schema: str = DEFAULT_SCHEMA) -> str:
    """The complete, idempotent migration SQL for ``schema`` (default ``public``)."""
    return shipped_migration_sql().replace(_DEFAULT_SCHEMA_IDENTIFIER, quote_schema(schema))


def shipped_migration_sql() -> str:
    """The text of the ``migrations/0001_initial.sql`` file shipped in this package."""
    return resources.files(__package__).joinpath(MIGRATION_FILE).read_text(encoding="utf-8")


def ledger_query(migrations: str) -> str:
    """The statement reading ``(version, needs)`` from the ledger table ``migrations``: the schema's
    version and the oldest driver version that may use it. Schemas migrated before version 3 have no
    ``min_driver_version`` column, which ``to_jsonb`` of the row reads as absent."""
    return (
        "SELECT coalesce(max(m.version), 0), "
        "coalesce(max(coalesce((to_jsonb(m) ->> 'min_driver_version')::integer, m.version)), 0) "
        f"FROM {migrations} AS m"
    )


# The schemas of the database that hold a Runlane ledger, but the one named by the parameter.
OTHER_SCHEMAS_QUERY = (
    "SELECT coalesce(array_agg(n.nspname::text ORDER BY n.nspname), '{}') FROM pg_catalog.pg_class AS c "
    "JOIN pg_catalog.pg_namespace AS n ON n.oid = c.relnamespace "
    "WHERE c.relname = 'runlane_schema_migrations' AND c.relkind IN ('r', 'p') AND n.nspname <> %s"
)


def _likeness(name: str, schema: str) -> float:
    return difflib.SequenceMatcher(None, name.lower(), schema.lower()).ratio()


def likeliest_schemas(others: Sequence[str], schema: str, *, shown: int = 5) -> list[str]:
    """The first ``shown`` of ``others`` in the order a lane meaning one of them for ``schema`` most likely
    does: the same name in another case, a misspelling, then the rest by name."""
    return sorted(others, key=lambda name: -_likeness(name, schema))[:shown]


def mistaken_for(others: Sequence[str], schema: str) -> list[str]:
    """Those of ``others`` that a lane naming ``schema`` more likely meant than a schema of its own: the same
    name in another case or a close spelling, or any of them when ``schema`` is the default (none was set)."""
    if schema == DEFAULT_SCHEMA:
        return list(others)
    return [name for name in others if _likeness(name, schema) >= _CLOSE_SPELLING]


def newer_schema_error(schema: str, database: str, version: int, *, migrating: bool) -> RunlaneError:
    """``configuration_invalid`` for a schema a newer release migrated (``version`` > ``SCHEMA_VERSION``)."""
    advice = (
        "Nothing was changed: upgrade runlane-postgres to the release that migrated it (or a later one)."
        if migrating
        else "Upgrade runlane-postgres in this deployment to the release that migrated it (or a later one)."
    )
    return RunlaneError(
        ErrorCode.CONFIGURATION_INVALID,
        f"The Runlane schema {schema!r} in {database} is at version {version}, newer than version "
        f"{SCHEMA_VERSION} that this release of runlane-postgres knows (a newer release migrated it). {advice}",
        meta={"schema": schema, "version": version, "supported_version": SCHEMA_VERSION},
    )


def encoding_error(encoding: object, database: str) -> RunlaneError | None:
    """``configuration_invalid`` for a database whose ``server_encoding`` is not UTF8, else ``None``:
    Runlane stores documents, ids and keys as UTF-8 text."""
    # A SQL_ASCII connection's text comes back as bytes.
    name = encoding.decode("ascii", "replace") if isinstance(encoding, bytes) else str(encoding)
    if name.upper() in ("UTF8", "UTF-8"):
        return None
    return RunlaneError(
        ErrorCode.CONFIGURATION_INVALID,
        f"The Postgres database {database} uses the {name} encoding; Runlane needs a UTF8 database. Create "
        "one for it (CREATE DATABASE ... ENCODING 'UTF8' TEMPLATE template0) and point the lane at that.",
        meta={"encoding": name},
    )


@dataclass(frozen=True, slots=True)
class PostgresMigrationResult:
    """What ``apply_postgres_migrations`` did: the schema, the database (without credentials), the
    schema version found before (0: none) and the version after. When it created the schema's tables,
    ``other_schemas`` names the database's Runlane schemas beside it (at most five, the likeliest meant
    first): the lane's schema may be misspelt, in another case, or not set."""

    schema: str
    database: str
    previous_version: int
    version: int
    other_schemas: tuple[str, ...] = field(default=())

    @property
    def changed(self) -> bool:
        return self.previous_version != self.version

    def to_json(self) -> dict[str, object]:
        return {
            "schema": self.schema,
            "database": self.database,
            "previous_version": self.previous_version,
            "version": self.version,
            "changed": self.changed,
            "other_schemas": list(self.other_schemas),
        }


async def apply_postgres_migrations(
    connection_string: str, schema: str | None = None, *, connect_timeout: float = 10.0
) -> PostgresMigrationResult:
    """Apply the migration SQL to the database of ``connection_string`` in one transaction.

    The schema is resolved like ``postgres_storage``: the explicit ``schema``, else a Prisma-style
    ``?schema=`` in the URL, else ``public``. Applying it again changes nothing. Connection and
    permission problems raise ``RunlaneError`` (``storage_unavailable`` or ``configuration_invalid``);
    so does a schema that needs a newer release (``configuration_invalid``, and nothing is changed). A
    newer schema this release may still use is left as it is (the result says nothing changed). When it
    creates the schema's tables, the result names the database's other Runlane schemas (``other_schemas``).
    """
    import psycopg

    from .storage import check_seconds, map_postgres_error, resolve_postgres_connection

    target = resolve_postgres_connection(connection_string, schema)
    check_seconds("connect_timeout", connect_timeout)
    migrations = f"{quote_schema(target.schema)}.runlane_schema_migrations"
    sql = postgres_migration_sql(target.schema)
    try:
        connection = await psycopg.AsyncConnection.connect(
            target.conninfo, **target.connection_defaults(connect_timeout=connect_timeout)
        )
    except Exception as error:  # noqa: BLE001 - mapped to a RunlaneError
        raise map_postgres_error(error, f"connect to Postgres at {target.display}", migrating=True) from error
    try:
        async with connection:
            cursor = await connection.execute("SHOW server_encoding")
            (encoding,) = await cursor.fetchone()  # type: ignore[misc]
            refused = encoding_error(encoding, target.display)
            if refused is not None:
                raise refused  # before anything is created: the driver would refuse the schema at every start
            async with connection.transaction():
                # Before reading the version: a concurrent migrate that got in first is then seen as done.
                await connection.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK_KEY,))
                cursor = await connection.execute("SELECT to_regclass(%s) IS NOT NULL", (migrations,))
                (exists,) = await cursor.fetchone()  # type: ignore[misc]
                previous = needs = 0
                if exists:
                    cursor = await connection.execute(ledger_query(migrations))
                    (previous, needs) = await cursor.fetchone()  # type: ignore[misc]
                if needs > SCHEMA_VERSION:
                    # Raised inside the transaction, which rolls back: the newer release's functions stay.
                    raise newer_schema_error(target.schema, target.display, int(previous), migrating=True)
                if previous <= SCHEMA_VERSION:
                    # Several statements: the simple protocol. A newer schema this driver may use is left
                    # as it is: this SQL would only put older functions in place of its own.
                    await connection.execute(sql.encode("utf-8"))
                others: list[str] = []
                if not exists:
                    cursor = await connection.execute(OTHER_SCHEMAS_QUERY, (target.schema,))
                    (others,) = await cursor.fetchone()  # type: ignore[misc]
    except RunlaneError:
        raise
    except Exception as error:  # noqa: BLE001 - mapped to a RunlaneError
        raise map_postgres_error(error, f"apply the Runlane migration to {target.display}", migrating=True) from error
    return PostgresMigrationResult(
        target.schema,
        target.display,
        int(previous),
        max(int(previous), SCHEMA_VERSION),
        tuple(likeliest_schemas(others, target.schema)),
    )
