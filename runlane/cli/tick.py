"""``runlane tick``: one bounded maintenance pass through ``runlane.tick()``."""

from __future__ import annotations

from typing import Any

import typer

from .main import OperationParams, operation, run_operation
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


class TickParams(OperationParams):
    schedule_materialization_limit: int | None = None
    delivery_request_limit: int | None = None
    cancellation_finalization_limit: int | None = None
    timeout_finalization_limit: int | None = None
    outbox_claim_limit: int | None = None


@operation("tick", TickParams, lambda output, params, result: output.tick_result(result))
async def _tick(runtime: Any, params: TickParams) -> Any:
    return await runtime.tick(**params.model_dump(exclude_none=True))


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
    run_operation(ctx, "tick", **TickLimits.of(
        schedule_materialization_limit,
        delivery_request_limit,
        cancellation_finalization_limit,
        timeout_finalization_limit,
        outbox_claim_limit,
    ))
