"""Query and operator cursors: opaque tokens bound to the exact scope that produced them."""

from __future__ import annotations

import base64
import dataclasses
import json
from datetime import UTC, datetime

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from runlane.errors import ErrorCode, RunlaneError
from runlane.models import Environment
from runlane.storage import (
    RunEventFilter,
    RunFilter,
    StorageIndexName,
    StorageQuery,
    StorageQueryPosition,
    StorageRange,
    StorageRecordKey,
    TimeRange,
    decode_operator_cursor,
    decode_storage_query_cursor,
    encode_operator_cursor,
    encode_storage_query_cursor,
    encode_storage_tuple,
)
from runlane.vocabulary import PaginationCursorKind, RunEventSortField, RunSortField, RunStatus, SortDirection

PROPERTY = settings(max_examples=300, deadline=None)

POSITION = StorageQueryPosition(
    sort=encode_storage_tuple(("2024-01-01T00:00:00.000000Z", "run_1")),
    key=StorageRecordKey("runs", "production", "run_1").encoded,
)


def base_query(**changes) -> StorageQuery:
    query = StorageQuery(
        StorageIndexName.RUNS_RUNNABLE,
        ("production", "emails"),
        range=StorageRange.between(("2024",), ("2025",)),
        direction=SortDirection.ASC,
        limit=10,
    )
    return dataclasses.replace(query, **changes)


def with_cursor(query: StorageQuery, cursor: object) -> StorageQuery:
    return dataclasses.replace(query, cursor=cursor)


def b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode("ascii").rstrip("=")


def assert_invalid_cursor(query: StorageQuery) -> RunlaneError:
    with pytest.raises(RunlaneError) as caught:
        decode_storage_query_cursor(query)
    assert caught.value.code is ErrorCode.VALIDATION_FAILED
    assert caught.value.meta.get("field") == "cursor"
    return caught.value


# ---------------------------------------------------------------------------------------------
# Storage query cursors


def test_cursor_round_trips_its_position():
    query = base_query()
    cursor = encode_storage_query_cursor(query, POSITION)
    assert isinstance(cursor, str) and cursor.isascii()
    assert "=" not in cursor
    assert decode_storage_query_cursor(with_cursor(query, cursor)) == POSITION


def test_absent_cursor_decodes_to_no_position():
    assert decode_storage_query_cursor(base_query()) is None


def test_cursor_survives_a_different_page_size():
    # The limit is not part of the scope: a caller may ask for a bigger next page.
    cursor = encode_storage_query_cursor(base_query(), POSITION)
    assert decode_storage_query_cursor(with_cursor(base_query(limit=99), cursor)) == POSITION


@pytest.mark.parametrize(
    "changes",
    [
        {"index": StorageIndexName.RUNS_NEEDING_DELIVERY},
        {"partition": ("production", "media")},
        {"partition": ("production",)},
        {"partition": ("production", "emails", "")},
        {"range": StorageRange()},
        {"range": StorageRange.between(("2024",), ("2026",))},
        {"range": StorageRange.between(("2024",), ("2025",), upper_inclusive=True)},
        {"range": StorageRange.between(("2024",), ("2025",), lower_inclusive=False)},
        {"range": StorageRange.between(("2023",), ("2025",))},
        {"range": StorageRange.prefix(("2024",))},
        {"direction": SortDirection.DESC},
    ],
)
def test_cursor_rejected_when_any_scope_part_changes(changes):
    cursor = encode_storage_query_cursor(base_query(), POSITION)
    error = assert_invalid_cursor(with_cursor(base_query(**changes), cursor))
    assert "different query" in error.message


def _garbage_cursors() -> list[object]:
    good = encode_storage_query_cursor(base_query(), POSITION)
    payload = json.loads(base64.urlsafe_b64decode(good + "=" * (-len(good) % 4)))
    return [
        "",
        "!",
        "a",
        "not a cursor",
        good[:-3],
        good + "A",
        good + "!!",
        good + "==",
        good[:5] + "!" + good[5:],
        " " + good,
        good + "\n",
        good[:-1] + ("B" if good[-1] != "B" else "C"),
        good.replace("J", "é", 1),
        b64(b"not json"),
        b64(b"\xff\xfe\xfd"),
        b64(b"[1, 2, 3]"),
        b64(b'"a string"'),
        b64(b"null"),
        b64(b"{}"),
        b64(b"[" * 50_000),
        b64(json.dumps({**payload, "v": 2}).encode()),
        b64(json.dumps({**payload, "v": True}).encode()),
        b64(json.dumps({**payload, "v": 1.0}).encode()),
        b64(json.dumps({k: v for k, v in payload.items() if k != "v"}).encode()),
        b64(json.dumps({k: v for k, v in payload.items() if k != "sort"}).encode()),
        b64(json.dumps({**payload, "sort": 5}).encode()),
        b64(json.dumps({**payload, "key": "zz"}).encode()),
        b64(json.dumps({**payload, "sort": "6"}).encode()),
        b64(json.dumps({**payload, "key": None}).encode()),
        b64(b'{"v": NaN}'),
        123,
        b"bytes",
    ]


@pytest.mark.parametrize("cursor", _garbage_cursors())
def test_malformed_cursors_rejected(cursor):
    assert_invalid_cursor(with_cursor(base_query(), cursor))


def test_standard_base64_alphabet_is_not_accepted_for_url_safe_tokens():
    # Raw range bounds are copied into the token; '?' and '~' runs yield 6-bit groups 62 and 63.
    candidates = (base_query(range=StorageRange(gt="?" * n + "~" * m)) for n in range(4) for m in range(4))
    query, cursor = next((q, c) for q in candidates if any(ch in (c := encode_storage_query_cursor(q, POSITION)) for ch in "-_"))
    translated = cursor.replace("-", "+").replace("_", "/")
    assert_invalid_cursor(with_cursor(query, translated))
    assert decode_storage_query_cursor(with_cursor(query, cursor)) == POSITION


# A property: whatever scope part changes, and however, the old cursor never applies.

partitions = st.lists(st.text(max_size=4), min_size=1, max_size=3).map(tuple)
bound = st.one_of(st.none(), st.lists(st.text(max_size=3), min_size=1, max_size=2).map(tuple))


@st.composite
def ranges(draw):
    kind = draw(st.sampled_from(["empty", "between", "prefix", "raw"]))
    if kind == "empty":
        return StorageRange()
    if kind == "prefix":
        return StorageRange.prefix(draw(partitions))
    if kind == "between":
        return StorageRange.between(draw(bound), draw(bound), lower_inclusive=draw(st.booleans()), upper_inclusive=draw(st.booleans()))
    encoded = st.one_of(st.none(), st.text(alphabet="0123456789abcdef/", max_size=6))
    return StorageRange(gt=draw(encoded), lt=draw(encoded))


queries = st.builds(
    StorageQuery,
    index=st.sampled_from(list(StorageIndexName)),
    partition=partitions,
    range=ranges(),
    direction=st.sampled_from(list(SortDirection)),
    limit=st.integers(min_value=1, max_value=500),
)


@PROPERTY
@given(queries, st.data())
def test_random_scope_mutations_are_always_rejected(query, data):
    cursor = encode_storage_query_cursor(query, POSITION)
    assert decode_storage_query_cursor(with_cursor(query, cursor)) == POSITION
    field = data.draw(st.sampled_from(["index", "partition", "range", "direction"]))
    if field == "index":
        changed = data.draw(st.sampled_from(list(StorageIndexName)))
        assume(changed != query.index)
    elif field == "partition":
        changed = data.draw(partitions)
        assume(changed != query.partition)
    elif field == "range":
        changed = data.draw(ranges())
        assume(changed.to_json() != query.range.to_json())
    else:
        changed = SortDirection.DESC if query.direction is SortDirection.ASC else SortDirection.ASC
    mutated = dataclasses.replace(query, **{field: changed}, limit=data.draw(st.integers(min_value=1, max_value=500)))
    assert_invalid_cursor(with_cursor(mutated, cursor))


@PROPERTY
@given(queries, st.lists(st.text(max_size=5), min_size=1, max_size=3), st.lists(st.text(max_size=5), min_size=2, max_size=3))
def test_any_position_round_trips(query, sort, key):
    assume(key[0])
    position = StorageQueryPosition(sort=encode_storage_tuple(sort), key=StorageRecordKey(*key).encoded)
    cursor = encode_storage_query_cursor(query, position)
    assert decode_storage_query_cursor(with_cursor(query, cursor)) == position


# ---------------------------------------------------------------------------------------------
# Operator cursors

ENV = Environment(name="production")
RUN_FILTER = RunFilter(environment=ENV, statuses=(RunStatus.FAILED,), sort_by=RunSortField.CREATED_AT, sort_direction=SortDirection.DESC)
LAST = ("2024-01-01T00:00:00.000000Z", "run_1")


def assert_invalid_operator_cursor(cursor, kind, filter) -> RunlaneError:
    with pytest.raises(RunlaneError) as caught:
        decode_operator_cursor(cursor, kind, filter)
    assert caught.value.code is ErrorCode.VALIDATION_FAILED
    assert caught.value.meta.get("field") == "cursor"
    return caught.value


def test_operator_cursor_round_trips():
    cursor = encode_operator_cursor(PaginationCursorKind.RUN_LIST, RUN_FILTER, LAST)
    assert decode_operator_cursor(cursor, PaginationCursorKind.RUN_LIST, RUN_FILTER) == LAST
    assert decode_operator_cursor(None, PaginationCursorKind.RUN_LIST, RUN_FILTER) is None
    # An equal filter built separately is the same scope.
    same = RunFilter(environment=Environment(name="production"), statuses=(RunStatus.FAILED,), sort_direction=SortDirection.DESC)
    assert decode_operator_cursor(cursor, PaginationCursorKind.RUN_LIST, same) == LAST


def test_operator_cursor_round_trips_with_a_dict_scope():
    scope = {"environment": "production", "older_than": "2024-01-01T00:00:00Z", "statuses": ["failed"]}
    cursor = encode_operator_cursor(PaginationCursorKind.RUN_PRUNE, scope, ("x",))
    assert decode_operator_cursor(cursor, PaginationCursorKind.RUN_PRUNE, dict(scope)) == ("x",)
    assert_invalid_operator_cursor(cursor, PaginationCursorKind.RUN_PRUNE, {**scope, "statuses": ["cancelled"]})


def test_operator_cursor_bound_to_kind():
    cursor = encode_operator_cursor(PaginationCursorKind.RUN_LIST, RUN_FILTER, LAST)
    for kind in (PaginationCursorKind.RUN_EVENT_LIST, PaginationCursorKind.RUN_PRUNE):
        assert_invalid_operator_cursor(cursor, kind, RUN_FILTER)


@pytest.mark.parametrize(
    "changes",
    [
        {"environment": Environment(name="staging")},
        {"statuses": (RunStatus.FAILED, RunStatus.CANCELLED)},
        {"statuses": None},
        {"task_ids": ("emails.welcome",)},
        {"queues": ("emails",)},
        {"created_at": TimeRange(start=datetime(2024, 1, 1, tzinfo=UTC))},
        {"updated_at": TimeRange(end=datetime(2024, 1, 1, tzinfo=UTC))},
        {"run_at": TimeRange()},
        {"idempotency_key": "k"},
        {"singleton_key": "k"},
        {"source_run_id": "run_0"},
        {"sort_by": RunSortField.UPDATED_AT},
        {"sort_by": RunSortField.RUN_AT},
        {"sort_direction": SortDirection.ASC},
    ],
)
def test_operator_cursor_bound_to_every_run_filter_field(changes):
    cursor = encode_operator_cursor(PaginationCursorKind.RUN_LIST, RUN_FILTER, LAST)
    changed = RUN_FILTER.model_copy(update=changes)
    changed = RunFilter.model_validate(changed.model_dump())
    assert_invalid_operator_cursor(cursor, PaginationCursorKind.RUN_LIST, changed)


def test_operator_cursor_bound_to_event_filter():
    events = RunEventFilter(environment=ENV, run_id="run_1", sort_by=RunEventSortField.SEQUENCE)
    cursor = encode_operator_cursor(PaginationCursorKind.RUN_EVENT_LIST, events, ("00000000000000000003",))
    assert decode_operator_cursor(cursor, PaginationCursorKind.RUN_EVENT_LIST, events) == ("00000000000000000003",)
    for changed in (
        RunEventFilter(environment=ENV, run_id="run_2", sort_by=RunEventSortField.SEQUENCE),
        RunEventFilter(environment=ENV, run_id="run_1"),
        RunEventFilter(environment=ENV, run_id="run_1", sort_by=RunEventSortField.SEQUENCE, sort_direction=SortDirection.DESC),
        RunEventFilter(environment=ENV, run_id="run_1", sort_by=RunEventSortField.SEQUENCE, types=("run.created",)),
    ):
        assert_invalid_operator_cursor(cursor, PaginationCursorKind.RUN_EVENT_LIST, changed)


def _operator_garbage() -> list[object]:
    good = encode_operator_cursor(PaginationCursorKind.RUN_LIST, RUN_FILTER, LAST)
    payload = json.loads(base64.urlsafe_b64decode(good + "=" * (-len(good) % 4)))
    return [
        "",
        "garbage",
        good + "!!",
        good + "A",
        good[:-2],
        b64(b"not json"),
        b64(b"\xff"),
        b64(b"[]"),
        b64(b"[" * 50_000),
        b64(json.dumps({**payload, "v": 2}).encode()),
        b64(json.dumps({**payload, "v": True}).encode()),
        b64(json.dumps({**payload, "last": "x"}).encode()),
        b64(json.dumps({**payload, "last": [1, 2]}).encode()),
        b64(json.dumps({k: v for k, v in payload.items() if k != "last"}).encode()),
        42,
    ]


@pytest.mark.parametrize("cursor", _operator_garbage())
def test_malformed_operator_cursors_rejected(cursor):
    assert_invalid_operator_cursor(cursor, PaginationCursorKind.RUN_LIST, RUN_FILTER)


def test_storage_and_operator_cursors_are_not_interchangeable():
    storage_cursor = encode_storage_query_cursor(base_query(), POSITION)
    assert_invalid_operator_cursor(storage_cursor, PaginationCursorKind.RUN_LIST, RUN_FILTER)
    operator_cursor = encode_operator_cursor(PaginationCursorKind.RUN_LIST, RUN_FILTER, LAST)
    assert_invalid_cursor(with_cursor(base_query(), operator_cursor))
