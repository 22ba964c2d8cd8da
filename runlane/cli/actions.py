"""Operator actions on runs: ``runlane retry``, ``rerun``, ``cancel`` and ``prune``.

``prune --older-than`` is checked (a duration or ISO 8601 only) before the runtime is loaded.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from ..models import Actor
from ..vocabulary import ActorType, RunStatus
from .main import guard, state_of, with_runtime
from .options import ActorIdOption, CursorOption, LimitOption, QueueOption, RunIdOption, parse_cutoff

__all__ = ["app"]

app = typer.Typer()

SourceRunArgument = Annotated[str, typer.Argument(help="The source run id.", metavar="RUN_ID")]


def _actor(actor_id: str | None) -> Actor:
    return Actor(type=ActorType.OPERATOR, id=actor_id)


@app.command("retry")
def retry(
    ctx: typer.Context,
    source_run_id: SourceRunArgument,
    queue: QueueOption = None,
    run_id: RunIdOption = None,
    actor_id: ActorIdOption = None,
) -> None:
    """Create a manual retry child of a failed run."""

    async def body(runtime: Any) -> Any:
        return await runtime.runs.retry(source_run_id, actor=_actor(actor_id), queue=queue, run_id=run_id)

    state_of(ctx).output.run_result(with_runtime(ctx, body), verb="created retry")


@app.command("rerun")
def rerun(
    ctx: typer.Context,
    source_run_id: SourceRunArgument,
    queue: QueueOption = None,
    run_id: RunIdOption = None,
    actor_id: ActorIdOption = None,
) -> None:
    """Create a linked child of a terminal run to execute its work again."""

    async def body(runtime: Any) -> Any:
        return await runtime.runs.rerun(source_run_id, actor=_actor(actor_id), queue=queue, run_id=run_id)

    state_of(ctx).output.run_result(with_runtime(ctx, body), verb="created rerun")


@app.command("cancel")
def cancel(
    ctx: typer.Context,
    run_id: Annotated[str, typer.Argument(help="The run to cancel.", metavar="RUN_ID")],
    reason: Annotated[str | None, typer.Option("--reason", help="Cancellation reason.", metavar="R")] = None,
    actor_id: ActorIdOption = None,
) -> None:
    """Cancel a waiting run, or request cooperative cancellation of a running one."""

    async def body(runtime: Any) -> Any:
        return await runtime.runs.cancel(run_id, actor=_actor(actor_id), reason=reason)

    state_of(ctx).output.run_result(with_runtime(ctx, body), verb="cancel recorded for")


@app.command("prune")
def prune(
    ctx: typer.Context,
    older_than: Annotated[
        str, typer.Option("--older-than", help="A duration (30d) or ISO 8601 cutoff.", metavar="DURATION_OR_ISO")
    ],
    status: Annotated[
        list[RunStatus] | None, typer.Option("--status", help="Terminal status to prune (repeat for more).", metavar="S")
    ] = None,
    limit: LimitOption = None,
    cursor: CursorOption = None,
    actor_id: ActorIdOption = None,
) -> None:
    """Delete old terminal run history."""
    cutoff = guard(ctx, lambda: parse_cutoff(older_than))

    async def body(runtime: Any) -> Any:
        return await runtime.runs.prune(
            older_than=cutoff, statuses=status or None, limit=limit, cursor=cursor, actor=_actor(actor_id)
        )

    state_of(ctx).output.prune_result(with_runtime(ctx, body))
