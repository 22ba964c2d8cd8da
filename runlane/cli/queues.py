"""``runlane queues``: every registered queue with its policy and how many of its runs are active.

Each count comes from ``runlane.runs.list`` filtered by the queue and that one status, read in bounded
pages up to ``--limit`` runs: a count is exact below the limit, and a status with more runs than the
limit shows the limit with a ``+`` (listed in ``capped`` in the JSON output). A backlog in one status
never hides the runs of another. The dashboard reads the same operation.
"""

from __future__ import annotations

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
    """One queue: its policy, its active runs by status, and the statuses with more runs than were counted."""

    name: str
    default: bool
    concurrency_limit: int | None
    counts: dict[str, int] = field(default_factory=dict)
    capped: tuple[str, ...] = ()

    @property
    def more(self) -> bool:
        """Whether any status had more runs than were counted."""
        return bool(self.capped)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "default": self.default,
            "concurrency_limit": self.concurrency_limit,
            "counts": {status.value: self.counts.get(status.value, 0) for status in ACTIVE_STATUSES},
            "more": self.more,
            "capped": list(self.capped),
        }


class QueuesParams(OperationParams):
    limit: int = DEFAULT_COUNT_LIMIT


async def queue_overview(runtime: Any, limit: int = DEFAULT_COUNT_LIMIT) -> list[QueueOverview]:
    """Each registered queue, with its runs of each active status counted up to ``limit``."""
    overview = []
    for definition in runtime.queues.values():
        counts: dict[str, int] = {}
        capped: list[str] = []
        for status in ACTIVE_STATUSES:
            counts[status.value], more = await _count(runtime, definition.name, status, limit)
            if more:
                capped.append(status.value)
        overview.append(
            QueueOverview(
                name=definition.name,
                default=definition.default,
                concurrency_limit=definition.concurrency_limit,
                counts=counts,
                capped=tuple(capped),
            )
        )
    return overview


async def _count(runtime: Any, queue_name: str, status: RunStatus, limit: int) -> tuple[int, bool]:
    """How many runs of ``queue_name`` have ``status``, up to ``limit``, and whether there are more."""
    counted, cursor = 0, None
    while True:
        page = await runtime.runs.list(queues=[queue_name], statuses=[status], limit=limit - counted, cursor=cursor)
        counted += len(page.data)
        cursor = page.next_cursor
        if cursor is None or counted >= limit:
            return counted, cursor is not None


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
        typer.Option(
            "--limit",
            min=1,
            max=10_000,
            help="Count at most N runs of each active status per queue; a status with more shows N+.",
            metavar="N",
        ),
    ] = DEFAULT_COUNT_LIMIT,
) -> None:
    """List the registered queues with their policy and their active runs by status."""
    run_operation(ctx, "queues", limit=limit)
