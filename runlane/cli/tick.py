"""``runlane tick``: one bounded maintenance pass through ``runlane.tick()``."""

from __future__ import annotations

from typing import Any

import typer

from .main import state_of, with_runtime
from .options import (
    CancellationFinalizationLimit,
    DeliveryRequestLimit,
    OutboxClaimLimit,
    ScheduleMaterializationLimit,
    TickLimits,
    TimeoutFinalizationLimit,
)

__all__ = ["app"]

app = typer.Typer()


@app.command("tick")
def tick(
    ctx: typer.Context,
    schedule_materialization_limit: ScheduleMaterializationLimit = None,
    delivery_request_limit: DeliveryRequestLimit = None,
    cancellation_finalization_limit: CancellationFinalizationLimit = None,
    timeout_finalization_limit: TimeoutFinalizationLimit = None,
    outbox_claim_limit: OutboxClaimLimit = None,
) -> None:
    """Run one maintenance pass: schedules, recovery, cancellations, timeouts, outbox."""
    limits = TickLimits.of(
        schedule_materialization_limit,
        delivery_request_limit,
        cancellation_finalization_limit,
        timeout_finalization_limit,
        outbox_claim_limit,
    )

    async def body(runtime: Any) -> Any:
        return await runtime.tick(**limits)

    state_of(ctx).output.tick_result(with_runtime(ctx, body))
