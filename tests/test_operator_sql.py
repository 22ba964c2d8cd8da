"""The SQL operator projection and list queries page exactly like the in-memory reference.

A runtime over the in-memory lane creates a varied set of runs (statuses, queues, keys, sources,
tombstones, an undecodable run); every record is then copied into a plain SQLite database with the
projection rows ``runlane.storage.operator_sql`` derives, and each filter / sort / direction /
page size is listed through both, page by page, comparing ids and cursors' effect.
"""

from __future__ import annotations

import asyncio
import sqlite3
from datetime import timedelta
from typing import Any

import pytest

from runlane import Retry, RunEventSortField, RunEventType, RunSortField, RunStatus, SortDirection, TimeRange, task
from runlane.errors import ErrorCode, RunlaneError
from runlane.models import Environment
from runlane.storage import (
    PaginationParams,
    RunEventFilter,
    RunFilter,
    StorageDocument,
    StorageRecordKey,
    run_tombstone_key,
)
from runlane.storage.operator_sql import (
    OPERATOR_EVENT_COLUMNS,
    OPERATOR_RUN_COLUMNS,
    finish_event_page,
    finish_run_page,
    is_operator_event_key,
    is_operator_run_key,
    operator_event_row,
    operator_run_row,
    run_event_list_query,
    run_list_query,
)
from runlane.storage.tables import peek_run_event_document
from runlane_local.memory import _unpack

from runtime_support import DEFAULT_QUEUE, make_runtime
from runlane import queue

EMAILS = queue("emails")
ENV = Environment(name="default")


@task(id="ok")
async def ok(payload: dict) -> dict:
    return {"done": True}


@task(id="flaky", retry=Retry(max_attempts=3))
async def flaky(payload: dict) -> None:
    raise RuntimeError("nope")


async def _populate() -> tuple[Any, list[str]]:
    runtime, clock = make_runtime(ok, flaky, queues=[DEFAULT_QUEUE, EMAILS])
    ids: list[str] = []
    for index in range(14):
        clock.advance(timedelta(seconds=7 * (index % 5) + 1))
        definition = ok if index % 3 else flaky
        options: dict[str, Any] = {}
        if index % 4 == 0:
            options["idempotency_key"] = f"idem-{index}"
        if index % 5 == 0:
            options["singleton_key"] = f"single-{index}"
        if index % 2:
            options["queue"] = "emails"
        result = await runtime.trigger(definition, {"n": index}, **options)
        ids.append(result.run.id)
    for _ in range(5):
        await runtime.execute_next()
        clock.advance(timedelta(seconds=3))
    await runtime.runs.cancel(ids[-1])
    return runtime, ids


def _copy_into_sqlite(runtime: Any, ids: list[str]) -> sqlite3.Connection:
    connection = sqlite3.connect(":memory:")
    connection.execute("CREATE TABLE records (key TEXT PRIMARY KEY, document TEXT, byte_size INTEGER)")
    connection.execute(f"CREATE TABLE oruns ({', '.join(OPERATOR_RUN_COLUMNS)})")
    connection.execute(f"CREATE TABLE oevents ({', '.join(OPERATOR_EVENT_COLUMNS)})")
    state = runtime.lane.storage.store._state
    records = [_unpack(stored) for stored in state.records.values()]
    # One tombstoned run (hidden with its events) and one run whose document no longer decodes.
    tombstoned = StorageRecordKey("runs", "default", ids[1])
    hidden = run_tombstone_key("default", ids[1])
    broken = StorageRecordKey("runs", "default", ids[2])
    for record in records:
        document = record.document
        if record.key.encoded == broken.encoded:
            document = StorageDocument.encode({"run": {"id": "garbage"}})
        connection.execute("INSERT INTO records VALUES (?, ?, ?)", (record.key.encoded, document.text, document.byte_size))
        if is_operator_run_key(record.key) and (row := operator_run_row(record.key, document)) is not None:
            connection.execute(f"INSERT INTO oruns VALUES ({', '.join('?' * len(row))})", row)
        if is_operator_event_key(record.key) and (row := operator_event_row(record.key, document)) is not None:
            connection.execute(f"INSERT INTO oevents VALUES ({', '.join('?' * len(row))})", row)
    connection.execute("INSERT INTO records VALUES (?, '{}', 2)", (hidden.encoded,))
    assert tombstoned.encoded != hidden.encoded
    return connection


async def _reference(runtime: Any, ids: list[str]) -> Any:
    """The reference driver with the same tombstone and broken run applied."""
    from runlane.storage import NewStorageRecord

    driver = runtime.lane.storage

    async def corrupt(tx: Any) -> None:
        broken, tombstone = await tx.get([StorageRecordKey("runs", "default", ids[2]), run_tombstone_key("default", ids[1])])
        tx.replace(broken, NewStorageRecord(broken.key, StorageDocument.encode({"run": {"id": "garbage"}}), broken.indexes))
        tx.create(NewStorageRecord(run_tombstone_key("default", ids[1]), StorageDocument.encode({}), ()))

    await driver.with_transaction(corrupt)
    return driver


def _sql_pages(connection: sqlite3.Connection, build: Any, finish: Any, flt: Any, limit: int) -> list[list[str]]:
    pages, cursor = [], None
    while True:
        query = build(flt, PaginationParams(limit=limit, cursor=cursor))
        page = finish(query, flt, connection.execute(query.text, query.params).fetchall())
        pages.append([_ident(item) for item in page.data])
        cursor = page.next_cursor
        if cursor is None:
            return pages


async def _reference_pages(list_page: Any, flt: Any, limit: int) -> list[list[str]]:
    pages, cursor = [], None
    while True:
        page = await list_page(flt, PaginationParams(limit=limit, cursor=cursor))
        pages.append([_ident(item) for item in page.data])
        cursor = page.next_cursor
        if cursor is None:
            return pages


def _ident(item: Any) -> str:
    return item.id if hasattr(item, "task_id") else f"{item.event.run_id}#{item.sequence}"


RUN_FILTERS = [
    {},
    {"statuses": (RunStatus.QUEUED, RunStatus.SUCCEEDED)},
    {"statuses": ()},
    {"queues": ("emails",)},
    {"task_ids": ("flaky",)},
    {"idempotency_key": "idem-4"},
    {"singleton_key": "single-10"},
    {"created_at": TimeRange(start=None, end=None)},
]


@pytest.mark.parametrize("extra", RUN_FILTERS)
@pytest.mark.parametrize("sort_by", list(RunSortField))
@pytest.mark.parametrize("direction", list(SortDirection))
@pytest.mark.parametrize("limit", [1, 3, 100])
def test_run_pages_match_the_reference(extra: dict, sort_by: RunSortField, direction: SortDirection, limit: int) -> None:
    async def main() -> None:
        runtime, ids = await _populate()
        connection = _copy_into_sqlite(runtime, ids)
        driver = await _reference(runtime, ids)
        flt = RunFilter(environment=ENV, sort_by=sort_by, sort_direction=direction, **extra)

        def build(f: Any, p: Any) -> Any:
            return run_list_query(f, p, runs_table="oruns", records_table="records", placeholder="?")

        expected = await _reference_pages(driver.list_runs, flt, limit)
        assert _sql_pages(connection, build, finish_run_page, flt, limit) == expected
        listed = {run_id for page in expected for run_id in page}
        assert ids[1] not in listed and ids[2] not in listed

    asyncio.run(main())


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"types": (RunEventType("run.created"),)},
        {"run_id": "pick"},
        {"run_id": "pick", "sort_by": RunEventSortField.SEQUENCE},
        {"run_id": "hidden"},
    ],
)
@pytest.mark.parametrize("direction", list(SortDirection))
@pytest.mark.parametrize("limit", [2, 100])
def test_event_pages_match_the_reference(extra: dict, direction: SortDirection, limit: int) -> None:
    async def main() -> None:
        runtime, ids = await _populate()
        connection = _copy_into_sqlite(runtime, ids)
        driver = await _reference(runtime, ids)
        options = dict(extra)
        if options.get("run_id") == "pick":
            options["run_id"] = ids[0]
        elif options.get("run_id") == "hidden":
            options["run_id"] = ids[1]
        flt = RunEventFilter(environment=ENV, sort_direction=direction, **options)

        def build(f: Any, p: Any) -> Any:
            return run_event_list_query(
                f, p, events_table="oevents", runs_table="oruns", records_table="records", placeholder="?"
            )

        expected = await _reference_pages(driver.list_run_events, flt, limit)
        assert _sql_pages(connection, build, finish_event_page, flt, limit) == expected
        if options.get("run_id") == ids[1]:
            assert expected == [[]]

    asyncio.run(main())


def test_rows_are_built_without_decoding_and_refuse_mismatched_keys() -> None:
    async def main() -> None:
        runtime, ids = await _populate()
        state = runtime.lane.storage.store._state
        for stored in state.records.values():
            record = _unpack(stored)
            if is_operator_run_key(record.key):
                plain = StorageDocument(record.document.text, record.document.byte_size)  # nothing remembered
                row = operator_run_row(record.key, plain)
                assert row is not None and row == operator_run_row(record.key, record.document)
                assert row[3] == run_tombstone_key(*record.key.parts).encoded
                other = StorageRecordKey("runs", "default", "run_other")
                assert operator_run_row(other, plain) is None
                elsewhere = StorageRecordKey("not_runs", *record.key.parts)  # same parts, another collection
                assert operator_run_row(elsewhere, plain) is None
                assert operator_run_row(elsewhere, record.document) is None
            if is_operator_event_key(record.key):
                plain = StorageDocument(record.document.text, record.document.byte_size)
                decoded = StorageDocument(record.document.text, record.document.byte_size)
                assert peek_run_event_document(decoded) is not None  # remembered: the other path
                row = operator_event_row(record.key, plain)
                assert row is not None and row == operator_event_row(record.key, decoded)
                wrong = StorageRecordKey("run_events", "default", record.key.parts[1], "00000000000000000099")
                assert operator_event_row(wrong, plain) is None

    asyncio.run(main())


@pytest.mark.parametrize(
    ("sort", "last"),
    [
        ({"sort_by": RunSortField.RUN_AT}, ("7", "2026-01-01T00:00:00.000Z", "run_x")),  # no such group flag
        ({"sort_by": RunSortField.RUN_AT}, ("0", "run_x")),
        ({"sort_by": RunSortField.CREATED_AT}, ("2026-01-01T00:00:00.000Z",)),
        ({"sort_by": RunSortField.UPDATED_AT}, ("a", "b", "c")),
    ],
)
def test_a_cursor_of_the_wrong_shape_is_rejected_by_every_driver(tmp_path: Any, sort: dict, last: tuple) -> None:
    """A cursor in the right scope whose position is not a sort value of that order is
    ``validation_failed`` on the in-memory and the SQLite driver alike, never a query error."""
    from runlane.storage.operator import encode_operator_cursor
    from runlane.vocabulary import PaginationCursorKind
    from runlane_local import sqlite_storage

    flt = RunFilter(environment=ENV, **sort)
    cursor = encode_operator_cursor(PaginationCursorKind.RUN_LIST, flt, last)

    async def main() -> None:
        runtime, _ = await _populate()
        sqlite = sqlite_storage(tmp_path / "runlane.db")
        await sqlite.start()
        try:
            for driver in (runtime.lane.storage, sqlite):
                with pytest.raises(RunlaneError) as info:
                    await driver.list_runs(flt, PaginationParams(limit=5, cursor=cursor))
                assert info.value.code is ErrorCode.VALIDATION_FAILED
        finally:
            await sqlite.close()

    asyncio.run(main())


def test_a_run_event_cursor_of_the_wrong_shape_is_rejected() -> None:
    from runlane.storage.operator import decode_operator_cursor, encode_operator_cursor
    from runlane.vocabulary import PaginationCursorKind

    for sort, last in (
        ({"sort_by": RunEventSortField.OCCURRED_AT}, ("2026-01-01T00:00:00.000Z",)),
        ({"sort_by": RunEventSortField.SEQUENCE, "run_id": "run_a"}, ("1", "2")),
    ):
        flt = RunEventFilter(environment=ENV, **sort)
        cursor = encode_operator_cursor(PaginationCursorKind.RUN_EVENT_LIST, flt, last)
        with pytest.raises(RunlaneError) as info:
            decode_operator_cursor(cursor, PaginationCursorKind.RUN_EVENT_LIST, flt)
        assert info.value.code is ErrorCode.VALIDATION_FAILED
