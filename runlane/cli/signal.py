"""``runlane signal send``: resume runs waiting on a signal key through ``runlane.signals.send()``."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from .main import state_of, with_runtime
from .options import LimitOption

__all__ = ["app"]

app = typer.Typer(help="Send signals to waiting runs.", no_args_is_help=True)


@app.command("send")
def send(
    ctx: typer.Context,
    signal_key: Annotated[str, typer.Argument(help="The signal key runs wait on.", metavar="SIGNAL_KEY")],
    limit: LimitOption = None,
) -> None:
    """Resume runs waiting on SIGNAL_KEY."""

    async def body(runtime: Any) -> Any:
        return await runtime.signals.send(signal_key, limit=limit)

    state_of(ctx).output.signal_result(signal_key, with_runtime(ctx, body))
