"""``RecordingTransport``: a transport adapter that records what it publishes and fails on request.

It proves outbox paths without a provider. Every publish call validates its command the way a real
adapter must (``validate_publish_wakeups_command``), so a malformed command is rejected whole and
nothing is recorded. Valid commands land in ``commands``; every accepted wakeup lands in
``published``. Failures are injected ahead of time:

- ``fail_next(count, retryable=True)``: the next ``count`` attempts (across calls, in attempt order)
  come back as ``failed`` outcomes carrying an ``OutboxFailureRecord`` with code
  ``transport_publish_failed``;
- ``fail_operation_next(count, code=ErrorCode.TRANSPORT_UNAVAILABLE)``: the next ``count`` publish
  calls raise a ``RunlaneError`` (retryable by default) before anything is published, like a provider
  outage, for which no per-attempt outcome exists.

It needs no test runner. It does not deliver wakeups to workers: tests read ``published`` and call
``runlane.execute_delivery(message)`` themselves when they want a delivery.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Protocol

from ..core.transport import (
    PublishWakeupsCommand,
    PublishWakeupsResult,
    validate_publish_wakeups_command,
)
from ..errors import ErrorCode, RunlaneError
from ..models import DeliveryMessage, OutboxFailureRecord, WakeupPublishOutcome
from ..vocabulary import WakeupPublishOutcomeType

__all__ = ["RecordingTransport"]


class _Clock(Protocol):
    def now(self) -> datetime: ...


@dataclass
class _InjectedFailures:
    """A run of injected failures still to hand out, oldest first."""

    remaining: int
    retryable: bool
    code: ErrorCode = ErrorCode.TRANSPORT_PUBLISH_FAILED


def _take(pending: list[_InjectedFailures]) -> _InjectedFailures | None:
    if not pending:
        return None
    entry = pending[0]
    entry.remaining -= 1
    if entry.remaining == 0:
        pending.pop(0)
    return entry


def _invalid(message: str) -> RunlaneError:
    return RunlaneError(ErrorCode.CONFIGURATION_INVALID, message)


def _count(count: object) -> int:
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise _invalid(f"count must be a non-negative integer, got {count!r}.")
    return count


class RecordingTransport:
    """A ``TransportAdapter`` that keeps every published ``DeliveryMessage`` in ``published``.

    ``clock`` (any object with ``now()``, such as ``ControlledClock``) stamps ``published_at`` and
    ``failed_at``; it defaults to the system clock. ``lifecycle`` records ``"start"`` and ``"close"``
    calls in order.
    """

    def __init__(self, *, name: str = "recording", clock: _Clock | None = None) -> None:
        if not isinstance(name, str) or not name:
            raise _invalid(f"A transport name must be a non-empty string, got {name!r}.")
        if clock is not None and not callable(getattr(clock, "now", None)):
            raise _invalid(f"clock must have a now() method, got {clock!r}.")
        self.name = name
        self.published: list[DeliveryMessage] = []
        self.commands: list[PublishWakeupsCommand] = []
        self.lifecycle: list[str] = []
        self._clock = clock
        self._published_total = 0
        self._attempt_failures: list[_InjectedFailures] = []
        self._operation_failures: list[_InjectedFailures] = []

    def __repr__(self) -> str:
        return f"RecordingTransport(name={self.name!r}, published={len(self.published)})"

    # -- failure injection ----------------------------------------------------------------------

    def fail_next(self, count: int = 1, retryable: bool = True) -> None:
        """Answer the next ``count`` publish attempts with ``failed`` outcomes (``transport_publish_failed``)."""
        if not isinstance(retryable, bool):
            raise _invalid(f"retryable must be True or False, got {retryable!r}.")
        if _count(count):
            self._attempt_failures.append(_InjectedFailures(count, retryable))

    def fail_operation_next(
        self, count: int = 1, code: ErrorCode | str = ErrorCode.TRANSPORT_UNAVAILABLE, *, retryable: bool = True
    ) -> None:
        """Make the next ``count`` publish calls raise ``RunlaneError(code)`` before publishing anything."""
        try:
            error_code = ErrorCode(code)
        except ValueError:
            raise _invalid(f"Unknown error code {code!r}; use an ErrorCode such as TRANSPORT_UNAVAILABLE.") from None
        if not isinstance(retryable, bool):
            raise _invalid(f"retryable must be True or False, got {retryable!r}.")
        if _count(count):
            self._operation_failures.append(_InjectedFailures(count, retryable, error_code))

    @property
    def pending_failures(self) -> tuple[int, int]:
        """Injected failures not used yet: ``(attempts, operations)``."""
        attempts = sum(entry.remaining for entry in self._attempt_failures)
        operations = sum(entry.remaining for entry in self._operation_failures)
        return attempts, operations

    # -- adapter surface ------------------------------------------------------------------------

    async def start(self) -> None:
        self.lifecycle.append("start")

    async def close(self) -> None:
        self.lifecycle.append("close")

    async def publish_wakeups(self, command: PublishWakeupsCommand) -> PublishWakeupsResult:
        """Validate ``command``, then publish or fail each attempt; ``outcomes[i]`` answers ``attempts[i]``."""
        checked = validate_publish_wakeups_command(command)
        self.commands.append(checked)
        operation = _take(self._operation_failures)
        if operation is not None:
            raise RunlaneError(
                operation.code,
                f"Transport {self.name!r} was told to fail this publish call; nothing was published.",
                retryable=operation.retryable,
                meta={"transport": self.name},
            )
        now = self._now()
        outcomes: list[WakeupPublishOutcome] = []
        for attempt in checked.attempts:
            failure = _take(self._attempt_failures)
            if failure is not None:
                record = OutboxFailureRecord(
                    code=ErrorCode.TRANSPORT_PUBLISH_FAILED,
                    message=f"Transport {self.name!r} was told to fail this publish attempt.",
                    retryable=failure.retryable,
                    failed_at=now,
                    meta={"transport": self.name},
                )
                outcomes.append(WakeupPublishOutcome(type=WakeupPublishOutcomeType.FAILED, failure=record))
                continue
            self._published_total += 1
            self.published.append(attempt.message)
            outcomes.append(
                WakeupPublishOutcome(
                    type=WakeupPublishOutcomeType.PUBLISHED,
                    published_at=now,
                    provider_message_id=f"{self.name}-{self._published_total}",
                )
            )
        return PublishWakeupsResult(outcomes)

    def _now(self) -> datetime:
        return datetime.now(UTC) if self._clock is None else self._clock.now()
