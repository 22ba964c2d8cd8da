"""Durations: the strings ``"500ms"``, ``"0.5s"``, ``"30s"``, ``"5m"``, ``"2h"``, ``"7d"`` or a ``timedelta``.

A duration resolves to a positive whole number of milliseconds no larger than 2**53 - 1.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from decimal import Decimal, InvalidOperation

from .errors import ErrorCode, RunlaneError

__all__ = ["MAX_INSTANT", "Duration", "duration_ms", "format_duration", "later", "parse_duration"]

Duration = str | timedelta

MAX_DURATION_STRING_LENGTH = 100
MAX_SAFE_INTEGER = 2**53 - 1
_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
# ASCII digits only (``\d`` would admit other scripts' digits); used with ``fullmatch`` because
# ``$`` would also accept a trailing newline.
_PATTERN = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ms|s|m|h|d)")


def duration_ms(value: object, what: str = "duration", *, code: ErrorCode = ErrorCode.CONFIGURATION_INVALID) -> int:
    """Resolve a duration string or ``timedelta`` to positive whole milliseconds."""
    if isinstance(value, timedelta):
        micros = (value.days * 86_400 + value.seconds) * 1_000_000 + value.microseconds
        if micros <= 0 or micros % 1000:
            raise RunlaneError(
                code, f"Invalid {what}: {value!r} must be positive whole milliseconds.", meta={"field": what}
            )
        ms = micros // 1000
    elif isinstance(value, str):
        if len(value) > MAX_DURATION_STRING_LENGTH:
            raise RunlaneError(code, f"Invalid {what}: longer than {MAX_DURATION_STRING_LENGTH} characters.", meta={"field": what})
        match = _PATTERN.fullmatch(value)
        if match is None:
            raise RunlaneError(
                code,
                f"Invalid {what} {value!r}: use a number with a unit, such as '500ms', '30s', '5m', '2h' or '7d'.",
                meta={"field": what},
            )
        try:
            exact = Decimal(match.group(1)) * _UNIT_MS[match.group(2)]
        except InvalidOperation:  # pragma: no cover - the pattern admits only decimals
            raise RunlaneError(code, f"Invalid {what} {value!r}.", meta={"field": what}) from None
        if exact != exact.to_integral_value():
            raise RunlaneError(code, f"Invalid {what} {value!r}: it must resolve to whole milliseconds.", meta={"field": what})
        ms = int(exact)
        if ms <= 0:
            raise RunlaneError(code, f"Invalid {what} {value!r}: it must be positive.", meta={"field": what})
    else:
        raise RunlaneError(
            code,
            f"Invalid {what}: expected a duration string such as '30s' or a timedelta, got {type(value).__name__}.",
            meta={"field": what},
        )
    if ms > MAX_SAFE_INTEGER:
        raise RunlaneError(code, f"Invalid {what}: it is too large.", meta={"field": what})
    return ms


def duration_seconds(value: object, what: str = "timeout") -> float:
    """``value`` as seconds: a duration (``"10s"``, ``"500ms"``, a ``timedelta``) or a positive finite
    number of seconds (what client libraries take for their timeouts); ``configuration_invalid`` else."""
    if isinstance(value, (str, timedelta)):
        return duration_ms(value, what) / 1000
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < float("inf"):
        raise RunlaneError(
            ErrorCode.CONFIGURATION_INVALID,
            f"{what} must be a duration such as '10s' or a positive number of seconds, got {value!r}.",
            meta={"field": what},
        )
    return float(value)


MAX_INSTANT = datetime(9999, 12, 31, 23, 59, 59, 999_000, tzinfo=UTC)
"""The latest instant a run can be due at: ``datetime`` ends with the year 9999."""


def later(at: datetime, milliseconds: int) -> datetime:
    """``at`` plus ``milliseconds``, or ``MAX_INSTANT`` when that lies beyond it.

    A valid duration reaches 2**53 - 1 ms (285,000 years), past what ``datetime`` can hold; a retry
    delay, release or lease that long means "not before the end of time", which ``MAX_INSTANT`` says.
    """
    try:
        return min(at + timedelta(milliseconds=milliseconds), MAX_INSTANT)
    except OverflowError:
        return MAX_INSTANT


def parse_duration(value: object, what: str = "duration", *, code: ErrorCode = ErrorCode.CONFIGURATION_INVALID) -> timedelta:
    return timedelta(milliseconds=duration_ms(value, what, code=code))


def format_duration(value: int | timedelta) -> str:
    """The shortest exact duration string: 60000 ms -> ``"1m"``, 1500 ms -> ``"1500ms"``."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1 or value > MAX_SAFE_INTEGER:
            raise RunlaneError(
                ErrorCode.CONFIGURATION_INVALID,
                f"Invalid duration: {value!r} ms must be a positive whole number no larger than {MAX_SAFE_INTEGER}.",
                meta={"field": "duration"},
            )
        ms = value
    else:
        ms = duration_ms(value)
    for unit in ("d", "h", "m", "s"):
        if ms % _UNIT_MS[unit] == 0:
            return f"{ms // _UNIT_MS[unit]}{unit}"
    return f"{ms}ms"
