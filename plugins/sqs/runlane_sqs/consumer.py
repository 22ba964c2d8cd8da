"""``create_sqs_delivery_consumer()``: a long-running SQS receive loop for one queue URL.

The loop long-polls ``ReceiveMessage``, parses each body as a Runlane wakeup, calls
``execute_delivery(message, **delivery_options)`` and deletes (``DeleteMessageBatch``) exactly the
messages whose delivery resolved. A message whose shape, body or delivery failed is left alone: the
queue's visibility timeout and redrive policy deliver it again or move it to the dead-letter queue.
It never scans storage; that is what a polling worker does.

A delivery that failed because storage is unavailable (``storage_unavailable``: the database is down)
is the exception: the consumer holds its message instead, keeps it invisible, receives nothing new
and delivers the held messages again with backoff until storage answers. An outage therefore costs
each wakeup one receive, however long it lasts, instead of one per visibility timeout until the redrive
policy dead-letters every wakeup of the queue (leaving their runs queued with no wakeup).

Messages of one receive are delivered concurrently on a standard queue. On a FIFO queue
(``fifo=True``) they are delivered in order, and the first failure leaves the rest of the batch
undelivered, so SQS keeps their order.

``stop()`` (or the ``signal`` passed in) ends the loop: the receive in flight is abandoned at once
(messages it still returns are made visible again, if the process lives until it returns:
``wait_for_abandoned_receive()``), the signal every delivery got is aborted so
cooperative task code can stop, and ``stop()`` returns when the deliveries in flight have resolved
and their messages are deleted; a run whose handler stopped with it (``released: worker_stopped``)
keeps its message instead, made visible again for the next consumer. A receive or delete call that
fails as a whole, or an ``on_delivery_failure`` that raises, ends the loop with that error:
``await consumer.closed`` raises it. A consumer is single-start; create a new one to receive again.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from runlane.core.cancellation import CancellationSignal
from runlane.core.worker import REASON_WORKER_STOPPED, backoff_delay, stopped_by
from runlane.errors import ErrorCode, RunlaneError
from runlane.models import DeliveryMessage
from runlane.vocabulary import RunStatus

from .aws import call_sqs, classify_provider_error, in_daemon_thread
from .bindings import FIFO_SUFFIX, SQS_MAX_WAIT_TIME_SECONDS, check_client, check_count, invalid
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
from .transport import SQS_MAX_BATCH_SIZE

__all__ = ["SqsConsumerCounts", "SqsDeliveryConsumer", "create_sqs_delivery_consumer"]

SQS_MAX_VISIBILITY_TIMEOUT_SECONDS = 12 * 60 * 60

# How one message's delivery settled (``SqsDeliveryConsumer._deliver``).
_RESOLVED = object()
_HANDED_BACK = object()
_UNRESOLVED = object()
_STORAGE_DOWN = object()  # the delivery failed with ``storage_unavailable``: hold the message, try again

# Held messages are delivered again after this many seconds, doubling up to the maximum (with jitter).
_HOLD_BACKOFF_START_S = 0.5
_HOLD_BACKOFF_MAX_S = 5.0
# How much longer than the wait before the next try a held message is kept invisible: long enough for
# that try to finish, short enough that the message of a consumer that died meanwhile comes back soon.
_HOLD_VISIBILITY_MARGIN_S = 30

_log = logging.getLogger("runlane.worker")


@dataclass(slots=True)
class SqsConsumerCounts:
    """What a consumer has done so far."""

    received: int = 0
    delivered: int = 0
    deleted: int = 0
    failed: int = 0


@dataclass(frozen=True, slots=True)
class _Received:
    message_id: str | None
    receipt_handle: str | None
    body: object


class SqsDeliveryConsumer:
    """The receive loop of one SQS queue URL. Build it with ``create_sqs_delivery_consumer()``."""

    def __init__(
        self,
        *,
        client: Any,
        queue_url: str,
        execute_delivery: ExecuteDelivery,
        delivery_options: dict[str, Any],
        fifo: bool,
        max_number_of_messages: int,
        wait_time_seconds: int,
        visibility_timeout_seconds: int | None,
        signal: CancellationSignal | None,
        on_delivery_failure: FailureObserver | None,
    ) -> None:
        self.client = client
        self.queue_url = queue_url
        self.execute_delivery = execute_delivery
        self.fifo = fifo
        self.max_number_of_messages = max_number_of_messages
        self.wait_time_seconds = wait_time_seconds
        self.visibility_timeout_seconds = visibility_timeout_seconds
        self.on_delivery_failure = on_delivery_failure
        self.counts = SqsConsumerCounts()
        # The consumer's signal and the deliveries' one stop it as stop() does, whatever reason they were
        # aborted with (as a worker's signal stops the worker): a handler that raises on it hands its run
        # back (``worker_stopped``) and keeps its wakeup, instead of failing the run and deleting the wakeup.
        self._controller, unlink_parents = stopped_by(signal, delivery_options.get("signal"))
        self._controller.signal.add_callback(unlink_parents)  # once the consumer stops, however it stops
        self._delivery_options = {**delivery_options, "signal": self._controller.signal}
        self._task: asyncio.Task[None] | None = None
        # Settles once the thread of the latest receive call has returned and, when the call was
        # abandoned, handed back what it received (``wait_for_abandoned_receive``).
        self._receive_returned: asyncio.Future[None] | None = None

    def __repr__(self) -> str:
        state = "new" if self._task is None else ("closed" if self._task.done() else "running")
        return f"SqsDeliveryConsumer(queue_url={self.queue_url!r}, {state})"

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def closed(self) -> asyncio.Task[None]:
        """Awaitable that completes when the loop ends; it raises the error that ended it, if any."""
        if self._task is None:
            raise RunlaneError(ErrorCode.CONFIGURATION_INVALID, "The SQS consumer has not been started; call start().")
        return self._task

    async def start(self) -> None:
        """Start the receive loop (a no-op while it runs; a stopped consumer cannot start again)."""
        if self._task is not None:
            if self._task.done():
                raise RunlaneError(
                    ErrorCode.CONFIGURATION_INVALID,
                    "This SQS consumer has stopped; create a new one with create_sqs_delivery_consumer().",
                )
            return
        self._task = asyncio.create_task(self._run(), name=f"runlane-sqs-consumer {self.queue_url}")

    async def stop(self) -> None:
        """Stop receiving, abort the deliveries' signal and wait for the deliveries in flight."""
        self._controller.abort(REASON_WORKER_STOPPED)  # what a worker's stop says, so handlers check one reason
        if self._task is not None:
            await asyncio.wait([self._task])

    async def wait_for_abandoned_receive(self, timeout: float | None = None) -> bool:
        """After ``stop()``: wait until the long poll ``stop()`` abandoned has returned and made what it
        received visible again; ``True`` once it has (or none was in flight), ``False`` after ``timeout``
        seconds. A process that exits before that strands those wakeups until their visibility timeout
        ends, because SQS still hands messages to a poll whose caller has gone. The poll returns at the
        latest ``wait_time_seconds`` after it started."""
        returned = self._receive_returned
        if returned is None or returned.done():
            return True
        await asyncio.wait([returned], timeout=timeout)
        return returned.done()

    # -- the loop -----------------------------------------------------------------------------------

    async def _run(self) -> None:
        signal = self._controller.signal
        try:
            while not signal.aborted:
                received = await self._receive()
                if not received:
                    continue
                if signal.aborted:
                    await self._release(received)
                    break
                self.counts.received += len(received)
                held = await self._settle(received)
                if held:
                    await self._ride_out(held)
        finally:
            self._controller.abort("The SQS consumer stopped.")

    async def _settle(self, batch: list[_Received], *, holding: bool = False) -> list[_Received]:
        """Deliver ``batch``, delete the messages whose delivery resolved and make the handed-back ones
        visible again; returns the messages to hold because storage is unavailable (on a FIFO queue,
        the rest of the batch from the first of them on, so their order is kept)."""
        signal = self._controller.signal
        error: BaseException | None = None
        settled: list[tuple[_Received, object]] = []
        held: list[_Received] = []
        if self.fifo:
            for position, message in enumerate(batch):
                if signal.aborted:
                    # Stopping: hand the rest of the batch back, in order, for the next consumer
                    # instead of running it under an aborted signal.
                    await self._release(batch[position:])
                    break
                outcome = await self._deliver(message, holding=holding)
                if outcome is _STORAGE_DOWN:
                    held = batch[position:]
                    break
                settled.append((message, outcome))
                if outcome is _UNRESOLVED:
                    break
        else:
            # Every delivery of the batch settles before an observer's error ends the loop, so none
            # is left running after ``closed`` and the ones that resolved are still deleted.
            outcomes = await asyncio.gather(
                *(self._deliver(message, holding=holding) for message in batch), return_exceptions=True
            )
            settled = list(zip(batch, outcomes))
            held = [message for message, outcome in settled if outcome is _STORAGE_DOWN]
            error = next((outcome for outcome in outcomes if isinstance(outcome, BaseException)), None)
        # A run its handler handed back because this consumer stopped (``released: worker_stopped``)
        # keeps its wakeup: made visible again, it runs at once on a consumer still up.
        handed_back = [message for message, outcome in settled if outcome is _HANDED_BACK]
        await self._release(handed_back)
        await self._delete([message for message, outcome in settled if outcome is _RESOLVED])
        if error is not None:
            await self._release(held)
            raise error
        return held

    async def _ride_out(self, held: list[_Received]) -> None:
        """Storage is unavailable: keep ``held`` invisible and deliver it again with backoff, receiving
        nothing new, until storage answers; on stop, hand the messages still held back at once."""
        signal = self._controller.signal
        failures = 1
        _log.warning(
            "SQS consumer of %s: storage is unavailable; holding %d wakeup(s) and delivering them again with "
            "backoff, receiving no more until storage answers.", self.queue_url, len(held),
        )  # fmt: skip
        while held:
            delay = backoff_delay(failures, _HOLD_BACKOFF_START_S, _HOLD_BACKOFF_MAX_S)
            await self._release(held, visibility_timeout=int(delay) + _HOLD_VISIBILITY_MARGIN_S)
            try:
                await asyncio.wait_for(signal.wait(), timeout=delay)
            except TimeoutError:
                pass
            if signal.aborted:
                await self._release(held)
                return
            held = await self._settle(held, holding=True)
            if held:
                failures += 1
        _log.warning("SQS consumer of %s: storage is reachable again after %d failures.", self.queue_url, failures)

    def _receive_params(self) -> dict[str, Any]:
        params: dict[str, Any] = {
            "QueueUrl": self.queue_url,
            "MaxNumberOfMessages": self.max_number_of_messages,
            "WaitTimeSeconds": self.wait_time_seconds,
        }
        if self.visibility_timeout_seconds is not None:
            params["VisibilityTimeout"] = self.visibility_timeout_seconds
        return params

    async def _receive(self) -> list[_Received]:
        """One long poll, abandoned as soon as the consumer stops."""
        method = getattr(self.client, "receive_message")
        signal = self._controller.signal
        if inspect.iscoroutinefunction(method):
            call_future: asyncio.Future[Any] = asyncio.ensure_future(method(**self._receive_params()))
        else:
            call_future = self._receive_in_thread(method)
        stopped = asyncio.ensure_future(signal.wait())
        try:
            await asyncio.wait([call_future, stopped], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
        if not call_future.done():
            call_future.cancel()  # a thread's receive releases what it gets once it returns
            return []
        try:
            response = call_future.result()
        except Exception as error:
            raise classify_provider_error(
                error, operation="ReceiveMessage", queue_url=self.queue_url, refused=ErrorCode.CONFIGURATION_INVALID
            ) from None
        messages = response.get("Messages") if isinstance(response, dict) else None
        if not isinstance(messages, list):
            return []
        return [
            _Received(
                message_id=message.get("MessageId") if isinstance(message, dict) else None,
                receipt_handle=message.get("ReceiptHandle") if isinstance(message, dict) else None,
                body=message.get("Body") if isinstance(message, dict) else None,
            )
            for message in messages
        ]

    def _receive_in_thread(self, method: Any) -> asyncio.Future[Any]:
        # A daemon thread, not the loop's executor: a long poll in flight must not hold up process exit.
        returned: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._receive_returned = returned
        params = self._receive_params()
        signal = self._controller.signal

        def work() -> Any:
            result = method(**params)
            if signal.aborted:
                self._release_now(result)  # in this thread: the loop may be gone by now
                return {}
            return result

        def on_return() -> None:
            if not returned.done():
                returned.set_result(None)

        return in_daemon_thread(work, "runlane-sqs-receive", on_return)

    def _release_now(self, response: Any) -> None:
        """Make the messages of an abandoned receive visible again (best effort, in the receive thread)."""
        messages = response.get("Messages") if isinstance(response, dict) else None
        listed = messages if isinstance(messages, list) else []
        entries = _visibility_entries([message.get("ReceiptHandle") for message in listed if isinstance(message, dict)])
        if not entries:
            return
        try:
            self.client.change_message_visibility_batch(QueueUrl=self.queue_url, Entries=entries)
        except Exception:
            pass  # they become visible at the end of their visibility timeout instead

    async def _release(self, received: list[_Received], *, visibility_timeout: int = 0) -> None:
        """Make ``received`` visible again (or, with ``visibility_timeout``, keep it invisible that long
        from now); best effort."""
        entries = _visibility_entries([message.receipt_handle for message in received], visibility_timeout)
        if entries:
            try:
                await call_sqs(self.client, "change_message_visibility_batch", QueueUrl=self.queue_url, Entries=entries)
            except Exception:
                pass  # they become visible at the end of their visibility timeout instead

    async def _deliver(self, received: _Received, *, holding: bool = False) -> object:
        """Deliver one message: ``_RESOLVED`` (delete it), ``_HANDED_BACK`` (its run was released because
        this consumer stopped: make it visible again), ``_STORAGE_DOWN`` (storage is unavailable: hold
        it) or ``_UNRESOLVED`` (leave it to its visibility timeout). A held message (``holding``) whose
        delivery fails for storage again is not reported again."""
        storage_down = False

        async def report(
            phase: SqsDeliveryFailurePhase, cause: BaseException, message: DeliveryMessage | None
        ) -> None:
            nonlocal storage_down
            storage_down = (
                phase is SqsDeliveryFailurePhase.EXECUTE
                and isinstance(cause, RunlaneError)
                and cause.code is ErrorCode.STORAGE_UNAVAILABLE
            )
            if not (storage_down and holding):
                await self._failed(phase, cause, received.message_id, message)

        if not received.message_id or not received.receipt_handle:
            error = RunlaneError(
                ErrorCode.VALIDATION_FAILED, "SQS returned a message without MessageId or ReceiptHandle."
            )
            await report(SqsDeliveryFailurePhase.MESSAGE, error, None)
            return _UNRESOLVED
        results: list[Any] = []

        async def execute(message: DeliveryMessage, **options: Any) -> Any:
            results.append(await call(self.execute_delivery, message, **options))
            return results[-1]

        if not await deliver_body(received.body, execute, self._delivery_options, report):
            return _STORAGE_DOWN if storage_down else _UNRESOLVED
        self.counts.delivered += 1
        run = getattr(results[-1], "run", None) if results else None
        stopped = self._controller.signal.reason == REASON_WORKER_STOPPED
        if stopped and getattr(run, "status", None) is RunStatus.RELEASED:
            return _HANDED_BACK
        return _RESOLVED

    async def _delete(self, handled: list[_Received]) -> None:
        for start in range(0, len(handled), SQS_MAX_BATCH_SIZE):
            chunk = handled[start : start + SQS_MAX_BATCH_SIZE]
            entries = [{"Id": str(index), "ReceiptHandle": item.receipt_handle} for index, item in enumerate(chunk)]
            try:
                response = await call_sqs(
                    self.client, "delete_message_batch", QueueUrl=self.queue_url, Entries=entries
                )
            except Exception as error:
                raise classify_provider_error(
                    error,
                    operation="DeleteMessageBatch",
                    queue_url=self.queue_url,
                    refused=ErrorCode.CONFIGURATION_INVALID,
                ) from None
            failed = response.get("Failed") if isinstance(response, dict) else None
            failed_ids = set()
            for entry in failed if isinstance(failed, list) else []:
                entry_id = entry.get("Id") if isinstance(entry, dict) else None
                if not isinstance(entry_id, str) or not entry_id.isdigit() or int(entry_id) >= len(chunk):
                    continue
                failed_ids.add(entry_id)
                code = entry.get("Code")
                delete_error = RunlaneError(
                    ErrorCode.TRANSPORT_UNAVAILABLE,
                    f"SQS did not delete a handled message ({code if isinstance(code, str) else 'no code'}); "
                    "it will be delivered again and ignored as already handled.",
                    retryable=True,
                    meta={"provider_code": code} if isinstance(code, str) else {},
                )
                await self._failed(SqsDeliveryFailurePhase.DELETE, delete_error, chunk[int(entry_id)].message_id)
            self.counts.deleted += len(chunk) - len(failed_ids)

    async def _failed(
        self,
        phase: SqsDeliveryFailurePhase,
        cause: BaseException,
        message_id: str | None,
        message: DeliveryMessage | None = None,
    ) -> None:
        self.counts.failed += phase is not SqsDeliveryFailurePhase.DELETE
        if self.on_delivery_failure is not None:
            failure = SqsDeliveryFailure(
                phase=phase,
                cause=cause,
                provider_message_id=message_id,
                delivery_message=message,
                queue_url=self.queue_url,
            )
            await call(self.on_delivery_failure, failure)


def _visibility_entries(receipt_handles: list[Any], visibility_timeout: int = 0) -> list[dict[str, Any]]:
    """``ChangeMessageVisibilityBatch`` entries that make these messages visible again at once (or after
    ``visibility_timeout`` seconds)."""
    return [
        {"Id": str(index), "ReceiptHandle": handle, "VisibilityTimeout": visibility_timeout}
        for index, handle in enumerate(receipt_handles)
        if isinstance(handle, str) and handle
    ]


def create_sqs_delivery_consumer(
    *,
    client: Any,
    queue_url: str,
    execute_delivery: ExecuteDelivery,
    delivery_options: Mapping[str, Any] | None = None,
    fifo: bool = False,
    max_number_of_messages: int = SQS_MAX_BATCH_SIZE,
    wait_time_seconds: int = SQS_MAX_WAIT_TIME_SECONDS,
    visibility_timeout_seconds: int | None = None,
    signal: CancellationSignal | None = None,
    on_delivery_failure: FailureObserver | None = None,
) -> SqsDeliveryConsumer:
    """A consumer of the SQS queue at ``queue_url``; ``await consumer.start()`` to run it.

    ``execute_delivery`` is normally ``runlane.execute_delivery``; ``delivery_options``
    (``lease_duration``, ``heartbeat_interval``, ``max_attempt_duration``, ``signal``, ``worker_id``)
    are passed to every delivery, with a signal that also aborts on ``stop()`` and on ``signal``.
    ``fifo`` must be ``True`` exactly for a FIFO queue (its URL ends in ``.fifo``).
    ``max_number_of_messages`` (1-10), ``wait_time_seconds`` (0-20) and ``visibility_timeout_seconds``
    (0-43200; default: the queue's) shape each ``ReceiveMessage``; keep the visibility timeout longer
    than a delivery takes.
    """
    check_client(client, ("receive_message", "delete_message_batch"), "create_sqs_delivery_consumer()")
    if not isinstance(queue_url, str) or not queue_url.startswith(("http://", "https://")):
        raise invalid(f"queue_url must be an http(s) SQS queue URL, got {queue_url!r}.", field="queue_url")
    check_callable(execute_delivery, "execute_delivery")
    if on_delivery_failure is not None:
        check_callable(on_delivery_failure, "on_delivery_failure")
    if not isinstance(fifo, bool):
        raise invalid(f"fifo must be True or False, got {fifo!r}.", field="fifo")
    is_fifo_queue = queue_url.rstrip("/").endswith(FIFO_SUFFIX)
    if fifo != is_fifo_queue:
        raise invalid(
            f"{queue_url!r} is a {'FIFO' if is_fifo_queue else 'standard'} queue; "
            f"pass fifo={is_fifo_queue} so deliveries {'keep' if is_fifo_queue else 'do not wait on'} its order.",
            field="fifo",
        )
    if signal is not None and not isinstance(signal, CancellationSignal):
        raise invalid(f"signal must be a CancellationSignal, got {signal!r}.", field="signal")
    options = check_delivery_options(delivery_options)
    size = check_count(max_number_of_messages, "max_number_of_messages", 1, SQS_MAX_BATCH_SIZE)
    wait = check_count(wait_time_seconds, "wait_time_seconds", 0, SQS_MAX_WAIT_TIME_SECONDS)
    visibility = None
    if visibility_timeout_seconds is not None:
        visibility = check_count(
            visibility_timeout_seconds, "visibility_timeout_seconds", 0, SQS_MAX_VISIBILITY_TIMEOUT_SECONDS
        )
    return SqsDeliveryConsumer(
        client=client,
        queue_url=queue_url,
        execute_delivery=execute_delivery,
        delivery_options=options,
        fifo=fifo,
        max_number_of_messages=size,
        wait_time_seconds=wait,
        visibility_timeout_seconds=visibility,
        signal=signal,
        on_delivery_failure=on_delivery_failure,
    )
