"""``runlane plugins list``: installed plugins, their versions and what each provides (lanes, drivers,
transports, exporters, task modules, observers and CLI commands). Loads no runtime."""

from __future__ import annotations

import dataclasses

import typer

from ..plugins.manager import get_plugin_failures, get_plugins, get_registries, pm
from ..plugins.registries import registered_by
from .main import command_names, invoke, state_of

__all__ = ["app"]

app = typer.Typer(help="Inspect installed plugins.", no_args_is_help=True)


@app.command("list")
def list_plugins(ctx: typer.Context) -> None:
    """List installed plugins and what each provides."""

    async def main() -> list:
        return get_plugins()

    plugins = invoke(ctx, main)
    commands = _commands_by_plugin()
    plugins = [
        dataclasses.replace(plugin, provides={**plugin.provides, "commands": commands[plugin.name]})
        if commands.get(plugin.name)
        else plugin
        for plugin in plugins
    ]
    state_of(ctx).output.plugins_table(plugins, get_plugin_failures(), _collisions(commands))


def _commands_by_plugin() -> dict[str, list[str]]:
    """The commands and command groups each plugin adds through ``register_commands``, found by letting
    it register them on a scratch app."""
    found: dict[str, list[str]] = {}
    for impl in pm.hook.register_commands.get_hookimpls():
        scratch = typer.Typer()
        try:
            impl.function(*(scratch for _ in impl.argnames))
        except (Exception, SystemExit):  # noqa: BLE001 - the real registration reports it; listing must not fail
            continue
        try:
            names = command_names(scratch.registered_commands, scratch.registered_groups)
        except Exception:  # noqa: BLE001 - a malformed registration: the real one reports it
            continue
        # A plugin may implement the hook more than once (pluggy's ``specname``): its commands are all of them.
        found[impl.plugin_name] = sorted({*found.get(impl.plugin_name, ()), *names})
    return found


def _collisions(commands: dict[str, list[str]]) -> list[str]:
    registries = get_registries()
    notes = []
    for registry in (registries.lanes, registries.storage_drivers, registries.transports, registries.exporters):
        for name, plugins in sorted(registry.collisions.items()):
            notes.append(f"the {registry.kind} {name!r} is {registered_by(plugins)}; selecting it fails")
    adding: dict[str, list[str]] = {}
    for plugin, names in sorted(commands.items()):
        for name in names:
            adding.setdefault(name, []).append(plugin)
    for name, plugins in sorted(adding.items()):
        if len(plugins) > 1:
            owners = " and ".join(repr(plugin) for plugin in plugins)
            notes.append(f"the command {name!r} is added by plugins {owners}; it is added by neither")
    return notes
