"""``runlane observations trim``: retention for the durable observation stream (``runlane.observations.trim``).

``runs.prune`` deletes old run history but keeps the observation records, so exporters can catch up
after it; this command is their retention. Records an exporter of ``runlane.toml`` has not exported yet
are always kept, and so are those of every ``--consumer`` named.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from ..core.observations import ObservationTrimResult
from ..core.pruning import resolve_older_than
from .main import OperationParams, guard, load_cli_config, operation, run_operation
from .options import MULTI_VALUE, MultiValueCommand, older_than_option, parse_cutoff
from .output import plural

__all__ = ["app"]

app = typer.Typer(help="Manage the durable observation stream.", no_args_is_help=True)


class ObservationTrimParams(OperationParams):
    older_than: str
    consumers: list[str] = []
    limit: int | None = None
    all_pages: bool = False


@operation(
    "observations trim",
    ObservationTrimParams,
    lambda output, params, result: output.trim_result(result),
    summary=lambda params, result: f"✓ trimmed {plural(result.deleted, 'observation record')}",
)
async def _trim(runtime: Any, params: ObservationTrimParams) -> Any:
    older_than = resolve_older_than(parse_cutoff(params.older_than), runtime.now())  # one cutoff for every call
    deleted = 0
    while True:
        result = await runtime.observations.trim(older_than=older_than, consumers=params.consumers, limit=params.limit)
        deleted += result.deleted
        if not params.all_pages or not result.more:
            return ObservationTrimResult(deleted=deleted, more=result.more)


@app.command("trim", cls=MultiValueCommand, short_help="Delete exported observation records older than a cutoff.")
def trim(
    ctx: typer.Context,
    older_than: Annotated[str, older_than_option("7d")],
    consumer: Annotated[
        list[str] | None,
        typer.Option(
            "--consumer", help=f"Also keep what this consumer has not exported; {MULTI_VALUE}.", metavar="C..."
        ),
    ] = None,
    limit: Annotated[
        int | None, typer.Option("--limit", min=1, help="Records to delete per call (default 1000).", metavar="N")
    ] = None,
    all_pages: Annotated[bool, typer.Option("--all", help="Call again until nothing old is left.")] = False,
) -> None:
    """Delete observation records recorded before a cutoff that every exporter has exported."""
    configured = guard(ctx, lambda: [entry.consumer for entry in load_cli_config(ctx).exporters])
    consumers = list(dict.fromkeys([*configured, *(consumer or [])]))
    run_operation(
        ctx, "observations trim", older_than=older_than, consumers=consumers, limit=limit, all_pages=all_pages
    )
