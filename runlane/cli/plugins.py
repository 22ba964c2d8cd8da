"""``runlane plugins list``: installed plugins, their versions and what each provides. Loads no runtime."""

from __future__ import annotations

import typer

from ..plugins.manager import get_plugin_failures, get_plugins
from .main import invoke, state_of

__all__ = ["app"]

app = typer.Typer(help="Inspect installed plugins.", no_args_is_help=True)


@app.command("list")
def list_plugins(ctx: typer.Context) -> None:
    """List installed plugins and what each provides."""

    async def main() -> list:
        return get_plugins()

    plugins = invoke(ctx, main)
    state_of(ctx).output.plugins_table(plugins, get_plugin_failures())
