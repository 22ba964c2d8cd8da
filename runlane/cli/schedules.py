"""``runlane schedules``: every registered schedule, when it fires next, and what already fired here.

Read-only. The latest fire time is the schedule's high-water mark in this environment: the latest fire
time a maintenance pass (``runlane tick``, ``runlane dev``) materialized, read from storage, with the run
it created, or none when an active run held the task's singleton key then (a skipped fire time).
The next fire time is computed from the definition by the rules the materializer uses
(``next_fire_time``): the first one after the runtime clock's ``now``, or after the high-water mark when
that is later (no fire time at or before it is materialized again); a disabled schedule has none. A fire
time that is due but not materialized yet shows as neither: its run is created by the next pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import typer

from ..core.authoring import ScheduleDefinition, TaskDefinition
from ..core.schedules import ScheduleOccurrences, next_fire_time
from ..durations import format_duration
from ..errors import RunlaneError
from ..models import ScheduleOccurrence
from ..vocabulary import ScheduleType
from .main import OperationParams, operation, run_operation
from .output import iso, plural

__all__ = ["ScheduleOverview", "app", "schedule_overview"]

app = typer.Typer()


@dataclass(frozen=True, slots=True)
class ScheduleOverview:
    """One registered schedule: its definition, the queue its runs land on, and its fire times."""

    definition: ScheduleDefinition
    task_id: str
    queue: str
    next_fire_at: datetime | None
    latest_fire_at: datetime | None
    latest_error: RunlaneError | None = None
    """Why the latest fire time could not be read (a corrupt record), when it could not."""
    latest_run_ids: tuple[str, ...] | None = None
    """The runs the latest fire time created: none when an active run held the task's singleton key then
    (the fire time was skipped); ``None`` when unknown."""

    @property
    def expression(self) -> str:
        """The schedule's selector in a few words: ``0 9 * * * (Europe/Paris)``, ``every 15m``, ``at ...``."""
        item = self.definition
        if item.type is ScheduleType.CRON:
            return f"{item.cron} ({item.time_zone or 'UTC'})"
        if item.type is ScheduleType.INTERVAL and item.every_ms is not None:
            text = f"every {format_duration(item.every_ms)}"
            if item.starts_at is not None:
                text += f" from {iso(item.starts_at)}"
            if item.ends_at is not None:
                text += f" until {iso(item.ends_at)}"
            return text
        return f"at {iso(item.run_at)}"

    def to_json(self) -> dict[str, Any]:
        item = self.definition
        return {
            "id": item.id,
            "task_id": self.task_id,
            "type": item.type.value,
            "expression": self.expression,
            "cron": item.cron,
            "time_zone": (item.time_zone or "UTC") if item.type is ScheduleType.CRON else None,
            "every_ms": item.every_ms,
            "starts_at": iso(item.starts_at),
            "ends_at": iso(item.ends_at),
            "run_at": iso(item.run_at),
            "queue": self.queue,
            "enabled": item.enabled,
            "next_fire_at": iso(self.next_fire_at),
            "latest_fire_at": iso(self.latest_fire_at),
            "latest_fire_error": None if self.latest_error is None else self.latest_error.to_json(),
            "latest_fire_run_id": self.latest_run_ids[0] if self.latest_run_ids else None,
            "latest_fire_skipped": self.latest_run_ids == (),
        }


class SchedulesParams(OperationParams):
    pass


def _registered(runtime: Any) -> list[tuple[ScheduleDefinition, TaskDefinition]]:
    """Each registered schedule with its task, in registration order (a task registered under two names
    once)."""
    seen: set[str] = set()
    found: list[tuple[ScheduleDefinition, TaskDefinition]] = []
    for task in runtime.tasks.values():
        if task.id not in seen:
            seen.add(task.id)
            found.extend((item, task) for item in task.schedules)
    return found


async def schedule_overview(runtime: Any) -> list[ScheduleOverview]:
    """Each registered schedule with its next fire time after the runtime's ``now`` and the latest fire
    time materialized in the runtime's environment."""
    registered = _registered(runtime)
    if not registered:
        return []
    now = runtime.now()
    default = next((queue for queue in runtime.queues.values() if queue.default), None)
    occurrences = ScheduleOccurrences(runtime.lane.storage, runtime.environment)
    latest = await occurrences.latest_fires([item.id for item, _ in registered])
    occurrence_ids = [stored[0] for stored in latest if isinstance(stored, tuple)]
    occurrences_by_id = dict(zip(occurrence_ids, await occurrences.get_many(occurrence_ids), strict=True))
    overview = []
    for (item, task), stored in zip(registered, latest, strict=True):
        occurrence_id, fired = stored if isinstance(stored, tuple) else ("", None)
        occurrence = occurrences_by_id.get(occurrence_id)  # none for a schedule that has not fired
        # The queue its runs land on: the schedule's, else the task's, else the default (create_runlane
        # refuses a schedule with none of them).
        queue = item.queue or task.queue or default
        overview.append(
            ScheduleOverview(
                definition=item,
                task_id=task.id,
                queue="" if queue is None else queue.name,
                next_fire_at=_next(item, now, fired) if item.enabled else None,
                latest_fire_at=fired,
                latest_error=stored if isinstance(stored, RunlaneError) else None,
                latest_run_ids=tuple(occurrence.run_ids) if isinstance(occurrence, ScheduleOccurrence) else None,
            )
        )
    return overview


def _next(item: ScheduleDefinition, now: datetime, latest: datetime | None) -> datetime | None:
    # A fire time at or before the high-water mark is never materialized: one a maintenance process whose
    # clock is ahead already materialized, or one a changed definition brings back, is not the next.
    if latest is not None and latest > now:
        return next_fire_time(item, latest)
    return next_fire_time(item, now)


@operation(
    "schedules",
    SchedulesParams,
    lambda output, params, result: output.schedules_table(result),
    summary=lambda params, schedules: f"✓ {plural(len(schedules), 'schedule')}",
)
async def _schedules(runtime: Any, params: SchedulesParams) -> list[ScheduleOverview]:
    return await schedule_overview(runtime)


@app.command("schedules", short_help="List the schedules with their next and latest fire times.")
def schedules(ctx: typer.Context) -> None:
    """List the registered schedules with their next and latest fire times.

    The next fire time is the first one after now (none when the schedule is disabled or has none
    ahead); the latest is the last one a maintenance pass (runlane tick, runlane dev) handled in this
    environment: it created a run (--json: latest_fire_run_id), or shows "(skipped)" when an active run
    held the task's singleton key then, so that fire time has no run. A fire time already due that no
    pass has handled yet (maintenance is not running, or a run_at schedule waits for its task's
    singleton key) shows as neither: a pass creates its run.
    """
    run_operation(ctx, "schedules")
