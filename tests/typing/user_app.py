"""An application written against Runlane's public API the way the guides show, fully annotated.

``tests/test_typing.py`` type-checks it with ``mypy --strict``: every name it imports must be typed
and every call must agree with the published signatures.
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta

from pydantic import BaseModel

from runlane import (
    Backoff,
    ObservationTrimResult,
    Retry,
    RetryBackoffType,
    RunlaneError,
    RunRecord,
    RunStatus,
    TaskContext,
    TaskRelease,
    TriggerRunResult,
    WorkerMode,
    create_runlane,
    queue,
    schedule,
    task,
)
from runlane.testing import ControlledClock
from runlane_local import local_lane, sqlite_lane
from runlane_otlp import otlp_sink
from runlane_postgres import postgres_migration_sql, postgres_polling_lane, postgres_storage

emails = queue("emails", default=True)
reports = queue("reports", concurrency_limit=2)


class Welcome(BaseModel):
    user_id: str


@task(
    "emails.welcome",
    queue=emails,
    idempotency_key=lambda payload: f"emails.welcome.{payload.user_id}",
    retry=Retry(max_attempts=3, backoff=Backoff(type=RetryBackoffType.EXPONENTIAL, delay="5s", max_delay="1m")),
)
async def send_welcome_email(payload: Welcome, ctx: TaskContext) -> dict[str, str] | TaskRelease:
    if ctx.is_cancellation_requested():
        return ctx.release("1m", reason="retry later")
    ctx.signal.raise_if_aborted()

    async def fetch(token: str) -> str:
        return token

    token = await ctx.step.run("fetch", fetch, output=str)
    child = await ctx.trigger(build_report, {"user_id": payload.user_id})
    return {"user": payload.user_id, "token": token, "child": child.run.id}


@task(
    "reports.build",
    queue=reports,
    max_attempt_duration="10m",
    schedule=schedule("reports.daily", cron="0 9 * * *", time_zone="America/New_York", payload={"user_id": "u"}),
)
def build_report(payload: Welcome, ctx: TaskContext) -> int:
    return ctx.attempt


@task("reports.wait", queue=reports)
async def wait_for_report(payload: str, ctx: TaskContext) -> TaskRelease | None:
    if payload:
        return ctx.wait_for_run(payload, timeout=timedelta(hours=1))
    return ctx.wait_for_signal("report-ready", timeout="1h")


async def main() -> None:
    clock = ControlledClock()
    runlane = create_runlane(
        lane=local_lane(),
        queues=[emails, reports],
        tasks=[send_welcome_email, build_report, wait_for_report],
        clock=clock,
    )
    started: datetime = runlane.clock.now()
    print(started.isoformat())
    async with runlane:
        result: TriggerRunResult = await runlane.trigger(send_welcome_email, {"user_id": "user_123"})
        run: RunRecord = result.run
        print(run.status.value, result.outcome.value)
        done = await runlane.execute_next(queues=[emails])
        if done is not None and done.status is RunStatus.SUCCEEDED:
            print(done.output, done.counters.attempts)
        handle = runlane.worker(mode=WorkerMode.DRAIN, concurrency=4, empty_poll_delay=timedelta(milliseconds=50))
        await handle.closed
        clock.advance("1h")
        tick = await runlane.tick()
        print(tick.materialized + tick.delivery_requested + tick.cancellations_finalized)
        page = await runlane.runs.list(limit=10, statuses=[RunStatus.SUCCEEDED])
        await runlane.runs.list(statuses=["failed", "retrying"], sort_by="updated_at", sort_direction="asc")
        await runlane.runs.events("run_1", types=["run.failed"], sort_by="sequence")
        await runlane.worker(mode="poll").stop()
        for summary in page.data:
            print(summary.id, summary.status)
        events = await runlane.runs.events(run.id, limit=50)
        print([record.event.type for record in events.data], events.next_cursor)
        woken: list[RunRecord] = await runlane.signals.send("report-ready")
        print(len(woken))
        try:
            await runlane.runs.cancel("run_missing", reason="not needed")
        except RunlaneError as error:
            print(error.code, error.retryable, error.meta)


def sync_producer(path: str) -> RunStatus | None:
    runlane = create_runlane(lane=sqlite_lane(path), queues=[emails], tasks=[send_welcome_email])
    try:
        result = runlane.sync.trigger(send_welcome_email, {"user_id": "user_123"}, idempotency_key="welcome-1")
        again = runlane.sync.runs.get(result.run.id)
        return None if again is None else again.status
    finally:
        runlane.sync.close()


def postgres_producer(connection_string: str) -> int:
    migration: str = postgres_migration_sql(schema="app")
    print(len(migration), postgres_storage(connection_string, schema="app").name)
    runlane = create_runlane(
        lane=postgres_polling_lane(connection_string, schema="app"), queues=[emails], clock=ControlledClock()
    )
    try:
        trimmed: ObservationTrimResult = runlane.sync.observations.trim(older_than="7d", consumers=["otlp"], limit=500)
        return trimmed.deleted
    finally:
        runlane.sync.close()


EXPORTER = otlp_sink(endpoint="http://collector:4318/v1/logs")


if __name__ == "__main__":
    asyncio.run(main())
