"""``create_sqs_lambda_handler()``: an AWS Lambda handler for an SQS event source.

It parses each record's body as a Runlane wakeup, calls ``execute_delivery(message, **delivery_options)``
and answers with Lambda's partial batch failure shape, ``{"batchItemFailures": [{"itemIdentifier":
message_id}, ...]}``, so only the records that were not handled are delivered again. Enable
``ReportBatchItemFailures`` on the event source mapping, or Lambda ignores that answer.

A record is acknowledged when its delivery resolves, whatever the run's outcome; a record whose body
is not a wakeup, or whose delivery raised, is reported as failed. With ``fifo=True`` the handler stops
at the first failure and reports it together with every later record, so SQS keeps their order.

The Lambda runtime calls the handler synchronously; the handler keeps one event loop for the life of
the execution environment, so a runtime (and its database pool) created on the first invocation is
reused by the next ones. Inside a running event loop, ``await handler.handle(event)`` instead.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
from collections.abc import Mapping
from typing import Any

from runlane.core.runtime import runtimes_started_on
from runlane.errors import ErrorCode, RunlaneError
from runlane.models import DeliveryMessage

from .bindings import invalid
from .delivery import (
    ExecuteDelivery,
    FailureObserver,
    SqsDeliveryFailure,
    SqsDeliveryFailurePhase,
    call,
    check_callable,
    check_delivery_options,
    deliver_body,
)

__all__ = ["SqsLambdaHandler", "create_sqs_lambda_handler"]


class SqsLambdaHandler:
    """The handler ``create_sqs_lambda_handler()`` returns: ``handler(event, context)`` for Lambda,
    ``await handler.handle(event)`` from async code."""

    def __init__(
        self,
        *,
        execute_delivery: ExecuteDelivery,
        delivery_options: dict[str, Any],
        fifo: bool,
        on_delivery_failure: FailureObserver | None,
    ) -> None:
        self.execute_delivery = execute_delivery
        self.delivery_options = delivery_options
        self.fifo = fifo
        self.on_delivery_failure = on_delivery_failure
        self._loop: asyncio.AbstractEventLoop | None = None

    def __call__(self, event: Mapping[str, Any], context: Any = None) -> dict[str, Any]:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            raise RunlaneError(
                ErrorCode.CONFIGURATION_INVALID,
                "The SQS Lambda handler was called inside a running event loop; use `await handler.handle(event)`.",
            )
        if self._loop is None or self._loop.is_closed():
            self._loop = asyncio.new_event_loop()
            atexit.register(self.close)  # a local run ends without tasks left pending on a dead loop
        return self._loop.run_until_complete(self.handle(event))

    def close(self) -> None:
        """Close the event loop the synchronous handler keeps between invocations, closing first the
        runtimes started on it (the one ``execute_delivery`` delivers to, however it is wrapped), whose
        connections live on that loop. Runs at interpreter exit too; calling it again does nothing."""
        loop, self._loop = self._loop, None
        if loop is None or loop.is_closed():
            return
        try:
            for runtime in runtimes_started_on(loop):
                with contextlib.suppress(Exception):
                    loop.run_until_complete(runtime.close())
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()

    async def handle(self, event: Mapping[str, Any]) -> dict[str, Any]:
        """Deliver every record of an SQS event; returns ``{"batchItemFailures": [...]}``."""
        records = event.get("Records") if isinstance(event, Mapping) else None
        if not isinstance(records, list):
            raise RunlaneError(
                ErrorCode.VALIDATION_FAILED,
                "The Lambda event has no Records list; wire this handler to an SQS event source.",
            )
        message_ids: list[str] = []
        for position, record in enumerate(records):
            message_id = record.get("messageId") if isinstance(record, Mapping) else None
            if not isinstance(message_id, str) or not message_id:
                # Without its id the record cannot be reported on its own: fail the whole batch, before
                # any record is delivered (a FIFO batch may otherwise leave it undelivered yet acknowledged).
                raise RunlaneError(
                    ErrorCode.VALIDATION_FAILED,
                    f"SQS record {position} has no messageId, so it cannot be reported as a batch item failure; "
                    "the whole batch will be delivered again.",
                    meta={"record": position},
                )
            message_ids.append(message_id)
        failures: list[dict[str, str]] = []
        for position, (record, message_id) in enumerate(zip(records, message_ids)):
            if await self._handle_record(record, message_id):
                continue
            failures.append({"itemIdentifier": message_id})
            if self.fifo:
                failures.extend({"itemIdentifier": later_id} for later_id in message_ids[position + 1 :])
                break
        return {"batchItemFailures": failures}

    async def _handle_record(self, record: Mapping[str, Any], message_id: str) -> bool:
        async def report(
            phase: SqsDeliveryFailurePhase, cause: BaseException, message: DeliveryMessage | None
        ) -> None:
            if self.on_delivery_failure is not None:
                failure = SqsDeliveryFailure(
                    phase=phase, cause=cause, provider_message_id=message_id, delivery_message=message
                )
                await call(self.on_delivery_failure, failure)

        return await deliver_body(record.get("body"), self.execute_delivery, self.delivery_options, report)


def create_sqs_lambda_handler(
    *,
    execute_delivery: ExecuteDelivery,
    delivery_options: Mapping[str, Any] | None = None,
    fifo: bool = False,
    on_delivery_failure: FailureObserver | None = None,
) -> SqsLambdaHandler:
    """A Lambda handler for SQS records carrying Runlane wakeups.

    ``execute_delivery`` is normally ``runlane.execute_delivery`` (it starts the runtime on first use);
    ``delivery_options`` (``lease_duration``, ``heartbeat_interval``, ``max_attempt_duration``,
    ``signal``, ``worker_id``) are passed to every call. ``fifo=True`` keeps FIFO order on failure.
    ``on_delivery_failure(failure)`` sees each record before it is reported failed; if it raises,
    the handler raises too.
    """
    check_callable(execute_delivery, "execute_delivery")
    if on_delivery_failure is not None:
        check_callable(on_delivery_failure, "on_delivery_failure")
    if not isinstance(fifo, bool):
        raise invalid(f"fifo must be True or False, got {fifo!r}.", field="fifo")
    return SqsLambdaHandler(
        execute_delivery=execute_delivery,
        delivery_options=check_delivery_options(delivery_options),
        fifo=fifo,
        on_delivery_failure=on_delivery_failure,
    )
