"""``runlane runs list|get|wait|attempts|steps``: operator reads through ``runlane.runs``.

Dates are parsed (ISO 8601 only) while the command line is, so a malformed one is a usage error.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

import typer

from ..core.store import run_not_found
from ..durations import duration_ms
from ..errors import ErrorCode, RunlaneError
from ..storage.operator import TimeRange
from ..vocabulary import RunEventSortField, RunSortField, RunStatus, SortDirection
from .main import OperationParams, operation, run_operation, usage_guard
from .output import display_value, plural
from .options import (
    DURATION,
    MULTI_VALUE,
    PAGE_LIMIT_HELP,
    CursorOption,
    LimitOption,
    MultiValueCommand,
    QueuesOption,
    checked,
    limit_option,
    parse_iso_datetime,
)

__all__ = ["app"]

app = typer.Typer(help="Read runs.", no_args_is_help=True)

RunIdArgument = Annotated[str, typer.Argument(help="The run id.", metavar="RUN_ID")]


def _date_option(flag: str, help_text: str) -> Any:
    """A date option; its help ends in how a date-time without an offset is read."""
    return typer.Option(
        flag, help=f"{help_text} UTC unless it has an offset.", metavar="DATE", callback=checked(parse_iso_datetime)
    )


def _range(start: str | None, end: str | None, start_flag: str, end_flag: str) -> TimeRange | None:
    if start is None and end is None:
        return None
    first: datetime | None = parse_iso_datetime(start, start_flag) if start is not None else None
    last: datetime | None = parse_iso_datetime(end, end_flag, end_of_day=True) if end is not None else None
    if first is not None and last is not None and first > last:
        raise RunlaneError(
            ErrorCode.CONFIGURATION_INVALID, f"{start_flag} is after {end_flag}; swap them or widen the range."
        )
    return TimeRange(start=first, end=last)


class RunsListParams(OperationParams):
    cursor: str | None = None
    limit: int | None = None
    status: list[RunStatus] | None = None
    task: list[str] | None = None
    queue: list[str] | None = None
    idempotency_key: str | None = None
    singleton_key: str | None = None
    source_run: str | None = None
    created_from: str | None = None
    created_to: str | None = None
    updated_from: str | None = None
    updated_to: str | None = None
    run_at_from: str | None = None
    run_at_to: str | None = None
    sort_by: RunSortField = RunSortField.CREATED_AT
    sort_direction: SortDirection = SortDirection.DESC


def _ranges(params: RunsListParams) -> dict[str, TimeRange | None]:
    return {
        "created_at": _range(params.created_from, params.created_to, "--created-from", "--created-to"),
        "updated_at": _range(params.updated_from, params.updated_to, "--updated-from", "--updated-to"),
        "run_at": _range(params.run_at_from, params.run_at_to, "--run-at-from", "--run-at-to"),
    }


@operation(
    "runs list",
    RunsListParams,
    lambda output, params, result: output.runs_table(result),
    summary=lambda params, page: f"✓ {plural(len(page.data), 'run')}" + (" (more pages)" if page.next_cursor else ""),
)
async def _list(runtime: Any, params: RunsListParams) -> Any:
    return await runtime.runs.list(
        cursor=params.cursor,
        limit=params.limit,
        statuses=params.status or None,
        task_ids=params.task or None,
        queues=params.queue or None,
        idempotency_key=params.idempotency_key,
        singleton_key=params.singleton_key,
        source_run_id=params.source_run,
        sort_by=params.sort_by,
        sort_direction=params.sort_direction,
        **_ranges(params),
    )


class RunsGetParams(OperationParams):
    run_id: str
    events: bool = False
    cursor: str | None = None
    limit: int | None = None
    # The dashboard reads the newest page of a long history (``desc``); the command pages oldest first.
    events_direction: SortDirection = SortDirection.ASC


@operation(
    "runs get",
    RunsGetParams,
    lambda output, params, result: output.run_detail(*result),
    summary=lambda params, result: f"✓ {result[0].id} status={display_value(result[0].status)}"
    + (f" events={len(result[1].data)}" if result[1] is not None else ""),
)
async def _get(runtime: Any, params: RunsGetParams) -> tuple[Any, Any]:
    run = await runtime.runs.get(params.run_id)
    if run is None:
        raise run_not_found(params.run_id, runtime.environment)
    page = None
    if params.events:
        page = await runtime.runs.events(
            params.run_id,
            cursor=params.cursor,
            limit=params.limit,
            sort_by=RunEventSortField.SEQUENCE,
            sort_direction=params.events_direction,
        )
    return run, page


class RunsAttemptsParams(OperationParams):
    run_id: str


@operation(
    "runs attempts",
    RunsAttemptsParams,
    lambda output, params, result: output.attempts_table(*result),
    summary=lambda params, result: f"✓ {params.run_id} {plural(len(result[1]), 'attempt')}",
)
async def _attempts(runtime: Any, params: RunsAttemptsParams) -> Any:
    """The run (its status says whether its latest attempt still runs) and its attempts."""
    run = await runtime.runs.get(params.run_id)
    if run is None:
        raise run_not_found(params.run_id, runtime.environment)
    return run, await runtime.runs.attempts(params.run_id)


class RunsStepsParams(OperationParams):
    run_id: str
    cursor: str | None = None
    limit: int | None = None


@operation(
    "runs steps",
    RunsStepsParams,
    lambda output, params, result: output.steps_table(params.run_id, result),
    summary=lambda params, page: f"✓ {params.run_id} {plural(len(page.data), 'step')}"
    + (" (more pages)" if page.next_cursor else ""),
)
async def _steps(runtime: Any, params: RunsStepsParams) -> Any:
    return await runtime.runs.steps(params.run_id, cursor=params.cursor, limit=params.limit)


class RunsWaitParams(OperationParams):
    run_id: str
    timeout: str | None = None


# Exit statuses of ``runlane runs wait`` besides 0 (the run succeeded) and those of every command.
EXIT_RUN_DID_NOT_SUCCEED = 3
EXIT_WAIT_TIMED_OUT = 4


def _wait_status(params: RunsWaitParams, result: tuple[Any, bool]) -> int:
    run, finished = result
    if not finished:
        return EXIT_WAIT_TIMED_OUT
    return 0 if run.status is RunStatus.SUCCEEDED else EXIT_RUN_DID_NOT_SUCCEED


def _render_wait(output: Any, params: RunsWaitParams, result: tuple[Any, bool]) -> None:
    run, finished = result
    if not finished:
        output.warning(
            "wait_timed_out",
            f"run {run.id} is still {display_value(run.status)} after {params.timeout}; it goes on, and "
            f"`runlane runs wait {run.id}` waits again.",
        )
    output.run_detail(run, None)


def _answer_within(params: RunsWaitParams) -> float | None:
    # Through `runlane dev` the answer comes once the wait is over, so the bridge waits as long (and a little more).
    return None if params.timeout is None else duration_ms(params.timeout, "--timeout") / 1000 + 30


@operation(
    "runs wait",
    RunsWaitParams,
    _render_wait,
    summary=lambda params, result: f"✓ {result[0].id} status={display_value(result[0].status)}"
    + ("" if result[1] else " (still waiting at the timeout)"),
    exit_status=_wait_status,
    answer_within=_answer_within,
)
async def _wait(runtime: Any, params: RunsWaitParams) -> tuple[Any, bool]:
    try:
        return await runtime.runs.wait(params.run_id, timeout=params.timeout), True
    except TimeoutError:
        run = await runtime.runs.get(params.run_id)
        if run is None:  # pruned as the wait ended
            raise run_not_found(params.run_id, runtime.environment) from None
        return run, False


@app.command("list", cls=MultiValueCommand)
def list_runs(
    ctx: typer.Context,
    cursor: CursorOption = None,
    limit: LimitOption = None,
    status: Annotated[
        list[RunStatus] | None,
        typer.Option("--status", help=f"Filter by status; {MULTI_VALUE}.", metavar="S..."),
    ] = None,
    task: Annotated[
        list[str] | None, typer.Option("--task", help=f"Filter by task id; {MULTI_VALUE}.", metavar="T...")
    ] = None,
    queue: QueuesOption = None,
    idempotency_key: Annotated[
        str | None, typer.Option("--idempotency-key", help="Filter by idempotency key.", metavar="K")
    ] = None,
    singleton_key: Annotated[
        str | None, typer.Option("--singleton-key", help="Filter by singleton key.", metavar="K")
    ] = None,
    source_run: Annotated[
        str | None, typer.Option("--source-run", help="Filter by linked source run id.", metavar="ID")
    ] = None,
    created_from: Annotated[str | None, _date_option("--created-from", "Created at or after (ISO 8601).")] = None,
    created_to: Annotated[
        str | None, _date_option("--created-to", "Created at or before (ISO 8601; a date alone includes that day).")
    ] = None,
    updated_from: Annotated[str | None, _date_option("--updated-from", "Updated at or after (ISO 8601).")] = None,
    updated_to: Annotated[
        str | None, _date_option("--updated-to", "Updated at or before (ISO 8601; a date alone includes that day).")
    ] = None,
    run_at_from: Annotated[str | None, _date_option("--run-at-from", "Due at or after (ISO 8601).")] = None,
    run_at_to: Annotated[
        str | None, _date_option("--run-at-to", "Due at or before (ISO 8601; a date alone includes that day).")
    ] = None,
    sort_by: Annotated[
        RunSortField,
        typer.Option(
            "--sort-by",
            help="Sort field; run_at orders by when each run is next due (a running one: when its lease ends), "
            "and lists the runs due at no set time (finished, waiting for a signal, being cancelled) after "
            "the others in either direction.",
        ),
    ] = RunSortField.CREATED_AT,
    sort_direction: Annotated[
        SortDirection, typer.Option("--sort-direction", help="Sort direction.")
    ] = SortDirection.DESC,
) -> None:
    """List run summaries in the configured environment."""
    values: dict[str, Any] = {
        "cursor": cursor,
        "limit": limit,
        "status": status or None,
        "task": task or None,
        "queue": queue or None,
        "idempotency_key": idempotency_key,
        "singleton_key": singleton_key,
        "source_run": source_run,
        "created_from": created_from,
        "created_to": created_to,
        "updated_from": updated_from,
        "updated_to": updated_to,
        "run_at_from": run_at_from,
        "run_at_to": run_at_to,
        "sort_by": sort_by,
        "sort_direction": sort_direction,
    }
    usage_guard(ctx, lambda: _ranges(RunsListParams.model_validate(values)))  # a range ending before it starts
    run_operation(ctx, "runs list", **values)


@app.command("get")
def get_run(
    ctx: typer.Context,
    run_id: RunIdArgument,
    events: Annotated[bool, typer.Option("--events", help="Include the run's event history.")] = False,
    cursor: Annotated[
        str | None, typer.Option("--cursor", help="Continue a previous page of events (with --events).", metavar="C")
    ] = None,
    limit: Annotated[
        int | None, typer.Option("--limit", min=1, help=f"Events (with --events) {PAGE_LIMIT_HELP}", metavar="N")
    ] = None,
) -> None:
    """Show one run (and its event history with --events)."""
    if not events and (cursor is not None or limit is not None):
        ctx.fail("--cursor and --limit page the event history: pass them with --events.")
    run_operation(ctx, "runs get", run_id=run_id, events=events, cursor=cursor, limit=limit)


@app.command("wait")
def wait_for_run(
    ctx: typer.Context,
    run_id: RunIdArgument,
    timeout: Annotated[
        str | None,
        typer.Option(
            "--timeout", help="Stop waiting after this duration (default: as long as it takes).", metavar="D",
            callback=DURATION,
        ),
    ] = None,
) -> None:
    """Wait until a run has finished, then show it. Exit status 0 when it succeeded, 3 when it failed or was
    cancelled, 4 when it was still active at --timeout (it goes on; the run is shown as it was then)."""
    run_operation(ctx, "runs wait", run_id=run_id, timeout=timeout)


@app.command("attempts")
def run_attempts(ctx: typer.Context, run_id: RunIdArgument) -> None:
    """List a run's attempts."""
    run_operation(ctx, "runs attempts", run_id=run_id)


@app.command("steps", short_help="List the durable steps a run completed (ctx.step.run).")
def run_steps(
    ctx: typer.Context,
    run_id: RunIdArgument,
    cursor: CursorOption = None,
    limit: Annotated[int | None, limit_option(f"Steps {PAGE_LIMIT_HELP}")] = None,
) -> None:
    """List the durable steps a run completed (what ctx.step.run stored), in step-key order."""
    run_operation(ctx, "runs steps", run_id=run_id, cursor=cursor, limit=limit)
