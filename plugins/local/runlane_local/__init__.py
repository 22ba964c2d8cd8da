"""runlane-local: the in-memory reference storage driver and the local lane."""

from .lane import local_lane
from .memory import LocalStorageDriver, LocalStorageStore, local_storage_driver

__all__ = ["LocalStorageDriver", "LocalStorageStore", "local_lane", "local_storage_driver"]
