"""Operator read contract: run and event filters, pagination, and the cursor and ordering rules
every ``OperatorReadDriver`` shares so all drivers page identically.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any, ClassVar

from pydantic import Field, field_validator, model_validator

from ..defaults import contract_defaults
from ..errors import ErrorCode, RunlaneError
from ..json_values import is_unicode_text
from ..models import CallerBuilt, Environment, RunEventRecord, RunlaneModel, RunRecord, UtcDateTime
from ..run_scans import get_run_runnable_available_at
from ..vocabulary import PaginationCursorKind, RunEventSortField, RunEventType, RunSortField, RunStatus, SortDirection
from .codecs import decode_iso_date, decode_storage_unsigned_integer, encode_iso_date, encode_storage_unsigned_integer
from .cursor import decode_opaque_token, encode_opaque_token

__all__ = [
    "PaginationParams",
    "RunEventFilter",
    "RunFilter",
    "TimeRange",
    "clamp_page_limit",
    "decode_operator_cursor",
    "encode_operator_cursor",
    "run_event_matches_filter",
    "run_event_sort_value",
    "run_matches_filter",
    "run_sort_value",
]


class TimeRange(RunlaneModel, metaclass=CallerBuilt):
    """Inclusive bounds; either side may be open."""

    # Built by hand (``TimeRange(start=...)``), bad bounds are a query filter's ``validation_failed``;
    # validated inside a filter, they are that filter's validation error.
    __caller_error__: ClassVar[tuple[ErrorCode, str, str]] = (ErrorCode.VALIDATION_FAILED, "time range", "range")

    start: UtcDateTime | None = None
    end: UtcDateTime | None = None

    @model_validator(mode="after")
    def _ordered(self) -> TimeRange:
        if self.start is not None and self.end is not None and self.start > self.end:
            raise ValueError("a time range must not end before it starts")
        return self

    def contains(self, value: datetime | None) -> bool:
        if value is None:
            return False
        return (self.start is None or value >= self.start) and (self.end is None or value <= self.end)


def _value_set(values: tuple[Any, ...] | None) -> tuple[Any, ...] | None:
    """A filter's values in one canonical order, each once: a filter matches any of them, so two requests
    naming the same values in another order are one listing and share its cursors."""
    return None if values is None else tuple(sorted(set(values)))


class RunFilter(RunlaneModel):
    environment: Environment
    statuses: tuple[RunStatus, ...] | None = None
    task_ids: tuple[str, ...] | None = None
    queues: tuple[str, ...] | None = None
    created_at: TimeRange | None = None
    updated_at: TimeRange | None = None
    run_at: TimeRange | None = None
    idempotency_key: str | None = None
    singleton_key: str | None = None
    source_run_id: str | None = None
    sort_by: RunSortField = contract_defaults.sort.runs.field  # type: ignore[assignment]
    sort_direction: SortDirection = contract_defaults.sort.runs.direction

    _value_sets = field_validator("statuses", "task_ids", "queues")(_value_set)


class RunEventFilter(RunlaneModel):
    environment: Environment
    run_id: str | None = None
    types: tuple[RunEventType, ...] | None = None
    occurred_at: TimeRange | None = None
    sort_by: RunEventSortField = contract_defaults.sort.run_events.field  # type: ignore[assignment]
    sort_direction: SortDirection = contract_defaults.sort.run_events.direction

    _value_sets = field_validator("types")(_value_set)

    @model_validator(mode="after")
    def _sequence_needs_run(self) -> RunEventFilter:
        if self.sort_by is RunEventSortField.SEQUENCE and self.run_id is None:
            raise ValueError("sorting events by sequence requires a run_id filter (sequences are per run)")
        return self


class PaginationParams(RunlaneModel):
    limit: int | None = Field(default=None, ge=1)
    cursor: str | None = None


def clamp_page_limit(limit: int | None, max_limit: int = contract_defaults.pagination.max_limit) -> int:
    if limit is None:
        return min(contract_defaults.pagination.default_limit, max_limit)
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise RunlaneError(ErrorCode.VALIDATION_FAILED, f"limit must be a positive integer, got {limit!r}.", meta={"field": "limit"})
    return min(limit, max_limit)


# ---------------------------------------------------------------------------------------------
# Matching and ordering (drivers whose native query language cannot express these reuse them).


def run_matches_filter(run: RunRecord, filter: RunFilter) -> bool:
    if run.environment.name != filter.environment.name:  # the environment's key (a model's == is slow)
        return False
    if filter.statuses is not None and run.status not in filter.statuses:
        return False
    if filter.task_ids is not None and run.task_id not in filter.task_ids:
        return False
    if filter.queues is not None and run.queue not in filter.queues:
        return False
    if filter.created_at is not None and not filter.created_at.contains(run.created_at):
        return False
    if filter.updated_at is not None and not filter.updated_at.contains(run.updated_at):
        return False
    if filter.run_at is not None and not filter.run_at.contains(run.run_at):
        return False
    if filter.idempotency_key is not None and run.idempotency_key != filter.idempotency_key:
        return False
    if filter.singleton_key is not None and run.singleton_key != filter.singleton_key:
        return False
    if filter.source_run_id is not None and (run.source is None or run.source.source_run_id != filter.source_run_id):
        return False
    return True


def run_sort_value(run: RunRecord, field: RunSortField, direction: SortDirection) -> tuple[str, ...]:
    """A string tuple whose order (reversed for DESC) is the page order; ties break on run id.

    ``run_at`` sorts by runnable availability, and runs without one come last in either direction.
    """
    if field is RunSortField.CREATED_AT:
        return (encode_iso_date(run.created_at), run.id)
    if field is RunSortField.UPDATED_AT:
        return (encode_iso_date(run.updated_at), run.id)
    available = get_run_runnable_available_at(run)
    has, missing = ("0", "1") if direction is SortDirection.ASC else ("1", "0")
    if available is None:
        return (missing, "", run.id)
    return (has, encode_iso_date(available), run.id)


def run_event_matches_filter(record: RunEventRecord, filter: RunEventFilter) -> bool:
    event = record.event
    if event.environment.name != filter.environment.name:
        return False
    if filter.run_id is not None and event.run_id != filter.run_id:
        return False
    if filter.types is not None and event.type not in filter.types:
        return False
    if filter.occurred_at is not None and not filter.occurred_at.contains(event.occurred_at):
        return False
    return True


def run_event_sort_value(record: RunEventRecord, field: RunEventSortField) -> tuple[str, ...]:
    event = record.event
    sequence = encode_storage_unsigned_integer(record.sequence)
    if field is RunEventSortField.SEQUENCE:
        return (sequence,)
    return (encode_iso_date(event.occurred_at), event.run_id, sequence)


# ---------------------------------------------------------------------------------------------
# Operator cursors: bound to the cursor kind and the canonical filter, holding the last sort value.


def _scope(kind: PaginationCursorKind, filter: RunlaneModel | dict[str, Any]) -> str:
    data = filter if isinstance(filter, dict) else filter.model_dump(mode="json")
    return json.dumps({"kind": PaginationCursorKind(kind).value, "filter": data}, sort_keys=True, separators=(",", ":"))


def encode_operator_cursor(kind: PaginationCursorKind, filter: RunlaneModel | dict[str, Any], last: Sequence[str]) -> str:
    return encode_opaque_token({"v": 1, "scope": _scope(kind, filter), "last": list(last)})


def decode_operator_cursor(cursor: str | None, kind: PaginationCursorKind, filter: RunlaneModel | dict[str, Any]) -> tuple[str, ...] | None:
    """The last sort value of ``cursor`` (``None`` when absent); a cursor from another scope is rejected."""
    if cursor is None:
        return None
    payload = decode_opaque_token(cursor)
    if (
        not isinstance(payload, dict)
        or type(payload.get("v")) is not int
        or payload["v"] != 1
        or not isinstance(payload.get("last"), list)
    ):
        raise RunlaneError(ErrorCode.VALIDATION_FAILED, "Malformed cursor: pass back the whole next_cursor value unchanged.", meta={"field": "cursor"})
    scope = _scope(kind, filter)
    if payload.get("scope") != scope:
        other_kind, other, other_filter = _scope_parts(payload.get("scope"))
        _, environment, this_filter = _scope_parts(scope)
        if other is not None and other != environment:
            belongs_to = "another environment"
        elif other_kind is not None and other_kind != PaginationCursorKind(kind).value:
            belongs_to = f"another listing ({_LISTINGS.get(str(other_kind), other_kind)})"
        elif _other_run(other_filter, this_filter):
            belongs_to = "another run"
        else:
            belongs_to = "a different filter or sort"
        raise RunlaneError(
            ErrorCode.VALIDATION_FAILED,
            f"This cursor belongs to {belongs_to}; restart the listing without a cursor.",
            meta={"field": "cursor"},
        )
    last = payload["last"]
    # Positions go to the driver as query parameters: text it cannot encode (a lone surrogate, which a
    # JSON escape can carry, or NUL, which Postgres text refuses) is as malformed as a wrong shape.
    if not all(isinstance(item, str) and "\x00" not in item and is_unicode_text(item) for item in last) or not _fits(
        last, filter
    ):
        raise RunlaneError(ErrorCode.VALIDATION_FAILED, "Malformed cursor position.", meta={"field": "cursor"})
    return tuple(last)


# What each cursor kind continues, as a refusal names it.
_LISTINGS = {
    PaginationCursorKind.RUN_LIST.value: "a run list",
    PaginationCursorKind.RUN_EVENT_LIST.value: "a run's events",
    PaginationCursorKind.RUN_STEP_LIST.value: "a run's steps",
    PaginationCursorKind.RUN_PRUNE.value: "a prune",
}


def _scope_parts(scope: object) -> tuple[object, object, object]:
    """The kind of a cursor scope, the name of the environment its filter names and the filter (each
    ``None`` when it has none or this is not a scope). A run or event filter holds the environment as an
    object, the steps scope as its key: both are its name."""
    try:
        data = json.loads(scope) if isinstance(scope, str) else None
    except ValueError:
        return None, None, None
    if not isinstance(data, dict):
        return None, None, None
    found = data.get("filter")
    environment = found.get("environment") if isinstance(found, dict) else None
    if isinstance(environment, dict):
        environment = environment.get("name")
    return data.get("kind"), environment, found


def _other_run(other: object, this: object) -> bool:
    """Whether two filters of a run's listing (its events, its steps) differ in the run alone."""
    if not isinstance(other, dict) or not isinstance(this, dict) or other.get("run_id") == this.get("run_id"):
        return False
    return {**other, "run_id": None} == {**this, "run_id": None}


def _fits(last: list[str], filter: RunlaneModel | dict[str, Any]) -> bool:
    """``last`` is a sort value of the filter's order (``run_sort_value`` / ``run_event_sort_value``): its
    shape and each part (a canonical time, sequence or id), so a position edited by hand is refused instead
    of quietly giving an empty page or the first one again; other scopes are not checked."""
    if isinstance(filter, RunFilter):
        if filter.sort_by is RunSortField.RUN_AT:
            return len(last) == 3 and last[0] in ("0", "1") and (last[1] == "" or _is_time(last[1])) and bool(last[2])
        return len(last) == 2 and _is_time(last[0]) and bool(last[1])
    if isinstance(filter, RunEventFilter):
        if filter.sort_by is RunEventSortField.SEQUENCE:
            return len(last) == 1 and _is_sequence(last[0])
        return len(last) == 3 and _is_time(last[0]) and bool(last[1]) and _is_sequence(last[2])
    return True


def _is_time(text: str) -> bool:
    try:
        return encode_iso_date(decode_iso_date(text)) == text
    except (RunlaneError, ValueError, TypeError, OverflowError):
        return False


def _is_sequence(text: str) -> bool:
    try:
        return encode_storage_unsigned_integer(decode_storage_unsigned_integer(text)) == text
    except (RunlaneError, ValueError, TypeError, OverflowError):
        return False
