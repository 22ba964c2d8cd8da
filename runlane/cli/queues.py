"""``runlane queues``: every registered queue with its policy and how many of its runs are active, and
each queue not registered here that still holds active runs.

Each status is counted first across all queues, oldest runs first, with ``runlane.runs.list`` in bounded
pages up to ``--limit`` runs. When a status has no more runs than that, this one walk gives every queue's
exact count. Otherwise each registered queue's runs of the status are counted on their own (filtered by
queue, up to the limit), and a status with more runs than the limit shows the limit with a ``+`` (listed
in ``capped`` in the JSON output). A backlog in one status never hides the runs of another.

A run whose queue is not registered (the queue was renamed or removed since it was triggered, or the
run belongs to another program over the same storage and environment) is claimed by no worker of this
program. Such queues are listed after the registered ones, marked ``registered: false``, with what
the walks found: a status whose walk reached the limit is a lower bound, marked ``+`` (oldest first,
so runs left behind by a rename are found before a newer backlog). The dashboard reads the same operation.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Annotated, Any

import typer

from ..vocabulary import RunSortField, RunStatus, SortDirection
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
    """One queue: its policy, its active runs by status, and the statuses with more runs than were counted.

    A queue not registered in this program (``registered`` false) has no known policy: ``default`` is
    false and ``concurrency_limit`` is ``None``.
    """

    name: str
    default: bool
    concurrency_limit: int | None
    counts: dict[str, int] = field(default_factory=dict)
    capped: tuple[str, ...] = ()
    registered: bool = True

    @property
    def more(self) -> bool:
        """Whether any status had more runs than were counted."""
        return bool(self.capped)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "registered": self.registered,
            "default": self.default,
            "concurrency_limit": self.concurrency_limit,
            "counts": {status.value: self.counts.get(status.value, 0) for status in ACTIVE_STATUSES},
            "more": self.more,
            "capped": list(self.capped),
        }


class QueuesParams(OperationParams):
    limit: int = DEFAULT_COUNT_LIMIT


async def queue_overview(runtime: Any, limit: int = DEFAULT_COUNT_LIMIT) -> list[QueueOverview]:
    """Each registered queue, then each other queue holding active runs, with its runs of each active
    status counted up to ``limit``."""
    walks = {status: await _count_by_queue(runtime, status, limit) for status in ACTIVE_STATUSES}
    overview = []
    for definition in runtime.queues.values():
        counts: dict[str, int] = {}
        capped: list[str] = []
        for status, (found, walk_capped) in walks.items():
            if walk_capped:
                counts[status.value], more = await _count(runtime, definition.name, status, limit)
            else:
                counts[status.value], more = found[definition.name], False
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
    registered = {definition.name for definition in runtime.queues.values()}
    others = sorted({name for found, _ in walks.values() for name in found} - registered)
    for name in others:
        overview.append(
            QueueOverview(
                name=name,
                default=False,
                concurrency_limit=None,
                counts={status.value: found[name] for status, (found, _) in walks.items()},
                capped=tuple(status.value for status, (_, walk_capped) in walks.items() if walk_capped),
                registered=False,
            )
        )
    return overview


async def _count_by_queue(runtime: Any, status: RunStatus, limit: int) -> tuple[Counter[str], bool]:
    """The runs with ``status`` in every queue, oldest first, up to ``limit`` runs: how many each queue
    has, and whether there are more."""
    found: Counter[str] = Counter()
    counted, cursor = 0, None
    while True:
        page = await runtime.runs.list(
            statuses=[status],
            sort_by=RunSortField.CREATED_AT,
            sort_direction=SortDirection.ASC,
            limit=limit - counted,
            cursor=cursor,
        )
        found.update(run.queue for run in page.data)
        counted += len(page.data)
        cursor = page.next_cursor
        if cursor is None or counted >= limit:
            return found, cursor is not None


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


@app.command("queues", short_help="List the queues with their active runs by status.")
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
    """List the queues with their policy and their active runs by status.

    A queue this project does not register is listed too while it holds active runs (no worker of this
    project claims them): a queue renamed or removed since they were triggered."""
    run_operation(ctx, "queues", limit=limit)
