"""Durable observation export (``runlane.core.observations``) over the in-memory driver.

Stream records are written the way core's write paths do: ``stage_observations`` inside
``driver.with_transaction``, through native ordered append or through the point-write fallback.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import io
import json
import sys
from datetime import UTC, datetime, timedelta

import pytest
from runlane_local import local_storage_driver

from runlane.core.cancellation import CancellationController
from runlane.core.observations import (
    OBSERVATION_CHECKPOINTS_COLLECTION,
    ConsoleObservationSink,
    ExporterTick,
    ObservationExporter,
    advance_observation_checkpoint,
    event_observation_values,
    get_observation_checkpoint,
    observation_checkpoint_key,
    observation_cursor,
    observation_for_event,
    observation_for_step,
    observation_head_key,
    observation_head_reads,
    observation_record_id,
    observation_record_value,
    scan_observation_records,
    stage_observations,
    step_observation_value,
)
from runlane.errors import ErrorCode, RunlaneError, StorageConflictKind, is_storage_conflict
from runlane.json_values import canonical_json
from runlane.models import (
    Actor,
    Environment,
    RunCreatedEvent,
    RunEventRecord,
    RunFailedEvent,
    RunFailure,
    RunlaneObservationRecord,
    RunRecord,
    RunReleasedEvent,
    RunStepRecord,
    RunSucceededEvent,
    environment_key,
)
from runlane.storage import (
    StorageIndexConsistency,
    StorageIndexName,
    StorageLimits,
    StorageQuery,
    StorageQueryResult,
    StorageStreamName,
    storage_stream_layouts,
)
from runlane.storage.cursor import decode_opaque_token, encode_opaque_token
from runlane.testing import ControlledClock
from runlane.vocabulary import (
    ActorType,
    RunEventType,
    RunlaneObservationExporterTickStatus as Tick,
    RunlaneObservationSourceKind,
    RunlaneObservationType,
    RunStatus,
)

ENV = Environment(name="production")
OTHER_ENV = Environment(name="staging")
T0 = datetime(2026, 1, 1, tzinfo=UTC)
SYSTEM = Actor(type=ActorType.SYSTEM)
LAYOUT = storage_stream_layouts[StorageStreamName.OBSERVATIONS]
SECRET = "secret-customer-data"


# ---------------------------------------------------------------------------------------------
# Fixtures and helpers


@pytest.fixture
def driver():
    return local_storage_driver(clock=ControlledClock(T0))


def no_append(profile):
    """The same driver's profile as a driver without native append would report it."""
    return dataclasses.replace(profile, ordered_append=False)


def make_run(run_id: str = "run_1", env: Environment = ENV, **changes) -> RunRecord:
    fields = dict(
        id=run_id,
        environment=env,
        task_id="send_email",
        queue="emails",
        status=RunStatus.SUCCEEDED,
        payload={"email": SECRET},
        event_sequence=3,
        created_at=T0,
        updated_at=T0,
        output={"receipt": SECRET},
        has_output=True,
        meta={"note": SECRET},
    )
    fields.update(changes)
    return RunRecord(**fields)


def created(run: RunRecord, sequence: int = 1, event_id: str = "evt_1") -> RunEventRecord:
    event = RunCreatedEvent(
        run_id=run.id,
        environment=run.environment,
        occurred_at=T0 + timedelta(seconds=sequence),
        actor=SYSTEM,
        task_id=run.task_id,
        queue=run.queue,
        payload={"email": SECRET},
        meta={"note": SECRET},
        trace_carrier={"traceparent": "00-abc-def-01"},
    )
    return RunEventRecord(id=event_id, sequence=sequence, event=event)


def events_for(run: RunRecord, count: int, prefix: str = "evt") -> list[RunEventRecord]:
    return [created(run, sequence, f"{prefix}_{run.id}_{sequence}") for sequence in range(1, count + 1)]


def values_for(run_id: str, count: int, env: Environment = ENV) -> list[dict]:
    run = make_run(run_id, env)
    return event_observation_values(run, events_for(run, count))


async def append(driver, values, *, env: Environment = ENV, native: bool = True) -> None:
    """Stage ``values`` in one transaction the way a core write path will."""
    profile = driver.profile if native else no_append(driver.profile)

    async def attempt(tx):
        head = None
        reads = observation_head_reads(profile, env)
        if reads:
            [head] = await tx.get(list(reads))
        stage_observations(tx, profile, env, values, head=head)

    await driver.with_transaction(attempt)


async def raw_stream(driver, env: Environment = ENV):
    """The head document and every record (key, document text, index entries) of a partition."""
    [head] = await driver.get([observation_head_key(env)])
    records = []
    position = 1
    while True:
        [record] = await driver.get([LAYOUT.record_key(env.name, position)])
        if record is None:
            break
        records.append((record.key, record.document.text, record.indexes))
        position += 1
    return (None if head is None else head.document.value), records


async def scan_all(driver, env: Environment = ENV, cursor=None, limit=None):
    records = []
    while True:
        page = await scan_observation_records(driver, env, cursor=cursor, limit=limit)
        if not page.records:
            return records, cursor
        records.extend(page.records)
        cursor = page.cursor


class RecordingSink:
    def __init__(self) -> None:
        self.batches: list[list[RunlaneObservationRecord]] = []

    async def export(self, records):
        self.batches.append(list(records))

    @property
    def ids(self) -> list[str]:
        return [record.id for batch in self.batches for record in batch]


# ---------------------------------------------------------------------------------------------
# Sanitized observations and record values


def test_event_observation_carries_identity_and_no_customer_data():
    run = make_run()
    failed = RunEventRecord(
        id="evt_fail",
        sequence=5,
        event=RunFailedEvent(
            run_id=run.id,
            environment=ENV,
            occurred_at=T0,
            actor=SYSTEM,
            attempt=2,
            failure=RunFailure(code=ErrorCode.TASK_FAILED, message=SECRET, meta={"detail": SECRET}),
            meta={"note": SECRET},
        ),
    )
    released = RunEventRecord(
        id="evt_release",
        sequence=6,
        event=RunReleasedEvent(
            run_id=run.id, environment=ENV, occurred_at=T0, actor=SYSTEM, attempt=3, delay="1m",
            resume_at=T0 + timedelta(minutes=1), reason=SECRET, meta={"note": SECRET},
        ),
    )
    succeeded = RunEventRecord(
        id="evt_ok",
        sequence=7,
        event=RunSucceededEvent(
            run_id=run.id, environment=ENV, occurred_at=T0, actor=SYSTEM, attempt=3,
            output={"x": SECRET}, has_output=True,
        ),
    )
    for record in (created(run), failed, released, succeeded):
        observation = observation_for_event(record, run)
        assert SECRET not in json.dumps(observation.to_json())
        assert observation.type is RunlaneObservationType.RUN_EVENT
        assert (observation.environment, observation.run_id, observation.task_id, observation.queue) == (
            ENV, "run_1", "send_email", "emails",
        )
        assert (observation.event_id, observation.event_sequence, observation.event_type) == (
            record.id, record.sequence, record.event.type,
        )
        assert observation.occurred_at == record.event.occurred_at
        assert observation.status is RunStatus.SUCCEEDED
    assert observation_for_event(failed, run).failure_code is ErrorCode.TASK_FAILED
    assert observation_for_event(failed, run).attempt == 2
    assert observation_for_event(created(run), run).trace_carrier == {"traceparent": "00-abc-def-01"}
    assert observation_for_event(created(run), run).attempt is None


def test_event_observation_rejects_an_event_of_another_run():
    with pytest.raises(RunlaneError) as caught:
        observation_for_event(created(make_run("run_2")), make_run("run_1"))
    assert caught.value.code is ErrorCode.INVARIANT_VIOLATION


def test_step_observation_has_no_step_output():
    step = RunStepRecord(
        environment=ENV, run_id="run_1", step_key="charge", token="step_abc", attempt=2,
        output={"card": SECRET}, completed_at=T0,
    )
    observation = observation_for_step(step, make_run())
    assert SECRET not in json.dumps(observation.to_json())
    assert observation.type is RunlaneObservationType.RUN_STEP
    assert (observation.step_key, observation.step_token, observation.attempt) == ("charge", "step_abc", 2)
    assert (observation.task_id, observation.queue, observation.occurred_at) == ("send_email", "emails", T0)
    bare = observation_for_step(step)
    assert bare.task_id is None and bare.queue is None
    value = step_observation_value(step, make_run())
    assert value["source_kind"] == "run_step" and value["source_id"] == "step_abc"
    assert SECRET not in json.dumps(value)


def test_record_value_shape_and_stable_source_derived_id():
    run = make_run()
    record = created(run)
    observation = observation_for_event(record, run)
    value = observation_record_value(observation, RunlaneObservationSourceKind.RUN_EVENT, "evt_1", T0)
    expected_id = "obs_" + hashlib.sha256(canonical_json(["production", "run_event", "evt_1"]).encode()).hexdigest()
    assert value["id"] == expected_id == observation_record_id(ENV, "run_event", "evt_1")
    assert set(value) == {"id", "environment", "source_kind", "source_id", "recorded_at", "observation"}
    assert "stream_position" not in value
    assert value["environment"] == {"name": "production"}
    # The same source always maps to the same id and value, however often it is rebuilt.
    again = observation_record_value(observation_for_event(created(run), run), "run_event", "evt_1", T0)
    assert again == value
    # Any other source (kind, id or environment) gets another id.
    assert observation_record_id(ENV, "run_step", "evt_1") != expected_id
    assert observation_record_id(OTHER_ENV, "run_event", "evt_1") != expected_id
    assert observation_record_id(ENV, "run_event", "evt_2") != expected_id
    # The stored value plus a position is a valid public record.
    parsed = RunlaneObservationRecord.model_validate({**value, "stream_position": "1"})
    assert parsed.observation == observation and parsed.recorded_at == T0
    assert event_observation_values(run, [record]) == [
        observation_record_value(observation, "run_event", "evt_1", record.event.occurred_at)
    ]


# ---------------------------------------------------------------------------------------------
# Staging: native append and the point-write fallback


async def test_native_append_and_fallback_persist_identical_documents_and_positions():
    native, fallback = local_storage_driver(), local_storage_driver()
    batches = [values_for("run_a", 2), values_for("run_b", 3), values_for("run_c", 1)]
    for values in batches:
        await append(native, values, native=True)
        await append(fallback, values, native=False)
    native_head, native_records = await raw_stream(native)
    fallback_head, fallback_records = await raw_stream(fallback)
    assert native_head == fallback_head == {"next_position": "7"}
    assert native_records == fallback_records
    assert [key for key, _, _ in native_records] == [LAYOUT.record_key("production", p) for p in range(1, 7)]
    for position, (_, text, indexes) in enumerate(native_records, start=1):
        assert json.loads(text)["value"]["stream_position"] == str(position)
        (entry,) = indexes
        assert entry.name is StorageIndexName.OBSERVATION_STREAM and entry.partition == ("production",)
    records, _ = await scan_all(native)
    assert [record.id for record in records] == [value["id"] for values in batches for value in values]


async def test_mixed_writers_share_one_gap_free_stream(driver):
    batches = [values_for(f"run_{n}", n % 3 + 1) for n in range(9)]
    for n, values in enumerate(batches):
        await append(driver, values, native=n % 2 == 0)
    records, _ = await scan_all(driver)
    assert [record.stream_position for record in records] == [str(p) for p in range(1, len(records) + 1)]
    assert [record.id for record in records] == [value["id"] for values in batches for value in values]


async def test_concurrent_mixed_writers_never_lose_or_interleave_a_batch(driver):
    batches = [values_for(f"run_{n}", 3) for n in range(12)]
    await asyncio.gather(*(append(driver, values, native=n % 2 == 0) for n, values in enumerate(batches)))
    records, _ = await scan_all(driver)
    assert [record.stream_position for record in records] == [str(p) for p in range(1, 37)]
    by_run: dict[str, list[int]] = {}
    for record in records:
        by_run.setdefault(record.observation.run_id, []).append(int(record.stream_position))
    assert len(by_run) == 12
    for positions in by_run.values():  # each batch is contiguous
        assert positions == list(range(positions[0], positions[0] + 3))


async def test_staged_observations_roll_back_with_their_transaction(driver):
    class Boom(Exception):
        pass

    for native in (True, False):
        profile = driver.profile if native else no_append(driver.profile)

        async def attempt(tx, profile=profile):
            [head] = await tx.get(list(observation_head_reads(profile, ENV)) or [observation_checkpoint_key(ENV, "x")])
            stage_observations(tx, profile, ENV, values_for("run_1", 2), head=None if profile.ordered_append else head)
            raise Boom()

        with pytest.raises(Boom):
            await driver.with_transaction(attempt)
    assert await raw_stream(driver) == (None, [])
    await append(driver, values_for("run_2", 1))
    records, _ = await scan_all(driver)
    assert [record.stream_position for record in records] == ["1"]  # aborted attempts consumed no positions


async def test_fallback_requires_the_head_from_the_read_phase(driver):
    profile = no_append(driver.profile)
    assert observation_head_reads(profile, ENV) == (observation_head_key(ENV),)
    assert observation_head_reads(driver.profile, ENV) == ()

    async def without_head(tx):
        stage_observations(tx, profile, ENV, values_for("run_1", 1))

    with pytest.raises(RunlaneError) as caught:
        await driver.with_transaction(without_head)
    assert caught.value.code is ErrorCode.INVARIANT_VIOLATION

    await append(driver, values_for("run_1", 1, OTHER_ENV), env=OTHER_ENV, native=False)

    async def foreign_head(tx):
        [head] = await tx.get([observation_head_key(OTHER_ENV)])
        stage_observations(tx, profile, ENV, values_for("run_2", 1), head=head)

    with pytest.raises(RunlaneError) as caught:
        await driver.with_transaction(foreign_head)
    assert caught.value.code is ErrorCode.INVARIANT_VIOLATION
    assert await raw_stream(driver) == (None, [])


async def test_staging_rejects_values_of_another_environment(driver):
    for native in (True, False):
        with pytest.raises(RunlaneError) as caught:
            await append(driver, values_for("run_1", 1, OTHER_ENV), native=native)
        assert caught.value.code is ErrorCode.INVARIANT_VIOLATION
    assert await raw_stream(driver) == (None, [])


async def test_staging_nothing_writes_nothing(driver):
    async def attempt(tx):
        stage_observations(tx, driver.profile, ENV, [])
        stage_observations(tx, no_append(driver.profile), ENV, [])

    await driver.with_transaction(attempt)
    assert await raw_stream(driver) == (None, [])


# ---------------------------------------------------------------------------------------------
# Scans and cursors


async def test_scan_pages_forward_in_stream_order_with_cursors(driver):
    await append(driver, values_for("run_1", 4))
    await append(driver, values_for("run_2", 3), native=False)
    first = await scan_observation_records(driver, ENV, limit=3)
    assert [r.stream_position for r in first.records] == ["1", "2", "3"]
    assert first.cursor == observation_cursor(ENV, "3")
    second = await scan_observation_records(driver, ENV, cursor=first.cursor, limit=3)
    assert [r.stream_position for r in second.records] == ["4", "5", "6"]
    third = await scan_observation_records(driver, ENV, cursor=second.cursor, limit=3)
    assert [r.stream_position for r in third.records] == ["7"]
    empty = await scan_observation_records(driver, ENV, cursor=third.cursor, limit=3)
    assert empty.records == [] and empty.cursor == third.cursor
    assert (await scan_observation_records(driver, OTHER_ENV)).records == []
    assert (await scan_observation_records(driver, OTHER_ENV)).cursor is None
    # A cursor keeps working as the stream grows.
    await append(driver, values_for("run_3", 2))
    later = await scan_observation_records(driver, ENV, cursor=third.cursor)
    assert [r.stream_position for r in later.records] == ["8", "9"]
    assert all(r.environment == ENV and r.source_kind is RunlaneObservationSourceKind.RUN_EVENT for r in later.records)


async def test_scan_reads_records_in_chunks_of_the_point_read_limit():
    limited = local_storage_driver(limits=StorageLimits(max_point_reads=2))
    await append(limited, values_for("run_1", 5))
    page = await scan_observation_records(limited, ENV, limit=5)
    assert [r.stream_position for r in page.records] == ["1", "2", "3", "4", "5"]


async def test_scan_clamps_limit_to_the_pagination_maximum(driver):
    for n in range(3):
        await append(driver, values_for(f"run_{n}", 50))
    page = await scan_observation_records(driver, ENV, limit=1000)
    assert len(page.records) == 100
    assert len((await scan_observation_records(driver, ENV)).records) == 50  # default page


async def test_scan_rejects_foreign_and_malformed_cursors_and_bad_limits(driver):
    await append(driver, values_for("run_1", 1, OTHER_ENV), env=OTHER_ENV)
    foreign = (await scan_observation_records(driver, OTHER_ENV)).cursor
    token = decode_opaque_token(foreign)
    huge = encode_opaque_token({**token, "environment": environment_key(ENV), "position": "9" * 5000})  # > int()
    for bad in (foreign, "not-a-cursor", "1", foreign + "x", huge):
        with pytest.raises(RunlaneError) as caught:
            await scan_observation_records(driver, ENV, cursor=bad)
        assert caught.value.code is ErrorCode.VALIDATION_FAILED
    for limit in (0, -1, True, 1.5):
        with pytest.raises(RunlaneError) as caught:
            await scan_observation_records(driver, ENV, limit=limit)
        assert caught.value.code is ErrorCode.VALIDATION_FAILED


class LaggingIndexDriver:
    """An eventually consistent view: the index hides some rows that are already committed."""

    def __init__(self, inner, hidden: set[int]) -> None:
        self.inner, self.hidden, self.name = inner, hidden, inner.name
        self.profile = dataclasses.replace(inner.profile, index_consistency=StorageIndexConsistency.EVENTUAL)

    async def get(self, keys):
        return await self.inner.get(keys)

    async def query(self, query: StorageQuery) -> StorageQueryResult:
        result = await self.inner.query(query)
        items = tuple(ref for ref in result.items if int(ref.key.parts[1]) not in self.hidden)
        return StorageQueryResult(items, result.next_cursor)

    async def with_transaction(self, callback):
        return await self.inner.with_transaction(callback)


async def test_scan_over_a_lagging_index_stops_at_a_gap_instead_of_skipping(driver):
    await append(driver, values_for("run_1", 5))
    lagging = LaggingIndexDriver(driver, hidden={3})
    page = await scan_observation_records(lagging, ENV)
    assert [r.stream_position for r in page.records] == ["1", "2"]
    assert (await scan_observation_records(lagging, ENV, cursor=page.cursor)).records == []
    lagging.hidden.clear()
    assert [r.stream_position for r in (await scan_observation_records(lagging, ENV, cursor=page.cursor)).records] == [
        "3", "4", "5",
    ]


# ---------------------------------------------------------------------------------------------
# Checkpoints


async def test_checkpoint_advances_only_from_the_expected_cursor_forward_to_real_records(driver):
    await append(driver, values_for("run_1", 5))
    page = await scan_observation_records(driver, ENV, limit=2)
    assert await get_observation_checkpoint(driver, ENV, "otel") is None
    await advance_observation_checkpoint(driver, ENV, "otel", expected_cursor=None, cursor=page.cursor)
    assert await get_observation_checkpoint(driver, ENV, "otel") == page.cursor
    [stored] = await driver.get([observation_checkpoint_key(ENV, "otel")])
    assert stored.key.collection == OBSERVATION_CHECKPOINTS_COLLECTION == "observation_checkpoints"
    assert stored.key.parts == ("production", "otel")

    async def rejected(expected, cursor, *, retryable: bool):
        with pytest.raises(RunlaneError) as caught:
            await advance_observation_checkpoint(driver, ENV, "otel", expected_cursor=expected, cursor=cursor)
        assert is_storage_conflict(caught.value, StorageConflictKind.OBSERVATION_CHECKPOINT)
        assert caught.value.retryable is retryable
        assert await get_observation_checkpoint(driver, ENV, "otel") == page.cursor

    at_4 = observation_cursor(ENV, "4")
    await rejected(None, at_4, retryable=True)  # stale: the checkpoint already moved
    await rejected(observation_cursor(ENV, "1"), at_4, retryable=True)  # stale: a different expected cursor
    await rejected(page.cursor, observation_cursor(ENV, "1"), retryable=False)  # backwards
    await rejected(page.cursor, page.cursor, retryable=False)  # not forward
    await rejected(page.cursor, observation_cursor(ENV, "6"), retryable=False)  # no such record
    await append(driver, values_for("run_9", 4, OTHER_ENV), env=OTHER_ENV)
    await rejected(page.cursor, observation_cursor(OTHER_ENV, "4"), retryable=False)  # another environment's record

    await advance_observation_checkpoint(driver, ENV, "otel", expected_cursor=page.cursor, cursor=at_4)
    assert await get_observation_checkpoint(driver, ENV, "otel") == at_4
    # Consumers and environments keep independent checkpoints.
    assert await get_observation_checkpoint(driver, ENV, "audit") is None
    assert await get_observation_checkpoint(driver, OTHER_ENV, "otel") is None


async def test_first_checkpoint_must_reference_an_existing_record(driver):
    with pytest.raises(RunlaneError) as caught:
        first = observation_cursor(ENV, "1")
        await advance_observation_checkpoint(driver, ENV, "otel", expected_cursor=None, cursor=first)
    assert is_storage_conflict(caught.value, StorageConflictKind.OBSERVATION_CHECKPOINT)
    assert await get_observation_checkpoint(driver, ENV, "otel") is None


async def test_only_one_of_two_concurrent_writers_from_the_same_cursor_wins(driver):
    await append(driver, values_for("run_1", 4))
    results = await asyncio.gather(
        advance_observation_checkpoint(driver, ENV, "otel", expected_cursor=None, cursor=observation_cursor(ENV, "2")),
        advance_observation_checkpoint(driver, ENV, "otel", expected_cursor=None, cursor=observation_cursor(ENV, "4")),
        return_exceptions=True,
    )
    errors = [result for result in results if isinstance(result, BaseException)]
    assert len(errors) == 1 and is_storage_conflict(errors[0], StorageConflictKind.OBSERVATION_CHECKPOINT)
    winner = observation_cursor(ENV, "2" if results[0] is None else "4")
    assert await get_observation_checkpoint(driver, ENV, "otel") == winner


async def test_checkpoint_inputs_are_validated(driver):
    await append(driver, values_for("run_1", 1))
    cursor = observation_cursor(ENV, "1")
    for consumer in ("a:b", "", 7):
        with pytest.raises(RunlaneError) as caught:
            await get_observation_checkpoint(driver, ENV, consumer)
        assert caught.value.code is ErrorCode.VALIDATION_FAILED
        with pytest.raises(RunlaneError) as caught:
            await advance_observation_checkpoint(driver, ENV, consumer, expected_cursor=None, cursor=cursor)
        assert caught.value.code is ErrorCode.VALIDATION_FAILED
    with pytest.raises(RunlaneError) as caught:
        await advance_observation_checkpoint(driver, ENV, "otel", expected_cursor=None, cursor="garbage")
    assert caught.value.code is ErrorCode.VALIDATION_FAILED
    assert await get_observation_checkpoint(driver, ENV, "otel") is None


# ---------------------------------------------------------------------------------------------
# Exporter


async def test_exporter_ticks_idle_exported_and_idle_again():
    clock = ControlledClock(T0)
    driver = local_storage_driver(clock=clock)
    sink = RecordingSink()
    exporter = ObservationExporter(driver, ENV, "otel", sink, batch_size=3, clock=clock)
    idle = await exporter.export_once()
    assert isinstance(idle, ExporterTick)
    assert (idle.status, idle.exported, idle.error, idle.cursor) == (Tick.IDLE, 0, None, None)
    assert sink.batches == []

    await append(driver, values_for("run_1", 4))
    first = await exporter.export_once()
    assert (first.status, first.exported, first.error) == (Tick.EXPORTED, 3, None)
    assert first.cursor == observation_cursor(ENV, "3") == await get_observation_checkpoint(driver, ENV, "otel")
    second = await exporter.export_once()
    assert (second.status, second.exported) == (Tick.EXPORTED, 1)
    assert (await exporter.export_once()).status is Tick.IDLE
    assert [[r.stream_position for r in batch] for batch in sink.batches] == [["1", "2", "3"], ["4"]]
    stats = exporter.stats
    assert (stats.ticks, stats.exported, stats.batches, stats.failures, stats.last_exported_at) == (4, 4, 2, 0, T0)


async def test_exporter_batches_can_span_several_scan_pages(driver):
    await append(driver, values_for("run_1", 90))
    await append(driver, values_for("run_2", 40))
    sink = RecordingSink()
    tick = await ObservationExporter(driver, ENV, "otel", sink, batch_size=500).export_once()
    assert (tick.status, tick.exported) == (Tick.EXPORTED, 130)
    assert [r.stream_position for r in sink.batches[0]] == [str(p) for p in range(1, 131)]


async def test_failed_sink_leaves_the_checkpoint_untouched(driver):
    await append(driver, values_for("run_1", 2))

    class Rejecting:
        async def export(self, records):
            raise RunlaneError(ErrorCode.OBSERVATION_EXPORT_FAILED, "collector said 503", retryable=True)

    exporter = ObservationExporter(driver, ENV, "otel", Rejecting())
    tick = await exporter.export_once()
    assert tick.status is Tick.FAILED and tick.exported == 0
    assert isinstance(tick.error, RunlaneError) and tick.error.code is ErrorCode.OBSERVATION_EXPORT_FAILED
    assert await get_observation_checkpoint(driver, ENV, "otel") is None
    assert exporter.stats.failures == 1


async def test_a_sink_letting_a_cancellation_escape_fails_the_tick_and_the_loop_retries_it(driver):
    # The CancelledError of something the sink awaited (a send another task cancelled) escaped
    # export_once() and ended run() as if the exporter itself had been cancelled: runlane export's
    # exporter stopped without a word, though nobody stopped it.
    await append(driver, values_for("run_1", 2))
    controller = CancellationController()
    cancelled_sends = [1]

    class CancelledOnce(RecordingSink):
        async def export(self, records):
            if cancelled_sends:
                cancelled_sends.pop()
                send = asyncio.get_running_loop().create_future()
                send.cancel()
                await send
            await super().export(records)
            controller.abort("exported")

    sink = CancelledOnce()
    tick = await ObservationExporter(driver, ENV, "otel", sink).export_once()
    assert tick.status is Tick.FAILED and isinstance(tick.error, asyncio.CancelledError)
    assert await get_observation_checkpoint(driver, ENV, "otel") is None
    cancelled_sends.append(1)
    await asyncio.wait_for(
        ObservationExporter(driver, ENV, "otel", sink).run(signal=controller.signal, retry_delay="1ms"), 5
    )
    assert len(sink.ids) == 2
    assert await get_observation_checkpoint(driver, ENV, "otel") == observation_cursor(ENV, "2")


async def test_a_sink_that_calls_sys_exit_fails_its_exporter_for_good_instead_of_ending_the_process(driver):
    # Escaping, the SystemExit ended the event loop of the process (runlane dev's worker with it) with the
    # sink's exit status, and from a task (an export with a signal) as a 'never retrieved' traceback.
    await append(driver, values_for("run_1", 2))

    class Exiting:
        def export(self, records):
            sys.exit(3)

    exporter = ObservationExporter(driver, ENV, "otel", Exiting())
    for signal in (None, CancellationController().signal):
        tick = await exporter.export_once(signal=signal)
        assert tick.status is Tick.FAILED and isinstance(tick.error, RunlaneError)
        assert tick.error.code is ErrorCode.OBSERVATION_EXPORT_FAILED and not tick.error.retryable
        assert tick.error.message == "The sink called sys.exit(3); a sink reports a failure by raising."
    assert await get_observation_checkpoint(driver, ENV, "otel") is None
    with pytest.raises(RunlaneError) as stopped:
        await asyncio.wait_for(exporter.run(signal=CancellationController().signal), 5)
    assert stopped.value.code is ErrorCode.OBSERVATION_EXPORT_FAILED


async def test_stale_checkpoint_fails_the_tick_after_delivery(driver):
    """Two loops with one consumer race: the loser's sink saw the batch, but its advance is rejected."""
    await append(driver, values_for("run_1", 2))
    winner_sink = RecordingSink()
    winner = ObservationExporter(driver, ENV, "otel", winner_sink)

    class RacingSink(RecordingSink):
        async def export(self, records):
            await super().export(records)
            assert (await winner.export_once()).status is Tick.EXPORTED

    loser_sink = RacingSink()
    tick = await ObservationExporter(driver, ENV, "otel", loser_sink).export_once()
    assert tick.status is Tick.FAILED
    assert is_storage_conflict(tick.error, StorageConflictKind.OBSERVATION_CHECKPOINT)
    assert loser_sink.ids == winner_sink.ids  # delivered twice: at least once, deduplicable by id
    assert await get_observation_checkpoint(driver, ENV, "otel") == observation_cursor(ENV, "2")


async def test_crashing_sink_gets_the_whole_batch_again_from_the_previous_checkpoint(driver):
    await append(driver, values_for("run_1", 3))
    exporter_sink_calls = []

    class CrashingSink:
        """Accepts part of the first batch downstream, then crashes before acknowledging it."""

        def __init__(self) -> None:
            self.delivered: list[RunlaneObservationRecord] = []

        async def export(self, records):
            exporter_sink_calls.append(len(records))
            if len(exporter_sink_calls) == 1:
                self.delivered.extend(records[:2])
                raise ConnectionResetError("collector went away")
            self.delivered.extend(records)

    sink = CrashingSink()
    exporter = ObservationExporter(driver, ENV, "otel", sink, batch_size=10)
    failed = await exporter.export_once()
    assert failed.status is Tick.FAILED and isinstance(failed.error, ConnectionResetError)
    assert await get_observation_checkpoint(driver, ENV, "otel") is None
    # A restarted exporter resumes from the stored checkpoint and redelivers the whole batch.
    restarted = ObservationExporter(driver, ENV, "otel", sink, batch_size=10)
    redelivered = await restarted.export_once()
    assert (redelivered.status, redelivered.exported) == (Tick.EXPORTED, 3)
    assert exporter_sink_calls == [3, 3]
    ids = [record.id for record in sink.delivered]
    assert len(ids) == 5 and len(set(ids)) == 3
    assert list(dict.fromkeys(ids)) == [value["id"] for value in values_for("run_1", 3)]
    assert (await restarted.export_once()).status is Tick.IDLE


async def test_export_once_reports_aborted_without_moving_the_checkpoint(driver):
    await append(driver, values_for("run_1", 2))
    controller = CancellationController()
    controller.abort("stopping")
    sink = RecordingSink()
    tick = await ObservationExporter(driver, ENV, "otel", sink).export_once(signal=controller.signal)
    assert tick.status is Tick.ABORTED and sink.batches == []

    controller = CancellationController()
    started, cancelled = asyncio.Event(), []

    class Hanging:
        async def export(self, records):
            started.set()
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                cancelled.append(True)
                raise

    exporter = ObservationExporter(driver, ENV, "otel", Hanging())
    exporting = asyncio.ensure_future(exporter.export_once(signal=controller.signal))
    await started.wait()
    controller.abort("shutdown")
    tick = await exporting
    assert tick.status is Tick.ABORTED and cancelled == [True]
    assert await get_observation_checkpoint(driver, ENV, "otel") is None


async def test_run_exports_until_the_signal_aborts(driver):
    await append(driver, values_for("run_1", 3))
    controller = CancellationController()
    sink = RecordingSink()
    exporter = ObservationExporter(driver, ENV, "otel", sink, batch_size=2)
    loop = asyncio.ensure_future(exporter.run(signal=controller.signal, idle_delay="5ms"))
    for _ in range(200):
        if len(sink.ids) == 3:
            break
        await asyncio.sleep(0.005)
    await append(driver, values_for("run_2", 1))
    for _ in range(200):
        if len(sink.ids) == 4:
            break
        await asyncio.sleep(0.005)
    controller.abort("done")
    await asyncio.wait_for(loop, 5)
    assert sink.ids == [v["id"] for v in values_for("run_1", 3) + values_for("run_2", 1)]
    assert await get_observation_checkpoint(driver, ENV, "otel") == observation_cursor(ENV, "4")


async def test_run_stopped_while_the_sink_sends_a_batch_finishes_it_and_advances_the_checkpoint(driver):
    """A stop during a send (SIGTERM to runlane export): the sink keeps sending it whatever the loop does,
    so the loop waits for it and checkpoints it, instead of leaving it to be sent again."""
    await append(driver, values_for("run_1", 2))
    controller = CancellationController()
    sending = asyncio.Event()
    may_answer = asyncio.Event()

    class SlowSink(RecordingSink):
        async def export(self, records):
            sending.set()
            await may_answer.wait()
            await super().export(records)

    sink = SlowSink()
    exporter = ObservationExporter(driver, ENV, "otel", sink)
    loop = asyncio.ensure_future(exporter.run(signal=controller.signal, idle_delay="1h"))
    await asyncio.wait_for(sending.wait(), 5)
    controller.abort("runlane export is stopping")
    await asyncio.sleep(0.01)
    assert not loop.done()  # the batch in flight is not abandoned
    may_answer.set()
    await asyncio.wait_for(loop, 5)
    assert sink.ids == [v["id"] for v in values_for("run_1", 2)] and exporter.stats.exported == 2
    assert await get_observation_checkpoint(driver, ENV, "otel") == observation_cursor(ENV, "2")


async def test_run_stops_while_idle_and_returns_at_once_for_an_aborted_signal(driver):
    controller = CancellationController()
    exporter = ObservationExporter(driver, ENV, "otel", RecordingSink())
    loop = asyncio.ensure_future(exporter.run(signal=controller.signal, idle_delay="1h"))
    await asyncio.sleep(0.01)
    controller.abort()
    await asyncio.wait_for(loop, 5)
    await asyncio.wait_for(exporter.run(signal=controller.signal), 5)


async def test_run_retries_untyped_and_retryable_failures(driver, caplog):
    await append(driver, values_for("run_1", 2))
    controller = CancellationController()
    failures = [
        RunlaneError(ErrorCode.OBSERVATION_EXPORT_FAILED, "collector down", retryable=True),
        ValueError("flaky"),
        RunlaneError(ErrorCode.OBSERVATION_EXPORT_FAILED, "collector down", retryable=True),
    ]

    class Flaky(RecordingSink):
        async def export(self, records):
            if failures:
                raise failures.pop(0)
            await super().export(records)
            controller.abort("exported")

    sink = Flaky()
    with caplog.at_level("WARNING", logger="runlane"):
        await asyncio.wait_for(
            ObservationExporter(driver, ENV, "otel", sink).run(signal=controller.signal, retry_delay="1ms"), 5
        )
    assert failures == [] and len(sink.ids) == 2
    assert await get_observation_checkpoint(driver, ENV, "otel") == observation_cursor(ENV, "2")
    # One line for the outage (its reason, no traceback for a RunlaneError) and one for its end.
    messages = [record.getMessage() for record in caplog.records]
    assert {record.name for record in caplog.records} == {"runlane.export"}
    assert messages == [
        "Observation export for consumer 'otel' in 'production' failed (observation_export_failed: collector down); "
        "retrying every 0.001s.",
        "Observation export for consumer 'otel' in 'production' works again after 3 failures.",
    ]
    assert caplog.records[0].exc_info is None


async def test_run_raises_non_retryable_runlane_errors(driver):
    await append(driver, values_for("run_1", 1))
    calls = []

    class Misconfigured:
        async def export(self, records):
            calls.append(1)
            raise RunlaneError(ErrorCode.CONFIGURATION_INVALID, "no endpoint configured")

    with pytest.raises(RunlaneError) as caught:
        await asyncio.wait_for(ObservationExporter(driver, ENV, "otel", Misconfigured()).run(retry_delay="1ms"), 5)
    assert caught.value.code is ErrorCode.CONFIGURATION_INVALID and calls == [1]


def test_exporter_configuration_is_validated(driver):
    sink = RecordingSink()
    for kwargs in (
        dict(consumer="a:b"),
        dict(batch_size=0),
        dict(batch_size=True),
        dict(sink=object()),
        dict(environment=""),
        dict(clock=object()),
    ):
        arguments = dict(environment=ENV, consumer="otel", sink=sink) | kwargs
        with pytest.raises(RunlaneError) as caught:
            environment, consumer = arguments.pop("environment"), arguments.pop("consumer")
            ObservationExporter(driver, environment, consumer, arguments.pop("sink"), **arguments)
        assert caught.value.code is ErrorCode.CONFIGURATION_INVALID
    assert ObservationExporter(driver, "production", "otel", sink).environment == ENV


async def test_run_rejects_bad_delays(driver):
    exporter = ObservationExporter(driver, ENV, "otel", RecordingSink())
    for kwargs in (dict(idle_delay="soon"), dict(retry_delay=0)):
        with pytest.raises(RunlaneError) as caught:
            await exporter.run(**kwargs)
        assert caught.value.code is ErrorCode.CONFIGURATION_INVALID


# ---------------------------------------------------------------------------------------------
# Console sink


async def test_console_sink_writes_one_json_object_per_line(driver):
    run = make_run()
    step = RunStepRecord(environment=ENV, run_id=run.id, step_key="charge", token="step_1", attempt=1, completed_at=T0)
    await append(driver, [*event_observation_values(run, events_for(run, 2)), step_observation_value(step, run)])
    stream = io.StringIO()
    tick = await ObservationExporter(driver, ENV, "local_console", ConsoleObservationSink(stream)).export_once()
    assert tick.status is Tick.EXPORTED
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3
    parsed = [RunlaneObservationRecord.model_validate(json.loads(line)) for line in lines]
    records, _ = await scan_all(driver)
    assert parsed == records
    assert parsed[2].observation.type is RunlaneObservationType.RUN_STEP
    assert parsed[0].observation.event_type is RunEventType.CREATED


async def test_console_sink_on_a_stream_that_cannot_encode_a_name_writes_it_escaped(driver):
    # Written raw, a name the stream's encoding lacks (PYTHONIOENCODING=ascii, a Latin-1 locale) raised
    # UnicodeEncodeError for every batch: runlane export retried it for ever, --once failed.
    run = make_run(task_id="émail.wélcome")
    await append(driver, event_observation_values(run, events_for(run, 2)))
    raw = io.BytesIO()
    stream = io.TextIOWrapper(raw, encoding="ascii")
    tick = await ObservationExporter(driver, ENV, "local_console", ConsoleObservationSink(stream)).export_once()
    assert tick.status is Tick.EXPORTED, tick.error
    lines = raw.getvalue().decode("ascii").splitlines()
    assert len(lines) == 2 and "\\u00e9mail" in lines[0]
    records, _ = await scan_all(driver)
    assert [RunlaneObservationRecord.model_validate(json.loads(line)) for line in lines] == records
    assert records[0].observation.task_id == "émail.wélcome"


async def test_console_sink_whose_reader_went_away_stops_the_exporter_and_keeps_the_batch(driver):
    class ClosedPipe(io.StringIO):
        def write(self, text: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

    await append(driver, values_for("run_1", 2))
    exporter = ObservationExporter(driver, ENV, "piped", ConsoleObservationSink(ClosedPipe()))
    tick = await exporter.export_once()
    # Not retryable, so exporter.run() stops instead of writing into the closed pipe for ever.
    assert tick.status is Tick.FAILED and isinstance(tick.error, RunlaneError)
    assert tick.error.code is ErrorCode.OBSERVATION_EXPORT_FAILED and not tick.error.retryable
    assert "closed by its reader" in tick.error.message
    assert await get_observation_checkpoint(driver, ENV, "piped") is None


async def test_console_sink_defaults_to_stdout(driver, capsys):
    await append(driver, values_for("run_1", 1))
    page = await scan_observation_records(driver, ENV)
    await ConsoleObservationSink().export(page.records)
    (line,) = capsys.readouterr().out.splitlines()
    assert json.loads(line)["id"] == page.records[0].id
