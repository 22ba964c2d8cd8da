"""``runlane runs list|get|attempts``: operator reads through ``runlane.runs``.

Dates are parsed (ISO 8601 only) before the runtime is loaded.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

import typer

from ..errors import ErrorCode, RunlaneError
from ..storage.operator import TimeRange
from ..vocabulary import RunEventSortField, RunSortField, RunStatus, SortDirection
from .main import guard, state_of, with_runtime
from .options import CursorOption, LimitOption, QueuesOption, parse_iso_datetime

__all__ = ["app"]

app = typer.Typer(help="Read runs.", no_args_is_help=True)

RunIdArgument = Annotated[str, typer.Argument(help="The run id.", metavar="RUN_ID")]


def _date_option(flag: str, help_text: str) -> Any:
    return typer.Option(flag, help=help_text, metavar="DATE")


def _range(start: str | None, end: str | None, start_flag: str, end_flag: str) -> TimeRange | None:
    if start is None and end is None:
        return None
    first: datetime | None = parse_iso_datetime(start, start_flag) if start is not None else None
    last: datetime | None = parse_iso_datetime(end, end_flag) if end is not None else None
    if first is not None and last is not None and first > last:
        raise RunlaneError(
            ErrorCode.CONFIGURATION_INVALID, f"{start_flag} is after {end_flag}; swap them or widen the range."
        )
    return TimeRange(start=first, end=last)


@app.command("list")
def list_runs(
    ctx: typer.Context,
    cursor: CursorOption = None,
    limit: LimitOption = None,
    status: Annotated[
        list[RunStatus] | None, typer.Option("--status", help="Filter by status (repeat for more).", metavar="S")
    ] = None,
    task: Annotated[
        list[str] | None, typer.Option("--task", help="Filter by task id (repeat for more).", metavar="T")
    ] = None,
    queue: QueuesOption = None,
    source_run: Annotated[
        str | None, typer.Option("--source-run", help="Filter by linked source run id.", metavar="ID")
    ] = None,
    created_from: Annotated[str | None, _date_option("--created-from", "Created at or after (ISO 8601).")] = None,
    created_to: Annotated[str | None, _date_option("--created-to", "Created at or before (ISO 8601).")] = None,
    updated_from: Annotated[str | None, _date_option("--updated-from", "Updated at or after (ISO 8601).")] = None,
    updated_to: Annotated[str | None, _date_option("--updated-to", "Updated at or before (ISO 8601).")] = None,
    run_at_from: Annotated[str | None, _date_option("--run-at-from", "Due at or after (ISO 8601).")] = None,
    run_at_to: Annotated[str | None, _date_option("--run-at-to", "Due at or before (ISO 8601).")] = None,
    sort_by: Annotated[RunSortField, typer.Option("--sort-by", help="Sort field.")] = RunSortField.CREATED_AT,
    sort_direction: Annotated[
        SortDirection, typer.Option("--sort-direction", help="Sort direction.")
    ] = SortDirection.DESC,
) -> None:
    """List run summaries in the configured environment."""
    ranges = guard(
        ctx,
        lambda: {
            "created_at": _range(created_from, created_to, "--created-from", "--created-to"),
            "updated_at": _range(updated_from, updated_to, "--updated-from", "--updated-to"),
            "run_at": _range(run_at_from, run_at_to, "--run-at-from", "--run-at-to"),
        },
    )

    async def body(runtime: Any) -> Any:
        return await runtime.runs.list(
            cursor=cursor,
            limit=limit,
            statuses=status or None,
            task_ids=task or None,
            queues=queue or None,
            source_run_id=source_run,
            sort_by=sort_by,
            sort_direction=sort_direction,
            **ranges,
        )

    state_of(ctx).output.runs_table(with_runtime(ctx, body))


@app.command("get")
def get_run(
    ctx: typer.Context,
    run_id: RunIdArgument,
    events: Annotated[bool, typer.Option("--events", help="Include the run's event history.")] = False,
    cursor: CursorOption = None,
    limit: LimitOption = None,
) -> None:
    """Show one run (and its event history with --events)."""

    async def body(runtime: Any) -> tuple[Any, Any]:
        run = await runtime.runs.get(run_id)
        if run is None:
            raise RunlaneError(ErrorCode.RUN_NOT_FOUND, f"Run {run_id!r} was not found.", meta={"run_id": run_id})
        page = None
        if events:
            page = await runtime.runs.events(
                run_id, cursor=cursor, limit=limit, sort_by=RunEventSortField.SEQUENCE, sort_direction=SortDirection.ASC
            )
        return run, page

    run, page = with_runtime(ctx, body)
    state_of(ctx).output.run_detail(run, page)


@app.command("attempts")
def run_attempts(ctx: typer.Context, run_id: RunIdArgument) -> None:
    """List a run's attempts."""

    async def body(runtime: Any) -> Any:
        if await runtime.runs.get(run_id) is None:
            raise RunlaneError(ErrorCode.RUN_NOT_FOUND, f"Run {run_id!r} was not found.", meta={"run_id": run_id})
        return await runtime.runs.attempts(run_id)

    state_of(ctx).output.attempts_table(run_id, with_runtime(ctx, body))
