"""Signal waits, run-completion waits and their timeouts."""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta

import pytest

from runlane import ErrorCode, RunlaneError, RunStatus, RunWaitConditionType, TaskContext, task

from runtime_support import DEFAULT_QUEUE, event_types, make_runtime


@task("reports.wait")
async def wait_for_report(payload: dict, ctx: TaskContext):
    if payload.get("ready_after", 1) > ctx.attempt:
        return ctx.wait_for_signal(f"report_ready_{payload['report']}", reason="webhook_pending")
    return {"attempt": ctx.attempt}


async def test_signal_send_resumes_waiting_runs_once():
    runtime, _ = make_runtime(wait_for_report)
    async with runtime:
        run = (await runtime.trigger(wait_for_report, {"report": "r1", "ready_after": 2})).run
        other = (await runtime.trigger(wait_for_report, {"report": "r2", "ready_after": 2})).run
        await runtime.execute_next()
        await runtime.execute_next()
        waiting = await runtime.runs.get(run.id)
        assert waiting.status is RunStatus.RELEASED
        assert waiting.wait.type is RunWaitConditionType.SIGNAL and waiting.wait.signal_key == "report_ready_r1"
        assert await runtime.execute_next() is None
        resumed = await runtime.signals.send("report_ready_r1")
        assert [r.id for r in resumed] == [run.id]
        assert resumed[0].status is RunStatus.QUEUED and resumed[0].wait is None
        assert await runtime.signals.send("report_ready_r1") == []
        done = await runtime.execute_next()
        assert done.id == run.id and done.status is RunStatus.SUCCEEDED and done.output == {"attempt": 2}
        assert (await runtime.runs.get(other.id)).status is RunStatus.RELEASED
        assert await runtime.signals.send("report_ready_unknown") == []


async def test_racing_signal_senders_converge_on_one_resume():
    runtime, _ = make_runtime(wait_for_report)
    async with runtime:
        run = (await runtime.trigger(wait_for_report, {"report": "r", "ready_after": 2})).run
        await runtime.execute_next()
        results = await asyncio.gather(*(runtime.signals.send("report_ready_r") for _ in range(5)))
        assert sum(len(result) for result in results) == 1
        assert (await event_types(runtime, run.id)).count("run.delivery_requested") == 2


async def test_a_sender_that_loses_a_race_still_resumes_up_to_its_limit():
    # 30 runs wait; two senders with a limit of 10 race: each resumes 10 other runs (the loser skips
    # the runs the winner took instead of stopping), and 10 are left for the next send.
    runtime, _ = make_runtime(wait_for_report)
    async with runtime:
        for _ in range(30):
            await runtime.trigger(wait_for_report, {"report": "race", "ready_after": 2})
        while await runtime.execute_next() is not None:
            pass
        first, second = await asyncio.gather(
            runtime.signals.send("report_ready_race", limit=10), runtime.signals.send("report_ready_race", limit=10)
        )
        assert len(first) == len(second) == 10
        assert not {run.id for run in first} & {run.id for run in second}
        assert len(await runtime.signals.send("report_ready_race")) == 10


async def test_a_sender_that_loses_a_race_on_its_last_page_still_resumes_the_runs_past_it():
    # 20 runs wait; six senders with a limit of 7 race. A sender that lost its first page to one sender
    # and its second to another read 13 rows but tried only 7: the rows past those still wait for it.
    runtime, _ = make_runtime(wait_for_report)
    async with runtime:
        for _ in range(20):
            await runtime.trigger(wait_for_report, {"report": "crowd", "ready_after": 2})
        while await runtime.execute_next() is not None:
            pass
        results = await asyncio.gather(*(runtime.signals.send("report_ready_crowd", limit=7) for _ in range(6)))
        assert sum(len(result) for result in results) == 20
        assert len({run.id for result in results for run in result}) == 20
        assert await runtime.signals.send("report_ready_crowd") == []


async def test_signal_send_limit_bounds_one_call():
    runtime, _ = make_runtime(wait_for_report)
    async with runtime:
        for _ in range(3):
            await runtime.trigger(wait_for_report, {"report": "shared", "ready_after": 2})
        for _ in range(3):
            await runtime.execute_next()
        assert len(await runtime.signals.send("report_ready_shared", limit=2)) == 2
        assert len(await runtime.signals.send("report_ready_shared")) == 1
        with pytest.raises(RunlaneError) as raised:
            await runtime.signals.send("bad:key")
        assert raised.value.code is ErrorCode.CONFIGURATION_INVALID
        with pytest.raises(RunlaneError):
            await runtime.signals.send("ok", limit=0)


async def test_a_send_whose_write_storage_gave_up_on_resumes_the_runs_on_a_later_try(monkeypatch):
    # The driver retries a transaction that lost validation (a busy bounded queue's capacity row, other
    # senders) and then gives up with a retryable storage_conflict. The runs of that write are still
    # waiting: the send tries them again instead of counting them as taken by another sender.
    from runlane.errors import StorageConflictKind, create_storage_conflict_error
    from runlane.storage import StorageIndexName

    runtime, _ = make_runtime(wait_for_report)
    async with runtime:
        waiting = [(await runtime.trigger(wait_for_report, {"report": "busy", "ready_after": 2})).run for _ in range(3)]
        while await runtime.execute_next() is not None:
            pass
        storage = runtime.lane.storage
        query, transact = storage.query, storage.with_transaction
        armed = {"resume_write": False, "lost": 0}

        async def watching(command, *args, **kwargs):
            if command.index is StorageIndexName.RUNS_WAITING_FOR_SIGNAL and not armed["lost"]:
                armed["resume_write"] = True  # the next transaction is the first resume write
            return await query(command, *args, **kwargs)

        async def losing(callback, *args, **kwargs):
            if armed["resume_write"]:
                armed["resume_write"] = False
                armed["lost"] += 1
                raise create_storage_conflict_error(StorageConflictKind.TRANSACTION, "lost validation 16 times")
            return await transact(callback, *args, **kwargs)

        monkeypatch.setattr(storage, "query", watching)
        monkeypatch.setattr(storage, "with_transaction", losing)
        resumed = await runtime.signals.send("report_ready_busy")
        assert armed["lost"] == 1
        assert sorted(run.id for run in resumed) == sorted(run.id for run in waiting)
        assert [(await runtime.runs.get(run.id)).status for run in waiting] == [RunStatus.QUEUED] * 3


async def test_a_send_storage_keeps_refusing_raises_its_conflict_for_the_caller_to_send_again(monkeypatch):
    from runlane.errors import StorageConflictKind, create_storage_conflict_error
    from runlane.storage import StorageIndexName

    runtime, _ = make_runtime(wait_for_report)
    async with runtime:
        run = (await runtime.trigger(wait_for_report, {"report": "jammed", "ready_after": 2})).run
        await runtime.execute_next()
        storage = runtime.lane.storage
        query, transact = storage.query, storage.with_transaction
        armed = {"on": False}

        async def watching(command, *args, **kwargs):
            if command.index is StorageIndexName.RUNS_WAITING_FOR_SIGNAL:
                armed["on"] = True
            return await query(command, *args, **kwargs)

        async def losing(callback, *args, **kwargs):
            if armed["on"]:
                raise create_storage_conflict_error(StorageConflictKind.TRANSACTION, "lost validation 16 times")
            return await transact(callback, *args, **kwargs)

        monkeypatch.setattr(storage, "query", watching)
        monkeypatch.setattr(storage, "with_transaction", losing)
        with pytest.raises(RunlaneError) as raised:
            await runtime.signals.send("report_ready_jammed")
        assert raised.value.code is ErrorCode.STORAGE_CONFLICT and raised.value.retryable
        monkeypatch.setattr(storage, "with_transaction", transact)
        assert [r.id for r in await runtime.signals.send("report_ready_jammed")] == [run.id]


async def test_a_long_signal_key_resumes_runs_an_earlier_release_indexed_by_the_key_itself():
    """A signal key past 256 bytes is indexed by its digest; a run released before that (its wait indexed
    by the key itself, then the run id) still resumes when the key is sent."""
    from runlane.core.store import _run_key, signal_wait_partition
    from runlane.storage import NewStorageRecord, StorageIndexEntry, StorageIndexName

    report = "r" * 300  # a key of 313 bytes
    runtime, _ = make_runtime(wait_for_report)
    async with runtime:
        old, new = [(await runtime.trigger(wait_for_report, {"report": report, "ready_after": 2})).run for _ in "ab"]
        for _ in "ab":
            assert (await runtime.execute_next()).status is RunStatus.RELEASED
        key = f"report_ready_{report}"
        assert signal_wait_partition(key) != key

        async def reindex_as_before(tx):
            (record,) = await tx.get([_run_key(runtime.store.env_key, old.id)])
            (wait,) = [entry for entry in record.indexes if entry.name is StorageIndexName.RUNS_WAITING_FOR_SIGNAL]
            legacy = StorageIndexEntry(wait.name, (wait.partition[0], key), (*wait.sort, old.id))
            indexes = [entry for entry in record.indexes if entry is not wait]
            tx.replace(record, NewStorageRecord(record.key, record.document, [*indexes, legacy]))

        await runtime.lane.storage.with_transaction(reindex_as_before)
        assert sorted(run.id for run in await runtime.signals.send(key)) == sorted([old.id, new.id])
        assert await runtime.signals.send(key) == []


async def test_signal_wait_timeout_falls_back_to_maintenance_delivery():
    @task("wait.timeout")
    async def waiter(payload: dict, ctx: TaskContext):
        if ctx.attempt == 1:
            return ctx.wait_for_signal("never", timeout="1h")
        return "woke"

    runtime, clock = make_runtime(waiter)
    async with runtime:
        run = (await runtime.trigger(waiter, {})).run
        released = await runtime.execute_next()
        assert released.wait.timeout_at == clock.now() + timedelta(hours=1)
        assert (await runtime.tick()).delivery_requested == 0
        clock.advance("1h")
        assert (await runtime.tick()).delivery_requested == 1
        done = await runtime.execute_next()
        assert done.output == "woke" and done.counters.failures == 0
        # The signal arriving later finds nothing to resume.
        assert await runtime.signals.send("never") == []
        assert done.id == run.id


async def test_wait_for_run_resumes_when_the_source_run_finishes():
    @task("child.work")
    async def child(payload: dict, ctx: TaskContext):
        if payload.get("release") and ctx.attempt == 1:
            return ctx.release("1m")
        return "child-done"

    @task("parent.wait")
    async def parent(payload: dict, ctx: TaskContext):
        if ctx.attempt == 1:
            started = await ctx.trigger(child, {"release": True})
            return ctx.wait_for_run(started.run.id, reason="waiting_for_child")
        return "parent-done"

    runtime, clock = make_runtime(parent, child)
    async with runtime:
        run = (await runtime.trigger(parent, {})).run
        waiting = await runtime.execute_next()
        assert waiting.status is RunStatus.RELEASED
        assert waiting.wait.type is RunWaitConditionType.RUN_COMPLETION
        child_id = waiting.wait.run_id
        # The child releases once: the parent keeps waiting.
        assert (await runtime.execute_next()).id == child_id
        assert (await runtime.runs.get(run.id)).status is RunStatus.RELEASED
        clock.advance("1m")
        finished = await runtime.execute_next()
        assert finished.id == child_id and finished.status is RunStatus.SUCCEEDED
        # Terminal source: the waiter was resumed automatically.
        assert (await runtime.runs.get(run.id)).status is RunStatus.QUEUED
        done = await runtime.execute_next()
        assert done.id == run.id and done.output == "parent-done"


@task("quick")
async def quick() -> str:
    return "ok"


@task("late.waiter")
async def late_waiter(payload: dict, ctx: TaskContext):
    if ctx.attempt == 1:
        return ctx.wait_for_run(payload["source"])
    return "resumed"


async def test_a_storage_blip_after_the_source_finishes_does_not_strand_its_waiters(caplog, monkeypatch):
    import runlane.core.runtime as runtime_module
    from runlane.storage import StorageIndexName

    runtime, clock = make_runtime(quick, late_waiter)
    async with runtime:
        storage = runtime.lane.storage
        query = storage.query
        failures = {"left": 2}

        async def blipping(command, *args, **kwargs):
            if command.index is StorageIndexName.RUNS_WAITING_FOR_COMPLETION and failures["left"]:
                failures["left"] -= 1
                raise RunlaneError(ErrorCode.STORAGE_UNAVAILABLE, "database restarting", retryable=True)
            return await query(command, *args, **kwargs)

        monkeypatch.setattr(storage, "query", blipping)
        first = (await runtime.trigger(quick)).run
        assert (await runtime.run_now(late_waiter, {"source": first.id})).status is RunStatus.RELEASED
        finished = await runtime.execute_next()  # the source; resuming its waiter fails twice, then works
        assert finished.id == first.id and finished.status is RunStatus.SUCCEEDED
        assert failures["left"] == 0
        assert (await runtime.execute_next()).output == "resumed"

        # An outage that outlasts the retries is logged, not reported as the source's failure.
        monkeypatch.setattr(runtime_module, "_WAITER_RESUME_RETRY_S", 0.2)
        failures["left"] = 1000
        second = (await runtime.trigger(quick)).run
        stranded = await runtime.run_now(late_waiter, {"source": second.id})
        with caplog.at_level("ERROR", logger="runlane.runtime"):
            assert (await runtime.execute_next()).status is RunStatus.SUCCEEDED
        assert f"Run {second.id} finished, but the runs waiting for it (wait_for_run) could not be resumed" in (
            caplog.text
        )
        assert "tick() resumes them from 1m after it finished" in caplog.text
        assert (await runtime.runs.get(stranded.id)).status is RunStatus.RELEASED

        # The outage ends: tick() takes over once the source has been finished a minute, and only then.
        failures["left"] = 0
        assert (await runtime.tick()).delivery_requested == 0
        assert (await runtime.runs.get(stranded.id)).status is RunStatus.RELEASED
        clock.advance("1m")
        assert (await runtime.tick()).delivery_requested == 1
        assert (await runtime.execute_next()).output == "resumed"
        assert await event_types(runtime, stranded.id) == [
            "run.created", "run.lease_claimed", "run.started", "run.released", "run.delivery_requested",
            "run.lease_claimed", "run.started", "run.succeeded",
        ]  # fmt: skip
        # Done with: later passes find nothing more to do for that source.
        clock.advance("1h")
        assert (await runtime.tick()).delivery_requested == 0


async def test_tick_has_nothing_to_take_over_once_the_finishing_process_resumed_the_waiters():
    runtime, clock = make_runtime(quick, late_waiter)
    async with runtime:
        source = (await runtime.trigger(quick)).run
        waiter = await runtime.run_now(late_waiter, {"source": source.id})
        assert waiter.status is RunStatus.RELEASED
        await runtime.execute_next()
        assert (await runtime.runs.get(waiter.id)).status is RunStatus.QUEUED
        clock.advance("1h")
        assert (await runtime.tick()).delivery_requested == 0
        assert (await runtime.execute_next()).output == "resumed"
        assert (await event_types(runtime, waiter.id)).count("run.delivery_requested") == 1


async def test_waiters_past_a_page_that_stopped_waiting_meanwhile_are_still_resumed(monkeypatch):
    # 150 runs wait for one source; the first page of them (100) is cancelled between the scan that
    # read it and the resume: those appends do nothing, and the 50 on the next page must still resume.
    from runlane.storage import StorageIndexName

    runtime, _ = make_runtime(quick, late_waiter)
    async with runtime:
        waiters = [(await runtime.trigger(late_waiter, {"source": "the-source"})).run for _ in range(150)]
        while await runtime.execute_next() is not None:
            pass
        storage = runtime.lane.storage
        query = storage.query
        cancelled: list[str] = []

        async def cancelling_first_page(command, *args, **kwargs):
            page = await query(command, *args, **kwargs)
            if command.index is StorageIndexName.RUNS_WAITING_FOR_COMPLETION and not cancelled:
                for ref in page.items:
                    cancelled.append((await runtime.runs.cancel(ref.key.parts[-1])).id)
            return page

        monkeypatch.setattr(storage, "query", cancelling_first_page)
        await runtime.trigger(quick, run_id="the-source")
        assert (await runtime.execute_next()).id == "the-source"
        assert len(cancelled) == 100
        statuses = {run.id: (await runtime.runs.get(run.id)).status for run in waiters}
        assert sorted(statuses.values()) == sorted([RunStatus.CANCELLED] * 100 + [RunStatus.QUEUED] * 50)


async def test_a_storage_blip_on_the_resume_write_itself_is_retried_too(monkeypatch):
    from runlane.storage import StorageIndexName

    runtime, _ = make_runtime(quick, late_waiter)
    async with runtime:
        storage = runtime.lane.storage
        query, transact = storage.query, storage.with_transaction
        armed = {"resume_write": False, "failed": 0}

        async def watching(command, *args, **kwargs):
            if command.index is StorageIndexName.RUNS_WAITING_FOR_COMPLETION and not armed["failed"]:
                armed["resume_write"] = True  # the next transaction is the waiter's resume
            return await query(command, *args, **kwargs)

        async def blipping(callback, *args, **kwargs):
            if armed["resume_write"]:
                armed["resume_write"] = False
                armed["failed"] += 1
                raise RunlaneError(ErrorCode.STORAGE_UNAVAILABLE, "connection reset", retryable=True)
            return await transact(callback, *args, **kwargs)

        monkeypatch.setattr(storage, "query", watching)
        monkeypatch.setattr(storage, "with_transaction", blipping)
        source = (await runtime.trigger(quick)).run
        waiter = await runtime.run_now(late_waiter, {"source": source.id})
        assert waiter.status is RunStatus.RELEASED
        assert (await runtime.execute_next()).id == source.id
        assert armed["failed"] == 1
        assert (await runtime.runs.get(waiter.id)).status is RunStatus.QUEUED
        assert (await runtime.execute_next()).output == "resumed"


async def test_waiting_for_a_run_still_to_come_resumes_once_it_is_created_and_finishes(caplog):
    # A wait may name a run that does not exist yet (a known id a producer triggers later): the waiter
    # stays released until that run finishes, then resumes.
    runtime, _ = make_runtime(quick, late_waiter)
    caplog.set_level(logging.WARNING, logger="runlane.task")
    async with runtime:
        waiter = await runtime.run_now(late_waiter, {"source": "run_export_42"})
        assert waiter.status is RunStatus.RELEASED and waiter.wait.run_id == "run_export_42"
        assert await runtime.execute_next() is None  # nothing resumes it meanwhile
        warned = [record for record in caplog.records if "waits for run run_export_42" in record.getMessage()]
        assert len(warned) == 1 and "give ctx.wait_for_run() a timeout" in warned[0].getMessage()
        assert warned[0].waits_for == "run_export_42"

        await runtime.trigger(quick, run_id="run_export_42")
        assert (await runtime.execute_next()).id == "run_export_42"
        assert (await runtime.runs.get(waiter.id)).status is RunStatus.QUEUED
        done = await runtime.execute_next()
        assert done.id == waiter.id and done.output == "resumed"


async def test_a_wait_for_a_missing_run_that_is_not_recorded_is_not_reported_as_waiting(caplog):
    """The warning that a run waits for a run that does not exist is for a wait that was recorded: not for a
    handler that returned such a wait after its cancellation was requested (the run is cancelled) or with
    meta too large to store (the attempt failed)."""
    started = asyncio.Event()

    @task("waits.for.missing")
    async def handler(payload: dict, ctx: TaskContext):
        if payload.get("cancelled"):
            started.set()
            await ctx.signal.wait()
        return ctx.wait_for_run("run_never", meta={"note": "n" * payload.get("size", 1)})

    runtime, _ = make_runtime(handler)
    caplog.set_level(logging.WARNING, logger="runlane.task")
    async with runtime:
        run = (await runtime.trigger(handler, {"cancelled": True})).run
        execution = asyncio.ensure_future(runtime.execute_next())
        await asyncio.wait_for(started.wait(), 10)
        await runtime.runs.cancel(run.id)
        assert (await execution).status is RunStatus.CANCELLED
        too_large = await runtime.run_now(handler, {"size": 500_000})
        assert too_large.status is RunStatus.FAILED and too_large.failure.code is ErrorCode.TASK_OUTPUT_INVALID
        assert not [record for record in caplog.records if "waits for run" in record.getMessage()]
        assert (await runtime.run_now(handler, {})).status is RunStatus.RELEASED
        assert len([record for record in caplog.records if "waits for run run_never" in record.getMessage()]) == 1


async def test_a_wait_for_a_run_that_never_comes_ends_at_its_timeout(caplog):
    @task("waits.with.timeout")
    async def patient(payload: dict, ctx: TaskContext):
        if ctx.attempt == 1:
            return ctx.wait_for_run(payload["source"], timeout="10m")
        return "gave up waiting"

    runtime, clock = make_runtime(quick, patient)
    caplog.set_level(logging.WARNING, logger="runlane.task")
    async with runtime:
        pruned = await runtime.run_now(quick)
        clock.advance("2d")
        assert (await runtime.runs.prune(older_than="1d")).pruned == 1
        for source in ("run_mistyped", pruned.id):
            waiter = await runtime.run_now(patient, {"source": source})
            assert waiter.status is RunStatus.RELEASED
            clock.advance("10m")
            assert (await runtime.tick()).delivery_requested == 1
            assert (await runtime.execute_next()).output == "gave up waiting"
        assert not [record for record in caplog.records if "waits for run" in record.getMessage()]  # it has a timeout


async def test_wait_for_an_already_terminal_run_resumes_in_the_same_commit():
    runtime, _ = make_runtime(quick, late_waiter)
    async with runtime:
        source = await runtime.run_now(quick)
        run = await runtime.run_now(late_waiter, {"source": source.id})
        assert run.status is RunStatus.QUEUED
        types = await event_types(runtime, run.id)
        assert types[-2:] == ["run.released", "run.delivery_requested"]
        assert (await runtime.execute_next()).output == "resumed"


async def test_wait_for_run_timeout_and_cancelled_sources():
    @task("stuck")
    async def stuck(payload: dict, ctx: TaskContext):
        return ctx.release("1d")

    @task("waits.for.stuck")
    async def waiter(payload: dict, ctx: TaskContext):
        if ctx.attempt == 1:
            return ctx.wait_for_run(payload["source"], timeout="10m")
        return ctx.attempt

    runtime, clock = make_runtime(stuck, waiter)
    async with runtime:
        source = await runtime.run_now(stuck, {})
        timed = await runtime.run_now(waiter, {"source": source.id})
        assert timed.status is RunStatus.RELEASED and timed.run_at == clock.now() + timedelta(minutes=10)
        clock.advance("10m")
        assert (await runtime.tick()).delivery_requested == 1
        assert (await runtime.execute_next()).output == 2
        # A cancelled source is terminal too: its waiters resume.
        other = await runtime.run_now(waiter, {"source": source.id})
        assert other.status is RunStatus.RELEASED
        await runtime.runs.cancel(source.id)
        assert (await runtime.runs.get(other.id)).status is RunStatus.QUEUED


_DIES_AFTER_THE_SOURCE = """
import asyncio, os, sys

from runlane import RunStatus, TaskContext, create_runlane, queue, task
from runlane_local import sqlite_lane

DEFAULT = queue("default", default=True)


@task("quick")
async def quick() -> str:
    return "ok"


@task("late.waiter")
async def late_waiter(payload: dict, ctx: TaskContext):
    return ctx.wait_for_run(payload["source"])


def die_once_the_source_is_finished(observation) -> None:
    if observation.run_id == sys.argv[2] and observation.status is RunStatus.SUCCEEDED:
        os._exit(17)  # the source's outcome is committed; resuming its waiter was to come next


async def main() -> None:
    runtime = create_runlane(
        lane=sqlite_lane(sys.argv[1]),
        queues=[DEFAULT],
        tasks=[quick, late_waiter],
        observers=[die_once_the_source_is_finished],
    )
    async with runtime:
        await runtime.execute_next()


asyncio.run(main())
"""


async def test_a_process_that_dies_between_finishing_a_source_and_resuming_its_waiters_strands_none(tmp_path):
    import subprocess
    import sys
    from datetime import UTC, datetime

    from runlane import create_runlane
    from runlane.testing import ControlledClock
    from runlane_local import sqlite_lane

    database = tmp_path / "runlane.db"
    clock = ControlledClock(datetime.now(UTC))
    runtime = create_runlane(
        lane=sqlite_lane(database), queues=[DEFAULT_QUEUE], tasks=[quick, late_waiter], clock=clock
    )
    async with runtime:
        source = (await runtime.trigger(quick)).run
        waiter = await runtime.run_now(late_waiter, {"source": source.id})
        assert waiter.status is RunStatus.RELEASED and waiter.wait.run_id == source.id
        script = tmp_path / "dies_after_the_source.py"
        script.write_text(_DIES_AFTER_THE_SOURCE)
        finished = subprocess.run(
            [sys.executable, str(script), str(database), source.id], capture_output=True, text=True, timeout=60
        )
        assert finished.returncode == 17, finished.stderr
        assert (await runtime.runs.get(source.id)).status is RunStatus.SUCCEEDED
        assert (await runtime.runs.get(waiter.id)).status is RunStatus.RELEASED  # nobody resumed it

        clock.set(datetime.now(UTC) + timedelta(minutes=1, seconds=1))
        assert (await runtime.tick()).delivery_requested == 1
        assert (await runtime.runs.get(waiter.id)).status is RunStatus.QUEUED
        assert (await runtime.execute_next()).output == "resumed"
