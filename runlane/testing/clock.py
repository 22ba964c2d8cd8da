"""``ControlledClock``: a clock tests move by hand."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from ..durations import Duration, parse_duration
from ..errors import ErrorCode, RunlaneError

__all__ = ["ControlledClock"]

DEFAULT_START = datetime(2026, 1, 1, tzinfo=UTC)


class ControlledClock:
    """``now()`` returns the set time until ``advance()`` or ``set()`` moves it (thread-safe).

    A runtime watches the clock (``watch()``), so what is due at a time happens when the clock is moved
    there, and not before: an attempt is aborted when the clock reaches its ``max_attempt_duration``
    deadline (at once when a move passes it), however long it has run in real time, and an ``async def``
    handler still running is cancelled when the clock passes the grace after that deadline.
    """

    def __init__(self, start: datetime | None = None) -> None:
        self._lock = threading.Lock()
        self._now = self._check(start or DEFAULT_START)
        self._watchers: list[Callable[[datetime], None]] = []

    @staticmethod
    def _check(value: datetime) -> datetime:
        if not isinstance(value, datetime) or value.tzinfo is None or value.utcoffset() is None:
            raise RunlaneError(
                ErrorCode.CONFIGURATION_INVALID,
                f"ControlledClock needs a timezone-aware datetime, got {value!r}; attach a tzinfo such as UTC.",
            )
        return value.astimezone(UTC)

    def now(self) -> datetime:
        with self._lock:
            return self._now

    def advance(self, duration: Duration) -> datetime:
        delta = duration if isinstance(duration, timedelta) and duration == timedelta(0) else parse_duration(duration)
        with self._lock:
            self._now = now = self._now + delta
            watchers = list(self._watchers)
        return self._moved(now, watchers)

    def set(self, value: datetime) -> datetime:
        checked = self._check(value)
        with self._lock:
            self._now = checked
            watchers = list(self._watchers)
        return self._moved(checked, watchers)

    def watch(self, callback: Callable[[datetime], None]) -> Callable[[], None]:
        """Call ``callback(now)`` after every move (on the moving thread); returns a function that
        stops it."""
        with self._lock:
            self._watchers.append(callback)

        def unwatch() -> None:
            with self._lock, contextlib.suppress(ValueError):
                self._watchers.remove(callback)

        return unwatch

    @staticmethod
    def _moved(now: datetime, watchers: list[Callable[[datetime], None]]) -> datetime:
        for callback in watchers:
            callback(now)
        return now
