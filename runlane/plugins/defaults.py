"""Core's own default plugin: the ``console`` exporter.

Registered through the same plugin manager as every installed plugin (it is listed in
``runlane.plugins.manager.DEFAULT_PLUGINS``), so it uses only the public hooks and provider types.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel, ConfigDict

from ..core.observations import ConsoleObservationSink
from .hookspecs import hookimpl
from .registries import ExporterProvider, ProviderContext

__all__ = ["ConsoleExporterOptions", "register_exporters"]


class ConsoleExporterOptions(BaseModel):
    """Options of ``[[exporters]] use = "console"``: which standard stream receives the JSON lines."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    stream: Literal["stdout", "stderr"] = "stdout"


def create_console_exporter(options: ConsoleExporterOptions, context: ProviderContext) -> ConsoleObservationSink:
    # stdout is looked up per write (stream=None) so redirections made after startup still apply.
    return ConsoleObservationSink(sys.stderr if options.stream == "stderr" else None)


@hookimpl
def register_exporters(register: Callable[[ExporterProvider], None]) -> None:
    register(ExporterProvider("console", ConsoleExporterOptions, create_console_exporter))
