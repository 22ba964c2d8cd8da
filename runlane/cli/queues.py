"""``runlane queues``: every registered queue with its policy and how many of its runs are active.

Counts come from ``runlane.runs.list`` filtered by queue and active status, one bounded page per
queue: a queue with more active runs than ``--limit`` shows the limit with a ``+``. The dashboard reads
the same operation.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Annotated, Any

import typer

from ..vocabulary import RunStatus
from .main import OperationParams, operation, run_operation
from .output import plural

__all__ = ["ACTIVE_STATUSES", "QueueOverview", "app"]

app = typer.Typer()

ACTIVE_STATUSES = (
    RunStatus.SCHEDULED,
    RunStatus.QUEUED,
    RunStatus.RUNNING,
    RunStatus.RETRYING,
    RunStatus.RELEASED,
    RunStatus.CANCELLATION_REQUESTED,
)
"""The statuses of runs that are not finished, in the order a run usually moves through them."""

DEFAULT_COUNT_LIMIT = 1000


@dataclass(frozen=True, slots=True)
class QueueOverview:
    """One queue: its policy, the active runs by status, and whether there were more than were counted."""

    name: str
    default: bool
    concurrency_limit: int | None
    counts: dict[str, int] = field(default_factory=dict)
    more: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "default": self.default,
            "concurrency_limit": self.concurrency_limit,
            "counts": {status.value: self.counts.get(status.value, 0) for status in ACTIVE_STATUSES},
            "more": self.more,
        }


class QueuesParams(OperationParams):
    limit: int = DEFAULT_COUNT_LIMIT


async def queue_overview(runtime: Any, limit: int = DEFAULT_COUNT_LIMIT) -> list[QueueOverview]:
    """Each registered queue, with up to ``limit`` of its active runs counted by status."""
    overview = []
    for definition in runtime.queues.values():
        counts: Counter[str] = Counter()
        counted, cursor = 0, None
        while True:
            page = await runtime.runs.list(
                queues=[definition.name], statuses=list(ACTIVE_STATUSES), limit=limit - counted, cursor=cursor
            )
            counts.update(run.status.value for run in page.data)
            counted += len(page.data)
            cursor = page.next_cursor
            if cursor is None or counted >= limit:
                break
        overview.append(
            QueueOverview(
                name=definition.name,
                default=definition.default,
                concurrency_limit=definition.concurrency_limit,
                counts=dict(counts),
                more=cursor is not None,
            )
        )
    return overview


@operation(
    "queues",
    QueuesParams,
    lambda output, params, result: output.queues_table(result),
    summary=lambda params, queues: f"✓ {plural(len(queues), 'queue')}",
)
async def _queues(runtime: Any, params: QueuesParams) -> list[QueueOverview]:
    return await queue_overview(runtime, params.limit)


@app.command("queues")
def queues(
    ctx: typer.Context,
    limit: Annotated[
        int,
        typer.Option("--limit", min=1, max=10_000, help="Count at most this many active runs per queue.", metavar="N"),
    ] = DEFAULT_COUNT_LIMIT,
) -> None:
    """List the registered queues with their policy and their active runs by status."""
    run_operation(ctx, "queues", limit=limit)
