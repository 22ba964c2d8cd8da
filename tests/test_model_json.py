"""The storage write path's fast JSON dumps equal pydantic's ``model_dump(mode="json")`` for every shape."""

from __future__ import annotations

import enum
import itertools
import random
from datetime import UTC, datetime, timedelta, timezone

from runlane import model_json
from runlane.errors import ErrorCode
from runlane.json_values import canonical_json
from runlane.models import (
    Actor,
    DeliveryIntent,
    Environment,
    RunCancellationRequestedEvent,
    RunCancelledEvent,
    RunCompletionWaitCondition,
    RunCounters,
    RunCreatedEvent,
    RunDeliveryRequestedEvent,
    RunEventRecord,
    RunFailedEvent,
    RunFailure,
    RunLease,
    RunLeaseClaimedEvent,
    RunLeaseHeartbeatEvent,
    RunRecord,
    RunReleasedEvent,
    RunRetryScheduledEvent,
    RunSource,
    RunStartedEvent,
    RunSucceededEvent,
    SignalWaitCondition,
    TimeWaitCondition,
)
from runlane.vocabulary import ActorType, RunSourceType, RunStatus


class Colour(enum.StrEnum):
    RED = "red"


ENV = Environment(name="tests")
T0 = datetime(2030, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)
TIMES = [
    T0,
    T0.replace(microsecond=0),
    T0.replace(microsecond=120000),
    datetime(1, 1, 1, tzinfo=UTC),
    # Validation converts other offsets to UTC; the dump must agree with pydantic's either way.
    datetime(2030, 6, 1, 12, 0, tzinfo=timezone(timedelta(hours=5, minutes=30))),
]
JSON_VALUES = [
    None,
    {"n": 1},
    {"nested": {"list": [1, 2.5, None, True, "ü"], "deep": {"x": []}}},
    [1, "two", {"three": 3}],
    "text",
    0,
    -1.25,
    False,
    2**70,
    {"tuple": (1, "x"), "enum": Colour.RED},
]
ACTORS = [
    Actor(type=ActorType.SYSTEM),
    Actor(type=ActorType.WORKER, id="worker-1"),
    Actor(type=ActorType.OPERATOR, id="op"),
]
FAILURES = [
    RunFailure(code=ErrorCode.TASK_FAILED, message="Task failed.", retryable=True),
    RunFailure(code=ErrorCode.TASK_TIMED_OUT, message="Task timed out.", meta={"detail": {"a": [1, (2, 3)]}}),
]
SOURCES = [
    None,
    RunSource(type=RunSourceType.TRIGGER, source_run_id="run_parent"),
    RunSource(type=RunSourceType.SCHEDULE, schedule_id="nightly", occurrence_id="occ_1"),
]
WAITS = [
    None,
    TimeWaitCondition(resume_at=T0),
    SignalWaitCondition(signal_key="sig", timeout_at=TIMES[1]),
    SignalWaitCondition(signal_key="sig"),
    RunCompletionWaitCondition(run_id="run_other", timeout_at=TIMES[4]),
]


def lease(n: int) -> RunLease:
    return RunLease(worker_id=f"worker-{n}", token=f"token-{n}", claimed_at=TIMES[n % 5], expires_at=TIMES[(n + 1) % 5])


def base(n: int) -> dict:
    return {
        "run_id": f"run_{n}",
        "environment": ENV,
        "occurred_at": TIMES[n % len(TIMES)],
        "actor": ACTORS[n % len(ACTORS)],
        "trace_carrier": None if n % 2 else {"traceparent": f"00-{n}"},
        "meta": None if n % 3 else {"m": JSON_VALUES[n % len(JSON_VALUES)]},
    }


def all_events() -> list:
    events = []
    for n in range(12):
        common = base(n)
        pick = JSON_VALUES[n % len(JSON_VALUES)]
        events.extend(
            [
                RunCreatedEvent(
                    **common,
                    task_id="task.x",
                    queue="q",
                    payload=pick,
                    run_at=None if n % 2 else TIMES[n % 5],
                    concurrency_key=None if n % 3 else "ck",
                    idempotency_key=None if n % 4 else "ik",
                    idempotency_key_ttl=[None, 1000, "active"][n % 3],
                    singleton_key=None if n % 5 else "sk",
                    source=SOURCES[n % 3],
                ),
                RunDeliveryRequestedEvent(
                    **common,
                    delivery=DeliveryIntent(
                        environment=ENV,
                        run_id=common["run_id"],
                        queue="q",
                        requested_at=TIMES[n % 5],
                        available_at=TIMES[(n + 2) % 5],
                        dispatch_expires_at=None if n % 2 else TIMES[3],
                        trace_carrier=common["trace_carrier"],
                    ),
                ),
                RunLeaseClaimedEvent(**common, lease=lease(n), attempt_deadline_at=None if n % 2 else TIMES[2]),
                RunLeaseHeartbeatEvent(**common, lease=lease(n + 1)),
                RunStartedEvent(**common, attempt=n + 1),
                RunSucceededEvent(**common, attempt=1, output=pick, has_output=pick is not None or n % 2 == 0),
                RunSucceededEvent(**common, attempt=2),
                RunFailedEvent(**common, attempt=1, failure=FAILURES[n % 2]),
                RunRetryScheduledEvent(
                    **common, attempt=1, failure=FAILURES[n % 2], delay="10s", retry_at=TIMES[n % 5]
                ),
                RunReleasedEvent(
                    **common, attempt=1, delay="1m", resume_at=TIMES[n % 5], reason=None if n % 2 else "later"
                ),
                RunReleasedEvent(**{**common, "meta": {"why": pick}}, attempt=1, wait=WAITS[2 + n % 3]),
                RunCancellationRequestedEvent(**common, reason=None if n % 2 else "operator"),
                RunCancelledEvent(**common, reason="stop", attempt=None if n % 2 else 3),
            ]
        )
    return events


def all_runs() -> list[RunRecord]:
    runs = []
    rng = random.Random(5)
    for n, status in zip(range(60), itertools.cycle(RunStatus)):
        has_output = n % 3 == 0
        runs.append(
            RunRecord(
                id=f"run_{n}",
                environment=ENV,
                task_id="task.x",
                queue="q",
                status=status,
                payload=JSON_VALUES[n % len(JSON_VALUES)],
                counters=RunCounters(attempts=n % 4, failures=n % 2, retries=n % 3, releases=n % 5),
                event_sequence=n + 1,
                created_at=TIMES[n % 5],
                updated_at=TIMES[(n + 1) % 5],
                run_at=rng.choice([None, *TIMES]),
                started_at=rng.choice([None, *TIMES]),
                finished_at=rng.choice([None, *TIMES]),
                lease=rng.choice([None, lease(n)]),
                attempt_deadline_at=rng.choice([None, *TIMES]),
                dispatched_at=rng.choice([None, *TIMES]),
                dispatch_expires_at=rng.choice([None, *TIMES]),
                wait=WAITS[n % len(WAITS)],
                failure=rng.choice([None, *FAILURES]),
                output=JSON_VALUES[(n + 1) % len(JSON_VALUES)] if has_output else None,
                has_output=has_output,
                source=SOURCES[n % 3],
                idempotency_key=rng.choice([None, "ik"]),
                singleton_key=rng.choice([None, "sk"]),
                concurrency_key=rng.choice([None, "ck"]),
                trace_carrier=rng.choice([None, {"traceparent": "t"}]),
                meta=rng.choice([None, {"m": JSON_VALUES[n % len(JSON_VALUES)]}]),
            )
        )
    return runs


def test_every_model_field_is_written():
    assert model_json._ENABLED


def test_run_dumps_equal_pydantic_dumps():
    for run in all_runs():
        expected = run.model_dump(mode="json")
        assert model_json.run_record_json(run) == expected
        assert canonical_json(model_json.run_record_json(run)) == canonical_json(expected)


def test_event_and_event_record_dumps_equal_pydantic_dumps():
    events = all_events()
    assert {type(event) for event in events} == set(model_json._EVENT_FIELDS)
    for sequence, event in enumerate(events, start=1):
        assert model_json.run_event_json(event) == event.model_dump(mode="json")
        record = RunEventRecord(id=f"evt_{sequence}", sequence=sequence, event=event)
        expected = record.model_dump(mode="json")
        dumped = model_json.run_event_record_json(f"evt_{sequence}", sequence, event)
        assert dumped == expected
        assert canonical_json(dumped) == canonical_json(expected)


def test_unknown_event_types_take_pydantic():
    class Custom(RunStartedEvent):
        pass

    event = Custom(**base(1), attempt=1)
    assert model_json.run_event_json(event) == event.model_dump(mode="json")
    assert model_json.run_event_record_json("evt_1", 1, event) == RunEventRecord.model_construct(
        id="evt_1", sequence=1, event=event
    ).model_dump(mode="json")
