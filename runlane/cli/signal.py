"""``runlane signal send``: resume runs waiting on a signal key through ``runlane.signals.send()``."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from ..defaults import contract_defaults
from .main import OperationParams, operation, run_operation
from .options import limit_option
from .output import plural

__all__ = ["app"]

app = typer.Typer(help="Send signals to waiting runs.", no_args_is_help=True)


class SignalSendParams(OperationParams):
    signal_key: str
    limit: int | None = None


@operation(
    "signal send",
    SignalSendParams,
    lambda output, params, result: output.signal_result(params.signal_key, result, _limit(params)),
    summary=lambda params, runs: f"✓ signal {params.signal_key} resumed {plural(len(runs), 'run')}",
)
async def _send(runtime: Any, params: SignalSendParams) -> Any:
    return await runtime.signals.send(params.signal_key, limit=params.limit)


def _limit(params: SignalSendParams) -> int:
    return contract_defaults.maintenance.delivery_request_limit if params.limit is None else params.limit


@app.command("send")
def send(
    ctx: typer.Context,
    signal_key: Annotated[str, typer.Argument(help="The signal key runs wait on.", metavar="SIGNAL_KEY")],
    limit: Annotated[
        int | None,
        limit_option(
            f"Resume at most N runs (default {contract_defaults.maintenance.delivery_request_limit}); "
            "when N are resumed, more may still wait: send again."
        ),
    ] = None,
) -> None:
    """Resume runs waiting on SIGNAL_KEY."""

    run_operation(ctx, "signal send", signal_key=signal_key, limit=limit)
