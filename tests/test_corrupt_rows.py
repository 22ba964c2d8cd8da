"""One corrupt stored row must not stop the lane: workers set aside a run they cannot read (or a runnable
index row that keeps naming a run that is gone) and go on with the others, and a tick runs all its
phases when one of them meets a corrupt record.

The records are corrupted in the SQLite file directly, as a bad migration or a manual edit would."""

from __future__ import annotations

import asyncio
import logging
import signal
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from runlane import ErrorCode, Retry, RunlaneError, WorkerMode, create_runlane, queue, schedule, task
from runlane.cli.tick import tick_until_stopped
from runlane.core.store import idempotency_owner_key, singleton_owner_key
from runlane.storage import StorageRecordKey
from runlane.storage.codecs import encode_storage_tuple
from runlane.storage.tables import run_key
from runlane.testing import ControlledClock
from runlane_local import sqlite_lane

from cli_support import cli, make_project, run_json_until
from sql_driver_support import edit_sqlite_document

DEFAULT = queue("default", default=True)
GATEWAY = queue("gateway", concurrency_limit=1)


@task("plain.work")
async def plain(payload: dict) -> None:
    return None


@task("gateway.call", queue=GATEWAY)
async def gateway_call(payload: dict) -> None:
    return None


@task("sched.every", schedule=schedule("sched.every", every="1m", payload={}))
async def every(payload: dict) -> None:
    return None


def runtime(path: Path) -> Any:
    return create_runlane(lane=sqlite_lane(path), queues=[DEFAULT, GATEWAY], tasks=[plain, gateway_call, every])


def add_runnable_row(path: Path, run_id: str, key: StorageRecordKey) -> None:
    """A row of the runnable index, due long ago, naming ``run_id`` with record key ``key``."""
    with sqlite3.connect(path) as db:
        db.execute(
            "insert into runlane_index_rows values (?, ?, ?, ?)",
            (
                "runs_runnable",
                encode_storage_tuple(("default", "default")),
                encode_storage_tuple(("2000-01-01T00:00:00.000000Z", run_id)),
                key.encoded,
            ),
        )
    db.close()


def occurrence_key(path: Path) -> StorageRecordKey:
    with sqlite3.connect(path) as db:
        keys = [StorageRecordKey.decode(key) for (key,) in db.execute("select key from runlane_records")]
    db.close()
    (key,) = [key for key in keys if key.collection == "schedule_occurrences"]
    return key


async def seed(path: Path, count: int) -> None:
    async with runtime(path) as rl:
        for n in range(count):
            await rl.trigger(plain, {"n": n}, run_id=f"run_{n}")


def corrupt_shape(document: dict[str, Any]) -> None:
    document["value"]["run"] = {"foo": 1}


def corrupt_schema_version(document: dict[str, Any]) -> None:
    document["schemaVersion"] = 2  # refused by the driver itself, before core decodes the run


def corrupt_id(document: dict[str, Any]) -> None:
    document["value"]["run"]["id"] = "run_0"


def worker_records(caplog: pytest.LogCaptureFixture, level: int) -> list[logging.LogRecord]:
    return [record for record in caplog.records if record.name == "runlane.worker" and record.levelno == level]


# -- an unreadable queued run ---------------------------------------------------------------------


@pytest.mark.parametrize("corrupt", [corrupt_shape, corrupt_schema_version, corrupt_id])
async def test_a_worker_sets_an_unreadable_run_aside_and_runs_the_others(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, corrupt: Callable[[dict[str, Any]], None]
) -> None:
    path = tmp_path / "runlane.db"
    await seed(path, 4)
    edit_sqlite_document(path, run_key("default", "run_1"), corrupt)
    caplog.set_level(logging.WARNING, logger="runlane.worker")
    async with runtime(path) as rl:
        worker = rl.worker(mode=WorkerMode.DRAIN, concurrency=2)
        await asyncio.wait_for(worker.closed, 20)  # it does not stop on the bad run
        assert worker.executed == 3
        for run_id in ("run_0", "run_2", "run_3"):
            assert (await rl.runs.get(run_id)).status.value == "succeeded"
        # Later workers and polls of this runtime pass over it without reporting it again.
        poll = rl.worker(mode=WorkerMode.POLL, empty_poll_delay="10ms")
        await asyncio.sleep(0.2)
        await poll.stop()
        again = rl.worker(mode=WorkerMode.DRAIN)
        await asyncio.wait_for(again.closed, 20)
    (reported,) = worker_records(caplog, logging.ERROR)
    message = reported.getMessage()
    assert "run_1" in message and "set aside" in message and "invariant_violation" in message
    assert reported.run_id == "run_1"  # type: ignore[attr-defined]


async def test_execute_next_raises_for_an_unreadable_run_once_then_passes_over_it(tmp_path: Path) -> None:
    path = tmp_path / "runlane.db"
    await seed(path, 2)
    edit_sqlite_document(path, run_key("default", "run_0"), corrupt_shape)
    async with runtime(path) as rl:
        with pytest.raises(RunlaneError) as raised:
            await rl.execute_next()
        assert raised.value.code is ErrorCode.INVARIANT_VIOLATION
        executed = await rl.execute_next()
        assert executed is not None and executed.id == "run_1"
        assert await rl.execute_next() is None


async def test_an_unreadable_run_of_a_bounded_queue_is_set_aside_too(tmp_path: Path) -> None:
    path = tmp_path / "runlane.db"
    async with runtime(path) as rl:
        for n in range(2):
            await rl.trigger(gateway_call, {"n": n}, run_id=f"run_gw_{n}")
        await rl.tick()  # reserves the bounded queue's capacity for the first run
    edit_sqlite_document(path, run_key("default", "run_gw_0"), corrupt_shape)
    async with runtime(path) as rl:
        worker = rl.worker(mode=WorkerMode.DRAIN, queues=["gateway"])
        await asyncio.wait_for(worker.closed, 20)
        with pytest.raises(RunlaneError):
            await rl.runs.get("run_gw_0")


# -- a runnable index row naming a run that is gone -----------------------------------------------


@pytest.mark.parametrize("target", ["run_ghost", "run_done"])
async def test_a_drain_passes_over_a_stale_runnable_index_row_and_finishes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, target: str
) -> None:
    path = tmp_path / "runlane.db"
    async with runtime(path) as rl:
        await rl.trigger(plain, {}, run_id="run_done")
        assert (await rl.execute_next()).id == "run_done"
        await rl.trigger(plain, {}, run_id="run_0")
    add_runnable_row(path, target, run_key("default", target))  # a missing run, or a finished one
    caplog.set_level(logging.WARNING, logger="runlane.worker")
    async with runtime(path) as rl:
        worker = rl.worker(mode=WorkerMode.DRAIN)
        await asyncio.wait_for(worker.closed, 20)
        assert (await rl.runs.get("run_0")).status.value == "succeeded"
        again = rl.worker(mode=WorkerMode.DRAIN)
        await asyncio.wait_for(again.closed, 20)
    (reported,) = worker_records(caplog, logging.WARNING)
    assert target in reported.getMessage() and "index row may be corrupt" in reported.getMessage()


async def test_a_slot_whose_claims_keep_coming_back_lost_backs_off(tmp_path: Path, monkeypatch: Any) -> None:
    calls = 0

    async def always_lost(*args: Any, **kwargs: Any) -> tuple[None, str]:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0)
        return None, "lost"

    async with runtime(tmp_path / "runlane.db") as rl:
        monkeypatch.setattr(rl, "execute_one", always_lost)
        worker = rl.worker(mode=WorkerMode.POLL)
        await asyncio.sleep(0.5)
        await worker.stop()
    assert 3 < calls < 40  # a few immediate retries, then a backoff: not thousands of claims a second


async def test_a_lost_claim_is_retried_at_once(tmp_path: Path, monkeypatch: Any) -> None:
    results = iter([(None, "lost"), (None, "lost"), (None, "lost"), (None, "idle")])

    async def step(*args: Any, **kwargs: Any) -> tuple[None, str]:
        return next(results)

    async with runtime(tmp_path / "runlane.db") as rl:
        monkeypatch.setattr(rl, "execute_one", step)
        started = time.monotonic()
        await asyncio.wait_for(rl.worker(mode=WorkerMode.DRAIN).closed, 5)
        assert time.monotonic() - started < 0.05  # a lost race with another worker costs no wait


# -- tick ------------------------------------------------------------------------------------------


async def test_a_corrupt_schedule_occurrence_ends_the_tick_before_the_later_phases(tmp_path: Path) -> None:
    path = tmp_path / "runlane.db"
    async with runtime(path) as rl:
        assert (await rl.tick()).materialized == 1
    edit_sqlite_document(path, occurrence_key(path), lambda document: document.update(value={"foo": 1}))
    async with runtime(path) as rl:
        await rl.trigger(gateway_call, {}, run_id="run_gw")
        with pytest.raises(RunlaneError) as raised:
            await rl.tick()
        assert raised.value.code is ErrorCode.INVARIANT_VIOLATION
        assert "schedule occurrence" in raised.value.message
        # The pass stopped at the schedule, as the spec has it: dispatch did not reserve the bounded run.
        events = [record.event.type.value for record in (await rl.runs.events("run_gw")).data]
        assert events == ["run.created"]


@task("sched.other", schedule=schedule("sched.other", every="1m", payload={}))
async def other_schedule(payload: dict) -> None:
    return None


async def test_a_corrupt_schedule_occurrence_ends_every_pass_at_its_schedule(tmp_path: Path) -> None:
    path = tmp_path / "runlane.db"
    clock = ControlledClock()

    def two_schedules() -> Any:
        return create_runlane(lane=sqlite_lane(path), queues=[DEFAULT], tasks=[every, other_schedule], clock=clock)

    async with two_schedules() as rl:
        assert (await rl.tick()).materialized == 2
    with sqlite3.connect(path) as db:
        keys = [StorageRecordKey.decode(key) for (key,) in db.execute("select key from runlane_records")]
    db.close()
    # The occurrence of "sched.every" (the first in the pass) is corrupted.
    async with two_schedules() as rl:
        runs = {run.task_id: run for run in (await rl.runs.list()).data}
    occurrence_id = runs["sched.every"].source.occurrence_id  # type: ignore[union-attr]
    (key,) = [key for key in keys if key.collection == "schedule_occurrences" and key.parts[-1] == occurrence_id]
    edit_sqlite_document(path, key, lambda document: document.update(value={"foo": 1}))
    clock.advance("1m")
    async with two_schedules() as rl:
        for _ in range(2):  # every pass reports it, and stops there
            with pytest.raises(RunlaneError) as raised:
                await rl.tick()
            assert raised.value.code is ErrorCode.INVARIANT_VIOLATION
            expected = "Schedule 'sched.every' did not fire: The stored schedule occurrence "
            assert raised.value.message.startswith(expected)
            assert f"schedule_occurrences/default/{occurrence_id}" in raised.value.message
            assert raised.value.meta["schedule_id"] == "sched.every"
            clock.advance("1m")
        fired = [run.task_id for run in (await rl.runs.list()).data]
    # The failing schedule's runs are created before it meets its corrupt earlier occurrence; the schedule
    # after it did not fire again: it waits for the record to be repaired.
    assert fired.count("sched.every") == 3 and fired.count("sched.other") == 1


@task("flaky.work", retry=Retry(3, backoff="5s"))
async def flaky(payload: dict) -> None:
    raise ValueError("not yet")


def corrupt_other_id(document: dict[str, Any]) -> None:
    document["value"]["run"]["id"] = "run_other"


@pytest.mark.parametrize("corrupt", [corrupt_shape, corrupt_other_id])
async def test_tick_reports_an_unreadable_run_it_would_recover_and_recovers_the_others(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, corrupt: Callable[[dict[str, Any]], None]
) -> None:
    path = tmp_path / "runlane.db"
    clock = ControlledClock()

    def recovering() -> Any:
        tasks = [flaky, gateway_call]
        return create_runlane(lane=sqlite_lane(path), queues=[DEFAULT, GATEWAY], tasks=tasks, clock=clock)

    async with recovering() as rl:
        for n in range(3):
            await rl.trigger(flaky, {}, run_id=f"run_{n}")
            await rl.execute_next()  # fails once: a retry is due in 5 s
        for n in range(3):
            await rl.trigger(gateway_call, {}, run_id=f"run_gw_{n}")  # waits for its reservation
    edit_sqlite_document(path, run_key("default", "run_0"), corrupt)
    edit_sqlite_document(path, run_key("default", "run_gw_0"), corrupt)
    clock.advance("10s")
    caplog.set_level(logging.WARNING, logger="runlane.worker")
    async with recovering() as rl:
        result = await rl.tick()
        assert result.delivery_requested == 2  # the retries of run_1 and run_2
        assert result.dispatch_reserved == 1  # one slot: run_gw_1 (run_gw_0 cannot be read)
        assert (await rl.runs.get("run_gw_1")).dispatch_expires_at is not None
        # A later pass passes over both and reports neither again.
        again = await rl.tick()
        assert again.dispatch_reserved == 0
    reported = sorted(record.run_id for record in worker_records(caplog, logging.ERROR))  # type: ignore[attr-defined]
    assert reported == ["run_0", "run_gw_0"]
    messages = [record.getMessage() for record in worker_records(caplog, logging.ERROR)]
    (message,) = [text for text in messages if "run_0 " in text]
    assert "runs/default/run_0" in message and "set aside" in message and "tick()" in message


async def test_a_run_the_driver_cannot_read_at_all_does_not_take_its_batch_with_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Text that is not JSON: the driver refuses the whole read, not one record of it. Only that run is
    # set aside; the others recovered in the same batch run.
    path = tmp_path / "runlane.db"
    clock = ControlledClock()

    def recovering() -> Any:
        return create_runlane(lane=sqlite_lane(path), queues=[DEFAULT], tasks=[flaky, plain], clock=clock)

    async with recovering() as rl:
        for n in range(3):
            await rl.trigger(flaky, {}, run_id=f"run_{n}")
            await rl.execute_next()  # fails once: a retry is due in 5 s
    with sqlite3.connect(path) as db:
        key = run_key("default", "run_0").encoded
        db.execute("UPDATE runlane_records SET document = '{not json' WHERE key = ?", (key,))
    db.close()
    clock.advance("10s")
    caplog.set_level(logging.WARNING, logger="runlane.worker")
    async with recovering() as rl:
        assert (await rl.tick()).delivery_requested == 2
        statuses = [(await rl.execute_next()) for _ in range(3)]
    assert [run.id if run else None for run in statuses] == ["run_1", "run_2", None]
    set_aside = [record.run_id for record in worker_records(caplog, logging.ERROR)]  # type: ignore[attr-defined]
    assert set_aside == ["run_0"]


async def test_a_rotation_record_the_driver_cannot_read_does_not_stop_the_schedules(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "runlane.db"
    clock = ControlledClock()

    def two_schedules() -> Any:
        return create_runlane(lane=sqlite_lane(path), queues=[DEFAULT], tasks=[every, other_schedule], clock=clock)

    async with two_schedules() as rl:
        assert (await rl.tick(schedule_materialization_limit=1)).materialized == 1  # saves where to go on
    with sqlite3.connect(path) as db:
        db.execute(
            "UPDATE runlane_records SET document = '{oops' WHERE key = ?",
            (StorageRecordKey("schedule_rotation", "default").encoded,),
        )
    db.close()
    caplog.set_level(logging.WARNING, logger="runlane.schedules")
    async with two_schedules() as rl:
        for _ in range(2):
            clock.advance("1m")
            assert (await rl.tick(schedule_materialization_limit=1)).materialized == 1
    (warned,) = [record for record in caplog.records if record.name == "runlane.schedules"]
    assert "schedule_rotation/default cannot be read" in warned.getMessage()


async def test_a_retryable_tick_failure_still_stops_the_pass_at_once(tmp_path: Path, monkeypatch: Any) -> None:
    later: list[str] = []

    async def outage(now: Any, limit: int) -> int:
        raise RunlaneError(ErrorCode.STORAGE_UNAVAILABLE, "down", retryable=True)

    async def finalize(now: Any, limit: int) -> int:
        later.append("cancellations")
        return 0

    async with runtime(tmp_path / "runlane.db") as rl:
        monkeypatch.setattr(rl, "_materialize_schedules", outage)
        monkeypatch.setattr(rl, "_finalize_cancellations", finalize)
        with pytest.raises(RunlaneError) as raised:
            await rl.tick()
    assert raised.value.code is ErrorCode.STORAGE_UNAVAILABLE and later == []


class _Output:
    def __init__(self) -> None:
        self.records: list[tuple[str, dict[str, Any]]] = []
        self.ticks: list[Any] = []

    def record(self, kind: str, text: str, **fields: Any) -> None:
        self.records.append((kind, {"text": text, **fields}))

    def tick_record(self, result: Any) -> None:
        self.ticks.append(result)


async def test_the_tick_loop_reports_a_corrupt_record_once_and_keeps_going(tmp_path: Path) -> None:
    path = tmp_path / "runlane.db"
    async with runtime(path) as rl:
        await rl.tick()
    key = occurrence_key(path)
    edit_sqlite_document(path, key, lambda document: document.update(value={"foo": 1}))
    output = _Output()
    stopping = asyncio.Event()
    passes = 0

    class Counting:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        async def tick(self, **limits: Any) -> Any:
            nonlocal passes
            passes += 1
            if passes == 4:
                stopping.set()
            return await self.inner.tick(**limits)

    async with runtime(path) as rl:
        looping = tick_until_stopped(Counting(rl), output, {}, 0.01, stopping)  # type: ignore[arg-type]
        done = await asyncio.wait_for(looping, 20)
    assert done == 0 and passes == 4
    (failed,) = output.records
    assert failed[0] == "tick_failed" and failed[1]["error_code"] == "invariant_violation"
    assert key.parts[-1] in failed[1]["error_message"]


async def test_the_tick_loop_reports_one_outage_once_whatever_its_messages() -> None:
    # A storage outage fails passes with varying messages (the connection lost mid-pass, then refused).
    messages = iter(["server closed the connection unexpectedly", "Could not connect.", "Could not connect (2)."])
    stopping = asyncio.Event()

    class Outage:
        passes = 0

        async def tick(self, **limits: Any) -> Any:
            self.passes += 1
            message = next(messages, None)
            if message is not None:
                raise RunlaneError(ErrorCode.STORAGE_UNAVAILABLE, message, retryable=True)
            stopping.set()
            return "a pass"

    output = _Output()
    await asyncio.wait_for(tick_until_stopped(Outage(), output, {}, 0.001, stopping), 20)  # type: ignore[arg-type]
    assert [kind for kind, _ in output.records] == ["tick_failed", "tick_recovered"]


async def test_the_tick_loop_still_raises_other_errors(tmp_path: Path) -> None:
    class Broken:
        async def tick(self, **limits: Any) -> Any:
            raise RunlaneError(ErrorCode.CONFIGURATION_INVALID, "bad config")

    with pytest.raises(RunlaneError):
        await tick_until_stopped(Broken(), _Output(), {}, 0.01, asyncio.Event())  # type: ignore[arg-type]


def test_runlane_tick_every_keeps_going_past_a_corrupt_record_and_one_pass_exits_1(tmp_path: Path) -> None:
    project = make_project(tmp_path, lane="sqlite")  # the default tasks carry a one-time schedule
    first = cli(project, "tick")
    assert first.returncode == 0, first.stderr
    path = project / "runlane.db"
    key = occurrence_key(path)
    edit_sqlite_document(path, key, lambda document: document.update(value={"foo": 1}))
    once = cli(project, "tick")
    assert once.returncode == 1 and "invariant_violation" in once.stderr + once.stdout
    records, status, stderr = run_json_until(
        project, ["tick", "--every", "50ms"], lambda seen: any(r["type"] == "tick_failed" for r in seen), signal.SIGTERM
    )
    assert status == 0, stderr
    (failed,) = [record for record in records if record["type"] == "tick_failed"]
    assert failed["error_code"] == "invariant_violation" and key.parts[-1] in failed["error_message"]
    assert records[-1]["type"] == "tick_loop_stopped"


@pytest.mark.parametrize(("corrupt", "problem"), [(corrupt_shape, "is not a valid run"), (corrupt_id, "not a valid")])
async def test_reading_a_corrupt_run_names_the_run_and_its_record(
    tmp_path: Path, corrupt: Callable[[dict[str, Any]], None], problem: str
) -> None:
    path = tmp_path / "runlane.db"
    await seed(path, 2)
    edit_sqlite_document(path, run_key("default", "run_1"), corrupt)
    async with runtime(path) as rl:
        with pytest.raises(RunlaneError) as raised:
            await rl.runs.get("run_1")
    error = raised.value
    assert error.code is ErrorCode.INVARIANT_VIOLATION
    assert "runs/default/run_1" in error.message and problem in error.message
    assert error.meta["run_id"] == "run_1" and error.meta["record"] == "runs/default/run_1"


# -- owner rows that do not match their run --------------------------------------------------------


@pytest.mark.parametrize("names", ["run_other", "run_missing"])
async def test_an_idempotency_owner_naming_a_run_that_does_not_hold_its_key_is_refused(
    tmp_path: Path, names: str
) -> None:
    path = tmp_path / "runlane.db"
    async with runtime(path) as rl:
        await rl.trigger(plain, {}, run_id="run_keyed", idempotency_key="order-1")
        await rl.trigger(gateway_call, {}, run_id="run_other")  # another task's run
    owner = idempotency_owner_key("default", "plain.work", "order-1")
    edit_sqlite_document(path, owner, lambda document: document["value"].update(run_id=names))
    async with runtime(path) as rl:
        with pytest.raises(RunlaneError) as raised:
            await rl.trigger(plain, {}, idempotency_key="order-1")
        assert len((await rl.runs.list()).data) == 2  # nothing was written
        with pytest.raises(RunlaneError) as looked_up:  # a lookup says so too, instead of another task's run
            await rl.runs.find_current(task=plain, idempotency_key="order-1")
        assert looked_up.value.code is ErrorCode.INVARIANT_VIOLATION
    error = raised.value
    assert error.code is ErrorCode.INVARIANT_VIOLATION and error.meta["run_id"] == names
    assert "idempotency_owners/default/plain.work/order-1" in error.message, error.message
    assert ("does not exist" if names == "run_missing" else "does not hold that idempotency key") in error.message


async def test_a_singleton_owner_naming_a_run_that_does_not_hold_its_key_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "runlane.db"
    async with runtime(path) as rl:
        await rl.trigger(plain, {}, run_id="run_holder", singleton_key="account-1")
        await rl.trigger(plain, {}, run_id="run_free")
    owner = singleton_owner_key("default", "account-1")
    edit_sqlite_document(path, owner, lambda document: document["value"].update(run_id="run_free"))
    async with runtime(path) as rl:
        with pytest.raises(RunlaneError) as raised:
            await rl.trigger(plain, {}, singleton_key="account-1")
        assert len((await rl.runs.list()).data) == 2
        with pytest.raises(RunlaneError) as looked_up:
            await rl.runs.find_active(task=plain, singleton_key="account-1")
        assert looked_up.value.code is ErrorCode.INVARIANT_VIOLATION
    assert raised.value.code is ErrorCode.INVARIANT_VIOLATION
    assert "does not hold that singleton key" in raised.value.message
