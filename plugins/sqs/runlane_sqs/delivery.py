"""What the Lambda handler and the long-running consumer share: delivery options, the failure record
handed to ``on_delivery_failure``, and the call into ``execute_delivery``.

Neither imports the runtime: both take an ``execute_delivery(message, **options)`` callable, normally
``runlane.execute_delivery``. A delivery *resolves* when that call returns, whatever the run's
outcome (succeeded, failed, retry scheduled, released, cancelled, or ignored as stale): the SQS
message is then acknowledged. When it raises (storage down, a registration or persistence failure,
a cancelled delivery), the message stays on the queue for SQS to deliver again or redrive.
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from runlane.core.cancellation import CancellationSignal
from runlane.core.runtime import resolve_execution_options
from runlane.errors import ErrorCode, RunlaneError
from runlane.models import DeliveryMessage

from .bindings import invalid
from .envelope import parse_sqs_wakeup_body

__all__ = [
    "DELIVERY_OPTION_NAMES",
    "SqsDeliveryFailure",
    "SqsDeliveryFailurePhase",
    "check_delivery_options",
    "deliver_body",
]

DELIVERY_OPTION_NAMES = ("lease_duration", "heartbeat_interval", "max_attempt_duration", "signal", "worker_id")

ExecuteDelivery = Callable[..., Any]
FailureObserver = Callable[["SqsDeliveryFailure"], Any]
Report = Callable[["SqsDeliveryFailurePhase", BaseException, "DeliveryMessage | None"], Awaitable[None]]


class SqsDeliveryFailurePhase(enum.StrEnum):
    """Where handling one SQS message failed."""

    MESSAGE = "message"
    """The provider message itself is unusable (no body, no id or receipt handle)."""
    PARSE = "parse"
    """The body is not a Runlane wakeup."""
    EXECUTE = "execute"
    """``execute_delivery`` raised: nothing durable says the delivery was handled."""
    DELETE = "delete"
    """The delivery resolved, but SQS did not delete the message (it will be delivered again; harmless)."""


@dataclass(frozen=True, slots=True)
class SqsDeliveryFailure:
    """One message that was not acknowledged (or, for ``DELETE``, not deleted), and why."""

    phase: SqsDeliveryFailurePhase
    cause: BaseException
    provider_message_id: str | None = None
    delivery_message: DeliveryMessage | None = None
    queue_url: str | None = None


def check_delivery_options(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """A copy of ``options`` (keyword arguments for ``execute_delivery``) with unknown keys refused."""
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise invalid(
            f"delivery_options must be a dict of {', '.join(DELIVERY_OPTION_NAMES)}, got {options!r}.",
            field="delivery_options",
        )
    unknown = sorted(set(options) - set(DELIVERY_OPTION_NAMES))
    if unknown:
        raise invalid(
            f"Unknown delivery option {unknown[0]!r}; the options are {', '.join(DELIVERY_OPTION_NAMES)}.",
            field="delivery_options",
        )
    signal = options.get("signal")
    if signal is not None and not isinstance(signal, CancellationSignal):
        raise invalid(f"delivery_options signal must be a CancellationSignal, got {signal!r}.", field="signal")
    # Bad values fail here, once, rather than on every message (which would drain the queue into its DLQ).
    resolve_execution_options(
        options.get("lease_duration"),
        options.get("heartbeat_interval"),
        options.get("max_attempt_duration"),
        None,
        options.get("worker_id"),
        default_worker_id="sqs",
    )
    return dict(options)


def check_callable(value: object, what: str) -> None:
    if not callable(value):
        raise invalid(f"{what} must be a function, got {value!r}.", field=what)


async def call(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)``, awaited when it returns an awaitable."""
    result = function(*args, **kwargs)
    if inspect.isawaitable(result):
        result = await result
    return result


async def deliver_body(
    body: object, execute_delivery: ExecuteDelivery, options: Mapping[str, Any], report: Report
) -> bool:
    """Parse ``body`` and call ``execute_delivery``; ``True`` when the delivery resolved (acknowledge the
    message). A body that is not text, not a wakeup, or whose delivery raised is passed to ``report``."""
    if not isinstance(body, str):
        await report(
            SqsDeliveryFailurePhase.MESSAGE,
            RunlaneError(ErrorCode.VALIDATION_FAILED, "The SQS message has no text body."),
            None,
        )
        return False
    try:
        message = parse_sqs_wakeup_body(body)
    except RunlaneError as error:
        await report(SqsDeliveryFailurePhase.PARSE, error, None)
        return False
    try:
        await call(execute_delivery, message, **options)
    except Exception as error:
        await report(SqsDeliveryFailurePhase.EXECUTE, error, message)
        return False
    return True
