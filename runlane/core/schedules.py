"""Schedule materialization: fire-time math, deterministic identities, durable occurrence claims.

Schedules are definitions, occurrences are durable claims, runs are executable work. This module owns
the middle part and the pure timing rules in front of it:

* ``latest_due_fire_time`` - the one fire time a maintenance pass may materialize for a schedule
  (the latest one due at or before ``now``; missed boundaries are never backfilled);
* ``schedule_occurrence_id`` / ``scheduled_run_id`` - opaque hashed identities shared by every
  materializer, so concurrent maintenance processes race on the same durable records;
* ``ScheduleOccurrences`` - the occurrence table over a ``StorageDriver``:

  | collection             | key parts           | document                   |
  | ---------------------- | ------------------- | -------------------------- |
  | ``schedule_occurrences`` | env, occurrence_id | ``ScheduleOccurrence`` JSON |

  | ``schedule_latest_occurrences`` | env, schedule_id | ``{occurrence_id, fire_at}`` |

  | ``schedule_rotation`` | env | ``{next: {schedule set digest: next_schedule_id}}`` |

  A claimed occurrence has one ``SCHEDULE_OCCURRENCES_CLAIMED`` entry, partition ``(env,)`` and
  sort ``(claim_expires_at, occurrence_id)``; a completed occurrence has none. Each schedule keeps
  its latest completed occurrence (the latest record points at it); completing a later one deletes
  the one it supersedes, and an occurrence that completes once a later one is the latest is deleted
  as it completes, so a recurring schedule keeps one or two occurrence records, not one per fire
  time. The latest record is also the schedule's high-water mark: a fire time at or before it is
  never claimed again (a materializer whose clock is behind, or a changed definition, would
  otherwise reach a superseded fire time whose run may have been pruned). The rotation record says
  which schedule the next pass starts with, when a pass stopped at its limit (advisory: the last
  writer wins), per set of schedules: two applications with different schedules in one environment
  would otherwise keep handing each other a schedule id the other does not have, and each start
  every pass with its first schedules. A claim that expired on a fire time before its schedule's latest due one (its
  materializer died, and no pass looks at that fire time again) is settled by the pass: completed with
  the run it may have created, or with none.

* ``ScheduleMaterializer`` - claim, create or recover the scheduled run, complete. It takes the run
  creation and lookup as callables so it does not depend on the runtime.

Cron time zones
---------------

A cron expression is matched against the *wall clock* of its time zone (UTC when none is given). The
Schedules page asks for "the most recent matching fire time at or before the maintenance time", so a
fire time is an instant at which the zone's clock actually shows a matching wall time:

* a wall time skipped by a spring-forward transition never appears on the clock, so it does not fire
  that day (``30 2 * * *`` in America/New_York has no fire on the spring-forward day);
* a wall time repeated by a fall-back transition fires once, at its first occurrence, when the cron
  names fixed times (``30 1 * * *`` fires at 01:30 EDT, not again at 01:30 EST): every fire time is
  an occurrence identity, so firing it twice would create two runs for one logical daily slot;
* a cron whose minute or hour field is a wildcard (``*/15 * * * *``, ``0 * * * *``, ``* 1 * * *``)
  fires through the repeated hour like through any other, at both passes (Vixie cron's rule), so a
  quarter-hourly job does not pause for an hour when the clocks go back.

croniter's own handling of aware datetimes differs on both points (it shifts the skipped 02:30 to
03:00 and yields the repeated 01:30 twice), so croniter only enumerates *naive wall times* here and
this module maps them to instants with ``fold=0`` (the earlier instant) after dropping wall times the
zone skips, and to the later instant (``fold=1``) as well for wildcard crons. Use ``every=`` (elapsed
time, independent of time zones) for a strict cadence.

Only standard five-field expressions and the ``@yearly``/``@annually``/``@monthly``/``@weekly``/
``@daily``/``@midnight``/``@hourly`` macros are accepted: six- and seven-field forms disagree between
cron dialects on where the seconds field goes, and croniter's random (``R``) and hashed (``H``)
fields would give different processes different fire times.
"""

from __future__ import annotations

import hashlib
import logging
import re
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, tzinfo
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Final

from croniter import CroniterBadDateError, CroniterError, croniter
from pydantic import ValidationError

from ..errors import ErrorCode, RunlaneError, StorageConflictKind, create_storage_conflict_error, is_storage_conflict
from ..ids import validate_id
from ..json_values import canonical_json
from ..models import Environment, RunRecord, ScheduleOccurrence, environment_key
from ..storage import (
    NewStorageRecord,
    StorageDocument,
    StorageDriver,
    StorageIndexEntry,
    StorageIndexName,
    StorageQuery,
    StorageRange,
    StorageRecord,
    StorageRecordKey,
    StorageTransaction,
    decode_iso_date,
    encode_iso_date,
    encode_storage_tuple,
)
from ..storage.tables import corrupt_record, describe_problem, describe_record_key
from ..vocabulary import ScheduleOccurrenceStatus, ScheduleType
from .authoring import load_time_zone, schedule_payload

if TYPE_CHECKING:
    from .authoring import ScheduleDefinition, TaskDefinition

__all__ = [
    "SCHEDULE_LATEST_OCCURRENCES_COLLECTION",
    "SCHEDULE_OCCURRENCES_COLLECTION",
    "CreateScheduledRun",
    "GetRun",
    "ScheduleMaterializer",
    "ScheduleOccurrences",
    "latest_due_fire_time",
    "new_schedule_claim_token",
    "next_fire_time",
    "schedule_occurrence_id",
    "schedule_occurrence_key",
    "scheduled_run_id",
    "validate_cron",
]

_schedule_log = logging.getLogger("runlane.schedules")

SCHEDULE_OCCURRENCES_COLLECTION: Final = "schedule_occurrences"
SCHEDULE_LATEST_OCCURRENCES_COLLECTION: Final = "schedule_latest_occurrences"
SCHEDULE_ROTATION_COLLECTION: Final = "schedule_rotation"

UNIX_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)


def interval_anchor_name(starts_at: datetime | None) -> str:
    """What an interval schedule's fire times count from, for a message: ``starts_at``, or else the epoch."""
    return "starts_at" if starts_at is not None else "the Unix epoch, the anchor when starts_at is left out"

# 128 bits of SHA-256: collision-safe for any realistic number of occurrences (the birthday bound is
# about 2**64 ids) while keeping ids and the run ids derived from them short.
_HASH_HEX_CHARS: Final = 32
_OCCURRENCE_ID_PREFIX: Final = "occ_"
_SCHEDULED_RUN_ID_PREFIX: Final = "run_sched_"

_CRON_MACROS: Final = frozenset({"@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly"})
_CRON_FIELDS: Final = 5
# A standalone R/H token (croniter's random and hashed fields); names such as MAR or THU do not match.
_NONDETERMINISTIC_FIELD: Final = re.compile(r"(?<![A-Za-z])[HR](?![A-Za-z])", re.IGNORECASE)
# Candidates a cron search may reject before giving up: skipped wall times in a spring-forward gap and
# wall times past ``now`` during a fall-back repeat. A day-long gap of a once-a-minute cron is 1440.
_MAX_CRON_CANDIDATES: Final = 50_000
_ONE_MINUTE: Final = timedelta(minutes=1)
# What croniter raises when a search runs out: its search window, or the calendar's first or last year
# (``ValueError: year 10000 is out of range``, for a cron whose later matches all fall in daylight-saving
# gaps, or a clock near the year 9999).
_CRON_SEARCH_ENDS: Final = (CroniterBadDateError, ValueError, OverflowError)


# ---------------------------------------------------------------------------------------------
# Timing


def _invalid(message: str, **meta: Any) -> RunlaneError:
    details = {key: value for key, value in meta.items() if value is not None}
    return RunlaneError(ErrorCode.CONFIGURATION_INVALID, message, meta=details)


def _aware(value: object, what: str) -> datetime:
    if not isinstance(value, datetime) or value.tzinfo is None or value.utcoffset() is None:
        raise _invalid(f"{what} must be a timezone-aware datetime, got {value!r}; attach a tzinfo such as UTC.")
    return value if value.tzinfo is UTC else value.astimezone(UTC)


def validate_cron(expression: object, *, schedule_id: str | None = None) -> str:
    """Return the normalized expression, or raise ``RunlaneError(configuration_invalid)`` saying what to fix.

    Accepts five fields (minute hour day-of-month month day-of-week, with ranges, steps, lists, month
    and weekday names, ``L`` and ``#``) or one of the ``@yearly``..``@hourly`` macros. An expression
    that can never match (``0 0 30 2 *``) is rejected too, and so is an nth weekday (``MON#1``) beside a
    day of month other than ``*`` or ``?``.
    """
    owner = "Cron expression" if schedule_id is None else f"Schedule {schedule_id!r}: cron expression"
    if not isinstance(expression, str) or not expression.strip():
        raise _invalid(
            f"{owner} must be a non-empty string such as '0 9 * * *'.", field="cron", schedule_id=schedule_id
        )
    normalized = " ".join(expression.split())
    checked, problem = _checked_cron(normalized)
    if problem is not None:
        raise _invalid(f"{owner} {normalized!r} {problem}", field="cron", schedule_id=schedule_id)
    return checked


# Every tick checks the cron of every schedule again: each distinct expression is checked once (keyed by
# the expression alone, so any number of schedules sharing a few expressions stay cached).
@lru_cache(maxsize=4096)
def _checked_cron(normalized: str) -> tuple[str, str | None]:
    """``(normalized expression, None)``, or ``("", what is wrong)`` to follow the expression in a message."""
    example = "'0 9 * * *' (09:00 daily) or '*/15 * * * *' (every 15 minutes)"
    if normalized.startswith("@"):
        if normalized.lower() not in _CRON_MACROS:
            macros = ", ".join(sorted(_CRON_MACROS))
            return "", f"is not supported; use one of {macros} or five fields such as {example}."
        return normalized.lower(), None
    fields = normalized.split(" ")
    if len(fields) != _CRON_FIELDS:
        return "", (
            f"has {len(fields)} field(s); write exactly five (minute hour day-of-month month day-of-week), such "
            f"as {example}. Seconds and year fields are not supported."
        )
    if any(_NONDETERMINISTIC_FIELD.search(item) for item in fields):
        return "", (
            "uses a random (R) or hashed (H) field; every process must compute the same fire times, so write "
            "explicit values instead."
        )
    if "#" in fields[4] and fields[2] not in ("*", "?"):
        # Cron fires on a day matching either day field when both are set; croniter gets that wrong for an
        # nth weekday (it skips days of the month, or finds no date at all), so the pair is refused.
        return "", (
            f"sets both a day of month ({fields[2]!r}) and an nth weekday ({fields[4]!r}), which is not supported; "
            "write '*' as the day of month, and use a second schedule for the days of the month."
        )
    try:
        iterator = croniter(normalized, datetime(2000, 1, 1), ret_type=datetime)
    except (CroniterError, ValueError, TypeError, KeyError) as error:
        return "", (
            f"is not valid cron syntax ({error}); fields are minute (0-59), hour (0-23), day of month (1-31), "
            f"month (1-12 or JAN-DEC) and day of week (0-6 or SUN-SAT), such as {example}."
        )
    try:
        iterator.get_next(datetime)
    except (CroniterBadDateError, CroniterError) as error:
        return "", f"never matches a real date ({error}); check the day-of-month and month fields."
    return normalized, None


def _zone(name: str | None) -> tzinfo:
    return UTC if name is None else load_time_zone(name)


def latest_due_fire_time(definition: ScheduleDefinition, now: datetime) -> datetime | None:
    """The latest fire time of ``definition`` at or before ``now`` (aware UTC), or ``None`` when none is due.

    * once: ``run_at`` once it is due, however late;
    * interval: the latest ``anchor + k * every`` at or before ``now`` (and at or before ``ends_at``),
      with ``anchor`` = ``starts_at`` or the Unix epoch and ``k >= 0``;
    * cron: the latest instant at which the zone's wall clock showed a matching time (see the module
      docstring for daylight-saving transitions).
    """
    now = _aware(now, "now")
    kind = definition.type
    if kind is ScheduleType.ONCE:
        run_at = _aware(definition.run_at, f"run_at of schedule {definition.id!r}")
        return run_at if run_at <= now else None
    if kind is ScheduleType.INTERVAL:
        return _latest_interval_boundary(definition, now)
    if kind is ScheduleType.CRON:
        expression = validate_cron(definition.cron, schedule_id=definition.id)
        return _latest_cron_fire(expression, _zone(definition.time_zone), now)
    raise _invalid(f"Schedule {definition.id!r} has unknown type {kind!r}.", schedule_id=definition.id)


def next_fire_time(definition: ScheduleDefinition, after: datetime) -> datetime | None:
    """The earliest fire time of ``definition`` strictly after ``after`` (aware UTC), or ``None`` when it
    will not fire again: the fire time ``latest_due_fire_time`` first returns once it is due.

    * once: ``run_at`` while it is still ahead;
    * interval: the first ``anchor + k * every`` after ``after`` (``k >= 0``, anchored as for
      ``latest_due_fire_time``), unless it is past ``ends_at``;
    * cron: the first instant after ``after`` at which the zone's wall clock shows a matching time, with
      the same daylight-saving rules (see the module docstring).

    It knows nothing of what was materialized: a fire time at or before a schedule's high-water mark (see
    ``ScheduleOccurrences``) is never materialized, so the next fire time that will create a run is the
    first one after the later of ``after`` and that mark.
    """
    after = _aware(after, "after")
    kind = definition.type
    if kind is ScheduleType.ONCE:
        run_at = _aware(definition.run_at, f"run_at of schedule {definition.id!r}")
        return run_at if run_at > after else None
    if kind is ScheduleType.INTERVAL:
        return _next_interval_boundary(definition, after)
    if kind is ScheduleType.CRON:
        expression = validate_cron(definition.cron, schedule_id=definition.id)
        return _next_cron_fire(expression, _zone(definition.time_zone), after)
    raise _invalid(f"Schedule {definition.id!r} has unknown type {kind!r}.", schedule_id=definition.id)


def _interval_bounds(definition: ScheduleDefinition) -> tuple[datetime, timedelta, datetime | None]:
    """An interval schedule's ``(anchor, every, ends_at)``, checked."""
    every_ms = definition.every_ms
    if isinstance(every_ms, bool) or not isinstance(every_ms, int) or every_ms < 1:
        raise _invalid(f"Schedule {definition.id!r}: every must be a positive duration.", schedule_id=definition.id)
    anchor = UNIX_EPOCH
    if definition.starts_at is not None:
        anchor = _aware(definition.starts_at, f"starts_at of schedule {definition.id!r}")
    ends_at = None
    if definition.ends_at is not None:
        ends_at = _aware(definition.ends_at, f"ends_at of schedule {definition.id!r}")
        if ends_at < anchor:
            raise _invalid(
                f"Schedule {definition.id!r}: ends_at must not be earlier than "
                f"{interval_anchor_name(definition.starts_at)}.",
                field="ends_at",
                schedule_id=definition.id,
            )
    return anchor, timedelta(milliseconds=every_ms), ends_at


def _latest_interval_boundary(definition: ScheduleDefinition, now: datetime) -> datetime | None:
    anchor, every, ends_at = _interval_bounds(definition)
    horizon = now if ends_at is None else min(now, ends_at)
    if horizon < anchor:
        return None
    # timedelta // timedelta is exact integer floor division (microsecond resolution).
    return anchor + every * ((horizon - anchor) // every)


def _next_interval_boundary(definition: ScheduleDefinition, after: datetime) -> datetime | None:
    anchor, every, ends_at = _interval_bounds(definition)
    try:
        boundary = anchor if after < anchor else anchor + every * ((after - anchor) // every + 1)
    except OverflowError:
        return None  # past the year 9999: it never fires again
    return None if ends_at is not None and boundary > ends_at else boundary


# The macros as five fields, for ``_fires_through_repeated_hours``.
_MACRO_FIELDS: Final = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}


def _fires_through_repeated_hours(expression: str) -> bool:
    """Whether the expression's minute or hour field is a wildcard (``*``, ``*/15``): such a cron fires
    through the repeated hour of a fall-back transition as through any other hour, while one at fixed
    times fires once, at the first occurrence of its wall time (the rule of Vixie cron)."""
    minute, hour = _MACRO_FIELDS.get(expression, expression).split()[:2]
    return minute.startswith("*") or hour.startswith("*")


def _latest_cron_fire(expression: str, zone: tzinfo, now: datetime) -> datetime | None:
    # Fire times are whole minutes (time zones are whole minutes off UTC), so every ``now`` within one
    # UTC minute has the same answer: ticks, which look at every schedule, search once per minute.
    return _latest_cron_fire_in_minute(expression, zone, now.replace(second=0, microsecond=0))


@lru_cache(maxsize=8192)
def _latest_cron_fire_in_minute(expression: str, zone: tzinfo, now: datetime) -> datetime | None:
    local_now = now.astimezone(zone)
    wall = local_now.replace(tzinfo=None)
    both_passes = _fires_through_repeated_hours(expression)
    if local_now.fold:
        # The second pass through a repeated wall-clock hour: every first-pass (fold=0) wall time in it,
        # up to the end of the repeat, is already in the past. Searching from ``wall + shift`` covers
        # them; candidates past ``now`` are rejected below.
        first = local_now.replace(fold=0).utcoffset()
        second = local_now.utcoffset()
        if first is not None and second is not None and first > second:
            wall += first - second
    # croniter's get_prev is strictly before its start; start one minute after the floored wall time so
    # a fire time equal to ``now`` (cron resolution is one minute) is included.
    start = wall.replace(second=0, microsecond=0) + _ONE_MINUTE
    iterator = croniter(expression, start, ret_type=datetime)
    # Wall times come latest first, and each pass maps them to instants in the same order, but in a
    # repeated hour a later wall time's first pass can precede an earlier one's second pass (01:45 EDT
    # is before 01:15 EST). So with both passes, the first first-pass instant that is due is kept
    # until the first due second-pass instant, and the later of the two wins.
    first_pass: datetime | None = None
    for _ in range(_MAX_CRON_CANDIDATES):
        try:
            candidate: datetime = iterator.get_prev(datetime)
        except _CRON_SEARCH_ENDS:
            return first_pass  # nothing (else) matched within croniter's search window or after the year 1
        instant = candidate.replace(tzinfo=zone, fold=0).astimezone(UTC)
        if instant.astimezone(zone).replace(tzinfo=None) != candidate:
            continue  # skipped by a spring-forward transition: this wall time never happened
        if both_passes:
            again = candidate.replace(tzinfo=zone, fold=1).astimezone(UTC)  # its second pass, if repeated
            if again <= now:
                return again if first_pass is None else max(first_pass, again)
            if first_pass is None and instant <= now:
                first_pass = instant
            continue
        if instant <= now:
            return instant
    raise RunlaneError(
        ErrorCode.INVARIANT_VIOLATION,
        f"Cron expression {expression!r} produced {_MAX_CRON_CANDIDATES} wall times that are not due; giving up.",
    )


def _next_cron_fire(expression: str, zone: tzinfo, after: datetime) -> datetime | None:
    local_after = after.astimezone(zone)
    wall = local_after.replace(tzinfo=None)
    both_passes = _fires_through_repeated_hours(expression)
    # When ``after`` is in the first pass through a repeated wall-clock hour, the second pass of a wall
    # time earlier in that hour is still ahead (with a wildcard minute or hour field it fires then), so
    # the search starts that much earlier on the wall clock; instants not after ``after`` are rejected.
    first = local_after.replace(fold=0).utcoffset()
    second = local_after.replace(fold=1).utcoffset()
    if first is not None and second is not None and first > second:
        wall -= first - second
    # croniter's get_next is strictly after its start.
    start = wall.replace(second=0, microsecond=0) - _ONE_MINUTE
    iterator = croniter(expression, start, ret_type=datetime)
    # Wall times come earliest first and their first-pass instants in the same order, but in a repeated
    # hour an earlier wall time's second pass can follow a later one's first pass (01:15 EST is after
    # 01:45 EDT): the earliest instant found is kept until a first pass comes after it.
    best: datetime | None = None
    for _ in range(_MAX_CRON_CANDIDATES):
        try:
            candidate: datetime = iterator.get_next(datetime)
        except _CRON_SEARCH_ENDS:
            return best  # nothing (else) matches within croniter's search window or before the year 9999 ends
        instant = candidate.replace(tzinfo=zone, fold=0).astimezone(UTC)
        if instant.astimezone(zone).replace(tzinfo=None) != candidate:
            continue  # skipped by a spring-forward transition: this wall time never happens
        if best is not None and instant >= best:
            return best
        if instant > after:
            return instant  # the earliest first pass ahead, and no second pass before it is (checked above)
        if both_passes:
            again = candidate.replace(tzinfo=zone, fold=1).astimezone(UTC)  # its second pass, if repeated
            if again > after and (best is None or again < best):
                best = again
    raise RunlaneError(
        ErrorCode.INVARIANT_VIOLATION,
        f"Cron expression {expression!r} produced {_MAX_CRON_CANDIDATES} wall times that are not ahead; giving up.",
    )


# ---------------------------------------------------------------------------------------------
# Identities


def _digest(value: list[str]) -> str:
    return hashlib.sha256(canonical_json(value).encode("utf-8")).hexdigest()[:_HASH_HEX_CHARS]


def schedule_occurrence_id(environment: Environment, schedule_id: str, fire_at: datetime) -> str:
    """The deterministic occurrence id of ``environment + schedule_id + fire_at``: ``occ_`` + 32 hex digits.

    Opaque: it hashes ``[environment key, schedule id, fire time as canonical ISO UTC]``; never parse it.
    """
    schedule_id = validate_id(schedule_id, "schedule id")
    fire_iso = encode_iso_date(_aware(fire_at, "fire_at"))
    return _OCCURRENCE_ID_PREFIX + _digest([environment_key(environment), schedule_id, fire_iso])


def scheduled_run_id(occurrence_id: str) -> str:
    """The run id every materializer uses for an occurrence: ``run_sched_`` + 32 hex digits (opaque)."""
    occurrence_id = validate_id(occurrence_id, "occurrence id")
    return _SCHEDULED_RUN_ID_PREFIX + _digest(["scheduled_run", occurrence_id])


def new_schedule_claim_token() -> str:
    """A fresh occurrence claim token; draw it before the claim transaction, never inside it."""
    return f"occlaim_{uuid.uuid4().hex}"


def schedule_occurrence_key(env_key: str, occurrence_id: str) -> StorageRecordKey:
    return StorageRecordKey(SCHEDULE_OCCURRENCES_COLLECTION, env_key, occurrence_id)


def _latest_key(env_key: str, schedule_id: str) -> StorageRecordKey:
    return StorageRecordKey(SCHEDULE_LATEST_OCCURRENCES_COLLECTION, env_key, schedule_id)


# ---------------------------------------------------------------------------------------------
# The occurrence table


def _occurrence_conflict(occurrence_id: str, why: str) -> RunlaneError:
    return create_storage_conflict_error(
        StorageConflictKind.SCHEDULE_OCCURRENCE,
        f"Schedule occurrence {occurrence_id} is not owned by this claim: {why}. Another materializer owns it now; "
        "skip it.",
        meta={"occurrence_id": occurrence_id},
    )


# How many schedule sets the rotation record keeps a position for: the applications sharing an
# environment, and the sets earlier releases registered, which age out.
_MAX_ROTATION_SETS: Final = 8


def schedule_set_digest(schedule_ids: Sequence[str]) -> str:
    """Names a set of schedule ids in the rotation record (the same for every replica of a release)."""
    joined = "\n".join(sorted(set(schedule_ids))).encode("utf-8", "surrogatepass")
    return hashlib.sha256(joined).hexdigest()[:32]


def _rotation_positions(value: dict[str, Any]) -> dict[str, str]:
    positions = value.get("next")
    if not isinstance(positions, dict):
        return {}
    return {digest: item for digest, item in positions.items() if isinstance(digest, str) and isinstance(item, str)}


class ScheduleOccurrences:
    """The durable occurrence claims of one environment over a ``StorageDriver``.

    Claim tokens and ids are prepared by the caller: transaction callbacks stay pure and replayable.
    """

    def __init__(self, driver: StorageDriver, environment: Environment) -> None:
        self.driver = driver
        self.environment = environment
        self.env_key = environment_key(environment)
        self._rotation_unreadable = False

    def __repr__(self) -> str:
        driver = getattr(self.driver, "name", self.driver)
        return f"ScheduleOccurrences(driver={driver!r}, environment={self.env_key!r})"

    def _key(self, occurrence_id: str) -> StorageRecordKey:
        return schedule_occurrence_key(self.env_key, occurrence_id)

    def _decode(self, record: StorageRecord) -> ScheduleOccurrence:
        try:
            occurrence = ScheduleOccurrence.model_validate(record.document.value)
        except ValidationError as error:
            raise corrupt_record("schedule occurrence", record.key, describe_problem(error), error) from None
        if occurrence.id != record.key.parts[-1] or environment_key(occurrence.environment) != record.key.parts[0]:
            raise corrupt_record("schedule occurrence", record.key, "its id or environment does not match its key")
        if (occurrence.status is ScheduleOccurrenceStatus.CLAIMED) != (occurrence.claim_expires_at is not None):
            raise corrupt_record("schedule occurrence", record.key, "its status and claim expiry disagree")
        return occurrence

    def _record(self, occurrence: ScheduleOccurrence) -> NewStorageRecord:
        indexes: tuple[StorageIndexEntry, ...] = ()
        if occurrence.status is ScheduleOccurrenceStatus.CLAIMED and occurrence.claim_expires_at is not None:
            indexes = (
                StorageIndexEntry(
                    StorageIndexName.SCHEDULE_OCCURRENCES_CLAIMED,
                    (self.env_key,),
                    (encode_iso_date(occurrence.claim_expires_at), occurrence.id),
                ),
            )
        document = StorageDocument.encode(occurrence.model_dump(mode="json"))
        return NewStorageRecord(self._key(occurrence.id), document, indexes)

    # -- reads -----------------------------------------------------------------------------------

    async def get(self, occurrence_id: str) -> ScheduleOccurrence | None:
        (record,) = await self.driver.get([self._key(occurrence_id)])
        return None if record is None else self._decode(record)

    async def get_many(self, occurrence_ids: Sequence[str]) -> list[ScheduleOccurrence | RunlaneError | None]:
        """Occurrences in request order, read in point-read-limit chunks: ``None`` for an absent one, the
        ``invariant_violation`` of one that does not decode (its neighbours are still read)."""
        size = self.driver.profile.limits.max_point_reads
        found: list[ScheduleOccurrence | RunlaneError | None] = []
        for start in range(0, len(occurrence_ids), size):
            keys = [self._key(item) for item in occurrence_ids[start : start + size]]
            found.extend(None if record is None else self._try_decode(record) for record in await self.driver.get(keys))
        return found

    async def latest_fire_times(self, schedule_ids: Sequence[str]) -> list[datetime | RunlaneError | None]:
        """The latest materialized fire time of each schedule (its high-water mark), in request order, read
        in point-read-limit chunks: ``None`` for a schedule that has not fired in this environment, the
        ``invariant_violation`` of a record that does not decode (its neighbours are still read)."""
        return [item[1] if isinstance(item, tuple) else item for item in await self.latest_fires(schedule_ids)]

    async def latest_fires(self, schedule_ids: Sequence[str]) -> list[tuple[str, datetime] | RunlaneError | None]:
        """As ``latest_fire_times``, each fire time with the id of its occurrence (``get_many`` reads the
        runs it created: none when an active run held the task's singleton key at that fire time)."""
        size = self.driver.profile.limits.max_point_reads
        found: list[tuple[str, datetime] | RunlaneError | None] = []
        for start in range(0, len(schedule_ids), size):
            keys = [_latest_key(self.env_key, item) for item in schedule_ids[start : start + size]]
            found.extend(None if record is None else self._try_latest(record) for record in await self.driver.get(keys))
        return found

    async def expired_claims(
        self, now: datetime, limit: int, *, after: str | None = None
    ) -> tuple[list[ScheduleOccurrence | RunlaneError], str | None]:
        """Claimed occurrences whose claim expired before ``now``, at most ``limit``, the longest expired
        first (after the ``after`` position when given); the ``invariant_violation`` of one that does not
        decode (its neighbours are still read). Also the position to read on from when there may be more
        (``None`` when this page ended them)."""
        upper = encode_storage_tuple((encode_iso_date(now),))
        size = min(limit, self.driver.profile.limits.max_query_results)
        index = StorageIndexName.SCHEDULE_OCCURRENCES_CLAIMED
        scanned = StorageRange(lt=upper) if after is None else StorageRange(gt=after, lt=upper)
        page = await self.driver.query(StorageQuery(index, (self.env_key,), scanned, limit=size))
        found = await self.get_many([item.key.parts[-1] for item in page.items])
        following = encode_storage_tuple(page.items[-1].sort) if len(page.items) == size else None
        return [occurrence for occurrence in found if occurrence is not None], following  # None: deleted since

    def _try_latest(self, record: StorageRecord) -> tuple[str, datetime] | RunlaneError:
        try:
            return self._decode_latest(record)
        except RunlaneError as error:
            return error

    def _try_decode(self, record: StorageRecord) -> ScheduleOccurrence | RunlaneError:
        try:
            return self._decode(record)
        except RunlaneError as error:
            return error

    # -- the rotation -----------------------------------------------------------------------------

    def _rotation_key(self) -> StorageRecordKey:
        return StorageRecordKey(SCHEDULE_ROTATION_COLLECTION, self.env_key)

    async def rotation_start(self, schedule_set: str = "") -> str | None:
        """The id of the schedule the next pass over ``schedule_set`` (``schedule_set_digest``) starts
        with, saved by a pass over that set that stopped at its limit. Advisory: a record without one
        reads as none (the next pass that stops at its limit rewrites it), and so does one the driver
        cannot read at all (logged once: delete it to save the rotation again)."""
        key = self._rotation_key()
        try:
            (record,) = await self.driver.get([key])
        except RunlaneError as error:
            if error.code is not ErrorCode.INVARIANT_VIOLATION:
                raise
            if self._rotation_unreadable:
                return None
            self._rotation_unreadable = True  # logged once per process, not every pass
            _schedule_log.warning(
                "The schedule rotation record %s cannot be read (%s); passes start with the first schedule "
                "until it is deleted, so schedules past the materialization limit may wait.",
                describe_record_key(key), error.message, extra={"error_code": error.code.value},
            )  # fmt: skip
            return None
        value = None if record is None else record.document.value
        if not isinstance(value, dict):
            return None
        schedule_id = _rotation_positions(value).get(schedule_set, value.get("next_schedule_id"))
        return schedule_id if isinstance(schedule_id, str) else None

    async def save_rotation_start(self, schedule_id: str, schedule_set: str = "") -> None:
        key = self._rotation_key()

        async def body(tx: StorageTransaction) -> None:
            (record,) = await tx.get([key])
            value = None if record is None else record.document.value
            positions = _rotation_positions(value) if isinstance(value, dict) else {}
            positions.pop(schedule_set, None)
            positions[schedule_set] = schedule_id  # the latest last: the oldest sets are dropped first
            kept = dict(list(positions.items())[-_MAX_ROTATION_SETS:])
            document = StorageDocument.encode({"next": kept})
            if record is None:
                tx.create(NewStorageRecord(key, document))
            else:
                tx.replace(record, NewStorageRecord(key, document))

        await self.driver.with_transaction(body)

    # -- writes ----------------------------------------------------------------------------------

    async def claim(
        self,
        schedule_id: str,
        task_id: str,
        fire_at: datetime,
        *,
        claim_token: str,
        worker_id: str,
        claim_duration_ms: int,
    ) -> ScheduleOccurrence | None:
        """Claim the occurrence of ``schedule_id`` at ``fire_at`` in one transaction.

        Creates it as claimed when absent; takes it over (with ``claim_token``) when its claim has
        expired; returns it unchanged when ``claim_token`` already holds it. Returns ``None`` when it is
        completed or another live claim holds it.
        """
        schedule_id = validate_id(schedule_id, "schedule id")
        task_id = validate_id(task_id, "task id")
        worker_id = validate_id(worker_id, "worker id")
        fire_at = _aware(fire_at, "fire_at")
        if not isinstance(claim_token, str) or not claim_token:
            raise _invalid("A schedule occurrence claim token must be a non-empty string.", field="claim_token")
        if isinstance(claim_duration_ms, bool) or not isinstance(claim_duration_ms, int) or claim_duration_ms < 1:
            raise _invalid(
                f"claim_duration_ms must be a positive whole number of milliseconds, got {claim_duration_ms!r}.",
                field="claim_duration_ms",
            )
        occurrence_id = schedule_occurrence_id(self.environment, schedule_id, fire_at)
        key = self._key(occurrence_id)
        claim_for = timedelta(milliseconds=claim_duration_ms)

        latest_key = _latest_key(self.env_key, schedule_id)

        async def body(tx: StorageTransaction) -> ScheduleOccurrence | None:
            record, latest = await tx.get([key, latest_key])
            now = _aware(await tx.now(), "storage time")
            if record is None and latest is not None and self._decode_latest(latest)[1] >= fire_at:
                # A fire time at or before the schedule's latest completed one: its record was deleted
                # when a later one completed, and it already ran (its run may be pruned since). A
                # materializer whose clock is behind, or a changed definition, never runs it again.
                return None
            if record is None:
                occurrence = ScheduleOccurrence(
                    id=occurrence_id,
                    environment=self.environment,
                    schedule_id=schedule_id,
                    task_id=task_id,
                    fire_at=fire_at,
                    status=ScheduleOccurrenceStatus.CLAIMED,
                    claim_token=claim_token,
                    claimed_by=worker_id,
                    claim_expires_at=now + claim_for,
                    created_at=now,
                    updated_at=now,
                )
                tx.create(self._record(occurrence))
                return occurrence
            current = self._decode(record)
            if current.schedule_id != schedule_id or current.fire_at != fire_at:
                raise RunlaneError(
                    ErrorCode.INVARIANT_VIOLATION,
                    f"Schedule occurrence {occurrence_id} belongs to schedule {current.schedule_id!r} at "
                    f"{encode_iso_date(current.fire_at)}, not {schedule_id!r} at {encode_iso_date(fire_at)}.",
                    meta={"occurrence_id": occurrence_id},
                )
            if current.status is ScheduleOccurrenceStatus.COMPLETED:
                return None
            expires_at = current.claim_expires_at
            live = expires_at is not None and expires_at > now
            if live:
                return current if current.claim_token == claim_token else None
            taken = ScheduleOccurrence.model_validate(
                {
                    **current.model_dump(),
                    "claim_token": claim_token,
                    "claimed_by": worker_id,
                    "claim_expires_at": now + claim_for,
                    "updated_at": now,
                }
            )
            tx.replace(record, self._record(taken))
            return taken

        return await self.driver.with_transaction(body)

    async def complete(self, occurrence_id: str, claim_token: str, run_ids: Sequence[str]) -> ScheduleOccurrence:
        """Mark a claimed occurrence completed with the runs it produced, fenced by ``claim_token``.

        Raises ``storage_conflict`` (``schedule_occurrence``) when the occurrence is missing, another
        claim took it over, or it was completed with other runs. Completing again with the same token
        and run ids returns the completed occurrence (a retried call after an uncertain commit),
        except for an occurrence older than its schedule's latest: its record is deleted as it
        completes, so a retried call finds none. An expired claim that nobody took over can still
        complete.
        """
        if not isinstance(claim_token, str) or not claim_token:
            raise _invalid("A schedule occurrence claim token must be a non-empty string.", field="claim_token")
        if isinstance(run_ids, str):
            raise _invalid("run_ids must be a sequence of run ids, not one string.", field="run_ids")
        produced = [validate_id(run_id, "run id") for run_id in run_ids]
        key = self._key(occurrence_id)

        async def body(tx: StorageTransaction) -> ScheduleOccurrence:
            (record,) = await tx.get([key])
            if record is None:
                raise _occurrence_conflict(occurrence_id, "it does not exist")
            current = self._decode(record)
            if current.claim_token != claim_token:
                raise _occurrence_conflict(occurrence_id, "its claim token changed")
            if current.status is ScheduleOccurrenceStatus.COMPLETED:
                if current.run_ids == produced:
                    return current
                raise _occurrence_conflict(occurrence_id, "it was already completed with other runs")
            supersede = await self._superseding(tx, current)
            now = _aware(await tx.now(), "storage time")
            completed = ScheduleOccurrence.model_validate(
                {
                    **current.model_dump(),
                    "status": ScheduleOccurrenceStatus.COMPLETED,
                    "claim_expires_at": None,
                    "run_ids": produced,
                    "updated_at": now,
                    "completed_at": now,
                }
            )
            if supersede is None:
                # Older than the schedule's latest: that high-water mark keeps its fire time from being
                # claimed again, and nothing would ever delete its record.
                tx.delete(record)
                return completed
            tx.replace(record, self._record(completed))
            supersede()
            return completed

        return await self.driver.with_transaction(body)

    async def _superseding(
        self, tx: StorageTransaction, occurrence: ScheduleOccurrence
    ) -> Callable[[], None] | None:
        """Read what completing ``occurrence`` supersedes; the returned function stages the writes
        (after the transaction's reads): ``occurrence`` becomes its schedule's latest, and the completed
        occurrence it replaces as the latest is deleted. ``None`` for an occurrence older than the latest
        (its materializer's clock was behind, or its pass straddled a fire time while another one
        completed the next): it supersedes nothing, and its own record is not kept."""
        key = _latest_key(self.env_key, occurrence.schedule_id)
        (record,) = await tx.get([key])
        previous: StorageRecord | None = None
        if record is not None:
            previous_id, previous_fire_at = self._decode_latest(record)
            if previous_fire_at > occurrence.fire_at:
                return None
            if previous_fire_at == occurrence.fire_at:
                return lambda: None
            (previous,) = await tx.get([self._key(previous_id)])
            if previous is not None:
                old = self._decode(previous)
                if old.status is not ScheduleOccurrenceStatus.COMPLETED or old.fire_at >= occurrence.fire_at:
                    previous = None
        latest = {"occurrence_id": occurrence.id, "fire_at": encode_iso_date(occurrence.fire_at)}
        document = StorageDocument.encode(latest)

        def stage() -> None:
            if previous is not None:
                tx.delete(previous)
            if record is None:
                tx.create(NewStorageRecord(key, document))
            else:
                tx.replace(record, NewStorageRecord(key, document))

        return stage

    def _decode_latest(self, record: StorageRecord) -> tuple[str, datetime]:
        value = record.document.value
        try:
            occurrence_id, fire_at = value["occurrence_id"], value["fire_at"]
            if not isinstance(occurrence_id, str) or not occurrence_id:
                raise ValueError("no occurrence id")
            fire = decode_iso_date(fire_at)
        except (KeyError, TypeError, ValueError, RunlaneError) as error:
            problem = error.message.rstrip(".") if isinstance(error, RunlaneError) else describe_problem(error)
            raise corrupt_record("latest schedule occurrence", record.key, problem, error) from None
        return occurrence_id, fire


# ---------------------------------------------------------------------------------------------
# Materialization

CreateScheduledRun = Callable[["ScheduleDefinition", "TaskDefinition", ScheduleOccurrence, str], Awaitable[RunRecord]]
"""``create_run(schedule, task, occurrence, run_id)``: create the scheduled run with exactly ``run_id``."""

GetRun = Callable[[str], Awaitable[RunRecord | None]]


@dataclass(frozen=True, slots=True)
class _Due:
    schedule: ScheduleDefinition
    task: TaskDefinition
    fire_at: datetime | None = None
    occurrence_id: str | None = None
    error: RunlaneError | None = None


class ScheduleMaterializer:
    """Turns due schedule occurrences into runs, safely under concurrent maintenance processes.

    ``new_claim_token`` draws claim tokens (outside any transaction); tests may pass a deterministic one.
    """

    def __init__(
        self,
        driver: StorageDriver,
        environment: Environment,
        *,
        new_claim_token: Callable[[], str] = new_schedule_claim_token,
    ) -> None:
        self.occurrences = ScheduleOccurrences(driver, environment)
        self.environment = environment
        self._new_claim_token = new_claim_token
        # Where the next pass reads on among the expired claims (``_settle_stale_claims``): claims it must
        # leave alone (another runtime's, a disabled schedule's) sort first for ever, and a pass that always
        # read from the start would never get past them.
        self._stale_claims_after: str | None = None

    def __repr__(self) -> str:
        return f"ScheduleMaterializer({self.occurrences!r})"

    async def materialize_due(
        self,
        schedules: Sequence[tuple[ScheduleDefinition, TaskDefinition]],
        now: datetime,
        *,
        limit: int,
        create_run: CreateScheduledRun,
        get_run: GetRun,
        worker_id: str,
        claim_duration_ms: int,
    ) -> int:
        """Materialize the latest due occurrence of each enabled schedule, in order; returns how many.

        Stops after ``limit`` materialized occurrences. Per schedule: compute the latest due fire time,
        skip it when its occurrence is already completed or held by a live claim (one batched read per
        chunk of schedules), validate the static payload and resolve the task's singleton and
        concurrency keys (so a bad definition never consumes a claim), claim, reuse the derived run
        when it already exists (a crashed earlier claim), else ``create_run``, then complete the
        occurrence with the run id.

        Each occurrence is durable on its own, not the set of schedules: when one fails (a bad definition,
        a corrupt stored occurrence, storage unavailable), the occurrences materialized before it stay,
        and the pass stops there and raises the error, naming the schedule; the schedules after it get
        their turn in the next pass, once the failure is fixed. A completion that lost its claim to
        another materializer (the claim expired mid-way) is not an error and is not counted: the run
        exists under the derived id and the new owner completes the occurrence.

        An occurrence whose run ``create_run`` refuses with a ``singleton_key`` conflict (an active run
        holds the task's singleton key) is not counted. A recurring schedule's occurrence is completed
        without a run: recurring work never overlaps, and its next fire time materializes normally. A
        one-off (``run_at``) occurrence is left to its claim, so a pass after the claim expires tries it
        again: its only fire time is not lost.

        A pass that stops at ``limit`` saves the schedule after the last one it looked at in storage, and
        the next pass (of any materializer: a maintenance process started anew for each pass, too)
        starts with it, so every schedule gets its turn.
        """
        now = _aware(now, "now")
        worker_id = validate_id(worker_id, "worker id")
        if isinstance(limit, bool) or not isinstance(limit, int):
            raise _invalid(f"limit must be a whole number, got {limit!r}.", field="limit")
        if limit < 1:
            return 0
        ordered = [(item, task) for item, task in schedules if item.enabled]
        first = 0
        schedule_set = schedule_set_digest([item.id for item, _ in ordered])
        if len(ordered) > limit:  # only then can a pass stop before the last schedule
            starting = await self.occurrences.rotation_start(schedule_set)
            first = next((index for index, (item, _) in enumerate(ordered) if item.id == starting), 0)
        # One-off fire times first: one that met a singleton conflict is tried again when its claim
        # expires, and a recurring schedule of the same task, handled first, would take the key anew
        # in that very pass every time its fire times line up with the retries.
        enabled = sorted(ordered[first:] + ordered[:first], key=lambda pair: pair[0].run_at is None)
        position = {item.id: index for index, (item, _) in enumerate(ordered)}
        chunk = max(1, self.occurrences.driver.profile.limits.max_point_reads)
        materialized = 0
        for start in range(0, len(enabled), chunk):
            window = [self._due(item, task, now) for item, task in enabled[start : start + chunk]]
            ids = [due.occurrence_id for due in window if due.occurrence_id is not None]
            known = dict(zip(ids, await self.occurrences.get_many(ids)))
            for due in window:
                try:
                    if due.error is not None:
                        raise due.error
                    if due.occurrence_id is None or due.fire_at is None:
                        continue
                    current = known.get(due.occurrence_id)
                    if isinstance(current, RunlaneError):
                        raise current
                    if current is not None and _settled(current, now):
                        continue
                    if not await self._materialize(due, create_run, get_run, worker_id, claim_duration_ms):
                        continue
                except RunlaneError as error:
                    if error.retryable:
                        raise
                    raise _schedule_failed(due.schedule, error) from None
                materialized += 1
                if materialized >= limit:
                    following = ordered[(position[due.schedule.id] + 1) % len(ordered)][0]
                    try:
                        await self.occurrences.save_rotation_start(following.id, schedule_set)
                    except RunlaneError as error:
                        # Another pass saved its own (either will do), or the record cannot be read
                        # (``rotation_start`` logged it): advisory either way.
                        if not is_storage_conflict(error) and error.code is not ErrorCode.INVARIANT_VIOLATION:
                            raise
                    break
            if materialized >= limit:
                break
        await self._settle_stale_claims(schedules, now, limit, get_run, worker_id, claim_duration_ms)
        return materialized

    async def _settle_stale_claims(
        self,
        schedules: Sequence[tuple[ScheduleDefinition, TaskDefinition]],
        now: datetime,
        limit: int,
        get_run: GetRun,
        worker_id: str,
        claim_duration_ms: int,
    ) -> None:
        """Complete the expired claims of fire times before the latest due one, at most ``limit`` of them.

        A materializer that died holding a claim leaves it to the next pass, which takes it over while its
        fire time is still the schedule's latest due one. Once a later fire time is due, no pass looks at
        the earlier one again (missed fire times are not backfilled), and its record would stay claimed
        for ever. It is taken over here and completed with the run it may have created, or with none: a
        run that was not created is a missed fire time. Only enabled schedules of this runtime are
        settled: another runtime's schedules, sharing the store, are its own, and a disabled schedule's
        claim waits for it to be enabled again. Each pass reads ``limit`` expired claims on from where the
        last pass of this materializer stopped, and from the longest expired again once they ran out, so
        the claims left alone never hide the ones after them.
        """
        registered = {item.id: (item, task) for item, task in schedules if item.enabled}
        expired, self._stale_claims_after = await self.occurrences.expired_claims(
            now, limit, after=self._stale_claims_after
        )
        for occurrence in expired:
            if isinstance(occurrence, RunlaneError):
                raise occurrence
            if (pair := registered.get(occurrence.schedule_id)) is None:
                continue
            item, task = pair
            due = self._due(item, task, now).fire_at
            if due is None or occurrence.fire_at >= due:
                continue  # still due (the pass takes it over and creates its run), or due on a clock ahead of ours
            token = self._new_claim_token()
            taken = await self.occurrences.claim(
                item.id,
                occurrence.task_id,
                occurrence.fire_at,
                claim_token=token,
                worker_id=worker_id,
                claim_duration_ms=claim_duration_ms,
            )
            if taken is None:
                continue
            run = await get_run(scheduled_run_id(taken.id))
            _schedule_log.info(
                "Schedule %s: the claim on its fire time %s expired after a later fire time was due; %s",
                item.id, encode_iso_date(taken.fire_at),
                "its run was created and stands." if run is not None else "it was missed, and no run is created.",
                extra={"schedule_id": item.id, "task_id": taken.task_id},
            )  # fmt: skip
            await self._complete(taken.id, token, [] if run is None else [run.id])

    def _due(self, item: ScheduleDefinition, task: TaskDefinition, now: datetime) -> _Due:
        # Errors are kept and raised when the schedule's turn comes, after earlier schedules materialized.
        try:
            fire_at = latest_due_fire_time(item, now)
            if fire_at is None:
                return _Due(item, task)
            return _Due(item, task, fire_at, schedule_occurrence_id(self.environment, item.id, fire_at))
        except RunlaneError as error:
            return _Due(item, task, error=error)

    async def _materialize(
        self,
        due: _Due,
        create_run: CreateScheduledRun,
        get_run: GetRun,
        worker_id: str,
        claim_duration_ms: int,
    ) -> bool:
        item, task = due.schedule, due.task
        _preflight(item, task)
        token = self._new_claim_token()
        occurrence = await self.occurrences.claim(
            item.id,
            task.id,
            due.fire_at,  # type: ignore[arg-type]
            claim_token=token,
            worker_id=worker_id,
            claim_duration_ms=claim_duration_ms,
        )
        if occurrence is None:
            return False
        run_id = scheduled_run_id(occurrence.id)
        run = await get_run(run_id)
        if run is None:
            try:
                run = await create_run(item, task, occurrence, run_id)
            except RunlaneError as error:
                # Another materializer took over an expired claim and created the run first.
                if not is_storage_conflict(error):
                    raise
                run = await get_run(run_id)
                if run is None:
                    if is_storage_conflict(error, StorageConflictKind.SINGLETON_KEY):
                        once = item.run_at is not None
                        _schedule_log.info(
                            "Schedule %s: the run of its fire time %s was not created, because an active run "
                            "holds the singleton key of task %s; %s",
                            item.id, encode_iso_date(occurrence.fire_at), task.id,
                            "it is tried again once its claim expires." if once else "its next fire time runs.",
                            extra={"schedule_id": item.id, "task_id": task.id},
                        )  # fmt: skip
                        if not once:
                            await self._complete(occurrence.id, token, [])
                        return False
                    raise
        if not isinstance(run, RunRecord) or run.id != run_id:
            raise RunlaneError(
                ErrorCode.INVARIANT_VIOLATION,
                f"Materializing schedule {item.id!r} must create run {run_id}, got "
                f"{run.id if isinstance(run, RunRecord) else run!r}.",
                meta={"schedule_id": item.id, "occurrence_id": occurrence.id, "run_id": run_id},
            )
        return await self._complete(occurrence.id, token, [run.id])

    async def _complete(self, occurrence_id: str, token: str, run_ids: list[str]) -> bool:
        """Complete the claimed occurrence; ``False`` when another materializer owns it now."""
        try:
            await self.occurrences.complete(occurrence_id, token, run_ids)
        except RunlaneError as error:
            if is_storage_conflict(error, StorageConflictKind.SCHEDULE_OCCURRENCE):
                return False
            raise
        return True


def _schedule_failed(item: ScheduleDefinition, error: RunlaneError) -> RunlaneError:
    """The error a pass stops with, naming the schedule that failed."""
    if error.meta.get("schedule_id") == item.id:
        return error
    return RunlaneError(
        error.code,
        f"Schedule {item.id!r} did not fire: {error.message}",
        meta={**error.meta, "schedule_id": item.id},
        cause=error,
    )


def _settled(occurrence: ScheduleOccurrence, now: datetime) -> bool:
    """Advisory pre-read: nothing to do for a completed occurrence or one another live claim holds."""
    if occurrence.status is ScheduleOccurrenceStatus.COMPLETED:
        return True
    return occurrence.claim_expires_at is not None and occurrence.claim_expires_at > now


def _preflight(item: ScheduleDefinition, task: TaskDefinition) -> None:
    """Validate the static payload again and resolve the task's run keys before claiming."""
    payload = schedule_payload(task, item, when_registered=False)
    for kind in ("singleton_key", "concurrency_key"):
        task.resolve_key(kind, payload)
