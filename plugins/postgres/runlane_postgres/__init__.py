"""runlane-postgres: Runlane's production storage on PostgreSQL.

* ``postgres_storage(connection_string, *, schema=None, ...)``: a ``StorageDriver`` with ordered
  append, exclusive candidates and operator reads, over psycopg 3 and a connection pool;
* ``postgres_polling_lane(connection_string, *, schema=None, name="postgres-polling")``: that storage
  with storage-polling workers, production durable;
* ``postgres_migration_sql(schema="public")`` and the shipped ``migrations/0001_initial.sql``: the
  schema to apply before starting (``runlane postgres migrate`` applies it);
  ``await apply_postgres_migrations(connection_string, schema=None)`` does the same from Python
  (a coroutine function: ``asyncio.run(apply_postgres_migrations(url))`` from a plain script).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from .lane import postgres_polling_lane as postgres_polling_lane
    from .migration import (
        PostgresMigrationResult as PostgresMigrationResult,
        apply_postgres_migrations as apply_postgres_migrations,
        postgres_migration_sql as postgres_migration_sql,
    )
    from .storage import (
        PostgresConnectionTarget as PostgresConnectionTarget,
        PostgresStorageDriver as PostgresStorageDriver,
        map_postgres_error as map_postgres_error,
        postgres_storage as postgres_storage,
        resolve_postgres_connection as resolve_postgres_connection,
    )

# A literal list: type checkers read it to know what the package exports (a computed one hides every name).
__all__ = [
    "PostgresConnectionTarget",
    "PostgresMigrationResult",
    "PostgresStorageDriver",
    "apply_postgres_migrations",
    "map_postgres_error",
    "postgres_migration_sql",
    "postgres_polling_lane",
    "postgres_storage",
    "resolve_postgres_connection",
]

# Names are imported on first use, so loading the plugin (every `runlane` command does) does not
# import psycopg.
_EXPORTS = {
    "PostgresConnectionTarget": "storage",
    "PostgresMigrationResult": "migration",
    "PostgresStorageDriver": "storage",
    "apply_postgres_migrations": "migration",
    "map_postgres_error": "storage",
    "postgres_migration_sql": "migration",
    "postgres_polling_lane": "lane",
    "postgres_storage": "storage",
    "resolve_postgres_connection": "storage",
}

# Hidden from type checkers, which would otherwise take any misspelt import from this package as ``Any``;
# they see the names imported above instead.
if not TYPE_CHECKING:

    def __getattr__(name: str) -> Any:
        module = _EXPORTS.get(name)
        if module is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
        globals()[name] = value
        return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
