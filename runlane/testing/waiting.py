"""Waiting for durable state in tests that run a live worker (or another process) beside them.

Tests driven by a ``ControlledClock`` and ``execute_next()`` need none of this. These helpers are for
tests where something else moves the run: a ``runlane.worker()`` on the same event loop, a worker
process, ``runlane dev``. They read through the runtime's operator API (``runlane.runs``), so they work
on every lane with operator reads, and they wait in real time: ``timeout`` and ``interval`` are wall
clock durations whatever clock the runtime uses.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable, Collection
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar, overload

from ..durations import Duration, parse_duration
from ..errors import ErrorCode, RunlaneError
from ..models import RunEventRecord, RunRecord
from ..vocabulary import RunEventSortField, RunEventType, RunStatus, run_status_values

if TYPE_CHECKING:
    from ..core.runtime import Runlane

__all__ = ["list_run_event_types", "wait_for_condition", "wait_for_run_event", "wait_for_run_status"]

T = TypeVar("T")

DEFAULT_TIMEOUT = "5s"
DEFAULT_INTERVAL = "10ms"


def _seconds(value: Duration, what: str) -> float:
    return parse_duration(value, what, code=ErrorCode.VALIDATION_FAILED) / timedelta(seconds=1)


# A check returns a falsy value (typically None) until the condition holds; the wait returns the first
# truthy value, so an Optional result type is narrowed away.
@overload
async def wait_for_condition(
    check: Callable[[], Awaitable[T | None]],
    *,
    timeout: Duration = DEFAULT_TIMEOUT,
    interval: Duration = DEFAULT_INTERVAL,
    description: str = "the condition",
) -> T: ...


@overload
async def wait_for_condition(
    check: Callable[[], T | None],
    *,
    timeout: Duration = DEFAULT_TIMEOUT,
    interval: Duration = DEFAULT_INTERVAL,
    description: str = "the condition",
) -> T: ...


async def wait_for_condition(
    check: Callable[[], Any],
    *,
    timeout: Duration = DEFAULT_TIMEOUT,
    interval: Duration = DEFAULT_INTERVAL,
    description: str = "the condition",
) -> Any:
    """Call ``check()`` (a function or a coroutine function) every ``interval`` until it returns a
    truthy value, and return that value. Raises ``TimeoutError`` naming ``description`` when
    ``timeout`` passes first, also while an awaited check is still running (a read that hangs). An
    exception ``check()`` raises ends the wait at once."""
    if inspect.isawaitable(check) or not callable(check):
        if inspect.iscoroutine(check):
            check.close()  # never awaited: closed, so it does not warn as well
        raise TypeError(
            f"wait_for_condition() takes a function to call again and again, got {check!r}; "
            "pass lambda: ... (or the coroutine function itself) instead of a call's result."
        )
    limit = _seconds(timeout, "timeout")
    pause = _seconds(interval, "interval")
    deadline = time.monotonic() + limit
    while True:
        value = check()
        if inspect.isawaitable(value):
            try:
                value = await asyncio.wait_for(value, max(deadline - time.monotonic(), 0))
            except TimeoutError:
                raise TimeoutError(f"{description} did not happen within {timeout} (a check still running)") from None
        if value:
            return value
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{description} did not happen within {timeout}")
        await asyncio.sleep(min(pause, left))


def _statuses(status: RunStatus | str | Collection[RunStatus | str]) -> frozenset[RunStatus]:
    wanted = [status] if isinstance(status, (RunStatus, str)) else list(status)
    try:
        found = frozenset(RunStatus(value) for value in wanted)
    except ValueError:
        known = ", ".join(member.value for member in RunStatus)
        raise RunlaneError(
            ErrorCode.VALIDATION_FAILED, f"Unknown run status in {status!r}; use one of: {known}."
        ) from None
    if not found:
        raise RunlaneError(ErrorCode.VALIDATION_FAILED, "wait_for_run_status() needs at least one status.")
    return found


def _describe(run: RunRecord) -> str:
    if run.failure is None:
        return run.status.value
    return f"{run.status.value} ({run.failure.code.value}: {run.failure.message})"


async def wait_for_run_status(
    runlane: Runlane,
    run_id: str,
    status: RunStatus | str | Collection[RunStatus | str],
    *,
    timeout: Duration = DEFAULT_TIMEOUT,
    interval: Duration = DEFAULT_INTERVAL,
) -> RunRecord:
    """Wait until run ``run_id`` has ``status`` (or one of several) and return it.

    A run that does not exist yet is waited for. A run that reaches a terminal status it was not
    awaited in fails the wait at once with an ``AssertionError`` saying how it ended (a terminal run
    never changes again), instead of waiting out the timeout.
    """
    wanted = _statuses(status)
    names = " or ".join(sorted(value.value for value in wanted))
    last: list[RunRecord | None] = [None]

    async def reached() -> RunRecord | None:
        run = last[0] = await runlane.runs.get(run_id)
        if run is None or run.status in wanted:
            return run
        if run_status_values.is_terminal(run.status):
            raise AssertionError(f"Run {run_id} ended {_describe(run)} while a test waited for {names}.")
        return None

    try:
        return await wait_for_condition(reached, timeout=timeout, interval=interval)
    except TimeoutError:
        seen = "does not exist" if last[0] is None else f"is {_describe(last[0])}"
        raise TimeoutError(f"Run {run_id} did not reach {names} within {timeout}; it {seen}.") from None


async def list_run_event_types(runlane: Runlane, run_id: str) -> list[str]:
    """The types of a run's events in sequence order (``run_not_found`` when there is no such run)."""
    types: list[str] = []
    cursor = None
    while True:
        page = await runlane.runs.events(run_id, cursor=cursor, limit=100, sort_by=RunEventSortField.SEQUENCE)
        types.extend(record.event.type.value for record in page.data)
        if page.next_cursor is None:
            return types
        cursor = page.next_cursor


async def wait_for_run_event(
    runlane: Runlane,
    run_id: str,
    event_type: RunEventType | str,
    *,
    timeout: Duration = DEFAULT_TIMEOUT,
    interval: Duration = DEFAULT_INTERVAL,
) -> RunEventRecord:
    """Wait until run ``run_id`` has an event of ``event_type`` and return the first one.

    A run that does not exist yet is waited for. A run that ended without the event fails the wait
    at once with an ``AssertionError`` (a terminal run records no more events)."""
    try:
        wanted = RunEventType(event_type)
    except ValueError:
        raise RunlaneError(
            ErrorCode.VALIDATION_FAILED,
            f"Unknown run event type {event_type!r}; use a RunEventType value such as 'run.succeeded'.",
        ) from None

    async def found() -> RunEventRecord | None:
        run = await runlane.runs.get(run_id)
        if run is None:
            return None
        page = await runlane.runs.events(run_id, limit=1, types=[wanted], sort_by=RunEventSortField.SEQUENCE)
        if page.data:
            return page.data[0]
        if run_status_values.is_terminal(run.status):
            raise AssertionError(f"Run {run_id} ended {_describe(run)} without a {wanted.value} event.")
        return None

    try:
        return await wait_for_condition(found, timeout=timeout, interval=interval)
    except TimeoutError:
        raise TimeoutError(f"Run {run_id} had no {wanted.value} event within {timeout}.") from None
