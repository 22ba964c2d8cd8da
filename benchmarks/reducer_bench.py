"""Reducer throughput for a typical run lifecycle.

Each run goes through run.created, run.delivery_requested, run.lease_claimed, run.started,
run.lease_heartbeat and run.succeeded. The events are built up front (event validation is the
caller's cost, not the reducer's); the timed part is ``project_run_events`` only, projected event by
event (one call per event, as the write paths do) and as one batch per run. Prints events/second.

    .venv/bin/python benchmarks/reducer_bench.py [--runs N] [--repeat R]
"""

from __future__ import annotations

import argparse
import gc
import platform
import time
from datetime import UTC, datetime, timedelta

import pydantic

from runlane import (
    Actor,
    ActorType,
    DeliveryIntent,
    Environment,
    RunCreatedEvent,
    RunDeliveryRequestedEvent,
    RunLease,
    RunLeaseClaimedEvent,
    RunLeaseHeartbeatEvent,
    RunRecord,
    RunStartedEvent,
    RunSucceededEvent,
    contract_defaults,
    project_run_events,
)

ENVIRONMENT = Environment(name="bench")
SYSTEM = contract_defaults.actor.system
WORKER = Actor(type=ActorType.WORKER, id="bench-worker")
QUEUE = "default"
T0 = datetime(2026, 1, 1, tzinfo=UTC)
LEASE = contract_defaults.lease.duration


def lifecycle(index: int) -> list:
    run_id = f"run_{index:08d}"
    base = T0 + timedelta(milliseconds=index)
    claimed = base + timedelta(milliseconds=5)
    common = {"run_id": run_id, "environment": ENVIRONMENT}
    return [
        RunCreatedEvent(
            **common,
            occurred_at=base,
            actor=SYSTEM,
            task_id="emails.send",
            queue=QUEUE,
            payload={"user_id": f"user_{index}", "template": "welcome"},
            trace_carrier={"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
        ),
        RunDeliveryRequestedEvent(
            **common,
            occurred_at=base,
            actor=SYSTEM,
            delivery=DeliveryIntent(
                environment=ENVIRONMENT, run_id=run_id, queue=QUEUE, requested_at=base, available_at=base
            ),
        ),
        RunLeaseClaimedEvent(
            **common,
            occurred_at=claimed,
            actor=WORKER,
            lease=RunLease(
                worker_id="bench-worker", token=f"tok_{index}", claimed_at=claimed, expires_at=claimed + LEASE
            ),
            attempt_deadline_at=claimed + timedelta(minutes=10),
        ),
        RunStartedEvent(**common, occurred_at=claimed, actor=WORKER, attempt=1),
        RunLeaseHeartbeatEvent(
            **common,
            occurred_at=claimed + timedelta(seconds=30),
            actor=WORKER,
            lease=RunLease(
                worker_id="bench-worker",
                token=f"tok_{index}",
                claimed_at=claimed,
                expires_at=claimed + timedelta(seconds=30) + LEASE,
            ),
        ),
        RunSucceededEvent(
            **common,
            occurred_at=claimed + timedelta(seconds=31),
            actor=WORKER,
            attempt=1,
            output={"email_id": f"em_{index}"},
            has_output=True,
        ),
    ]


def project_event_by_event(histories: list[list]) -> list[RunRecord]:
    finals = []
    for events in histories:
        run = None
        sequence = contract_defaults.run.new_event_sequence
        for event in events:
            run = project_run_events(run, sequence, (event,))
            sequence = run.event_sequence
        finals.append(run)
    return finals


def project_batch(histories: list[list]) -> list[RunRecord]:
    return [project_run_events(None, contract_defaults.run.new_event_sequence, events) for events in histories]


def best_of(repeat: int, function, histories: list[list], *, collect_garbage: bool) -> tuple[float, list[RunRecord]]:
    best = float("inf")
    result: list[RunRecord] = []
    for _ in range(repeat):
        result = []
        gc.collect()
        if not collect_garbage:
            gc.disable()
        try:
            started = time.perf_counter()
            result = function(histories)
            best = min(best, time.perf_counter() - started)
        finally:
            gc.enable()
    return best, result


def revalidate(records: list[RunRecord]) -> float:
    started = time.perf_counter()
    for record in records:
        RunRecord.model_validate(record.__dict__)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=3)
    args, _ = parser.parse_known_args()  # `./dev bench` passes the same arguments to every script

    build_started = time.perf_counter()
    histories = [lifecycle(index) for index in range(args.runs)]
    build_seconds = time.perf_counter() - build_started
    events = sum(len(history) for history in histories)

    print(
        f"Reducer benchmark: Python {platform.python_version()} ({platform.python_implementation()}), "
        f"pydantic {pydantic.VERSION}, {platform.machine()}"
    )
    print(f"  {args.runs} runs x {events // args.runs} events = {events} events, best of {args.repeat}")
    print(f"  (building and validating the events: {events / build_seconds:,.0f} events/s, not included below)")

    reference: list[RunRecord] | None = None
    for collect_garbage in (True, False):
        print(f"  garbage collector {'on (as in a server)' if collect_garbage else 'off (reducer CPU cost only)'}:")
        for label, function, calls in (
            ("event by event", project_event_by_event, events),
            ("one batch per run", project_batch, args.runs),
        ):
            seconds, finals = best_of(args.repeat, function, histories, collect_garbage=collect_garbage)
            if reference is None:
                reference = finals
            elif finals != reference:
                raise SystemExit(f"{label} projection disagrees with event-by-event projection")
            print(
                f"    {label:<18} {events / seconds:>10,.0f} events/s  {seconds * 1e6 / events:5.2f} us/event  "
                f"{seconds * 1e6 / calls:6.2f} us/call"
            )

    assert reference is not None
    print(
        "  for comparison, fully re-validating one projected RunRecord costs "
        f"{revalidate(reference) * 1e6 / len(reference):.2f} us"
    )


if __name__ == "__main__":
    main()
