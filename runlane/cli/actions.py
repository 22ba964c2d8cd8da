"""Operator actions on runs: ``runlane retry``, ``rerun``, ``cancel`` and ``prune``.

``prune --older-than`` is checked (a duration or ISO 8601 only) while the command line is parsed.
"""

from __future__ import annotations

import asyncio
import enum
import sys
from typing import Annotated, Any

import typer

from ..core.pruning import PruneResult
from ..defaults import contract_defaults
from ..models import Actor
from ..vocabulary import ActorType, RunStatus, run_status_values
from .main import OperationParams, operation, run_operation, run_operations, state_of
from .output import display_value, plural
from .options import (
    MULTI_VALUE,
    ActorIdOption,
    CursorOption,
    MultiValueCommand,
    RunIdOption,
    limit_option,
    older_than_option,
    parse_cutoff,
)

__all__ = ["app"]

app = typer.Typer()

_SEVERAL = (
    "; several may follow, or - to read them from standard input, one per line (results are printed in turn, "
    "one JSON document per line with --json; exit status 1 if any failed, 0 if there were none)"
)
SourceRunsArgument = Annotated[
    list[str], typer.Argument(help=f"The source run id{_SEVERAL}.", metavar="RUN_ID...", show_default=False)
]


# A linked child's queue defaults to its source's (not to the task's), so its option says so.
ChildQueueOption = Annotated[
    str | None,
    typer.Option("--queue", help="The new run's queue, a registered one (default: the source run's).", metavar="Q"),
]


def _run_ids(ctx: typer.Context, given: list[str]) -> list[str]:
    """The run ids of the command line, or of standard input for ``-``."""
    if given != ["-"]:
        if "-" in given:
            ctx.fail("- reads the run ids from standard input: give it alone.")
        return given
    if sys.stdin is None:
        ctx.fail("- reads the run ids from standard input, which is closed.")
    ids = [line.strip().lstrip("\ufeff") for line in sys.stdin.read().splitlines() if line.strip()]
    if not ids:
        # A pipe from `runlane runs list` that found nothing (no failed runs tonight): nothing to do, no error.
        nothing = f"standard input held no run ids: there was nothing to {ctx.info_name}."
        state_of(ctx).output.warning("no_run_ids", nothing)
    return ids


def _actor(actor_id: str | None) -> Actor:
    return Actor(type=ActorType.OPERATOR, id=actor_id)


class ChildRunParams(OperationParams):
    source_run_id: str
    queue: str | None = None
    run_id: str | None = None
    actor_id: str | None = None


@operation(
    "retry",
    ChildRunParams,
    lambda output, params, run: output.run_result(run, verb="created retry"),
    summary=lambda params, run: f"✓ created retry {run.id} of {params.source_run_id}",
    creates_runs=True,
)
async def _retry(runtime: Any, params: ChildRunParams) -> Any:
    return await runtime.runs.retry(
        params.source_run_id, actor=_actor(params.actor_id), queue=params.queue, run_id=params.run_id
    )


@operation(
    "rerun",
    ChildRunParams,
    lambda output, params, run: output.run_result(run, verb="created rerun"),
    summary=lambda params, run: f"✓ created rerun {run.id} of {params.source_run_id}",
    creates_runs=True,
)
async def _rerun(runtime: Any, params: ChildRunParams) -> Any:
    return await runtime.runs.rerun(
        params.source_run_id, actor=_actor(params.actor_id), queue=params.queue, run_id=params.run_id
    )


class CancelParams(OperationParams):
    run_id: str
    reason: str | None = None
    actor_id: str | None = None


@operation(
    "cancel",
    CancelParams,
    lambda output, params, run: output.run_result(run, verb="cancel recorded for"),
    summary=lambda params, run: f"✓ cancel recorded for {run.id} status={display_value(run.status)}",
)
async def _cancel(runtime: Any, params: CancelParams) -> Any:
    return await runtime.runs.cancel(params.run_id, actor=_actor(params.actor_id), reason=params.reason)


# Only terminal runs can be pruned: --status offers (and its usage error lists) those alone.
TerminalStatus = enum.StrEnum(  # type: ignore[misc]
    "TerminalStatus", {status.name: status.value for status in RunStatus if run_status_values.is_terminal(status)}
)


class PruneParams(OperationParams):
    older_than: str
    status: list[RunStatus] | None = None
    limit: int | None = None
    cursor: str | None = None
    actor_id: str | None = None
    all_pages: bool = False


@operation(
    "prune",
    PruneParams,
    lambda output, params, result: output.prune_result(result),
    summary=lambda params, result: f"✓ pruned {plural(result.pruned, 'run')}"
    + (" (more remain)" if result.next_cursor else ""),
)
async def _prune(runtime: Any, params: PruneParams) -> Any:
    older_than = parse_cutoff(params.older_than)  # each cursor keeps the cutoff of the first page
    pruned = 0
    cursor = params.cursor
    while True:
        try:
            result = await runtime.runs.prune(
                older_than=older_than,
                statuses=params.status or None,
                limit=params.limit,
                cursor=cursor,
                actor=_actor(params.actor_id),
            )
        except asyncio.CancelledError:
            if pruned:  # interrupted (Ctrl-C) after earlier pages: say what is already gone for good
                resume = f"; continue with --cursor {cursor}" if cursor else ""
                sys.stderr.write(f"interrupted: {plural(pruned, 'run')} pruned before the interruption{resume}\n")
            raise
        pruned += result.pruned
        cursor = result.next_cursor
        if not params.all_pages or cursor is None:
            return PruneResult(pruned=pruned, next_cursor=cursor)


def _linked(
    ctx: typer.Context, name: str, sources: list[str], queue: str | None, run_id: str | None, actor_id: str | None
) -> None:
    ids = _run_ids(ctx, sources)
    if run_id is not None and len(ids) > 1:
        ctx.fail("--run-id names one new run: give one source run with it.")
    items = [{"source_run_id": source, "queue": queue, "run_id": run_id, "actor_id": actor_id} for source in ids]
    run_operations(ctx, name, items)


@app.command("retry", short_help="Create a manual retry child of each failed run given.")
def retry(
    ctx: typer.Context,
    source_run_ids: SourceRunsArgument,
    queue: ChildQueueOption = None,
    run_id: RunIdOption = None,
    actor_id: ActorIdOption = None,
) -> None:
    """Create a manual retry child of a failed run (of each run given)."""
    _linked(ctx, "retry", source_run_ids, queue, run_id, actor_id)


@app.command("rerun", short_help="Create a rerun child of each terminal run given.")
def rerun(
    ctx: typer.Context,
    source_run_ids: SourceRunsArgument,
    queue: ChildQueueOption = None,
    run_id: RunIdOption = None,
    actor_id: ActorIdOption = None,
) -> None:
    """Create a linked child of a terminal run to execute its work again (of each run given)."""
    _linked(ctx, "rerun", source_run_ids, queue, run_id, actor_id)


@app.command("cancel", short_help="Cancel each run given (a running one cooperatively).")
def cancel(
    ctx: typer.Context,
    run_ids: Annotated[
        list[str], typer.Argument(help=f"The run to cancel{_SEVERAL}.", metavar="RUN_ID...", show_default=False)
    ],
    reason: Annotated[str | None, typer.Option("--reason", help="Cancellation reason.", metavar="R")] = None,
    actor_id: ActorIdOption = None,
) -> None:
    """Cancel a waiting run, or request cooperative cancellation of a running one (each run given)."""
    items = [{"run_id": run_id, "reason": reason, "actor_id": actor_id} for run_id in _run_ids(ctx, run_ids)]
    run_operations(ctx, "cancel", items)


@app.command("prune", cls=MultiValueCommand)
def prune(
    ctx: typer.Context,
    older_than: Annotated[str, older_than_option("30d")],
    status: Annotated[
        list[TerminalStatus] | None,
        typer.Option("--status", help=f"Terminal status to prune; {MULTI_VALUE}.", metavar="S..."),
    ] = None,
    limit: Annotated[
        int | None,
        limit_option(
            f"Prune at most N runs in one call (default {contract_defaults.pruning.batch_limit}); "
            "a call that stops early prints the cursor to continue with."
        ),
    ] = None,
    cursor: CursorOption = None,
    actor_id: ActorIdOption = None,
    all_pages: Annotated[
        bool,
        typer.Option("--all", help="Follow each next cursor until every run before the cutoff is pruned."),
    ] = False,
) -> None:
    """Delete old terminal run history.

    A pruned run takes its events, steps and idempotency key with it (a producer retrying with that
    key creates a new run): keep --older-than at least as long as your idempotency_key_ttl."""
    run_operation(
        ctx,
        "prune",
        older_than=older_than,
        status=[RunStatus(value) for value in status] if status else None,
        limit=limit,
        cursor=cursor,
        actor_id=actor_id,
        all_pages=all_pages,
    )
