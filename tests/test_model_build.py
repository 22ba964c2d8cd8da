"""Models built from already-valid values equal the validated construction exactly."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from pydantic import ValidationError

from runlane.json_values import canonical_json
from runlane.model_build import build_validated, worker_actor
from runlane.models import (
    Actor,
    DeliveryIntent,
    Environment,
    RunCounters,
    RunCreatedEvent,
    RunDeliveryRequestedEvent,
    RunEventRecord,
    RunFailure,
    RunLease,
    RunLeaseClaimedEvent,
    RunSource,
    RunStartedEvent,
    RunSucceededEvent,
)
from runlane.vocabulary import ActorType, RunSourceType

ENV = Environment(name="tests")
NOW = datetime(2030, 1, 2, 3, 4, 5, 6789, tzinfo=UTC)
ACTOR = Actor(type=ActorType.WORKER, id="worker-1")
LEASE = {"worker_id": "worker-1", "token": "tok", "claimed_at": NOW, "expires_at": NOW + timedelta(minutes=5)}
COMMON = {"run_id": "run_1", "environment": ENV, "occurred_at": NOW, "actor": ACTOR}

CASES = [
    (RunLease, LEASE),
    (RunLeaseClaimedEvent, {**COMMON, "lease": RunLease(**LEASE), "attempt_deadline_at": None}),
    (RunLeaseClaimedEvent, {**COMMON, "lease": RunLease(**LEASE), "attempt_deadline_at": NOW + timedelta(seconds=9)}),
    (RunStartedEvent, {**COMMON, "attempt": 1}),
    (RunSucceededEvent, {**COMMON, "attempt": 2, "output": None, "has_output": False}),
    (RunSucceededEvent, {**COMMON, "attempt": 1, "output": {"a": [1, 2.5, None]}, "has_output": True}),
    (RunSucceededEvent, {**COMMON, "attempt": 1, "output": None, "has_output": True}),
    (DeliveryIntent, {"environment": ENV, "run_id": "run_1", "queue": "q", "requested_at": NOW, "available_at": NOW}),
    (
        RunDeliveryRequestedEvent,
        {
            **COMMON,
            "delivery": DeliveryIntent(environment=ENV, run_id="run_1", queue="q", requested_at=NOW, available_at=NOW),
        },
    ),
    (
        RunCreatedEvent,
        {
            **COMMON,
            "trace_carrier": None,
            "meta": None,
            "task_id": "task.x",
            "queue": "q",
            "payload": {"n": 1},
            "concurrency_key": None,
            "idempotency_key": None,
            "idempotency_key_ttl": None,
            "singleton_key": None,
            "source": None,
        },
    ),
    (
        RunCreatedEvent,
        {
            **COMMON,
            "trace_carrier": {"traceparent": "00-1"},
            "meta": {"why": ["x"]},
            "task_id": "task.x",
            "queue": "q",
            "payload": [1, "two"],
            "concurrency_key": "ck",
            "idempotency_key": "ik",
            "idempotency_key_ttl": "active",
            "singleton_key": "sk",
            "source": RunSource(type=RunSourceType.TRIGGER, source_run_id="run_0"),
        },
    ),
    (RunEventRecord, {"id": "evt_1", "sequence": 3, "event": RunStartedEvent(**COMMON, attempt=1)}),
]


@pytest.mark.parametrize(("model", "values"), CASES)
def test_built_models_equal_validated_models(model, values):
    built = build_validated(model, values)
    validated = model(**values)
    assert type(built) is model
    assert built == validated
    assert list(built.__dict__) == list(validated.__dict__)
    assert built.model_fields_set == validated.model_fields_set
    assert canonical_json(built.model_dump(mode="json")) == canonical_json(validated.model_dump(mode="json"))
    assert built.model_copy(update={}) == validated
    with pytest.raises(ValidationError):  # still frozen
        built.__setattr__(next(iter(values)), None)


def test_models_with_default_factories_take_model_construct():
    values = {"code": "task_failed", "message": "m"}
    built = build_validated(RunFailure, values)
    assert built.meta == {} and built.meta is not build_validated(RunFailure, values).meta
    counters = build_validated(RunCounters, {"attempts": 1})
    assert counters == RunCounters(attempts=1)


def test_worker_actor_is_built_once_and_shared():
    assert worker_actor("worker-9") is worker_actor("worker-9")
    assert worker_actor("worker-9") == Actor(type=ActorType.WORKER, id="worker-9")


def test_detached_runs_equal_model_copy_and_share_no_json_values():
    from test_model_json import all_runs

    from runlane.storage.tables import _copy_json, _detached

    for run in all_runs():
        detached = _detached(run)
        update = {
            name: _copy_json(getattr(run, name))
            for name in ("payload", "output", "meta", "trace_carrier")
            if type(getattr(run, name)) in (dict, list)
        }
        if run.failure is not None and run.failure.meta:
            update["failure"] = run.failure.model_copy(update={"meta": _copy_json(run.failure.meta)})
        expected = run.model_copy(update=update) if update else run
        assert detached == expected == run
        assert detached.model_fields_set == expected.model_fields_set
        assert list(detached.__dict__) == list(run.__dict__)
        for name in ("payload", "output", "meta", "trace_carrier"):
            value = getattr(run, name)
            if type(value) in (dict, list):
                assert getattr(detached, name) is not value
        if run.failure is not None and run.failure.meta:
            assert detached.failure.meta is not run.failure.meta
