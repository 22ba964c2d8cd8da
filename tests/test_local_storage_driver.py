"""Behaviour specific to the in-memory reference storage driver (``runlane_local``)."""

from __future__ import annotations

import asyncio
import random
import threading
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from runlane.errors import ErrorCode, RunlaneError, StorageConflictKind, is_storage_conflict
from runlane.models import Actor, Environment, RunCreatedEvent, RunEventRecord, RunRecord
from runlane.storage import (
    NewStorageRecord,
    OperatorReadDriver,
    PaginationParams,
    RunEventFilter,
    RunFilter,
    StorageAppendCommand,
    StorageCandidateMode,
    StorageClockAuthority,
    StorageDocument,
    StorageDriver,
    StorageDurability,
    StorageIndexConsistency,
    StorageIndexEntry,
    StorageIndexName,
    StorageLimitError,
    StorageLimits,
    StorageQuery,
    StorageRange,
    StorageRecord,
    StorageRecordKey,
    StorageStreamName,
    encode_storage_tuple,
    storage_stream_layouts,
    supports_operator_reads,
)
from runlane.storage.tables import (
    decode_run_document,
    encode_run_document,
    encode_run_event_document,
    run_event_key,
    run_key,
    run_tombstone_key,
)
from runlane.testing.clock import ControlledClock
from runlane.vocabulary import ActorType, RunStatus, SortDirection
from runlane_local import LocalStorageDriver, LocalStorageStore, local_storage_driver

INDEX = StorageIndexName.OUTBOX_DUE
PARTITION = ("env",)
STREAM = storage_stream_layouts[StorageStreamName.OBSERVATIONS]
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def key(name: str) -> StorageRecordKey:
    return StorageRecordKey("items", name)


def record(name: str, value: object = None, *, sort: str | None = None) -> NewStorageRecord:
    entries = () if sort is None else (StorageIndexEntry(INDEX, PARTITION, (sort, name)),)
    return NewStorageRecord(key(name), StorageDocument.encode({"value": value}), entries)


async def put(driver: LocalStorageDriver, *records: NewStorageRecord) -> None:
    async def write(tx):
        for item in records:
            tx.create(item)

    await driver.with_transaction(write)


async def value_of(driver: LocalStorageDriver, name: str) -> object:
    [found] = await driver.get([key(name)])
    return None if found is None else found.document.value["value"]


def query(**options) -> StorageQuery:
    return StorageQuery(INDEX, PARTITION, **options)


async def all_keys(driver: LocalStorageDriver, **options) -> list[str]:
    names, cursor = [], None
    while True:
        result = await driver.query(query(cursor=cursor, **options))
        names.extend(item.key.parts[0] for item in result.items)
        if result.next_cursor is None:
            return names
        cursor = result.next_cursor


def assert_contract_violation(error: pytest.ExceptionInfo[RunlaneError]) -> None:
    assert error.value.code is ErrorCode.ADAPTER_CONTRACT_VIOLATION


# ---------------------------------------------------------------------------------------------
# Profile, configuration, lifecycle


async def test_default_profile_and_limits() -> None:
    driver = local_storage_driver()
    assert isinstance(driver, StorageDriver) and isinstance(driver, OperatorReadDriver)
    assert supports_operator_reads(driver)
    assert driver.name == "local-memory-storage"
    assert driver.max_transaction_attempts == 16
    profile = driver.profile
    assert profile.durability is StorageDurability.PROCESS
    assert profile.clock_authority is StorageClockAuthority.CLIENT
    assert profile.index_consistency is StorageIndexConsistency.STRONG
    assert profile.exclusive_candidates and profile.ordered_append and profile.process_local
    assert profile.limits == StorageLimits(
        max_point_reads=100,
        max_query_results=100,
        max_record_bytes=400 * 1024,
        max_transaction_records=100,
        max_transaction_bytes=4 * 1024 * 1024,
    )


async def test_configuration_is_validated() -> None:
    for options in ({"max_transaction_attempts": 0}, {"limits": {}}, {"clock": object()}, {"store": {}}, {"name": ""}):
        with pytest.raises(RunlaneError) as error:
            local_storage_driver(**options)
        assert error.value.code is ErrorCode.CONFIGURATION_INVALID


async def test_injected_limits_and_name() -> None:
    limits = StorageLimits(
        max_point_reads=2,
        max_query_results=3,
        max_record_bytes=1000,
        max_transaction_records=4,
        max_transaction_bytes=4000,
    )
    driver = local_storage_driver(limits=limits, name="custom")
    assert driver.profile.limits is limits and driver.name == "custom"
    with pytest.raises(StorageLimitError) as error:
        await driver.get([key("a"), key("b"), key("c")])
    assert (error.value.limit, error.value.allowed, error.value.actual) == ("max_point_reads", 2, 3)
    with pytest.raises(StorageLimitError):
        await driver.query(query(limit=4))
    assert (await driver.query(query(limit=3))).items == ()


async def test_closed_driver_refuses_work_until_started() -> None:
    driver = local_storage_driver()
    await driver.start()
    await put(driver, record("a", 1))
    await driver.close()
    with pytest.raises(RunlaneError) as error:
        await driver.get([key("a")])
    assert error.value.code is ErrorCode.STORAGE_UNAVAILABLE
    await driver.start()
    assert await value_of(driver, "a") == 1


# ---------------------------------------------------------------------------------------------
# Clock


async def test_injected_clock_is_sampled_once_per_attempt() -> None:
    clock = ControlledClock(T0)
    driver = local_storage_driver(clock=clock)

    async def sample(tx):
        first = await tx.now()
        clock.advance("5s")
        return first, await tx.now()

    first, second = await driver.with_transaction(sample)
    assert first == second == T0
    assert (await driver.with_transaction(lambda tx: tx.now())) == T0 + timedelta(seconds=5)


async def test_use_clock_switches_the_clock_later_attempts_sample() -> None:
    driver = local_storage_driver()
    clock = ControlledClock(T0)
    driver.use_clock(clock)
    assert driver.clock is clock
    assert (await driver.with_transaction(lambda tx: tx.now())) == T0
    clock.advance("1m")
    assert (await driver.with_transaction(lambda tx: tx.now())) == T0 + timedelta(minutes=1)
    with pytest.raises(RunlaneError) as error:
        driver.use_clock(object())  # type: ignore[arg-type]
    assert error.value.code is ErrorCode.CONFIGURATION_INVALID
    assert driver.clock is clock


async def test_each_replayed_attempt_samples_its_own_time() -> None:
    clock = ControlledClock(T0)
    store = LocalStorageStore()
    driver, other = local_storage_driver(clock=clock, store=store), local_storage_driver(store=store)
    await put(driver, record("counter", 0))
    seen: list[datetime] = []

    async def bump(tx):
        [current] = await tx.get([key("counter")])
        seen.append(await tx.now())
        if len(seen) == 1:
            await bump_through(other, "counter")
            clock.advance("1s")
        tx.replace(current, record("counter", current.document.value["value"] + 1))

    await driver.with_transaction(bump)
    assert seen == [T0, T0 + timedelta(seconds=1)]
    assert await value_of(driver, "counter") == 2


# ---------------------------------------------------------------------------------------------
# Reads, versions, snapshots


async def bump_through(driver: LocalStorageDriver, name: str) -> None:
    async def bump(tx):
        [current] = await tx.get([key(name)])
        bumped = StorageDocument.encode({"value": current.document.value["value"] + 1})
        tx.replace(current, NewStorageRecord(current.key, bumped, current.indexes))

    await driver.with_transaction(bump)


async def test_get_returns_one_position_per_key_in_order() -> None:
    driver = local_storage_driver()
    await put(driver, record("a", 1), record("b", 2))
    found = await driver.get([key("b"), key("missing"), key("a"), key("b")])
    assert [None if item is None else item.document.value["value"] for item in found] == [2, None, 1, 2]
    assert found[0] == found[3]
    inside = await driver.with_transaction(lambda tx: tx.get([key("a"), key("a"), key("zz")]))
    assert [item and item.key for item in inside] == [key("a"), key("a"), None]


async def test_versions_never_repeat() -> None:
    driver = local_storage_driver()
    versions: list[str] = []
    for round_ in range(3):
        await put(driver, record("a", round_))
        [current] = await driver.get([key("a")])
        versions.append(current.version)
        await bump_through(driver, "a")
        [bumped] = await driver.get([key("a")])
        versions.append(bumped.version)
        await driver.with_transaction(lambda tx: _delete(tx, "a"))
    assert len(set(versions)) == len(versions)
    assert all(version.isdigit() and not version.startswith("0") for version in versions)
    assert [int(version) for version in versions] == sorted(int(version) for version in versions)


async def _delete(tx, name: str) -> None:
    [current] = await tx.get([key(name)])
    tx.delete(current)


async def test_attempt_reads_the_snapshot_taken_when_it_started() -> None:
    store = LocalStorageStore()
    driver, other = local_storage_driver(store=store), local_storage_driver(store=store)
    await put(driver, record("a", 1, sort="1"))
    observed: list[tuple[object, bool, list[str]]] = []

    async def read(tx):
        if not observed:
            await put(other, record("b", 2, sort="0"))
            await bump_through(other, "a")
        [a, b] = await tx.get([key("a"), key("b")])
        page = await tx.query_candidates(query())
        observed.append((a.document.value["value"], b is not None, [item.key.parts[0] for item in page.items]))
        return observed[-1]

    # The first attempt reads its start-of-attempt snapshot; its stale dependencies force a replay.
    assert await driver.with_transaction(read) == (2, True, ["b", "a"])
    assert observed == [(1, False, ["a"]), (2, True, ["b", "a"])]


async def test_returned_and_supplied_values_cannot_change_stored_state() -> None:
    driver = local_storage_driver()
    value = {"nested": [1, 2]}
    item = NewStorageRecord(key("a"), StorageDocument.encode(value))
    await put(driver, item)
    value["nested"].append(3)
    [stored] = await driver.get([key("a")])
    stored.document.value["nested"].append(4)
    with pytest.raises(AttributeError):
        stored.version = "999"  # type: ignore[misc]
    [again] = await driver.get([key("a")])
    assert again.document.value == {"nested": [1, 2]}


# ---------------------------------------------------------------------------------------------
# Conflicts and replay


async def test_replay_returns_only_the_committed_attempts_value() -> None:
    store = LocalStorageStore()
    driver, other = local_storage_driver(store=store), local_storage_driver(store=store)
    await put(driver, record("counter", 0))
    attempts = 0

    async def bump(tx):
        nonlocal attempts
        attempts += 1
        [current] = await tx.get([key("counter")])
        if attempts == 1:
            await bump_through(other, "counter")  # another instance commits first
        tx.replace(current, record("counter", current.document.value["value"] + 1))
        return f"attempt {attempts}"

    assert await driver.with_transaction(bump) == "attempt 2"
    assert await value_of(other, "counter") == 2


async def test_absent_reads_and_blind_creates_conflict() -> None:
    store = LocalStorageStore()
    driver, other = local_storage_driver(store=store), local_storage_driver(store=store)
    attempts = 0

    async def create_if_absent(tx):
        nonlocal attempts
        attempts += 1
        [current] = await tx.get([key("a")])
        if attempts == 1:
            await put(other, record("a", "other"))
        if current is None:
            tx.create(record("a", "mine"))
        return current

    winner = await driver.with_transaction(create_if_absent)
    assert attempts == 2 and winner is not None and await value_of(driver, "a") == "other"

    blind = local_storage_driver(store=store, max_transaction_attempts=3)
    calls = 0

    async def blind_create(tx):
        nonlocal calls
        calls += 1
        tx.create(record("b", "mine"))
        if calls == 1:
            await put(other, record("b", "other"))

    with pytest.raises(RunlaneError) as error:
        await blind.with_transaction(blind_create)
    assert is_storage_conflict(error.value, StorageConflictKind.TRANSACTION) and error.value.retryable
    assert calls == 3 and await value_of(driver, "b") == "other"


async def test_read_only_dependencies_are_validated() -> None:
    store = LocalStorageStore()
    driver, other = local_storage_driver(store=store), local_storage_driver(store=store)
    await put(driver, record("guard", 0))
    attempts = 0

    async def write_under_guard(tx):
        nonlocal attempts
        attempts += 1
        [guard] = await tx.get([key("guard")])
        if attempts == 1:
            await driver.with_transaction(lambda inner: _delete(inner, "guard"))
        tx.create(record(f"child-{attempts}", guard is not None))

    await driver.with_transaction(write_under_guard)
    assert attempts == 2
    assert await other.get([key("child-1")]) == [None]
    assert await value_of(other, "child-2") is False


async def test_exhausted_attempt_budget_raises_a_retryable_transaction_conflict() -> None:
    store = LocalStorageStore()
    driver, other = local_storage_driver(store=store, max_transaction_attempts=2), local_storage_driver(store=store)
    await put(driver, record("counter", 0))
    attempts = 0

    async def always_loses(tx):
        nonlocal attempts
        attempts += 1
        [current] = await tx.get([key("counter")])
        await bump_through(other, "counter")
        tx.replace(current, record("counter", -1))

    with pytest.raises(RunlaneError) as error:
        await driver.with_transaction(always_loses)
    assert is_storage_conflict(error.value, StorageConflictKind.TRANSACTION) and error.value.retryable
    assert attempts == 2 and await value_of(driver, "counter") == 2


async def test_concurrent_increments_across_instances_threads_and_loops() -> None:
    store = LocalStorageStore()
    drivers = [local_storage_driver(store=store, max_transaction_attempts=1000) for _ in range(2)]
    await put(drivers[0], record("counter", 0))

    async def many(driver: LocalStorageDriver, count: int) -> None:
        await asyncio.gather(*(bump_through(driver, "counter") for _ in range(count)))

    thread = threading.Thread(target=lambda: asyncio.run(many(drivers[1], 25)))
    thread.start()
    await many(drivers[0], 25)
    await asyncio.to_thread(thread.join)
    assert await value_of(drivers[1], "counter") == 50


# ---------------------------------------------------------------------------------------------
# Rollback and contract violations


async def test_a_raising_callback_rolls_back_and_is_not_replayed() -> None:
    driver = local_storage_driver()
    await put(driver, record("a", 1, sort="1"))
    calls = 0

    class Boom(Exception):
        pass

    boom = Boom()

    async def fail(tx):
        nonlocal calls
        calls += 1
        await tx.query_candidates(query(), mode=StorageCandidateMode.EXCLUSIVE)
        tx.create(record("b", 2))
        raise boom

    with pytest.raises(Boom) as error:
        await driver.with_transaction(fail)
    assert error.value is boom and calls == 1
    assert await driver.get([key("b")]) == [None]
    # The exclusive hold went with the attempt.
    held = await driver.with_transaction(lambda tx: tx.query_candidates(query(), mode=StorageCandidateMode.EXCLUSIVE))
    assert [item.key for item in held.items] == [key("a")]


async def _misuse(driver: LocalStorageDriver, body) -> tuple[pytest.ExceptionInfo[RunlaneError], int]:
    calls = 0

    async def callback(tx):
        nonlocal calls
        calls += 1
        await body(tx)

    with pytest.raises(RunlaneError) as error:
        await driver.with_transaction(callback)
    return error, calls


async def test_contract_violations_roll_back_without_replay() -> None:
    driver = local_storage_driver()
    await put(driver, record("a", 1), record("b", 2))
    [a] = await driver.get([key("a")])
    head = STREAM.head_key("env")

    async def read_after_now(tx):
        tx.create(record("new", 0))
        await tx.now()
        await tx.get([key("a")])

    async def read_after_mutation(tx):
        tx.create(record("new", 0))
        await tx.query_candidates(query())

    async def mutate_twice(tx):
        tx.create(record("new", 0))
        tx.create(record("new", 1))

    async def create_present(tx):
        [current] = await tx.get([key("a")])
        tx.create(record("new", 0))
        tx.create(record("a", current))

    async def replace_unread(tx):
        tx.create(record("new", 0))
        tx.replace(a, record("a", 5))

    async def replace_other_version(tx):
        [current] = await tx.get([key("a")])
        tx.create(record("new", 0))
        tx.replace(StorageRecord(current.key, "999", current.document), record("a", 5))

    async def replace_changes_key(tx):
        [current] = await tx.get([key("a")])
        tx.create(record("new", 0))
        tx.replace(current, record("b", 5))

    async def delete_absent(tx):
        await tx.get([key("zz")])
        tx.create(record("new", 0))
        tx.delete(StorageRecord(key("zz"), "1", a.document))

    async def append_twice(tx):
        tx.append(StorageAppendCommand(StorageStreamName.OBSERVATIONS, "env", [{"n": 1}]))
        tx.append(StorageAppendCommand(StorageStreamName.OBSERVATIONS, "env", [{"n": 2}]))

    async def append_after_head_read(tx):
        await tx.get([head])
        tx.create(record("new", 0))
        tx.append(StorageAppendCommand(StorageStreamName.OBSERVATIONS, "env", [{"n": 1}]))

    async def mutate_stream_after_append(tx):
        tx.append(StorageAppendCommand(StorageStreamName.OBSERVATIONS, "env", [{"n": 1}]))
        tx.create(STREAM.head_record("env", 5))

    async def overlapping_reads(tx):
        await asyncio.gather(tx.get([key("a")]), tx.get([key("b")]))

    async def swallowed(tx):
        tx.create(record("new", 0))
        try:
            tx.create(record("new", 1))
        except RunlaneError:
            pass

    bodies = [
        read_after_now,
        read_after_mutation,
        mutate_twice,
        create_present,
        replace_unread,
        replace_other_version,
        replace_changes_key,
        delete_absent,
        append_twice,
        append_after_head_read,
        mutate_stream_after_append,
        overlapping_reads,
        swallowed,
    ]
    for body in bodies:
        error, calls = await _misuse(driver, body)
        assert error.value.code is ErrorCode.ADAPTER_CONTRACT_VIOLATION, body.__name__
        assert calls == 1, body.__name__
        assert await driver.get([key("new"), head]) == [None, None], body.__name__
    assert await value_of(driver, "a") == 1 and await value_of(driver, "b") == 2


async def test_the_transaction_object_is_dead_after_its_attempt() -> None:
    driver = local_storage_driver()
    leaked = await driver.with_transaction(lambda tx: asyncio.sleep(0, tx))
    for use in (lambda: leaked.get([key("a")]), leaked.now):
        with pytest.raises(RunlaneError) as error:
            await use()
        assert_contract_violation(error)
    with pytest.raises(RunlaneError) as error:
        leaked.create(record("a", 1))
    assert_contract_violation(error)
    assert await driver.get([key("a")]) == [None]


# ---------------------------------------------------------------------------------------------
# Limits


async def test_limit_errors_leave_nothing_behind() -> None:
    limits = StorageLimits(
        max_point_reads=3,
        max_query_results=2,
        max_record_bytes=300,
        max_transaction_records=5,
        max_transaction_bytes=1200,
    )
    driver = local_storage_driver(limits=limits)

    async def too_many_point_reads(tx):
        await tx.get([key("a"), key("b"), key("c"), key("d")])

    async def too_large_record(tx):
        tx.create(record("new", 0))
        tx.create(record("big", "x" * 300))

    async def too_many_records(tx):
        await tx.get([key("a"), key("b"), key("c")])
        for name in ("new", "d", "e"):
            tx.create(record(name, 0))

    async def too_many_bytes(tx):
        for name in ("new", "b", "c", "d", "e"):
            tx.create(record(name, "x" * 230))

    async def too_many_query_results(tx):
        await tx.query_candidates(query(limit=3))

    async def append_too_many(tx):
        tx.create(record("new", 0))
        tx.append(StorageAppendCommand(StorageStreamName.OBSERVATIONS, "env", [{"n": n} for n in range(5)]))

    async def swallowed(tx):
        tx.create(record("new", 0))
        try:
            tx.create(record("big", "x" * 300))
        except StorageLimitError:
            pass

    expected = {
        too_many_point_reads: "max_point_reads",
        too_large_record: "max_record_bytes",
        too_many_records: "max_transaction_records",
        too_many_bytes: "max_transaction_bytes",
        too_many_query_results: "max_query_results",
        append_too_many: "max_transaction_records",
        swallowed: "max_record_bytes",
    }
    for body, limit in expected.items():
        calls = 0

        async def callback(tx, body=body):
            nonlocal calls
            calls += 1
            await body(tx)

        with pytest.raises(StorageLimitError) as error:
            await driver.with_transaction(callback)
        assert error.value.limit == limit, body.__name__
        assert error.value.code is ErrorCode.VALIDATION_FAILED and not error.value.retryable
        assert calls == 1
        found = await driver.get([key("new"), key("big"), STREAM.head_key("env")])
        assert found == [None, None, None], body.__name__


# ---------------------------------------------------------------------------------------------
# Queries and exclusive candidates


async def test_queries_order_range_and_page_across_many_chunks() -> None:
    driver = local_storage_driver()
    names = [f"k{n:04d}" for n in range(400)]
    sorts = {name: f"{int(name[1:]) % 37:03d}" for name in names}
    shuffled = random.Random(7).sample(names, len(names))
    for start in range(0, len(shuffled), 50):
        await put(driver, *(record(name, 0, sort=sorts[name]) for name in shuffled[start : start + 50]))
    removed = set(shuffled[::3])
    for name in removed:
        await driver.with_transaction(lambda tx, name=name: _delete(tx, name))
    kept = [name for name in names if name not in removed]
    ordered = sorted(kept, key=lambda name: ((sorts[name], name), key(name).encoded))

    assert await all_keys(driver, limit=100) == ordered
    assert await all_keys(driver, limit=7, direction=SortDirection.DESC) == ordered[::-1]
    low, high = (sorts[ordered[10]], ordered[10]), (sorts[ordered[50]], ordered[50])
    inclusive = StorageRange.between(low, high, upper_inclusive=True)
    assert await all_keys(driver, limit=9, range=inclusive) == ordered[10:51]
    assert await all_keys(driver, limit=9, range=inclusive, direction=SortDirection.DESC) == ordered[50:9:-1]
    exclusive = StorageRange.between(low, high, lower_inclusive=False)
    assert await all_keys(driver, limit=9, range=exclusive) == ordered[11:50]
    assert await all_keys(driver, range=StorageRange.prefix(("007",))) == [n for n in ordered if sorts[n] == "007"]

    sevens = [n for n in ordered if sorts[n] == "007"]
    exact = await driver.query(query(limit=len(sevens), range=StorageRange.prefix(("007",))))
    assert len(exact.items) == len(sevens) and exact.next_cursor is None  # advisory pages look ahead
    [first] = (await driver.query(query(limit=1))).items
    assert first.sort == (sorts[ordered[0]], ordered[0])


async def test_exclusive_candidates_are_disjoint_across_instances() -> None:
    store = LocalStorageStore()
    first, second = local_storage_driver(store=store), local_storage_driver(store=store)
    await put(first, *(record(f"r{n}", n, sort=f"{n:02d}") for n in range(5)))
    holding, release = asyncio.Event(), asyncio.Event()
    seen: dict[str, list[str]] = {}

    async def hold(tx):
        page = await tx.query_candidates(query(limit=2), mode=StorageCandidateMode.EXCLUSIVE)
        seen["first"] = [item.key.parts[0] for item in page.items]
        holding.set()
        await release.wait()
        return page

    holder = asyncio.create_task(first.with_transaction(hold))
    await holding.wait()
    rest = await second.with_transaction(
        lambda tx: tx.query_candidates(query(limit=3), mode=StorageCandidateMode.EXCLUSIVE)
    )
    seen["second"] = [item.key.parts[0] for item in rest.items]
    # A full exclusive page returns a cursor even though nothing follows.
    assert rest.next_cursor is not None
    empty = await second.with_transaction(
        lambda tx: tx.query_candidates(query(limit=3, cursor=rest.next_cursor), mode=StorageCandidateMode.EXCLUSIVE)
    )
    assert empty.items == () and empty.next_cursor is None
    # Advisory reads ignore holds.
    assert len((await second.query(query())).items) == 5
    release.set()
    await holder
    assert seen == {"first": ["r0", "r1"], "second": ["r2", "r3", "r4"]}
    # Holds end with the attempt.
    after = await second.with_transaction(lambda tx: tx.query_candidates(query(), mode=StorageCandidateMode.EXCLUSIVE))
    assert len(after.items) == 5


async def test_replayed_attempts_release_their_exclusive_holds() -> None:
    store = LocalStorageStore()
    driver, other = local_storage_driver(store=store), local_storage_driver(store=store)
    await put(driver, record("job", 0, sort="1"), record("counter", 0))
    observed: list[list[str]] = []

    async def claim(tx):
        page = await tx.query_candidates(query(), mode=StorageCandidateMode.EXCLUSIVE)
        [counter] = await tx.get([key("counter")])
        if not observed:
            await bump_through(other, "counter")
            observed.append(await _exclusive_names(other))
        tx.replace(counter, record("counter", 100))
        return [item.key.parts[0] for item in page.items]

    assert await driver.with_transaction(claim) == ["job"]
    assert observed == [[]]  # held by the first attempt while it ran
    assert await _exclusive_names(other) == ["job"]


async def _exclusive_names(driver: LocalStorageDriver) -> list[str]:
    page = await driver.with_transaction(lambda tx: tx.query_candidates(query(), mode=StorageCandidateMode.EXCLUSIVE))
    return [item.key.parts[0] for item in page.items]


# ---------------------------------------------------------------------------------------------
# Ordered append


def observations(count: int, start: int = 0) -> StorageAppendCommand:
    return StorageAppendCommand(StorageStreamName.OBSERVATIONS, "env", [{"n": start + n} for n in range(count)])


async def stream_positions(driver: LocalStorageDriver) -> list[str]:
    result = await driver.query(StorageQuery(STREAM.index, ("env",)))
    found = await driver.get([item.key for item in result.items])
    return [item.document.value["stream_position"] for item in found]


async def test_append_allocates_contiguous_positions_with_mixed_writers() -> None:
    store = LocalStorageStore()
    native, other = local_storage_driver(store=store), local_storage_driver(store=store)
    await put(native, record("counter", 0))
    await native.with_transaction(lambda tx: _append(tx, observations(2)))

    async def point_writer(tx):
        [head] = await tx.get([STREAM.head_key("env")])
        position = int(head.document.value["next_position"])
        tx.create(STREAM.stream_record("env", position, {"n": "point"}))
        tx.replace(head, STREAM.head_record("env", position + 1))

    await other.with_transaction(point_writer)
    attempts = 0

    async def aborted_then_committed(tx):
        nonlocal attempts
        attempts += 1
        [counter] = await tx.get([key("counter")])
        if attempts == 1:  # a point writer extends the stream and a dependency changes: this attempt aborts
            await other.with_transaction(point_writer)
            await bump_through(other, "counter")
        tx.append(observations(3, start=10))
        tx.replace(counter, record("counter", 100))

    await native.with_transaction(aborted_then_committed)
    assert attempts == 2
    assert await stream_positions(native) == [str(n) for n in range(1, 8)]
    [head] = await native.get([STREAM.head_key("env")])
    assert head.document.value == {"next_position": "8"}


async def _append(tx, command: StorageAppendCommand) -> None:
    tx.append(command)


async def test_corrupt_or_exhausted_heads_fail_without_changing_state() -> None:
    driver = local_storage_driver()
    await put(driver, NewStorageRecord(STREAM.head_key("env"), StorageDocument.encode({"next_position": "zero"})))

    async def append_with_side_write(tx):
        tx.create(record("side", 1))
        tx.append(observations(1))

    with pytest.raises(RunlaneError) as error:
        await driver.with_transaction(append_with_side_write)
    assert error.value.code is ErrorCode.INVARIANT_VIOLATION
    assert await driver.get([key("side")]) == [None]

    [head] = await driver.get([STREAM.head_key("env")])
    await driver.with_transaction(lambda tx: _exhaust(tx, head))
    with pytest.raises(RunlaneError) as error:
        await driver.with_transaction(append_with_side_write)
    assert error.value.code is ErrorCode.INVARIANT_VIOLATION
    assert await driver.get([key("side")]) == [None] and await stream_positions(driver) == []


async def _exhaust(tx, head: StorageRecord) -> None:
    [current] = await tx.get([head.key])
    tx.replace(current, STREAM.head_record("env", 2**64 - 1))


# ---------------------------------------------------------------------------------------------
# Operator reads


ENV = Environment(name="prod")


def make_run(run_id: str, minute: int, *, status: RunStatus = RunStatus.QUEUED) -> RunRecord:
    at = T0 + timedelta(minutes=minute)
    return RunRecord(
        id=run_id,
        environment=ENV,
        task_id="task",
        queue="default",
        status=status,
        payload={"items": [minute]},
        event_sequence=1,
        created_at=at,
        updated_at=at,
    )


def make_event(run: RunRecord, sequence: int) -> RunEventRecord:
    created = RunCreatedEvent(
        run_id=run.id,
        environment=ENV,
        occurred_at=run.created_at + timedelta(seconds=sequence),
        actor=Actor(type=ActorType.SYSTEM),
        task_id=run.task_id,
        queue=run.queue,
        payload={"n": sequence},
    )
    return RunEventRecord(id=f"{run.id}-{sequence}", sequence=sequence, event=created)


def run_records(run: RunRecord, events: int) -> list[NewStorageRecord]:
    written = [NewStorageRecord(run_key(ENV.name, run.id), encode_run_document(run))]
    for sequence in range(1, events + 1):
        event = encode_run_event_document(make_event(run, sequence))
        written.append(NewStorageRecord(run_event_key(ENV.name, run.id, sequence), event))
    return written


async def test_operator_reads_follow_the_committed_records() -> None:
    store = LocalStorageStore()
    driver, other = local_storage_driver(store=store), local_storage_driver(store=store)
    runs = [make_run(f"run-{n}", n, status=RunStatus.SUCCEEDED if n % 2 else RunStatus.QUEUED) for n in range(5)]
    await put(driver, *(item for run in runs for item in run_records(run, 2)))
    # Documents that are not canonical stay raw records only.
    await put(
        driver,
        NewStorageRecord(run_key(ENV.name, "odd"), StorageDocument.encode({"run": {"id": "odd"}})),
        NewStorageRecord(run_key(ENV.name, "mismatch"), encode_run_document(make_run("other-id", 9))),
        NewStorageRecord(run_event_key(ENV.name, "run-0", 3), StorageDocument.encode({"sequence": 3})),
    )
    assert await other.get_run(ENV, "run-1") == runs[1]
    assert await other.get_run(ENV, "odd") is None and await other.get_run(ENV, "mismatch") is None
    assert await other.get_run(Environment(name="staging"), "run-1") is None

    page = await other.list_runs(RunFilter(environment=ENV), PaginationParams(limit=2))
    assert [summary.id for summary in page.data] == ["run-4", "run-3"] and page.next_cursor
    rest = await other.list_runs(RunFilter(environment=ENV), PaginationParams(limit=5, cursor=page.next_cursor))
    assert [summary.id for summary in rest.data] == ["run-2", "run-1", "run-0"] and rest.next_cursor is None
    assert rest.data[0] == runs[2].to_summary()
    queued = await other.list_runs(
        RunFilter(environment=ENV, statuses=(RunStatus.QUEUED,), sort_direction=SortDirection.ASC), PaginationParams()
    )
    assert [summary.id for summary in queued.data] == ["run-0", "run-2", "run-4"]
    with pytest.raises(RunlaneError) as error:
        other_filter = RunFilter(environment=ENV, statuses=(RunStatus.QUEUED,))
        await other.list_runs(other_filter, PaginationParams(cursor=page.next_cursor))
    assert error.value.code is ErrorCode.VALIDATION_FAILED

    history = await other.list_run_events(RunEventFilter(environment=ENV, run_id="run-0"), PaginationParams())
    assert [(event.event.run_id, event.sequence) for event in history.data] == [("run-0", 1), ("run-0", 2)]
    everything, cursor, seen = [], None, 0
    while True:
        events = await other.list_run_events(RunEventFilter(environment=ENV), PaginationParams(limit=3, cursor=cursor))
        everything.extend((event.event.run_id, event.sequence) for event in events.data)
        seen += 1
        if events.next_cursor is None:
            break
        cursor = events.next_cursor
    assert everything == [(run.id, sequence) for run in runs for sequence in (1, 2)] and seen == 4


async def test_tombstones_hide_runs_and_events_in_the_same_commit() -> None:
    driver = local_storage_driver()
    run = make_run("run-1", 1)
    await put(driver, *run_records(run, 2))

    async def tombstone(tx):
        [current] = await tx.get([run_key(ENV.name, run.id)])
        tx.create(NewStorageRecord(run_tombstone_key(ENV.name, run.id), StorageDocument.encode({"at": "now"})))
        return current

    await driver.with_transaction(tombstone)
    assert await driver.get_run(ENV, run.id) is None
    assert (await driver.list_runs(RunFilter(environment=ENV), PaginationParams())).data == []
    assert (await driver.list_run_events(RunEventFilter(environment=ENV), PaginationParams())).data == []
    raw = await driver.get([run_key(ENV.name, run.id), run_event_key(ENV.name, run.id, 1)])
    assert all(item is not None for item in raw)  # raw child cleanup may continue later

    await driver.with_transaction(lambda tx: _delete_key(tx, run_tombstone_key(ENV.name, run.id)))
    assert await driver.get_run(ENV, run.id) == run


async def _delete_key(tx, target: StorageRecordKey) -> None:
    [current] = await tx.get([target])
    tx.delete(current)


async def test_operator_reads_return_defensive_copies() -> None:
    driver = local_storage_driver()
    run = make_run("run-1", 1)
    await put(driver, *run_records(run, 1))
    fetched = await driver.get_run(ENV, run.id)
    fetched.payload["items"].append("changed")
    [event] = (await driver.list_run_events(RunEventFilter(environment=ENV), PaginationParams())).data
    event.event.payload["n"] = "changed"
    assert (await driver.get_run(ENV, run.id)).payload == {"items": [1]}
    [again] = (await driver.list_run_events(RunEventFilter(environment=ENV), PaginationParams())).data
    assert again.event.payload == {"n": 1}


async def test_operator_projection_tracks_replacements_and_deletes() -> None:
    driver = local_storage_driver()
    run = make_run("run-1", 1)
    await put(driver, *run_records(run, 1))
    finished = run.model_copy(update={"status": RunStatus.SUCCEEDED, "event_sequence": 2})

    async def replace_run(tx):
        [current] = await tx.get([run_key(ENV.name, run.id)])
        tx.replace(current, NewStorageRecord(current.key, encode_run_document(finished)))

    await driver.with_transaction(replace_run)
    assert (await driver.get_run(ENV, run.id)).status is RunStatus.SUCCEEDED

    async def corrupt_run(tx):
        [current] = await tx.get([run_key(ENV.name, run.id)])
        tx.replace(current, NewStorageRecord(current.key, StorageDocument.encode({"run": None})))

    await driver.with_transaction(corrupt_run)
    assert await driver.get_run(ENV, run.id) is None
    assert (await driver.list_run_events(RunEventFilter(environment=ENV), PaginationParams())).data == []

    await driver.with_transaction(lambda tx: _delete_key(tx, run_event_key(ENV.name, run.id, 1)))
    await driver.with_transaction(lambda tx: _replace_with(tx, run_key(ENV.name, run.id), encode_run_document(run)))
    assert await driver.get_run(ENV, run.id) == run
    assert (await driver.list_run_events(RunEventFilter(environment=ENV), PaginationParams())).data == []


async def _replace_with(tx, target: StorageRecordKey, document: StorageDocument) -> None:
    [current] = await tx.get([target])
    tx.replace(current, NewStorageRecord(target, document))


async def test_index_partitions_match_a_sorted_model_under_random_writes() -> None:
    """Random creates, moves and deletes across chunk boundaries; every listing equals the model's."""
    rng = random.Random(11)
    driver = local_storage_driver()
    model: dict[str, str] = {}  # name -> sort component
    names = [f"n{n:03d}" for n in range(300)]

    def random_bound() -> tuple[str, str]:
        return (f"{rng.randrange(40):02d}", rng.choice(names))

    for round_ in range(30):

        async def mutate(tx):
            chosen = rng.sample(names, 20)
            for name, current in zip(chosen, await tx.get([key(name) for name in chosen])):
                sort = f"{rng.randrange(40):02d}"
                if current is None:
                    tx.create(record(name, 0, sort=sort))
                elif rng.random() < 0.3:
                    tx.delete(current)
                else:
                    tx.replace(current, record(name, 1, sort=sort))
            return chosen

        chosen = await driver.with_transaction(mutate)
        for name, current in zip(chosen, await driver.get([key(name) for name in chosen])):
            if current is None:
                model.pop(name, None)
            else:
                model[name] = current.indexes[0].sort[0]

        low, high = sorted((random_bound(), random_bound()))
        bounds = StorageRange.between(low, high, lower_inclusive=rng.random() < 0.5, upper_inclusive=rng.random() < 0.5)
        direction = rng.choice(list(SortDirection))
        rows = sorted((encode_storage_tuple((sort, name)), key(name).encoded, name) for name, sort in model.items())
        wanted = [name for sort, _, name in rows if bounds.contains(sort)]
        listed = await all_keys(driver, limit=rng.randrange(1, 30), range=bounds, direction=direction)
        assert listed == (wanted[::-1] if direction is SortDirection.DESC else wanted), round_
    assert len(model) > 2 * 64  # the partition spans several chunks


def test_sorted_rows_batched_updates_match_a_sorted_list_and_keep_old_snapshots() -> None:
    from runlane_local.memory import _CHUNK, _NO_ROWS

    rng = random.Random(7)
    rows = _NO_ROWS
    model: list[tuple[str, str]] = []
    snapshots: list[tuple[Any, list[tuple[str, str]]]] = []
    for round_ in range(300):
        present = list(model)
        removes = rng.sample(present, min(len(present), rng.randrange(0, 40)))
        # Inserts may re-add a row removed in the same commit, land anywhere, or pile into one chunk.
        inserts = {
            (f"{rng.randrange(3000):05d}", f"k{rng.randrange(10**6)}")
            for _ in range(rng.choice([0, 1, 5, 60, 3 * _CHUNK]))
        }
        inserts.update(rng.sample(removes, len(removes) // 3))
        inserts -= set(model) - set(removes)
        rows = rows.updated(removes, list(inserts))
        model = sorted((set(model) - set(removes)) | inserts)
        snapshots.append((rows, model))
        listed = list(rows.between((0, 0), rows.end, descending=False))
        assert listed == model, round_
        assert all(0 < len(chunk) <= 2 * _CHUNK for chunk in rows._chunks)
        assert list(rows._lasts) == [chunk[-1] for chunk in rows._chunks]
        assert bool(rows) == bool(model)
    for earlier, seen in snapshots:  # later updates never change an earlier value
        assert list(earlier.between((0, 0), earlier.end, descending=False)) == seen
    with pytest.raises(RunlaneError):
        rows.updated([("missing", "row")], [])
    with pytest.raises(RunlaneError):
        _NO_ROWS.updated([("missing", "row")], [])


async def test_records_are_kept_untracked_by_the_garbage_collector() -> None:
    import gc

    driver = local_storage_driver()
    run = make_run("run-1", 1)
    flat = make_run("run-2", 2).model_copy(update={"payload": {"n": 2}})
    await put(driver, *run_records(run, 3), *run_records(flat, 0), record("plain", {"n": 1}, sort="a"))
    for _ in range(4):  # a tuple is untracked by a collection that finds everything inside it untracked
        gc.collect()
    stored = driver.store._snapshot().records
    # History rows, plain records and run documents that remember their run are all packed; a run
    # whose JSON values hold no list is untracked too (lists always are tracked).
    packed = [stored[run_event_key(ENV.name, run.id, n).encoded] for n in (1, 2, 3)] + [stored[key("plain").encoded]]
    packed.append(stored[run_key(ENV.name, flat.id).encoded])
    assert [(type(item), gc.is_tracked(item)) for item in packed] == [(tuple, False)] * 5
    assert type(stored[run_key(ENV.name, run.id).encoded]) is tuple
    # A run read back decodes from what the store remembered (no parsing) into an equal, fresh run.
    for expected in (run, flat):
        [found] = await driver.get([run_key(ENV.name, expected.id)])
        assert found.document.decoded is not None
        decoded, _ = decode_run_document(found.document)
        assert decoded == expected and decoded.model_fields_set == expected.model_fields_set
        assert decoded.payload is not expected.payload
    # Reads rebuild equal records.
    [plain] = await driver.get([key("plain")])
    assert plain.key == key("plain") and plain.document.value == {"value": {"n": 1}}
    assert plain.indexes == (StorageIndexEntry(INDEX, PARTITION, ("a", "plain")),)


async def test_operator_event_reads_follow_a_replaced_history_row() -> None:
    driver = local_storage_driver()
    run = make_run("run-1", 1)
    await put(driver, *run_records(run, 1))
    [before] = (await driver.list_run_events(RunEventFilter(environment=ENV), PaginationParams())).data
    changed = make_event(run, 1).model_copy(update={"id": "evt-replaced"})

    async def replace_event(tx):
        [current] = await tx.get([run_event_key(ENV.name, run.id, 1)])
        tx.replace(current, NewStorageRecord(current.key, encode_run_event_document(changed)))

    await driver.with_transaction(replace_event)
    [after] = (await driver.list_run_events(RunEventFilter(environment=ENV), PaginationParams())).data
    assert before.id != "evt-replaced" and after == changed
    await driver.with_transaction(lambda tx: _delete_key(tx, run_event_key(ENV.name, run.id, 1)))
    assert (await driver.list_run_events(RunEventFilter(environment=ENV), PaginationParams())).data == []
