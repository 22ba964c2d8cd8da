"""runlane-local's plugin: registers the ``local`` lane through the public hooks.

Loaded through the ``runlane`` entry-point group (``local = "runlane_local.plugin"``) exactly like a
third-party plugin; core has no special knowledge of it.
"""

from __future__ import annotations

from collections.abc import Callable

from pydantic import BaseModel, ConfigDict

from runlane.core.lanes import Lane
from runlane.plugins import hookimpl
from runlane.plugins.registries import LaneProvider, ProviderContext

from .lane import local_lane

__all__ = ["LocalLaneOptions", "register_lanes"]


class LocalLaneOptions(BaseModel):
    """Options of ``[lane] use = "local"``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "local"


def create_local_lane(options: LocalLaneOptions, context: ProviderContext) -> Lane:
    return local_lane(name=options.name)


@hookimpl
def register_lanes(register: Callable[[LaneProvider], None]) -> None:
    register(LaneProvider("local", LocalLaneOptions, create_local_lane))
