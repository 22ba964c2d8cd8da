"""What ``runlane sqs consume`` runs: one ``SqsDeliveryConsumer`` per bound SQS queue, supervised.

Each executed run prints the same line as ``runlane work``; an ignored (stale) wakeup and a message
left unacknowledged print a line of their own. A consumer that loses SQS for a retryable reason
(network, throttling, a 5xx) is started again after a backoff; any other failure (a queue that does
not exist, access denied) stops the command with that error. The first SIGINT/SIGTERM stops receiving,
lets the deliveries in flight finish and waits for the long poll in flight to return (at most the
``--wait-time``), handing back what it received; a second one exits at once.
"""

from __future__ import annotations

import asyncio
from typing import Any

from runlane.cli.output import Output, forward_runtime_logs, prints_as_json_logs
from runlane.cli.work import StopOnSignals
from runlane.errors import ErrorCode, RunlaneError
from runlane.vocabulary import ExecuteDeliveryStatus

from .aws import call_sqs, classify_provider_error
from .consumer import create_sqs_delivery_consumer
from .delivery import SqsDeliveryFailure, check_delivery_options
from .transport import SqsTransport

__all__ = ["consume_wakeups"]

# How much longer than its --wait-time an abandoned long poll may take to return (a slow network).
_RECEIVE_RETURN_MARGIN_S = 5.0


async def consume_wakeups(
    runtime: Any,
    output: Output,
    *,
    queues: list[str],
    delivery_options: dict[str, Any],
    max_number_of_messages: int,
    wait_time_seconds: int,
    visibility_timeout_seconds: int | None,
    restart_delay: tuple[float, float],
) -> int:
    """Consume until stopped; returns the number of runs executed."""
    transport = runtime.lane.delivery.transport
    if not isinstance(transport, SqsTransport):
        raise RunlaneError(
            ErrorCode.CONFIGURATION_INVALID,
            f"The configured lane {runtime.lane.name!r} publishes no SQS wakeups; `runlane sqs consume` needs a "
            "postgres-sqs lane. For a polling lane, run `runlane work`.",
            meta={"lane": runtime.lane.name},
        )
    check_delivery_options(delivery_options)  # bad durations or worker ids fail here, before any consumer starts
    names = list(dict.fromkeys(queues or [binding.queue_name for binding in transport.bindings]))
    bindings = {name: transport.binding(name) for name in names}  # an unbound queue fails here, at once
    by_url: dict[str, list[str]] = {}
    fifo: dict[str, bool] = {}

    executed = 0

    async def execute(message: Any, **options: Any) -> Any:
        nonlocal executed
        result = await runtime.execute_delivery(message, **options)
        if result.status is ExecuteDeliveryStatus.EXECUTED and result.run is not None:
            executed += 1
            output.run_executed(result.run)
        else:
            reason = result.reason.value if result.reason is not None else "unknown"
            output.record(
                "delivery_ignored",
                f"wakeup ignored run={message.run_id} queue={message.queue} reason={reason}",
                run_id=message.run_id,
                queue=message.queue,
                reason=reason,
            )
        return result

    def on_failure(failure: SqsDeliveryFailure) -> None:
        cause = failure.cause
        code = cause.code.value if isinstance(cause, RunlaneError) else type(cause).__name__
        text = cause.message if isinstance(cause, RunlaneError) else str(cause)
        output.record(
            "delivery_failed",
            f"message {failure.provider_message_id} left on the queue phase={failure.phase.value} error={code}: {text}",
            message_id=failure.provider_message_id,
            phase=failure.phase.value,
            error_code=code,
            error_message=text,
            queue_url=failure.queue_url,
        )

    async def supervise(url: str, stopping: asyncio.Event) -> None:
        first_delay, max_delay = restart_delay
        delay = first_delay
        loop = asyncio.get_running_loop()
        restarts = 0
        while not stopping.is_set():
            consumer = create_sqs_delivery_consumer(
                client=transport.client,
                queue_url=url,
                execute_delivery=execute,
                delivery_options=delivery_options,
                fifo=fifo[url],
                max_number_of_messages=max_number_of_messages,
                wait_time_seconds=wait_time_seconds,
                visibility_timeout_seconds=visibility_timeout_seconds,
                on_delivery_failure=on_failure,
            )
            await consumer.start()
            started = loop.time()
            output.record(
                "consumer_started",
                f"consumer {'restarted' if restarts else 'started'} queues={','.join(by_url[url])} url={url}",
                queues=by_url[url],
                queue_url=url,
                restarts=restarts,
            )
            restarts += 1
            stop_requested = asyncio.ensure_future(stopping.wait())
            try:
                await asyncio.wait([consumer.closed, stop_requested], return_when=asyncio.FIRST_COMPLETED)
            finally:
                stop_requested.cancel()
                if consumer.running:
                    await consumer.stop()
                if stopping.is_set():
                    await _hand_back_abandoned_receive(consumer, output, wait_time_seconds)
            error = consumer.closed.exception()
            if error is None:
                return
            if not (isinstance(error, RunlaneError) and error.retryable):
                raise error
            if loop.time() - started >= max_delay:
                delay = first_delay  # it ran well for a while: this is a new outage, not the same one
            output.record(
                "consumer_failed",
                f"consumer of {url} lost SQS ({error.code.value}): {error.message} Restarting in {delay:g}s.",
                queue_url=url,
                error_code=error.code.value,
                error_message=error.message,
                retry_in_seconds=delay,
            )
            if await _stopped_within(stopping, delay):
                return
            delay = min(delay * 2, max_delay)

    with (
        StopOnSignals(output, "current deliveries") as stop,
        forward_runtime_logs(output),
        prints_as_json_logs(output),
    ):
        urls = await _resolve_urls(transport, names, output, stop.stopping, restart_delay)
        for name, url in (urls or {}).items():
            by_url.setdefault(url, []).append(name)
            fifo[url] = bindings[name].is_fifo
        tasks = [asyncio.ensure_future(supervise(url, stop.stopping)) for url in by_url]
        try:
            if tasks:  # none when told to stop while waiting for SQS
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
                for task in done:
                    task.result()  # the first consumer that failed for good stops the command with its error
        finally:
            for task in tasks:
                task.cancel()  # each supervisor stops its consumer on the way out
            await asyncio.gather(*tasks, return_exceptions=True)
    output.record("consumer_stopped", f"consumer stopped runs={executed}", runs=executed)
    return executed


async def _resolve_urls(
    transport: SqsTransport,
    names: list[str],
    output: Output,
    stopping: asyncio.Event,
    delay: tuple[float, float],
) -> dict[str, str] | None:
    """The queue URL of every named queue (``queue_name`` bindings ask SQS), each checked to answer.
    While SQS cannot be reached the command says so and tries again with backoff; ``None`` when it is
    told to stop meanwhile, at once even while a call hangs on an endpoint that does not answer (its
    daemon thread is left to botocore's timeouts). A queue that does not exist is
    ``configuration_invalid`` at once."""

    async def resolve() -> dict[str, str]:
        urls = {name: await transport.queue_url(name, detached=True) for name in names}
        for url in dict.fromkeys(urls.values()):
            await _probe(transport, url)
        return urls

    wait, max_wait = delay
    said = False
    while True:
        attempt = asyncio.ensure_future(resolve())
        stop_requested = asyncio.ensure_future(stopping.wait())
        try:
            await asyncio.wait([attempt, stop_requested], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop_requested.cancel()
            if not attempt.done():
                attempt.cancel()
        if not attempt.done() or attempt.cancelled():
            return None  # told to stop while SQS was still being asked
        try:
            return attempt.result()
        except RunlaneError as error:
            if not error.retryable:
                raise
            if not said:
                output.record(
                    "sqs_waiting",
                    f"waiting for SQS: {error.message} Retrying until it answers (Ctrl-C to give up).",
                    error_code=error.code.value,
                    error_message=error.message,
                )
                said = True
        if await _stopped_within(stopping, wait):
            return None
        wait = min(wait * 2, max_wait)


async def _probe(transport: SqsTransport, url: str) -> None:
    """Ask SQS about the queue at ``url``: unreachable is retryable, a missing queue is not; any other
    answer (access denied included) shows SQS is up, and the consumer's receives report the rest."""
    try:
        await call_sqs(
            transport.client, "get_queue_attributes", detached=True, QueueUrl=url, AttributeNames=["QueueArn"]
        )
    except Exception as error:
        failure = classify_provider_error(
            error, operation="GetQueueAttributes", queue_url=url, refused=ErrorCode.TRANSPORT_PUBLISH_FAILED
        )
        if failure.retryable or failure.code is ErrorCode.CONFIGURATION_INVALID:
            raise failure from None


async def _hand_back_abandoned_receive(consumer: Any, output: Output, wait_time_seconds: int) -> None:
    """Stay until the long poll the stop abandoned has returned: SQS still hands wakeups to a poll whose
    process has exited, and they would stay invisible to every consumer until their visibility timeout
    ends. The consumer makes what the poll returns visible again at once."""
    if await consumer.wait_for_abandoned_receive(0):
        return
    output.record(
        "receive_wait",
        f"waiting up to {wait_time_seconds}s for the receive in flight to return, so the wakeups it gets "
        "are handed back at once (send again to exit now)",
        queue_url=consumer.queue_url,
        wait_seconds=wait_time_seconds,
    )
    await consumer.wait_for_abandoned_receive(wait_time_seconds + _RECEIVE_RETURN_MARGIN_S)


async def _stopped_within(stopping: asyncio.Event, seconds: float) -> bool:
    """Wait up to ``seconds``; ``True`` as soon as a stop is requested."""
    try:
        await asyncio.wait_for(stopping.wait(), seconds)
    except TimeoutError:
        return False
    return True
