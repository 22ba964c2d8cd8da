"""The SQLite driver beyond the conformance suite: durability across close/reopen and across processes,
conflicting writers in several processes, exclusive holds of a crashed process, bad input, and the
``sqlite`` lane through ``runlane.toml``."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from runlane import ErrorCode, RunlaneError
from runlane.core.lanes import Lane
from runlane.models import Environment
from runlane.plugins.manager import get_registries
from runlane.plugins.registries import ProviderContext, validate_options
from runlane.storage import (
    NewStorageRecord,
    PaginationParams,
    RunFilter,
    StorageAppendCommand,
    StorageCandidateMode,
    StorageClockAuthority,
    StorageDocument,
    StorageDurability,
    StorageIndexEntry,
    StorageIndexName,
    StorageQuery,
    StorageRecordKey,
    StorageStreamName,
    storage_stream_layouts,
)
from runlane.storage.operator_sql import OPERATOR_EVENT_COLUMNS, OPERATOR_RUN_COLUMNS
from runlane.testing import ControlledClock
from runlane_local import SqliteStorageDriver, sqlite_lane, sqlite_storage
from runlane_local import sqlite as sqlite_driver
from runlane_local.sqlite import SCHEMA_VERSION

from cli_support import cli, write
from sql_driver_support import check_replaced_documents_are_recognized

INDEX = StorageIndexName.OUTBOX_DUE
PARTITION = ("sqlite-tests", "p")
LAYOUT = storage_stream_layouts[StorageStreamName.OBSERVATIONS]
WAIT = 30.0  # bound of every wait on another process

CHILD = """
import asyncio, json, sys
from runlane.storage import (
    NewStorageRecord, StorageAppendCommand, StorageCandidateMode, StorageDocument, StorageIndexEntry,
    StorageIndexName, StorageQuery, StorageRecordKey, StorageStreamName,
)
from runlane_local import sqlite_storage

INDEX = StorageIndexName.OUTBOX_DUE
PARTITION = ("sqlite-tests", "p")


async def write(driver, prefix):
    async def attempt(tx):
        for n in range(3):
            key = StorageRecordKey("items", f"{prefix}-{n}")
            entry = StorageIndexEntry(INDEX, PARTITION, (f"{prefix}-{n}",))
            tx.create(NewStorageRecord(key, StorageDocument.encode({"n": n, "by": prefix}), (entry,)))

    await driver.with_transaction(attempt)

    async def append(tx):
        tx.append(StorageAppendCommand(StorageStreamName.OBSERVATIONS, "child-stream", [{"i": 0}, {"i": 1}]))

    await driver.with_transaction(append)


async def increment(driver, key_name, times):
    key = StorageRecordKey("counters", key_name)

    async def attempt(tx):
        [current] = await tx.get([key])
        await asyncio.sleep(0)
        tx.replace(current, NewStorageRecord(key, StorageDocument.encode({"n": current.document.value["n"] + 1})))

    for _ in range(times):
        await driver.with_transaction(attempt)


async def hold(driver, limit, marker):
    async def attempt(tx):
        query = StorageQuery(INDEX, PARTITION, limit=limit)
        result = await tx.query_candidates(query, mode=StorageCandidateMode.EXCLUSIVE)
        with open(marker, "w") as file:
            json.dump([list(ref.key.parts) for ref in result.items], file)
        await asyncio.sleep(3600)

    await driver.with_transaction(attempt)


async def main():
    command, path, *args = sys.argv[1:]
    driver = sqlite_storage(path, max_transaction_attempts=1000)
    await driver.start()
    try:
        if command == "write":
            await write(driver, *args)
        elif command == "increment":
            await increment(driver, args[0], int(args[1]))
        elif command == "hold":
            await hold(driver, int(args[0]), args[1])
    finally:
        await driver.close()


asyncio.run(main())
"""


@pytest.fixture
def database(tmp_path: Path) -> Path:
    return tmp_path / "runlane.db"


@pytest.fixture
def child(tmp_path: Path) -> Path:
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(CHILD))
    return script


def spawn(script: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(script), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def finish(process: subprocess.Popen[str]) -> None:
    try:
        out, err = process.communicate(timeout=WAIT)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        raise AssertionError("a child process did not finish in time") from None
    assert process.returncode == 0, err


def record(key: StorageRecordKey, value: dict[str, Any], *sort: str) -> NewStorageRecord:
    entries = (StorageIndexEntry(INDEX, PARTITION, sort),) if sort else ()
    return NewStorageRecord(key, StorageDocument.encode(value), entries)


async def create(driver: SqliteStorageDriver, *records: NewStorageRecord) -> None:
    async def attempt(tx: Any) -> None:
        for item in records:
            tx.create(item)

    await driver.with_transaction(attempt)


async def keys_of(driver: SqliteStorageDriver, query: StorageQuery) -> list[tuple[str, ...]]:
    return [ref.key.parts for ref in (await driver.query(query)).items]


async def select_exclusive(driver: SqliteStorageDriver, limit: int) -> list[tuple[str, ...]]:
    async def attempt(tx: Any) -> list[tuple[str, ...]]:
        query = StorageQuery(INDEX, PARTITION, limit=limit)
        result = await tx.query_candidates(query, mode=StorageCandidateMode.EXCLUSIVE)
        return [ref.key.parts for ref in result.items]

    return await asyncio.wait_for(driver.with_transaction(attempt), WAIT)


async def expect_error(awaitable: Any, code: ErrorCode) -> RunlaneError:
    with pytest.raises(RunlaneError) as caught:
        await asyncio.wait_for(awaitable, WAIT)
    assert caught.value.code is code, caught.value
    return caught.value


# ---------------------------------------------------------------------------------------------
# Profile, lane and schema


def test_profile_is_durable_shared_and_client_clocked(database: Path) -> None:
    driver = sqlite_storage(database)
    profile = driver.profile
    assert profile.durability is StorageDurability.DURABLE
    assert profile.clock_authority is StorageClockAuthority.CLIENT
    assert profile.exclusive_candidates and profile.ordered_append and not profile.process_local
    assert driver.synchronous == "full"
    clock = ControlledClock()
    driver.use_clock(clock)
    assert driver.clock is clock
    with pytest.raises(RunlaneError) as caught:
        driver.use_clock(object())  # type: ignore[arg-type]
    assert caught.value.code is ErrorCode.CONFIGURATION_INVALID


@pytest.mark.parametrize(
    "options",
    [
        {"path": ":memory:"},
        {"path": ""},
        {"path": "x.db", "synchronous": "off"},
        {"path": "x.db", "busy_timeout": 0},
        {"path": "x.db", "busy_timeout": "soon"},
        {"path": "x.db", "max_transaction_attempts": 0},
        {"path": "x.db", "name": ""},
    ],
)
def test_bad_options_are_configuration_invalid(options: dict[str, Any]) -> None:
    with pytest.raises(RunlaneError) as caught:
        sqlite_storage(**options)
    assert caught.value.code is ErrorCode.CONFIGURATION_INVALID


def test_sqlite_lane_capabilities(database: Path) -> None:
    lane = sqlite_lane(database)
    assert isinstance(lane, Lane) and lane.name == "sqlite"
    assert lane.capabilities.operator_reads and lane.capabilities.production_durable
    assert not lane.capabilities.process_local
    relaxed = sqlite_lane(database, name="fast", synchronous="normal")
    assert relaxed.capabilities.production_durable is False
    assert relaxed.storage.synchronous == "normal"


def test_projection_tables_have_the_operator_sql_columns(database: Path) -> None:
    asyncio.run(_start_and_close(sqlite_storage(database)))
    with sqlite3.connect(database) as connection:
        runs = [row[1] for row in connection.execute("PRAGMA table_info(runlane_operator_runs)")]
        events = [row[1] for row in connection.execute("PRAGMA table_info(runlane_operator_events)")]
        version = connection.execute("SELECT value FROM runlane_meta WHERE name = 'schema_version'").fetchone()[0]
        journal = connection.execute("PRAGMA journal_mode").fetchone()[0]
    assert tuple(runs) == OPERATOR_RUN_COLUMNS
    assert tuple(events) == OPERATOR_EVENT_COLUMNS
    assert version == str(SCHEMA_VERSION)
    assert journal == "wal"


async def _start_and_close(driver: SqliteStorageDriver) -> None:
    await driver.start()
    await driver.close()


# ---------------------------------------------------------------------------------------------
# Durability


async def test_records_survive_close_and_reopen(database: Path) -> None:
    key, other = StorageRecordKey("items", "a"), StorageRecordKey("items", "b")
    driver = sqlite_storage(database)
    await driver.start()
    await create(driver, record(key, {"n": 1}, "1"), record(other, {"n": 2}, "2"))

    async def append(tx: Any) -> None:
        tx.append(StorageAppendCommand(StorageStreamName.OBSERVATIONS, "stream", [{"i": 0}, {"i": 1}]))

    await driver.with_transaction(append)
    before = await driver.get([key, other])
    await driver.close()
    with pytest.raises(RunlaneError) as caught:
        await driver.get([key])
    assert caught.value.code is ErrorCode.STORAGE_UNAVAILABLE

    reopened = sqlite_storage(database)
    await reopened.start()
    try:
        assert await reopened.get([key, other]) == before
        assert await keys_of(reopened, StorageQuery(INDEX, PARTITION)) == [("a",), ("b",)]
        [head] = await reopened.get([LAYOUT.head_key("stream")])
        assert head is not None and head.document.value == {"next_position": "3"}

        async def bump(tx: Any) -> None:
            [current] = await tx.get([key])
            tx.replace(current, record(key, {"n": 3}, "1"))

        await reopened.with_transaction(bump)
        [after] = await reopened.get([key])
        versions = {before[0].version, before[1].version, head.version}
        assert after.version not in versions and int(after.version) > max(int(v) for v in versions)
    finally:
        await reopened.close()
    # The first instance can be started again.
    await driver.start()
    try:
        assert (await driver.get([key]))[0].document.value == {"n": 3}
    finally:
        await driver.close()


async def test_documents_replaced_here_are_recognized_and_others_are_read(database: Path) -> None:
    here, elsewhere = sqlite_storage(database), sqlite_storage(database)
    await here.start()
    await elsewhere.start()
    try:
        key = StorageRecordKey("recognized", "a")
        await check_replaced_documents_are_recognized(here, elsewhere, key, lambda key, value: record(key, value, "1"))
    finally:
        await here.close()
        await elsewhere.close()


async def test_commits_stay_durable_around_hold_transactions(database: Path) -> None:
    """Hold transactions commit without a log sync of their own; every other commit keeps the
    configured ``synchronous`` level, also after a hold transaction that failed half-way."""
    driver = sqlite_storage(database)
    await driver.start()

    def synchronous(connection: sqlite3.Connection) -> int:
        return connection.execute("PRAGMA synchronous").fetchone()[0]

    try:
        await create(driver, *(record(StorageRecordKey("items", str(n)), {"n": n}, str(n)) for n in range(3)))
        assert await select_exclusive(driver, 2) == [("0",), ("1",)]
        assert await driver._call(synchronous) == 2  # FULL

        def failing_hold(connection: sqlite3.Connection) -> None:
            driver._unsynced(connection)
            raise sqlite3.OperationalError("disk I/O error")

        await expect_error(driver._call(failing_hold), ErrorCode.STORAGE_UNAVAILABLE)
        assert await driver._call(synchronous) == 2
    finally:
        await driver.close()


async def test_a_file_with_the_earlier_records_layout_is_read_and_written(database: Path) -> None:
    """Files created before records moved to a rowid table (WITHOUT ROWID) keep working."""
    driver = sqlite_storage(database)
    await driver.start()
    await driver.close()
    with sqlite3.connect(database) as connection:
        connection.execute("DROP TABLE runlane_records")
        connection.execute(
            "CREATE TABLE runlane_records (key TEXT PRIMARY KEY, version INTEGER NOT NULL, document TEXT NOT NULL, "
            "byte_size INTEGER NOT NULL, indexes TEXT NOT NULL) WITHOUT ROWID"
        )
    reopened = sqlite_storage(database)
    await reopened.start()
    try:
        key = StorageRecordKey("items", "a")
        await create(reopened, record(key, {"n": 1}, "1"))

        async def bump(tx: Any) -> None:
            [current] = await tx.get([key])
            tx.replace(current, record(key, {"n": 2}, "2"))

        await reopened.with_transaction(bump)
        [stored] = await sqlite_storage_get(database, key)
        assert stored.document.value == {"n": 2} and await keys_of(reopened, StorageQuery(INDEX, PARTITION)) == [("a",)]
    finally:
        await reopened.close()


async def test_a_version_1_file_drops_the_rows_of_entries_that_restate_their_key(database: Path) -> None:
    """Version 1 kept an index row for every entry; version 2 reads entries that restate their key
    from the records' key range, so opening a version 1 file drops those rows (and nothing else)."""
    by_run = StorageIndexName.RUN_EVENTS_BY_RUN
    events = [StorageRecordKey("run_events", "env", "run_1", position) for position in ("01", "02")]
    elsewhere = StorageRecordKey("other", "env", "x")
    entries = {key: StorageIndexEntry(by_run, ("env", "run_1"), (key.parts[-1],)) for key in events}
    entries[elsewhere] = StorageIndexEntry(by_run, ("env", "run_1"), ("01",))
    driver = sqlite_storage(database)
    await driver.start()
    await create(driver, *(NewStorageRecord(key, StorageDocument.encode({}), (entry,)) for key, entry in entries.items()))
    await driver.close()
    rows = "SELECT key FROM runlane_index_rows WHERE index_name = 'run_events_by_run' ORDER BY key"
    with sqlite3.connect(database) as connection:
        assert connection.execute(rows).fetchall() == [(elsewhere.encoded,)]
        for key in events:  # what version 1 stored
            entry = entries[key]
            connection.execute(
                "INSERT INTO runlane_index_rows VALUES (?, ?, ?, ?)",
                (by_run.value, entry.encoded_partition, entry.encoded_sort, key.encoded),
            )
        connection.execute("UPDATE runlane_meta SET value = '1' WHERE name = 'schema_version'")

    expected = [(elsewhere, ("01",)), (events[0], ("01",)), (events[1], ("02",))]  # ties by key: "other" first
    reopened = sqlite_storage(database)
    await reopened.start()
    try:
        page = await reopened.query(StorageQuery(by_run, ("env", "run_1"), limit=10))
        assert [(item.key, item.sort) for item in page.items] == expected
        with sqlite3.connect(database) as connection:
            assert connection.execute(rows).fetchall() == [(elsewhere.encoded,)]
            version = connection.execute("SELECT value FROM runlane_meta WHERE name = 'schema_version'").fetchone()
            assert version == (str(SCHEMA_VERSION),) == ("2",)
            # A process that opened the file before the upgrade writes such a row again: not read twice.
            entry = entries[events[1]]
            connection.execute(
                "INSERT INTO runlane_index_rows VALUES (?, ?, ?, ?)",
                (by_run.value, entry.encoded_partition, entry.encoded_sort, events[1].encoded),
            )
        from runlane.testing.storage_conformance import _query_all as query_all  # the suite's pager

        for limit in (1, 10):
            assert await query_all(reopened, StorageQuery(by_run, ("env", "run_1"), limit=limit)) == expected, limit
    finally:
        await reopened.close()


async def sqlite_storage_get(database: Path, *keys: StorageRecordKey) -> list[Any]:
    """Read through a fresh driver (nothing it holds was written by it)."""
    reader = sqlite_storage(database)
    await reader.start()
    try:
        return await reader.get(list(keys))
    finally:
        await reader.close()


async def test_concurrent_commits_share_write_transactions_and_fail_alone(database: Path) -> None:
    """Attempts that reach their commit while one is in flight share the next write transaction; in
    it an attempt that conflicts replays, and one that fails gets its error, without the others."""
    driver = sqlite_storage(database)
    batches: list[int] = []
    commit_batch = driver._commit_batch

    def spy(connection: sqlite3.Connection, attempts: Any) -> Any:
        batches.append(len(attempts))
        return commit_batch(connection, attempts)

    driver._commit_batch = spy  # type: ignore[method-assign]
    await driver.start()
    try:
        counter = StorageRecordKey("batch-counter", "c")
        await create(driver, record(counter, {"n": 0}))

        async def increment(tx: Any) -> None:
            (current,) = await tx.get([counter])
            tx.replace(current, record(counter, {"n": current.document.value["n"] + 1}))
            tx.append(StorageAppendCommand(StorageStreamName.OBSERVATIONS, "batch", [{"n": 1}]))

        async def blind_create(n: int) -> None:
            await create(driver, record(StorageRecordKey("batch-item", str(n)), {"n": n}))

        async def append_to_broken(tx: Any) -> None:
            tx.append(StorageAppendCommand(StorageStreamName.OBSERVATIONS, "broken", [{"n": 1}]))

        await driver.with_transaction(append_to_broken)
        with sqlite3.connect(database) as connection:
            connection.execute(
                "UPDATE runlane_records SET document = ? WHERE key = ?",
                ('{"schemaVersion":1,"value":{"next_position":"x"}}', LAYOUT.head_key("broken").encoded),
            )
        outcomes = await asyncio.wait_for(
            asyncio.gather(
                *(driver.with_transaction(increment) for _ in range(12)),
                *(blind_create(n) for n in range(12)),
                *(driver.with_transaction(append_to_broken) for _ in range(3)),
                return_exceptions=True,
            ),
            WAIT,
        )
        assert outcomes[:24] == [None] * 24
        for failure in outcomes[24:]:
            assert isinstance(failure, RunlaneError) and failure.code is ErrorCode.INVARIANT_VIOLATION, failure
        assert max(batches) > 1, batches
        (current,) = await driver.get([counter])
        assert current is not None and current.document.value == {"n": 12}
        # The appends that committed took contiguous positions: replays and failures consumed none.
        (head,) = await driver.get([LAYOUT.head_key("batch")])
        assert head is not None and head.document.value == {"next_position": "13"}
        assert None not in await driver.get([StorageRecordKey("batch-item", str(n)) for n in range(12)])
        # A blind create of an existing key fails alone (a conflict that replays, then finds it).
        again = await asyncio.gather(blind_create(0), blind_create(100), return_exceptions=True)
        assert isinstance(again[0], RunlaneError) and again[1] is None
    finally:
        await driver.close()


@pytest.mark.parametrize("inotify", [True, False], ids=["inotify", "polling"])
async def test_commits_of_other_connections_wake_subscribers(
    database: Path, inotify: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Subscribers hear ("*": any queue) of commits made through another connection to the file, and
    the watcher stops when the last one unsubscribes and when the driver closes. Where inotify is
    missing, the watcher polls."""
    if not inotify:
        monkeypatch.setattr(sqlite_driver, "_directory_writes", lambda directory: None)
    elif sys.platform.startswith("linux"):  # where the watcher must not poll
        events = sqlite_driver._directory_writes(database.parent)
        assert events is not None, "inotify is missing on Linux"
        os.close(events)
    watcher, writer = sqlite_storage(database), sqlite_storage(database)
    await watcher.start()
    await writer.start()
    try:
        heard: list[str] = []
        unsubscribe = watcher.subscribe_wake_hints(heard.append)
        watcher.publish_wake_hint("emails")  # nothing to send: never raises
        await asyncio.sleep(watcher.wake_poll_interval * 4)
        assert heard == []  # no commit yet
        await create(writer, record(StorageRecordKey("items", "a"), {"n": 1}))
        deadline = asyncio.get_running_loop().time() + WAIT
        while not heard:
            assert asyncio.get_running_loop().time() < deadline, "no hint after another connection committed"
            await asyncio.sleep(0.005)
        assert set(heard) == {"*"}
        thread = watcher._watcher[0] if watcher._watcher else None
        assert thread is not None and thread.is_alive()
        unsubscribe()
        assert not thread.is_alive()
        watcher.subscribe_wake_hints(heard.append)
        thread = watcher._watcher[0] if watcher._watcher else None
        assert thread is not None and thread.is_alive()
    finally:
        await writer.close()
        await watcher.close()
    assert not thread.is_alive()


async def test_a_commit_right_after_subscribing_is_heard_however_late_the_watcher_thread_starts(
    database: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The watcher's first look at the file happens before ``subscribe_wake_hints`` returns: a commit
    made at once, while the watcher thread is still starting, wakes the subscriber all the same."""
    directory_writes = sqlite_driver._directory_writes
    thread_started = threading.Event()

    def slow(directory: Path) -> int | None:
        thread_started.wait(0.3)  # what a loaded machine does to a new thread
        return directory_writes(directory)

    monkeypatch.setattr(sqlite_driver, "_directory_writes", slow)
    await hear_a_commit(sqlite_storage(database), sqlite_storage(database), then=thread_started.set)


async def hear_a_commit(
    watcher: SqliteStorageDriver,
    writer: SqliteStorageDriver,
    then: Callable[[], object] = lambda: None,
    commits: int = 1,
) -> None:
    """Subscribe to ``watcher``'s hints; ``commits`` times, commit through ``writer``, call ``then`` and wait
    (up to ``WAIT``) for the hint. Both drivers are started here and closed after."""
    await watcher.start()
    await writer.start()
    try:
        heard: list[str] = []
        watcher.subscribe_wake_hints(heard.append)
        for n in range(commits):
            if n:
                await asyncio.sleep(watcher.wake_poll_interval * 2)  # past the watcher's one wake-up per interval
            heard.clear()
            await create(writer, record(StorageRecordKey("items", f"item_{n}"), {"n": n}))
            then()
            deadline = asyncio.get_running_loop().time() + WAIT
            while not heard:
                assert asyncio.get_running_loop().time() < deadline, f"commit {n} was never heard"
                await asyncio.sleep(0.002)
    finally:
        await writer.close()
        await watcher.close()


async def test_a_published_hint_wakes_a_watcher_that_looked_before_the_commit_was_visible(
    database: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A commit's writes reach the -wal file before the commit becomes visible, and what makes it visible
    (the -shm index, written through memory) raises no directory event. A watcher that looked once at the
    write and then slept would miss it until its next idle look: core's ``publish_wake_hint`` after the
    commit gives it an event of its own. Here the watcher looks once per event and idles for a minute."""
    monkeypatch.setattr(sqlite_driver, "_WATCH_SETTLE", 0.0)
    monkeypatch.setattr(sqlite_driver, "_WATCH_IDLE_CHECK", 60.0)
    writer = sqlite_storage(database)
    await hear_a_commit(sqlite_storage(database), writer, then=lambda: writer.publish_wake_hint("default"), commits=20)


async def test_a_process_with_more_than_1024_open_files_still_hears_commits(database: Path) -> None:
    """A worker in a process holding many files or sockets (a web application's) gets descriptor numbers
    past 1023 for its watcher, which ``select()`` cannot wait on: the watcher waits on them all the same,
    instead of its thread dying with a traceback and the process's workers waking only by polling."""
    resource = pytest.importorskip("resource")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1100:
        pytest.skip(f"the process may open only {hard} files")
    if soft != resource.RLIM_INFINITY and soft < 1100:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1100, hard))
    held: list[int] = []
    try:
        while not held or held[-1] < 1024:  # every lower number is taken: the watcher's are past 1023
            held.append(os.open(os.devnull, os.O_RDONLY))
        await hear_a_commit(sqlite_storage(database), sqlite_storage(database))
    finally:
        for descriptor in held:
            os.close(descriptor)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def test_a_file_behind_a_symbolic_link_is_checked_and_watched_where_its_log_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite keeps the -wal and -shm files beside the file a link names: that directory is the one that
    must exist and be writable, and the one whose writes wake idle workers (not the link's)."""
    real, links = tmp_path / "real", tmp_path / "links"
    real.mkdir()
    links.mkdir()
    (links / "runlane.db").symlink_to(real / "runlane.db")
    watched: list[Path] = []
    directory_writes = sqlite_driver._directory_writes

    def recording(directory: Path) -> int | None:
        watched.append(directory)
        return directory_writes(directory)

    monkeypatch.setattr(sqlite_driver, "_directory_writes", recording)
    await hear_a_commit(sqlite_storage(links / "runlane.db"), sqlite_storage(real / "runlane.db"))
    assert watched == [real.resolve()]
    (links / "gone.db").symlink_to(tmp_path / "missing" / "runlane.db")
    error = await expect_error(sqlite_storage(links / "gone.db").start(), ErrorCode.CONFIGURATION_INVALID)
    assert f"the directory {str((tmp_path / 'missing').resolve())!r} does not exist" in error.message


async def test_an_empty_exclusive_selection_takes_no_write_lock(database: Path) -> None:
    """An idle worker's scan that finds no row at all is a plain read: a long write transaction of
    another process does not hold it up (a scan that finds rows still holds them in one)."""
    idle = sqlite_storage(database, busy_timeout=0.5)
    await idle.start()
    try:
        with sqlite3.connect(database, isolation_level=None) as writer:
            writer.execute("BEGIN IMMEDIATE")  # the file's write lock, held meanwhile
            try:
                assert await select_exclusive(idle, 3) == []
            finally:
                writer.execute("ROLLBACK")
        await create(idle, record(StorageRecordKey("items", "0"), {"n": 0}, "0"))
        assert await select_exclusive(idle, 3) == [("0",)]
    finally:
        await idle.close()


def test_a_trigger_in_another_process_wakes_an_idle_poll_worker(tmp_path: Path) -> None:
    """An idle poll worker with a long poll delay starts a run another process triggered within
    moments, woken by the commit itself."""
    from runlane import WorkerMode, create_runlane, queue, task

    wake = queue("wake", default=True)
    started: list[float] = []

    @task("wake.echo", queue=wake)
    async def echo(payload: dict) -> None:
        started.append(time.monotonic())

    script = tmp_path / "producer.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import asyncio
            from runlane import create_runlane, queue, task
            from runlane_local import sqlite_lane

            wake = queue("wake", default=True)

            @task("wake.echo", queue=wake)
            async def echo(payload: dict) -> None:
                return None

            async def main():
                async with create_runlane(lane=sqlite_lane({str(tmp_path / "runlane.db")!r}), queues=[wake], tasks=[echo]) as runtime:
                    await runtime.trigger(echo, {{}})

            asyncio.run(main())
            """
        )
    )

    async def body() -> float:
        runtime = create_runlane(lane=sqlite_lane(tmp_path / "runlane.db"), queues=[wake], tasks=[echo])
        async with runtime:
            worker = runtime.worker(mode=WorkerMode.POLL, empty_poll_delay="60s")
            await asyncio.sleep(0.2)  # the worker has scanned once and waits
            producer = await asyncio.create_subprocess_exec(sys.executable, str(script))
            assert await asyncio.wait_for(producer.wait(), WAIT) == 0
            triggered = time.monotonic()
            deadline = triggered + WAIT
            while not started:
                assert time.monotonic() < deadline, "the idle worker never started the run"
                await asyncio.sleep(0.005)
            await worker.stop()
            return started[0] - triggered

    assert asyncio.run(body()) < 5.0  # far below the 60 s poll delay


async def test_a_separate_process_writes_and_this_one_reads(database: Path, child: Path) -> None:
    driver = sqlite_storage(database)
    await driver.start()  # created here, before the child writes
    try:
        process = spawn(child, "write", str(database), "child")
        await asyncio.to_thread(finish, process)
        found = await driver.get([StorageRecordKey("items", f"child-{n}") for n in range(3)])
        assert [item.document.value for item in found] == [{"n": n, "by": "child"} for n in range(3)]
        assert await keys_of(driver, StorageQuery(INDEX, PARTITION)) == [(f"child-{n}",) for n in range(3)]
        records = await driver.get([LAYOUT.record_key("child-stream", position) for position in (1, 2)])
        assert [item.document.value for item in records] == [
            {"i": 0, "stream_position": "1"},
            {"i": 1, "stream_position": "2"},
        ]
    finally:
        await driver.close()


async def test_conflicting_commits_from_several_processes_lose_nothing(database: Path, child: Path) -> None:
    driver = sqlite_storage(database, max_transaction_attempts=1000)
    await driver.start()
    key = StorageRecordKey("counters", "shared")
    try:
        await create(driver, record(key, {"n": 0}))
        processes = [spawn(child, "increment", str(database), "shared", "25") for _ in range(3)]

        async def increment(tx: Any) -> None:
            [current] = await tx.get([key])
            await asyncio.sleep(0)
            tx.replace(current, record(key, {"n": current.document.value["n"] + 1}))

        for _ in range(25):
            await asyncio.wait_for(driver.with_transaction(increment), WAIT)
        for process in processes:
            await asyncio.to_thread(finish, process)
        [final] = await driver.get([key])
        assert final.document.value == {"n": 100}
    finally:
        await driver.close()


# ---------------------------------------------------------------------------------------------
# Exclusive holds across processes


async def _wait_for_file(path: Path, process: subprocess.Popen[str]) -> Any:
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        if path.exists() and path.read_text():
            return json.loads(path.read_text())
        if process.poll() is not None:
            raise AssertionError(f"the child exited early: {process.communicate()[1]}")
        await asyncio.sleep(0.02)
    raise AssertionError("the child did not report its selection in time")


@pytest.mark.skipif(os.name != "posix", reason="dead-owner detection needs POSIX process ids")
async def test_holds_of_a_killed_process_are_freed_at_once(database: Path, child: Path, tmp_path: Path) -> None:
    driver = sqlite_storage(database)
    await driver.start()
    try:
        await create(driver, *(record(StorageRecordKey("items", str(n)), {"n": n}, str(n)) for n in range(4)))
        marker = tmp_path / "held.json"
        process = spawn(child, "hold", str(database), "2", str(marker))
        try:
            held = [tuple(parts) for parts in await _wait_for_file(marker, process)]
            assert held == [("0",), ("1",)]
            mine = await select_exclusive(driver, 4)
            assert mine == [("2",), ("3",)], "records held by another process were selected"
        finally:
            process.send_signal(signal.SIGKILL)
            await asyncio.to_thread(process.communicate, timeout=WAIT)
        started = time.monotonic()
        assert await select_exclusive(driver, 4) == [("0",), ("1",), ("2",), ("3",)]
        assert time.monotonic() - started < 5, "a dead process's holds waited for their expiry"
    finally:
        await driver.close()


async def test_holds_expire_after_hold_timeout(database: Path) -> None:
    holder, other = sqlite_storage(database, hold_timeout=1.0), sqlite_storage(database)
    await holder.start()
    await other.start()
    try:
        await create(holder, *(record(StorageRecordKey("items", str(n)), {"n": n}, str(n)) for n in range(3)))
        # A hold recorded by a process on another host, which never released it.
        with sqlite3.connect(database) as connection:
            connection.execute(
                "INSERT INTO runlane_holds (key, owner, host, pid, expires_at) VALUES (?, 'gone', 'elsewhere', 1, ?)",
                (StorageRecordKey("items", "0").encoded, time.time() + 1.0),
            )
        # An attempt of this process that stays open past its holds' expiry.
        release = asyncio.Event()
        selected: asyncio.Future[list[tuple[str, ...]]] = asyncio.get_running_loop().create_future()

        async def hang(tx: Any) -> None:
            query = StorageQuery(INDEX, PARTITION, limit=1)
            result = await tx.query_candidates(query, mode=StorageCandidateMode.EXCLUSIVE)
            selected.set_result([ref.key.parts for ref in result.items])
            await release.wait()

        hanging = asyncio.create_task(holder.with_transaction(hang))
        held_at = time.monotonic()
        assert await asyncio.wait_for(selected, WAIT) == [("1",)]
        mine = await select_exclusive(other, 3)
        if time.monotonic() - held_at < 0.9:  # both holds still live (the check ran in time)
            assert mine == [("2",)]
        await asyncio.sleep(max(0.0, held_at + 1.1 - time.monotonic()))
        assert await select_exclusive(other, 3) == [("0",), ("1",), ("2",)]
        release.set()
        await asyncio.wait_for(hanging, WAIT)
    finally:
        await other.close()
        await holder.close()


# ---------------------------------------------------------------------------------------------
# Bad input


async def test_missing_directory_is_configuration_invalid(tmp_path: Path) -> None:
    driver = sqlite_storage(tmp_path / "nope" / "runlane.db")
    error = await expect_error(driver.start(), ErrorCode.CONFIGURATION_INVALID)
    assert "does not exist" in error.message


async def test_a_file_where_the_path_needs_a_directory_is_not_said_to_be_missing(tmp_path: Path) -> None:
    (tmp_path / "app.db").write_bytes(b"")
    driver = sqlite_storage(tmp_path / "app.db" / "runlane.db")
    error = await expect_error(driver.start(), ErrorCode.CONFIGURATION_INVALID)
    assert f"{str((tmp_path / 'app.db').resolve())!r} is a file, not a directory" in error.message, error.message
    assert "does not exist" not in error.message


async def test_a_directory_is_not_a_database(tmp_path: Path) -> None:
    await expect_error(sqlite_storage(tmp_path).start(), ErrorCode.CONFIGURATION_INVALID)


@pytest.mark.parametrize(
    "path",
    [
        "~no-such-user-7f3a9c/runlane.db",  # the home of a user that does not exist
        "run\0lane.db",  # a NUL no file name can hold
        "{tmp}/" + "x" * 300 + "/runlane.db",  # a name too long for the file system
        os.devnull,  # a device, not a regular file
    ],
)
async def test_a_path_no_database_file_can_have_is_configuration_invalid(tmp_path: Path, path: str) -> None:
    async def start() -> None:
        driver = sqlite_storage(path.format(tmp=tmp_path))
        await driver.start()
        await driver.close()

    error = await expect_error(start(), ErrorCode.CONFIGURATION_INVALID)
    assert "SQLite storage" in error.message and error.retryable is False


@pytest.mark.parametrize(
    ("path", "scheme"),
    [("sqlite:///runlane.db", "sqlite"), ("postgresql://app:s3cret@db.internal/app", "postgresql")],
)
def test_a_url_for_a_path_is_refused_as_one_without_repeating_it(tmp_path: Path, path: str, scheme: str) -> None:
    # A SQLAlchemy-style URL, or the Postgres URL of another lane, was taken for a relative path: the lane
    # looked for a directory named "sqlite:" (and would have created a file in one that existed), and the
    # message repeated the URL with its password.
    for create in (lambda: sqlite_storage(path), lambda: sqlite_lane(path)):
        with pytest.raises(RunlaneError) as info:
            create()
        error = info.value
        assert error.code is ErrorCode.CONFIGURATION_INVALID
        assert f"must be a file path, got a {scheme}:// URL" in error.message, error.message
        assert "s3cret" not in error.message and "s3cret" not in str(error.meta)
    write(tmp_path / "runlane.toml", f'[runlane]\ntasks = []\n\n[lane]\nuse = "sqlite"\npath = "{path}"\n')
    done = cli(tmp_path, "runs", "list")
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"runlane.toml: The SQLite storage path must be a file path, got a {scheme}:// URL" in done.stderr
    assert "s3cret" not in done.stderr


async def test_a_loop_of_symbolic_links_is_configuration_invalid_and_a_dangling_link_is_created(
    tmp_path: Path,
) -> None:
    (tmp_path / "a.db").symlink_to(tmp_path / "b.db")
    (tmp_path / "b.db").symlink_to(tmp_path / "a.db")
    error = await expect_error(sqlite_storage(tmp_path / "a.db").start(), ErrorCode.CONFIGURATION_INVALID)
    assert "symbolic links" in error.message and "let this user write" not in error.message, error
    (tmp_path / "link.db").symlink_to(tmp_path / "target.db")
    await _start_and_close(sqlite_storage(tmp_path / "link.db"))
    assert (tmp_path / "target.db").is_file()


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes anywhere")
async def test_unwritable_directory_is_configuration_invalid(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        await expect_error(sqlite_storage(locked / "runlane.db").start(), ErrorCode.CONFIGURATION_INVALID)
    finally:
        locked.chmod(0o700)


@pytest.mark.parametrize("content", [b"this is a plain text file, not a database at all\n" * 100, b"x", b"\n"])
async def test_a_file_that_is_not_a_database_is_refused_and_left_as_it_is(database: Path, content: bytes) -> None:
    # SQLite itself would take a file of a byte for an empty database and write over it.
    database.write_bytes(content)
    error = await expect_error(sqlite_storage(database).start(), ErrorCode.CONFIGURATION_INVALID)
    assert "not a SQLite database" in error.message
    assert database.read_bytes() == content


async def test_an_empty_file_becomes_the_database(database: Path) -> None:
    database.write_bytes(b"")
    driver = sqlite_storage(database)
    await driver.start()
    try:
        await create(driver, record(StorageRecordKey("items", "k"), {"text": "x"}))
    finally:
        await driver.close()
    assert database.read_bytes().startswith(b"SQLite format 3\x00")


async def test_a_truncated_file_is_an_invariant_violation_saying_what_to_do(database: Path) -> None:
    driver = sqlite_storage(database)
    await driver.start()
    for number in range(200):  # pages past the first ones, cut off below
        await create(driver, record(StorageRecordKey("items", f"k{number}"), {"text": "x" * 500}))
    await driver.close()
    size = database.stat().st_size
    with database.open("r+b") as file:
        file.truncate(size // 2)
    error = await expect_error(sqlite_storage(database).start(), ErrorCode.INVARIANT_VIOLATION)
    assert "is corrupt" in error.message and "restore it from a backup" in error.message


async def test_a_file_deleted_under_another_process_says_to_stop_the_processes_using_it(database: Path) -> None:
    """A process that keeps the deleted file open keeps its -wal and -shm files under the path, so a
    new file there is read with that log, which names pages the new file does not have: the error
    says so, instead of being hidden by the COMMIT of a read transaction the failure had ended."""
    await _start_and_close(sqlite_storage(database))
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sqlite3, sys\n"
            "connection = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
            "connection.execute('PRAGMA wal_autocheckpoint = 0')\n"
            "connection.execute('CREATE TABLE filler (x BLOB)')\n"  # the schema page, in the -wal file
            "connection.execute('INSERT INTO filler VALUES (zeroblob(100000))')\n"
            "print('ready', flush=True)\n"
            "sys.stdin.read()\n",
            str(database),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        database.unlink()
        error = await expect_error(sqlite_storage(database).start(), ErrorCode.STORAGE_UNAVAILABLE)
    finally:
        holder.communicate(timeout=WAIT)
    assert error.meta["sqlite_error"] == "SQLITE_IOERR_SHORT_READ", error
    assert "deleted or replaced" in error.message and "stop every process using it" in error.message


async def test_an_unknown_schema_version_is_refused(database: Path) -> None:
    await _start_and_close(sqlite_storage(database))
    with sqlite3.connect(database) as connection:
        connection.execute("UPDATE runlane_meta SET value = '99' WHERE name = 'schema_version'")
    error = await expect_error(sqlite_storage(database).start(), ErrorCode.CONFIGURATION_INVALID)
    assert "'99'" in error.message and "upgrade runlane-local" in error.message
    with sqlite3.connect(database) as connection:
        connection.execute("UPDATE runlane_meta SET value = 'x' WHERE name = 'schema_version'")
    error = await expect_error(sqlite_storage(database).start(), ErrorCode.CONFIGURATION_INVALID)
    assert "'x'" in error.message and "restore the file from a backup" in error.message


async def test_a_database_of_something_else_is_refused(database: Path) -> None:
    with sqlite3.connect(database) as connection:
        connection.execute("CREATE TABLE invoices (id INTEGER PRIMARY KEY)")
    error = await expect_error(sqlite_storage(database).start(), ErrorCode.CONFIGURATION_INVALID)
    assert "invoices" in error.message
    with sqlite3.connect(database) as connection:
        tables = [row[0] for row in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        mode = connection.execute("PRAGMA journal_mode").fetchone()[0]
    assert tables == ["invoices"]
    assert mode == "delete", "the other application's database was switched to write-ahead logging"


async def test_an_incomplete_schema_is_an_invariant_violation(database: Path) -> None:
    await _start_and_close(sqlite_storage(database))
    with sqlite3.connect(database) as connection:
        connection.execute("DROP TABLE runlane_index_rows")
    error = await expect_error(sqlite_storage(database).start(), ErrorCode.INVARIANT_VIOLATION)
    assert "runlane_index_rows" in error.message and "restore it from a backup" in error.message


@pytest.mark.parametrize(
    "change",
    [
        "ALTER TABLE runlane_records RENAME COLUMN byte_size TO size",
        "ALTER TABLE runlane_index_rows RENAME COLUMN sort TO position",
        "UPDATE runlane_version_counter SET last = 'x'",
    ],
)
async def test_a_schema_changed_by_something_else_is_an_invariant_violation_saying_what_to_do(
    database: Path, change: str
) -> None:
    await _start_and_close(sqlite_storage(database))
    with sqlite3.connect(database) as connection:
        connection.execute(change)
    driver = sqlite_storage(database)
    try:
        await driver.start()  # the tables it checks are all there
        error = await expect_error(
            create(driver, record(StorageRecordKey("items", "a"), {"n": 1}, "1")), ErrorCode.INVARIANT_VIOLATION
        )
    finally:
        await driver.close()
    assert "something other than Runlane changed the file" in error.message, error
    assert "restore it from a backup" in error.message and error.retryable is False


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
async def test_a_forked_process_cannot_use_the_parents_driver(database: Path) -> None:
    driver = sqlite_storage(database)
    await driver.start()
    try:
        pid = os.fork()
        if pid == 0:  # the child: the inherited driver refuses instead of waiting for a thread it lacks
            code = 1
            try:
                asyncio.run(asyncio.wait_for(driver.get([StorageRecordKey("items", "a")]), 5))
            except RunlaneError as error:
                code = 0 if error.code is ErrorCode.STORAGE_UNAVAILABLE else 2
            except BaseException:
                code = 3
            try:  # closing lets go of the parent's connection without waiting for that thread either
                asyncio.run(asyncio.wait_for(driver.close(), 5))
            except BaseException:
                code = 4
            os._exit(code)
        deadline = time.monotonic() + WAIT
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise AssertionError("the forked child hung on the parent's driver")
            await asyncio.sleep(0.02)
        assert os.waitstatus_to_exitcode(status) == 0
        assert await driver.get([StorageRecordKey("items", "a")]) == [None]
    finally:
        await driver.close()


@pytest.mark.parametrize(
    ("column", "value"),
    [
        ("document", "not json"),
        ("document", '{"schemaVersion":2,"value":{}}'),
        ("document", '{"schemaVersion":1,"value":[]}'),
        ("document", '{"schemaVersion":1,"value":{"x":NaN}}'),
        ("indexes", "[[1,2]]"),
        ("indexes", '[["no_such_index","61","62"]]'),
        ("version", "'abc'"),
    ],
)
async def test_a_corrupt_row_is_an_invariant_violation(database: Path, column: str, value: str) -> None:
    driver = sqlite_storage(database)
    await driver.start()
    key = StorageRecordKey("items", "corrupt")
    try:
        await create(driver, record(key, {"n": 1}, "1"))
        with sqlite3.connect(database) as connection:
            literal = value if column == "version" else "?"
            params = () if column == "version" else (value,)
            connection.execute(f"UPDATE runlane_records SET {column} = {literal} WHERE key = ?", (*params, key.encoded))
        error = await expect_error(driver.get([key]), ErrorCode.INVARIANT_VIOLATION)
        assert key.encoded in error.message

        async def attempt(tx: Any) -> None:
            await tx.get([key])

        await expect_error(driver.with_transaction(attempt), ErrorCode.INVARIANT_VIOLATION)
    finally:
        await driver.close()


async def test_a_corrupt_run_document_fails_operator_reads(database: Path) -> None:
    from runlane.testing.storage_conformance import _run, _run_record  # the suite's own run builders
    from runlane.vocabulary import RunStatus

    environment = Environment(name="corrupt")
    run = _run(environment, "run-1", RunStatus.QUEUED, 0)
    driver = sqlite_storage(database)
    await driver.start()
    try:
        await create(driver, _run_record(run))
        assert await driver.get_run(environment, "run-1") == run
        with sqlite3.connect(database) as connection:
            encoded = _run_record(run).key.encoded
            connection.execute("UPDATE runlane_records SET document = 'garbage' WHERE key = ?", (encoded,))
        await expect_error(driver.get_run(environment, "run-1"), ErrorCode.INVARIANT_VIOLATION)
        await expect_error(
            driver.list_runs(RunFilter(environment=environment), PaginationParams()), ErrorCode.INVARIANT_VIOLATION
        )
    finally:
        await driver.close()


async def test_a_corrupt_index_row_is_an_invariant_violation_naming_the_row(database: Path) -> None:
    """An index row edited by hand (or damaged) that no longer decodes is durable corruption of the file,
    reported as such to the worker that scans it, not as a driver bug (adapter_contract_violation)."""
    from runlane import WorkerMode, create_runlane, queue, task

    default = queue("default", default=True)

    @task("corrupt.index")
    async def echo(payload: dict) -> dict:
        return payload

    runtime = create_runlane(lane=sqlite_lane(database), queues=[default], tasks=[echo])
    async with runtime:
        await runtime.trigger(echo, {"n": 1})
        with sqlite3.connect(database) as connection:
            connection.execute("UPDATE runlane_index_rows SET sort = '30/zz' WHERE index_name = 'runs_runnable'")
        worker = runtime.worker(mode=WorkerMode.DRAIN)
        with pytest.raises(RunlaneError) as raised:
            await asyncio.wait_for(worker.closed, WAIT)
    error = raised.value
    assert error.code is ErrorCode.INVARIANT_VIOLATION, error
    assert "runs_runnable index" in error.message and "'30/zz'" in error.message
    assert error.meta["row_sort"] == "30/zz"


async def test_operator_reads_name_a_run_or_event_whose_document_holds_something_else(database: Path) -> None:
    """A well-formed document under the wrong key (restored from elsewhere, edited by hand) is corruption
    too: listing it is refused, naming the record, instead of showing it under another id or leaving it out."""
    from runlane import create_runlane, queue, task

    default = queue("default", default=True)

    @task("corrupt.echo")
    async def echo(payload: dict) -> dict:
        return payload

    runtime = create_runlane(lane=sqlite_lane(database), queues=[default], tasks=[echo])
    async with runtime:
        first = await runtime.run_now(echo, {"n": 1})
        second = await runtime.run_now(echo, {"n": 2})
        assert len((await runtime.runs.list()).data) == 2

        def run_key(run_id: str) -> str:
            return StorageRecordKey("runs", "default", run_id).encoded

        def event_key(run_id: str, sequence: int) -> str:
            return StorageRecordKey("run_events", "default", run_id, f"{sequence:020d}").encoded

        def text(key: str) -> str:
            with sqlite3.connect(database) as connection:
                return connection.execute("SELECT document FROM runlane_records WHERE key = ?", (key,)).fetchone()[0]

        def put(key: str, document: str) -> None:
            with sqlite3.connect(database) as connection:
                connection.execute("UPDATE runlane_records SET document = ? WHERE key = ?", (document, key))

        run_text, second_text = text(run_key(first.id)), text(run_key(second.id))
        put(run_key(first.id), second_text)  # the first run's key now holds the second run
        with pytest.raises(RunlaneError) as raised:
            await runtime.runs.list()
        assert raised.value.code is ErrorCode.INVARIANT_VIOLATION
        message = raised.value.message
        assert f"The stored document of run {first.id} holds run {second.id}: durable corruption" in message
        put(run_key(first.id), run_text)

        two_key, one_text, two_text = event_key(first.id, 2), text(event_key(first.id, 1)), text(event_key(first.id, 2))
        put(two_key, one_text)  # event 2 of the run now holds event 1
        with pytest.raises(RunlaneError, match=rf"event 2 of run {first.id} holds event 1 of run {first.id}"):
            await runtime.runs.events(first.id, sort_by="sequence")
        put(two_key, '{"schemaVersion":1,"value":{}}')  # an empty event
        with pytest.raises(RunlaneError, match=rf"event 2 of run {first.id} is not a readable run event"):
            await runtime.runs.events(first.id, sort_by="sequence")
        put(two_key, '{"schemaVersion":2,"value":{}}')  # a version this release cannot read
        with pytest.raises(RunlaneError, match=rf"event 2 of run {first.id} cannot be read \(Unsupported"):
            await runtime.runs.events(first.id, sort_by="sequence")
        put(two_key, two_text)
        assert len((await runtime.runs.events(first.id)).data) == first.event_sequence


async def test_a_lane_starts_and_reads_while_another_process_holds_the_write_lock(database: Path) -> None:
    first = sqlite_storage(database)
    await first.start()  # creates the schema
    key = StorageRecordKey("items", "read-while-locked")
    await create(first, record(key, {"n": 1}))
    await first.close()
    blocker = sqlite3.connect(database, isolation_level=None)
    try:
        blocker.execute("BEGIN IMMEDIATE")  # a writer elsewhere, mid-transaction
        reader = sqlite_storage(database, busy_timeout=0.2)
        await asyncio.wait_for(reader.start(), WAIT)  # a current schema is only read
        try:
            assert (await reader.get([key]))[0].document.value == {"n": 1}
        finally:
            await reader.close()
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()


async def test_a_locked_database_is_storage_unavailable_without_blocking_the_loop(database: Path) -> None:
    driver = sqlite_storage(database, busy_timeout=0.4)
    await driver.start()
    key = StorageRecordKey("items", "locked")
    await create(driver, record(key, {"n": 1}))
    blocker = sqlite3.connect(database, isolation_level=None)
    try:
        blocker.execute("BEGIN IMMEDIATE")  # another writer holds the file's write lock
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticking = asyncio.create_task(ticker())
        try:
            # Reads need no write lock (WAL): they still work.
            assert (await asyncio.wait_for(driver.get([key]), WAIT))[0].document.value == {"n": 1}
            started = time.monotonic()
            blocked = create(driver, record(StorageRecordKey("items", "new"), {}))
            error = await expect_error(blocked, ErrorCode.STORAGE_UNAVAILABLE)
            waited = time.monotonic() - started
        finally:
            ticking.cancel()
        assert error.retryable is True
        assert "locked" in error.message
        assert "raise busy_timeout, or shorten the other process's write transactions" in error.message
        assert 0.3 <= waited < 5, f"waited {waited:.2f}s for a busy_timeout of 0.4s"
        assert ticks >= 10, "the event loop was blocked while the driver waited for the lock"
        blocker.execute("ROLLBACK")
        await create(driver, record(StorageRecordKey("items", "new"), {}))
        assert (await driver.get([StorageRecordKey("items", "new")]))[0] is not None
    finally:
        blocker.close()
        await driver.close()


# ---------------------------------------------------------------------------------------------
# The lane provider and runlane.toml


def test_lane_provider_options(tmp_path: Path) -> None:
    provider = get_registries().lanes.get("sqlite")
    assert provider.plugin == "local"
    options = validate_options(provider, {"path": "data/runlane.db", "synchronous": "normal", "busy_timeout": "250ms"})
    lane = provider.create(options, ProviderContext(base_dir=tmp_path))
    assert isinstance(lane, Lane) and lane.name == "sqlite"
    assert lane.storage.path == tmp_path / "data" / "runlane.db"
    assert lane.storage.synchronous == "normal" and lane.storage.busy_timeout == 0.25
    assert lane.capabilities.production_durable is False
    options = validate_options(provider, {"path": str(tmp_path / "a.db"), "name": "x"})
    absolute = provider.create(options, ProviderContext())
    assert absolute.storage.path == tmp_path / "a.db" and absolute.name == "x"
    seconds = provider.create(validate_options(provider, {"path": "x.db", "busy_timeout": 2}), ProviderContext())
    assert seconds.storage.busy_timeout == 2.0
    for bad in ({}, {"path": "x.db", "pth": "y"}, {"path": "x.db", "synchronous": "off"}, {"path": ""}):
        with pytest.raises(RunlaneError) as caught:
            validate_options(provider, bad)
        assert caught.value.code is ErrorCode.CONFIGURATION_INVALID
    with pytest.raises(RunlaneError) as caught:
        provider.create(validate_options(provider, {"path": "x.db", "busy_timeout": "soon"}), ProviderContext())
    assert caught.value.code is ErrorCode.CONFIGURATION_INVALID
    with pytest.raises(RunlaneError) as caught:  # not a RuntimeError the CLI blames on the plugin
        provider.create(validate_options(provider, {"path": "~no-such-user-7f3a9c/x.db"}), ProviderContext())
    assert caught.value.code is ErrorCode.CONFIGURATION_INVALID and "'~'" in caught.value.message
    for flag in (True, False):  # TOML's true is no duration: not taken for 1 second
        with pytest.raises(RunlaneError) as caught:
            validate_options(provider, {"path": "x.db", "busy_timeout": flag})
        assert caught.value.code is ErrorCode.CONFIGURATION_INVALID and "busy_timeout" in caught.value.message


@pytest.mark.parametrize("path", [":memory:", "file:x.db?mode=memory"])
def test_an_in_memory_database_through_runlane_toml_is_refused_as_in_python(tmp_path: Path, path: str) -> None:
    """Resolved against the config's directory, ':memory:' would otherwise be a durable file of that name."""
    provider = get_registries().lanes.get("sqlite")
    with pytest.raises(RunlaneError) as caught:
        provider.create(validate_options(provider, {"path": path}), ProviderContext(base_dir=tmp_path))
    assert caught.value.code is ErrorCode.CONFIGURATION_INVALID
    assert "must name a database file" in caught.value.message and "use the local lane" in caught.value.message
    assert list(tmp_path.iterdir()) == []


TASKS = """
from runlane import queue, task

emails = queue("emails", default=True)


@task("emails.welcome", queue=emails)
def send_welcome(payload: dict) -> dict:
    return {"sent": payload["user_id"]}
"""


def test_sqlite_lane_through_runlane_toml_shares_runs_between_processes(tmp_path: Path) -> None:
    project = tmp_path / "project"
    write(project / "app" / "__init__.py", "")
    write(project / "app" / "tasks.py", TASKS)
    write(
        project / "runlane.toml",
        """
        [runlane]
        tasks = ["app.tasks"]

        [lane]
        use = "sqlite"
        path = "state/runlane.db"
        """,
    )
    missing = cli(project, "--json", "trigger", "emails.welcome", '{"user_id": "u1"}')
    assert missing.returncode == 1
    assert json.loads(missing.stderr)["error"]["code"] == "configuration_invalid"
    (project / "state").mkdir()

    triggered = cli(project, "--json", "trigger", "emails.welcome", '{"user_id": "u1"}')
    assert triggered.returncode == 0, triggered.stderr
    run_id = json.loads(triggered.stdout)["run"]["id"]
    assert (project / "state" / "runlane.db").is_file()

    # Each command is its own process; a relative path resolves against the config's directory.
    listed = cli(tmp_path, "--json", "-c", str(project / "runlane.toml"), "runs", "list", "--status", "queued")
    assert listed.returncode == 0, listed.stderr
    assert [run["id"] for run in json.loads(listed.stdout)["data"]] == [run_id]

    worked = cli(project, "--json", "work", "--drain")
    assert worked.returncode == 0, worked.stderr

    detail = cli(project, "--json", "runs", "get", run_id, "--events")
    assert detail.returncode == 0, detail.stderr
    document = json.loads(detail.stdout)
    assert document["run"]["status"] == "succeeded"
    assert document["run"]["output"] == {"sent": "u1"}
    assert [record["event"]["type"] for record in document["events"]["data"]][-1] == "run.succeeded"

    bad = write(project / "bad.toml", '[lane]\nuse = "sqlite"\npath = "x.db"\nmode = "wal"\n')
    unknown = cli(project, "--json", "-c", str(bad), "runs", "list")
    assert unknown.returncode == 1
    assert "'mode'" in json.loads(unknown.stderr)["error"]["message"]


async def test_projection_rows_of_commits_match_the_stored_documents(database: Path) -> None:
    """The rows a commit writes come from fields core remembered on its documents (runs in every
    state, terminal ones included, and their history); rebuilt from the stored text they are equal."""
    from runlane import Retry, create_runlane, queue, task
    from runlane.storage.operator_sql import operator_event_row, operator_run_row

    rows_queue = queue("rows", default=True)

    @task("rows.ok", queue=rows_queue)
    async def ok(payload: dict) -> dict:
        return {"n": payload["n"]}

    @task("rows.failing", queue=rows_queue, retry=Retry(max_attempts=2))
    async def failing(payload: dict) -> None:
        raise RuntimeError("no")

    async with create_runlane(lane=sqlite_lane(database), queues=[rows_queue], tasks=[ok, failing]) as runtime:
        for n in range(3):
            await runtime.trigger(ok, {"n": n})
        await runtime.trigger(failing, {"n": 9}, idempotency_key="fail-once")
        cancelled = await runtime.trigger(ok, {"n": 10}, singleton_key="one")
        await runtime.runs.cancel(cancelled.run.id)
        for _ in range(4):
            await runtime.execute_next()
    with sqlite3.connect(database) as connection:
        records = connection.execute("SELECT key, document, byte_size FROM runlane_records").fetchall()
        runs = {row[2]: row for row in connection.execute("SELECT * FROM runlane_operator_runs")}
        events = {row[3]: row for row in connection.execute("SELECT * FROM runlane_operator_events")}
    expected_runs, expected_events = {}, {}
    for encoded, text, byte_size in records:
        key = StorageRecordKey.decode(encoded)
        document = StorageDocument(text, byte_size)  # nothing remembered: built from the text
        if key.collection == "runs":
            expected_runs[encoded] = operator_run_row(key, document)
        elif key.collection == "run_events":
            expected_events[encoded] = operator_event_row(key, document)
    assert len(expected_runs) == 5 and len(expected_events) > 10
    assert {row[4] for row in runs.values()} >= {"succeeded", "cancelled", "retrying"}
    assert runs == expected_runs
    assert events == expected_events


def _run_list_sql(filter: RunFilter) -> Any:
    from runlane.storage.operator_sql import run_list_query

    return run_list_query(
        filter,
        PaginationParams(limit=20),
        runs_table="runlane_operator_runs",
        records_table="runlane_records",
        placeholder="?",
    )


def _query_plan(database: Path, query: Any) -> list[str]:
    """The steps of SQLite's plan for an operator page query (``EXPLAIN QUERY PLAN``)."""
    with sqlite3.connect(database) as connection:
        return [row[3] for row in connection.execute(f"EXPLAIN QUERY PLAN {query.text}", query.params)]


@pytest.mark.parametrize("direction", ["asc", "desc"])
def test_the_run_at_list_reads_the_availability_index_and_older_files_gain_it(database: Path, direction: str) -> None:
    """Each availability group of the run_at order is read in index order (SQLite sorts only the
    page-sized results); a file created before the index existed gets it when a driver opens it."""
    from runlane.vocabulary import RunSortField, SortDirection

    asyncio.run(_start_and_close(sqlite_storage(database)))
    with sqlite3.connect(database) as connection:
        connection.execute("DROP INDEX runlane_operator_runs_by_availability")
    asyncio.run(_start_and_close(sqlite_storage(database)))  # an older file: the index comes back
    plan = _query_plan(
        database,
        _run_list_sql(
            RunFilter(
                environment=Environment(name="default"),
                sort_by=RunSortField.RUN_AT,
                sort_direction=SortDirection(direction),
            )
        ),
    )
    searches = [step for step in plan if "runlane_operator_runs_by_availability" in step]
    assert len(searches) == 2, plan  # one search per availability group
    # The only sort left is the one over both groups' limited rows (the outer query's).
    assert sum("USE TEMP B-TREE FOR ORDER BY" in step for step in plan) <= 1, plan


def test_one_runs_events_and_a_status_filter_read_their_own_index_rows_not_the_environments(database: Path) -> None:
    """``runs.events(run_id)`` in its default (time) order and ``runs.list(statuses=...)`` cost as much
    as the rows they return, not as every event or run of the environment; older files gain the indexes."""
    from runlane.storage.operator import RunEventFilter
    from runlane.storage.operator_sql import run_event_list_query
    from runlane.vocabulary import RunStatus

    asyncio.run(_start_and_close(sqlite_storage(database)))
    with sqlite3.connect(database) as connection:
        connection.execute("DROP INDEX runlane_operator_runs_by_status")
        connection.execute("DROP INDEX runlane_operator_events_of_run_by_time")
    asyncio.run(_start_and_close(sqlite_storage(database)))  # an older file: the indexes come back
    environment = Environment(name="default")
    events = run_event_list_query(
        RunEventFilter(environment=environment, run_id="run_1"),
        PaginationParams(limit=20),
        events_table="runlane_operator_events",
        runs_table="runlane_operator_runs",
        records_table="runlane_records",
        placeholder="?",
    )
    event_plan = _query_plan(database, events)
    run_plan = _query_plan(database, _run_list_sql(RunFilter(environment=environment, statuses=[RunStatus.FAILED])))
    assert any("runlane_operator_events_of_run_by_time (environment=? AND run_id=?)" in step for step in event_plan)
    assert not any("TEMP B-TREE" in step for step in event_plan), event_plan
    assert any("runlane_operator_runs_by_status (environment=? AND status=?)" in step for step in run_plan), run_plan
    assert not any("TEMP B-TREE" in step for step in run_plan), run_plan


_SELECTIVE_FILTERS = {
    "runlane_operator_runs_by_task": {"task_ids": ["billing.charge"]},
    "runlane_operator_runs_by_idempotency_key": {"idempotency_key": "order-7"},
    "runlane_operator_runs_by_singleton_key": {"singleton_key": "account-7"},
    "runlane_operator_runs_by_source_run": {"source_run_id": "run_parent"},
}


@pytest.mark.parametrize("index", list(_SELECTIVE_FILTERS))
def test_a_task_key_or_source_run_filter_reads_its_own_index_and_older_files_gain_it(
    database: Path, index: str
) -> None:
    """``runs list --task / --idempotency-key / --singleton-key / --source-run`` read the matching runs
    in created order from an index of their own, not every run of the environment."""
    asyncio.run(_start_and_close(sqlite_storage(database)))
    with sqlite3.connect(database) as connection:
        connection.execute(f"DROP INDEX {index}")
    asyncio.run(_start_and_close(sqlite_storage(database)))  # an older file: the index comes back
    run_filter = RunFilter(environment=Environment(name="default"), **_SELECTIVE_FILTERS[index])
    plan = _query_plan(database, _run_list_sql(run_filter))
    assert any(f"{index} (environment=? AND " in step for step in plan), plan
    assert not any("TEMP B-TREE" in step for step in plan), plan


@pytest.mark.parametrize("holder", [None, "owner"], ids=["query", "exclusive"])
def test_pages_of_entries_restating_their_key_search_both_primary_keys(database: Path, holder: str | None) -> None:
    """A page of events by run reads a range of the index rows' and of the records' primary keys
    (each cut to the page); only the page-sized union is sorted."""
    asyncio.run(_start_and_close(sqlite_storage(database)))
    query = StorageQuery(StorageIndexName.RUN_EVENTS_BY_RUN, ("env", "run_1"), limit=10)
    text, params = sqlite_driver._index_query(query, None, 11, holder)
    with sqlite3.connect(database) as connection:
        plan = [row[3] for row in connection.execute(f"EXPLAIN QUERY PLAN {text}", params)]
    assert any(step.startswith("SEARCH i USING PRIMARY KEY (index_name=? AND partition=?)") for step in plan), plan
    assert any(step.startswith("SEARCH r USING INDEX sqlite_autoindex_runlane_records_1 (key>? AND key<?)") for step in plan), plan
    assert not [step for step in plan if step.startswith(("SCAN i", "SCAN r"))], plan
    assert sum("USE TEMP B-TREE FOR ORDER BY" in step for step in plan) == 1, plan


async def test_the_wal_file_gives_its_space_back_once_a_checkpoint_has_caught_up(
    database: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sqlite_driver, "WAL_SIZE_LIMIT", 64 * 1024)
    driver = sqlite_storage(database)
    await driver.start()
    wal = Path(f"{database}-wal")
    blob = "x" * 10_000
    try:
        # A reader holding a snapshot (a long operator read, a backup) keeps checkpoints from catching up.
        reader = sqlite3.connect(database)
        reader.execute("BEGIN")
        reader.execute("SELECT count(*) FROM runlane_records").fetchone()
        for batch in range(10):
            keys = [StorageRecordKey("blobs", "default", f"b{batch}_{n}") for n in range(50)]
            await create(driver, *(record(key, {"blob": blob}) for key in keys))
        grown = wal.stat().st_size
        assert grown > 4 * 1024 * 1024
        reader.execute("COMMIT")
        reader.close()
        for n in range(3):  # the next commits checkpoint the log, then restart it from the beginning
            await create(driver, record(StorageRecordKey("blobs", "default", f"after_{n}"), {"n": n}))
        assert wal.stat().st_size <= 1024 * 1024, (grown, wal.stat().st_size)
    finally:
        await driver.close()


DISK_FULL_CHILD = """
import asyncio, errno, json, os, sqlite3, subprocess, sys
from runlane import RunlaneError, create_runlane, queue, task
from runlane_local import sqlite_lane

disk = sys.argv[1]
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", disk], check=True)
database = os.path.join(disk, "runlane.db")
filler = os.path.join(disk, "filler")
report = {}


DEFAULT = queue("default", default=True)


@task("fill.noop")
def noop(payload: dict) -> None:
    return None


def runtime():
    return create_runlane(lane=sqlite_lane(database), queues=[DEFAULT], tasks=[noop])


def fill() -> None:
    descriptor = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        while True:
            os.write(descriptor, bytes(4096))
    except OSError as error:
        assert error.errno == errno.ENOSPC, error
    finally:
        os.close(descriptor)


def failure(error: RunlaneError) -> dict:
    return {"code": error.code.value, "retryable": error.retryable, "message": error.message}


async def main() -> None:
    async with runtime() as rt:
        await rt.trigger(noop, {})
    fill()  # the -wal and -shm files went with the last connection: none can be created now
    try:
        async with runtime() as rt:
            await rt.runs.list()
    except RunlaneError as error:
        report["open"] = failure(error)
    os.remove(filler)
    async with runtime() as rt:
        fill()  # the -shm file exists now; the commits fill the -wal file
        try:
            for _ in range(1000):
                await rt.trigger(noop, {"pad": "x" * 4000})
        except RunlaneError as error:
            report["commit"] = failure(error)
        # Concurrent triggers share a write transaction too large for SQLite's page cache, which
        # spills to the -wal file before the COMMIT: the disk fills in the middle of the batch.
        outcomes = await asyncio.gather(
            *(rt.trigger(noop, {"pad": "y" * 150_000}) for _ in range(32)), return_exceptions=True
        )
        report["batch"] = [failure(error) for error in outcomes if isinstance(error, RunlaneError)]
        report["batch_others"] = [repr(error) for error in outcomes if isinstance(error, BaseException)]
        os.remove(filler)
        await rt.trigger(noop, {})
        while await rt.execute_next() is not None:
            pass
        statuses = set()
        cursor = None
        while True:
            page = await rt.runs.list(limit=100, cursor=cursor)
            statuses.update(run.status.value for run in page.data)
            if (cursor := page.next_cursor) is None:
                break
        report["statuses"] = sorted(statuses)
    with sqlite3.connect(database) as connection:
        report["integrity"] = connection.execute("PRAGMA integrity_check").fetchone()[0]


asyncio.run(main())
print(json.dumps(report))
"""


def test_a_full_disk_is_a_retryable_error_that_says_so_and_work_resumes_once_space_is_freed(tmp_path: Path) -> None:
    """On a small file system of its own (a tmpfs in a private mount namespace): a disk too full to
    create the -shm file, and a disk that fills while commits append to the -wal file (a lone commit,
    or a group commit in the middle of its transaction), fail with a retryable storage_unavailable
    naming the full disk, leave nothing half-written, and the runs go on once space is freed."""
    if not sys.platform.startswith("linux") or shutil.which("unshare") is None:
        pytest.skip("needs Linux and unshare(1) to mount a small file system")
    disk = tmp_path / "disk"
    disk.mkdir()
    script = tmp_path / "child.py"
    script.write_text(DISK_FULL_CHILD)
    isolated = ["unshare", "--user", "--map-root-user", "--mount"]
    probe = [*isolated, "mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)]
    if subprocess.run(probe, capture_output=True, timeout=WAIT).returncode != 0:
        pytest.skip("cannot mount a file system in a private mount namespace here")
    result = subprocess.run(
        [*isolated, sys.executable, str(script), str(disk)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(report["batch"]) == 32 and len(report["batch_others"]) == 32, report["batch_others"]
    for failure in (report["open"], report["commit"], *report["batch"]):
        assert failure["code"] == "storage_unavailable" and failure["retryable"], failure
        assert "disk holding the file is full: free space there" in failure["message"], failure
    assert report["statuses"] == ["succeeded"]
    assert report["integrity"] == "ok"


async def test_the_documented_backups_of_a_file_in_use_hold_every_commit_and_open_as_a_lane(tmp_path: Path) -> None:
    """docs/lanes.md ("Backups"): VACUUM INTO and Python's Connection.backup() copy a file while a
    runtime writes to it, with the commits still in its -wal file, and the copy opens as a lane."""
    from runlane import create_runlane, queue, task

    default = queue("default", default=True)

    @task("backup.noop")
    def noop(payload: dict) -> None:
        return None

    database = tmp_path / "runlane.db"
    runtime = create_runlane(lane=sqlite_lane(database), queues=[default], tasks=[noop])
    async with runtime:
        created = {(await runtime.trigger(noop, {"n": n})).run.id for n in range(5)}
        assert Path(f"{database}-wal").stat().st_size > 0  # the commits are (also) in the -wal file
        source, target = sqlite3.connect(database), sqlite3.connect(tmp_path / "copied.db")
        try:
            source.execute("VACUUM INTO ?", (str(tmp_path / "vacuumed.db"),))
            source.backup(target)
        finally:
            source.close()
            target.close()
        await runtime.trigger(noop, {"n": 5})  # after the copies
    for copy in ("vacuumed.db", "copied.db"):
        restored = create_runlane(lane=sqlite_lane(tmp_path / copy), queues=[default], tasks=[noop])
        async with restored:
            assert {run.id for run in (await restored.runs.list()).data} == created, copy
            assert await restored.execute_next() is not None
