"""``runlane tui``: the Textual dashboard (``runlane.tui``) for the configured runtime.

On a shared lane the dashboard opens its own runtime; on a process-local lane it reads the live
``runlane dev`` session for the same config, as the other stateful commands do. Textual is imported
only when the command runs (install it with ``pip install 'runlane[tui]'``).
"""

from __future__ import annotations

import sys
from typing import Annotated, Any

import typer

from ..durations import duration_ms
from ..errors import ErrorCode, RunlaneError
from .main import guard, invoke, load_cli_config, open_runtime, state_of
from .options import checked

__all__ = ["app"]

app = typer.Typer()

_MIN_REFRESH_MS = 250


def _refresh_seconds(text: str) -> float:
    """Seconds between reloads; ``0`` or ``off``: none (the screen reloads on ``r`` and after actions)."""
    if text.strip().lower() in ("0", "off"):
        return 0.0
    milliseconds = duration_ms(text, "--refresh")
    if milliseconds < _MIN_REFRESH_MS:
        raise RunlaneError(
            ErrorCode.CONFIGURATION_INVALID,
            f"--refresh must be at least {_MIN_REFRESH_MS}ms (or off, to reload only on r), got {text!r}.",
        )
    return milliseconds / 1000


def _dashboard_module() -> object:
    try:
        import runlane.tui as dashboard
    except ImportError as error:
        raise RunlaneError(
            ErrorCode.CONFIGURATION_INVALID,
            f"The dashboard needs Textual ({error.name} is missing); install it with: pip install 'runlane[tui]'",
        ) from None
    return dashboard


@app.command("tui", short_help="Open the live dashboard; cancel, retry and rerun runs.")
def tui(
    ctx: typer.Context,
    refresh: Annotated[
        str,
        typer.Option(
            "--refresh",
            help="How often the open screen reloads (at least 250ms); off: only on r and after actions.",
            metavar="D",
            callback=checked(lambda text, name: _refresh_seconds(text)),
        ),
    ] = "2s",
) -> None:
    """Open the dashboard: queues, the newest runs and run details, live; cancel, retry and rerun runs."""
    interval = _refresh_seconds(refresh)  # checked by its callback already
    dashboard = guard(ctx, _dashboard_module)

    async def main() -> None:
        from .bridge import lane_signature, pid_alive, read_session, serves

        client_type = dashboard.DashboardClient  # type: ignore[attr-defined]
        app_type = dashboard.RunlaneDashboard  # type: ignore[attr-defined]
        config = load_cli_config(ctx)
        session = read_session(config.path)
        if (
            session is not None
            and pid_alive(session.pid)
            and serves(session, lane_signature(config), state_of(ctx).output)
        ):
            signature = lane_signature(config)

            def find_session() -> Any:
                """The live session now recorded for this config (a new one after a dev restart)."""
                found = read_session(config.path)
                if found is None or not pid_alive(found.pid) or found.lane not in (None, signature):
                    return None
                return found

            # The names the dev process's runtime serves (a runtime = "module:attribute" names its own),
            # else, from a dev of an earlier release, what the file says.
            client = client_type.bridged(
                session,
                lane=session.lane_name or (config.lane.use if config.lane is not None else "runtime"),
                environment=session.environment or config.environment,
                find_session=find_session,
            )
            try:
                await client.queues()  # a session that no longer answers is discarded here
            except RunlaneError as error:
                if error.code is not ErrorCode.STORAGE_UNAVAILABLE:
                    raise
            else:
                await _run(app_type(client, refresh_interval=interval), ctx)
                return
        # On a terminal the dashboard is opened to watch, an outage included: a database not up yet is waited
        # for, as the long-running commands do, instead of ending the command (with none, it fails fast).
        async with open_runtime(ctx, wait_for_storage=_on_a_terminal()) as runtime:
            if runtime.lane.capabilities.process_local:
                raise RunlaneError(
                    ErrorCode.CONFIGURATION_INVALID,
                    f"The {runtime.lane.name!r} lane keeps its runs in the `runlane dev` process; start "
                    "`runlane dev` for this config, then open the dashboard again.",
                )
            await _run(app_type(client_type.local(runtime), refresh_interval=interval), ctx)

    invoke(ctx, main)


def _on_a_terminal() -> bool:
    return sys.stdin is not None and sys.stdin.isatty() and sys.stdout.isatty()  # stdin None: started closed


async def _run(app: Any, ctx: typer.Context) -> None:
    if not _on_a_terminal():
        raise RunlaneError(
            ErrorCode.CONFIGURATION_INVALID,
            "The dashboard needs a terminal for its input and output; from a script, read the same with "
            "`runlane queues` and `runlane runs list --json`.",
        )
    # What the runtime logs meanwhile (an observer that raised on a cancel) is shown as a notification: the
    # dashboard owns the terminal, and a line printed on it would break the screen.
    with state_of(ctx).output.logs_to(app.show_log):
        await app.run_async()
