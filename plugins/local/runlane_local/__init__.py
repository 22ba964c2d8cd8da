"""runlane-local: the in-memory reference storage driver and the local lane, plus the embedded SQLite
storage driver and its lane."""

from .lane import local_lane, sqlite_lane
from .memory import LocalStorageDriver, LocalStorageStore, local_storage_driver
from .sqlite import SqliteStorageDriver, sqlite_storage

__all__ = [
    "LocalStorageDriver",
    "LocalStorageStore",
    "SqliteStorageDriver",
    "local_lane",
    "local_storage_driver",
    "sqlite_lane",
    "sqlite_storage",
]
