"""Run pruning: retention of old terminal runs without touching active work.

Pruning runs in two phases over the generic ``StorageDriver`` contract:

1. **Tombstoning.** Candidates come from ``RUNS_TERMINAL_BY_FINISHED_AT`` (environment partition,
   sort strictly before the cutoff, ascending after the cursor position). Each candidate is
   point-read; only a terminal run whose status is selected and whose ``updated_at`` is before the
   cutoff is pruned. One transaction per batch creates the tombstone (``run_tombstones``, indexed in
   ``RUN_TOMBSTONES``) with the run's exact child counts, rewrites the run record with the same
   document and *no* index entries (so it leaves every operational scan in that commit; operator
   reads hide a run as soon as its tombstone exists) and deletes the retained idempotency owner when
   it still points to the run. The run's completion-wait marker stays: it is a durable, monotonic
   hint that waiters were ever registered, never a count of them, so pruning cannot know none are
   left (a waiter releasing meanwhile re-reads the run this commit rewrites, and is resumed at once).
2. **Cleanup.** Tombstones, oldest first, lose their child records in bounded transactions: events
   (``RUN_EVENTS_BY_RUN``), steps (``RUN_STEPS_BY_RUN``) and outbox rows (``OUTBOX_BY_RUN``). Every
   child is point-read and checked against the tombstone before it is deleted, and the tombstone's
   counter drops in the same commit. Counters, not index pages, decide completion: when all reach
   zero the run record and the tombstone are deleted together. A counter that would go negative, a
   child that does not belong to the run, or a child that remains once the counters say none do is
   ``invariant_violation``; nothing is ever orphaned. A ``prune()`` call cleans what it tombstoned
   plus a budget of older backlog (such as the tombstones of a call that died before its cleanup);
   while that budget runs out it returns a cursor even when no candidate is left, so a caller that
   follows cursors leaves no record behind.

Corrupt data is reported, never skipped silently, and one bad record never stops pruning: a
candidate run whose document does not decode (or whose child counts are not whole numbers >= 0) is
not tombstoned, and a tombstone that cannot be cleaned (it does not decode, a child breaks an
invariant above, or, on a driver with strong index consistency, its counter stays above zero while
no child of that kind is stored) is left as it is. Each is logged as a warning on ``runlane.prune``
(once per call and run, with the run id as the ``run_id`` attribute of the record) and the call goes
on with the other runs; ``RunPruner.cleanup`` also raises the first ``invariant_violation`` it met
once it has cleaned the others.

Observation stream records are never touched: telemetry retention belongs to the export boundary.

Runs that still hold wait-token links (``children.links``) are not pruned: link cleanup needs the
wait-token tables, and a tombstone that could never finish would only hide the run.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any, Final, Literal, TypeVar

from pydantic import ValidationError

from ..defaults import contract_defaults
from ..durations import duration_ms, format_duration
from ..errors import ErrorCode, RunlaneError
from ..models import Actor, Environment, RunRecord, environment_key
from ..storage import (
    NewStorageRecord,
    StorageCandidateMode,
    StorageDocument,
    StorageDriver,
    StorageIndexConsistency,
    StorageIndexEntry,
    StorageIndexName,
    StorageLimitError,
    StorageQuery,
    StorageRange,
    StorageRecord,
    StorageRecordKey,
    StorageTransaction,
    decode_iso_date,
    decode_operator_cursor,
    encode_iso_date,
    encode_operator_cursor,
    encode_storage_tuple,
    encode_storage_unsigned_integer,
)
from ..storage.cursor import decode_opaque_token
from ..storage.tables import (
    RUN_TOMBSTONES_COLLECTION,
    RUNS_COLLECTION,
    RunChildCounts,
    decode_run_document,
    decode_run_event_document,
    describe_record_key,
    record_key_meta,
    run_key,
    run_tombstone_key,
)
from ..vocabulary import PaginationCursorKind, RunStatus, run_status_values
from .store import RUN_STEPS_COLLECTION, idempotency_owner_key, run_step_keys

__all__ = [
    "DEFAULT_CLEANUP_BUDGET",
    "CleanupResult",
    "PruneResult",
    "RunPruner",
    "RunTombstone",
    "decode_run_tombstone",
    "prune_cursor_scope",
    "older_than_ms",
    "resolve_older_than",
    "resolve_prune_request",
    "run_tombstone_record",
]

T = TypeVar("T")

_log = logging.getLogger("runlane.prune")

_TERMINAL: Final = run_status_values.terminal
# Terminal statuses in their documented order, for messages.
_TERMINAL_ORDER: Final = (RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED)
_TERMINAL_NAMES: Final = ", ".join(status.value for status in _TERMINAL_ORDER)

DEFAULT_CLEANUP_BUDGET: Final = 1000
"""Child records one ``prune()`` call deletes at most while cleaning tombstones."""


# ---------------------------------------------------------------------------------------------
# Results


@dataclass(frozen=True, slots=True)
class PruneResult:
    """``pruned``: runs tombstoned by this call. ``next_cursor``: set while more candidates may remain,
    or records of pruned runs this call had no budget left to delete; pass it back with the same
    environment, cutoff and statuses."""

    pruned: int
    next_cursor: str | None = None


@dataclass(frozen=True, slots=True)
class CleanupResult:
    """``deleted``: child records removed. ``finished``: tombstones whose run and tombstone records
    were removed. ``pending``: tombstones visited that still have children left. ``corrupt``: those of
    the pending ones left because a record is corrupt (each logged on ``runlane.prune``). ``more``:
    this call deleted records, and it stopped at its budget or left a tombstone it visited unfinished
    for a reason other than corruption, so another call may clean more."""

    deleted: int = 0
    finished: int = 0
    pending: int = 0
    corrupt: int = 0
    more: bool = False


# ---------------------------------------------------------------------------------------------
# Errors


def _invalid(message: str, **meta: Any) -> RunlaneError:
    return RunlaneError(ErrorCode.VALIDATION_FAILED, message, meta=meta)


def _invariant(message: str, **meta: Any) -> RunlaneError:
    return RunlaneError(ErrorCode.INVARIANT_VIOLATION, message, meta=meta)


_MALFORMED_CURSOR: Final = "Malformed prune cursor: pass back the whole next_cursor value unchanged."


def _bad_cursor(message: str = _MALFORMED_CURSOR) -> RunlaneError:
    return _invalid(message, field="cursor")


class _Reports:
    """The corruption one prune or cleanup call met: each run is logged once per call (a transaction
    body that is retried, or a tombstone visited twice, does not log it again)."""

    __slots__ = ("_runs", "first")

    def __init__(self) -> None:
        self._runs: set[str] = set()
        self.first: RunlaneError | None = None

    def warn(self, run_id: str, message: str, error: RunlaneError | None = None) -> None:
        if error is not None and self.first is None:
            self.first = error
        if run_id in self._runs:
            return
        self._runs.add(run_id)
        _log.warning(message, extra={"run_id": run_id})


# ---------------------------------------------------------------------------------------------
# Tombstones


@dataclass(frozen=True, slots=True)
class RunTombstone:
    """A pruned run awaiting cleanup: who pruned it, when, and the exact children still stored."""

    run_id: str
    tombstoned_at: datetime
    pruned_by: Actor
    children: RunChildCounts


def _tombstone_document(tombstone: RunTombstone) -> StorageDocument:
    return StorageDocument.encode(
        {
            "run_id": tombstone.run_id,
            "tombstoned_at": encode_iso_date(tombstone.tombstoned_at),
            "pruned_by": tombstone.pruned_by.model_dump(mode="json"),
            "children": tombstone.children.to_json(),
        }
    )


def run_tombstone_record(env_key: str, tombstone: RunTombstone) -> NewStorageRecord:
    """The tombstone record at ``run_tombstone_key(env, run_id)``, indexed by ``(tombstoned_at, run_id)``."""
    return NewStorageRecord(
        run_tombstone_key(env_key, tombstone.run_id),
        _tombstone_document(tombstone),
        (
            StorageIndexEntry(
                StorageIndexName.RUN_TOMBSTONES,
                (env_key,),
                (encode_iso_date(tombstone.tombstoned_at), tombstone.run_id),
            ),
        ),
    )


_COUNTERS: Final = ("events", "outbox", "steps", "links")


def _corrupt_tombstone(key: StorageRecordKey, problem: str, error: Exception | None = None) -> RunlaneError:
    return RunlaneError(
        ErrorCode.INVARIANT_VIOLATION,
        f"The stored tombstone of pruned run {key.parts[-1]} (record {describe_record_key(key)}) is not valid: "
        f"{problem}. This is durable corruption: its run is hidden but not cleaned up; restore the tombstone "
        "from a backup, or delete the run's records.",
        meta=record_key_meta(key),
        cause=error,
    )


def _detail(error: Exception) -> str:
    if isinstance(error, RunlaneError):
        return error.message
    if isinstance(error, ValidationError):
        first = error.errors(include_url=False)[0]
        where = ".".join(str(part) for part in first.get("loc", ()))
        return f"{where}: {first['msg']}" if where else str(first["msg"])
    return str(error)


def decode_run_tombstone(record: StorageRecord) -> RunTombstone:
    """The tombstone stored in ``record``; anything else (or a record under another key) is corruption."""
    key = record.key
    if key.collection != RUN_TOMBSTONES_COLLECTION or len(key.parts) != 2:
        raise _invariant(
            f"The record {describe_record_key(key)} is not a run tombstone.", **record_key_meta(key)
        )
    value = record.document.value
    field = "run_id"
    try:
        run_id = value["run_id"]
        if not isinstance(run_id, str):
            raise ValueError(f"{run_id!r} is not a run id")
        field = "tombstoned_at"
        tombstoned_at = decode_iso_date(value["tombstoned_at"])
        field = "pruned_by"
        pruned_by = Actor.model_validate(value["pruned_by"])
        field = "children"
        raw = value["children"]
        if not isinstance(raw, dict) or set(raw) != set(_COUNTERS):
            raise ValueError("it is not an object of exactly the events, outbox, steps and links counts")
        for name in _COUNTERS:
            count = raw[name]
            if type(count) is not int or count < 0:
                field = f"children.{name}"
                raise ValueError(f"{count!r} is not a whole number >= 0")
        children = RunChildCounts(**raw)
    except KeyError as error:
        raise _corrupt_tombstone(key, f"field {field!r} is missing", error) from None
    except (TypeError, ValueError, RunlaneError) as error:
        detail = _detail(error)
        raise _corrupt_tombstone(key, f"field {field!r} is invalid ({detail.rstrip('.')})", error) from None
    if run_id != key.parts[1]:
        raise _corrupt_tombstone(key, f"it names run {run_id!r}; a tombstone must name the run of its key")
    return RunTombstone(run_id=run_id, tombstoned_at=tombstoned_at, pruned_by=pruned_by, children=children)


def _with_count(children: RunChildCounts, counter: str, value: int) -> RunChildCounts:
    return replace(children, **{counter: value})


# ---------------------------------------------------------------------------------------------
# Child kinds cleaned after tombstoning


def _event_belongs(record: StorageRecord, env: str, run_id: str) -> bool:
    event = decode_run_event_document(record.document)
    return (
        event.event.run_id == run_id
        and environment_key(event.event.environment) == env
        and record.key.collection == "run_events"
        and record.key.parts == (env, run_id, encode_storage_unsigned_integer(event.sequence))
    )


def _step_belongs(record: StorageRecord, env: str, run_id: str) -> bool:
    value = record.document.value
    step_key = value.get("step_key")
    environment = value.get("environment")
    return (
        record.key.collection == RUN_STEPS_COLLECTION
        and value.get("run_id") == run_id
        and isinstance(environment, dict)
        and environment.get("name") == env
        and isinstance(step_key, str)
        and record.key in run_step_keys(env, run_id, step_key)
    )


def _outbox_belongs(record: StorageRecord, env: str, run_id: str) -> bool:
    # Outbox rows are checked generically: a ``run_id`` the document carries must be this run's.
    value = record.document.value
    return "run_id" not in value or value["run_id"] == run_id


@dataclass(frozen=True, slots=True)
class _ChildKind:
    counter: str
    index: StorageIndexName
    belongs: Callable[[StorageRecord, str, str], bool]


_CHILD_KINDS: Final = (
    _ChildKind("events", StorageIndexName.RUN_EVENTS_BY_RUN, _event_belongs),
    _ChildKind("steps", StorageIndexName.RUN_STEPS_BY_RUN, _step_belongs),
    _ChildKind("outbox", StorageIndexName.OUTBOX_BY_RUN, _outbox_belongs),
)


def _check_child(kind: _ChildKind, record: StorageRecord, env: str, run_id: str) -> None:
    """A child must carry this run's index entry and a document that names this run."""
    partition = (env, run_id)
    indexed = any(entry.name is kind.index and entry.partition == partition for entry in record.indexes)
    try:
        belongs = indexed and kind.belongs(record, env, run_id)
    except (RunlaneError, ValueError, TypeError, AttributeError):
        belongs = False
    if not belongs:
        raise _invariant(
            f"The {kind.counter} record {describe_record_key(record.key)} found for pruned run {run_id} does not "
            "belong to it; its cleanup stopped so no record is orphaned. Restore or remove that record.",
            run_id=run_id,
            key=record.key.encoded,
        )


# ---------------------------------------------------------------------------------------------
# Request resolution and cursors


def _aware(value: object, what: str) -> datetime:
    if not isinstance(value, datetime) or value.tzinfo is None or value.utcoffset() is None:
        raise _invalid(f"{what} must be a timezone-aware datetime, got {value!r}.", field=what)
    try:
        return value.astimezone(UTC)
    except OverflowError:  # datetime(1, 1, 1, tzinfo=+05:00) is before the year 1 in UTC
        raise _invalid(
            f"{what} {value!r} is out of range in UTC (years 1 to 9999); pass a time within it.", field=what
        ) from None


def _statuses(statuses: object) -> frozenset[RunStatus]:
    if statuses is None:
        return _TERMINAL
    if isinstance(statuses, (str, RunStatus)):
        statuses = (statuses,)  # one bare status is one value, as in runs.list
    elif not isinstance(statuses, Iterable):
        raise _invalid(f"statuses must be a list of terminal statuses ({_TERMINAL_NAMES}).", field="statuses")
    resolved: set[RunStatus] = set()
    for item in statuses:
        try:
            status = RunStatus(item)
        except ValueError:
            raise _invalid(
                f"Unknown run status {item!r}; prune accepts terminal statuses only: {_TERMINAL_NAMES}.",
                field="statuses",
            ) from None
        if status not in _TERMINAL:
            raise _invalid(
                f"Run status {status.value!r} is active and cannot be pruned; prune accepts terminal statuses only: "
                f"{_TERMINAL_NAMES}. Inspect or cancel stuck active runs instead.",
                field="statuses",
                status=status.value,
            )
        resolved.add(status)
    if not resolved:
        raise _invalid(
            f"statuses must name at least one terminal status ({_TERMINAL_NAMES}); omit it to prune all of them.",
            field="statuses",
        )
    return frozenset(resolved)


def _limit(limit: object) -> int:
    if limit is None:
        return contract_defaults.pruning.batch_limit
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise _invalid(f"limit must be a positive whole number, got {limit!r}.", field="limit")
    return limit


def _sorted_status_values(statuses: Iterable[RunStatus]) -> list[str]:
    return sorted(status.value for status in statuses)


def prune_cursor_scope(
    environment: Environment | str,
    cutoff: datetime,
    statuses: Iterable[RunStatus],
    older_than_ms: int | None = None,
) -> dict[str, Any]:
    """The retention scope a public prune cursor is bound to (with kind ``run_prune``): the cutoff it
    froze and, when ``older_than`` was a duration, that duration (``older_than_ms``)."""
    env = environment if isinstance(environment, str) else environment_key(environment)
    scope: dict[str, Any] = {
        "environment": env,
        "older_than": encode_iso_date(_aware(cutoff, "older_than")),
        "statuses": _sorted_status_values(statuses),
    }
    if older_than_ms is not None:
        scope["older_than_ms"] = older_than_ms
    return scope


@dataclass(frozen=True, slots=True)
class _CursorScope:
    environment: str
    cutoff: datetime
    statuses: frozenset[RunStatus]
    older_than_ms: int | None


def _peek_cursor_scope(cursor: object) -> _CursorScope:
    """The retention scope a prune cursor claims (validated in full when the prune decodes it)."""
    payload = decode_opaque_token(cursor)
    if not isinstance(payload, dict) or not isinstance(payload.get("scope"), str):
        raise _bad_cursor()
    try:
        scope = json.loads(payload["scope"])
    except ValueError:
        raise _bad_cursor() from None
    if not isinstance(scope, dict) or scope.get("kind") != PaginationCursorKind.RUN_PRUNE.value:
        raise _bad_cursor("This cursor is not a prune cursor; restart the prune without a cursor.")
    scoped = scope.get("filter")
    if not isinstance(scoped, dict) or set(scoped) - {"older_than_ms"} != {"environment", "older_than", "statuses"}:
        raise _bad_cursor()
    environment, older_than, statuses = scoped["environment"], scoped["older_than"], scoped["statuses"]
    if not isinstance(environment, str) or not isinstance(older_than, str) or not isinstance(statuses, list):
        raise _bad_cursor()
    duration = scoped.get("older_than_ms")
    if duration is not None and (type(duration) is not int or duration < 1):
        raise _bad_cursor()
    try:
        cutoff = decode_iso_date(older_than)
        values = frozenset(RunStatus(item) for item in statuses)
    except (RunlaneError, ValueError, TypeError):
        raise _bad_cursor() from None
    if not values or not values <= _TERMINAL or _sorted_status_values(values) != statuses:
        raise _bad_cursor()
    return _CursorScope(environment, cutoff, values, duration)


def _older_than(older_than: object) -> tuple[datetime | None, timedelta | None]:
    """``(explicit cutoff, None)`` for an aware datetime, ``(None, duration)`` for a duration."""
    if isinstance(older_than, datetime):
        return _aware(older_than, "older_than"), None
    if isinstance(older_than, (str, timedelta)):
        return None, timedelta(milliseconds=duration_ms(older_than, "older_than", code=ErrorCode.VALIDATION_FAILED))
    raise _invalid(
        f"older_than must be a duration such as '30d', a timedelta or an aware datetime, got {older_than!r}.",
        field="older_than",
    )


def older_than_ms(older_than: str | timedelta | datetime) -> int | None:
    """The duration an ``older_than`` names, in milliseconds, or ``None`` for a datetime cutoff."""
    duration = _older_than(older_than)[1]
    return None if duration is None else duration // timedelta(milliseconds=1)


def resolve_older_than(older_than: str | timedelta | datetime, now: datetime) -> datetime:
    """The cutoff an ``older_than`` names at ``now``: an aware datetime as it is (in UTC), or ``now``
    minus a duration (``"30d"`` or a ``timedelta``); anything else is ``validation_failed``."""
    explicit, duration = _older_than(older_than)
    if explicit is not None:
        return explicit
    assert duration is not None
    try:
        return _aware(now, "now") - duration
    except OverflowError:
        raise _invalid(f"older_than {older_than!r} reaches before year 1.", field="older_than") from None


def resolve_prune_request(
    *,
    older_than: str | timedelta | datetime,
    statuses: Iterable[RunStatus | str] | None = None,
    limit: int | None = None,
    cursor: str | None = None,
    now: datetime,
    environment: Environment | str | None = None,
) -> tuple[datetime, frozenset[RunStatus], int]:
    """Validate a prune request before storage is touched: ``(cutoff, statuses, limit)``.

    * ``older_than``: a duration (``"30d"`` or a ``timedelta``) resolved relative to ``now``, or an
      aware ``datetime`` cutoff.
    * ``statuses``: terminal statuses only; omitted means every terminal status.
    * ``limit``: a positive whole number (default ``contract_defaults.pruning.batch_limit``).
    * ``cursor``: its frozen cutoff wins over a duration, so continuations never drift. A cursor of
      another environment (when ``environment`` is given), with other statuses, or issued for another
      ``older_than`` (another duration, another datetime, a datetime for a duration) is rejected.
    """
    current = _aware(now, "now")
    chosen = _statuses(statuses)
    wanted = _limit(limit)
    explicit, duration = _older_than(older_than)  # validated here, before the cursor is read
    if cursor is None:
        return resolve_older_than(older_than, current), chosen, wanted

    scope = _peek_cursor_scope(cursor)
    if environment is not None:
        env = environment if isinstance(environment, str) else environment_key(environment)
        if scope.environment != env:
            raise _bad_cursor("This prune cursor belongs to another environment; restart the prune without a cursor.")
    if scope.statuses != chosen:
        raise _bad_cursor(
            "This prune cursor was issued for statuses "
            f"{', '.join(_sorted_status_values(scope.statuses))}; continue with the same statuses."
        )
    if explicit is not None:
        if explicit != scope.cutoff or scope.older_than_ms is not None:
            raise _bad_cursor(
                f"This prune cursor is frozen at cutoff {encode_iso_date(scope.cutoff)}; continue with the same "
                "older_than instead of a new date."
            )
        return scope.cutoff, chosen, wanted
    assert duration is not None
    given_ms = duration // timedelta(milliseconds=1)
    if scope.older_than_ms != given_ms:
        issued = (
            f"older_than {format_duration(scope.older_than_ms)}"
            if scope.older_than_ms is not None
            else f"the cutoff {encode_iso_date(scope.cutoff)}"
        )
        raise _bad_cursor(
            f"This prune cursor was issued for {issued}; continue with the same older_than, or restart without "
            "a cursor."
        )
    # The frozen cutoff wins over the duration; it can only be at or before ``now - duration`` for a
    # cursor this duration issued earlier, so a later one means a tampered cursor.
    if scope.cutoff > resolve_older_than(older_than, current):
        raise _bad_cursor(
            f"This prune cursor is frozen at cutoff {encode_iso_date(scope.cutoff)}, later than older_than allows now; "
            "restart without a cursor."
        )
    return scope.cutoff, chosen, wanted


# ---------------------------------------------------------------------------------------------
# The pruner


class _Gone(Exception):
    """The tombstone disappeared between reads (another cleaner finished it)."""


# Rows one prune call may read per run it is asked to prune (and at least this many), so a status
# filter that skips most terminal runs still ends each call in bounded time, with a cursor.
_PRUNE_SCAN_FACTOR: Final = 10
_PRUNE_SCAN_MIN: Final = 1_000


def _tombstone_too_large(error: StorageLimitError, actor: Actor) -> StorageLimitError:
    """The limit error of tombstoning one run alone: what varies in a tombstone is who pruned it."""
    size = len((actor.id or "").encode("utf-8"))
    message = error.too_large(
        "The tombstone of a run, which records the actor of the prune,",
        f" That run is not pruned; prune with a shorter actor id (this one takes {size:,} bytes).",
    )
    return StorageLimitError(error.limit, error.allowed, error.actual, message, reserved=error.reserved)


def _scanned(cutoff: datetime) -> tuple[str, str]:
    """The cursor position after every candidate: it sorts after each ``(finished_at, run_id)`` before
    ``cutoff``, so a continuation from it scans nothing and only cleans up."""
    return (encode_iso_date(cutoff), "")


class RunPruner:
    """Tombstones old terminal runs of one environment and cleans their records up in bounded steps.

    ``cleanup_budget`` is the number of child records one ``prune()`` call deletes at most (``0``
    leaves cleanup to explicit ``cleanup()`` calls).
    """

    def __init__(
        self, driver: StorageDriver, environment: Environment | str, *, cleanup_budget: int = DEFAULT_CLEANUP_BUDGET
    ) -> None:
        if isinstance(environment, str):
            environment = Environment(name=environment)
        if not isinstance(environment, Environment):
            raise RunlaneError(
                ErrorCode.CONFIGURATION_INVALID, f"environment must be an Environment, got {environment!r}."
            )
        if isinstance(cleanup_budget, bool) or not isinstance(cleanup_budget, int) or cleanup_budget < 0:
            raise RunlaneError(
                ErrorCode.CONFIGURATION_INVALID, f"cleanup_budget must be a whole number >= 0, got {cleanup_budget!r}."
            )
        self.driver = driver
        self.environment = environment
        self.env_key = environment_key(environment)
        self.cleanup_budget = cleanup_budget

    def __repr__(self) -> str:
        return f"RunPruner(driver={getattr(self.driver, 'name', self.driver)!r}, environment={self.env_key!r})"

    # -- limits ------------------------------------------------------------------------------------

    @property
    def _limits(self) -> Any:
        return self.driver.profile.limits

    def _tombstone_batch_size(self) -> int:
        # Reads: run, tombstone and completion-wait marker per run, then one owner per run; records:
        # run, tombstone, owner, marker.
        limits = self._limits
        return max(1, min(limits.max_point_reads // 3, limits.max_transaction_records // 4))

    def _child_batch_size(self) -> int:
        # Reads and records: the tombstone and the children.
        limits = self._limits
        return max(1, min(limits.max_point_reads - 1, limits.max_transaction_records - 1, limits.max_query_results))

    async def _split(
        self,
        items: Sequence[T],
        run_batch: Callable[[Sequence[T]], Awaitable[int]],
        on_corrupt: Callable[[T, RunlaneError], None] | None = None,
    ) -> int:
        """Run one batch; a batch that exceeded a storage limit rolled back and is halved. With
        ``on_corrupt``, so is a batch a corrupt record failed (``invariant_violation``: a driver that
        cannot read a record fails the whole transaction), until its item is alone: that item is
        reported to ``on_corrupt`` and left out."""
        try:
            return await run_batch(items)
        except StorageLimitError:
            if len(items) <= 1:
                raise
        except RunlaneError as error:
            if on_corrupt is None or error.code is not ErrorCode.INVARIANT_VIOLATION:
                raise
            if len(items) <= 1:
                on_corrupt(items[0], error)
                return 0
        middle = len(items) // 2
        return await self._split(items[:middle], run_batch, on_corrupt) + await self._split(
            items[middle:], run_batch, on_corrupt
        )

    # -- prune -------------------------------------------------------------------------------------

    async def prune(
        self,
        *,
        older_than: datetime,
        statuses: frozenset[RunStatus],
        limit: int,
        cursor: str | None,
        actor: Actor,
        now: datetime,
        older_than_ms: int | None = None,
    ) -> PruneResult:
        """Tombstone up to ``limit`` candidates older than ``older_than``, then clean up a bounded amount.

        ``older_than`` and ``statuses`` are the resolved scope (see ``resolve_prune_request``),
        ``older_than_ms`` the duration the caller named, if any (cursors are bound to it); ``now`` is
        the prune time recorded on each tombstone and ``actor`` who pruned.
        """
        cutoff = _aware(older_than, "older_than")
        pruned_at = _aware(now, "now")
        chosen = _statuses(statuses)
        wanted = _limit(limit)
        if not isinstance(actor, Actor):
            raise RunlaneError(
                ErrorCode.CONFIGURATION_INVALID,
                f"actor must be an Actor(type=ActorType..., id=...), got {actor!r}.",
                meta={"field": "actor"},
            )
        scope = prune_cursor_scope(self.env_key, cutoff, chosen, older_than_ms)
        last = decode_operator_cursor(cursor, PaginationCursorKind.RUN_PRUNE, scope)
        if last is not None:
            try:
                if len(last) != 2:
                    raise ValueError("position")
                decode_iso_date(last[0])
                encode_storage_tuple(last)
            except (ValueError, RunlaneError):
                raise _bad_cursor("Malformed prune cursor position.") from None

        upper = encode_storage_tuple((encode_iso_date(cutoff),))
        env = self.env_key
        examined = pruned = 0
        more = False
        # A position at the cutoff (see ``_scanned``) continues a prune whose candidates are all
        # tombstoned: only cleanup is left.
        scanned = last is not None and encode_storage_tuple(last) >= upper
        tombstoned_children: list[int] = []  # per tombstoned run, its child records still to delete
        reports = _Reports()
        # The scan reads every terminal status in finish order and skips the runs the filter leaves
        # out, so ``limit`` counts pruned runs and the rows read are bounded separately: a call with a
        # status filter still prunes what it can behind older runs of other statuses.
        budget = max(wanted * _PRUNE_SCAN_FACTOR, _PRUNE_SCAN_MIN)
        while not scanned and pruned < wanted and examined < budget:
            bounds = StorageRange(gt=None if last is None else encode_storage_tuple(last), lt=upper)
            size = min(wanted - pruned, budget - examined, self._limits.max_query_results)
            page = await self.driver.query(
                StorageQuery(StorageIndexName.RUNS_TERMINAL_BY_FINISHED_AT, (env,), bounds, limit=size)
            )
            if not page.items:
                more = False
                break
            run_ids = list(
                dict.fromkeys(
                    ref.key.parts[1]
                    for ref in page.items
                    if ref.key.collection == RUNS_COLLECTION and len(ref.key.parts) == 2 and ref.key.parts[0] == env
                )
            )
            batch = self._tombstone_batch_size()
            for start in range(0, len(run_ids), batch):
                chunk = run_ids[start : start + batch]
                try:
                    pruned += await self._split(
                        chunk,
                        lambda items: self._tombstone(
                            items, cutoff, chosen, actor, pruned_at, tombstoned_children, reports
                        ),
                        lambda run_id, error: reports.warn(run_id, f"Run {run_id} is not pruned: {error.message}"),
                    )
                except StorageLimitError as error:
                    raise _tombstone_too_large(error, actor) from None
            examined += len(page.items)
            last = page.items[-1].sort
            more = page.next_cursor is not None
            if not more:
                break

        backlog = False
        if self.cleanup_budget:
            # At least what this call tombstoned, so cleanup keeps pace with pruning (a caller paging
            # through every cursor leaves no backlog behind), plus the budget for an older backlog.
            # Corruption met there is logged, not raised: the tombstones of this call have committed, and a
            # record only an operator can repair must not fail every later prune.
            backlog = (await self._cleanup(self.cleanup_budget + sum(tombstoned_children), reports)).more
        if more and last is not None:
            next_cursor: str | None = encode_operator_cursor(PaginationCursorKind.RUN_PRUNE, scope, last)
        elif backlog:
            # Every candidate is tombstoned, but a backlog of pruned runs' records (one an interrupted call
            # left, say) outlasted the budget: a caller following cursors goes on until it is deleted.
            next_cursor = encode_operator_cursor(PaginationCursorKind.RUN_PRUNE, scope, _scanned(cutoff))
        else:
            next_cursor = None
        return PruneResult(pruned=pruned, next_cursor=next_cursor)

    async def _tombstone(
        self,
        run_ids: Sequence[str],
        cutoff: datetime,
        statuses: frozenset[RunStatus],
        actor: Actor,
        pruned_at: datetime,
        tombstoned_children: list[int],
        reports: _Reports | None = None,
    ) -> int:
        """Tombstone the eligible runs of ``run_ids`` in one commit; returns how many were tombstoned and
        appends each one's child record count to ``tombstoned_children`` once it has committed."""
        env = self.env_key
        keys = [run_key(env, run_id) for run_id in run_ids]
        keys.extend(run_tombstone_key(env, run_id) for run_id in run_ids)
        count = len(run_ids)

        async def body(tx: StorageTransaction) -> list[int]:
            found = await tx.get(keys)
            eligible: list[tuple[StorageRecord, RunRecord, RunChildCounts]] = []
            owner_keys: dict[str, StorageRecordKey] = {}
            for record, tombstone_record in zip(found[:count], found[count:], strict=True):
                if record is None or tombstone_record is not None:
                    continue  # gone, or already tombstoned
                decoded = self._eligible(record, cutoff, statuses, reports or _Reports())
                if decoded is None:
                    continue
                run, children = decoded
                eligible.append((record, run, children))
                if run.idempotency_key is not None:
                    owner_key = idempotency_owner_key(env, run.task_id, run.idempotency_key)
                    owner_keys.setdefault(owner_key.encoded, owner_key)
            owner_list = list(owner_keys.values())
            owners = await tx.get(owner_list) if owner_list else []
            await tx.now()
            pruned_ids = {run.id for _, run, _ in eligible}
            for record, run, children in eligible:
                tombstone = RunTombstone(run_id=run.id, tombstoned_at=pruned_at, pruned_by=actor, children=children)
                tx.create(run_tombstone_record(env, tombstone))
                # Same document, no index entries: the run leaves every operational scan in this commit.
                tx.replace(record, NewStorageRecord(record.key, record.document))
            for owner in owners:
                if owner is None:
                    continue
                owner_run = owner.document.value.get("run_id")
                if isinstance(owner_run, str) and owner_run in pruned_ids:
                    tx.delete(owner)
            return [children.events + children.steps + children.outbox for _, _, children in eligible]

        committed = await self.driver.with_transaction(body)
        tombstoned_children.extend(committed)
        return len(committed)

    def _eligible(
        self, record: StorageRecord, cutoff: datetime, statuses: frozenset[RunStatus], reports: _Reports
    ) -> tuple[RunRecord, RunChildCounts] | None:
        """The run of a candidate record when it may be pruned. A record that does not decode as this
        environment's run is corrupt: it is reported and left alone (its children cannot be counted)."""
        key = record.key
        run_id = key.parts[-1]
        try:
            run, children = decode_run_document(record.document, key)
        except RunlaneError as error:
            reports.warn(run_id, f"Run {run_id} is not pruned: {error.message}")
            return None
        if run.id != run_id or environment_key(run.environment) != self.env_key:
            reports.warn(
                run_id,
                f"Run {run_id} is not pruned: its stored document (record {describe_record_key(key)}) holds run "
                f"{run.id} of environment {environment_key(run.environment)!r}. This is durable corruption: restore "
                "the record from a backup, or delete the run's records.",
            )
            return None
        if run.status not in _TERMINAL or run.status not in statuses:
            return None
        if not run.updated_at < cutoff:
            return None
        if children.links:
            return None
        return run, children

    # -- cleanup -----------------------------------------------------------------------------------

    async def cleanup(self, *, budget: int | None = None) -> CleanupResult:
        """Delete the children of the oldest tombstones, at most ``budget`` child records, and remove
        every finished run and tombstone. Visits at most ``budget`` tombstones, oldest first, going past
        pending and corrupt ones (each corrupt one is logged); the first ``invariant_violation`` met is
        raised once the others are cleaned."""
        allowed = self.cleanup_budget if budget is None else budget
        if isinstance(allowed, bool) or not isinstance(allowed, int) or allowed < 0:
            raise _invalid(f"budget must be a whole number >= 0, got {allowed!r}.", field="budget")
        reports = _Reports()
        result = await self._cleanup(allowed, reports)
        if reports.first is not None:
            raise reports.first
        return result

    async def _cleanup(self, allowed: int, reports: _Reports) -> CleanupResult:
        env = self.env_key
        deleted = finished = pending = corrupt = visited = 0
        removed_here = 0  # tombstones this call removed (not found removed by another cleaner)
        after: str | None = None
        # Every tombstone left counts at least one event (each run has one), so visiting at most
        # ``allowed`` tombstones keeps a call bounded even when many are pending or corrupt.
        exhausted = False  # every tombstone of the environment was visited
        while deleted < allowed and visited < allowed:
            size = min(allowed - visited, self._limits.max_query_results)
            page = await self.driver.query(
                StorageQuery(StorageIndexName.RUN_TOMBSTONES, (env,), StorageRange(gt=after), limit=size)
            )
            cut = False  # the budget ran out before the end of this page
            for ref in page.items:
                if deleted >= allowed:
                    cut = True
                    break
                visited += 1
                key = ref.key
                if key.collection != RUN_TOMBSTONES_COLLECTION or len(key.parts) != 2 or key.parts[0] != env:
                    continue
                run_id = key.parts[1]
                try:
                    removed, state = await self._clean_run(run_id, allowed - deleted, reports)
                except RunlaneError as error:
                    if error.code is not ErrorCode.INVARIANT_VIOLATION:
                        raise
                    reports.warn(run_id, f"Pruned run {run_id} is not cleaned up: {error.message}", error)
                    removed, state = 0, "corrupt"
                deleted += removed
                if state == "finished" or state == "gone":
                    finished += 1
                    removed_here += state == "finished"
                else:
                    pending += 1
                    corrupt += state == "corrupt"
            if len(page.items) < size or not page.items:
                exhausted = not cut
                break
            # Pending and corrupt tombstones stay indexed: go on after the last one visited.
            after = encode_storage_tuple(page.items[-1].sort)
        more = bool(deleted or removed_here) and (not exhausted or pending > corrupt)
        return CleanupResult(deleted=deleted, finished=finished, pending=pending, corrupt=corrupt, more=more)

    async def _clean_run(
        self, run_id: str, budget: int, reports: _Reports
    ) -> tuple[int, Literal["finished", "gone", "pending", "corrupt"]]:
        """Clean one tombstone: ``(children deleted, state)``; ``gone`` when another cleaner removed it."""
        env = self.env_key
        tombstone_key = run_tombstone_key(env, run_id)
        (record,) = await self.driver.get([tombstone_key])
        if record is None:
            return 0, "gone"
        children = decode_run_tombstone(record).children
        if children.links:
            reports.warn(
                run_id,
                f"Pruned run {run_id} is not cleaned up: its tombstone counts {children.links} wait-token link(s), "
                "which cleanup never deletes (a run holding links is never pruned), so it can never finish. The run "
                "stays hidden and its records are kept; restore the tombstone from a backup, or delete the run's "
                "records.",
            )
            return 0, "corrupt"
        deleted = 0
        for kind in _CHILD_KINDS:
            while getattr(children, kind.counter) > 0 and deleted < budget:
                size = min(budget - deleted, self._child_batch_size())
                page = await self.driver.query(StorageQuery(kind.index, (env, run_id), limit=size))
                if not page.items:
                    # Not proof of completion on an eventual index: the counter says children remain
                    # (the index may not show them yet), so leave the tombstone for a later pass.
                    if self.driver.profile.index_consistency is not StorageIndexConsistency.STRONG:
                        break
                    # A strong index shows every child: a counter still above zero after this query
                    # (re-read, so a concurrent cleaner's progress is seen) can never reach zero.
                    (record,) = await self.driver.get([tombstone_key])
                    if record is None:
                        return deleted, "gone"
                    children = decode_run_tombstone(record).children
                    left = getattr(children, kind.counter)
                    if left == 0:
                        continue
                    reports.warn(
                        run_id,
                        f"Pruned run {run_id} is not cleaned up: its tombstone's {kind.counter} counter is {left} "
                        f"but no {kind.counter} record of the run is stored (lost, or deleted outside Runlane), so "
                        "it can never reach zero. The run stays hidden and its remaining records are kept; restore "
                        "the missing records from a backup, or delete the run's records.",
                    )
                    return deleted, "corrupt"
                outcomes: list[RunChildCounts] = []

                async def run_batch(keys: Sequence[StorageRecordKey], kind: _ChildKind = kind) -> int:
                    removed, counts = await self._delete_children(run_id, kind, keys)
                    outcomes.append(counts)
                    return removed

                try:
                    progress = await self._split([ref.key for ref in page.items], run_batch)
                except _Gone:
                    return deleted, "gone"
                if outcomes:
                    children = outcomes[-1]
                deleted += progress
                if progress == 0:
                    # Every candidate was already gone (another cleaner); re-read before going on.
                    (record,) = await self.driver.get([tombstone_key])
                    if record is None:
                        return deleted, "gone"
                    fresh = decode_run_tombstone(record).children
                    stalled = fresh == children
                    children = fresh
                    if stalled:
                        break
        if any(getattr(children, kind.counter) for kind in _CHILD_KINDS) or children.links:
            return deleted, "pending"
        await self._finish(run_id)
        return deleted, "finished"

    async def _delete_children(
        self, run_id: str, kind: _ChildKind, keys: Sequence[StorageRecordKey]
    ) -> tuple[int, RunChildCounts]:
        """Point-read ``keys``, delete those present and lower the tombstone counter in one commit."""
        env = self.env_key
        tombstone_key = run_tombstone_key(env, run_id)
        reads = [tombstone_key, *keys]

        async def body(tx: StorageTransaction) -> tuple[int, RunChildCounts]:
            found = await tx.get(reads)
            await tx.now()
            record = found[0]
            if record is None:
                raise _Gone()
            tombstone = decode_run_tombstone(record)
            present: dict[str, StorageRecord] = {}
            for child in found[1:]:
                if child is not None and child.key.encoded not in present:
                    _check_child(kind, child, env, run_id)
                    present[child.key.encoded] = child
            if not present:
                return 0, tombstone.children
            remaining = getattr(tombstone.children, kind.counter) - len(present)
            if remaining < 0:
                raise _invariant(
                    f"Pruned run {run_id} has more {kind.counter} records than its tombstone counts "
                    f"({getattr(tombstone.children, kind.counter)}); cleanup stopped so no record is orphaned.",
                    run_id=run_id,
                    counter=kind.counter,
                )
            for child in present.values():
                tx.delete(child)
            children = _with_count(tombstone.children, kind.counter, remaining)
            tx.replace(record, run_tombstone_record(env, replace(tombstone, children=children)))
            return len(present), children

        return await self.driver.with_transaction(body)

    async def _finish(self, run_id: str) -> None:
        """Delete the run record and its tombstone once every counter is zero (and no child is indexed)."""
        env = self.env_key
        keys = [run_tombstone_key(env, run_id), run_key(env, run_id)]

        async def body(tx: StorageTransaction) -> None:
            record, run_record = await tx.get(keys)
            if record is None:
                await tx.now()
                return
            tombstone = decode_run_tombstone(record)
            counts = tombstone.children
            if any(getattr(counts, kind.counter) for kind in _CHILD_KINDS) or counts.links:
                await tx.now()
                return  # a concurrent change: the next pass continues
            for kind in _CHILD_KINDS:
                leftover = await tx.query_candidates(
                    StorageQuery(kind.index, (env, run_id), limit=1), mode=StorageCandidateMode.ADVISORY
                )
                if leftover.items:
                    raise _invariant(
                        f"Pruned run {run_id} still has a {kind.counter} record ({leftover.items[0].key!r}) although "
                        "its tombstone counts none; the run and tombstone are kept so nothing is orphaned.",
                        run_id=run_id,
                        counter=kind.counter,
                    )
            await tx.now()
            tx.delete(record)
            if run_record is not None:
                tx.delete(run_record)

        await self.driver.with_transaction(body)
