"""runlane-postgres: Runlane's production storage on PostgreSQL.

* ``postgres_storage(connection_string, *, schema=None, ...)``: a ``StorageDriver`` with ordered
  append, exclusive candidates and operator reads, over psycopg 3 and a connection pool;
* ``postgres_polling_lane(connection_string, *, schema=None, name="postgres-polling")``: that storage
  with storage-polling workers, production durable;
* ``postgres_migration_sql(schema="public")`` and the shipped ``migrations/0001_initial.sql``: the
  schema to apply before starting (``runlane postgres migrate`` applies it);
  ``apply_postgres_migrations(connection_string, schema=None)`` does the same from Python.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from .lane import postgres_polling_lane
    from .migration import PostgresMigrationResult, apply_postgres_migrations, postgres_migration_sql
    from .storage import (
        PostgresConnectionTarget,
        PostgresStorageDriver,
        map_postgres_error,
        postgres_storage,
        resolve_postgres_connection,
    )

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

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
