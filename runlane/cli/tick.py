"""``runlane tick``: one bounded maintenance pass through ``runlane.tick()``, or one every ``--every D``.

``--every`` is the maintenance process of a deployment on a shared lane: it ticks until SIGINT/SIGTERM
(the pass in progress finishes first), prints one lifecycle line per pass, and rides out storage
outages (a retryable failure is reported and the next pass goes on), corrupt stored records (an
``invariant_violation`` is reported and the next passes go on: ``tick()`` runs its other phases anyway,
and a restart would not repair the record) and a queue whose wakeups the transport refuses (an SQS
``queue_name`` that does not resolve: the other queues' wakeups still go out). ``runlane dev`` runs the
same loop next to its worker.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import typer

from ..durations import duration_ms
from ..errors import ErrorCode, RunlaneError
from .main import OperationParams, operation, require_shared_lane, run_operation, state_of, with_runtime
from .output import Output, forward_runtime_logs, tick_counts
from .options import (
    DURATION,
    CancellationFinalizationLimit,
    DeliveryRequestLimit,
    DispatchReservationLimit,
    HealthFileOption,
    OutboxClaimLimit,
    ScheduleMaterializationLimit,
    TickLimits,
    TimeoutFinalizationLimit,
)
from .work import StopOnSignals

__all__ = ["app", "tick_until_stopped"]

app = typer.Typer()


class TickParams(OperationParams):
    schedule_materialization_limit: int | None = None
    delivery_request_limit: int | None = None
    cancellation_finalization_limit: int | None = None
    timeout_finalization_limit: int | None = None
    outbox_claim_limit: int | None = None
    dispatch_reservation_limit: int | None = None


@operation(
    "tick",
    TickParams,
    lambda output, params, result: output.tick_result(result),
    summary=lambda params, result: f"✓ {tick_counts(result)}",
)
async def _tick(runtime: Any, params: TickParams) -> Any:
    return await runtime.tick(**params.model_dump(exclude_none=True))


async def tick_until_stopped(
    runtime: Any,
    output: Output,
    limits: TickLimits,
    interval_s: float,
    stopping: asyncio.Event,
    *,
    alongside: Iterable[asyncio.Future[Any]] = (),
) -> int:
    """Tick every ``interval_s`` until ``stopping`` is set or one of ``alongside`` finishes; returns the
    passes that completed.

    A retryable failure (a storage outage), an ``invariant_violation`` (a corrupt stored record), a
    failure of one schedule (``meta["schedule_id"]``: a definition that cannot fire, such as a payload
    too large for the lane) or the transport refusing one queue's wakeups (``meta["queue"]``: an SQS
    ``queue_name`` that does not resolve) is reported, the next passes go on, and the pass that works
    again says so (as a worker does): ``tick()`` raises the last three once its other phases have run,
    and one of them must not stop recovery, retries and publishing for the whole lane. A failure is
    reported when it first occurs and again only when the error changes (for an outage, its code), not
    on every pass. Any other failure raises.
    """
    others = set(alongside)
    passes = failed = 0
    reported: tuple[str, str] | None = None
    while not stopping.is_set() and not any(other.done() for other in others):
        try:
            result = await runtime.tick(**limits)
        except RunlaneError as error:
            one_part = "schedule_id" in error.meta or "queue" in error.meta
            if not error.retryable and error.code is not ErrorCode.INVARIANT_VIOLATION and not one_part:
                raise
            # One outage is one report however its messages vary from pass to pass (the connection
            # lost mid-pass, then refused); a corrupt record is reported again when another one is met.
            seen = (error.code.value, "" if error.retryable else error.message)
            if reported != seen:
                reported = seen
                output.record(
                    "tick_failed",
                    f"tick failed ({error.code.value}): {error.message} The next passes go on.",
                    error_code=error.code.value,
                    error_message=error.message,
                )
            failed += 1
        else:
            if failed:
                output.record("tick_recovered", f"tick works again after {failed} failed passes", failed=failed)
                failed = 0
                reported = None
            output.tick_record(result)
            passes += 1
        sleeper = asyncio.ensure_future(stopping.wait())
        try:
            await asyncio.wait({sleeper, *others}, timeout=interval_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            sleeper.cancel()
    return passes


@app.command("tick", short_help="Run one maintenance pass, or one every D with --every.")
def tick(
    ctx: typer.Context,
    every: str | None = typer.Option(
        None,
        "--every",
        metavar="D",
        help="Run a pass every D (such as 5s) until stopped, instead of once.",
        callback=DURATION,
    ),
    schedule_materialization_limit: ScheduleMaterializationLimit = None,
    delivery_request_limit: DeliveryRequestLimit = None,
    cancellation_finalization_limit: CancellationFinalizationLimit = None,
    timeout_finalization_limit: TimeoutFinalizationLimit = None,
    outbox_claim_limit: OutboxClaimLimit = None,
    dispatch_reservation_limit: DispatchReservationLimit = None,
    health_file: HealthFileOption = None,
) -> None:
    """Run one maintenance pass: schedules, recovery, cancellations, timeouts, outbox.

    With --every D, run one every D until SIGINT/SIGTERM: the maintenance process of a deployment.
    """
    limits = TickLimits.of(
        schedule_materialization_limit,
        delivery_request_limit,
        cancellation_finalization_limit,
        timeout_finalization_limit,
        outbox_claim_limit,
        dispatch_reservation_limit,
    )
    if every is None:
        if health_file is not None:
            ctx.fail("--health-file needs --every: a single pass has no liveness to report.")
        run_operation(ctx, "tick", **limits)
        return
    interval_s = duration_ms(every, "--every") / 1000  # checked by its callback already
    output = state_of(ctx).output

    async def body(runtime: Any) -> None:
        require_shared_lane(
            runtime,
            separately="a separate maintenance loop would tick an empty store",
            dev_does="already ticks that lane",
            command="runlane tick --every",
        )
        lane = runtime.lane
        output.record(
            "tick_loop_started",
            f"maintenance started lane={lane.name} environment={runtime.environment.name} every={every}",
            lane=lane.name,
            environment=runtime.environment.name,
            every_seconds=interval_s,
        )
        with StopOnSignals(output, finishing="the current pass") as stop, forward_runtime_logs(output):
            passes = await tick_until_stopped(runtime, output, limits, interval_s, stop.stopping)
        output.record("tick_loop_stopped", f"maintenance stopped passes={passes}", passes=passes)

    with_runtime(ctx, body, wait_for_storage=every is not None, health_file=health_file)
