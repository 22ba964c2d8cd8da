"""``ControlledClock``: a clock tests move by hand."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta

from ..durations import Duration, parse_duration
from ..errors import ErrorCode, RunlaneError

__all__ = ["ControlledClock"]

DEFAULT_START = datetime(2026, 1, 1, tzinfo=UTC)


class ControlledClock:
    """``now()`` returns the set time until ``advance()`` or ``set()`` moves it (thread-safe)."""

    def __init__(self, start: datetime | None = None) -> None:
        self._lock = threading.Lock()
        self._now = self._check(start or DEFAULT_START)

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
            self._now = self._now + delta
            return self._now

    def set(self, value: datetime) -> datetime:
        checked = self._check(value)
        with self._lock:
            self._now = checked
            return self._now
