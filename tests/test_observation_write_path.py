"""The observation write path's fast encodings equal the reference ones byte for byte: observation
builders and dumps, append-value documents, and materialized / measured stream records."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from pydantic import TypeAdapter

from runlane import (
    Environment,
    Retry,
    RunlaneObservation,
    RunlaneObservationSourceKind,
    RunStepRecord,
    TaskContext,
    task,
)
from runlane.core.observations import (
    observation_for_event,
    observation_for_step,
    observation_record_id,
    observation_record_value,
)
from runlane.model_json import runlane_observation_json
from runlane.models import UtcDateTime
from runlane.storage import (
    MAX_UNSIGNED_64,
    StorageAppendCommand,
    StorageDocument,
    StorageStreamName,
    encode_storage_append_value,
    materialize_storage_append,
    measure_storage_append,
    measure_storage_record,
    storage_stream_layouts,
)
from runlane.testing import ControlledClock

from runtime_support import make_runtime

LAYOUT = storage_stream_layouts[StorageStreamName.OBSERVATIONS]
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def reference_value(observation: RunlaneObservation, kind: str, source_id: str, recorded_at: datetime) -> dict[str, Any]:
    """``observation_record_value`` spelled out through pydantic's generic serializers."""
    adapter = TypeAdapter(UtcDateTime)
    return {
        "id": observation_record_id(observation.environment, kind, source_id),
        "environment": observation.environment.to_json(),
        "source_kind": kind,
        "source_id": source_id,
        "recorded_at": adapter.dump_python(adapter.validate_python(recorded_at), mode="json"),
        "observation": observation.model_dump(mode="json", exclude_none=True),
    }


async def test_observations_of_every_event_shape_equal_their_validated_construction():
    @task("shapes", retry=Retry(2, backoff="1m"))
    async def shapes(payload: dict, ctx: TaskContext) -> Any:
        await ctx.step.run("s", lambda token: 1)
        if ctx.attempt == 1:
            raise ValueError("again")
        if ctx.attempt == 2:
            return ctx.release("1m", reason="later")
        return {"ok": True}

    runtime, clock = make_runtime(shapes, clock=ControlledClock(T0))
    async with runtime:
        run = (await runtime.trigger(shapes, {}, trace_carrier={"traceparent": "t"})).run
        for _ in range(3):
            await runtime.execute_next(lease_duration="1s", heartbeat_interval="100ms")
            clock.advance("2m")
        cancelled = (await runtime.trigger(shapes, {})).run
        await runtime.runs.cancel(cancelled.id)
        owners = {run.id: await runtime.runs.get(run.id), cancelled.id: await runtime.runs.get(cancelled.id)}
        final = owners[run.id]
        records = [
            *(await runtime.runs.events(run.id, sort_by="sequence")).data,
            *(await runtime.runs.events(cancelled.id, sort_by="sequence")).data,
        ]
        step = await runtime.store.get_step(run.id, "s")
    types = {record.event.type.value for record in records}
    assert {"run.retry_scheduled", "run.released", "run.succeeded", "run.cancelled"} <= types
    for record in records:
        fast = observation_for_event(record, owners[record.event.run_id])
        assert fast == RunlaneObservation.model_validate(fast.model_dump())
        assert runlane_observation_json(fast) == fast.to_json()
        kind = RunlaneObservationSourceKind.RUN_EVENT
        value = observation_record_value(fast, kind, record.id, record.event.occurred_at)
        assert value == reference_value(fast, kind.value, record.id, record.event.occurred_at)
        assert StorageDocument.encode(value).text == encode_storage_append_value(dict(value), checked=True).text
    for owner in (final, None):
        fast = observation_for_step(step, owner)
        assert fast == RunlaneObservation.model_validate(fast.model_dump())
        assert runlane_observation_json(fast) == fast.to_json()


def test_inputs_that_are_not_plain_validated_models_take_the_validating_path():
    env = Environment(name="e")
    step = RunStepRecord(environment=env, run_id="run_1", step_key="k", token="tok", attempt=1, output=None, completed_at=T0)
    constructed = RunStepRecord.model_construct(**{**dict(step), "completed_at": datetime(2026, 1, 1, 2, tzinfo=timezone(timedelta(hours=2)))})
    observation = observation_for_step(constructed)
    assert observation.occurred_at == T0 and observation.occurred_at.tzinfo is UTC
    other_zone = datetime(2026, 1, 1, 1, tzinfo=timezone(timedelta(hours=1)))
    value = observation_record_value(observation, "run_step", "tok", other_zone)
    assert value["recorded_at"] == "2026-01-01T00:00:00Z"
    assert value == reference_value(observation, "run_step", "tok", other_zone)


VALUES: list[dict[str, Any]] = [
    {},
    {"a": 1},
    {"é": "ü", "a": [1.5, {"stream_position_x": None}]},
    {"note": "stream_position"},
    {"nested": {"stream_position": "1"}},
    {"zz": 1e300, "aa": -0.0, "big": 2**70},
    {"stream_positio": 1},
    {"stream_position0": 2},
    {"stream": 1, "ü": 2},
    {"z": "after the position field"},
    {"text": "line\nbreak \u2028 \"quoted\" \\ /"},
]


@pytest.mark.parametrize("checked", [False, True])
@pytest.mark.parametrize("partition", ["default", "ünïcode env", "a/b"])
def test_materialized_and_measured_stream_records_equal_the_layouts_reference(checked, partition):
    documents = [encode_storage_append_value(dict(value), checked=checked) for value in VALUES]
    assert [document.text for document in documents] == [StorageDocument.encode(value).text for value in VALUES]
    fast = StorageAppendCommand(StorageStreamName.OBSERVATIONS, partition, documents)
    plain = StorageAppendCommand(StorageStreamName.OBSERVATIONS, partition, VALUES)
    widest = MAX_UNSIGNED_64 - 1
    reference_sizes = [measure_storage_record(LAYOUT.stream_record(partition, widest, value)) for value in VALUES]
    head_size = measure_storage_record(LAYOUT.head_record(partition, widest))
    expected = (len(VALUES) + 1, head_size + sum(reference_sizes), reference_sizes)
    for command in (fast, plain):
        records, total, per_record = measure_storage_append(command)
        assert (records, total, list(per_record)) == expected
        for start in (1, 99, MAX_UNSIGNED_64 - len(VALUES)):
            appended = materialize_storage_append(command, start)
            for offset, (record, value) in enumerate(zip(appended.records, VALUES)):
                reference = LAYOUT.stream_record(partition, start + offset, value)
                assert record == reference
                assert record.document.text == reference.document.text
                assert record.document.byte_size == reference.document.byte_size
                assert [(e.encoded_partition, e.encoded_sort) for e in record.indexes] == [
                    (e.encoded_partition, e.encoded_sort) for e in reference.indexes
                ]
            head = StorageDocument.encode({"next_position": str(start + len(VALUES))})
            assert appended.head.key == LAYOUT.head_key(partition)
            assert (appended.head.document.text, appended.head.document.byte_size) == (head.text, head.byte_size)


@pytest.mark.parametrize("checked", [False, True])
def test_values_carrying_the_position_field_are_still_rejected(checked):
    for value in ({"stream_position": "1"}, {"a": 1, "stream_position": "1"}, {"stream_position": "1", "z": 2}):
        command = StorageAppendCommand(
            StorageStreamName.OBSERVATIONS, "p", [encode_storage_append_value(value, checked=checked)]
        )
        for action in (lambda: materialize_storage_append(command, 1), lambda: measure_storage_append(command)):
            with pytest.raises(Exception) as caught:
                action()
            assert getattr(caught.value, "code", None) is not None and caught.value.code.value == "adapter_contract_violation"
