"""The durable observation stream written by the runtime: every persisted run event and first-time step
completion is appended in its own commit, in commit order, with stable ids; live observers see exactly
the stored observations; the exporter moves everything at least once; transaction limits still hold.

Every scenario runs over native ordered append and over the point-write fallback (a driver whose
profile reports no ordered append).
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
from collections import Counter
from datetime import UTC, datetime
from typing import Any

import pytest

from runlane import (
    ConsoleObservationSink,
    DeliveryMessage,
    LaneDelivery,
    LaneDeliveryMode,
    ObservationExporter,
    Retry,
    RunlaneObservation,
    RunlaneObservationRecord,
    RunlaneObservationSourceKind,
    RunStatus,
    TaskContext,
    WorkerMode,
    create_lane,
    create_runlane,
    queue,
    schedule,
    task,
)
from runlane.core.attempt import step_token
from runlane.core.cancellation import CancellationController
from runlane.core.observations import observation_record_id
from runlane.core.store import ClaimRequest
from runlane.storage import StorageLimits
from runlane.testing import ControlledClock
from runlane.vocabulary import RunlaneObservationExporterTickStatus
from runlane_local import local_storage_driver

from runtime_support import DEFAULT_QUEUE

T0 = datetime(2026, 1, 1, tzinfo=UTC)
PARKED = queue("parked")
MODES = ("native_append", "point_writes")


class ProbeDriver:
    """The local driver counting transactions; with ``ordered_append=False`` core takes the point-write
    fallback (same store layout, the head read in each write path's first read)."""

    def __init__(self, inner: Any, *, ordered_append: bool) -> None:
        self._inner = inner
        self.name = inner.name
        self.profile = dataclasses.replace(inner.profile, ordered_append=ordered_append)
        self.transactions = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def with_transaction(self, callback: Any) -> Any:
        self.transactions += 1
        return await self._inner.with_transaction(callback)


def make(mode: str, *tasks: Any, limits: StorageLimits | None = None, **options: Any):
    clock = ControlledClock(T0)
    driver = ProbeDriver(local_storage_driver(limits=limits), ordered_append=mode == "native_append")
    lane = create_lane(storage=driver, delivery=LaneDelivery(mode=LaneDeliveryMode.STORAGE_POLLING))
    live: list[RunlaneObservation] = []
    runtime = create_runlane(
        lane=lane,
        queues=[DEFAULT_QUEUE, PARKED],
        tasks=list(tasks),
        clock=clock,
        observers=[live.append],
        **options,
    )
    return runtime, clock, driver, live


async def stream(runtime: Any, page: int = 50) -> list[RunlaneObservationRecord]:
    records: list[RunlaneObservationRecord] = []
    cursor = None
    while True:
        result = await runtime.observations.scan(cursor=cursor, limit=page)
        if not result.records:
            return records
        records.extend(result.records)
        cursor = result.cursor


async def histories(runtime: Any) -> dict[str, list[Any]]:
    """Every run's events in sequence order."""
    runs = (await runtime.runs.list(limit=100)).data
    return {run.id: (await runtime.runs.events(run.id, sort_by="sequence", limit=100)).data for run in runs}


def check_stream_matches(records: list[RunlaneObservationRecord], history: dict[str, list[Any]], env: Any) -> None:
    """Positions are contiguous; every event is in the stream once, each run's in sequence order."""
    assert [int(record.stream_position) for record in records] == list(range(1, len(records) + 1))
    by_run: dict[str, list[str]] = {}
    for record in records:
        assert record.id == observation_record_id(env, record.source_kind, record.source_id)
        assert record.environment == env and record.observation.environment == env
        if record.source_kind is RunlaneObservationSourceKind.RUN_EVENT:
            assert record.observation.event_id == record.source_id
            assert record.recorded_at == record.observation.occurred_at
            by_run.setdefault(record.observation.run_id, []).append(record.source_id)
    assert by_run == {run_id: [event.id for event in events] for run_id, events in history.items()}
    for run_id, events in history.items():
        observed = [r.observation for r in records if r.source_kind is RunlaneObservationSourceKind.RUN_EVENT and r.observation.run_id == run_id]
        assert [(o.event_sequence, o.event_type) for o in observed] == [(e.sequence, e.event.type) for e in events]


# ---------------------------------------------------------------------------------------------
# Every write path


@pytest.mark.parametrize("mode", MODES)
async def test_every_persisted_event_and_first_step_completion_is_in_the_stream_in_commit_order(mode):
    @task("child")
    async def child(payload: dict) -> None:
        return None

    @task("workflow", retry=Retry(3, backoff="1m"))
    async def workflow(payload: dict, ctx: TaskContext) -> Any:
        await ctx.step.run("a", lambda token: {"a": 1})
        if ctx.attempt == 1:
            raise ValueError("transient")
        if ctx.attempt == 2:
            await ctx.step.run("b", lambda token: {"b": 2})
            return ctx.wait_for_signal("go")
        await ctx.trigger(child, {"from": ctx.run_id})
        return {"done": True}

    @task("slow")
    async def slow(payload: dict) -> None:
        await asyncio.sleep(0.08)  # long enough for a few heartbeats

    @task("parked.work", queue=PARKED)
    async def parked_work(payload: dict) -> None:
        return None

    @task("scheduled", schedule=schedule("scheduled.hourly", every="1h", payload={}))
    async def scheduled(payload: dict) -> None:
        return None

    runtime, clock, _, live = make(mode, child, workflow, slow, parked_work, scheduled)
    async with runtime:
        flow = (await runtime.trigger(workflow, {}, trace_carrier={"traceparent": "00-abc-def-01"})).run
        await runtime.execute_next()  # attempt 1: step a, then a retryable failure
        clock.advance("2m")
        await runtime.execute_next()  # attempt 2: step a replays, step b, then a signal wait
        assert (await runtime.runs.get(flow.id)).status is RunStatus.RELEASED
        assert [run.id for run in await runtime.signals.send("go")] == [flow.id]
        await runtime.execute_next()  # attempt 3: a child trigger, success
        await runtime.execute_next()  # the child

        await runtime.run_now(child, {"inline": True})
        heartbeating = (await runtime.trigger(slow, {})).run
        await runtime.execute_next(lease_duration="1s", heartbeat_interval="20ms")
        cancelled = (await runtime.trigger(parked_work, {})).run
        await runtime.runs.cancel(cancelled.id, reason="not needed")
        rerun = await runtime.runs.rerun(heartbeating.id)

        delivered = (await runtime.trigger(child, {"delivery": True})).run
        message = DeliveryMessage(
            environment=runtime.environment, run_id=delivered.id, queue="default", requested_at=clock.now()
        )
        assert (await runtime.execute_delivery(message)).run.status is RunStatus.SUCCEEDED

        abandoned = (await runtime.trigger(parked_work, {"abandoned": True})).run
        (claim,) = await runtime.store.claim([ClaimRequest(abandoned.id, None, "gone", "tok", 1000, also_start=True)])
        assert claim.claimed  # a direct store write: its observations reach the stream, not live observers
        clock.advance("1m")
        result = await runtime.tick()  # a scheduled run; the expired lease gets a delivery request
        assert (result.materialized, result.delivery_requested) == (1, 1)
        await runtime.worker(mode=WorkerMode.DRAIN).closed

        records = await stream(runtime)
        history = await histories(runtime)
        check_stream_matches(records, history, runtime.environment)
        types = Counter(event.event.type.value for events in history.values() for event in events)
        assert types["run.lease_heartbeat"] >= 1 and types["run.cancelled"] == 1 and types["run.released"] == 1
        assert types["run.retry_scheduled"] == 1 and len(history) == 9
        assert (await runtime.runs.get(rerun.id)).status is RunStatus.SUCCEEDED

        # Steps: one record per first-time completion, none for the replay of "a".
        steps = [r for r in records if r.source_kind is RunlaneObservationSourceKind.RUN_STEP]
        assert [(r.observation.step_key, r.observation.attempt) for r in steps] == [("a", 1), ("b", 2)]
        assert [r.source_id for r in steps] == [step_token(runtime.environment, flow.id, key) for key in ("a", "b")]
        assert all(r.observation.run_id == flow.id and r.observation.task_id == "workflow" for r in steps)

        # Trace context travels; customer data never does.
        first = next(r for r in records if r.observation.run_id == flow.id)
        assert first.observation.trace_carrier == {"traceparent": "00-abc-def-01"}
        text = json.dumps([record.to_json() for record in records])
        assert "transient" not in text and '"done"' not in text and '"from"' not in text

        # Live observers saw exactly the stored observations, in commit order (the direct store claim
        # above is the only write that did not go through the runtime).
        stored = [record.observation for record in records]
        direct = [o for o in stored if o.run_id == abandoned.id and o.event_sequence in (3, 4)]  # claimed, started
        assert len(direct) == 2
        assert live == [o for o in stored if not any(o is d for d in direct)]


@pytest.mark.parametrize("mode", MODES)
async def test_a_replayed_step_completion_adds_no_record(mode):
    outcomes: list[bool] = []

    @task("replayed", retry=Retry(2, backoff="1s"))
    async def replayed(payload: dict, ctx: TaskContext) -> Any:
        value = await ctx.step.run("charge", lambda token: {"charge": "ch_1"})
        if ctx.attempt == 1:
            current = await runtime.store.get_run(ctx.run_id)
            token = step_token(ctx.environment, ctx.run_id, "charge")
            _, created = await runtime.store.complete_step(
                ctx.run_id, "charge", token, current.lease.token, ctx.attempt, {"charge": "ch_1"}
            )
            outcomes.append(created)
            raise ValueError("retry me")
        return value

    runtime, clock, _, live = make(mode, replayed)
    async with runtime:
        run = (await runtime.trigger(replayed, {})).run
        await runtime.execute_next()
        clock.advance("1s")
        assert (await runtime.execute_next()).output == {"charge": "ch_1"}
        records = await stream(runtime)
        steps = [r for r in records if r.source_kind is RunlaneObservationSourceKind.RUN_STEP]
        assert outcomes == [False]
        assert len(steps) == 1 and steps[0].observation.step_key == "charge"
        check_stream_matches(records, await histories(runtime), runtime.environment)
        assert [o.step_key for o in live if o.step_key is not None] == ["charge"]
        assert (await runtime.runs.get(run.id)).status is RunStatus.SUCCEEDED


@pytest.mark.parametrize("mode", MODES)
async def test_record_ids_are_stable_and_scans_page_forward(mode):
    @task("quick")
    async def quick(payload: dict) -> None:
        return None

    runtime, _, _, _ = make(mode, quick)
    async with runtime:
        for index in range(4):
            await runtime.run_now(quick, {"n": index})
        everything = await stream(runtime, page=100)
        assert len(everything) == 4 * 4  # run_now: created, lease_claimed and started; then succeeded
        paged = await stream(runtime, page=3)
        assert paged == everything
        assert len({record.id for record in everything}) == len(everything)
        again = await stream(runtime)
        assert [record.id for record in again] == [record.id for record in everything]
        assert await runtime.observations.checkpoint("nobody") is None


# ---------------------------------------------------------------------------------------------
# Export


class FlakySink:
    """Receives every batch; every third delivery fails after the records arrived (a lost ack)."""

    def __init__(self) -> None:
        self.received: list[str] = []
        self.deliveries = 0

    async def export(self, records: Any) -> None:
        self.deliveries += 1
        self.received.extend(record.id for record in records)
        if self.deliveries % 3 == 0:
            raise ConnectionError("collector timed out")


@pytest.mark.parametrize("mode", MODES)
async def test_an_exporter_beside_a_running_worker_exports_everything_at_least_once(mode):
    @task("exported")
    async def exported(payload: dict, ctx: TaskContext) -> None:
        await ctx.step.run("s", lambda token: payload["n"])
        await asyncio.sleep(0)
        if payload["n"] % 5 == 0:
            raise ValueError("broken")

    runtime, _, _, _ = make(mode, exported)
    sink = FlakySink()
    async with runtime:
        exporter = runtime.observation_exporter("otel", sink, batch_size=7)
        assert isinstance(exporter, ObservationExporter)
        stop = CancellationController()
        exporting = asyncio.create_task(exporter.run(signal=stop.signal, idle_delay="2ms", retry_delay="2ms"))
        worker = runtime.worker(concurrency=4, empty_poll_delay="2ms")
        for index in range(30):
            await runtime.trigger(exported, {"n": index})
            if index % 4 == 0:
                await asyncio.sleep(0.001)

        async def settled() -> bool:
            runs = (await runtime.runs.list(limit=100)).data
            if len(runs) < 30 or any(run.status not in (RunStatus.SUCCEEDED, RunStatus.FAILED) for run in runs):
                return False
            last = (await stream(runtime))[-1]
            return await runtime.observations.checkpoint("otel") == _cursor_after(runtime, last)

        for _ in range(2000):
            if await settled():
                break
            await asyncio.sleep(0.005)
        await worker.stop()
        stop.abort("done")
        await exporting

        statuses = Counter(run.status for run in (await runtime.runs.list(limit=100)).data)
        assert statuses == Counter({RunStatus.SUCCEEDED: 24, RunStatus.FAILED: 6})
        records = await stream(runtime)
        assert await runtime.observations.checkpoint("otel") == _cursor_after(runtime, records[-1])
        assert set(sink.received) == {record.id for record in records}
        assert len(sink.received) > len(records)  # failed deliveries were sent again
        assert exporter.stats.failures >= 1 and exporter.stats.exported == len(records)
        check_stream_matches(records, await histories(runtime), runtime.environment)


def _cursor_after(runtime: Any, record: RunlaneObservationRecord) -> str:
    from runlane.core.observations import observation_cursor

    return observation_cursor(runtime.environment, record.stream_position)


async def test_the_console_sink_writes_one_json_line_per_exported_record():
    @task("console")
    async def console(payload: dict) -> None:
        return None

    runtime, _, _, _ = make("native_append", console)
    out = io.StringIO()
    async with runtime:
        await runtime.run_now(console, {"secret": "hunter2"})
        exporter = runtime.observation_exporter("console", ConsoleObservationSink(out), batch_size=100)
        tick = await exporter.export_once()
        assert tick.status is RunlaneObservationExporterTickStatus.EXPORTED and tick.exported == 4
        assert (await exporter.export_once()).status is RunlaneObservationExporterTickStatus.IDLE
        lines = [json.loads(line) for line in out.getvalue().splitlines()]
        assert [line["id"] for line in lines] == [record.id for record in await stream(runtime)]
        assert "hunter2" not in out.getvalue()
    # A closed runtime's exporter fails with a non-retryable error instead of reading closed storage.
    failed = await exporter.export_once()
    assert failed.status is RunlaneObservationExporterTickStatus.FAILED and not failed.error.retryable


# ---------------------------------------------------------------------------------------------
# Transaction limits


TIGHT = StorageLimits(
    max_point_reads=100,
    max_query_results=100,
    max_record_bytes=64 * 1024,
    max_transaction_records=10,
    max_transaction_bytes=10 * 64 * 1024,
)


@pytest.mark.parametrize("mode", MODES)
async def test_observation_records_count_against_transaction_limits_and_batches_split(mode):
    bounded = queue("bounded", concurrency_limit=20)

    @task("limited", queue=bounded, singleton_key=lambda payload: f"lock_{payload['n']}")
    async def limited(payload: dict, ctx: TaskContext) -> None:
        await ctx.step.run("only", lambda token: True)

    clock = ControlledClock(T0)
    driver = ProbeDriver(local_storage_driver(limits=TIGHT), ordered_append=mode == "native_append")
    lane = create_lane(storage=driver, delivery=LaneDelivery(mode=LaneDeliveryMode.STORAGE_POLLING))
    runtime = create_runlane(lane=lane, queues=[DEFAULT_QUEUE, bounded], tasks=[limited], clock=clock)
    async with runtime:
        runs = [(await runtime.trigger(limited, {"n": index})).run for index in range(12)]
        # One claim call for all twelve: each claim writes its run, two events and two observation
        # records, so the store splits the call into transactions that fit ten records.
        before = driver.transactions
        claims = await runtime.store.claim(
            [ClaimRequest(run.id, None, "w", f"tok_{run.id}", 60_000, also_start=True) for run in runs[:6]]
        )
        assert all(claim.claimed for claim in claims)
        assert driver.transactions - before >= 3
        clock.advance("2m")  # those leases expire; the drain worker claims everything again
        await runtime.tick()
        await runtime.worker(mode=WorkerMode.DRAIN, concurrency=8).closed
        assert {run.status for run in (await runtime.runs.list(limit=100)).data} == {RunStatus.SUCCEEDED}
        records = await stream(runtime)
        check_stream_matches(records, await histories(runtime), runtime.environment)
        assert sum(1 for r in records if r.source_kind is RunlaneObservationSourceKind.RUN_STEP) == 12


class RecordingSink:
    def __init__(self, delivered: list[str]) -> None:
        self.delivered = delivered

    async def export(self, records: Any) -> None:
        self.delivered.extend(record.id for record in records)


async def test_two_exporters_of_one_consumer_deliver_a_batch_twice_and_the_loser_says_why():
    @task("noop")
    async def noop(payload: dict) -> None:
        return None

    runtime, _, _, _ = make("native_append", noop)
    delivered: list[str] = []
    async with runtime:
        await runtime.trigger(noop, {})
        winner = runtime.observation_exporter("otel", RecordingSink(delivered))

        class Racing(RecordingSink):
            async def export(self, records: Any) -> None:
                await super().export(records)
                assert (await winner.export_once()).status is RunlaneObservationExporterTickStatus.EXPORTED

        tick = await runtime.observation_exporter("otel", Racing(delivered)).export_once()
        records = await stream(runtime)
    assert tick.status is RunlaneObservationExporterTickStatus.FAILED and tick.error.retryable
    assert sorted(delivered) == sorted([record.id for record in records] * 2)  # at least once: both sent it
    # The operator is told what to do, not to "read it again and retry".
    assert "Another exporter" in tick.error.message and "one exporter per consumer" in tick.error.message
