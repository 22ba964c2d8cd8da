"""Operator reads for SQL drivers: projection rows kept in the commit, and the two list queries.

A SQL driver keeps two projection tables beside its raw records and updates them in the same
commit as the records they describe:

* ``operator runs``: one row per run record that decodes and agrees with its key
  (``OPERATOR_RUN_COLUMNS``, built by ``operator_run_row``);
* ``operator events``: one row per run event record that decodes and agrees with its key
  (``OPERATOR_EVENT_COLUMNS``, built by ``operator_event_row``).

A created or replaced record whose row builder returns ``None`` removes any row of its key (it is
outside the operator view, exactly like the in-memory reference); a deleted record removes its row.
Visibility of a run (no tombstone) is decided at read time through the ``tombstone_key`` column, so
tombstoning needs no projection bookkeeping.

The list queries order exactly like ``run_sort_value`` / ``run_event_sort_value`` and continue after
operator cursors from ``encode_operator_cursor``, so every driver pages identically. Encoded dates and
keys are ASCII, so byte-order collation (SQLite's ``BINARY``, Postgres' ``COLLATE "C"``) orders them.

Indexes the queries are written for (drivers create them in their schema):

* runs: ``(environment, created_at, run_id)``, ``(environment, updated_at, run_id)``,
  ``(environment, available_missing, available_at, run_id)`` (the run_at order), ``(record_key)``;
* events: ``(environment, run_id, sequence)`` (also the primary key), ``(environment, occurred_at,
  run_id, sequence)``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import orjson

from ..errors import ErrorCode, RunlaneError
from ..models import Page, RunEvent, RunEventRecord, RunRecord, RunSummary, environment_key
from ..run_scans import get_run_runnable_available_at
from ..vocabulary import PaginationCursorKind, RunEventSortField, RunEventType, RunSortField, RunStatus, SortDirection
from .codecs import (
    encode_iso_date,
    encode_storage_tuple,
    encode_storage_tuple_prefix_upper_bound,
    encode_storage_unsigned_integer,
)
from .operator import (
    PaginationParams,
    RunEventFilter,
    RunFilter,
    TimeRange,
    clamp_page_limit,
    decode_operator_cursor,
    encode_operator_cursor,
    run_event_matches_filter,
    run_event_sort_value,
    run_matches_filter,
    run_sort_value,
)
from .tables import (
    OPERATOR_ROW_CODECS,
    RUN_EVENTS_COLLECTION,
    RUN_TOMBSTONES_COLLECTION,
    RUNS_COLLECTION,
    peek_run_document,
    peek_run_event_document,
)
from .types import StorageDocument, StorageRecordKey

__all__ = [
    "OPERATOR_EVENT_COLUMNS",
    "OPERATOR_RUN_COLUMNS",
    "OperatorSql",
    "finish_event_page",
    "finish_run_page",
    "is_operator_event_key",
    "is_operator_run_key",
    "operator_event_row",
    "operator_run_row",
    "remember_event_row",
    "remember_run_row",
    "run_event_list_query",
    "run_list_query",
]

OPERATOR_RUN_COLUMNS = (
    "environment",  # text: the environment key
    "run_id",  # text
    "record_key",  # text: the run record's encoded key
    "tombstone_key",  # text: the encoded key whose presence hides the run
    "status",  # text
    "task_id",  # text
    "queue",  # text
    "idempotency_key",  # text, nullable
    "singleton_key",  # text, nullable
    "source_run_id",  # text, nullable
    "created_at",  # text: encoded ISO date
    "updated_at",  # text: encoded ISO date
    "run_at",  # text: encoded ISO date, nullable (the run's own run_at, for filtering)
    "available_missing",  # integer: 1 when the run has no runnable availability, else 0
    "available_at",  # text: encoded runnable availability ('' when missing), for run_at sorting
)

OPERATOR_EVENT_COLUMNS = (
    "environment",  # text
    "run_id",  # text
    "sequence",  # text: encode_storage_unsigned_integer(sequence)
    "record_key",  # text: the event record's encoded key
    "type",  # text
    "occurred_at",  # text: encoded ISO date
)


def is_operator_run_key(key: StorageRecordKey) -> bool:
    return key.collection == RUNS_COLLECTION and len(key.parts) == 2


def is_operator_event_key(key: StorageRecordKey) -> bool:
    return key.collection == RUN_EVENTS_COLLECTION and len(key.parts) == 3


def _iso(value: Any) -> str | None:
    return None if value is None else encode_iso_date(value)


# Rows are built in every commit that writes a run or an event, so documents without a remembered
# decoded value (history rows, finished runs) are read from their JSON by hand instead of being
# validated as whole models: the fields a row needs are checked for type, anything else is left to
# the full decode at read time (``finish_*_page``), which keeps undecodable records out of pages.


def _text(value: Any) -> str:
    if type(value) is not str:
        raise ValueError("not a string")
    return value


def _optional_text(value: Any) -> str | None:
    return None if value is None else _text(value)


def _date(value: Any) -> datetime:
    parsed = datetime.fromisoformat(_text(value))
    if parsed.tzinfo is None:
        raise ValueError("a naive date")
    return parsed


def _optional_date(value: Any) -> datetime | None:
    return None if value is None else _date(value)


def _json_value(document: StorageDocument) -> Any:
    return orjson.loads(document.text)["value"]


# What a commit needs of a document core wrote, remembered on the document by the code that encoded
# it when nothing else is remembered there (finished runs, history rows): the model it was encoded
# from, of which building the projection row reads only immutable fields, so it needs no parse. A
# store that keeps documents for long drops these (``compact_decoded``): only the commit that
# writes the document reads them.
_RUN_ROW_CODEC = OPERATOR_ROW_CODECS[0]
_EVENT_ROW_CODEC = OPERATOR_ROW_CODECS[1]


def _fields_of_run(run: RunRecord) -> tuple[Any, ...]:
    source = run.source
    return (
        environment_key(run.environment), run.id, run.status.value, run.task_id, run.queue,
        run.idempotency_key, run.singleton_key, None if source is None else source.source_run_id,
        run.created_at, run.updated_at, run.run_at, get_run_runnable_available_at(run),
    )  # fmt: skip


def remember_run_row(document: StorageDocument, run: RunRecord) -> StorageDocument:
    """Remember the run ``document`` was encoded from, for its projection row (see above)."""
    return document.remember_decoded((_RUN_ROW_CODEC, run))


def remember_event_row(document: StorageDocument, sequence: int, event: RunEvent) -> StorageDocument:
    """Remember the run event ``document`` was encoded from (at ``sequence``), for its projection row."""
    return document.remember_decoded((_EVENT_ROW_CODEC, sequence, event))


def _run_fields(document: StorageDocument) -> tuple[Any, ...] | None:
    """(environment, id, status, task, queue, idempotency, singleton, source run, created, updated,
    run_at, availability) of a run document, or ``None`` when it is not shaped like one."""
    remembered = document.decoded
    if remembered is not None:
        if type(remembered) is tuple and remembered[0] == _RUN_ROW_CODEC:
            return _fields_of_run(remembered[1])
        run = peek_run_document(document)
        return None if run is None else _fields_of_run(run)
    try:
        run = _json_value(document)["run"]
        status = RunStatus(_text(run["status"]))
        source = run["source"]
        lease = run["lease"]
        updated_at = _date(run["updated_at"])
        run_at = _optional_date(run["run_at"])
        available: datetime | None
        if status is RunStatus.QUEUED:
            available = run_at or updated_at
        elif status in (RunStatus.SCHEDULED, RunStatus.RETRYING, RunStatus.RELEASED):
            available = run_at
        elif status is RunStatus.RUNNING:
            available = _date(lease["expires_at"]) if lease is not None else updated_at
        else:
            available = None
        return (
            _text(run["environment"]["name"]), _text(run["id"]), status.value,
            _text(run["task_id"]), _text(run["queue"]), _optional_text(run["idempotency_key"]),
            _optional_text(run["singleton_key"]),
            None if source is None else _optional_text(source.get("source_run_id")),
            _date(run["created_at"]), updated_at, run_at, available,
        )  # fmt: skip
    except (KeyError, TypeError, ValueError, AttributeError, RunlaneError, orjson.JSONDecodeError):
        return None


# A run's key and its tombstone's key differ only in their collection: the rest of the encoding is shared.
_RUN_KEY_PREFIX = encode_storage_tuple((RUNS_COLLECTION,)) + "/"
_TOMBSTONE_KEY_PREFIX = encode_storage_tuple((RUN_TOMBSTONES_COLLECTION,)) + "/"


def _tombstone_key(run_key: StorageRecordKey) -> str:
    """``run_tombstone_key(*run_key.parts).encoded`` of a run key (``is_operator_run_key``)."""
    return _TOMBSTONE_KEY_PREFIX + run_key.encoded[len(_RUN_KEY_PREFIX) :]


def operator_run_row(key: StorageRecordKey, document: StorageDocument) -> tuple[Any, ...] | None:
    """The projection row of a run record, or ``None`` when it is not a run or disagrees with its key."""
    if not is_operator_run_key(key):
        return None
    fields = _run_fields(document)
    if fields is None:
        return None
    environment, run_id, status, task_id, queue, idempotency, singleton, source_run, created, updated, run_at, available = fields
    if (environment, run_id) != key.parts:
        return None
    return (
        environment,
        run_id,
        key.encoded,
        _tombstone_key(key),
        status,
        task_id,
        queue,
        idempotency,
        singleton,
        source_run,
        encode_iso_date(created),
        encode_iso_date(updated),
        _iso(run_at),
        1 if available is None else 0,
        "" if available is None else encode_iso_date(available),
    )


def operator_event_row(key: StorageRecordKey, document: StorageDocument) -> tuple[Any, ...] | None:
    """The projection row of a run event record, or ``None`` when it is not one or disagrees with its key."""
    try:
        remembered = document.decoded
        if remembered is not None:
            if type(remembered) is tuple and remembered[0] == _EVENT_ROW_CODEC:
                _, sequence_number, event = remembered
            else:
                record = peek_run_event_document(document)
                if record is None:
                    return None
                sequence_number, event = record.sequence, record.event
            fields = (
                environment_key(event.environment), event.run_id, sequence_number, event.type.value, event.occurred_at
            )
        else:
            value = _json_value(document)
            event = value["event"]
            sequence = value["sequence"]
            if type(sequence) is not int or sequence < 1:
                return None
            fields = (
                _text(event["environment"]["name"]), _text(event["run_id"]),
                sequence, RunEventType(_text(event["type"])).value, _date(event["occurred_at"]),
            )  # fmt: skip
    except (KeyError, TypeError, ValueError, AttributeError, RunlaneError, orjson.JSONDecodeError):
        return None
    environment, run_id, sequence_number, event_type, occurred_at = fields
    sequence = encode_storage_unsigned_integer(sequence_number)
    if (environment, run_id, sequence) != key.parts:
        return None
    return (environment, run_id, sequence, key.encoded, event_type, encode_iso_date(occurred_at))


# ---------------------------------------------------------------------------------------------
# List queries


@dataclass(frozen=True, slots=True)
class OperatorSql:
    """One list query: ``text`` selects ``document`` text (the record's canonical envelope) and
    ``byte_size`` per row, at most ``limit + 1`` rows, in page order."""

    text: str
    params: tuple[Any, ...]
    limit: int


class _Builder:
    def __init__(self, placeholder: str) -> None:
        self._placeholder = placeholder
        self.params: list[Any] = []
        self.where: list[str] = []

    def param(self, value: Any) -> str:
        self.params.append(value)
        return self._placeholder

    def equals(self, column: str, value: Any) -> None:
        self.where.append(f"{column} = {self.param(value)}")

    def among(self, column: str, values: Iterable[Any] | None) -> None:
        if values is None:
            return
        values = list(values)
        if not values:
            self.where.append("1 = 0")
            return
        self.where.append(f"{column} IN ({', '.join(self.param(value) for value in values)})")

    def within(self, column: str, bounds: TimeRange | None) -> None:
        if bounds is None:
            return
        self.where.append(f"{column} IS NOT NULL")
        if bounds.start is not None:
            self.where.append(f"{column} >= {self.param(encode_iso_date(bounds.start))}")
        if bounds.end is not None:
            self.where.append(f"{column} <= {self.param(encode_iso_date(bounds.end))}")

    def after(self, expressions: list[str], last: Iterable[Any], descending: bool) -> None:
        columns = ", ".join(expressions)
        values = ", ".join(self.param(value) for value in last)
        self.where.append(f"({columns}) {'<' if descending else '>'} ({values})")

    def not_tombstoned(self, records_table: str, environment: str) -> str:
        """The condition that the run of projection row ``o`` has no tombstone record.

        The key range is implied by the equality (every tombstone key of the environment lies in it),
        but it lets a planner estimate the probe from the few tombstone keys rather than from every
        record key: Postgres otherwise assumes each run has a tombstone (the records table holds more
        distinct keys than there are runs), expects the anti-join to leave almost nothing, and reads
        and sorts the whole projection instead of walking the ordered index until the page is full.
        """
        prefix = (RUN_TOMBSTONES_COLLECTION, environment)
        low = self.param(encode_storage_tuple(prefix) + "/")
        high = self.param(encode_storage_tuple_prefix_upper_bound(prefix))
        return (
            f"NOT EXISTS (SELECT 1 FROM {records_table} t WHERE t.key = o.tombstone_key "
            f"AND t.key >= {low} AND t.key < {high})"
        )


def _run_order(filter: RunFilter) -> tuple[list[str], list[str]]:
    """(row expressions compared with the cursor, ORDER BY terms) of the created_at and updated_at orders."""
    direction = "DESC" if filter.sort_direction is SortDirection.DESC else "ASC"
    column = "o.created_at" if filter.sort_by is RunSortField.CREATED_AT else "o.updated_at"
    expressions = [column, "o.run_id"]
    return expressions, [f"{term} {direction}" for term in expressions]


def _run_filter(query: _Builder, filter: RunFilter, environment: str, records_table: str) -> None:
    """The conditions of ``filter`` on projection row ``o`` (and that its run has no tombstone)."""
    query.equals("o.environment", environment)
    query.where.append(query.not_tombstoned(records_table, environment))
    query.among("o.status", None if filter.statuses is None else [status.value for status in filter.statuses])
    query.among("o.task_id", filter.task_ids)
    query.among("o.queue", filter.queues)
    query.within("o.created_at", filter.created_at)
    query.within("o.updated_at", filter.updated_at)
    query.within("o.run_at", filter.run_at)
    for column, value in (
        ("o.idempotency_key", filter.idempotency_key),
        ("o.singleton_key", filter.singleton_key),
        ("o.source_run_id", filter.source_run_id),
    ):
        if value is not None:
            query.equals(column, value)


def run_list_query(
    filter: RunFilter,
    pagination: PaginationParams,
    *,
    runs_table: str,
    records_table: str,
    placeholder: str,
) -> OperatorSql:
    """The ``list_runs`` page query over the projection (table names already quoted/qualified)."""
    limit = clamp_page_limit(pagination.limit)
    after = decode_operator_cursor(pagination.cursor, PaginationCursorKind.RUN_LIST, filter)
    environment = environment_key(filter.environment)
    # A left join: a projection row whose run record is gone comes back without a document, which
    # ``finish_run_page`` reports as corruption instead of the page leaving the run out.
    source = f"FROM {runs_table} o LEFT JOIN {records_table} r ON r.key = o.record_key"
    if filter.sort_by is RunSortField.RUN_AT:
        return _run_at_list_query(filter, after, limit, environment, source, records_table, placeholder)
    query = _Builder(placeholder)
    _run_filter(query, filter, environment, records_table)
    expressions, order = _run_order(filter)
    if after is not None:
        query.after(expressions, after, filter.sort_direction is SortDirection.DESC)
    text = (
        f"SELECT r.document, r.byte_size, o.run_id {source} WHERE {' AND '.join(query.where)} "
        f"ORDER BY {', '.join(order)} LIMIT {limit + 1}"
    )
    return OperatorSql(text, tuple(query.params), limit)


def _run_at_list_query(
    filter: RunFilter,
    after: tuple[str, ...] | None,
    limit: int,
    environment: str,
    source: str,
    records_table: str,
    placeholder: str,
) -> OperatorSql:
    """The run_at order (``run_sort_value``): runs with an availability first in either direction,
    ordered by it and their id, then the runs without one (``available_missing = 1``, availability
    ``''``) by id. The two groups are read separately, each in the order of the projection's
    ``(environment, available_missing, available_at, run_id)`` index, forwards or backwards, and only
    the at most 2 x (page + 1) rows they return are sorted together. The cursor is
    ``(flag, availability, id)`` where the flag is ``available_missing`` ascending and its
    complement descending."""
    descending = filter.sort_direction is SortDirection.DESC
    direction = "DESC" if descending else "ASC"
    cursor_missing = None
    if after is not None:
        flag = int(after[0])
        cursor_missing = 1 - flag if descending else flag
    branches: list[str] = []
    params: list[Any] = []
    for missing in (0, 1):
        if cursor_missing is not None and missing < cursor_missing:
            continue  # every run of this group came before the cursor
        query = _Builder(placeholder)
        _run_filter(query, filter, environment, records_table)
        query.where.append(f"o.available_missing = {missing}")
        if after is not None and missing == cursor_missing:
            query.after(["o.available_at", "o.run_id"], after[1:], descending)
        branches.append(
            f"SELECT * FROM (SELECT {missing} AS m, o.available_at AS a, o.run_id AS i, r.document, r.byte_size "
            f"{source} WHERE {' AND '.join(query.where)} "
            f"ORDER BY o.available_at {direction}, o.run_id {direction} LIMIT {limit + 1}) AS g{missing}"
        )
        params.extend(query.params)
    text = (
        f"SELECT document, byte_size, i FROM ({' UNION ALL '.join(branches)}) AS u "
        f"ORDER BY m, a {direction}, i {direction} LIMIT {limit + 1}"
    )
    return OperatorSql(text, tuple(params), limit)


def run_event_list_query(
    filter: RunEventFilter,
    pagination: PaginationParams,
    *,
    events_table: str,
    runs_table: str,
    records_table: str,
    placeholder: str,
) -> OperatorSql:
    """The ``list_run_events`` page query: events of visible runs only."""
    limit = clamp_page_limit(pagination.limit)
    after = decode_operator_cursor(pagination.cursor, PaginationCursorKind.RUN_EVENT_LIST, filter)
    query = _Builder(placeholder)
    environment = environment_key(filter.environment)
    query.equals("e.environment", environment)
    if filter.run_id is not None:
        query.equals("e.run_id", filter.run_id)
    query.among("e.type", None if filter.types is None else [kind.value for kind in filter.types])
    query.within("e.occurred_at", filter.occurred_at)
    query.where.append(
        f"EXISTS (SELECT 1 FROM {runs_table} o WHERE o.environment = e.environment AND o.run_id = e.run_id "
        f"AND {query.not_tombstoned(records_table, environment)})"
    )
    if filter.sort_by is RunEventSortField.SEQUENCE:
        expressions = ["e.sequence"]
    else:
        expressions = ["e.occurred_at", "e.run_id", "e.sequence"]
    descending = filter.sort_direction is SortDirection.DESC
    if after is not None:
        query.after(expressions, after, descending)
    order = ", ".join(f"{term} {'DESC' if descending else 'ASC'}" for term in expressions)
    text = (
        f"SELECT r.document, r.byte_size, e.run_id, e.sequence FROM {events_table} e "
        f"LEFT JOIN {records_table} r ON r.key = e.record_key "  # a missing record is reported, not skipped
        f"WHERE {' AND '.join(query.where)} ORDER BY {order} LIMIT {limit + 1}"
    )
    return OperatorSql(text, tuple(query.params), limit)


# ---------------------------------------------------------------------------------------------
# Pages


def _document(text: Any, what: str) -> StorageDocument:
    if isinstance(text, StorageDocument):
        return text
    if text is None:  # the projection row's record is missing (the list queries join it from the left)
        raise _corrupt_row(what, "is missing although its operator projection row is there")
    try:
        return StorageDocument.parse(text)
    except RunlaneError as error:  # not an envelope this version reads
        raise _corrupt_row(what, f"cannot be read ({error.message.rstrip('.')})") from None


def _corrupt_row(what: str, problem: str) -> RunlaneError:
    return RunlaneError(
        ErrorCode.INVARIANT_VIOLATION,
        f"The stored document of {what} {problem}: durable corruption. Restore the record from a backup, or "
        "delete the run's records (pruning leaves a run it cannot read alone); a listing cannot read past it.",
        meta={"record": what},
    )


def finish_run_page(query: OperatorSql, filter: RunFilter, rows: Iterable[tuple[Any, ...]]) -> Page[RunSummary]:
    """The page of ``rows`` (document text, byte size, projected run id) fetched with ``query``. A
    document that is missing, does not decode, holds another run than its projection row or does not
    match the filter its projection row matched is durable corruption: ``invariant_violation`` naming
    the run, never a row left out or shown under the wrong id or filter."""
    runs: list[RunRecord] = []
    for text, _size, run_id in rows:
        run = peek_run_document(_document(text, f"run {run_id}"))
        if run is None:
            raise _corrupt_row(f"run {run_id}", "is not a readable run")
        if run.id != run_id:
            raise _corrupt_row(f"run {run_id}", f"holds run {run.id}")
        if not run_matches_filter(run, filter):
            raise _corrupt_row(
                f"run {run_id}",
                f"does not match its operator projection row (the run is {run.status.value}, task {run.task_id!r}, "
                f"queue {run.queue!r})",
            )
        runs.append(run)
    cursor = None
    if len(runs) > query.limit:
        runs = runs[: query.limit]
        last = run_sort_value(runs[-1], filter.sort_by, filter.sort_direction)
        cursor = encode_operator_cursor(PaginationCursorKind.RUN_LIST, filter, last)
    return Page[RunSummary](data=[run.to_summary().model_copy(deep=True) for run in runs], next_cursor=cursor)


def finish_event_page(
    query: OperatorSql, filter: RunEventFilter, rows: Iterable[tuple[Any, ...]]
) -> Page[RunEventRecord]:
    """The page of ``rows`` (document text, byte size, projected run id and sequence); a document that
    does not decode or holds another event than its row is ``invariant_violation``, as for runs."""
    events: list[RunEventRecord] = []
    for text, _size, run_id, stored_sequence in rows:
        sequence = int(stored_sequence)  # a zero-padded sortable text in some drivers
        what = f"event {sequence} of run {run_id}"
        event = peek_run_event_document(_document(text, what))
        if event is None:
            raise _corrupt_row(what, "is not a readable run event")
        if (event.event.run_id, event.sequence) != (run_id, sequence):
            raise _corrupt_row(what, f"holds event {event.sequence} of run {event.event.run_id}")
        if not run_event_matches_filter(event, filter):
            raise _corrupt_row(what, f"does not match its operator projection row (a {event.event.type.value} event)")
        events.append(event)
    cursor = None
    if len(events) > query.limit:
        events = events[: query.limit]
        last = run_event_sort_value(events[-1], filter.sort_by)
        cursor = encode_operator_cursor(PaginationCursorKind.RUN_EVENT_LIST, filter, last)
    return Page[RunEventRecord](data=[event.model_copy(deep=True) for event in events], next_cursor=cursor)
