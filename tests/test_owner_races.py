"""An owner record and the run it names are two reads: another process's commit can land between them.

On a driver whose reads are separate statements (SQLite, Postgres), a transaction can read a singleton or
idempotency owner naming run X, and then find X gone: another process finished X (freeing the key) and
pruned it in between. Those reads are stale, not corrupt: the commit's validation of the read set
replays the attempt, which sees the key free. These tests let such a commit land between the two reads,
as a second runtime over the same SQLite file, and check that triggers and lookups go on as they would
have a moment later instead of reporting durable corruption.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from runlane import LaneDelivery, LaneDeliveryMode, RunStatus, TriggerOutcomeType, create_lane, create_runlane, task
from runlane_local import sqlite_lane, sqlite_storage

from runtime_support import DEFAULT_QUEUE


@task("owners.sync", singleton_key=lambda payload: payload["account"])
async def sync_account(payload: dict) -> None:
    return None


@task("owners.receipt")
async def receipt(payload: dict) -> None:
    return None


class _Reads:
    """A transaction whose reads go through ``driver.after_read``."""

    def __init__(self, inner: Any, driver: BetweenReads) -> None:
        self._inner = inner
        self._driver = driver

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def get(self, keys: Any) -> Any:
        found = await self._inner.get(keys)
        await self._driver.after_read(keys)
        return found


class BetweenReads:
    """The SQLite driver; once ``meanwhile`` is set, the first read of a record of ``collection`` (in a
    transaction or not) runs it before returning, as a commit of another process landing right after
    that read."""

    def __init__(self, inner: Any, collection: str) -> None:
        self._inner = inner
        self.name = inner.name
        self.profile = inner.profile
        self.collection = collection
        self.meanwhile: Callable[[], Awaitable[None]] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def after_read(self, keys: Any) -> None:
        if self.meanwhile is not None and any(key.collection == self.collection for key in keys):
            meanwhile, self.meanwhile = self.meanwhile, None
            await meanwhile()

    async def get(self, keys: Any) -> Any:
        found = await self._inner.get(keys)
        await self.after_read(keys)
        return found

    async def with_transaction(self, callback: Any) -> Any:
        return await self._inner.with_transaction(lambda tx: callback(_Reads(tx, self)))


def _runtimes(path: Path, collection: str) -> tuple[Any, Any, BetweenReads]:
    driver = BetweenReads(sqlite_storage(path), collection)
    lane = create_lane(
        storage=driver, delivery=LaneDelivery(mode=LaneDeliveryMode.STORAGE_POLLING), operator_reads=True
    )
    tasks = [sync_account, receipt]
    here = create_runlane(lane=lane, queues=[DEFAULT_QUEUE], tasks=tasks)
    elsewhere = create_runlane(lane=sqlite_lane(path), queues=[DEFAULT_QUEUE], tasks=tasks)
    return here, elsewhere, driver


def _finish_and_prune(elsewhere: Any, run_id: str) -> Callable[[], Awaitable[None]]:
    async def meanwhile() -> None:
        await elsewhere.runs.cancel(run_id)
        await elsewhere.runs.prune(older_than=elsewhere.now() + timedelta(hours=1))

    return meanwhile


async def test_a_trigger_whose_singleton_holder_finishes_and_is_pruned_between_its_reads_takes_the_key(
    tmp_path: Path,
) -> None:
    here, elsewhere, driver = _runtimes(tmp_path / "runlane.db", "singleton_owners")
    async with here, elsewhere:
        holder = (await elsewhere.trigger(sync_account, {"account": "acct_1"})).run
        driver.meanwhile = _finish_and_prune(elsewhere, holder.id)
        result = await here.trigger(sync_account, {"account": "acct_1"})
        assert driver.meanwhile is None, "the holder finished between the trigger's reads"
        assert result.outcome is TriggerOutcomeType.CREATED and result.run.id != holder.id
        assert result.run.status is RunStatus.QUEUED
        assert await here.runs.get(holder.id) is None  # pruned
        assert (await here.runs.find_active(task=sync_account, singleton_key="acct_1")).id == result.run.id


async def test_find_active_whose_singleton_holder_finishes_and_is_pruned_between_its_reads_finds_none(
    tmp_path: Path,
) -> None:
    here, elsewhere, driver = _runtimes(tmp_path / "runlane.db", "singleton_owners")
    async with here, elsewhere:
        holder = (await elsewhere.trigger(sync_account, {"account": "acct_1"})).run
        driver.meanwhile = _finish_and_prune(elsewhere, holder.id)
        assert await here.runs.find_active(task=sync_account, singleton_key="acct_1") is None
        assert driver.meanwhile is None, "the holder finished between the lookup's reads"


async def test_a_trigger_whose_retained_idempotency_owner_is_pruned_between_its_reads_creates_a_run(
    tmp_path: Path,
) -> None:
    here, elsewhere, driver = _runtimes(tmp_path / "runlane.db", "idempotency_owners")
    async with here, elsewhere:
        first = (await elsewhere.trigger(receipt, {}, idempotency_key="order_1")).run
        await elsewhere.runs.cancel(first.id)  # retained for the key's TTL
        driver.meanwhile = _prune(elsewhere)
        result = await here.trigger(receipt, {}, idempotency_key="order_1")
        assert driver.meanwhile is None, "the owner was pruned between the trigger's reads"
        assert result.outcome is TriggerOutcomeType.CREATED and result.run.id != first.id
        assert (await here.runs.find_current(task=receipt, idempotency_key="order_1")).id == result.run.id


def _prune(elsewhere: Any) -> Callable[[], Awaitable[None]]:
    async def meanwhile() -> None:
        await elsewhere.runs.prune(older_than=elsewhere.now() + timedelta(hours=1))

    return meanwhile
