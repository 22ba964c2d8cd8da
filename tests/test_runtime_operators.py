"""Operator reads and actions through ``runlane.runs`` and ``runlane.idempotency_keys``.

Covers the Operator APIs page (list/events/attempts/find_active/find_current/cancel/rerun/retry),
Rerun And Manual Retry, and the Operator Reads vocabulary (filters, sorts, cursors, attempt
summaries), driven only through the public runtime over a local lane and a controlled clock.
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta
from typing import Any

import pytest
from pydantic import BaseModel

from runlane import (
    Actor,
    ActorType,
    ErrorCode,
    Retry,
    RunAttemptStatus,
    RunEventSortField,
    RunEventType,
    RunlaneError,
    RunSortField,
    RunSourceType,
    RunStatus,
    SignalWaitCondition,
    SortDirection,
    StorageConflictKind,
    TaskContext,
    TimeRange,
    TriggerOutcomeType,
    WorkerMode,
    contract_defaults,
    create_lane,
    create_runlane,
    get_storage_conflict_kind,
    queue,
    task,
)
from runlane.core.lanes import LaneDelivery
from runlane.testing import ControlledClock
from runlane.vocabulary import LaneDeliveryMode
from runlane_local import LocalStorageStore, local_lane, local_storage_driver

DEFAULT = queue("default", default=True)
EMAILS = queue("emails")
BOUNDED = queue("bounded", concurrency_limit=1)
RECOVERY = queue("recovery")
QUEUES = [DEFAULT, EMAILS, BOUNDED, RECOVERY]

T0 = ControlledClock().now()
OPERATOR = Actor(type=ActorType.OPERATOR, id="ops@example.com")


def at(minutes: float) -> datetime:
    return T0 + timedelta(minutes=minutes)


@task("ops.work", retry=Retry(2, backoff="10m"))
async def work(payload: dict, ctx: TaskContext) -> Any:
    mode = payload.get("mode", "ok")
    if mode == "ok":
        return {"n": payload.get("n")}
    if mode == "void":
        return None
    if mode == "fail":
        raise RunlaneError(ErrorCode.TASK_FAILED, "provider rejected", retryable=False, meta={"why": "test"})
    if mode == "retry":
        raise RuntimeError("provider down")
    if mode == "flaky":
        if ctx.attempt == 1:
            raise RuntimeError("first attempt fails")
        return {"attempt": ctx.attempt}
    if mode == "sleep":
        return ctx.release("5m", reason="provider_not_ready")
    if mode == "signal":
        return ctx.wait_for_signal("sig_ops", timeout="1h", reason="awaiting_webhook")
    if mode == "signal_forever":
        return ctx.wait_for_signal("sig_forever")
    raise AssertionError(f"unknown mode {mode!r}")


@task("ops.mail", queue=EMAILS)
async def mail(payload: dict) -> None:
    return None


@task(
    "ops.keyed",
    idempotency_key=lambda p: f"order_{p['order']}",
    singleton_key=lambda p: f"acct_{p['account']}",
)
async def keyed(payload: dict) -> Any:
    if payload.get("fail"):
        raise RunlaneError(ErrorCode.TASK_FAILED, "keyed failure", retryable=False)
    return {"order": payload["order"]}


@task("ops.keyed_other", idempotency_key=lambda p: f"order_{p['order']}")
async def keyed_other(payload: dict) -> None:
    return None


@task("ops.singleton_other", singleton_key=lambda p: f"acct_{p['account']}")
async def singleton_other(payload: dict) -> None:
    return None


@task("ops.short_ttl", idempotency_key="fixed", idempotency_key_ttl="1h")
async def short_ttl(payload: dict) -> None:
    if payload.get("fail"):
        raise RunlaneError(ErrorCode.TASK_FAILED, "short ttl failure", retryable=False)
    return None


@task("ops.active_ttl", idempotency_key="fixed", idempotency_key_ttl="active")
async def active_ttl(payload: dict) -> None:
    return None


ALL_TASKS = [work, mail, keyed, keyed_other, singleton_other, short_ttl, active_ttl]


def make(*extra_tasks: Any, clock: ControlledClock | None = None):
    clock = clock or ControlledClock()
    runtime = create_runlane(
        lane=local_lane(), queues=QUEUES, tasks=[*ALL_TASKS, *extra_tasks], clock=clock, worker_id="ops_worker"
    )
    return runtime, clock


def shared_store_runtimes(*task_sets: list[Any], queue_sets: list[list[Any]] | None = None):
    """Runtimes over one in-memory store (one environment), each with its own registry."""
    clock = ControlledClock()
    store = LocalStorageStore()
    runtimes = []
    for index, tasks in enumerate(task_sets):
        lane = create_lane(
            storage=local_storage_driver(store=store, clock=clock),
            delivery=LaneDelivery(mode=LaneDeliveryMode.STORAGE_POLLING),
            name=f"ops-{index}",
        )
        queues = queue_sets[index] if queue_sets is not None else QUEUES
        runtimes.append(create_runlane(lane=lane, queues=queues, tasks=tasks, clock=clock))
    return runtimes, clock


async def rejects(code: ErrorCode, awaitable: Any) -> RunlaneError:
    with pytest.raises(RunlaneError) as raised:
        await awaitable
    assert raised.value.code is code, raised.value
    return raised.value


async def ids(runtime, **options: Any) -> list[str]:
    page = await runtime.runs.list(limit=100, **options)
    assert page.next_cursor is None
    return [summary.id for summary in page.data]


async def id_set(runtime, **options: Any) -> set[str]:
    found = await ids(runtime, **options)
    assert len(found) == len(set(found))
    return set(found)


async def paged_ids(runtime, limit: int, cursor_start: str | None = None, **options: Any) -> tuple[list[str], int]:
    collected: list[str] = []
    cursor = cursor_start
    pages = 0
    while True:
        page = await runtime.runs.list(limit=limit, cursor=cursor, **options)
        pages += 1
        assert len(page.data) <= limit
        collected.extend(summary.id for summary in page.data)
        cursor = page.next_cursor
        if cursor is None:
            break
        assert pages < 200
    return collected, pages


async def all_events(runtime, run_id: str) -> list[Any]:
    page = await runtime.runs.events(run_id, sort_by=RunEventSortField.SEQUENCE, limit=100)
    assert page.next_cursor is None
    return page.data


async def event_count(runtime, run_id: str) -> int:
    return len(await all_events(runtime, run_id))


# ---------------------------------------------------------------------------------------------
# runs.list: filters


async def test_list_filters_by_status_task_and_registered_queue_definitions():
    runtime, clock = make()
    async with runtime:
        succeeded = await runtime.run_now(work, {"mode": "ok"})
        clock.advance("1s")
        failed = await runtime.run_now(work, {"mode": "fail"})
        clock.advance("1s")
        queued_default = (await runtime.trigger(work, {"mode": "ok"})).run
        clock.advance("1s")
        queued_bounded = (await runtime.trigger(work, {"mode": "ok"}, queue=BOUNDED)).run
        clock.advance("1s")
        queued_mail = (await runtime.trigger(mail, {})).run
        clock.advance("1s")
        retrying = await runtime.run_now(work, {"mode": "retry"})
        assert (succeeded.status, failed.status, retrying.status) == (
            RunStatus.SUCCEEDED,
            RunStatus.FAILED,
            RunStatus.RETRYING,
        )
        everything = {succeeded.id, failed.id, queued_default.id, queued_bounded.id, queued_mail.id, retrying.id}
        assert await id_set(runtime) == everything

        assert await id_set(runtime, statuses=[RunStatus.FAILED]) == {failed.id}
        assert await id_set(runtime, statuses=["succeeded", "retrying"]) == {succeeded.id, retrying.id}
        assert await id_set(runtime, statuses=[RunStatus.QUEUED]) == {
            queued_default.id,
            queued_bounded.id,
            queued_mail.id,
        }
        assert await id_set(runtime, statuses=[RunStatus.CANCELLED]) == set()

        assert await id_set(runtime, task_ids=["ops.mail"]) == {queued_mail.id}
        assert await id_set(runtime, task_ids=["ops.work", "ops.mail"]) == everything
        assert await id_set(runtime, task_ids=["ops.unknown"]) == set()

        assert await id_set(runtime, queues=[EMAILS]) == {queued_mail.id}
        assert await id_set(runtime, queues=[BOUNDED]) == {queued_bounded.id}
        assert await id_set(runtime, queues=[DEFAULT, BOUNDED]) == everything - {queued_mail.id}
        assert await id_set(runtime, queues=[RECOVERY]) == set()

        # Filters combine: every supplied filter must match.
        assert await id_set(runtime, statuses=[RunStatus.QUEUED], task_ids=["ops.work"]) == {
            queued_default.id,
            queued_bounded.id,
        }
        assert await id_set(runtime, statuses=[RunStatus.QUEUED], queues=[DEFAULT]) == {queued_default.id}
        assert await id_set(runtime, statuses=[RunStatus.FAILED], queues=[EMAILS]) == set()

        # Summaries are compact rows of the matching runs.
        (row,) = (await runtime.runs.list(statuses=[RunStatus.FAILED])).data
        assert (row.id, row.task_id, row.queue, row.status) == (failed.id, "ops.work", "default", RunStatus.FAILED)
        assert row.failure.code is ErrorCode.TASK_FAILED
        assert row.counters.failures == 1
        assert not hasattr(row, "payload") and not hasattr(row, "output")


async def test_list_rejects_unregistered_or_drifted_queues_and_unknown_statuses():
    runtime, _ = make()
    async with runtime:
        await runtime.trigger(mail, {})
        await rejects(ErrorCode.CONFIGURATION_INVALID, runtime.runs.list(queues=[queue("unregistered")]))
        await rejects(ErrorCode.CONFIGURATION_INVALID, runtime.runs.list(queues=[EMAILS, queue("unregistered")]))
        # Same name, different policy than the registered definition.
        await rejects(ErrorCode.CONFIGURATION_INVALID, runtime.runs.list(queues=[queue("emails", concurrency_limit=3)]))
        await rejects(ErrorCode.VALIDATION_FAILED, runtime.runs.list(queues=["bad:name"]))
        await rejects(ErrorCode.VALIDATION_FAILED, runtime.runs.list(queues=[f"q{n}" for n in range(1001)]))
        await rejects(ErrorCode.VALIDATION_FAILED, runtime.runs.list(statuses=["exploded"]))
        await rejects(ErrorCode.VALIDATION_FAILED, runtime.runs.list(sort_by="priority"))
        await rejects(ErrorCode.VALIDATION_FAILED, runtime.runs.list(sort_direction="sideways"))


async def test_list_finds_the_runs_of_a_queue_no_longer_registered_by_its_name():
    """Runs an earlier release left in a queue it had (renamed or removed since) stay listable by the
    queue's name, so an operator can cancel or rerun them."""
    from runlane_local import LocalStorageStore

    store = LocalStorageStore()
    old_queue = queue("emails.old", default=True)

    @task("ops.moved", queue=old_queue)
    async def moved(payload: dict) -> None:
        return None

    def release(queues, tasks):
        from runlane import create_lane
        from runlane.core.lanes import LaneDelivery
        from runlane.vocabulary import LaneDeliveryMode
        from runlane_local import local_storage_driver

        lane = create_lane(
            storage=local_storage_driver(store=store), delivery=LaneDelivery(mode=LaneDeliveryMode.STORAGE_POLLING)
        )
        return create_runlane(lane=lane, queues=queues, tasks=tasks)

    earlier = release([old_queue], [moved])
    async with earlier:
        left = (await earlier.trigger(moved, {})).run
    later = release([queue("emails", default=True)], [])
    async with later:
        assert [run.id for run in (await later.runs.list(queues=["emails.old"])).data] == [left.id]
        assert (await later.runs.list(queues=["emails"])).data == []
        # A definition is checked against the registry, as everywhere else.
        await rejects(ErrorCode.CONFIGURATION_INVALID, later.runs.list(queues=[old_queue]))


async def test_list_filters_by_idempotency_key_singleton_key_and_source_run():
    runtime, clock = make()
    async with runtime:
        first = (await runtime.trigger(keyed, {"order": 1, "account": "a"})).run
        clock.advance("1s")
        # Same idempotency key on another task: the key filter is not task scoped by itself.
        other_task = (await runtime.trigger(keyed_other, {"order": 1})).run
        clock.advance("1s")
        second = (await runtime.trigger(keyed, {"order": 2, "account": "b"})).run
        clock.advance("1s")
        explicit = (
            await runtime.trigger(work, {"mode": "ok"}, idempotency_key="order_1", singleton_key="acct_c")
        ).run
        clock.advance("1s")
        plain = (await runtime.trigger(work, {"mode": "ok"})).run
        assert first.idempotency_key == "order_1" and first.singleton_key == "acct_a"

        assert await id_set(runtime, idempotency_key="order_1") == {first.id, other_task.id, explicit.id}
        assert await id_set(runtime, idempotency_key="order_1", task_ids=["ops.keyed"]) == {first.id}
        assert await id_set(runtime, idempotency_key="order_2") == {second.id}
        assert await id_set(runtime, idempotency_key="order_9") == set()
        assert await id_set(runtime, singleton_key="acct_a") == {first.id}
        assert await id_set(runtime, singleton_key="acct_c") == {explicit.id}
        assert await id_set(runtime, singleton_key="acct_a", idempotency_key="order_2") == set()

        # Linked children of one source: reruns, manual retries and task-context triggers.
        for run in (first, second, explicit, plain, other_task):
            await runtime.runs.cancel(run.id)
        failed = await runtime.run_now(work, {"mode": "fail"})
        rerun_child = await runtime.runs.rerun(failed.id)
        retry_child = await runtime.runs.retry(failed.id)
        unrelated_child = await runtime.runs.rerun(plain.id)

        @task("ops.parent")
        async def parent(payload: dict, ctx: TaskContext) -> None:
            await ctx.trigger(mail, {})

        runtime2, _ = make(parent, clock=clock)
        async with runtime2:
            parent_run = await runtime2.run_now(parent, {})
            (trigger_child,) = (await runtime2.runs.list(source_run_id=parent_run.id)).data
            assert trigger_child.source.type is RunSourceType.TRIGGER

        assert await id_set(runtime, source_run_id=failed.id) == {rerun_child.id, retry_child.id}
        assert await id_set(runtime, source_run_id=plain.id) == {unrelated_child.id}
        assert await id_set(runtime, source_run_id=rerun_child.id) == set()
        summaries = {s.id: s for s in (await runtime.runs.list(source_run_id=failed.id)).data}
        assert summaries[rerun_child.id].source.type is RunSourceType.RERUN
        assert summaries[retry_child.id].source.type is RunSourceType.MANUAL_RETRY
        assert {s.source.source_run_id for s in summaries.values()} == {failed.id}


async def _timeline(runtime, clock) -> dict[str, Any]:
    """Runs with known created/updated/run_at/runnable-availability times (minutes after T0).

    name  state                         created  updated  run_at   runnable availability
    a     queued on a bounded queue     1        1        -        1 (queued: updated_at)
    b     retrying (10m backoff)        2        2        12       12
    c     released for 5m               3        3        8        8
    d     queued on emails              4        4        4        4
    e     cancelled while queued        5        9        5        -
    f     succeeded                     6        6        -        -
    g     released until a signal       7        7        -        -
    """
    runs: dict[str, Any] = {}
    clock.set(at(1))
    runs["a"] = (await runtime.trigger(work, {"mode": "ok"}, queue=BOUNDED)).run
    clock.set(at(2))
    runs["b"] = await runtime.run_now(work, {"mode": "retry"})
    clock.set(at(3))
    runs["c"] = await runtime.run_now(work, {"mode": "sleep"})
    clock.set(at(4))
    runs["d"] = (await runtime.trigger(mail, {})).run
    clock.set(at(5))
    runs["e"] = (await runtime.trigger(work, {"mode": "ok"})).run
    clock.set(at(6))
    runs["f"] = await runtime.run_now(work, {"mode": "ok"})
    clock.set(at(7))
    runs["g"] = await runtime.run_now(work, {"mode": "signal_forever"})
    clock.set(at(9))
    runs["e"] = await runtime.runs.cancel(runs["e"].id)
    current = {name: await runtime.runs.get(run.id) for name, run in runs.items()}
    # Preconditions of the table above (persisted fields as the reducer defines them).
    assert [current[n].status for n in "abcdefg"] == [
        RunStatus.QUEUED,
        RunStatus.RETRYING,
        RunStatus.RELEASED,
        RunStatus.QUEUED,
        RunStatus.CANCELLED,
        RunStatus.SUCCEEDED,
        RunStatus.RELEASED,
    ]
    assert [current[n].run_at for n in "abcdefg"] == [None, at(12), at(8), at(4), at(5), None, None]
    assert [current[n].created_at for n in "abcdefg"] == [at(m) for m in (1, 2, 3, 4, 5, 6, 7)]
    assert [current[n].updated_at for n in "abcdefg"] == [at(m) for m in (1, 2, 3, 4, 9, 6, 7)]
    return {name: run.id for name, run in current.items()}


def _names(found: list[str] | set[str], runs: dict[str, str]) -> Any:
    by_id = {run_id: name for name, run_id in runs.items()}
    if isinstance(found, set):
        return {by_id[run_id] for run_id in found}
    return "".join(by_id[run_id] for run_id in found)


async def test_list_time_range_filters_are_inclusive_and_run_at_needs_a_persisted_run_at():
    runtime, clock = make()
    async with runtime:
        runs = await _timeline(runtime, clock)

        async def names(**options: Any) -> set[str]:
            return _names(await id_set(runtime, **options), runs)

        assert await names() == set("abcdefg")
        # created_at: inclusive on both ends, open sides allowed.
        assert await names(created_at=TimeRange(start=at(2), end=at(4))) == set("bcd")
        assert await names(created_at=TimeRange(start=at(6))) == set("fg")
        assert await names(created_at=TimeRange(end=at(1))) == set("a")
        assert await names(created_at=TimeRange(start=at(3), end=at(3))) == set("c")
        assert await names(created_at=TimeRange(start=at(2) + timedelta(microseconds=1), end=at(4))) == set("cd")
        assert await names(created_at=TimeRange(start=at(8))) == set()
        # updated_at follows the materialized update time (e was cancelled at 9).
        assert await names(updated_at=TimeRange(start=at(7))) == set("eg")
        assert await names(updated_at=TimeRange(start=at(5), end=at(8))) == set("fg")
        assert await names(updated_at=TimeRange(end=at(4) - timedelta(microseconds=1))) == set("abc")
        # run_at checks the persisted run_at: runs without one only match when no range is given,
        # even an unbounded range.
        assert await names(run_at=TimeRange()) == set("bcde")
        assert await names(run_at=TimeRange(start=at(4), end=at(8))) == set("cde")
        assert await names(run_at=TimeRange(start=at(8))) == set("bc")
        assert await names(run_at=TimeRange(end=at(5))) == set("de")
        assert await names(run_at=TimeRange(start=at(5), end=at(5))) == set("e")
        assert await names(run_at=TimeRange(start=at(12) + timedelta(microseconds=1))) == set()
        # Ranges combine with other filters.
        assert await names(run_at=TimeRange(end=at(12)), statuses=[RunStatus.QUEUED]) == set("d")
        assert await names(created_at=TimeRange(start=at(2)), updated_at=TimeRange(end=at(7)), queues=[DEFAULT]) == set(
            "bcfg"
        )


async def test_list_sorts_by_created_and_updated_time_in_both_directions():
    runtime, clock = make()
    async with runtime:
        runs = await _timeline(runtime, clock)

        async def order(**options: Any) -> str:
            return _names(await ids(runtime, **options), runs)

        # The default is created_at, newest first.
        assert await order() == "gfedcba"
        assert await order(sort_by=RunSortField.CREATED_AT, sort_direction=SortDirection.DESC) == "gfedcba"
        assert await order(sort_by=RunSortField.CREATED_AT, sort_direction=SortDirection.ASC) == "abcdefg"
        assert await order(sort_by="created_at", sort_direction="asc") == "abcdefg"
        assert await order(sort_by=RunSortField.UPDATED_AT, sort_direction=SortDirection.ASC) == "abcdfge"
        assert await order(sort_by=RunSortField.UPDATED_AT, sort_direction=SortDirection.DESC) == "egfdcba"
        # Sorting applies within a filter.
        assert await order(sort_by="updated_at", sort_direction="asc", queues=[DEFAULT]) == "bcfge"
        # A run written since the last listing moves (nothing of the earlier listing is reused for it).
        clock.advance("1m")
        await runtime.runs.cancel(runs["b"])
        assert await order(sort_by=RunSortField.UPDATED_AT, sort_direction=SortDirection.ASC) == "acdfgeb"
        assert await order(sort_by="updated_at", sort_direction="asc", queues=[DEFAULT]) == "cfgeb"


async def test_list_run_at_sort_uses_runnable_availability_with_unavailable_runs_last_both_ways():
    runtime, clock = make()
    async with runtime:
        runs = await _timeline(runtime, clock)

        async def order(direction: SortDirection) -> str:
            return _names(await ids(runtime, sort_by=RunSortField.RUN_AT, sort_direction=direction), runs)

        # a is queued without run_at and sorts by updated_at (1); b/c/d sort by run_at;
        # e (cancelled, with a persisted run_at), f and g have no runnable time and come last.
        ascending = await order(SortDirection.ASC)
        assert ascending[:4] == "adcb"
        assert set(ascending[4:]) == set("efg")
        descending = await order(SortDirection.DESC)
        assert descending[:4] == "bcda"
        assert set(descending[4:]) == set("efg")
        # Paging through the run_at order gives the same sequence, each run once.
        for direction, full in ((SortDirection.ASC, ascending), (SortDirection.DESC, descending)):
            collected, pages = await paged_ids(runtime, 2, sort_by=RunSortField.RUN_AT, sort_direction=direction)
            assert _names(collected, runs) == full
            assert 4 <= pages <= 5
        # run_at sort is not the run_at filter: the filter still only sees persisted run_at values.
        filtered = await ids(runtime, sort_by="run_at", sort_direction="asc", run_at=TimeRange())
        assert _names(filtered, runs)[:3] == "dcb" and set(_names(filtered, runs)) == set("bcde")
        assert _names(filtered, runs)[3] == "e"


async def test_list_run_at_sort_places_running_runs_at_their_lease_expiry():
    gate = asyncio.Event()
    started = asyncio.Event()

    @task("ops.block", queue=RECOVERY)
    async def block(payload: dict) -> None:
        started.set()
        await gate.wait()

    runtime, clock = make(block)
    async with runtime:
        clock.set(at(1))
        queued = (await runtime.trigger(work, {"mode": "ok"})).run  # runnable at 1
        clock.set(at(2))
        running = (await runtime.trigger(block, {})).run
        pending = asyncio.ensure_future(runtime.execute_next(queues=[RECOVERY], lease_duration="8m"))
        try:
            await asyncio.wait_for(started.wait(), 2)
            clock.set(at(3))
            retrying = await runtime.run_now(work, {"mode": "retry"})  # runnable at 13
            clock.set(at(4))
            released = await runtime.run_now(work, {"mode": "sleep"})  # runnable at 9
            current = await runtime.runs.get(running.id)
            assert current.status is RunStatus.RUNNING
            assert current.lease.expires_at == at(10)
            assert current.run_at == at(2) and current.updated_at == at(2)
            names = {queued.id: "q", running.id: "r", retrying.id: "t", released.id: "s"}
            asc = await ids(runtime, sort_by="run_at", sort_direction="asc")
            desc = await ids(runtime, sort_by="run_at", sort_direction="desc")
            assert "".join(names[i] for i in asc) == "qsrt"
            assert "".join(names[i] for i in desc) == "trsq"
        finally:
            gate.set()
            done = await asyncio.wait_for(pending, 2)
        assert done.status is RunStatus.SUCCEEDED


# ---------------------------------------------------------------------------------------------
# runs.list: pagination and cursors


async def test_list_cursor_pages_yield_every_run_once_in_order_for_every_sort():
    runtime, clock = make()
    async with runtime:
        created: list[str] = []
        for index in range(9):
            # Groups of three runs share a creation time, so ties must page correctly too.
            if index % 3 == 0:
                clock.advance("1m")
            created.append((await runtime.trigger(work, {"mode": "ok", "n": index})).run.id)
        # Touch some runs later so updated_at order differs from created_at order.
        for run_id in (created[4], created[0], created[7]):
            clock.advance("10s")
            await runtime.runs.cancel(run_id)
        for field in (RunSortField.CREATED_AT, RunSortField.UPDATED_AT, RunSortField.RUN_AT):
            for direction in (SortDirection.ASC, SortDirection.DESC):
                full = await ids(runtime, sort_by=field, sort_direction=direction)
                assert sorted(full) == sorted(created)
                for limit in (1, 2, 4, 8, 9, 50):
                    collected, pages = await paged_ids(runtime, limit, sort_by=field, sort_direction=direction)
                    assert collected == full, (field, direction, limit)
                    # At most one trailing empty page.
                    assert pages <= max(1, -(-len(full) // limit)) + 1, (field, direction, limit)
        # The created_at groups appear in time order (ties are only reordered within a group).
        asc = await ids(runtime, sort_by="created_at", sort_direction="asc")
        assert [set(asc[i : i + 3]) for i in (0, 3, 6)] == [set(created[i : i + 3]) for i in (0, 3, 6)]
        desc = await ids(runtime, sort_by="created_at", sort_direction="desc")
        assert [set(desc[i : i + 3]) for i in (0, 3, 6)] == [set(created[i : i + 3]) for i in (6, 3, 0)]
        upd = await ids(runtime, sort_by="updated_at", sort_direction="desc")
        assert upd[:3] == [created[7], created[0], created[4]]
        # Paging with a filter only yields the filter's runs.
        collected, _ = await paged_ids(runtime, 2, statuses=[RunStatus.CANCELLED], sort_direction="asc")
        assert collected == [created[0], created[4], created[7]]


async def test_list_applies_the_default_limit_and_caps_large_limits():
    runtime, clock = make()
    async with runtime:
        default_limit = contract_defaults.pagination.default_limit
        max_limit = contract_defaults.pagination.max_limit
        total = max_limit + 5
        for index in range(total):
            clock.advance("1s")
            await runtime.trigger(work, {"mode": "ok", "n": index})
        first = await runtime.runs.list()
        assert len(first.data) == default_limit and first.next_cursor is not None
        capped = await runtime.runs.list(limit=max_limit * 10)
        assert len(capped.data) == max_limit and capped.next_cursor is not None
        rest = await runtime.runs.list(limit=max_limit * 10, cursor=capped.next_cursor)
        assert len(rest.data) == total - max_limit and rest.next_cursor is None
        assert len({s.id for s in capped.data} | {s.id for s in rest.data}) == total
        second = await runtime.runs.list(cursor=first.next_cursor)
        assert len(second.data) == default_limit
        assert not {s.id for s in first.data} & {s.id for s in second.data}


async def test_list_cursor_is_bound_to_its_filter_and_sort():
    runtime, clock = make()
    async with runtime:
        for index in range(5):
            clock.advance("1s")
            await runtime.trigger(work, {"mode": "ok", "n": index})
        base: dict[str, Any] = dict(statuses=[RunStatus.QUEUED], sort_by="created_at", sort_direction="asc")
        page = await runtime.runs.list(limit=2, **base)
        cursor = page.next_cursor
        assert cursor is not None
        # The same logical request continues.
        same = await runtime.runs.list(limit=2, cursor=cursor, **base)
        assert [s.id for s in same.data] != [s.id for s in page.data] and len(same.data) == 2
        changed: list[dict[str, Any]] = [
            {**base, "statuses": [RunStatus.QUEUED, RunStatus.FAILED]},
            {**base, "statuses": None},
            {**base, "sort_direction": "desc"},
            {**base, "sort_by": "updated_at"},
            {**base, "sort_by": "run_at"},
            {**base, "task_ids": ["ops.work"]},
            {**base, "queues": [DEFAULT]},
            {**base, "idempotency_key": "order_1"},
            {**base, "singleton_key": "acct_a"},
            {**base, "source_run_id": "run_source"},
            {**base, "created_at": TimeRange(start=T0)},
            {**base, "updated_at": TimeRange(start=T0)},
            {**base, "run_at": TimeRange(start=T0)},
        ]
        for options in changed:
            await rejects(ErrorCode.VALIDATION_FAILED, runtime.runs.list(limit=2, cursor=cursor, **options))
        # An event-history cursor is not a run-list cursor.
        run_id = page.data[0].id
        events_cursor = (await runtime.runs.events(run_id, limit=1)).next_cursor
        assert events_cursor is not None
        await rejects(ErrorCode.VALIDATION_FAILED, runtime.runs.list(limit=2, cursor=events_cursor, **base))


async def test_list_cursor_continues_whatever_the_order_of_the_filter_values():
    # Filter values are sets: a request naming them in another order (query parameters, or a Python set
    # whose order changes from process to process) is the same listing and continues its cursor.
    runtime, clock = make()
    async with runtime:
        for index in range(4):
            clock.advance("1s")
            await runtime.trigger(work, {"mode": "ok", "n": index})
            await runtime.trigger(mail, {"n": index})
        await runtime.execute_next(queues=[EMAILS])
        first = await runtime.runs.list(
            limit=3, statuses=["queued", "succeeded"], task_ids=["ops.work", "ops.mail"], queues=[DEFAULT, EMAILS]
        )
        assert first.next_cursor is not None
        rest = await runtime.runs.list(
            cursor=first.next_cursor,
            statuses=[RunStatus.SUCCEEDED, RunStatus.QUEUED],
            task_ids=["ops.mail", "ops.work"],
            queues=["emails", "default"],
        )
        assert len(first.data) + len(rest.data) == 8
        assert not {s.id for s in first.data} & {s.id for s in rest.data}
        run_id = first.data[-1].id
        types = [RunEventType.CREATED, RunEventType.DELIVERY_REQUESTED]
        events = await runtime.runs.events(run_id, limit=1, types=types)
        assert events.next_cursor is not None
        more = await runtime.runs.events(run_id, cursor=events.next_cursor, types=types[::-1])
        assert [e.sequence for e in events.data + more.data] == [1, 2]


@pytest.mark.parametrize("cursor", ["garbage", "not a cursor!", "e30", "eyJ2IjoxfQ", "\u00e9t\u00e9", ""])
async def test_list_rejects_garbage_cursors(cursor):
    runtime, _ = make()
    async with runtime:
        await runtime.trigger(work, {"mode": "ok"})
        await rejects(ErrorCode.VALIDATION_FAILED, runtime.runs.list(cursor=cursor))


async def test_list_rejects_a_truncated_cursor():
    runtime, clock = make()
    async with runtime:
        for _ in range(3):
            clock.advance("1s")
            await runtime.trigger(work, {"mode": "ok"})
        cursor = (await runtime.runs.list(limit=1)).next_cursor
        await rejects(ErrorCode.VALIDATION_FAILED, runtime.runs.list(limit=1, cursor=cursor[:-4]))
        await rejects(ErrorCode.VALIDATION_FAILED, runtime.runs.list(limit=1, cursor=cursor + "AAAA"))


@pytest.mark.parametrize("limit", [0, -1, -100])
async def test_list_and_events_reject_non_positive_limits(limit):
    runtime, _ = make()
    async with runtime:
        run = (await runtime.trigger(work, {"mode": "ok"})).run
        await rejects(ErrorCode.VALIDATION_FAILED, runtime.runs.list(limit=limit))
        await rejects(ErrorCode.VALIDATION_FAILED, runtime.runs.events(run.id, limit=limit))


# ---------------------------------------------------------------------------------------------
# runs.events


async def _eight_event_run(runtime, clock) -> tuple[str, str]:
    """A run with 8 events: created+delivery at 1, claim/start/retry at 2, claim/start/failed at 12."""
    clock.set(at(1))
    run = (await runtime.trigger(work, {"mode": "retry"})).run
    clock.set(at(1.5))
    other = (await runtime.trigger(mail, {})).run
    clock.set(at(2))
    assert (await runtime.execute_next(queues=[DEFAULT])).status is RunStatus.RETRYING
    clock.set(at(12))
    assert (await runtime.execute_next(queues=[DEFAULT])).status is RunStatus.FAILED
    return run.id, other.id


EIGHT_TYPES = [
    "run.created",
    "run.delivery_requested",
    "run.lease_claimed",
    "run.started",
    "run.retry_scheduled",
    "run.lease_claimed",
    "run.started",
    "run.failed",
]
EIGHT_TIMES = [at(1), at(1), at(2), at(2), at(2), at(12), at(12), at(12)]


async def test_events_sort_by_sequence_and_occurred_at_in_both_directions():
    runtime, clock = make()
    async with runtime:
        run_id, other_id = await _eight_event_run(runtime, clock)
        by_sequence = await all_events(runtime, run_id)
        assert [r.sequence for r in by_sequence] == list(range(1, 9))
        assert [r.event.type.value for r in by_sequence] == EIGHT_TYPES
        assert [r.event.occurred_at for r in by_sequence] == EIGHT_TIMES
        assert {r.event.run_id for r in by_sequence} == {run_id}
        assert len({r.id for r in by_sequence}) == 8

        desc_seq = (await runtime.runs.events(run_id, sort_by="sequence", sort_direction="desc")).data
        assert [r.sequence for r in desc_seq] == list(range(8, 0, -1))
        # The default is occurred_at ascending; ties within one run keep sequence order.
        default = (await runtime.runs.events(run_id)).data
        assert [r.sequence for r in default] == list(range(1, 9))
        asc_time = (await runtime.runs.events(run_id, sort_by=RunEventSortField.OCCURRED_AT, sort_direction="asc")).data
        assert [r.sequence for r in asc_time] == list(range(1, 9))
        desc_time = (
            await runtime.runs.events(run_id, sort_by=RunEventSortField.OCCURRED_AT, sort_direction=SortDirection.DESC)
        ).data
        assert [r.event.occurred_at for r in desc_time] == sorted(EIGHT_TIMES, reverse=True)
        assert [r.sequence for r in desc_time] == list(range(8, 0, -1))
        # Another run's history never leaks in.
        other = await all_events(runtime, other_id)
        assert [r.event.type.value for r in other] == ["run.created", "run.delivery_requested"]
        assert [r.sequence for r in other] == [1, 2]


async def test_events_filter_by_types_and_inclusive_occurred_at_bounds():
    runtime, clock = make()
    async with runtime:
        run_id, _ = await _eight_event_run(runtime, clock)

        async def seqs(**options: Any) -> list[int]:
            page = await runtime.runs.events(run_id, sort_by="sequence", limit=100, **options)
            return [r.sequence for r in page.data]

        assert await seqs(types=[RunEventType.STARTED]) == [4, 7]
        assert await seqs(types=["run.lease_claimed", "run.failed"]) == [3, 6, 8]
        assert await seqs(types=[RunEventType.SUCCEEDED]) == []
        assert await seqs(occurred_at=TimeRange(start=at(2), end=at(2))) == [3, 4, 5]
        assert await seqs(occurred_at=TimeRange(start=at(2))) == [3, 4, 5, 6, 7, 8]
        assert await seqs(occurred_at=TimeRange(end=at(2))) == [1, 2, 3, 4, 5]
        assert await seqs(occurred_at=TimeRange(start=at(2) + timedelta(microseconds=1), end=at(12))) == [6, 7, 8]
        assert await seqs(occurred_at=TimeRange(start=at(13))) == []
        assert await seqs(types=["run.started"], occurred_at=TimeRange(start=at(3))) == [7]
        await rejects(ErrorCode.VALIDATION_FAILED, runtime.runs.events(run_id, types=["run.exploded"]))
        await rejects(ErrorCode.VALIDATION_FAILED, runtime.runs.events(run_id, sort_by="priority"))
        await rejects(ErrorCode.RUN_NOT_FOUND, runtime.runs.events("run_missing"))


async def test_events_cursor_paging_in_every_order():
    runtime, clock = make()
    async with runtime:
        run_id, _ = await _eight_event_run(runtime, clock)
        for sort_by in ("sequence", "occurred_at"):
            for direction in ("asc", "desc"):
                full = (await runtime.runs.events(run_id, sort_by=sort_by, sort_direction=direction, limit=100)).data
                for limit in (1, 3, 7, 8):
                    collected: list[Any] = []
                    cursor = None
                    pages = 0
                    while True:
                        page = await runtime.runs.events(
                            run_id, sort_by=sort_by, sort_direction=direction, limit=limit, cursor=cursor
                        )
                        pages += 1
                        collected.extend(page.data)
                        cursor = page.next_cursor
                        if cursor is None:
                            break
                    assert collected == full, (sort_by, direction, limit)
                    assert pages <= -(-8 // limit) + 1
        # Paging with a type filter.
        first = await runtime.runs.events(run_id, types=["run.lease_claimed", "run.started"], limit=3)
        rest = await runtime.runs.events(
            run_id, types=["run.lease_claimed", "run.started"], limit=3, cursor=first.next_cursor
        )
        assert [r.sequence for r in first.data + rest.data] == [3, 4, 6, 7] and rest.next_cursor is None


async def test_events_reject_foreign_and_garbage_cursors():
    runtime, clock = make()
    async with runtime:
        run_id, other_id = await _eight_event_run(runtime, clock)
        cursor = (await runtime.runs.events(run_id, sort_by="sequence", limit=2)).next_cursor
        assert cursor is not None
        # Another run's history.
        await rejects(
            ErrorCode.VALIDATION_FAILED, runtime.runs.events(other_id, sort_by="sequence", limit=2, cursor=cursor)
        )
        # Another sort or filter of the same run.
        await rejects(
            ErrorCode.VALIDATION_FAILED, runtime.runs.events(run_id, sort_by="occurred_at", limit=2, cursor=cursor)
        )
        await rejects(
            ErrorCode.VALIDATION_FAILED,
            runtime.runs.events(run_id, sort_by="sequence", sort_direction="desc", limit=2, cursor=cursor),
        )
        await rejects(
            ErrorCode.VALIDATION_FAILED,
            runtime.runs.events(run_id, sort_by="sequence", types=["run.started"], limit=2, cursor=cursor),
        )
        await rejects(
            ErrorCode.VALIDATION_FAILED,
            runtime.runs.events(run_id, sort_by="sequence", occurred_at=TimeRange(start=T0), limit=2, cursor=cursor),
        )
        # A run-list cursor.
        list_cursor = (await runtime.runs.list(limit=1)).next_cursor
        assert list_cursor is not None
        await rejects(ErrorCode.VALIDATION_FAILED, runtime.runs.events(run_id, limit=2, cursor=list_cursor))
        await rejects(ErrorCode.VALIDATION_FAILED, runtime.runs.events(run_id, limit=2, cursor="garbage"))
        # The right cursor still works.
        page = await runtime.runs.events(run_id, sort_by="sequence", limit=2, cursor=cursor)
        assert [r.sequence for r in page.data] == [3, 4]


# ---------------------------------------------------------------------------------------------
# runs.attempts


async def test_attempts_for_success_with_and_without_output_and_for_failure():
    runtime, clock = make()
    async with runtime:
        clock.set(at(1))
        ok = await runtime.run_now(work, {"mode": "ok", "n": 7})
        (attempt,) = await runtime.runs.attempts(ok.id)
        assert (attempt.attempt, attempt.status, attempt.started_at, attempt.completed_at) == (
            1,
            RunAttemptStatus.SUCCEEDED,
            at(1),
            at(1),
        )
        assert attempt.has_output and attempt.output == {"n": 7}
        assert attempt.failure is None and attempt.retry_at is None and attempt.release_delay is None

        void = await runtime.run_now(work, {"mode": "void"})
        (attempt,) = await runtime.runs.attempts(void.id)
        assert attempt.status is RunAttemptStatus.SUCCEEDED
        assert not attempt.has_output and attempt.output is None
        assert "output" not in attempt.model_dump(mode="json")

        clock.set(at(2))
        failed = await runtime.run_now(work, {"mode": "fail"})
        (attempt,) = await runtime.runs.attempts(failed.id)
        assert (attempt.status, attempt.completed_at) == (RunAttemptStatus.FAILED, at(2))
        assert (attempt.failure.code, attempt.failure.message, attempt.failure.meta) == (
            ErrorCode.TASK_FAILED,
            "Task failed.",  # normalized public message
            {"why": "test"},
        )
        assert attempt.failure.retryable is False
        assert not attempt.has_output and attempt.retry_at is None
        await rejects(ErrorCode.RUN_NOT_FOUND, runtime.runs.attempts("run_missing"))


async def test_attempts_for_retrying_then_succeeding_runs():
    runtime, clock = make()
    async with runtime:
        clock.set(at(1))
        run = (await runtime.trigger(work, {"mode": "flaky"})).run
        assert await runtime.runs.attempts(run.id) == []
        clock.set(at(2))
        await runtime.execute_next()
        (first,) = await runtime.runs.attempts(run.id)
        assert (first.attempt, first.status, first.started_at, first.completed_at) == (
            1,
            RunAttemptStatus.RETRYING,
            at(2),
            at(2),
        )
        assert (first.retry_delay, first.retry_at) == ("10m", at(12))
        assert first.failure is not None and first.failure.retryable
        assert not first.has_output
        clock.set(at(12))
        assert (await runtime.tick()).delivery_requested == 1
        clock.set(at(13))
        assert (await runtime.execute_next()).status is RunStatus.SUCCEEDED
        attempts = await runtime.runs.attempts(run.id)
        assert [(a.attempt, a.status) for a in attempts] == [
            (1, RunAttemptStatus.RETRYING),
            (2, RunAttemptStatus.SUCCEEDED),
        ]
        assert attempts[0] == first  # earlier attempts do not change
        assert (attempts[1].started_at, attempts[1].completed_at) == (at(13), at(13))
        assert attempts[1].output == {"attempt": 2}
        assert attempts[1].failure is None
        # Only run.started creates an attempt: one summary per started event, whatever else happened.
        types = [r.event.type for r in await all_events(runtime, run.id)]
        assert types.count(RunEventType.STARTED) == len(attempts)
        assert types.count(RunEventType.DELIVERY_REQUESTED) == 2 and types.count(RunEventType.LEASE_CLAIMED) == 2


async def test_attempts_for_time_and_signal_releases():
    runtime, clock = make()
    async with runtime:
        clock.set(at(1))
        sleeper = await runtime.run_now(work, {"mode": "sleep"})
        (attempt,) = await runtime.runs.attempts(sleeper.id)
        assert (attempt.status, attempt.completed_at) == (RunAttemptStatus.RELEASED, at(1))
        assert (attempt.release_delay, attempt.resume_at, attempt.release_reason) == ("5m", at(6), "provider_not_ready")
        assert attempt.failure is None and attempt.retry_at is None and not attempt.has_output

        clock.set(at(2))
        waiter = await runtime.run_now(work, {"mode": "signal"})
        (attempt,) = await runtime.runs.attempts(waiter.id)
        assert (attempt.status, attempt.completed_at) == (RunAttemptStatus.RELEASED, at(2))
        assert attempt.release_wait == SignalWaitCondition(signal_key="sig_ops", timeout_at=at(62))
        assert attempt.release_reason == "awaiting_webhook"
        assert attempt.release_delay is None
        assert attempt.failure is None

        forever = await runtime.run_now(work, {"mode": "signal_forever"})
        (attempt,) = await runtime.runs.attempts(forever.id)
        assert attempt.release_wait == SignalWaitCondition(signal_key="sig_forever")
        assert attempt.resume_at is None and attempt.release_reason is None

        # The signal arrives: the next attempt is a new row; the released one stays released.
        assert [r.id for r in await runtime.signals.send("sig_ops")] == [waiter.id]
        clock.set(at(3))
        assert (await runtime.execute_next()).id == waiter.id
        # "signal" mode releases again on every attempt.
        attempts = await runtime.runs.attempts(waiter.id)
        assert [(a.attempt, a.status) for a in attempts] == [
            (1, RunAttemptStatus.RELEASED),
            (2, RunAttemptStatus.RELEASED),
        ]
        assert attempts[1].started_at == at(3)


async def test_attempt_resume_at_is_only_set_for_time_releases():
    runtime, clock = make()
    async with runtime:
        clock.set(at(2))
        waiter = await runtime.run_now(work, {"mode": "signal"})
        released = (await runtime.runs.events(waiter.id, types=["run.released"])).data[0].event
        assert released.resume_at is None  # the event carries the wait only
        (attempt,) = await runtime.runs.attempts(waiter.id)
        assert attempt.resume_at is None


async def test_attempts_for_cooperative_cancellation_of_a_started_attempt():
    started = asyncio.Event()

    @task("ops.cooperative")
    async def cooperative(payload: dict, ctx: TaskContext) -> None:
        started.set()
        await ctx.signal.wait()
        if payload.get("throw"):
            raise RuntimeError("cleanup failed")

    runtime, clock = make(cooperative)
    async with runtime:
        for throw in (False, True):
            started.clear()
            clock.advance("1m")
            run = (await runtime.trigger(cooperative, {"throw": throw})).run
            pending = asyncio.ensure_future(runtime.execute_next())
            await asyncio.wait_for(started.wait(), 2)
            (attempt,) = await runtime.runs.attempts(run.id)
            assert attempt.status is RunAttemptStatus.RUNNING and attempt.completed_at is None
            claimed_at = clock.now()
            clock.advance("5s")
            requested = await runtime.runs.cancel(run.id, actor=OPERATOR, reason="operator_requested")
            assert requested.status is RunStatus.CANCELLATION_REQUESTED
            finished = await asyncio.wait_for(pending, 2)
            (attempt,) = await runtime.runs.attempts(run.id)
            assert attempt.started_at == claimed_at and attempt.completed_at == clock.now()
            if throw:
                # Task code that throws during cancellation leaves a failed attempt.
                assert finished.status is RunStatus.FAILED
                assert attempt.status is RunAttemptStatus.FAILED and attempt.failure is not None
            else:
                assert finished.status is RunStatus.CANCELLED
                assert attempt.status is RunAttemptStatus.CANCELLED and attempt.failure is None


async def test_cancelling_work_without_a_running_attempt_creates_no_attempt_row():
    runtime, clock = make()
    async with runtime:
        queued = (await runtime.trigger(work, {"mode": "ok"})).run
        bounded = (await runtime.trigger(work, {"mode": "ok"}, queue=BOUNDED)).run
        await runtime.runs.cancel(queued.id)
        await runtime.runs.cancel(bounded.id)
        assert await runtime.runs.attempts(queued.id) == []
        assert await runtime.runs.attempts(bounded.id) == []

        retrying = await runtime.run_now(work, {"mode": "retry"})
        released = await runtime.run_now(work, {"mode": "sleep"})
        clock.advance("1m")
        for run in (retrying, released):
            assert (await runtime.runs.cancel(run.id)).status is RunStatus.CANCELLED
        # The earlier attempt keeps its own outcome; cancellation adds no row.
        (attempt,) = await runtime.runs.attempts(retrying.id)
        assert attempt.status is RunAttemptStatus.RETRYING and attempt.completed_at == retrying.updated_at
        (attempt,) = await runtime.runs.attempts(released.id)
        assert attempt.status is RunAttemptStatus.RELEASED and attempt.completed_at == released.updated_at


async def test_cancelling_a_run_taken_back_from_a_dead_worker_leaves_its_attempt_without_an_outcome():
    """The attempt ended with no outcome when its lease expired and tick() queued the run again: it was
    shown as cancelled (at the cancellation's time) as if its handler had stopped for the cancellation."""
    started = asyncio.Event()

    @task("ops.dies")
    async def dies(payload: dict) -> None:
        started.set()
        await asyncio.sleep(3600)  # stands in for a worker killed mid-attempt

    runtime, clock = make(dies)
    async with runtime:
        run = (await runtime.trigger(dies, {})).run
        killed = asyncio.ensure_future(runtime.execute_next(lease_duration="30s"))
        await asyncio.wait_for(started.wait(), 2)
        killed.cancel()
        await asyncio.gather(killed, return_exceptions=True)
        clock.advance("31s")
        assert (await runtime.tick()).delivery_requested == 1
        assert (await runtime.runs.cancel(run.id)).status is RunStatus.CANCELLED
        (attempt,) = await runtime.runs.attempts(run.id)
        assert attempt.status is RunAttemptStatus.RUNNING and attempt.completed_at is None


# ---------------------------------------------------------------------------------------------
# find_active and find_current


async def test_find_active_needs_a_task_and_a_key_and_returns_only_active_runs():
    runtime, _ = make()
    async with runtime:
        with pytest.raises(RunlaneError) as raised:
            await runtime.runs.find_active(task=keyed)
        assert raised.value.code in (ErrorCode.CONFIGURATION_INVALID, ErrorCode.VALIDATION_FAILED)
        await rejects(ErrorCode.TASK_NOT_FOUND, runtime.runs.find_active(task="ops.unknown", singleton_key="acct_a"))

        active = (await runtime.trigger(keyed, {"order": 1, "account": "a"})).run
        by_idem = await runtime.runs.find_active(task=keyed, idempotency_key="order_1")
        by_single = await runtime.runs.find_active(task="ops.keyed", singleton_key="acct_a")
        assert by_idem.id == active.id and by_single.id == active.id
        assert by_idem.payload == {"order": 1, "account": "a"}  # a full run record
        # Another task's keys, or keys nobody holds, find nothing.
        assert await runtime.runs.find_active(task=keyed_other, idempotency_key="order_1") is None
        assert await runtime.runs.find_active(task=singleton_other, singleton_key="acct_a") is None
        assert await runtime.runs.find_active(task=keyed, idempotency_key="order_2") is None
        assert await runtime.runs.find_active(task=keyed, singleton_key="acct_b") is None

        # Once terminal, the run is no longer active, even though the idempotency owner is retained.
        done = await runtime.execute_next()
        assert done.id == active.id and done.status is RunStatus.SUCCEEDED
        assert await runtime.runs.find_active(task=keyed, idempotency_key="order_1") is None
        assert await runtime.runs.find_active(task=keyed, singleton_key="acct_a") is None
        assert (await runtime.runs.find_current(task=keyed, idempotency_key="order_1")).id == active.id

        # Released and retrying runs are active.
        retrying = await runtime.run_now(work, {"mode": "retry"}, singleton_key="acct_r", idempotency_key="idem_r")
        assert (await runtime.runs.find_active(task=work, singleton_key="acct_r")).id == retrying.id
        assert (await runtime.runs.find_active(task=work, idempotency_key="idem_r")).id == retrying.id
        released = await runtime.run_now(work, {"mode": "signal_forever"}, singleton_key="acct_s")
        assert (await runtime.runs.find_active(task=work, singleton_key="acct_s")).id == released.id
        await runtime.runs.cancel(released.id)
        assert await runtime.runs.find_active(task=work, singleton_key="acct_s") is None


async def test_find_active_with_both_keys_requires_a_run_matching_both():
    runtime, _ = make()
    async with runtime:
        active = (await runtime.trigger(keyed, {"order": 1, "account": "a"})).run
        assert (
            await runtime.runs.find_active(task=keyed, idempotency_key="order_1", singleton_key="acct_a")
        ).id == active.id
        assert await runtime.runs.find_active(task=keyed, idempotency_key="order_1", singleton_key="acct_zzz") is None
        assert await runtime.runs.find_active(task=keyed, idempotency_key="order_zzz", singleton_key="acct_a") is None


async def test_find_current_follows_idempotency_retention_rules():
    runtime, clock = make()
    async with runtime:
        await rejects(ErrorCode.TASK_NOT_FOUND, runtime.runs.find_current(task="ops.unknown", idempotency_key="k"))
        assert await runtime.runs.find_current(task=keyed, idempotency_key="order_1") is None

        # Active owner.
        live = (await runtime.trigger(keyed, {"order": 1, "account": "a"})).run
        assert (await runtime.runs.find_current(task=keyed, idempotency_key="order_1")).id == live.id
        # Task scoped: the same key on another task has no owner.
        assert await runtime.runs.find_current(task=keyed_other, idempotency_key="order_1") is None
        # Retained succeeded owner (default 30d).
        await runtime.execute_next()
        current = await runtime.runs.find_current(task=keyed, idempotency_key="order_1")
        assert current.id == live.id and current.status is RunStatus.SUCCEEDED
        # Retained cancelled owner.
        cancelled = (await runtime.trigger(keyed, {"order": 2, "account": "b"})).run
        await runtime.runs.cancel(cancelled.id)
        current = await runtime.runs.find_current(task=keyed, idempotency_key="order_2")
        assert current.id == cancelled.id and current.status is RunStatus.CANCELLED
        # A failed owner releases its key at once.
        failed = await runtime.run_now(keyed, {"order": 3, "account": "c", "fail": True})
        assert failed.status is RunStatus.FAILED
        assert await runtime.runs.find_current(task=keyed, idempotency_key="order_3") is None
        # ttl "active": released at any terminal state, returned while active.
        pending = (await runtime.trigger(active_ttl, {})).run
        assert (await runtime.runs.find_current(task=active_ttl, idempotency_key="fixed")).id == pending.id
        assert (await runtime.execute_next()).id == pending.id
        assert await runtime.runs.find_current(task=active_ttl, idempotency_key="fixed") is None
        # A finite ttl keeps the owner until it expires.
        short = await runtime.run_now(short_ttl, {})
        clock.advance("59m")
        assert (await runtime.runs.find_current(task=short_ttl, idempotency_key="fixed")).id == short.id
        clock.advance("2m")
        assert await runtime.runs.find_current(task=short_ttl, idempotency_key="fixed") is None
        # The 30d default also expires.
        clock.advance("30d")
        assert await runtime.runs.find_current(task=keyed, idempotency_key="order_1") is None


# ---------------------------------------------------------------------------------------------
# rerun and retry


async def test_rerun_accepts_every_terminal_source_and_links_a_new_child():
    runtime, clock = make()
    async with runtime:
        succeeded = await runtime.run_now(
            work, {"mode": "ok", "n": 1}, queue=EMAILS, trace_carrier={"traceparent": "s"}
        )
        failed = await runtime.run_now(work, {"mode": "fail", "n": 2})
        cancelled = (await runtime.trigger(work, {"mode": "ok", "n": 3}, queue=RECOVERY)).run
        cancelled = await runtime.runs.cancel(cancelled.id)
        for source in (succeeded, failed, cancelled):
            clock.advance("1m")
            before = await runtime.runs.get(source.id)
            events_before = await event_count(runtime, source.id)
            child = await runtime.runs.rerun(source.id)
            assert child.id != source.id
            assert child.status is RunStatus.QUEUED
            assert (child.source.type, child.source.source_run_id) == (RunSourceType.RERUN, source.id)
            assert (child.task_id, child.payload, child.queue) == (source.task_id, source.payload, source.queue)
            assert (child.counters.attempts, child.counters.failures, child.counters.retries) == (0, 0, 0)
            assert child.created_at == clock.now() and child.failure is None and not child.has_output
            assert child.trace_carrier == source.trace_carrier  # inherited when omitted
            created = (await all_events(runtime, child.id))[0].event
            assert created.type is RunEventType.CREATED and created.actor.type is ActorType.OPERATOR
            # The source is not mutated.
            assert await runtime.runs.get(source.id) == before
            assert await event_count(runtime, source.id) == events_before
            assert (await runtime.runs.get(child.id)).source.source_run_id == source.id
        # Children run like any other work.
        clock.advance("1m")
        outcomes = []
        while (run := await runtime.execute_next(queues=[DEFAULT, EMAILS, RECOVERY])) is not None:
            outcomes.append((run.source.type, run.status))
        assert sorted(outcomes) == sorted(
            [
                (RunSourceType.RERUN, RunStatus.SUCCEEDED),
                (RunSourceType.RERUN, RunStatus.FAILED),
                (RunSourceType.RERUN, RunStatus.SUCCEEDED),
            ]
        )


async def test_rerun_records_actor_meta_and_trace_carrier_overrides():
    runtime, _ = make()
    async with runtime:
        source = await runtime.run_now(work, {"mode": "ok"}, trace_carrier={"traceparent": "src"})
        child = await runtime.runs.rerun(
            source.id, actor=OPERATOR, meta={"reason": "provider_replay"}, trace_carrier={"traceparent": "own"}
        )
        assert child.meta == {"reason": "provider_replay"}
        assert child.trace_carrier == {"traceparent": "own"}
        created = (await all_events(runtime, child.id))[0].event
        assert created.actor == OPERATOR and created.meta == {"reason": "provider_replay"}
        retried_source = await runtime.run_now(work, {"mode": "fail"})
        recovery = await runtime.runs.retry(retried_source.id, actor=OPERATOR, meta={"ticket": 42})
        created = (await all_events(runtime, recovery.id))[0].event
        assert created.actor == OPERATOR and created.meta == {"ticket": 42}


async def test_rerun_and_retry_reject_active_sources_without_creating_children():
    gate = asyncio.Event()
    started = asyncio.Event()

    @task("ops.block", queue=RECOVERY)
    async def block(payload: dict, ctx: TaskContext) -> None:
        started.set()
        await gate.wait()

    runtime, _ = make(block)
    async with runtime:
        queued = (await runtime.trigger(work, {"mode": "ok"})).run
        bounded = (await runtime.trigger(work, {"mode": "ok"}, queue=BOUNDED)).run
        retrying = await runtime.run_now(work, {"mode": "retry"})
        released = await runtime.run_now(work, {"mode": "sleep"})
        waiting = await runtime.run_now(work, {"mode": "signal_forever"})
        running = (await runtime.trigger(block, {})).run
        pending = asyncio.ensure_future(runtime.execute_next(queues=[RECOVERY]))
        try:
            await asyncio.wait_for(started.wait(), 2)
            sources = [queued, bounded, retrying, released, waiting, running]
            statuses = [(await runtime.runs.get(run.id)).status for run in sources]
            assert statuses == [
                RunStatus.QUEUED,
                RunStatus.QUEUED,
                RunStatus.RETRYING,
                RunStatus.RELEASED,
                RunStatus.RELEASED,
                RunStatus.RUNNING,
            ]
            for source in sources:
                await rejects(ErrorCode.VALIDATION_FAILED, runtime.runs.rerun(source.id))
                await rejects(ErrorCode.VALIDATION_FAILED, runtime.runs.retry(source.id))
                assert await ids(runtime, source_run_id=source.id) == []
            # cancellation_requested is still active.
            requested = await runtime.runs.cancel(running.id)
            assert requested.status is RunStatus.CANCELLATION_REQUESTED
            await rejects(ErrorCode.VALIDATION_FAILED, runtime.runs.rerun(running.id))
            await rejects(ErrorCode.VALIDATION_FAILED, runtime.runs.retry(running.id))
            assert await ids(runtime, source_run_id=running.id) == []
        finally:
            gate.set()
            await asyncio.wait_for(pending, 2)
        await rejects(ErrorCode.RUN_NOT_FOUND, runtime.runs.rerun("run_missing"))


async def test_rerun_and_retry_of_an_active_run_say_how_to_get_a_finished_one():
    # A manual retry of a run that is still retrying must not point at rerun, which refuses it as well.
    runtime, _ = make()
    async with runtime:
        retrying = await runtime.run_now(work, {"mode": "retry"})
        assert retrying.status is RunStatus.RETRYING
        error = await rejects(ErrorCode.VALIDATION_FAILED, runtime.runs.retry(retrying.id))
        assert error.message == (
            f"Run {retrying.id} is still retrying; manual retry needs a failed run. Wait for it to finish "
            f"(runs.wait(), or runlane runs wait {retrying.id}): retry it if it failed, rerun it otherwise."
        )
        assert error.meta == {"run_id": retrying.id, "status": "retrying"}
        queued = (await runtime.trigger(work, {"mode": "ok"})).run
        error = await rejects(ErrorCode.VALIDATION_FAILED, runtime.runs.rerun(queued.id))
        assert error.message == (
            f"Run {queued.id} is still queued; only a finished run (succeeded, failed or cancelled) can be rerun. "
            f"Wait for it to finish (runs.wait(), or runlane runs wait {queued.id}), or cancel it and rerun it "
            "once it is cancelled."
        )
        assert await ids(runtime, source_run_id=retrying.id) == [] and await ids(runtime, source_run_id=queued.id) == []


async def test_retry_accepts_only_failed_sources():
    runtime, _ = make()
    async with runtime:
        failed = await runtime.run_now(work, {"mode": "fail", "n": 5}, queue=EMAILS)
        succeeded = await runtime.run_now(work, {"mode": "ok"})
        cancelled = await runtime.runs.cancel((await runtime.trigger(work, {"mode": "ok"})).run.id)
        for source in (succeeded, cancelled):
            await rejects(ErrorCode.VALIDATION_FAILED, runtime.runs.retry(source.id))
            assert await ids(runtime, source_run_id=source.id) == []
        before = await runtime.runs.get(failed.id)
        child = await runtime.runs.retry(failed.id)
        assert (child.source.type, child.source.source_run_id) == (RunSourceType.MANUAL_RETRY, failed.id)
        assert (child.task_id, child.payload, child.queue, child.status) == (
            "ops.work",
            {"mode": "fail", "n": 5},
            "emails",
            RunStatus.QUEUED,
        )
        assert child.counters.attempts == 0 and child.failure is None
        created = (await all_events(runtime, child.id))[0].event
        assert created.actor.type is ActorType.OPERATOR
        assert await runtime.runs.get(failed.id) == before
        # A failed source can be retried more than once; a failed child can be retried too.
        again = await runtime.runs.retry(failed.id)
        assert again.id != child.id
        assert await id_set(runtime, source_run_id=failed.id) == {child.id, again.id}
        done = await runtime.execute_next(queues=[EMAILS])
        assert done.status is RunStatus.FAILED
        grandchild = await runtime.runs.retry(done.id)
        assert grandchild.source.source_run_id == done.id
        await rejects(ErrorCode.RUN_NOT_FOUND, runtime.runs.retry("run_missing"))


async def test_rerun_and_retry_queue_overrides_must_be_registered():
    runtime, _ = make()
    async with runtime:
        failed = await runtime.run_now(work, {"mode": "fail"})
        child = await runtime.runs.rerun(failed.id, queue=RECOVERY)
        assert child.queue == "recovery"
        recovery = await runtime.runs.retry(failed.id, queue=EMAILS)
        assert recovery.queue == "emails"
        bounded = await runtime.runs.retry(failed.id, queue=BOUNDED)
        assert bounded.queue == "bounded"
        for linked in (runtime.runs.rerun, runtime.runs.retry):
            await rejects(ErrorCode.CONFIGURATION_INVALID, linked(failed.id, queue=queue("unregistered")))
            drifted = queue("recovery", concurrency_limit=5)
            await rejects(ErrorCode.CONFIGURATION_INVALID, linked(failed.id, queue=drifted))
        assert await id_set(runtime, source_run_id=failed.id) == {child.id, recovery.id, bounded.id}
        assert (await runtime.execute_next(queues=[RECOVERY])).id == child.id


async def test_rerun_and_retry_keep_the_sources_concurrency_key_on_a_bounded_queue():
    # The concurrency key names the resource the run uses (a tenant): a linked child stays in that
    # partition whether its queue is left out or named, and drops it only on an unbounded queue.
    runtime, _ = make()
    async with runtime:
        source = (await runtime.trigger(work, {"mode": "fail"}, queue=BOUNDED, concurrency_key="tenant_a")).run
        await runtime.tick()
        failed = await runtime.execute_next(queues=[BOUNDED])
        assert failed.id == source.id and failed.status is RunStatus.FAILED
        assert (await runtime.runs.retry(failed.id)).concurrency_key == "tenant_a"
        assert (await runtime.runs.retry(failed.id, queue=BOUNDED)).concurrency_key == "tenant_a"
        assert (await runtime.runs.rerun(failed.id, queue="bounded")).concurrency_key == "tenant_a"
        assert (await runtime.runs.rerun(failed.id, queue=RECOVERY)).concurrency_key is None


async def test_a_task_level_concurrency_key_is_dropped_when_a_retry_moves_to_an_unbounded_queue():
    @task("ops.tenant_import", queue=BOUNDED, concurrency_key=lambda payload: f"tenant_{payload['tenant']}")
    async def tenant_import(payload: dict) -> None:
        raise RuntimeError("provider down")

    runtime, _ = make(tenant_import)
    async with runtime:
        source = (await runtime.trigger(tenant_import, {"tenant": "t1"})).run
        await runtime.tick()
        failed = await runtime.execute_next(queues=[BOUNDED])
        assert failed.id == source.id and failed.status is RunStatus.FAILED
        moved = await runtime.runs.retry(failed.id, queue=RECOVERY)
        assert (moved.queue, moved.concurrency_key) == ("recovery", None)
        assert (await runtime.runs.rerun(failed.id)).concurrency_key == "tenant_t1"
        # A trigger onto that queue still refuses the key: there it is the caller's own choice.
        with pytest.raises(RunlaneError) as refused:
            await runtime.trigger(tenant_import, {"tenant": "t1"}, queue=RECOVERY)
        assert refused.value.code is ErrorCode.CONFIGURATION_INVALID


async def test_rerun_and_retry_use_an_explicit_child_run_id_and_report_duplicates():
    runtime, _ = make()
    async with runtime:
        failed = await runtime.run_now(work, {"mode": "fail"})
        child = await runtime.runs.rerun(failed.id, run_id="run_rerun_2026_user_1")
        assert child.id == "run_rerun_2026_user_1"
        assert (await runtime.runs.get("run_rerun_2026_user_1")).source.source_run_id == failed.id
        recovery = await runtime.runs.retry(failed.id, run_id="run_retry_2026_user_1")
        assert recovery.id == "run_retry_2026_user_1"
        # An existing id is a storage conflict, not an idempotent replay.
        before = await event_count(runtime, child.id)
        error = await rejects(ErrorCode.STORAGE_CONFLICT, runtime.runs.retry(failed.id, run_id=child.id))
        assert error.code is ErrorCode.STORAGE_CONFLICT
        await rejects(ErrorCode.STORAGE_CONFLICT, runtime.runs.rerun(failed.id, run_id=failed.id))
        assert await event_count(runtime, child.id) == before
        assert await id_set(runtime, source_run_id=failed.id) == {child.id, recovery.id}
        with pytest.raises(RunlaneError):
            await runtime.runs.rerun(failed.id, run_id="bad:id")


async def test_a_rerun_too_large_for_the_lane_names_what_the_call_adds_not_the_sources_payload():
    runtime, _ = make()
    async with runtime:
        source = await runtime.run_now(work, {"mode": "ok", "pad": "p" * 400_000}, meta={"big": "m" * 3000})
        assert source.status is RunStatus.SUCCEEDED
        # The source's meta stays with the source: the rerun fits without it.
        assert (await runtime.runs.rerun(source.id)).meta is None
        error = await rejects(ErrorCode.VALIDATION_FAILED, runtime.runs.rerun(source.id, meta={"note": "z" * 6000}))
        payload_bytes = len('{"mode":"ok","pad":""}') + 400_000
        meta_bytes = len('{"note":""}') + 6000
        assert (
            f"a rerun or retry repeats its source's payload ({payload_bytes:,} bytes), so give it a shorter run_id "
            f"or actor id, or less meta (its meta takes {meta_bytes:,} bytes)."
        ) in error.message
        assert len(await ids(runtime, source_run_id=source.id)) == 1  # the refused rerun wrote nothing


async def test_a_rerun_whose_payload_grew_under_the_current_schema_says_the_payload_is_too_large():
    class Small(BaseModel):
        pad: str

    class Grown(BaseModel):
        pad: str
        note: str = "n" * 3000  # a field added since, with a large default

    @task("ops.grows", schema=Small)
    async def small(payload) -> None:
        return None

    @task("ops.grows", schema=Grown)
    async def grown(payload) -> None:
        return None

    (before, after), _ = shared_store_runtimes([small], [grown])
    async with before, after:
        source = (await before.trigger(small, {"pad": "p" * 403_000})).run
        await before.runs.cancel(source.id)
        error = await rejects(ErrorCode.VALIDATION_FAILED, after.runs.rerun(source.id))
        # Nothing the call added is to blame (it added no meta, actor id or run id).
        assert "takes 0 bytes" not in error.message
        payload_bytes = len('{"note":"","pad":""}') + 3000 + 403_000
        assert f"its payload, the source's ({payload_bytes:,} bytes as the task's schema reads it now)" in error.message
        assert "leaves no room for a new run on this lane: trigger one with a smaller payload" in error.message
        assert await ids(before, source_run_id=source.id) == []


async def test_rerun_revalidates_the_persisted_payload_against_the_registered_task():
    class V1(BaseModel):
        user_id: str

    class V2(BaseModel):
        account_id: int

    class V3(BaseModel):
        user_id: str
        locale: str = "en"

    @task("ops.schema", schema=V1)
    async def schema_v1(payload) -> None:
        return None

    @task("ops.schema", schema=V2)
    async def schema_v2(payload) -> None:
        return None

    @task("ops.schema", schema=V3)
    async def schema_v3(payload) -> None:
        return None

    (old, incompatible, compatible, missing), _ = shared_store_runtimes(
        [schema_v1], [schema_v2], [schema_v3], [work]
    )
    async with old, incompatible, compatible, missing:
        source = await old.run_now(schema_v1, {"user_id": "u1"})
        assert source.status is RunStatus.SUCCEEDED
        second = await old.run_now(schema_v1, {"user_id": "u2"}, run_id="run_schema_second")
        # Changed incompatibly: linked creation fails instead of enqueueing a run workers reject.
        await rejects(ErrorCode.VALIDATION_FAILED, incompatible.runs.rerun(source.id))
        # Task no longer registered here.
        await rejects(ErrorCode.TASK_NOT_FOUND, missing.runs.rerun(source.id))
        assert await ids(old, source_run_id=source.id) == []
        # A compatible schema accepts the persisted payload.
        child = await compatible.runs.rerun(source.id)
        assert child.task_id == "ops.schema" and child.payload["user_id"] == "u1"
        assert await ids(old, source_run_id=source.id) == [child.id]
        assert second.status is RunStatus.SUCCEEDED
        await rejects(ErrorCode.VALIDATION_FAILED, incompatible.runs.rerun(second.id))
        await rejects(ErrorCode.VALIDATION_FAILED, incompatible.runs.retry(second.id))  # not failed either way


async def test_rerun_of_a_source_on_a_queue_this_runtime_does_not_register():
    (producer, other), _ = shared_store_runtimes([work], [work], queue_sets=[QUEUES, [DEFAULT]])
    async with producer, other:
        source = await producer.run_now(work, {"mode": "ok"}, queue=RECOVERY)
        # The caller named no queue: the error says the source's queue is gone and how to choose another.
        error = await rejects(ErrorCode.CONFIGURATION_INVALID, other.runs.rerun(source.id))
        assert f"Run {source.id} ran on queue 'recovery', which is not registered" in error.message
        assert "pass a registered queue (queue=, or --queue) to rerun it there" in error.message
        assert error.meta == {"field": "queue", "queue": "recovery", "run_id": source.id}
        failed = await producer.run_now(work, {"mode": "fail"}, queue=RECOVERY)
        error = await rejects(ErrorCode.CONFIGURATION_INVALID, other.runs.retry(failed.id))
        assert "to retry it there" in error.message
        assert await ids(other, source_run_id=source.id) == [] and await ids(other, source_run_id=failed.id) == []
        child = await other.runs.rerun(source.id, queue=DEFAULT)
        assert child.queue == "default"


async def test_linked_children_do_not_reuse_idempotency_keys():
    runtime, _ = make()
    async with runtime:
        source = await runtime.run_now(keyed, {"order": 1, "account": "a"})
        assert source.idempotency_key == "order_1"
        child = await runtime.runs.rerun(source.id)
        assert child.idempotency_key is None
        # The source keeps ownership: a duplicate trigger still returns it, not the child.
        duplicate = await runtime.trigger(keyed, {"order": 1, "account": "zzz"})
        assert duplicate.outcome is TriggerOutcomeType.RETURNED_EXISTING and duplicate.run.id == source.id
        assert (await runtime.runs.find_current(task=keyed, idempotency_key="order_1")).id == source.id
        assert await id_set(runtime, idempotency_key="order_1") == {source.id}
        # A failed source released its key; its manual retry does not take it either.
        await runtime.runs.cancel(child.id)
        failed = await runtime.run_now(keyed, {"order": 2, "account": "b", "fail": True})
        recovery = await runtime.runs.retry(failed.id)
        assert recovery.idempotency_key is None
        assert await runtime.runs.find_current(task=keyed, idempotency_key="order_2") is None
        await runtime.runs.cancel(recovery.id)
        fresh = await runtime.trigger(keyed, {"order": 2, "account": "b"})
        assert fresh.outcome is TriggerOutcomeType.CREATED and fresh.run.id not in (failed.id, recovery.id)


async def test_linked_children_still_respect_singleton_keys():
    runtime, _ = make()
    async with runtime:
        source = await runtime.run_now(keyed, {"order": 1, "account": "a", "fail": True})
        assert source.status is RunStatus.FAILED and source.singleton_key == "acct_a"
        holder = (await runtime.trigger(keyed, {"order": 2, "account": "a"})).run
        for linked in (runtime.runs.rerun, runtime.runs.retry):
            error = await rejects(ErrorCode.STORAGE_CONFLICT, linked(source.id))
            assert get_storage_conflict_kind(error) is StorageConflictKind.SINGLETON_KEY
        assert await ids(runtime, source_run_id=source.id) == []
        await runtime.runs.cancel(holder.id)
        child = await runtime.runs.retry(source.id)
        assert child.singleton_key == "acct_a"
        # The active child now holds the resource.
        error = await rejects(ErrorCode.STORAGE_CONFLICT, runtime.trigger(keyed, {"order": 3, "account": "a"}))
        assert get_storage_conflict_kind(error) is StorageConflictKind.SINGLETON_KEY
        assert (await runtime.runs.find_active(task=keyed, singleton_key="acct_a")).id == child.id


async def test_linked_children_keep_a_singleton_key_the_source_was_triggered_with():
    runtime, _ = make()
    async with runtime:
        source = await runtime.run_now(work, {"mode": "fail"}, singleton_key="export_7")
        assert source.status is RunStatus.FAILED and source.singleton_key == "export_7"
        holder = (await runtime.trigger(work, {"mode": "ok"}, singleton_key="export_7")).run
        for linked in (runtime.runs.rerun, runtime.runs.retry):
            error = await rejects(ErrorCode.STORAGE_CONFLICT, linked(source.id))
            assert get_storage_conflict_kind(error) is StorageConflictKind.SINGLETON_KEY
        await runtime.runs.cancel(holder.id)
        child = await runtime.runs.rerun(source.id)
        assert child.singleton_key == "export_7"


# ---------------------------------------------------------------------------------------------
# idempotency_keys.reset


async def test_reset_clears_a_retained_terminal_owner_so_a_new_trigger_creates_a_run():
    runtime, _ = make()
    async with runtime:
        first = await runtime.run_now(keyed, {"order": 1, "account": "a"})
        other_task = await runtime.run_now(keyed_other, {"order": 1})
        assert (await runtime.trigger(keyed, {"order": 1, "account": "a"})).run.id == first.id
        await runtime.idempotency_keys.reset(keyed, key="order_1")
        assert await runtime.runs.find_current(task=keyed, idempotency_key="order_1") is None
        # Only this task's owner is cleared.
        assert (await runtime.runs.find_current(task=keyed_other, idempotency_key="order_1")).id == other_task.id
        # History is kept.
        assert (await runtime.runs.get(first.id)).status is RunStatus.SUCCEEDED
        second = await runtime.trigger(keyed, {"order": 1, "account": "a"})
        assert second.outcome is TriggerOutcomeType.CREATED and second.run.id != first.id
        assert (await runtime.runs.find_current(task=keyed, idempotency_key="order_1")).id == second.run.id
        # A cancelled retained owner can be reset too (by task id).
        await runtime.runs.cancel(second.run.id)
        await runtime.idempotency_keys.reset("ops.keyed", key="order_1")
        third = await runtime.trigger(keyed, {"order": 1, "account": "a"})
        assert third.outcome is TriggerOutcomeType.CREATED
        await rejects(ErrorCode.TASK_NOT_FOUND, runtime.idempotency_keys.reset("ops.unknown", key="order_1"))


async def test_reset_rejects_an_active_owner_and_changes_nothing():
    runtime, _ = make()
    async with runtime:
        active = (await runtime.trigger(keyed, {"order": 1, "account": "a"})).run
        before = await runtime.runs.get(active.id)
        events_before = await event_count(runtime, active.id)
        await rejects(ErrorCode.VALIDATION_FAILED, runtime.idempotency_keys.reset(keyed, key="order_1"))
        assert await runtime.runs.get(active.id) == before
        assert await event_count(runtime, active.id) == events_before
        assert (await runtime.runs.find_current(task=keyed, idempotency_key="order_1")).id == active.id
        duplicate = await runtime.trigger(keyed, {"order": 1, "account": "a"})
        assert duplicate.outcome is TriggerOutcomeType.RETURNED_EXISTING and duplicate.run.id == active.id
        # Released (business-waiting) owners are active as well.
        waiting = await runtime.run_now(work, {"mode": "sleep"}, idempotency_key="wait_1")
        assert waiting.status is RunStatus.RELEASED
        await rejects(ErrorCode.VALIDATION_FAILED, runtime.idempotency_keys.reset(work, key="wait_1"))
        assert (await runtime.runs.find_current(task=work, idempotency_key="wait_1")).id == waiting.id


# ---------------------------------------------------------------------------------------------
# cancel


async def test_cancel_records_actor_reason_and_meta_and_terminal_runs_cannot_be_cancelled_again():
    runtime, clock = make()
    async with runtime:
        run = (await runtime.trigger(work, {"mode": "ok"})).run
        clock.advance("1m")
        cancelled = await runtime.runs.cancel(
            run.id, actor=OPERATOR, reason="operator_requested", meta={"ticket": "OPS-1"}
        )
        assert cancelled.status is RunStatus.CANCELLED and cancelled.finished_at == clock.now()
        (record,) = (await runtime.runs.events(run.id, types=[RunEventType.CANCELLED])).data
        event = record.event
        assert (event.actor, event.reason, event.meta, event.occurred_at) == (
            OPERATOR,
            "operator_requested",
            {"ticket": "OPS-1"},
            clock.now(),
        )
        # Default actor is the operator.
        other = (await runtime.trigger(work, {"mode": "ok"})).run
        await runtime.runs.cancel(other.id)
        (record,) = (await runtime.runs.events(other.id, types=["run.cancelled"])).data
        assert record.event.actor.type is ActorType.OPERATOR and record.event.reason is None

        succeeded = await runtime.run_now(work, {"mode": "ok"})
        failed = await runtime.run_now(work, {"mode": "fail"})
        clock.advance("1m")
        for terminal in (cancelled, succeeded, failed):
            before = await runtime.runs.get(terminal.id)
            count = await event_count(runtime, terminal.id)
            for _ in range(2):
                await rejects(ErrorCode.VALIDATION_FAILED, runtime.runs.cancel(terminal.id, reason="again"))
            assert await runtime.runs.get(terminal.id) == before
            assert await event_count(runtime, terminal.id) == count
        await rejects(ErrorCode.RUN_NOT_FOUND, runtime.runs.cancel("run_missing"))


async def test_repeated_cancel_of_a_cancellation_requested_run_adds_no_event():
    started = asyncio.Event()
    gate = asyncio.Event()
    seen: list[bool] = []

    @task("ops.cooperative_cancel")
    async def cooperative(payload: dict, ctx: TaskContext) -> str:
        started.set()
        await gate.wait()  # ignores the signal until the test lets it finish
        seen.append(ctx.is_cancellation_requested())
        return "stopped"

    runtime, clock = make(cooperative)
    async with runtime:
        run = (await runtime.trigger(cooperative, {})).run
        pending = asyncio.ensure_future(runtime.execute_next())
        try:
            await asyncio.wait_for(started.wait(), 2)
            clock.advance("1s")
            requested = await runtime.runs.cancel(run.id, actor=OPERATOR, reason="first", meta={"n": 1})
            assert requested.status is RunStatus.CANCELLATION_REQUESTED
            (record,) = (await runtime.runs.events(run.id, types=["run.cancellation_requested"])).data
            assert (record.event.actor, record.event.reason, record.event.meta) == (OPERATOR, "first", {"n": 1})
            count = await event_count(runtime, run.id)
            clock.advance("1s")
            again = await runtime.runs.cancel(run.id, reason="second")
            assert again.status is RunStatus.CANCELLATION_REQUESTED and again.id == run.id
            assert again.event_sequence == requested.event_sequence
            assert await event_count(runtime, run.id) == count
        finally:
            gate.set()
            finished = await asyncio.wait_for(pending, 2)
        assert seen == [True]
        assert finished.status is RunStatus.CANCELLED
        types = [r.event.type for r in await all_events(runtime, run.id)]
        assert types.count(RunEventType.CANCELLATION_REQUESTED) == 1 and types[-1] is RunEventType.CANCELLED
        count = len(types)
        await rejects(ErrorCode.VALIDATION_FAILED, runtime.runs.cancel(run.id))
        assert await event_count(runtime, run.id) == count


# ---------------------------------------------------------------------------------------------
# Scoping and keyset continuation


def production_and_staging() -> tuple[Any, Any]:
    """Runtimes of the environments ``production`` and ``staging`` over one store, on one clock."""
    clock = ControlledClock()
    store = LocalStorageStore()

    def runtime_for(environment: str):
        lane = create_lane(
            storage=local_storage_driver(store=store, clock=clock),
            delivery=LaneDelivery(mode=LaneDeliveryMode.STORAGE_POLLING),
            name=f"lane-{environment}",
        )
        return create_runlane(lane=lane, queues=QUEUES, tasks=ALL_TASKS, clock=clock, environment=environment)

    return runtime_for("production"), runtime_for("staging")


async def test_operator_reads_and_actions_are_scoped_to_the_runtime_environment():
    production, staging = production_and_staging()
    async with production, staging:
        failed = await production.run_now(keyed, {"order": 1, "account": "a", "fail": True})
        done = await production.run_now(keyed, {"order": 2, "account": "b"})
        queued = (await production.trigger(work, {"mode": "ok"}, idempotency_key="q_1", singleton_key="s_1")).run
        assert (await production.runs.find_active(task=work, singleton_key="s_1")).id == queued.id
        assert await staging.runs.get(failed.id) is None
        assert await ids(staging) == []
        assert await ids(staging, source_run_id=failed.id) == []
        await rejects(ErrorCode.RUN_NOT_FOUND, staging.runs.events(failed.id))
        await rejects(ErrorCode.RUN_NOT_FOUND, staging.runs.attempts(failed.id))
        await rejects(ErrorCode.RUN_NOT_FOUND, staging.runs.rerun(failed.id))
        await rejects(ErrorCode.RUN_NOT_FOUND, staging.runs.retry(failed.id))
        await rejects(ErrorCode.RUN_NOT_FOUND, staging.runs.cancel(queued.id))
        assert await staging.runs.find_current(task=keyed, idempotency_key="order_2") is None
        assert await staging.runs.find_current(task=work, idempotency_key="q_1") is None
        assert await staging.runs.find_active(task=work, idempotency_key="q_1") is None
        assert await staging.runs.find_active(task=work, singleton_key="s_1") is None
        # The staging key space is independent: a staging trigger creates its own run.
        own = await staging.trigger(keyed, {"order": 2, "account": "b"})
        assert own.outcome is TriggerOutcomeType.CREATED and own.run.id != done.id
        assert (await production.runs.get(queued.id)).status is RunStatus.QUEUED
        assert await id_set(production) == {failed.id, done.id, queued.id}


async def test_a_list_or_events_cursor_of_another_environment_is_refused_as_one():
    production, staging = production_and_staging()
    async with production, staging:
        for runtime in (production, staging):  # the same run ids in both
            for number in range(2):
                await runtime.trigger(work, {"mode": "ok"}, run_id=f"run_{number}")
        listing = (await production.runs.list(limit=1)).next_cursor
        events = (await production.runs.events("run_0", limit=1)).next_cursor
        assert listing is not None and events is not None
        other = "This cursor belongs to another environment; restart the listing without a cursor."
        for call in (staging.runs.list(limit=1, cursor=listing), staging.runs.events("run_0", limit=1, cursor=events)):
            assert (await rejects(ErrorCode.VALIDATION_FAILED, call)).message == other
        # Within one environment, another filter is still told apart from another environment.
        filtered = production.runs.list(limit=1, cursor=listing, statuses=["queued"])
        refused = await rejects(ErrorCode.VALIDATION_FAILED, filtered)
        assert "belongs to a different filter or sort" in refused.message
        assert len((await production.runs.list(limit=1, cursor=listing)).data) == 1


async def test_list_cursor_continues_by_key_when_runs_are_created_between_pages():
    runtime, clock = make()
    async with runtime:
        created = []
        for _ in range(4):
            clock.advance("1s")
            created.append((await runtime.trigger(work, {"mode": "ok"})).run.id)
        asc = await runtime.runs.list(limit=2, sort_direction="asc")
        desc = await runtime.runs.list(limit=2, sort_direction="desc")
        clock.advance("1s")
        newer = (await runtime.trigger(work, {"mode": "ok"})).run.id
        asc_rest, _ = await paged_ids(runtime, 2, sort_direction="asc", cursor_start=asc.next_cursor)
        desc_rest, _ = await paged_ids(runtime, 2, sort_direction="desc", cursor_start=desc.next_cursor)
        # Ascending: the new run sorts after the cursor and appears once, at the end.
        assert [s.id for s in asc.data] + asc_rest == created + [newer]
        # Descending: the new run sorts before the cursor and is not repeated or inserted.
        assert [s.id for s in desc.data] + desc_rest == list(reversed(created))


async def test_attempts_cover_histories_longer_than_one_event_page():
    @task("ops.poll_many")
    async def poll_many(payload: dict, ctx: TaskContext) -> Any:
        if ctx.attempt < 40:
            return ctx.release("1s", reason=f"poll_{ctx.attempt}")
        return {"polls": ctx.attempt}

    runtime, clock = make(poll_many)
    async with runtime:
        run = (await runtime.trigger(poll_many, {})).run
        for _ in range(40):
            assert (await runtime.execute_next()).id == run.id
            clock.advance("1s")
        final = await runtime.runs.get(run.id)
        assert final.status is RunStatus.SUCCEEDED
        assert final.event_sequence > contract_defaults.pagination.max_limit
        attempts = await runtime.runs.attempts(run.id)
        assert [a.attempt for a in attempts] == list(range(1, 41))
        assert all(a.status is RunAttemptStatus.RELEASED for a in attempts[:-1])
        assert [a.release_reason for a in attempts[:-1]] == [f"poll_{n}" for n in range(1, 40)]
        assert attempts[-1].status is RunAttemptStatus.SUCCEEDED and attempts[-1].output == {"polls": 40}


async def test_rerun_of_a_task_without_payload():
    @task("ops.no_payload")
    async def no_payload() -> None:
        return None

    runtime, _ = make(no_payload)
    async with runtime:
        source = await runtime.run_now(no_payload)
        child = await runtime.runs.rerun(source.id)
        assert child.payload is None and child.source.type is RunSourceType.RERUN
        assert (await runtime.execute_next()).status is RunStatus.SUCCEEDED


async def test_a_lane_without_operator_reads_refuses_every_operator_read_and_read_backed_action():
    from runlane import LaneDelivery, LaneDeliveryMode, create_lane, create_runlane, queue, task
    from runlane_local import local_storage_driver

    default = queue("default", default=True)

    @task("no.reads", queue=default)
    async def no_reads(payload: dict) -> str:
        return "done"

    lane = create_lane(
        storage=local_storage_driver(),
        delivery=LaneDelivery(mode=LaneDeliveryMode.STORAGE_POLLING),
        operator_reads=False,
    )
    runtime = create_runlane(lane=lane, queues=[default], tasks=[no_reads])
    async with runtime:
        waiting = (await runtime.trigger(no_reads, {}, idempotency_key="k", singleton_key="s")).run
        calls = {
            "get": lambda: runtime.runs.get(waiting.id),
            "list": lambda: runtime.runs.list(),
            "events": lambda: runtime.runs.events(waiting.id),
            "attempts": lambda: runtime.runs.attempts(waiting.id),
            "find_active": lambda: runtime.runs.find_active(task=no_reads, singleton_key="s"),
            "find_current": lambda: runtime.runs.find_current(task=no_reads, idempotency_key="k"),
            "cancel": lambda: runtime.runs.cancel(waiting.id),
            "rerun": lambda: runtime.runs.rerun(waiting.id),
            "retry": lambda: runtime.runs.retry(waiting.id),
        }
        for name, call in calls.items():
            with pytest.raises(RunlaneError) as raised:
                await call()
            assert raised.value.code is ErrorCode.CAPABILITY_UNSUPPORTED, name
            assert "operator_reads=True" in raised.value.message
        # The refused cancel changed nothing: the run still executes.
        done = await runtime.execute_next()
        assert done.id == waiting.id and done.status is RunStatus.SUCCEEDED


async def test_bad_list_and_event_options_name_the_option_and_what_it_must_be():
    runtime, _ = make()
    async with runtime:
        run = await runtime.run_now(work, {"mode": "ok"})
        cases = [
            (runtime.runs.list(limit=0), "Invalid run list options: limit must be greater than or equal to 1 (got 0)."),
            (runtime.runs.list(sort_by="name"), "sort_by must be 'created_at', 'run_at' or 'updated_at' (got 'name')"),
            (
                runtime.runs.events(run.id, limit=-1),
                "Invalid run event options: limit must be greater than or equal to 1",
            ),
            (runtime.runs.list(limit=True), "limit must be a whole number, got True."),
            (runtime.runs.events(run.id, limit="2"), "limit must be a whole number, got '2'."),
            (runtime.runs.list(idempotency_key="a:b"), "Invalid idempotency key 'a:b': ':' is reserved"),
            (runtime.runs.list(singleton_key=""), "Invalid singleton key: it must not be empty."),
            (runtime.runs.list(source_run_id="run:1"), "Invalid source run id 'run:1'"),
            (runtime.runs.list(task_ids=["emails.send", "a:b"]), "Invalid task id 'a:b'"),
        ]
        for call, expected in cases:
            error = await rejects(ErrorCode.VALIDATION_FAILED, call)
            assert expected in error.message
            assert "pydantic" not in error.message and "validation error for" not in error.message


def test_a_time_range_built_with_bad_bounds_is_validation_failed():
    from datetime import UTC, date, datetime

    from runlane.storage import TimeRange

    for bounds, says in (
        ({"start": datetime(2030, 1, 1, tzinfo=UTC), "end": datetime(2020, 1, 1, tzinfo=UTC)}, "must not end before"),
        ({"start": datetime(2030, 1, 1)}, "start: datetimes must be timezone-aware"),
        ({"start": date(2030, 1, 1)}, "such as datetime(2026, 1, 1, tzinfo=UTC) or datetime.now(UTC); a date"),
    ):
        with pytest.raises(RunlaneError) as raised:
            TimeRange(**bounds)
        assert raised.value.code is ErrorCode.VALIDATION_FAILED and says in raised.value.message
    assert TimeRange(start=datetime(2030, 1, 1, tzinfo=UTC)).end is None


async def test_one_bare_string_is_one_filter_value():
    runtime, _ = make()
    async with runtime:
        run = await runtime.run_now(work, {"mode": "ok"})
        assert [s.id for s in (await runtime.runs.list(task_ids=work.id)).data] == [run.id]
        # A task definition stands for its id, as in trigger().
        assert [s.id for s in (await runtime.runs.list(task_ids=[work])).data] == [run.id]
        assert [s.id for s in (await runtime.runs.list(task_ids=work)).data] == [run.id]
        assert [s.id for s in (await runtime.runs.list(task_ids=[work, work.id])).data] == [run.id]
        assert [s.id for s in (await runtime.runs.list(statuses="succeeded")).data] == [run.id]
        assert (await runtime.runs.list(statuses="queued")).data == []
        events = (await runtime.runs.events(run.id, types="run.succeeded")).data
        assert [record.event.type for record in events] == ["run.succeeded"]


async def test_wait_returns_a_run_once_it_has_finished_elsewhere():
    """A producer that needs a result: the run finishes on a worker while the producer waits."""
    from runlane import WorkerMode

    @task("reports.render")
    async def render(payload: dict) -> dict:
        await asyncio.sleep(0.05)
        return {"pages": payload["pages"]}

    runtime = create_runlane(lane=local_lane(), queues=[DEFAULT], tasks=[render])
    async with runtime:
        run = (await runtime.trigger(render, {"pages": 3})).run
        waiting = asyncio.ensure_future(runtime.runs.wait(run.id, timeout="10s"))
        await asyncio.sleep(0.02)
        assert not waiting.done()
        worker = runtime.worker(mode=WorkerMode.POLL, empty_poll_delay="10ms")
        try:
            done = await asyncio.wait_for(waiting, 10)
        finally:
            await worker.stop()
        assert done.status is RunStatus.SUCCEEDED and done.output == {"pages": 3}
        assert (await runtime.runs.wait(run.id)).output == {"pages": 3}  # finished: returned at once


async def test_wait_returns_as_soon_as_this_process_commits_the_outcome(monkeypatch):
    # Reads between commits are only for runs finishing in other processes: with them an hour apart,
    # a run this process finishes still ends the wait at once.
    import runlane.core.runtime as runtime_module

    monkeypatch.setattr(runtime_module, "_WAIT_FIRST_S", 3600.0)

    @task("reports.quick")
    async def quick(payload: dict) -> str:
        return "done"

    runtime = create_runlane(lane=local_lane(), queues=[DEFAULT], tasks=[quick])
    async with runtime:
        run = (await runtime.trigger(quick, {})).run
        waiting = asyncio.ensure_future(runtime.runs.wait(run.id))
        await asyncio.sleep(0.01)
        assert not waiting.done()
        assert (await runtime.execute_next()).status is RunStatus.SUCCEEDED
        assert (await asyncio.wait_for(waiting, 5)).output == "done"
        assert runtime._finish_waiters == {}  # nothing left registered


async def test_a_wait_left_on_a_closed_event_loop_does_not_fail_the_run_that_finishes():
    # A thread's loop that stopped and closed with a runs.wait() still pending (a web framework torn down):
    # the commit of that run's outcome elsewhere must not fail over the waiter nobody listens to any more.
    import threading

    from runlane import WorkerMode

    @task("reports.orphaned")
    async def orphaned(payload: dict) -> str:
        return "done"

    runtime = create_runlane(lane=local_lane(), queues=[DEFAULT], tasks=[orphaned])
    async with runtime:
        run = (await runtime.trigger(orphaned, {})).run

        def abandoned_waiter() -> None:
            loop = asyncio.new_event_loop()
            loop.create_task(runtime.runs.wait(run.id))
            loop.call_later(0.05, loop.stop)
            loop.run_forever()
            loop.close()

        thread = threading.Thread(target=abandoned_waiter)
        thread.start()
        thread.join(10)
        worker = runtime.worker(mode=WorkerMode.DRAIN)
        await asyncio.wait_for(worker.closed, 10)  # raised RuntimeError("Event loop is closed") before
        assert worker.executed == 1
        assert (await runtime.runs.get(run.id)).status is RunStatus.SUCCEEDED


async def test_wait_reports_a_missing_run_and_a_timeout_with_the_status_it_saw():
    @task("reports.parked")
    async def parked(payload: dict) -> None:
        return None

    runtime = create_runlane(lane=local_lane(), queues=[DEFAULT], tasks=[parked])
    async with runtime:
        with pytest.raises(RunlaneError) as raised:
            await runtime.runs.wait("run_missing", timeout="1s")
        assert raised.value.code is ErrorCode.RUN_NOT_FOUND
        run = (await runtime.trigger(parked, {})).run  # no worker: it stays queued
        with pytest.raises(TimeoutError, match=f"Run {run.id} is still queued after 50ms"):
            await runtime.runs.wait(run.id, timeout="50ms")
        with pytest.raises(RunlaneError) as raised:
            await runtime.runs.wait(run.id, timeout="soon")
        assert raised.value.code is ErrorCode.CONFIGURATION_INVALID


def test_the_sync_facade_waits_for_a_run_from_plain_code():
    import threading

    @task("reports.sync")
    def render(payload: dict) -> str:
        return "rendered"

    runtime = create_runlane(lane=local_lane(), queues=[DEFAULT], tasks=[render])
    try:
        run = runtime.sync.trigger(render, {}).run
        executed = threading.Timer(0.05, runtime.sync.execute_next)
        executed.start()
        assert runtime.sync.runs.wait(run.id, timeout="10s").output == "rendered"
        executed.join(5)
    finally:
        runtime.sync.close()


def test_a_handler_waiting_for_its_own_run_is_refused_instead_of_waiting_for_ever():
    """The run cannot finish before its handler returns: runs.wait() of it from that handler (awaited, through
    runlane.sync from a def handler, on a worker of the facade loop or of another loop) never returned and
    held its worker slot; it is refused. A task the handler starts may wait for the run to end."""
    import threading

    @task("reports.waits.for.itself")
    async def waits(payload: dict, ctx: TaskContext) -> str:
        try:
            await runtime.runs.wait(ctx.run_id, timeout="1h")
        except RunlaneError as error:
            refused.append(error)
        background.append(asyncio.create_task(runtime.runs.wait(ctx.run_id)))  # ends once the run has
        return "done"

    @task("reports.waits.for.itself.sync")
    def waits_sync(payload: dict, ctx: TaskContext) -> str:
        try:
            runtime.sync.runs.wait(ctx.run_id, timeout="1h")
        except RunlaneError as error:
            refused.append(error)
        return "done"

    refused: list[RunlaneError] = []
    background: list[asyncio.Task[Any]] = []
    runtime = create_runlane(lane=local_lane(), queues=[DEFAULT], tasks=[waits, waits_sync])
    try:
        for definition in (waits, waits_sync):
            run = runtime.sync.trigger(definition, {}).run
            worker = runtime.sync.worker(mode=WorkerMode.DRAIN)
            worker.wait(10)
            assert runtime.sync.runs.get(run.id).output == "done"
        assert runtime.sync.call(lambda: asyncio.wait_for(background[0], 5)).output == "done"

        async def on_a_loop_of_its_own() -> str:  # the def handler's worker on another loop than the facade's
            await runtime.trigger(waits_sync, {})
            return (await asyncio.wait_for(runtime.execute_next(), 10)).output

        outcome: list[str] = []
        thread = threading.Thread(target=lambda: outcome.append(asyncio.run(on_a_loop_of_its_own())))
        thread.start()
        thread.join(10)
        assert outcome == ["done"]
        assert [error.code for error in refused] == [ErrorCode.CONFIGURATION_INVALID] * 3
        assert "was called by the handler of run" in refused[0].message
        assert refused[0].message.startswith("runs.wait()")
        assert refused[1].message.startswith("runlane.sync.runs.wait()")
    finally:
        runtime.sync.close()


@pytest.mark.parametrize(
    ("listing", "position"),
    [
        ("created_at", ["not a time", "run_x"]),
        ("run_at", ["0", "yesterday", "run_x"]),
        ("events", ["00000000000000000abc"]),
    ],
)
async def test_a_cursor_whose_position_was_edited_is_refused_not_read_as_an_empty_or_first_page(
    listing: str, position: list[str]
) -> None:
    """A position of the right shape but not a time, sequence or id (edited by hand, or cut short) would
    give an empty page, which reads as the end of the listing, or the first page again."""
    from runlane.storage.cursor import decode_opaque_token, encode_opaque_token

    runtime, clock = make()
    async with runtime:
        for _ in range(3):
            run = (await runtime.trigger(mail, {})).run
            clock.advance("1s")

        async def page(cursor: str | None = None) -> Any:
            if listing == "events":
                return await runtime.runs.events(run.id, limit=1, cursor=cursor)
            return await runtime.runs.list(limit=1, sort_by=listing, cursor=cursor)

        cursor = (await page()).next_cursor
        assert cursor is not None
        edited = encode_opaque_token({**decode_opaque_token(cursor), "last": position})
        with pytest.raises(RunlaneError) as caught:
            await page(edited)
        assert caught.value.code is ErrorCode.VALIDATION_FAILED and caught.value.message == "Malformed cursor position."
        assert len((await page(cursor)).data) == 1  # the cursor as given still works
