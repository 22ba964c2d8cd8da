"""runlane-local's plugin: registers the ``local`` and ``sqlite`` lanes through the public hooks.

Loaded through the ``runlane`` entry-point group (``local = "runlane_local.plugin"``) exactly like a
third-party plugin; core has no special knowledge of it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from runlane.core.lanes import Lane
from runlane.plugins import hookimpl
from runlane.plugins.registries import LaneProvider, ProviderContext

from .lane import local_lane, sqlite_lane
from .sqlite import expand_database_path

__all__ = ["LocalLaneOptions", "SqliteLaneOptions", "register_lanes"]


class LocalLaneOptions(BaseModel):
    """Options of ``[lane] use = "local"``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "local"


def create_local_lane(options: LocalLaneOptions, context: ProviderContext) -> Lane:
    return local_lane(name=options.name)


class SqliteLaneOptions(BaseModel):
    """Options of ``[lane] use = "sqlite"``.

    ``path`` is the database file; a relative path resolves against the directory of the
    configuration file. ``synchronous`` is ``"full"`` (default), ``"extra"`` or ``"normal"``;
    ``busy_timeout`` is how long one operation waits for the file's write lock, such as ``"5s"`` (or a
    number of seconds).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str = Field(min_length=1)
    name: str = Field(default="sqlite", min_length=1)
    synchronous: Literal["full", "extra", "normal"] = "full"
    busy_timeout: str | float = "5s"

    @field_validator("busy_timeout", mode="before")
    @classmethod
    def _not_a_boolean(cls, value: object) -> object:
        # pydantic would take true for 1 second and false for 0, where sqlite_lane() refuses both.
        if isinstance(value, bool):
            raise ValueError(f"must be a positive number of seconds or a duration such as '5s', got {value!r}")
        return value


def sqlite_database_path(options: SqliteLaneOptions, context: ProviderContext) -> Path:
    """``options.path`` with ``~`` expanded, relative to the configuration's directory when it has one."""
    path = expand_database_path(options.path)
    if not path.is_absolute() and context.base_dir is not None:
        path = Path(context.base_dir) / path
    return path


def create_sqlite_lane(options: SqliteLaneOptions, context: ProviderContext) -> Lane:
    return sqlite_lane(
        sqlite_database_path(options, context),
        name=options.name,
        synchronous=options.synchronous,
        busy_timeout=options.busy_timeout,
    )


@hookimpl
def register_lanes(register: Callable[[LaneProvider], None]) -> None:
    register(LaneProvider("local", LocalLaneOptions, create_local_lane))
    register(LaneProvider("sqlite", SqliteLaneOptions, create_sqlite_lane))
