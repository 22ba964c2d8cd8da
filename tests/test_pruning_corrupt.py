"""Corrupt records met by pruning are reported (a ``runlane.prune`` warning, or an error naming the run
and what is wrong), never silently skipped, and one bad record never stops pruning of the others."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from runlane import Actor, ActorType, ErrorCode, RunlaneError, create_runlane, queue, task
from runlane.core.pruning import RunPruner, decode_run_tombstone, resolve_prune_request
from runlane.storage import (
    NewStorageRecord,
    StorageDocument,
    StorageIndexConsistency,
    StorageIndexName,
    StorageQuery,
    StorageRecordKey,
)
from runlane.storage.tables import (
    decode_run_document,
    decode_run_event_document,
    encode_run_document,
    run_event_key,
    run_key,
    run_tombstone_key,
)
from runlane.testing import ControlledClock
from runlane_local import local_lane, sqlite_lane
from sql_driver_support import edit_sqlite_document

DEFAULT = queue("default", default=True)
OPERATOR = Actor(type=ActorType.OPERATOR, id="ops@example.com")


@task("work.plain")
async def plain(payload: dict) -> str:
    return "done"


def make() -> Any:
    return create_runlane(lane=local_lane(), queues=[DEFAULT], tasks=[plain], clock=ControlledClock())


async def finish(runtime: Any, run_id: str) -> None:
    await runtime.trigger(plain, {}, run_id=run_id)
    executed = await runtime.execute_next()
    assert executed is not None and executed.id == run_id
    runtime.clock.advance("1s")


async def raw(driver: Any, key: StorageRecordKey) -> Any:
    (record,) = await driver.get([key])
    return record


async def edit(driver: Any, key: StorageRecordKey, change: Callable[[dict[str, Any]], None]) -> None:
    """Rewrite one stored document in place (as a bad migration or a manual edit would), keeping its indexes."""

    async def body(tx: Any) -> None:
        (record,) = await tx.get([key])
        await tx.now()
        value = json.loads(json.dumps(record.document.value))
        change(value)
        tx.replace(record, NewStorageRecord(key, StorageDocument.encode(value), record.indexes))

    await driver.with_transaction(body)


async def delete(driver: Any, key: StorageRecordKey) -> None:
    async def body(tx: Any) -> None:
        (record,) = await tx.get([key])
        await tx.now()
        tx.delete(record)

    await driver.with_transaction(body)


@asynccontextmanager
async def pruning(caplog: pytest.LogCaptureFixture, *finished: str) -> AsyncIterator[tuple[Any, Any, str]]:
    """A started runtime with the runs ``finished`` (succeeded), capturing ``runlane.prune`` warnings:
    ``(runtime, its storage driver, its environment key)``."""
    caplog.set_level(logging.WARNING, logger="runlane.prune")
    runtime = make()
    async with runtime:
        for run_id in finished:
            await finish(runtime, run_id)
        yield runtime, runtime.lane.storage, runtime.store.env_key


async def prune(runtime: Any) -> Any:
    runtime.clock.advance("2d")
    return await runtime.runs.prune(older_than="1d")


async def tombstone_only(runtime: Any, count: int) -> RunPruner:
    """Tombstone every old terminal run (``count`` of them) without cleaning any of them up."""
    runtime.clock.advance("2d")
    pruner = RunPruner(runtime.lane.storage, runtime.environment, cleanup_budget=0)
    now = runtime.clock.now()
    cutoff, statuses, limit = resolve_prune_request(older_than="1d", now=now)
    result = await pruner.prune(older_than=cutoff, statuses=statuses, limit=limit, cursor=None, actor=OPERATOR, now=now)
    assert result.pruned == count
    return pruner


def warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    records = [record for record in caplog.records if record.name == "runlane.prune"]
    assert all(record.levelno == logging.WARNING for record in records)
    return records


def warned_runs(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [getattr(record, "run_id") for record in warnings(caplog)]


async def gone(driver: Any, env: str, run_id: str) -> bool:
    events = await driver.query(StorageQuery(StorageIndexName.RUN_EVENTS_BY_RUN, (env, run_id), limit=10))
    return (
        await raw(driver, run_key(env, run_id)) is None
        and await raw(driver, run_tombstone_key(env, run_id)) is None
        and not events.items
    )


# ---------------------------------------------------------------------------------------------
# Child counts of a run document


@pytest.mark.parametrize("count", [-5, "3", 1.5, True, None])
async def test_a_run_document_with_a_bad_child_count_does_not_decode(count: object) -> None:
    runtime = make()
    async with runtime:
        run = (await runtime.trigger(plain, {}, run_id="run_bad")).run
    value = json.loads(json.dumps(encode_run_document(run).value))
    value["children"]["events"] = count
    key = run_key("default", "run_bad")
    with pytest.raises(RunlaneError) as caught:
        decode_run_document(StorageDocument.encode(value), key)
    error = caught.value
    assert error.code is ErrorCode.INVARIANT_VIOLATION
    assert "run run_bad" in error.message and "runs/default/run_bad" in error.message
    assert f"children.events is {count!r}" in error.message and "backup" in error.message
    assert error.meta["run_id"] == "run_bad" and error.meta["key"] == key.encoded
    # Without the key (a caller that has none), the run is still named from the document.
    with pytest.raises(RunlaneError) as caught:
        decode_run_document(StorageDocument.encode(value))
    assert "run run_bad" in caught.value.message and caught.value.meta == {"run_id": "run_bad"}


async def test_a_run_with_a_negative_child_count_is_reported_and_never_tombstoned(caplog) -> None:
    async with pruning(caplog, "run_0", "run_1") as (runtime, driver, env):
        await edit(driver, run_key(env, "run_0"), lambda value: value["children"].update(events=-5))

        with pytest.raises(RunlaneError) as caught:
            await runtime.runs.get("run_0")
        assert caught.value.code is ErrorCode.INVARIANT_VIOLATION
        assert "run run_0" in caught.value.message and "children.events is -5" in caught.value.message

        assert (await prune(runtime)).pruned == 1
        assert await raw(driver, run_tombstone_key(env, "run_0")) is None  # no bad tombstone is ever written
        assert await gone(driver, env, "run_1")  # the healthy run is pruned and cleaned in full
        [record] = warnings(caplog)
        assert record.run_id == "run_0"  # type: ignore[attr-defined]
        assert "Run run_0 is not pruned" in record.getMessage() and "children.events is -5" in record.getMessage()

        caplog.clear()
        assert (await runtime.runs.prune(older_than="1d")).pruned == 0
        assert warned_runs(caplog) == ["run_0"]  # reported again on the next call, once
        assert await raw(driver, run_key(env, "run_0")) is not None


async def test_a_run_that_does_not_decode_is_reported_not_skipped_silently(caplog) -> None:
    async with pruning(caplog, "run_0", "run_1") as (runtime, driver, env):
        await edit(driver, run_key(env, "run_0"), lambda value: value.update(run={"foo": 1}))
        assert (await prune(runtime)).pruned == 1
        [record] = warnings(caplog)
        message = record.getMessage()
        assert record.run_id == "run_0"  # type: ignore[attr-defined]
        assert "Run run_0 is not pruned" in message and "runs/default/run_0" in message and "run.id" in message
        assert await gone(driver, env, "run_1")
        assert await raw(driver, run_key(env, "run_0")) is not None


# ---------------------------------------------------------------------------------------------
# Tombstones that cannot be cleaned


async def test_a_corrupt_tombstone_is_reported_and_the_other_tombstones_are_cleaned(caplog) -> None:
    # Both are tombstoned at the same time; the corrupt one sorts first in the tombstone index.
    async with pruning(caplog, "run_a", "run_b") as (runtime, driver, env):
        pruner = await tombstone_only(runtime, 2)
        await edit(driver, run_tombstone_key(env, "run_a"), lambda value: value["children"].update(events=-1))

        with pytest.raises(RunlaneError) as caught:
            decode_run_tombstone(await raw(driver, run_tombstone_key(env, "run_a")))
        error = caught.value
        assert error.code is ErrorCode.INVARIANT_VIOLATION
        assert "pruned run run_a" in error.message and "run_tombstones/default/run_a" in error.message
        assert "'children.events'" in error.message and "-1" in error.message
        assert error.meta["run_id"] == "run_a"

        result = await runtime.runs.prune(older_than="1d")
        assert result.pruned == 0
        assert await gone(driver, env, "run_b")
        assert await raw(driver, run_tombstone_key(env, "run_a")) is not None
        [record] = warnings(caplog)
        assert record.run_id == "run_a"  # type: ignore[attr-defined]
        assert "Pruned run run_a is not cleaned up" in record.getMessage()
        assert "'children.events'" in record.getMessage()

        # An explicit cleanup raises it, after cleaning what it can.
        with pytest.raises(RunlaneError) as caught:
            await pruner.cleanup(budget=100)
        assert caught.value.code is ErrorCode.INVARIANT_VIOLATION and caught.value.meta["run_id"] == "run_a"


async def test_a_tombstone_whose_child_record_is_missing_is_reported_once_per_call(caplog) -> None:
    async with pruning(caplog, "run_0", "run_1") as (runtime, driver, env):
        assert driver.profile.index_consistency is StorageIndexConsistency.STRONG
        await delete(driver, run_event_key(env, "run_0", 2))

        assert (await prune(runtime)).pruned == 2
        assert await gone(driver, env, "run_1")
        [record] = warnings(caplog)
        message = record.getMessage()
        assert record.run_id == "run_0"  # type: ignore[attr-defined]
        assert "Pruned run run_0 is not cleaned up" in message and "events counter is 1" in message
        tombstone = decode_run_tombstone(await raw(driver, run_tombstone_key(env, "run_0")))
        assert tombstone.children.events == 1  # left as it is
        for _ in range(2):
            caplog.clear()
            assert (await runtime.runs.prune(older_than="1d")).pruned == 0
            assert warned_runs(caplog) == ["run_0"]

        result = await RunPruner(driver, runtime.environment).cleanup(budget=100)
        assert (result.finished, result.pending, result.corrupt) == (0, 1, 1)


class _EventualIndexes:
    """The same driver, claiming eventual index consistency."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.profile = replace(inner.profile, index_consistency=StorageIndexConsistency.EVENTUAL)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


async def test_an_empty_child_page_on_an_eventual_index_waits_without_a_report(caplog) -> None:
    async with pruning(caplog, "run_0") as (runtime, driver, env):
        pruner = await tombstone_only(runtime, 1)
        await delete(driver, run_event_key(env, "run_0", 2))
        caplog.clear()
        eventual = RunPruner(_EventualIndexes(driver), runtime.environment)  # type: ignore[arg-type]
        result = await eventual.cleanup(budget=100)
        assert (result.finished, result.pending, result.corrupt) == (0, 1, 0)
        assert warnings(caplog) == []
        assert (await pruner.cleanup(budget=100)).corrupt == 1  # the strong driver itself reports it


async def test_a_tombstone_counting_links_is_reported(caplog) -> None:
    async with pruning(caplog, "run_0") as (runtime, driver, env):
        pruner = await tombstone_only(runtime, 1)
        await edit(driver, run_tombstone_key(env, "run_0"), lambda value: value["children"].update(links=1))
        caplog.clear()
        result = await pruner.cleanup(budget=100)
        assert (result.finished, result.pending, result.corrupt) == (0, 1, 1)
        [record] = warnings(caplog)
        assert record.run_id == "run_0" and "wait-token link" in record.getMessage()  # type: ignore[attr-defined]
        assert await raw(driver, run_key(env, "run_0")) is not None


# ---------------------------------------------------------------------------------------------
# Messages an operator reads


def test_a_corrupt_run_event_names_its_run_and_record() -> None:
    key = run_event_key("default", "run_0", 3)
    with pytest.raises(RunlaneError) as caught:
        decode_run_event_document(StorageDocument.encode({"run_id": "run_0", "sequence": "x"}), key)
    error = caught.value
    assert error.code is ErrorCode.INVARIANT_VIOLATION
    assert "an event of run run_0" in error.message and "run_events/default/run_0/" in error.message
    assert error.meta["run_id"] == "run_0" and error.meta["key"] == key.encoded


async def test_sqlite_corruption_is_named_in_plain_text_and_pruning_goes_on(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="runlane.prune")
    path = tmp_path / "runlane.db"

    def open_runtime() -> Any:
        return create_runlane(lane=sqlite_lane(path), queues=[DEFAULT], tasks=[plain])

    async with open_runtime() as runtime:
        for run_id in ("run_0", "run_1", "run_2"):
            await runtime.trigger(plain, {}, run_id=run_id)
            assert await runtime.execute_next() is not None
        env = runtime.store.env_key
    edit_sqlite_document(path, run_key(env, "run_0"), lambda document: document["value"]["children"].update(events=-5))
    edit_sqlite_document(path, run_key(env, "run_1"), lambda document: document.update(schemaVersion=2))

    async with open_runtime() as runtime:
        with pytest.raises(RunlaneError) as caught:
            await runtime.runs.get("run_1")
        error = caught.value
        assert error.code is ErrorCode.INVARIANT_VIOLATION
        assert error.message.startswith("The stored record runs/default/run_1 of run run_1 ")
        assert "schema version 2" in error.message and "backup" in error.message
        assert error.meta["run_id"] == "run_1" and error.meta["record"] == "runs/default/run_1"

        with pytest.raises(RunlaneError) as caught:
            await runtime.runs.get("run_0")
        assert "run run_0" in caught.value.message and "children.events is -5" in caught.value.message

        result = await runtime.runs.prune(older_than=datetime.now(UTC) + timedelta(days=1))
        assert result.pruned == 1
        assert await runtime.runs.get("run_2") is None
        assert sorted(warned_runs(caplog)) == ["run_0", "run_1"]
        driver = runtime.lane.storage
        assert await gone(driver, env, "run_2")
        assert await raw(driver, run_tombstone_key(env, "run_0")) is None
