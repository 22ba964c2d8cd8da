"""Runlane's hook specifications: the whole plugin surface, in one flat module.

Every hook is called by core, never by a plugin. Registration hooks receive a ``register`` callback so
core owns the registries, stamps the providing plugin's name on every entry and reports collisions;
implementations return nothing. Implement a hook with ``@runlane.hookimpl`` (``runlane.plugins.hookimpl``);
an implementation may accept fewer arguments than the spec, never different ones.

This module must not import the runtime: it is imported by ``runlane.plugins`` on ``import runlane``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from .registries import ExporterProvider, LaneProvider, StorageDriverProvider, TransportProvider

__all__ = [
    "hookimpl",
    "hookspec",
    "register_commands",
    "register_exporters",
    "register_lanes",
    "register_observers",
    "register_storage_drivers",
    "register_task_modules",
    "register_transports",
]

PROJECT_NAME = "runlane"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


# ---------------------------------------------------------------------------------------------
# Providers: named factories that runlane.toml selects with ``use = "<name>"``


@hookspec
def register_lanes(register: Callable[[LaneProvider], None]) -> None:
    """Register lanes, selected in ``runlane.toml`` by ``[lane] use = "<name>"``.

    Called once per plugin whenever core collects its registries (config loading,
    ``runlane plugins list``). Call ``register`` once per lane; nothing is returned.

    :param register: takes a ``LaneProvider(name, options_model, create)``; ``create(options, context)``
        returns a ``Lane``. Registering a name another plugin already registered is a
        ``configuration_invalid`` error naming both plugins.
    """


@hookspec
def register_storage_drivers(register: Callable[[StorageDriverProvider], None]) -> None:
    """Register storage drivers that lanes and configuration can compose by name.

    Called once per plugin whenever core collects its registries. Nothing is returned.

    :param register: takes a ``StorageDriverProvider(name, options_model, create)``;
        ``create(options, context)`` returns a ``StorageDriver``. Duplicate names are rejected.
    """


@hookspec
def register_transports(register: Callable[[TransportProvider], None]) -> None:
    """Register wakeup transports (for lanes with ``LaneDeliveryMode.TRANSPORT``).

    Called once per plugin whenever core collects its registries. Nothing is returned.

    :param register: takes a ``TransportProvider(name, options_model, create)``; ``create(options, context)``
        returns a ``TransportAdapter``. Duplicate names are rejected.
    """


@hookspec
def register_exporters(register: Callable[[ExporterProvider], None]) -> None:
    """Register observation exporters, selected by ``[[exporters]] use = "<name>"``.

    Called once per plugin whenever core collects its registries. Nothing is returned.

    :param register: takes an ``ExporterProvider(name, options_model, create)``; ``create(options, context)``
        returns an observation sink (an object with ``async export(records)``). Duplicate names are rejected.
    """


# ---------------------------------------------------------------------------------------------
# Runtime contributions: added to every runtime built from configuration


@hookspec
def register_task_modules(register: Callable[[str], None]) -> None:
    """Contribute modules whose ``TaskDefinition`` and ``QueueDefinition`` objects are registered.

    Called once per plugin whenever core collects its registries; the modules are imported exactly
    like ``[runlane] tasks`` entries when a runtime is built from ``[runlane] tasks`` and ``[lane]`` (a
    ``[runlane] runtime`` factory's runtime is used as it is built). Nothing is returned.

    :param register: takes a dotted module name such as ``"package.module"``; the module is not
        imported at registration time.
    """


@hookspec
def register_observers(register: Callable[[Callable[[Any], Any]], None]) -> None:
    """Contribute live observers added to every runtime built from configuration.

    Called once per plugin whenever core collects its registries. Nothing is returned.

    :param register: takes a callable ``observer(observation)`` (plain or ``async``), called after the
        storage commit that persisted what it observes; its errors never fail the run.
    """


# ---------------------------------------------------------------------------------------------
# CLI


@hookspec
def register_commands(app: Any) -> None:
    """Add sub-apps or commands to the ``runlane`` command line.

    Called once per plugin while the CLI is being assembled, before arguments are parsed.
    Nothing is returned.

    :param app: the root ``typer.Typer`` application; use ``app.add_typer(...)`` or ``@app.command()``.
        Never pass Click objects.
    """
