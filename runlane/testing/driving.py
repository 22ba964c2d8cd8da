"""Driving a runtime on a ``ControlledClock`` until nothing is left to do: ``run_until_idle()``.

Where ``wait_for_run_status()`` and its kin wait in real time for something else to move a run, this
helper moves the runs itself: it ticks, executes every due run and steps the controlled clock to the next
time something becomes due, the way a time-skipping test environment does. Retries, releases, wait
timeouts and schedules then play out in one call, without sleeping and without hand-written
``clock.advance()`` steps.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable
from datetime import datetime

from ..core.attempt import REASON_WORKER_STOPPED
from ..core.authoring import ScheduleDefinition
from ..core.cancellation import CancellationController
from ..core.runtime import Runlane
from ..core.schedules import next_fire_time, schedule_occurrence_id
from ..core.sync import SyncRunlane
from ..durations import Duration, duration_ms, later
from ..errors import ErrorCode, RunlaneError
from ..models import RunRecord, RunSummary, ScheduleOccurrence
from ..run_scans import (
    get_run_attempt_timeout_finalization_available_at,
    get_run_cancellation_finalization_available_at,
    get_run_runnable_available_at,
)
from ..storage import TimeRange
from ..vocabulary import RunSortField, RunStatus, ScheduleOccurrenceStatus, SortDirection, run_status_values
from .clock import ControlledClock

__all__ = ["run_until_idle"]

DEFAULT_MAX_ADVANCE = "1d"
DEFAULT_LIMIT = 10_000

# Statuses whose next due time is the listed ``run_at``: a delayed queued run, a scheduled delivery, a
# retry, a time release or the timeout of a signal or run-completion wait (a wait without one has none).
_WAITING = (RunStatus.QUEUED, RunStatus.SCHEDULED, RunStatus.RETRYING, RunStatus.RELEASED)
# Statuses whose due time is on the lease or the attempt deadline, which only the full record carries.
_HELD = (RunStatus.RUNNING, RunStatus.CANCELLATION_REQUESTED)
_PAGE = 100
_SHOWN_ACTIVE = 5
# How long (real time) an attempt may run before its handler is checked for waiting on its signal alone.
_BLOCKED_CHECK_S = 0.02
# How long (real time) a handler may keep waiting for its signal alone, its deadline out of reach, before
# the call fails instead of waiting for ever.
_STUCK_S = 0.5


def _invalid(message: str, field: str) -> RunlaneError:
    return RunlaneError(ErrorCode.CONFIGURATION_INVALID, message, meta={"field": field})


def _check_arguments(runlane: object, clock: object, tick: object, limit: object) -> None:
    if isinstance(runlane, SyncRunlane):
        raise _invalid(
            "run_until_idle() is a coroutine over the asynchronous runtime; pass the Runlane itself, not "
            "runlane.sync, and await the call (in a synchronous test: runlane.sync.call(run_until_idle, "
            "runlane, clock)).",
            "runlane",
        )
    if not isinstance(runlane, Runlane):
        raise _invalid(
            f"run_until_idle() takes the runtime from create_runlane() first, got {type(runlane).__name__}.",
            "runlane",
        )
    if not isinstance(clock, ControlledClock):
        raise _invalid(
            f"run_until_idle() moves a ControlledClock, got {type(clock).__name__}; create the runtime with "
            "create_runlane(..., clock=ControlledClock()) and pass that clock.",
            "clock",
        )
    if runlane.clock is not clock:
        raise _invalid(
            "run_until_idle() got a ControlledClock the runtime does not use; pass the clock given to "
            "create_runlane(clock=...), or moving it would change nothing the runtime sees.",
            "clock",
        )
    if not runlane.lane.capabilities.operator_reads:
        raise RunlaneError(
            ErrorCode.CAPABILITY_UNSUPPORTED,
            f"run_until_idle() finds what becomes due next through runlane.runs, which lane "
            f"{runlane.lane.name!r} cannot read; test on a lane with operator reads, such as local_lane().",
        )
    if not isinstance(tick, bool):
        raise _invalid(f"run_until_idle() tick must be True or False, got {tick!r}.", "tick")
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise _invalid(f"run_until_idle() limit must be a positive whole number of runs, got {limit!r}.", "limit")


async def run_until_idle(
    runlane: Runlane,
    clock: ControlledClock,
    *,
    max_advance: Duration = DEFAULT_MAX_ADVANCE,
    tick: bool = True,
    limit: int = DEFAULT_LIMIT,
) -> list[RunRecord]:
    """Execute every run that is or becomes due, moving ``clock`` forward as far as needed, and return
    the ``RunRecord`` of each executed attempt in the order they ran.

    At each time it reaches it runs ``runlane.tick()`` (with ``tick``: due schedules, cancellation and
    timeout finalization, bounded-queue dispatch) and ``runlane.execute_next()`` until no run is due,
    and repeats that while runs were executed (a finished run can wake another at the same time). Then
    it sets the clock to exactly the earliest time at which something becomes due: the ``run_at`` of a
    delayed, retrying or released run, the timeout of a signal or run-completion wait, the lease expiry
    of a run left running (a worker that died), and with ``tick`` an attempt deadline, the lease expiry
    of a run whose cancellation was requested, the next fire time of an enabled schedule of the
    runtime's tasks or the retry of a ``run_at`` fire time that met a singleton conflict (its claim
    expiring). A run waiting for a signal or another run without a timeout is not due: it stays
    released. An attempt whose handler waits for its signal alone (``await ctx.signal.wait()``) can only
    end at its ``max_attempt_duration`` deadline: the clock moves there while it waits, and a deadline
    past ``max_advance``, or none (a task without ``max_attempt_duration``), raises ``RuntimeError`` naming
    the run instead of waiting for ever (and aborts the handler's signal, ``worker_stopped``, so a ``def``
    handler's thread ends too). Short waits that end by themselves, one after another (pauses
    between batches of work), are progress and move nothing.

    It returns when nothing is left to become due, or when the next due time lies more than
    ``max_advance`` after the clock's time at the call; the clock is then left at the last due time it
    reached, not moved on to the limit. Executing ``limit`` runs with work still due raises
    ``RuntimeError`` naming the runs still active: a task that releases or retriggers itself forever
    fails the test instead of hanging it.

    Meant for tests in which nothing else executes the runtime's runs: a worker running beside it
    competes for the same runs. Bad arguments raise ``RunlaneError`` ``configuration_invalid``.
    """
    _check_arguments(runlane, clock, tick, limit)
    horizon = later(clock.now(), duration_ms(max_advance, "max_advance"))
    executed: list[RunRecord] = []
    while True:
        while True:
            if tick:
                await runlane.tick()
            if not await _execute_due(runlane, clock, executed, limit, horizon, tick):
                break
        due = await _next_due(runlane, clock.now(), tick, include_due=False)
        if due is None or due > horizon:
            return executed
        clock.set(due)


async def _execute_due(
    runlane: Runlane, clock: ControlledClock, executed: list[RunRecord], limit: int, horizon: datetime, tick: bool
) -> bool:
    """Execute due runs until none is left; whether any was executed."""
    ran = False
    while True:
        if len(executed) >= limit:
            pending = await _next_due(runlane, clock.now(), tick, include_due=True)
            if pending is not None and pending <= horizon:
                raise RuntimeError(await _runaway_message(runlane, executed, limit))
            return ran
        run = await _execute_next(runlane, clock, horizon)
        if run is None:
            return ran
        executed.append(run)
        ran = True


async def _execute_next(runlane: Runlane, clock: ControlledClock, horizon: datetime) -> RunRecord | None:
    """``runlane.execute_next()``; while its handler waits for its signal alone (``await ctx.signal.wait()``),
    only its ``max_attempt_duration`` deadline can end it, so the clock moves there, as far as ``horizon``;
    a handler that keeps waiting with its deadline past ``horizon``, or without a deadline, raises
    ``RuntimeError``, as nothing will end it."""
    # Aborted when the call gives up on the attempt: cancelling execute_next() ends an async def handler, but a
    # def handler's thread runs on, and one waiting for its signal alone would hold up the test process's exit.
    giving_up = CancellationController()
    executing = asyncio.ensure_future(runlane.execute_next(signal=giving_up.signal))
    seen: dict[tuple[int, int], datetime | None] = {}
    # The lasting waits, and since when (real time) the same ones have lasted with no deadline in reach.
    stuck: tuple[set[tuple[int, int]], float] | None = None
    try:
        while True:
            done, _ = await asyncio.wait({executing}, timeout=_BLOCKED_CHECK_S)
            if done:
                return executing.result()
            waits = runlane.registry.signal_waits()
            # A wait seen at two checks in a row: one that ended and another began (a pause between batches
            # that a stop would cut short) is a handler making progress, which moving the clock would time out.
            lasting = {key: at for key, at in waits.items() if key in seen}
            seen = waits
            deadlines = [at for at in lasting.values() if at is not None and at <= horizon]
            if deadlines and min(deadlines) > clock.now():
                clock.set(min(deadlines))
            if deadlines or not lasting:
                stuck = None
            elif stuck is None or stuck[0] != set(lasting):
                stuck = (set(lasting), time.monotonic())
            elif time.monotonic() - stuck[1] >= _STUCK_S:
                beyond = [at for at in lasting.values() if at is not None]
                raise RuntimeError(await _stuck_message(runlane, min(beyond, default=None), horizon))
    finally:
        if not executing.done():
            giving_up.abort(REASON_WORKER_STOPPED)
            executing.cancel()


async def _next_due(runlane: Runlane, now: datetime, tick: bool, *, include_due: bool) -> datetime | None:
    """The earliest time after ``now`` at which something becomes due (with ``include_due``: the earliest
    time anything is due, ``now`` or before included), or ``None`` when nothing ever will be."""
    times = [await _next_waiting(runlane, now, include_due), *await _held_times(runlane, now, tick, include_due)]
    if tick:
        times.extend(next_fire_time(item, now) for item in _schedules(runlane))
        times.extend(await _one_off_retries(runlane, now, include_due))
    found = [at for at in times if at is not None]
    return min(found, default=None)


def _waiting_due_at(run: RunSummary) -> datetime | None:
    if run.status is RunStatus.QUEUED:
        return run.run_at or run.updated_at
    return run.run_at


async def _next_waiting(runlane: Runlane, now: datetime, include_due: bool) -> datetime | None:
    # The listing sorts these statuses by when they are due (runs without a time last); runs due at
    # ``now`` that were not executed (a full bounded queue, a task this runtime does not register) are
    # passed over, as they will not become due later than they are.
    cursor = None
    while True:
        page = await runlane.runs.list(
            cursor=cursor,
            limit=_PAGE,
            statuses=list(_WAITING),
            run_at=None if include_due else TimeRange(start=now),
            sort_by=RunSortField.RUN_AT,
            sort_direction=SortDirection.ASC,
        )
        for summary in page.data:
            at = _waiting_due_at(summary)
            if at is None:
                return None  # the rest have no due time either
            if include_due or at > now:
                return at
        if page.next_cursor is None:
            return None
        cursor = page.next_cursor


async def _held_times(runlane: Runlane, now: datetime, tick: bool, include_due: bool) -> list[datetime]:
    """Lease expiries (and, with ``tick``, attempt deadlines and cancellation finalization) of held runs."""
    times: list[datetime] = []
    async for summary in _all_runs(runlane, _HELD):
        run = await runlane.runs.get(summary.id)
        if run is None:
            continue  # pruned since the listing
        candidates = [get_run_runnable_available_at(run)]
        if tick:
            candidates += [
                get_run_cancellation_finalization_available_at(run),
                get_run_attempt_timeout_finalization_available_at(run),
            ]
        times.extend(at for at in candidates if at is not None and (include_due or at > now))
    return times


async def _all_runs(runlane: Runlane, statuses: Iterable[RunStatus]) -> AsyncIterator[RunSummary]:
    cursor = None
    while True:
        page = await runlane.runs.list(cursor=cursor, limit=_PAGE, statuses=list(statuses))
        for summary in page.data:
            yield summary
        if page.next_cursor is None:
            return
        cursor = page.next_cursor


async def _one_off_retries(runlane: Runlane, now: datetime, include_due: bool) -> list[datetime]:
    """When the past fire times of ``run_at`` schedules that are claimed but have no run yet (a singleton
    conflict, or a materializer that died) are tried again: as their claims expire."""
    past = [item for item in _schedules(runlane) if item.run_at is not None and item.run_at <= now]
    if not past:
        return []
    occurrences = runlane._materializer.occurrences
    ids = [schedule_occurrence_id(runlane.environment, item.id, item.run_at) for item in past]  # type: ignore[arg-type]
    times = []
    for occurrence in await occurrences.get_many(ids):
        if not isinstance(occurrence, ScheduleOccurrence) or occurrence.status is not ScheduleOccurrenceStatus.CLAIMED:
            continue  # completed or never claimed (the next tick claims it), or unreadable (tick reports it)
        expires = occurrence.claim_expires_at
        if expires is not None and (include_due or expires > now):
            times.append(expires)
    return times


def _schedules(runlane: Runlane) -> list[ScheduleDefinition]:
    return [item for definition in runlane.tasks.values() for item in definition.schedules if item.enabled]


def _describe(run: RunSummary) -> str:
    due = _waiting_due_at(run) if run.status in _WAITING else None
    when = "" if due is None else f", due {_utc(due)}"
    return f"{run.id} ({run.task_id}, {run.status.value}{when})"


def _utc(at: datetime) -> str:
    return at.isoformat().replace("+00:00", "Z")


async def _stuck_message(runlane: Runlane, deadline: datetime | None, horizon: datetime) -> str:
    page = await runlane.runs.list(limit=_SHOWN_ACTIVE, statuses=list(_HELD))
    shown = "; ".join(_describe(run) for run in page.data) or "none listed"
    if deadline is None:
        return (
            f"run_until_idle() is executing a run whose handler waits for its signal alone ({shown}), and its "
            "task sets no max_attempt_duration: nothing will end the attempt. Set max_attempt_duration= on the "
            "task, or have the handler return (a release, say) instead of waiting for ctx.signal."
        )
    return (
        f"run_until_idle() is executing a run whose handler waits for its signal alone ({shown}): only its "
        f"max_attempt_duration deadline, {_utc(deadline)}, can end it, and that lies past max_advance (the "
        f"clock moves as far as {_utc(horizon)}). Pass a larger max_advance=, or have the handler return "
        "(a release, say) instead of waiting for ctx.signal."
    )


async def _runaway_message(runlane: Runlane, executed: list[RunRecord], limit: int) -> str:
    statuses = sorted(run_status_values.active, key=lambda status: status.value)
    page = await runlane.runs.list(
        limit=_SHOWN_ACTIVE, statuses=statuses, sort_by=RunSortField.RUN_AT, sort_direction=SortDirection.ASC
    )
    shown = "; ".join(_describe(run) for run in page.data) or "none listed"
    more = " and more" if page.next_cursor is not None else ""
    last = executed[-1]
    return (
        f"run_until_idle() executed {limit:,} runs, its limit, and work is still due: a task that keeps "
        f"retrying, releasing or triggering runs never lets the lane go idle, and a schedule fires again and "
        f"again until max_advance. Last executed: {last.id} ({last.task_id}, {last.status.value}). Still "
        f"active: {shown}{more}. Pass a smaller max_advance= (or tick=False) for schedules, or a larger limit= "
        "if the test needs more runs."
    )
