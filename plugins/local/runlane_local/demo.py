"""A walk through one run's durable lifecycle on the in-memory lane.

Every step is what the runtime does on each write path: read the current run inside a storage
transaction, project new events with the pure reducer, and commit events + projection atomically.
Then two writers race on the same run to show optimistic concurrency, and the operator read model
lists the result.

    ./dev demo
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from datetime import timedelta

from runlane import (
    Actor,
    ActorType,
    DeliveryIntent,
    Environment,
    ErrorCode,
    PaginationParams,
    RunCreatedEvent,
    RunDeliveryRequestedEvent,
    RunEventFilter,
    RunEventRecord,
    RunEventSortField,
    RunFilter,
    RunLease,
    RunLeaseClaimedEvent,
    RunlaneError,
    RunRecord,
    RunStartedEvent,
    RunSucceededEvent,
    SortDirection,
    contract_defaults,
    environment_key,
    get_storage_conflict_kind,
    project_run_events,
)
from runlane.storage import NewStorageRecord, StorageDriver
from runlane.storage.tables import (
    RunChildCounts,
    decode_run_document,
    encode_run_document,
    encode_run_event_document,
    run_event_key,
    run_key,
)
from runlane.testing import ControlledClock

from .memory import local_storage_driver

ENVIRONMENT = Environment(name="demo")
SYSTEM = contract_defaults.actor.system
WORKER = Actor(type=ActorType.WORKER, id="demo-worker")


async def append(driver: StorageDriver, run_id: str, build: Callable[..., list]) -> RunRecord:
    """One write path: read the run, project ``build(now, run)`` events, commit everything at once."""
    env = environment_key(ENVIRONMENT)
    event_ids = [f"evt_{uuid.uuid4().hex[:12]}" for _ in range(8)]  # identities prepared outside the attempt

    async def attempt(tx):
        (current,) = await tx.get([run_key(env, run_id)])
        run, children = decode_run_document(current.document) if current else (None, RunChildCounts())
        now = await tx.now()
        events = build(now, run)
        sequence = run.event_sequence if run else contract_defaults.run.new_event_sequence
        projected = project_run_events(run, sequence, events)
        for offset, event in enumerate(events, start=1):
            record = RunEventRecord(id=event_ids[offset - 1], sequence=sequence + offset, event=event)
            tx.create(NewStorageRecord(run_event_key(env, run_id, sequence + offset), encode_run_event_document(record)))
        counts = RunChildCounts(events=children.events + len(events))
        new = NewStorageRecord(run_key(env, run_id), encode_run_document(projected, counts))
        tx.replace(current, new) if current else tx.create(new)
        return projected

    return await driver.with_transaction(attempt)


def _show(run: RunRecord, what: str) -> None:
    print(f"  {what:<34} status={run.status.value:<10} sequence={run.event_sequence} attempts={run.counters.attempts}")


async def main() -> None:
    clock = ControlledClock()
    driver = local_storage_driver(clock=clock)
    await driver.start()
    try:
        run_id = "run_welcome_user_123"
        print(f"Runlane demo: one run on the in-memory lane (environment {ENVIRONMENT.name!r})\n")

        run = await append(
            driver,
            run_id,
            lambda now, _: [
                RunCreatedEvent(run_id=run_id, environment=ENVIRONMENT, occurred_at=now, actor=SYSTEM,
                                task_id="emails.welcome", queue="emails", payload={"user_id": "user_123"}),
                RunDeliveryRequestedEvent(run_id=run_id, environment=ENVIRONMENT, occurred_at=now, actor=SYSTEM,
                                          delivery=DeliveryIntent(environment=ENVIRONMENT, run_id=run_id, queue="emails",
                                                                  requested_at=now, available_at=now)),
            ],
        )
        _show(run, "triggered")

        clock.advance("1s")
        token = uuid.uuid4().hex
        run = await append(
            driver,
            run_id,
            lambda now, _: [
                RunLeaseClaimedEvent(run_id=run_id, environment=ENVIRONMENT, occurred_at=now, actor=WORKER,
                                     lease=RunLease(worker_id="demo-worker", token=token, claimed_at=now,
                                                    expires_at=now + contract_defaults.lease.duration)),
                RunStartedEvent(run_id=run_id, environment=ENVIRONMENT, occurred_at=now, actor=WORKER, attempt=1),
            ],
        )
        _show(run, "lease claimed, attempt 1 started")

        clock.advance(timedelta(milliseconds=250))
        stale = run
        run = await append(
            driver,
            run_id,
            lambda now, _: [RunSucceededEvent(run_id=run_id, environment=ENVIRONMENT, occurred_at=now, actor=WORKER,
                                              attempt=1, output={"email_id": "em_42"}, has_output=True)],
        )
        _show(run, "succeeded with output")

        # A second writer still holding the old projection loses the race instead of overwriting it.
        try:
            project_run_events(run, stale.event_sequence, [
                RunSucceededEvent(run_id=run_id, environment=ENVIRONMENT, occurred_at=clock.now(), actor=WORKER,
                                  attempt=1, has_output=False)])
        except RunlaneError as error:
            assert error.code is ErrorCode.STORAGE_CONFLICT
            print(f"  stale writer rejected:             {error.code.value} ({get_storage_conflict_kind(error).value}), retryable={error.retryable}")

        page = await driver.list_runs(RunFilter(environment=ENVIRONMENT), PaginationParams())
        print(f"\nOperator list ({len(page.data)} run):")
        for summary in page.data:
            print(f"  {summary.id}  {summary.task_id}  {summary.status.value}  queue={summary.queue}")

        events = await driver.list_run_events(
            RunEventFilter(environment=ENVIRONMENT, run_id=run_id, sort_by=RunEventSortField.SEQUENCE,
                           sort_direction=SortDirection.ASC),
            PaginationParams(),
        )
        print("\nEvent history:")
        for record in events.data:
            print(f"  #{record.sequence}  {record.event.occurred_at:%H:%M:%S.%f}  {record.event.type.value}")
        final = await driver.get_run(ENVIRONMENT, run_id)
        print(f"\nOutput: {final.output}  (process-local state: gone when this process exits)")
    finally:
        await driver.close()


if __name__ == "__main__":
    asyncio.run(main())
