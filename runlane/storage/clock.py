"""Client clock authority, written once for every driver that samples the runtime's clock.

A driver whose profile says ``StorageClockAuthority.CLIENT`` mixes in ``ClientClock``: every
transaction attempt's ``now()`` samples ``driver.clock``, and ``create_runlane(clock=...)`` calls
``use_clock`` so storage time and runtime time come from one clock.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Protocol

from ..errors import ErrorCode, RunlaneError

__all__ = ["Clock", "ClientClock", "SystemClock", "checked_clock"]


class Clock(Protocol):
    def now(self) -> datetime: ...


class SystemClock:
    """The machine's UTC time."""

    def now(self) -> datetime:
        return datetime.now(UTC)


def checked_clock(clock: object) -> Clock:
    """``clock`` when it has a ``now()`` method, else ``configuration_invalid``."""
    if not callable(getattr(clock, "now", None)):
        raise RunlaneError(ErrorCode.CONFIGURATION_INVALID, "clock must be an object with a now() method.")
    return clock  # type: ignore[return-value]


class ClientClock:
    """The ``clock`` property and ``use_clock`` of a client-clock driver (set ``_clock`` in ``__init__``)."""

    _clock: Clock

    @property
    def clock(self) -> Clock:
        """The clock every transaction attempt's ``now()`` samples (client clock authority)."""
        return self._clock

    def use_clock(self, clock: Clock) -> None:
        """Sample ``clock`` in every later transaction attempt (an attempt in flight keeps its time).

        ``create_runlane(clock=...)`` calls this so storage time and runtime time come from one clock;
        tests may call it directly. ``clock`` is any object with a ``now()`` returning aware datetimes.
        """
        self._clock = checked_clock(clock)
